"""sam3.build: the written bundle decodes, by the project's parsers, to what its manifest says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from amdxdna_direct import insts
from amdxdna_direct.xclbin import Xclbin
from sam3 import pack
from sam3.build import PRESETS, build, build_cached
from sam3.bundle import Bundle

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("b") / "tiny", "tiny", seed=7)


def _patches(path: Path) -> dict[int, int]:
    """arg_idx -> BD length in bytes, from the stream's BLOCKWRITEs and DDR_PATCHes (shim BD i at
    0x1D000 + 0x20*i, word 0 = length in words; the patch targets word 1, spec 2.3 / design 2)."""
    stream = insts.load(path)
    lengths = {op.addr & 0xFFFFF: op.words[0] * 4 for op in stream.ops if isinstance(op, insts.BlockWrite)}
    return {op.arg_idx: lengths[(op.reg_addr & 0xFFFFF) - 4] for op in stream.ops if isinstance(op, insts.DdrPatch)}


def test_manifest_matches_preset(tiny):
    doc = json.loads((tiny / "manifest.json").read_text())
    g = PRESETS["tiny"]
    assert doc["format"] == 1 and doc["target"] == "npu4"
    gemms = {e["key"]: e for e in doc["gemms"]}
    assert (gemms["blk0.qkv"]["k"], gemms["blk0.qkv"]["n"]) == (g.width, 3 * g.width)
    assert (gemms["blk0.fc1"]["n"], gemms["blk0.fc2"]["k"]) == (g.mlp, g.mlp)
    assert gemms["neck.conv16"]["b_layout"] == "conv3x3:4"
    assert {e["key"]: e["seq"] for e in doc["mhas"]} == {"blk0.attn": 64, "glb.attn": 256}
    assert doc["ops"][0]["elems"] == g.rows * g.mlp
    Bundle.load(tiny)  # and it validates


def test_streams_patch_every_argument_with_its_extent(tiny):
    b = Bundle.load(tiny)
    for key, g in b.gemms.items():
        a_bytes = ((g.m - 1) * g.lda + g.k) * 2
        assert _patches(g.insts) == {0: a_bytes, 1: g.k * g.n * 2, 2: g.m * g.n * 2}, key
    for key, h in b.mhas.items():
        assert _patches(h.insts) == dict.fromkeys(range(4), h.elems * 2), key
    assert _patches(b.ops["blk0.gelu"].insts) == {0: b.ops["blk0.gelu"].elems * 2}
    # The RTP words make a stream unique to its computation: equal streams <=> equal (shape, layout, fn).
    what = {k: (g.m, g.k, g.n, g.lda, g.b_layout) for k, g in b.gemms.items()}
    what.update({k: (h.heads, h.seq, h.d) for k, h in b.mhas.items()})
    what.update({k: (o.fn, o.elems) for k, o in b.ops.items()})
    for k1 in b.keys():
        for k2 in b.keys():
            same = b.kernel(k1).insts.read_bytes() == b.kernel(k2).insts.read_bytes()
            assert same == (what[k1] == what[k2]), (k1, k2)
    assert what["neck.conv16"] == what["neck.conv32"]  # one conv kernel serves both map sizes
    assert insts.load(b.gemms["blk0.qkv"].insts).dev_gen == 4


def test_xclbins_and_weights(tiny):
    b = Bundle.load(tiny)
    pdis = set()
    for entry in b.xclbins.values():
        x = Xclbin.load(entry.path)
        assert x.kernel("MLIR_AIE").name == "MLIR_AIE"
        pdis.add(x.pdi_for("MLIR_AIE").image)
    assert len(pdis) == len(b.xclbins)  # a PDI per context
    for key, g in b.gemms.items():
        assert b.weights(key).stat().st_size == g.b_bytes


def test_deterministic_and_seeded(tiny, tmp_path):
    again = build(tmp_path / "again", "tiny", seed=7)
    other = build(tmp_path / "other", "tiny", seed=8)
    for rel in ("weights/blk0.fc1.bin", "xclbin/mha.xclbin", "insts/blk0.qkv.bin", "manifest.json"):
        assert (again / rel).read_bytes() == (tiny / rel).read_bytes()
    assert (other / "weights/blk0.fc1.bin").read_bytes() != (tiny / "weights/blk0.fc1.bin").read_bytes()
    assert (other / "insts/blk0.qkv.bin").read_bytes() == (tiny / "insts/blk0.qkv.bin").read_bytes()


def test_user_weights_from_npz(tmp_path):
    g = PRESETS["tiny"]
    w = np.arange(g.width * g.mlp, dtype=np.float32).reshape(g.width, g.mlp) / 1000
    conv = np.ones((32, 32, 3, 3), np.float32)
    np.savez(tmp_path / "w.npz", **{"blk0.fc1": w, "neck.conv16": conv})
    root = build(tmp_path / "b", "tiny", weights=tmp_path / "w.npz")
    packed = np.fromfile(root / "weights/blk0.fc1.bin", np.uint16)
    assert np.array_equal(packed, pack.pack_b(w, "tiled:16,32"))
    assert np.array_equal(np.fromfile(root / "weights/neck.conv16.bin", np.uint16), pack.pack_conv3x3(conv, 4))
    np.savez(tmp_path / "bad.npz", **{"blk0.fc1": w.T})
    with pytest.raises(ValueError, match=r"blk0\.fc1: shape \(160, 64\), the tiny preset needs \(64, 160\)"):
        build(tmp_path / "c", "tiny", weights=tmp_path / "bad.npz")
    np.savez(tmp_path / "extra.npz", **{"blk9.x": w})
    with pytest.raises(ValueError, match=r"\['blk9\.x'\] match no kernel"):
        build(tmp_path / "d", "tiny", weights=tmp_path / "extra.npz")


def test_npu1_target_and_errors(tmp_path):
    root = build(tmp_path / "p", "tiny", target="npu1")
    b = Bundle.load(root)
    assert b.target == "npu1" and insts.load(b.mhas["blk0.attn"].insts).dev_gen == 3
    with pytest.raises(ValueError, match="already holds a bundle"):
        build(root, "tiny")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build(tmp_path / "q", "huge")
    with pytest.raises(ValueError, match="unknown target 'npu3'"):
        build(tmp_path / "q", "tiny", target="npu3")


def test_cached_build_is_reused(tmp_path):
    first = build_cached(tmp_path, "tiny")
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert build_cached(tmp_path, "tiny") == first
    assert (first / "manifest.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind


def test_tool_script(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "tools" / "build_bundle.py"), str(tmp_path / "t"),
                          "--preset", "tiny", "--target", "npu5"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert Bundle.load(tmp_path / "t").target == "npu5"
