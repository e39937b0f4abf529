"""amdxdna top: snapshots of the driver's context entries, rates from counter deltas, plain and curses output.

Oracles: the field list of amdxdna_drm_hwctx_entry (docs/uapi.md 2.5, written out below, not
taken from abi.py), the commands this test itself submits on a second file descriptor, arithmetic on
counters over a clock the test controls, and a pseudo-terminal driving the real command (it must redraw
and quit on ``q``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_cli_isolation

from amdxdna_direct import insts, open_device
from amdxdna_direct.cli import main, top_cmd
from amdxdna_direct.doctor import bind_model
from amdxdna_direct.emu import EmuDevice
from amdxdna_direct.emu.models import Passthrough
from amdxdna_direct.xclbin import build_mlir_aie

no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")

REPO = Path(__file__).resolve().parents[1]
# struct amdxdna_drm_hwctx_entry (docs/uapi.md 2.5): every field but pad; `name` only in the 160-byte layout.
ENTRY_FIELDS = ("context_id", "start_col", "num_col", "hwctx_id", "pid", "command_submissions",
                "command_completions", "migrations", "preemptions", "errors", "priority", "heap_usage",
                "suspensions", "state", "pasid", "gops", "fps", "dma_bandwidth", "latency", "frame_exec_time",
                "txn_op_idx", "ctx_pc", "fatal_error_type", "fatal_error_exception_type", "fatal_error_exception_pc",
                "fatal_error_app_module", "name")


class Busy:
    """A second fd on ``emu`` holding a 2-column context that runs a passthrough on demand."""

    def __init__(self, emu: EmuDevice) -> None:
        self.dev = open_device(emu)
        stream = insts.dma_stream(4, [(0, 256, "in"), (1, 256, "out")])
        bind_model(emu, stream, Passthrough())
        self.ctx = self.dev.hw_context(build_mlir_aie(b"pdi", column_width=2, n_buffers=2))
        self.run = self.ctx.kernel().prepare_npu(stream, [self.dev.bo(4096), self.dev.bo(4096)])

    def submit(self, n: int) -> None:
        for _ in range(n):
            self.run.start()
            self.run.wait(5.0)

    def close(self) -> None:
        self.dev.close()


def test_rates_are_counter_deltas_over_the_clock():
    previous = {"monotonic": 10.0, "contexts": [
        {"context_id": 1, "pid": 7, "command_submissions": 10, "command_completions": 9, "errors": 0,
         "migrations": 0, "preemptions": 0, "suspensions": None},
        {"context_id": 2, "pid": 7, "command_submissions": 50, "command_completions": 50, "errors": 0,
         "migrations": 0, "preemptions": 0, "suspensions": None}]}
    current = {"monotonic": 12.5, "contexts": [
        {"context_id": 1, "pid": 7, "command_submissions": 35, "command_completions": 34, "errors": 5,
         "migrations": 0, "preemptions": 1, "suspensions": None},
        {"context_id": 2, "pid": 7, "command_submissions": 3, "command_completions": 3, "errors": 0,  # a new context
         "migrations": 0, "preemptions": 0, "suspensions": None},
        {"context_id": 3, "pid": 8, "command_submissions": 1, "command_completions": 1, "errors": 0,
         "migrations": 0, "preemptions": 0, "suspensions": None}]}
    assert top_cmd.rates(previous, current) == {1: {"command_submissions": 10.0, "command_completions": 10.0,
                                                    "errors": 2.0, "migrations": 0.0, "preemptions": 0.4}}
    assert top_cmd.rates(None, current) == {}
    assert top_cmd.rates({**current, "monotonic": 12.5}, current) == {}  # no time passed


def test_snapshots_with_rates_from_real_submissions():
    ticks = iter([100.0, 100.5, 101.5])
    with EmuDevice("npu4") as emu:
        busy = Busy(emu)
        try:
            busy.submit(1)
            with open_device(emu) as dev:
                waits = iter([lambda: busy.submit(2), lambda: busy.submit(4)])
                snaps = list(top_cmd.snapshots(dev, 0.5, 3, sleep=lambda s: next(waits)(), clock=lambda: next(ticks)))
        finally:
            busy.close()
    assert [s["refresh"] for s in snaps] == [1, 2, 3]
    counts = [s["contexts"][0]["command_submissions"] for s in snaps]
    assert counts == [1, 3, 7]
    assert snaps[0]["contexts"][0]["rates"] is None  # one snapshot has no rate
    assert snaps[1]["contexts"][0]["rates"]["command_submissions"] == 2 / 0.5
    assert snaps[2]["contexts"][0]["rates"]["command_completions"] == 4 / 1.0
    assert snaps[2]["contexts"][0]["rates"]["errors"] == 0.0


def test_top_json_carries_every_field_of_the_drivers_entry(capsys):
    with EmuDevice("npu4:linux-6.18") as emu:       # spatial placement: the context's own 2 columns
        busy = Busy(emu)
        try:
            busy.submit(3)
            assert top_cmd.run(argparse.Namespace(device=emu, json=True, record=None, interval=1.0,
                                                  count=None)) == 0
        finally:
            busy.close()
    snap = json.loads(capsys.readouterr().out)
    assert {"time", "monotonic", "device", "power_mode", "clocks", "resources", "contexts"} <= set(snap)
    entry, = snap["contexts"]
    assert set(ENTRY_FIELDS) <= set(entry)
    assert (entry["pid"], entry["num_col"], entry["command_submissions"], entry["command_completions"]) == (
        os.getpid(), 2, 3, 3)
    assert entry["rates"] is None and entry["state_name"] in ("IDLE", "ACTIVE")
    assert entry["element_size"] in (144, 160) and entry["source"] == "GET_ARRAY"


def test_top_plain_lines_and_record_file(tmp_path, capsys):
    record = tmp_path / "top.jsonl"
    assert main(["top", "--device", "emu:npu4", "--count", "3", "--interval", "0.01", "--record", str(record)]) == 0
    blocks = [b for b in capsys.readouterr().out.split("\n\n") if b.strip()]  # stdout is not a terminal here
    assert [b.splitlines()[0].split("  ")[1].split(" at ")[0] for b in blocks] == ["refresh #1", "refresh #2",
                                                                                    "refresh #3"]
    assert all("power DEFAULT" in b and "0 context(s)" in b for b in blocks)
    records = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["refresh"] for r in records] == [1, 2, 3]
    assert [r["device"] for r in records] == ["emu:npu4"] * 3 and records[0]["contexts"] == []


def test_top_table_shows_the_context_and_its_rates():
    with EmuDevice("npu4") as emu:
        busy = Busy(emu)
        try:
            with open_device(emu) as dev:
                waits = iter([lambda: busy.submit(5)])
                snaps = list(top_cmd.snapshots(dev, 1.0, 2, sleep=lambda s: next(waits)(),
                                               clock=iter([0.0, 2.0]).__next__))
        finally:
            busy.close()
    lines = top_cmd.format_snapshot(snaps[1])
    assert "refresh #2" in lines[0] and "1 context(s)" in lines[0]
    assert lines[1].split() == ["id", "columns", "pid", "process", "state", "prio", "submitted", "completed",
                                "errors", "sub/s", "done/s"]
    row = lines[2].split()
    assert row[2] == str(os.getpid()) and row[-5:] == ["5", "5", "0", "2.5", "2.5"]


def test_top_usage_errors(capsys):
    for argv in (["top", "--interval", "0"], ["top", "--interval", "-1"], ["top", "--count", "0"],
                 ["top", "--interval", "soon"]):
        assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "the interval must be a positive number of seconds" in err and "must be at least 1" in err


def test_top_without_a_device_still_prints_json(tmp_path, capsys):
    assert main(["top", "--device", str(tmp_path / "accel7"), "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["device"] == str(tmp_path / "accel7") and "ENOENT" in doc["error"]
    assert "ENOENT" in err


def test_top_record_file_that_cannot_be_written(tmp_path, capsys):
    assert main(["top", "--device", "emu:npu1", "--count", "1", "--record", str(tmp_path / "no/such/dir/x")]) == 1
    assert "--record" in capsys.readouterr().err


def _read_until(fd: int, needle: bytes, limit_s: float) -> bytes:
    """Read the pseudo-terminal until ``needle`` appears in what is read now (a safety limit only bounds a
    broken run)."""
    seen = b""
    deadline = time.monotonic() + limit_s
    while needle not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{needle!r} never appeared; the terminal showed: {seen[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    return seen


def test_top_in_a_terminal_redraws_and_quits_on_q():
    master, slave = os.openpty()
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(REPO), "LINES": "30", "COLUMNS": "150"}
    env.pop("AMDXDNA_DEVICE", None)
    child = subprocess.Popen([sys.executable, "-m", "amdxdna_direct.cli", "top", "--device", "emu:npu4",
                              "--interval", "0.05"], stdin=slave, stdout=slave, stderr=slave, env=env,
                             start_new_session=True)
    os.close(slave)
    try:
        screen = _read_until(master, b"q: quit", 60.0)  # the first full draw
        assert b"emu:npu4  refresh #1 at " in screen and b"power DEFAULT" in screen
        assert b"\x1b[" in screen  # drawn with terminal escapes, not plain lines
        # Later refreshes rewrite only what changed: the refresh number on the header row (row 1).
        _read_until(master, b"\x1b[1;", 60.0)
        os.write(master, b"q")
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(master)
