"""The tracker in the bundle (sam3/export_tracker.py, sam3/tracker_bundle.py, the NPU tracker neck): the export of
the sam3-tiny-tracker checkpoint, its params and tensors against the checkpoint, the packed neck against the
float32 reference, and the bundle's point path on the emulator against the transformers reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tracker_fixture as tf
from safetensors.numpy import load_file, save_file

from sam3 import export, tracker_decoder, tracker_neck, tracker_post, tracker_prompt
from sam3.bundle import Bundle
from sam3.export_text import ExportError
from sam3.export_tracker import host_names
from sam3.hostmath import cosine
from sam3.points import Points
from sam3.tracker_bundle import config as bundle_config
from sam3.tracker_bundle import weights as bundle_weights
from sam3.tracker_config import TrackerConfig, TrackerError

CASES = tf.case_indices()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tf.full_checkpoint(tmp_path_factory.mktemp("tracker-ckpt") / "hf")


@pytest.fixture(scope="module")
def bundle_dir(ckpt_dir, tmp_path_factory):
    lines: list[str] = []
    out = export.export(ckpt_dir, tmp_path_factory.mktemp("tracker-bundle") / "b", progress=lines.append)
    (out / "progress.log").write_text("\n".join(lines))
    return out


@pytest.fixture(scope="module")
def bundle(bundle_dir):
    with Bundle.open(bundle_dir) as b:
        yield b


@pytest.fixture(scope="module")
def ref():
    return tf.Reference()


def channels_last(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1).T


def test_the_export_says_what_it_left_out(bundle_dir):
    log = (bundle_dir / "progress.log").read_text().splitlines()
    assert "tracker" in log
    # the mask-input branch (10) and no_memory_embedding; the neck's unused fourth level (4)
    assert "tracker_model 11" in log[-1] and "tracker_neck 4" in log[-1]


def test_tracker_params_come_from_the_tracker_config(bundle):
    p, tc = bundle.params, tf.config()["tracker_config"]
    md = tc["mask_decoder_config"]
    assert p.tracker and p.trk_heads == md["num_attention_heads"] and p.trk_layers == md["num_hidden_layers"]
    assert p.trk_mask_tokens == md["num_multimask_outputs"] + 1
    assert p.trk_out_ch == [md["hidden_size"] // 8, md["hidden_size"] // 4, md["hidden_size"]]
    assert abs(p.trk_stability_delta - 0.05) < 1e-7 and abs(p.trk_stability_thresh - 0.98) < 1e-7
    depths = {name: p.depth(name) for name in p.tracker_mlps()}
    assert depths == {"trk.0.mlp": 2, "trk.1.mlp": 2, **{f"trk.hyper{i}": 3 for i in range(4)},
                      "trk.iou_head": md["iou_head_depth"], "trk.obj_head": 3}


def test_host_tensors_are_the_checkpoints(bundle):
    w = tf.tracker_tensors()
    cfg = TrackerConfig.from_config(tf.config())
    names = list(host_names(cfg, w))
    assert len(names) == len({b for b, _ in names}) > 100
    for b, c in names:
        assert np.array_equal(bundle.tensors.get(b, "f32").reshape(w[c].shape), w[c]), b
    tokens = bundle.tensors.get("trk.tokens", "f32")
    dec = "tracker_model.mask_decoder."
    assert np.array_equal(tokens, np.concatenate([w[dec + "obj_score_token.weight"], w[dec + "iou_token.weight"],
                                                  w[dec + "mask_tokens.weight"]]))
    assert bundle.tensors.get("trk.0.mlp.0.w", "f32").shape == (64, 32)      # torch layout [out, in]
    assert bundle.tensors.get("trk.up1.w", "f32").shape == (32, 8, 2, 2)     # ConvT [Cin, Cout, 2, 2]
    assert bundle.tensors.get("trk.no_mask", "f32").shape == (32,)


def test_the_image_pe_is_the_references(bundle, ref):
    np.testing.assert_allclose(bundle.tensors.get("trk.image_pe", "f32"), channels_last(ref(0, "image_pe")),
                               atol=1e-6)


def test_the_bundle_reads_back_as_the_checkpoint(bundle):
    cfg = bundle_config(bundle)
    want = TrackerConfig.from_config(tf.config())
    assert (cfg.width, cfg.grid, cfg.heads, cfg.layers, cfg.downsample, cfg.multimask_outputs) == \
        (want.width, want.grid, want.heads, want.layers, want.downsample, want.multimask_outputs)
    got, w = bundle_weights(bundle, cfg), tf.tracker_tensors()
    for name, a in got.items():
        assert np.array_equal(a, w[name]), name


def test_the_packed_neck_matches_the_reference(bundle, ref):
    for i in CASES[:2]:
        got = tracker_neck.bundle_reference(bundle, ref(i, "vit_out"))
        for j in range(3):
            want = channels_last(ref(i, f"image_embeddings.{j}"))
            assert got[j].shape == want.shape and cosine(got[j], want) > 0.9999


def test_a_checkpoint_without_tracker_config_exports_no_tracker(tmp_path):
    out = export.export(tf.detector_dir(), tmp_path / "b")
    with Bundle.open(out) as b:
        assert not b.params.tracker and "trk.tokens" not in b.tensors
        with pytest.raises(TrackerError, match="has no tracker"):
            bundle_config(b)


def test_a_tracker_tensor_missing_is_named(ckpt_dir, tmp_path):
    broken = tmp_path / "hf"
    broken.mkdir()
    for f in ckpt_dir.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    t = load_file(ckpt_dir / "model.safetensors")
    del t["tracker_model.mask_decoder.iou_token.weight"]
    save_file(t, broken / "model.safetensors")
    with pytest.raises(ExportError, match="tracker tensor tracker_model.mask_decoder.iou_token.weight missing"):
        export.export(broken, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_a_tracker_neck_scale_the_bundle_cannot_pack_is_refused(ckpt_dir, tmp_path):
    bad = tmp_path / "hf"
    bad.mkdir()
    for f in ckpt_dir.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg["tracker_config"]["vision_config"]["scale_factors"] = [2.0, 2.0, 1.0, 0.5]
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="scale_factors"):
        export.export(bad, tmp_path / "b")


# --------------------------------------------------------------------------------------------- on the emulator


@pytest.fixture(scope="module")
def on_emu(bundle_dir):
    with Points.from_bundle(bundle_dir, "emu") as pts:
        yield pts


@pytest.mark.parametrize("i", CASES)
def test_npu_neck_then_host_decoder_on_the_reference_vit_output(on_emu, ref, i):
    c = {c["index"]: c for c in tf.cases()}[i]
    emb = on_emu.encode.neck.forward(ref(i, "vit_out"))
    for j in range(3):
        assert cosine(emb[j], channels_last(ref(i, f"image_embeddings.{j}"))) > 0.9999
    w, cfg = on_emu.weights, on_emu.cfg
    pts = ref(i, "input_points") if ref.has(i, "input_points") else None
    labels = ref(i, "input_labels") if pts is not None else None
    box = ref(i, "input_boxes") if ref.has(i, "input_boxes") else None
    out = tracker_decoder.decode(w, cfg, emb, on_emu.image_pe, tracker_prompt.sparse(w, cfg, pts, labels, box),
                                 on_emu.dense)
    assert cosine(out.masks, ref(i, "all_low_res_masks")) > 0.9995
    assert np.abs(out.iou - ref(i, "all_iou_scores")).max() < 0.03
    assert abs(out.object_score - float(ref(i, "object_score_logits")[0])) < 0.01
    assert tracker_post.single_choice(out.masks, out.iou, cfg) == c["single_choice"]
    chosen = tracker_post.choose(out.masks, out.iou, cfg, c["multimask"])
    masks, want = tracker_post.to_image(out.masks[chosen], c["width"], c["height"]), ref(i, "masks")
    assert ((masks & want).sum((1, 2)) / (masks | want).sum((1, 2))).min() > 0.98


@pytest.mark.parametrize("i", CASES)
def test_points_end_to_end_on_the_emulator(on_emu, ref, i):
    """From the image file through the bundle's ViT: its bfp16 weights move the masks more than bf16 noise
    does (docs/sam3-tracker.md 8), so the bars are the NPU ViT's: mask IoU > 0.95, IoU score within 0.05."""
    c = {c["index"]: c for c in tf.cases()}[i]
    found = on_emu.segment_points(tf.tracker_dir() / c["image"], c["points"], c["labels"], c["box"], c["multimask"])
    want = ref(i, "masks")
    assert found.candidates == ([1, 2, 3] if c["multimask"] else [c["single_choice"]])
    assert ((found.masks & want).sum((1, 2)) / (found.masks | want).sum((1, 2))).min() > 0.95
    assert np.abs(found.iou - ref(i, "iou_scores")).max() < 0.05
    assert abs(found.object_score - float(ref(i, "object_score_logits")[0])) < 0.05
