"""Hostile conditions for the runtime (issue 13 items 2, 3, 5, 6): sizes checked before allocating, a
buffer shorter than the stream's DMA refused, Ctrl-C at every syscall of a bring-up, a run and its
teardown leaving nothing behind, and a device lost while a wait blocks reported as lost at the wait."""

from __future__ import annotations

import errno
import functools
import gc
import re
import signal
import threading
import time
import tracemalloc

import pytest
from conftest import RecordingSeam, emu_open

from amdxdna_direct import Device, RunList, errors, insts, xclbin
from amdxdna_direct.emu import EmuDevice, Passthrough
from amdxdna_direct.kernel import MAX_REGMAP_BYTES, check_regmap, stream_extents

pytestmark = pytest.mark.emu_only

ZERO = {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def _copy_stream(nbytes: int = 256, dev_gen: int = 4) -> bytes:
    return insts.encode(insts.dma_stream(dev_gen, [(0, nbytes, "in"), (1, nbytes, "out")]))


# -- sizes before allocations -------------------------------------------------------------------------


def _huge_regmap_xclbin() -> bytes:
    """A 6 KB mlir-aie xclbin whose metadata puts bo1 at offset 0x7fffffff0000."""
    x = xclbin.build_mlir_aie(b"p" * 3500, n_buffers=2)
    sections = []
    for s in x.sections:
        if isinstance(s.content, xclbin.EmbeddedMetadata):
            xml = s.content.xml.replace('name="bo1" addressQualifier="1" id="4" size="0x8" offset="0x1c"',
                                        'name="bo1" addressQualifier="1" id="4" size="0x8" offset="0x7fffffff0000"')
            assert xml != s.content.xml
            s = xclbin.Section(s.kind, s.name, xclbin.EmbeddedMetadata(xml))
        sections.append(s)
    return xclbin.write(xclbin.Xclbin(x.header, tuple(sections)))


def test_a_huge_regmap_offset_is_refused_before_any_allocation():
    data = _huge_regmap_xclbin()
    assert 5000 < len(data) < 7000
    parsed = xclbin.Xclbin.load(data)
    assert parsed.kernels[0].regmap_size == 0x7FFFFFFF0000 + 8
    dev, emu, seam = emu_open("npu4")
    with dev:
        tracemalloc.start()
        try:
            with pytest.raises(xclbin.XclbinError) as info:
                dev.hw_context(data)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, peak
        message = str(info.value)
        assert "kernel MLIR_AIE: argument 4 (bo1) at offset 0x7fffffff0000 of 8 bytes" in message
        assert f"ends at byte {0x7FFFFFFF0008}" in message and f"({MAX_REGMAP_BYTES} bytes" in message
        assert isinstance(info.value, errors.Error) and isinstance(info.value, ValueError)
        assert "CREATE_BO" not in seam.ioctls() and "CREATE_HWCTX" not in seam.ioctls()


def test_the_largest_regmap_a_packet_holds_is_accepted():
    kernel = xclbin.build_mlir_aie(b"p").kernels[0]
    check_regmap(kernel)                        # 0x24 bytes: fine
    assert MAX_REGMAP_BYTES == 4096 - 8         # the buffer less the header and the CU mask word


# -- a buffer shorter than the stream's DMA ----------------------------------------------------------


def test_stream_extents_follow_the_buffer_descriptors():
    stream = insts.dma_stream(4, [(0, 16384, "in"), (1, 256, "out")])
    extents = stream_extents(stream)
    assert sorted(extents) == [0, 1]
    assert (extents[0].nbytes, extents[0].bd, extents[0].column, extents[0].arg_plus) == (16384, 0, 0, 0)
    assert (extents[1].nbytes, extents[1].bd) == (256, 1)
    assert isinstance(stream.ops[extents[1].op_index], insts.DdrPatch)
    assert extents[1].word == insts.layout(stream)[extents[1].op_index]
    # A later write of a BD's length word counts, and arg_plus moves the reach.
    ops = list(stream.ops)
    patch = ops[extents[0].op_index]
    ops.insert(extents[0].op_index, insts.Write32(addr=patch.reg_addr - 4, value=64))
    ops[extents[0].op_index + 1] = insts.DdrPatch(reg_addr=patch.reg_addr, arg_idx=0, arg_plus=4096)
    moved = stream_extents(insts.Stream(**{**stream.__dict__, "ops": tuple(ops)}))
    assert (moved[0].nbytes, moved[0].length, moved[0].arg_plus) == (4096 + 256, 256, 4096)


def test_prepare_npu_refuses_a_sub_buffer_shorter_than_the_stream_dma():
    with Device(EmuDevice("npu4").open()) as dev:
        stream = _copy_stream(16384)
        ctx = dev.hw_context(xclbin.build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        kernel = ctx.kernel()
        parent = dev.bo(65536)
        src, short = parent.sub(0, 16384), parent.sub(16384, 64)
        creates = dev.stats["CREATE_BO"]
        with pytest.raises(ValueError) as info:
            kernel.prepare_npu(stream, [src, short])
        op = 4      # buffer 0: BLOCKWRITE, DDR_PATCH, WRITE32; buffer 1: BLOCKWRITE, then its DDR_PATCH
        word = insts.layout(insts.decode(stream))[op]
        assert str(info.value) == (
            f"MLIR_AIE: bo1 (argument 4 (bo1)) is a 64-byte buffer, but the instruction stream's DDR_PATCH (op {op}, "
            f"word {word}) points shim BD 1 of column 0 at it for 16384 bytes at offset 0: its DMA reaches 16384 "
            f"bytes (a larger buffer, or a stream for this size)")
        assert dev.stats["CREATE_BO"] == creates + 1        # the instruction buffer only: no command packet
        run = kernel.prepare_npu(stream, [src, parent.sub(16384, 16384)])      # exactly the extent: accepted
        kernel.prepare_npu(stream, [src, None])             # an unset slot is the firmware's to fault
        # Lengthening a BD under a prepared run is refused too, and nothing is written.
        bd1_length = insts.layout(insts.decode(stream))[3] + 4      # BLOCKWRITE header: 4 words (TXN 0.1)
        before = run.insts.read()
        with pytest.raises(ValueError, match=r"bo1 .* is a 16384-byte buffer, .* for 32768 bytes"):
            run.set_insts_words([(bd1_length, 32768 // 4)])
        assert run.insts.read() == before


# -- a device lost while a wait blocks ----------------------------------------------------------------


def _lose_soon(emu, delay=0.05):
    timer = threading.Timer(delay, emu.faults.lose_device)
    timer.start()
    return timer


@pytest.mark.parametrize("queued", [False, True])
def test_a_device_lost_during_a_wait_is_reported_lost_at_the_wait(queued):
    """Running (the wait wakes with ENODEV) or queued behind a hung run (the job ends ABORT and its fence
    signals): either way the wait itself raises DeviceLostError, and it is latched."""
    for _ in range(3):
        emu = EmuDevice("npu4", tdr_timeout=30)
        with Device(emu.open(), emulator=emu, owns_emulator=True) as dev:
            stream = _copy_stream()
            emu.models.bind(stream, Passthrough())
            ctx = dev.hw_context(xclbin.build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
            a, b = dev.bo(256), dev.bo(256)
            runs = [ctx.kernel().prepare_npu(stream, [a, b]) for _ in range(2)]
            emu.faults.hang(stream)
            runs[0].start()
            waited = runs[1].start() if queued else runs[0]
            timer = _lose_soon(emu)
            with pytest.raises(errors.DeviceLostError) as info:
                waited.wait(20)
            timer.join()
            assert info.value.errno == errno.ENODEV and "ENODEV" in str(info.value)
            with pytest.raises(errors.DeviceLostError, match="device lost earlier"):
                dev.bo(4096)


def test_a_device_lost_under_a_run_list_is_reported_lost_at_its_wait():
    emu = EmuDevice("npu4", tdr_timeout=30)
    with Device(emu.open(), emulator=emu, owns_emulator=True) as dev:
        stream, other = _copy_stream(), _copy_stream(512)
        emu.models.bind(stream, Passthrough())
        emu.models.bind(other, Passthrough())
        ctx = dev.hw_context(xclbin.build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        a, b = dev.bo(512), dev.bo(512)
        hung = ctx.kernel().prepare_npu(other, [a, b])
        emu.faults.hang(other)
        hung.start()
        chain = RunList(ctx, [ctx.kernel().prepare_npu(stream, [a, b]) for _ in range(3)]).start()
        timer = _lose_soon(emu)
        with pytest.raises(errors.DeviceLostError, match=r"ABORT.*device was lost|ENODEV"):
            chain.wait(20)
        timer.join()


def test_an_abort_without_a_lost_device_stays_a_command_error():
    """The probe behind the classification: a live device answers it, the ABORT is reported as such."""
    with Device(EmuDevice("npu4").open()) as dev:
        ctx = dev.hw_context(xclbin.build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        run = ctx.kernel().prepare_npu(_copy_stream(), [dev.bo(256), dev.bo(256)])
        err = errors.CommandError(errno.ECANCELED, "k: command ABORT", kernel="k", state="ABORT", seq=0)
        from amdxdna_direct.kernel import _classified

        versions = dev.stats["VERSION"]
        assert _classified(err, run.ctx) is err and dev.stats["VERSION"] == versions + 1


# -- Ctrl-C at every syscall ----------------------------------------------------------------------------


class _InterruptNth(RecordingSeam):
    """A Ctrl-C at the n-th syscall counted from ``arm``: SIGINT is raised ``before`` the inner call or ``after``
    it returned, as a key press landing just before or during the syscall would."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.arm(-1, "before")

    def arm(self, n: int, when: str) -> None:
        self.left, self.when, self.counted, self.hit = n, when, 0, None

    def _step(self, name, call):
        self.counted += 1
        self.left -= 1
        if self.left == -1:
            self.hit = name
            if self.when == "before":
                signal.raise_signal(signal.SIGINT)
        result = call()
        if self.left == -1 and self.when == "after":
            signal.raise_signal(signal.SIGINT)
        return result

    def ioctl(self, request, buf):
        return self._step(request, lambda: super(_InterruptNth, self).ioctl(request, buf))

    def mmap(self, length, offset, addr=0):
        return self._step("mmap", lambda: super(_InterruptNth, self).mmap(length, offset, addr))

    def reserve(self, length, alignment):
        return self._step("reserve", lambda: super(_InterruptNth, self).reserve(length, alignment))

    def munmap(self, addr, length):
        return self._step("munmap", lambda: super(_InterruptNth, self).munmap(addr, length))


def _scenario(dev, stream):
    """Bring-up, a run, syncs, a run list, and the teardown of each object: every multi-step sequence."""
    ctx = dev.hw_context(xclbin.build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
    a, b = dev.bo(4096), dev.bo(4096)
    a.sync()
    runs = [ctx.kernel().prepare_npu(stream, [a, b]) for _ in range(2)]
    runs[0].start().wait(30)
    b.sync()
    chain = RunList(ctx, runs)
    chain.start().wait(30)
    chain.close()
    for run in runs:
        run.close()
    a.close()
    b.close()
    ctx.close()


def _open_interrupting():
    emu = EmuDevice("npu4")
    seam = _InterruptNth(emu.open())
    dev = Device(seam, emulator=emu, owns_emulator=True)
    stream = _copy_stream()
    emu.models.bind(stream, Passthrough())
    return dev, emu, seam, stream


def _held(emu):
    live = emu.counters.live()
    return live["hwctx"], live["syncobjs"], live["mappings"], set(emu.clients[0].bos)


def _settled(probe, expected, seconds=5.0):
    # A run interrupted in its wait still executes in the emulator; what it uses lives until it ends.
    deadline = time.monotonic() + seconds
    while probe() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return probe()


def _syscalls() -> int:
    dev, emu, seam, stream = _open_interrupting()
    seam.arm(-1, "before")
    _scenario(dev, stream)
    counted = seam.counted
    dev.close()
    return counted


@pytest.mark.parametrize("when", ["before", "after"])
def test_ctrl_c_at_every_syscall_leaves_nothing_behind(when):
    """Interrupt each syscall of the scenario in turn: the KeyboardInterrupt surfaces, and once the caller's
    objects are gone (collected) the fd holds nothing but its heap; closing the device then leaves nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _every_syscall(when)
    finally:
        signal.signal(signal.SIGINT, previous)


def _every_syscall(when):
    steps = _syscalls()
    assert steps > 40
    leaks = []
    for n in range(steps):
        dev, emu, seam, stream = _open_interrupting()
        seam.arm(n, when)
        with pytest.raises(KeyboardInterrupt):
            _scenario(dev, stream)
        hit = seam.hit if isinstance(seam.hit, str) else re.sub(r"^DRM_IOCTL_(AMDXDNA_)?", "", _name(seam.hit))
        gc.collect()
        heap = {chunk.handle for chunk in dev.heap}
        expected = (0, 0, len(heap), heap)
        held = _settled(functools.partial(_held, emu), expected)
        if held != expected:
            leaks.append((n, hit, held, expected))
        dev.close()
        assert _settled(emu.counters.live, ZERO) == ZERO, (n, hit)
    assert not leaks, leaks


def _name(request: int) -> str:
    from amdxdna_direct import trace

    return trace.describe_request(request)[0]


# -- the dispatch path: counts, not times ---------------------------------------------------------------


def _null_device():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from null_seam import NullSeam

    emu = EmuDevice("npu4")
    seam = NullSeam(emu.open())
    return Device(seam, emulator=emu, owns_emulator=True), seam


def test_a_chain_of_96_costs_3_exec_cmd_and_1_wait_and_no_hold_per_dispatch(monkeypatch):
    from amdxdna_direct import bo as bo_mod

    dev, seam = _null_device()
    with dev:
        stream = insts.encode(insts.dma_stream(4, [(0, 4096, "in"), (1, 4096, "in"), (2, 4096, "out")]))
        ctx = dev.hw_context(xclbin.build_mlir_aie(b"pdi", column_width=1, n_buffers=3))
        bufs = [dev.bo(4096) for _ in range(3)]
        single = ctx.kernel().prepare_npu(stream, bufs)
        chain = RunList(ctx, [ctx.kernel().prepare_npu(stream, bufs) for _ in range(96)])
        holds = []
        monkeypatch.setattr(bo_mod.Bo, "hold", lambda self, what: holds.append(what) or ())
        before = dict(dev.stats)
        for _ in range(3):
            assert chain.start().wait() == [4] * 96
        for _ in range(5):
            assert single.start().wait() == 4
        delta = {k: v - before.get(k, 0) for k, v in dev.stats.items() if v != before.get(k, 0)}
        assert delta == {"EXEC_CMD": 3 * 3 + 5, "SYNCOBJ_TIMELINE_WAIT": 3 + 5}
        assert seam.calls == {"EXEC_CMD": 14, "wait": 8} and holds == []
        # Cheap checks, same refusals: a sub-buffer whose parent closes under a prepared list and run.
        sub_run = ctx.kernel().prepare_npu(stream, [bufs[0], bufs[1], bufs[2].sub(0, 4096)])
        bufs[2].close()
        for unit in (chain, single, sub_run):
            with pytest.raises(errors.XdnaError, match="EBADF .*argument buffer .* is closed"):
                unit.start()
        assert dev.stats["EXEC_CMD"] == before.get("EXEC_CMD", 0) + 14
