"""A fake kernel family for cache tests that need many entries or processes quickly.

``compile_fake(n)`` goes through the real ``jit_cache`` machinery (keys, layers,
verification, locks, atomic export, trust checks, pruning); only the two calls
into the CuTe DSL runtime are replaced (:func:`use_fakes`): the export writes a
deterministic payload derived from the key's symbol prefix plus a C header the
real ABI parser reads, and the load records whether the bytes it read are
exactly that payload (a corrupt read) instead of linking anything.

It imports neither torch nor the CuTe DSL, so worker processes start in a
fraction of a second (see ``WORKER_PRELUDE``).
"""

import hashlib
import os
from pathlib import Path

import quack.cache
from quack.cache import native
from quack.launch.handle import KernelHandle

FAMILY = "test_fake"
HEADER = "#include <cuda_runtime.h>\nint32_t cute_dsl_{prefix}_wrapper(void *module, cudaStream_t stream);\n"

LOADS: list = []  # (keyhash, intact) per load


class FakeCompiled:
    def __init__(self, n):
        self.n = n

    def __call__(self, *args):
        return None


@quack.cache.jit_cache(FAMILY)
def compile_fake(n: int = 1):
    log = os.environ.get("QUACK_TEST_COMPILE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    return FakeCompiled(n)


def payload(prefix: str, size: int = 4096) -> bytes:
    seed = hashlib.sha256(prefix.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def export_object(compiled, directory, name, prefix):
    Path(directory, f"{name}.o").write_bytes(payload(prefix))
    Path(directory, f"{name}.h").write_text(HEADER.format(prefix=prefix))


def load_object(data, prefix, keyhash, abi):
    LOADS.append((keyhash, data == payload(prefix)))
    return KernelHandle(FakeCompiled(0), keyhash)


def use_fakes(monkeypatch=None):
    """Route the cache's export and load through the fakes (undone with ``monkeypatch``)."""
    LOADS.clear()
    for name, fake in (("export_object", export_object), ("load_object", load_object)):
        if monkeypatch is not None:
            monkeypatch.setattr(native, name, fake)
        else:
            setattr(native, name, fake)


# Start of a worker script: import quack.cache (``import quack`` loads no kernel family, torch
# or the CuTe DSL) without reading the CUDA flavour from the DSL.
# Needs REPO (the checkout) and QUACK_ARCH in the environment.
WORKER_PRELUDE = """
import os, sys
REPO = os.environ["REPO"]
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
import quack.cache.key
quack.cache.key.cuda_flavour = lambda: "cu13"
import quack.cache
from cache_fixtures import fake_kernel
fake_kernel.use_fakes()
"""
