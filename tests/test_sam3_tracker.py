"""The host tracker stages (sam3/tracker_*.py) against the sam3-tiny-tracker fixture's float32 transformers
reference, stage by stage and case by case, each stage fed the reference's own inputs; plus the layers against
direct definitions and the documented errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tracker_fixture as tf

from sam3 import tracker_decoder as td
from sam3 import tracker_neck as tn
from sam3 import tracker_post as tpost
from sam3 import tracker_prompt as tp
from sam3.tracker_config import TrackerConfig, TrackerError, has_tracker, tensor
from sam3.tracker_layers import conv1x1, conv3x3, conv_transpose2x2

CASES = tf.case_indices()


@pytest.fixture(scope="module")
def fx():
    """(weights, config, reference, cases by index)."""
    return (tf.tracker_tensors(), TrackerConfig.from_config(tf.config()), tf.Reference(),
            {c["index"]: c for c in tf.cases()})


def channels_last(a: np.ndarray) -> np.ndarray:
    """The reference's channels-first `[C, H, W]` as `[H*W, C]` raster."""
    return a.reshape(a.shape[0], -1).T


def prompt(ref, i):
    pts = ref(i, "input_points") if ref.has(i, "input_points") else None
    labels = ref(i, "input_labels") if pts is not None else None
    box = ref(i, "input_boxes") if ref.has(i, "input_boxes") else None
    return pts, labels, box


def decoded(fx, i) -> td.DecoderOutput:
    w, cfg, ref, _ = fx
    emb = [channels_last(ref(i, f"image_embeddings.{j}")) for j in range(3)]
    return td.decode(w, cfg, emb, tp.image_pe(w, cfg), tp.sparse(w, cfg, *prompt(ref, i)), tp.dense(w, cfg))


# --------------------------------------------------------------------------------------------- config


def test_config_sizes_come_from_tracker_config(fx):
    w, cfg, _, _ = fx
    tc = tf.config()["tracker_config"]
    assert cfg.width == tc["mask_decoder_config"]["hidden_size"]
    assert cfg.grid * cfg.patch == tc["prompt_encoder_config"]["image_size"]
    assert cfg.mask_side == tc["vision_config"]["backbone_feature_sizes"][0][0]
    assert (cfg.stability_delta, cfg.stability_thresh) == (0.05, 0.98)
    assert has_tracker(w) and not has_tracker({k: v for k, v in w.items() if not k.startswith("tracker_neck.")})


def test_a_config_without_tracker_config_is_refused():
    cfg = dict(tf.config())
    del cfg["tracker_config"]
    with pytest.raises(TrackerError, match="no tracker_config"):
        TrackerConfig.from_config(cfg)


def test_a_bad_size_is_named():
    cfg = tf.config()
    cfg["tracker_config"]["mask_decoder_config"]["num_attention_heads"] = 0
    with pytest.raises(TrackerError, match="num_attention_heads must be a positive integer"):
        TrackerConfig.from_config(cfg)


def test_a_missing_or_misshapen_tensor_is_named(fx):
    w, cfg, ref, _ = fx
    name = "tracker_model.prompt_encoder.point_embed.weight"
    with pytest.raises(TrackerError, match=f"{name} missing"):
        tp.sparse({k: v for k, v in w.items() if k != name}, cfg, *prompt(ref, 0))
    with pytest.raises(TrackerError, match=r"shape \[4, 32\], expected \[4, 31\]"):
        tensor(w, name, (4, 31))


# --------------------------------------------------------------------------------------------- prompt encoder


@pytest.mark.parametrize("i", CASES)
def test_prompt_coordinates_scale_to_the_model_frame(fx, i):
    _, cfg, ref, cases = fx
    c = cases[i]
    if c["points"]:
        got = tp.model_frame(np.array(c["points"]), c["width"], c["height"], cfg.image_size)
        np.testing.assert_allclose(got, ref(i, "input_points"), rtol=0, atol=2e-5)
    if c["box"] is not None:
        got = tp.model_frame(np.array(c["box"]).reshape(2, 2), c["width"], c["height"], cfg.image_size)
        np.testing.assert_allclose(got.reshape(4), ref(i, "input_boxes"), rtol=0, atol=2e-5)


