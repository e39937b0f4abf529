"""Packets over the single-command limit (docs/runtime.md 1.4): up to 6.18 a lone ERT_START_CU carries 19 payload
words, so the runtime submits a larger one as a one-command chain and says so in the trace; every profile runs it.

The oracle is the emulator's driver model (docs/emulator.md, Driver profiles S6: a raw lone 21-word packet stays
NEW on linux-6.14/6.18) and numpy's copy of the input.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from amdxdna_direct import cmd, insts, open_device, trace
from amdxdna_direct.bo import FROM_DEVICE
from amdxdna_direct.emu import DRIVERS, Passthrough
from amdxdna_direct.xclbin import build_mlir_aie, write

N_BUFFERS = 8           # opcode (2 words), instr (2), ninstr (1), 8 u64 buffers: a 21-word regmap
SIZE = 256
LONE_LIMITED = {"linux-6.14", "linux-6.18"}


@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_21_word_regmap_completes_on_every_profile(driver):
    xclbin = write(build_mlir_aie(b"single command limit PDI", column_width=1, n_buffers=N_BUFFERS))
    stream = insts.encode(insts.dma_stream(4, [(0, SIZE, "in"), (1, SIZE, "out")]))
    log = io.StringIO()
    trace.enable(log)
    try:
        with open_device(f"emu:npu4:{driver}:coherent") as dev:
            dev.emulator.models.bind(stream, Passthrough())
            ctx = dev.hw_context(xclbin)
            src, dst = dev.bo(SIZE), dev.bo(SIZE)
            data = np.arange(SIZE, dtype=np.uint8)[::-1].copy()
            src.write(data)
            src.sync()
            run = ctx.kernel().prepare_npu(stream, [src, dst])
            assert run.words == 21
            assert run() == cmd.ERT_CMD_STATE_COMPLETED
            dst.sync(direction=FROM_DEVICE)
            np.testing.assert_array_equal(dst.array()[:SIZE], data)
            chained = run.chain is not None
            lines = log.getvalue().splitlines()
            exec_handles = [line for line in lines if " EXEC_CMD(" in line]
            notes = [line for line in lines if " note: " in line]
    finally:
        trace.disable()
    assert chained == (driver in LONE_LIMITED)
    if chained:
        assert len(notes) == 1 and "21 payload words exceed the 19" in notes[0] and "ERT_CMD_CHAIN" in notes[0]
        assert f"cmd_handles={run.chain.handle}" in exec_handles[0]
    else:
        assert notes == []
        assert f"cmd_handles={run.packet.handle}" in exec_handles[0]


def test_limit_follows_the_driver_version():
    # docs/runtime.md 1.4: 19 / 35 words before feature level 0.6 upstream; the command list from 0.6 and out of tree
    assert cmd.lone_command_limit(cmd.ERT_START_CU, 0, 0) == 19
    assert cmd.lone_command_limit(cmd.ERT_START_NPU, 0, 1) == 35
    assert cmd.lone_command_limit(cmd.ERT_START_CU, 0, 6) is None
    assert cmd.lone_command_limit(cmd.ERT_START_CU, 1, 0) is None


@pytest.mark.parametrize("driver", sorted(LONE_LIMITED))
def test_a_rewritten_argument_keeps_the_one_command_chain_whole(driver):
    """set_arg on a run submitted as a one-command chain: the chain still lists its packet among the buffers
    EXEC_CMD passes (docs/uapi.md 6.5), and the run writes into the new buffer."""
    xclbin = write(build_mlir_aie(b"single command limit PDI", column_width=1, n_buffers=N_BUFFERS))
    stream = insts.encode(insts.dma_stream(4, [(0, SIZE, "in"), (1, SIZE, "out")]))
    with open_device(f"emu:npu4:{driver}:coherent") as dev:
        dev.emulator.models.bind(stream, Passthrough())
        ctx = dev.hw_context(xclbin)
        src, dst, other = dev.bo(SIZE), dev.bo(SIZE), dev.bo(SIZE)
        data = np.arange(SIZE, dtype=np.uint8)
        src.write(data)
        src.sync()
        run = ctx.kernel().prepare_npu(stream, [src, dst])
        assert run.chain is not None and run() == cmd.ERT_CMD_STATE_COMPLETED
        run.set_arg(4, other)                       # bo1, the output
        log = io.StringIO()
        trace.enable(log)
        try:
            assert run() == cmd.ERT_CMD_STATE_COMPLETED
        finally:
            trace.disable()
        exec_line = next(line for line in log.getvalue().splitlines() if " EXEC_CMD(" in line)
        # the buffers: the instructions, src, the new output, and the chain's packet
        assert f"cmd_handles={run.chain.handle}" in exec_line and "arg_count=4" in exec_line
        other.sync(direction=FROM_DEVICE)
        np.testing.assert_array_equal(other.array()[:SIZE], data)
