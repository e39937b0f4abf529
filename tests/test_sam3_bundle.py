"""sam3.bundle against bundles the tests write by hand (docs/sam3-bundle.md): grammar, checks, views, writer, summary.

Every bundle here is plain text and bytes written by the test (the writer is tested by reading its output back
with the reader and by hand). Expected values are spelled out from the format description, not computed by
the module under test.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from sam3.bundle import (
    Bundle,
    BundleError,
    BundleWriter,
    Case,
    GemmSpec,
    KernelSource,
    MhaSpec,
    OpSpec,
    Record,
    TensorInfo,
    TokTest,
    XclbinRecord,
    escape,
    format_summary,
    summarize,
    unescape,
)
from sam3.bundle import reader as bundle_mod

# The suggested tiny model of the format description: every size rule holds (docs/sam3-bundle.md 5).
PARAMS = {
    "grid": "8", "window": "4", "vit_dim": "64", "vit_heads": "2", "vit_layers": "2", "vit_ffn_pad": "128",
    "vit_global": "1", "patch": "2", "image_size": "16", "d_model": "32", "d_heads": "2", "d_layers": "1",
    "d_ffn": "64", "text_len": "8", "text_dim": "32", "text_heads": "2", "text_layers": "1", "text_ffn": "64",
    "text_eps": "1e-5", "vit_eps": "1e-6", "queries": "4", "dec_layers": "1", "neck_splits": "64,128,32",
    "mask_size": "32", "bos": "49406", "eos": "49407", "pad": "0",
}
TRACKER = {
    "tracker": "1", "trk_heads": "2", "trk_layers": "2", "trk_mask_tokens": "2", "trk_out_ch": "8,16,32",
    "trk_stability_delta": "0.05", "trk_stability_thresh": "0.95", "trk.0.mlp.depth": "2", "trk.1.mlp.depth": "2",
    "trk.hyper0.depth": "3", "trk.hyper1.depth": "3", "trk.iou_head.depth": "3", "trk.obj_head.depth": "3",
}
# The upload tensors of docs/sam3-bundle.md 5 for vit_layers=2, d_layers=1, written out by hand.
UPLOADS = [
    "v.embed", "n.in", "n.up", "dec.kv",
    "v.0.qkv", "v.0.o", "v.0.fc1", "v.0.fc2", "v.1.qkv", "v.1.o", "v.1.fc1", "v.1.fc2",
    "d.0.qkv", "d.0.o", "d.0.fc1", "d.0.fc2",
    "n.conv0", "n.conv1", "n.conv2", "m.conv0", "m.conv1",
]
ROPE_TABS = ["v.rope_tab.win", "v.rope_tab.glob"]
TRACKER_UPLOADS = ["tn.in", "tn.up", "tn.conv0", "tn.conv1", "tn.conv2"]

# Host tensors of the hand bundle: name, dtype, shape, the bytes (packed by hand), spelled out.
HOST = [
    ("v.pos", "f32", "2,2", struct.pack("<4f", 1.0, 2.0, 3.0, -4.5)),
    ("t.tok_emb", "bf16", "1,2", struct.pack("<2H", 0x3F80, 0xC040)),  # bf16 1.0, -3.0
    ("v.perm", "i32", "4", struct.pack("<4i", 3, 2, 1, -1)),
    ("ref.rgb", "u8", "1,2,3", bytes([1, 2, 3, 4, 5, 6])),
]


def _tensors(names: list[str], packed: int = 8) -> tuple[list[str], bytes]:
    """tensors.txt lines and tensors.bin: each upload tensor `packed` bytes of its index, then HOST, 64-aligned."""
    lines, blob = [], bytearray()
    for i, name in enumerate(names):
        lines.append(f"{name} u8 {packed} {len(blob)} {packed}")
        blob += bytes([i]) * packed
        blob += bytes(-len(blob) % 64)
    for name, dtype, shape, data in HOST:
        lines.append(f"{name} {dtype} {shape} {len(blob)} {len(data)}")
        blob += data + bytes(-(len(blob) + len(data)) % 64)
    return lines, bytes(blob)


def write_hand_bundle(
    root: Path,
    body: str = "",
    *,
    version: str | None = "2",
    params: dict[str, str] | None = None,
    drop: tuple[str, ...] = (),
    uploads: list[str] | None = None,
    index: str | None = None,
    blob: bytes | None = None,
    vocab: str = '{"a</w>": 320, "b</w>": 321, "ab</w>": 322}',
    merges: str = "#version: 0.2\na b</w>\n",
) -> Path:
    """A bundle written as plain text: version, params, one xclbin, then `body` (more manifest lines)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = [] if version is None else [f"version {version}"]
    lines += [f"param {k} {v}" for k, v in {**PARAMS, **(params or {})}.items() if k not in drop]
    lines.append("xclbin gemm kernels/gemm.xclbin MLIR_AIE")
    (root / "manifest.txt").write_text("\n".join(lines) + "\n" + body)
    idx, data = _tensors(UPLOADS if uploads is None else uploads)
    (root / "tensors.txt").write_text("\n".join(idx) + "\n" if index is None else index)
    (root / "tensors.bin").write_bytes(data if blob is None else blob)
    (root / "vocab.json").write_text(vocab)
    (root / "merges.txt").write_text(merges)
    (root / "kernels").mkdir(exist_ok=True)
    (root / "kernels" / "gemm.xclbin").write_bytes(b"xclbin bytes")
    return root


def _open_error(root: Path) -> str:
    with pytest.raises(BundleError) as e:
        Bundle.open(root)
    return str(e.value)


def _line_of(root: Path, text: str) -> int:
    """The 1-based line number of `text` in root/manifest.txt (the oracle for error line numbers)."""
    return (root / "manifest.txt").read_text().split("\n").index(text) + 1


# -------------------------------------------------------------------------------------------------------
# A full hand-written bundle
# -------------------------------------------------------------------------------------------------------

BODY = """\
# kernels
#no-space comment
   # indented comment

gemm v_qkv ctx=gemm insts=kernels/v_qkv.insts.bin M=64 K=64 N=192 lda=64 tile_k=64 tile_n=8 ct_k=8 bias=1 b_bytes=15552
gemm conv ctx=gemm insts=kernels/conv.insts.bin M=+40 K=288 N=128 lda=96 tile_k=288 tile_n=8 ct_k=8 bias=0 b_bytes=41472
mha mha_win xclbin=kernels/mha.xclbin insts=kernels/mha_win.insts.bin heads=2 seq=16 d=32 token_major=1 elems=1024
mha mha_d xclbin=kernels/mha.xclbin insts=kernels/mha_d.insts.bin name=MHA2 heads=2 seq=64 d=64 token_major=0 elems=8192
op rope xclbin=kernels/rope.xclbin insts=kernels/rope.insts.bin
op addln xclbin=kernels/addln.xclbin insts=kernels/addln.insts.bin name=ADDLN
step ignored by=sam3
ref_image cases/ref.png
ref_prompt two  cats\t
tok_test 0 a\\tb\\u00e9 \\\\x
tok_test 7 plain
case 1 cases/cats.jpg Two  dogs, playing!
pcase 2 cases/car.png points=10,20,1;30,40 box=
pcase 3 cases/car.png
"""


def _full(tmp_path: Path) -> Path:
    root = write_hand_bundle(tmp_path / "b", BODY)
    for name in ("v_qkv", "conv", "mha_win", "mha_d", "rope", "addln"):
        (root / "kernels" / f"{name}.insts.bin").write_bytes(struct.pack("<2I", 0x06030100, len(name)))
    return root


def test_open_reads_every_record(tmp_path):
    root = _full(tmp_path)
    with Bundle.open(root) as b:
        assert b.version == 2
        assert b.root == root.resolve()
        assert b.xclbins == {"gemm": XclbinRecord("gemm", root.resolve() / "kernels/gemm.xclbin", "MLIR_AIE", 29)}
        r = root.resolve()
        qkv_line = _line_of(root, BODY.split("\n")[4])
        assert b.gemms["v_qkv"] == GemmSpec("v_qkv", "gemm", r / "kernels/v_qkv.insts.bin", 64, 64, 192, 64, 64, 8, 8,
                                            True, 15552, qkv_line)
        assert b.gemms["conv"].m == 40 and b.gemms["conv"].bias is False
        assert b.mhas["mha_win"] == MhaSpec("mha_win", r / "kernels/mha.xclbin", r / "kernels/mha_win.insts.bin",
                                            "MLIR_AIE", 2, 16, 32, True, 1024, qkv_line + 2)
        assert b.mhas["mha_d"].name == "MHA2" and b.mhas["mha_d"].token_major is False
        assert b.ops["rope"] == OpSpec("rope", r / "kernels/rope.xclbin", r / "kernels/rope.insts.bin", "MLIR_AIE",
                                       qkv_line + 4)
        assert b.ops["addln"].name == "ADDLN"
        assert b.ref_image == r / "cases/ref.png"
        assert b.ref_prompt == "two  cats\t"  # rest(0): inner and trailing whitespace kept
        assert b.tok_tests == [TokTest(0, "a\tbé \\x", qkv_line + 9), TokTest(7, "plain", qkv_line + 10)]
        assert b.cases == [Case(1, r / "cases/cats.jpg", "Two  dogs, playing!", qkv_line + 11)]
        assert b.pcases == [Case(2, r / "cases/car.png", "points=10,20,1;30,40 box=", qkv_line + 12),
                            Case(3, r / "cases/car.png", "", qkv_line + 13)]
        # Every non-shared record is kept in file order, the unknown tag `step` included.
        assert [rec.tag for rec in b.records] == ["gemm", "gemm", "mha", "mha", "op", "op", "step", "ref_image",
                                                   "ref_prompt", "tok_test", "tok_test", "case", "pcase", "pcase"]
        assert b.vocab == {"a</w>": 320, "b</w>": 321, "ab</w>": 322}
        assert b.merges == [("a", "b</w>")]


