"""The pytest plugin's semantics (``--compile-only``, markers, report), in inner pytest runs."""

import os
from pathlib import Path

import pytest

import quack.testing
from quack.compile_only.gpu import CUDA_BUILD

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

pytestmark = pytest.mark.quack_gpu

def test_values_compared(tmp_path_factory):
    x = torch.ones(4, device="cuda")
    assert is_compile_only()
    # Value comparisons: meaningless when fake, no-ops that let the test go on.
    torch.testing.assert_close(x.sum(), torch.tensor(123.0, device="cuda"))
    assert torch.allclose(x, x * 2) and torch.equal(x, x + 1) and x.equal(x - 1)
    (tmp_path_factory.getbasetemp() / "reached_the_end").touch()

def test_other_error():
    raise RuntimeError("a real bug")

def test_real_assertion():
    assert 1 + 1 == 3, "a failed assert is a failure, also under --compile-only"

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
    result.assert_outcomes(skipped=4)
    result.stdout.fnmatch_lines(["*needs a CUDA GPU (none visible)*"])


def test_compile_only_runs_gpu_tests_and_fails_only_on_real_errors(run, pytester):
    result = run("--compile-only", "-rs", "--basetemp", str(pytester.path / "inner_tmp"))
    # The value comparisons are no-ops and the test runs to its end; the
    # RuntimeError and the failed assert fail; the fake-incompatible test is skipped.
    result.assert_outcomes(passed=1, failed=2, skipped=1)
    assert (pytester.path / "inner_tmp" / "reached_the_end").exists()
    result.stdout.fnmatch_lines([
        "*compile-only: kernel objects per test*",
        "EXPORTED  ON DISK  MEMORY HITS  TEST",
        "*GPU tests warmed nothing:*",
        "*test_inner.py::test_other_error: failed in call (RuntimeError: a real bug)",
        "*test_inner.py::test_values_compared: ran to its end without calling a quack kernel",
        "*cannot run on fake tensors*",
    ])


KERNEL_TESTS = """
import pytest
from cache_fixtures import fake_kernel

pytestmark = pytest.mark.quack_gpu
fake_kernel.use_fakes()

def test_twice():
    fake_kernel.compile_fake(1)
    fake_kernel.compile_fake(1)

def test_again():
    fake_kernel.compile_fake(1)
"""


def test_the_report_tells_exports_entries_on_disk_and_memory_hits_apart(pytester, monkeypatch):
    """The first run exports the kernel; the second finds it on disk; a repeated lookup in a
    process is a memory hit, never counted as found in the cache."""
    pytester.makepyfile(test_inner=KERNEL_TESTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ["PYTHONPATH"]]))
    monkeypatch.setenv("QUACK_CACHE_DIR", str(pytester.path / "cache"))
    monkeypatch.setenv("QUACK_ARCH", "sm_90a")
    for name in ("QUACK_CACHE_PATH", "QUACK_CACHE_STRICT", "QUACK_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def run():
        result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider",
                                               "--compile-only")
        result.assert_outcomes(passed=2)
        return result

    # Columns: exported, on disk, memory hits, test.
    run().stdout.re_match_lines([
        r"^memory hits \(kernels this process already had\) +2$",
        r"^exported +1$",
        r"^ +0 +0 +1  test_inner\.py::test_again$",
        r"^ +1 +0 +1  test_inner\.py::test_twice$",
    ])
    run().stdout.re_match_lines([
        r"^memory hits \(kernels this process already had\) +2$",
        r"^found on disk: writable +1$",
        r"^exported +0$",
        r"^ +0 +0 +1  test_inner\.py::test_again$",
        r"^ +0 +1 +1  test_inner\.py::test_twice$",
    ])


def test_smoke_selection_keeps_only_the_matrix_among_gpu_tests(pytester, monkeypatch):
    pytester.makepyfile(test_inner="""
import pytest

def test_on_the_cpu():
    pass

@pytest.mark.quack_gpu
def test_matrix():
    pass

@pytest.mark.quack_gpu
def test_other():
    pass
""")
    monkeypatch.setenv("QUACK_MATRIX", "smoke")
    result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider",
                                           "--compile-only", "-v")
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.fnmatch_lines(["*test_on_the_cpu PASSED*", "*test_matrix PASSED*"])


def test_shards_split_the_tests_and_together_run_each_once(pytester):
    pytester.makepyfile(test_inner="".join(f"def test_{i}():\n    pass\n\n" for i in range(5)))
    ran = []
    for shard in ("0/2", "1/2"):
        result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider",
                                               "--quack-shard", shard, "-v")
        ran += [line.split("::")[1].split()[0] for line in result.outlines if " PASSED" in line]
    assert ran == ["test_0", "test_2", "test_4", "test_1", "test_3"]
    for bad in ("2/2", "1", "a/b"):
        result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "--quack-shard", bad)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"*--quack-shard takes I/N with 0 <= I < N, got '{bad}'*"])


