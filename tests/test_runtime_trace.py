"""The ioctl trace: every ioctl of a passthrough run logged decoded, the summary, AMDXDNA_TRACE=1."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import passthrough_stream

from amdxdna_direct import Xclbin, open_device, trace

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def traced():
    stream = io.StringIO()
    trace.TRACER.reset()
    trace.enable(stream)
    yield stream
    trace.disable()
    trace.TRACER.reset()


def _passthrough(fixture):
    dev = open_device("emu:npu1")
    stream = passthrough_stream(dev, fixture)
    ctx = dev.hw_context(Xclbin.load(fixture / "aie.xclbin"))
    a, b, c = dev.bo(4096), dev.bo(4096), dev.bo(4096)
    a.array(np.uint32)[:] = 1
    a.sync()
    ctx.kernel().prepare_npu(stream, [a, b, c]).start().wait(30)
    c.sync(direction="from_device")
    return dev


def test_every_ioctl_of_a_passthrough_run_is_logged_decoded(traced, npu1_fixture):
    dev = _passthrough(npu1_fixture)
    dev.close()
    lines = traced.getvalue().splitlines()
    # name(decoded input fields) -> 0 {fields the driver wrote} | ERRNO (text), then the duration
    shape = re.compile(r"amdxdna-trace: emu:npu1 (\w+)\((\w+=[^,()]+(, )?)+\) -> (0 \{.*\}|E[A-Z]+ \(.+\)) [\d.]+us")
    assert all(shape.fullmatch(line) for line in lines), [line for line in lines if not shape.fullmatch(line)]
    names = [shape.fullmatch(line).group(1) for line in lines]
    issued = {k: v for k, v in dev.stats.items() if k.isupper()}
    assert {n: names.count(n) for n in set(names)} == issued          # one line per ioctl, none missing
    # every ioctl XRT issues for one run (docs/xrt-sequence.md 0), plus the DRM version check
    assert set(names) == {"VERSION", "CREATE_BO", "GET_BO_INFO", "GET_INFO", "CREATE_HWCTX", "CONFIG_HWCTX",
                          "SYNC_BO", "EXEC_CMD", "SYNCOBJ_TIMELINE_WAIT", "GEM_CLOSE", "SYNCOBJ_DESTROY",
                          "DESTROY_HWCTX"}
    by_name = {n: [line for line in lines if f" {n}(" in line] for n in set(names)}
    assert "param=1, buffer_size=64" in by_name["GET_INFO"][0]               # QUERY_AIE_METADATA, 64 bytes
    assert re.search(r"param_type=0, param_val=0x[0-9a-f]+, param_val_size=16", by_name["CONFIG_HWCTX"][0])
    assert "count_handles=1, flags=2" in by_name["SYNCOBJ_TIMELINE_WAIT"][0]   # WAIT_FOR_SUBMIT
    assert all("direction=0" in line for line in by_name["SYNC_BO"])         # TO_DEVICE both ways (docs/uapi.md 4.6)
    create = next(line for line in lines if " CREATE_HWCTX(" in line)
    assert "max_opc=2048" in create and "num_tiles=4" in create and "-> 0 {" in create
    assert re.search(r"handle=1, syncobj_handle=\d+", create) and create.endswith("us")
    execute = next(line for line in lines if " EXEC_CMD(" in line)
    assert "cmd_count=1" in execute and "arg_count=4" in execute and "type=0" in execute
    heap = next(line for line in lines if " CREATE_BO(" in line)
    assert "size=0x4000000" in heap and "type=2" in heap
    summary = trace.TRACER.summary()
    assert {k: v[0] for k, v in summary.items()} == issued
    assert "EXEC_CMD" in trace.TRACER.format_summary()


def test_failed_ioctl_is_logged_with_its_errno(traced):
    from amdxdna_direct import abi, errors

    with open_device("emu:npu1") as dev:
        req = abi.ffi.new("struct drm_gem_close *")
        req.handle = 77
        with pytest.raises(errors.XdnaError):
            dev.raw_ioctl(abi.DRM_IOCTL_GEM_CLOSE, abi.ffi.buffer(req))
    line = next(line for line in traced.getvalue().splitlines() if " GEM_CLOSE(" in line)
    assert "GEM_CLOSE(handle=77, pad=0) -> EINVAL (Invalid argument)" in line
    assert trace.TRACER.errors["GEM_CLOSE"] == 1


def test_env_variable_traces_and_prints_the_summary_at_exit(npu1_fixture):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "from test_runtime_trace import _passthrough; _passthrough(Path(sys.argv[2])).close()")
    env = dict(os.environ, AMDXDNA_TRACE="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code, str(REPO / "tests"), str(npu1_fixture)], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    assert "amdxdna-trace: emu:npu1 EXEC_CMD(" in done.stderr
    assert "ioctl summary for pid" in done.stderr and re.search(r"EXEC_CMD\s+1\s+0", done.stderr)
