"""sam3.preprocess: decoding, the fixed-point antialiased bilinear resize, normalisation.

Oracles: Pillow's own ``Image.resize(BILINEAR)`` (the int32-weight format), a per-pixel loop written from
docs/sam3-host.md 3.2 (the int16 format), filter taps computed by hand, and the sam3-tiny fixture's
decoded images and pixel values (the SAM3 processor's output).
"""

from __future__ import annotations

import json
import math

import numpy as np
import PIL
import pytest
from fixture_files import REPO_FIXTURES
from PIL import Image

from sam3.preprocess import (
    ImageError,
    bilinear_taps,
    load_rgb,
    normalize,
    preprocess,
    preprocess_file,
    resize_rgb,
)

TINY = REPO_FIXTURES / "sam3-tiny"


def _tiny(rel: str):
    path = TINY / rel
    if not path.exists():
        pytest.skip(f"fixture {path} absent (tests/fixtures incomplete in this checkout)")
    return path


def _pillow_vertical_first(h: int, w: int, oh: int, ow: int) -> bool:
    """Pillow 13 runs the vertical pass first when the height shrinks by more than twice what the width does."""
    if int(PIL.__version__.split(".")[0]) < 13:
        return False
    return h - oh > 0 and h - oh > 2 * (w - ow)


def _loop_resize(img: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """docs/sam3-host.md 3.2, int16 weights, one pixel at a time: the slow, obvious oracle."""

    def taps(n_in: int, n_out: int):
        scale = n_in / n_out
        support = max(scale, 1.0)
        rows = []
        for o in range(n_out):
            c = (o + 0.5) * scale
            lo, hi = max(int(c - support + 0.5), 0), min(int(c + support + 0.5), n_in)
            ws = [max(0.0, 1.0 - abs((i - c + 0.5) / support)) for i in range(lo, hi)]
            rows.append((lo, [w / sum(ws) for w in ws]))
        wmax = max(max(ws) for _, ws in rows)
        p = 0
        while p < 22 and int(0.5 + wmax * 2 ** (p + 1)) < 32768:
            p += 1
        return [(lo, [math.floor(w * 2**p + 0.5) for w in ws]) for lo, ws in rows], p

    def one_pass(src: np.ndarray, n_out: int) -> np.ndarray:  # along axis 1
        table, p = taps(src.shape[1], n_out)
        out = np.zeros((src.shape[0], n_out, src.shape[2]), dtype=np.uint8)
        for y in range(src.shape[0]):
            for x, (lo, ws) in enumerate(table):
                for ch in range(src.shape[2]):
                    acc = (1 << (p - 1)) + sum(int(src[y, lo + j, ch]) * w for j, w in enumerate(ws))
                    out[y, x, ch] = min(max(acc >> p, 0), 255)
        return out

    out = one_pass(img, ow) if ow != img.shape[1] else img
    out = one_pass(out.transpose(1, 0, 2), oh).transpose(1, 0, 2) if oh != img.shape[0] else out
    return out


def _image(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth gradient plus noise: exercises both flat regions and edges."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], axis=-1)
    return np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8)


# --- filter taps, by hand ---------------------------------------------------------------------------------

def test_taps_downscale_by_two_by_hand():
    # 4 -> 2: scale 2, support 2; output 0 centres at 1.0 and reads inputs 0..2 with weights 3/7, 3/7, 1/7.
    taps = bilinear_taps(4, 2)
    assert taps.precision == 16  # 3/7 * 2**17 + 0.5 would reach 32768
    assert taps.index[0, :3].tolist() == [0, 1, 2]
    assert taps.weight[0].tolist() == [28087, 28087, 9362, 0, 0]
    pil = bilinear_taps(4, 2, weights="int32")
    assert pil.precision == 22
    assert pil.weight[0].tolist() == [1797559, 1797559, 599186, 0, 0]


def test_taps_upscale_keeps_support_one_and_clamps_at_the_edges():
    taps = bilinear_taps(2, 4)  # scale 0.5, support 1
    assert taps.precision == 14  # the largest weight is 1 at the border
    # output 0 centres at 0.25: taps from trunc(-0.25) = 0 to trunc(1.75) = 1, input 0 only -> weight 1
    assert taps.weight[0].tolist() == [1 << 14, 0, 0]
    # output 1 centres at 0.75: inputs 0 and 1, weights 3/4 and 1/4
    assert taps.weight[1, :2].tolist() == [12288, 4096]
    assert int(taps.index.max()) == 1  # padding taps stay inside the image


def test_taps_reject_bad_arguments():
    with pytest.raises(ValueError, match=r"resample sizes must be positive, got 0 -> 3"):
        bilinear_taps(0, 3)
    with pytest.raises(ValueError, match=r"weights 'float': expected one of int16, int32"):
        bilinear_taps(3, 2, weights="float")


# --- the resampler against Pillow and the loop oracle -----------------------------------------------------

SIZES = [((150, 200), (168, 168)), ((224, 160), (168, 168)), ((37, 91), (64, 13)), ((1, 5), (7, 1)),
         ((97, 61), (200, 61)), ((61, 97), (61, 200)), ((240, 40), (20, 38)), ((33, 33), (1, 1)),
         ((20, 2500), (7, 37))]  # the last: ~140 taps per output


@pytest.mark.parametrize(("src", "dst"), SIZES)
def test_int32_weights_are_pillow_bilinear_bit_for_bit(src, dst):
    img = _image(*src, seed=src[0] * 7 + dst[1])
    (h, w), (oh, ow) = src, dst
    want = np.asarray(Image.fromarray(img).resize((ow, oh), Image.BILINEAR))
    got = resize_rgb(img, oh, ow, weights="int32", vertical_first=_pillow_vertical_first(h, w, oh, ow))
    assert got.dtype == np.uint8 and got.shape == (oh, ow, 3)
    np.testing.assert_array_equal(got, want)


def test_int32_weights_match_pillow_on_random_sizes():
    rng = np.random.default_rng(11)
    for _ in range(40):
        h, w, oh, ow = (int(v) for v in rng.integers(1, 160, 4))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(img).resize((ow, oh), Image.BILINEAR))
        got = resize_rgb(img, oh, ow, weights="int32", vertical_first=_pillow_vertical_first(h, w, oh, ow))
        np.testing.assert_array_equal(got, want, err_msg=f"{h}x{w} -> {oh}x{ow}")


