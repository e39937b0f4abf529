"""The 2026 expandable heap behind ``EmuDevice(..., expandable_heap=True)`` (docs/uapi.md 4.4, 7).

Raw-ioctl tests (tests/emu_raw.py, structs from the ABI facts) provoke each rule of the staging paragraph
of docs/uapi.md 4.4: DEV_HEAP sizes are non-zero multiples of 64 MiB, chunks append at 0x4000000 + cumulative size
up to dev_heap_max_size (NPU1 64 MiB, NPU4/5/6 512 MiB) then ENOSPC, a DEV BO short of heap or over an
unmapped chunk is EAGAIN, and the chunks under one DEV BO must sit at contiguous user VAs (else EINVAL).
The last tests drive the runtime's XRT-style growth (device.py grow_heap, bo.py retry on EAGAIN).
"""

from __future__ import annotations

import errno

import numpy as np
import pytest
from emu_raw import (
    BO_DEV,
    BO_DEV_HEAP,
    HEAP_BASE,
    INVALID_ADDR,
    PAGE,
    ZERO_LIVE,
    Raw,
    emu_device,
    errno_of,
    pack,
    read_addr,
    request,
    write_addr,
)

from amdxdna_direct import Xclbin, cmd, open_device
from amdxdna_direct.emu import DeviceFault, EmuDevice, Passthrough
from amdxdna_direct.errors import XdnaError

KIB = 1 << 10
MIB = 1 << 20
CHUNK = 64 * MIB                    # AIE2_DEVM_SIZE: the unit of heap sizes (docs/uapi.md 4.4 staging)


@pytest.fixture
def emu():
    with emu_device("npu4", expandable_heap=True) as device:    # whatever a test leaves, close must release
        yield device


@pytest.fixture
def raw(emu):
    return Raw(emu.open())


def add_chunk(raw: Raw, base: int | None, index: int, size: int = CHUNK) -> tuple[int, int | None]:
    """CREATE_BO DEV_HEAP of `size`; mapped at base + index x 64 MiB unless `base` is None: (handle, VA)."""
    handle = raw.create_bo(size, BO_DEV_HEAP)
    if base is None:
        return handle, None
    return handle, raw.map_bo(handle, size, base + index * CHUNK)


# ---------------------------------------------------------------------------------------------- DEV_HEAP

def test_heap_size_must_be_a_nonzero_multiple_of_64_mib(raw):
    for size in (0, PAGE, 32 * MIB, CHUNK + PAGE, CHUNK + 32 * MIB):
        assert errno_of(raw.create_bo, size, BO_DEV_HEAP) == errno.EINVAL, hex(size)
    first = raw.create_bo(CHUNK, BO_DEV_HEAP)
    second = raw.create_bo(2 * CHUNK, BO_DEV_HEAP)          # no EBUSY: several heaps per fd
    assert raw.bo_info(first).xdna_addr == HEAP_BASE
    assert raw.bo_info(second).xdna_addr == HEAP_BASE + CHUNK


def test_chunks_append_up_to_dev_heap_max_size_then_enospc(raw):
    sizes = [CHUNK, 3 * CHUNK, CHUNK, 2 * CHUNK, CHUNK]     # 8 x 64 MiB = 512 MiB (NPU4)
    handles = [raw.create_bo(size, BO_DEV_HEAP) for size in sizes]
    starts = [HEAP_BASE + sum(sizes[:i]) for i in range(len(sizes))]
    assert [raw.bo_info(h).xdna_addr for h in handles] == starts
    assert errno_of(raw.create_bo, CHUNK, BO_DEV_HEAP) == errno.ENOSPC
    assert errno_of(raw.create_bo, PAGE, BO_DEV_HEAP) == errno.EINVAL        # the size rule comes first


