"""sam3.post: instances from the model's outputs (against the sam3-tiny fixture's own post-processing, and values
worked by hand), the bilinear resize, RLE, greedy matching, the overlay PNG, and every documented input error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixture_files import REPO_FIXTURES
from PIL import Image

from sam3 import post
from sam3.post import COLORS, Instances, PostError

TINY = REPO_FIXTURES / "sam3-tiny"


def _cases() -> list[dict]:
    path = TINY / "cases.json"
    return json.loads(path.read_text())["cases"] if path.is_file() else []


@pytest.fixture(scope="module")
def reference():
    path = TINY / "reference.npz"
    if not path.is_file():
        pytest.skip(f"fixture {path} absent (tests/fixtures incomplete in this checkout)")
    with np.load(path) as z:
        yield {k: z[k] for k in z.files}


@pytest.mark.parametrize("tag", ["thr50", "thrx"])
@pytest.mark.parametrize("index", [c["index"] for c in _cases()] or [pytest.param(0, marks=pytest.mark.skip(
    reason="tests/fixtures/sam3-tiny/cases.json absent"))])
def test_fixture_instances(reference, index, tag):
    """The fixture's raw outputs through `instances` give its post-processed instances: the same queries (found by
    their boxes in pred_boxes, not by score), scores, boxes within 0.01 px, masks within 0.1% of the pixels."""
    case = next(c for c in _cases() if c["index"] == index)
    r = {k[len(f"case.{index}."):]: v for k, v in reference.items() if k.startswith(f"case.{index}.")}
    w, h = case["width"], case["height"]
    got = post.instances(r["pred_logits"], r["presence"], r["pred_boxes"], r["pred_masks"], w, h,
                         float(r[f"{tag}.threshold"]))
    want_boxes, want_masks = r[f"{tag}.boxes"], r[f"{tag}.masks"]
    n = want_boxes.shape[0]
    if tag == "thrx":
        assert n == case["instances"][str(float(r["thrx.threshold"]))] and n > 0
    assert len(got) == n
    # which query each reference instance is: the one whose scaled box it is
    scaled = r["pred_boxes"] * np.array([w, h, w, h], np.float32)
    queries = np.argmin(np.abs(scaled[None] - want_boxes[:, None]).max(axis=2), axis=1)
    np.testing.assert_array_equal(got.queries, queries)
    np.testing.assert_allclose(got.scores, r[f"{tag}.scores"], rtol=0, atol=1e-6)
    if n:
        assert np.abs(got.boxes - want_boxes).max() < 0.01
        assert got.masks.shape == (n, h, w)
        differ = (got.masks != want_masks.astype(bool)).reshape(n, -1).mean(axis=1)
        assert differ.max() <= 0.001


def test_upsample_matches_hand_values():
    """A 2x2 plane to 4x4 (align_corners=False): the edges replicate, the inner samples sit a quarter between."""
    x = np.array([[[0, 1], [2, 3]]], np.float32)
    want = np.array([[0, 0.25, 0.75, 1], [0.5, 0.75, 1.25, 1.5], [1.5, 1.75, 2.25, 2.5], [2, 2.25, 2.75, 3]])
    np.testing.assert_allclose(post.upsample_bilinear(x, 4, 4)[0], want, atol=1e-6)
    # 3 -> 2 columns: src = (dst + 0.5) * 1.5 - 0.5 = 0.25 and 1.75
    row = np.array([[[10, 20, 40]]], np.float32)
    np.testing.assert_allclose(post.upsample_bilinear(row, 1, 2)[0, 0], [12.5, 35], atol=1e-5)


def test_upsample_identity_and_separable():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    np.testing.assert_array_equal(post.upsample_bilinear(x, 5, 7), x)
    # separable: resizing a product of a row and a column profile is the product of the resized profiles
    col, row = rng.random(6).astype(np.float32), rng.random(4).astype(np.float32)
    plane = (col[:, None] * row[None, :])[None]
    up = post.upsample_bilinear(plane, 11, 9)[0]
    c = post.upsample_bilinear(col[None, :, None], 11, 1)[0, :, 0]
    r = post.upsample_bilinear(row[None, None, :], 1, 9)[0, 0]
    np.testing.assert_allclose(up, c[:, None] * r[None, :], rtol=1e-5)


def _outputs(q: int = 3, side: int = 4):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(q).astype(np.float32), np.float32(0.3),
            rng.random((q, 4)).astype(np.float32), rng.standard_normal((q, side, side)).astype(np.float32))


def test_threshold_is_strict_and_order_kept():
    # sigmoid(0) = 0.5 exactly and sigmoid(40) = 1.0 in float32: a score of exactly 0.5
    logits = np.array([3.0, 0.0, -3.0, 2.0], np.float32)
    boxes = np.array([[-0.1, 0.2, 1.3, 0.9], [0, 0, 1, 1], [0.5, 0.5, 0.6, 0.6], [0.1, 0.1, 0.2, 0.2]], np.float32)
    masks = np.zeros((4, 2, 2), np.float32)
    got = post.instances(logits, 40.0, boxes, masks, 10, 20, threshold=0.5)
    np.testing.assert_array_equal(got.queries, [0, 3])
    np.testing.assert_allclose(got.scores, 1 / (1 + np.exp(-logits[[0, 3]])), rtol=1e-6)
    np.testing.assert_allclose(got.boxes[0], [-1.0, 4.0, 13.0, 18.0], rtol=1e-6)  # scaled, not clamped
    assert got.masks.shape == (2, 20, 10) and not got.masks.any()  # sigmoid(0) = 0.5 is not > 0.5
    assert list(post.instances(logits, 40.0, boxes, masks, 10, 20, threshold=0.49).queries) == [0, 1, 3]
    none = post.instances(logits, 40.0, boxes, masks, 10, 20, threshold=1.0)
    assert len(none) == 0 and none.masks.shape == (0, 20, 10) and none.boxes.shape == (0, 4)


def test_presence_scales_scores():
    logits, _, boxes, masks = _outputs()
    got = post.instances(logits, -2.0, boxes, masks, 8, 8, threshold=0.0)
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(got.scores, sig / (1 + np.exp(2.0)), rtol=1e-6)


def test_masks_are_upsampled_probabilities():
    """A pixel is on where the bilinear upsample of sigmoid(logits) exceeds the mask threshold."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 6, 6)).astype(np.float32)
    prob = 1 / (1 + np.exp(-logits))
    got = post.instances(np.array([5, 5], np.float32), 5.0, np.zeros((2, 4), np.float32), logits, 13, 9,
                         threshold=0.5, mask_threshold=0.6)
    np.testing.assert_array_equal(got.masks, post.upsample_bilinear(prob, 9, 13) > np.float32(0.6))
    assert got.masks.any() and not got.masks.all()


