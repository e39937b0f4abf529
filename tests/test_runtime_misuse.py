"""The public API under misuse: bad arguments refused before any ioctl with the documented errors,
numpy views and concurrent waits that outlive a close without touching unmapped memory, a device lost
at CREATE_HWCTX, timeouts of every shape, closed runs and buffers inside runs and run lists."""

from __future__ import annotations

import errno
import gc
import threading

import numpy as np
import pytest
from conftest import emu_open, passthrough_stream, request_of

from amdxdna_direct import Device, RunList, Xclbin, abi, cmd, errors, insts, kernel, open_device, trace
from amdxdna_direct.bo import unhold
from amdxdna_direct.emu import EmuDevice

pytestmark = pytest.mark.emu_only


def _setup(dev, fixture):
    stream = passthrough_stream(dev, fixture)
    ctx = dev.hw_context(Xclbin.load(fixture / "aie.xclbin"))
    a, b, c = dev.bo(4096), dev.bo(4096), dev.bo(4096)
    a.array(np.uint32)[:] = np.arange(1024, dtype=np.uint32)
    a.sync()
    return ctx, ctx.kernel(), stream, (a, b, c)


def _mappings(emu):
    return emu.counters.live()["mappings"]


def test_a_view_outliving_its_buffer_close_stays_mapped_until_collected():
    dev = open_device("emu:npu1")
    emu = dev.emulator
    bo = dev.bo(8192)
    view = bo.array(np.uint32)
    sub_view = bo.sub(4096, 64).array(np.uint8)
    view[:] = 7
    before = _mappings(emu)
    bo.close()
    assert bo.closed and _mappings(emu) == before          # munmap waits for the views ...
    assert int(view[5]) == 7 and int(sub_view[0]) == 7      # ... which read mapped memory, not a fault
    view[0] = 1
    del view
    gc.collect()
    assert _mappings(emu) == before
    del sub_view
    gc.collect()
    assert _mappings(emu) == before - 1                      # the last view ran the munmap
    with pytest.raises(errors.XdnaError, match=r"array\(handle=\d+\): EBADF .*buffer is closed"):
        bo.array()
    dev.close()
    assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def test_views_outliving_the_device_keep_the_file_open_until_collected(npu1_fixture):
    with open_device("emu:npu1") as dev:
        emu = dev.emulator
        ctx, k, stream, (a, b, c) = _setup(dev, npu1_fixture)
        k.prepare_npu(stream, [a, b, c])(30)
        c.sync()
        out = c.array(np.uint32)[:16]                       # a slice keeps the view's base alive
        dev_bo = dev.bo(4096, "dev")
        heap_view = dev_bo.array(np.uint32)
        heap_view[:] = 5
    assert dev.closed
    assert out.tolist() == list(range(16)) and int(heap_view[3]) == 5
    assert emu.counters.live()["hwctx"] == 0                 # everything but the viewed memory is gone
    del out, heap_view
    gc.collect()
    assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def test_closing_the_device_while_another_thread_waits(npu1_fixture):
    emu = EmuDevice("npu1", tdr_timeout=0.2)
    dev = Device(emu.open(), emulator=emu, owns_emulator=True)
    ctx, k, stream, bufs = _setup(dev, npu1_fixture)
    run = k.prepare_npu(stream, list(bufs))
    emu.faults.hang(stream)
    run.start()
    outcome: list[BaseException] = []
    entered = threading.Event()

    def waiter():
        entered.set()
        try:
            run.wait(kernel.FOREVER)
        except BaseException as exc:  # noqa: BLE001 - the outcome is what is checked
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    entered.wait(5)
    dev.close()                                              # destroys the context: TDR ends the wait
    thread.join(10)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.XdnaError), outcome
    assert outcome[0].errno in (errno.EBADF, errno.ETIME), outcome[0]
    gc.collect()
    assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def test_a_held_packet_stays_mapped_through_a_concurrent_close(npu1_fixture):
    """What the waiter above relies on, deterministically: a close during an access defers the munmap."""
    dev = open_device("emu:npu1")
    emu = dev.emulator
    ctx, k, stream, bufs = _setup(dev, npu1_fixture)
    run = k.prepare_npu(stream, list(bufs))
    before = _mappings(emu)
    held = run.packet.hold("test")
    run.close()
    assert _mappings(emu) == before and cmd.read_state(run._view) == cmd.ERT_CMD_STATE_NEW

    unhold(held)
    assert _mappings(emu) == before - 1
    with pytest.raises(errors.XdnaError, match="run is closed"):
        _ = run.state
    dev.close()


def test_closing_a_run_unmaps_its_packet_at_once(npu1_fixture):
    dev = open_device("emu:npu1")
    ctx, k, stream, bufs = _setup(dev, npu1_fixture)
    run = k.prepare_npu(stream, list(bufs))
    chain = RunList(ctx, [run])
    before = _mappings(dev.emulator)
    chain.close()
    run.close()
    assert _mappings(dev.emulator) == before - 2
    dev.close()


