"""The emulated driver against docs/driver-rules.md: one test per rule D*, H*, B*, I* (E* live in test_emu_exec.py).

Every test drives the emulator with raw request numbers and structs packed by hand (tests/emu_raw.py,
from the ABI facts) and checks the errno or the effect the spec names.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import os
import struct
import threading
import time
from pathlib import Path

import pytest
from emu_raw import (
    BO_CMD,
    BO_DEV,
    BO_DEV_HEAP,
    BO_SHMEM,
    ERT_START_CU,
    ERT_STATE_ABORT,
    ERT_STATE_COMPLETED,
    FMT,
    HEAP_BASE,
    INVALID_ADDR,
    IOW,
    IOWR,
    PAGE,
    WAIT_FOR_SUBMIT,
    Gate,
    Raw,
    UserMem,
    call,
    check_released,
    emu_device,
    errno_of,
    ioc,
    monotonic_ns,
    pack,
    packet,
    read_addr,
    regmap,
    request,
    state_of,
    unpack,
    write_addr,
)
from fixture_files import REPO_FIXTURES, SHARED

from amdxdna_direct.emu import PROFILES, DeviceFault, EmuDevice, Passthrough
from amdxdna_direct.emu.contexts import map_priority

NPU1_1COL = REPO_FIXTURES / "xdna" / "mlir-aie-npu1_1col"
KIB = 1 << 10
MIB = 1 << 20
QUERY_HW_CONTEXTS, QUERY_AIE_STATUS, QUERY_AIE_METADATA, QUERY_AIE_VERSION = 5, 0, 1, 2
QUERY_CLOCK_METADATA, QUERY_SENSORS, QUERY_FIRMWARE_VERSION, GET_POWER_MODE, QUERY_RESOURCE_INFO = 3, 4, 8, 9, 12
HW_CONTEXT_ALL, HW_LAST_ASYNC_ERR, BO_USAGE = 0, 2, 6
HWCTX_ENTRY_SIZE = 144


# ---------------------------------------------------------------------------------------------- helpers

@pytest.fixture
def dev():
    with emu_device("npu4", tdr_timeout=5.0) as device:     # whatever a test leaves, close must release
        yield device


@pytest.fixture
def raw(dev):
    return Raw(dev.open())


@pytest.fixture
def spatial():
    """An fd on npu4 under Linux 6.18, whose placement is spatial (7.0's NPU4 is temporal-only, S14)."""
    with emu_device("npu4:linux-6.18", tdr_timeout=5.0) as device:
        yield Raw(device.open())


def hw_contexts(raw: Raw) -> list[tuple]:
    """QUERY_HW_CONTEXTS entries: (context_id, start_col, num_col, pid, submissions, completions, errors)."""
    data, left = raw.get_info(QUERY_HW_CONTEXTS, 64 * 32)
    count = (64 * 32 - left) // 64
    entries = [struct.unpack_from("<IIIIqQQQQQ", data, 64 * i) for i in range(count)]
    return [(e[0], e[1], e[2], e[4], e[5], e[6], e[9]) for e in entries]


def get_array(raw: Raw, param: int, element_size: int, num_element: int, pad: int = 0,
              prefill: bytes = b"") -> tuple[bytes, int, int]:
    mem = UserMem(max(element_size * num_element, len(prefill), 1))
    mem.write(prefill)
    values = call(raw.seam, "GET_ARRAY", param, element_size, num_element, pad, mem.addr)
    return mem.read(), values[1], values[2]


def set_state(raw: Raw, param: int, payload: bytes) -> None:
    mem = UserMem(payload)
    call(raw.seam, "SET_STATE", param, len(payload), mem.addr)


def timeline_wait(raw: Raw, handle: int, point: int, deadline_ns: int, flags: int = 0, count: int = 1) -> tuple:
    handles = UserMem(struct.pack("<I", handle))
    points = UserMem(struct.pack("<Q", point))
    return call(raw.seam, "SYNCOBJ_TIMELINE_WAIT", handles.addr, points.addr, deadline_ns, count, flags, 0)


def cmd_bo(raw: Raw, packet: bytes, size: int = PAGE) -> tuple[int, int]:
    handle, addr = raw.shmem(size, BO_CMD)
    write_addr(addr, packet)
    return handle, addr


class Npu1Job:
    """The real mlir-aie npu1_1col stream set up on an npu1 fd: heap, context, PDI, instructions, data."""

    def __init__(self, dev: EmuDevice, raw: Raw, model):
        if not NPU1_1COL.is_dir():
            pytest.skip(f"fixtures absent: {NPU1_1COL}")
        self.insts = (NPU1_1COL / "insts.bin").read_bytes()
        dev.models.bind(self.insts, model)
        self.raw = raw
        raw.heap(64 * MIB)
        self.ctx, self.syncobj = raw.create_hwctx(4)
        pdi, _ = raw.dev_bo(PAGE)
        raw.config_cu(self.ctx, [(pdi, 0)])
        self.instr, info = raw.dev_bo(len(self.insts))
        write_addr(info.vaddr, self.insts)
        raw.sync(self.instr, len(self.insts))
        self.instr_addr = info.xdna_addr
        self.src, self.src_addr = raw.shmem(PAGE)
        self.dst, self.dst_addr = raw.shmem(PAGE)
        write_addr(self.src_addr, bytes(range(256)) * 16)
        raw.sync(self.src, PAGE)

    def submit(self) -> tuple[int, int]:
        """A fresh command BO with the 15-word regmap (bo0 = src, bo2 = dst); returns (seq, cmd address)."""
        words = regmap(self.instr_addr, len(self.insts) // 4, [self.src_addr, 0, self.dst_addr], nslots=5)
        handle, addr = cmd_bo(self.raw, packet(ERT_START_CU, words))
        return self.raw.exec_cmd(self.ctx, handle, [self.src, self.dst, self.instr]), addr


# ---------------------------------------------------------------------------------------------- D: DRM core

def test_rule_D1(raw):
    bad_type = ioc(IOWR, 0x43, struct.calcsize(FMT["create_bo"]), type_byte=ord("e"))
    assert errno_of(raw.seam.ioctl, bad_type, pack("create_bo", 0, 0, PAGE, BO_SHMEM, 0)) == errno.ENOTTY


def test_rule_D2(raw):
    assert errno_of(raw.seam.ioctl, ioc(IOWR, 0x60, 16), bytearray(16)) == errno.EINVAL     # beyond the table
    assert errno_of(raw.seam.ioctl, ioc(IOWR, 0x55, 16), bytearray(16)) == errno.EINVAL     # core nr not modelled
    with emu_device("npu4", drm_minor=6) as old:     # 6.18-7.0: slot 9 is an empty slot
        seam = old.open()
        assert errno_of(seam.ioctl, request("WAIT_CMD"), pack("wait_cmd", 1, 0, 0)) == errno.EINVAL
        with emu_device("npu4", drm_minor=0) as first:   # 6.14: no GET_ARRAY at nr 0x4A
            assert errno_of(first.open().ioctl, request("GET_ARRAY"), pack("get_array", 0, 8, 1, 0, 0)) == errno.EINVAL


def test_rule_D3(raw):
    handle = raw.create_bo(PAGE, BO_SHMEM)
    # A user struct of 24 bytes: type and handle are zero-filled by DRM, so type 0 is rejected.
    short = bytearray(struct.pack("<QQQ", 0, 0, PAGE))
    assert errno_of(raw.seam.ioctl, ioc(IOWR, 0x43, 24), short) == errno.EINVAL
    # A longer user struct: all 56 bytes go in and come back; the tail the kernel ignores is unchanged.
    longer = bytearray(struct.pack(FMT["get_bo_info"], 0, 0, handle, 0, 0, 0, 0) + b"\xaa" * 8)
    raw.seam.ioctl(ioc(IOWR, 0x44, 56), longer)
    assert longer[48:] == b"\xaa" * 8
    assert unpack("get_bo_info", longer)[4] == raw.bo_info(handle).map_offset
    # A user struct shorter than the outputs: only the user's 24 bytes are copied back.
    clipped = bytearray(struct.pack("<QQII", 0, 0, handle, 0)) + b"\x55" * 8
    raw.seam.ioctl(ioc(IOWR, 0x44, 24), clipped)
    assert clipped[24:] == b"\x55" * 8
    # The same request encoded IOW: the handler runs but nothing is copied back.
    iow = pack("get_bo_info", 0, 0, handle, 0, 7, 7, 7)
    raw.seam.ioctl(ioc(IOW, 0x44, 48), iow)
    assert unpack("get_bo_info", iow)[4:] == (7, 7, 7)


def test_rule_D4():
    payload = struct.pack("<B7x", 0)
    for admin, expected in ((False, errno.EACCES), (True, None)):
        with emu_device("npu4", cap_sys_admin=admin) as device:
            raw = Raw(device.open())
            if expected is None:
                set_state(raw, 0, payload)
            else:
                assert errno_of(set_state, raw, 0, payload) == expected


def test_rule_D5(dev, raw):
    handle = raw.create_bo(PAGE, BO_SHMEM)
    offset = raw.bo_info(handle).map_offset
    dev.faults.lose_device()
    assert errno_of(call, raw.seam, "VERSION", 0, 0, 0, 0, 0, 0, 0, 0, 0) == errno.ENODEV
    assert errno_of(raw.create_bo, PAGE, BO_SHMEM) == errno.ENODEV
    assert errno_of(raw.gem_close, handle) == errno.ENODEV
    assert errno_of(raw.seam.mmap, PAGE, offset) == errno.ENODEV
    assert errno_of(dev.open) == errno.ENODEV


def test_rule_D6(dev, raw):
    name, date, desc = UserMem(64), UserMem(64), UserMem(64)
    values = call(raw.seam, "VERSION", 9, 9, 9, 4, name.addr, 64, date.addr, 64, desc.addr)
    assert values[:3] == (0, dev.profile.drm_minor, 0)
    assert name.read(0, 5) == b"amdx\0"                  # truncated to the 4 bytes offered
    assert values[3] == len("amdxdna_accel_driver")      # full length reported
    assert date.read(0, values[5]) == b"0"
    assert desc.read(0, values[7]) == b"AMD XDNA DRM implementation"
    # Lengths only (NULL buffers): the full lengths come back, nothing is written.
    assert call(raw.seam, "VERSION", 0, 0, 0, 0, 0, 0, 0, 0, 0)[3::2] == (20, 1, 27)
    with emu_device("npu1", drm_minor=6) as old:
        assert call(old.open(), "VERSION", 0, 0, 0, 0, 0, 0, 0, 0, 0)[1] == 6


def test_rule_D7():
    # Coherent: the output is read after its handle is gone, when no SYNC_BO can bring the device's write back.
    with emu_device("npu1", tdr_timeout=10.0, coherent=True) as dev:
        raw = Raw(dev.open())
        assert errno_of(raw.gem_close, 77) == errno.EINVAL
        gate = Gate()
        job = Npu1Job(dev, raw, gate)
        live = dev.counters.live()["bos"]
        seq, cmd_addr = job.submit()
        assert gate.entered.wait(5)
        raw.gem_close(job.dst)                   # only the handle goes; the job still holds the BO
        assert errno_of(raw.bo_info, job.dst) == errno.ENOENT
        assert dev.counters.live()["bos"] == live + 1       # + the command BO, nothing released
        gate.release.set()
        raw.timeline_wait(job.syncobj, seq)
        assert state_of(cmd_addr) == ERT_STATE_COMPLETED
        # Written through the kept BO: the fixture's shim BD moves 16 words (64 bytes).
        assert read_addr(job.dst_addr, PAGE) == bytes(range(64)) + bytes(PAGE - 64)


def test_rule_D8(raw):
    now = monotonic_ns()
    signalled = call(raw.seam, "SYNCOBJ_CREATE", 0, 1)[0]
    empty = call(raw.seam, "SYNCOBJ_CREATE", 0, 0)[0]
    assert (signalled, empty) == (1, 2)
    assert errno_of(call, raw.seam, "SYNCOBJ_CREATE", 0, 2) == errno.EINVAL
    timeline_wait(raw, signalled, 0, now)                                     # CREATE_SIGNALED: ready
    assert errno_of(timeline_wait, raw, empty, 0, now) == errno.EINVAL        # nothing submitted
    assert errno_of(timeline_wait, raw, 99, 0, now) == errno.ENOENT
    assert errno_of(timeline_wait, raw, empty, 0, now, count=0) == errno.EINVAL
    start = time.monotonic()
    deadline = monotonic_ns() + 200_000_000                                   # absolute CLOCK_MONOTONIC
    assert errno_of(timeline_wait, raw, empty, 1, deadline, WAIT_FOR_SUBMIT) == errno.ETIME
    assert 0.15 <= time.monotonic() - start < 2.0
    raw.timeline_signal(empty, 5)
    assert raw.query(empty) == 5
    timeline_wait(raw, empty, 3, now)                                        # first link >= 3 is 5
    assert errno_of(timeline_wait, raw, empty, 6, now) == errno.EINVAL
    # A waiter blocked on an unsubmitted point with WAIT_FOR_SUBMIT wakes when it is signalled.
    waiter = threading.Thread(target=timeline_wait, args=(raw, empty, 9, monotonic_ns() + 5 * 10**9, WAIT_FOR_SUBMIT))
    waiter.start()
    time.sleep(0.05)
    raw.timeline_signal(empty, 9)
    waiter.join(5)
    assert not waiter.is_alive() and raw.query(empty) == 9
    timeline_wait(raw, empty, 2, now)                                        # covered by a pruned link
    # The old 40-byte and new 48-byte TIMELINE_WAIT and 32/40-byte WAIT structs are all accepted.
    handles, points = UserMem(struct.pack("<I", empty)), UserMem(struct.pack("<Q", 9))
    for size in (40, 48):
        raw.seam.ioctl(ioc(IOWR, 0xCA, size), pack("syncobj_timeline_wait", handles.addr, points.addr, now, 1, 0, 0)
                       .ljust(size, b"\0"))
    for size in (32, 40):
        raw.seam.ioctl(ioc(IOWR, 0xC3, size), pack("syncobj_wait", handles.addr, now, 1, 0, 0).ljust(size, b"\0"))
    # Binary RESET drops the fence (nothing to wait on), SIGNAL installs a signalled one.
    call(raw.seam, "SYNCOBJ_RESET", handles.addr, 1, 0)
    assert errno_of(timeline_wait, raw, empty, 0, now) == errno.EINVAL
    call(raw.seam, "SYNCOBJ_SIGNAL", handles.addr, 1, 0)
    timeline_wait(raw, empty, 0, now)
    assert errno_of(call, raw.seam, "SYNCOBJ_SIGNAL", handles.addr, 0, 0) == errno.EINVAL     # count 0
    call(raw.seam, "SYNCOBJ_DESTROY", empty, 0)
    assert errno_of(call, raw.seam, "SYNCOBJ_DESTROY", empty, 0) == errno.EINVAL


def test_rule_D8_point_zero_waits_for_latest():
    with emu_device("npu1", tdr_timeout=10.0) as dev:
        raw = Raw(dev.open())
        gate = Gate()
        job = Npu1Job(dev, raw, gate)
        gate.release.set()
        first, _ = job.submit()
        raw.timeline_wait(job.syncobj, first)
        gate.release.clear()
        second, _ = job.submit()
        assert gate.entered.wait(5)
        # seq 0 is signalled, yet point 0 means "the latest fence", which is still pending.
        assert errno_of(timeline_wait, raw, job.syncobj, first, monotonic_ns()) == errno.ETIME
        assert (raw.query(job.syncobj), raw.query(job.syncobj, flags=1)) == (first, second)
        gate.release.set()
        timeline_wait(raw, job.syncobj, 0, monotonic_ns() + 5 * 10**9)
        assert raw.query(job.syncobj) == second == 1


# ---------------------------------------------------------------------------------------------- H: contexts

def test_rule_H1(raw):
    raw.heap()
    qos = UserMem(24)
    for ext, ext_flags in ((1, 0), (0, 1)):
        assert errno_of(call, raw.seam, "CREATE_HWCTX", ext, ext_flags, qos.addr, 0, 0, 0, 4, 0, 0, 0, 0) \
            == errno.EINVAL


def test_rule_H2(raw):
    # Checked before the heap: no heap exists, yet the answer is EFAULT.
    assert errno_of(call, raw.seam, "CREATE_HWCTX", 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0) == errno.EFAULT
    protected = raw.seam.reserve(PAGE, PAGE)         # PROT_NONE: unreadable
    assert errno_of(call, raw.seam, "CREATE_HWCTX", 0, 0, protected, 0, 0, 0, 4, 0, 0, 0, 0) == errno.EFAULT
    # 24 readable bytes at the very end of a readable page are enough (the driver reads 24).
    page = raw.seam.reserve(2 * PAGE, PAGE)
    raw.seam.munmap(page, 2 * PAGE)
    buf = (ctypes.c_char * (2 * PAGE))()
    end = (ctypes.addressof(buf) + PAGE) & ~(PAGE - 1)
    raw.heap()
    call(raw.seam, "CREATE_HWCTX", 0, 0, end - 24, 0, 0, 0, 4, 0, 0, 0, 0)


def test_rule_H3(raw):
    assert errno_of(raw.create_hwctx) == errno.ENOENT
    raw.create_bo(64 * MIB, BO_DEV_HEAP)
    assert errno_of(raw.create_hwctx) == errno.EINVAL


def test_rule_H4(raw):
    raw.heap(4 * 32 * KIB)
    raw.create_hwctx()
    assert errno_of(raw.create_hwctx) == errno.ENOSPC
    assert errno_of(raw.dev_bo, PAGE) == errno.ENOSPC     # the first context took all four 32 KiB slots


def test_rule_H4_placement_after_context(raw):
    raw.heap()
    raw.create_hwctx()
    assert raw.dev_bo(PAGE)[1].xdna_addr == HEAP_BASE + 4 * 32 * KIB


def test_rule_H5(spatial):
    raw = spatial
    raw.heap()
    for tiles in (0, 3, 4 * 9):                  # zero tiles, zero columns, more columns than npu4 has
        assert errno_of(raw.create_hwctx, tiles) == errno.EINVAL
    raw.create_hwctx(8 + 3)                      # 11 tiles -> 2 columns
    assert hw_contexts(raw)[0][2] == 2


def test_rule_H6():
    with emu_device("npu1") as dev:
        raw = Raw(dev.open())
        raw.heap()
        a, _ = raw.create_hwctx(8)
        b, _ = raw.create_hwctx(8)
        assert errno_of(raw.create_hwctx, 4) == errno.ENODEV      # no free column, no 1-column partition
        c, _ = raw.create_hwctx(8)                                # shares the first 2-column partition
        placed = {ctx: (start, cols) for ctx, start, cols, *_ in hw_contexts(raw)}
        assert placed == {a: (1, 2), b: (3, 2), c: (1, 2)}
    with emu_device("npu1") as full:
        raw = Raw(full.open())
        raw.heap()
        raw.create_hwctx(4 * 5)
        assert hw_contexts(raw)[0][1:3] == (0, 5)                 # only a full partition uses column 0
    with emu_device("npu6:linux-6.18") as aligned:
        raw = Raw(aligned.open())
        raw.heap()
        for tiles in (4, 8, 16, 4):
            raw.create_hwctx(tiles)
        assert [entry[1:3] for entry in hw_contexts(raw)] == [(0, 1), (2, 2), (4, 4), (1, 1)]


def test_rule_H7(caplog):
    with emu_device("npu1") as dev:
        raw = Raw(dev.open())
        raw.heap()
        for _ in range(PROFILES["npu1"].hwctx_limit):
            raw.create_hwctx(4)                   # 4 partitions, then 2 shared
        with caplog.at_level(logging.ERROR, logger="amdxdna_direct.emu"):
            assert errno_of(raw.create_hwctx, 4) == errno.EINVAL
        assert "command opcode 0x2 failed" in caplog.text and "create context failed" in caplog.text
        # A second fd on the same device counts against the same firmware limit.
        other = Raw(dev.open())
        other.heap()
        assert errno_of(other.create_hwctx, 4) == errno.EINVAL
    with emu_device("npu4") as capped:
        raw = Raw(capped.open())
        raw.heap()
        capped.faults.cap_contexts(1)
        raw.create_hwctx()
        assert errno_of(raw.create_hwctx) == errno.EINVAL
        capped.faults.fail_next_create_hwctx(errno.ENODEV)
        capped.faults.cap_contexts(16)
        assert errno_of(raw.create_hwctx) == errno.ENODEV
        raw.create_hwctx()
        for bad in (-1, 2.5, None):
            with pytest.raises(ValueError, match="cap_contexts"):
                capped.faults.cap_contexts(bad)
        for bad in (0, 100000, "ENODEV"):
            with pytest.raises(ValueError, match="not an errno number"):
                capped.faults.fail_next_create_hwctx(bad)


def test_rule_H8(raw):
    raw.heap()
    own = call(raw.seam, "SYNCOBJ_CREATE", 0, 0)[0]
    first, sync1 = raw.create_hwctx()
    second, sync2 = raw.create_hwctx()
    assert (first, second) == (1, 2)
    assert len({own, sync1, sync2}) == 3 and 0 not in (sync1, sync2)
    assert raw.query(sync1) == 0 and raw.query(sync1, flags=1) == 0
    assert errno_of(timeline_wait, raw, sync1, 0, monotonic_ns()) == errno.EINVAL     # empty timeline
    raw.destroy_hwctx(first)
    assert raw.create_hwctx()[0] == 3                         # cyclic: 1 is not reused at once


def test_rule_H9(raw):
    raw.heap()
    for priority in (0x100, 0x280, 0x123, 0):
        raw.create_hwctx(priority=priority)
    data, size, count = get_array(raw, HW_CONTEXT_ALL, HWCTX_ENTRY_SIZE, 8)
    priorities = [struct.unpack_from("<Q", data, i * size + 64)[0] for i in range(count)]
    assert priorities == [0x100, 0x280, 0x123, 0]     # GET_ARRAY reports qos.priority as given (S19)
    assert [map_priority(p) for p in priorities] == [0x100, 0x280, 0x180, 0x180]    # what the firmware gets


def test_rule_H10(raw):
    raw.heap()
    ctx, sync = raw.create_hwctx()
    assert errno_of(call, raw.seam, "DESTROY_HWCTX", ctx, 1) == errno.EINVAL
    assert errno_of(raw.destroy_hwctx, 42) == errno.EINVAL
    raw.destroy_hwctx(ctx)
    assert errno_of(raw.destroy_hwctx, ctx) == errno.EINVAL
    assert raw.query(sync) == 0                   # the syncobj survives: userspace destroys it
    raw.syncobj_destroy(sync)


def test_rule_H10_in_flight_jobs_abort():
    with emu_device("npu1:xdna-oot", tdr_timeout=30.0) as dev:      # the out-of-tree driver's 0xFF fill
        raw = Raw(dev.open())
        job = Npu1Job(dev, raw, Passthrough())
        dev.faults.hang(job.insts)                # the first run hangs, the second queues behind it
        (_, hung_addr), (last, queued_addr) = job.submit(), job.submit()
        destroy = threading.Thread(target=raw.destroy_hwctx, args=(job.ctx,))
        start = time.monotonic()
        destroy.start()
        time.sleep(0.1)
        # DESTROY_HWCTX waits (2 s, docs/uapi.md 4.2) without holding the driver: other ioctls go through meanwhile.
        raw.gem_close(raw.create_bo(PAGE, BO_SHMEM))
        assert raw.query(job.syncobj) == 0 and time.monotonic() - start < 1.0 and destroy.is_alive()
        destroy.join(10)
        assert 1.9 <= time.monotonic() - start < 3.5
        assert state_of(hung_addr) == state_of(queued_addr) == ERT_STATE_ABORT
        assert read_addr(queued_addr + 4, 64) == b"\xff" * 64                # ABORT fills the payload (rule E12)
        timeline_wait(raw, job.syncobj, last, monotonic_ns())       # every point is signalled
        assert raw.query(job.syncobj) == last == 1                  # and the syncobj is still there
        assert errno_of(raw.destroy_hwctx, job.ctx) == errno.EINVAL


def test_rule_H11(raw):
    raw.heap()
    ctx, _ = raw.create_hwctx()
    assert errno_of(call, raw.seam, "CONFIG_HWCTX", ctx, 1, 0, 0, 1) == errno.EINVAL       # pad
    assert errno_of(call, raw.seam, "CONFIG_HWCTX", ctx, 7, 0, 0, 0) == errno.EINVAL       # param_type
    pdi, _ = raw.dev_bo(PAGE)
    assert errno_of(raw.config_cu, 9, [(pdi, 0)]) == errno.EINVAL                          # context


def test_rule_H12(raw):
    raw.heap()
    ctx, _ = raw.create_hwctx()
    pdi, _ = raw.dev_bo(PAGE)
    shmem = raw.create_bo(PAGE, BO_SHMEM)

    def config(payload: bytes, size: int | None = None, addr: int | None = None) -> int:
        mem = UserMem(payload)
        length = len(payload) if size is None else size
        return errno_of(call, raw.seam, "CONFIG_HWCTX", ctx, 0, mem.addr if addr is None else addr, length, 0)

    def cu(bo: int, pad: int = 0) -> bytes:
        return struct.pack("<IB3s", bo, 0, bytes([pad, 0, 0]))

    header = struct.pack("<H6x", 1)
    assert config(header + cu(pdi), size=4097) == errno.E2BIG
    assert config(b"", size=16, addr=0) == errno.EFAULT
    assert config(struct.pack("<HH4x", 1, 1) + cu(pdi)) == errno.EINVAL                   # config pad
    assert config(struct.pack("<H6x", 0)) == errno.EINVAL                                 # num_cus 0
    assert config(struct.pack("<H6x", 33) + cu(pdi) * 33) == errno.EINVAL                 # > 32 CUs
    assert config(struct.pack("<H6x", 2) + cu(pdi)) == errno.EINVAL                       # 8 + 16 > 16
    assert config(header + cu(pdi, pad=1)) == errno.EINVAL                                # cu pad
    assert config(header + cu(shmem)) == errno.EINVAL                                     # not a DEV BO
    assert config(header + cu(99)) == errno.EINVAL                                        # unknown BO
    raw.config_cu(ctx, [(pdi, 0)])
    assert errno_of(raw.config_cu, ctx, [(pdi, 0)]) == errno.EINVAL                       # second CONFIG_CU


def test_rule_H13(raw):
    raw.heap()
    ctx, _ = raw.create_hwctx()
    dbg, _ = raw.dev_bo(PAGE)
    shmem = raw.create_bo(PAGE, BO_SHMEM)
    assert errno_of(call, raw.seam, "CONFIG_HWCTX", ctx, 1, shmem, 0, 0) == errno.EINVAL   # not DEV
    assert errno_of(call, raw.seam, "CONFIG_HWCTX", ctx, 2, dbg, 0, 0) == errno.EINVAL     # not assigned
    call(raw.seam, "CONFIG_HWCTX", ctx, 1, dbg, 0, 0)
    assert errno_of(call, raw.seam, "CONFIG_HWCTX", ctx, 1, dbg, 0, 0) == errno.EBUSY
    call(raw.seam, "SYNC_BO", dbg, 1, 0, PAGE)                        # FROM_DEVICE on a debug buffer
    call(raw.seam, "CONFIG_HWCTX", ctx, 2, dbg, 0, 0)
    assert errno_of(call, raw.seam, "SYNC_BO", dbg, 1, 0, PAGE) == errno.EINVAL


def test_rule_H14(dev):
    first, second = Raw(dev.open()), Raw(dev.open())
    first.heap()
    second.heap()
    first.create_hwctx()
    first.create_hwctx()
    kept, _ = second.create_hwctx()
    assert len(hw_contexts(second)) == 3
    first.seam.close()
    assert [entry[0] for entry in hw_contexts(second)] == [kept]
    assert dev.counters.live()["hwctx"] == 1
    assert errno_of(first.create_bo, PAGE, BO_SHMEM) == errno.EBADF


# ---------------------------------------------------------------------------------------------- B: buffers

def test_rule_B1(raw):
    assert errno_of(raw.create_bo, PAGE, BO_SHMEM, flags=1) == errno.EINVAL
    for bo_type in (0, 5):
        assert errno_of(raw.create_bo, PAGE, bo_type) == errno.EINVAL


def test_rule_B2(raw):
    handle = raw.create_bo(100, BO_SHMEM)            # rounded up to one page
    offset = raw.bo_info(handle).map_offset
    assert errno_of(raw.seam.mmap, 2 * PAGE, offset) == errno.EINVAL
    assert errno_of(raw.seam.mmap, PAGE, offset, private=True) == errno.EINVAL
    first = raw.seam.mmap(PAGE, offset)
    second = raw.seam.mmap(PAGE, offset)
    write_addr(first + PAGE - 4, b"xdna")
    assert read_addr(second + PAGE - 4, 4) == b"xdna"             # one set of shared pages
    assert raw.bo_info(handle).vaddr == first                    # vaddr is the first mapping


def test_create_bo_without_backing_store_leaks_nothing(dev, raw):
    gc.collect()    # earlier tests' devices may still hold fds until collected (views keep mappings alive)
    fds = len(os.listdir("/proc/self/fd"))
    live = dev.counters.live()
    assert errno_of(raw.create_bo, 1 << 50, BO_SHMEM) == errno.ENOMEM      # 1 PiB: no address space for it
    assert len(os.listdir("/proc/self/fd")) == fds and dev.counters.live() == live
    assert raw.create_bo(PAGE, BO_SHMEM) == 1                                 # no handle was taken either


def test_rule_B3(raw):
    assert errno_of(raw.create_bo, 64 * MIB + PAGE, BO_DEV_HEAP) == errno.EINVAL
    heap = raw.create_bo(64 * MIB, BO_DEV_HEAP)
    assert errno_of(raw.create_bo, MIB, BO_DEV_HEAP) == errno.EBUSY
    assert raw.bo_info(heap).xdna_addr == HEAP_BASE


def test_rule_B4(raw):
    assert errno_of(raw.create_bo, PAGE, BO_DEV) == errno.EINVAL                # no heap
    heap = raw.create_bo(256 * KIB, BO_DEV_HEAP)
    assert errno_of(raw.create_bo, PAGE, BO_DEV) == errno.EINVAL                # heap not mapped
    heap_va = raw.map_bo(heap, 256 * KIB)
    for size in (0, 256 * KIB + 1):
        assert errno_of(raw.create_bo, size, BO_DEV) == errno.EINVAL
    infos = [raw.dev_bo(PAGE)[1] for _ in range(8)]                             # 8 x 32 KiB = 256 KiB
    assert [i.xdna_addr - HEAP_BASE for i in infos] == [n * 32 * KIB for n in range(8)]
    assert all(i.map_offset == INVALID_ADDR and i.vaddr == heap_va + i.xdna_addr - HEAP_BASE for i in infos)
    assert errno_of(raw.create_bo, PAGE, BO_DEV) == errno.ENOSPC
    write_addr(infos[3].vaddr, b"pdi!")
    assert read_addr(heap_va + 3 * 32 * KIB, 4) == b"pdi!"


def test_rule_B5(raw):
    assert errno_of(raw.create_bo, 3, BO_CMD) == errno.EINVAL
    raw.heap()
    ctx, sync = raw.create_hwctx()
    big = raw.create_bo(32 * KIB + 1, BO_CMD)               # accepted at creation ...
    assert errno_of(raw.exec_cmd, ctx, big, []) == errno.EINVAL      # ... refused at EXEC_CMD
    limit = raw.create_bo(32 * KIB, BO_CMD)
    raw.timeline_wait(sync, raw.exec_cmd(ctx, limit, []))


def test_rule_B6(raw):
    shmem = raw.create_bo(PAGE, BO_SHMEM)
    cmd = raw.create_bo(PAGE, BO_CMD)
    for ext, ext_flags, pad in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):
        assert errno_of(call, raw.seam, "GET_BO_INFO", ext, ext_flags, shmem, pad, 0, 0, 0) == errno.EINVAL
    assert errno_of(raw.bo_info, 42) == errno.ENOENT
    assert raw.bo_info(shmem).xdna_addr == INVALID_ADDR and raw.bo_info(cmd).xdna_addr == INVALID_ADDR
    assert raw.bo_info(shmem).vaddr == INVALID_ADDR           # never mapped
    raw.heap()
    assert raw.dev_bo(PAGE)[1].xdna_addr == HEAP_BASE


def test_rule_B7(raw):
    handle, addr = raw.shmem(2 * PAGE)
    assert errno_of(call, raw.seam, "SYNC_BO", 42, 0, 0, PAGE) == errno.ENOENT
    call(raw.seam, "SYNC_BO", handle, 0, PAGE, PAGE)
    assert errno_of(call, raw.seam, "SYNC_BO", handle, 1, 0, PAGE) == errno.EINVAL
    with emu_device("npu4", drm_minor=2) as old:          # before 0.3 the direction is ignored
        older = Raw(old.open())
        call(older.seam, "SYNC_BO", older.create_bo(PAGE, BO_SHMEM), 1, 0, PAGE)


def test_rule_B8(dev, raw):
    handle = raw.create_bo(PAGE, BO_SHMEM)
    offset = raw.bo_info(handle).map_offset
    assert errno_of(raw.seam.mmap, PAGE, offset + PAGE) == errno.EINVAL
    other = Raw(dev.open())
    assert errno_of(other.seam.mmap, PAGE, offset) == errno.EACCES      # a BO of another fd (drm_gem_mmap, S2)
    raw.heap()
    dev_bo, _ = raw.dev_bo(PAGE)
    assert errno_of(raw.seam.mmap, PAGE, INVALID_ADDR) == errno.EINVAL  # DEV BOs have no map_offset


# ---------------------------------------------------------------------------------------------- I: information

def test_rule_I1(raw):
    for param in (6, 7, 99):
        assert errno_of(raw.get_info, param, 64) == errno.EOPNOTSUPP
    # <= 7.0: a fixed-size result is copied whole whatever buffer_size says.
    mem = UserMem(16)
    call(raw.seam, "GET_INFO", QUERY_AIE_VERSION, 0, mem.addr)
    assert struct.unpack("<II", mem.read(0, 8)) == PROFILES["npu4"].aie_version
    assert errno_of(call, raw.seam, "GET_INFO", QUERY_AIE_VERSION, 8, 0) == errno.EFAULT


def test_rule_I2(spatial):
    raw = spatial
    col_size = raw.seam.device.profile.col_size
    status = UserMem(8 * col_size)

    def query(buffer_size: int) -> tuple:
        carrier = UserMem(struct.pack("<QII", status.addr, buffer_size, 0))
        call(raw.seam, "GET_INFO", QUERY_AIE_STATUS, 16, carrier.addr)
        return struct.unpack("<QII", carrier.read())

    assert errno_of(query, 8 * col_size + 1) == errno.EINVAL
    assert query(8 * col_size)[2] == 0
    raw.heap()
    raw.create_hwctx(4)
    raw.create_hwctx(8)                        # columns 0 and 2..3
    assert query(8 * col_size)[2] == 0b1101
    assert errno_of(query, 2 * col_size) == errno.EINVAL       # three columns do not fit two


def test_rule_I3(dev, raw):
    prof = dev.profile
    meta, _ = raw.get_info(QUERY_AIE_METADATA, 64)
    col_size, cols, rows = struct.unpack_from("<IHH", meta)
    core = struct.unpack_from("<5H", meta, 16)
    assert (cols, rows, core[:2]) == (8, 6, (4, 2)) and col_size == prof.col_size
    assert struct.unpack("<4I", raw.get_info(QUERY_FIRMWARE_VERSION, 16)[0]) == prof.firmware_version
    clocks, _ = raw.get_info(QUERY_CLOCK_METADATA, 48)
    assert clocks[:12] == b"MP-NPU Clock" and clocks[24:31] == b"H Clock"
    assert raw.get_info(GET_POWER_MODE, 8)[0][0] == 0
    raw.heap()
    raw.create_hwctx()
    resources = struct.unpack("<5Q", raw.get_info(QUERY_RESOURCE_INFO, 40)[0])
    assert resources[2] == 16 and resources[4] == 1
    assert errno_of(raw.get_info, QUERY_SENSORS, 168) == errno.EOPNOTSUPP
    with emu_device("npu1") as npu1:
        meta, _ = Raw(npu1.open()).get_info(QUERY_AIE_METADATA, 64)
        assert struct.unpack_from("<HH", meta, 4) == (5, 6)


def test_rule_I4(spatial):
    raw = spatial
    raw.heap()
    first, sync = raw.create_hwctx(4)
    second, _ = raw.create_hwctx(16)
    malformed = cmd_bo(raw, bytes(16))[0]            # header count 0: fails with state NEW
    raw.timeline_wait(sync, raw.exec_cmd(first, malformed, []))
    # `errors` is never set by any driver version (S15)
    assert hw_contexts(raw) == [(first, 0, 1, os.getpid(), 1, 1, 0), (second, 4, 4, os.getpid(), 0, 0, 0)]


def test_rule_I5():
    with emu_device("npu4:xdna-oot", tdr_timeout=5.0) as device:    # the entry fields the out-of-tree driver fills
        _check_rule_I5(Raw(device.open()))


def _check_rule_I5(raw):
    for element_size, num_element, pad in ((8, 1, 1), (8, 0, 0), (0, 1, 0)):
        assert errno_of(get_array, raw, HW_CONTEXT_ALL, element_size, num_element, pad) == errno.EINVAL
    assert errno_of(get_array, raw, 99, 8, 1) == errno.EOPNOTSUPP
    assert errno_of(get_array, raw, HW_CONTEXT_ALL, 4097, 1) == errno.EINVAL
    assert errno_of(get_array, raw, HW_CONTEXT_ALL, 8, 1025) == errno.EINVAL
    raw.heap()
    handles = [raw.create_hwctx()[0] for _ in range(3)]
    data, size, count = get_array(raw, HW_CONTEXT_ALL, 200, 8)
    assert (size, count) == (160, 3)                                # the out-of-tree entry, with the name
    assert [struct.unpack_from("<I", data, i * size)[0] for i in range(3)] == handles
    # Entry 0 (offsets of amdxdna_drm_hwctx_entry, docs/uapi.md 2.5): the whole array from column 0 (temporal),
    # pid, the fd's heap usage (the 4 x 4 KiB command-list BOs of each of the 3 contexts), the zero priority as
    # given, state ACTIVE, the PASID.
    first = struct.unpack_from("<IIIIqQQQQQQQQII", data)
    assert first[1:3] == (0, 8) and first[4] == os.getpid() and first[10:12] == (0, 3 * 4 * PAGE)
    assert first[13:] == (1, 1)
    data, size, count = get_array(raw, HW_CONTEXT_ALL, 8, 2)
    assert (size, count) == (8, 2) and struct.unpack_from("<4I", data) == (1, 0, 2, 0)
    assert get_array(raw, HW_LAST_ASYNC_ERR, 8, 4)[1:] == (24, 1)
    usage, _, _ = get_array(raw, BO_USAGE, 32, 1, prefill=struct.pack("<q", 1 << 30))
    assert struct.unpack("<q3Q", usage) == (1 << 30, 0, 0, 0)       # a pid with no fds
    assert errno_of(get_array, raw, BO_USAGE, 32, 1) == errno.EINVAL    # pid 0


def test_rule_I6(raw):
    def mode(value: int, pad: bytes = bytes(7)) -> None:
        set_state(raw, 0, bytes([value]) + pad)

    assert errno_of(mode, 0, b"\1" + bytes(6)) == errno.EINVAL
    assert errno_of(mode, 5) == errno.EINVAL
    for low in (1, 2):
        assert errno_of(mode, low) == errno.EOPNOTSUPP
    def clocks() -> tuple[int, int]:
        data, _ = raw.get_info(QUERY_CLOCK_METADATA, 48)
        return struct.unpack_from("<I", data, 16)[0], struct.unpack_from("<I", data, 40)[0]

    levels = PROFILES["npu4"].dpm_clocks
    assert clocks() == levels[0]                                   # DEFAULT: the lowest DPM level
    raw.heap()
    ctx, _ = raw.create_hwctx()
    assert errno_of(mode, 4) == errno.EINVAL
    mode(3)
    assert raw.get_info(GET_POWER_MODE, 8)[0][0] == 3
    assert clocks() == levels[-1]                                  # HIGH: the top level (docs/uapi.md 10)
    raw.destroy_hwctx(ctx)
    mode(4)
    assert raw.get_info(GET_POWER_MODE, 8)[0][0] == 4


def test_preemption_attributes_round_trip():
    """SET_STATE 3/4 and GET_INFO 11/13 (0.6): state 0/1 with zero pad, per attribute (docs/uapi.md 10)."""
    force_get, frame_get, force_set, frame_set = 11, 13, 3, 4
    with emu_device("npu4", cap_sys_admin=True) as device:
        raw = Raw(device.open())
        set_state(raw, force_set, bytes([1]) + bytes(7))
        assert (raw.get_info(force_get, 8)[0][0], raw.get_info(frame_get, 8)[0][0]) == (1, 0)
        set_state(raw, frame_set, bytes([1]) + bytes(7))
        assert raw.get_info(frame_get, 8)[0][0] == 1
        assert errno_of(set_state, raw, force_set, bytes([2]) + bytes(7)) == errno.EINVAL
        assert errno_of(set_state, raw, force_set, bytes([0, 1]) + bytes(6)) == errno.EINVAL
        assert raw.get_info(force_get, 8)[0][0] == 1                    # refused requests change nothing
    with emu_device("npu4", cap_sys_admin=True, drm_minor=5) as older:
        raw = Raw(older.open())
        assert errno_of(raw.get_info, force_get, 8) == errno.EOPNOTSUPP
        assert errno_of(set_state, raw, force_set, bytes(8)) == errno.EOPNOTSUPP


# ---------------------------------------------------------------------------------------------- lifetime

def test_counters_back_to_zero_after_error_paths():
    dev = EmuDevice("npu4")
    raw = Raw(dev.open())
    assert errno_of(raw.create_hwctx) == errno.ENOENT          # no heap
    raw.heap(4 * 32 * KIB + 32 * KIB)
    ctx, sync = raw.create_hwctx()
    assert errno_of(raw.create_hwctx) == errno.ENOSPC          # after taking nothing
    shmem, _ = raw.shmem(2 * PAGE)
    assert errno_of(raw.exec_cmd, ctx, shmem, []) == errno.EINVAL       # not a CMD BO
    cmd, _ = cmd_bo(raw, bytes(16))
    assert errno_of(raw.exec_cmd, ctx, cmd, [shmem, 1234]) == errno.ENOENT     # unknown arg
    raw.timeline_wait(sync, raw.exec_cmd(ctx, cmd, [shmem]))
    dev_bo, _ = raw.dev_bo(PAGE)
    raw.config_cu(ctx, [(dev_bo, 0)])
    extra = raw.seam.mmap(PAGE, raw.bo_info(shmem).map_offset)
    raw.seam.munmap(extra, PAGE)
    live = dev.counters.live()
    assert live["hwctx"] == 1 and live["syncobjs"] == 1 and live["mappings"] == 3
    assert dev.counters.bytes_mapped == 5 * 32 * KIB + 2 * PAGE + PAGE
    assert dev.counters.ioctls["CREATE_HWCTX"] == 3 and dev.counters.ioctls["EXEC_CMD"] == 3
    raw.seam.close()                                            # the user never unmapped or closed anything
    check_released(dev)
    dev.close()


def test_wait_cmd_upstream_and_out_of_tree():
    with emu_device("npu4") as linux_7_0:
        raw = Raw(linux_7_0.open())
        assert errno_of(raw.seam.ioctl, ioc(IOW, 0x49, 16), pack("wait_cmd", 1, 0, 0)) == errno.EINVAL  # S13
    with emu_device("npu4", drm_minor=10) as upstream:          # mainline 0.10: IOW, no cmd_wait op on AIE2
        raw = Raw(upstream.open())
        assert errno_of(call, raw.seam, "WAIT_CMD", 1, 0, 0) == errno.EOPNOTSUPP
    with emu_device("npu4:xdna-oot") as oot:
        raw = Raw(oot.open())
        raw.heap()
        ctx, _ = raw.create_hwctx()
        wait_iowr = ioc(IOWR, 0x49, 16)
        assert errno_of(raw.seam.ioctl, wait_iowr, pack("wait_cmd", 9, 0, 0)) == errno.EINVAL      # context
        assert errno_of(raw.seam.ioctl, wait_iowr, pack("wait_cmd", ctx, 0, 0)) == errno.EINVAL    # seq
        seq = raw.exec_cmd(ctx, cmd_bo(raw, bytes(16))[0], [])
        raw.seam.ioctl(wait_iowr, pack("wait_cmd", ctx, 1000, seq))


def test_prime_export_import_shares_the_bo(dev, raw):
    handle, addr = raw.shmem(PAGE)
    write_addr(addr, b"shared")
    assert call(raw.seam, "GET_CAP", 0x5, 0)[1] == 3                     # DRM_PRIME_CAP_IMPORT | EXPORT
    assert errno_of(call, raw.seam, "PRIME_HANDLE_TO_FD", handle, 1, -1) == errno.EINVAL
    assert errno_of(call, raw.seam, "PRIME_HANDLE_TO_FD", 99, 0, -1) == errno.ENOENT
    fd = call(raw.seam, "PRIME_HANDLE_TO_FD", handle, os.O_CLOEXEC | os.O_RDWR, -1)[2]
    try:
        other = Raw(dev.open())
        imported = call(other.seam, "PRIME_FD_TO_HANDLE", 0, 0, fd)[0]
        assert call(other.seam, "PRIME_FD_TO_HANDLE", 0, 0, fd)[0] == imported      # same object, same handle
        mapped = other.map_bo(imported, PAGE)
        assert read_addr(mapped, 6) == b"shared"
        raw.gem_close(handle)
        raw.seam.munmap(addr, PAGE)
        write_addr(mapped, b"still!")                                               # the import keeps it
        assert other.seam.client.bos[imported].mem[:6] == b"still!"
        other.seam.close()
    finally:
        os.close(fd)
    assert errno_of(call, raw.seam, "PRIME_FD_TO_HANDLE", 0, 0, fd) == errno.EBADF
    assert dev.counters.live()["bos"] == 0


def test_bo_usage_sums_this_pid():
    with emu_device("npu4", drm_minor=10) as device:      # BO_USAGE: feature level 0.8
        _check_bo_usage(Raw(device.open()))


def _check_bo_usage(raw):
    heap, _ = raw.heap(2 * MIB)
    raw.create_bo(3 * PAGE, BO_SHMEM)
    raw.create_bo(PAGE, BO_CMD)
    raw.dev_bo(5 * PAGE)
    usage, _, _ = get_array(raw, BO_USAGE, 32, 1, prefill=struct.pack("<q", os.getpid()))
    assert struct.unpack("<q3Q", usage)[1:] == (2 * MIB + 4 * PAGE, 2 * MIB + PAGE, 5 * PAGE)


def test_device_addresses_follow_user_mappings(dev, raw):
    handle, addr = raw.shmem(2 * PAGE)
    memory = raw.seam.client.memory
    bo = raw.seam.client.bos[handle]
    assert memory.resolve(addr + PAGE + 8, 16) == (bo, PAGE + 8)          # SVA: the mapping's VA
    raw.seam.munmap(addr, PAGE)                                           # the head goes, the tail stays
    assert memory.resolve(addr + PAGE, PAGE) == (bo, PAGE)
    with pytest.raises(DeviceFault):
        memory.resolve(addr, 8)
    with pytest.raises(DeviceFault):
        memory.resolve(addr + PAGE, PAGE + 1)                             # runs past the BO


def test_profiles_and_options():
    assert {name: (p.pci_device, p.pci_revision, p.columns, p.hwctx_limit, p.txn_dev_gen)
            for name, p in PROFILES.items()} == {"npu1": (0x1502, 0x00, 5, 6, 3), "npu4": (0x17F0, 0x10, 8, 16, 4),
                                                "npu5": (0x17F0, 0x11, 8, 16, 4), "npu6": (0x17F0, 0x20, 8, 16, 4)}
    with pytest.raises(ValueError, match="dev_heap_max_size"):
        EmuDevice("npu4", dev_heap_max_size=3 << 20)
    for bad in ("x", 3 << 20, 1.5 * (64 << 20)):            # a non-int used to fail deep in a comparison
        with pytest.raises(ValueError, match="dev_heap_max_size"):
            EmuDevice("npu4", dev_heap_max_size=bad)
    with pytest.raises(KeyError, match="unknown emulator profile 'npu9' .profiles: npu1, npu4, npu5, npu6"):
        EmuDevice("npu9")


def test_emulator_is_independent_of_the_binding():
    """The emulator plays the kernel: it must not share the binding's layouts (abi.py, cffi, headers/)."""
    import ast

    import amdxdna_direct.emu as emu

    allowed = {"__future__", "bisect", "collections", "contextlib", "ctypes", "dataclasses", "errno", "functools",
               "hashlib", "logging", "math", "mmap", "operator", "os", "queue", "re", "struct", "sys", "threading",
               "time",
               "typing", "weakref", "numpy", "ml_dtypes"}
    sources = sorted(Path(emu.__file__).parent.glob("*.py"))
    assert len(sources) >= 8
    for source in sources:
        text = source.read_text()
        assert "headers" not in text.replace("``headers/``", ""), source.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
                assert node.level in (0, 1), f"{source.name}: import from outside the emu package"
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{source.name} imports {name}"


def test_rule_table_names_every_rule_and_real_tests():
    """docs/emulator.md maps each rule of docs/driver-rules.md to its tests: every rule has a row, every
    test named there exists, and each rule's own test_rule_<N> is among them."""
    import ast
    import re

    rules_path = SHARED / "spec" / "driver-rules.md"
    if not rules_path.is_file():
        pytest.skip(f"spec absent: {rules_path}")
    rules = re.findall(r"^- ([DHBEI]\d+) ", rules_path.read_text(), re.M)
    assert len(rules) == 49
    tests_dir = Path(__file__).resolve().parent
    defined = {node.name for path in tests_dir.glob("test_emu_*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    doc = (tests_dir.parent / "docs" / "emulator.md").read_text()
    rows = dict(re.findall(r"^\| ([DHBEI]\d+) [^|]*\|[^|]*\|([^|]*)\|$", doc, re.M))
    assert sorted(rows) == sorted(rules)
    for rule, cell in rows.items():
        named = set(re.findall(r"`(test_\w+)`", cell))
        assert f"test_rule_{rule}" in named and named <= defined, (rule, named - defined)
    # The emulator's own rules (docs/emulator.md: inferred from the driver or the firmware, not in the spec's
    # list) are numbered on from 50, each with its test_rule_<N>.
    own = re.findall(r"^\| (\d+) [^|]*\|[^|]*\|([^|]*)\|$", doc, re.M)
    assert [int(number) for number, _ in own] == list(range(len(rules) + 1, len(rules) + 1 + len(own)))
    for number, cell in own:
        named = set(re.findall(r"`(test_\w+)`", cell))
        assert f"test_rule_{number}" in named and named <= defined, (number, named - defined)


def test_rule_table_names_code_that_exists():
    """Each rule row's "modelled in" cell names functions, classes or methods that its module defines."""
    import ast
    import re

    import amdxdna_direct.emu as emu

    emu_dir = Path(emu.__file__).parent
    defined: dict[str, set[str]] = {}
    for source in emu_dir.glob("*.py"):
        names = defined.setdefault(source.name, set())
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{sub.name}" for sub in node.body if isinstance(sub, ast.FunctionDef)}
                names |= {sub.name for sub in node.body if isinstance(sub, ast.FunctionDef)}
    doc = (Path(__file__).resolve().parent.parent / "docs" / "emulator.md").read_text()
    cells = re.findall(r"^\| ((?:[DHBEI])?\d+) [^|]*\|([^|]*)\|[^|]*\|$", doc, re.M)
    assert len(cells) >= 49
    checked = 0
    for rule, cell in cells:
        module = None
        for module_name, symbol in re.findall(r"(\w+\.py)|`([\w.*]+)`", cell):
            if module_name:
                module = module_name
                continue
            assert module in defined, (rule, module)
            if symbol.endswith("*"):
                assert any(name.startswith(symbol[:-1]) for name in defined[module]), (rule, module, symbol)
            else:
                assert symbol in defined[module], (rule, module, symbol)
            checked += 1
    assert checked >= 80


def abi_fact_lines() -> list[str]:
    """The pinned facts of docs/uapi.md Appendix A."""
    lines = []
    for name in ("abi-facts-amdxdna.txt", "abi-facts-drm.txt"):
        path = SHARED / "spec" / name
        if not path.is_file():
            pytest.skip(f"spec absent: {path}")
        lines += path.read_text().splitlines()
    return lines


def test_layouts_match_the_abi_facts():
    from amdxdna_direct.emu import layouts

    facts = {}
    for line in abi_fact_lines():
        if line.startswith("struct ") and " size=" in line:
            struct_name, size = line[len("struct "):].split(" size=")
            facts[struct_name] = int(size)
    # The facts hold the staging/OOT 160-byte hwctx_entry (hwctx_entry_oot) and the pre-deadline DRM wait structs;
    # the emulator also models the mainline 144-byte entry, and the newer wait structs (docs/uapi.md 2.5, 5).
    newer = {"amdxdna_drm_hwctx_entry": 144, "drm_syncobj_wait": 40, "drm_syncobj_timeline_wait": 48}
    checked = 0
    for layout in vars(layouts).values():
        if isinstance(layout, layouts.Layout) and layout.name in facts:
            fact = facts[layout.name]
            want = fact if layout is layouts.hwctx_entry_oot else newer.get(layout.name, fact)
            assert layout.size == want, layout.name
            checked += 1
    assert checked >= 30


def test_raw_request_numbers_match_the_abi_facts():
    facts = dict(line.split("=") for line in abi_fact_lines() if line.startswith("DRM_IOCTL_"))
    prefixes = ("DRM_IOCTL_AMDXDNA_", "DRM_IOCTL_")
    checked = 0
    for full, value in facts.items():
        name = next(full[len(p):] for p in prefixes if full.startswith(p))
        assert request(name) == int(value, 16), full
        checked += 1
    assert checked == 22
