"""Runs each kernel action outside Bazel on copies of its declared inputs only (tools/check_declared_inputs.sh).

    python3 run_declared_inputs.py AQUERY_JSON EXECROOT WORK

AQUERY_JSON is `bazel aquery --include_param_files --output=jsonproto` of the QuackKernel
actions; those whose output the build made (EXECROOT/<output> exists) are run. For each: a folder
WORK/<family>/<unit>/ gets a copy of every input file the action declares and its params file, at
their execroot paths, and nothing else; the action's command runs there standalone (not as a
worker) with exactly the action's environment (what `bazel aquery` lists, no HOME, no user
variables); its output folder must then hold the same files, byte for byte, as Bazel's.

The action's executable is the //tools:warm_cache py_binary: its runfiles, which the query names
by a middleman, are copied as Bazel built them (`<tool>.runfiles`, links followed), as an executor
stages a tool's runfiles. One input lies outside the copy by design: the pinned Python
environment. The interpreter shim in those runfiles finds the environment through the link `env`
beside its real path (as in Bazel's sandbox), so the copied shim gets that link, pointing where
Bazel's does.
Prints one line per action; exit 0 when every action's objects are identical.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
import shutil
import subprocess
import sys
from pathlib import Path


def _paths(query: dict) -> dict[int, str]:
    """artifact id -> execroot-relative path."""
    fragments = {f["id"]: f for f in query.get("pathFragments", [])}

    def path(fid: int) -> str:
        parts = []
        while fid:
            fragment = fragments[fid]
            parts.append(fragment["label"])
            fid = fragment.get("parentId", 0)
        return "/".join(reversed(parts))

    return {a["id"]: path(a["pathFragmentId"]) for a in query.get("artifacts", [])}


def _inputs(query: dict, action: dict, paths: dict[int, str]) -> list[str]:
    depsets = {d["id"]: d for d in query.get("depSetOfFiles", [])}
    seen, pending, found = set(), list(action.get("inputDepSetIds", [])), []
    while pending:
        d = depsets[pending.pop()]
        if d["id"] in seen:
            continue
        seen.add(d["id"])
        found.extend(paths[a] for a in d.get("directArtifactIds", []))
        pending.extend(d.get("transitiveDepSetIds", []))
    return sorted(set(found))


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def run_action(query: dict, action: dict, paths: dict[int, str], execroot: Path, work: Path) -> tuple[bool, str]:
    (output,) = [paths[i] for i in action["outputIds"]]
    family = Path(output).parent.name.removeprefix("units_")
    unit = f"{family}/{Path(output).name}"
    root = work / unit
    inputs = [rel for rel in _inputs(query, action, paths) if "/_middlemen/" not in rel]
    for rel in inputs:
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(execroot / rel, dest, follow_symlinks=True)
    for params in action.get("paramFiles", []):
        dest = root / params["execPath"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("".join(arg + "\n" for arg in params["arguments"]))
    tool = action["arguments"][0] + ".runfiles"
    shutil.copytree(execroot / tool, root / tool, symlinks=False)
    # The folders of the copied runfiles whose originals lie beside an `env` link: the runtime's
    # (twice where Bazel also keeps the legacy external/ runfiles paths).
    linked = {copied.parent: Path(os.path.realpath(execroot / copied.relative_to(root))).parent / "env"
              for copied in (root / tool).rglob("*") if copied.is_file()}
    linked = {folder: env for folder, env in linked.items() if env.is_dir()}
    if not linked:
        return False, f"{unit}: no interpreter shim with an environment link in the tool's runfiles {tool}"
    for folder, env in linked.items():
        folder.joinpath("env").symlink_to(os.path.realpath(env))
    (root / output).mkdir(parents=True)
    env = {v["key"]: v["value"] for v in action.get("environmentVariables", [])}
    done = subprocess.run(action["arguments"], cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        return False, f"{unit}: the action failed on its declared inputs (exit {done.returncode}):\n{tail}"
    ours, bazels = _digest(root / output), _digest(execroot / output)
    objects = sum(name.endswith(".o") for name in bazels)
    if not objects:
        return False, f"{unit}: Bazel's output {output} holds no objects"
    if ours != bazels:
        differ = sorted(set(ours.items()) ^ set(bazels.items()))[:10]
        return False, f"{unit}: outputs differ from Bazel's ({len(ours)} vs {len(bazels)} files): {differ}"
    return True, (f"{unit}: {len(inputs)} declared inputs copied, the action ran there: "
                  f"{len(ours)} files ({objects} objects) identical to Bazel's")


def main(argv: list[str]) -> int:
    query = json.loads(Path(argv[1]).read_text())
    execroot, work = Path(argv[2]), Path(argv[3])
    paths = _paths(query)
    actions = [a for a in query.get("actions", []) if a.get("mnemonic") == "QuackKernel"
               and all((execroot / paths[i]).is_dir() for i in a["outputIds"])]
    if not actions:
        print("declared inputs: FAIL (no QuackKernel action the build ran in the query)")
        return 1
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda a: run_action(query, a, paths, execroot, work), actions))
    for _, line in results:
        print(line)
    ok = all(passed for passed, _ in results)
    print(f"declared inputs: {'PASS' if ok else 'FAIL'} ({sum(p for p, _ in results)}/{len(results)} kernel actions "
          "identical standalone on copies of their declared inputs; the pinned environment is reached through the shim's link)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