def test_params_are_typed(tmp_path):
    with Bundle.open(_full(tmp_path)) as b:
        p = b.params
        assert (p.grid, p.window, p.vit_dim, p.vit_layers, p.text_ffn, p.bos, p.eos) == (8, 4, 64, 2, 64, 49406, 49407)
        assert p.vit_global == [1] and p.neck_splits == [64, 128, 32]
        assert p.vit_eps == float(np.float32(1e-6)) and p.vit_eps != 1e-6  # rounded to float32
        assert (p.vit_device, p.vit_res_f32, p.tracker) == (False, False, False)
        assert p.trk_heads is None and p.trk_out_ch is None and p.tracker_mlps() == []
        assert p.raw["neck_splits"] == "64,128,32" and p.raw["text_eps"] == "1e-5"


def test_kernels_contexts_and_streams(tmp_path):
    root = _full(tmp_path)
    with Bundle.open(root) as b:
        r = root.resolve()
        assert b.kernel_keys() == ["addln", "conv", "mha_d", "mha_win", "rope", "v_qkv"]
        assert b.kernel("v_qkv") == KernelSource("v_qkv", "gemm", r / "kernels/gemm.xclbin",
                                                 r / "kernels/v_qkv.insts.bin", "MLIR_AIE", 2 * 64 * 64 * 192)
        assert b.kernel("mha_d") == KernelSource("mha_d", "mha_d", r / "kernels/mha.xclbin",
                                                 r / "kernels/mha_d.insts.bin", "MHA2", 4 * 2 * 64 * 64 * 64)
        assert b.kernel("addln").ops == 0 and b.kernel("addln").ctx == "addln"
        assert b.insts_bytes("mha_d") == struct.pack("<2I", 0x06030100, 5)
        (root / "kernels" / "mha_d.insts.bin").write_bytes(b"changed")
        assert b.insts_bytes("mha_d") == struct.pack("<2I", 0x06030100, 5)  # read once, cached
        assert b.file_bytes(b.xclbins["gemm"].path) == b"xclbin bytes"
        assert b.file_bytes("kernels/gemm.xclbin") == b"xclbin bytes"
        with pytest.raises(BundleError, match="^no kernel nope$"):
            b.kernel("nope")
        with pytest.raises(BundleError, match="^kernel mha_d missing from the manifest$"):
            b.gemm("mha_d")
        with pytest.raises(BundleError, match="^no MHA v_qkv$"):
            b.mha("v_qkv")
        assert b.gemm("conv") is b.gemms["conv"] and b.mha("mha_d") is b.mhas["mha_d"]
        assert b.xclbin("gemm") is b.xclbins["gemm"]
        with pytest.raises(BundleError, match="^xclbin mha missing from the manifest$"):
            b.xclbin("mha")


def test_missing_stream_is_reported_at_use(tmp_path):
    root = _full(tmp_path)
    (root / "kernels" / "conv.insts.bin").unlink()
    with Bundle.open(root) as b:  # the manifest parse never opens kernel files
        with pytest.raises(BundleError, match="^kernels/conv.insts.bin: no such file$"):
            b.insts_bytes("conv")


# -------------------------------------------------------------------------------------------------------
# manifest.txt grammar (docs/sam3-bundle.md 2)
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, tag, fields", [
    ("gemm a b=c", "gemm", ("a", "b=c")),
    ("  gemm\ta  b ", "gemm", ("a", "b")),
    ("x a\u3000b\u2028c\u00a0d", "x", ("a", "b", "c", "d")),  # Unicode White_Space splits
    ("x a\x1fb", "x", ("a\x1fb",)),  # U+001F is not White_Space: Python's str.split would split here
    ("x a #b", "x", ("a", "#b")),  # a later '#' is an ordinary field
])
def test_record_fields(text, tag, fields):
    r = Record.parse(3, text)
    assert (r.tag, r.fields, r.line, r.text) == (tag, fields, 3, text)


@pytest.mark.parametrize("text", ["", "   ", "\t", "#x", "# x", "  #indented", "#"])
def test_blank_and_comment_lines_are_skipped(text):
    assert Record.parse(1, text) is None


def test_kv_fields():
    r = Record.parse(1, "gemm k=1 M=2 M=3 x=a=b =e")
    assert dict(r.kv) == {"k": "1", "M": "3", "x": "a=b", "": "e"}  # split at the first '=', last wins
    assert r.field(0) == "k=1" and r.has("x") and not r.has("y")
    assert r.str("x") == "a=b" and r.uint("M") == 3


@pytest.mark.parametrize("text, n, rest", [
    ("case 0 cases/cats.jpg Two  dogs, playing!", 2, "Two  dogs, playing!"),
    ("case 0 cases/cats.jpg Two  dogs, playing!", 0, "0 cases/cats.jpg Two  dogs, playing!"),
    ("param grid  72", 1, " 72"),  # exactly one leading space is removed
    ("param grid \t72", 1, "\t72"),  # only an ASCII space is removed
    ("param grid\t72", 1, "\t72"),  # the tab after `grid` is kept: only a space is stripped
    ("ref_prompt a b  ", 0, "a b  "),  # trailing whitespace stays
    ("pcase 3 img", 2, ""),
    ("pcase 3 img ", 2, ""),
    ("pcase 3 img   ", 2, "  "),
    ("x", 3, ""),
    ("  x   a", 0, "  a"),
])
def test_rest(text, n, rest):
    assert Record.parse(1, text).rest(n) == rest


@pytest.mark.parametrize("text, call, message", [
    ("gemm", lambda r: r.field(0), "expected at least 1 fields"),
    ("gemm a", lambda r: r.field(2), "expected at least 3 fields"),
    ("tok_test x p", lambda r: r.uint_field(0), "field 1 (x) is malformed"),
    ("gemm a", lambda r: r.str("M"), "`M=` missing"),
    ("gemm a M=-1", lambda r: r.uint("M"), "`M=-1` is malformed"),
    ("gemm a M=1_0", lambda r: r.uint("M"), "`M=1_0` is malformed"),
    ("gemm a M=\u0663", lambda r: r.uint("M"), "`M=\u0663` is malformed"),  # an Arabic-Indic digit
    ("gemm a M=18446744073709551616", lambda r: r.uint("M"), "`M=18446744073709551616` is malformed"),
    ("gemm a bias=2", lambda r: r.flag("bias"), "`bias=2` is not 0 or 1"),
    ("gemm a bias=", lambda r: r.flag("bias"), "`bias=` is not 0 or 1"),
])
def test_record_errors(text, call, message):
    with pytest.raises(BundleError) as e:
        call(Record.parse(12, text))
    assert str(e.value) == f"manifest.txt:12: {message}, in: {text}"


def test_uint_edges():
    r = Record.parse(1, "g a=+7 b=007 c=18446744073709551615 d=0000000000000000000000001 e=" + "9" * 5000)
    assert (r.uint("a"), r.uint("b"), r.uint("c"), r.uint("d")) == (7, 7, 2**64 - 1, 1)
    with pytest.raises(BundleError, match="is malformed"):  # never Python's int-digit-limit ValueError
        r.uint("e")


def test_crlf_and_line_numbers(tmp_path):
    root = write_hand_bundle(tmp_path / "b")
    text = (root / "manifest.txt").read_text().replace("\n", "\r\n")
    (root / "manifest.txt").write_bytes((text + "gemm g ctx=nope\r\n").encode())
    line = text.count("\r\n") + 1
    # The CR is stripped from the text the error quotes, and the line count is LF-based.
    assert _open_error(root) == f"manifest.txt:{line}: `insts=` missing, in: gemm g ctx=nope"


def test_manifest_not_utf8(tmp_path):
    root = write_hand_bundle(tmp_path / "b")
    (root / "manifest.txt").write_bytes(b"version 2\nparam x \xff\n")
    assert _open_error(root) == "manifest.txt: not UTF-8 text (byte 18: invalid start byte)"


