"""Remote-execution readiness of the kernel actions (tools/check_remote_cache.sh): every
QuackKernel spawn of an execution log declares only relative inputs, names no absolute path
in its command or environment, is remotable and remote-cacheable, declares every package
module it may import (other kernel families' modules are left out on purpose), and reads no
test, manifest or kernel list (its unit comes in its params file).

    remote_readiness.py EXEC_LOG CHECKOUT      (exit 0 = ready; prints one line per action)
"""

import glob
import os
import sys

from exec_log import spawns


def problems_of(spawn: dict, checkout: str) -> list:
    """What keeps one kernel action from running on a remote executor."""
    inputs = [i["path"] for i in spawn["inputs"]]
    words = spawn["commandArgs"] + [e["value"] for e in spawn.get("environmentVariables", [])]
    problems = ["absolute input %s" % p for p in inputs if p.startswith("/")]
    problems += ["absolute path in command/env: %s" % w for w in words if w.startswith("/") or "=/" in w]
    if not spawn.get("remotable", True) or not spawn.get("remoteCacheable", True):
        problems.append("%s is not remotable" % spawn["targetLabel"])
    family = spawn["targetLabel"].rsplit(":units_", 1)[-1]
    for path in glob.glob(os.path.join(checkout, "quack/**/*.py"), recursive=True):
        rel = os.path.relpath(path, checkout)
        parts = rel.split("/")
        owner = parts[2] if len(parts) > 3 and parts[1] == "families" else None
        if owner not in (None, family):
            continue
        if rel not in inputs:
            problems.append("%s: module %s is not a declared input" % (spawn["targetLabel"], rel))
    if "requirements_lock.txt" not in inputs:
        problems.append("%s: requirements_lock.txt is not a declared input" % spawn["targetLabel"])
    # The tool, //tools:warm_cache, brings its script in its runfiles.
    if not any(p.endswith(".runfiles/_main/tools/warm_cache.py") for p in inputs):
        problems.append("%s: the tool's tools/warm_cache.py is not among its inputs" % spawn["targetLabel"])
    problems += ["%s: reads %s (a kernel action's inputs are sources, its unit and the toolchain)" % (spawn["targetLabel"], p)
                 for p in inputs if p.startswith(("tests/", "tools/configs/", "tools/kernels/"))]
    return problems


def main(log: str, checkout: str) -> int:
    problems, per_target = [], {}
    for spawn in spawns(log, "QuackKernel"):
        problems += problems_of(spawn, checkout)
        per_target.setdefault(spawn["targetLabel"], []).append(len(spawn["inputs"]))
    for label, counts in sorted(per_target.items()):
        print("   %s: %d actions of %d declared inputs each, all relative; command and environment relative"
              % (label, len(counts), max(counts)))
    if not per_target:
        problems.append("no QuackKernel spawn in %s" % log)
    for p in problems:
        print("   problem: " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
