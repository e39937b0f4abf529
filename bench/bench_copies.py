"""bf16 copies into and out of BOs against memcpy of the same bytes, side by side in one run.

Run: ``python bench/bench_copies.py [--rounds 9] [--sizes 64K,8M,32M]``

For each size (bytes of bf16 in the BO), alternated round by round so that a busy machine slows
every side alike (figures are medians):

- memcpy baseline: one ``np.copyto`` of the bf16 bytes, host -> BO mapping and BO -> host;
- ``Bo.write_bf16(f32)``: float32 -> bf16 rounded straight into the mapping, split over the copy pool;
- ``Bo.read_f32_from_bf16(out=...)``: bf16 -> float32 out of the mapping into a reused array (and into a
  fresh one, which pays the first touch of its pages);
- the previous way, for scale: ``to_bf16`` (two temporaries) then ``copy_wide`` into the mapping, and
  ``copy_wide`` out then ``from_bf16``;
- the floor of a numpy conversion: ml_dtypes' float32 -> bf16 cast alone, one thread, into a host array that
  stays cached (no NaN check, no mapping). ``write_bf16`` divided by it is printed: at ~1.0x the conversion
  costs what numpy's fastest cast costs, and what is left of the goal is the cast's own speed (a compiled
  kernel would be needed to go below it; the runtime compiles nothing).

Goals (issue 14): write and read <= 1.5x the memcpy time at >= 8 MiB; at 64 KiB no pool hand-off (the
fixed cost is printed in microseconds). Deterministic counts: bytes copied per call (``Device.stats``)
and pool hand-offs per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Runnable from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amdxdna_direct import bo as bo_mod  # noqa: E402
from amdxdna_direct import open_device  # noqa: E402
from sam3.pack import copy_wide, from_bf16, to_bf16  # noqa: E402

GOAL = 1.5
GOAL_FROM = 8 << 20


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _per_call(fn: Callable[[], object], budget: float = 0.004) -> float:
    """Seconds per call of ``fn``, repeated until ``budget`` seconds passed (at least once)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            return elapsed / calls


class _CountingPool:
    """Counts the parts handed to the real copy pool."""

    def __init__(self) -> None:
        self.parts = 0
        self.real = bo_mod.copy_pool

    def __call__(self):
        self.parts += 1
        return self.real()


def bench_size(device, nbytes: int, rounds: int) -> None:
    n = nbytes // 2
    rng = np.random.default_rng(14)
    src = (rng.standard_normal(n) * 4).astype(np.float32)
    bits = to_bf16(src)
    bo = device.bo(nbytes)
    view = bo.array(np.uint8)
    host = np.empty(nbytes, np.uint8)
    scratch = np.empty(n, bo_mod.BF16)
    out = np.empty(n, np.float32)
    bo.write_bf16(src)
    out.fill(0)
    host.fill(0)                                   # every buffer touched before timing
    scratch.view(np.uint16).fill(0)
    ops: dict[str, Callable[[], object]] = {
        "memcpy in": lambda: np.copyto(view, bits.view(np.uint8)),
        "write_bf16": lambda: bo.write_bf16(src),
        "old in (to_bf16 + copy_wide)": lambda: copy_wide(view, to_bf16(src)),
        "floor: ml_dtypes cast alone": lambda: np.copyto(scratch, src, casting="unsafe"),
        "memcpy out": lambda: np.copyto(host, view),
        "read_f32_from_bf16 (reused out)": lambda: bo.read_f32_from_bf16(n, out=out),
        "read_f32_from_bf16 (fresh array)": lambda: bo.read_f32_from_bf16(n),
        "old out (copy_wide + from_bf16)": lambda: from_bf16(_copied(view, nbytes).view(np.uint16)),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, fn in ops.items():
            times[name].append(_per_call(fn))
    med = {name: statistics.median(t) for name, t in times.items()}

    # deterministic counts: bytes per call from Device.stats, pool hand-offs per call
    counter = _CountingPool()
    bo_mod.copy_pool = counter
    try:
        before = dict(device.stats)
        bo.write_bf16(src)
        written, parts_in = device.stats["bytes_in"] - before.get("bytes_in", 0), counter.parts
        bo.read_f32_from_bf16(n, out=out)
        read, parts_out = device.stats["bytes_out"] - before.get("bytes_out", 0), counter.parts - parts_in
    finally:
        bo_mod.copy_pool = counter.real
    if not np.array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16):
        raise SystemExit("bench_copies: the round trip changed values")

    label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
    print(f"{label} of bf16 ({n} values): bytes copied per call: in {written}, out {read}; "
          f"pool hand-offs per call: in {parts_in}, out {parts_out}")
    goal_applies = nbytes >= GOAL_FROM
    for base, names in (("memcpy in", ("write_bf16", "old in (to_bf16 + copy_wide)", "floor: ml_dtypes cast alone")),
                        ("memcpy out", ("read_f32_from_bf16 (reused out)", "read_f32_from_bf16 (fresh array)",
                                        "old out (copy_wide + from_bf16)"))):
        print(f"  {base:34s} {med[base] * 1e6:10.1f} us  ({nbytes / med[base] / 1e9:5.1f} GB/s)")
        for name in names:
            ratio = med[name] / med[base]
            verdict = ""
            if goal_applies and not name.startswith(("old", "floor")) and "fresh" not in name:
                verdict = f"  goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'}"
            elif not goal_applies and not name.startswith(("old", "floor")):
                verdict = f"  (+{(med[name] - med[base]) * 1e6:.1f} us over memcpy; goal: no pool hand-off)"
            print(f"  {name:34s} {med[name] * 1e6:10.1f} us  {ratio:5.2f}x memcpy{verdict}")
        if base == "memcpy in":
            floor = med["floor: ml_dtypes cast alone"]
            print(f"  {'write_bf16 / the cast alone':34s} {med['write_bf16'] / floor:10.2f}x")


def _copied(view: np.ndarray, nbytes: int) -> np.ndarray:
    dst = np.empty(nbytes, np.uint8)
    copy_wide(dst, view)
    return dst


def main(argv: list[str] | None = None) -> int:
    """Print the copy figures; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="alternated rounds per figure (default 9)")
    parser.add_argument("--sizes", default="64K,8M,32M", help="bytes of bf16 per copy (default 64K,8M,32M)")
    args = parser.parse_args(argv)
    print(f"copy pool: {bo_mod.COPY_WORKERS} threads (calling thread included); pool from "
          f"{bo_mod.POOL_MIN_BYTES >> 20} MiB (memcpy) / {bo_mod.POOL_MIN_ELEMENTS} values (bf16); "
          f"{args.rounds} rounds, medians")
    print("load average at start: %.2f %.2f %.2f on %d CPUs (other work slows both sides of each ratio)"
          % (*os.getloadavg(), os.cpu_count() or 1))
    with open_device("emu") as device:
        for text in args.sizes.split(","):
            bench_size(device, _size(text.strip()), args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