# --- versions and the shared records ---------------------------------------------------------------


@pytest.mark.parametrize("version", ["1", "2", "+2", "02"])
def test_versions_1_and_2_open(tmp_path, version):
    with Bundle.open(write_hand_bundle(tmp_path / "b", version=version)) as b:
        assert b.version == int(version)


@pytest.mark.parametrize("version, found", [("3", "version 3"), ("0", "version 0"), (None, "no version record")])
def test_other_versions_report_the_version_2_attempt(tmp_path, version, found):
    root = write_hand_bundle(tmp_path / "b", version=version)
    assert _open_error(root) == (f"{root.resolve() / 'manifest.txt'}: {found}, this runtime reads version 2; "
                                 "re-export the bundle")


def test_version_errors(tmp_path):
    root = write_hand_bundle(tmp_path / "b", "version 2\n")
    assert _open_error(root) == f"manifest.txt:{len(PARAMS) + 3}: second version record, in: version 2"
    for text in ("version 4294967296", "version x", "version -1"):
        root = write_hand_bundle(tmp_path / text.replace(" ", "_"), version=None, params={})
        (root / "manifest.txt").write_text(text + "\n" + (root / "manifest.txt").read_text())
        assert _open_error(root) == f"manifest.txt:1: field 1 ({text.split()[1]}) is malformed, in: {text}"
    root = write_hand_bundle(tmp_path / "bare", version=None)
    (root / "manifest.txt").write_text("version\n")
    assert _open_error(root) == "manifest.txt:1: expected at least 1 fields, in: version"


def test_grammar_error_in_a_version_1_bundle(tmp_path):
    # The version is checked after the shared records: a v1 bundle's grammar error is reported as such.
    root = write_hand_bundle(tmp_path / "b", "param grid 9\n", version="1")
    assert _open_error(root) == f"manifest.txt:{len(PARAMS) + 3}: param grid defined twice, in: param grid 9"


@pytest.mark.parametrize("line, message", [
    ("param", "expected at least 1 fields"),
    ("param lonely", "expected at least 2 fields"),
    ("param lonely   ", "expected at least 2 fields"),
    ("param grid 9", "param grid defined twice"),
    ("xclbin", "expected at least 1 fields"),
    ("xclbin k", "expected at least 2 fields"),
    ("xclbin k f", "expected at least 3 fields"),
    ("xclbin gemm kernels/b.xclbin K", "xclbin gemm defined twice"),
])
def test_shared_record_errors(tmp_path, line, message):
    root = write_hand_bundle(tmp_path / "b", line + "\n")
    assert _open_error(root) == f"manifest.txt:{len(PARAMS) + 3}: {message}, in: {line}"


def test_xclbin_extra_fields_are_ignored(tmp_path):
    root = write_hand_bundle(tmp_path / "b", "xclbin other kernels/o.xclbin KERN extra fields\n")
    with Bundle.open(root) as b:
        assert b.xclbins["other"].kernel == "KERN"
        assert b.xclbins["other"].path == root.resolve() / "kernels/o.xclbin"


# --- model records (docs/sam3-bundle.md 4) ---------------------------------------------------------

GEMM = "gemm g ctx=gemm insts=k.bin M=8 K=8 N=8 lda=8 tile_k=8 tile_n=8 ct_k=8 bias=0 b_bytes=72"


@pytest.mark.parametrize("line, message", [
    ("gemm", "expected at least 1 fields"),
    (GEMM.replace(" ctx=gemm", ""), "`ctx=` missing"),
    (GEMM.replace(" insts=k.bin", ""), "`insts=` missing"),
    (GEMM.replace(" N=8", ""), "`N=` missing"),
    (GEMM.replace("lda=8", "lda=8.0"), "`lda=8.0` is malformed"),
    (GEMM.replace("K=8", "K=" + "1" * 40), "`K=" + "1" * 40 + "` is malformed"),
    (GEMM.replace("bias=0", "bias=yes"), "`bias=yes` is not 0 or 1"),
    (GEMM.replace(" b_bytes=72", ""), "`b_bytes=` missing"),
    (GEMM.replace("ctx=gemm", "ctx=nope"), "gemm g runs on unknown xclbin nope"),
    # Fields are read key, ctx, insts, M..ct_k, bias, b_bytes, then the ctx check: the first error wins.
    (GEMM.replace("ctx=gemm", "ctx=nope").replace("M=8", "M=x"), "`M=x` is malformed"),
    ("mha h xclbin=x.xclbin insts=i.bin heads=1 seq=1 d=1 elems=1", "`token_major=` missing"),
    ("mha h xclbin=x.xclbin insts=i.bin heads=1 seq=1 d=1 token_major=1", "`elems=` missing"),
    ("mha h insts=i.bin", "`xclbin=` missing"),
    ("op o xclbin=x.xclbin", "`insts=` missing"),
    ("op", "expected at least 1 fields"),
    ("tok_test x hello", "field 1 (x) is malformed"),
    ("tok_test", "expected at least 1 fields"),
    ("case 0 img.jpg", "expected at least 3 fields"),
    ("case x img.jpg a cat", "field 1 (x) is malformed"),
    ("pcase 0", "expected at least 2 fields"),
])
def test_model_record_errors(tmp_path, line, message):
    root = write_hand_bundle(tmp_path / "b", line + "\n")
    assert _open_error(root) == f"manifest.txt:{len(PARAMS) + 3}: {message}, in: {line}"


# Duplicate and cross-kind kernel keys open, with warnings: tests/test_bundle_parity.py.


def test_unknown_tags_are_ignored(tmp_path):
    with Bundle.open(write_hand_bundle(tmp_path / "b", "kernel k x=1\nfc1 q\nstep 3\n")) as b:
        assert [r.tag for r in b.records] == ["kernel", "fc1", "step"]
        assert b.gemms == {} and b.kernel_keys() == []


def test_later_ref_records_replace_earlier(tmp_path):
    body = "ref_image a.png\nref_image b.png\nref_prompt one\nref_prompt  two\n"
    with Bundle.open(write_hand_bundle(tmp_path / "b", body)) as b:
        assert b.ref_image == (tmp_path / "b").resolve() / "b.png"
        assert b.ref_prompt == " two"


@pytest.mark.parametrize("escaped, text", [
    ("\\t\\n\\r\\\\", "\t\n\r\\"),
    ("\\x41\\u00e9\\U0001F600", "Aé\U0001f600"),
    ("\\x4a\\x4A", "JJ"),
    ("\\q\\'", "\\q\\'"),  # any other escape stays as written
    ("end\\", "end\\"),  # a lone trailing backslash stays
    ("\\xZZc", "c"),  # bad hex: the escape and its two digits are dropped
    ("\\x4", "\x04"),  # fewer digits at the end: what is there is read
    ("\\x", ""),
    ("\\uD800x", "x"),  # a surrogate is not a character: dropped
    ("\\U00110000!", "!"),  # above U+10FFFF: dropped
    ("\\x+1", "\x01"),  # a leading '+' is accepted by the hex parse
    ("\\u12", "\u0012"),
    ("a\\\\tb", "a\\tb"),  # an escaped backslash, then a plain 't'
])
def test_unescape(escaped, text):
    assert unescape(escaped) == text


@pytest.mark.parametrize("text", ["a\tb", "é", "\U0001f600 x", "back\\slash", "new\nline", "'q'"])
def test_escape_round_trip(text):
    assert unescape(escape(text)) == text
    assert "\n" not in escape(text) and escape(text).isascii()


def test_case_prompt_is_not_unescaped(tmp_path):
    with Bundle.open(write_hand_bundle(tmp_path / "b", "case 0 a.jpg a\\tcat\n")) as b:
        assert b.cases[0].prompt == "a\\tcat"


# -------------------------------------------------------------------------------------------------------
# Params (docs/sam3-bundle.md 5)
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grid", "text_ffn", "pad", "vit_global", "neck_splits", "vit_eps", "text_eps"])
def test_required_param_missing(tmp_path, name):
    root = write_hand_bundle(tmp_path / "b", drop=(name,))
    assert _open_error(root) == f"manifest.txt: param {name} missing from the manifest"


@pytest.mark.parametrize("name, value, message", [
    ("grid", " 72", "param grid ( 72) is malformed"),  # `param grid  72`: rest(1) keeps one space
    ("grid", "7 2", "param grid (7 2) is malformed"),
    ("bos", "-1", "param bos (-1) is malformed"),
    ("queries", "9" * 30, f"param queries ({'9' * 30}) is malformed"),
    ("vit_eps", "1e", "param vit_eps (1e) is malformed"),
    ("vit_eps", "1_0", "param vit_eps (1_0) is malformed"),
    ("text_eps", " 1e-5", "param text_eps ( 1e-5) is malformed"),
    ("vit_global", "1, 2", "param vit_global: bad list item  2"),  # items are not trimmed
    ("neck_splits", "64;128", "param neck_splits: bad list item 64;128"),
    ("neck_splits", "1,x,", "param neck_splits: bad list item x"),
])
def test_param_malformed(tmp_path, name, value, message):
    root = write_hand_bundle(tmp_path / "b", params={name: value})
    line = f"param {name} {value}"
    assert _open_error(root) == f"manifest.txt:{_line_of(root, line)}: {message}, in: {line}"


