"""The compile-only depth counter (``quack.compile_only`` pushes it; the cache reads it).

It lives here, below the cache, so the cache can read it without importing torch's
fake-tensor machinery. A ``ContextVar`` makes it per thread and per asyncio task.
"""

from __future__ import annotations

import contextvars

_COMPILE_ONLY_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar(
    "quack_compile_only_depth", default=0
)


def compile_only_active() -> bool:
    """Live: true while any ``compile_only_mode`` is entered in this context."""
    return _COMPILE_ONLY_DEPTH.get() > 0
