"""DMA extents: a buffer descriptor's transfer must end inside the BO its patched address lands in
(docs/emulator.md, "DMA extents"; issue 13 item 3).

Oracles: the BD lengths the test writes into the TXN stream, the BO sizes it creates (SHMEM sizes round up to a page,
DEV BOs start 32 KiB aligned: docs/emulator.md, Memory model) and the neighbour's bytes, which it reads back.
"""

from __future__ import annotations

import pytest
from emu_raw import (
    ERT_START_CU,
    ERT_STATE_COMPLETED,
    ERT_STATE_ERROR,
    PAGE,
    Npu,
    packet,
    read_addr,
    regmap,
    state_of,
    txn_stream,
    write_addr,
)

KIB = 1024


@pytest.fixture
def npu():
    made = Npu()
    yield made
    made.close()


def run(npu: Npu, ctx: int, syncobj: int, stream: bytes, slots: list[int], handles: list[int]) -> tuple[int, int]:
    """Bind a passthrough to `stream`, run it with the buffer `slots` -> (state, seq)."""
    from amdxdna_direct.emu import Passthrough

    npu.dev.models.bind(stream, Passthrough())
    ins, iaddr = npu.instr(stream)
    cmd, cmd_addr = npu.cmd(packet(ERT_START_CU, regmap(iaddr, len(stream) // 4, slots)))
    seq = npu.raw.exec_cmd(ctx, cmd, [ins, *handles])
    npu.raw.timeline_wait(syncobj, seq)
    return state_of(cmd_addr), seq


@pytest.mark.parametrize("after", [0, 448])
def test_sub_buffer_near_the_end_of_its_parent_faults_past_the_parent(npu, after):
    """The issue's case: a 64-byte sub-buffer with `after` bytes of its parent behind it (448: the bytes the issue saw
    overwritten; 0: the parent's last 64 bytes) given to a stream that programs 16 KiB. The emulator sees only the
    parent: the transfer runs past the parent's end and faults before writing anything, so the parent beyond the
    sub-buffer and the mapping after the parent (another BO, placed right behind it) keep their bytes."""
    ctx, syncobj = npu.context()
    src, src_addr = npu.data(16 * KIB, bytes(range(256)) * 64)
    base = npu.seam.reserve(2 * PAGE + 16 * KIB, PAGE)
    parent, neighbour = npu.raw.create_bo(PAGE, 1), npu.raw.create_bo(16 * KIB, 1)
    parent_addr = npu.raw.map_bo(parent, PAGE, base)
    neighbour_addr = npu.raw.map_bo(neighbour, 16 * KIB, base + PAGE)
    write_addr(neighbour_addr, b"\x5a" * 16 * KIB)
    npu.raw.sync(neighbour, 16 * KIB)
    npu.raw.sync(parent, PAGE)
    stream = txn_stream(npu.gen, [(0, 16 * KIB), (1, 16 * KIB)], tag=1)
    start = PAGE - 64 - after
    sub_addr = parent_addr + start
    state, seq = run(npu, ctx, syncobj, stream, [src_addr, sub_addr], [src, parent, neighbour])
    assert state == ERT_STATE_ERROR
    assert npu.seam.command_reason(ctx, seq) == (
        f"firmware error: arg 1: the DMA of TXN op 5 (DDR_PATCH of shim BD 1, column 0: 16384 bytes at regmap slot "
        f"{sub_addr:#x} + arg_plus 0) faults: device access [{sub_addr:#x}, {sub_addr + 16 * KIB:#x}) runs "
        f"{16 * KIB - 64 - after} bytes past the end of SHMEM BO handle {parent} (0x1000 bytes, the access starts at "
        f"offset {start:#x})")
    npu.raw.sync(neighbour, 16 * KIB)
    assert read_addr(neighbour_addr, 16 * KIB) == b"\x5a" * 16 * KIB
    assert read_addr(parent_addr, PAGE) == bytes(PAGE)


def test_dma_past_a_dev_bo_does_not_reach_the_next_one(npu):
    """Two DEV BOs side by side in the heap: a BD of 64 KiB patched into the first (32 KiB) used to resolve as a
    raw heap access and overwrite the second; it faults at the first BO's end."""
    ctx, syncobj = npu.context()
    src, src_addr = npu.data(64 * KIB, b"\x11" * 64 * KIB)
    first, first_info = npu.raw.dev_bo(32 * KIB)
    second, second_info = npu.raw.dev_bo(32 * KIB)
    assert second_info.xdna_addr == first_info.xdna_addr + 32 * KIB          # adjacent (32 KiB-aligned placement)
    write_addr(second_info.vaddr, b"\x77" * 32 * KIB)
    npu.raw.sync(second, 32 * KIB)
    stream = txn_stream(npu.gen, [(0, 64 * KIB), (1, 64 * KIB)], tag=2)
    state, seq = run(npu, ctx, syncobj, stream, [src_addr, first_info.xdna_addr], [src, first, second])
    assert state == ERT_STATE_ERROR
    reason = npu.seam.command_reason(ctx, seq)
    assert f"runs 32768 bytes past the end of DEV BO handle {first} (0x8000 bytes, the access starts at offset 0x0)" \
        in reason, reason
    npu.raw.sync(second, 32 * KIB)
    assert read_addr(second_info.vaddr, 32 * KIB) == b"\x77" * 32 * KIB
    # The same DMA sized to the BO runs.
    fits = txn_stream(npu.gen, [(0, 32 * KIB), (1, 32 * KIB)], tag=3)
    assert run(npu, ctx, syncobj, fits, [src_addr, first_info.xdna_addr], [src, first])[0] == ERT_STATE_COMPLETED
    npu.raw.sync(first, 32 * KIB)
    assert read_addr(first_info.vaddr, 32 * KIB) == b"\x11" * 32 * KIB


def test_dma_past_a_partial_mapping_faults(npu):
    """A SHMEM BO mapped only in part: the device resolves through the mapping (SVA), so a transfer past the mapped
    part faults even though the BO itself is larger."""
    ctx, syncobj = npu.context()
    src, src_addr = npu.data(2 * PAGE, b"\x22" * 2 * PAGE)
    dst = npu.raw.create_bo(2 * PAGE, 1)
    dst_addr = npu.raw.map_bo(dst, PAGE)
    stream = txn_stream(npu.gen, [(0, 2 * PAGE), (1, 2 * PAGE)], tag=4)
    state, seq = run(npu, ctx, syncobj, stream, [src_addr, dst_addr], [src, dst])
    assert state == ERT_STATE_ERROR
    assert npu.seam.command_reason(ctx, seq).endswith(
        f"device access [{dst_addr:#x}, {dst_addr + 2 * PAGE:#x}) runs 4096 bytes past the end of its user mapping "
        f"of SHMEM BO handle {dst} (the rest of the BO is not mapped there)")


def test_short_sub_buffer_inside_its_parent_is_invisible_to_the_emulator(npu):
    """What the emulator cannot catch (the runtime's prepare_npu check does): a 64-byte sub-buffer at the start of
    a 64 KiB parent with a 16 KiB transfer stays inside the parent, so the device, like the IOMMU, sees a legal
    access and the parent beyond the sub-buffer is written."""
    ctx, syncobj = npu.context()
    src, src_addr = npu.data(16 * KIB, b"\x33" * 16 * KIB)
    parent, parent_addr = npu.data(64 * KIB)
    stream = txn_stream(npu.gen, [(0, 16 * KIB), (1, 16 * KIB)], tag=5)
    assert run(npu, ctx, syncobj, stream, [src_addr, parent_addr], [src, parent])[0] == ERT_STATE_COMPLETED
    npu.raw.sync(parent, 64 * KIB)
    assert read_addr(parent_addr, 64 * KIB) == b"\x33" * 16 * KIB + bytes(48 * KIB)
