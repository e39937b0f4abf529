"""Runs end to end: the real npu1_1col fixture, a GEMM over chunked sub-buffers, the exact XRT ioctl
sequence, failures (ERROR, TDR hang, lost device, context refusal) and concurrency."""

from __future__ import annotations

import ctypes
import errno
import functools
import gc
import inspect
import json
import math
import os
import struct
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from conftest import (
    CONFIG_HWCTX,
    CREATE_BO,
    CREATE_HWCTX,
    EXEC_CMD,
    IOCTL_NAMES,
    SYNC_BO,
    TIMELINE_WAIT,
    RecordingSeam,
    emu_open,
    passthrough_stream,
    request_of,
    txn_dev_gen,
)
from fixture_files import fixture

from amdxdna_direct import Device, Run, RunList, Xclbin, cmd, errors, insts, open_device, xclbin
from amdxdna_direct import kernel as kernel_mod
from amdxdna_direct.emu import EmuDevice, Gemm

# Hand-decoded from insts.bin (docs/xrt-sequence.md 2.3 worked example): BD1 (0x1D020, patched with arg_idx 2, the
# output)
# has length word 0x10 = 16 words; BD0 (0x1D000, arg_idx 0, the input) 0x11 = 17 words.
OUT_BYTES = 16 * 4
IN_BYTES = 17 * 4
BF16 = ml_dtypes.bfloat16


def _passthrough(dev, fixture_dir):
    """(ctx, kernel, stream bytes) for the fixture, with the emulator told what the stream computes."""
    stream = passthrough_stream(dev, fixture_dir)
    ctx = dev.hw_context(Xclbin.load(fixture_dir / "aie.xclbin"))
    return ctx, ctx.kernel(), stream


def _buffers(dev, seed=0):
    rng = np.random.default_rng(seed)
    a, b, c = dev.bo(4096), dev.bo(4096), dev.bo(4096)
    src = rng.integers(0, 2**32, 1024, dtype=np.uint32)
    a.array(np.uint32)[:] = src
    a.sync()
    c.array(np.uint8)[:] = 0
    c.sync()
    return a, b, c, src


def test_fixture_passthrough_returns_the_data(device, npu1_fixture):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    a, b, c, src = _buffers(device)
    run = kernel.prepare_npu(stream, [a, b, c])
    assert run.start().wait(timeout=30) == cmd.ERT_CMD_STATE_COMPLETED
    c.sync(direction="from_device")
    out = c.array(np.uint8)
    assert out[:OUT_BYTES].tobytes() == src.view(np.uint8)[:OUT_BYTES].tobytes()
    assert not out[OUT_BYTES:].any()
    assert run.state == cmd.ERT_CMD_STATE_COMPLETED and run.elapsed > 0 and run.seq == 0
    ctx.close()


