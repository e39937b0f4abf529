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
    with pytest.raises(NotImplementedError, match=r"get_info\(kdma\)"):
        device.get_info(xrt.xrt_info_device.kdma)
    with pytest.raises(NotImplementedError, match=r"bo\(flags=0x1\)"):
        xrt.bo(device, 64, 1, 0)
    with pytest.raises(NotImplementedError, match=r"pyxrt\.elf"):
        xrt.elf("design.elf")
    with pytest.raises(NotImplementedError, match=r"pyxrt\.ext\.kernel"):
        xrt.ext.kernel(ctx, "main:dpu")
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


# -- the real clients' call sequences, run as scripts under the module (in this process) ----------------------

DESIGNS = {   # profile, xclbin, insts, the kernel's buffer sizes in bytes (decoded from the stream's BDs)
    "npu1": ("emu:npu1", "mlir-aie-npu1_1col/aie.xclbin", "mlir-aie-npu1_1col/insts.bin", (68, 64, 64)),
    "npu2": ("emu:npu4", "mlir-aie-npu2_1col/final.xclbin", "mlir-aie-npu2_1col/insts.bin", (512, 16384)),
}


@pytest.fixture
def run_script(monkeypatch, capsys):
    """Run a script of tests/pyxrt_scripts through ``python -m amdxdna_direct.pyxrt``'s main in this process;
    returns its stdout lines. What the script imports (pyxrt, its sibling modules) is dropped afterwards."""
    from amdxdna_direct.pyxrt.__main__ import main

    def run(name: str, *args: object) -> list[str]:
        before = set(sys.modules)
        monkeypatch.setattr(sys, "argv", list(sys.argv))
        monkeypatch.setattr(sys, "path", list(sys.path))
        try:
            assert main([str(SCRIPT.parent / name), *map(str, args)]) == 0
        finally:
            for module in set(sys.modules) - before:
                del sys.modules[module]
        return capsys.readouterr().out.splitlines()
    return run


def design(monkeypatch, name):
    profile, xclbin, insts, sizes = DESIGNS[name]
    monkeypatch.setenv("AMDXDNA_DEVICE", profile)
    monkeypatch.setenv("AMDXDNA_EMU_MODEL", "passthrough")
    return fixture(xclbin), fixture(insts), sizes


@pytest.mark.parametrize("name", DESIGNS)
def test_mlir_aie_utils_setup_execute_and_trace(monkeypatch, tmp_path, run_script, name):
    """aie.utils.xrt's way: a text instruction file, buffers registered at group ids 3 (4) 5, execute(), and
    with a trace the output buffer as raw bytes followed by the trace region."""
    xclbin, insts, sizes = design(monkeypatch, name)
    text = tmp_path / "insts.txt"
    text.write_text("".join(f"{w:08X}\n" for w in np.fromfile(insts, dtype=np.uint32)))
    words_in, words_out = sizes[0] // 4, sizes[-1] // 4
    two = "1" if len(sizes) == 3 else "0"
    monkeypatch.chdir(tmp_path)     # the script imports its sibling module from its own directory, not the cwd
    assert run_script("run_aie_utils.py", xclbin, text, words_in, words_out, two) == ["PASS!"]
    trace = tmp_path / "trace.txt"
    assert run_script("run_aie_utils.py", xclbin, text, words_in, words_out, two, trace) == ["PASS!"]
    assert trace.read_text() == ""      # the passthrough writes no trace: no non-zero word to print


@pytest.mark.parametrize("name", DESIGNS)
def test_mlir_air_backend_invoker(monkeypatch, run_script, name):
    """mlir-air's XRT backend: the kernel found by a substring of its name, bfloat16 stored as int16, new bos
    at group_id(i + 3) on every call, ninstr the word count."""
    xclbin, insts, sizes = design(monkeypatch, name)
    assert run_script("run_air_backend.py", xclbin, insts, *sizes) == ["PASS!", "PASS!"]


@pytest.mark.parametrize("name", DESIGNS)
def test_iron_host_runtime(monkeypatch, run_script, name):
    """IRON's host runtime: the NPU family from get_info(name), ninstr in bytes, a new instruction bo per run,
    tensors as numpy views of map() bound through sub-buffer handles of one allocation."""
    xclbin, insts, sizes = design(monkeypatch, name)
    family = {"npu1": "RyzenAI-npu1 npu1", "npu2": "RyzenAI-npu4 npu2"}[name]
    assert run_script("run_iron_runtime.py", xclbin, insts, *sizes) == [family, "PASS!"]


def test_device_names_are_the_drivers_vbnv(monkeypatch):
    """get_info(name) is the driver's vbnv per generation (docs/pyxrt.md): RyzenAI-npu1 ... RyzenAI-npu6."""
    for gen in ("npu1", "npu4", "npu5", "npu6"):
        monkeypatch.setenv("AMDXDNA_DEVICE", f"emu:{gen}")
        dev = xrt.device(0)
        assert dev.get_info(xrt.xrt_info_device.name) == f"RyzenAI-{gen}"
        assert dev.get_info(xrt.xrt_info_device.bdf) == f"emu:{gen}"
        dev.close()