def test_plugin_named_twice_registers_once(pytester):
    """``-p`` and ``pytest_plugins`` (and the entry point, same name) never double-register."""
    pytester.makeconftest('pytest_plugins = ["quack.testing.pytest_plugin"]')
    pytester.makepyfile(test_one="def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider", "--compile-only")
    result.assert_outcomes(passed=1)


ALIASED = """
import pytest

@pytest.mark.gpu
def test_marked_the_project_way():
    pass
"""


def test_the_plain_gpu_marker_means_nothing_to_the_plugin_unless_aliased(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(test_inner=ALIASED)
    args = ("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider", "-p", "no:warnings", "-rs")
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=1)  # another project's marker: untouched
    pytester.makeini("[pytest]\nquack_gpu_marker_alias = gpu\n")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs a CUDA GPU (none visible)*"])


def test_an_alias_must_name_one_marker(pytester):
    pytester.makeini("[pytest]\nquack_gpu_marker_alias = gpu slow\n")
    pytester.makepyfile(test_inner=ALIASED)
    result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["*quack_gpu_marker_alias must name one marker*"])


UNMARKED_GPU_TESTS = """
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_guarded():
    model = torch.nn.Linear(8, 8).cuda()
    model(torch.randn(4, 8, device=DEVICE)).sum().backward()
    assert model.weight.grad is not None
"""

UNMARKED_FIXTURE_TESTS = """
import pytest
import torch


@pytest.fixture
def device():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return "cuda"


def test_with_fixture(device):
    assert torch.ones(2, device=device).sum().item() == 1.0


@pytest.mark.skipif("not torch.cuda.is_available()")
def test_string_condition():
    assert torch.ones(2, device="cuda").shape == (2,)


def test_on_the_cpu():
    assert torch.ones(2).sum().item() == 2.0


def test_touches_cuda_unrecognised():
    torch.zeros(1).cuda()
"""


@pytest.mark.skipif(not CUDA_BUILD, reason="recognising GPU tests needs a CUDA build of torch")
def test_compile_only_recognises_tests_written_for_a_gpu(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(test_module_guard=UNMARKED_GPU_TESTS, test_fixture_guard=UNMARKED_FIXTURE_TESTS)
    # A library that asks at import makes no GPU tests of the modules importing it.
    pytester.makepyfile(probing_library="import torch\nHAS_CUDA = torch.cuda.is_available()\n")
    pytester.makepyfile(test_cpu_only="import probing_library, torch\n\n"
                                      "def test_real_values():\n    assert torch.ones(2).sum().item() == 2.0\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pytester.path), os.environ["PYTHONPATH"]]))
    args = ("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider", "-p", "no:warnings", "-rs")
    plain = pytester.runpytest_subprocess(*args)
    plain.assert_outcomes(passed=2, skipped=3, failed=1)
    result = pytester.runpytest_subprocess(*args, "--compile-only")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines([
        "*quack --compile-only*",
        "*not recognised as a GPU test. Mark it @pytest.mark.quack_gpu*",
        "*compile-only: kernel objects per test*",
        "*test_fixture_guard.py::test_string_condition: ran to its end without calling a quack kernel",
        "*test_fixture_guard.py::test_with_fixture: ran to its end*",
        "*test_module_guard.py::test_guarded: ran to its end*",
    ])
    assert "test_on_the_cpu:" not in result.stdout.str() and "test_real_values" not in result.stdout.str()


SHARED_ACROSS_TESTS = """
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import quack


@pytest.fixture(scope="session")
def model():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    return torch.nn.Linear(256, 256, dtype=torch.bfloat16).cuda()


def test_first(model):
    model(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)).sum().backward()


def test_second_reuses_the_session_model(model):
    model(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)).sum().backward()


def test_workers_make_tensors_and_take_the_tests(model):
    weight = torch.ones(256, device="cuda", dtype=torch.float32)

    def work(rows):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        return quack.rmsnorm(model(x), weight).shape

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(work, [1, 2, 3, 4])) == [torch.Size([r, 256]) for r in (1, 2, 3, 4)]
"""


@pytest.mark.skipif(not CUDA_BUILD, reason="Module.cuda() and backward on fake CUDA tensors need a CUDA build of torch")
def test_session_fixtures_and_worker_threads_share_the_fake_mode(pytester, monkeypatch):
    """A session fixture's module serves every test, and threads a test starts run in the mode."""
    pytester.makepyfile(test_inner=SHARED_ACROSS_TESTS)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(pytester.path / "cache"))
    monkeypatch.setenv("QUACK_ARCH", "sm_90a")
    for name in ("QUACK_CACHE_PATH", "QUACK_CACHE_STRICT"):
        monkeypatch.delenv(name, raising=False)
    result = pytester.runpytest_subprocess("-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider",
                                           "--compile-only")
    result.assert_outcomes(passed=3)