def _bad_calls(dev, ctx, k, stream, a):
    return [
        (lambda: dev.bo(1 << 64), ValueError, "u64"),
        (lambda: dev.bo(4096, kind=["shmem"]), ValueError, "kind"),
        (lambda: a.sub(4.7, 4), TypeError, "sub: offset must be an int"),
        (lambda: a.sub(0, None), TypeError, "sub: size must be an int"),
        (lambda: a.array(np.uint8, 4, 1.5), TypeError, "array: offset must be an int"),
        (lambda: a.array(np.uint8, 4, None), TypeError, "array: offset must be an int"),
        (lambda: a.array(np.uint8, 2.5), TypeError, "array: count must be an int"),
        (lambda: a.array(np.dtype("V0")), TypeError, "cannot view raw device memory"),
        (lambda: a.array(object), TypeError, "cannot view raw device memory"),
        (lambda: a.array(np.uint8, 10, shape=(2, 2)), ValueError, "contradicts shape"),
        (lambda: a.sync("a"), TypeError, "sync: offset must be an int"),
        (lambda: a.sync(0, 1.5), TypeError, "sync: size must be an int"),
        (lambda: a.write("text"), TypeError, "write: data must be bytes-like"),
        (lambda: dev.hw_contexts(0), ValueError, "max_entries"),
        (lambda: dev.hw_contexts(-1), ValueError, "max_entries"),
        (lambda: dev.raw_ioctl("x", bytearray(8)), TypeError, "request must be an ioctl number"),
        (lambda: dev.raw_ioctl(0, None), TypeError, "writable buffer"),
        (lambda: dev.raw_ioctl(0, bytes(8)), TypeError, "read-only"),
        (lambda: dev.raw_ioctl(abi.DRM_IOCTL_AMDXDNA_GET_INFO, bytearray(2)), ValueError, "carries 16 bytes"),
        (lambda: k.prepare_npu(stream, a), TypeError, "sequence of Bo"),
        (lambda: k.prepare_npu(stream, None), TypeError, "sequence of Bo"),
        (lambda: k.prepare_npu([-1, 0, 0, 0], [a]), insts.InstsError, "u32"),
        (lambda: k.prepare_npu(np.zeros((2, 4), np.uint32), [a]), insts.InstsError, "flat sequence"),
        (lambda: k.prepare_npu(stream, [a])("1"), ValueError, "timeout"),
        (lambda: k.prepare_npu(stream, [a])(-1), ValueError, "timeout"),
        (lambda: RunList(ctx, [k.prepare_npu(stream, [a])])(float("nan")), ValueError, "timeout"),
    ]


def test_bad_arguments_are_refused_with_what_was_expected_before_any_submission(npu1_fixture):
    dev = open_device("emu:npu1")
    ctx, k, stream, (a, b, c) = _setup(dev, npu1_fixture)
    for i, (call, exc_type, text) in enumerate(_bad_calls(dev, ctx, k, stream, a)):
        issued = dict(dev.stats)
        with pytest.raises(exc_type, match=text):
            call()
        assert dev.stats["EXEC_CMD"] == issued.get("EXEC_CMD", 0), i
        assert dev.stats["SYNCOBJ_TIMELINE_WAIT"] == issued.get("SYNCOBJ_TIMELINE_WAIT", 0), i
    grid = np.arange(64, dtype=np.uint8).reshape(8, 8)
    a.write(grid[:, ::2])                                    # a strided array is copied, not refused
    assert a.read(32) == grid[:, ::2].tobytes()
    assert a.array(np.uint8, shape=(2, 4)).shape == (2, 4)
    dev.close()
    assert dev.emulator.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def test_infinite_and_huge_timeouts_wait_forever(npu1_fixture):
    dev = open_device("emu:npu1")
    ctx, k, stream, bufs = _setup(dev, npu1_fixture)
    run = k.prepare_npu(stream, list(bufs))
    assert run.start().wait(float("inf")) == cmd.ERT_CMD_STATE_COMPLETED
    assert run.start().wait(1e30) == cmd.ERT_CMD_STATE_COMPLETED
    assert run(np.float32(30)) == cmd.ERT_CMD_STATE_COMPLETED
    assert RunList(ctx, [run])(float("inf")) == [cmd.ERT_CMD_STATE_COMPLETED]
    # WAIT_CMD (contexts without a syncobj): u32 milliseconds, 0 = forever (docs/uapi.md 2.3)
    assert kernel._wait_cmd_ms(float("inf")) == 0 and kernel._wait_cmd_ms(None) == 0
    assert kernel._wait_cmd_ms(1e30) == 0xFFFFFFFF and kernel._wait_cmd_ms(0) == 1
    dev.close()


