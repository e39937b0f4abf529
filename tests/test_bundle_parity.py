"""Reader parity with taconite-sam3 (docs/sam3-bundle.md 4.1, 6, 11): what the reference opens opens here too.

A gemm, mha or op key defined twice opens with the later record; one key of two kinds opens, run as the kind the
runtime launches; a tensor whose recorded shape is not its byte count's opens, read flat; each is a summary
warning, and `sam3 bundle` exits 0 on warnings alone. A `t.pos_emb` longer than text_len rows gives its first
rows; bos, eos and pad need not be vocabulary ids.

Oracles: manifests and indexes written by hand (the expected records, lines and bytes spelled out), the float64
loop encoder of tests/test_sam3_text.py, token ids worked out by hand, and a run of the unchanged bundle.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_sam3_bundle import PARAMS, UPLOADS, _line_of, _tensors, write_hand_bundle
from test_sam3_text import _loop_oracle, _params, _prompt, _weights

from sam3 import build
from sam3.bundle import Bundle, KernelSource, summarize
from sam3.cli import main
from sam3.text import TextError, encode_text
from sam3.tokenizer import ClipTokenizer

GEMM = "gemm g ctx=gemm insts=k.bin M=8 K=8 N=8 lda=8 tile_k=8 tile_n=8 ct_k=8 bias=0 b_bytes=72"
MHA = "mha g xclbin=x.xclbin insts=i.bin heads=1 seq=1 d=1 token_major=0 elems=1"
OP = "op g xclbin=x.xclbin insts=i.bin"


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -------------------------------------------------------------------------------------------------------
# Kernel keys
# -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("first, second, table, field, want", [
    (GEMM, GEMM.replace("M=8", "M=16"), "gemms", "m", 16),
    (MHA, MHA.replace("heads=1", "heads=4"), "mhas", "heads", 4),
    (OP, OP.replace("i.bin", "j.bin"), "ops", "insts", "j.bin"),
])
def test_a_key_defined_twice_opens_with_the_later_record(tmp_path, first, second, table, field, want):
    root = write_hand_bundle(tmp_path / "b", f"{first}\n{second}\n")
    first_line, second_line = len(PARAMS) + 3, len(PARAMS) + 4  # version, params, xclbin, then the body
    assert (_line_of(root, first), _line_of(root, second)) == (first_line, second_line)
    with Bundle.open(root) as b:
        spec = getattr(b, table)["g"]
        got = getattr(spec, field)
        assert (got.name if isinstance(got, Path) else got) == want
        assert spec.line == second_line
        assert b.kernel_keys() == ["g"]
        s = summarize(b)
    tag = first.split()[0]
    assert s["warnings"] == [f"manifest.txt:{second_line}: {tag} g defined twice (first at line {first_line}): "
                             "the later record wins"]
    assert not any("twice" in p for p in s["problems"])


@pytest.mark.parametrize("key, body, runs_as", [
    ("g", [GEMM, OP], "gemm"),                     # no runtime key: the first of gemm, mha, op
    ("g", [OP, MHA], "mha"),
    ("rope", [GEMM.replace(" g ", " rope "), OP.replace(" g ", " rope ")], "op"),  # the runtime's op
    ("mha_d", [OP.replace(" g ", " mha_d "), MHA.replace(" g ", " mha_d ")], "mha"),
    ("conv", [MHA.replace(" g ", " conv "), GEMM.replace(" g ", " conv ")], "gemm"),
])
def test_one_key_of_two_kinds_opens_and_runs_as_the_runtime_kind(tmp_path, key, body, runs_as):
    root = write_hand_bundle(tmp_path / "b", "\n".join(body) + "\n")
    lines = {rec.split()[0]: _line_of(root, rec) for rec in body}
    r = root.resolve()
    want = {
        "gemm": KernelSource(key, "gemm", r / "kernels/gemm.xclbin", r / "k.bin", "MLIR_AIE", 2 * 8 * 8 * 8),
        "mha": KernelSource(key, key, r / "x.xclbin", r / "i.bin", "MLIR_AIE", 4 * 1 * 1 * 1 * 1),
        "op": KernelSource(key, key, r / "x.xclbin", r / "i.bin", "MLIR_AIE", 0),
    }[runs_as]
    with Bundle.open(root) as b:
        assert all(key in getattr(b, {"gemm": "gemms", "mha": "mhas", "op": "ops"}[t]) for t in lines)
        assert b.kernel_keys() == [key]
        assert b.kernel(key) == want
        s = summarize(b)
    order = [t for t in ("gemm", "mha", "op") if t in lines]
    where = ", ".join(f"{t} at line {lines[t]}" for t in order)
    assert s["warnings"] == [f"manifest.txt: kernel key {key} is defined by 2 kinds ({where}): it runs as the "
                             f"{runs_as}"]
    assert [c["kernels"] for c in s["contexts"]] == [[key]]


# -------------------------------------------------------------------------------------------------------
# Tensor shapes
# -------------------------------------------------------------------------------------------------------

def test_a_logical_shape_on_packed_bytes_opens_read_flat(tmp_path):
    idx, data = _tensors(UPLOADS)
    k = UPLOADS.index("v.0.qkv")
    assert idx[k] == f"v.0.qkv u8 8 {k * 64} 8"  # the writer of test_sam3_bundle: 8 bytes of value k, 64 apart
    idx[k] = f"v.0.qkv u8 2,2 {k * 64} 8"        # a logical [K, N] of 4 over 8 packed bytes
    idx.append("a f32 2,3 0 20")                 # 6 elements recorded over 5 floats' bytes
    with Bundle.open(write_hand_bundle(tmp_path / "b", index="\n".join(idx) + "\n", blob=data)) as b:
        info = b.tensors.info("v.0.qkv")
        assert (info.shape, info.count, info.shaped) == ((2, 2), 8, False)
        view = b.tensors.get("v.0.qkv")
        assert view.shape == (8,) and view.tolist() == [k] * 8
        assert b.tensors.raw("v.0.qkv").tolist() == [k] * 8
        assert b.tensors.get("a").shape == (5,)
        assert b.tensors.get("v.pos").shape == (2, 2)  # a matching shape is kept
        s = summarize(b)
    assert s["warnings"] == [
        f"tensors.txt:{k + 1}: tensor v.0.qkv: shape 2,2 of u8 is 4 elements, but 8 bytes hold 8: read as 8 flat "
        "elements",
        f"tensors.txt:{len(idx)}: tensor a: shape 2,3 of f32 is 6 elements, but 20 bytes hold 5: read as 5 flat "
        "elements",
    ]


# -------------------------------------------------------------------------------------------------------
# `sam3 bundle` and `sam3 segment` on a generated bundle the reference would open
# -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A generated tiny bundle, the same with a repeated gemm, an op reusing a gemm key and a logical shape,
    and an image."""
    base = tmp_path_factory.mktemp("parity")
    plain = build.build(base / "plain", "tiny", variant="host")
    odd = base / "odd"
    shutil.copytree(plain, odd)
    manifest = (odd / "manifest.txt").read_text().splitlines()
    m_head = next(ln for ln in manifest if ln.startswith("gemm m_head "))
    v_qkv = next(ln for ln in manifest if ln.startswith("gemm v_qkv ")).split()
    ctx = v_qkv[2].removeprefix("ctx=")
    xclbin = next(ln for ln in manifest if ln.startswith(f"xclbin {ctx} ")).split()[2]
    manifest += [m_head, f"op v_qkv xclbin={xclbin} {v_qkv[3]}"]
    (odd / "manifest.txt").write_text("\n".join(manifest) + "\n")
    index = (odd / "tensors.txt").read_text().splitlines()
    k = next(i for i, ln in enumerate(index) if ln.startswith("v.0.qkv "))
    name, dtype, shape, offset, nbytes = index[k].split()
    assert (dtype, shape, nbytes) == ("u8", "15552", "15552")  # 9 * 192 * (64 + 8) / 8 packed bytes
    index[k] = " ".join([name, dtype, "64,192", offset, nbytes])  # v_qkv's logical K x N
    (odd / "tensors.txt").write_text("\n".join(index) + "\n")
    image = base / "scene.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (21, 27, 3), dtype=np.uint8)).save(image)
    return plain, odd, image


