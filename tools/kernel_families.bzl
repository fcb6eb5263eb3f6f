"""The kernel families: one module each, quack/<family>.py, tested by tests/test_<family>.py.

Adding a family is adding its name here: quack/BUILD.bazel then builds its kernel cache action
(//quack:warm_cache_<family>, part of //quack:warm_cache) and keeps its module out of the other
families' actions; tests/BUILD.bazel makes its test a GPU test that consumes the cache.
"""

KERNEL_FAMILIES = [
    "cross_entropy",
    "gemm",
    "layernorm",
    "rmsnorm",
    "softmax",
]
