"""sam3.decoder: the DETR decoder stage on the emulator against its float32 reference (a generated tiny bundle with
two decoder layers), its host pieces against values and formulas worked in the test, its input errors, and
both against the sam3-tiny fixture's transformers outputs through the exporter's bundle."""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import pytest
from fixture_files import REPO_FIXTURES, sam3_tiny_cases

from sam3 import decoder
from sam3.build import Geometry, build
from sam3.bundle import Bundle
from sam3.hostmath import cosine
from sam3.npu import Npu, NpuError

TINY = REPO_FIXTURES / "sam3-tiny"


def two_layer_tiny() -> Geometry:
    """The builder's tiny geometry with two decoder layers and six queries, every kernel choice kept."""
    g = Geometry.tiny()
    fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name not in ("name", "gemms", "mhas")}
    fields.update(dec_layers=2, queries=6)
    choice = {key: {"m": s.m, "tile_k": s.tile_k, "tile_n": s.tile_n, "ct_k": s.ct_k} for key, s in g.gemms.items()}
    base = g.gemms["d_o"]
    return Geometry.derive("tiny-dec2", m=base.m, tile_k=base.tile_k, tile_n=base.tile_n, ct_k=base.ct_k,
                           mha_d_head=g.mhas["mha_d"].d, conv_p=g.conv_p, overrides=choice, **fields)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    b = Bundle.open(build(tmp_path_factory.mktemp("dec") / "b", two_layer_tiny(), variant="host"))
    yield b
    b.close()


def inputs(bundle: Bundle, seed: int = 0, n_valid: int = 5):
    p = bundle.params
    rng = np.random.default_rng(seed)
    enc = rng.standard_normal((p.grid * p.grid, p.d_model)).astype(np.float32)
    feats = rng.standard_normal((p.text_len, p.d_model)).astype(np.float32)
    return enc, feats, np.arange(p.text_len) < n_valid


def test_stage_matches_reference(bundle):
    p = bundle.params
    assert p.dec_layers == 2
    enc, feats, valid = inputs(bundle)
    want = decoder.reference(bundle, enc, feats, valid)
    with Npu(bundle, "emu:npu4") as npu:
        got = decoder.Decoder(npu).forward(enc, feats, valid)
    assert got.hidden.shape == (p.queries, p.d_model) and got.boxes.shape == (p.queries, 4)
    assert got.logits.shape == (p.queries,) and got.presence.shape == (1,)
    assert got.layer_hidden.shape == (2, p.queries, p.d_model) and got.layer_boxes.shape == (2, p.queries, 4)
    assert cosine(got.hidden, want.hidden) > 0.999
    assert np.abs(got.boxes - want.boxes).max() < 0.01
    assert np.abs(got.logits - want.logits).max() < 0.1
    assert np.abs(got.presence - want.presence).max() < 0.05
    # the second layer starts from the first layer's refined boxes, not the initial ones
    first = decoder.sigmoid(bundle.tensors.get("dec.reference_points", "f32").reshape(p.queries, 4))
    np.testing.assert_allclose(want.layer_boxes[0], first, rtol=1e-6)
    assert np.abs(want.layer_boxes[1] - first).max() > 1e-3
    assert (np.abs(want.layer_presence) <= decoder.PRESENCE_CLAMP).all()


def test_masked_prompt_rows_do_not_matter(bundle):
    enc, feats, valid = inputs(bundle, seed=1, n_valid=3)
    other = feats.copy()
    other[~valid] = np.random.default_rng(7).standard_normal(other[~valid].shape) * 50
    a, b = decoder.reference(bundle, enc, feats, valid), decoder.reference(bundle, enc, other, valid)
    np.testing.assert_allclose(a.hidden, b.hidden, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-6, atol=1e-6)
    # while a valid row does
    other[0] += 1
    assert np.abs(decoder.reference(bundle, enc, other, valid).logits - a.logits).max() > 1e-4