def test_lines_format():
    found = Instances(queries=np.array([4]), scores=np.array([0.98349], np.float32),
                      boxes=np.array([[387.04, 69.5, 498.94, 346.2]], np.float32), masks=np.ones((1, 3, 5), bool))
    assert found.lines() == ["  score 0.983  box [387.0, 69.5, 498.9, 346.2]  mask 15 px"]
    assert (found.width, found.height, len(found)) == (5, 3, 1)


@pytest.mark.parametrize("change, message", [
    ({"logits": np.zeros((3, 1), np.float32)}, "logits must have shape [n], got [3, 1]"),
    ({"boxes": np.zeros((3, 3), np.float32)}, "boxes must have shape [3, 4], got [3, 3]"),
    ({"boxes": np.zeros((2, 4), np.float32)}, "boxes must have shape [3, 4], got [2, 4]"),
    ({"masks": np.zeros((2, 4, 4), np.float32)}, "masks must have shape [3, n, n], got [2, 4, 4]"),
    ({"masks": np.zeros((3, 0, 0), np.float32)}, "masks is empty: shape [3, 0, 0]"),
    ({"masks": np.zeros((3, 16), np.float32)}, "masks must have shape [3, n, n], got [3, 16]"),
    ({"logits": np.zeros(0, np.float32)}, "logits is empty"),
    ({"presence": np.zeros(2, np.float32)}, "presence must have shape [1], got [2]"),
    ({"logits": np.array([0, np.nan, 1], np.float32)}, "logits has 1 non-finite value(s); the first is nan at [1]"),
    ({"masks": np.full((3, 4, 4), "a")}, "masks must be a real-valued array"),
    ({"threshold": -0.1}, "threshold must be in [0, 1], got -0.1"),
    ({"threshold": 1.5}, "threshold must be in [0, 1], got 1.5"),
    ({"threshold": float("nan")}, "threshold must be in [0, 1], got nan"),
    ({"threshold": True}, "threshold must be a number in [0, 1], got bool True"),
    ({"mask_threshold": 2}, "mask_threshold must be in [0, 1], got 2"),
    ({"width": 0}, "width must be positive, got 0"),
    ({"height": 2.5}, "height must be an integer, got float 2.5"),
])
def test_instances_errors(change, message):
    logits, presence, boxes, masks = _outputs()
    args = {"logits": logits, "presence": presence, "boxes": boxes, "masks": masks, "width": 8, "height": 6,
            "threshold": 0.5, "mask_threshold": 0.5} | change
    with pytest.raises(PostError) as e:
        post.instances(**args)
    assert message in str(e.value)


