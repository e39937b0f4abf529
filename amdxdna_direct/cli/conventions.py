"""The conventions every command line of the project shares, ``amdxdna`` and ``sam3`` alike (docs/cli.md
"Conventions"): exit codes, one-line messages, the ``--json`` document and error object, ``--version``.

Pure functions and constants; nothing here imports the runtime, so a command line pays nothing for them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["SCHEMA", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INTERRUPTED", "DISTRIBUTION", "one_line",
           "json_document", "dump_json", "error_document", "report_failure", "distribution_version",
           "version_line", "add_version_option"]

SCHEMA = 1  # the version of every --json document's layout
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program Ctrl-C ended
DISTRIBUTION = "amdxdna-direct"


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters escaped: a message stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def json_document(command: str | None, document: dict[str, Any]) -> dict[str, Any]:
    """A ``--json`` document: ``{"schema": SCHEMA, "command": command, **document}``."""
    return {"schema": SCHEMA, "command": command, **document}


def dump_json(command: str | None, document: dict[str, Any], **kwargs: Any) -> str:
    """:func:`json_document` as JSON text (ASCII only; ``kwargs`` go to ``json.dumps``)."""
    import json  # only for --json: not on the start-up path

    return json.dumps(json_document(command, document), **kwargs)


def error_document(command: str | None, message: str, **fields: Any) -> dict[str, Any]:
    """The JSON error object of a failed command: ``{"schema", "command", "ok": false, "error", **fields}``."""
    return json_document(command, {"ok": False, "error": message, **fields})


def report_failure(prog: str, command: str | None, message: str, as_json: bool = False,
                   code: int = EXIT_FAILURE, **fields: Any) -> int:
    """One line ``PROG COMMAND: message`` on stderr and, with ``as_json``, the JSON error object on stdout.

    Returns ``code`` (1, or 2 for a usage error).
    """
    if as_json:
        import json

        print(json.dumps(error_document(command, message, **fields), indent=2))
    who = f"{prog} {command}" if command else prog
    print(f"{who}: {one_line(message)}", file=sys.stderr)
    return code


def distribution_version(module: str | None = None, distribution: str = DISTRIBUTION) -> str:
    """``module``'s ``__version__`` when it is imported and has one, else the installed distribution's version,
    else a sentence saying it is not installed."""
    own = getattr(sys.modules.get(module or ""), "__version__", None)
    if isinstance(own, str):
        return own
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def version_line(prog: str, module: str | None = None, distribution: str = DISTRIBUTION) -> str:
    """What ``PROG --version`` prints: ``amdxdna (amdxdna-direct) 0.1.0``."""
    return f"{prog} ({distribution}) {distribution_version(module, distribution)}"


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit 0; the metadata is only read when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, *, prog: str = "",
                 module: str | None = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.prog_name, self.module = prog, module

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any) -> None:
        print(version_line(self.prog_name or parser.prog, self.module))
        parser.exit(0)


def add_version_option(parser: argparse.ArgumentParser, prog: str | None = None, module: str | None = None) -> None:
    """Add ``--version`` to ``parser``: prints ``PROG (amdxdna-direct) VERSION`` (``module``'s ``__version__``
    first, see :func:`distribution_version`) and exits 0."""
    parser.add_argument("--version", action=_VersionAction, prog=prog or parser.prog, module=module,
                        help="print the version and exit")