@pytest.mark.parametrize("i", CASES)
def test_sparse_embeddings(fx, i):
    w, cfg, ref, _ = fx
    got = tp.sparse(w, cfg, *prompt(ref, i))
    want = ref(i, "sparse_embeddings")
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() < 2e-5


@pytest.mark.parametrize("i", CASES)
def test_dense_embeddings_and_image_pe(fx, i):
    w, cfg, ref, _ = fx
    assert np.array_equal(tp.dense(w, cfg), channels_last(ref(i, "dense_embeddings")))
    assert np.abs(tp.image_pe(w, cfg) - channels_last(ref(i, "image_pe"))).max() < 1e-6


def test_label_rules(fx):
    w, cfg, _, _ = fx
    pe = "tracker_model.prompt_encoder."
    pts = np.array([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0], [70.0, 80.0]])
    out = tp.embed_points(w, cfg, pts, np.array([1, 0, -1, -10]), pad=True)
    assert out.shape == (5, cfg.width)
    fourier = tp.fourier((pts[:2] + 0.5) / cfg.image_size, w[pe + "shared_embedding.positional_embedding"])
    np.testing.assert_allclose(out[:2], fourier + w[pe + "point_embed.weight"][[1, 0]], atol=1e-6)
    assert np.array_equal(out[2], w[pe + "not_a_point_embed.weight"][0])     # -1: not-a-point alone
    assert not out[3].any()                                                  # -10: padding, zeros
    assert np.array_equal(out[4], w[pe + "not_a_point_embed.weight"][0])     # the pad token


def test_a_box_is_two_corners_and_a_not_a_point(fx):
    w, cfg, _, _ = fx
    pe = "tracker_model.prompt_encoder."
    box = np.array([5.0, 6.0, 100.0, 120.0])
    out = tp.sparse(w, cfg, None, None, box)
    corners = tp.fourier((box.reshape(2, 2) + 0.5) / cfg.image_size, w[pe + "shared_embedding.positional_embedding"])
    np.testing.assert_allclose(out[:2], corners + w[pe + "point_embed.weight"][[2, 3]], atol=1e-6)
    assert np.array_equal(out[2], w[pe + "not_a_point_embed.weight"][0]) and len(out) == 3


def test_bad_labels_and_label_counts_are_refused(fx):
    w, cfg, _, _ = fx
    with pytest.raises(TrackerError, match="labels must be 0..3"):
        tp.sparse(w, cfg, np.zeros((1, 2)), np.array([7]), None)
    with pytest.raises(TrackerError, match="one label"):
        tp.sparse(w, cfg, np.zeros((2, 2)), np.array([1]), None)


# --------------------------------------------------------------------------------------------- neck


@pytest.mark.parametrize("i", CASES)
def test_image_embeddings_from_the_vit_output(fx, i):
    w, cfg, ref, _ = fx
    got = tn.image_embeddings(w, cfg, ref(i, "vit_out"))
    for j in range(3):
        want = channels_last(ref(i, f"image_embeddings.{j}"))
        assert got[j].shape == want.shape
        assert np.abs(got[j] - want).max() < 1e-5 * max(1.0, float(np.abs(want).max()))


def test_the_neck_refuses_a_scale_it_does_not_read(fx):
    w, cfg, ref, _ = fx
    with pytest.raises(TrackerError, match="scale factor 0.5"):
        tn.level(w, replace(cfg, scale_factors=(0.5, 2.0, 1.0)), 0, ref(0, "vit_out").reshape(cfg.grid, cfg.grid, -1))


# --------------------------------------------------------------------------------------------- layers


