r"""Fill a kernel cache directory in compile-only mode: no GPU, nothing launched.

    python tools/warm_cache.py --out=DIR --family=rmsnorm \
        --tests=tests/test_rmsnorm.py --configs=tools/configs/production.jsonl

Two sources of kernel calls, both on fake CUDA tensors:

* test files, through ``pytest --compile-only`` (the quack pytest plugin), so
  every object a GPU run of those tests needs is exported;
* manifests of call signatures (``quack/calls/manifest.py``; ``--configs``,
  repeatable), such as tools/configs/production.jsonl or a file a job
  recorded with ``QUACK_CACHE_RECORD=FILE``: each call's plan is warmed,
  with no per-op code here.

QUACK_MATRIX (quack/testing/matrix.py) selects the tests' cases; under
``smoke`` only the first call of each manifest is warmed too.

The result is DIR/<family>/<key>.o + .json sidecars and DIR/manifest.json
(key hash, file, sha256, in sorted order), byte-identical from run to run.
DIR must be new, empty or a cache folder; nothing in it is ever deleted.
Bazel's //quack:warm_cache runs this once per kernel family; the package's
``python -m quack.warm`` (quack/warm.py, which does the work) replays
manifests without Bazel.
"""

from __future__ import annotations

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
flags.DEFINE_string("out", None, "Cache directory to fill: new, empty or a cache folder.", required=True)
flags.DEFINE_multi_string("family", [], "Kernel families to warm (default: every family seen).")
flags.DEFINE_multi_string("tests", [], "Test files to run under pytest --compile-only.")
flags.DEFINE_multi_string("configs", [], "Manifests of calls to warm (quack/calls/manifest.py).")
flags.DEFINE_string("arch", None, "GPU arch to compile for (default: QUACK_ARCH or sm_90a).")


def main(argv: list[str]) -> None:
    del argv
    from quack import warm
    from quack.cache.errors import CacheError
    from quack.calls.manifest import ManifestError

    try:
        result = warm.warm(Path(FLAGS.out), manifests=FLAGS.configs, families=FLAGS.family,
                           tests=FLAGS.tests, rootdir=ROOT, arch=FLAGS.arch)
    except ManifestError as e:
        raise app.UsageError(str(e)) from None
    except (CacheError, OSError) as e:
        sys.exit(f"warm_cache: {e}")
    logging.info("%s", warm.summary(result, FLAGS.family))


if __name__ == "__main__":
    app.run(main)