def test_sam3_bundle_lists_warnings_and_exits_0(generated, capsys):
    plain, odd, _ = generated
    code, out, _ = _run(capsys, "bundle", plain, "--json")
    assert code == 0 and json.loads(out)["problems"] == [] and json.loads(out)["warnings"] == []
    code, out, _ = _run(capsys, "bundle", odd, "--json")
    doc = json.loads(out)
    lines = (odd / "manifest.txt").read_text().splitlines()
    m_head = [n for n, ln in enumerate(lines, 1) if ln.startswith("gemm m_head ")]
    v_qkv = _line_of(odd, next(ln for ln in lines if ln.startswith("gemm v_qkv ")))
    op_line = len(lines)
    qkv = next(n for n, ln in enumerate((odd / "tensors.txt").read_text().splitlines(), 1) if ln.startswith("v.0.qkv "))
    assert code == 0 and doc["problems"] == []
    assert doc["warnings"] == [
        f"manifest.txt:{m_head[1]}: gemm m_head defined twice (first at line {m_head[0]}): the later record wins",
        f"manifest.txt: kernel key v_qkv is defined by 2 kinds (gemm at line {v_qkv}, op at line {op_line}): it "
        "runs as the gemm",
        f"tensors.txt:{qkv}: tensor v.0.qkv: shape 64,192 of u8 is 12288 elements, but 15552 bytes hold 15552: "
        "read as 15552 flat elements",
    ]
    code, out, _ = _run(capsys, "bundle", odd)
    rows = out.splitlines()
    assert code == 0 and "problems  none" in rows
    assert [r.split(None, 1)[1] for r in rows if r.startswith("warning ")] == doc["warnings"]
    assert rows.index("problems  none") < min(i for i, r in enumerate(rows) if r.startswith("warning "))


