"""The non-coherent emulator (docs/emulator.md, Memory coherence; rule 56): the device sees a buffer's bytes as of
its last SYNC_BO, and the CPU sees the device's writes only after the next SYNC_BO over them.

Oracles: the bytes each side wrote, the command state, and the firmware's error naming the buffer and range.
The sync-removal tests go through the public runtime API (open a Device on an EmuDevice, hw_context, bo,
prepare_npu) with a seam that drops one SYNC_BO of the run at a time; each dropped sync the run depends on must
show: an ERROR for a buffer the device reads, stale data for the output the CPU reads.
"""

from __future__ import annotations

import errno
import logging
import os
import struct

import numpy as np
import pytest
from emu_raw import (
    ERT_START_CU,
    ERT_STATE_COMPLETED,
    ERT_STATE_ERROR,
    PAGE,
    Npu,
    Raw,
    call,
    emu_device,
    errno_of,
    packet,
    read_addr,
    regmap,
    run_one,
    write_addr,
)
from fixture_files import REPO_FIXTURES

from amdxdna_direct import Device, Xclbin, insts
from amdxdna_direct.emu import EmuDevice, Passthrough
from amdxdna_direct.emu.coherence import LINE, DeviceView
from amdxdna_direct.errors import CommandError
from amdxdna_direct.xclbin import build_mlir_aie, write

NPU1_1COL = REPO_FIXTURES / "xdna" / "mlir-aie-npu1_1col"
STALE = "were written by the CPU after the last sync"


# ------------------------------------------------------------------------------------------- DeviceView alone

def test_device_view_sync_moves_whole_lines_both_ways():
    pages = bytearray(4 * LINE)
    view = DeviceView(memoryview(pages))
    pages[10:20] = b"x" * 10                                   # a CPU write: the device does not see it
    assert view.stale(0, 4 * LINE) == (10, 20) and not view.dev.any()
    view.sync(15, 16)                                          # one byte: its whole line is flushed
    assert view.stale(0, 4 * LINE) is None and bytes(view.dev[10:20]) == b"x" * 10
    view.dev[LINE + 1] = 7                                     # a device write to line 1 ...
    view.written(LINE, 2 * LINE, whole=False)
    assert pages[LINE + 1] == 0                                # ... is not in the CPU pages yet
    assert view.stale(0, 4 * LINE) is None                     # nor does it make the line stale
    view.sync(0, LINE)                                         # another line: line 1 stays device-only
    assert pages[LINE + 1] == 0
    view.sync(LINE + 63, LINE + 64)
    assert pages[LINE + 1] == 7 and not view.dirty.any()


def test_device_view_write_only_range_and_a_cpu_write_over_device_lines():
    pages = bytearray(3 * LINE)
    view = DeviceView(memoryview(pages))
    pages[:] = b"\x11" * len(pages)
    view.sync(0, len(pages))
    view.dev[LINE:] = 0x33                                     # the device writes lines 1 and 2 ...
    view.written(LINE, LINE + 8, whole=True)                   # ... an S2MM range: its whole line counts
    view.written(2 * LINE, 3 * LINE, whole=False)              # a read-write range: the lines that changed
    assert list(view.dirty) == [False, True, True]
    pages[2 * LINE + 5] = 0x22                                 # the CPU writes into a device-written line
    assert view.stale(0, len(pages)) == (2 * LINE + 5, 2 * LINE + 6)     # the device would not see it
    view.sync(0, len(pages))
    # Line 0: not device-written, the CPU's; line 1: the device's; line 2: the CPU's write-back wins.
    assert bytes(pages) == b"\x11" * LINE + b"\x33" * LINE + b"\x11" * 5 + b"\x22" + b"\x11" * (LINE - 6)
    assert bytes(view.dev) == bytes(pages) and not view.dirty.any()


# ------------------------------------------------------------------------------------------- raw ioctls

@pytest.fixture
def npu():
    made = Npu("npu4")
    yield made
    made.close()


