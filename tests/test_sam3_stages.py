"""The image-encoder stages on the emulator against their float32 numpy references: the ViT on both paths (and
the device path's 8 launches a layer with no host work), the neck, the DETR encoder; a broken weight is caught."""

from __future__ import annotations

import numpy as np
import pytest

from sam3 import detr, neck, vit
from sam3.build import build
from sam3.bundle import Bundle
from sam3.npu import Npu, NpuError


@pytest.fixture(scope="module", params=["host", "device", "device-f32"])
def bundle(request, tmp_path_factory) -> Bundle:
    b = Bundle.open(build(tmp_path_factory.mktemp("b") / request.param, "tiny", variant=request.param))
    yield b
    b.close()


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def pixels(bundle, seed=0):
    side = bundle.params.grid * bundle.params.patch
    return np.random.default_rng(seed).uniform(-1, 1, (3, side, side)).astype(np.float32)


def test_vit_matches_its_float32_reference(bundle):
    with Npu(bundle, "emu:npu4") as npu:
        x = pixels(bundle)
        got = vit.Vit(npu).forward(x)
    want = vit.reference(bundle, x)
    assert got.shape == (bundle.params.grid ** 2, bundle.params.vit_dim)
    assert cosine(got, want) > 0.9999


def test_device_vit_runs_eight_launches_a_layer_with_no_host_work(tmp_path_factory):
    b = Bundle.open(build(tmp_path_factory.mktemp("d") / "dev", "tiny", variant="device-f32"))
    with b, Npu(b, "emu:npu4") as npu:
        encoder = vit.Vit(npu)
        encoder.forward(pixels(b))  # the first forward builds every command packet
        marks = []
        encoder.forward(pixels(b, 1), on_layer=lambda i: marks.append(dict(npu.device.stats)))
    for before, after in zip(marks, marks[1:], strict=False):
        assert after["EXEC_CMD"] - before["EXEC_CMD"] == 8
        assert after.get("SYNC_BO", 0) == before.get("SYNC_BO", 0)  # no host sync between the launches
        assert after["bytes_in"] == before["bytes_in"] and after["bytes_out"] == before["bytes_out"]


def test_a_broken_weight_layout_is_caught(tmp_path_factory):
    """Swapping two heads' q columns in one layer's packed qkv (what a wrong export would do) moves the ViT's
    output away from the reference computed on the intended weights."""
    from sam3 import pack

    root = build(tmp_path_factory.mktemp("x") / "host", "tiny", variant="host")
    b = Bundle.open(root)
    g = b.gemms["v_qkv"]
    weights, bias = pack.unpack_b(b.tensors.raw("v.0.qkv"), g.k, g.n, g.tile_k, g.tile_n, g.ct_k, g.bias)
    hd = b.params.vit_dim // b.params.vit_heads
    swapped = weights.copy()
    swapped[:, :hd], swapped[:, hd:2 * hd] = weights[:, hd:2 * hd], weights[:, :hd]
    want = vit.reference(b, pixels(b))
    with Npu(b, "emu:npu4") as npu:
        encoder = vit.Vit(npu)
        npu._weights["v.0.qkv"] = npu.upload(pack.pack_b(swapped, bias, g.tile_k, g.tile_n, g.ct_k))
        got = encoder.forward(pixels(b))
    b.close()
    assert cosine(got, want) < 0.999


def test_neck_and_detr_encoder_match_their_references(bundle):
    p = bundle.params
    rng = np.random.default_rng(2)
    vit_out = rng.standard_normal((p.grid ** 2, p.vit_dim)).astype(np.float32)
    feats = rng.standard_normal((p.text_len, p.d_model)).astype(np.float32)
    valid = np.arange(p.text_len) < 3
    with Npu(bundle, "emu:npu4") as npu:
        levels = neck.Neck(npu).forward(vit_out)
        enc = detr.Encoder(npu)
        enc.set_prompt(feats)
        out = enc.forward(levels[2], valid)
    want = neck.reference(bundle, vit_out)
    sides = [4 * p.grid, 2 * p.grid, p.grid]
    for got_level, want_level, side in zip(levels, want, sides, strict=True):
        assert got_level.shape == (side * side, p.d_model)
        assert cosine(got_level, want_level) > 0.9995
    assert cosine(out, detr.reference(bundle, levels[2], feats, valid)) > 0.9995


