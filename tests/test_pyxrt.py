"""amdxdna_direct.pyxrt against the calls mlir-aie's run.py scripts make, on the npu1 fixture (docs/pyxrt.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from fixture_files import fixture

from amdxdna_direct import pyxrt as xrt

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "pyxrt_scripts" / "run_passthrough.py"
EXEC = ("EXEC_CMD", "SYNCOBJ_TIMELINE_WAIT")


@pytest.fixture
def npu1(monkeypatch):
    monkeypatch.setenv("AMDXDNA_DEVICE", "emu:npu1")
    monkeypatch.setenv("AMDXDNA_EMU_MODEL", "passthrough")
    return fixture("mlir-aie-npu1_1col/aie.xclbin"), fixture("mlir-aie-npu1_1col/insts.bin")


def setup(paths):
    device = xrt.device(0)
    xb = xrt.xclbin(str(paths[0]))
    device.register_xclbin(xb)
    ctx = xrt.hw_context(device, xb.get_uuid())
    kernel = xrt.kernel(ctx, xb.get_kernels()[0].get_name())
    instr = np.fromfile(paths[1], dtype=np.uint32)
    bo_instr = xrt.bo(device, len(instr) * 4, xrt.bo.cacheable, kernel.group_id(1))
    bo_instr.write(instr, 0)
    bo_instr.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    bos = [xrt.bo(device, n, xrt.bo.host_only, kernel.group_id(3 + i)) for i, n in enumerate((68, 64, 64))]
    return device, ctx, kernel, bo_instr, len(instr), bos


def test_script_runs_unchanged_under_the_module(npu1):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for extra in ([], ["3"]):
        done = subprocess.run([sys.executable, "-m", "amdxdna_direct.pyxrt", str(SCRIPT), *map(str, npu1), *extra],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["ert_cmd_state.ERT_CMD_STATE_COMPLETED", "PASS!"]


def test_kernel_call_output_and_run_reuse(npu1):
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    for k in range(2):
        data = np.arange(17, dtype=np.int32) - 5 * k
        a.write(data, 0)
        a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        h = kernel(3, bo_instr, n, a, b, c)
        assert h.wait() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        assert h.state() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, 64, 0)
        out = c.read(64, 0)
        assert out.dtype == np.int8
        np.testing.assert_array_equal(out.view(np.int32), data[:16])
    h.start()       # a run started again with the same arguments
    assert h.wait(5000) == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED


@pytest.mark.parametrize("count", [1, 5, 40])
def test_runlist_ioctls_per_run_equal_the_runtimes(npu1, count):
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    a.write(np.arange(17, dtype=np.int32), 0)
    a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    stats = device._dev.stats
    rl = xrt.runlist(ctx)
    runs = []
    for _ in range(count):
        r = xrt.run(kernel)
        for i, v in enumerate((3, bo_instr, n, a, b, c)):
            r.set_arg(i, v)
        rl.add(r)
        runs.append(r)
    before = Counter({k: stats[k] for k in EXEC})
    rl.execute()
    rl.wait()
    ours = Counter({k: stats[k] - before[k] for k in EXEC})
    # the runtime's own RunList over the same prepared runs
    before = Counter({k: stats[k] for k in EXEC})
    rl._list.start().wait()
    theirs = Counter({k: stats[k] - before[k] for k in EXEC})
    assert ours == theirs and ours["SYNCOBJ_TIMELINE_WAIT"] == 1
    assert ours["EXEC_CMD"] == 1 if count <= 5 else ours["EXEC_CMD"] < count
    assert all(r.state() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED for r in runs)
    c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
    np.testing.assert_array_equal(c.read(64, 0).view(np.int32), np.arange(16))


def test_empty_runlist_does_nothing(npu1):
    device, ctx, *_ = setup(npu1)
    before = dict(device._dev.stats)
    rl = xrt.runlist(ctx)
    rl.execute()
    rl.wait()
    assert {k: device._dev.stats[k] for k in EXEC} == {k: before.get(k, 0) for k in EXEC}


def test_edge_cases(npu1):
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    with pytest.raises(RuntimeError, match=r"group_id\(0\).*scalar"):
        kernel.group_id(0)
    with pytest.raises(RuntimeError, match=r"group_id\(99\)"):
        kernel.group_id(99)
    small = xrt.bo(device, 16, xrt.bo.host_only, kernel.group_id(3))
    with pytest.raises(RuntimeError, match="68"):      # the stream's DMA reads 68 bytes through bo0
        kernel(3, bo_instr, n, small, b, c)
    with pytest.raises(NotImplementedError, match=r"pyxrt\.device\(bdf\)"):
        xrt.device("0000:c5:00.1")
    with pytest.raises(NotImplementedError, match="get_info"):
        device.get_info(xrt.xrt_info_device.bdf)
    with pytest.warns(DeprecationWarning):
        device.load_xclbin(str(npu1[0]))
    assert xrt.xclbin(str(npu1[0])).get_uuid().to_string().count("-") == 4
    assert [x.get_name() for x in xrt.xclbin(str(npu1[0])).get_kernels()[0].get_args()][:3] == [
        "opcode", "instr", "ninstr"]
    assert a.size() == 68 and a.address() != 0 and len(a.map()) >= 68


def test_wait_timeout_returns_timeout_state(npu1):
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    emu = device._dev.emulator
    emu.faults.hang(bytes(bo_instr.read(n * 4, 0)))
    h = kernel(3, bo_instr, n, a, b, c)
    assert h.wait(50) == xrt.ert_cmd_state.ERT_CMD_STATE_TIMEOUT


def test_sync_of_a_range_and_write_at_an_offset(npu1):
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    a.write(np.arange(17, dtype=np.int32), 0)
    a.write(np.array([99], dtype=np.int32), 8)
    a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, 68, 0)
    assert kernel(3, bo_instr, n, a, b, c).wait() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
    c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, 16, 0)   # only the first 16 bytes
    np.testing.assert_array_equal(c.read(16, 0).view(np.int32), [0, 1, 99, 3])


def test_amdxdna_trace_decodes_the_scripts_ioctls(npu1):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "amdxdna_direct.cli", "trace", "--", sys.executable, "-m",
                           "amdxdna_direct.pyxrt", str(SCRIPT), *map(str, npu1)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "PASS!" in done.stdout
    assert "EXEC_CMD" in done.stdout + done.stderr and "CREATE_HWCTX" in done.stdout + done.stderr