def test_rule_56(npu, caplog):
    """An input the CPU wrote after its last sync fails the command naming the BO and the range; the output the
    device wrote reaches the CPU only at a SYNC_BO over it."""
    ctx, syncobj = npu.context()
    job = npu.passthrough(nbytes=256)
    a = job["args"][1]
    in_addr = job["words"][5] | job["words"][6] << 32
    write_addr(in_addr + 8, b"late")                           # after Npu.data's sync
    with caplog.at_level(logging.ERROR, logger="amdxdna_direct.emu"):
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_ERROR
    assert f"arg 0: SHMEM BO handle {a}, bytes [0x8, 0xc) {STALE}" in caplog.text
    npu.raw.sync(a, 12, offset=8)
    write_addr(job["cmd_addr"], packet(ERT_START_CU, job["words"]))      # the failure 0xFF-filled the packet
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
    expected = job["src"][:8] + b"late" + job["src"][12:]
    assert read_addr(job["out"], 256) == bytes(256)            # not synced yet: the CPU's stale copy
    npu.raw.sync(job["out_bo"], 1, offset=LINE + 5)            # one byte: its whole cache line
    assert read_addr(job["out"], 256) == bytes(LINE) + expected[LINE:2 * LINE] + bytes(256 - 2 * LINE)
    assert npu.output(job) == expected


def test_instructions_and_pdi_written_after_their_sync_fail(npu, caplog):
    ctx, syncobj = npu.context()
    job = npu.passthrough()
    ins = job["args"][0]
    instr_addr = job["words"][2] | job["words"][3] << 32
    info = npu.raw.bo_info(ins)
    assert info.xdna_addr == instr_addr
    write_addr(info.vaddr + 4 * 7, struct.pack("<I", 0xAAAA))    # a word of the first op, not synced
    with caplog.at_level(logging.ERROR, logger="amdxdna_direct.emu"):
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_ERROR
        assert f"the instruction stream: DEV BO handle {ins}, bytes [0x1c, 0x1e) {STALE}" in caplog.text
        write_addr(info.vaddr + 4 * 7, job["stream"][28:32])   # written back as it was: nothing stale
        write_addr(job["cmd_addr"], packet(ERT_START_CU, job["words"]))
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
        pdi = npu.dev.clients[0].contexts[ctx].cus[0][0]
        write_addr(pdi.vaddr, b"\x00")                         # the PDI's first byte (0xdd) changed
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_ERROR
        assert f"the PDI of CU 0: DEV BO handle {pdi.handle}, bytes [0x0, 0x1) {STALE}" in caplog.text


def test_device_to_device_needs_no_cpu_sync(npu):
    """Job 1's output is job 2's input: the device reads what it wrote, no SYNC_BO in between."""
    ctx, syncobj = npu.context()
    first = npu.passthrough(tag=3)
    second = npu.passthrough(tag=4)
    mid = first["args"][2]
    mid_addr = first["out"]
    words = second["words"]
    rewired = regmap(words[2] | words[3] << 32, words[4], [mid_addr, second["out"]], nslots=5)
    write_addr(second["cmd_addr"], packet(ERT_START_CU, rewired))
    second["args"][1] = mid
    assert run_one(npu, ctx, syncobj, first) == ERT_STATE_COMPLETED
    assert run_one(npu, ctx, syncobj, second) == ERT_STATE_COMPLETED
    assert npu.output(second) == first["src"]
    assert read_addr(mid_addr, 64) == bytes(64)                # never synced to the CPU


