"""Dispatch and copy costs, measured side by side in one run.

Run: ``python bench/bench_dispatch.py [--device emu|/dev/accel/accel0] [--chunks 96] [--rounds 7]``

Three comparisons, each alternated round by round so that a noisy, shared machine slows both
sides alike; the ratio of the medians is what to quote:

1. one stage of ``--chunks`` GEMM chunks submitted one run at a time (the seed's way: an EXEC_CMD
   and a wait per chunk) against the same prepared runs as ERT_CMD_CHAIN packets (``RunList``);
2. prepared runs restarted (packet built once) against a fresh ``prepare_npu`` per dispatch
   (a command buffer allocated, mapped and closed every time);
3. filling a BO from a float32 host array, converted to bf16: ``sam3.npu.push`` (wide block copies)
   against a copy row by row.

Counts are deterministic: ioctls by name per stage (``Device.stats``) and bytes copied.
On the emulator the "device" time is the emulator's numpy model, so ratios show the host-side
costs this runtime controls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Runnable from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amdxdna_direct import RunList, open_device, xclbin  # noqa: E402
from amdxdna_direct.device import TXN_DEV_GEN  # noqa: E402
from amdxdna_direct.insts import dma_stream, encode  # noqa: E402
from amdxdna_direct.kernel import Run  # noqa: E402
from sam3.npu import push  # noqa: E402
from sam3.pack import BF16_BYTES as BF16  # noqa: E402
from sam3.pack import to_bf16  # noqa: E402


def _gemm_kernel(dev, m: int, k: int, n: int):
    """A context running a bf16 GEMM of m rows (emulator: bound to the Gemm model)."""
    buffers = [(0, m * k * BF16, "in"), (1, k * n * BF16, "in"), (2, m * n * BF16, "out")]
    stream = encode(dma_stream(TXN_DEV_GEN[dev.generation], buffers, rtp=[m, k, n, k]))
    if dev.emulator is not None:
        from amdxdna_direct.emu import Gemm
        dev.emulator.models.bind(stream, Gemm(m, k, n, k))
    pdi = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    ctx = dev.hw_context(xclbin.build_mlir_aie(pdi, column_width=1))
    return ctx, ctx.kernel(), stream


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _counted(dev, fn: Callable[[], object]) -> Counter:
    before = Counter(dev.stats)
    fn()
    return Counter({k: v - before[k] for k, v in dev.stats.items() if v - before[k]})


def _side_by_side(rounds: int, a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """Median seconds of a and b, alternating which goes first each round."""
    ta, tb = [], []
    a(), b()  # warm-up: first-use uploads and page faults stay out of the numbers
    for r in range(rounds):
        if r % 2:
            tb.append(_timed(b))
            ta.append(_timed(a))
        else:
            ta.append(_timed(a))
            tb.append(_timed(b))
    return statistics.median(ta), statistics.median(tb)


def _ioctls(c: Counter) -> str:
    names = [k for k in sorted(c) if k.isupper()]
    return ", ".join(f"{k} {c[k]}" for k in names) or "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="emu", help="what open_device takes (default: emu)")
    ap.add_argument("--chunks", type=int, default=96, help="GEMM chunks per stage (default 96)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per comparison (default 7)")
    args = ap.parse_args(argv)
    m, k, n = 16, 64, 64
    with open_device(args.device) as dev:
        ctx, kern, stream = _gemm_kernel(dev, m, k, n)
        a = dev.bo(args.chunks * m * k * BF16)
        w = dev.bo(k * n * BF16)
        c = dev.bo(args.chunks * m * n * BF16)
        push(to_bf16(np.random.default_rng(1).standard_normal(args.chunks * m * k, dtype=np.float32)), a)
        push(to_bf16(np.random.default_rng(2).standard_normal(k * n, dtype=np.float32)), w)
        # The operands of each chunk, shared by every way of dispatching it.
        chunks = [[a.sub(i * m * k * BF16, m * k * BF16), w, c.sub(i * m * n * BF16, m * n * BF16)]
                  for i in range(args.chunks)]
        runs = [kern.prepare_npu(stream, bufs) for bufs in chunks]
        chain = RunList(ctx, runs)

        def one_by_one() -> None:
            for run in runs:
                run.start().wait()

        def chained() -> None:
            chain.start().wait()

        def fresh_packets() -> None:
            for bufs in chunks:
                run: Run = kern.prepare_npu(stream, bufs)
                run.start().wait()
                run.close()

        print(f"device {dev.name}; stage of {args.chunks} GEMM chunks ({m}x{k}x{n} bf16); "
              f"medians of {args.rounds} alternating rounds")
        t_single, t_chain = _side_by_side(args.rounds, one_by_one, chained)
        c_single, c_chain = _counted(dev, one_by_one), _counted(dev, chained)
        print(f"1. chained vs one run at a time: {t_single / t_chain:.2f}x faster "
              f"({t_single * 1e3:.1f} ms -> {t_chain * 1e3:.1f} ms per stage)")
        print(f"   ioctls per stage, one at a time: {_ioctls(c_single)}")
        print(f"   ioctls per stage, chained:       {_ioctls(c_chain)}")
        t_fresh, t_reused = _side_by_side(args.rounds, fresh_packets, one_by_one)
        c_fresh = _counted(dev, fresh_packets)
        print(f"2. reused packets vs a new packet per dispatch: {t_fresh / t_reused:.2f}x faster "
              f"({t_fresh * 1e3:.1f} ms -> {t_reused * 1e3:.1f} ms per stage)")
        print(f"   ioctls per stage, new packets: {_ioctls(c_fresh)}")

        rows, width = 4096, 1024
        src = np.random.default_rng(3).standard_normal((rows, width), dtype=np.float32)
        big = dev.bo(rows * width * BF16)
        view = big.array(np.uint16, rows * width).reshape(rows, width)

        def wide() -> None:
            push(to_bf16(src), big)

        def by_row() -> None:
            for r in range(rows):
                view[r] = to_bf16(src[r])
            big.sync()

        t_row, t_wide = _side_by_side(args.rounds, by_row, wide)
        print(f"3. wide copy vs row by row ({rows}x{width} float32 -> bf16, {rows * width * BF16 >> 20} MiB): "
              f"{t_row / t_wide:.2f}x faster ({t_row * 1e3:.1f} ms -> {t_wide * 1e3:.1f} ms); "
              f"bytes copied per fill {rows * width * BF16}, SYNC_BO 1 both ways")
        for bo in (*runs, chain, big, a, w, c, ctx):
            bo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