@pytest.mark.parametrize(("src", "dst"), [((15, 20), (17, 17)), ((22, 16), (9, 30)), ((5, 40), (12, 6)),
                                          ((3, 700), (2, 9))])
def test_int16_weights_match_the_per_pixel_oracle(src, dst):
    img = _image(*src, seed=3)
    np.testing.assert_array_equal(resize_rgb(img, *dst), _loop_resize(img, *dst))


def test_int16_and_int32_weights_differ_by_at_most_one_level():
    img = _image(150, 200, seed=5)
    a = resize_rgb(img, 168).astype(int)
    b = resize_rgb(img, 168, weights="int32").astype(int)
    assert np.abs(a - b).max() == 1  # they do differ (the fixture test shows which one the model wants)


def test_same_size_is_a_copy_and_width_defaults_to_height():
    img = _image(12, 12, seed=1)
    out = resize_rgb(img, 12)
    np.testing.assert_array_equal(out, img)
    assert out is not img
    assert resize_rgb(_image(20, 30, seed=2), 8).shape == (8, 8, 3)


def test_resize_rejects_bad_images():
    with pytest.raises(ValueError, match=r"expected a non-empty \[H, W, C\] uint8 image, got dtype float32"):
        resize_rgb(np.zeros((4, 4, 3), np.float32), 2)
    with pytest.raises(ValueError, match=r"shape \(4, 4\)"):
        resize_rgb(np.zeros((4, 4), np.uint8), 2)
    with pytest.raises(ValueError, match=r"resample sizes must be positive, got 4 -> 0"):
        resize_rgb(np.zeros((4, 4, 3), np.uint8), 0)


# --- normalisation --------------------------------------------------------------------------------------

def test_normalize_maps_0_255_to_minus_one_one_channels_first():
    rgb = np.array([[[0, 128, 255]]], dtype=np.uint8)
    out = normalize(rgb)
    assert out.dtype == np.float32 and out.shape == (3, 1, 1)
    np.testing.assert_allclose(out.ravel(), [-1.0, 128 / 127.5 - 1.0, 1.0], atol=1e-6)
    with pytest.raises(ValueError, match=r"expected a \[H, W, C\] uint8 image"):
        normalize(np.zeros((2, 2, 3), np.int32))