def test_device_by_pci_address(monkeypatch, tmp_path):
    """device(bdf) opens the node whose sysfs device is that PCI function, with or without the domain."""
    sysfs = tmp_path / "class" / "accel"
    for node, bdf in (("accel0", "0000:c5:00.1"), ("accel1", "0000:66:00.1")):
        target = tmp_path / "devices" / "pci0000:00" / bdf
        target.mkdir(parents=True)
        (target / "vbnv").write_text("RyzenAI-npu4\n")
        (sysfs / node).mkdir(parents=True)
        (sysfs / node / "device").symlink_to(target)
    monkeypatch.setattr(xrt, "SYSFS_ACCEL", str(sysfs))
    monkeypatch.setattr(xrt, "_amdxdna_nodes", lambda: ["/dev/accel/accel0", "/dev/accel/accel1"])
    opened, real_open = [], xrt.open_device
    monkeypatch.setattr(xrt, "open_device", lambda spec: opened.append(spec) or real_open("emu:npu4"))
    xrt.device("66:00.1").close()
    xrt.device("0000:C5:00.1").close()
    assert opened == ["/dev/accel/accel1", "/dev/accel/accel0"]
    with pytest.raises(RuntimeError, match=r"no amdxdna device at PCI address 0000:01:00\.0 \(/dev/accel/accel0 "
                                           r"at 0000:c5:00\.1, /dev/accel/accel1 at 0000:66:00\.1\)"):
        xrt.device("01:00.0")
    assert xrt._sysfs_vbnv("/dev/accel/accel1") == "RyzenAI-npu4"
    assert xrt._node_bdf("/dev/accel/accel0") == "0000:c5:00.1"


def test_repeated_calls_cost_what_the_runtimes_restart_costs(npu1):
    """kernel(...) again with the same buffers and stream reuses the last call's packet; a new buffer, a new
    stream or a call while the last is in flight prepares another (one CREATE_BO)."""
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    stats = device._dev.stats

    def ioctls(fn):
        before = Counter(stats)
        fn()
        return {k: stats[k] - before[k] for k in stats if stats[k] != before[k] and not k.startswith("bytes")}

    kernel(3, bo_instr, n, a, b, c).wait()
    runtime = kernel._kernel.prepare_npu(bytes(bo_instr.read(n * 4, 0)), [a._bo, b._bo, c._bo])
    runtime.start().wait()
    assert ioctls(lambda: kernel(3, bo_instr, n, a, b, c).wait()) == ioctls(lambda: runtime.start().wait()) == {
        "EXEC_CMD": 1, "SYNCOBJ_TIMELINE_WAIT": 1}
    assert ioctls(lambda: kernel(3, bo_instr, n * 4, a, b, c).wait()) == {"EXEC_CMD": 1, "SYNCOBJ_TIMELINE_WAIT": 1}
    other = xrt.bo(device, 64, xrt.bo.host_only, kernel.group_id(5))
    assert ioctls(lambda: kernel(3, bo_instr, n, a, b, other).wait())["CREATE_BO"] == 1
    first = kernel(3, bo_instr, n, a, b, other)
    assert ioctls(lambda: kernel(3, bo_instr, n, a, b, other).wait())["CREATE_BO"] == 1
    assert first.wait() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED


def test_instruction_length_comes_from_the_stream_header(npu1):
    """ninstr as words (mlir-aie) or bytes (IRON) runs the same stream; a bo that holds no TXN header is refused
    before any EXEC_CMD, naming its size, ninstr and the header's size."""
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    a.write(np.arange(17, dtype=np.int32), 0)
    a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    for ninstr in (n, n * 4, 0):
        c.write(np.zeros(16, dtype=np.int32), 0)
        c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        assert kernel(3, bo_instr, ninstr, a, b, c).wait() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
        np.testing.assert_array_equal(c.read(64, 0).view(np.int32), np.arange(16))
    padded = xrt.bo(device, n * 4 + 4096, xrt.bo.cacheable, kernel.group_id(1))     # a larger bo: the header rules
    padded.write(bo_instr.read(n * 4, 0), 0)
    padded.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    assert kernel(3, padded, n, a, b, c).wait() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
    junk = xrt.bo(device, 64, xrt.bo.cacheable, kernel.group_id(1))
    junk.write(np.full(16, 0xFFFF, dtype=np.uint32), 0)
    before = device._dev.stats["EXEC_CMD"]
    with pytest.raises(RuntimeError, match=r"instruction bo \(64 bytes, ninstr=16\) holds no TXN stream: its "
                                           r"header's size_bytes \(word 3\) is 65535"):
        kernel(3, junk, 16, a, b, c)
    assert device._dev.stats["EXEC_CMD"] == before


