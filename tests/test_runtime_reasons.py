"""One exception base for the package, and a failed command's reason in its exception (issue 16 item 4)."""

from __future__ import annotations

import errno
import logging
import pickle

import pytest

import amdxdna_direct
from amdxdna_direct import errors, insts, open_device
from amdxdna_direct.emu import DeviceFault, Passthrough
from amdxdna_direct.kernel import RunList
from amdxdna_direct.xclbin import build_mlir_aie


def _design(dev, nbytes=256):
    """A two-buffer copy design built here: the xclbin, its kernel, the stream (not bound to any model)."""
    ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
    gen = 3 if dev.aie_metadata().cols == 5 else 4
    stream = insts.encode(insts.dma_stream(gen, [(0, nbytes, "in"), (1, nbytes, "out")]))
    return ctx, ctx.kernel(), stream


def test_every_error_class_of_the_package_derives_from_one_base():
    import sam3.build
    import sam3.bundle
    import sam3.export_text
    import sam3.kernels
    import sam3.npu
    import sam3.pack
    import sam3.post
    import sam3.preprocess
    import sam3.text
    import sam3.tokenizer

    assert amdxdna_direct.Error is errors.Error
    runtime = (errors.XdnaError, errors.NoDeviceError, errors.PermissionDeniedError, errors.ContextUnavailableError,
               errors.CommandError, errors.CommandTimeout, errors.DeviceLostError)
    for cls in runtime:     # callers catching OSError keep working
        assert issubclass(cls, errors.Error) and issubclass(cls, OSError), cls
    value_errors = (sam3.bundle.BundleError, sam3.pack.PackError, sam3.kernels.StreamError, sam3.build.GeometryError,
                    sam3.post.PostError, sam3.preprocess.ImageError, sam3.text.TextError,
                    sam3.tokenizer.TokenizerError, sam3.export_text.ExportError)
    for cls in value_errors:
        assert issubclass(cls, errors.Error) and issubclass(cls, ValueError), cls
    assert issubclass(sam3.npu.NpuError, errors.Error) and issubclass(sam3.npu.NpuError, RuntimeError)
    assert not issubclass(errors.Error, (OSError, ValueError))


def test_a_device_error_is_caught_by_the_base():
    with pytest.raises(errors.Error) as info:
        open_device("/nonexistent/accel9")
    assert isinstance(info.value, errors.NoDeviceError) and info.value.errno == errno.ENOENT


def test_command_error_pickles_its_reason():
    err = errors.CommandError(errno.EIO, "k: ERROR; emulated firmware: boom", kernel="k", state="ERROR", seq=2,
                              reason="boom")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.reason, back.state, back.seq, str(back)) == \
        (errors.CommandError, "boom", "ERROR", 2, "k: ERROR; emulated firmware: boom")


def test_an_unbound_stream_fails_with_the_emulated_firmware_reason(caplog):
    with open_device("emu:npu4") as dev:
        ctx, kernel, stream = _design(dev)
        a, b = dev.bo(256), dev.bo(256)
        run = kernel.prepare_npu(stream, [a, b])
        with caplog.at_level(logging.CRITICAL, logger="amdxdna_direct.emu"), pytest.raises(errors.CommandError) as info:
            run(timeout=5)
        err = info.value
        assert err.state == "ERROR" and err.errno == errno.EIO and err.seq == run.seq
        digest = run.insts.digest
        assert err.reason is not None and "no model bound" in err.reason and digest in err.reason
        assert f"emulated firmware: {err.reason}" in str(err) and "command ERROR" in str(err)


def test_a_model_fault_carries_the_model_message_in_a_run_list():
    class Faulty:
        name = "faulty"

        def __call__(self, args):
            raise DeviceFault("lane 7 overflowed its accumulator")

    with open_device("emu:npu4") as dev:
        ctx, kernel, stream = _design(dev)
        good_stream = insts.encode(insts.dma_stream(4, [(0, 64, "in"), (1, 64, "out")]))
        dev.emulator.models.bind(good_stream, Passthrough())
        dev.emulator.models.bind(stream, Faulty())
        a, b = dev.bo(256), dev.bo(256)
        runs = [kernel.prepare_npu(good_stream, [a, b]), kernel.prepare_npu(stream, [a, b])]
        with pytest.raises(errors.CommandError) as info:
            RunList(ctx, runs)(timeout=5)
        err = info.value
        assert err.index == 1 and err.state == "ERROR"
        assert "lane 7 overflowed its accumulator" in err.reason and "faulty" in err.reason
        assert "lane 7 overflowed its accumulator" in str(err)


def test_a_completed_run_has_no_reason_and_a_real_device_error_none():
    with open_device("emu:npu4") as dev:
        ctx, kernel, stream = _design(dev, 64)
        dev.emulator.models.bind(stream, Passthrough())
        a, b = dev.bo(64), dev.bo(64)
        run = kernel.prepare_npu(stream, [a, b])
        assert run(timeout=5) == 4
