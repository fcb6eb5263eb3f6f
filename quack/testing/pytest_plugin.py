"""pytest plugin: ``pytest --compile-only`` warms the kernel cache from a test suite.

Enable it with ``-p quack.testing.pytest_plugin``, with
``pytest_plugins = ["quack.testing.pytest_plugin"]`` in a conftest, or through
the ``pytest11`` entry point of the installed package (all three register it
under the same name, so it is never registered twice).  Nothing it adds
changes a run without ``--compile-only`` or ``--quack-shard I/N`` (the I-th of
N interleaved parts of the tests, for parallel enumerations) but its own
marker, so installing it leaves other projects' suites alone.

Markers:

* ``quack_gpu``: the test needs a GPU.  In a normal run on a machine without
  one it is skipped (with that reason).  Under ``--compile-only`` it runs
  inside ``compile_only_mode()``: tensors are fake, every kernel it calls is
  compiled and exported to the cache, nothing is launched.  A project whose
  tests already carry a marker of their own for this opts in with the ini
  option ``quack_gpu_marker_alias`` (``quack_gpu_marker_alias = "gpu"`` under
  ``[tool.pytest.ini_options]``): that marker then means ``quack_gpu``.
* ``no_compile_only``: the test cannot run on fake tensors (it reads real
  values in a way sentinels cannot stand in for, or uses CUDA streams, events
  that record, CUDA generators); skipped under ``--compile-only``.

Tests written for a GPU without the marker are recognised under
``--compile-only`` (with a CUDA build of torch, which needs no GPU):
``torch.cuda.is_available()`` answers True while test modules are imported
and inside the mode, so a module that asks it at import (``DEVICE = "cuda"
if torch.cuda.is_available() else "cpu"``, ``skipif(not
torch.cuda.is_available())``) has its tests run as GPU tests, and so does a
test whose function, fixtures or string ``skipif`` condition ask it.  Inside
the mode the ordinary GPU code of a test runs as on the GPU: autograd
(``loss.backward()``, ``torch.autograd.grad``, optimizers), ``Module.cuda()``,
autocast, ``GradScaler``, ``torch.compile`` (its captured graph runs
eagerly), device queries answered for the compile target ``QUACK_ARCH``
(``quack/compile_only/gpu.py`` says what is emulated and what is not).  A
test that touches CUDA outside the mode fails with a hint to mark it.

Under ``--compile-only`` value comparisons are meaningless, so
``torch.testing.assert_close``, ``torch.allclose``, ``torch.equal`` (and their
tensor-method forms) are no-ops that report a match while a GPU test runs:
the test goes on to its end and warms every kernel it calls.  ``.item()``
reads sentinels (1, 1.0, and for a bool what healthy data answers: "is
everything finite?" yes, "is anything non-finite?" no).  Any exception, an ``AssertionError`` included (a bare
``assert`` on values is a test bug: it reads sentinels), fails the test.  The
terminal summary lists, per GPU test, how many objects it exported, how many
it found already on disk and how many lookups this process had answered
before (memory hits), and names the tests that warmed nothing, saying why.

Under ``QUACK_MATRIX=smoke`` (the Bazel wiring checks' ``--config=smoke``)
only the GPU tests named ``test_matrix`` are collected.
"""

from __future__ import annotations

import sys

import pytest

