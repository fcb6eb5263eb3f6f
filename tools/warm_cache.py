"""Fill a kernel cache directory in compile-only mode: no GPU, nothing launched.

    python tools/warm_cache.py --out=DIR --family=rmsnorm \
        --tests=tests/test_rmsnorm.py --configs=tools/configs/production.jsonl

Two sources of kernel calls, both on fake CUDA tensors:

* test files, through ``pytest --compile-only`` (the quack pytest plugin), so
  every object a GPU run of those tests needs is exported;
* manifests of call signatures (``quack/cache/manifest.py``; ``--configs``,
  repeatable), such as tools/configs/production.jsonl or a file a job
  recorded with ``QUACK_CACHE_RECORD=FILE``: each call's plan is warmed,
  with no per-op code here.

QUACK_MATRIX (quack/testing/matrix.py) selects the tests' cases; under
``smoke`` only the first call of each manifest is warmed too.

The result is DIR/<family>/<key>.o + .json sidecars and DIR/manifest.json
(key hash, file, sha256, in sorted order), byte-identical from run to run.
Bazel's //quack:warm_cache runs this once per kernel family.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from absl import app, flags, logging

# Python puts this script's folder, symlinks resolved, first on sys.path: in a Bazel action that
# is the source tree's tools/, which the action does not declare.  Imports come from the folder
# above this script as the command named it (the execroot in an action, else the checkout).
ROOT = Path(os.path.abspath(__file__)).parent.parent
sys.path[0] = str(ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Cache directory to fill (the writable layer).", required=True)
flags.DEFINE_multi_string("family", [], "Kernel families to warm (default: every family seen).")
flags.DEFINE_multi_string("tests", [], "Test files to run under pytest --compile-only.")
flags.DEFINE_multi_string("configs", [], "Manifests of calls to warm (quack/cache/manifest.py; repeatable).")
flags.DEFINE_string("arch", None, "GPU arch to compile for (default: QUACK_ARCH or sm_90a).")


def warm_manifests(paths: list[str], families: set[str]) -> int:
    """Warm every call of the manifests (quack/cache/manifest.py) of the selected
    families (an op's name is its family's), through its plan; returns how
    many calls."""
    from quack import plan
    from quack.cache import manifest
    from quack.compile_only import compile_only_mode
    from quack.testing import matrix

    done = 0
    for path in paths:
        try:
            calls = manifest.read(path, families or None)
        except manifest.ManifestError as e:
            raise app.UsageError(str(e)) from None
        if matrix.selection() == "smoke":  # the wiring checks: one call of each manifest
            calls = calls[:1]
        for sig in calls:
            logging.info("%s: %s", path, plan.entry_line(sig))
            with compile_only_mode():
                plan.plan_for(sig).warm()
            done += 1
    return done


def warm_tests(test_files: list[str]) -> None:
    """pytest --compile-only over the given files, in this process."""
    import pytest

    logging.info("pytest --compile-only %s", " ".join(test_files))
    code = pytest.main(
        ["--compile-only", "-q", "-p", "quack.testing.pytest_plugin", "-p", "no:cacheprovider",
         "--rootdir", str(ROOT), *test_files]
    )
    if code != 0:
        raise SystemExit(f"pytest --compile-only failed with exit code {int(code)}")


def write_manifest(out: Path) -> list[dict]:
    """Drop lock files and write manifest.json listing every object, sorted."""
    for lock in out.rglob("*.lock"):
        lock.unlink()
    entries = []
    for obj in sorted(out.rglob("*.o")):
        rel = obj.relative_to(out).as_posix()
        entries.append({
            "key": obj.stem,
            "family": obj.parent.name,
            "file": rel,
            "sha256": hashlib.sha256(obj.read_bytes()).hexdigest(),
        })
    (out / "manifest.json").write_text(json.dumps({"objects": entries}, indent=1, sort_keys=True) + "\n")
    return entries


def main(argv: list[str]) -> None:
    del argv
    out = Path(FLAGS.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["QUACK_CACHE_DIR"] = str(out)
    os.environ.pop("QUACK_CACHE_PATH", None)
    os.environ.pop("QUACK_CACHE_STRICT", None)
    if FLAGS.arch:
        os.environ["QUACK_ARCH"] = FLAGS.arch
    if FLAGS.tests:
        warm_tests(FLAGS.tests)
    configs = warm_manifests(FLAGS.configs, set(FLAGS.family))

    from quack.cache import stats

    entries = write_manifest(out)
    s = stats()
    logging.info(
        "warmed %s: %d objects (%d exported now, %d already present), %d manifest calls, %.1f s compiling",
        ",".join(FLAGS.family) or "all families", len(entries), s["exports"],
        sum(s["hits"].values()), configs, s["compile_seconds"],
    )


if __name__ == "__main__":
    app.run(main)
