"""Kernel caches built one object per action, from the committed kernel lists.

`kernel_units` runs one `QuackKernel` action per unit (one object) of the
committed kernel lists (tools/kernels/units.bzl and units_full.bzl), whose inputs are the family's
sources, the unit and the toolchain only (never the tests, the manifests or the lists), run by the
//tools:warm_cache tool as a persistent worker where Bazel can (the DSL imported once per worker)
and standalone elsewhere. `unit_cache` merges a selection of a family's units into one kernel
cache directory (`python -m quack.cache merge`, with the `manifest.json` a warm run writes).

quack/BUILD.bazel creates them through `kernel_unit_sets` (the actions of every list) and
`unit_caches` (one selection's caches: ci or smoke, full).
"""

load("@rules_python//python:defs.bzl", "PyRuntimeInfo")
load("//tools:kernel_cache.bzl", "CACHE_CLI_ENV", "COMPILE_ENV", "PINNED_PYTHON", "WARM_CACHE", "cache_dir_providers", "kernel_cache_set")
load("//tools:kernel_families.bzl", "KERNEL_FAMILIES")

# The command that refreshes the committed kernel lists (tools/kernel_lists.py; --full for the
# full matrix's).
REFRESH = "tools/bazel run //tools:kernel_lists -- --update [--full]"

KernelUnitsInfo = provider(
    doc = "One kernel family's unit objects: one directory per unit of the committed kernel list.",
    fields = {"trees": "dict: unit id -> directory File (<family>/<key>.o, .json)"},
)

def _kernel_units_impl(ctx):
    inputs = depset(ctx.files.srcs + [ctx.file.lock])
    trees = {}
    for unit_id, unit in sorted(ctx.attr.units.items()):
        tree = ctx.actions.declare_directory("%s/%s" % (ctx.attr.name, unit_id))
        request = ctx.actions.args()
        request.add(tree.path, format = "--out=%s")
        request.add(ctx.attr.arch, format = "--arch=%s")
        request.add(unit, format = "--unit=%s")
        request.use_param_file("@%s", use_always = True)
        request.set_param_file_format("multiline")

        # Everything outside the params file would start the worker (be its key): nothing does.
        ctx.actions.run(
            executable = ctx.executable._warm_cache,
            arguments = [request],
            inputs = inputs,
            outputs = [tree],
            env = COMPILE_ENV,
            execution_requirements = {
                "requires-worker-protocol": "json",
                "supports-workers": "1",
            },
            mnemonic = "QuackKernel",
            progress_message = "Compiling %s kernel %s for %s" % (ctx.attr.family, unit_id, ctx.attr.arch),
        )
        trees[unit_id] = tree
    return [
        # Built on request only (bazel build //quack:units_gemm): the caches are unit_cache targets.
        DefaultInfo(files = depset(trees.values())),
        KernelUnitsInfo(trees = trees),
    ]

kernel_units = rule(
    implementation = _kernel_units_impl,
    doc = "One kernel family's objects, one QuackKernel action per unit of its kernel list.",
    attrs = {
        "arch": attr.string(default = "sm_90a", doc = "GPU arch the objects are compiled for."),
        "family": attr.string(mandatory = True, doc = "Kernel family (quack/families/<family>/)."),
        "lock": attr.label(mandatory = True, allow_single_file = True, doc = "The Python lock file."),
        "srcs": attr.label_list(mandatory = True, allow_files = [".py"], doc = "The family's package plus the shared modules."),
        "units": attr.string_dict(doc = "Unit id -> unit JSON (UNITS[family] of tools/kernels/units.bzl and units_full.bzl)."),
        "_warm_cache": attr.label(default = WARM_CACHE, executable = True, cfg = "exec"),
    },
)

