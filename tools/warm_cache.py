"""Fill a kernel cache directory in compile-only mode: no GPU, nothing launched.

    python tools/warm_cache.py --out=DIR --family=rmsnorm \
        --tests=tests/test_rmsnorm.py --configs=tools/configs/production.json

Two sources of kernel calls, both run on fake CUDA tensors:

* test files, through ``pytest --compile-only`` (the quack pytest plugin), so
  every object a GPU run of those tests needs is exported;
* a JSON manifest of production configurations (op, dtypes, shape, flags),
  for shapes no test uses.

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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Cache directory to fill (the writable layer).", required=True)
flags.DEFINE_multi_string("family", [], "Kernel families to warm (default: every family seen).")
flags.DEFINE_multi_string("tests", [], "Test files to run under pytest --compile-only.")
flags.DEFINE_string("configs", None, "JSON manifest of production configurations.")
flags.DEFINE_string("arch", None, "GPU arch to compile for (default: QUACK_ARCH or sm_90a).")


def _warm_rmsnorm(cfg: dict) -> None:
    import torch

    import quack

    dtype = getattr(torch, cfg["dtype"])
    shape = tuple(cfg["shape"])
    grad = bool(cfg.get("grad", False))
    x = torch.empty(shape, device="cuda", dtype=dtype, requires_grad=grad)
    w = None
    if cfg.get("weight_dtype"):
        w = torch.empty(shape[-1], device="cuda", dtype=getattr(torch, cfg["weight_dtype"]))
    r = torch.empty(shape, device="cuda", dtype=dtype) if cfg.get("residual") else None
    quack.rmsnorm(x, w, residual=r)


def _warm_softmax(cfg: dict) -> None:
    import torch

    import quack

    x = torch.empty(tuple(cfg["shape"]), device="cuda", dtype=getattr(torch, cfg["dtype"]),
                    requires_grad=bool(cfg.get("grad", False)))
    quack.softmax(x)


def _warm_cross_entropy(cfg: dict) -> None:
    import torch

    import quack

    shape = tuple(cfg["shape"])
    logits = torch.empty(shape, device="cuda", dtype=getattr(torch, cfg["dtype"]),
                         requires_grad=bool(cfg.get("grad", False)))
    target = torch.zeros(shape[:-1], device="cuda", dtype=getattr(torch, cfg.get("target_dtype", "int64")))
    quack.cross_entropy(logits, target)


def _warm_layernorm(cfg: dict) -> None:
    import torch

    import quack

    dtype = getattr(torch, cfg["dtype"])
    shape = tuple(cfg["shape"])
    grad = bool(cfg.get("grad", False))
    x = torch.empty(shape, device="cuda", dtype=dtype, requires_grad=grad)
    w = b = None
    if cfg.get("weight_dtype"):
        w = torch.empty(shape[-1], device="cuda", dtype=getattr(torch, cfg["weight_dtype"]),
                        requires_grad=grad)
        if cfg.get("bias", True):
            b = torch.empty_like(w, requires_grad=grad)
    quack.layernorm(x, w, b)


def _warm_gemm(cfg: dict) -> None:
    import torch

    import quack

    dtype = getattr(torch, cfg["dtype"])
    m, n, k = cfg["shape"]
    groups = cfg.get("groups")
    a = torch.empty(m, k, device="cuda", dtype=dtype)
    # B row-major (N contiguous) or column-major (K contiguous) per group.
    b_strides = (n, 1) if cfg.get("b_layout", "row") == "row" else (1, k)
    b_shape, b_strides = ((groups, k, n), (k * n, *b_strides)) if groups else ((k, n), b_strides)
    b = torch.empty_strided(b_shape, b_strides, device="cuda", dtype=dtype)
    cu = torch.zeros(groups + 1, device="cuda", dtype=torch.int32) if groups else None
    out_dtype = getattr(torch, cfg["out_dtype"]) if cfg.get("out_dtype") else None
    quack.gemm(a, b, out_dtype=out_dtype, cu_seqlens_m=cu)


# op name in the manifest -> (family, function that makes the calls)
WARMERS = {
    "rmsnorm": ("rmsnorm", _warm_rmsnorm),
    "softmax": ("softmax", _warm_softmax),
    "cross_entropy": ("cross_entropy", _warm_cross_entropy),
    "layernorm": ("layernorm", _warm_layernorm),
    "gemm": ("gemm", _warm_gemm),
}


def warm_configs(path: Path, families: set[str]) -> int:
    """Run every manifest entry of the selected families; returns how many ran."""
    from quack.compile_only import compile_only_mode

    entries = json.loads(path.read_text())["configs"]
    done = 0
    for i, cfg in enumerate(entries):
        op = cfg.get("op")
        if op not in WARMERS:
            raise app.UsageError(f"{path}: entry {i} names unknown op {op!r}; known: {sorted(WARMERS)}")
        family, warm = WARMERS[op]
        if families and family not in families:
            continue
        logging.info("config %d/%d: %s", i + 1, len(entries), json.dumps(cfg, sort_keys=True))
        # A training configuration is also evaluated without grad, which can
        # use other kernels (no saved statistics): warm both.
        for grad in (True, False) if cfg.get("grad") else (False,):
            with compile_only_mode():
                warm({**cfg, "grad": grad})
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
    configs = warm_configs(Path(FLAGS.configs), set(FLAGS.family)) if FLAGS.configs else 0

    from quack.cache import stats

    entries = write_manifest(out)
    s = stats()
    logging.info(
        "warmed %s: %d objects (%d exported now, %d already present), %d configs, %.1f s compiling",
        ",".join(FLAGS.family) or "all families", len(entries), s["exports"],
        sum(s["hits"].values()), configs, s["compile_seconds"],
    )


if __name__ == "__main__":
    app.run(main)