_WARMED_KEY = pytest.StashKey[dict]()
_OUTCOMES_KEY = pytest.StashKey[dict]()
_CLAIM_KEY = pytest.StashKey[object]()
_MODE_KEY = pytest.StashKey[object]()
MARKER = "quack_gpu"
ALIAS_INI = "quack_gpu_marker_alias"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compile-only",
        action="store_true",
        default=False,
        help="run GPU tests on fake tensors: compile and export every kernel, launch nothing",
    )
    parser.addoption(
        "--quack-shard",
        default=None,
        metavar="I/N",
        help="run only the I-th of N interleaved parts of the collected tests (0 <= I < N): parallel passes",
    )
    parser.addini(
        ALIAS_INI,
        default="",
        help=f"a marker of the project's own that means {MARKER} (e.g. gpu); empty: none",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: the test needs a CUDA GPU (runs under --compile-only)")
    alias = _alias(config)
    if alias:
        config.addinivalue_line("markers", f"{alias}: the test needs a CUDA GPU (the {MARKER} marker)")
    config.addinivalue_line(
        "markers", "no_compile_only: the test cannot run on fake tensors (skipped under --compile-only)"
    )
    config.stash[_WARMED_KEY] = {}
    config.stash[_OUTCOMES_KEY] = {}


def _alias(config: pytest.Config) -> str:
    alias = str(config.getini(ALIAS_INI) or "").strip()
    if alias and not alias.isidentifier():
        raise pytest.UsageError(f"{ALIAS_INI} must name one marker, got {alias!r}")
    return alias


def _compile_only(config: pytest.Config) -> bool:
    return bool(config.getoption("--compile-only"))


def _is_gpu_test(item: pytest.Item) -> bool:
    alias = _alias(item.config)
    return item.get_closest_marker(MARKER) is not None or bool(alias and item.get_closest_marker(alias))


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """Under --compile-only, torch.cuda answers as a GPU while test modules
    are imported (a CUDA build of torch: ``quack.compile_only.gpu.claimed``)."""
    if not _compile_only(session.config):
        return (yield)
    from quack.compile_only.gpu import claimed

    with claimed():
        return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    compile_only = _compile_only(config)
    if compile_only:
        _mark_tests_asking_for_cuda(config, items)
    _deselect_for_smoke(config, items)
    _keep_shard(config, items)
    has_gpu = None
    for item in items:
        if compile_only and item.get_closest_marker("no_compile_only"):
            item.add_marker(pytest.mark.skip(reason="cannot run on fake tensors (--compile-only)"))
        elif not compile_only and _is_gpu_test(item):
            if has_gpu is None:
                has_gpu = _gpu_available()
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))


def _keep_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--quack-shard I/N``: keep every N-th collected test from the I-th on."""
    shard = config.getoption("--quack-shard")
    if shard is None:
        return
    index, _, count = shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"--quack-shard takes I/N with 0 <= I < N, got {shard!r}")
    index, count = int(index), int(count)
    dropped = [item for position, item in enumerate(items) if position % count != index]
    items[:] = [item for position, item in enumerate(items) if position % count == index]
    config.hook.pytest_deselected(items=dropped)


def _mark_tests_asking_for_cuda(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under --compile-only, a test written for a GPU without the marker is
    one: its module's own code asked ``torch.cuda.is_available()`` at import
    (``quack.compile_only.gpu.ASKED_FROM``), or its
    function, one of its fixtures or a string ``skipif`` condition asks it."""
    from quack.compile_only.gpu import ASKED_FROM, CUDA_BUILD

    if not CUDA_BUILD:
        return  # nothing can run them on fake CUDA tensors (the summary says so)
    for item in items:
        if _is_gpu_test(item):
            continue
        module = item.getparent(pytest.Module)
        if (module is not None and str(module.path) in ASKED_FROM) or _asks_for_cuda(item):
            item.add_marker(MARKER)


