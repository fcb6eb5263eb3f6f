r"""Fill a kernel cache directory in compile-only mode: no GPU, nothing launched.

    python tools/warm_cache.py --out=DIR --family=rmsnorm \
        --tests=tests/test_rmsnorm.py --configs=tools/configs/production.jsonl
    python tools/warm_cache.py --out=DIR --unit='<a line of tools/kernels/units.bzl>'
    python tools/warm_cache.py --persistent_worker      (Bazel runs it so)

Three sources of kernels, all on fake CUDA tensors:

* test files, through ``pytest --compile-only`` (the quack pytest plugin), so
  every object a GPU run of those tests needs is exported;
* manifests of call signatures (``quack/calls/manifest.py``; ``--configs``,
  repeatable), such as tools/configs/production.jsonl or a file a job
  recorded with ``QUACK_CACHE_RECORD=FILE``: each call's plan is warmed,
  with no per-op code here;
* units (``--unit``, repeatable; quack/kernel_lists.py): one object each, by
  compile function and static arguments, as the committed kernel lists name
  them: one object per run, the step of per-object build actions.

QUACK_MATRIX (quack/testing/matrix.py) selects the tests' cases; under
``smoke`` only the first call of each manifest is warmed too.

The result is DIR/<family>/<key>.o + .json sidecars and DIR/manifest.json
(key hash, file, sha256, in sorted order), byte-identical from run to run.
DIR must be new, empty or a cache folder; nothing in it is ever deleted.
The package's ``python -m quack.warm`` (quack/warm.py, which does the work)
replays manifests without Bazel.

As a Bazel persistent worker (``--persistent_worker``, JSON protocol) it
imports torch and the CuTe DSL once, then forks one child per request: the
child imports ``quack`` from the request's inputs, warms, and exits, so no
state of one request (imported sources, plans, registered ops) reaches the
next, and a changed source is always read afresh.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from absl import app, flags, logging


def _checkout() -> Path:
    """Where ``quack`` is imported from: under ``bazel run``, the user's
    checkout (relative paths then start where the user ran it); in a Bazel
    action (the //tools:warm_cache py_binary, whose runfiles hold this script
    alone), the working directory, where the action's declared sources are
    staged; else the folder above this script as the command named it.
    Python's own first entry (this script's folder, symlinks resolved: the
    source tree's tools/, which no action declares) is replaced by it."""
    if os.environ.get("BUILD_WORKSPACE_DIRECTORY"):
        return Path(os.environ["BUILD_WORKSPACE_DIRECTORY"])
    if (Path.cwd() / "quack" / "__init__.py").is_file():
        return Path.cwd()
    return Path(os.path.abspath(__file__)).parent.parent


ROOT = _checkout()
sys.path[0] = str(ROOT)
if os.environ.get("BUILD_WORKING_DIRECTORY"):
    os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Cache directory to fill: new, empty or a cache folder.", required=True)
flags.DEFINE_multi_string("family", [], "Kernel families to warm (default: every family seen).")
flags.DEFINE_multi_string("tests", [], "Test files to run under pytest --compile-only.")
flags.DEFINE_multi_string("configs", [], "Manifests of calls to warm (quack/calls/manifest.py).")
flags.DEFINE_multi_string("unit", [], "Objects to compile: kernel_lists.Unit JSON (tools/kernels/units.bzl).")
flags.DEFINE_string("arch", None, "GPU arch to compile for (default: QUACK_ARCH or sm_90a).")


def main(argv: list[str]) -> None:
    del argv
    from quack import warm
    from quack.cache.errors import CacheError
    from quack.calls.manifest import ManifestError

    try:
        result = warm.warm(Path(FLAGS.out), manifests=FLAGS.configs, families=FLAGS.family,
                           tests=FLAGS.tests, units=FLAGS.unit, rootdir=Path(sys.path[0]), arch=FLAGS.arch)
    except (ManifestError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    except (CacheError, OSError) as e:
        sys.exit(f"warm_cache: {e}")
    logging.info("%s", warm.summary(result, FLAGS.family))


def serve() -> int:
    """Answer Bazel's work requests (one JSON object per line on stdin) until
    stdin closes; each runs in a forked child (``_run_forked``)."""
    # What every request's first compile imports (compile-only mode's fake
    # tensor mode imports torch._dynamo as it starts): imported once here,
    # inherited by each child.
    import cutlass.cute  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._subclasses.fake_tensor  # noqa: F401

    responses = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # only responses reach Bazel's pipe; a stray print goes to the worker log
    for line in sys.stdin:
        request = json.loads(line)
        code, output = _run_forked(request.get("arguments", []), request.get("sandboxDir") or "")
        responses.write(json.dumps({"exitCode": code, "output": output, "requestId": request.get("requestId", 0)}) + "\n")
        responses.flush()
    return 0


def _run_forked(arguments: list[str], sandbox: str) -> tuple[int, str]:
    """Run ``main`` on ``arguments`` in a child whose imports come from
    ``sandbox`` (else the worker's folder, the execroot); its exit status and output."""
    with tempfile.TemporaryFile() as log:
        pid = os.fork()
        if pid == 0:  # the child: never returns
            status = 1
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                if sandbox:
                    os.chdir(sandbox)
                sys.path[0] = os.getcwd()
                main(FLAGS([sys.argv[0], *arguments]))
                status = 0
            except app.UsageError as e:
                print(f"warm_cache: {e}", file=sys.stderr)
                status = 2
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 (reported in the response, never raised in the worker)
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        log.seek(0)
        output = log.read().decode(errors="replace")
    return os.waitstatus_to_exitcode(wait_status), output


def expand_params(argv: list[str]) -> list[str]:
    """``@FILE`` arguments replaced by FILE's lines (Bazel's multiline
    params file, which a worker gets expanded in its request)."""
    expanded = []
    for arg in argv:
        if arg.startswith("@"):
            expanded += Path(arg[1:]).read_text().splitlines()
        else:
            expanded.append(arg)
    return expanded


if __name__ == "__main__":
    if "--persistent_worker" in sys.argv[1:]:
        sys.exit(serve())
    app.run(main, argv=expand_params(sys.argv))
