"""The ``amdxdna`` command line: a registry of subcommand modules, imported only when chosen.

Each module named in :data:`COMMANDS` (a module of this package) exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``. ``amdxdna --help`` lists
the commands from the registry's summaries without importing any of them; ``amdxdna NAME ...`` imports
NAME's module only (docs/cli.md "Conventions").

The conventions every command shares (docs/cli.md "Conventions"): exit 0 success, 1 failure (one line
on stderr), 2 usage error (one line on stderr), 130 Ctrl-C (one line, ``amdxdna NAME: interrupted``); a
closed stdout ends the command quietly; a stdout that cannot encode a character gets it escaped;
``--json`` documents carry ``"schema": SCHEMA`` and ``"command"``, and a failure with ``--json`` prints a
JSON error object (:func:`fail`) besides the stderr line. The two file-format commands (``xclbin``,
``insts``) share :func:`add_file_parser` and :func:`inspect_file`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Callable, Collection, Sequence
from typing import Any, NoReturn, TextIO, TypeAlias

from .. import files
from ..errors import Error

__all__ = ["COMMANDS", "SUBCOMMANDS", "DEVICE_ENV", "SCHEMA", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INTERRUPTED",
           "StdoutClosed", "StdoutError", "Subparsers", "add_device_option", "add_file_parser", "build_parser",
           "command_parser", "device_spec", "dump_json", "fail", "guarded", "inspect_file", "main", "shown",
           "one_line", "version"]

# name -> (module of this package, the one-line summary `amdxdna --help` shows). The summary lives here so
# that the top-level help needs no subcommand module.
COMMANDS: dict[str, tuple[str, str]] = {
    "xclbin": ("xclbin_cmd", "summarise an xclbin (header, sections, kernels, AIE partition)"),
    "insts": ("insts_cmd", "disassemble an instruction stream (insts.bin or insts.txt)"),
    "info": ("info_cmd", "show the device, driver, firmware, AIE array, clocks and live contexts"),
    "top": ("top_cmd", "show the device's hardware contexts live, with submission and completion rates"),
    "doctor": ("doctor_cmd", "check the NPU setup and print the fix for each problem"),
    "validate": ("validate_cmd", "run designs on the device: latency, throughput and an output check"),
    "configure": ("configure_cmd", "set the NPU power mode (root only)"),
    "run": ("run_cmd", "run one kernel with numpy inputs and outputs, timing each run"),
    "trace": ("trace_cmd", "run a program with every ioctl traced, then summarise"),
}
SUBCOMMANDS = tuple(module for module, _summary in COMMANDS.values())
# What each module's ``add_parser`` is given: the ``add_subparsers()`` object of the ``amdxdna`` parser. A string,
# since argparse's class is only generic in its type stubs.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

SCHEMA = 1  # the version of every --json document's layout (docs/cli.md "Conventions")
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program Ctrl-C ended
DEVICE_ENV = "AMDXDNA_DEVICE"
# Longest --device value accepted: PATH_MAX counts the terminating NUL, so no openable path is longer.
MAX_DEVICE = 4095
_SHOWN_LIMIT = 200  # characters of a user-given name kept in a message


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise :class:`_UsageError` (reported in one line by ``main``, exit 2)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self.prog, message)


class _UsageError(Exception):
    """The command line is wrong: ``prog`` (``amdxdna run``) and argparse's message."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


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


def version() -> str:
    """The package's version (``amdxdna --version``): ``amdxdna_direct.__version__``, else the installed
    distribution's, else a sentence saying it is not installed."""
    from importlib import metadata

    own = getattr(sys.modules[__name__.rpartition(".")[0]], "__version__", None)
    if isinstance(own, str):
        return own
    try:
        return metadata.version("amdxdna-direct")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``: print and exit 0; the metadata is only read when asked (start-up cost)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any) -> None:
        print(f"amdxdna (amdxdna-direct) {version()}")
        parser.exit(0)


