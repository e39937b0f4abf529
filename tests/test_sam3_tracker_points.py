"""`sam3.points`: the tracker path end to end from the checkpoint (host ViT, tracker neck, prompt encoder, decoder,
selection, masks) against the sam3-tiny-tracker reference for its 4 cases; the image side's reuse; the checkpoint
layout facebook/sam3 ships (`sam3_video`); and every documented bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tracker_fixture as tf
from safetensors.numpy import save_file

from sam3 import preprocess, tracker_vit
from sam3.points import Points, check_prompt
from sam3.post import rle_decode
from sam3.preprocess import ImageError
from sam3.tracker_config import TrackerError

CASES = tf.case_indices()


@pytest.fixture(scope="module")
def pts():
    return Points.from_checkpoint(tf.tracker_dir() / "hf", tf.detector_dir())


@pytest.fixture(scope="module")
def fx():
    return tf.Reference(), {c["index"]: c for c in tf.cases()}


def run(pts, c, multimask=None):
    return pts.segment_points(tf.tracker_dir() / c["image"], c["points"], c["labels"], c["box"],
                              c["multimask"] if multimask is None else multimask)


@pytest.mark.parametrize("i", CASES)
def test_host_vit_matches_the_reference(pts, fx, i):
    ref, _ = fx
    out = tracker_vit.forward(pts.weights, pts.encode.vit_cfg, ref(i, "pixel_values"))
    assert np.abs(out - ref(i, "vit_out")).max() < 1e-5 * np.abs(ref(i, "vit_out")).max()
    assert np.abs(preprocess.preprocess(ref(i, "rgb"), pts.cfg.image_size) - ref(i, "pixel_values")).max() < 1e-6


@pytest.mark.parametrize("i", CASES)
def test_each_case_end_to_end(pts, fx, i):
    ref, cases = fx
    c = cases[i]
    found = run(pts, c)
    want = ref(i, "masks")
    assert found.masks.shape == want.shape
    assert (found.masks != want).sum() <= 2          # float32 rounding may flip a pixel whose logit is ~0
    assert np.abs(found.iou - ref(i, "iou_scores")).max() < 1e-5
    assert abs(found.object_score - float(ref(i, "object_score_logits")[0])) < 1e-5
    assert abs(found.pixels()[0] - c["mask_pixels"][0]) <= 2
    if c["multimask"]:
        assert found.candidates == [1, 2, 3]
        assert 1 + int(np.argmax(found.iou)) == c["best_multimask"]
    else:
        assert found.candidates == [c["single_choice"]]
    assert abs(found.stability - c["stability"]) < 1e-4


@pytest.mark.parametrize("i", CASES)
def test_the_other_mode_picks_by_the_rule(pts, fx, i):
    ref, cases = fx
    c = cases[i]
    found = run(pts, c, multimask=not c["multimask"])
    if c["multimask"]:       # single mask: the rule's pick, as the reference computed it
        assert found.candidates == [int(ref(i, "single_choice"))]
    else:
        assert found.candidates == [1, 2, 3]


def test_the_image_side_is_reused_for_the_next_prompt(pts, fx):
    _, cases = fx
    c = cases[0]
    run(pts, c)
    again = pts.segment_points(tf.tracker_dir() / c["image"], [[10, 10]], [1])
    assert "vit" not in again.timing and "decoder" in again.timing
    rgb = preprocess.load_rgb(tf.tracker_dir() / c["image"])
    first = pts.segment_points(rgb, c["points"], c["labels"], multimask=False)
    assert "vit" not in first.timing                  # the file's pixels as an array: the same content, reused
    flipped = np.ascontiguousarray(rgb[::-1])
    assert "vit" in pts.segment_points(flipped, c["points"], c["labels"], multimask=False).timing
    second = pts.segment_points(rgb.copy(), c["points"], c["labels"], multimask=False)
    assert "vit" in second.timing and np.array_equal(first.masks, second.masks)


def test_a_rewritten_file_with_its_mtime_kept_is_not_served_the_old_image(pts, fx, tmp_path):
    """The image side is keyed on the decoded pixels, not the path, size and mtime (docs/sam3-tracker.md)."""
    import os

    from PIL import Image

    _, cases = fx
    c = cases[0]
    rgb = preprocess.load_rgb(tf.tracker_dir() / c["image"])
    path = tmp_path / "photo.png"
    Image.fromarray(rgb).save(path)
    before = pts.segment_points(path, c["points"], c["labels"], multimask=False)
    stat = path.stat()
    Image.fromarray(np.ascontiguousarray(rgb[::-1])).save(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = pts.segment_points(path, c["points"], c["labels"], multimask=False)
    want = pts.segment_points(np.ascontiguousarray(rgb[::-1]), c["points"], c["labels"], multimask=False)
    assert "vit" in after.timing and np.array_equal(after.masks, want.masks)
    assert not np.array_equal(after.masks, before.masks)


def test_threads_on_one_points_object_give_the_serial_results(pts, fx):
    from concurrent.futures import ThreadPoolExecutor

    _, cases = fx
    rgb = preprocess.load_rgb(tf.tracker_dir() / cases[0]["image"])
    images = [rgb, np.ascontiguousarray(rgb[::-1]), np.ascontiguousarray(rgb[:, ::-1])]
    calls = [(images[k % 3], cases[k % len(cases)]) for k in range(12)]

    def one(call):
        image, c = call
        return pts.segment_points(image, c["points"], c["labels"], c["box"], c["multimask"])

    serial = [one(call) for call in calls]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(one, calls))
    for a, b in zip(serial, threaded, strict=True):
        assert np.array_equal(a.masks, b.masks) and np.array_equal(a.iou, b.iou)


def test_json_and_lines(pts, fx):
    _, cases = fx
    c = cases[1]
    found = run(pts, c)
    doc = json.loads(json.dumps(found.as_json()))
    assert [m["candidate"] for m in doc["masks"]] == [1, 2, 3]
    assert [m["pixels"] for m in doc["masks"]] == found.pixels()
    assert np.array_equal(rle_decode(doc["masks"][0]["mask"]), found.masks[0])
    assert doc["object_score_logit"] == found.object_score
    lines = found.lines()
    assert lines[0].startswith("  candidate 1  iou ") and lines[-1].startswith("  object score logit -")


def test_the_sam3_video_layout_reads_the_same(tmp_path, pts, fx):
    """facebook/sam3's layout: config.json with detector_config + tracker_config, the detector's tensors under
    `detector_model.`."""
    ref, cases = fx
    cfg = tf.config()
    tracker = cfg.pop("tracker_config")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "sam3_video", "detector_config": cfg,
                                                      "tracker_config": tracker}))
    detector = tf.tensors(tf.detector_dir())
    save_file({"detector_model." + k: v for k, v in detector.items()}, tmp_path / "model-00001-of-00002.safetensors")
    shutil.copy(next((tf.tracker_dir() / "hf").glob("*.safetensors")), tmp_path / "model-00002-of-00002.safetensors")
    video = Points.from_checkpoint(tmp_path)
    c = cases[2]
    found = video.segment_points(tf.tracker_dir() / c["image"], c["points"], c["labels"], c["box"])
    assert (found.masks != ref(2, "masks")).sum() <= 2


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("points", "labels", "box", "match"), [
    ([], [], None, "empty"),
    ([[200, 10]], [1], None, r"point \(200, 10\) is outside the 200x150 image"),
    ([[-1, 10]], [1], None, "outside"),
    ([[10, 10]], [2], None, "labels must be 1 .object. or 0 .background., got \\[2.0\\]"),
    ([[10, 10]], [1, 0], None, r"1 point\(s\) but 2 label\(s\)"),
    ([], [], [50, 10, 20, 40], "x1 <= x2"),
    ([], [], [0, 0, 10, 151], "inside the 200x150 image"),
    ([[10, float("nan")]], [1], None, "not finite"),
    ([[1, 2, 3]], [1], None, "points must be"),
])
def test_bad_prompts_are_one_line_errors(points, labels, box, match):
    with pytest.raises(TrackerError, match=match) as e:
        check_prompt(points, labels, box, 200, 150)
    assert "\n" not in str(e.value)


def test_a_bad_prompt_on_an_array_fails_before_the_vit(pts):
    rgb = np.zeros((150, 200, 3), np.uint8)
    with pytest.raises(TrackerError, match="outside"):
        pts.segment_points(rgb, [[500, 1]], [1])


def test_bad_images_are_refused(pts, tmp_path):
    with pytest.raises(ImageError, match="no such file"):
        pts.segment_points(tmp_path / "absent.png", [[1, 1]], [1])
    with pytest.raises(TrackerError, match="RGB8"):
        pts.segment_points(np.zeros((4, 4), np.uint8), [[1, 1]], [1])


def test_a_checkpoint_without_a_tracker_or_a_backbone_is_refused(tmp_path):
    with pytest.raises(TrackerError, match="no tracker_config|no tracker tensors"):
        Points.from_checkpoint(tf.detector_dir())
    (tmp_path / "config.json").write_text((tf.tracker_dir() / "hf" / "config.json").read_text())
    save_file(tf.tracker_tensors(), tmp_path / "model.safetensors")
    with pytest.raises(TrackerError, match="no ViT backbone"):
        Points.from_checkpoint(tmp_path)
