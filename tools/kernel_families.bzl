"""The kernel families: one package each, quack/families/<family>/, tested by tests/test_<family>.py.

The packages are the truth; this list names them for the BUILD files that cannot glob under quack/
(quack/BUILD.bazel fails the build when the two differ). Adding a family is adding its package and
its name here: quack/BUILD.bazel then builds its kernel cache action (//quack:warm_cache_<family>,
part of //quack:warm_cache) and keeps its package out of the other families' actions;
tests/BUILD.bazel makes its test a GPU test that consumes the cache.
"""

KERNEL_FAMILIES = [
    "cross_entropy",
    "gemm",
    "layernorm",
    "rmsnorm",
    "softmax",
]

def check_family_packages(packages):
    """Fails the build unless `packages` (the folders quack/families/*/) are KERNEL_FAMILIES.

    Args:
      packages: the kernel family packages found under quack/families/.
    """
    if sorted(packages) != sorted(KERNEL_FAMILIES):
        fail("the kernel family packages quack/families/*/ are %s, tools/kernel_families.bzl lists %s: make them agree" % (sorted(packages), sorted(KERNEL_FAMILIES)))
