"""``amdxdna trace -- COMMAND ...``: run a program with the ioctl trace on, show its ioctls and a summary.

The program runs with ``AMDXDNA_TRACE=1`` in its environment, and this package's directory first on
``PYTHONPATH`` so that Python programs use this same runtime. Every process of the program that uses
the package then logs each ioctl through :mod:`amdxdna_direct.trace` (logger ``amdxdna_direct.trace``,
lines prefixed ``amdxdna-trace:`` on its stderr). This command reads the program's stderr, takes those
lines out, decodes them into records (device, ioctl name, input fields, result or errno, changed output
fields, duration) and passes every other line through unchanged. At exit it prints the summary over all
processes: count, errors and total time per ioctl.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, cast

from ..errors import errno_text, format_fields
from . import DEVICE_ENV, StdoutError, Subparsers, add_device_option, command_parser, dump_json, fail, shown

__all__ = ["TraceRecord", "parse_line", "parse_fields", "summarise", "format_summary", "add_parser", "run"]

# The prefix and record format written by amdxdna_direct.trace (Tracer.call, enable()).
TRACE_PREFIX = "amdxdna-trace: "
_RECORD = re.compile(r"^(?P<device>\S+) (?P<name>\w+)\((?P<fields>.*?)\) -> (?P<result>.*) "
                     r"(?P<us>\d+(?:\.\d+)?)us$")
_OK_RESULT = re.compile(r"^(?P<value>-?\d+) \{(?P<changed>.*)\}$")
# The per-process summary trace.py logs at exit: a header line, then a table without the prefix.
_SUMMARY_HEAD = re.compile(r"^ioctl summary for pid \d+:$")
_SUMMARY_ROW = re.compile(r"^(ioctl\s+count\s+errors\s+total ms\s+mean us|\S+\s+\d+\s+\d+\s+\d+\.\d+\s+\d+\.\d+)$")

EXIT_CODES = """\
exit codes:
  N    the exit status of COMMAND (128+signal when a signal ended it)
  1    COMMAND could not be started (not found, not executable), or the -o FILE cannot be written
  2    usage error (no COMMAND given, bad option, unknown emulator profile in --device)"""


@dataclass(frozen=True)
class TraceRecord:
    """One traced ioctl: ``result`` is the return value, or None when it failed with ``error``."""

    device: str
    name: str
    fields: dict[str, int | str]
    result: int | None
    changed: dict[str, int | str]
    error: str
    seconds: float

    def to_dict(self) -> dict[str, object]:
        """The record as a plain dict (for ``--json``)."""
        return asdict(self)

    def format(self) -> str:
        """One line: ``NAME(fields) -> result {changed} 12.3us`` or ``... -> ENAME (text) 12.3us``."""
        outcome = f"{self.result} {{{format_fields(self.changed)}}}" if self.error == "" else self.error
        return f"{self.device} {self.name}({format_fields(self.fields)}) -> {outcome} {self.seconds * 1e6:.1f}us"


_FIELD_SPLIT = re.compile(r", (?=\w+=)")
_INT = re.compile(r"-?(0x[0-9a-fA-F]+|\d+)")


def parse_fields(text: str) -> dict[str, int | str]:
    """``"a=1, b=0x10, c=b'x'"`` -> ``{"a": 1, "b": 16, "c": "b'x'"}`` (integers decoded, the rest kept as text)."""
    fields: dict[str, int | str] = {}
    for item in _FIELD_SPLIT.split(text) if text else []:
        key, _, value = item.partition("=")
        fields[key] = int(value, 0) if _INT.fullmatch(value) else value
    return fields


def parse_line(text: str) -> TraceRecord | None:
    """The record of one trace log message (the text after the prefix), or None if it is not a record."""
    match = _RECORD.match(text)
    if match is None:
        return None
    ok = _OK_RESULT.match(match["result"])
    seconds = float(match["us"]) * 1e-6
    fields = parse_fields(match["fields"])
    if ok is not None:
        return TraceRecord(match["device"], match["name"], fields, int(ok["value"]), parse_fields(ok["changed"]), "",
                           seconds)
    return TraceRecord(match["device"], match["name"], fields, None, {}, match["result"], seconds)


def summarise(records: Iterable[TraceRecord]) -> dict[str, dict[str, float]]:
    """``{ioctl: {"count", "errors", "total_ms"}}`` over ``records``, by ioctl name."""
    table: dict[str, dict[str, float]] = {}
    for record in records:
        row = table.setdefault(record.name, {"count": 0, "errors": 0, "total_ms": 0.0})
        row["count"] += 1
        row["errors"] += record.error != ""
        row["total_ms"] += record.seconds * 1e3
    return dict(sorted(table.items()))


def format_summary(table: dict[str, dict[str, float]]) -> str:
    """The summary as a text table with a total line."""
    lines = [f"{'ioctl':<24}{'count':>8}{'errors':>8}{'total ms':>12}{'mean us':>10}"]
    for name, row in table.items():
        mean_us = row["total_ms"] * 1e3 / row["count"]
        lines.append(f"{name:<24}{row['count']:>8}{row['errors']:>8}{row['total_ms']:>12.3f}{mean_us:>10.1f}")
    count = sum(row["count"] for row in table.values())
    total = sum(row["total_ms"] for row in table.values())
    lines.append(f"{'total':<24}{count:>8}{sum(r['errors'] for r in table.values()):>8}{total:>12.3f}")
    return "\n".join(lines)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``trace`` on an ``argparse`` subparsers object."""
    parser = command_parser(
        subparsers, "trace",
        "Run COMMAND with AMDXDNA_TRACE=1 and show every ioctl its processes make through amdxdna_direct "
        "(name, input fields, result or errno, changed output fields, duration), then a summary per ioctl "
        "(count, errors, total and mean time). The program's own stdout is untouched; its stderr passes "
        "through minus the trace lines. This package's directory is put first on PYTHONPATH so Python "
        "programs trace through it. Example: amdxdna trace -- python script.py", EXIT_CODES)
    add_device_option(parser, "device for the program, exported as AMDXDNA_DEVICE",
                      "the inherited $AMDXDNA_DEVICE, else the program's choice")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document at exit (command, exit status, records, summary) "
                             "instead of the text log and table (default: text)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the trace to FILE instead of stdout (default: stdout)")
    parser.add_argument("--no-log", action="store_true",
                        help="print only the summary, not each ioctl (default: print each ioctl as it happens)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the program and its arguments, after --")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``args.command`` traced; return its exit status (1 if it cannot start or -o cannot be written,
    2 without a command)."""
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        print("amdxdna trace: no COMMAND given (usage: amdxdna trace [options] -- COMMAND ...)", file=sys.stderr)
        return 2
    env = dict(os.environ, AMDXDNA_TRACE="1", PYTHONPATH=_python_path())
    if args.device is not None:
        env[DEVICE_ENV] = args.device
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout  # noqa: SIM115
    except OSError as exc:
        return fail("trace", f"-o {shown(args.output)}: cannot write: {_errno(exc)}", args.json)
    # With --json on stdout, the program's own stdout goes to stderr: stdout holds the document alone.
    child_out = _fileno(sys.stderr, 2) if args.json and out is sys.stdout else None
    sink = _Sink(None if args.json or args.no_log else out)
    status = 0
    try:
        try:
            child = subprocess.Popen(command, env=env, stdout=child_out, stderr=subprocess.PIPE)
        except OSError as exc:
            return fail("trace", f"cannot start {shown(command[0])}: {_errno(exc)}", args.json)
        with _sigint_to_child():
            records = _collect(cast(IO[bytes], child.stderr), sink)  # stderr=PIPE: Popen made the pipe
            status = child.wait()
        if sink.error is None:
            _report(out, command, status, records, args.json)
            if out is not sys.stdout:
                out.flush()
    except (OSError, StdoutError) as exc:
        sink.error = exc
    finally:
        if out is not sys.stdout:
            with contextlib.suppress(OSError):  # a failed write left the buffer full: this fails again
                out.close()
    code = 128 - status if status < 0 else status
    if isinstance(sink.error, StdoutError):
        raise sink.error  # stdout's own failure: the command line ends quietly (closed) or says so
    if sink.error is not None:
        where = f"-o {shown(args.output)}" if out is not sys.stdout else "standard output"
        print(f"amdxdna trace: {where}: cannot write: {_errno(sink.error)}", file=sys.stderr)
        return 1
    return code


def _fileno(stream: IO[str], default: int) -> int:
    """The descriptor of ``stream``, or ``default`` for a stream without one (a test's capture)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return default


def _errno(exc: OSError | StdoutError) -> str:
    return errno_text(exc.errno) if exc.errno else str(exc)


class _Sink:
    """Where each record is echoed as it happens; the first write error stops the echo (the program's stderr
    is still drained, so it never blocks) and is kept in ``error`` for the exit status."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream
        self.error: OSError | StdoutError | None = None

    def write(self, line: str) -> None:
        if self.stream is None or self.error is not None:
            return
        try:
            print(line, file=self.stream, flush=True)
        except (OSError, StdoutError) as exc:
            self.error = exc


@contextlib.contextmanager
def _sigint_to_child() -> Iterator[None]:
    """Ignore Ctrl-C here while the program runs: it reaches the program (same process group), which ends,
    and the summary is still printed. Only the main thread may change signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _python_path() -> str:
    """$PYTHONPATH with this package's parent directory first, so Python programs trace through this runtime."""
    package_parent = str(Path(__file__).resolve().parents[2])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_parent]
    return os.pathsep.join([package_parent, *rest])


