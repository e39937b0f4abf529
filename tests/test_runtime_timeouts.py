"""A wait that expires while the command is still on the device (docs/runtime.md 3.4), on every driver profile.

On 6.x/7.0 the driver resets a hung command only at its 60 s TDR (2 s out of tree), so the runtime's wait can end
first. The emulator's hang fault and its test clock (docs/emulator.md, Driver profiles: every TDR lasts time_scale
times its modelled length) stand in for the kernels; the oracle is the emulator's own ioctl counts and live BOs.
"""

from __future__ import annotations

import contextlib

import pytest

from amdxdna_direct import XdnaError, insts, open_device
from amdxdna_direct.emu import DRIVERS, EmuDevice, Passthrough, resolve
from amdxdna_direct.errors import CommandTimeout
from amdxdna_direct.kernel import FOREVER, RunList
from amdxdna_direct.xclbin import build_mlir_aie, write

SIZE = 256
TDR_WALL_S = 0.6        # every profile's TDR, scaled to this much wall time


@contextlib.contextmanager
def copy_design(driver):
    """An emulated npu1 under ``driver`` with its TDR scaled to TDR_WALL_S, a copy design's context, its stream
    (the passthrough bound) and two buffers: (emu, dev, ctx, stream, src, dst)."""
    profile = resolve(f"npu1:{driver}")
    emu = EmuDevice(f"npu1:{driver}", coherent=True, time_scale=TDR_WALL_S / profile.tdr_timeout)
    try:
        dev = open_device(emu)
        stream = insts.encode(insts.dma_stream(dev.txn_dev_gen, [(0, SIZE, "in"), (1, SIZE, "out")]))
        emu.models.bind(stream, Passthrough())
        ctx = dev.hw_context(write(build_mlir_aie(b"timeouts PDI", column_width=1, n_buffers=2)))
        yield emu, dev, ctx, stream, dev.bo(SIZE), dev.bo(SIZE)
    finally:
        emu.close()


@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_expired_wait_keeps_the_command_buffers_until_it_ends(driver):
    with copy_design(driver) as (emu, dev, ctx, stream, src, dst):
        run = ctx.kernel().prepare_npu(stream, [src, dst])
        emu.faults.hang(stream, count=2)
        run.start()
        with pytest.raises(CommandTimeout) as expired:
            run.wait(timeout=0.05)
        assert expired.value.state == "RUNNING"
        with pytest.raises(RuntimeError, match=r"MLIR_AIE \(seq=0\) timed out in wait\(\) and is still on the device"):
            run.start()
        closes = dev.stats["GEM_CLOSE"]
        src.close()                                     # the command still reads it
        assert dev.stats["GEM_CLOSE"] == closes
        with pytest.raises(CommandTimeout) as reset:    # the driver's TDR ends it
            run.wait(timeout=FOREVER)
        assert reset.value.state == "TIMEOUT"
        assert dev.stats["GEM_CLOSE"] == closes + 1     # src's GEM_CLOSE, now that the command is over
        assert not run.in_flight

        other = ctx.kernel().prepare_npu(stream, [dst, dev.bo(SIZE)])
        other.start()
        with pytest.raises(CommandTimeout, match="not finished after 0.05 s"):
            other.wait(timeout=0.05)
        closes = dev.stats["GEM_CLOSE"]
        other.close()                                   # its packet stays allocated for the device
        assert dev.stats["GEM_CLOSE"] == closes
        dev.close()
        assert emu.counters.live()["bos"] == 0          # everything freed once the device file closed


@pytest.mark.parametrize("driver", ["linux-6.14", "xdna-oot"])
def test_expired_run_list_wait_keeps_its_packets(driver):
    with copy_design(driver) as (emu, dev, ctx, stream, src, dst):
        runs = RunList(ctx, [ctx.kernel().prepare_npu(stream, [src, dst])])
        emu.faults.hang(stream)
        runs.start()
        with pytest.raises(CommandTimeout):
            runs.wait(timeout=0.05)
        with pytest.raises(RuntimeError, match="RunList of 1 runs timed out in wait"):
            runs.start()
        closes = dev.stats["GEM_CLOSE"]
        runs.close()                                    # its chain packet stays allocated for the device
        dst.close()
        assert dev.stats["GEM_CLOSE"] == closes
        with pytest.raises(XdnaError, match="EBADF"):
            runs.wait(timeout=FOREVER)
        dev.close()
        assert emu.counters.live()["bos"] == 0