def build_parser(command: str | None = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The ``amdxdna`` parser; each subcommand parser sets ``handler`` to its module's ``run``.

    By default every subcommand module is imported and registered in full. With ``lazy``, only
    ``command``'s module is (none when it is None or unknown); the others are registered by name and
    summary alone, which is all ``amdxdna --help`` shows.
    """
    parser = _Parser(prog="amdxdna", description="Drive AMD XDNA NPUs through the amdxdna driver without XRT; "
                     "inspect xclbins and instruction streams.", formatter_class=_CommandListFormatter,
                     epilog="`amdxdna COMMAND --help` describes a command; docs/cli.md all of them. "
                            "Exit codes: 0 success, 1 failure, 2 usage error, 130 interrupted.")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    subparsers = parser.add_subparsers(metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        if lazy and name != command:
            subparsers.add_parser(name, help=summary, add_help=False)
            continue
        module = importlib.import_module(f"{__name__}.{module_name}")
        module.add_parser(subparsers).set_defaults(handler=module.run)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (None without one)."""
    for word in argv:  # a loop, not a generator: a Ctrl-C while a generator is finalised would be ignored
        if not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amdxdna`` with ``argv`` (default ``sys.argv[1:]``); return the exit code (docs/cli.md "Conventions").

    Ctrl-C anywhere returns 130 with one line; a closed stdout ends quietly (the command's own code when it
    had finished, else 0); an stdout that cannot be written (ENOSPC) is one line and 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded("amdxdna", lambda: _dispatch(argv, _command_of(argv)), argv, COMMANDS)


def guarded(prog: str, body: Callable[[], int], argv: Sequence[str] = (), commands: Collection[str] = ()) -> int:
    """Run a command line's ``body`` under the conventions every command shares (docs/cli.md "Conventions").

    Characters stdout cannot encode are escaped. Ctrl-C returns 130 after one line ``PROG COMMAND:
    interrupted`` (COMMAND: the first word of ``argv`` that is not an option, when it is one of
    ``commands``); a closed stdout returns quietly (``body``'s code if it had finished, else 0); a stdout
    that cannot be written returns 1 after one line. In each case stdout's descriptor is pointed at
    /dev/null so the interpreter's last flush cannot fail. Shared by ``amdxdna`` and ``sam3``.
    """
    who, code, real = prog, None, sys.stdout
    try:  # everything inside: a Ctrl-C at the first instruction is still one line
        command = _command_of(argv)
        who = f"{prog} {command}" if command in commands else prog
        if sys.stdout is None:  # started with descriptor 1 closed: the output has nowhere to go
            sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115  (lives as long as the process)
        _tolerant_stdout()
        real = sys.stdout
        sys.stdout = _GuardedStdout(real)
        code = int(body())
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        _quiet_stdout(real)
        _say(f"{who}: interrupted")
        return EXIT_INTERRUPTED
    except (BrokenPipeError, StdoutClosed):  # the reader went away (`amdxdna info | head -1`): nothing to say
        _quiet_stdout(real)
        return 0 if code is None else code
    except StdoutError as exc:
        _quiet_stdout(real)
        _say(f"{who}: cannot write standard output: {_errno_text(exc)}")
        return EXIT_FAILURE
    finally:
        sys.stdout = real


class StdoutError(Exception):
    """Standard output could not be written (``errno``: ENOSPC on /dev/full, EIO, EPIPE). Not an OSError, so
    that no command's handler of its own file errors takes it for one: it reaches :func:`guarded`."""

    def __init__(self, err: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = err


class StdoutClosed(StdoutError):
    """Standard output's reader went away (EPIPE): the command line ends quietly."""


class _GuardedStdout:
    """``sys.stdout`` while a command runs: its write errors become :class:`StdoutError` (:class:`StdoutClosed`
    for a closed pipe); everything else is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _stdout_error(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise _stdout_error(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _dispatch(argv: list[str], command: str | None) -> int:
    parser = build_parser(command, lazy=True)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:          # argparse exits 0 after --help and --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except _UsageError as exc:  # the top-level parser reports a command's unknown options: name the command
        prog = f"amdxdna {command}" if exc.prog == "amdxdna" and command in COMMANDS else exc.prog
        return _usage(prog, str(exc), "--json" in argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        return _usage("amdxdna", "a COMMAND is required", "--json" in argv)
    return int(handler(args))


def _usage(prog: str, message: str, as_json: bool) -> int:
    """A usage error: one line naming the help to read; with ``--json`` also the JSON error object."""
    if as_json:
        print(dump_json(prog.partition(" ")[2] or None, {"ok": False, "error": message}, indent=2))
    print(f"{prog}: error: {one_line(message)} (see `{prog} --help`)", file=sys.stderr)
    return EXIT_USAGE


def _tolerant_stdout() -> None:
    """Escape what stdout's encoding cannot hold (an ASCII locale, a kernel named in UTF-8) instead of failing."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="backslashreplace")
        except (ValueError, OSError):  # a closed or detached stream: its first write says so
            pass


def _quiet_stdout(stream: Any) -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's flush at exit has nowhere to fail (the
    advice of Python's signal documentation for SIGPIPE)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing is flushed at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _say(line: str) -> None:
    """One line on stderr, if stderr can take it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _stdout_error(exc: OSError) -> StdoutError:
    kind = StdoutClosed if isinstance(exc, BrokenPipeError) else StdoutError
    return kind(exc.errno, exc.strerror or str(exc))


def _errno_text(exc: OSError | StdoutError) -> str:
    from ..errors import errno_text

    return errno_text(exc.errno) if exc.errno else str(exc)


# --------------------------------------------------------------------------------------------- messages


def shown(value: Any) -> str:
    """A user-given path or name as a message shows it: ``amdxdna_direct.files.shown`` (quoted and escaped
    when it holds a newline, a terminal escape or another control character; docs/files.md 4), and
    shortened to its two ends when it is longer than a line, saying how long it was."""
    text = os.fsdecode(value) if isinstance(value, (bytes, os.PathLike)) else str(value)
    if len(text) <= _SHOWN_LIMIT:
        return files.shown(text)
    head, tail = files.shown(text[:_SHOWN_LIMIT // 2]), files.shown(text[-_SHOWN_LIMIT // 4:])
    return f"{head}...{tail} ({len(text)} characters)"


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters escaped: a message stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def dump_json(command: str | None, document: dict[str, Any], **kwargs: Any) -> str:
    """A ``--json`` document: ``{"schema": SCHEMA, "command": command, ...document}`` (ASCII-only text)."""
    import json  # only for --json: not on the start-up path

    return json.dumps({"schema": SCHEMA, "command": command, **document}, **kwargs)


def fail(command: str, message: str, as_json: bool = False, code: int = EXIT_FAILURE, **fields: Any) -> int:
    """Report a failed command: one line ``amdxdna COMMAND: message`` on stderr and, with ``as_json``, the
    JSON error object ``{"schema", "command", "ok": false, "error": message, **fields}`` on stdout.

    Returns ``code`` (1, or 2 for a usage error).
    """
    if as_json:
        print(dump_json(command, {"ok": False, "error": message, **fields}, indent=2))
    print(f"amdxdna {command}: {one_line(message)}", file=sys.stderr)
    return code


# --------------------------------------------------------------------------------------------- parsers


def add_file_parser(subparsers: Subparsers, name: str, what: str, description: str) -> argparse.ArgumentParser:
    """Register ``amdxdna NAME FILE [--json]`` for a file of kind ``what`` ("xclbin", "TXN stream")."""
    epilog = (f"exit codes:\n  0    the {what} was decoded and printed\n"
              f"  1    the file cannot be read or is not a valid {what} (message on stderr)\n  2    usage error")
    parser = subparsers.add_parser(name, help=COMMANDS[name][1], description=description, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", metavar="FILE", help=f"the {what} file")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of text (default: text)")
    return parser


def inspect_file(name: str, args: argparse.Namespace, load: Callable[[str], Any], error: type[Exception],
                 describe: Callable[[Any], dict[str, Any]], render: Callable[[Any], str]) -> int:
    """Decode ``args.file`` with ``load`` and print ``describe`` as JSON (``--json``) or ``render``'s text.

    Returns 0, or 1 with ``amdxdna NAME: FILE: message`` on stderr (and the JSON error object with
    ``--json``) when the file cannot be read (with the errno name) or ``load`` raises ``error`` (the
    parser's message names the field or word at fault).
    """
    path = shown(args.file)
    try:
        decoded = load(args.file)
    except files.FileRefused as exc:  # its message starts with the path, shown
        return fail(name, str(exc), args.json, file=str(args.file))
    except (error, Error) as exc:
        return fail(name, f"{path}: {exc}", args.json, file=str(args.file))
    except OSError as exc:
        return fail(name, f"{path}: {_errno_text(exc)}", args.json, file=str(args.file))
    print(dump_json(name, {"file": str(args.file), **describe(decoded)}, indent=2) if args.json else render(decoded))
    return 0


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (a usage error, exit 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def command_parser(subparsers: Subparsers, name: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand parser: its summary from :data:`COMMANDS`, ``description`` wrapped, ``epilog`` as is.

    Shared by the device commands (info, top, doctor, validate, configure, run, trace) so their help reads the
    same.
    """
    return subparsers.add_parser(name, help=COMMANDS[name][1], description=textwrap.fill(description, 100),
                                 epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)


def device_spec(text: str) -> str:
    """Check a ``--device`` value (an argparse ``type``): what :func:`open_device` takes as a string.

    A node path is only checked when opened (the open names the errno); an emulator spec is checked
    here, so that a mistyped profile is a usage error (exit 2) rather than a failed device.

    Raises:
        argparse.ArgumentTypeError: an empty value, one longer than any path (PATH_MAX), or
            ``emu:<profile>`` with an unknown profile.
    """
    if not text:
        raise argparse.ArgumentTypeError("empty device: expected /dev/accel/accelN, emu or emu:<profile>")
    if len(text) > MAX_DEVICE:
        raise argparse.ArgumentTypeError(f"{shown(text)}: longer than any device path ({len(text)} characters, "
                                         f"at most {MAX_DEVICE})")
    kind, _, profile = text.partition(":")
    if kind == "emu" and profile:
        from ..emu import resolve

        try:
            resolve(profile)
        except KeyError as exc:
            raise argparse.ArgumentTypeError(f"{shown(text)}: {exc.args[0]}") from None
    return text


def add_device_option(parser: argparse.ArgumentParser, what: str, default: str, from_env: bool = True) -> None:
    """``--device DEV`` (checked by :func:`device_spec`); ``from_env`` takes ``$AMDXDNA_DEVICE`` as default.

    argparse runs ``type`` on a string default too, so a bad ``$AMDXDNA_DEVICE`` is a usage error as well.
    """
    parser.add_argument("--device", metavar="DEV", type=device_spec,
                        default=(os.environ.get(DEVICE_ENV) or None) if from_env else None,
                        help=f"{what}: /dev/accel/accelN, emu, emu:npu1, emu:npu4, ... (default: {default})")