def _collect(stderr: IO[bytes], live: _Sink) -> list[TraceRecord]:
    """Split the program's stderr into trace records (echoed to ``live``) and pass-through lines."""
    records: list[TraceRecord] = []
    in_summary = False
    passthrough = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    for raw in iter(stderr.readline, b""):
        text = raw.decode("utf-8", "replace").rstrip("\n")
        if text.startswith(TRACE_PREFIX):
            message = text[len(TRACE_PREFIX):]
            in_summary = bool(_SUMMARY_HEAD.match(message))
            record = parse_line(message)
            if record is not None:
                records.append(record)
                live.write(record.format())
                continue
            if in_summary:
                continue
        elif in_summary and _SUMMARY_ROW.match(text):
            continue  # we print our own summary over every process
        in_summary = False
        _pass_through(raw, passthrough)
    stderr.close()
    return records


def _pass_through(raw: bytes, binary: IO[bytes] | None) -> None:
    if binary is not None:
        binary.write(raw)
        binary.flush()
    else:
        sys.stderr.write(raw.decode("utf-8", "replace"))


def _report(out: IO[str], command: list[str], status: int, records: list[TraceRecord], as_json: bool) -> None:
    table = summarise(records)
    if as_json:
        document = {"program": command, "exit_status": status, "records": [r.to_dict() for r in records],
                    "summary": table}
        out.write(dump_json("trace", document, indent=2) + "\n")
        return
    ending = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    print(f"-- {len(records)} ioctls traced; {shown(command[0])} {ending}", file=out)
    if records:
        print(format_summary(table), file=out)
