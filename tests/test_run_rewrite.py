"""Run.set_arg: a prepared run's argument words rewritten in place (docs/runtime.md 3.5). Oracles: numpy GEMMs over
the buffers the test fills, the packet's regmap words decoded by hand (header, CU mask, then the regmap), and the
EXEC_CMD argument handles the driver is passed."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from conftest import txn_dev_gen

from amdxdna_direct import RunList, errors, insts, xclbin
from amdxdna_direct.emu import Gemm

BF16 = ml_dtypes.bfloat16
M, K, N = 16, 64, 32


def _gemm(device):
    """A kernel whose stream the emulator runs as an M x K x N GEMM, and that stream."""
    model = Gemm(M, K, N, K)
    stream = insts.encode(insts.dma_stream(txn_dev_gen(device), [(0, model.a_bytes, "in"), (1, model.b_bytes, "in"),
                                                                 (2, model.c_bytes, "out")], rtp=[M, K, N]))
    device.emulator.models.bind(stream, model)
    ctx = device.hw_context(xclbin.build_mlir_aie(bytes(range(256)) * 4))
    return ctx, ctx.kernel("MLIR_AIE"), stream


def _filled(device, shape, seed):
    host = np.random.default_rng(seed).standard_normal(shape).astype(BF16)
    bo = device.bo(host.nbytes)
    bo.array(BF16, shape=shape)[:] = host
    bo.sync()
    return host, bo


def _result(c):
    c.sync(direction="from_device")
    return c.array(BF16, shape=(M, N)).copy()


def _product(a, b):
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(BF16)


@pytest.mark.emu_only
def test_set_arg_rewrites_the_weights_in_place(device):
    _, kernel, stream = _gemm(device)
    a_host, a = _filled(device, (M, K), 1)
    b1_host, b1 = _filled(device, (K, N), 2)
    b2_host, b2 = _filled(device, (K, N), 3)
    c = device.bo(M * N * 2)
    run = kernel.prepare_npu(stream, [a, b1, c])
    run()
    np.testing.assert_array_equal(_result(c), _product(a_host, b1_host))
    bos = device.stats["CREATE_BO"]
    run.set_arg(4, b2)                     # opcode, instr, ninstr, bo0 (A), bo1 (B): argument 4
    packet = run.packet.array(np.uint8)
    # header, CU mask, then the regmap: bo1's 8-byte address at its xclbin offset
    offset = kernel.args[4].offset
    assert struct.unpack_from("<Q", packet, 8 + offset)[0] == b2.address
    assert b2.handle in run.handles and b1.handle not in run.handles and run.npu_buffers == (a, b2, c)
    run()
    np.testing.assert_array_equal(_result(c), _product(a_host, b2_host))
    assert device.stats["CREATE_BO"] == bos       # nothing allocated: the packet was rewritten


@pytest.mark.emu_only
def test_a_run_list_follows_its_runs_rewritten(device):
    ctx, kernel, stream = _gemm(device)
    a_host, a = _filled(device, (2 * M, K), 4)
    b1_host, b1 = _filled(device, (K, N), 5)
    b2_host, b2 = _filled(device, (K, N), 6)
    c = device.bo(2 * M * N * 2)
    subs = [(a.sub(i * M * K * 2, M * K * 2), c.sub(i * M * N * 2, M * N * 2)) for i in range(2)]
    runs = [kernel.prepare_npu(stream, [sa, b1, sc]) for sa, sc in subs]
    chain = RunList(ctx, runs)
    chain()
    for run in runs:
        run.set_arg(4, b2)
    chain()
    c.sync(direction="from_device")
    np.testing.assert_array_equal(c.array(BF16, shape=(2 * M, N)), _product(a_host, b2_host))
    assert b2.handle in list(chain.chains[0].exec.args) and b1.handle not in list(chain.chains[0].exec.args)


@pytest.mark.emu_only
def test_set_arg_refusals(device):
    _, kernel, stream = _gemm(device)
    _, a = _filled(device, (M, K), 7)
    _, b = _filled(device, (K, N), 8)
    c = device.bo(M * N * 2)
    run = kernel.prepare_npu(stream, [a, b, c])
    with pytest.raises(ValueError, match="set_arg index 9 is not one of its"):
        run.set_arg(9, b)
    with pytest.raises(TypeError, match=r"is a buffer: pass a Bo or None, got int"):
        run.set_arg(4, 5)
    with pytest.raises(ValueError, match=r"bo1 \(argument 4 \(bo1\)\) is a 64-byte buffer"):
        run.set_arg(4, device.bo(64))
    closed = device.bo(b.size)
    closed.close()
    with pytest.raises(ValueError, match="buffer is closed"):
        run.set_arg(4, closed)
    run.start()
    with pytest.raises(RuntimeError, match="is in flight: its packet is not rewritten"):
        run.set_arg(4, b)
    run.wait()
    run.close()
    with pytest.raises(errors.XdnaError, match="set_arg"):
        run.set_arg(4, b)
