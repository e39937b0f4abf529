"""The runtime's driver-facing paths under every driver profile (issue 22 item 6; docs/emulator.md, Driver
profiles): buffers (create, map, sync), contexts (create, destroy), exec and wait, chains, and the errors a
program sees. The oracle: numpy copies of the inputs, the emulator's live-object counters and the errnos
docs/driver-rules.md gives (the same on every version for these paths).
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

from amdxdna_direct import XdnaError, cmd, insts, open_device
from amdxdna_direct.bo import FROM_DEVICE
from amdxdna_direct.emu import DRIVERS, EmuDevice, Passthrough
from amdxdna_direct.errors import CommandError
from amdxdna_direct.kernel import RunList
from amdxdna_direct.xclbin import build_mlir_aie, write

SIZE = 4096
XCLBIN = write(build_mlir_aie(b"profiles PDI", column_width=1, n_buffers=2))


@pytest.fixture(params=sorted(DRIVERS))
def profile_device(request):
    """A runtime Device on ``npu1:<driver>`` (non-coherent: every sync counts), with its emulator."""
    emu = EmuDevice(f"npu1:{request.param}")
    dev = open_device(emu)
    try:
        yield dev, emu
    finally:
        dev.close()
        assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}
        emu.close()


def copy_stream(dev, size: int = SIZE) -> bytes:
    return insts.encode(insts.dma_stream(dev.txn_dev_gen, [(0, size, "in"), (1, size, "out")]))


def test_buffers_map_and_sync(profile_device):
    dev, _ = profile_device
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    with dev.bo(SIZE) as bo, dev.bo(SIZE, "dev") as dbo:
        bo.write(data)
        bo.sync()
        bo.sync(direction=FROM_DEVICE)
        np.testing.assert_array_equal(bo.array(), data)
        assert dbo.address >= 0x4000000 and dbo.address % (32 << 10) == 0     # rule B4: heap window, 32 KiB
    with pytest.raises(XdnaError, match="EBADF"):
        bo.read()


def test_context_exec_wait_and_chain(profile_device):
    dev, emu = profile_device
    stream = copy_stream(dev)
    emu.models.bind(stream, Passthrough())
    data = np.arange(SIZE, dtype=np.uint32).view(np.uint8)[:SIZE]
    with dev.hw_context(XCLBIN) as ctx:
        assert emu.counters.live()["hwctx"] == 1
        src, dst, dst2 = dev.bo(SIZE), dev.bo(SIZE), dev.bo(SIZE)
        src.write(data)
        src.sync()
        run = ctx.kernel().prepare_npu(stream, [src, dst])
        assert run() == cmd.ERT_CMD_STATE_COMPLETED
        dst.sync(direction=FROM_DEVICE)
        np.testing.assert_array_equal(dst.array(), data)
        second = ctx.kernel().prepare_npu(stream, [src, dst2])
        with RunList(ctx, [run, second]) as runs:
            assert runs() == [cmd.ERT_CMD_STATE_COMPLETED] * 2
        dst2.sync(direction=FROM_DEVICE)
        np.testing.assert_array_equal(dst2.array(), data)
    assert emu.counters.live()["hwctx"] == 0


def test_errors_a_program_sees(profile_device):
    dev, emu = profile_device
    stream = copy_stream(dev)
    emu.models.bind(stream, Passthrough())
    with dev.hw_context(XCLBIN) as ctx:
        src, dst = dev.bo(SIZE), dev.bo(SIZE)
        run = ctx.kernel().prepare_npu(stream, [src, dst])
        emu.faults.error(stream)
        with pytest.raises(CommandError, match="command ERROR") as failed:
            run()
        assert failed.value.errno == errno.EIO
        assert run() == cmd.ERT_CMD_STATE_COMPLETED       # rebuilt and resubmitted
        with pytest.raises(RuntimeError, match="never started"):
            ctx.kernel().prepare_npu(stream, [src, dst]).wait()
        dst.close()
        with pytest.raises(XdnaError, match="EBADF"):
            run.start()
