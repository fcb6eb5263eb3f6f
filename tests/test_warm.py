"""Warming a cache folder from a manifest: ``python -m quack.warm`` and tools/warm_cache.py
(the same code): what the folder holds after, the counts reported, and folders that are not
caches (a project checkout given by mistake), whose files are never touched (CPU only)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quack import warm
from quack.calls import manifest
from quack.families.softmax.op import SoftmaxCall

REPO = Path(__file__).resolve().parents[1]
KEY = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def calls(tmp_path):
    """A manifest of two small calls: two objects, the forward one needed by both."""
    path = tmp_path / "calls.jsonl"
    manifest.write(path, [SoftmaxCall("float32", 7, 1, False), SoftmaxCall("float32", 7, 1, True)])
    return path


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")}
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(env, PYTHONPATH=path, QUACK_ARCH="sm_90a", QUACK_CACHE_DIR=str(tmp_path / "default"))


def _quack_warm(tmp_path, *argv):
    return subprocess.run([sys.executable, "-m", "quack.warm", *map(str, argv)], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)


def _tool(tmp_path, *argv):
    return subprocess.run([sys.executable, str(REPO / "tools/warm_cache.py"), *map(str, argv)],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300, cwd=REPO)


def _snapshot(root: Path) -> dict:
    """Every file and folder under ``root``: a file's bytes and mtime (a folder: None)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def test_warm_fills_an_empty_folder_then_finds_its_objects_present(tmp_path, calls):
    out = tmp_path / "out"
    out.mkdir()
    first = _quack_warm(tmp_path, calls, "--out", out)
    assert first.returncode == 0, first.stderr
    # The second call's forward kernel is the first call's: a memory hit, not an object found present.
    assert "warmed all families: 2 objects (2 exported now, 0 already present), 2 manifest calls" in first.stdout
    objects = sorted((out / "softmax").glob("*.o"))
    listed = json.loads((out / "manifest.json").read_text())["objects"]
    assert listed == [{"family": "softmax", "file": f"softmax/{obj.name}", "key": obj.stem,
                       "sha256": hashlib.sha256(obj.read_bytes()).hexdigest()} for obj in objects]
    entries = {f"softmax/{obj.stem}{suffix}" for obj in objects for suffix in (".o", ".json")}
    assert set(_snapshot(out)) == {"manifest.json", "softmax"} | entries
    again = _quack_warm(tmp_path, calls, "--out", out)
    assert again.returncode == 0, again.stderr
    assert "2 objects (0 exported now, 2 already present)" in again.stdout
    # The build's tool runs the same code: the same folder from an empty one, and the right counts.
    built = tmp_path / "built"
    tool = _tool(tmp_path, f"--out={built}", f"--configs={calls}")
    assert tool.returncode == 0, tool.stderr
    assert "2 objects (2 exported now, 0 already present)" in tool.stderr
    assert _snapshot(built)["manifest.json"][0] == (out / "manifest.json").read_bytes()


def test_warm_adds_to_a_cache_folder_and_keeps_what_it_did_not_write(tmp_path, calls):
    out = tmp_path / "cache"
    (out / "rmsnorm").mkdir(parents=True)
    (out / "rmsnorm" / f"{KEY}.o").write_bytes(b"not an object")  # a bad entry
    (out / "rmsnorm" / f"{KEY}.json").write_text("{}")
    (out / "softmax").mkdir()
    (out / "softmax" / f"{KEY}.lock").write_text("4242\n")  # another process's key lock
    (out / ".locks").mkdir()
    (out / ".locks" / "held").write_text("4243\n")
    before = _snapshot(out)
    done = _quack_warm(tmp_path, calls, "--out", out)
    assert done.returncode == 0, done.stderr
    assert "2 objects (2 exported now, 0 already present)" in done.stdout
    assert f"rmsnorm/{KEY} is not listed in manifest.json" in done.stderr
    after = _snapshot(out)
    assert {name: after[name] for name in before} == before  # not one byte or mtime changed
    objects = sorted((out / "softmax").glob("*.o"))
    added = {f"softmax/{obj.stem}{suffix}" for obj in objects for suffix in (".o", ".json")}
    assert set(after) - set(before) == {"manifest.json"} | added
    assert [o["key"] for o in json.loads((out / "manifest.json").read_text())["objects"]] == [o.stem for o in objects]


