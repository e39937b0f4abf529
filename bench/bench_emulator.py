"""The emulator's own costs, measured side by side in one run (issue 14, emulator goals).

Run: ``python bench/bench_emulator.py [--rounds 7] [--dispatches 400]``

1. Buffer lookup against the number of live user mappings (10, 100, 1000, 2000): the scan the emulator used to do
   over every mapping (``scan_resolve``, kept here for the comparison) and ``Memory.resolve``'s sorted index
   (bisect), on the same table, every mapping looked up once per round in a shuffled order. Goal: O(log n).
   Then a passthrough dispatch's round trip with 10 and with 2000 extra mappings live (flat with the index).
2. A passthrough dispatch (64 bytes in, 64 out; ``Run.start`` + ``Run.wait`` on the emulator): its round trip with
   the model run on the context's worker (small compute-only models, the default) against the hand-off to the
   engine thread and back (``Firmware.inline_bytes = -1``), the firmware's own time per dispatch (packet, stream,
   buffers, model) and the model's. Goal: the hand-off costs no more than the model on small dispatches.
3. BLAS threads: host matmuls on the main thread while the emulator runs GEMMs on its engine, with the emulator's
   BLAS budget on (threads = cores // (running models + 1) inside model calls) and off. Goal: no oversubscription.

Counts (deterministic): buffer lookups per dispatch, model runs inline / on the engine, ioctls per dispatch, the BLAS
threads in force inside a model.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Runnable from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amdxdna_direct import insts, open_device, xclbin  # noqa: E402
from amdxdna_direct.device import TXN_DEV_GEN  # noqa: E402
from amdxdna_direct.emu import Gemm, Passthrough, blas  # noqa: E402
from amdxdna_direct.emu.memory import AMDXDNA_BO_SHMEM, PAGE_SIZE, Bo, DeviceFault, Memory  # noqa: E402

MAPPING_COUNTS = (10, 100, 1000, 2000)
NBYTES = 64


def scan_resolve(memory: Memory, addr: int, length: int) -> tuple[Bo, int]:
    """The lookup the emulator did before the index: every user mapping scanned in turn."""
    with memory._lock:
        for start, (size, bo, bo_offset) in memory.mappings.items():
            if start <= addr and addr + length <= start + size:
                return bo, bo_offset + addr - start
    raise DeviceFault(f"device access [{addr:#x}, {addr + length:#x}) is outside every BO")


def _side_by_side(rounds: int, a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """Median seconds of a and b, alternating which goes first each round (after one warm-up of each)."""
    ta, tb = [], []
    a(), b()
    for r in range(rounds):
        for fn, out in ((b, tb), (a, ta)) if r % 2 else ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


# --- 1. lookups ---------------------------------------------------------------------------------------------------

def _table(count: int) -> tuple[Memory, list[tuple[int, Bo]]]:
    """A Memory with `count` one-page mappings, a page apart, and (address, BO) of each."""
    memory = Memory(threading.RLock())
    base = 0x7F0000000000
    placed = []
    for i in range(count):
        bo = Bo(handle=i + 1, kind=AMDXDNA_BO_SHMEM, size=PAGE_SIZE, mem=memoryview(b""))
        addr = base + 2 * i * PAGE_SIZE
        memory.add_mapping(addr, PAGE_SIZE, bo)
        placed.append((addr, bo))
    return memory, placed


def bench_lookups(rounds: int) -> None:
    print("1. buffer lookup vs live mappings (us per lookup; every mapping once per round, shuffled)")
    print(f"   {'mappings':>8} {'scan (old)':>11} {'index':>8} {'ratio':>7}")
    for count in MAPPING_COUNTS:
        memory, placed = _table(count)
        random.Random(count).shuffle(placed)
        queries = [(addr + 64, 256, bo) for addr, bo in placed]
        for addr, length, bo in queries:        # the same answers both ways
            if scan_resolve(memory, addr, length) != (bo, 64) or memory.resolve(addr, length) != (bo, 64):
                raise RuntimeError(f"lookup of {addr:#x} with {count} mappings disagrees")

        def old(memory=memory, queries=queries) -> None:
            for addr, length, _ in queries:
                scan_resolve(memory, addr, length)

        def new(memory=memory, queries=queries) -> None:
            for addr, length, _ in queries:
                memory.resolve(addr, length)

        t_old, t_new = _side_by_side(rounds, old, new)
        per_old, per_new = t_old / count * 1e6, t_new / count * 1e6
        print(f"   {count:>8} {per_old:>11.2f} {per_new:>8.2f} {per_old / per_new:>6.1f}x")


# --- 2. passthrough dispatch ---------------------------------------------------------------------------------------

class _Passthrough:
    """A Passthrough run in one session: the device, its context, a prepared run and what it counts."""

    def __init__(self) -> None:
        self.dev = open_device("emu")
        self.emu = self.dev.emulator
        gen = TXN_DEV_GEN[self.dev.generation]
        self.stream = insts.encode(insts.dma_stream(gen, [(0, NBYTES, "in"), (1, NBYTES, "out")]))
        self.emu.models.bind(self.stream, Passthrough())
        pdi = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        self.ctx = self.dev.hw_context(xclbin.build_mlir_aie(pdi, column_width=1))
        self.a, self.b = self.dev.bo(NBYTES), self.dev.bo(NBYTES)
        self.a.write(np.arange(NBYTES, dtype=np.uint8))
        self.a.sync()
        self.run = self.ctx.kernel().prepare_npu(self.stream, [self.a, self.b])
        self.extra: list = []

    def dispatches(self, count: int) -> Callable[[], None]:
        def go() -> None:
            for _ in range(count):
                self.run.start().wait()
        return go

    def add_mappings(self, total: int) -> None:
        """Live user mappings up to `total` (one-page BOs, mapped by the runtime)."""
        while len(self.extra) < total:
            bo = self.dev.bo(PAGE_SIZE)
            bo.array(np.uint8, 1)[0] = 1         # map it: the device resolves SHMEM addresses through mappings
            bo.sync()
            self.extra.append(bo)

    def mappings(self) -> int:
        return self.emu.counters.live()["mappings"]

    def close(self) -> None:
        for bo in (self.run, *self.extra, self.a, self.b, self.ctx):
            bo.close()
        self.dev.close()


def _firmware_clock(emu) -> list[float]:
    """Wrap the firmware's per-job step with a clock (this bench's instrument; the list collects seconds per job)."""
    spent: list[float] = []
    execute = emu.firmware._execute

    def timed(lane, job):
        t0 = time.perf_counter()
        try:
            return execute(lane, job)
        finally:
            spent.append(time.perf_counter() - t0)

    emu.firmware._execute = timed
    return spent


def _model_time(repeats: int = 2000) -> float:
    src, dst = np.arange(NBYTES, dtype=np.uint8), np.zeros(NBYTES, np.uint8)
    model, args = Passthrough(), {0: src, 1: dst}
    t0 = time.perf_counter()
    for _ in range(repeats):
        model(args)
    return (time.perf_counter() - t0) / repeats


def bench_dispatch(rounds: int, count: int) -> None:
    session = _Passthrough()
    try:
        emu, fw = session.emu, session.emu.firmware
        inline_limit = fw.inline_bytes

        def inline() -> None:
            fw.inline_bytes = inline_limit
            session.dispatches(count)()

        def engine() -> None:
            fw.inline_bytes = -1
            session.dispatches(count)()

        t_inline, t_engine = _side_by_side(rounds, inline, engine)
        spent = _firmware_clock(emu)
        fw.inline_bytes = inline_limit
        session.dispatches(count)()
        fw_inline = statistics.median(spent)
        spent.clear()
        fw.inline_bytes = -1
        session.dispatches(count)()
        fw_engine = statistics.median(spent)
        fw.inline_bytes = inline_limit
        model = _model_time()
        per_inline, per_engine = t_inline / count * 1e6, t_engine / count * 1e6
        handoff = (fw_engine - fw_inline) * 1e6
        print(f"2. passthrough dispatch ({NBYTES} B in, {NBYTES} B out; start + wait; medians of {rounds} rounds of "
              f"{count})")
        print(f"   round trip: model on the worker {per_inline:.1f} us, handed to the engine {per_engine:.1f} us "
              f"({per_engine / per_inline:.2f}x)")
        print(f"   firmware per dispatch (packet, stream, buffers, model): on the worker {fw_inline * 1e6:.1f} us, "
              f"via the engine {fw_engine * 1e6:.1f} us; the model itself {model * 1e6:.2f} us")
        print(f"   engine hand-off {handoff:.1f} us = {handoff / (model * 1e6):.0f}x the model (goal <= 1x: small "
              f"compute-only models run on the worker, no hand-off)")
        _dispatch_counts(session)

        base = session.mappings()
        session.add_mappings(10)
        few = session.mappings()
        t_few = _side_by_side(rounds, session.dispatches(count), lambda: None)[0]
        session.add_mappings(2000)
        many = session.mappings()
        t_many = _side_by_side(rounds, session.dispatches(count), lambda: None)[0]
        print(f"   round trip with {few} live mappings {t_few / count * 1e6:.1f} us, with {many} "
              f"{t_many / count * 1e6:.1f} us ({t_many / t_few:.2f}x; the runtime's own {base} included)")
    finally:
        session.close()


def _dispatch_counts(session: _Passthrough) -> None:
    emu = session.emu
    memory = emu.clients[0].memory
    runs, lookups, ioctls = Counter(emu.firmware.runs), memory.lookups, Counter(emu.counters.ioctls)
    session.dispatches(10)()
    runs = Counter({k: v - runs[k] for k, v in emu.firmware.runs.items() if v - runs[k]})
    ioctls = Counter({k: v - ioctls[k] for k, v in emu.counters.ioctls.items() if v - ioctls[k]})
    print(f"   counts per dispatch: {(memory.lookups - lookups) / 10:g} buffer lookups; model runs "
          f"{dict(runs)} per 10; ioctls per 10: {', '.join(f'{k} {v}' for k, v in sorted(ioctls.items()))}")


# --- 3. BLAS threads -----------------------------------------------------------------------------------------------

class _ThreadProbe:
    """A Gemm model that also notes the BLAS thread count in force while it runs."""

    compute_only = True

    def __init__(self, model: Gemm):
        self.model, self.name, self.seen = model, model.name, Counter()

    def __call__(self, args: dict[int, np.ndarray]) -> None:
        self.seen[blas.threads()] += 1
        self.model(args)


def bench_blas(rounds: int) -> None:
    status = blas.status()
    cores = os.cpu_count()
    if status.reason != "limiting":
        print(f"3. BLAS threads: not measured: {status.reason}")
        return
    dim, host_reps, device_reps = 512, 12, 6
    dev = open_device("emu")
    try:
        gen = TXN_DEV_GEN[dev.generation]
        size = dim * dim * 2
        stream = insts.encode(insts.dma_stream(gen, [(0, size, "in"), (1, size, "in"), (2, size, "out")]))
        probe = _ThreadProbe(Gemm(dim, dim, dim, dim))
        dev.emulator.models.bind(stream, probe)
        pdi = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        ctx = dev.hw_context(xclbin.build_mlir_aie(pdi, column_width=1))
        bos = [dev.bo(size) for _ in range(3)]
        rng = np.random.default_rng(1)
        for bo in bos[:2]:
            bo.write_bf16(rng.standard_normal(dim * dim, dtype=np.float32) * 0.1)
            bo.sync()
        run = ctx.kernel().prepare_npu(stream, bos)
        host = rng.standard_normal((dim, dim), dtype=np.float32)

        def both() -> None:
            def device() -> None:
                for _ in range(device_reps):
                    run.start().wait()
            thread = threading.Thread(target=device)
            thread.start()
            for _ in range(host_reps):
                host @ host
            thread.join()

        def budget_on() -> None:
            blas.set_enabled(True)
            both()

        def budget_off() -> None:
            blas.set_enabled(False)
            both()

        t_on, t_off = _side_by_side(rounds, budget_on, budget_off)
        blas.set_enabled(True)
        probe.seen.clear()
        both()
        seen_on = dict(probe.seen)
        print(f"3. BLAS threads ({status.symbol}, {status.threads} threads, {cores} cores): {host_reps} host "
              f"{dim}^3 fp32 matmuls beside {device_reps} emulated {dim}^3 bf16 GEMMs (engine, medians of {rounds})")
        print(f"   budget on {t_on * 1e3:.1f} ms, off {t_off * 1e3:.1f} ms ({t_off / t_on:.2f}x); threads inside the "
              f"model with the budget on: {seen_on} (runs by thread count); after: {blas.threads()}")
        for obj in (run, *bos, ctx):
            obj.close()
    finally:
        blas.set_enabled(True)
        dev.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per comparison (default 7)")
    ap.add_argument("--dispatches", type=int, default=400, help="dispatches per round (default 400)")
    args = ap.parse_args(argv)
    bench_lookups(args.rounds)
    bench_dispatch(args.rounds, args.dispatches)
    bench_blas(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
