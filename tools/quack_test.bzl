"""`quack_test`: the project's test macro, one `py_test` per test file.

Every test runs its file under pytest with the project plugin through a generated launcher
(tools/bazel_support/pytest_launcher.py.tpl). A GPU test (`gpu = True`):

  - is tagged `gpu` and carries `exec_properties` a remote GPU pool matches (`Pool: gpu`);
  - lists the kernel cache (default //quack:warm_cache) in `data` and reads kernels only from it:
    QUACK_CACHE_PATH = its runfiles directories, QUACK_CACHE_STRICT = 1 (a miss is an error);
  - runs normally where a GPU is visible (zero compiles) and `--compile-only` where none is, so a
    CPU machine still proves that the Bazel-built objects cover every kernel the test calls.

The launcher finds everything from its own place in the runfiles, so the target also runs from a
`--build_python_zip` archive on a GPU machine without Bazel: `python3 bazel-bin/tests/NAME.zip`.

Example (tests/BUILD.bazel):

    quack_test(name = "test_cache", srcs = ["test_cache.py"])
    quack_test(name = "test_rmsnorm", srcs = ["test_rmsnorm.py"], gpu = True, size = "large")
"""

load("@rules_python//python:defs.bzl", "py_test")

_DEFAULT_KERNEL_CACHE = "//quack:warm_cache"

_SIZES = ("small", "medium", "large", "enormous")

def _pytest_launcher_impl(ctx):
    cache_dirs = []
    for dep in ctx.attr.kernel_cache:
        cache_dirs += [d.short_path for d in dep[DefaultInfo].files.to_list() if d.is_directory]
    config = {
        "cache_dirs": sorted(cache_dirs),
        "gpu": ctx.attr.gpu,
        "package": ctx.label.package,
        "test_files": [f.short_path for f in ctx.files.tests],
    }
    out = ctx.actions.declare_file(ctx.attr.name + ".py")
    ctx.actions.expand_template(
        template = ctx.file._template,
        output = out,
        substitutions = {"%{CONFIG}": json.encode(config)},
    )
    return [DefaultInfo(files = depset([out]))]

_pytest_launcher = rule(
    implementation = _pytest_launcher_impl,
    attrs = {
        "gpu": attr.bool(mandatory = True),
        "kernel_cache": attr.label_list(),
        "tests": attr.label_list(allow_files = [".py"], mandatory = True),
        "_template": attr.label(
            allow_single_file = True,
            default = "//tools/bazel_support:pytest_launcher.py.tpl",
        ),
    },
)

def _test_env(gpu):
    env = {"QUACK_REQUIRE_PINNED_ENV": "1"}
    if gpu:
        env["QUACK_CACHE_STRICT"] = "1"
    return env

def quack_test(
        *,
        name,
        srcs,
        gpu = False,
        kernel_cache = None,
        deps = [],
        data = [],
        size = "medium",
        timeout = None,
        tags = [],
        gpu_exec_properties = {"Pool": "gpu"},
        flaky = False):
    """A py_test that runs one test file under pytest with the quack plugin.

    Args:
      name: target name; by convention the file's name without `.py`.
      srcs: exactly one test file, `test_*.py`.
      gpu: the file has GPU tests (marked with the project's GPU marker): tag `gpu`, consume the
        kernel cache, run strict (normal run with a GPU, `--compile-only` without).
      kernel_cache: kernel cache target for a GPU test; default //quack:warm_cache.
      deps: extra Python deps; //quack is always a dependency.
      data: extra runtime files.
      size: test size.
      timeout: test timeout; default from size.
      tags: extra tags.
      gpu_exec_properties: `exec_properties` of a GPU test (what a remote GPU pool matches).
      flaky: passed to py_test.
    """
    if type(srcs) != type([]) or len(srcs) != 1:
        fail("quack_test(name = %r): srcs must be a list of exactly one test file, got %r" % (name, srcs))
    src = srcs[0]
    base = src.rsplit(":", 1)[-1].rsplit("/", 1)[-1]
    if not (base.startswith("test_") and base.endswith(".py")):
        fail("quack_test(name = %r): the test file must be named test_*.py, got %r" % (name, src))
    if type(gpu) != type(True):
        fail("quack_test(name = %r): gpu must be True or False, got %r" % (name, gpu))
    if kernel_cache != None and not gpu:
        fail("quack_test(name = %r): kernel_cache is only for gpu = True tests" % name)
    if size not in _SIZES:
        fail("quack_test(name = %r): size must be one of %s, got %r" % (name, _SIZES, size))
    if "gpu" in tags:
        fail("quack_test(name = %r): do not tag `gpu` by hand; set gpu = True" % name)

    caches = [kernel_cache or _DEFAULT_KERNEL_CACHE] if gpu else []
    launcher = name + "_pytest_main"
    _pytest_launcher(
        name = launcher,
        gpu = gpu,
        kernel_cache = caches,
        tests = srcs,
        testonly = True,
    )
    py_test(
        name = name,
        srcs = [":" + launcher] + srcs,
        main = ":%s.py" % launcher,
        deps = sorted({d: None for d in ["//quack"] + deps}.keys()),
        # A GPU test launches through the C launcher (without it, through ctypes).
        data = ["//:pytest_config"] + caches + (["//quack:launch/_fastlaunch.abi3.so"] if gpu else []) + data,
        # QUACK_MATRIX follows the kernel cache's selection (--config=smoke: //tools:smoke_matrix).
        env = select({
            "//tools:smoke_matrix": dict(_test_env(gpu), QUACK_MATRIX = "smoke"),
            "//conditions:default": _test_env(gpu),
        }),
        exec_properties = gpu_exec_properties if gpu else {},
        size = size,
        timeout = timeout,
        tags = tags + (["gpu"] if gpu else []),
        flaky = flaky,
        python_version = "PY3",
        srcs_version = "PY3",
    )
