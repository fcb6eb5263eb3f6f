"""``jit_cache``: the decorator that turns a compile function into a cached kernel getter.

Lookup order for a key: in-process memory, each read-only layer
(``QUACK_CACHE_PATH``), the writable layer (``QUACK_CACHE_DIR``), then a compile
that exports into the writable layer under a per-key lock (re-checked after the
lock is taken, so racing processes compile once). Strict mode turns the compile
into ``CacheMissError``. Compile-only mode only ensures the entry exists and
returns a no-op handle: loading native code needs a CUDA driver.

Trust: objects are native code. Read-only layers are the ones the user
configured; the writable layer is used only while it is owned by this user and
not writable by group or others, otherwise it is bypassed with one warning
(nothing loaded from it, compiles are not exported; compile-only mode raises,
since exporting is its job). A failed export (full
disk) is warned once and the freshly compiled kernel is used uncached;
compile-only mode raises, as its job is the export. None of this runs on a
memory hit.

Threads: compiles are serialised across the process (``native.DSL_LOCK``: the
DSL is not thread-safe); memory hits, loads and launches run concurrently.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from . import maintenance, native, stats
from .config import CacheConfig, read_config
from .errors import CacheError, CacheMissError
from .files import UnsafeFile
from quack.launch.handle import KernelHandle, _noop_kernel
from .key import canonical_json, function_prefix, key_hash, object_key
from quack.launch.launcher import FastLauncher
from .mode import compile_only_active
from .source_hash import record_imported
from quack.launch.launcher import parse_abi
from .store import (
    ExportError,
    summary,
    Layer,
    key_lock,
    touch_last_use,
    verify_entry,
    write_entry,
    writable_problem,
)

log = logging.getLogger("quack.cache")

_MEMORY: dict[str, KernelHandle] = {}  # keyhash -> loaded or freshly compiled handle
_ENSURED: set[tuple[Path, str]] = set()  # (writable root, keyhash) known on disk, compile-only
_WARNED: set[tuple[str, str, str]] = set()  # (layer, keyhash, problem) already logged
_LOCK = threading.Lock()
# Writable layer root -> bytes it held at its last scan plus this process's exports since.
_LAYER_BYTES: dict[Path, int] = {}
# (compile function, args, kwargs) -> handle: the per-call fast path.  Binding
# the signature and hashing the key costs tens of microseconds; a kernel
# launch must not pay that on every call.  The knobs (QUACK_ARCH, layers) are
# read when a key is first resolved in a process; clear() forgets this map.
_RECENT: dict[tuple, KernelHandle] = {}
# While ``listing()`` runs: the objects compile-only requests asked for, by
# (function, canonical JSON of the arguments), instead of compiling them.
_LISTED: dict[tuple[str, str], "ListedObject"] | None = None


@dataclass(frozen=True)
class ListedObject:
    """One object a compile-only request asked for under ``listing()``:
    the compile function (module.qualname) and its bound arguments, as the key holds them."""

    family: str
    function: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Request:
    """One lookup: the key, where to look, and how to compile on a miss."""

    family: str
    function: str
    key: dict[str, Any]
    keyhash: str
    prefix: str
    config: CacheConfig
    compile: Callable[[], Any]

    @property
    def layers(self) -> list[Layer]:
        readonly = [Layer(p, str(p), False) for p in self.config.readonly_dirs]
        return readonly + [self.writable]

    @property
    def writable(self) -> Layer:
        return Layer(self.config.writable_dir, "writable", True)


def jit_cache(family: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a kernel family's compile function; its arguments are the static key.

    The decorated function returns a handle: ``handle(*runtime_args)`` launches
    the kernel (a no-op under compile-only mode). Positional and keyword calls
    with the same values give the same key. Its ``request(*args, **kwargs)``
    is the lookup such a call makes, without making it (see ``is_cached``).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        record_imported(fn.__module__)  # the sources as imported enter the key

        def request(*args: Any, **kwargs: Any) -> Request:
            """The lookup a call with these arguments makes (its key, the
            layers to search), without making it: nothing is compiled."""
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return _request(family, fn, bound)

        @functools.wraps(fn)
        def get(*args: Any, **kwargs: Any) -> Callable[..., Any]:
            recent = (fn, args, tuple(kwargs.items())) if kwargs else (fn, args)
            handle = _RECENT.get(recent)
            if handle is not None and not compile_only_active():
                stats.record_hit("memory")
                return handle
            handle = get_kernel(request(*args, **kwargs))
            if isinstance(handle, KernelHandle):
                with _LOCK:
                    _RECENT[recent] = handle
            return handle

        get.request = request  # type: ignore[attr-defined]
        return get

    return decorate


def get_kernel(req: Request) -> Callable[..., Any]:
    """Resolve one request to a handle, in the documented lookup order."""
    if compile_only_active():
        return _ensure_exported(req)
    handle = _lookup_memory(req) or _lookup_layers(req, load=True)
    if handle is None:
        handle = _compile(req, load=True)
        with _LOCK:
            _MEMORY[req.keyhash] = handle
    if handle.reload is None:
        handle.reload = functools.partial(_load_again, req)
    return handle


def is_cached(req: Request) -> bool:
    """Whether a layer holds a valid entry for ``req`` (a decorated function's
    ``request(...)``), verified as a lookup verifies it but neither loaded nor
    compiled: a check that needs no GPU (``quack/preflight.py``). As in a
    lookup, a bad entry is a miss, warned once (strict mode: ``CacheError``)."""
    return _lookup_layers(req, load=False) is not None


def _load_again(req: Request) -> KernelHandle:
    """A handle of its own for another device (``KernelHandle``): the entry
    loaded again from the first layer that has it valid, or, where none does
    (it could not be cached), compiled again; strict mode raises there."""
    for layer in req.layers:
        if layer.writable and not _writable_trusted(req):
            continue
        handle = _probe(layer, req, load=True)
        if handle is not None:
            return handle
    if req.config.strict:
        raise CacheMissError(_miss_message(req))
    return _compile_uncached(req, None)


def _request(family: str, fn: Callable[..., Any], bound: inspect.BoundArguments) -> Request:
    config = read_config()
    key = object_key(family, fn.__module__, fn.__qualname__, dict(bound.arguments), config.arch)
    keyhash = key_hash(key)
    return Request(
        family=family,
        function=f"{fn.__module__}.{fn.__qualname__}",
        key=key,
        keyhash=keyhash,
        prefix=function_prefix(family, keyhash),
        config=config,
        compile=lambda: fn(*bound.args, **bound.kwargs),
    )


@contextlib.contextmanager
def listing() -> Iterator[dict[tuple[str, str], ListedObject]]:
    """Within the block, compile-only requests neither look up nor compile:
    each object asked for is added to the dict yielded (the kernel lists'
    enumerate pass: which objects a run needs, in seconds)."""
    global _LISTED
    with _LOCK:
        if _LISTED is not None:
            raise RuntimeError("listing() is already active")
        _LISTED = listed = {}
    try:
        yield listed
    finally:
        with _LOCK:
            _LISTED = None


def _ensure_exported(req: Request) -> Callable[..., Any]:
    """Compile-only: make sure a valid entry exists in some layer; never load
    (under ``listing()``: only note the request)."""
    listed = _LISTED
    if listed is not None:
        obj = ListedObject(req.family, req.function, req.key["args"])
        with _LOCK:
            listed.setdefault((obj.function, canonical_json(obj.args)), obj)
        return _noop_kernel
    marker = (req.config.writable_dir, req.keyhash)
    if marker in _ENSURED:
        stats.record_hit("memory")
    elif _lookup_layers(req, load=False) is None:
        _compile(req, load=False)
    with _LOCK:
        _ENSURED.add(marker)
    return _noop_kernel


def _lookup_memory(req: Request) -> KernelHandle | None:
    """A handle this process already loaded or compiled for the key."""
    handle = _MEMORY.get(req.keyhash)
    if handle is not None:
        stats.record_hit("memory")
    return handle


def _lookup_layers(req: Request, *, load: bool) -> Callable[..., Any] | None:
    """First valid entry across the layers, loaded (or a no-op when ``load`` is false).

    A bad entry or a failed load is logged once and skipped (strict: raised).
    """
    removed: list[str] = []
    for layer in req.layers:
        if layer.writable and not _writable_trusted(req):
            continue
        handle = _probe(layer, req, load=load, removed=removed)
        if handle is not None:
            stats.record_hit(layer.label)
            if load:
                with _LOCK:
                    _MEMORY[req.keyhash] = handle
            return handle
    if removed and req.config.strict:
        raise CacheMissError(f"{_miss_message(req)} ({'; '.join(removed)})")
    return None


def _probe(
    layer: Layer, req: Request, *, load: bool, report: bool = True, removed: list | None = None
) -> Callable[..., Any] | None:
    """Verify one layer's entry and load it; ``None`` when absent or bad.

    ``report=False`` skips reporting a bad entry (already reported before the lock).
    ``removed`` collects the layers whose entry vanished while it was read.
    """
    removed = [] if removed is None else removed
    start = time.perf_counter()
    verdict = verify_entry(layer, req.family, req.keyhash, req.key)
    stats.record_seconds("verify", time.perf_counter() - start)
    if verdict.state == "absent":
        if verdict.problem:
            removed.append(f"{layer.label}: the entry was {verdict.problem}")
        return None
    if verdict.state == "bad":
        if report:
            _report_bad(layer, req, verdict.problem)
        return None
    touch_last_use(layer, req.family, req.keyhash)
    if not load:
        return _noop_kernel
    start = time.perf_counter()
    try:
        handle = native.load_object(verdict.data, req.prefix, req.keyhash, verdict.sidecar["abi"])
    except Exception as exc:  # any load failure is a miss, never a crash
        if report:
            _report_bad(layer, req, f"load failed ({type(exc).__name__}: {exc})")
        return None
    stats.record_seconds("load", time.perf_counter() - start)
    return handle


def _compile(req: Request, *, load: bool) -> Callable[..., Any]:
    """Miss: compile and export into the writable layer under the key's lock.

    Re-checks the writable layer once the lock is held: another process may
    have exported the entry meanwhile. Strict mode raises instead.
    """
    stats.record("miss")
    if req.config.strict:
        raise CacheMissError(_miss_message(req))
    layer = req.writable
    if not _writable_trusted(req):
        if not load:
            raise CacheError(f"compile-only mode cannot export {req.function}: {writable_problem(layer.root)}")
        return _compile_uncached(req, None)
    with contextlib.ExitStack() as locked:
        try:
            locked.enter_context(key_lock(layer, req.family, req.keyhash))
        except (OSError, UnsafeFile) as exc:  # no lock file possible: full disk, read-only, unsafe folder
            error = ExportError(f"cannot lock {layer.lock_path(req.family, req.keyhash)}: {exc}")
            return _compile_uncached(req, error, load=load)
        handle = _probe(layer, req, load=load, report=False)
        if handle is not None:
            stats.record_hit(layer.label)
            return handle
        start = time.perf_counter()
        with native.DSL_LOCK:
            compiled = req.compile()
        stats.record("compile")
        try:
            abi = write_entry(
                layer,
                req.family,
                req.keyhash,
                req.key,
                req.prefix,
                lambda directory, name: native.export_object(compiled, directory, name, req.prefix),
            )
        except ExportError as exc:
            stats.record_seconds("compile", time.perf_counter() - start)
            return _compile_uncached(req, exc, compiled=compiled, load=load)
        stats.record("export")
        stats.record_seconds("compile", time.perf_counter() - start)
    if req.config.max_size is not None:
        _bound_size(layer, req)
    if not load:
        return _noop_kernel
    return KernelHandle(FastLauncher(compiled, abi), req.keyhash)


def _writable_trusted(req: Request) -> bool:
    """Whether the writable layer may be read and written (one stat); warns once if not."""
    problem = writable_problem(req.config.writable_dir)
    if not problem:
        return True
    warned = ("trust", str(req.config.writable_dir), problem)
    if warned not in _WARNED:
        _WARNED.add(warned)
        log.warning("%s; bypassing it: nothing is loaded from it and compiles are not cached", problem)
    return False


def _compile_uncached(
    req: Request, error: ExportError | None, *, compiled: Any = None, load: bool = True
) -> Callable[..., Any]:
    """Use a compiled kernel without caching it: the writable layer is untrusted
    (``error`` None) or could not be written (``error``, warned once).
    Compile-only mode raises instead: exporting is all it is for."""
    if error is not None:
        if not load:
            raise CacheError(f"compile-only mode could not export {req.function}: {error}") from error
        warned = ("export", str(req.config.writable_dir), type(error.__cause__).__name__)
        if warned not in _WARNED:
            _WARNED.add(warned)
            log.warning("%s; using the compiled kernel without caching it", error)
    if compiled is None:
        start = time.perf_counter()
        with native.DSL_LOCK:
            compiled = req.compile()
        stats.record("compile")
        stats.record_seconds("compile", time.perf_counter() - start)
    abi = error.abi if error is not None else None
    if abi is None:
        abi = _abi_of(compiled, req)
    return KernelHandle(FastLauncher(compiled, abi), req.keyhash)


def _abi_of(compiled: Any, req: Request) -> list:
    """The argument layout of a compiled kernel, read from an export into a
    private temporary directory (the header is where the layout comes from)."""
    try:
        with tempfile.TemporaryDirectory(prefix="quack-abi-") as tmp:
            native.export_object(compiled, Path(tmp), req.keyhash, req.prefix)
            return parse_abi((Path(tmp) / f"{req.keyhash}.h").read_text(), req.prefix)
    except Exception as exc:  # the DSL wraps OS errors (a full disk) in its own
        raise CacheError(f"cannot use {req.function} uncached: exporting it failed ({summary(exc)})") from exc


def _bound_size(layer: Layer, req: Request) -> None:
    """``QUACK_CACHE_MAX_SIZE``: evict least recently used entries after an export.

    The layer is scanned on the process's first export and then only when the
    bytes it is known to hold (that scan's total plus this process's exports
    since) pass the bound: an export does not pay a walk of the whole layer.
    """
    bound = req.config.max_size
    known = _LAYER_BYTES.get(layer.root)
    if known is not None:
        known += _entry_bytes(layer, req)
        _LAYER_BYTES[layer.root] = known
        if known <= bound:
            return
    try:
        removed, left = maintenance.prune(layer, bound, keep=[(req.family, req.keyhash)])
    except (OSError, CacheError) as exc:
        log.warning("could not bound the cache %s to QUACK_CACHE_MAX_SIZE: %s", layer.root, exc)
        return
    _LAYER_BYTES[layer.root] = left
    if removed:
        log.info("evicted %d entries from %s (QUACK_CACHE_MAX_SIZE)", len(removed), layer.root)


def _entry_bytes(layer: Layer, req: Request) -> int:
    total = 0
    for path in (layer.object_path(req.family, req.keyhash), layer.sidecar_path(req.family, req.keyhash)):
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total


def _report_bad(layer: Layer, req: Request, problem: str) -> None:
    """Count and log a bad entry once; in strict mode raise ``CacheError`` naming it."""
    stats.record("bad_entry")
    where = layer.object_path(req.family, req.keyhash)
    message = f"bad cache entry {where} for {req.function} ({req.family}): {problem}"
    if req.config.strict:
        raise CacheError(message)
    warned = (layer.label, req.keyhash, problem)
    if warned not in _WARNED:
        _WARNED.add(warned)
        log.warning("%s; treating it as a miss", message)


def _miss_message(req: Request) -> str:
    fields = "\n".join(f"  {name} = {value!r}" for name, value in sorted(req.key.items()))
    searched = ", ".join(str(layer.root) for layer in req.layers)
    return (
        f"quack cache miss in strict mode (QUACK_CACHE_STRICT=1): family {req.family!r}, "
        f"kernel {req.function}, key {req.keyhash}\n{fields}\nsearched: {searched}"
    )


_ON_CLEAR: list[Callable[[], None]] = []


def on_clear(forget: Callable[[], None]) -> None:
    """Have ``clear`` call ``forget``: a layer above the cache that keeps
    loaded handles registers how to drop them (the cache imports no layer above it)."""
    _ON_CLEAR.append(forget)


def clear(*, disk: bool = False) -> None:
    """Forget in-process handles (the ops' fast-path closures too), warnings and stats (not the source hashes
    of imported modules: they describe the code this process runs).

    With ``disk=True`` also delete every entry of the current writable layer:
    its entries and the cache's own temporaries, nothing else (see
    ``maintenance.clear``); a layer that fails the trust check raises
    ``CacheError`` and is left as it is.
    """
    with _LOCK:
        _MEMORY.clear()
        _RECENT.clear()
        _ENSURED.clear()
        _WARNED.clear()
        _LAYER_BYTES.clear()
    stats.reset()
    for forget in _ON_CLEAR:  # the layers above that hold loaded handles (the fast path's closures)
        forget()
    if disk:
        maintenance.clear(Layer(read_config().writable_dir, "writable", True))
