"""``python -m quack.cache`` / ``quack-cache``: inspect and maintain kernel caches.

    quack-cache ls [--family F]          entries of every layer: family, key fields, size, last use
    quack-cache stats                    entries and bytes per layer and family
    quack-cache verify                   re-hash every entry; remove bad ones from the writable layer
    quack-cache prune --max-size 2G      evict least recently used writable entries down to a size
    quack-cache clear                    remove every writable entry
    quack-cache bundle --out F.tar [DIR...]   one deterministic archive (default: the writable layer)
    quack-cache merge DIR... --into NEW        the union of cache folders, with its manifest.json
    quack-cache install F.tar [--into DIR]    verify and install a bundle (default: the writable layer)
    quack-cache show-config              versions, arch, layers and their trust, launcher, settings
    quack-cache --version

Every command prints tables for people and takes ``--json`` (one JSON document
on stdout) for scripts. Layers come from ``QUACK_CACHE_DIR`` /
``QUACK_CACHE_PATH`` unless ``--cache-dir`` / ``--cache-path`` are given. Exit
status: 0 success, 1 the operation found or hit a problem (bad entries, a
refused bundle), 2 bad arguments, 141 (128 + SIGPIPE) when the reader of the
output went away (``quack-cache ls | head``), silently. Warming a cache
from a manifest of calls is ``python -m quack.warm`` (quack/warm.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import DISTRIBUTION, __version__
from . import maintenance
from .bundle import install_bundle, write_bundle
from .config import _resolve_layers, _writable_dir, max_cache_size, parse_size
from .errors import CacheError
from .store import Layer, writable_problem

PROG = "quack-cache"


class UsageError(Exception):
    """A bad argument the parser could not see (a missing file): its message alone, exit status 2."""


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("--cache-dir", metavar="DIR", help="writable layer (default: QUACK_CACHE_DIR, else ~/.cache/quack)")
    common.add_argument("--cache-path", metavar="DIRS",
                        help=f"read-only layers, '{os.pathsep}'-separated (default: QUACK_CACHE_PATH)")
    parser = argparse.ArgumentParser(prog=PROG, description="Inspect and maintain quack kernel caches.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    ls = sub.add_parser("ls", parents=[common], help="list entries: family, key fields, size, last use")
    ls.add_argument("--family", action="append", default=[], help="only this family (repeatable)")
    sub.add_parser("stats", parents=[common], help="entries and bytes per layer and family")
    sub.add_parser("verify", parents=[common],
                   help="re-hash every entry against its sidecar; remove bad ones from the writable layer")
    prune = sub.add_parser("prune", parents=[common], help="evict least recently used writable entries")
    prune.add_argument("--max-size", required=True, type=_size_arg, metavar="SIZE",
                       help="bound in bytes, or with a unit K, M, G, T (powers of 1024): 500M, 2G")
    prune.add_argument("--dry-run", action="store_true", help="only say what would be evicted")
    sub.add_parser("clear", parents=[common], help="remove every entry of the writable layer")
    bundle = sub.add_parser("bundle", parents=[common], help="write a deterministic archive of cache directories")
    bundle.add_argument("--out", required=True, metavar="FILE.tar", help="archive to write")
    bundle.add_argument("dirs", nargs="*", metavar="DIR", help="cache directories (default: the writable layer)")
    merge = sub.add_parser("merge", parents=[common], help="write the union of cache folders as one new folder")
    merge.add_argument("dirs", nargs="+", metavar="DIR", help="cache folders (entries verified, equal keys byte-equal)")
    merge.add_argument("--into", required=True, metavar="DIR", help="the new or empty folder to write")
    install = sub.add_parser("install", parents=[common], help="verify and install a bundle")
    install.add_argument("bundle", metavar="FILE.tar")
    install.add_argument("--into", metavar="DIR", help="cache directory (default: the writable layer)")
    sub.add_parser("show-config", parents=[common],
                   help="versions, arch, layers and their trust, launcher, settings in force")
    return parser


def _layers(args: argparse.Namespace) -> tuple[list[Layer], Layer]:
    raw = args.cache_path if args.cache_path is not None else os.environ.get("QUACK_CACHE_PATH", "")
    readonly = [Layer(p, str(p), False) for p in _resolve_layers(raw)]
    writable = Path(args.cache_dir).expanduser() if args.cache_dir else _writable_dir()
    return readonly, Layer(writable, "writable", True)


def _when(epoch: float) -> str:
    if not epoch:
        return ""
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = (),
                 indent: str = "") -> list[str]:
    """Lines of a plain-text table: the header, then the rows, each column as
    wide as its widest cell; the columns numbered in ``right`` (numbers,
    sizes) are right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        (indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                            for i, (c, w) in enumerate(zip(row, widths)))).rstrip()
        for row in cells
    ]


