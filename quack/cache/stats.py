"""Process-wide counters of what the cache did, for tests, warm-up reports and benchmarks."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

_LOCK = threading.Lock()
_HITS: Counter[str] = Counter()  # layer label ("memory", a read-only path, "writable") -> hits
_COUNTS: Counter[str] = Counter()  # misses, compiles, exports, bad_entries
_SECONDS: Counter[str] = Counter()  # verify, load, compile


def record_hit(layer: str) -> None:
    # No lock: this runs on every kernel launch, and a dict update of one key
    # is atomic under the GIL.
    _HITS[layer] += 1


def record(event: str) -> None:
    """Count one ``miss``, ``compile``, ``export`` or ``bad_entry``."""
    with _LOCK:
        _COUNTS[event] += 1


def record_seconds(phase: str, seconds: float) -> None:
    """Add time spent in ``verify`` (reading an entry and checking its sidecar
    and sha256), ``load`` (all of loading an object), of it the DSL
    runtime's C loader's two stages ``runtime_create`` (linking the object,
    loading its CUDA library) and ``runtime_function`` (finding its
    function), or ``compile`` (compile includes export)."""
    with _LOCK:
        _SECONDS[phase] += seconds


def stats() -> dict[str, Any]:
    """A snapshot; missing counters read 0.

    ``hits`` per layer label: ``memory`` counts lookups this process answered
    from what it already had (a kernel loaded or compiled earlier, in
    compile-only mode an entry already ensured); every other label is a layer
    whose entry was verified on disk (and loaded, outside compile-only mode).
    ``memory_hits`` and ``disk_hits`` are the two totals.
    """
    with _LOCK:
        hits = dict(_HITS)  # one copy: record_hit takes no lock
        return {
            "hits": hits,
            "memory_hits": hits.get("memory", 0),
            "disk_hits": sum(hits.values()) - hits.get("memory", 0),
            "misses": _COUNTS["miss"],
            "compiles": _COUNTS["compile"],
            "exports": _COUNTS["export"],
            "bad_entries": _COUNTS["bad_entry"],
            "verify_seconds": _SECONDS["verify"],
            "load_seconds": _SECONDS["load"],
            "runtime_create_seconds": _SECONDS["runtime_create"],
            "runtime_function_seconds": _SECONDS["runtime_function"],
            "compile_seconds": _SECONDS["compile"],
        }


def reset() -> None:
    with _LOCK:
        _HITS.clear()
        _COUNTS.clear()
        _SECONDS.clear()