def test_npu1_window_is_one_chunk():
    with emu_device("npu1", expandable_heap=True) as device:
        raw = Raw(device.open())
        assert errno_of(raw.create_bo, 2 * CHUNK, BO_DEV_HEAP) == errno.ENOSPC
        raw.create_bo(CHUNK, BO_DEV_HEAP)
        assert errno_of(raw.create_bo, CHUNK, BO_DEV_HEAP) == errno.ENOSPC
        assert errno_of(raw.create_bo, CHUNK + PAGE, BO_DEV) == errno.EINVAL  # beyond dev_heap_max_size


def test_default_profile_keeps_the_7_0_rules():
    with emu_device("npu4") as device:
        raw = Raw(device.open())
        assert errno_of(raw.create_bo, PAGE, BO_DEV) == errno.EINVAL         # no heap: EINVAL, not EAGAIN
        raw.heap(32 * MIB)                                                   # 7.0 takes any size <= 64 MiB
        assert errno_of(raw.create_bo, CHUNK, BO_DEV_HEAP) == errno.EBUSY
        assert errno_of(raw.create_bo, 32 * MIB + PAGE, BO_DEV) == errno.EINVAL


# ---------------------------------------------------------------------------------------------- DEV BOs

def test_dev_bo_without_enough_mapped_heap_is_eagain(emu, raw):
    assert errno_of(raw.create_bo, PAGE, BO_DEV) == errno.EAGAIN                 # no heap
    assert errno_of(raw.create_bo, 0, BO_DEV) == errno.EINVAL
    assert errno_of(raw.create_bo, 512 * MIB + PAGE, BO_DEV) == errno.EINVAL     # > dev_heap_max_size
    base = raw.seam.reserve(8 * CHUNK, CHUNK)
    first, _ = add_chunk(raw, None, 0)
    assert errno_of(raw.create_bo, PAGE, BO_DEV) == errno.EAGAIN                 # heap not mapped
    va0 = raw.map_bo(first, CHUNK, base)
    filler, filler_info = raw.dev_bo(CHUNK - 32 * KIB)
    assert (filler_info.xdna_addr, filler_info.vaddr) == (HEAP_BASE, va0)
    assert errno_of(raw.create_bo, 64 * KIB, BO_DEV) == errno.EAGAIN             # 32 KiB left in the heap
    second, _ = add_chunk(raw, None, 1)
    assert errno_of(raw.create_bo, 64 * KIB, BO_DEV) == errno.EAGAIN             # the new chunk is unmapped
    raw.map_bo(second, CHUNK, base + CHUNK)
    handle, info = raw.dev_bo(64 * KIB)                                          # retried, as XRT does
    assert info.xdna_addr == HEAP_BASE + CHUNK - 32 * KIB                        # the failed tries took nothing
    assert (info.vaddr, info.map_offset) == (va0 + CHUNK - 32 * KIB, INVALID_ADDR)
    assert emu.counters.live()["bos"] == 4                                       # 2 chunks, 2 DEV BOs


def test_chunks_under_one_dev_bo_need_contiguous_uvas(raw):
    base = raw.seam.reserve(3 * CHUNK, CHUNK)
    _, va0 = add_chunk(raw, base, 0)
    _, va1 = add_chunk(raw, base, 2)                        # a 64 MiB gap after chunk 0
    raw.dev_bo(32 * MIB)
    assert errno_of(raw.create_bo, CHUNK, BO_DEV) == errno.EINVAL               # "uva is not contiguous"
    _, inside0 = raw.dev_bo(32 * MIB)                       # the refused range was given back
    _, inside1 = raw.dev_bo(MIB)                            # wholly in chunk 1: its own VA is enough
    assert (inside0.xdna_addr, inside0.vaddr) == (HEAP_BASE + 32 * MIB, va0 + 32 * MIB)
    assert (inside1.xdna_addr, inside1.vaddr) == (HEAP_BASE + CHUNK, va1)


