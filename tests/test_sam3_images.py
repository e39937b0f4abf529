"""Image decoding as transformers' `load_image` does it (issue 26 item 5; docs/sam3-segment.md 11.1): 16-bit
greyscale PNGs reduced by their high byte as Pillow reduces 16-bit colour ones, the EXIF orientation applied
(boxes and masks in the displayed frame), a multi-picture JPEG (MPO) read as its first picture.

Every image is made here with Pillow (or, for the one PNG colour type Pillow cannot write, byte by byte); the
expectations are Pillow's own decoding of the same samples or numpy's transposes, never `load_rgb` itself.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from sam3 import preprocess
from sam3.build import build
from sam3.pipeline import Sam3

ORIENTATION = 0x0112  # the EXIF tag


def _png(width: int, height: int, depth: int, colour_type: int, samples: np.ndarray) -> bytes:
    """A PNG file written by hand: samples [height, width * channels] big-endian, filter 0 on every row."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + row.tobytes() for row in samples)
    header = struct.pack(">IIBBBBB", width, height, depth, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _grey16() -> np.ndarray:
    """16-bit samples covering the edges of each high byte (0x00ff / 0x0100, 0x7fff / 0x8000, ...)."""
    edges = np.array([0, 1, 255, 256, 257, 1000, 0x7FFF, 0x8000, 0xFEFF, 0xFF00, 0xFFFE, 0xFFFF], np.uint16)
    rng = np.random.default_rng(5)
    return np.concatenate([edges, rng.integers(0, 1 << 16, 36, dtype=np.uint16)]).reshape(6, 8)


# --------------------------------------------------------------------------------------------- 16-bit PNGs


def test_a_16_bit_grey_png_decodes_as_pillow_decodes_the_same_samples_in_16_bit_rgb(tmp_path):
    v = _grey16()
    Image.fromarray(v).save(tmp_path / "grey16.png")  # Pillow writes mode I;16 as a 16-bit greyscale PNG
    with Image.open(tmp_path / "grey16.png") as img:
        assert img.mode == "I;16"
    rgb16 = np.repeat(v[:, :, None], 3, axis=2).reshape(6, 24).astype(">u2")
    (tmp_path / "rgb16.png").write_bytes(_png(8, 6, 16, 2, rgb16))
    with Image.open(tmp_path / "rgb16.png") as img:
        pillow = np.asarray(img.convert("RGB"))  # Pillow reduces 16-bit colour samples to 8 bits itself
    got = preprocess.load_rgb(tmp_path / "grey16.png")
    np.testing.assert_array_equal(got, pillow)
    np.testing.assert_array_equal(got[:, :, 0], (v >> 8).astype(np.uint8))  # the high byte
    assert (got == 255).mean() < 0.5  # not the clipped, mostly white picture of a plain convert("RGB")


def test_an_8_bit_picture_stored_in_16_bits_comes_back_exactly(tmp_path):
    a8 = np.random.default_rng(1).integers(0, 256, (9, 13), dtype=np.uint8)
    Image.fromarray(a8.astype(np.uint16) * 257).save(tmp_path / "g.png")  # v * 257: both bytes are v
    Image.fromarray(a8).save(tmp_path / "g8.png")
    np.testing.assert_array_equal(preprocess.load_rgb(tmp_path / "g.png"), preprocess.load_rgb(tmp_path / "g8.png"))


def test_a_16_bit_grey_png_with_a_transparent_grey_is_white_there(tmp_path):
    v = _grey16()
    Image.fromarray(v).save(tmp_path / "t.png", transparency=1000)
    with Image.open(tmp_path / "t.png") as img:
        assert img.info["transparency"] == 1000
    want = np.where(v == 1000, 255, v >> 8).astype(np.uint8)
    np.testing.assert_array_equal(preprocess.load_rgb(tmp_path / "t.png")[:, :, 1], want)


def test_mode_i_samples_are_clamped_to_16_bits_then_reduced():
    v = np.array([[-5, 0, 255, 256, 65535, 70000, 1 << 30]], np.int32)
    got = preprocess.to_rgb(Image.fromarray(v, mode="I"))
    assert got[0, :, 0].tolist() == [0, 0, 0, 1, 255, 255, 255]


@pytest.mark.parametrize("colour_type, channels", [(4, 2), (6, 4)])
def test_16_bit_pngs_with_alpha_are_composited_by_their_high_bytes(tmp_path, colour_type, channels):
    v = _grey16()
    alpha = np.full_like(v, 0xFFFF)
    alpha[0, :4] = 0  # four transparent pixels: white
    planes = [v] * (channels - 1) + [alpha]
    samples = np.stack(planes, axis=2).reshape(6, 8 * channels).astype(">u2")
    (tmp_path / "a.png").write_bytes(_png(8, 6, 16, colour_type, samples))
    want = np.where(alpha == 0, 255, v >> 8).astype(np.uint8)
    np.testing.assert_array_equal(preprocess.load_rgb(tmp_path / "a.png"), np.repeat(want[:, :, None], 3, axis=2))


# --------------------------------------------------------------------------------------------- EXIF orientation

# What a viewer does for each EXIF orientation, as numpy transposes of the stored [H, W, C] pixels.
DISPLAYED = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # the transverse: across the other diagonal
    8: lambda a: np.rot90(a, 1),
}


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    return exif


