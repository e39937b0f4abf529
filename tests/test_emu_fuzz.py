"""The emulator's ioctl surface under hostile input: random structs, pointers, packets, streams and threads.

Oracles: the errnos of docs/docs/driver-rules.md and docs/uapi.md (only an OSError with one of them may
come out of an ioctl, its message naming the errno), the kernel facts each regression cites (DRM's
kmalloc_array of user arrays, shmem_file_setup's size limit, fput after the last ioctl of a closed fd), the
ERT states of docs/uapi.md 6.6 (every job's fence signals, its state is one of NEW COMPLETED ERROR ABORT TIMEOUT), and
the device counters (nothing live after close). Examples are bounded and derandomized; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import re
import resource
import struct
import threading
import time

import pytest
from emu_raw import (
    BO_CMD,
    BO_SHMEM,
    DRM_COMMAND_BASE,
    ERT_START_CU,
    ERT_START_NPU,
    ERT_STATE_ABORT,
    ERT_STATE_COMPLETED,
    ERT_STATE_ERROR,
    ERT_STATE_NEW,
    ERT_STATE_TIMEOUT,
    FMT,
    IOW,
    IOWR,
    REQUESTS,
    WAIT_FOR_SUBMIT,
    Gate,
    Raw,
    UserMem,
    call,
    chain_packet,
    check_message,
    check_released,
    emu_device,
    ioc,
    monotonic_ns,
    pack,
    packet,
    read_addr,
    regmap,
    request,
    state_of,
    txn_stream,
    write_addr,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amdxdna_direct.emu import DeviceFault, EmuDevice, Passthrough, txn

# Every errno the spec gives an ioctl (docs/driver-rules.md D-I, docs/uapi.md 4-5, 12), ENOMEM included
# (DRM allocations, the backing store); EBADF is a closed fd.
SPEC_ERRNOS = {errno.ENOTTY, errno.EINVAL, errno.ENODEV, errno.EACCES, errno.EFAULT, errno.ENOENT, errno.ENOSPC,
               errno.EBUSY, errno.E2BIG, errno.EOPNOTSUPP, errno.ETIME, errno.EBADF, errno.ENOMEM, errno.EAGAIN}
ENDED_STATES = {ERT_STATE_NEW, ERT_STATE_COMPLETED, ERT_STATE_ERROR, ERT_STATE_ABORT, ERT_STATE_TIMEOUT}
# Fields that are user pointers, by struct and position in emu_raw.FMT.
POINTER_FIELDS = {"create_hwctx": {2}, "config_hwctx": {2}, "exec_cmd": {5}, "get_info": {2}, "set_state": {2},
                  "get_array": {4}, "drm_version": {4, 6, 8}, "syncobj_wait": {0}, "syncobj_timeline_wait": {0, 1},
                  "syncobj_timeline_array": {0, 1}, "syncobj_array": {0}}
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class BadLog(logging.Handler):
    """Collects emulator log records that report an emulator defect (an exception, an internal failure)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "internal" in message or (record.exc_info and "model" not in message):
            self.records.append(message)


@contextlib.contextmanager
def watched_log():
    handler = BadLog()
    logger = logging.getLogger("amdxdna_direct.emu")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class Bench:
    """One emulated NPU4 fd with a mapped heap, a context with one CU, data, instruction and command BOs."""

    def __init__(self, device: EmuDevice):
        self.device = device
        self.seam = device.open()
        self.raw = Raw(self.seam)
        self.heap, self.heap_va = self.raw.heap()
        self.ctx, self.syncobj = self.raw.create_hwctx(4)
        cu, cu_info = self.raw.dev_bo(4096)
        write_addr(cu_info.vaddr, b"\xdd" * 64)
        self.raw.sync(cu, 4096)
        self.raw.config_cu(self.ctx, [(cu, 0)])
        self.stream = txn_stream(4, [(0, 64), (1, 64)])
        device.models.bind(self.stream, Passthrough())
        self.instr, info = self.raw.dev_bo(len(self.stream))
        write_addr(info.vaddr, self.stream)
        self.raw.sync(self.instr, len(self.stream))
        self.instr_addr = info.xdna_addr
        self.data = [self.raw.shmem(4096) for _ in range(2)]
        self.cmds = [self.raw.shmem(4096, BO_CMD) for _ in range(4)]
        # A live user buffer the fuzzed pointers may name, as large as the longest result the emulator may
        # write at it (telemetry: its header and up to 4 MiB of data, from scratch + 4096).
        self.scratch = UserMem(8 << 20)

    def handles(self) -> list[int]:
        return [self.instr, *(h for h, _ in self.data), *(h for h, _ in self.cmds)]

    def run(self, cmd: int, args: list[int]) -> int:
        """EXEC_CMD, then a bounded wait: the job must end (its fence signals) within 5 s."""
        seq = self.raw.exec_cmd(self.ctx, cmd, args)
        self.raw.timeline_wait(self.syncobj, seq, timeout_s=5.0)
        return seq


