"""The pytest plugin's semantics (``--compile-only``, markers, report), in inner pytest runs."""

import os
from pathlib import Path

import pytest

import quack.testing

pytest_plugins = ["pytester"]
# Inner runs are subprocesses in a temporary folder: they import quack from here.
PACKAGE_ROOT = str(Path(quack.testing.__file__).resolve().parents[2])


@pytest.fixture(autouse=True)
def _quack_importable(monkeypatch):
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", PACKAGE_ROOT + (os.pathsep + path if path else ""))

GPU_TESTS = """
import pytest
import torch
from quack.compile_only import is_compile_only

pytestmark = pytest.mark.gpu

def test_values_compared():
    x = torch.ones(4, device="cuda")
    assert is_compile_only()
    torch.testing.assert_close(x.sum().item(), 123.0)  # a value comparison: meaningless when fake

def test_other_error():
    raise RuntimeError("a real bug")

@pytest.mark.no_compile_only
def test_needs_real_values():
    pass
"""


@pytest.fixture
def run(pytester):
    pytester.makepyfile(test_inner=GPU_TESTS)

    def run(*args):
        return pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider", *args)

    return run


def test_gpu_tests_skip_without_a_gpu(run, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, also on a GPU machine
    result = run("-rs")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(["*needs a CUDA GPU (none visible)*"])


def test_compile_only_runs_gpu_tests_and_fails_only_on_real_errors(run):
    result = run("--compile-only", "-rs")
    # The value comparison passes vacuously, the RuntimeError fails, the
    # fake-incompatible test is skipped.
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*compile-only: kernel objects per test*",
        "*GPU tests called no kernel:*",
        "*test_inner.py::test_values_compared*",
        "*cannot run on fake tensors*",
    ])


def test_plugin_named_twice_registers_once(pytester):
    """``-p`` and ``pytest_plugins`` (and the entry point, same name) never double-register."""
    pytester.makeconftest('pytest_plugins = ["quack.testing.pytest_plugin"]')
    pytester.makepyfile(test_one="def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider", "--compile-only")
    result.assert_outcomes(passed=1)