def test_conv3x3_is_the_zero_padded_correlation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7, 3)).astype(np.float32)
    wt = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    p = np.pad(x, ((1, 1), (1, 1), (0, 0)))
    want = np.empty((5, 7, 4))
    for y in range(5):
        for xx in range(7):
            want[y, xx] = np.einsum("hwc,ochw->o", p[y:y + 3, xx:xx + 3], wt) + b
    np.testing.assert_allclose(conv3x3(x, wt, b), want, atol=1e-5)
    np.testing.assert_allclose(conv1x1(x, wt[:, :, 1:2, 1:2], b), x @ wt[:, :, 1, 1].T + b, atol=1e-5)


def test_conv_transpose2x2_places_each_tap():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 2)).astype(np.float32)
    wt = rng.standard_normal((2, 5, 2, 2)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    got = conv_transpose2x2(x, wt, b)
    assert got.shape == (6, 8, 5)
    for dy in range(2):
        for dx in range(2):
            np.testing.assert_allclose(got[dy::2, dx::2], x @ wt[:, :, dy, dx] + b, atol=1e-5)


# --------------------------------------------------------------------------------------------- decoder


@pytest.mark.parametrize("i", CASES)
def test_two_way_transformer_tokens_and_image(fx, i):
    _, _, ref, _ = fx
    out = decoded(fx, i)
    assert out.tokens.shape == ref(i, "tokens_out").shape
    assert np.abs(out.tokens - ref(i, "tokens_out")).max() < 1e-5
    assert np.abs(out.image - ref(i, "image_out")).max() < 1e-5


@pytest.mark.parametrize("i", CASES)
def test_upscaling_and_hypernetworks(fx, i):
    _, _, ref, _ = fx
    out = decoded(fx, i)
    assert np.abs(out.upscaled - ref(i, "upscaled")).max() < 1e-5
    np.testing.assert_allclose(out.hyper_in, ref(i, "hyper_in"), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("i", CASES)
def test_all_candidates_and_heads(fx, i):
    _, _, ref, _ = fx
    out = decoded(fx, i)
    want = ref(i, "all_low_res_masks")
    assert out.masks.shape == want.shape and out.masks.dtype == np.float32
    assert np.abs(out.masks - want).max() < 1e-4
    assert np.abs(out.iou - ref(i, "all_iou_scores")).max() < 1e-5
    assert abs(out.object_score - float(ref(i, "object_score_logits")[0])) < 1e-5


# --------------------------------------------------------------------------------------------- selection, masks


@pytest.mark.parametrize("i", CASES)
def test_stability_and_single_mask_pick(fx, i):
    _, cfg, ref, cases = fx
    out = decoded(fx, i)
    assert abs(tpost.stability(out.masks[0], cfg.stability_delta) - float(ref(i, "stability"))) < 1e-6
    assert tpost.single_choice(out.masks, out.iou, cfg) == int(ref(i, "single_choice")) == cases[i]["single_choice"]


@pytest.mark.parametrize("i", CASES)
def test_selected_candidates_and_final_masks(fx, i):
    _, cfg, ref, cases = fx
    c = cases[i]
    out = decoded(fx, i)
    chosen = tpost.choose(out.masks, out.iou, cfg, c["multimask"])
    assert np.abs(out.masks[chosen] - ref(i, "low_res_masks")).max() < 1e-4
    assert np.abs(out.iou[chosen] - ref(i, "iou_scores")).max() < 1e-5
    masks = tpost.to_image(out.masks[chosen], c["width"], c["height"])
    want = ref(i, "masks")
    assert masks.shape == want.shape and masks.dtype == np.bool_
    # logits within 1e-4 of the reference may cross 0 only where the reference's own logit is that close to 0
    assert (masks != want).sum() <= 2
    assert np.abs(masks.sum(axis=(1, 2)) - np.array(c["mask_pixels"])).max() <= 2


def test_stability_of_an_empty_mask_is_one():
    assert tpost.stability(np.full((4, 4), -1.0), 0.05) == 1.0
    assert tpost.stability(np.array([0.1, 0.0, -0.1]), 0.05) == 0.5
