"""A tiny real CuTe DSL kernel family and helpers for the cache tests (no GPU needed)."""
