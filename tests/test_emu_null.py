"""The null firmware `emu:<npu>:null` (docs/emulator.md, "The null firmware"): every well-formed command completes
at once without reading its stream or running a model; output buffers keep what they held. Oracles: the buffers'
bytes as the test wrote them, the ERT states (docs/design.md 4), the profile fields each name sets."""

from __future__ import annotations

import numpy as np
import pytest

from amdxdna_direct import RunList, cmd, errors, insts, open_device, xclbin
from amdxdna_direct.emu import EmuDevice, Gemm, resolve


def _unbound_run(dev, c_fill):
    """A run over a stream no model is bound to, with its output buffer filled with `c_fill`."""
    stream = insts.encode(insts.dma_stream(4, [(0, 4096, "in"), (1, 4096, "in"), (2, 4096, "out")]))
    ctx = dev.hw_context(xclbin.build_mlir_aie(b"null firmware test", column_width=1, n_buffers=3))
    a, b, c = (dev.bo(4096) for _ in range(3))
    c.array(np.uint8)[:] = c_fill
    for bo in (a, b, c):
        bo.sync()
    return ctx, ctx.kernel().prepare_npu(stream, [a, b, c]), c, stream


def test_every_command_completes_and_outputs_keep_what_they_held():
    with open_device("emu:npu4:null") as dev:
        ctx, run, c, stream = _unbound_run(dev, 0xA5)
        assert run() == cmd.ERT_CMD_STATE_COMPLETED        # no model bound: the null firmware runs none
        c.sync(direction="from_device")
        assert np.all(c.array(np.uint8) == 0xA5)
        chained = RunList(ctx, [run, ctx.kernel().prepare_npu(stream, run.npu_buffers)])
        assert chained() == [cmd.ERT_CMD_STATE_COMPLETED] * 2


def test_without_it_the_same_command_fails():
    with open_device("emu:npu4") as dev:
        _, run, _, _ = _unbound_run(dev, 0)
        with pytest.raises(errors.CommandError, match="no model bound to instruction stream"):
            run()


def test_a_bound_model_is_not_run():
    emu = EmuDevice("npu4:null")
    try:
        with open_device(emu) as dev:
            model = Gemm(16, 64, 32, 64)
            stream = insts.encode(insts.dma_stream(4, [(0, model.a_bytes, "in"), (1, model.b_bytes, "in"),
                                                       (2, model.c_bytes, "out")], rtp=[16, 64, 32]))
            emu.models.bind(stream, model)
            ctx = dev.hw_context(xclbin.build_mlir_aie(bytes(range(256)) * 4))
            a, b, c = dev.bo(model.a_bytes), dev.bo(model.b_bytes), dev.bo(model.c_bytes)
            a.array(np.uint16)[:] = 0x3F80      # bf16 1.0: a model run would write 64.0 into every C element
            b.array(np.uint16)[:] = 0x3F80
            c.array(np.uint16)[:] = 7
            for bo in (a, b, c):
                bo.sync()
            ctx.kernel("MLIR_AIE").prepare_npu(stream, [a, b, c])()
            c.sync(direction="from_device")
            assert np.all(c.array(np.uint16) == 7)
    finally:
        emu.close()


def test_it_combines_with_the_other_variants():
    p = resolve("npu1:linux-6.18:null:coherent")
    assert (p.name, p.driver, p.null_firmware, p.coherent, p.drm_minor) == ("npu1", "linux-6.18", True, True, 1)
    p = resolve("npu4:coherent:null")
    assert (p.driver, p.null_firmware, p.coherent) == ("linux-7.0", True, True)
    assert not resolve("npu4").null_firmware and not resolve("npu4:coherent").null_firmware
    with pytest.raises(KeyError, match="a variant is given twice"):
        resolve("npu4:null:null")
    with pytest.raises(ValueError, match="a variant is given twice"):
        open_device("emu:npu4:null:null")
    with pytest.raises(KeyError, match=r"expected <npu>\[:<driver>\]\[:coherent\]\[:null\]"):
        resolve("npu4:linux-7.0:xdna-oot:null")
    with EmuDevice("npu4", null_firmware=True) as emu:
        assert emu.profile.null_firmware
