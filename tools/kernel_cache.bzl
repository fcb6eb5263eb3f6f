"""Kernel object caches as Bazel outputs.

`kernel_cache` runs `tools/warm_cache.py` in compile-only mode (no GPU) for one kernel family, in
one action (running the family's tests: what the full matrix, which has no kernel list, needs)
whose output is one directory:

    <out>/<family>/<hash>.o, <hash>.json    the exported objects and their sidecars
    <out>/manifest.json                      sorted, deterministic

The action's inputs are exactly: the family's module and the modules shared by every family
(never another family's module, so editing one family reruns that family's action only), the
family's tests, the manifests of calls to warm, the warm_cache script, the lock and the
pinned interpreter (a shim naming the lock's digest and the Python version, and no path; it
finds the environment through a link, the one input outside the action's tree). Its outputs are
byte-identical across clean builds, output bases and checkout folders, so any Bazel cache shares
them.

`kernel_cache_set` is the union of several `kernel_cache` or `unit_cache` targets: its files are
their directories plus `<name>.dirs`, one runfiles path per line (what QUACK_CACHE_PATH lists).

`kernel_caches` creates one `kernel_cache` per family and their union; tools/kernel_units.bzl
builds the same directories from the committed kernel lists, one action per object.
"""

load("@rules_python//python:defs.bzl", "PyRuntimeInfo")
load("//tools:kernel_families.bzl", "KERNEL_FAMILIES")

KernelCacheInfo = provider(
    doc = "Directories of exported kernel objects, one per kernel family.",
    fields = {"dirs": "depset of directory Files"},
)

# Kernel and bundle actions always run in the pinned environment (@quack_python), whatever Python
# toolchain a configuration registers: their keys are then the default build's in every
# configuration, so GPU runners (--config=gpu) hit what CI built (tools/check_gpu_config_keys.sh).
PINNED_PYTHON = "@quack_python//:py3_runtime"

# The kernel actions' tool: a py_binary built for the exec configuration, whose Python toolchain is
# the one this module registers (the pinned environment; warm_cache.py refuses any other, as
# QUACK_REQUIRE_PINNED_ENV asks). Its runfiles are the script and that runtime only: the package's
# sources are each action's declared inputs, so an edit reruns only the actions that read it.
WARM_CACHE = "//tools:warm_cache"

# The environment every kernel object is compiled in. The DSL's own file cache would be an input
# outside the declared ones; bytecode would be written into the sources of an unsandboxed action.
COMPILE_ENV = {
    "CUTE_DSL_DISABLE_FILE_CACHING": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONPATH": ".",  # the execroot (a worker's request: its sandbox): `import quack`
    "QUACK_REQUIRE_PINNED_ENV": "1",
}

# The environment of `python -m quack.cache` actions (bundle, merge): the standard library only.
CACHE_CLI_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONPATH": ".",  # the execroot: quack/cache/
    "QUACK_REQUIRE_PINNED_ENV": "1",
}

def cache_dir_providers(ctx, out):
    """The providers of a rule whose output is one kernel cache directory `out`.

    Args:
      ctx: the rule's context.
      out: the directory File.

    Returns:
      DefaultInfo (the directory, also as runfiles) and KernelCacheInfo.
    """
    return [
        DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out])),
        KernelCacheInfo(dirs = depset([out])),
    ]

def _kernel_cache_impl(ctx):
    out = ctx.actions.declare_directory(ctx.attr.name)

    args = ctx.actions.args()
    args.add(out.path, format = "--out=%s")
    args.add(ctx.attr.family, format = "--family=%s")
    args.add_all(ctx.files.tests, format_each = "--tests=%s")
    args.add_all(ctx.files.manifests, format_each = "--configs=%s")

    ctx.actions.run(
        executable = ctx.executable._warm_cache,
        arguments = [args],
        inputs = ctx.files.srcs + ctx.files.tests + ctx.files.data + ctx.files.manifests + [ctx.file.lock],
        outputs = [out],
        env = COMPILE_ENV | {
            "QUACK_ARCH": ctx.attr.arch,
            "QUACK_MATRIX": ctx.attr.matrix,  # which cases of the tests' correctness matrices run
        },
        mnemonic = "QuackWarmCache",
        progress_message = "Compiling %s kernels for %s into %%{output}" % (ctx.attr.family, ctx.attr.arch),
    )
    return cache_dir_providers(ctx, out)

