"""Kernel object caches as Bazel outputs: what the kernel actions (tools/kernel_units.bzl) share.

A kernel cache is one directory:

    <out>/<family>/<hash>.o, <hash>.json    the exported objects and their sidecars
    <out>/manifest.json                      sorted, deterministic

built without a GPU by the //tools:warm_cache tool (WARM_CACHE) in the pinned environment
(COMPILE_ENV), byte-identical across clean builds, output bases and checkout folders, so any
Bazel cache shares it.

`kernel_cache_set` is the union of several `unit_cache` targets: its files are their directories
plus `<name>.dirs`, one runfiles path per line (what QUACK_CACHE_PATH lists).
`kernel_cache_bundle` packs such directories into one deterministic tar.
"""

load("@rules_python//python:defs.bzl", "PyRuntimeInfo")

KernelCacheInfo = provider(
    doc = "Directories of exported kernel objects, one per kernel family.",
    fields = {"dirs": "depset of directory Files"},
)

# The merge and bundle actions run the pinned environment's interpreter (@quack_python) directly,
# whatever Python toolchain a configuration registers.
PINNED_PYTHON = "@quack_python//:py3_runtime"

# The kernel actions' tool: a py_binary built for the exec configuration, whose Python toolchain is
# the one this module registers, the pinned environment (--config=gpu registers no other, so GPU
# runners hit what CI built: tools/check_gpu_config_keys.sh). A build that registers another Python
# toolchain ahead of it, or another exec platform, compiles with that and gets other keys. The
# tool's runfiles are the script and that runtime only: the package's sources are each action's
# declared inputs, so an edit reruns only the actions that read it.
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
        "caches": attr.label_list(mandatory = True, providers = [KernelCacheInfo], doc = "kernel_cache_set targets."),
        "srcs": attr.label_list(mandatory = True, allow_files = [".py"], doc = "quack/__init__.py and the quack/cache/ and quack/launch/ modules (the bundler)."),
        "_python": attr.label(default = PINNED_PYTHON, providers = [PyRuntimeInfo]),
    },
)