@pytest.fixture
def bench():
    with emu_device("npu4", tdr_timeout=0.5) as device:
        yield Bench(device)


# --------------------------------------------------------------------------------------------------
# Random structs for every request, random user pointers
# --------------------------------------------------------------------------------------------------

def field_codes(key: str) -> list[str]:
    """One struct code per field of an emu_raw format ("<QQ8I" -> Q Q I I ...; padding dropped)."""
    return [code for count, code in re.findall(r"(\d*)([a-zA-Z])", FMT[key]) if code != "x"
            for _ in range(int(count or 1))]


def value_for(draw, code: str, pointer: bool, scratch: int) -> int:
    if pointer:
        return draw(st.sampled_from([0, 1, 8, 0x1000, 0xDEAD0000, 0xFFFF888000000000, (1 << 64) - 1, 1 << 63,
                                     scratch, scratch + 4096]))
    bits = struct.calcsize(code) * 8
    value = draw(st.one_of(st.integers(0, 20), st.sampled_from([0x40, 0x100, 4096, 32 << 10, 64 << 20,
                                                                 (1 << bits) - 1, 1 << (bits - 1)]),
                           st.integers(0, (1 << bits) - 1)))
    return value - (1 << bits) if code.islower() and value >= 1 << (bits - 1) else value