@pytest.mark.parametrize("value, items", [("1,2,,3", [1, 2, 3]), (",", []), (",,5,", [5]), ("+3", [3])])
def test_list_params(tmp_path, value, items):
    with Bundle.open(write_hand_bundle(tmp_path / "b", params={"vit_global": value})) as b:
        assert b.params.vit_global == items
        assert b.params.raw["vit_global"] == value


@pytest.mark.parametrize("value, parsed", [
    ("1e-6", np.float32(1e-6)), (".5", 0.5), ("5.", 5.0), ("+2E3", 2000.0), ("-0.25", -0.25),
    ("inf", math.inf), ("Infinity", math.inf), ("1e39", math.inf),  # past float32: infinity, as parsed
])
def test_f32_params(tmp_path, value, parsed):
    with Bundle.open(write_hand_bundle(tmp_path / "b", params={"vit_eps": value})) as b:
        assert b.params.vit_eps == float(parsed)


def test_f32_nan(tmp_path):
    with Bundle.open(write_hand_bundle(tmp_path / "b", params={"text_eps": "NaN"})) as b:
        assert math.isnan(b.params.text_eps)


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("true", False), ("01", False), ("1 ", False)])
def test_flags_are_exactly_1(tmp_path, value, on):
    with Bundle.open(write_hand_bundle(tmp_path / "b", params={"vit_res_f32": value})) as b:
        assert b.params.vit_res_f32 is on


def test_tracker_params_required_only_with_tracker(tmp_path):
    # Without tracker=1 the tracker params are neither read nor required.
    with Bundle.open(write_hand_bundle(tmp_path / "off", params={"trk_heads": "x"})) as b:
        assert b.params.trk_heads is None
    params = dict(TRACKER)
    root = write_hand_bundle(tmp_path / "on", params=params, uploads=UPLOADS + TRACKER_UPLOADS)
    with Bundle.open(root) as b:
        p = b.params
        assert (p.trk_heads, p.trk_layers, p.trk_mask_tokens, p.trk_out_ch) == (2, 2, 2, [8, 16, 32])
        assert p.trk_stability_delta == float(np.float32(0.05))
        assert p.tracker_mlps() == ["trk.0.mlp", "trk.1.mlp", "trk.hyper0", "trk.hyper1", "trk.iou_head",
                                    "trk.obj_head"]
        assert p.depth("trk.hyper1") == 3
    for name in ("trk_heads", "trk_stability_thresh", "trk.1.mlp.depth", "trk.hyper1.depth", "trk.obj_head.depth"):
        root = write_hand_bundle(tmp_path / name, params=params, drop=(name,), uploads=UPLOADS + TRACKER_UPLOADS)
        assert _open_error(root) == f"manifest.txt: param {name} missing from the manifest"
    root = write_hand_bundle(tmp_path / "ch", params={**params, "trk_out_ch": "8,16"},
                             uploads=UPLOADS + TRACKER_UPLOADS)
    line = "param trk_out_ch 8,16"
    assert _open_error(root) == (f"manifest.txt:{_line_of(root, line)}: param trk_out_ch (8,16) has 2 items, "
                                 f"wanted 3, in: {line}")


# -------------------------------------------------------------------------------------------------------
# Upload tensors, vocab.json, merges.txt (docs/sam3-bundle.md 5, 7)
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params, uploads, missing", [
    ({}, [n for n in UPLOADS if n != "v.1.fc2"], "v.1.fc2"),
    ({}, [n for n in UPLOADS if n != "m.conv1"], "m.conv1"),
    ({"vit_device": "1"}, UPLOADS + ["v.rope_tab.win"], "v.rope_tab.glob"),
    ({**TRACKER}, UPLOADS + ["tn.in", "tn.up", "tn.conv0", "tn.conv2"], "tn.conv1"),
])
def test_upload_tensor_missing(tmp_path, params, uploads, missing):
    root = write_hand_bundle(tmp_path / "b", params=params, uploads=uploads)
    assert _open_error(root) == f"tensor {missing} missing from the bundle"


def test_upload_tensors_follow_the_layer_counts(tmp_path):
    # One ViT layer fewer: v.1.* are no longer required; vit_device with its tables opens.
    uploads = [n for n in UPLOADS if not n.startswith("v.1.")] + ROPE_TABS
    with Bundle.open(write_hand_bundle(tmp_path / "b", params={"vit_layers": "1", "vit_device": "1"},
                                       uploads=uploads)) as b:
        assert b.params.vit_device and "v.1.qkv" not in b.tensors


@pytest.mark.parametrize("vocab, detail", [
    ("[1, 2]", "a JSON list"),
    ('{"a": "1"}', "'a' maps to \"1\""),
    ('{"a": true}', "'a' maps to true"),
    ('{"a": 1.5}', "'a' maps to 1.5"),
    ('{"a": {"b": 1}}', "'a' maps to {\"b\": 1}"),
])
def test_vocab_not_flat(tmp_path, vocab, detail):
    root = write_hand_bundle(tmp_path / "b", vocab=vocab)
    assert _open_error(root) == f"vocab.json: not a flat {{string: int}} object ({detail})"


@pytest.mark.parametrize("vocab", ['{"a": 1', "", '{"a": ' + "9" * 5000 + "}", "[" * 100000 + "]" * 100000],
                         ids=["truncated", "empty", "huge-int", "deep-nesting"])
def test_vocab_unparsable(tmp_path, vocab):
    root = write_hand_bundle(tmp_path / "b", vocab=vocab)
    assert _open_error(root).startswith("vocab.json: not a flat {string: int} object (")


def test_merges(tmp_path):
    merges = "#version: 0.2\n\na b\r\n#versionx c\nt h e\n"
    with Bundle.open(write_hand_bundle(tmp_path / "ok", merges=merges)) as b:
        assert b.merges == [("a", "b"), ("t", "h e")]
    root = write_hand_bundle(tmp_path / "bad", merges="#version: 0.2\na b\nab\n")
    assert _open_error(root) == "merges.txt:3: ab"
    root = write_hand_bundle(tmp_path / "hash", merges="# a comment is not skipped\n#x\n")
    assert _open_error(root) == "merges.txt:2: #x"


# -------------------------------------------------------------------------------------------------------
# tensors.txt + tensors.bin (docs/sam3-bundle.md 6)
# -------------------------------------------------------------------------------------------------------


def _index_bundle(tmp_path: Path, extra: str, blob_size: int | None = None) -> Path:
    idx, data = _tensors(UPLOADS)
    text = "\n".join(idx) + "\n" + extra
    data = data if blob_size is None else data.ljust(blob_size, b"\0")
    return write_hand_bundle(tmp_path / "b", index=text, blob=data)


@pytest.mark.parametrize("line, message", [
    ("a f32 1 0", "expected <name> <dtype> <shape> <offset> <bytes>"),
    ("a f32 1 0 4 x", "expected <name> <dtype> <shape> <offset> <bytes>"),
    ("", "expected <name> <dtype> <shape> <offset> <bytes>"),  # no blank lines
    ("# a f32 1 0 4", "expected <name> <dtype> <shape> <offset> <bytes>"),  # no comments either
    ("a f64 1 0 8", "unknown dtype"),
    ("a F32 1 0 4", "unknown dtype"),
    ("a f32 1,,1 0 4", "bad shape"),
    ("a f32 , 0 4", "bad shape"),
    ("a f32 1,-1 0 4", "bad shape"),
    ("a f32 99999999999999999999 0 4", "bad shape"),
    ("a f32 " + ",".join(["1"] * 33) + " 0 4", "bad shape (more than 32 dimensions)"),
    ("a f32 1 x 4", "bad offset"),
    ("a f32 1 -8 4", "bad offset"),
    ("a f32 1 " + "8" * 30 + " 4", "bad offset"),
    ("a f32 1 0 4.0", "bad byte count"),
    ("a f32 1 4 4", "offset is not 8-byte aligned"),
    ("a f32 1 0 6", "byte count is not a whole number of elements"),
    ("a bf16 1 0 3", "byte count is not a whole number of elements"),
    ("v.embed u8 8 0 8", "tensor defined twice"),
])
def test_index_errors(tmp_path, line, message):
    # A shape that is not the byte count's opens, with a warning: tests/test_bundle_parity.py.
    root = _index_bundle(tmp_path, line + "\n")
    assert _open_error(root) == f"tensors.txt:{len(UPLOADS) + len(HOST) + 1}: {message}, in: {line}"