@pytest.mark.parametrize("orientation", sorted(DISPLAYED))
def test_the_exif_orientation_of_a_png_is_applied(tmp_path, orientation):
    stored = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    Image.fromarray(stored).save(tmp_path / "o.png", exif=_exif(orientation))
    np.testing.assert_array_equal(preprocess.load_rgb(tmp_path / "o.png"), DISPLAYED[orientation](stored))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_the_exif_orientation_of_a_jpeg_is_applied_as_pillow_applies_it(tmp_path, orientation):
    stored = np.random.default_rng(9).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    Image.fromarray(stored).save(tmp_path / "o.jpg", exif=_exif(orientation), quality=95)
    with Image.open(tmp_path / "o.jpg") as img:
        want = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
        plain = np.asarray(img.convert("RGB"))
    got = preprocess.load_rgb(tmp_path / "o.jpg")
    assert got.shape == DISPLAYED[orientation](plain).shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, DISPLAYED[orientation](plain))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build(tmp_path_factory.mktemp("b") / "dev", "tiny", variant="device-f32")


def test_boxes_and_masks_are_in_the_displayed_frame(root, tmp_path):
    # a picture stored 18 x 30 and shown 30 x 18 (orientation 6, rotated a quarter turn clockwise)
    stored = np.random.default_rng(3).integers(0, 256, (18, 30, 3), dtype=np.uint8)
    Image.fromarray(stored).save(tmp_path / "r.png", exif=_exif(6))
    shown = np.ascontiguousarray(np.rot90(stored, -1))
    with Sam3(root, "emu:npu4") as sam:
        from_file = sam.segment(tmp_path / "r.png", "a cat", threshold=0.0)
        from_array = sam.segment(shown.copy(), "a cat", threshold=0.0)
    assert from_file.masks.shape[1:] == (30, 18)
    np.testing.assert_array_equal(from_file.rgb, shown)
    np.testing.assert_array_equal(from_file.masks, from_array.masks)
    np.testing.assert_array_equal(from_file.boxes, from_array.boxes)
    np.testing.assert_array_equal(from_file.scores, from_array.scores)


# --------------------------------------------------------------------------------------------- multi-picture JPEG


def test_a_multi_picture_jpeg_is_read_as_its_first_picture(tmp_path):
    rng = np.random.default_rng(4)
    first = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    second = 255 - first
    Image.fromarray(first).save(tmp_path / "two.mpo", format="MPO", save_all=True, quality=90,
                                append_images=[Image.fromarray(second)])
    Image.fromarray(first).save(tmp_path / "first.jpg", quality=90)
    Image.fromarray(second).save(tmp_path / "second.jpg", quality=90)
    with Image.open(tmp_path / "two.mpo") as img:
        assert img.format == "MPO" and img.n_frames == 2
    with Image.open(tmp_path / "first.jpg") as img:
        want = np.asarray(img.convert("RGB"))
    with Image.open(tmp_path / "second.jpg") as img:
        other = np.asarray(img.convert("RGB"))
    got = preprocess.load_rgb(tmp_path / "two.mpo")
    np.testing.assert_array_equal(got, want)
    assert np.abs(got.astype(int) - other).mean() > 50


def test_other_formats_are_still_refused_by_name(tmp_path):
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "a.gif")
    with pytest.raises(preprocess.ImageError, match=r"a\.gif: format GIF is not supported \(expected JPEG or PNG\)"):
        preprocess.load_rgb(tmp_path / "a.gif")