@pytest.mark.parametrize("files, foreign", [
    ({"poetry.lock": "", "Cargo.lock": "", "foo.o": ""}, "Cargo.lock"),
    ({"build/foo.o": ""}, "build/foo.o"),
    ({f"softmax/{KEY}.o": "", "notes.txt": ""}, "notes.txt"),
    ({f"softmax/{KEY}.o": "", f"softmax/{KEY}.json": "", "manifest.json": "", ".locks/x": ""}, ""),
    ({}, ""),
])
def test_only_new_empty_or_cache_folders_are_warmed(tmp_path, files, foreign):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert warm.foreign_content(tmp_path) == foreign
    assert warm.foreign_content(tmp_path / "new") == ""


def test_a_file_is_not_a_folder_to_warm(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(warm.OutputFolderError, match="is not a folder"):
        warm.check_output_folder(tmp_path / "file")


def test_a_project_folder_is_refused_and_left_as_it_was(tmp_path, calls):
    project = tmp_path / "project"
    for name in ("poetry.lock", "Cargo.lock", "foo.o", "build/bar.o", "build/baz.lock"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(name)
    before = _snapshot(project)
    tool = _tool(tmp_path, f"--out={project}", f"--configs={calls}")
    assert tool.returncode == 1
    assert tool.stderr.strip() == (f"warm_cache: {project} is neither empty nor a kernel cache folder (it holds "
                                   "'Cargo.lock'): give a new or empty folder, or a cache folder "
                                   "(<family>/<key>.o and .json entries)")
    package = _quack_warm(tmp_path, calls, "--out", project)
    assert package.returncode == 1 and "is neither empty nor a kernel cache folder" in package.stderr
    assert "Traceback" not in package.stderr
    assert _snapshot(project) == before


def test_a_bad_manifest_is_refused_before_anything_is_written(tmp_path):
    bad = tmp_path / "calls.jsonl"
    bad.write_text('{"configs": []}\n')
    out = tmp_path / "new"
    done = _quack_warm(tmp_path, bad, "--out", out)
    assert done.returncode == 1 and "not a quack manifest" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_the_tools_help_shows_its_example_on_two_lines(tmp_path):
    done = _tool(tmp_path, "--help")
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "python tools/warm_cache.py" in line)
    assert lines[start].rstrip().endswith("--family=rmsnorm \\")
    assert lines[start + 1].strip().startswith("--tests=tests/test_rmsnorm.py")


def _unit_of_forward(call: SoftmaxCall):
    """The unit (compile function and arguments) of ``call``'s forward kernel, as the kernel lists name it."""
    from quack.cache import jit
    from quack.calls import plan
    from quack.compile_only import compile_only_mode
    from quack.warm import unit_of

    with jit.listing() as asked, compile_only_mode():
        plan.plan_for(call).warm()
    (forward,) = [obj for obj in asked.values() if obj.function.endswith("compile_softmax_fwd")]
    return unit_of(forward)


def test_a_unit_warms_exactly_its_object(tmp_path, calls):
    unit = _unit_of_forward(SoftmaxCall("float32", 7, 1, False))
    whole = tmp_path / "whole"
    assert _quack_warm(tmp_path, calls, "--out", whole).returncode == 0
    params = tmp_path / "params"
    params.write_text(f"--out={tmp_path / 'unit'}\n--unit={unit.text}\n")  # Bazel's multiline params file
    tool = _tool(tmp_path, f"@{params}")
    assert tool.returncode == 0, tool.stderr
    (obj,) = (tmp_path / "unit/softmax").glob("*.o")
    assert obj.read_bytes() == (whole / "softmax" / obj.name).read_bytes()
    bad = _tool(tmp_path, f"--out={tmp_path / 'bad'}", "--unit={\"family\": \"softmax\"}")
    assert bad.returncode != 0 and "not a kernel unit" in bad.stderr
    not_a_kernel = unit.text.replace(unit.function, "os.getcwd")
    refused = _tool(tmp_path, f"--out={tmp_path / 'bad'}", f"--unit={not_a_kernel}")
    assert refused.returncode != 0 and "not a compile function of kernel family 'softmax'" in refused.stderr
    assert not (tmp_path / "bad").exists()


def test_bazel_run_imports_the_checkout_and_writes_where_the_user_ran_it(tmp_path):
    """``tools/bazel run //tools:warm_cache``: the script alone in its runfiles
    (the py_binary has no deps), started in that folder, imports the package
    from the checkout and takes relative paths from where the user ran it."""
    unit = _unit_of_forward(SoftmaxCall("float32", 7, 1, False))
    runfiles, user = tmp_path / "warm_cache.runfiles/_main/tools", tmp_path / "user"
    runfiles.mkdir(parents=True)
    user.mkdir()
    shutil.copy(REPO / "tools/warm_cache.py", runfiles)
    # The checkout must come from BUILD_WORKSPACE_DIRECTORY, not PYTHONPATH; what else PYTHONPATH
    # holds stays (on some machines the CuTe DSL is importable only through it).
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env = dict(_env(tmp_path), PYTHONPATH=os.pathsep.join(others), BUILD_WORKSPACE_DIRECTORY=str(REPO),
               BUILD_WORKING_DIRECTORY=str(user))
    tool = subprocess.run([sys.executable, str(runfiles / "warm_cache.py"), "--out=objects", f"--unit={unit.text}"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=runfiles.parent)
    assert tool.returncode == 0, tool.stderr
    assert len(list((user / "objects/softmax").glob("*.o"))) == 1
    assert not (runfiles.parent / "objects").exists()


def test_the_persistent_worker_answers_each_request_from_a_fresh_child(tmp_path):
    unit = _unit_of_forward(SoftmaxCall("float32", 7, 1, False))
    worker = subprocess.Popen([sys.executable, str(REPO / "tools/warm_cache.py"), "--persistent_worker"],
                              env=_env(tmp_path), cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        answers = []
        for request_id, arguments in enumerate([[f"--out={tmp_path / 'a'}", f"--unit={unit.text}"],
                                                [f"--out={tmp_path / 'b'}", "--unit=not json"],
                                                [f"--out={tmp_path / 'c'}", f"--unit={unit.text}"]]):
            worker.stdin.write(json.dumps({"arguments": arguments, "requestId": request_id, "extra": 1}) + "\n")
            worker.stdin.flush()
            answers.append(json.loads(worker.stdout.readline()))
        worker.stdin.close()
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
    assert [(a["requestId"], a["exitCode"]) for a in answers] == [(0, 0), (1, 2), (2, 0)]
    assert "not a kernel unit" in answers[1]["output"]
    # A failed request leaves the worker as it was: the third compiles the first's object again.
    assert (tmp_path / "a/manifest.json").read_bytes() == (tmp_path / "c/manifest.json").read_bytes()
    assert not (tmp_path / "b").exists()


def test_listing_notes_objects_without_compiling_or_writing(tmp_path, monkeypatch):
    from quack.cache import jit, stats
    from quack.calls import plan
    from quack.compile_only import compile_only_mode

    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "layer"))
    before = stats()["compiles"]
    with jit.listing() as asked, compile_only_mode():
        plan.plan_for(SoftmaxCall("float32", 9, 1, True)).warm()
        with pytest.raises(RuntimeError, match="already active"):
            with jit.listing():
                pass
    assert sorted(obj.function.rpartition(".")[2] for obj in asked.values()) == [
        "compile_softmax_bwd", "compile_softmax_fwd"]
    assert stats()["compiles"] == before and not (tmp_path / "layer").exists()
