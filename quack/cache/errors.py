"""Exceptions raised by the kernel cache (both are RuntimeErrors, so callers that
only know "the kernel is unavailable" can catch that)."""


class CacheError(RuntimeError):
    """A cache entry or layer cannot be used (bad entry in strict mode, unsafe layer)."""


class CacheMissError(CacheError):
    """Strict mode: the object for a key is in no layer, and compiling is not allowed."""