@st.composite
def raw_ioctl(draw, name: str, scratch: int):
    direction, nr, key = REQUESTS[name]
    codes = field_codes(key)
    pointers = POINTER_FIELDS.get(key, set())
    values = [value_for(draw, code, i in pointers, scratch) for i, code in enumerate(codes)]
    if name in ("SYNCOBJ_WAIT", "SYNCOBJ_TIMELINE_WAIT"):
        values[codes.index("q")] = min(values[codes.index("q")], monotonic_ns())      # absolute: poll, never block
    if name == "WAIT_CMD":
        values[1] = min(values[1], 10) or 1                                          # ms, 0 would be forever
    buf = pack(key, *values)
    size = draw(st.sampled_from([len(buf), len(buf), 0, len(buf) // 2, len(buf) + 8]))
    direction = draw(st.sampled_from([direction, direction, 0, IOW, IOWR]))
    return ioc(direction, nr, size), buf + bytes(8)


def expect_spec_error(fn) -> None:
    """Run one ioctl: it succeeds or raises an OSError with a spec errno whose name the message carries."""
    try:
        fn()
    except OSError as exc:
        assert exc.errno in SPEC_ERRNOS, exc
        check_message(exc)


@pytest.mark.parametrize("profile, options", [("npu4", {}), ("npu1", {"expandable_heap": True, "drm_minor": 5})],
                         ids=["npu4", "npu1-expandable-0.5"])
@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_random_structs_only_give_spec_errnos(name, profile, options):
    with emu_device(profile, tdr_timeout=0.5, wait_cmd=name == "WAIT_CMD", cap_sys_admin=True, **options) as device:
        bench = Bench(device)

        @FUZZ
        @given(raw_ioctl(name, bench.scratch.addr))
        def one(case):
            req, buf = case
            bench.scratch.write(bytes(1 << 16))      # no result of an earlier example is read back as a pointer
            expect_spec_error(lambda: bench.seam.ioctl(req, buf))

        one()


@FUZZ
@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, (1 << 14) - 1), st.integers(0, 3))
def test_any_request_number_gives_a_spec_errno(type_byte, nr, size, direction):
    with emu_device("npu4") as device, device.open() as seam:
        buf = bytearray(size)
        expect_spec_error(lambda: seam.ioctl(ioc(direction, nr, size, type_byte), buf))


def test_unknown_numbers_name_the_errno():
    with emu_device("npu4") as device, device.open() as seam:
        with pytest.raises(OSError) as caught:
            seam.ioctl(ioc(IOWR, DRM_COMMAND_BASE + 0x30, 16), bytearray(16))
        assert caught.value.errno == errno.EINVAL
        check_message(caught.value)
        with pytest.raises(OSError) as caught:
            seam.ioctl(ioc(IOWR, 0, 64, type_byte=ord("A")), bytearray(64))
        assert caught.value.errno == errno.ENOTTY


# --------------------------------------------------------------------------------------------------
# Regressions found by fuzzing
# --------------------------------------------------------------------------------------------------

SYNCOBJ_ARRAYS = [("SYNCOBJ_RESET", lambda h, p, n: (h, n, 0)), ("SYNCOBJ_SIGNAL", lambda h, p, n: (h, n, 0)),
                  ("SYNCOBJ_WAIT", lambda h, p, n: (h, 0, n, 0, 0)),
                  ("SYNCOBJ_TIMELINE_WAIT", lambda h, p, n: (h, p, 0, n, 0, 0)),
                  ("SYNCOBJ_QUERY", lambda h, p, n: (h, p, n, 0)),
                  ("SYNCOBJ_TIMELINE_SIGNAL", lambda h, p, n: (h, p, n, 0))]


@pytest.mark.parametrize("name, fields", SYNCOBJ_ARRAYS, ids=[n for n, _ in SYNCOBJ_ARRAYS])
def test_huge_syncobj_count_is_enomem_not_an_allocation(name, fields):
    """drm_syncobj_array_find kmalloc_arrays count_handles u32s before copying: past KMALLOC_MAX_SIZE that is
    ENOMEM. The emulator used to allocate 4 x count bytes (16 GiB: MemoryError, or seconds of memset)."""
    with emu_device("npu4") as device, device.open() as seam:
        user = UserMem(1 << 16)
        for count in (0xFFFFFFFF, (4 << 20) // 4 + 1):
            started = time.monotonic()
            with pytest.raises(OSError) as caught:
                call(seam, name, *fields(user.addr, user.addr, count))
            assert caught.value.errno == errno.ENOMEM and "ENOMEM" in str(caught.value)
            assert time.monotonic() - started < 1.0
        if name in ("SYNCOBJ_TIMELINE_WAIT", "SYNCOBJ_QUERY", "SYNCOBJ_TIMELINE_SIGNAL"):
            # 8-byte points: an array the u32 handles fit but whose points do not.
            with pytest.raises(OSError) as caught:
                call(seam, name, *fields(seam.reserve(4 << 20, 4096), user.addr, (4 << 20) // 8 + 1))
            assert caught.value.errno in (errno.ENOMEM, errno.EFAULT)
        guard = seam.reserve(4 << 20, 4096)          # PROT_NONE: at the limit the copy itself faults
        with pytest.raises(OSError) as caught:
            call(seam, name, *fields(guard, guard, (4 << 20) // 8))
        assert caught.value.errno == errno.EFAULT
        seam.munmap(guard, 4 << 20)


@pytest.mark.parametrize("size", [1 << 63, (1 << 64) - 1, (1 << 64) - 4096])
@pytest.mark.parametrize("bo_type", [BO_SHMEM, BO_CMD])
def test_create_bo_beyond_max_lfs_filesize_is_einval(size, bo_type):
    """shmem_file_setup refuses sizes above MAX_LFS_FILESIZE with EINVAL; the emulator raised OverflowError
    from ftruncate (or wrapped 2^64 - 1 to a page-aligned 2^64)."""
    with emu_device("npu4") as device, device.open() as seam:
        with pytest.raises(OSError) as caught:
            Raw(seam).create_bo(size, bo_type)
        assert caught.value.errno == errno.EINVAL and "CREATE_BO" in str(caught.value)
        assert device.counters.live()["bos"] == 0


def test_mmap_and_reserve_refuse_non_positive_lengths():
    """A negative mmap length went past the 1..size check to libc (ENOMEM from mmap, no op named); a negative
    reserve length returned a zero-length 'reservation'."""
    with emu_device("npu4") as device, device.open() as seam:
        raw = Raw(seam)
        handle = raw.create_bo(8192, BO_SHMEM)
        offset = raw.bo_info(handle).map_offset
        for length in (-1, -4096, 0, 8193):
            with pytest.raises(OSError) as caught:
                seam.mmap(length, offset)
            assert caught.value.errno == errno.EINVAL and "mmap" in str(caught.value)
            check_message(caught.value)
        for length in (-1, 0):
            with pytest.raises(ValueError, match="length"):
                seam.reserve(length, 4096)
        assert device.counters.live()["mappings"] == 0


def test_map_fixed_over_a_mapping_replaces_it_for_the_device(bench):
    """MAP_FIXED over a live BO mapping replaces it (mm/mmap.c): the device must use the BO the user now sees
    there. The emulator kept the old entry (the device wrote into the old BO), and a mapping at the same start
    overwrote the old entry and leaked the old BO's reference."""
    raw, seam = bench.raw, bench.seam
    a, b = raw.create_bo(8192, BO_SHMEM), raw.create_bo(4096, BO_SHMEM)
    base = seam.reserve(8192, 4096)
    seam.mmap(8192, raw.bo_info(a).map_offset, base)
    seam.mmap(4096, raw.bo_info(b).map_offset, base + 4096)       # B over A's second page
    (src, src_addr), _ = bench.data
    write_addr(src_addr, bytes(range(1, 65)))
    raw.sync(src, 64)
    cmd, cmd_addr = bench.cmds[0]
    write_addr(cmd_addr, packet(ERT_START_CU, regmap(bench.instr_addr, len(bench.stream) // 4,
                                                           [src_addr, base + 4096])))
    bench.run(cmd, [bench.instr, src, b])
    assert state_of(cmd_addr) == ERT_STATE_COMPLETED
    raw.sync(b, 64)
    assert read_addr(base + 4096, 64) == bytes(range(1, 65))
    seam.mmap(4096, raw.bo_info(b).map_offset, base)               # B again, at A's start
    seam.munmap(base, 8192)
    raw.gem_close(a)
    raw.gem_close(b)
    assert bench.device.counters.live()["mappings"] == 1 + 2 + 4        # the bench's heap, data and command BOs
    # (the emu_device fixture then checks that closing releases every BO: A's reference used to leak)


def map_unmap(seam, handle: int, rounds: int, wrong: list) -> None:
    """Map and unmap one BO `rounds` times; record each time the device does not see it at its new address."""
    offset = Raw(seam).bo_info(handle).map_offset
    for _ in range(rounds):
        addr = seam.mmap(4096, offset)
        try:
            if seam.client.memory.resolve(addr, 16)[0].handle != handle:
                wrong.append(addr)
        except DeviceFault:
            wrong.append(addr)
        seam.munmap(addr, 4096)


def test_munmap_racing_mmap_keeps_the_device_view():
    """Threads mapping and unmapping BOs of one fd: the kernel hands a just-freed range to the next mmap, and
    munmap used to forget its range after releasing the lock's protection, dropping the new mapping from
    the device's view (its DMA then faulted) and its BO reference."""
    with emu_device("npu4") as device, device.open() as seam:
        handles = [Raw(seam).create_bo(4096, BO_SHMEM) for _ in range(3)]
        wrong: list[int] = []
        threads = [threading.Thread(target=map_unmap, args=(seam, handle, 2000, wrong)) for handle in handles]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert wrong == []
        assert device.counters.live()["mappings"] == 0


@contextlib.contextmanager
def no_free_fds():
    """The process out of file descriptors (RLIMIT_NOFILE just above the fds in use, the holes filled)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(name) for name in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    fillers = []
    try:
        with contextlib.suppress(OSError):
            for _ in range(highest + 1):
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_process_out_of_fds_gets_the_errno_named():
    """PRIME_HANDLE_TO_FD needs a new fd (dma_buf_fd: EMFILE), a heap chunk of the expandable heap a dup of
    the window file (the emulator's backing store: ENOMEM). Both used to raise a bare OSError naming neither
    the ioctl nor the errno."""
    with emu_device("npu4", expandable_heap=True) as device, device.open() as seam:
        raw = Raw(seam)
        raw.heap()
        handle = raw.create_bo(4096, BO_SHMEM)
        with no_free_fds():
            with pytest.raises(OSError) as caught:
                call(seam, "PRIME_HANDLE_TO_FD", handle, 0, 0)
            assert caught.value.errno == errno.EMFILE
            with pytest.raises(OSError) as caught:
                call(seam, "CREATE_BO", 0, 0, 64 << 20, 2, 0)
            assert caught.value.errno == errno.ENOMEM
        fd = call(seam, "PRIME_HANDLE_TO_FD", handle, 0, 0)[2]
        os.close(fd)


def test_an_unordered_timeline_point_never_moves_the_timeline_back():
    """TIMELINE_SIGNAL of 5 then 3: dma_fence_chain_init gives the second link seqno max(5, 3) = 5 in a new
    fence context, so the last submitted and signalled points stay 5 and a wait on 5 or 4 succeeds. The
    emulator answered 3 and refused those waits as never submitted (EINVAL)."""
    with emu_device("npu4") as device, device.open() as seam:
        raw = Raw(seam)
        handle = call(seam, "SYNCOBJ_CREATE", 0, 0)[0]
        raw.timeline_signal(handle, 5)
        raw.timeline_signal(handle, 3)
        assert raw.query(handle, flags=1) == 5 and raw.query(handle) == 5
        for point in (5, 4, 1):
            raw.timeline_wait(handle, point, timeout_s=0.0, flags=0)
        with pytest.raises(OSError) as caught:
            raw.timeline_wait(handle, 6, timeout_s=0.0, flags=0)
        assert caught.value.errno == errno.EINVAL


def test_a_job_after_an_unordered_point_is_waited_for_from_any_earlier_point(bench):
    """Job 0 done, a stub at point 5 on the context's syncobj, then job 1 (held by a model): job 1's link
    gets seqno 5 in a new fence context (prev_seqno 0), so dma_fence_chain_find_seqno of point 1 stops at it
    and the wait covers job 1. The emulator found the stub and returned while job 1 still ran."""
    gate = Gate()
    stream = txn_stream(4, [(0, 64), (1, 64)], tag=7)
    bench.device.models.bind(stream, gate)
    instr, info = bench.raw.dev_bo(len(stream))
    write_addr(info.vaddr, stream)
    bench.raw.sync(instr, len(stream))
    slots = [addr for _, addr in bench.data]
    (first, first_addr), (held, held_addr) = bench.cmds[:2]
    write_addr(first_addr, packet(ERT_START_CU, regmap(bench.instr_addr, len(bench.stream) // 4, slots)))
    write_addr(held_addr, packet(ERT_START_CU, regmap(info.xdna_addr, len(stream) // 4, slots)))
    data = [h for h, _ in bench.data]
    assert bench.run(first, [bench.instr, *data]) == 0
    bench.raw.timeline_signal(bench.syncobj, 5)
    assert bench.raw.exec_cmd(bench.ctx, held, [instr, *data]) == 1
    try:
        assert gate.entered.wait(5)
        with pytest.raises(OSError) as caught:
            bench.raw.timeline_wait(bench.syncobj, 1, timeout_s=0.05)
        assert caught.value.errno == errno.ETIME
    finally:
        gate.release.set()
    bench.raw.timeline_wait(bench.syncobj, 1, timeout_s=5.0)
    assert state_of(held_addr) == ERT_STATE_COMPLETED


def test_read_only_or_strided_argument_is_refused_before_the_ioctl_runs():
    """A buffer the result cannot be copied back into is refused up front: CREATE_BO used to create the BO
    and then fail with 'cannot modify read-only memory', leaving a BO whose handle nobody knew."""
    with emu_device("npu4") as device, device.open() as seam:
        args = pack("create_bo", 0, 0, 4096, BO_SHMEM, 0)
        for buf in (bytes(args), memoryview(bytearray(2 * len(args)))[::2], None):
            with pytest.raises(TypeError, match="CREATE_BO"):
                seam.ioctl(request("CREATE_BO"), buf)
        assert device.counters.live()["bos"] == 0 and not device.counters.ioctls["CREATE_BO"] > 3
        handle = Raw(seam).create_bo(4096, BO_SHMEM)
        seam.ioctl(request("GEM_CLOSE"), bytes(pack("gem_close", handle, 0)))     # IOW: read-only is fine
        assert device.counters.live()["bos"] == 0


def hammer(seam, raw: Raw, seed: int, start: threading.Barrier, outcomes: list) -> None:
    """Create BOs, syncobjs and contexts on `seam` until its fd is closed under this thread (bounded)."""
    rng = random.Random(seed)
    start.wait(5)
    for _ in range(2000):
        try:
            raw.create_bo(4096, rng.choice([BO_SHMEM, BO_CMD, 3]))
            call(seam, "SYNCOBJ_CREATE", 0, 0)
            if rng.random() < 0.2:
                raw.create_hwctx(4)
        except OSError as exc:
            if exc.errno == errno.EBADF:
                outcomes.append(None)
                return
            if exc.errno not in (errno.EINVAL, errno.ENOSPC, errno.ENODEV, errno.ENOENT):
                outcomes.append(exc)
                return
    outcomes.append(AssertionError("the fd was never closed under the thread"))


def test_close_racing_ioctls_leaks_nothing():
    """close() while other threads are inside ioctls on the fd: the release waits for them (fput), later
    ioctls get EBADF. Objects an ioctl created after close had cleared the tables used to leak."""
    for trial in range(4):
        with emu_device("npu4") as device:
            seam = device.open()
            raw = Raw(seam)
            raw.heap()
            start = threading.Barrier(4)
            outcomes: list[BaseException | None] = []
            threads = [threading.Thread(target=hammer, args=(seam, raw, trial * 10 + i, start, outcomes))
                       for i in range(3)]
            for thread in threads:
                thread.start()
            start.wait(5)
            for _ in range(200):              # let them get going: a bounded number of ioctls
                if sum(device.counters.ioctls.values()) > 40:
                    break
                time.sleep(0.001)
            seam.close()
            for thread in threads:
                thread.join(10)
            assert not any(thread.is_alive() for thread in threads)
            assert outcomes == [None] * 3, outcomes


def test_device_close_ends_a_blocked_wait_and_releases_its_fd():
    """A wait in flight keeps its fd (closing the fd does not release it); EmuDevice.close ends the wait with
    ENODEV at once and the fd is then released. The wait used to sleep out its whole timeout."""
    device = EmuDevice("npu4")
    seam = device.open()
    raw = Raw(seam)
    handle = call(seam, "SYNCOBJ_CREATE", 0, 0)[0]
    result: list[BaseException] = []

    def waiter() -> None:
        try:
            raw.timeline_wait(handle, 1, timeout_s=8.0, flags=WAIT_FOR_SUBMIT)
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    for _ in range(5000):
        if seam.client.users:
            break
        time.sleep(0.001)
    assert seam.client.users == 1
    seam.close()
    with pytest.raises(OSError) as caught:
        call(seam, "SYNCOBJ_CREATE", 0, 0)
    assert caught.value.errno == errno.EBADF
    assert device.counters.live()["syncobjs"] == 1          # still held by the wait in flight
    started = time.monotonic()
    device.close()
    thread.join(8)
    assert time.monotonic() - started < 2.0 and not thread.is_alive()
    assert [exc.errno for exc in result] == [errno.ENODEV]
    check_message(result[0], "SYNCOBJ_TIMELINE_WAIT")
    check_released(device)


# --------------------------------------------------------------------------------------------------
# Random command packets and TXN streams: every job ends, in a defined state
# --------------------------------------------------------------------------------------------------

@st.composite
def command_packet(draw, bench: Bench):
    """ERT_START_CU / ERT_START_NPU / chains (of anything, themselves included) / noise, then maybe a header bit
    flipped."""
    kind = draw(st.sampled_from(["cu", "npu", "chain", "noise"]))
    addrs = [addr for _, addr in bench.data] + [0, 0x4000000, bench.instr_addr, 1 << 63]
    slots = draw(st.lists(st.sampled_from(addrs), max_size=5))
    instr = draw(st.sampled_from([bench.instr_addr, bench.instr_addr + 4, 0, bench.data[0][1]]))
    ninstr = draw(st.sampled_from([len(bench.stream) // 4, 0, 1, 0xFFFFFFFF]))
    if kind == "cu":
        masks = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 1 << 31]), min_size=1, max_size=4)))
        data = packet(ERT_START_CU, regmap(instr, ninstr, slots), masks)
    elif kind == "npu":
        props = draw(st.lists(st.integers(0, 0xFFFFFFFF), max_size=3))
        preamble = [instr & 0xFFFFFFFF, instr >> 32, 4 * ninstr & 0xFFFFFFFF, len(props), *props]
        data = packet(ERT_START_NPU, preamble + regmap(instr, ninstr, slots))
    elif kind == "chain":
        handles = bench.handles() + [0, 9999, (1 << 64) - 1]
        data = chain_packet(draw(st.lists(st.sampled_from(handles), max_size=6)))
    else:
        data = draw(st.binary(min_size=4, max_size=96))
    flip = draw(st.sampled_from([None, None, *range(32)]))
    if flip is not None:
        data = struct.pack("<I", struct.unpack_from("<I", data)[0] ^ 1 << flip) + data[4:]
    return data


def test_random_packets_always_end_in_a_defined_state(bench):
    """Every packet a user can write ends: fence signalled within the bound, state NEW/COMPLETED/ERROR/ABORT/
    TIMEOUT, nothing reported as an internal firmware failure; sub-commands hold valid ERT_START_CU packets."""
    valid = packet(ERT_START_CU, regmap(bench.instr_addr, len(bench.stream) // 4,
                                              [addr for _, addr in bench.data]))

    @FUZZ
    @given(st.data())
    def one(data):
        cmd, cmd_addr = data.draw(st.sampled_from(bench.cmds))
        for other, other_addr in bench.cmds:
            if other != cmd:
                write_addr(other_addr, data.draw(st.one_of(st.just(valid), command_packet(bench))))
        write_addr(cmd_addr, data.draw(command_packet(bench)))
        args = data.draw(st.lists(st.sampled_from(bench.handles()), max_size=4))
        try:
            bench.run(cmd, args)
        except OSError as exc:
            # EALREADY: an argument handle drawn twice (rule 51).
            assert exc.errno in (errno.EINVAL, errno.ENOENT, errno.EALREADY), exc
            return
        assert state_of(cmd_addr) in ENDED_STATES

    with watched_log() as log:
        one()
    assert log.records == []


def mutated(stream: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    words = list(struct.unpack(f"<{len(stream) // 4}I", stream))
    for index, value in edits:
        words[index % len(words)] = value
    data = struct.pack(f"<{len(words)}I", *words)
    return data if cut is None else data[:4 * max(1, cut % len(words))]


WORD = st.one_of(st.sampled_from([0, 1, 4, 16, 48, 0x81, 0x80, 0x1D004, 0xFFFFFFFF]), st.integers(0, 0xFFFFFFFF))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 200), WORD), max_size=4), st.one_of(st.none(), st.integers(0, 200)))
def test_txn_walk_raises_only_txn_error(edits, cut):
    stream = mutated(txn_stream(4, [(0, 64), (1, 64), (2, 128)]), edits, cut)
    try:
        txn.walk(stream, 4)
    except txn.TxnError:
        pass


def test_a_stream_of_millions_of_register_words_is_walked_in_bounded_time_and_memory():
    """Two BLOCKWRITEs over rows 0-5 of a column (1.5 M words each, a 12 MiB stream), then the fixture-shaped
    BD, DDR_PATCH and push: the walker used to store every word in a dict (hundreds of MB for a stream that
    fits the heap, seconds of the context's worker); it keeps only the shim DMA registers it reads."""
    words_per_block = (6 << 20) // 4                  # rows 0..5 of one column: 6 tiles of 1 MiB
    ops = [[0x01, 0, col << 25, 4 * (4 + words_per_block), *([7] * words_per_block)] for col in (0, 1)]
    bd = [0x01, 0, 0x1D020, 48, 16, 0, 0, 0, 0x80000000, 0x02000000, 0, 0x02000000]
    patch = [0x81, 48, 0, 0, 0, 0, 0x1D024, 0, 2, 0, 0, 0]
    ops += [bd, patch, [0x00, 0, 0x1D214, 0, 0x80000001, 24]]
    body = [w for op in ops for w in op]
    words = [0x06040100, 0x102, len(ops), 4 * (4 + len(body)), *body]
    data = struct.pack(f"<{len(words)}I", *words)
    started = time.monotonic()
    program = txn.walk(data, 4)
    assert time.monotonic() - started < 1.0
    assert len(program.registers) <= 2 * 0x300 // 4
    assert [(p.arg_idx, p.length) for p in program.patches] == [(2, 64)]
    # The blocks wrote 7 into both columns' four task queues too: pushes of BD 7, then the stream's own push.
    assert [(q.col, q.bd) for q in program.pushes] == [(0, 7)] * 4 + [(1, 7)] * 4 + [(0, 1)]
    assert program.registers[0x1D000] == 7 and program.registers[(1 << 25) | 0x1D2FC] == 7


def test_mutated_streams_bound_to_models_complete_or_fail_cleanly(bench):
    """A model bound to a malformed stream: the job ends ERROR (or COMPLETED when the edit is harmless)."""

    @FUZZ
    @given(st.lists(st.tuples(st.integers(0, 200), WORD), min_size=1, max_size=3))
    def one(edits):
        stream = mutated(bench.stream, edits, None)
        bench.device.models.bind(stream, Passthrough())
        instr, info = bench.raw.dev_bo(len(stream))
        write_addr(info.vaddr, stream)
        cmd, cmd_addr = bench.cmds[0]
        write_addr(cmd_addr, packet(ERT_START_CU, regmap(info.xdna_addr, len(stream) // 4,
                                                               [addr for _, addr in bench.data])))
        bench.run(cmd, [instr, *(h for h, _ in bench.data)])
        assert state_of(cmd_addr) in (ERT_STATE_COMPLETED, ERT_STATE_ERROR)
        bench.raw.gem_close(instr)

    with watched_log() as log:
        one()
    assert log.records == []


# --------------------------------------------------------------------------------------------------
# Many fds and contexts from threads
# --------------------------------------------------------------------------------------------------

def random_client(device: EmuDevice, seed: int, failures: list) -> None:
    """Random operations on one fd: contexts, runs (some hung, some chained), waits, destroys, closes."""
    rng = random.Random(seed)
    try:
        seam = device.open()
    except OSError as exc:
        failures.extend([] if exc.errno == errno.ENODEV else [exc])
        return
    raw = Raw(seam)
    contexts, cmds = [], []
    try:
        raw.heap()
        stream = txn_stream(4, [(0, 64), (1, 64)], tag=seed % 3)
        device.models.bind(stream, Passthrough())
        instr, info = raw.dev_bo(len(stream))
        write_addr(info.vaddr, stream)
        (a, a_addr), (b, b_addr) = raw.shmem(4096), raw.shmem(4096)
        for _ in range(60):
            roll = rng.random()
            try:
                if roll < 0.15 or not contexts:
                    ctx, syncobj = raw.create_hwctx(4)
                    cu, _ = raw.dev_bo(256)
                    raw.config_cu(ctx, [(cu, 0)])
                    contexts.append((ctx, syncobj))
                elif roll < 0.6:
                    ctx, syncobj = rng.choice(contexts)
                    cmd, cmd_addr = raw.shmem(4096, BO_CMD)
                    write_addr(cmd_addr, packet(ERT_START_CU, regmap(info.xdna_addr, len(stream) // 4,
                                                                           [a_addr, b_addr])))
                    if cmds and rng.random() < 0.3:
                        chain, chain_addr = raw.shmem(4096, BO_CMD)
                        write_addr(chain_addr, chain_packet([cmd, rng.choice(cmds), chain]))
                        cmd = chain
                    if rng.random() < 0.05:
                        device.faults.hang(stream)
                    seq = raw.exec_cmd(ctx, cmd, [instr, a, b])
                    cmds.append(cmd)
                    if rng.random() < 0.5:
                        raw.timeline_wait(syncobj, seq, timeout_s=rng.choice([0.001, 3.0]))
                elif roll < 0.7:
                    ctx, syncobj = contexts.pop(rng.randrange(len(contexts)))
                    raw.destroy_hwctx(ctx)
                    raw.syncobj_destroy(syncobj)
                elif roll < 0.8 and cmds:
                    raw.gem_close(cmds.pop(rng.randrange(len(cmds))))
                elif roll < 0.9:
                    user = UserMem(4096)
                    call(seam, "GET_INFO", 5, 4096, user.addr)
                    call(seam, "GET_ARRAY", 0, 4096, 1, 0, user.addr)
            except OSError as exc:
                if exc.errno == errno.EBADF or exc.errno == errno.ENODEV:
                    return
                if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.ENOSPC, errno.EBUSY, errno.ETIME):
                    failures.append(exc)
    except OSError as exc:
        if exc.errno not in (errno.EBADF, errno.ENODEV):
            failures.append(exc)
    except BaseException as exc:          # any other exception is a defect: report it from the main thread
        failures.append(exc)
    finally:
        if rng.random() < 0.7:
            seam.close()


@pytest.mark.parametrize("close_device_early", [False, True])
def test_many_fds_from_threads(close_device_early):
    """Four fds driven at once (contexts, chains, hangs, destroys, GEM_CLOSE, queries); the device closed
    under them or after them: no thread stuck, nothing reported as internal, nothing live after close."""
    failures: list[BaseException] = []
    with watched_log() as log:
        device = EmuDevice("npu4", tdr_timeout=0.2)
        threads = [threading.Thread(target=random_client, args=(device, seed, failures)) for seed in range(4)]
        for thread in threads:
            thread.start()
        if close_device_early:
            for _ in range(2000):
                if sum(device.counters.ioctls.values()) > 150:
                    break
                time.sleep(0.001)
            device.close()
        for thread in threads:
            thread.join(20)
        assert not any(thread.is_alive() for thread in threads)
        device.close()
    assert failures == []
    assert log.records == []
    check_released(device)