def test_tensor_past_the_end(tmp_path):
    idx, data = _tensors(UPLOADS)
    size = len(data)
    line = f"tail u8 16 {size - 8} 16"
    root = write_hand_bundle(tmp_path / "b", index="\n".join(idx) + "\n" + line + "\n", blob=data)
    assert _open_error(root) == (f"tensors.txt:{len(idx) + 1}: tensor tail runs past the end of tensors.bin "
                                 f"({size - 8} + 16 > {size} bytes), in: {line}")


def test_index_without_final_newline_and_empty_tensors(tmp_path):
    idx, data = _tensors(UPLOADS)
    text = "\n".join(idx + [f"empty f32 0 {len(data)} 0", "a\tf32  1 0\t4"])  # no final LF; tabs split
    with Bundle.open(write_hand_bundle(tmp_path / "b", index=text, blob=data)) as b:
        assert b.tensors.get("empty").shape == (0,)
        assert b.tensors.info("a") == TensorInfo("a", "f32", (1,), 0, 4, len(idx) + 2)


def test_views_are_typed_and_zero_copy(tmp_path):
    with Bundle.open(write_hand_bundle(tmp_path / "b")) as b:
        t = b.tensors
        pos, emb, perm, rgb = (t.get(n) for n in ("v.pos", "t.tok_emb", "v.perm", "ref.rgb"))
        assert pos.dtype == np.float32 and pos.shape == (2, 2) and pos.tolist() == [[1.0, 2.0], [3.0, -4.5]]
        assert emb.dtype == ml_dtypes.bfloat16 and emb.shape == (1, 2)
        assert emb.astype(np.float32).tolist() == [[1.0, -3.0]] and emb.view(np.uint16).tolist() == [[0x3F80, 0xC040]]
        assert perm.dtype == np.int32 and perm.tolist() == [3, 2, 1, -1]
        assert rgb.dtype == np.uint8 and rgb.shape == (1, 2, 3)
        whole = np.frombuffer(t.buffer, np.uint8)
        for view in (pos, emb, perm, rgb, t.raw("v.pos"), t.get("n.in")):
            assert np.shares_memory(view, whole)
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view.reshape(-1)[0] = 0
            base = view
            while isinstance(base, np.ndarray):
                base = base.base
            assert base.obj is t.buffer  # the mapping itself, through one memoryview
        assert type(t.buffer).__name__ == "mmap"
        info = t.info("v.perm")
        assert t.raw("v.perm").tobytes() == struct.pack("<4i", 3, 2, 1, -1)
        assert (info.dtype, info.shape, info.count, info.nbytes, info.offset % 64) == ("i32", (4,), 4, 16, 0)
        assert t.names()[:2] == ["v.embed", "n.in"] and len(t) == len(UPLOADS) + len(HOST)
        assert t.get("v.pos", "f32").sum() == 1.5 and t.expect("v.perm", "i32", 4).tolist() == [3, 2, 1, -1]


@pytest.mark.parametrize("call, message", [
    (lambda t: t.get("nope"), "tensor nope missing from the bundle"),
    (lambda t: t.info("nope"), "tensor nope missing from the bundle"),
    (lambda t: t.raw("nope"), "tensor nope missing from the bundle"),
    (lambda t: t.get("v.pos", "bf16"), "tensor v.pos is F32, wanted Bf16"),
    (lambda t: t.get("t.tok_emb", "u8"), "tensor t.tok_emb is Bf16, wanted U8"),
    (lambda t: t.get("ref.rgb", "i32"), "tensor ref.rgb is U8, wanted I32"),
    (lambda t: t.get("v.perm", "f32"), "tensor v.perm is I32, wanted F32"),
    (lambda t: t.expect("v.pos", "f32", 5), "tensor v.pos is 4 x F32, wanted 5 x F32"),
    (lambda t: t.expect("v.pos", "i32", 4), "tensor v.pos is 4 x F32, wanted 4 x I32"),
    (lambda t: t.get("v.pos", "f64"), "unknown dtype 'f64' (one of f32, bf16, u8, i32)"),
])
def test_lookup_errors(tmp_path, call, message):
    with Bundle.open(write_hand_bundle(tmp_path / "b")) as b:
        with pytest.raises(BundleError) as e:
            call(b.tensors)
        assert str(e.value) == message


def test_views_outlive_close(tmp_path):
    b = Bundle.open(write_hand_bundle(tmp_path / "b"))
    pos = b.tensors.get("v.pos")
    b.close()
    b.close()  # idempotent
    assert pos.tolist() == [[1.0, 2.0], [3.0, -4.5]]  # the mapping lives while a view does
    with pytest.raises(BundleError, match="^tensors.bin: the bundle is closed$"):
        b.tensors.get("v.pos")
    with pytest.raises(BundleError, match="the bundle is closed"):
        b.file_bytes("kernels/gemm.xclbin")


def test_empty_blob(tmp_path):
    index = "\n".join(f"{n} u8 0 0 0" for n in UPLOADS) + "\n"
    with Bundle.open(write_hand_bundle(tmp_path / "b", index=index, blob=b"")) as b:
        assert b.tensors.get("v.embed").shape == (0,)


def test_large_bundle_maps_without_heap(tmp_path):
    """A 256 MiB tensors.bin (sparse) opens with a heap peak far below its size, and views read through."""
    size = 256 << 20
    idx, data = _tensors(UPLOADS)
    big = f"big f32 {size // 4 // 1024},1024 {len(data)} {size}"
    root = write_hand_bundle(tmp_path / "b", index="\n".join(idx) + "\n" + big + "\n", blob=data)
    with open(root / "tensors.bin", "r+b") as f:
        f.truncate(len(data) + size)
        f.seek(len(data) + size - 4)
        f.write(struct.pack("<f", 7.5))
    tracemalloc.start()
    try:
        with Bundle.open(root) as b:
            view = b.tensors.get("big")
            last = float(view[-1, -1])
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert view.shape == (size // 4096, 1024) and last == 7.5
    assert peak < 4 << 20, f"heap peak {peak} bytes opening a {size}-byte bundle"


# -------------------------------------------------------------------------------------------------------
# Paths and files (docs/sam3-bundle.md 8)
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line, what, path, reason", [
    ("op o xclbin=/etc/passwd insts=i.bin", "xclbin", "/etc/passwd", "is absolute"),
    ("op o xclbin=x.xclbin insts=../outside.bin", "insts", "../outside.bin", "escapes the bundle directory"),
    ("op o xclbin=x.xclbin insts=kernels/../../o.bin", "insts", "kernels/../../o.bin", "escapes the bundle directory"),
    ("xclbin up ../up.xclbin K", "xclbin", "../up.xclbin", "escapes the bundle directory"),
    ("case 0 /tmp/cats.jpg a cat", "case image", "/tmp/cats.jpg", "is absolute"),
    ("pcase 0 ../car.png", "pcase image", "../car.png", "escapes the bundle directory"),
    ("ref_image ../ref.png", "ref_image", "../ref.png", "escapes the bundle directory"),
    ("ref_image", "ref_image", "", "is empty"),
    (GEMM.replace("insts=k.bin", "insts=/k.bin"), "insts", "/k.bin", "is absolute"),
])
def test_manifest_paths_refused(tmp_path, line, what, path, reason):
    root = write_hand_bundle(tmp_path / "b", line + "\n")
    assert _open_error(root) == f"manifest.txt:{len(PARAMS) + 3}: {what} path {path!r} {reason}, in: {line}"


def test_paths_that_stay_inside_are_accepted(tmp_path):
    root = write_hand_bundle(tmp_path / "b", "op o xclbin=kernels/../kernels/gemm.xclbin insts=./kernels/o.bin\n")
    (root / "kernels" / "o.bin").write_bytes(b"\1\0\0\0")
    with Bundle.open(root) as b:
        assert b.ops["o"].xclbin == root.resolve() / "kernels/gemm.xclbin"
        assert b.insts_bytes("o") == b"\1\0\0\0"