def test_sam3_bundle_still_exits_1_on_a_problem(generated, tmp_path, capsys):
    _, odd, _ = generated
    broken = tmp_path / "broken"
    shutil.copytree(odd, broken)
    (broken / "kernels" / "m_head.insts.bin").unlink()
    code, out, _ = _run(capsys, "bundle", broken, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["problems"] == ["gemm m_head insts: kernels/m_head.insts.bin: no such file"]
    assert len(doc["warnings"]) == 3


def test_the_bundle_with_warnings_segments_as_the_plain_one(generated, capsys):
    plain, odd, image = generated
    docs = []
    for root in (plain, odd):
        code, out, err = _run(capsys, "segment", root, image, "a cat", "--threshold", "0", "--device", "emu",
                              "--json")
        assert code == 0, err
        docs.append(json.loads(out)["prompts"][0]["instances"])
    assert docs[0] and docs[1] == docs[0]


# -------------------------------------------------------------------------------------------------------
# t.pos_emb and the special ids
# -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [6 + 71, 6 + 1])
def test_a_longer_pos_emb_uses_its_first_rows(rows):
    p = _params()  # text_len 6
    w = _weights(p)
    extra = np.random.default_rng(1).standard_normal((rows - p.text_len, p.text_dim)).astype(np.float32)
    long = {**w, "t.pos_emb": np.concatenate([w["t.pos_emb"], extra])}
    ids, mask = _prompt(p, 4)
    got = encode_text(ids, mask, long, p)
    np.testing.assert_allclose(got, _loop_oracle(ids, 4, w, p), rtol=1e-4, atol=1e-5)
    assert not got[4:].any()


def test_a_pos_emb_shorter_than_the_prompt_is_an_error():
    p = _params()
    w = _weights(p)
    ids, mask = _prompt(p, 4)
    w3 = {**w, "t.pos_emb": w["t.pos_emb"][:3]}
    with pytest.raises(TextError, match=r"^text encoder: tensor t.pos_emb has 24 values, fewer than the prompt's 4 "
                                        r"tokens x text_dim 8 = 32$"):
        encode_text(ids, mask, w3, p)
    # Exactly the prompt's rows suffice, as the reference reads no others.
    np.testing.assert_allclose(encode_text(ids, mask, {**w, "t.pos_emb": w["t.pos_emb"][:4]}, p),
                               _loop_oracle(ids, 4, w, p), rtol=1e-4, atol=1e-5)


def test_special_ids_need_not_be_vocabulary_ids(tmp_path):
    # bos 49406, eos 49407, pad 0 (PARAMS), none of them an id of this vocabulary.
    vocab = '{"a": 1, "b</w>": 2, "a</w>": 3, "ab</w>": 4}'
    root = write_hand_bundle(tmp_path / "b", vocab=vocab, merges="#version: 0.2\na b</w>\n")
    with Bundle.open(root) as b:
        tok = ClipTokenizer.from_bundle(b)
    ids, mask = tok.encode("AB a c")
    # "ab" -> a b</w> -> ab</w> (4); "a" -> a</w> (3); "c" -> c</w>, not in the vocabulary: eos.
    assert ids.tolist() == [49406, 4, 3, 49407, 49407, 0, 0, 0]
    assert mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
