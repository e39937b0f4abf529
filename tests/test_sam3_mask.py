"""sam3.mask: the mask decoder stage on the emulator against its float32 reference (the builder's tiny bundle), its
host pieces against values and formulas worked in the test, the shared conv operand sets, its input errors, and
both against the sam3-tiny fixture's transformers outputs through the exporter's bundle.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from fixture_files import REPO_FIXTURES, sam3_tiny_cases

from sam3 import mask
from sam3.build import build
from sam3.bundle import Bundle
from sam3.hostmath import cosine
from sam3.npu import Npu, NpuError

TINY = REPO_FIXTURES / "sam3-tiny"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    b = Bundle.open(build(tmp_path_factory.mktemp("mask") / "b", "tiny", variant="host"))
    yield b
    b.close()


def inputs(bundle: Bundle, seed: int = 0, n_valid: int = 5):
    p = bundle.params
    g, d = p.grid, p.d_model
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((p.queries, d)).astype(np.float32)
    fpn = [rng.standard_normal(((4 * g) ** 2, d)).astype(np.float32),
           rng.standard_normal(((2 * g) ** 2, d)).astype(np.float32)]
    enc = rng.standard_normal((g * g, d)).astype(np.float32)
    feats = rng.standard_normal((p.text_len, d)).astype(np.float32)
    return hidden, fpn, enc, feats, np.arange(p.text_len) < n_valid


def test_stage_matches_reference(bundle):
    p = bundle.params
    hidden, fpn, enc, feats, valid = inputs(bundle)
    want = mask.reference(bundle, hidden, fpn, enc, feats, valid)
    with Npu(bundle, "emu:npu4") as npu:
        stage = mask.MaskDecoder(npu)
        stage.set_prompt(feats)
        got = stage.forward(hidden, fpn, enc, valid)
        assert sorted(stage.convs) == [2 * p.grid, 4 * p.grid]
    assert got.masks.shape == want.masks.shape == (p.queries, p.mask_size, p.mask_size)
    assert got.semantic.shape == (p.mask_size, p.mask_size)
    assert cosine(got.masks, want.masks) > 0.995
    assert cosine(got.semantic, want.semantic) > 0.99
    assert want.masks.std() > 0.1  # not a degenerate (constant) output


def test_conv_operands_shared(bundle):
    hidden, fpn, enc, feats, valid = inputs(bundle, seed=1)
    with Npu(bundle, "emu:npu4") as npu:
        convs: dict = {}
        first = mask.MaskDecoder(npu, convs)
        first.set_prompt(feats)
        a = first.forward(hidden, fpn, enc, valid)
        ios = dict(convs)
        second = mask.MaskDecoder(npu, convs, cross=(first.s, first.c))
        assert second.s is first.s and second.c is first.c
        second.set_prompt(feats)
        b = second.forward(hidden, fpn, enc, valid)
        assert all(convs[side] is io for side, io in ios.items()) and len(convs) == 2
    np.testing.assert_array_equal(a.masks, b.masks)


def test_cross_operands_checked(bundle):
    with Npu(bundle, "emu:npu4") as npu:
        wrong = npu.io("d_s", 16)
        with pytest.raises(NpuError, match="cross operands must be the d_s Io of at least 64 rows") as e:
            mask.MaskDecoder(npu, cross=(wrong, npu.io("d_c", 64)))
        assert e.value.key == "d_s"
        with pytest.raises(NpuError, match="must be the d_c Io of at least 64 rows .*, got d_s"):
            mask.MaskDecoder(npu, cross=(npu.io("d_s", 64), npu.io("d_s", 64)))


def test_prompt_changes_output_and_masked_rows_do_not(bundle):
    hidden, fpn, enc, feats, valid = inputs(bundle, seed=2, n_valid=3)
    base = mask.reference(bundle, hidden, fpn, enc, feats, valid)
    other = feats.copy()
    other[~valid] *= 40
    same = mask.reference(bundle, hidden, fpn, enc, other, valid)
    np.testing.assert_allclose(same.masks, base.masks, rtol=1e-5, atol=1e-4)
    other[0] += 1
    assert np.abs(mask.reference(bundle, hidden, fpn, enc, other, valid).masks - base.masks).max() > 1e-3


def test_group_norm_relu_by_groups():
    rng = np.random.default_rng(3)
    px, c, groups = 50, 16, 8
    x = (rng.standard_normal((px, c)) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    want = np.empty((px, c))
    for g in range(groups):
        cols = slice(g * c // groups, (g + 1) * c // groups)
        part = x[:, cols].astype(np.float64)
        want[:, cols] = (part - part.mean()) / np.sqrt(part.var() + 1e-5)
    want = np.maximum(want * w + b, 0)
    got = mask.group_norm_relu(x, w, b, groups)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got == 0).any()


def test_group_norm_constant_group_is_zero_variance():
    x = np.full((4, 8), 3.0, np.float32)  # a constant group: zero variance, the output is the bias
    out = mask.group_norm_relu(x, np.ones(8, np.float32), np.full(8, 0.5, np.float32))
    np.testing.assert_allclose(out, 0.5, atol=1e-3)


def test_upsample2_by_hand():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)  # a 2x2 map, 2 channels
    up = mask.upsample2(x, 2).reshape(4, 4, 2)
    np.testing.assert_array_equal(up[..., 0], [[0, 0, 2, 2], [0, 0, 2, 2], [4, 4, 6, 6], [4, 4, 6, 6]])
    np.testing.assert_array_equal(up[..., 1], up[..., 0] + 1)


def test_head_operand_is_the_folded_head(bundle):
    t = bundle.tensors
    p = bundle.params
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((p.queries, p.d_model)).astype(np.float32)
    pixels = rng.standard_normal((30, p.d_model)).astype(np.float32)
    n = bundle.gemms["m_head"].n
    b, bias = mask.head_operand(bundle, hidden, n)
    assert b.shape == (p.d_model, n) and bias.shape == (n,)
    m = mask.embed(bundle, hidden)
    inst = pixels @ t.get("m.inst.w", "f32").T + t.get("m.inst.b", "f32")
    got = pixels @ b + bias
    np.testing.assert_allclose(got[:, :p.queries], inst @ m.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[:, p.queries], pixels @ t.get("m.sem.w", "f32") + t.get("m.sem.b", "f32")[0],
                               rtol=1e-5, atol=1e-5)
    assert not b[:, p.queries + 1:].any() and not bias[p.queries + 1:].any()
    # the embedder: three layers counted from 0, ReLU between
    h = np.maximum(hidden @ t.get("m.embed.0.w", "f32").T + t.get("m.embed.0.b", "f32"), 0)
    h = np.maximum(h @ t.get("m.embed.1.w", "f32").T + t.get("m.embed.1.b", "f32"), 0)
    np.testing.assert_allclose(m, h @ t.get("m.embed.2.w", "f32").T + t.get("m.embed.2.b", "f32"), rtol=1e-5,
                               atol=1e-5)


def test_forward_needs_a_prompt(bundle):
    hidden, fpn, enc, _, valid = inputs(bundle)
    with Npu(bundle, "emu:npu4") as npu, pytest.raises(NpuError, match=r"set_prompt\(feats\) first"):
        mask.MaskDecoder(npu).forward(hidden, fpn, enc, valid)


@pytest.mark.parametrize("change, message", [
    ({"hidden": np.zeros((3, 32), np.float32)}, "hidden must be [4, 32] (queries x d_model), got [3, 32]"),
    ({"enc": np.zeros((64, 16), np.float32)}, "enc must be [64, 32] (channels-last), got [64, 16]"),
    ({"fpn": [np.zeros((1024, 32), np.float32), np.zeros((64, 32), np.float32)]},
     "fpn[1] must be [256, 32] (channels-last), got [64, 32]"),
    ({"fpn": [np.zeros((1024, 32), np.float32)]}, "fpn must hold at least 2 levels"),
    ({"valid": np.ones(4, bool)}, "valid must be [8] (one flag per prompt token), got [4]"),
    ({"feats": np.zeros((8, 30), np.float32)}, "feats must be [8, 32] (text_len x d_model), got [8, 30]"),
])
def test_input_errors(bundle, change, message):
    hidden, fpn, enc, feats, valid = inputs(bundle)
    args = {"hidden": hidden, "fpn": fpn, "enc": enc, "feats": feats, "valid": valid} | change
    with pytest.raises(ValueError) as e:
        mask.reference(bundle, **args)
    assert message in str(e.value)
    with Npu(bundle, "emu:npu4") as npu, pytest.raises(ValueError) as e:
        stage = mask.MaskDecoder(npu)
        stage.set_prompt(args["feats"])
        stage.forward(args["hidden"], args["fpn"], args["enc"], args["valid"])
    assert message in str(e.value)


def test_non_finite_input(bundle):
    hidden, fpn, enc, feats, valid = inputs(bundle)
    fpn[0][5, 1] = np.nan
    with pytest.raises(ValueError, match=r"fpn\[0\] has 1 non-finite value"):
        mask.reference(bundle, hidden, fpn, enc, feats, valid)


def _fake(bundle: Bundle, **params):
    p = types.SimpleNamespace(**{k: getattr(bundle.params, k) for k in
                                 ("d_model", "grid", "mask_size", "queries", "d_heads", "text_len")} | params)
    return types.SimpleNamespace(params=p, tensors=bundle.tensors)


@pytest.mark.parametrize("params, message", [
    ({"mask_size": 24}, "mask_size 24 must be grid 8 times a power of two"),
    ({"mask_size": 8}, "mask_size 8 must be grid 8 times a power of two"),
    ({"d_model": 36}, "d_model 36 is not a multiple of the GroupNorm's 8 groups"),
    ({"mask_size": 64}, "3 upsampling stages (grid 8 -> 64) need tensors m.conv2, missing from the bundle"),
])
def test_geometry_errors(bundle, params, message):
    with pytest.raises(NpuError) as e:
        mask.Geometry(_fake(bundle, **params))
    assert message in str(e.value)
    assert mask.Geometry(_fake(bundle)).stages == 2


# ---------------------------------------------------------------------------------------------
# the sam3-tiny fixture (transformers' float32 outputs), through the exporter's bundle




@pytest.mark.parametrize("index", sam3_tiny_cases())
def test_fixture_masks(fixture_bundle, index):
    """The stage on the emulator and the float32 reference, fed the fixture's own decoder hidden states, FPN levels
    (channels first there), encoder output and text features: masks cos > 0.995, semantic cos > 0.99."""
    bundle, ref = fixture_bundle
    r = {k[len(f"case.{index}."):]: v for k, v in ref.items() if k.startswith(f"case.{index}.")}
    d = bundle.params.d_model
    fpn = [r[f"fpn{i}"].transpose(1, 2, 0).reshape(-1, d) for i in range(3)]
    hidden = r["dec.intermediate_hidden_states"][-1, 0]
    valid = r["attention_mask"] != 0
    with Npu(bundle, "emu:npu4") as npu:
        stage = mask.MaskDecoder(npu)
        stage.set_prompt(r["text"])
        got = stage.forward(hidden, fpn, r["enc_out"], valid)
    want = mask.reference(bundle, hidden, fpn, r["enc_out"], r["text"], valid)
    for out in (got, want):
        assert out.masks.shape == r["pred_masks"].shape
        assert cosine(out.masks, r["pred_masks"]) > 0.995
        assert cosine(out.semantic, r["semantic"][0]) > 0.99
