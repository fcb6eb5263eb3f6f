"""pytest plugin: ``pytest --compile-only`` warms the kernel cache from a test suite.

Enable it with ``-p quack.testing.pytest_plugin``, with
``pytest_plugins = ["quack.testing.pytest_plugin"]`` in a conftest, or through
the ``pytest11`` entry point of the installed package (all three register it
under the same name, so it is never registered twice).

Markers:

* ``gpu``: the test needs a GPU.  In a normal run on a machine without one it
  is skipped (with that reason).  Under ``--compile-only`` it runs inside
  ``compile_only_mode()``: tensors are fake, every kernel it calls is compiled
  and exported to the cache, nothing is launched.
* ``no_compile_only``: the test cannot run on fake tensors (it reads real
  values in a way sentinels cannot stand in for); skipped under ``--compile-only``.

Under ``--compile-only`` value comparisons are meaningless, so
``torch.testing.assert_close``, ``torch.allclose``, ``torch.equal`` (and their
tensor-method forms) are no-ops that report a match while a GPU test runs:
the test goes on to its end and warms every kernel it calls.  Any exception,
an ``AssertionError`` included (a bare ``assert`` on values is a test bug:
it reads sentinels), fails the test.  The terminal summary
lists, per GPU test, how many objects it exported, how many it found already
on disk and how many lookups this process had answered before (memory hits),
and names the tests that touched no kernel at all.

Under ``QUACK_MATRIX=smoke`` (the Bazel wiring checks' ``--config=smoke``)
only the GPU tests named ``test_matrix`` are collected.
"""

from __future__ import annotations

import pytest

_WARMED_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compile-only",
        action="store_true",
        default=False,
        help="run GPU tests on fake tensors: compile and export every kernel, launch nothing",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: the test needs a CUDA GPU (runs under --compile-only)")
    config.addinivalue_line(
        "markers", "no_compile_only: the test cannot run on fake tensors (skipped under --compile-only)"
    )
    config.stash[_WARMED_KEY] = {}


def _compile_only(config: pytest.Config) -> bool:
    return bool(config.getoption("--compile-only"))


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_for_smoke(config, items)
    compile_only = _compile_only(config)
    has_gpu = None
    for item in items:
        if compile_only and item.get_closest_marker("no_compile_only"):
            item.add_marker(pytest.mark.skip(reason="cannot run on fake tensors (--compile-only)"))
        elif not compile_only and item.get_closest_marker("gpu"):
            if has_gpu is None:
                has_gpu = _gpu_available()
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))


def _deselect_for_smoke(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under QUACK_MATRIX=smoke, GPU tests other than ``test_matrix`` are
    deselected (quack/testing/matrix.py says why)."""
    from quack.testing import matrix

    if matrix.selection() != "smoke":
        return
    keep, drop = [], []
    for item in items:
        smoke = not item.get_closest_marker("gpu") or getattr(item, "originalname", "") == "test_matrix"
        (keep if smoke else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _cache_counts() -> tuple[int, int, int]:
    """(objects exported, entries found on disk, memory hits) so far in this process."""
    from quack.cache import stats

    s = stats()
    return s["exports"], s["disk_hits"], s["memory_hits"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Run setup, call and teardown of a GPU test inside one compile-only context,
    so tensors made by fixtures and by the test share one fake mode."""
    if not (_compile_only(item.config) and item.get_closest_marker("gpu")):
        return (yield)
    if item.get_closest_marker("no_compile_only"):
        return (yield)
    from quack.compile_only import compile_only_mode

    before = _cache_counts()
    patch = _comparisons_disabled()
    try:
        with compile_only_mode():
            result = yield
    finally:
        patch.undo()
    item.config.stash[_WARMED_KEY][item.nodeid] = tuple(a - b for a, b in zip(_cache_counts(), before))
    return result


# Value comparisons, which mean nothing on fake tensors: under --compile-only
# each is a no-op that reports a match, so a test goes on to its end and warms
# every kernel it calls.  (module, name, what it returns.)
_VALUE_COMPARISONS = (
    ("torch.testing", "assert_close", None),
    ("torch.testing", "assert_allclose", None),
    ("torch", "allclose", True),
    ("torch", "equal", True),
    ("torch.Tensor", "allclose", True),
    ("torch.Tensor", "equal", True),
)


def _comparisons_disabled():
    """A MonkeyPatch context with every ``_VALUE_COMPARISONS`` entry a no-op."""
    import torch

    patch = pytest.MonkeyPatch()
    owners = {"torch": torch, "torch.testing": torch.testing, "torch.Tensor": torch.Tensor}
    for owner, name, answer in _VALUE_COMPARISONS:
        if hasattr(owners[owner], name):
            patch.setattr(owners[owner], name, lambda *args, _answer=answer, **kwargs: _answer)
    return patch


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    _report_cache_stats(terminalreporter)
    _report_warmed(terminalreporter, config)


def _report_cache_stats(tr) -> None:
    """The kernel cache's counters for this process, as a table, when kernels ran."""
    import sys

    if "quack.cache" not in sys.modules:
        return
    s = sys.modules["quack.cache"].stats()
    if not (s["compiles"] or s["hits"] or s["misses"]):
        return
    from quack.cache.cli import format_table

    rows = [["memory hits (kernels this process already had)", s["memory_hits"], ""]]
    rows += [[f"found on disk: {layer}", n, ""] for layer, n in sorted(s["hits"].items()) if layer != "memory"]
    rows += [
        ["misses", s["misses"], ""],
        ["compiled", s["compiles"], f"{s['compile_seconds']:.2f} s"],
        ["exported", s["exports"], ""],
        ["bad entries skipped", s["bad_entries"], ""],
        ["verifying entries", "", f"{s['verify_seconds']:.2f} s"],
        ["loading objects", "", f"{s['load_seconds']:.2f} s"],
    ]
    tr.section("quack kernel cache")
    for line in format_table(["EVENT", "COUNT", "TIME"], rows, right=[1, 2]):
        tr.write_line(line)


def _report_warmed(terminalreporter, config: pytest.Config) -> None:
    warmed = config.stash.get(_WARMED_KEY, {})
    if not _compile_only(config) or not warmed:
        return
    from quack.cache.cli import format_table

    tr = terminalreporter
    tr.section("compile-only: kernel objects per test")
    rows = [[*counts, nodeid] for nodeid, counts in sorted(warmed.items())]
    for line in format_table(["EXPORTED", "ON DISK", "MEMORY HITS", "TEST"], rows, right=[0, 1, 2]):
        tr.write_line(line)
    idle = [nodeid for nodeid, counts in sorted(warmed.items()) if not any(counts)]
    total = sum(exported for exported, _, _ in warmed.values())
    tr.write_line(f"{len(warmed)} GPU tests, {total} objects exported")
    if idle:
        tr.write_line(f"{len(idle)} GPU tests called no kernel:")
        for nodeid in idle:
            tr.write_line(f"  {nodeid}")
