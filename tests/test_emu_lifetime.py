"""Lifetimes across threads: munmap of a mapping in-flight jobs use, device loss and close with waiters blocked.

Oracles: docs/uapi.md 7 (lifetime: "munmap/invalidation of a mapped arg BO blocks until the BO's
fences signal"), docs/driver-rules.md D5 (after loss every ioctl answers ENODEV) and E6, the passthrough data
each job must produce, and the device counters (nothing live after close). Every wait is bounded; a gate
model holds a job open until the test releases it.
"""

from __future__ import annotations

import errno
import struct
import threading
import time

import numpy as np
import pytest
from emu_raw import (
    ERT_STATE_ABORT,
    ERT_STATE_COMPLETED,
    ERT_STATE_NEW,
    WAIT_FOR_SUBMIT,
    Gate,
    Npu,
    UserMem,
    call,
    check_message,
    check_released,
    monotonic_ns,
    read_addr,
    state_of,
)

PROMPT_S = 1.0          # "promptly": far below the 2 s TDR that used to be the only way out


def slot_addr(job: dict, k: int) -> int:
    """Regmap buffer slot k of a passthrough job (words: opcode, instr, ninstr, then u64 slots)."""
    return job["words"][5 + 2 * k] | job["words"][6 + 2 * k] << 32


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """Run fn(*args) in a thread; the list gets its result or the exception it raised."""
    out: list = []

    def body() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:        # reported to the test through `out`
            out.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def wait_state(addr: int, want: int, bound: float = 5.0) -> int:
    """Poll a command header until its state is `want` (bounded); returns the last state seen."""
    end = time.monotonic() + bound
    while (state := state_of(addr)) != want and time.monotonic() < end:
        time.sleep(0.01)
    return state


@pytest.fixture
def npu():
    made = Npu()
    yield made
    made.close()


def gated_pair(npu: Npu):
    """A context running a gated job, with a second job queued behind it: (ctx, syncobj, gate, first, second)."""
    ctx, syncobj = npu.context()
    gate = Gate()
    first, second = npu.passthrough(tag=1, model=gate), npu.passthrough(tag=2)
    assert [npu.exec(ctx, first), npu.exec(ctx, second)] == [0, 1]
    assert gate.entered.wait(2)
    return ctx, syncobj, gate, first, second


def test_munmap_of_an_argument_mapping_waits_for_its_jobs(npu):
    """The queued job resolves its buffers through the user mappings (SVA) when it runs: munmap must wait
    for it (it used to unmap at once, and the job failed ERROR with "device access outside every BO")."""
    _, syncobj, gate, first, second = gated_pair(npu)
    # Not arguments of a job in flight: the command BO (the driver keeps its own reference), a spare buffer.
    spare, spare_addr = npu.data(4096)
    mappings = npu.dev.counters.live()["mappings"]
    started = time.monotonic()
    npu.seam.munmap(first["cmd_addr"], 4096)
    npu.seam.munmap(spare_addr, 4096)
    assert time.monotonic() - started < PROMPT_S
    unmapper, done = in_thread(lambda: [npu.seam.munmap(slot_addr(job, k), 4096)
                                        for job in (first, second) for k in (0, 1)])
    unmapper.join(0.3)
    assert unmapper.is_alive() and not done                 # held while the gate holds the first job
    mapper, _ = in_thread(npu.data, 4096)                   # another thread's mmap waits for the mm lock
    mapper.join(0.1)
    assert mapper.is_alive()
    assert npu.raw.query(syncobj, flags=1) == 1             # ioctls of any thread go through meanwhile
    gate.release.set()
    unmapper.join(5)
    mapper.join(5)
    assert done == [[None] * 4] and not mapper.is_alive()
    npu.raw.timeline_wait(syncobj, 1)
    assert npu.dev.counters.live()["mappings"] == mappings - 6 + 1
    for job in (first, second):
        cmd = npu.raw.map_bo(job["cmd"], 4096)
        assert state_of(cmd) == ERT_STATE_COMPLETED
        out = npu.raw.map_bo(job["args"][2], 4096)
        npu.raw.sync(job["args"][2], 4096)
        assert read_addr(out, job["nbytes"]) == job["src"]