def _unit_cache_impl(ctx):
    if ctx.attr.unlisted:
        fail("%s: family %r has no kernel list: run %s" % (ctx.label, ctx.attr.unlisted, REFRESH))
    trees = ctx.attr.units[KernelUnitsInfo].trees
    unknown = [unit_id for unit_id in ctx.attr.ids if unit_id not in trees]
    if unknown:
        fail("%s: units %s are not in %s" % (ctx.label, unknown, ctx.attr.units.label))
    out = ctx.actions.declare_directory(ctx.attr.name)
    runtime = ctx.attr._python[PyRuntimeInfo]
    selected = [trees[unit_id] for unit_id in sorted(ctx.attr.ids)]

    args = ctx.actions.args()
    args.add_all(["-m", "quack.cache", "merge"])
    args.add_all(selected, expand_directories = False)
    args.add(out.path, format = "--into=%s")

    ctx.actions.run(
        executable = runtime.interpreter,
        arguments = [args],
        inputs = depset(ctx.files.srcs + selected, transitive = [runtime.files]),
        outputs = [out],
        env = CACHE_CLI_ENV,
        mnemonic = "QuackCacheMerge",
        progress_message = "Merging %d kernel units into %%{output}" % len(selected),
    )
    return cache_dir_providers(ctx, out)

unit_cache = rule(
    implementation = _unit_cache_impl,
    doc = "A selection of one family's units merged into one kernel cache directory.",
    attrs = {
        "ids": attr.string_list(mandatory = True, doc = "The selected unit ids (SELECTIONS[family][selection]); may be a select()."),
        "srcs": attr.label_list(mandatory = True, allow_files = [".py"], doc = "quack/__init__.py and the quack/cache/ and quack/launch/ modules (the merger)."),
        "units": attr.label(mandatory = True, providers = [KernelUnitsInfo], doc = "The family's kernel_units target."),
        "unlisted": attr.string(doc = "A family the lists lack: building this target fails, naming the refresh command."),
        "_python": attr.label(default = PINNED_PYTHON, providers = [PyRuntimeInfo]),
    },
)

def kernel_unit_sets(*, name, units, shared_srcs, family_srcs, lock, families = KERNEL_FAMILIES, arch = "sm_90a"):
    """`<name>_<family>`: one kernel_units target per family, every unit of every list.

    Args:
      name: prefix of the targets; `unit_caches` finds them as `units_<family>`.
      units: dict family -> unit id -> unit JSON (UNITS of tools/kernels/units.bzl, and of
        units_full.bzl: a unit in both is one action).
      shared_srcs: modules every family may import (the package without any family package).
      family_srcs: dict family -> list of its own modules.
      lock: the Python lock file (a declared input: a lock change recompiles everything).
      families: kernel families; default: KERNEL_FAMILIES (tools/kernel_families.bzl).
      arch: GPU arch, default sm_90a.
    """
    for family in families:
        kernel_units(
            name = "%s_%s" % (name, family),
            arch = arch,
            family = family,
            lock = lock,
            srcs = shared_srcs + family_srcs[family],
            units = units.get(family, {}),
        )

def unit_caches(*, name, selections, selection, cache_cli, families = KERNEL_FAMILIES):
    """A kernel cache per family merged from a selection of its units, and their union `<name>`.

    Per family `<name>_<family>`, a selection of `:units_<family>` (kernel_unit_sets) merged;
    `<name>` is the kernel_cache_set of those.

    Args:
      name: name of the union target (a `kernel_cache_set`).
      selections: dict family -> selection -> unit ids (SELECTIONS of tools/kernels/units.bzl or
        units_full.bzl).
      selection: which selection each family's cache holds ("ci", "smoke" or "full"); may be a dict
        of config_setting label -> selection, made into a select().
      cache_cli: quack/__init__.py and the quack/cache/ and quack/launch/ modules (the merger).
      families: kernel families; default: KERNEL_FAMILIES (tools/kernel_families.bzl).
    """
    for family in families:
        # A family the lists lack fails when its cache is built, not when the package loads: the
        # package must load for `tools/bazel run //tools:kernel_lists -- --update` to run.
        listed = selections.get(family, {})
        if type(selection) == "dict":
            ids = select({setting: listed.get(chosen, []) for setting, chosen in selection.items()})
        else:
            ids = listed.get(selection, [])
        unit_cache(
            name = "%s_%s" % (name, family),
            ids = ids,
            srcs = cache_cli,
            units = ":units_%s" % family,
            unlisted = "" if family in selections else family,
        )
    kernel_cache_set(
        name = name,
        caches = [":%s_%s" % (name, family) for family in families],
    )
