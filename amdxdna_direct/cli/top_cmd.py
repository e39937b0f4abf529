"""``amdxdna top``: the device's hardware contexts, refreshed live, with rates from the counters' deltas.

Each refresh is one snapshot (:func:`snapshot`): power mode, clocks, resources and the driver's full entry
of every context (as ``amdxdna info``). Rates per second come from the difference of two snapshots'
counters over their monotonic times (:func:`rates`); a context whose counters went down (a new context
that reuses an id) gets no rate. On a terminal the table is drawn with curses and ``q`` quits; otherwise
each refresh prints plain lines. ``--json`` prints one snapshot; ``--record FILE`` appends every snapshot
to FILE as one JSON line (docs/cli.md "amdxdna top").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from .. import open_device
from ..device import Device
from ..errors import XdnaError
from . import Subparsers, add_device_option, command_parser, dump_json, fail, positive_int, shown
from .info_cmd import clock_mhz, context_dict, error_text, format_contexts, query

__all__ = ["COUNTERS", "add_parser", "run", "snapshot", "rates", "format_snapshot", "snapshots"]

# The counters of a context entry that rates are computed for.
COUNTERS = ("command_submissions", "command_completions", "errors", "migrations", "preemptions", "suspensions")

EXIT_CODES = """\
keys (terminal):
  q    quit

exit codes:
  0    the refreshes ran until --count, q or Ctrl-C (a query error is shown in the table, not an exit)
  1    the device could not be opened (with --json the document carries the error), or the --record
       file cannot be written (message on stderr)
  2    usage error (bad option: --interval not a positive number, --count below 1; unknown emulator
       profile in --device or $AMDXDNA_DEVICE)"""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the interval must be a positive number of seconds")
    return value


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``top`` on an ``argparse`` subparsers object."""
    parser = command_parser(
        subparsers, "top",
        "Refresh the driver's entry for every hardware context of every process (pid and process name, "
        "columns, state, priority, QoS, submissions, completions, errors, health record) every --interval "
        "seconds, with per-second rates from the counters' deltas. On a terminal it draws a table (q quits); "
        "otherwise it prints one block of plain lines per refresh.", EXIT_CODES)
    add_device_option(parser, "device to watch", "$AMDXDNA_DEVICE, else the first /dev/accel node driven by amdxdna")
    parser.add_argument("--interval", type=_positive_float, default=1.0, metavar="SECONDS",
                        help="seconds between refreshes (default: 1)")
    parser.add_argument("--count", type=positive_int, default=None, metavar="N",
                        help="stop after N refreshes (default: until q or Ctrl-C)")
    parser.add_argument("--json", action="store_true",
                        help="print one snapshot as a JSON object and exit (rates need two snapshots: null) "
                             "(default: live table)")
    parser.add_argument("--record", metavar="FILE",
                        help="append every snapshot to FILE as one JSON line, rates included (default: none)")
    return parser