def _print_lines(lines: Sequence[str], out) -> None:
    for line in lines:
        print(line, file=out)


def _layer_info(layer: Layer) -> dict[str, Any]:
    info = {"root": str(layer.root), "writable": layer.writable, "exists": layer.root.is_dir()}
    if layer.writable:
        info["problem"] = writable_problem(layer.root) or None
    return info


def _entry_info(entry: maintenance.Entry) -> dict[str, Any]:
    meta = entry.meta or {}
    key = meta.get("key") if isinstance(meta.get("key"), dict) else {}
    return {
        "layer": str(entry.layer.root),
        "writable": entry.layer.writable,
        "family": entry.family,
        "key": entry.keyhash,
        "function": key.get("function"),
        "args": key.get("args"),
        "arch": key.get("arch"),
        "dsl_version": key.get("dsl_version"),
        "cuda": key.get("cuda"),
        "source": key.get("source"),
        "size": entry.size,
        "last_use": _when(entry.last_use),
        "last_use_epoch": entry.last_use,
    }


def cmd_ls(args, out) -> int:
    readonly, writable = _layers(args)
    families = set(args.family)
    layers = readonly + [writable]
    entries = [e for layer in layers for e in maintenance.scan(layer) if not families or e.family in families]
    if args.json:
        _dump({"layers": [_layer_info(layer) for layer in layers], "entries": [_entry_info(e) for e in entries]}, out)
        return 0
    for n, layer in enumerate(layers):
        mine = [e for e in entries if e.layer is layer]
        kind = "writable" if layer.writable else "read-only"
        note = _layer_note(layer)
        if n:
            print(file=out)
        print(f"{kind} layer {layer.root}: {len(mine)} entries, {format_size(sum(e.size for e in mine))}{note}",
              file=out)
        if not mine:
            continue
        rows = []
        for e in sorted(mine, key=lambda e: (e.family, -e.last_use, e.keyhash)):
            info = _entry_info(e)
            args_text = json.dumps(info["args"], sort_keys=True, separators=(",", ":")) if info["args"] is not None else "?"
            rows.append([e.family, e.keyhash, format_size(e.size), info["last_use"] or "-", info["arch"] or "?",
                         info["function"] or "?", args_text])
        _print_lines(format_table(["FAMILY", "KEY", "SIZE", "LAST USE", "ARCH", "KERNEL", "ARGS"], rows,
                                  right=[2], indent="  "), out)
    return 0


def _layer_note(layer: Layer) -> str:
    if not layer.root.is_dir():
        return " (does not exist)"
    if layer.writable and writable_problem(layer.root):
        return " (UNTRUSTED: the cache bypasses it; " + writable_problem(layer.root) + ")"
    return ""


def cmd_stats(args, out) -> int:
    readonly, writable = _layers(args)
    result = {"max_size": max_cache_size(), "layers": []}
    for layer in readonly + [writable]:
        entries = maintenance.scan(layer)
        families: dict[str, dict[str, int]] = {}
        for e in entries:
            f = families.setdefault(e.family, {"entries": 0, "bytes": 0})
            f["entries"] += 1
            f["bytes"] += e.size
        uses = [e.last_use for e in entries if e.last_use]
        info = _layer_info(layer)
        info.update(entries=len(entries), bytes=sum(e.size for e in entries), families=families,
                    oldest_use=_when(min(uses)) if uses else None, newest_use=_when(max(uses)) if uses else None)
        result["layers"].append(info)
    if args.json:
        _dump(result, out)
        return 0
    rows = []
    for info, layer in zip(result["layers"], readonly + [writable]):
        kind = "writable" if layer.writable else "read-only"
        uses = f"{info['oldest_use']} .. {info['newest_use']}" if info["entries"] else "-"
        rows.append([f"{kind} {info['root']}{_layer_note(layer)}", "(all)", info["entries"],
                     format_size(info["bytes"]), uses])
        for family, f in sorted(info["families"].items()):
            rows.append(["", family, f["entries"], format_size(f["bytes"]), ""])
    _print_lines(format_table(["LAYER", "FAMILY", "ENTRIES", "SIZE", "LAST USE"], rows, right=[2, 3]), out)
    bound = result["max_size"]
    print(f"QUACK_CACHE_MAX_SIZE: {format_size(bound) if bound is not None else 'unset'}", file=out)
    return 0


