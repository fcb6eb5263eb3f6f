"""Reads Bazel's JSON execution log (--execution_log_json_file) for the tools/check_*.sh scripts.

The log is a stream of JSON objects, one per spawn, not one JSON document, so ``json.load``
cannot read it: ``spawns`` decodes the objects one after another.

    exec_log.py LOG MNEMONIC QUERY

prints, of the spawns of MNEMONIC in LOG:
    runs   how many ran (no cache hit) and their target labels: "N: label label ..."
    targets  of those that ran, how many per target: "label=N label=N ..." (sorted; empty if none)
    ran    how many ran (no cache hit)
    hit    how many were remote cache hits
    count  how many there are
    time   their total seconds (metrics.totalTime)
"""

import json
import sys


def spawns(path: str, mnemonic: str) -> list:
    """The spawns of ``mnemonic`` in the execution log at ``path``, in log order."""
    text = open(path).read()
    dec, pos, found = json.JSONDecoder(), 0, []
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        spawn, pos = dec.raw_decode(text, pos)
        if spawn.get("mnemonic") == mnemonic:
            found.append(spawn)
    return found


def _runs(found: list) -> str:
    labels = sorted(s.get("targetLabel", "?") for s in found if not s.get("cacheHit"))
    return "%d: %s" % (len(labels), " ".join(labels))


def _targets(found: list) -> str:
    counts = {}
    for s in found:
        if not s.get("cacheHit"):
            label = s.get("targetLabel", "?")
            counts[label] = counts.get(label, 0) + 1
    return " ".join("%s=%d" % item for item in sorted(counts.items()))


def _total_seconds(found: list) -> str:
    return "%.3f" % sum(float(s.get("metrics", {}).get("totalTime", "0s").rstrip("s")) for s in found)


QUERIES = {
    "runs": _runs,
    "targets": _targets,
    "ran": lambda found: sum(1 for s in found if not s.get("cacheHit")),
    "hit": lambda found: sum(1 for s in found if s.get("cacheHit") and s.get("runner") == "remote cache hit"),
    "count": len,
    "time": _total_seconds,
}


def main(argv: list) -> int:
    if len(argv) != 3 or argv[2] not in QUERIES:
        sys.exit("usage: exec_log.py LOG MNEMONIC {%s}" % ",".join(QUERIES))
    path, mnemonic, query = argv
    print(QUERIES[query](spawns(path, mnemonic)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
