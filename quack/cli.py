"""``quack-cache``: the cache commands of ``quack.cache.cli`` plus the two that need plans.

    quack-cache preflight MANIFEST... [--json]   objects the manifests' calls need that no layer holds
    quack-cache warm MANIFEST... [--out DIR]     compile the manifests' calls into a cache folder
    quack-cache ls | stats | verify | ...        quack.cache.cli, unchanged

The cache package imports neither plans nor ops, so ``preflight``
(quack/preflight.py) and ``warm`` (quack/warm.py) are added here, one layer
up; every other command runs as ``python -m quack.cache`` runs it.
``python -m quack.cli`` is ``quack-cache``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from quack import preflight, warm
from quack.cache import cli as cache_cli


def build_parser() -> argparse.ArgumentParser:
    """``quack.cache.cli``'s parser with ``preflight`` and ``warm`` among its commands."""
    parser = cache_cli.build_parser()
    # argparse keeps the subcommands' action only among its (private) actions.
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    check = commands.add_parser("preflight", help="objects the calls of manifests need that no layer holds (no GPU)",
                                description=preflight.DESCRIPTION)
    preflight.add_arguments(check)
    warming = warm.build_parser()
    commands.add_parser("warm", parents=[warming], add_help=False, description=warming.description,
                        help="compile the calls of manifests into a cache folder (no GPU)")
    return parser


def main(argv: Sequence[str] | None = None, out=None) -> int:
    """Run one command; returns the exit status (argparse errors exit 2 themselves)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "preflight":
        return preflight.run(args, out, prog=f"{cache_cli.PROG} preflight")
    if args.command == "warm":
        return warm.run(args, prog=f"{cache_cli.PROG} warm")
    return cache_cli.main(argv, out)


def console_main() -> None:
    """Entry point of ``quack-cache`` (a reader that goes away ends it silently, status 141)."""
    cache_cli.console_main(main)


if __name__ == "__main__":
    console_main()
