"""The ``amdxdna`` command line: a registry of subcommand modules.

Each module named in :data:`SUBCOMMANDS` (a module of this package) exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``.
Exit codes: 0 success, 1 failure (message on stderr), 2 usage error. The two file-format commands
(``xclbin``, ``insts``) share :func:`add_file_parser` and :func:`inspect_file`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import errno_text

__all__ = ["SUBCOMMANDS", "DEVICE_ENV", "add_device_option", "add_file_parser", "build_parser", "command_parser",
           "device_spec", "inspect_file", "main"]

SUBCOMMANDS = ("xclbin_cmd", "insts_cmd", "info_cmd", "top_cmd", "doctor_cmd", "validate_cmd", "configure_cmd",
               "run_cmd", "trace_cmd")

EXIT_USAGE = 2
DEVICE_ENV = "AMDXDNA_DEVICE"


class _CommandListFormatter(argparse.HelpFormatter):
    """argparse measures subcommand names at their parent's indent, two columns less than they are printed
    at, so the longest names wrap below their summary; this measures them where they are printed."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.help is not argparse.SUPPRESS:
            names = [self._format_action_invocation(sub) for sub in getattr(action, "_get_subactions", list)()]
            if names:
                longest = max(map(len, names)) + self._current_indent + self._indent_increment
                self._action_max_length = max(self._action_max_length, longest)


def build_parser() -> argparse.ArgumentParser:
    """The ``amdxdna`` parser with every registered subcommand; each sets ``run`` as its handler."""
    parser = argparse.ArgumentParser(prog="amdxdna", description="Drive AMD XDNA NPUs through the amdxdna "
                                     "driver without XRT; inspect xclbins and instruction streams.",
                                     formatter_class=_CommandListFormatter)
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
        print(f"{command}: {errno_text(exc.errno) if exc.errno else exc}", file=sys.stderr)
        return 1
    print(json.dumps(describe(decoded), indent=2) if args.json else render(decoded))
    return 0


def command_parser(subparsers, name: str, summary: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand parser: one-line ``summary`` for ``amdxdna --help``, ``description`` wrapped, ``epilog`` as is.

    Shared by the device commands (info, top, doctor, validate, configure, run, trace) so their help reads the
    same.
    """
    return subparsers.add_parser(name, help=summary, description=textwrap.fill(description, 100), epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def device_spec(text: str) -> str:
    """Check a ``--device`` value (an argparse ``type``): what :func:`open_device` takes as a string.

    A node path is only checked when opened (the open names the errno); an emulator spec is checked
    here, so that a mistyped profile is a usage error (exit 2) rather than a failed device.

    Raises:
        argparse.ArgumentTypeError: an empty value, or ``emu:<profile>`` with an unknown profile.
    """
    from ..emu import PROFILES

    if not text:
        raise argparse.ArgumentTypeError("empty device: expected /dev/accel/accelN, emu or emu:<profile>")
    kind, _, profile = text.partition(":")
    if kind == "emu" and profile and profile not in PROFILES:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown emulator profile {profile!r} "
                                         f"(profiles: {', '.join(sorted(PROFILES))})")
    return text


def add_device_option(parser: argparse.ArgumentParser, what: str, default: str, from_env: bool = True) -> None:
    """``--device DEV`` (checked by :func:`device_spec`); ``from_env`` takes ``$AMDXDNA_DEVICE`` as default.

    argparse runs ``type`` on a string default too, so a bad ``$AMDXDNA_DEVICE`` is a usage error as well.
    """
    parser.add_argument("--device", metavar="DEV", type=device_spec,
                        default=(os.environ.get(DEVICE_ENV) or None) if from_env else None,
                        help=f"{what}: /dev/accel/accelN, emu, emu:npu1, emu:npu4, ... (default: {default})")