def cmd_verify(args, out) -> int:
    readonly, writable = _layers(args)
    checked, bad = 0, []
    for layer in readonly + [writable]:
        trusted = not layer.writable or not writable_problem(layer.root)
        for entry in maintenance.scan(layer):
            checked += 1
            problem = maintenance.check(entry)
            if problem:
                removed = layer.writable and trusted and maintenance.remove(entry)
                bad.append({"layer": str(layer.root), "writable": layer.writable, "family": entry.family,
                            "key": entry.keyhash, "problem": problem, "removed": bool(removed)})
    temps = maintenance.remove_stale_temps(writable) if not writable_problem(writable.root) else []
    result = {"checked": checked, "ok": checked - len(bad), "bad": bad, "stale_temps_removed": [str(t) for t in temps]}
    if args.json:
        _dump(result, out)
    else:
        for b in bad:
            action = "removed" if b["removed"] else ("kept: read-only layer" if not b["writable"] else "kept")
            print(f"BAD {b['layer']}/{b['family']}/{b['key']}: {b['problem']} ({action})", file=out)
        for t in temps:
            print(f"removed stale temporary directory {t}", file=out)
        print(f"verified {checked} entries: {checked - len(bad)} ok, {len(bad)} bad", file=out)
    return 1 if bad else 0


def cmd_prune(args, out) -> int:
    _, writable = _layers(args)
    _require_trusted(writable)
    removed, total = maintenance.prune(writable, args.max_size, dry_run=args.dry_run)
    freed = sum(e.size for e in removed)
    if args.json:
        _dump({"layer": str(writable.root), "max_size": args.max_size, "dry_run": args.dry_run,
               "removed": [_entry_info(e) for e in removed], "freed": freed, "bytes_left": total}, out)
    else:
        verb = "would evict" if args.dry_run else "evicted"
        if removed:
            _print_lines(format_table(["FAMILY", "KEY", "SIZE", "LAST USE"],
                                      [[e.family, e.keyhash, format_size(e.size), _when(e.last_use)] for e in removed],
                                      right=[2]), out)
        print(f"{verb} {len(removed)} entries ({format_size(freed)}); {writable.root} now holds "
              f"{format_size(total)} (bound {format_size(args.max_size)})", file=out)
    return 0


def cmd_clear(args, out) -> int:
    _, writable = _layers(args)
    _require_trusted(writable)
    removed = maintenance.clear(writable)
    freed = sum(e.size for e in removed)
    if args.json:
        _dump({"layer": str(writable.root), "removed": len(removed), "freed": freed}, out)
    else:
        print(f"removed {len(removed)} entries ({format_size(freed)}) from {writable.root}", file=out)
    return 0


def cmd_bundle(args, out) -> int:
    dirs = [Path(d) for d in args.dirs] or [_layers(args)[1].root]
    for d in dirs:
        if not d.is_dir():
            raise UsageError(f"not a directory: {d}")
    result = write_bundle(dirs, Path(args.out))
    if args.json:
        _dump(result, out)
    else:
        print(f"wrote {result['out']}: {result['objects']} objects, {format_size(result['bytes'])}, "
              f"sha256 {result['sha256']}", file=out)
    return 0


def cmd_merge(args, out) -> int:
    from .folders import merge

    listed = merge([Path(d) for d in args.dirs], Path(args.into))
    print(f"wrote {args.into}: {len(listed)} entries from {len(args.dirs)} folders", file=out)
    return 0


def cmd_install(args, out) -> int:
    path = Path(args.bundle)
    if not path.is_file():
        raise UsageError(f"not a file: {path}" if path.exists() else f"no such bundle: {path}")
    into = Path(args.into).expanduser() if args.into else _layers(args)[1].root
    result = install_bundle(path, into)
    if args.json:
        _dump(result, out)
    else:
        print(f"installed {result['installed']} of {result['objects']} objects into {result['into']} "
              f"({result['already_present']} already present)", file=out)
    return 0


