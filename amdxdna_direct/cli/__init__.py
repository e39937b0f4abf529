"""The ``amdxdna`` command line: a registry of subcommand modules.

Each module named in :data:`SUBCOMMANDS` (a module of this package) exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``.
Exit codes: 0 success, 1 failure (message on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS = ("xclbin_cmd", "insts_cmd", "info_cmd", "doctor_cmd", "run_cmd", "trace_cmd")

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The ``amdxdna`` parser with every registered subcommand; each sets ``run`` as its handler."""
    parser = argparse.ArgumentParser(prog="amdxdna", description="Drive AMD XDNA NPUs through the amdxdna "
                                     "driver without XRT; inspect xclbins and instruction streams.")
    subparsers = parser.add_subparsers(metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.add_parser(subparsers).set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amdxdna`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:          # argparse exits 2 on a usage error and 0 after --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_usage(sys.stderr)
        print("amdxdna: error: a COMMAND is required", file=sys.stderr)
        return EXIT_USAGE
    return handler(args)