def test_the_fold_equals_cross_attention(bundle):
    """The folded operands give the cross-attention computed the direct way (q, k, v projections, per-head
    softmax over the valid tokens, output projection)."""
    p = bundle.params
    t = bundle.tensors
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, p.d_model)).astype(np.float32)
    feats = rng.standard_normal((p.text_len, p.d_model)).astype(np.float32)
    valid = np.arange(p.text_len) < 4
    f = detr.fold(bundle, 0, feats)
    got = detr.prompt_softmax(x @ f.s + f.s_bias, valid, p.d_heads) @ f.c + f.c_bias

    def lin(a, name):
        return a @ t.get(f"d.0.ca.{name}.w", "f32").T + t.get(f"d.0.ca.{name}.b", "f32")

    hd = p.d_model // p.d_heads
    q, k, v = (lin(a, n).reshape(len(a), p.d_heads, hd).transpose(1, 0, 2) for a, n in ((x, "q"), (feats, "k"),
                                                                                       (feats, "v")))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    s[:, :, ~valid] = -np.inf
    w = np.exp(s - s.max(-1, keepdims=True))
    o = (w / w.sum(-1, keepdims=True)) @ v
    want = lin(o.transpose(1, 0, 2).reshape(len(x), -1), "o")
    assert np.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_detr_forward_needs_a_prompt(bundle):
    from sam3.npu import NpuError

    p = bundle.params
    with Npu(bundle, "emu:npu4") as npu:
        with pytest.raises(NpuError, match="set_prompt"):
            detr.Encoder(npu).forward(np.zeros((p.grid ** 2, p.d_model), np.float32), np.ones(p.text_len, bool))


def test_pixels_of_the_wrong_shape(bundle):
    with Npu(bundle, "emu:npu4") as npu:
        with pytest.raises(ValueError, match=r"pixels must be \[3, "):
            vit.Vit(npu).forward(np.zeros((3, 5, 5), np.float32))


def test_stage_misuse_is_named(bundle):
    from sam3 import mask
    from sam3.npu import NpuError

    p = bundle.params
    with Npu(bundle, "emu:npu4") as npu:
        with pytest.raises(NpuError, match=r"v_o: this operand set of \d+ rows has no convolution geometry"):
            npu.io("v_o", 1).conv_geometry()
        with pytest.raises(NpuError, match="mask decoder: set_prompt"):
            mask.MaskDecoder(npu).cross(np.zeros((p.grid ** 2, p.d_model), np.float32), np.ones(p.text_len, bool))


def _relabel_mha(manifest, key, **fields):
    lines = manifest.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"mha {key} "):
            words = [w for w in line.split() if w.split("=")[0] not in fields]
            lines[i] = " ".join(words + [f"{k}={v}" for k, v in fields.items()])
    manifest.write_text("\n".join(lines) + "\n")


def test_device_vit_reads_only_elems_of_its_mha_records(tmp_path_factory):
    """A device bundle whose mha records describe another layout (per-window heads, as the real device-form
    records may) opens and computes what the original does: of those records the device path reads elems only,
    as taconite-sam3 does (docs/sam3-kernels.md 4.3). Too few elems is still refused, naming the record."""
    root = build(tmp_path_factory.mktemp("rl") / "dev", "tiny", variant="device-f32")
    with Bundle.open(root) as b, Npu(b, "emu:npu4") as npu:
        want = vit.Vit(npu).forward(pixels(b))
        p = b.params
    _relabel_mha(root / "manifest.txt", "mha_win", heads=p.vit_heads, seq=p.window ** 2, d=7, token_major=1)
    _relabel_mha(root / "manifest.txt", "mha_glob", heads=1, seq=3, d=5, token_major=0)
    with Bundle.open(root) as b, Npu(b, "emu:npu4") as npu:
        assert (b.mhas["mha_win"].heads, b.mhas["mha_glob"].seq) == (p.vit_heads, 3)
        np.testing.assert_array_equal(vit.Vit(npu).forward(pixels(b)), want)
    _relabel_mha(root / "manifest.txt", "mha_glob", elems=p.grid ** 2 * p.vit_dim - 1)
    with Bundle.open(root) as b, Npu(b, "emu:npu4") as npu, pytest.raises(
            NpuError, match=rf"mha_glob: MHA elems={p.grid ** 2 * p.vit_dim - 1} is fewer than the ViT's "
                            rf"{p.grid ** 2} x {p.vit_dim} elements"):
        vit.Vit(npu)