def test_file_link_out_of_the_bundle_is_read_a_directory_link_out_refused(tmp_path):
    """A link to a regular file is followed wherever it points, as the reference reads (a hub snapshot's files
    link into ../../blobs); the directories of a manifest path must stay inside the bundle."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret")
    root = write_hand_bundle(tmp_path / "b", "op o xclbin=kernels/gemm.xclbin insts=kernels/o.bin\n")
    os.symlink(secret, root / "kernels" / "o.bin")
    with Bundle.open(root) as b:
        assert b.insts_bytes("o") == b"secret"
        assert b.ops["o"].insts == root.resolve() / "kernels/o.bin"  # the path as written, not the link's target
    (root / "kernels" / "o.bin").unlink()
    os.symlink(tmp_path, root / "up")
    (root / "manifest.txt").write_text((root / "manifest.txt").read_text().replace("kernels/o.bin", "up/secret.bin"))
    line = "op o xclbin=kernels/gemm.xclbin insts=up/secret.bin"
    assert _open_error(root) == (f"manifest.txt:{len(PARAMS) + 3}: insts path 'up/secret.bin' passes through a "
                                 f"symbolic link to a directory outside the bundle ({tmp_path.resolve()}), in: {line}")


def test_symlink_inside_the_bundle_is_followed(tmp_path):
    root = write_hand_bundle(tmp_path / "b", "op o xclbin=kernels/gemm.xclbin insts=kernels/link.bin\n")
    (root / "kernels" / "real.bin").write_bytes(b"real")
    os.symlink("real.bin", root / "kernels" / "link.bin")
    with Bundle.open(root) as b:
        assert b.insts_bytes("o") == b"real"


def test_file_swapped_for_a_symlink_after_open(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret")
    root = write_hand_bundle(tmp_path / "b", "op o xclbin=kernels/gemm.xclbin insts=kernels/o.bin\n"
                             "op p xclbin=kernels/gemm.xclbin insts=kernels/sub/p.bin\n")
    (root / "kernels" / "o.bin").write_bytes(b"mine")
    (root / "kernels" / "sub").mkdir()
    (root / "kernels" / "sub" / "p.bin").write_bytes(b"mine too")
    with Bundle.open(root) as b:
        # The race: a file recorded when the bundle was opened, then swapped for a link (to a regular file
        # elsewhere) before the read. The open follows the link but finds another file, and refuses it.
        (root / "kernels" / "o.bin").unlink()
        os.symlink(secret, root / "kernels" / "o.bin")
        swapped = "kernels/o.bin: was replaced after the bundle was opened (another file is there now)"
        with pytest.raises(BundleError) as e:
            b._dir.read(("kernels", "o.bin"), "kernels/o.bin", 1 << 20)
        assert str(e.value) == swapped
        with pytest.raises(BundleError) as e:
            b.insts_bytes("o")
        assert str(e.value) == swapped
        # A directory component swapped for a link is not followed either.
        os.rename(root / "kernels" / "sub", tmp_path / "sub")
        os.symlink(tmp_path / "sub", root / "kernels" / "sub")
        with pytest.raises(BundleError) as e:
            b._dir.read(("kernels", "sub", "p.bin"), "kernels/sub/p.bin", 1 << 20)
        assert str(e.value).startswith("kernels/sub/p.bin: ") and "symbolic link" in str(e.value)


def test_top_level_files_must_be_regular(tmp_path):
    root = write_hand_bundle(tmp_path / "fifo", "op o xclbin=kernels/gemm.xclbin insts=kernels/fifo\n")
    os.mkfifo(root / "kernels" / "fifo")
    with Bundle.open(root) as b:  # opened non-blocking: no hang waiting for a writer
        with pytest.raises(BundleError, match=r"^kernels/fifo: is not a regular file \(a FIFO\)$"):
            b.insts_bytes("o")
    root = write_hand_bundle(tmp_path / "dir")
    (root / "tensors.bin").unlink()
    (root / "tensors.bin").mkdir()
    assert _open_error(root) == "tensors.bin: is not a regular file (a directory)"
    root = write_hand_bundle(tmp_path / "dev")
    (root / "vocab.json").unlink()
    os.symlink("/dev/null", root / "vocab.json")
    assert _open_error(root) == ("vocab.json: is a symbolic link to /dev/null, which is not a regular file "
                                 "(a character device)")
    root = write_hand_bundle(tmp_path / "missing")
    (root / "manifest.txt").unlink()
    assert _open_error(root) == "manifest.txt: no such file"
    assert _open_error(tmp_path / "nowhere").startswith(f"{tmp_path / 'nowhere'}: cannot open the bundle directory")


def test_in_bundle_symlinked_top_level_file(tmp_path):
    root = write_hand_bundle(tmp_path / "b")
    os.rename(root / "merges.txt", root / "merges.real")
    os.symlink("merges.real", root / "merges.txt")
    with Bundle.open(root) as b:
        assert b.merges == [("a", "b</w>")]


def test_size_limits(tmp_path, monkeypatch):
    root = write_hand_bundle(tmp_path / "b")
    size = (root / "manifest.txt").stat().st_size
    monkeypatch.setattr(bundle_mod, "TEXT_LIMIT", size - 1)
    assert _open_error(root) == f"manifest.txt: {size} bytes, over the {size - 1}-byte limit"
    monkeypatch.setattr(bundle_mod, "TEXT_LIMIT", 64 << 20)
    big = write_hand_bundle(tmp_path / "big", merges="#version: 0.2\n" + "a b\n" * ((64 << 20) // 4 + 1))
    assert _open_error(big) == f"merges.txt: {(big / 'merges.txt').stat().st_size} bytes, over the 64 MiB limit"
    (big / "merges.txt").write_text("a b\n")
    with Bundle.open(big) as b:
        with pytest.raises(BundleError, match="^kernels/gemm.xclbin: 12 bytes, over the 8-byte limit$"):
            b.file_bytes("kernels/gemm.xclbin", limit=8)


# -------------------------------------------------------------------------------------------------------
# The writer (docs/sam3-bundle.md 10)
# -------------------------------------------------------------------------------------------------------


def _write_full(root: Path) -> None:
    with BundleWriter(root) as w:
        w.comment("written by the test")
        for k, v in PARAMS.items():
            if k not in ("vit_global", "text_eps"):
                w.param(k, v)
        w.param("vit_device", True)
        w.param("note", "two  words")
        w.param("vit_global", [1, 3])
        w.param("text_eps", 1e-5)
        w.xclbin("gemm", "kernels/gemm.xclbin", "MLIR_AIE")
        w.record("gemm", "v_qkv", ctx="gemm", insts="kernels/v_qkv.insts.bin", M=64, K=64, N=192, lda=64, tile_k=64,
                 tile_n=8, ct_k=8, bias=True, b_bytes=15552)
        w.record("op", "rope", xclbin="kernels/rope.xclbin", insts="kernels/rope.insts.bin", name="ROPE")
        w.record("tok_test", 3, escape("a\tb é\\"))
        w.record("case", 0, "cases/cats.jpg", "two  cats ")
        w.record("ref_prompt", "")
        for i, name in enumerate(UPLOADS + ROPE_TABS):
            w.raw_tensor(name, bytes([i]) * (i + 1))
        w.tensor("f", np.arange(6, dtype=np.float32).reshape(2, 3))
        w.tensor("fbig", np.arange(3, dtype=">f4"))
        w.tensor("bf", np.array([1.0, -3.0], dtype=ml_dtypes.bfloat16))
        w.tensor("bits", np.array([[0x3F80], [0x4000]], dtype=np.uint16), dtype="bf16")
        w.tensor("i", np.array([-1, 2], dtype=np.int32), dtype="i32")
        w.tensor("u", np.arange(5, dtype=np.uint8)[::2])  # not contiguous
        w.raw_tensor("raw", np.arange(3, dtype=np.uint8))
        w.file("kernels/v_qkv.insts.bin", b"\0" * 8)
        w.file("vocab.json", b'{"a": 1}')
        w.file("merges.txt", b"#version: 0.2\n")


def test_writer_round_trip(tmp_path):
    root = tmp_path / "w"
    _write_full(root)
    lines = (root / "manifest.txt").read_text().split("\n")
    assert lines[:3] == ["version 2", "# written by the test", "param grid 8"]
    assert "param vit_device 1" in lines and "param vit_global 1,3" in lines and "param text_eps 1e-05" in lines
    assert ("gemm v_qkv ctx=gemm insts=kernels/v_qkv.insts.bin M=64 K=64 N=192 lda=64 tile_k=64 tile_n=8 ct_k=8 "
            "bias=1 b_bytes=15552") in lines
    assert "tok_test 3 a\\tb \\xe9\\\\" in lines and lines[-1] == ""
    index = (root / "tensors.txt").read_text().split("\n")
    assert index[0] == "v.embed u8 1 0 1" and index[1] == "n.in u8 2 64 2"
    with Bundle.open(root) as b:
        assert b.version == 2 and b.params.vit_device and b.params.vit_global == [1, 3]
        assert b.params.raw["note"] == "two  words" and b.params.text_eps == float(np.float32(1e-5))
        assert b.gemms["v_qkv"].b_bytes == 15552 and b.gemms["v_qkv"].bias is True and b.ops["rope"].name == "ROPE"
        assert b.tok_tests[0].prompt == "a\tb é\\"
        assert b.cases[0].prompt == "two  cats " and b.ref_prompt == ""
        t = b.tensors
        assert all(info.offset % 64 == 0 for info in t)
        assert t.get("f").tolist() == [[0, 1, 2], [3, 4, 5]] and t.get("fbig").tolist() == [0, 1, 2]
        assert t.get("bf").astype(np.float32).tolist() == [1.0, -3.0]
        assert t.get("bits").shape == (2, 1) and t.get("bits").astype(np.float32).tolist() == [[1.0], [2.0]]
        assert t.get("i").tolist() == [-1, 2] and t.get("u").tolist() == [0, 2, 4]
        assert t.get("raw").tolist() == [0, 1, 2]
        assert t.raw("v.rope_tab.glob").tobytes() == bytes([22]) * 23
        assert b.insts_bytes("v_qkv") == b"\0" * 8


@pytest.mark.parametrize("call, exc, message", [
    (lambda w: w.tensor("x", np.zeros(2)), BundleError, "tensor x: unknown dtype float64 (write f32, bf16, u8 or i32)"),
    (lambda w: w.tensor("x", np.zeros(2, np.int64)), BundleError, "tensor x: unknown dtype int64"),
    (lambda w: w.tensor("x", np.zeros(2, np.float32), dtype="f16"), BundleError, "tensor x: unknown dtype 'f16'"),
    (lambda w: w.tensor("x", np.zeros(2, np.float32), dtype="bf16"), BundleError,
     "tensor x: array is float32, wanted bf16 (convert it first)"),
    (lambda w: w.tensor("x", np.float32(1)), BundleError, "tensor x: a 0-d array"),
    (lambda w: w.tensor("a b", np.zeros(1, np.uint8)), BundleError, "tensor name 'a b': a manifest token"),
    (lambda w: w.raw_tensor("x", np.zeros(2, np.int8)), BundleError, "tensor x: raw bytes must be uint8, not int8"),
    (lambda w: (w.raw_tensor("x", b"1"), w.raw_tensor("x", b"2")), BundleError, "tensor x written twice"),
    (lambda w: (w.param("p", 1), w.param("p", 2)), BundleError, "param p defined twice"),
    (lambda w: w.param("p", "a\nb"), BundleError, "param p 'a\\nb': a manifest line cannot hold a line break"),
    (lambda w: w.param("p", None), TypeError, "param p: NoneType is not a manifest value"),
    (lambda w: w.param("p", [1, "a b"]), BundleError, "param p item 'a b'"),
    (lambda w: (w.xclbin("k", "a", "K"), w.xclbin("k", "b", "K")), BundleError, "xclbin k defined twice"),
    (lambda w: w.xclbin("k", "a b", "K"), BundleError, "xclbin path 'a b'"),
    (lambda w: w.record("param", "x", 1), BundleError, "record tag 'param': write it with the writer's own method"),
    (lambda w: w.record("gemm", "g", M="1 2"), BundleError, "gemm M= '1 2'"),
    (lambda w: w.record("case", 0, "a b.jpg", "p"), BundleError, "case field 'a b.jpg'"),
    (lambda w: w.comment("a\rb"), BundleError, "comment 'a\\rb'"),
    (lambda w: w.file("../x", b""), BundleError, "file '../x': not a path inside the bundle"),
    (lambda w: w.file("/x", b""), BundleError, "file '/x': not a path inside the bundle"),
    (lambda w: w.file("manifest.txt", b""), BundleError, "file 'manifest.txt': written twice, or a name the writer"),
    (lambda w: (w.file("a/b", b""), w.file("a/./b", b"")), BundleError, "file 'a/./b': written twice"),
])
def test_writer_errors(tmp_path, call, exc, message):
    w = BundleWriter(tmp_path / "w")
    with pytest.raises(exc) as e:
        call(w)
    assert str(e.value).startswith(message)
    w.abort()


def test_writer_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(BundleError, match="the bundle directory must not exist or be empty"):
        BundleWriter(tmp_path / "full")
    (tmp_path / "file").write_text("x")
    with pytest.raises(BundleError, match="the bundle directory must not exist or be empty"):
        BundleWriter(tmp_path / "file")
    with pytest.raises(BundleError, match="^version 3: this runtime reads versions 2, 1$"):
        BundleWriter(tmp_path / "v3", version=3)
    (tmp_path / "empty").mkdir()
    BundleWriter(tmp_path / "empty", version=1).close()
    assert (tmp_path / "empty" / "manifest.txt").read_text() == "version 1\n"


def test_failed_write_leaves_no_bundle(tmp_path):
    root = tmp_path / "w"
    with pytest.raises(RuntimeError):
        with BundleWriter(root) as w:
            for k, v in PARAMS.items():
                w.param(k, v)
            w.raw_tensor("v.embed", b"123")
            raise RuntimeError("exporter crashed")
    assert not (root / "manifest.txt").exists() and (root / "tensors.bin").exists()
    assert _open_error(root) == "manifest.txt: no such file"
    with pytest.raises(BundleError, match="the writer is closed"):
        w.param("late", 1)


def test_writer_close_is_idempotent_and_closes(tmp_path):
    w = BundleWriter(tmp_path / "w")
    assert w.close() == tmp_path / "w" and w.close() == tmp_path / "w"
    with pytest.raises(BundleError, match="the writer is closed"):
        w.raw_tensor("x", b"")
    assert (tmp_path / "w" / "tensors.txt").read_text() == ""
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["manifest.txt", "tensors.bin", "tensors.txt"]


# -------------------------------------------------------------------------------------------------------
# summarize / format_summary (docs/sam3-bundle.md 11), on a bundle written by hand
# -------------------------------------------------------------------------------------------------------

SUMMARY_BODY = """\
xclbin spare kernels/spare.xclbin SPARE
gemm v_qkv ctx=gemm insts=kernels/v_qkv.insts.bin M=64 K=8 N=16 lda=8 tile_k=8 tile_n=8 ct_k=8 bias=1 b_bytes=36
gemm n_in ctx=gemm insts=kernels/n_in.insts.bin M=8 K=8 N=8 lda=8 tile_k=8 tile_n=8 ct_k=8 bias=0 b_bytes=8
mha mha_d xclbin=kernels/gemm.xclbin insts=kernels/mha_d.insts.bin heads=2 seq=4 d=8 token_major=1 elems=64
op addln xclbin=kernels/addln.xclbin insts=kernels/addln.insts.bin name=ADDLN
case 0 cases/none.jpg a cat
"""


def test_summarize_hand_bundle(tmp_path):
    root = tmp_path / "s"
    index = "\n".join([
        "v.embed u8 8 0 8", "n.in u8 8 64 8", "n.up u8 8 128 8", "dec.kv u8 8 192 8",
        "v.0.qkv u8 36 256 36", "v.0.o u8 8 320 8", "v.0.fc1 u8 8 384 8", "v.0.fc2 u8 8 448 8",
        "v.1.qkv u8 40 512 40", "v.1.o u8 8 576 8", "v.1.fc1 u8 8 640 8", "v.1.fc2 u8 8 704 8",
        "d.0.qkv u8 8 768 8", "d.0.o u8 8 832 8", "d.0.fc1 u8 8 896 8", "d.0.fc2 u8 8 960 8",
        "n.conv0 u8 8 1024 8", "n.conv1 u8 8 1088 8", "n.conv2 u8 8 1152 8", "m.conv0 u8 8 1216 8",
        "m.conv1 u8 8 1280 8", "v.pos f32 2,2 1288 16", "t.tok_emb bf16 3 1296 6",
    ]) + "\n"
    write_hand_bundle(root, SUMMARY_BODY, params={"tracker": "yes"}, index=index, blob=bytes(1344))
    (root / "kernels" / "v_qkv.insts.bin").write_bytes(b"\0" * 4)
    (root / "kernels" / "mha_d.insts.bin").write_bytes(b"\0" * 4)
    os.mkfifo(root / "kernels" / "addln.insts.bin")
    with Bundle.open(root) as b:
        s = summarize(b)
    line = {rec.split()[1]: _line_of(root, rec) for rec in SUMMARY_BODY.splitlines()}
    line["gemm"] = _line_of(root, "xclbin gemm kernels/gemm.xclbin MLIR_AIE")
    assert json.loads(json.dumps(s)) == s  # JSON-ready
    assert s["root"] == str(root.resolve()) and s["version"] == 2
    assert s["params"] == {**PARAMS, "tracker": "yes"} and list(s["params"])[0] == "grid"
    assert s["xclbins"] == [
        {"key": "gemm", "path": "kernels/gemm.xclbin", "kernel": "MLIR_AIE", "line": line["gemm"],
         "kernels": ["mha_d", "n_in", "v_qkv"]},
        {"key": "spare", "path": "kernels/spare.xclbin", "kernel": "SPARE", "line": line["spare"], "kernels": []},
    ]
    # Kernels with equal (xclbin path, kernel name) share a context: mha_d runs on the GEMMs' xclbin.
    assert s["contexts"] == [
        {"xclbin": "kernels/addln.xclbin", "kernel": "ADDLN", "kernels": ["addln"]},
        {"xclbin": "kernels/gemm.xclbin", "kernel": "MLIR_AIE", "kernels": ["mha_d", "n_in", "v_qkv"]},
    ]
    assert s["gemms"] == [
        {"key": "v_qkv", "ctx": "gemm", "insts": "kernels/v_qkv.insts.bin", "M": 64, "K": 8, "N": 16, "lda": 8,
         "tile_k": 8, "tile_n": 8, "ct_k": 8, "bias": True, "b_bytes": 36, "line": line["v_qkv"]},
        {"key": "n_in", "ctx": "gemm", "insts": "kernels/n_in.insts.bin", "M": 8, "K": 8, "N": 8, "lda": 8,
         "tile_k": 8, "tile_n": 8, "ct_k": 8, "bias": False, "b_bytes": 8, "line": line["n_in"]},
    ]
    assert s["mhas"] == [{"key": "mha_d", "xclbin": "kernels/gemm.xclbin", "insts": "kernels/mha_d.insts.bin",
                          "name": "MLIR_AIE", "heads": 2, "seq": 4, "d": 8, "token_major": True, "elems": 64,
                          "line": line["mha_d"]}]
    assert s["ops"] == [{"key": "addln", "xclbin": "kernels/addln.xclbin", "insts": "kernels/addln.insts.bin",
                         "name": "ADDLN", "line": line["addln"]}]
    t = s["tensors"]
    assert t["count"] == 23 and t["bytes"] == 8 * 19 + 36 + 40 + 16 + 6
    assert t["by_dtype"] == {"u8": {"count": 21, "bytes": 8 * 19 + 36 + 40}, "f32": {"count": 1, "bytes": 16},
                             "bf16": {"count": 1, "bytes": 6}}
    assert t["items"][4] == {"name": "v.0.qkv", "dtype": "u8", "shape": [36], "bytes": 36, "offset": 256}
    assert t["items"][-1] == {"name": "t.tok_emb", "dtype": "bf16", "shape": [3], "bytes": 6, "offset": 1296}
    # By hand: v_qkv b_bytes = 9*16*(8+8)/8 = 288, not 36; n_in = 9*8*8/8 = 72, not 8. v.0.qkv is 36 bytes
    # (equal to the manifest's b_bytes), v.1.qkv 40; n.in 8 = n_in's b_bytes.
    missing = ["v_embed", "v_o", "v_fc1", "v_fc2", "n_up", "conv", "d_qkv", "d_o", "d_s", "d_c", "d_fc1", "d_fc2",
               "dec_kv", "m_head", "mha_win", "mha_glob"]
    expected = [
        "xclbin spare: kernels/spare.xclbin: no such file",
        "xclbin spare (kernels/spare.xclbin) is used by no kernel",
        "gemm v_qkv: b_bytes=36, but 9*N*(K+ct_k*bias)/8 = 288",
        "gemm n_in insts: kernels/n_in.insts.bin: no such file",
        "gemm n_in: b_bytes=8, but 9*N*(K+ct_k*bias)/8 = 72",
        "op addln xclbin: kernels/addln.xclbin: no such file",
        "op addln insts: kernels/addln.insts.bin: is not a regular file (a FIFO)",
        *[f"kernel {k} missing from the manifest" for k in missing],
        "param tracker (yes) is not 0 or 1: read as off",
        "tensor v.1.qkv is 40 bytes, gemm v_qkv b_bytes=36",
        "tensor v.pos: offset 1288 is not 64-byte aligned",
        "tensor t.tok_emb: offset 1296 is not 64-byte aligned",
        "tensor t.tok_emb overlaps tensor v.pos in tensors.bin",
        f"case 0 image (line {line['0']}): cases/none.jpg: no such file",
        # The consistency rules of docs/sam3-bundle.md 12, by hand: vit_dim 64, neck_splits 64+128+32, T = 8^2.
        f"manifest.txt:{line['v_qkv']}: gemm v_qkv: K=8, the params need vit_dim = 64",
        f"manifest.txt:{line['v_qkv']}: gemm v_qkv: N=16, the params need 3 * vit_dim = 192",
        f"manifest.txt:{line['n_in']}: gemm n_in: K=8, the params need vit_dim = 64",
        f"manifest.txt:{line['n_in']}: gemm n_in: N=8, the params need s0 + s1 + s2 = 224",
        f"manifest.txt:{line['mha_d']}: mha mha_d: heads=2 seq=4 d=8 token_major=1, the params need heads=2 seq=64 "
        "d>=16 token_major=1",
    ]
    assert sorted(s["problems"]) == sorted(expected)

    text = format_summary(s)
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == 1 + len(PARAMS) + 1 + 2 + 2 + 2 + 1 + 1 + 23 + 3 + 1 + len(expected)
    assert lines[0].split() == ["bundle", str(root.resolve()), "version", "2"]
    params = [ln for ln in lines if ln.startswith("param ")]
    assert params[0].split() == ["param", "grid", "8"] and params[-1].split() == ["param", "tracker", "yes"]
    assert len({ln.index(ln.split()[2]) for ln in params}) == 1  # the value column is aligned
    assert "xclbin   spare  kernels/spare.xclbin  SPARE     (unused)" in lines
    gemm = next(ln for ln in lines if ln.startswith("gemm     v_qkv"))
    assert gemm.split()[2:] == ["ctx=gemm", "M=64", "K=8", "N=16", "lda=8", "tile_k=8", "tile_n=8", "ct_k=8", "bias=1",
                                "b_bytes=36", "kernels/v_qkv.insts.bin"]
    assert next(ln for ln in lines if " v.pos " in ln).split() == ["tensor", "v.pos", "f32", "2x2", "16", "bytes"]
    assert lines[-len(expected) - 1].split() == ["tensors", "all", "23", "tensors", str(t["bytes"]), "bytes"]
    assert all(ln.startswith("problem  ") for ln in lines[-len(expected):])


def test_summary_without_problems_says_so():
    s = {"root": "/b", "version": 1, "params": {}, "xclbins": [], "contexts": [], "gemms": [], "mhas": [], "ops": [],
         "tensors": {"count": 0, "bytes": 0, "by_dtype": {}, "items": []}, "problems": []}
    assert format_summary(s).splitlines() == ["bundle    /b  version 1", "tensors   all  0 tensors  0 bytes",
                                              "problems  none"]


def test_file_bytes_outside_the_bundle(tmp_path):
    (tmp_path / "other.bin").write_bytes(b"x")
    with Bundle.open(write_hand_bundle(tmp_path / "b")) as b:
        with pytest.raises(BundleError, match="not a path inside the bundle"):
            b.file_bytes(tmp_path / "other.bin")
        with pytest.raises(BundleError, match=r"^\.\./other\.bin: the path escapes the bundle directory$"):
            b.file_bytes("../other.bin")
        assert b.file_problem(tmp_path / "other.bin").endswith(f"not a path inside the bundle {b.root}")
        assert b.file_problem("kernels/gemm.xclbin") is None
        assert b.file_problem("kernels") == "kernels: is not a regular file (a directory)"


def test_huge_layer_counts_fail_at_the_first_missing_name(tmp_path):
    root = write_hand_bundle(tmp_path / "vit", params={"vit_layers": str(10**18)})
    assert _open_error(root) == "tensor v.2.qkv missing from the bundle"
    root = write_hand_bundle(tmp_path / "trk", params={**TRACKER, "trk_layers": str(2**64 - 1)},
                             uploads=UPLOADS + TRACKER_UPLOADS)
    assert _open_error(root) == "manifest.txt: param trk.2.mlp.depth missing from the manifest"


# -------------------------------------------------------------------------------------------------------
# The package (sam3/bundle/): every public name of the former module, from the module that owns it
# -------------------------------------------------------------------------------------------------------

# The public names sam3/bundle.py had (read from its last version), which sam3.bundle keeps.
PUBLIC = """BLOB Bundle BundleError BundleWriter Case DEFAULT_KERNEL_NAME DTYPES DTYPE_NAMES F32_PARAMS FILE_LIMIT
FLAG_PARAMS GEMM_KEYS GemmSpec INDEX KernelSource LIST_PARAMS MANIFEST MERGES MHA_KEYS MhaSpec OP_KEYS OpSpec Params
READ_ALIGN Record TEXT_LIMIT TRACKER_F32_PARAMS TRACKER_LIST_PARAMS TRACKER_USIZE_PARAMS TensorInfo TensorStore
TokTest USIZE_PARAMS VERSION VERSIONS VOCAB WRITE_ALIGN XclbinRecord escape format_summary packed_tensors parse_f32
parse_index parse_merges parse_uint parse_vocab split_fields summarize unescape upload_tensors""".split()


def test_the_package_keeps_every_public_name():
    import importlib

    import sam3.bundle as pkg

    assert hasattr(pkg, "__path__"), "sam3.bundle is a package"
    subs = [importlib.import_module(f"sam3.bundle.{m}") for m in ("manifest", "tensors", "reader", "writer", "summary")]
    assert sorted(pkg.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        owners = [m for m in subs if name in vars(m)]
        assert owners and all(getattr(m, name) is getattr(pkg, name) for m in owners), name
    assert pkg.Bundle.__module__ == "sam3.bundle.reader" and pkg.BundleWriter.__module__ == "sam3.bundle.writer"
    assert pkg.summarize.__module__ == "sam3.bundle.summary" and pkg.TensorStore.__module__ == "sam3.bundle.tensors"
    assert pkg.Record.__module__ == "sam3.bundle.manifest"
