"""The committed kernel lists (tools/kernels/) are current, and a stale one is caught.

The lists are the pinned environment's (tools/kernel_lists.py): this test runs
under Bazel, where that environment is the test's own.  Elsewhere it is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(os.path.abspath(__file__)).parents[1]

pytestmark = pytest.mark.skipif(
    os.environ.get("QUACK_REQUIRE_PINNED_ENV") != "1",
    reason="the kernel lists are enumerated in the pinned environment: run it under Bazel",
)


def _script():
    spec = importlib.util.spec_from_file_location("kernel_lists_script", REPO / "tools/kernel_lists.py")
    module = importlib.util.module_from_spec(spec)
    saved = sys.path[0]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[0] = saved
    return module


@pytest.fixture(scope="module")
def lists():
    script = _script()
    return script, script.current(REPO, os.cpu_count() or 1)


def test_committed_lists_are_current(lists):
    script, expected = lists
    diff = script.stale(expected, REPO / script.LISTS)
    assert not diff, f"stale kernel lists; refresh with {script.REFRESH}\n{diff}"


def test_a_list_with_a_line_removed_is_stale(lists, tmp_path, capsys, monkeypatch):
    script, expected = lists
    damaged = tmp_path / "kernels"
    shutil.copytree(REPO / script.LISTS, damaged)
    listed = damaged / "gemm.ci.jsonl"
    lines = listed.read_text().splitlines(True)
    removed = lines.pop(len(lines) // 2)
    listed.write_text("".join(lines))

    diff = script.stale(expected, damaged)
    assert f"+{removed}" in diff and diff.count("\n+") == 1 + diff.count("\n+++")
    monkeypatch.setattr(script, "current", lambda root, jobs, selections: expected)
    assert script.main(["--check", "--lists", str(damaged)]) == 1
    assert script.REFRESH in capsys.readouterr().err


def test_update_writes_only_its_own_files(lists, tmp_path, monkeypatch):
    script, expected = lists
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "README.md").write_text("kept\n")
    (folder / "oldfamily.ci.jsonl").write_text("a family since removed\n")
    # The full matrix's lists are --full's: an update without it leaves them as they are.
    full = {"gemm.full.jsonl": "full signatures\n", "units_full.bzl": "UNITS = {}\n"}
    for name, text in full.items():
        (folder / name).write_text(text)
    asked = []
    monkeypatch.setattr(script, "current", lambda root, jobs, selections: asked.append(selections) or expected)
    assert script.main(["--update", "--lists", str(folder)]) == 0
    assert asked == [script.SELECTIONS]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*expected, "README.md", *full])
    assert all((folder / name).read_text() == text for name, text in full.items())
    assert script.main(["--check", "--lists", str(folder)]) == 0