def test_dev_bo_across_chunks_is_one_range_for_host_and_device(emu, raw):
    base = raw.seam.reserve(2 * CHUNK, CHUNK)
    chunk0, va0 = add_chunk(raw, base, 0)
    chunk1, va1 = add_chunk(raw, base, 1)
    raw.dev_bo(CHUNK - MIB)
    handle, info = raw.dev_bo(2 * MIB)                      # the last 1 MiB of chunk 0 and the first of chunk 1
    assert (info.xdna_addr, info.vaddr) == (HEAP_BASE + CHUNK - MIB, va0 + CHUNK - MIB)
    assert va1 == va0 + CHUNK
    pattern = bytes(range(256)) * 64                        # 16 KiB across the chunk boundary
    write_addr(info.vaddr + MIB - 8 * KIB, pattern)
    memory = raw.seam.client.memory
    bo, offset = memory.resolve(info.xdna_addr + MIB - 8 * KIB, len(pattern))
    assert (bo is raw.seam.client.bos[handle], offset) == (True, MIB - 8 * KIB)
    assert bytes(bo.mem[offset:offset + len(pattern)]) == pattern
    assert read_addr(va1, 8 * KIB) == pattern[8 * KIB:]   # chunk 1's own mapping holds the second half
    # Outside a DEV BO the device sees one chunk at a time.
    chunk_bo, chunk_offset = memory.resolve(HEAP_BASE + CHUNK + 4 * MIB, PAGE)
    assert (chunk_bo is raw.seam.client.bos[chunk1], chunk_offset) == (True, 4 * MIB)
    with pytest.raises(DeviceFault):
        memory.resolve(HEAP_BASE + 2 * CHUNK - PAGE, 2 * PAGE)                  # past the last chunk
    # The BO references both chunks (the driver pins and puts heap_start_id..heap_end_id).
    chunks = [raw.seam.client.bos[h] for h in (chunk0, chunk1)]
    assert (bo.heap, bo.more_heaps) == (chunks[0], (chunks[1],))
    before = [c.refs for c in chunks]
    raw.gem_close(handle)
    assert [c.refs for c in chunks] == [before[0] - 1, before[1] - 1]
    raw.seam.munmap(base, 2 * CHUNK)
    raw.seam.close()
    assert emu.counters.live() == ZERO_LIVE


def test_contexts_take_their_buffers_from_the_chunks(emu, raw):
    base = raw.seam.reserve(2 * CHUNK, CHUNK)
    add_chunk(raw, base, 0)
    raw.dev_bo(CHUNK - 4 * 32 * KIB)
    raw.create_hwctx()                                      # the last four 32 KiB slots of chunk 0
    assert errno_of(raw.create_hwctx) == errno.EAGAIN       # same heap allocator: EAGAIN, not ENOSPC
    add_chunk(raw, base, 1)
    raw.create_hwctx()
    assert emu.counters.live()["hwctx"] == 2
    raw.seam.close()
    assert emu.counters.live() == ZERO_LIVE


def test_heap_chunks_are_not_exported(raw):
    # Emulator limit: chunks share one window file, which PRIME import could not tell apart.
    handle = raw.create_bo(CHUNK, BO_DEV_HEAP)
    args = pack("prime_handle", handle, 0, -1)
    assert errno_of(raw.seam.ioctl, request("PRIME_HANDLE_TO_FD"), args) == errno.EOPNOTSUPP


# ---------------------------------------------------------------------------------------------- runtime

