"""Remote-execution readiness of the kernel actions (tools/check_remote_cache.sh): every
QuackWarmCache spawn of an execution log declares only relative inputs, names no absolute path
in its command or environment, is remotable and remote-cacheable, and declares every package
module it may import (other kernel families' modules are left out on purpose).

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
    family = spawn["targetLabel"].rsplit("warm_cache_", 1)[-1]
    for path in glob.glob(os.path.join(checkout, "quack/**/*.py"), recursive=True):
        rel = os.path.relpath(path, checkout)
        parts = rel.split("/")
        owner = parts[2] if len(parts) > 3 and parts[1] == "families" else None
        if owner not in (None, family):
            continue
        if rel not in inputs:
            problems.append("%s: module %s is not a declared input" % (spawn["targetLabel"], rel))
    for need in ("tools/warm_cache.py", "requirements_lock.txt", "tools/configs/production.jsonl", "tests/test_%s.py" % family):
        if need not in inputs:
            problems.append("%s: %s is not a declared input" % (spawn["targetLabel"], need))
    return problems


def main(log: str, checkout: str) -> int:
    problems = []
    for spawn in spawns(log, "QuackWarmCache"):
        problems += problems_of(spawn, checkout)
        print("   %s: %d declared inputs, all relative; command and environment relative"
              % (spawn["targetLabel"], len(spawn["inputs"])))
    for p in problems:
        print("   problem: " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