def test_sine_boxes_by_hand():
    d = 8  # f = 4 features per coordinate: dim_t = 1, 1, 10000^(1/2), 10000^(1/2)
    box = np.array([[0.25, 0.5, 0.1, 0.2]], np.float32)  # cx, cy, w, h
    got = decoder.sine_boxes(box, d)[0]
    assert got.shape == (16,)
    cy, cx, w, h = 0.5 * 2 * math.pi, 0.25 * 2 * math.pi, 0.1 * 2 * math.pi, 0.2 * 2 * math.pi
    want = []
    for c in (cy, cx, w, h):
        want += [math.sin(c), math.cos(c), math.sin(c / 100), math.cos(c / 100)]
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_inverse_sigmoid_clamps():
    x = np.array([0.5, 0.0, 1.0, -3.0, 7.0, 0.25], np.float32)
    want = [0.0, math.log(1e-3), math.log(1 / 1e-3), math.log(1e-3), math.log(1 / 1e-3), math.log(1 / 3)]
    np.testing.assert_allclose(decoder.inverse_sigmoid(x), want, rtol=1e-5, atol=1e-6)
    y = np.linspace(0.01, 0.99, 7, dtype=np.float32)
    np.testing.assert_allclose(decoder.sigmoid(decoder.inverse_sigmoid(y)), y, rtol=1e-5)


def _mlp2(bundle: Bundle, name: str, x: np.ndarray) -> np.ndarray:
    t = bundle.tensors
    h = np.maximum(x @ t.get(f"{name}.1.w", "f32").T + t.get(f"{name}.1.b", "f32"), 0)
    return h @ t.get(f"{name}.2.w", "f32").T + t.get(f"{name}.2.b", "f32")


