"""The ``amdxdna`` command line: a registry of subcommand modules.

Each module named in :data:`SUBCOMMANDS` (a module of this package) exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``.
Exit codes: 0 success, 1 failure (message on stderr), 2 usage error. The two file-format commands
(``xclbin``, ``insts``) share :func:`add_file_parser` and :func:`inspect_file`.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SUBCOMMANDS", "add_file_parser", "build_parser", "inspect_file", "main"]

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


def add_file_parser(subparsers: Any, name: str, what: str, help: str, description: str) -> argparse.ArgumentParser:
    """Register ``amdxdna NAME FILE [--json]`` for a file of kind ``what`` ("xclbin", "TXN stream")."""
    epilog = (f"exit codes:\n  0    the {what} was decoded and printed\n"
              f"  1    the file cannot be read or is not a valid {what} (message on stderr)\n  2    usage error")
    parser = subparsers.add_parser(name, help=help, description=description, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", metavar="FILE", help=f"the {what} file")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    return parser


def inspect_file(name: str, args: argparse.Namespace, load: Callable[[str], Any], error: type[Exception],
                 describe: Callable[[Any], dict], render: Callable[[Any], str]) -> int:
    """Decode ``args.file`` with ``load`` and print ``describe`` as JSON (``--json``) or ``render``'s text.

    Returns 0, or 1 with ``amdxdna NAME: FILE: message`` on stderr when the file cannot be read (with the
    errno name) or ``load`` raises ``error`` (the parser's message names the field or word at fault).
    """
    command = f"amdxdna {name}: {args.file}"
    try:
        decoded = load(args.file)
    except error as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{command}: {exc.strerror or exc} ({errno.errorcode.get(exc.errno, exc.errno)})", file=sys.stderr)
        return 1
    print(json.dumps(describe(decoded), indent=2) if args.json else render(decoded))
    return 0
