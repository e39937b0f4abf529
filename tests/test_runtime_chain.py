"""Run lists: ERT_CMD_CHAIN packets of 1, 24 and 100 runs, chain sizing, the failing index, reuse."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from conftest import EXEC_CMD, emu_open, passthrough_stream, request_of, txn_dev_gen

from amdxdna_direct import RunList, Xclbin, cmd, errors, insts
from amdxdna_direct.emu import Passthrough

OUT_BYTES = 64      # insts.bin BD1 length: 16 words (hand-decoded, docs/xrt-sequence.md 2.3 worked example)
SLOT_IN = 128       # each run reads its own 128-byte slice of one A buffer ...
SLOT_OUT = 64       # ... and writes its own 64-byte slice of one C buffer
# Runs per chain packet, from docs/uapi.md 6.5 / docs/xrt-sequence.md 1.7: the driver's 4 KiB
# command list, slots of at most 52 header bytes + 4 per argument word, 15 regmap words per mlir-aie run.
PER_CHAIN = 4096 // (52 + 4 * 15)


def _setup(dev, fixture, n):
    stream = passthrough_stream(dev, fixture)
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


@pytest.mark.parametrize("n, chains", [(1, 1), (24, 1), (PER_CHAIN, 1), (PER_CHAIN + 1, 2), (100, 3)])
def test_chain_runs_every_command(device, npu1_fixture, n, chains):
    ctx, kernel, a, c, runs, expected = _setup(device, npu1_fixture, n)
    rl = RunList(ctx, runs)
    assert PER_CHAIN == 36 and len(rl.chains) == chains
    assert [len(ch.runs) for ch in rl.chains] == [PER_CHAIN] * (n // PER_CHAIN) + [n % PER_CHAIN] * bool(n % PER_CHAIN)
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
    ctx, kernel, a, c, runs, _ = _setup(dev, npu1_fixture, PER_CHAIN + 6)
    rl = RunList(ctx, runs)
    first = rl.chains[0]
    info = cmd.decode_chain(first.bo.read(4 + 24 + 8 * PER_CHAIN))
    assert info.command_count == PER_CHAIN and info.handles == tuple(r.packet.handle for r in runs[:PER_CHAIN])
    n = len(seam.calls)
    rl.start().wait(60)
    execs = [EXEC_CMD.unpack_from(call[2]) for call in seam.calls[n:] if call[0] == "ioctl" and call[1] & 0xFF == 0x46]
    instr = ctx.instructions((npu1_fixture / "insts.bin").read_bytes()).bo
    # arg list: every sub-command's BOs once (instructions, A, C: sub-buffers share handles) + sub-commands
    assert [(e[4], e[7]) for e in execs] == [(first.bo.handle, 3 + PER_CHAIN), (rl.chains[1].bo.handle, 3 + 6)]
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
    # Run 37 is the second sub-command of the second chain (runs 36..71): XRT's per-run report is
    # COMPLETED before the error index, ABORT after it, and the other chains are unaffected.
    assert rl.states[:37] == [cmd.ERT_CMD_STATE_COMPLETED] * 37
    assert rl.states[37] == cmd.ERT_CMD_STATE_ERROR
    assert rl.states[38:2 * PER_CHAIN] == [cmd.ERT_CMD_STATE_ABORT] * (2 * PER_CHAIN - 38)
    assert rl.states[2 * PER_CHAIN:] == [cmd.ERT_CMD_STATE_COMPLETED] * (100 - 2 * PER_CHAIN)
    # After the failure the driver 0xFF-filled a payload: restarting rebuilds it and everything completes,
    # and the runs of the failed chain also work on their own again.
    assert runs[PER_CHAIN].start().wait(30) == cmd.ERT_CMD_STATE_COMPLETED
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


def test_closing_the_context_releases_its_chains_and_runs(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx, kernel, a, c, runs, _ = _setup(dev, npu1_fixture, PER_CHAIN + 1)
    rl = RunList(ctx, runs)
    rl.start().wait(60)
    ctx.close()
    assert all(chain.bo.closed for chain in rl.chains) and all(run.packet.closed for run in runs)
    assert set(emu.clients[0].bos) == {dev.heap[0].handle, a.handle, c.handle}      # data buffers stay
    with pytest.raises(errors.XdnaError, match=r"EXEC_CMD\(hwctx=1\): EBADF .*context is closed"):
        rl.start()
    with pytest.raises(errors.XdnaError, match="context is closed"):
        RunList(ctx, runs)
    dev.close()
    assert set(emu.counters.live().values()) == {0}


def test_a_refused_chain_submission_leaves_the_rest_drainable(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx, kernel, a, c, runs, expected = _setup(dev, npu1_fixture, PER_CHAIN + 2)
    rl = RunList(ctx, runs)
    refusals = iter([None, errno.EINVAL])                        # the second chain's EXEC_CMD is refused
    seam.inject[request_of(0x46)] = lambda buf: next(refusals, None)
    with pytest.raises(errors.XdnaError, match=rf"EXEC_CMD\(hwctx=1, cmd_handles={rl.chains[1].bo.handle}, "
                                               rf"arg_count=5\): EINVAL"):
        rl.start()
    with pytest.raises(RuntimeError, match="still in flight"):
        rl.start()                                               # chain 0 runs: its packets stay untouched
    states = rl.wait(60)                                         # drains what was submitted
    assert states == [cmd.ERT_CMD_STATE_COMPLETED] * PER_CHAIN + [cmd.ERT_CMD_STATE_NEW] * 2
    c.sync()
    np.testing.assert_array_equal(c.array().reshape(-1, SLOT_OUT)[:PER_CHAIN], expected[:PER_CHAIN])
    assert rl.start().wait(60) == [cmd.ERT_CMD_STATE_COMPLETED] * (PER_CHAIN + 2)
    dev.close()


def test_closed_runs_and_lists_refuse_instead_of_touching_unmapped_packets(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx, kernel, a, c, runs, _ = _setup(dev, npu1_fixture, 3)
    rl = RunList(ctx, runs)
    runs[1].start().wait(30)
    runs[1].close()
    for call in (runs[1].start, runs[1].wait, lambda: runs[1].state, rl.start):
        with pytest.raises(errors.XdnaError, match=rf"cmd_handles={runs[1].packet.handle}\): EBADF .*run is closed"):
            call()
    assert "state=closed" in repr(runs[1])
    other = RunList(ctx, [runs[0], runs[2]])
    other.close()
    with pytest.raises(errors.XdnaError, match="run list is closed"):
        other.start()
    assert RunList(ctx, [runs[0], runs[2]]).start().wait(30) == [cmd.ERT_CMD_STATE_COMPLETED] * 2
    dev.close()