def test_cpu_input_over_a_device_output_reaches_the_device(npu, caplog):
    """The CPU reuses a buffer the device wrote (never synced back) as the next input: written without a sync it
    is stale for the device; synced, the CPU's bytes win over the device's, as clflush writes a dirty line back."""
    ctx, syncobj = npu.context()
    first = npu.passthrough(tag=5)
    assert run_one(npu, ctx, syncobj, first) == ERT_STATE_COMPLETED          # `out` now device-written
    second = npu.passthrough(tag=6)
    words = second["words"]
    write_addr(second["cmd_addr"], packet(ERT_START_CU, regmap(words[2] | words[3] << 32, words[4],
                                                               [first["out"], second["out"]], nslots=5)))
    second["args"][1] = first["out_bo"]
    write_addr(first["out"], b"new input")
    with caplog.at_level(logging.ERROR, logger="amdxdna_direct.emu"):
        assert run_one(npu, ctx, syncobj, second) == ERT_STATE_ERROR
    assert f"arg 0: SHMEM BO handle {first['out_bo']}, bytes [0x0, 0x9) {STALE}" in caplog.text
    npu.raw.sync(first["out_bo"], 64)
    write_addr(second["cmd_addr"], packet(ERT_START_CU, regmap(words[2] | words[3] << 32, words[4],
                                                               [first["out"], second["out"]], nslots=5)))
    assert run_one(npu, ctx, syncobj, second) == ERT_STATE_COMPLETED
    assert npu.output(second)[:9] == b"new input"
    assert npu.output(second)[9:] == bytes(55)                 # the CPU's zeros of that line, not the old output


def test_command_bo_is_coherent(npu):
    """The driver reads the command BO through its own mapping and writes the state there: no sync either way."""
    ctx, syncobj = npu.context()
    job = npu.passthrough()
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED   # packet written after no sync; state read


def test_coherent_profile_needs_no_sync():
    made = Npu("npu4", coherent=True)
    try:
        ctx, syncobj = made.context()
        job = made.passthrough()
        in_addr = job["words"][5] | job["words"][6] << 32
        write_addr(in_addr, b"fresh")
        assert run_one(made, ctx, syncobj, job) == ERT_STATE_COMPLETED
        assert read_addr(job["out"], 5) == b"fresh"
    finally:
        made.close()


def test_sync_from_device_still_flushes_before_its_einval(npu):
    """Rule B7: FROM_DEVICE on a BO that is no debug buffer is EINVAL after the flush."""
    ctx, syncobj = npu.context()
    job = npu.passthrough()
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
    assert errno_of(call, npu.seam, "SYNC_BO", job["out_bo"], 1, 0, 64) == errno.EINVAL
    assert read_addr(job["out"], 64) == job["src"]


def test_imported_buffer_shares_the_device_memory():
    """Two devices importing one dma-buf share one RAM: a sync in one makes the CPU's bytes the other's input."""
    with emu_device("npu4") as exporter:
        raw = Raw(exporter.open())
        handle, addr = raw.shmem(PAGE)
        fd = call(raw.seam, "PRIME_HANDLE_TO_FD", handle, 0, -1)[2]
        try:
            npu = Npu("npu4")
            try:
                theirs = call(npu.seam, "PRIME_FD_TO_HANDLE", 0, 0, fd)[0]
                theirs_addr = npu.raw.map_bo(theirs, PAGE)
                ctx, syncobj = npu.context()
                job = npu.passthrough()
                words = job["words"]
                write_addr(job["cmd_addr"], packet(ERT_START_CU, regmap(words[2] | words[3] << 32, words[4],
                                                                        [theirs_addr, job["out"]], nslots=5)))
                job["args"][1] = theirs
                write_addr(addr, job["src"])
                raw.sync(handle, 64)                           # synced by the exporter's fd
                assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
                assert npu.output(job) == job["src"]
                npu.seam.munmap(theirs_addr, PAGE)
            finally:
                npu.close()
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------- the runtime

class DropSync:
    """A seam that forwards everything but the `drop`-th SYNC_BO (counting from 0), which it answers 0 without
    calling the driver; it records each SYNC_BO as (phase, handle, dropped)."""

    SYNC_BO_NR = 0x45

    def __init__(self, inner, drop: int | None):
        self.inner, self.name, self.drop = inner, inner.name, drop
        self.phase = "open"
        self.syncs: list[tuple[str, int, bool]] = []

    def ioctl(self, request: int, buf) -> int:
        if request & 0xFF == self.SYNC_BO_NR and (request >> 8) & 0xFF == ord("d"):
            dropped = len(self.syncs) == self.drop
            self.syncs.append((self.phase, struct.unpack_from("<I", buf)[0], dropped))
            if dropped:
                return 0
        return self.inner.ioctl(request, buf)

    def mmap(self, length: int, offset: int, addr: int = 0) -> int:
        return self.inner.mmap(length, offset, addr)

    def reserve(self, length: int, alignment: int) -> int:
        return self.inner.reserve(length, alignment)

    def munmap(self, addr: int, length: int) -> None:
        self.inner.munmap(addr, length)

    def close(self) -> None:
        self.inner.close()


