"""Check that two kernel caches built on different machines hold identical objects.

    python tools/compare_manifests.py BUILT_HERE/manifest.json BUILT_THERE/manifest.json

Every object key present in both manifests (written by tools/warm_cache.py)
must have the same sha256: the objects are byte-identical across machines.
Prints one line per shared key and a summary; exits 1 on any difference or
when the manifests share no key.
"""

from __future__ import annotations

import json
import sys


def load(path: str) -> dict[str, str]:
    with open(path) as f:
        return {entry["file"]: entry["sha256"] for entry in json.load(f)["objects"]}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    a, b = load(argv[1]), load(argv[2])
    shared = sorted(a.keys() & b.keys())
    differing = [key for key in shared if a[key] != b[key]]
    for key in shared:
        print(f"{'same' if a[key] == b[key] else 'DIFFERENT'}  {key}")
    print(f"{len(shared)} objects in both, {len(shared) - len(differing)} identical, {len(differing)} different")
    return 1 if differing or not shared else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