def test_runtime_grows_the_heap_on_eagain():
    emu = EmuDevice("npu4", expandable_heap=True)
    dev = open_device(emu)
    try:
        sizes = (40 * MIB, 40 * MIB, 24 * MIB)              # 104 MiB: the second BO crosses into chunk 1
        bos = [dev.bo(size, kind="dev") for size in sizes]
        chunks = dev.heap
        assert len(chunks) == 2
        assert chunks[1].va == chunks[0].va + chunks[0].size == chunks[0].va + CHUNK
        assert [c.xdna_addr for c in chunks] == [HEAP_BASE, HEAP_BASE + CHUNK]
        # heap, BO 0, BO 1 (EAGAIN), heap, BO 1 again, BO 2
        assert dev.stats["CREATE_BO"] == emu.counters.ioctls["CREATE_BO"] == 6
        assert [b.address for b in bos] == [HEAP_BASE, HEAP_BASE + 40 * MIB, HEAP_BASE + 80 * MIB]
        assert [b.cpu_address - chunks[0].va for b in bos] == [0, 40 * MIB, 80 * MIB]
        crossing = bos[1]
        edge = CHUNK - 40 * MIB - 4 * KIB                   # 8 KiB straddling the chunk boundary
        data = np.arange(2048, dtype=np.uint32)
        crossing.array(np.uint32, 2048, edge)[:] = data
        memory = emu.clients[0].memory
        bo, offset = memory.resolve(crossing.address + edge, data.nbytes)
        assert bo.xdna_addr == crossing.address and offset == edge
        assert np.array_equal(np.frombuffer(bo.mem, np.uint32, 2048, offset), data)
        assert emu.counters.live()["bos"] == 5
    finally:
        dev.close()
    assert emu.counters.live() == ZERO_LIVE
    emu.close()


def test_runtime_runs_instructions_from_a_grown_chunk(npu1_fixture):
    # npu1_1col streams are TXN generation 3; an npu4 window with that generation runs them unchanged.
    emu = EmuDevice("npu4", expandable_heap=True, txn_dev_gen=3)
    dev = open_device(emu)
    try:
        stream = (npu1_fixture / "insts.bin").read_bytes()
        emu.models.bind(stream, Passthrough())
        filler = dev.bo(CHUNK - 160 * KIB, kind="dev")      # leaves 4 context slots + the PDI in chunk 0
        ctx = dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
        a, b, c = dev.bo(PAGE), dev.bo(PAGE), dev.bo(PAGE)
        src = np.arange(1024, dtype=np.uint32)
        a.array(np.uint32)[:] = src
        a.sync()
        run = ctx.kernel().prepare_npu(stream, [a, b, c])   # the instruction BO: EAGAIN, grow, chunk 1
        assert run.start().wait(timeout=30) == cmd.ERT_CMD_STATE_COMPLETED
        c.sync()
        assert np.array_equal(c.array(np.uint32)[:16], src[:16])     # the fixture copies 16 words
        assert len(dev.heap) == 2 and not filler.closed
        in_chunk1 = [bo for off, bo in emu.clients[0].memory.dev_bos.items() if off >= CHUNK]
        assert len(in_chunk1) == 1 and bytes(in_chunk1[0].mem[:len(stream)]) == stream
        ctx.close()
    finally:
        dev.close()
    assert emu.counters.live() == ZERO_LIVE
    emu.close()


def test_runtime_grows_the_heap_when_a_context_finds_it_short(npu1_fixture):
    # A context takes 4 x 32 KiB of heap (docs/uapi.md 4.1); with chunk 0 full the driver answers EAGAIN and the
    # runtime grows the heap, as it does for a DEV BO.
    emu = EmuDevice("npu4", expandable_heap=True)
    dev = open_device(emu)
    try:
        filler = dev.bo(CHUNK - 64 * KIB, kind="dev")       # room for the PDI, not for the 4 command lists
        ctx = dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
        assert len(dev.heap) == 2 and ctx.handle >= 1 and not filler.closed
        assert emu.counters.ioctls["CREATE_HWCTX"] == 2     # EAGAIN, then success after the new chunk
        ctx.close()
    finally:
        dev.close()
    assert emu.counters.live() == ZERO_LIVE
    emu.close()


def test_runtime_stops_at_the_driver_limit():
    emu = EmuDevice("npu1", expandable_heap=True)
    dev = open_device(emu)
    try:
        kept = dev.bo(40 * MIB, kind="dev")                 # referenced: a collected Bo frees its range
        with pytest.raises(XdnaError) as caught:
            dev.bo(40 * MIB, kind="dev")
        assert caught.value.errno == errno.ENOSPC           # the 64 MiB NPU1 window is full
        assert len(dev.heap) == 1 and not kept.closed
    finally:
        dev.close()
    assert emu.counters.live() == ZERO_LIVE
    emu.close()
