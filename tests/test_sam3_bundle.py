"""sam3.bundle: a hand-written bundle loads; each documented manifest error names its key and field."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from amdxdna_direct import xclbin
from sam3.bundle import Bundle, BundleError

_XCLBIN = xclbin.write(xclbin.build_mlir_aie(b"\x01" * 64))  # a well-formed mlir-aie xclbin (kernel MLIR_AIE)


def _txn(gen: int) -> bytes:
    # TXN header only (spec/xrt-npu-sequence.md 2.3): numRows 6, devGen, minor 1; 1 column; 0 ops; 16 bytes.
    return struct.pack("<4I", 6 << 24 | gen << 16 | 1 << 8, 0x101, 0, 16)


def _manifest() -> dict:
    return {
        "format": 1,
        "target": "npu4",
        "xclbins": {"gemm": {"path": "xclbin/gemm.xclbin", "kernel": "MLIR_AIE"}},
        "gemms": [
            {"key": "blk0.qkv", "ctx": "gemm", "m": 4, "k": 8, "n": 24, "lda": 8, "insts": "insts/blk0.qkv.bin",
             "b_bytes": 8 * 24 * 2, "b_layout": "kn"},
            {"key": "neck.conv", "ctx": "gemm", "m": 4, "k": 6 * 2, "n": 3 * 4 * 5, "lda": 4 * 2,
             "insts": "insts/neck.conv.bin", "b_bytes": 12 * 60 * 2, "b_layout": "conv3x3:4"},
        ],
        "mhas": [{"key": "blk0.attn", "heads": 2, "seq": 4, "d": 4, "elems": 32, "xclbin": "xclbin/mha.xclbin",
                  "insts": "insts/blk0.attn.bin", "name": "MLIR_AIE"}],
        "ops": [{"key": "blk0.gelu", "xclbin": "xclbin/ew.xclbin", "insts": "insts/blk0.gelu.bin",
                 "name": "MLIR_AIE", "fn": "gelu", "elems": 96},
                {"key": "blk0.ln", "xclbin": "xclbin/ew.xclbin", "insts": "insts/blk0.ln.bin",
                 "name": "MLIR_AIE", "fn": "layernorm", "elems": 96, "n": 8}],
    }


def _write(root: Path, manifest: dict, gen: int = 4) -> Path:
    for sub in ("xclbin", "insts"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for name in ("gemm", "mha", "ew"):
        (root / "xclbin" / f"{name}.xclbin").write_bytes(_XCLBIN)
    for key in ("blk0.qkv", "neck.conv", "blk0.attn", "blk0.gelu", "blk0.ln"):
        (root / "insts" / f"{key}.bin").write_bytes(_txn(gen))
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_loads_and_groups_contexts(tmp_path):
    b = Bundle.load(_write(tmp_path, _manifest()))
    assert b.target == "npu4"
    assert b.keys() == ["blk0.attn", "blk0.gelu", "blk0.ln", "blk0.qkv", "neck.conv"]
    assert b.kernel("blk0.qkv").ctx == b.kernel("neck.conv").ctx == "xclbin/gemm.xclbin"
    assert b.kernel("blk0.gelu").ctx == b.kernel("blk0.ln").ctx == "xclbin/ew.xclbin"
    assert b.kernel("blk0.attn").name == "MLIR_AIE"
    conv = b.gemms["neck.conv"].conv
    assert (conv.d, conv.p, conv.cout) == (2, 4, 5)
    assert b.gemms["blk0.qkv"].conv is None
    assert b.ops["blk0.ln"].n == 8
    assert b.weights("blk0.qkv") is None
    with pytest.raises(KeyError, match="nope"):
        b.kernel("nope")


def test_target_generations(tmp_path):
    b = Bundle.load(_write(tmp_path, _manifest()))
    b.check_target("npu5")  # same AIE2P family
    with pytest.raises(BundleError, match=r"targets npu4 .*device is npu1") as e:
        b.check_target("npu1")
    assert e.value.field == "target"


def _expect(tmp_path, manifest, key, field, message, gen=4):
    with pytest.raises(BundleError, match=message) as e:
        Bundle.load(_write(tmp_path, manifest, gen))
    assert (e.value.key, e.value.field) == (key, field)
    if key:
        assert key in str(e.value)
    return e.value


def _gemm(m):
    return m["gemms"][0]


@pytest.mark.parametrize("edit, key, field, message", [
    (lambda m: _gemm(m).update(m=0), "blk0.qkv", "m", "positive integer"),
    (lambda m: _gemm(m).update(k="8"), "blk0.qkv", "k", "positive integer"),
    (lambda m: _gemm(m).update(extra=1), "blk0.qkv", "extra", "unknown field"),
    (lambda m: _gemm(m).pop("lda"), "blk0.qkv", "lda", "missing field"),
    (lambda m: _gemm(m).update(ctx="other"), "blk0.qkv", "ctx", "unknown context"),
    (lambda m: _gemm(m).update(b_bytes=100), "blk0.qkv", "b_bytes", "does not match"),
    (lambda m: _gemm(m).update(b_layout="tiled:3,8"), "blk0.qkv", "b_layout", "does not tile"),
    (lambda m: _gemm(m).update(b_layout="zigzag"), "blk0.qkv", "b_layout", "unknown b_layout"),
    (lambda m: _gemm(m).update(lda=4), "blk0.qkv", "lda", "only conv3x3"),
    (lambda m: m["gemms"][1].update(b_layout="conv3x3:2"), "neck.conv", "b_layout", "give P=4"),
    (lambda m: m["mhas"][0].update(elems=33), "blk0.attn", "elems", "heads"),
    (lambda m: m["ops"][0].update(fn="relu"), "blk0.gelu", "fn", "unknown function"),
    (lambda m: m["ops"][1].pop("n"), "blk0.ln", "n", "missing field"),
    (lambda m: m["ops"][0].update(n=8), "blk0.gelu", "n", "only layernorm"),
    (lambda m: m["ops"][0].update(key="blk0.qkv"), "blk0.qkv", "key", "duplicate key"),
    (lambda m: m["xclbins"]["gemm"].pop("kernel"), "gemm", "kernel", "missing field"),
])
def test_field_errors_name_key_and_field(tmp_path, edit, key, field, message):
    m = _manifest()
    edit(m)
    _expect(tmp_path, m, key, field, message)


@pytest.mark.parametrize("edit, field, message", [
    (lambda m: m.update(format=2), "format", "not supported"),
    (lambda m: m.update(target="npu9"), "target", "unknown NPU"),
    (lambda m: m.pop("xclbins"), "xclbins", "missing field"),
    (lambda m: m.update(gemms={}), "gemms", "expected a list"),
    (lambda m: m.update(extra=[]), "extra", "unknown field"),
])
def test_top_level_errors(tmp_path, edit, field, message):
    m = _manifest()
    edit(m)
    _expect(tmp_path, m, None, field, message)


def test_corrupt_manifest(tmp_path):
    _write(tmp_path, _manifest())
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(BundleError, match="manifest.json is not valid JSON") as e:
        Bundle.load(tmp_path)
    assert e.value.field == "manifest.json"


def test_missing_manifest_and_missing_file(tmp_path):
    with pytest.raises(BundleError, match="manifest.json not found"):
        Bundle.load(tmp_path)
    _write(tmp_path, _manifest())
    (tmp_path / "insts" / "blk0.attn.bin").unlink()
    with pytest.raises(BundleError, match=r"blk0\.attn\.insts: file 'insts/blk0\.attn\.bin' not found") as e:
        Bundle.load(tmp_path)
    assert (e.value.key, e.value.field) == ("blk0.attn", "insts")


@pytest.mark.parametrize("path", ["../outside.bin", "/etc/passwd", "insts/../../outside.bin"])
def test_path_escapes(tmp_path, path):
    m = _manifest()
    m["ops"][0]["insts"] = path
    (tmp_path / "outside.bin").write_bytes(_txn(4))
    _expect(tmp_path / "bundle", m, "blk0.gelu", "insts", "escapes the bundle")


def test_symlink_out_is_refused_and_inside_is_followed(tmp_path):
    root = tmp_path / "bundle"
    _write(root, _manifest())
    (tmp_path / "evil.bin").write_bytes(_txn(4))
    (root / "insts" / "blk0.gelu.bin").unlink()
    os.symlink(tmp_path / "evil.bin", root / "insts" / "blk0.gelu.bin")
    with pytest.raises(BundleError, match="escapes the bundle") as e:
        Bundle.load(root)
    assert (e.value.key, e.value.field) == ("blk0.gelu", "insts")
    (root / "insts" / "blk0.gelu.bin").unlink()
    os.symlink(root / "insts" / "blk0.ln.bin", root / "insts" / "blk0.gelu.bin")
    assert Bundle.load(root).ops["blk0.gelu"].fn == "gelu"


def test_stream_generation_must_match_target(tmp_path):
    _expect(tmp_path, _manifest(), "blk0.attn", "insts", "TXN device generation 3 does not match target npu4", gen=3)


def test_weights_checked(tmp_path):
    _write(tmp_path, _manifest())
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "blk0.qkv.bin").write_bytes(bytes(8 * 24 * 2))
    assert Bundle.load(tmp_path).weights("blk0.qkv") == tmp_path.resolve() / "weights" / "blk0.qkv.bin"
    (tmp_path / "weights" / "blk0.qkv.bin").write_bytes(bytes(10))
    with pytest.raises(BundleError, match="has 10 bytes") as e:
        Bundle.load(tmp_path)
    assert (e.value.key, e.value.field) == ("blk0.qkv", "b_bytes")


def test_xclbin_must_parse_and_hold_the_kernel(tmp_path):
    _write(tmp_path, _manifest())
    (tmp_path / "xclbin" / "mha.xclbin").write_bytes(b"xclbin2\0" + bytes(8))
    with pytest.raises(BundleError, match=r"blk0\.attn\.xclbin: xclbin/mha\.xclbin is not a usable xclbin") as e:
        Bundle.load(tmp_path)
    assert (e.value.key, e.value.field) == ("blk0.attn", "xclbin")
    m = _manifest()
    m["xclbins"]["gemm"]["kernel"] = "OTHER"
    _expect(tmp_path, m, "blk0.qkv", "ctx", "no kernel 'OTHER'")