def test_preprocess_is_resize_then_normalize():
    img = _image(30, 50, seed=9)
    out = preprocess(img, 21)
    assert out.shape == (3, 21, 21) and out.dtype == np.float32
    np.testing.assert_array_equal(out, normalize(resize_rgb(img, 21)))


# --- decoding -------------------------------------------------------------------------------------------

def test_load_png_and_jpeg(tmp_path):
    img = _image(20, 30, seed=4)
    Image.fromarray(img).save(tmp_path / "a.png")
    np.testing.assert_array_equal(load_rgb(tmp_path / "a.png"), img)
    Image.fromarray(img).save(tmp_path / "a.jpg", quality=95)
    jpg = load_rgb(tmp_path / "a.jpg")
    assert jpg.shape == (20, 30, 3) and jpg.dtype == np.uint8
    np.testing.assert_array_equal(jpg, np.asarray(Image.open(tmp_path / "a.jpg").convert("RGB")))


def test_alpha_is_composited_over_white_and_grey_widened(tmp_path):
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)   # opaque: kept
    rgba[0, 1] = (10, 20, 30, 0)     # transparent: white
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    out = load_rgb(tmp_path / "a.png")
    assert out[0, 0].tolist() == [10, 20, 30]
    assert out[0, 1].tolist() == [255, 255, 255]
    Image.fromarray(np.full((3, 3), 77, np.uint8), "L").save(tmp_path / "g.png")
    assert load_rgb(tmp_path / "g.png").tolist() == [[[77, 77, 77]] * 3] * 3


def test_decoding_errors_name_the_file(tmp_path):
    missing = tmp_path / "none.png"
    with pytest.raises(ImageError, match=rf"image {missing}: no such file"):
        load_rgb(missing)
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"not an image at all")
    with pytest.raises(ImageError, match=rf"image {junk}: not a recognised image file"):
        load_rgb(junk)
    Image.fromarray(_image(64, 64, seed=6)).save(tmp_path / "full.png")
    cut = tmp_path / "cut.png"
    cut.write_bytes((tmp_path / "full.png").read_bytes()[:300])
    with pytest.raises(ImageError, match=rf"image {cut}: cannot decode"):
        load_rgb(cut)
    Image.fromarray(_image(4, 4, seed=6)).save(tmp_path / "a.bmp")
    with pytest.raises(ImageError, match=r"a\.bmp: format BMP is not supported \(expected JPEG or PNG\)"):
        preprocess_file(tmp_path / "a.bmp", 8)


# --- the sam3-tiny fixture: the SAM3 processor's own output ---------------------------------------------

def _cases():
    return json.loads(_tiny("cases.json").read_text())["cases"]


def _image_size() -> int:
    proc = json.loads(_tiny("hf/processor_config.json").read_text())["image_processor"]
    assert proc["size"]["height"] == proc["size"]["width"]
    assert proc["image_mean"] == [0.5] * 3 and proc["image_std"] == [0.5] * 3 and proc["resample"] == 2
    return proc["size"]["height"]


def test_fixture_decoding_matches_the_reference_rgb():
    ref = np.load(_tiny("reference.npz"))
    for case in _cases():
        np.testing.assert_array_equal(load_rgb(TINY / case["image"]), ref[f"case.{case['index']}.rgb"])


def test_fixture_pixel_values_check_line():
    """The check line: 0 values with |diff| > 1e-4 against the processor's pixel values, for every case."""
    ref = np.load(_tiny("reference.npz"))
    size = _image_size()
    for case in _cases():
        got = preprocess_file(TINY / case["image"], size)
        want = ref[f"case.{case['index']}.pixel_values"]
        assert got.shape == want.shape
        assert int((np.abs(got - want) > 1e-4).sum()) == 0, case["image"]


def test_fixture_rejects_pillow_weights_and_the_other_pass_order():
    """Either Pillow's weights or a vertical-first order changes hundreds of values: the check would fail."""
    ref = np.load(_tiny("reference.npz"))
    size = _image_size()
    case = _cases()[0]
    rgb = ref[f"case.{case['index']}.rgb"]
    want = ref[f"case.{case['index']}.pixel_values"]
    for kwargs in ({"weights": "int32"}, {"vertical_first": True}):
        got = normalize(resize_rgb(rgb, size, **kwargs))
        assert int((np.abs(got - want) > 1e-4).sum()) > 100, kwargs