def test_fd_close_and_device_close_with_munmap_blocked():
    """A munmap waiting for a job does not deadlock the fd's release nor EmuDevice.close."""
    npu = Npu()
    _, _, gate, first, _ = gated_pair(npu)
    unmapper, done = in_thread(npu.seam.munmap, slot_addr(first, 1), 4096)
    unmapper.join(0.2)
    closer, closed = in_thread(npu.seam.close)             # the release waits for the context's jobs
    closer.join(0.2)
    assert unmapper.is_alive() and closer.is_alive()
    gate.release.set()
    unmapper.join(5)
    closer.join(5)
    assert done == [None] and closed == [None]
    check_released(npu.dev)
    npu.dev.close()

    npu = Npu(tdr=30.0)
    _, _, gate, first, _ = gated_pair(npu)
    unmapper, done = in_thread(npu.seam.munmap, slot_addr(first, 1), 4096)
    unmapper.join(0.2)
    closer, closed = in_thread(npu.dev.close)
    unmapper.join(PROMPT_S)
    assert done == [None] and closer.is_alive()           # close ends the wait before the gate opens
    gate.release.set()
    closer.join(5)
    assert closed == [None]
    check_released(npu.dev)


def syncobj_wait(npu: Npu, syncobj: int) -> None:
    handles = UserMem(struct.pack("<I", syncobj))
    call(npu.seam, "SYNCOBJ_WAIT", handles.addr, monotonic_ns() + 10 * 10**9, 1, WAIT_FOR_SUBMIT, 0)


def test_lose_device_wakes_every_blocked_waiter():
    """Rule D5: waiters blocked on a gated job wake with ENODEV at once (they used to wait for the TDR, or for
    ever with the gate), the jobs in flight end ABORT, and close leaves nothing live."""
    npu = Npu(tdr=30.0, wait_cmd=True)
    ctx, syncobj, gate, first, second = gated_pair(npu)
    others = [npu.passthrough(tag=3 + i) for i in range(2)]
    assert [npu.exec(ctx, job) for job in others] == [2, 3]
    waiters = [in_thread(npu.raw.timeline_wait, syncobj, 1, 10.0), in_thread(syncobj_wait, npu, syncobj),
               in_thread(call, npu.seam, "WAIT_CMD", ctx, 0, 0),       # the running job
               in_thread(npu.exec, ctx, npu.passthrough(tag=9)),            # a fifth EXEC_CMD: no free slot
               in_thread(npu.seam.munmap, slot_addr(second, 1), 4096)]      # the device no longer needs it
    for thread, _ in waiters:
        thread.join(0.05)
    assert all(thread.is_alive() for thread, _ in waiters)
    started = time.monotonic()
    npu.dev.faults.lose_device()
    for thread, _ in waiters:
        thread.join(PROMPT_S)
    assert time.monotonic() - started < PROMPT_S
    results = [out for _, out in waiters]
    assert results[-1] == [None]
    for (out,), op in zip(results[:-1], ("SYNCOBJ_TIMELINE_WAIT", "SYNCOBJ_WAIT", "WAIT_CMD", "EXEC_CMD"),
                          strict=True):
        assert isinstance(out, OSError) and out.errno == errno.ENODEV, out
        check_message(out, op)
    for job in (second, *others):                           # queued: aborted at once
        assert wait_state(job["cmd_addr"], ERT_STATE_ABORT, PROMPT_S) == ERT_STATE_ABORT
    assert state_of(first["cmd_addr"]) == ERT_STATE_NEW     # running: its model cannot be interrupted
    gate.release.set()
    assert wait_state(first["cmd_addr"], ERT_STATE_ABORT) == ERT_STATE_ABORT
    npu.seam.close()
    npu.dev.close()
    check_released(npu.dev)