def fixture_design() -> tuple[str, Xclbin, bytes, int, list]:
    if not NPU1_1COL.is_dir():
        pytest.skip(f"tests/fixtures incomplete: no fixture at {NPU1_1COL}")
    return "npu1", Xclbin.load(NPU1_1COL / "aie.xclbin"), (NPU1_1COL / "insts.bin").read_bytes(), 64, [0, None, 1]


def generated_design() -> tuple[str, Xclbin, bytes, int, list]:
    stream = insts.encode(insts.dma_stream(4, [(0, 256, "in"), (1, 256, "out")]))
    return "npu4", Xclbin.load(write(build_mlir_aie(b"\xdd" * 512, n_buffers=2))), stream, 256, [0, 1]


def passthrough_run(design, drop: int | None) -> tuple[list, str, np.ndarray, np.ndarray, dict]:
    """The README's passthrough run on a fresh emulated device, dropping SYNC_BO number `drop`:
    (syncs, final state, input, output as the CPU reads it, handles by role)."""
    profile, xclbin, stream, nbytes, slots = design
    emu = EmuDevice(profile)
    seam = DropSync(emu.open(), drop)
    dev = Device(seam, emulator=emu, owns_emulator=True)
    try:
        emu.models.bind(stream, Passthrough())
        seam.phase = "hw_context"
        ctx = dev.hw_context(xclbin)
        seam.phase = "bo"
        bos = [dev.bo(4096), dev.bo(4096)]
        src = np.arange(nbytes // 4, dtype=np.int32) + 1
        bos[0].array(np.int32)[:nbytes // 4] = src
        seam.phase = "input"
        bos[0].sync()
        seam.phase = "prepare"
        run = ctx.kernel().prepare_npu(stream, [None if s is None else bos[s] for s in slots])
        seam.phase = "run"
        try:
            run.start().wait(timeout=10)
            state = "COMPLETED"
        except CommandError as exc:
            state = exc.state
        seam.phase = "output"
        bos[1].sync()
        out = bos[1].array(np.int32)[:nbytes // 4].copy()
        return seam.syncs, state, src, out, {"input": bos[0].handle, "output": bos[1].handle}
    finally:
        dev.close()


@pytest.mark.parametrize("design", [fixture_design, generated_design], ids=["npu1_1col-fixture", "dma_stream"])
def test_removing_any_needed_sync_from_a_runtime_passthrough_shows(design, caplog):
    design = design()
    syncs, state, src, out, handles = passthrough_run(design, None)
    assert state == "COMPLETED" and np.array_equal(out, src)
    phases = [phase for phase, _, _ in syncs]
    # PDI, the two new buffers, the input, the instructions, the output.
    assert phases == ["hw_context", "bo", "bo", "input", "prepare", "output"], syncs
    for index, (phase, handle, _) in enumerate(syncs):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="amdxdna_direct.emu"):
            _, state, src, out, handles = passthrough_run(design, index)
        if phase == "bo":
            # A new buffer's pages are zeros on both sides: its first sync changes nothing the emulator sees.
            assert state == "COMPLETED" and np.array_equal(out, src), (phase, handle)
        elif phase == "output":
            assert state == "COMPLETED" and not out.any()          # the CPU still has the zeros it wrote
        else:
            assert state == "ERROR", (phase, handle, state)
            what = {"hw_context": "the PDI of CU 0: DEV BO", "prepare": "the instruction stream: DEV BO",
                    "input": f"arg 0: SHMEM BO handle {handles['input']},"}[phase]
            assert what in caplog.text and STALE in caplog.text, caplog.text
