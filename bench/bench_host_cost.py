"""Host cost per dispatch with a null seam: the runtime's own Python cost, nothing below it (issue 14).

Run: ``python bench/bench_host_cost.py [--rounds 7] [--singles 20000] [--chains 300] [--before DIR]``

The device is the emulator behind ``bench/null_seam.py``, which answers EXEC_CMD and the waits inline,
so the time measured is what ``Run.start`` / ``Run.wait`` and ``RunList.start`` / ``RunList.wait`` cost
on the host. Figures:

1. one prepared run, ``start()`` + ``wait()``: microseconds per run (goal <= 6 us);
2. a ``RunList`` of 96 prepared runs, ``start()`` + ``wait()``: microseconds per dispatch (goal <= 1 us);
3. ioctls per 96-run chain (deterministic; goal: 3 EXEC_CMD + 1 wait, unchanged).

Each figure is the median over ``--rounds`` rounds of the process CPU time (the machine may be shared:
wall time is printed too). Every round runs in a fresh worker process. With ``--before DIR`` (a
directory holding an older ``amdxdna_direct``, e.g. ``git worktree add DIR <commit>``) the rounds
alternate between this tree and that one, and the ratio printed is measured side by side; without it
the old cost is the issue's quote ("before, quoted": 9.4 us per single run, 4.75 us per chained
dispatch, measured on another machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHAIN = 96
BEFORE_SINGLE_US = 9.4      # issue 14, the same loops before the change
BEFORE_CHAINED_US = 4.75
GOAL_SINGLE_US = 6.0
GOAL_CHAINED_US = 1.0


def _worker(singles: int, chains: int) -> dict[str, object]:
    """One round in this process: the runtime found first on sys.path, the null seam from bench/."""
    from null_seam import NullSeam

    from amdxdna_direct import Device, RunList, insts, xclbin
    from amdxdna_direct.emu import EmuDevice

    emu = EmuDevice("npu4")
    with Device(NullSeam(emu.open()), emulator=emu, owns_emulator=True) as dev:
        stream = insts.encode(insts.dma_stream(4, [(0, 4096, "in"), (1, 4096, "in"), (2, 4096, "out")]))
        ctx = dev.hw_context(xclbin.build_mlir_aie(b"null seam bench", column_width=1, n_buffers=3))
        kernel = ctx.kernel()
        bufs = [dev.bo(4096) for _ in range(3)]
        single = kernel.prepare_npu(stream, bufs)
        chain = RunList(ctx, [kernel.prepare_npu(stream, bufs) for _ in range(CHAIN)])
        for _ in range(200):
            single.start().wait()
        before = dict(dev.stats)
        chain.start().wait()
        per_chain = {name: count - before.get(name, 0) for name, count in dev.stats.items()
                     if count != before.get(name, 0)}

        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(singles):
            single.start()
            single.wait()
        c1, w1 = time.process_time(), time.perf_counter()
        for _ in range(chains):
            chain.start()
            chain.wait()
        c2, w2 = time.process_time(), time.perf_counter()
    return {"single_cpu": (c1 - c0) / singles * 1e6, "single_wall": (w1 - w0) / singles * 1e6,
            "chained_cpu": (c2 - c1) / (chains * CHAIN) * 1e6, "chained_wall": (w2 - w1) / (chains * CHAIN) * 1e6,
            "per_chain": per_chain}


def _round(tree: Path, singles: int, chains: int) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(HERE)]), AMDXDNA_TRACE="")
    out = subprocess.run([sys.executable, str(Path(__file__)), "--worker", str(singles), str(chains)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    """Print the figures with their goals; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--singles", type=int, default=20000, help="start+wait pairs per round")
    parser.add_argument("--chains", type=int, default=300, help="96-run chain dispatches per round")
    parser.add_argument("--before", type=Path, help="a tree with the old amdxdna_direct, measured side by side")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return 0

    trees = {"now": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():        # alternated, so that a busy machine slows both alike
            rounds[name].append(_round(tree, args.singles, args.chains))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name])

    old = ({"single": median("before", "single_cpu"), "chained": median("before", "chained_cpu")}
           if args.before else {"single": BEFORE_SINGLE_US, "chained": BEFORE_CHAINED_US})
    how = "before, measured" if args.before else "before, quoted"
    print(f"host cost with a null seam: median of {args.rounds} rounds, process CPU time (wall in brackets)")
    for label, key, goal in (("single run start+wait", "single", GOAL_SINGLE_US),
                             (f"dispatch in a chain of {CHAIN}", "chained", GOAL_CHAINED_US)):
        now, wall = median("now", f"{key}_cpu"), median("now", f"{key}_wall")
        print(f"  {label:28s} {now:6.2f} us ({wall:.2f})   goal <= {goal} us   {how}: {old[key]:.2f} us   "
              f"ratio {now / old[key]:.2f}x")
    counts = rounds["now"][0]["per_chain"]
    shown = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    print(f"  ioctls per chain of {CHAIN}: {shown}   goal: EXEC_CMD 3, SYNCOBJ_TIMELINE_WAIT 1 (unchanged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