def test_exact_ioctl_sequence_of_one_passthrough_run(npu1_fixture):
    """The XRT sequence of docs/xrt-sequence.md section 0, call for call, and its key field values."""
    dev, emu, seam = emu_open("npu1")
    config_cu = []
    seam.inject[request_of(0x42)] = lambda buf: config_cu.append(
        ctypes.string_at(CONFIG_HWCTX.unpack_from(buf)[2], CONFIG_HWCTX.unpack_from(buf)[3]))
    ctx, kernel, stream = _passthrough(dev, npu1_fixture)
    pdi = ctx.cus[0].pdi
    pdi_head = pdi.read(16)
    a, b, c, _ = _buffers(dev)
    run = kernel.prepare_npu(stream, [a, b, c])
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    run.start().wait(30)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    c.sync(direction="from_device")
    ctx.close()
    dev.close()
    shmem = ["CREATE_BO", "GET_BO_INFO", "mmap", "SYNC_BO"]        # step 8 + initial flush
    expected = (["VERSION",
                 "CREATE_BO", "GET_BO_INFO", "reserve", "mmap",      # step 2: the heap
                 "GET_INFO", "CREATE_HWCTX",                         # step 4
                 "CREATE_BO", "GET_BO_INFO", "SYNC_BO", "CONFIG_HWCTX"]  # step 5: PDI DEV BO + CONFIG_CU
                + shmem * 3 + ["SYNC_BO", "SYNC_BO"]                 # a, b, c; flush a and c after filling
                + ["CREATE_BO", "GET_BO_INFO", "SYNC_BO"]            # step 7: instruction DEV BO
                + ["CREATE_BO", "GET_BO_INFO", "mmap"]               # step 10: exec BO
                + ["EXEC_CMD", "SYNCOBJ_TIMELINE_WAIT", "SYNC_BO"]   # steps 10-12
                + ["munmap", "GEM_CLOSE", "GEM_CLOSE"]               # step 13: exec BO, instruction BO
                + ["SYNCOBJ_DESTROY", "DESTROY_HWCTX", "GEM_CLOSE"]  # syncobj, context, PDI
                + ["munmap", "GEM_CLOSE"] * 3                        # c, b, a (newest first)
                + ["munmap", "GEM_CLOSE", "munmap", "close"])        # heap, rest of the reservation, fd
    assert seam.names() == expected
    calls = [c for c in seam.calls if c[0] == "ioctl"]
    by_name = {}
    for call, name in zip(calls, seam.ioctls(), strict=True):
        by_name.setdefault(name, []).append(call[2])
    heap = CREATE_BO.unpack_from(by_name["CREATE_BO"][0])
    assert (heap[2], heap[3]) == (64 << 20, 2)                               # DEV_HEAP 64 MiB
    reserve = next(c for c in seam.calls if c[0] == "reserve")
    heap_map = next(c for c in seam.calls if c[0] == "mmap")
    assert reserve[2] == 64 << 20 and heap_map[3] == reserve[3] and heap_map[3] % (64 << 20) == 0
    hwctx = CREATE_HWCTX.unpack_from(by_name["CREATE_HWCTX"][0])
    assert hwctx[0] == hwctx[1] == 0 and hwctx[2] != 0                       # ext, ext_flags, qos_p
    # max_opc and column_width from the JSON the fixture xclbin was built from; core rows 4 (docs/uapi.md 8)
    partition = json.loads((npu1_fixture / "main_aie_partition.json").read_text())["aie_partition"]
    assert (hwctx[5], hwctx[6]) == (int(partition["operations_per_cycle"]), 4 * partition["partition"]["column_width"])
    # CONFIG_CU (docs/uapi.md 2.1): num_cus 1, pad 0; cu_bo = the PDI DEV BO (2nd CREATE_BO), cu_func 0, pad 0
    pdi_create = CREATE_BO.unpack_from(by_name["CREATE_BO"][1])
    # DEV, the 2640-byte PDI (docs/xrt-sequence.md 3.8)
    assert pdi_create[3] == 3 and pdi_create[2] == 2640
    assert struct.unpack("<HHHHIB3s", config_cu[0]) == (1, 0, 0, 0, pdi.handle, 0, bytes(3))
    assert pdi_head == bytes.fromhex("DD000000 44332211 88776655 CCBBAA99".replace(" ", ""))
    exe = EXEC_CMD.unpack_from(by_name["EXEC_CMD"][0])
    assert (exe[3], exe[6], exe[7]) == (0, 1, 4)                             # type, cmd_count, arg_count
    wait = TIMELINE_WAIT.unpack_from(by_name["SYNCOBJ_TIMELINE_WAIT"][0])
    assert (wait[3], wait[4]) == (1, 2)                                      # one handle, WAIT_FOR_SUBMIT
    assert before + 30 * 10**9 <= wait[2] <= after + 30 * 10**9              # absolute CLOCK_MONOTONIC
    last_sync = SYNC_BO.unpack_from(by_name["SYNC_BO"][-1])
    assert last_sync[1] == 0 and last_sync[3] == 4096                        # FROM_DEVICE done as TO_DEVICE