def show_config(args) -> dict[str, Any]:
    """What this process would use: versions, arch, layers with their trust,
    launcher and object loader, and the settings in force."""
    import torch

    from . import key, native
    from .config import HOST_TARGET, RECORD_ENV, lock_timeout, read_config
    from quack.launch.launcher import launcher_kind

    config = read_config()
    with warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always")
        launcher = launcher_kind()  # says why once where the C launcher cannot run
    try:
        dsl = f"{key.dsl_version()} ({key.cuda_flavour()})"
    except ImportError:
        dsl = None
    readonly, writable = _layers(args)
    layers = []
    for layer in readonly + [writable]:
        info = _layer_info(layer)
        info["trust"] = _trust(layer)
        layers.append(info)
    runtime = native.runtime_library_path()
    return {
        "versions": {
            DISTRIBUTION: __version__,
            "torch": torch.__version__,
            "nvidia-cutlass-dsl": dsl,
            "python": sys.version.split()[0],
        },
        "arch": config.arch,
        "arch_from": "QUACK_ARCH" if os.environ.get("QUACK_ARCH", "").strip() else (
            "the visible GPU" if torch.cuda.is_available() else "the default"),
        "layers": layers,
        "launcher": {
            "kind": launcher,
            "detail": "quack.launch._fastlaunch" if launcher == "C" else "; ".join(str(n.message) for n in notices),
        },
        "object_loader": (f"the CuTe DSL runtime's C loader ({runtime})" if runtime
                          else "the CuTe DSL's load_module (no runtime library found)"),
        "settings": {
            "QUACK_CACHE_STRICT": config.strict,
            "QUACK_CACHE_MAX_SIZE": config.max_size,
            "QUACK_CACHE_LOCK_TIMEOUT": lock_timeout(),
            RECORD_ENV: os.environ.get(RECORD_ENV) or None,
            "host_target": HOST_TARGET,
            "cache_format": key.CACHE_FORMAT_VERSION,
            "dsl_settings": key.dsl_settings(),
        },
    }


def _trust(layer: Layer) -> str:
    if not layer.writable:
        return "trusted: configured read-only layer"
    if not layer.root.exists():
        return "trusted: created private on first export"
    problem = writable_problem(layer.root)
    return f"UNTRUSTED: {problem}" if problem else "trusted: yours, private"


def cmd_show_config(args, out) -> int:
    result = show_config(args)
    if args.json:
        _dump(result, out)
        return 0
    versions = result["versions"]
    launcher, settings = result["launcher"], result["settings"]
    max_size = settings["QUACK_CACHE_MAX_SIZE"]
    rows = [
        [DISTRIBUTION, versions[DISTRIBUTION]],
        ["torch", versions["torch"]],
        ["nvidia-cutlass-dsl", versions["nvidia-cutlass-dsl"] or "not installed"],
        ["python", versions["python"]],
        ["arch", f"{result['arch']} (from {result['arch_from']})"],
        ["launcher", f"{launcher['kind']} ({launcher['detail']})" if launcher["detail"] else launcher["kind"]],
        ["object loader", result["object_loader"]],
        ["strict", "yes" if settings["QUACK_CACHE_STRICT"] else "no"],
        ["max size", format_size(max_size) if max_size is not None else "unset"],
        ["lock timeout", f"{settings['QUACK_CACHE_LOCK_TIMEOUT']:g} s"],
        ["recording to", settings["QUACK_CACHE_RECORD"] or "-"],
        ["host target", settings["host_target"]],
        ["cache format", settings["cache_format"]],
        ["DSL settings", " ".join(f"{k}={v}" for k, v in sorted(settings["dsl_settings"].items())) or "-"],
    ]
    _print_lines(format_table(["SETTING", "VALUE"], rows), out)
    print(file=out)
    layer_rows = [["writable" if info["writable"] else "read-only", info["root"],
                   "yes" if info["exists"] else "no", info["trust"]] for info in result["layers"]]
    _print_lines(format_table(["LAYER", "PATH", "EXISTS", "TRUST"], layer_rows), out)
    return 0


def _require_trusted(layer: Layer) -> None:
    problem = writable_problem(layer.root)
    if problem:
        raise CacheError(problem)


def _dump(value: Any, out) -> None:
    json.dump(value, out, indent=1, sort_keys=True)
    out.write("\n")


COMMANDS = {"ls": cmd_ls, "stats": cmd_stats, "verify": cmd_verify, "prune": cmd_prune,
            "clear": cmd_clear, "bundle": cmd_bundle, "merge": cmd_merge, "install": cmd_install, "show-config": cmd_show_config}


def main(argv: Sequence[str] | None = None, out=None) -> int:
    """Run one command; returns the exit status (argparse errors exit 2 themselves)."""
    out = out if out is not None else sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args, out)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # the reader went away: console_main's to handle, not an error of the command
    except (CacheError, OSError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def console_main(run: Callable[[], int] | None = None) -> None:
    """Entry point of ``python -m quack.cache`` (and, with ``run`` =
    ``quack.cli.main``, of ``quack-cache``).

    When the reader of the output goes away (``quack-cache ls | head``), the
    command stops without a word and exits 141 (128 + SIGPIPE), as a command
    the signal ended would; stdout is pointed at /dev/null first, so the
    interpreter's own flush at exit does not fail again.
    """
    try:
        code = (run or main)()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        code = 128 + signal.SIGPIPE
    sys.exit(code)