def test_sub_buffers_and_map(npu1):
    """bo(parent, size, offset) shares the parent's memory; map() is writable and numpy views of it see what
    the device wrote; a sub-buffer outside its parent is refused."""
    device, ctx, kernel, bo_instr, n, _ = setup(npu1)
    whole = xrt.bo(device, 68 + 64 + 64, xrt.bo.host_only, 0)
    host = np.frombuffer(whole.map(), dtype=np.uint8)
    a, b, c = xrt.bo(whole, 68, 0), xrt.bo(whole, 64, 68), xrt.bo(whole, 64, 132)
    assert (a.size(), c.size(), c.address() - whole.address()) == (68, 64, 132)
    host[:68].view(np.int32)[:] = np.arange(17) * 5
    a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    assert kernel(3, bo_instr, n, a, b, c).wait() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
    c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
    np.testing.assert_array_equal(host[132:].view(np.int32), np.arange(16) * 5)
    np.testing.assert_array_equal(c.read(64, 0).view(np.int32), np.arange(16) * 5)
    with pytest.raises(ValueError, match="outside a 196-byte buffer"):
        xrt.bo(whole, 128, 100)
    with pytest.raises(ValueError, match="size must be positive"):
        xrt.bo(device, 0, xrt.bo.host_only, 0)


def test_wait2_raises_for_a_run_that_did_not_complete(npu1):
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    kernel(3, bo_instr, n, a, b, c).wait2()
    device._dev.emulator.faults.hang(bytes(bo_instr.read(n * 4, 0)))
    h = kernel(3, bo_instr, n, a, b, c)
    with pytest.raises(RuntimeError, match="MLIR_AIE ended in ERT_CMD_STATE_TIMEOUT"):
        h.wait2(50)


def test_runlist_of_one_run_added_twice_gives_each_entry_a_packet(npu1):
    device, ctx, kernel, bo_instr, n, (a, b, c) = setup(npu1)
    r = xrt.run(kernel)
    for i, v in enumerate((3, bo_instr, n, a, b, c)):
        r.set_arg(i, v)
    rl = xrt.runlist(ctx)
    rl.add(r)
    rl.add(r)
    rl.execute()
    rl.wait()
    assert r.state() == xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED


def test_a_missing_script_is_one_line(capsys):
    from amdxdna_direct.pyxrt.__main__ import main

    assert main(["/nonexistent/run.py"]) == 2
    assert capsys.readouterr().err == "python -m amdxdna_direct.pyxrt: /nonexistent/run.py: no such script\n"


def test_contexts_from_a_uuid_an_xclbin_or_a_path_and_the_flag_spellings(npu1):
    device = xrt.device(0)
    xb = xrt.xclbin(str(npu1[0]))
    with pytest.raises(RuntimeError, match=rf"xclbin {xb.get_uuid().to_string()} is not registered"):
        xrt.hw_context(device, xb.get_uuid())
    assert xb.get_xsa_name() == ""     # mlir-aie leaves the header's m_platformVBNV zero (decoded by hand)
    assert xrt.xclbin(str(fixture("amd-npu4/preemption_4x4.xclbin"))).get_xsa_name() == "xilinx_v1_ipu_0_0"
    for how in (xb, str(npu1[0])):
        ctx = xrt.hw_context(device, how)
        kernel = xrt.kernel(ctx, "MLIR_AIE")
        assert kernel.group_id(3) == 3
    assert (xrt.bo.flags.cacheable, xrt.bo.flags.host_only) == (xrt.bo.cacheable, xrt.bo.host_only) == (
        1 << 24, 1 << 29)
    buf = xrt.bo(device, np.int64(64), xrt.bo.flags.host_only, kernel.group_id(3))
    assert buf.size() == 64
    assert xrt.enumerate_devices() == 1        # $AMDXDNA_DEVICE names one


def test_failures_are_runtime_errors_with_the_runtimes_message(npu1, tmp_path, monkeypatch):
    """What XRT reports by exception arrives as a RuntimeError (PyxrtError) carrying the runtime's message, the
    runtime's own error chained."""
    from amdxdna_direct.errors import NoDeviceError

    with pytest.raises(RuntimeError, match=r"pyxrt\.xclbin: .*missing\.xclbin") as caught:
        xrt.xclbin(str(tmp_path / "missing.xclbin"))
    assert isinstance(caught.value.__cause__, OSError)
    junk = tmp_path / "junk.xclbin"
    junk.write_bytes(b"not an xclbin at all" * 10)
    with pytest.raises(RuntimeError, match=r"pyxrt\.xclbin: axlf header: .* outside the 200 bytes"):
        xrt.xclbin(str(junk))
    monkeypatch.setenv("AMDXDNA_DEVICE", str(tmp_path / "accel9"))
    with pytest.raises(RuntimeError, match=r"pyxrt\.device: .*accel9") as caught:
        xrt.device(0)
    assert isinstance(caught.value.__cause__, NoDeviceError)