def test_upsample_errors():
    with pytest.raises(PostError, match=r"planes is empty: shape \[1, 0, 3\]"):
        post.upsample_bilinear(np.zeros((1, 0, 3), np.float32), 2, 2)
    with pytest.raises(PostError, match="width must be positive, got -1"):
        post.upsample_bilinear(np.zeros((1, 2, 3), np.float32), 2, -1)


# ---------------------------------------------------------------------------------------------
# RLE


def test_rle_by_hand():
    # column-major: [[0, 1], [1, 1]] reads 0, 1, 1, 1
    assert post.rle_encode(np.array([[0, 1], [1, 1]])) == {"size": [2, 2], "counts": [1, 3]}
    assert post.rle_encode(np.ones((1, 2), bool)) == {"size": [1, 2], "counts": [0, 2]}
    assert post.rle_encode(np.zeros((3, 2), bool)) == {"size": [3, 2], "counts": [6]}
    # [[1, 0, 0], [1, 1, 0]] by columns: 1 1 | 0 1 | 0 0
    assert post.rle_encode(np.array([[1, 0, 0], [1, 1, 0]]))["counts"] == [0, 2, 1, 1, 2]


def test_rle_round_trip():
    rng = np.random.default_rng(5)
    for shape in ((1, 1), (7, 3), (40, 55)):
        mask = rng.random(shape) > 0.6
        rle = post.rle_encode(mask)
        assert sum(rle["counts"]) == mask.size
        np.testing.assert_array_equal(post.rle_decode(rle), mask)
    assert json.loads(json.dumps(rle)) == rle


@pytest.mark.parametrize("rle, message", [
    ({"size": [2, 2], "counts": [1, 2]}, "counts sum to 3, size 2x2 has 4 pixels"),
    ({"size": [2, 2], "counts": [5, -1]}, "counts must be non-negative, run 1 is -1"),
    ({"size": [2, 2], "counts": [1.5, 2.5]}, "counts must be a list of integers"),
    ({"size": [0, 2], "counts": []}, "size[0] (H) must be positive, got 0"),
    ({"size": [2], "counts": [2]}, "size must be [H, W], got [2]"),
    ({"counts": [4]}, "expected a dict with 'size' and 'counts'"),
])
def test_rle_decode_errors(rle, message):
    with pytest.raises(PostError) as e:
        post.rle_decode(rle)
    assert message in str(e.value)


def test_rle_encode_errors():
    with pytest.raises(PostError, match=r"mask must be \[H, W\] with H, W > 0, got shape \[0, 4\]"):
        post.rle_encode(np.zeros((0, 4), bool))
    with pytest.raises(PostError, match=r"got shape \[2, 2, 2\]"):
        post.rle_encode(np.zeros((2, 2, 2), bool))


def test_match_greedy_in_reference_order():
    a = np.zeros((3, 4, 4), bool)
    a[0, :2], a[1, :3], a[2, 3] = True, True, True
    found = np.stack([a[1], a[0]])  # found 0 is reference 1's mask, found 1 reference 0's
    ious, which = post.match(a, found)
    np.testing.assert_array_equal(which, [1, 0, -1])
    np.testing.assert_allclose(ious, [1.0, 1.0, 0.0])
    empty = np.zeros((1, 4, 4), bool)
    assert post.match(empty, empty)[0][0] == 1.0  # an empty union counts as IoU 1
    with pytest.raises(PostError, match="same image size"):
        post.match(a, np.zeros((1, 4, 5), bool))


