"""sam3.demo: the `sam3-npu demo` command end to end on the emulator, and the sam3 preset on a reduced path."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from amdxdna_direct import cmd
from sam3 import demo, pack
from sam3.build import PRESETS, build
from sam3.npu import Npu

REPO = Path(__file__).resolve().parents[1]
STAGE_KEYS = {"name", "kind", "rows", "chunks", "exec_cmds", "waits", "bytes_in", "bytes_out", "seconds",
              "max_rel_err"}
DEVICE_STAGES = ["qkv", "attn", "proj", "fc1", "gelu", "fc2", "glb.attn", "neck.conv16", "neck.conv32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = demo.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_tiny_demo_json(tiny, capsys):
    rc, out, _ = _run(capsys, "demo", "--device", "emu", "--bundle", str(tiny), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True
    assert set(doc) == {"device", "preset", "stages", "loads", "evictions", "ok"}
    assert (doc["device"], doc["preset"], doc["loads"], doc["evictions"]) == ("emu:npu4", "tiny", 5, 0)
    stages = {s["name"]: s for s in doc["stages"]}
    assert all(set(s) == STAGE_KEYS for s in doc["stages"])
    assert [s["name"] for s in doc["stages"] if s["kind"] != "host"] == DEVICE_STAGES
    g = PRESETS["tiny"]
    # qkv pushes the bf16 LayerNorm output and pulls the bf16 q|k|v: sizes by hand.
    assert (stages["qkv"]["bytes_in"], stages["qkv"]["bytes_out"]) == (g.tokens * g.width * 2,
                                                                        g.tokens * 3 * g.width * 2)
    assert stages["fc2"]["bytes_in"] == 0  # chained on fc1's C: nothing through the host
    for name in DEVICE_STAGES:
        s = stages[name]
        assert s["waits"] == 1 and s["max_rel_err"] <= demo.STAGE_TOLERANCE, s
        if s["chunks"] > 1:
            assert s["exec_cmds"] < s["chunks"], s
    assert stages["block"]["max_rel_err"] <= demo.BLOCK_TOLERANCE


def test_two_contexts_still_pass_with_evictions(tiny, capsys, monkeypatch):
    monkeypatch.setenv("SAM3_MAX_CONTEXTS", "2")
    rc, out, _ = _run(capsys, "demo", "--device", "emu", "--bundle", str(tiny), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True
    assert doc["evictions"] > 0 and doc["loads"] > 5
    assert {s["name"]: s for s in doc["stages"]}["fc2"]["bytes_in"] == 0


def test_table_and_cached_build(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SAM3_CACHE", str(tmp_path))
    rc, out, _ = _run(capsys, "demo", "--device", "emu")
    assert rc == 0
    assert "result: OK" in out and "contexts: 5 loaded, 0 evicted" in out
    assert "neck.conv32" in out and "tolerance:" in out
    assert [p.name for p in (tmp_path / "bundles").iterdir()] == ["tiny-npu4-seed0-v1"]


def test_out_of_tolerance_exits_nonzero(tiny, capsys, monkeypatch):
    monkeypatch.setattr(demo, "STAGE_TOLERANCE", 0.0)
    rc, out, _ = _run(capsys, "demo", "--device", "emu", "--bundle", str(tiny), "--json")
    assert rc == 1 and json.loads(out)["ok"] is False


def test_wrong_generation_and_bad_bundle(tiny, tmp_path, capsys):
    rc, _, err = _run(capsys, "demo", "--device", "emu:npu1", "--bundle", str(tiny))
    assert rc == 1 and "targets npu4" in err and "device is npu1" in err
    (tmp_path / "manifest.json").write_text('{"format": 1,')
    rc, _, err = _run(capsys, "demo", "--device", "emu", "--bundle", str(tmp_path))
    assert rc == 1 and "manifest.json is not valid JSON" in err
    rc, _, err = _run(capsys, "demo", "--device", "emu", "--bundle", str(tiny), "--preset", "sam3")
    assert rc == 1 and "blk0.qkv: the sam3 preset needs a GEMM with k=1024 n=3072, bundle has k=64 n=192" in err


def test_bundle_without_weights(tiny, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    (copy / "weights" / "blk0.proj.bin").unlink()
    rc, _, err = _run(capsys, "demo", "--device", "emu", "--bundle", str(copy))
    assert rc == 1 and "blk0.proj: the demo needs weights/blk0.proj.bin in the bundle" in err


def test_console_module_runs(tiny):
    out = subprocess.run([sys.executable, "-m", "sam3.demo", "demo", "--device", "emu", "--bundle", str(tiny),
                          "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True


def test_sam3_preset_reduced_path(tmp_path):
    """The sam3 preset's bundle and kernels through the demo's own stage code, reduced to fit the suite's
    time budget: the 72x72 neck conv with 256 channels (21 chunks) and the 81-chunk projection GEMM of a
    5184-token, 1024-wide block. The full demo (every stage) takes about 25 s on a 2-core machine: see
    the README."""
    g = PRESETS["sam3"]
    root = build(tmp_path / "sam3", "sam3")
    with Npu(root, "emu") as npu:
        d = demo.Demo(npu, g)
        d.convs(only=["neck.conv72"])
        x = pack.round_bf16(np.random.default_rng(0).standard_normal((g.tokens, g.width), dtype=np.float32))
        _, proj, st = d.gemm("proj", "blk0.proj", x, g.tokens)
        # Independent of the demo's own check: the float32 product with the weights as shipped.
        w = pack.from_bf16(np.fromfile(root / "weights" / "blk0.proj.bin", np.uint16)).reshape(g.width, g.width).T
        assert float(np.abs(proj - x @ w).max() / np.abs(x @ w).max()) < demo.STAGE_TOLERANCE
    conv = d.stages[0]
    assert (conv.name, conv.rows, conv.chunks, conv.exec_cmds, conv.waits) == ("neck.conv72", 672, 21, 1, 1)
    # ceil(81 / capacity) chains, one wait; capacity: the driver's 4 KiB command list over 52 + 4 * 15-byte
    # slots (spec amdxdna-uapi.md 6.5, xrt-npu-sequence.md 1.7, 2.2), at most the runtime's sub-command cap.
    capacity = min(cmd.CHAIN_MAX_RUNS, 4096 // (52 + 4 * 15))
    assert (st.chunks, st.exec_cmds, st.waits) == (81, math.ceil(81 / capacity), 1)
    assert d.ok and conv.max_rel_err <= demo.STAGE_TOLERANCE


def test_progress_goes_to_stderr(tiny, capsys):
    doc = demo.run_demo("tiny", "emu", tiny, progress=True)
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert lines[0] == "[sam3-npu] 5 context(s) loaded on emu:npu4"
    assert [line.split(":")[0] for line in lines[1:]] == ["[sam3-npu] " + s["name"] for s in doc["stages"]]
    rc, _, err = _run(capsys, "demo", "--device", "emu", "--bundle", str(tiny))
    assert rc == 0 and err == ""  # the tiny preset is not a long run: no progress


def test_table_layout():
    doc = {"device": "emu:npu4", "preset": "tiny", "loads": 7, "evictions": 2, "ok": False, "stages": [
        {"name": "fc2", "kind": "gemm", "rows": 256, "chunks": 8, "exec_cmds": 1, "waits": 1, "bytes_in": 0,
         "bytes_out": 3 << 20, "seconds": 0.0123, "max_rel_err": 0.00251}]}
    lines = demo.format_table(doc).splitlines()
    assert lines[0] == "sam3-npu demo: preset tiny on emu:npu4"
    assert lines[1].split() == ["stage", "kind", "rows", "chunks", "EXEC", "waits", "in", "out", "seconds", "max",
                                "rel", "err"]
    assert lines[3].split() == ["fc2", "gemm", "256", "8", "1", "1", "0", "B", "3.0", "MiB", "0.012", "2.51e-03"]
    assert lines[-2:] == ["contexts: 7 loaded, 2 evicted", "result: FAILED"]


def test_build_subcommand(tmp_path, capsys):
    rc, out, _ = _run(capsys, "build", str(tmp_path / "b"), "--preset", "tiny", "--target", "npu6", "--seed", "3")
    assert rc == 0 and out.strip() == str(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["target"] == "npu6"
    rc, _, err = _run(capsys, "build", str(tmp_path / "b"))
    assert rc == 1 and err.startswith("sam3-npu build: ") and "already holds a bundle" in err