kernel_cache = rule(
    implementation = _kernel_cache_impl,
    doc = "One kernel family's objects, compiled without a GPU by tools/warm_cache.py.",
    attrs = {
        "arch": attr.string(default = "sm_90a", doc = "GPU arch the objects are compiled for."),
        "data": attr.label_list(allow_files = True, doc = "Other inputs the run reads (pytest configuration)."),
        "family": attr.string(mandatory = True, doc = "Kernel family (module quack/<family>.py)."),
        "lock": attr.label(mandatory = True, allow_single_file = True, doc = "The Python lock file."),
        "manifests": attr.label_list(
            allow_files = [".jsonl"],
            doc = "Manifests of calls to warm beside the tests (quack/calls/manifest.py), e.g. recorded with QUACK_CACHE_RECORD.",
        ),
        "matrix": attr.string(
            default = "ci",
            values = ["ci", "full", "smoke"],
            doc = "Cases of the tests' correctness matrices (quack/testing/matrix.py): the CI covering array, the full product, or the array's first case.",
        ),
        "srcs": attr.label_list(mandatory = True, allow_files = [".py"], doc = "The family's module plus the shared modules."),
        "tests": attr.label_list(allow_files = [".py"], doc = "Test files that warm the family."),
        "_warm_cache": attr.label(default = WARM_CACHE, executable = True, cfg = "exec"),
    },
)

def _kernel_cache_set_impl(ctx):
    dirs = depset(transitive = [dep[KernelCacheInfo].dirs for dep in ctx.attr.caches])
    listing = ctx.actions.declare_file(ctx.attr.name + ".dirs")
    ctx.actions.write(listing, "".join([d.short_path + "\n" for d in dirs.to_list()]))
    files = depset([listing], transitive = [dirs])
    return [
        DefaultInfo(files = files, runfiles = ctx.runfiles(transitive_files = files)),
        KernelCacheInfo(dirs = dirs),
    ]

kernel_cache_set = rule(
    implementation = _kernel_cache_set_impl,
    doc = "The union of kernel caches, plus a <name>.dirs listing of their runfiles paths.",
    attrs = {
        "caches": attr.label_list(mandatory = True, providers = [KernelCacheInfo]),
    },
)

def kernel_caches(*, name, families = KERNEL_FAMILIES, shared_srcs, family_srcs, tests, manifests, lock, data = [], arch = "sm_90a", matrix = "ci"):
    """One `kernel_cache` per family, `<name>_<family>`, and their union `<name>`.

    Args:
      name: name of the union target (a `kernel_cache_set`).
      families: kernel families; default: KERNEL_FAMILIES (tools/kernel_families.bzl).
      shared_srcs: modules every family may import (the package without any family module).
      family_srcs: dict family -> list of its own modules (quack/<family>.py, quack/<family>_*.py).
      tests: dict family -> list of test file labels that warm it.
      manifests: manifests of calls to warm beside the tests (each family warms its ops' entries).
      lock: the Python lock file (a declared input: a lock change recompiles everything).
      data: other files each run reads (pytest configuration).
      arch: GPU arch, default sm_90a.
      matrix: "ci" (the covering array of each test's correctness matrix), "full" (every case) or
        "smoke" (the array's first case, for checks of the build's wiring); may be a select().
    """
    if not families:
        fail("kernel_caches(name = %r): no kernel families" % name)
    for family in families:
        if family not in family_srcs:
            fail("kernel_caches(name = %r): family %r has no entry in family_srcs" % (name, family))
        if not tests.get(family):
            fail("kernel_caches(name = %r): family %r has no tests to warm it" % (name, family))
        kernel_cache(
            name = "%s_%s" % (name, family),
            arch = arch,
            manifests = manifests,
            data = data,
            family = family,
            lock = lock,
            matrix = matrix,
            srcs = shared_srcs + family_srcs[family],
            tests = tests[family],
        )
    kernel_cache_set(
        name = name,
        caches = [":%s_%s" % (name, family) for family in families],
    )

def _kernel_cache_bundle_impl(ctx):
    out = ctx.actions.declare_file(ctx.attr.name + ".tar")
    runtime = ctx.attr._python[PyRuntimeInfo]
    dirs = depset(transitive = [dep[KernelCacheInfo].dirs for dep in ctx.attr.caches])

    args = ctx.actions.args()

    # quack/__init__.py and quack/cache/ need the standard library only.
    args.add_all(["-m", "quack.cache", "bundle"])
    args.add(out, format = "--out=%s")
    args.add_all(dirs, expand_directories = False)

    ctx.actions.run(
        executable = runtime.interpreter,
        arguments = [args],
        inputs = depset(ctx.files.srcs, transitive = [dirs, runtime.files]),
        outputs = [out],
        env = CACHE_CLI_ENV,
        mnemonic = "QuackCacheBundle",
        progress_message = "Bundling kernel caches into %{output}",
    )
    return [DefaultInfo(files = depset([out]))]

kernel_cache_bundle = rule(
    implementation = _kernel_cache_bundle_impl,
    doc = """One deterministic tar of kernel caches: `python -m quack.cache bundle` over their directories.

    Byte-identical for identical caches (sorted members, fixed metadata); install it anywhere with
    `python -m quack.cache install <name>.tar --into DIR`.""",
    attrs = {
        "caches": attr.label_list(mandatory = True, providers = [KernelCacheInfo], doc = "kernel_cache or kernel_cache_set targets."),
        "srcs": attr.label_list(mandatory = True, allow_files = [".py"], doc = "quack/__init__.py and the quack/cache/ and quack/launch/ modules (the bundler)."),
        "_python": attr.label(default = PINNED_PYTHON, providers = [PyRuntimeInfo]),
    },
)
