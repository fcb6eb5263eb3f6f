"""Checks that the BUILD and .bzl files load every rule and provider Bazel 9 no longer predeclares.

    python3 tools/bazel_support/check_loads.py FILE...

Bazel 9 leaves --incompatible_autoload_externally empty: the rules and providers that moved out of
Bazel into rule sets (rules_python, rules_cc, rules_java, rules_shell, protobuf, rules_android) are
no longer predeclared names, and `native.<rule>` no longer has them. Bazel 7.7.1 cannot show this
with a flag while Debian's rule sets (rules_python 0.22.1, rules_cc 0.0.11) still call the native
rules themselves, so tools/check_bazel_future_flags.sh runs this check on the project's own files:
each such name a file uses must come from one of its load() statements (or be defined in it).
Exit 0 when every file passes; the last line is the summary.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# The names Bazel 7 predeclares for BUILD and .bzl files and Bazel 9 does not: its list of
# autoloadable symbols, each with the rule set that defines it now.
MOVED_RULES = {
    "py_binary", "py_library", "py_runtime", "py_test",
    "cc_binary", "cc_import", "cc_library", "cc_shared_library", "cc_test", "cc_toolchain",
    "cc_toolchain_suite", "fdo_prefetch_hints", "fdo_profile", "objc_import", "objc_library",
    "java_binary", "java_import", "java_library", "java_plugin", "java_runtime", "java_test",
    "java_toolchain", "java_package_configuration",
    "sh_binary", "sh_library", "sh_test",
    "proto_library", "proto_lang_toolchain", "cc_proto_library", "java_proto_library",
    "java_lite_proto_library", "py_proto_library",
    "aar_import", "android_binary", "android_library", "android_local_test", "android_sdk",
}
MOVED_SYMBOLS = MOVED_RULES | {
    "PyInfo", "PyRuntimeInfo", "PyCcLinkParamsProvider",
    "CcInfo", "CcSharedLibraryInfo", "CcToolchainConfigInfo", "DebugPackageInfo", "cc_common",
    "JavaInfo", "JavaPluginInfo", "java_common",
    "ProtoInfo", "proto_common_do_not_use",
}


def _bound_names(tree: ast.AST) -> set[str]:
    """Names a file binds: loaded, assigned, defined, or parameters."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "load":
            names.update(a.value for a in node.args[1:] if isinstance(a, ast.Constant))
            names.update(k.arg for k in node.keywords if k.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def problems(path: Path) -> list[str]:
    """One line per use of a moved rule or provider that the file does not load."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except OSError as e:
        return ["%s: cannot read: %s" % (path, e.strerror)]
    except SyntaxError as e:
        return ["%s:%s: cannot parse: %s" % (path, e.lineno, e.msg)]
    bound = _bound_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in MOVED_SYMBOLS and node.id not in bound:
                found.append((node.lineno, "%s is used but not loaded" % node.id))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "native" and node.attr in MOVED_RULES:
                found.append((node.lineno, "native.%s is gone in Bazel 9; load the rule" % node.attr))
    return ["%s:%d: %s" % (path, line, text) for line, text in sorted(found)]


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: check_loads.py FILE...", file=sys.stderr)
        return 2
    found = [line for name in argv for line in problems(Path(name))]
    for line in found:
        print(line)
    print("loads: %s (%d BUILD and .bzl files, %d problems: every rule and provider Bazel 9 no longer"
          " predeclares must be loaded)" % ("FAIL" if found else "PASS", len(argv), len(found)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