def test_a_device_lost_at_create_hwctx_is_reported_lost_not_full(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    dev.ensure_heap()
    dev.aie_metadata()
    seam.inject[request_of(0x40)] = lambda buf: emu.faults.lose_device()
    with pytest.raises(errors.DeviceLostError, match=r"ENODEV") as info:
        dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    assert not isinstance(info.value, errors.ContextUnavailableError)
    assert isinstance(info.value.__cause__, errors.ContextUnavailableError)
    with pytest.raises(errors.DeviceLostError, match="device lost earlier"):
        dev.bo(4096)
    dev.close()
    assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def test_closed_runs_and_argument_buffers_are_refused_before_exec_cmd(npu1_fixture):
    dev = open_device("emu:npu1")
    ctx, k, stream, (a, b, c) = _setup(dev, npu1_fixture)
    closed = k.prepare_npu(stream, [a, b, c])
    closed.close()
    with pytest.raises(errors.XdnaError, match=r"RunList\(cmd_handles=\d+\): EBADF .*run is closed"):
        RunList(ctx, [closed])
    run = k.prepare_npu(stream, [a.sub(0, 128), None, c])
    chain = RunList(ctx, [run])
    a.close()
    exec_cmds = dev.stats["EXEC_CMD"]
    with pytest.raises(errors.XdnaError, match=r"EXEC_CMD\(.*arg_handle=\d+\): EBADF .*argument buffer"):
        run.start()
    with pytest.raises(errors.XdnaError, match=r"EXEC_CMD\(.*arg_handle=\d+\): EBADF .*argument buffer"):
        chain.start()
    assert dev.stats["EXEC_CMD"] == exec_cmds
    dev.close()
    with pytest.raises(errors.XdnaError, match=r"hw_context\(\): EBADF .*device closed"):
        dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    with pytest.raises(errors.XdnaError, match=r"CREATE_BO\(type=DEV, size=4096\): EBADF"):
        dev.bo(4096, "dev")


def test_wait_after_a_failed_start_says_so_instead_of_blaming_the_driver(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx, k, stream, bufs = _setup(dev, npu1_fixture)
    run = k.prepare_npu(stream, list(bufs))
    assert run(30) == cmd.ERT_CMD_STATE_COMPLETED
    seam.inject[request_of(0x46)] = lambda buf: errno.EAGAIN
    with pytest.raises(errors.XdnaError, match=r"EXEC_CMD\(.*\): EAGAIN"):
        run.start()
    del seam.inject[request_of(0x46)]
    with pytest.raises(RuntimeError, match="its last start\\(\\) failed"):
        run.wait(5)
    assert run(30) == cmd.ERT_CMD_STATE_COMPLETED
    dev.close()


def test_opening_a_closed_emulator_is_a_typed_no_device_error():
    emu = EmuDevice("npu1")
    emu.close()
    with pytest.raises(errors.NoDeviceError, match=r"open\(path=emu:npu1\): ENODEV"):
        open_device(emu)


def test_two_threads_closing_one_device_neither_fails(npu1_fixture):
    dev = open_device("emu:npu1")
    ctx, k, stream, bufs = _setup(dev, npu1_fixture)
    runs = [k.prepare_npu(stream, list(bufs)) for _ in range(40)]      # a close with plenty to release
    barrier = threading.Barrier(3)
    failures: list[BaseException] = []

    def closer():
        barrier.wait(5)
        try:
            dev.close()
        except BaseException as exc:  # noqa: BLE001 - the outcome is what is checked
            failures.append(exc)

    threads = [threading.Thread(target=closer) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert failures == [] and dev.closed and runs[0].packet.closed
    assert dev.emulator.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def test_a_run_in_flight_in_a_list_cannot_be_submitted_again_elsewhere(npu1_fixture):
    """One CMD BO in two submissions at once: the driver writes both outcomes into it and a restart rewrites
    the state the other one reports. Refused (RuntimeError, no EXEC_CMD) until the list was waited for."""
    emu = EmuDevice("npu1", tdr_timeout=0.2)
    dev = Device(emu.open(), emulator=emu, owns_emulator=True)
    ctx, k, stream, bufs = _setup(dev, npu1_fixture)
    runs = [k.prepare_npu(stream, list(bufs)) for _ in range(3)]
    first, second = RunList(ctx, runs), RunList(ctx, runs[::-1])
    emu.faults.hang(stream)
    first.start()
    exec_cmds = dev.stats["EXEC_CMD"]
    with pytest.raises(RuntimeError, match="in flight in a RunList: wait\\(\\) for the list first"):
        runs[1].start()
    with pytest.raises(RuntimeError, match="entry 0 .* still in flight in another RunList"):
        second.start()
    assert dev.stats["EXEC_CMD"] == exec_cmds
    with pytest.raises(errors.CommandTimeout, match="index=0"):
        first.wait(10)                                        # the TDR ends the hang
    assert second(10) == [cmd.ERT_CMD_STATE_COMPLETED] * 3 and runs[1](10) == cmd.ERT_CMD_STATE_COMPLETED
    dev.close()
    assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}


def test_the_trace_never_decodes_past_a_short_buffer():
    """A raw ioctl may pass any buffer: decoding it as the request's struct read memory past its end."""
    assert trace.decode("struct amdxdna_drm_get_info", bytearray(2)) == {"short_buffer": 2}
    full = bytearray(abi.ffi.sizeof("struct amdxdna_drm_get_info"))
    full[:4] = (7).to_bytes(4, "little")
    assert trace.decode("struct amdxdna_drm_get_info", full)["param"] == 7