# ---------------------------------------------------------------------------------------------
# the overlay


def _scene():
    rng = np.random.default_rng(9)
    h, w = 30, 40
    rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    masks = np.zeros((2, h, w), bool)
    masks[0, 10:20, 5:15] = True
    masks[1, 14:24, 10:30] = True  # overlaps mask 0 in rows 14..19, columns 10..14
    boxes = np.array([[4.6, 8.4, 16.5, 21.49],   # corners round to (5, 8) and (17, 21)
                      [-3.0, 12.0, 55.0, 26.2]],  # clamps to (0, 12) and (39, 26)
                     np.float32)
    found = Instances(queries=np.array([2, 7]), scores=np.array([0.9, 0.8], np.float32), boxes=boxes, masks=masks)
    return rgb, found


def _outline(h: int, w: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
    """The 3-px outline of a box, pixel by pixel (the test's own drawing)."""
    yy, xx = np.mgrid[0:h, 0:w]
    inside = (xx >= x0) & (xx <= x1) & (yy >= y0) & (yy <= y1)
    near = (yy < y0 + 3) | (yy > y1 - 3) | (xx < x0 + 3) | (xx > x1 - 3)
    return inside & near


def test_overlay_png(tmp_path):
    rgb, found = _scene()
    h, w = rgb.shape[:2]
    path = post.write_overlay(tmp_path / "out.png", rgb, found)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (w, h) and im.mode == "RGB"
        img = np.asarray(im)
    line0, line1 = _outline(h, w, 5, 8, 17, 21), _outline(h, w, 0, 12, 39, 26)
    m0, m1 = found.masks
    c0, c1 = (np.array(c, np.int32) for c in COLORS[:2])
    orig = rgb.astype(np.int32)
    changed = (img != rgb).any(axis=2)
    # nothing changes outside the masks and outlines
    assert not changed[~(m0 | m1 | line0 | line1)].any()
    # mask pixels off the outlines: one blend, or two where the masks overlap (0 first)
    only0 = m0 & ~m1 & ~line0 & ~line1
    only1 = m1 & ~m0 & ~line0 & ~line1
    both = m0 & m1 & ~line0 & ~line1
    assert only0.any() and only1.any() and both.any()
    np.testing.assert_array_equal(img[only0], (orig[only0] + c0) // 2)
    np.testing.assert_array_equal(img[only1], (orig[only1] + c1) // 2)
    np.testing.assert_array_equal(img[both], ((orig[both] + c0) // 2 + c1) // 2)
    # outline 1 is drawn last: its colour exactly; outline 0 where mask 1 does not cover it, else blended by it
    assert (img[line1] == c1).all()
    plain0 = line0 & ~line1 & ~m1
    assert plain0.any() and (img[plain0] == c0).all()
    covered0 = line0 & ~line1 & m1
    assert covered0.any() and (img[covered0] == (c0 + c1) // 2).all()
    # the clamped box's outline runs along the image's left and right edges
    assert (img[12:27, 0] == c1).all() and (img[12:27, w - 1] == c1).all() and (img[12:27, w - 3] == c1).all()


def test_overlay_formats_and_errors(tmp_path):
    rgb, found = _scene()
    jpg = post.write_overlay(tmp_path / "out.JPG", rgb, found)
    with Image.open(jpg) as im:
        assert im.format == "JPEG" and im.size == (rgb.shape[1], rgb.shape[0])
    with pytest.raises(PostError, match=r"no image format writes extension '\.xyz'"):
        post.write_overlay(tmp_path / "out.xyz", rgb, found)
    with pytest.raises(PostError, match=r"no image format writes extension '\(none\)'"):
        post.write_overlay(tmp_path / "out", rgb, found)
    with pytest.raises(PostError, match=r"masks are \[30, 40\], the image is \[30, 41\]"):
        post.overlay(np.zeros((30, 41, 3), np.uint8), found)
    with pytest.raises(PostError, match=r"image must be uint8 \[H, W, 3\], got float32 \[30, 40, 3\]"):
        post.overlay(rgb.astype(np.float32), found)
    none = Instances(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, 4), np.float32),
                     np.zeros((0, 30, 40), bool))
    np.testing.assert_array_equal(post.overlay(rgb, none), rgb)