def _asks_for_cuda(item: pytest.Item) -> bool:
    functions = [getattr(item, "obj", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        functions += [d.func for d in defs]
    if any(_names_is_available(getattr(f, "__code__", None)) for f in functions):
        return True
    return any(
        isinstance(c, str) and "is_available" in c
        for mark in item.iter_markers("skipif")
        for c in (*mark.args, mark.kwargs.get("condition"))
    )


def _names_is_available(code) -> bool:
    """Does this code (or code nested in it) name ``is_available``?"""
    if code is None:
        return False
    return "is_available" in code.co_names or any(
        _names_is_available(c) for c in code.co_consts if hasattr(c, "co_names")
    )


def _deselect_for_smoke(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under QUACK_MATRIX=smoke, GPU tests other than ``test_matrix`` are
    deselected (quack/testing/matrix.py says why)."""
    from quack.testing import matrix

    if matrix.selection() != "smoke":
        return
    keep, drop = [], []
    for item in items:
        smoke = not _is_gpu_test(item) or getattr(item, "originalname", "") == "test_matrix"
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
    in the session's fake mode, so tensors made by fixtures of any scope and
    by the test share it."""
    if not (_compile_only(item.config) and _is_gpu_test(item)):
        return (yield)
    if item.get_closest_marker("no_compile_only"):
        return (yield)
    from quack.compile_only import CompileOnlyFakeTensorMode, compile_only_mode

    before = _cache_counts()
    patch = _comparisons_disabled()
    # One fake mode for the session: a module- or session-scoped fixture's
    # tensors, made in an earlier test, mix with this test's.
    if _MODE_KEY not in item.config.stash:
        item.config.stash[_MODE_KEY] = CompileOnlyFakeTensorMode()
    mode = item.config.stash[_MODE_KEY]
    try:
        with compile_only_mode(mode):
            result = yield
    finally:
        patch.undo()
        _reset_dynamo()
    item.config.stash[_WARMED_KEY][item.nodeid] = tuple(a - b for a, b in zip(_cache_counts(), before))
    return result


def _reset_dynamo() -> None:
    """Forget what torch.compile compiled in a GPU test (its fake inputs), so
    recompile limits never carry over from one parametrized test to the next."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


# Errors of a test that touched CUDA outside compile-only mode.
_NO_GPU_ERRORS = (
    "Found no NVIDIA driver", "Torch not compiled with CUDA enabled", "PyTorch is not linked with support for cuda",
    "CUDA driver version is insufficient", "no CUDA GPUs are available",
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Under --compile-only: note each GPU test's outcome (for the summary),
    give a test that failed touching CUDA outside the mode a hint, and a GPU
    test that failed on what the mode cannot run (a CPU-only torch's limits,
    the CUDA driver) what ``compile_only_mode`` says about it: the test's own
    code may have caught the error before the mode's exit could."""
    report = yield
    if not _compile_only(item.config):
        return report
    if report.failed or report.skipped:
        outcomes = item.config.stash[_OUTCOMES_KEY]
        outcomes.setdefault(item.nodeid, _outcome_words(report))
    if report.failed and not _is_gpu_test(item) and any(e in str(report.longrepr) for e in _NO_GPU_ERRORS):
        report.sections.append(("quack --compile-only", _hint(item.config)))
    elif report.failed and _is_gpu_test(item) and call.excinfo is not None:
        from quack.compile_only import hinted_message

        hinted = hinted_message(str(call.excinfo.value))
        if hinted is not None:
            report.sections.append(("quack --compile-only", hinted))
    return report


def _outcome_words(report) -> str:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return f"skipped ({reason.removeprefix('Skipped: ')})"
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message.splitlines()[0] if crash is not None and crash.message else "an error"
    return f"failed in {report.when} ({message[:120]})"


def _hint(config: pytest.Config) -> str:
    alias = _alias(config)
    marker = f"@pytest.mark.{alias or MARKER}"
    return (
        "This test touched CUDA but ran outside compile-only mode: it is not recognised as a GPU test. "
        f"Mark it {marker} (then --compile-only runs it on fake CUDA tensors), or ask for the device the "
        "usual way, in the test or its fixture (`if not torch.cuda.is_available(): pytest.skip(...)`, "
        "`device = \"cuda\" if torch.cuda.is_available() else \"cpu\"`), which --compile-only recognises."
    )


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
    if not _compile_only(config):
        return
    from quack.compile_only.gpu import CUDA_BUILD

    tr = terminalreporter
    if not CUDA_BUILD:
        tr.write_line(
            "compile-only with a CPU-only build of torch: tests that ask torch.cuda.is_available() were not run "
            "as GPU tests, and autograd on fake CUDA tensors fails; use the CUDA build of torch (it needs no GPU)"
        )
    warmed = config.stash.get(_WARMED_KEY, {})
    if not warmed:
        return
    from quack.cache.cli import format_table

    tr.section("compile-only: kernel objects per test")
    rows = [[*counts, nodeid] for nodeid, counts in sorted(warmed.items())]
    for line in format_table(["EXPORTED", "ON DISK", "MEMORY HITS", "TEST"], rows, right=[0, 1, 2]):
        tr.write_line(line)
    idle = [nodeid for nodeid, counts in sorted(warmed.items()) if not any(counts)]
    total = sum(exported for exported, _, _ in warmed.values())
    tr.write_line(f"{len(warmed)} GPU tests, {total} objects exported")
    if idle:
        outcomes = config.stash.get(_OUTCOMES_KEY, {})
        tr.write_line(f"{len(idle)} GPU tests warmed nothing:")
        for nodeid in idle:
            why = outcomes.get(nodeid, "ran to its end without calling a quack kernel")
            tr.write_line(f"  {nodeid}: {why}")