def test_repeated_run_costs_exec_and_wait_only(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx, kernel, stream = _passthrough(dev, npu1_fixture)
    a, b, c, src = _buffers(dev)
    run = kernel.prepare_npu(stream, [a, b, c])
    run.start().wait(30)
    again = kernel.prepare_npu(stream, [a, b, c])   # same stream: the instruction upload is cached
    n = len(seam.calls)
    for i in range(3):
        a.array(np.uint32)[:] = src + i
        a.sync()
        run.start().wait(30)
        c.sync(direction="from_device")
        assert (c.array(np.uint32)[:OUT_BYTES // 4] == src[:OUT_BYTES // 4] + i).all()
    assert seam.names()[n:] == ["SYNC_BO", "EXEC_CMD", "SYNCOBJ_TIMELINE_WAIT", "SYNC_BO"] * 3
    assert emu.counters.ioctls["CREATE_BO"] == 1 + 1 + 3 + 1 + 2   # heap, PDI, a b c, instructions, 2 exec BOs
    # Same packet and the same arg-handle array and wait arrays every time (no allocation per dispatch);
    # only the wait deadline changes.
    execs = {EXEC_CMD.unpack_from(c[2])[:8] for c in seam.calls[n:] if c[0] == "ioctl" and c[1] & 0xFF == 0x46}
    waits = {TIMELINE_WAIT.unpack_from(c[2])[:2] for c in seam.calls[n:] if c[0] == "ioctl" and c[1] & 0xFF == 0xCA}
    assert len(execs) == 1 and next(iter(execs))[4] == run.packet.handle and len(waits) == 1
    assert again.packet.handle != run.packet.handle and run.seq == 3
    dev.close()


def _gemm_stream(dev_gen, model):
    return insts.encode(insts.dma_stream(dev_gen, [(0, model.a_bytes, "in"), (1, model.b_bytes, "in"),
                                                   (2, model.c_bytes, "out")], rtp=[model.m, model.k, model.n]))


@pytest.mark.emu_only
@pytest.mark.parametrize("rows", [64, 80])
def test_gemm_over_chunked_sub_buffers_equals_numpy(device, rows):
    m, k, n = 16, 64, 32
    pdi = bytes(range(256)) * 4
    x = xclbin.build_mlir_aie(pdi)
    gen = txn_dev_gen(device)
    models = {m: Gemm(m, k, n, k)}
    if rows % m:
        models[rows % m] = Gemm(rows % m, k, n, k)
    streams = {rows_: _gemm_stream(gen, model) for rows_, model in models.items()}
    for rows_, model in models.items():
        device.emulator.models.bind(streams[rows_], model)
    rng = np.random.default_rng(1)
    a_host = rng.standard_normal((rows, k)).astype(BF16)
    b_host = rng.standard_normal((k, n)).astype(BF16)
    a, b, c = device.bo(a_host.nbytes), device.bo(b_host.nbytes), device.bo(rows * n * 2)
    a.array(BF16, shape=(rows, k))[:] = a_host
    b.array(BF16, shape=(k, n))[:] = b_host
    for bo in (a, b, c):
        bo.sync()
    ctx = device.hw_context(x)
    kernel = ctx.kernel("MLIR_AIE")
    runs = []
    for start in range(0, rows, m):
        chunk = min(m, rows - start)
        a_sub = a.sub(start * k * 2, chunk * k * 2)
        c_sub = c.sub(start * n * 2, chunk * n * 2)
        assert a_sub.handle == a.handle and a_sub.address == a.address + start * k * 2
        runs.append(kernel.prepare_npu(streams[chunk], [a_sub, b, c_sub]))
    for run in runs:
        run.start()
    for run in runs:
        run.wait(30)
    c.sync(direction="from_device")
    expected = (a_host.astype(np.float32) @ b_host.astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(c.array(BF16, shape=(rows, n)), expected)
    assert runs[0].handles == [ctx.instructions(streams[m]).bo.handle, a.handle, b.handle, c.handle]


@pytest.mark.emu_only
def test_firmware_error_is_reported_and_the_run_recovers(device, npu1_fixture):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    a, b, c, src = _buffers(device)
    run = kernel.prepare_npu(stream, [a, b, c])
    device.emulator.faults.error(stream)
    with pytest.raises(errors.CommandError) as info:
        run.start().wait(30)
    err = info.value
    assert type(err) is errors.CommandError and err.state == "ERROR" and err.kernel == "MLIR_AIE"
    assert err.seq == 0 and err.errno == errno.EIO and "MLIR_AIE (hwctx=" in str(err) and "ERROR" in str(err)
    assert run.state == cmd.ERT_CMD_STATE_ERROR
    run.start().wait(30)   # the 0xFF-filled packet is rebuilt (docs/uapi.md 6.6)
    c.sync()
    assert c.array(np.uint32)[:OUT_BYTES // 4].tolist() == src[:OUT_BYTES // 4].tolist()


@pytest.mark.emu_only
def test_hang_times_out_after_tdr_and_context_keeps_working(npu1_fixture):
    emu = EmuDevice("npu1", tdr_timeout=0.3)
    dev = open_device(emu)
    ctx, kernel, stream = _passthrough(dev, npu1_fixture)
    a, b, c, src = _buffers(dev)
    run = kernel.prepare_npu(stream, [a, b, c])
    emu.faults.hang(stream)
    run.start()
    with pytest.raises(errors.CommandTimeout) as early:
        run.wait(timeout=0.05)       # host-side deadline before the TDR fires
    assert early.value.state == "RUNNING" and early.value.errno == errno.ETIME
    t0 = time.monotonic()
    with pytest.raises(errors.CommandTimeout) as tdr:
        run.wait(timeout=10)
    assert tdr.value.state == "TIMEOUT" and time.monotonic() - t0 < 5
    assert isinstance(tdr.value, TimeoutError) and run.state == cmd.ERT_CMD_STATE_TIMEOUT
    # docs/xrt-sequence.md 1.9 context health record
    assert tdr.value.health is not None and tdr.value.health.version == 1
    run.start().wait(10)
    c.sync()
    assert c.array(np.uint32)[:OUT_BYTES // 4].tolist() == src[:OUT_BYTES // 4].tolist()
    dev.close()
    emu.close()
    assert set(emu.counters.live().values()) == {0}


@pytest.mark.emu_only
def test_lost_device_latches_and_leaves_nothing(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx, kernel, stream = _passthrough(dev, npu1_fixture)
    a, b, c, _ = _buffers(dev)
    run = kernel.prepare_npu(stream, [a, b, c])
    emu.faults.lose_device()
    with pytest.raises(errors.DeviceLostError) as first:
        run.start()
    assert "EXEC_CMD(hwctx=" in str(first.value) and "ENODEV" in str(first.value)
    issued = len(seam.calls)
    with pytest.raises(errors.DeviceLostError, match="device lost earlier"):
        a.sync()
    with pytest.raises(errors.DeviceLostError):
        dev.bo(4096)
    assert len(seam.calls) == issued      # latched: no further ioctl reaches the device
    dev.close()
    assert set(emu.counters.live().values()) == {0}


@pytest.mark.emu_only
@pytest.mark.parametrize("err", [errno.ENODEV, errno.EBUSY, errno.EINVAL])
def test_context_unavailable_leaves_no_handles(npu1_fixture, err):
    dev, emu, seam = emu_open("npu1")
    emu.faults.fail_next_create_hwctx(err)
    with pytest.raises(errors.ContextUnavailableError) as info:
        dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    assert str(info.value).startswith("CREATE_HWCTX(num_tiles=4, max_opc=2048): ")
    assert info.value.errno == err
    assert emu.counters.live()["hwctx"] == 0 and emu.counters.live()["syncobjs"] == 0
    dev.close()
    assert set(emu.counters.live().values()) == {0}


@pytest.mark.emu_only
def test_failed_config_cu_releases_context_syncobj_and_pdi(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    seam.inject[request_of(0x42)] = lambda buf: errno.EINVAL
    with pytest.raises(errors.XdnaError, match=r"CONFIG_HWCTX\(handle=1, param_type=CONFIG_CU, num_cus=1\): EINVAL"):
        dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    live = emu.counters.live()
    assert (live["hwctx"], live["syncobjs"], live["bos"]) == (0, 0, 1)      # only the heap is left
    assert seam.ioctls()[-3:] == ["SYNCOBJ_DESTROY", "DESTROY_HWCTX", "GEM_CLOSE"]
    dev.close()
    assert set(emu.counters.live().values()) == {0}


@pytest.mark.emu_only
def test_firmware_context_limit_is_context_unavailable(npu1_fixture):
    dev, emu, _ = emu_open("npu1")
    emu.faults.cap_contexts(1)
    x = Xclbin.load(npu1_fixture / "aie.xclbin")
    first = dev.hw_context(x)
    with pytest.raises(errors.ContextUnavailableError, match="EINVAL"):
        dev.hw_context(x)
    first.close()
    dev.hw_context(x).close()
    dev.close()
    assert set(emu.counters.live().values()) == {0}


def test_threads_submit_and_wait_concurrently(device, npu1_fixture):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    errors_seen = []

    def worker(seed):
        try:
            a, b, c, src = _buffers(device, seed)
            run = kernel.prepare_npu(stream, [a, b, c])
            for i in range(5):
                a.array(np.uint32)[:] = src + i
                a.sync()
                run.start().wait(30)
                c.sync()
                assert (c.array(np.uint32)[:OUT_BYTES // 4] == src[:OUT_BYTES // 4] + i).all()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors_seen.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors_seen


def test_more_runs_in_flight_than_the_driver_depth(device, npu1_fixture):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    sets = [_buffers(device, seed) for seed in range(6)]
    runs = [kernel.prepare_npu(stream, [a, b, c]) for a, b, c, _ in sets]
    for run in runs:
        run.start()                     # the 5th EXEC_CMD blocks in the driver until one finishes
    assert [run.wait(30) for run in runs] == [cmd.ERT_CMD_STATE_COMPLETED] * 6
    assert [run.seq for run in runs] == list(range(6))
    for _, _, c, src in sets:
        c.sync()
        assert c.array(np.uint32)[:OUT_BYTES // 4].tolist() == src[:OUT_BYTES // 4].tolist()


def test_prepare_validates_arguments(device, npu1_fixture):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    a = device.bo(4096)
    with pytest.raises(TypeError, match=r"argument 3 \(bo0\) is a buffer"):
        kernel.prepare(3, None, 0, 7)
    with pytest.raises(TypeError, match=r"argument 0 \(opcode\) is a scalar"):
        kernel.prepare(a)
    with pytest.raises(ValueError, match="takes 8 arguments"):
        kernel.prepare(*([0] * 9))
    with pytest.raises(ValueError, match=r"ninstr\) = 4294967296 does not fit 4 bytes"):
        kernel.prepare(3, None, 1 << 32)
    with pytest.raises(RuntimeError, match="never started"):
        kernel.prepare(3).wait()
    with open_device("emu:npu1") as other:
        with pytest.raises(ValueError, match=r"argument 5 \(bo2\): buffer belongs to emu:npu1, not to this"):
            kernel.prepare(3, None, 0, a, None, other.bo(4096))
    closed = device.bo(4096)
    closed.close()
    with pytest.raises(ValueError, match=r"argument 3 \(bo0\): buffer is closed"):
        kernel.prepare(3, None, 0, closed)
    run = kernel.prepare_npu(stream, [a, None, device.bo(4096)])
    run.start()
    with pytest.raises(RuntimeError, match="still in flight"):
        run.start()
    assert run.wait(30) == run.wait(30) == cmd.ERT_CMD_STATE_COMPLETED
    ctx.close()
    with pytest.raises(errors.XdnaError, match="context is closed"):
        kernel.prepare(3)


def test_regmap_in_packet_uses_device_addresses(device, npu1_fixture):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    a, b, c, _ = _buffers(device)
    run = kernel.prepare_npu(stream, [a.sub(64, 128), None, c])
    prepared = ctx.instructions(stream)
    instr, nwords = prepared.bo, prepared.nwords
    assert run.insts is prepared
    words = struct.unpack_from("<17I", run.packet.read(68))
    assert words[0] == 0x30010001 and words[1] == 1
    assert words[2:4] == (3, 0) and words[6] == nwords == len(stream) // 4
    assert words[4] | words[5] << 32 == instr.address and 0x4000000 <= instr.address < 0x8000000
    assert words[7] | words[8] << 32 == a.address + 64
    assert words[9:11] == (0, 0) and words[11] | words[12] << 32 == c.address
    assert run.handles == [instr.handle, a.handle, c.handle]


class _NoSyncobj:
    """A driver whose contexts come without a syncobj (handle 0): the runtime must use WAIT_CMD."""

    def __init__(self, inner):
        self.inner, self.name, self.requests = inner, inner.name, []

    def ioctl(self, request, buf):
        self.requests.append(request & 0xFF)
        result = self.inner.ioctl(request, buf)
        if request & 0xFF == 0x40:
            struct.pack_into("<I", buf, 52, 0)      # syncobj_handle (docs/uapi.md 2.1)
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.emu_only
def test_wait_cmd_is_used_when_the_context_has_no_syncobj(npu1_fixture):
    from amdxdna_direct import Device

    emu = EmuDevice("npu1", wait_cmd=True)          # the out-of-tree driver's WAIT_CMD (docs/uapi.md 4.11)
    seam = _NoSyncobj(emu.open())
    dev = Device(seam, emulator=emu)
    ctx, kernel, stream = _passthrough(dev, npu1_fixture)
    a, b, c, src = _buffers(dev)
    kernel.prepare_npu(stream, [a, b, c]).start().wait(30)
    c.sync()
    assert c.array(np.uint32)[:OUT_BYTES // 4].tolist() == src[:OUT_BYTES // 4].tolist()
    assert 0x49 in seam.requests and 0xCA not in seam.requests
    ctx.close()
    assert 0xC0 not in seam.requests                # no syncobj to destroy
    dev.close()
    emu.close()


def test_context_geometry_and_regmap_follow_the_xclbin_not_the_mlir_aie_layout():
    """AMD's NPU1 xclbin (fixture amd-npu1): column_width 4, operations_per_cycle 8192 and the legacy
    DPU_PDI_0 argument layout, hand-decoded from its AIE_PARTITION and EMBEDDED_METADATA XML: opcode u64
    @0, ifm @8, param @0x10, ofm @0x18, inter @0x20, instruct @0x28, nistruct u32 @0x30, mc @0x34."""
    dev, emu, seam = emu_open("npu1")
    x = Xclbin.load(fixture("amd-npu1/validate_throughput_phx.xclbin"))
    ctx = dev.hw_context(x)                         # the HLS "vadd" kernel has no PDI: only DPU_PDI_0 is a CU
    hwctx = CREATE_HWCTX.unpack_from(next(c[2] for c in seam.calls if c[0] == "ioctl" and c[1] & 0xFF == 0x40))
    assert (hwctx[5], hwctx[6]) == (8192, 16) and [cu.kernel.name for cu in ctx.cus] == ["DPU_PDI_0"]
    kernel = ctx.kernel()
    ifm, param, ofm, instr = dev.bo(4096), dev.bo(4096), dev.bo(8192), dev.bo(4096, "dev")
    run = kernel.prepare(1, ifm, param, ofm.sub(4096, 64), None, instr, 20)
    words = struct.unpack("<17I", run.packet.read(68))
    assert words[0] == 0x30010001 and words[1] == 1                  # 15-word regmap, cu 0
    u64 = {off: words[2 + off // 4] | words[3 + off // 4] << 32 for off in (0x00, 0x08, 0x10, 0x18, 0x20, 0x28, 0x34)}
    assert u64 == {0x00: 1, 0x08: ifm.address, 0x10: param.address, 0x18: ofm.address + 4096, 0x20: 0,
                   0x28: instr.address, 0x34: 0}
    assert words[2 + 0x30 // 4] == 20
    assert run.handles == [ifm.handle, param.handle, ofm.handle, instr.handle]
    with pytest.raises(ValueError, match=r"nistruct\) = -4294967296 does not fit 4 bytes"):
        kernel.prepare(1, None, None, None, None, None, -(1 << 32))
    dev.close()


def test_instruction_streams_in_every_form_are_uploaded_once(device, npu1_fixture, tmp_path):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    words = struct.unpack(f"<{len(stream) // 4}I", stream)
    text = tmp_path / "insts.txt"
    text.write_text("".join(f"{w:08X}\n" for w in words))          # mlir-aie's text form (docs/xrt-sequence.md 2.3)
    creates = device.stats["CREATE_BO"]
    forms = [stream, npu1_fixture / "insts.bin", str(text), insts.load(stream), list(words),
             np.frombuffer(stream, np.uint32)]
    uploads = [ctx.instructions(form) for form in forms]
    assert device.stats["CREATE_BO"] == creates + 1
    assert all(u is uploads[0] for u in uploads) and uploads[0].nwords == len(stream) // 4 == 82
    assert uploads[0].read() == uploads[0].bo.read(len(stream)) == stream     # the bytes of the file, unchanged
    assert kernel.prepare_npu(str(text), [None]).handles == [uploads[0].bo.handle]
    with pytest.raises(insts.InstsError):
        ctx.instructions(stream[:-4])
    with pytest.raises(TypeError, match="instruction stream"):
        ctx.instructions(42)
    assert device.stats["CREATE_BO"] == creates + 1 + 1               # + the packet buffer of that run


def test_bad_timeouts_are_rejected_before_waiting(device, npu1_fixture):
    ctx, kernel, stream = _passthrough(device, npu1_fixture)
    run = kernel.prepare_npu(stream, [device.bo(4096), None, device.bo(4096)]).start()
    waits = device.stats["SYNCOBJ_TIMELINE_WAIT"]
    for bad in (-1, "soon", float("nan")):
        with pytest.raises(ValueError, match="timeout must be"):
            run.wait(bad)
    assert device.stats["SYNCOBJ_TIMELINE_WAIT"] == waits
    assert run.wait(30) == cmd.ERT_CMD_STATE_COMPLETED


def test_waits_are_bounded_by_10_seconds_unless_forever_is_asked(npu1_fixture):
    # docs/runtime.md 3.4: the deadline is absolute CLOCK_MONOTONIC (docs/xrt-sequence.md 1.9): now + 10 s by default
    # and for
    # None; FOREVER (math.inf) is INT64_MAX. Bounds: the clock read before and after the wait call.
    assert inspect.signature(Run.wait).parameters["timeout"].default == kernel_mod.DEFAULT_TIMEOUT == 10.0
    assert inspect.signature(RunList.wait).parameters["timeout"].default == 10.0
    assert kernel_mod.FOREVER == math.inf
    dev, emu, seam = emu_open("npu1")
    stream = passthrough_stream(dev, npu1_fixture)
    ctx = dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    run = ctx.kernel().prepare_npu(stream, [dev.bo(4096), None, dev.bo(4096)])

    def deadline_of(wait) -> tuple[int, int, int]:
        run.start()
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        wait()
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        call = [c for c in seam.calls if c[0] == "ioctl" and c[1] & 0xFF == 0xCA][-1]
        return before, TIMELINE_WAIT.unpack_from(call[2], 0)[2], after

    for wait in (run.wait, lambda: run.wait(None), lambda: run.wait(timeout=10)):
        before, deadline, after = deadline_of(wait)
        assert before + 10 * 10**9 <= deadline <= after + 10 * 10**9
    before, deadline, after = deadline_of(lambda: run.wait(2.5))
    assert before + 2_500_000_000 <= deadline <= after + 2_500_000_000
    assert deadline_of(lambda: run.wait(kernel_mod.FOREVER))[1] == (1 << 63) - 1
    rl = RunList(ctx, [run])
    rl.start()
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    rl.wait()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    call = [c for c in seam.calls if c[0] == "ioctl" and c[1] & 0xFF == 0xCA][-1]
    assert before + 10 * 10**9 <= TIMELINE_WAIT.unpack_from(call[2], 0)[2] <= after + 10 * 10**9
    dev.close()


def test_a_hung_run_with_the_default_timeout_ends(npu1_fixture):
    # A hang the driver's TDR ends is reported, not waited for without bound (the emulator's TDR is 0.2 s here).
    emu = EmuDevice("npu1", tdr_timeout=0.2)
    with open_device(emu) as dev:
        stream = passthrough_stream(dev, npu1_fixture)
        emu.faults.hang(stream)
        ctx = dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
        run = ctx.kernel().prepare_npu(stream, [dev.bo(4096), None, dev.bo(4096)])
        with pytest.raises(errors.CommandTimeout) as info:
            run.start().wait()
    emu.close()
    assert info.value.state == "TIMEOUT"


class _FailNth(RecordingSeam):
    """Fails the n-th syscall (ioctl, mmap or reserve) counted from ``arm()`` with ``err``."""

    def arm(self, n: int, err: int) -> None:
        self.left, self.err, self.counted = n, err, 0

    def _fail(self, key, *args) -> None:
        self.counted += 1
        self.left -= 1
        if self.left == -1:
            self.failed = key
            raise OSError(self.err, os.strerror(self.err))


def _bring_up_and_run(dev, fixture, stream):
    ctx = dev.hw_context(Xclbin.load(fixture / "aie.xclbin"))
    a, b, c = dev.bo(4096), dev.bo(4096), dev.bo(4096)
    a.sync()
    runs = [ctx.kernel().prepare_npu(stream, [a, b, c]) for _ in range(2)]
    runs[0].start().wait(30)
    c.sync()
    chain = RunList(ctx, runs)
    chain.start().wait(30)
    return dev.file.seam.counted        # syscalls so far; releasing the locals comes after


def _open_failing(fixture):
    emu = EmuDevice("npu1")
    seam = _FailNth(emu.open())
    seam.arm(1 << 30, 0)
    dev = Device(seam, emulator=emu, owns_emulator=True)
    return dev, emu, seam, passthrough_stream(dev, fixture)


def _held(emu):
    """(contexts, syncobjs, mappings, GEM handles) the emulated driver holds for the first fd."""
    live = emu.counters.live()
    return live["hwctx"], live["syncobjs"], live["mappings"], set(emu.clients[0].bos)


def _settled(probe, expected, seconds=5.0):
    # A run whose wait failed is still executing in the emulator; what it uses lives until it ends.
    deadline = time.monotonic() + seconds
    while probe() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return probe()


@pytest.mark.emu_only
@pytest.mark.parametrize("err", [errno.EIO, errno.ENODEV])
def test_every_failing_step_leaves_no_live_handles(npu1_fixture, err):
    """Fail each syscall of a bring-up + run + run list in turn: the error surfaces typed and named, and
    once the caller drops its objects the fd holds no GEM handle but the heap's, no context, syncobj or
    mapping but the heap's (the driver keeps a closed heap's pages until the fd closes, docs/uapi.md 7). A lost
    device (ENODEV outside CREATE_HWCTX) latches. Closing the fd then leaves nothing at all."""
    dev, emu, seam, stream = _open_failing(npu1_fixture)
    seam.arm(1 << 30, errno.EIO)
    steps = _bring_up_and_run(dev, npu1_fixture, stream)
    dev.close()
    assert steps == 40
    for n in range(steps):
        dev, emu, seam, stream = _open_failing(npu1_fixture)
        seam.arm(n, err)
        try:
            _bring_up_and_run(dev, npu1_fixture, stream)
        except errors.XdnaError as exc:
            failed = IOCTL_NAMES.get(seam.failed & 0xFF) if isinstance(seam.failed, int) else seam.failed
            assert exc.errno == err and f"{errno.errorcode[err]} (" in str(exc), (n, str(exc))
            refused_context = isinstance(exc, errors.ContextUnavailableError)
            assert refused_context == (failed == "CREATE_HWCTX" and err == errno.ENODEV), (n, failed, type(exc))
            lost = err == errno.ENODEV and not refused_context
            assert isinstance(exc, errors.DeviceLostError) == lost, (n, failed, type(exc))
        else:
            pytest.fail(f"syscall {n} failed with {errno.errorcode[err]} but nothing was raised")
        gc.collect()
        if lost:
            with pytest.raises(errors.DeviceLostError, match="device lost earlier"):
                dev.bo(4096)
        else:
            heap = {chunk.handle for chunk in dev.heap}
            expected = (0, 0, len(heap), heap)
            assert _settled(functools.partial(_held, emu), expected) == expected, (n, failed)
        dev.close()
        zero = dict.fromkeys(("bos", "hwctx", "syncobjs", "mappings"), 0)
        assert _settled(emu.counters.live, zero) == zero, (n, failed)
