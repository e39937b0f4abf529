#!/usr/bin/env python3
"""Stage times of `sam3 demo` on the emulator: wall time, the part spent between submissions and completions
(the emulated device), and the host's share (copies, conversions, host math), plus the deterministic counts.

    python bench/bench_demo.py [--geometry tiny|sam3] [--reps N] [--no-chains]

The host share is what a real NPU leaves to the host: the number to drive down. Bundles are built once into
$SAM3_CACHE (default ~/.cache/sam3); the full-size ones take a few minutes and ~3 GB the first time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sam3 import demo  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--geometry", choices=("tiny", "sam3"), default="tiny")
    p.add_argument("--reps", type=int, default=3, help="demo runs; the table shows each stage's median")
    p.add_argument("--no-chains", action="store_true", help="dispatch chunk by chunk (SAM3_CHAINS=0)")
    args = p.parse_args()
    say = demo.progress(args.geometry != "tiny")
    start = time.perf_counter()
    demo.run_demo("emu", geometry=args.geometry, say=say)  # builds the bundles when absent; warms the caches
    say(f"warm-up (and bundle build if needed): {time.perf_counter() - start:.1f} s")
    runs = [demo.run_demo("emu", geometry=args.geometry, chains=False if args.no_chains else None)
            for _ in range(args.reps)]
    if not all(r["ok"] for r in runs):
        print("a stage was out of tolerance", file=sys.stderr)
        return 1
    print(f"sam3 demo, geometry {args.geometry}, {args.reps} runs on the emulator (medians)")
    head = f"{'stage':<14}{'wall ms':>10}{'device ms':>11}{'host ms':>9}{'host %':>8}{'EXEC':>6}{'waits':>6}" \
           f"{'MiB in':>8}{'MiB out':>8}"
    print(head)
    print("-" * len(head))
    total = {"wall": 0.0, "host": 0.0}
    for i, first in enumerate(runs[0]["stages"]):
        rows = [r["stages"][i] for r in runs]
        wall = statistics.median(s["seconds"] for s in rows) * 1e3
        dev = statistics.median(s["device_seconds"] for s in rows) * 1e3
        host = statistics.median(s["host_seconds"] for s in rows) * 1e3
        total["wall"] += wall
        total["host"] += host
        print(f"{first['name']:<14}{wall:>10.1f}{dev:>11.1f}{host:>9.1f}{100 * host / wall:>7.0f}%"
              f"{first['exec_cmds']:>6}{first['waits']:>6}{first['bytes_in'] / 2**20:>8.2f}"
              f"{first['bytes_out'] / 2**20:>8.2f}")
    print(f"{'all stages':<14}{total['wall']:>10.1f}{'':>11}{total['host']:>9.1f}"
          f"{100 * total['host'] / total['wall']:>7.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
