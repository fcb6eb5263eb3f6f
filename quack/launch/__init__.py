"""The launcher: a loaded kernel's host function called with torch tensors.

``launcher.py`` packs a call's arguments in C (``_fastlaunch.c``, built by
setup.py or Bazel) or, without the extension, through ctypes; ``handle.py`` is
the callable the cache hands out.  This layer knows nothing of the cache,
plans or ops (docs/architecture.md).
"""