def test_a_wait_the_loss_itself_ends_answers_enodev():
    """Issue 13 item 6: a WAIT_CMD blocked on a queued job, which the loss ends ABORT at once, used to return 0 (the
    fence had signalled before the waiter looked at the device), so a runtime saw a plain ABORT. The loss is
    reported at the wait itself: ENODEV, and the command's reason says the device was lost."""
    npu = Npu(tdr=30.0, wait_cmd=True)
    ctx, syncobj, gate, first, second = gated_pair(npu)
    thread, out = in_thread(call, npu.seam, "WAIT_CMD", ctx, 0, 1)       # no timeout, seq 1: queued
    with npu.dev.cond:
        assert npu.dev.cond.wait_for(lambda: npu.seam.client.users == 1, 5)   # the wait is inside the driver
    thread.join(0.05)
    npu.dev.faults.lose_device()
    thread.join(PROMPT_S)
    assert len(out) == 1 and isinstance(out[0], OSError) and out[0].errno == errno.ENODEV, out
    check_message(out[0], "WAIT_CMD")
    assert state_of(second["cmd_addr"]) == ERT_STATE_ABORT
    assert npu.seam.command_reason(ctx, 1) == "aborted before it ran: the device was lost"
    gate.release.set()
    assert wait_state(first["cmd_addr"], ERT_STATE_ABORT) == ERT_STATE_ABORT
    npu.seam.close()
    npu.dev.close()
    check_released(npu.dev)


def test_bad_munmap_fails_before_waiting(npu):
    """munmap's own EINVAL checks (unaligned address, empty range) come before any wait for the device."""
    _, syncobj, gate, first, _ = gated_pair(npu)
    out = slot_addr(first, 1)
    started = time.monotonic()
    for addr, length in ((out + 8, 4096), (out, 0)):
        with pytest.raises(OSError) as err:
            npu.seam.munmap(addr, length)
        assert err.value.errno == errno.EINVAL and "EINVAL" in str(err.value) and "munmap" in str(err.value)
    assert time.monotonic() - started < PROMPT_S
    gate.release.set()
    npu.raw.timeline_wait(syncobj, 1)
    assert npu.output(first) == first["src"]


def maps_entry(addr: int) -> str | None:
    """The /proc/self/maps line of the mapping holding `addr`, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line
    return None


def test_fd_close_keeps_left_mappings_reserved():
    """Closing an fd with mappings left takes their pages but keeps their addresses reserved (PROT_NONE): they
    used to be unmapped, so the next mmap of anyone could get them and the user's late munmap (or a stray
    write) then hit that memory."""
    npu = Npu()
    job = npu.passthrough()
    out = job["out"]
    assert maps_entry(out).split()[1].startswith("rw-s")
    npu.seam.close()
    check_released(npu.dev)
    for addr in (out, npu.heap_va):
        entry = maps_entry(addr)
        assert entry is not None and entry.split()[1] == "---p", entry
    npu.seam.munmap(out, 4096)                              # the user's late munmap releases the reservation
    npu.seam.munmap(npu.heap_va, 64 << 20)
    npu.dev.close()


def test_seam_address_arguments_must_be_ints(npu):
    """mmap/munmap/reserve name a non-int argument (they used to fail inside message formatting: a ValueError
    "Unknown format code" or a TypeError from %-formatting) and take numpy integers (ctypes refused them)."""
    for call_, op, field in ((lambda: npu.seam.mmap("4096", 1 << 32), "mmap", "length"),
                             (lambda: npu.seam.munmap(npu.heap_va, 4096.0), "munmap", "length"),
                             (lambda: npu.seam.reserve(4096, None), "reserve", "alignment")):
        with pytest.raises(TypeError, match=f"{op}: {field} must be an int"):
            call_()
    handle = npu.raw.create_bo(4096, 1)
    addr = npu.seam.mmap(np.int64(4096), np.uint64(npu.raw.bo_info(handle).map_offset))
    npu.seam.munmap(np.uint64(addr), np.int32(4096))
    npu.raw.gem_close(handle)


def test_map_fixed_over_an_argument_mapping_waits_for_its_jobs(npu):
    """MAP_FIXED unmaps what it replaces, with munmap's wait: the queued job still reads its own input (it used
    to find the replacement BO at that address)."""
    _, syncobj, gate, _, second = gated_pair(npu)
    src_addr = slot_addr(second, 0)
    other, _ = npu.data(4096, b"\xee" * 4096)
    mapper, mapped = in_thread(npu.raw.map_bo, other, 4096, src_addr)
    mapper.join(0.3)
    assert mapper.is_alive() and not mapped
    gate.release.set()
    mapper.join(5)
    assert mapped == [src_addr] and read_addr(src_addr, 4) == b"\xee" * 4
    npu.raw.timeline_wait(syncobj, 1)
    assert state_of(second["cmd_addr"]) == ERT_STATE_COMPLETED
    assert npu.output(second) == second["src"]
