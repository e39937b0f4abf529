"""The emulator's fast paths keep their meaning: the sorted mapping index, small models run on the worker, the BLAS
thread budget (docs/emulator.md, "Lookups, hand-off and BLAS threads"; issue 14).

Oracles: a brute-force interval list kept beside the index through random map / unmap / split sequences; the
firmware's run counters; the BLAS thread count read back from the library numpy loaded.
"""

from __future__ import annotations

import threading

import pytest
from emu_raw import ERT_STATE_COMPLETED, ERT_STATE_ERROR, ERT_STATE_TIMEOUT, Gate, Npu, run_one, state_of
from hypothesis import given, settings
from hypothesis import strategies as st

from amdxdna_direct.emu import Gemm, Passthrough, blas
from amdxdna_direct.emu.memory import AMDXDNA_BO_SHMEM, PAGE_SIZE, Bo, DeviceFault, Memory

BASE = 0x7F0000000000


def fake_bo(handle: int, pages: int) -> Bo:
    return Bo(handle=handle, kind=AMDXDNA_BO_SHMEM, size=pages * PAGE_SIZE, mem=memoryview(b""))


def brute_resolve(intervals: list[tuple[int, int, Bo, int]], addr: int, length: int) -> tuple[Bo, int] | None:
    """The mapping holding `addr`, if the access also ends inside it and inside its BO; else None."""
    for start, size, bo, offset in intervals:
        if start <= addr < start + size:
            inside = addr + length <= start + size and offset + addr - start + length <= bo.size
            return (bo, offset + addr - start) if inside else None
    return None


ops = st.lists(st.tuples(st.sampled_from(["map", "unmap"]), st.integers(0, 63), st.integers(1, 8)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops, st.lists(st.tuples(st.integers(0, 72 * PAGE_SIZE), st.integers(1, 3 * PAGE_SIZE)), max_size=40))
def test_index_answers_as_a_scan_of_every_mapping(steps, probes):
    memory = Memory(threading.RLock())
    intervals: list[tuple[int, int, Bo, int]] = []     # the oracle: (start, size, bo, offset in bo)
    for handle, (kind, page, pages) in enumerate(steps, start=1):
        addr, length = BASE + page * PAGE_SIZE, pages * PAGE_SIZE
        removed = memory.remove_range(addr, length)
        kept, dropped = [], []
        for start, size, bo, offset in intervals:     # split what overlaps, as munmap does
            lo, hi = max(start, addr), min(start + size, addr + length)
            if lo >= hi:
                kept.append((start, size, bo, offset))
                continue
            dropped.append((lo, hi - lo, bo))
            if start < lo:
                kept.append((start, lo - start, bo, offset))
            if hi < start + size:
                kept.append((hi, start + size - hi, bo, offset + hi - start))
        assert sorted(removed, key=lambda r: r[0]) == sorted(dropped, key=lambda r: r[0])
        intervals = kept
        if kind == "map":
            bo = fake_bo(handle, pages + page % 3)          # sometimes larger than the mapping
            memory.add_mapping(addr, length, bo)
            intervals.append((addr, length, bo, 0))
        assert sorted(memory.mappings) == sorted(start for start, *_ in intervals)
    for offset, length in probes:
        addr = BASE + offset
        want = brute_resolve(intervals, addr, length)
        if want is None:
            with pytest.raises(DeviceFault):
                memory.resolve(addr, length)
        else:
            assert memory.resolve(addr, length) == want
        overlap = sorted((s, n, b, o) for s, n, b, o in intervals if s < addr + length and addr < s + n)
        assert memory.overlapping(addr, length) == overlap


@pytest.fixture
def npu():
    made = Npu(tdr=0.3)
    yield made
    made.close()


class Probe:
    """A compute-only passthrough that notes the thread it ran on and the BLAS threads in force."""

    compute_only = True
    name = "probe"

    def __init__(self):
        self.threads: list[str] = []
        self.blas: list[int | None] = []

    def __call__(self, args) -> None:
        self.threads.append(threading.current_thread().name)
        self.blas.append(blas.threads())
        Passthrough()(args)


def test_small_compute_only_models_run_on_the_worker(npu):
    ctx, syncobj = npu.context()
    small = Probe()
    job = npu.passthrough(tag=1, model=small)
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
    assert npu.output(job) == job["src"]
    assert npu.dev.firmware.runs == {"inline": 1}
    assert small.threads == [f"emu-ctx{ctx}"]                      # the worker, not the engine
    # A model that does not say it only computes (it may wait: Gate) runs on the engine, as before.
    gate = Gate()
    gate.release.set()
    assert run_one(npu, ctx, syncobj, npu.passthrough(tag=2, model=gate)) == ERT_STATE_COMPLETED
    # Over the byte limit, the engine too.
    npu.dev.firmware.inline_bytes = 63
    big = Probe()
    assert run_one(npu, ctx, syncobj, npu.passthrough(tag=3, model=big)) == ERT_STATE_COMPLETED
    assert big.threads == [f"emu-ctx{ctx}-engine"]
    assert npu.dev.firmware.runs == {"inline": 1, "engine": 2}


def test_an_injected_hang_still_times_out(npu):
    """A hang goes to the engine whatever the model: the TDR watches the engine's CPU clock."""
    ctx, syncobj = npu.context()
    job = npu.passthrough(tag=1, model=Probe())
    npu.dev.faults.hang(job["stream"])
    npu.raw.timeline_wait(syncobj, npu.exec(ctx, job))
    assert state_of(job["cmd_addr"]) == ERT_STATE_TIMEOUT
    assert npu.dev.firmware.runs == {"engine": 1}


def test_a_fault_in_an_inline_model_is_the_commands_reason(npu):
    """A built-in model run on the worker fails as on the engine: ERROR, with the model's own message."""
    ctx, syncobj = npu.context()
    model = Gemm(4, 8, 16, 8)
    job = npu.passthrough(nbytes=model.b_bytes, tag=1, model=model)   # two buffers: C (arg 2) is missing
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_ERROR
    assert npu.seam.command_reason(ctx, 0) == (f"device fault in {model.name}: {model.name}: C (arg 2) is not "
                                               f"patched into the stream")
    assert npu.dev.firmware.runs == {"inline": 1}


def blas_or_skip() -> blas.BlasStatus:
    status = blas.status()
    if status.reason != "limiting":
        pytest.skip(f"numpy's BLAS has no thread control this emulator knows: {status.reason}")
    return status


def test_blas_budget_shares_the_threads_while_models_run():
    status = blas_or_skip()
    full = status.threads
    assert blas.threads() == full
    with blas.limited():
        assert blas.threads() == max(1, full // 2)
        with blas.limited():
            assert blas.threads() == max(1, full // 3)
        assert blas.threads() == max(1, full // 2)
    assert blas.threads() == full
    blas.set_enabled(False)
    try:
        with blas.limited():
            assert blas.threads() == full
    finally:
        blas.set_enabled(True)


def test_models_on_the_engine_run_under_the_budget(npu):
    full = blas_or_skip().threads
    ctx, syncobj = npu.context()
    npu.dev.firmware.inline_bytes = -1
    probe = Probe()
    assert run_one(npu, ctx, syncobj, npu.passthrough(tag=1, model=probe)) == ERT_STATE_COMPLETED
    npu.dev.firmware.inline_bytes = 1 << 20
    assert run_one(npu, ctx, syncobj, npu.passthrough(tag=2, model=probe)) == ERT_STATE_COMPLETED
    assert probe.blas == [max(1, full // 2), full]         # engine: one share beside the host; worker: untouched
    assert blas.threads() == full
