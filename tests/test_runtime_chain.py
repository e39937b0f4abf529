"""Run lists: ERT_CMD_CHAIN packets of 1, 24 and 100 runs, the failing index, reuse."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from conftest import EXEC_CMD, emu_open, txn_dev_gen

from amdxdna_direct import RunList, Xclbin, cmd, errors, insts
from amdxdna_direct.emu import Passthrough

OUT_BYTES = 64      # insts.bin BD1 length: 16 words (hand-decoded, spec 2.3 worked example)
SLOT_IN = 128       # each run reads its own 128-byte slice of one A buffer ...
SLOT_OUT = 64       # ... and writes its own 64-byte slice of one C buffer


def _setup(dev, fixture, n):
    stream = (fixture / "insts.bin").read_bytes()
    if dev.emulator is not None:
        dev.emulator.models.bind(stream, Passthrough())
    elif txn_dev_gen(dev) != 3:
        pytest.skip("the npu1_1col fixture needs an NPU1 (Phoenix / Hawk Point)")
    ctx = dev.hw_context(Xclbin.load(fixture / "aie.xclbin"))
    kernel = ctx.kernel()
    a, c = dev.bo(n * SLOT_IN), dev.bo(n * SLOT_OUT)
    src = np.random.default_rng(n).integers(0, 256, n * SLOT_IN, dtype=np.uint8)
    a.array()[:] = src
    a.sync()
    c.array()[:] = 0
    c.sync()
    runs = [kernel.prepare_npu(stream, [a.sub(i * SLOT_IN, SLOT_IN), None, c.sub(i * SLOT_OUT, SLOT_OUT)])
            for i in range(n)]
    expected = src.reshape(n, SLOT_IN)[:, :OUT_BYTES]
    return ctx, kernel, a, c, runs, expected


@pytest.mark.parametrize("n, chains", [(1, 1), (24, 1), (100, 5)])
def test_chain_runs_every_command(device, npu1_fixture, n, chains):
    ctx, kernel, a, c, runs, expected = _setup(device, npu1_fixture, n)
    rl = RunList(ctx, runs)
    assert len(rl.chains) == chains and [len(ch.runs) for ch in rl.chains][0] == min(n, 24)
    execs, waits = device.stats["EXEC_CMD"], device.stats["SYNCOBJ_TIMELINE_WAIT"]
    assert rl.start().wait(60) == [cmd.ERT_CMD_STATE_COMPLETED] * n
    assert device.stats["EXEC_CMD"] - execs == chains                     # one EXEC_CMD per chain packet
    assert device.stats["SYNCOBJ_TIMELINE_WAIT"] - waits == 1             # waited once
    c.sync(direction="from_device")
    np.testing.assert_array_equal(c.array().reshape(n, SLOT_OUT), expected)
    c.array()[:] = 0
    c.sync()
    rl.start().wait(60)                                                   # reusable
    c.sync()
    np.testing.assert_array_equal(c.array().reshape(n, SLOT_OUT), expected)


def test_chain_packet_contents_and_exec_args(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx, kernel, a, c, runs, _ = _setup(dev, npu1_fixture, 30)
    rl = RunList(ctx, runs)
    first = rl.chains[0]
    info = cmd.decode_chain(first.bo.read(4 + 24 + 8 * 24))
    assert info.command_count == 24 and info.handles == tuple(r.packet.handle for r in runs[:24])
    n = len(seam.calls)
    rl.start().wait(60)
    execs = [EXEC_CMD.unpack_from(call[2]) for call in seam.calls[n:] if call[0] == "ioctl" and call[1] & 0xFF == 0x46]
    instr = ctx.instructions((npu1_fixture / "insts.bin").read_bytes())[0]
    # arg list: every sub-command's BOs once (instructions, A, C: sub-buffers share handles) + sub-commands
    assert [(e[4], e[7]) for e in execs] == [(first.bo.handle, 3 + 24), (rl.chains[1].bo.handle, 3 + 6)]
    assert runs[0].handles == [instr.handle, a.handle, c.handle]
    dev.close()


@pytest.mark.emu_only
def test_failing_run_inside_a_chain_is_reported_with_its_index(device, npu1_fixture):
    ctx, kernel, a, c, runs, expected = _setup(device, npu1_fixture, 100)
    # Run 37 gets a stream of its own (same passthrough, different bytes) that the firmware fails.
    bad_stream = insts.encode(insts.dma_stream(txn_dev_gen(device), [(0, OUT_BYTES, "in"), (2, OUT_BYTES, "out")]))
    device.emulator.models.bind(bad_stream, Passthrough())
    runs[37] = kernel.prepare_npu(bad_stream, [a.sub(37 * SLOT_IN, SLOT_IN), None, c.sub(37 * SLOT_OUT, SLOT_OUT)])
    rl = RunList(ctx, runs)
    device.emulator.faults.error(bad_stream)
    with pytest.raises(errors.CommandError) as info:
        rl.start().wait(60)
    err = info.value
    assert err.index == 37 and err.state == "ERROR" and err.errno == errno.EIO and "index=37" in str(err)
    assert rl.states[24:37] == [cmd.ERT_CMD_STATE_COMPLETED] * 13
    assert rl.states[37] == cmd.ERT_CMD_STATE_ERROR
    assert rl.states[38:48] == [cmd.ERT_CMD_STATE_ABORT] * 10
    # After the failure the driver 0xFF-filled a payload: restarting rebuilds it and everything completes,
    # and the runs of the failed chain also work on their own again.
    assert runs[24].start().wait(30) == cmd.ERT_CMD_STATE_COMPLETED
    assert rl.start().wait(60) == [cmd.ERT_CMD_STATE_COMPLETED] * 100
    c.sync()
    np.testing.assert_array_equal(c.array().reshape(100, SLOT_OUT), expected)


def test_runlist_rejects_bad_lists(device, npu1_fixture):
    ctx, kernel, a, c, runs, _ = _setup(device, npu1_fixture, 2)
    with pytest.raises(ValueError, match="at least one"):
        RunList(ctx, [])
    with pytest.raises(ValueError, match="same Run twice"):
        RunList(ctx, [runs[0], runs[0]])
    other = device.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    with pytest.raises(ValueError, match="another hardware context"):
        RunList(other, runs)
    with pytest.raises(TypeError, match="not a Run"):
        RunList(ctx, [runs[0], "run"])
    with pytest.raises(RuntimeError, match="never started"):
        RunList(ctx, runs).wait()