def snapshot(dev: Device, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """One refresh as plain data: times, device, power mode, clocks, resources, the contexts' entries.

    Failed queries become ``{"error": message}`` (as in ``amdxdna info``).
    """
    return {
        "time": time.time(), "monotonic": clock(), "device": dev.name,
        "power_mode": query(lambda: dev.power_mode().name),
        "clocks": query(lambda: clock_mhz(dev)),
        "resources": query(lambda: vars(dev.resource_info()).copy()),
        "contexts": query(lambda: [context_dict(c) for c in dev.hw_contexts()]),
    }


def rates(previous: dict[str, Any] | None, current: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per-second counter rates of each context of ``current`` present in ``previous`` (same id and pid).

    A counter the driver does not report (None) or that went down gets no rate.
    """
    if previous is None or error_text(previous["contexts"]) or error_text(current["contexts"]):
        return {}
    elapsed = current["monotonic"] - previous["monotonic"]
    if elapsed <= 0:
        return {}
    before = {(c["context_id"], c["pid"]): c for c in previous["contexts"]}
    out: dict[int, dict[str, float]] = {}
    for c in current["contexts"]:
        old = before.get((c["context_id"], c["pid"]))
        if old is None:
            continue
        deltas = {name: c[name] - old[name] for name in COUNTERS if c.get(name) is not None
                  and old.get(name) is not None}
        if any(delta < 0 for delta in deltas.values()):
            continue
        out[c["context_id"]] = {name: delta / elapsed for name, delta in deltas.items()}
    return out


def snapshots(dev: Device, interval: float, count: int | None, sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic) -> Iterator[dict[str, Any]]:
    """Snapshots every ``interval`` seconds (``count`` of them, or without end), each with its ``rates`` and
    its ``refresh`` number; ``sleep`` waits between them and ``clock`` times them (monotonic seconds)."""
    previous = None
    n = 0
    while count is None or n < count:
        if n:
            sleep(interval)
        current = _with_rates(previous, snapshot(dev, clock))
        n += 1
        current["refresh"] = n
        yield current
        previous = current


def _with_rates(previous: dict[str, Any] | None, current: dict[str, Any]) -> dict[str, Any]:
    per_context = rates(previous, current) if previous is not None else None
    if not error_text(current["contexts"]):
        for c in current["contexts"]:
            c["rates"] = None if per_context is None else per_context.get(c["context_id"])
    return current


def format_snapshot(snap: dict[str, Any]) -> list[str]:
    """The lines of one refresh: a header (device, refresh number, power mode, clocks, contexts) and the table."""
    clocks = snap["clocks"]
    clock_text = error_text(clocks) or ", ".join(f"{name} {mhz} MHz" for name, mhz in clocks.items())
    contexts = snap["contexts"]
    when = time.strftime("%H:%M:%S", time.localtime(snap["time"]))
    count = error_text(contexts) or f"{len(contexts)} context(s)"
    power = error_text(snap["power_mode"]) or snap["power_mode"]
    header = f"{snap['device']}  refresh #{snap.get('refresh', 1)} at {when}  power {power}  {clock_text}  {count}"
    if error_text(contexts) or not contexts:
        return [header]
    table_rates = {c["context_id"]: c["rates"] or {} for c in contexts}
    return [header, *format_contexts(contexts, table_rates)]


def run(args: argparse.Namespace) -> int:
    """Open the device and refresh; return 0, or 1 when it cannot be opened or --record cannot be written."""
    try:
        dev = open_device(args.device)
    except XdnaError as exc:
        return fail("top", str(exc), args.json, device=args.device if isinstance(args.device, str) else None,
                    hint="`amdxdna doctor` says why")
    with dev:
        if args.json:
            print(dump_json("top", _with_rates(None, snapshot(dev)), indent=2))
            return 0
        try:
            record = open(args.record, "a", encoding="utf-8") if args.record else None  # noqa: SIM115
        except OSError as exc:
            print(f"amdxdna top: --record {shown(args.record)}: {exc.strerror} ({exc.__class__.__name__})",
                  file=sys.stderr)
            return 1
        try:
            return _live(dev, args, record)
        finally:
            if record is not None:
                record.close()


def _live(dev: Device, args: argparse.Namespace, record: TextIO | None) -> int:
    terminal = sys.stdout.isatty() and os.environ.get("TERM", "dumb") not in ("", "dumb")
    try:
        if terminal:
            import curses

            return curses.wrapper(lambda screen: _curses_loop(screen, dev, args, record))
        for snap in snapshots(dev, args.interval, args.count):
            _record(record, snap)
            print("\n".join(format_snapshot(snap)), end="\n\n", flush=True)
    except KeyboardInterrupt:  # the documented way to stop the live table: exit 0
        pass
    except _RecordError as exc:
        print(f"amdxdna top: --record {shown(args.record)}: {exc}", file=sys.stderr)
        return 1
    return 0


class _RecordError(Exception):
    """The --record file could not be written (its OSError's text), told apart from a failing stdout."""


def _record(record: TextIO | None, snap: dict[str, Any]) -> None:
    if record is None:
        return
    try:
        record.write(dump_json("top", snap) + "\n")
        record.flush()
    except OSError as exc:
        raise _RecordError(exc.strerror or str(exc)) from exc


def _curses_loop(screen: Any, dev: Device, args: argparse.Namespace, record: TextIO | None) -> int:
    """Draw each snapshot; wait for a key up to the interval between refreshes; ``q`` ends the loop."""
    import curses

    with _hidden_cursor(curses):
        screen.timeout(int(args.interval * 1000))

        def wait(seconds: float) -> None:
            # getch waits up to the interval (screen.timeout); a resize or another key redraws early.
            if screen.getch() in (ord("q"), ord("Q")):
                raise _Quit

        try:
            for snap in snapshots(dev, args.interval, args.count, sleep=wait):
                _record(record, snap)
                _draw(screen, curses, format_snapshot(snap) + ["", "q: quit"])
        except _Quit:
            pass
    return 0


class _Quit(Exception):
    """``q`` was pressed."""


class _hidden_cursor:
    def __init__(self, curses: Any) -> None:
        self.curses, self.previous = curses, None

    def __enter__(self) -> None:
        try:
            self.previous = self.curses.curs_set(0)
        except self.curses.error:  # a terminal that cannot hide it
            self.previous = None

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            self.curses.curs_set(self.previous)


def _draw(screen: Any, curses: Any, lines: list[str]) -> None:
    screen.erase()
    height, width = screen.getmaxyx()
    for row, line in enumerate(lines[:height]):
        try:
            screen.addnstr(row, 0, line, max(width - 1, 1))
        except curses.error:  # the bottom-right cell of a full screen
            pass
    screen.refresh()