def test_box_bias_by_hand(bundle):
    g, heads = bundle.params.grid, bundle.params.d_heads
    boxes = np.array([[0.5, 0.4, 0.5, 0.3], [0.2, 0.7, 0.1, 0.25]], np.float32)  # cxcywh
    by, bx = decoder.box_bias(bundle, boxes, g)
    assert by.shape == bx.shape == (heads, 2, g)

    def enc(v: float) -> float:
        return math.copysign(math.log2(abs(8 * v) + 1) / 3, v) if v else 0.0

    for q, (cx, cy, w, h) in enumerate(boxes.tolist()):
        for i in (0, g // 2, g - 1):
            pos = i / g
            y_in = np.array([[enc(pos - (cy - h / 2)), enc(pos - (cy + h / 2))]], np.float32)
            x_in = np.array([[enc(pos - (cx - w / 2)), enc(pos - (cx + w / 2))]], np.float32)
            np.testing.assert_allclose(by[:, q, i], _mlp2(bundle, "dec.rpb_y", y_in)[0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(bx[:, q, i], _mlp2(bundle, "dec.rpb_x", x_in)[0], rtol=1e-4, atol=1e-5)
    # separable: moving a box along x leaves its y bias alone
    moved = boxes.copy()
    moved[:, 0] += 0.1
    by2, bx2 = decoder.box_bias(bundle, moved, g)
    np.testing.assert_array_equal(by2, by)
    assert np.abs(bx2 - bx).max() > 1e-4


def test_attention_against_per_head_loop():
    rng = np.random.default_rng(2)
    heads, d, nq, nk = 2, 8, 3, 5
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (nq, nk, nk))
    bias = rng.standard_normal((heads, nq, nk)).astype(np.float32)
    valid = np.array([1, 0, 1, 1, 0], bool)
    got = decoder.attention(q, k, v, heads, bias=bias, valid=valid)
    hd = d // heads
    for h in range(heads):
        cols = slice(h * hd, (h + 1) * hd)
        s = q[:, cols] @ k[:, cols].T / math.sqrt(hd) + bias[h]
        s[:, ~valid] = -np.inf
        e = np.exp(s - s.max(axis=1, keepdims=True))
        np.testing.assert_allclose(got[:, cols], e / e.sum(axis=1, keepdims=True) @ v[:, cols], rtol=1e-5, atol=1e-6)


def test_score_by_formula(bundle):
    t = bundle.tensors
    p = bundle.params
    rng = np.random.default_rng(4)
    hidden = rng.standard_normal((p.queries, p.d_model)).astype(np.float32)
    feats = rng.standard_normal((p.text_len, p.d_model)).astype(np.float32)
    valid = np.arange(p.text_len) < 4

    def ln(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * t.get(f"{name}.w", "f32") + t.get(f"{name}.b", "f32")

    def lin(x, name):
        return x @ t.get(f"{name}.w", "f32").T + t.get(f"{name}.b", "f32")

    text = ln(_mlp2(bundle, "score.text_mlp", feats) + feats, "score.text_ln")
    pooled = lin(text[valid].mean(axis=0), "score.text_proj")
    want = np.clip(lin(hidden, "score.query_proj") @ pooled / math.sqrt(p.d_model), -12, 12)
    np.testing.assert_allclose(decoder.score(bundle, hidden, feats, valid), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("which, shape, message", [
    ("enc", (10, 32), "enc must be [64, 32] (grid^2 or text_len rows, d_model 32 columns), got [10, 32]"),
    ("feats", (8, 31), "feats must be [8, 32]"),
    ("valid", (9,), "valid must be [8] (one flag per prompt token), got [9]"),
])
def test_input_errors(bundle, which, shape, message):
    enc, feats, valid = inputs(bundle)
    args = {"enc": enc, "feats": feats, "valid": valid}
    args[which] = np.zeros(shape, bool if which == "valid" else np.float32)
    with pytest.raises(ValueError) as e:
        decoder.reference(bundle, **args)
    assert message in str(e.value)
    with Npu(bundle, "emu:npu4") as npu, pytest.raises(ValueError) as e:
        decoder.Decoder(npu).forward(**args)
    assert message in str(e.value)


def test_non_finite_input(bundle):
    enc, feats, valid = inputs(bundle)
    enc[3, 4] = np.inf
    with pytest.raises(ValueError, match="enc has 1 non-finite value"):
        decoder.reference(bundle, enc, feats, valid)


def test_dec_kv_too_narrow(bundle):
    spec = bundle.gemms["dec_kv"]
    fake = types.SimpleNamespace(params=bundle.params, root=bundle.root,
                                 gemms={"dec_kv": dataclasses.replace(spec, n=spec.n - spec.tile_n)})
    with pytest.raises(NpuError, match=r"dec_kv: K=64, N=112; the decoder needs K = 2 d_model = 64 and N >= "
                                       r"dec_layers \* 2 d_model = 128") as e:
        decoder.check_kv(fake)
    assert e.value.key == "dec_kv"
    with pytest.raises(NpuError, match="no GEMM 'dec_kv'"):
        decoder.check_kv(types.SimpleNamespace(params=bundle.params, root=bundle.root, gemms={}))


# ---------------------------------------------------------------------------------------------
# the sam3-tiny fixture (transformers' float32 outputs), through the exporter's bundle




@pytest.mark.parametrize("index", sam3_tiny_cases())
def test_fixture_decoder(fixture_bundle, index):
    """The stage on the emulator, fed the fixture's own encoder output and text features, against transformers:
    hidden cos > 0.999, and over the confident queries (sigmoid(logit) > 0.1) boxes < 0.01 and logits < 0.1;
    presence < 0.05. The float32 reference shares the packed dec.kv's bfp16 rounding: the same bars, logits 0.15."""
    bundle, ref = fixture_bundle
    r = {k[len(f"case.{index}."):]: v for k, v in ref.items() if k.startswith(f"case.{index}.")}
    valid = r["attention_mask"] != 0
    with Npu(bundle, "emu:npu4") as npu:
        got = decoder.Decoder(npu).forward(r["enc_out"], r["text"], valid)
    want = decoder.reference(bundle, r["enc_out"], r["text"], valid)
    conf = 1 / (1 + np.exp(-r["pred_logits"])) > 0.1
    assert conf.any()
    for out, logit_bar in ((got, 0.1), (want, 0.15)):
        assert cosine(out.hidden, r["dec.intermediate_hidden_states"][-1, 0]) > 0.999
        assert np.abs(out.boxes - r["pred_boxes"])[conf].max() < 0.01
        assert np.abs(out.logits - r["pred_logits"])[conf].max() < logit_bar
        assert abs(float(out.presence[0] - r["presence"][0])) < 0.05
    # every layer: the boxes it starts from (cxcywh) and its presence logit
    assert np.abs(want.layer_boxes - r["dec.reference_boxes"][:, 0]).max() < 0.01
    assert np.abs(want.layer_presence - r["dec.presence_logits"][:, 0, 0]).max() < 0.05
