"""SAM3 image preprocessing: decode to RGB8, resize to image_size x image_size, normalise to CHW float32.

The resize is the antialiased bilinear resampler of docs/sam3-host.md 3.2: two separable passes in
integer fixed point (horizontal first, uint8 between the passes). Two weight formats exist and differ
by one level on some pixels: ``"int16"`` (adaptive precision, what the SAM3 processor computes, so the
default) and ``"int32"`` (a fixed 22 bits, bit-exact with Pillow's ``Image.resize(..., BILINEAR)``).
Each pass is vectorised over the whole image; the only Python loop is over the filter's taps (a handful).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, ImageOps, JpegImagePlugin, PngImagePlugin

from amdxdna_direct import files
from amdxdna_direct.errors import Error

# docs/sam3-host.md 3.2: 22 fraction bits at most (8-bit samples, 2 bits of headroom in an int32 sum);
# int16 weights lower the precision until the largest weight fits 15 bits.
_MAX_PRECISION = 22
_WEIGHT_LIMIT = 1 << 15
WEIGHT_FORMATS = ("int16", "int32")
# The largest image decoded by default, in pixels (docs/sam3-segment.md 11.2): 8192 x 8192, 64 Mpx; Pillow's own
# decompression-bomb warning starts above it.
MAX_PIXELS = 1 << 26


class ImageError(Error, ValueError):
    """An image file that is missing, unreadable, corrupt or of an unsupported format; the message names it."""


@dataclass(frozen=True)
class Taps:
    """One resampling pass's integer filter: output o = sum over j of input[index[o, j]] * weight[o, j].

    Every output has the same number of taps; those past its support have weight 0 and a clamped index.
    """

    index: np.ndarray   # int64 [out, width]: input coordinate of each tap, clamped into the image
    weight: np.ndarray  # int32 [out, width]: fixed-point weights, sum ~ 2**precision
    precision: int      # fraction bits of the weights


def pixel_limit(max_pixels: int) -> int:
    """``max_pixels`` checked: a positive whole number of pixels (``bool`` is not one).

    Raises:
        ValueError: anything else.
    """
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels <= 0:
        raise ValueError(f"max_pixels must be a positive whole number of pixels, got {max_pixels!r}")
    return max_pixels


def load_rgb(path: str | os.PathLike[str], max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode a JPEG (or multi-picture JPEG) or PNG file to RGB8 [H, W, 3] uint8 as displayed (docs/sam3-segment.md 11).

    The file is opened through ``amdxdna_direct.files`` (a regular file of at most 256 MiB); its size in pixels is
    read from its header and refused above ``max_pixels`` before anything is decoded. The EXIF orientation is
    applied, a multi-picture JPEG gives its first picture, a 16-bit PNG its high bytes, and alpha is composited
    over white (docs/sam3-host.md 3.1).

    Raises:
        ImageError: the file is missing, unreadable or not a regular file, not an image, corrupt or truncated,
            neither JPEG nor PNG, or more than ``max_pixels`` pixels.
        ValueError: ``max_pixels`` is not a positive integer.
    """
    limit = pixel_limit(max_pixels)
    name = files.shown(path)
    try:
        f = files.open_file(path, "image")
    except files.FileRefused as exc:
        raise ImageError(f"image {name}: {exc.reason}") from exc
    except FileNotFoundError as exc:
        raise ImageError(f"image {name}: no such file") from exc
    except OSError as exc:
        raise ImageError(f"image {name}: cannot open: {exc.strerror or exc}") from exc
    with f:
        img = _header(f, name)
        try:
            width, height = img.size
            if width * height > limit:
                raise ImageError(f"image {name}: {width} x {height} = {width * height} pixels, over the limit of "
                                 f"{limit} pixels (max_pixels; --max-pixels on the command line)")
            img.load()
            return to_rgb(_displayed(img))
        except ImageError:
            raise
        except _DECODE_ERRORS as exc:  # Pillow reports corrupt or truncated data with these
            raise ImageError(f"image {name}: cannot decode: {exc}") from exc
        finally:
            img.close()


# What Pillow raises for data it cannot decode (its own Image.open catches the same from a format's reader).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError, struct.error)
# The signatures of the accepted formats (docs/sam3-segment.md 11.1); 16 bytes name any format Pillow knows.
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SIGNATURE = b"\xff\xd8\xff"
_PREFIX = 16


def _header(f: BinaryIO, name: str) -> Image.Image:
    """The image of the open file ``f`` with only its header read: PNG or JPEG (an MPO for a multi-picture one).

    The format's reader is called directly, not through ``Image.open``, whose decompression-bomb check would
    refuse or warn by Pillow's own limit before ours applies (docs/sam3-segment.md 11.2).
    """
    prefix = f.read(_PREFIX)
    f.seek(0)
    try:
        if prefix.startswith(_PNG_SIGNATURE):
            return PngImagePlugin.PngImageFile(f)
        if prefix.startswith(_JPEG_SIGNATURE):
            return JpegImagePlugin.jpeg_factory(f)
    except _DECODE_ERRORS as exc:
        raise ImageError(f"image {name}: cannot decode: {exc}") from exc
    other = _format_of(prefix)
    if other is None:
        raise ImageError(f"image {name}: not a recognised image file")
    raise ImageError(f"image {name}: format {other} is not supported (expected JPEG or PNG)")


def _format_of(prefix: bytes) -> str | None:
    """The Pillow format whose signature ``prefix`` has, found by each reader's own test without decoding."""
    Image.init()
    return next((fmt for fmt in Image.ID if (test := Image.OPEN[fmt][1]) is not None and test(prefix)), None)


def _displayed(img: Image.Image) -> Image.Image:
    """The picture as a viewer shows it: its EXIF orientation applied (transposed, flipped or rotated), as
    transformers' ``load_image`` does; a multi-picture file's first picture (the one opened)."""
    return ImageOps.exif_transpose(img)


def to_rgb(img: Image.Image) -> np.ndarray:
    """A decoded Pillow image as RGB8 [H, W, 3] uint8 (docs/sam3-host.md 3.1).

    RGB as is; a 16-bit or 32-bit greyscale image (``I;16*``, ``I``) by the high byte of each 16-bit sample,
    as Pillow itself reduces 16-bit colour PNGs; any other mode through RGBA over a white background.
    """
    if img.mode in _WIDE_GREY:
        return _grey16_to_rgb(img)
    if img.mode != "RGB":
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba).convert("RGB")
    return np.asarray(img, dtype=np.uint8).copy()


# Pillow's greyscale modes wider than 8 bits: a 16-bit greyscale PNG opens as I;16 (as I in older Pillow).
_WIDE_GREY = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def _grey16_to_rgb(img: Image.Image) -> np.ndarray:
    """16-bit grey samples (clamped into 0..65535 for mode I) to RGB8 by their high byte; a sample equal to the
    PNG's transparent grey value (tRNS) is fully transparent, hence white over the white background."""
    samples = np.clip(np.asarray(img).astype(np.int64), 0, 0xFFFF)
    grey = (samples >> 8).astype(np.uint8)
    clear = img.info.get("transparency")
    if isinstance(clear, int) and not isinstance(clear, bool):
        grey[samples == clear] = 255
    return np.repeat(grey[:, :, None], 3, axis=2)


def bilinear_taps(in_size: int, out_size: int, weights: str = "int16") -> Taps:
    """The fixed-point antialiased triangle filter mapping ``in_size`` samples to ``out_size`` (docs/sam3-host.md 3.2).

    ``weights`` is ``"int16"`` (adaptive precision, the SAM3 processor's) or ``"int32"`` (22 bits, Pillow's).

    Raises:
        ValueError: a size is not positive, or ``weights`` is not one of ``WEIGHT_FORMATS``.
    """
    if in_size <= 0 or out_size <= 0:
        raise ValueError(f"resample sizes must be positive, got {in_size} -> {out_size}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    scale = in_size / out_size
    support = max(scale, 1.0)
    width = int(np.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    stop = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64)
    j = np.arange(width, dtype=np.int64)
    live = j[None, :] < (stop - first)[:, None]
    pos = first[:, None] + j[None, :]
    # the distance is scaled by the reciprocal of the support and the weights summed tap by tap, in order,
    # as the reference resamplers do: a different rounding of either can move a weight across a rounding edge
    w = np.where(live, np.maximum(0.0, 1.0 - np.abs((pos - center[:, None] + 0.5) * (1.0 / support))), 0.0)
    total = np.zeros((out_size, 1))
    for tap in range(width):
        total[:, 0] += w[:, tap]
    w = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
    precision = _precision(float(w.max())) if weights == "int16" else _MAX_PRECISION
    scaled = w * float(1 << precision)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int32)
    return Taps(index=np.minimum(pos, in_size - 1), weight=fixed, precision=precision)


def _precision(max_weight: float) -> int:
    """The largest p <= 22 with trunc(0.5 + max_weight * 2**p) < 2**15."""
    p = 0
    while p < _MAX_PRECISION and int(0.5 + max_weight * (1 << (p + 1))) < _WEIGHT_LIMIT:
        p += 1
    return p


def _resample_axis(img: np.ndarray, taps: Taps, axis: int) -> np.ndarray:
    """One pass along ``axis`` of a uint8 image: sum of taps, rounded by 2**(p-1), shifted by p, clamped to uint8."""
    src = img.astype(np.int32)
    shape = [1] * img.ndim
    shape[axis] = -1
    acc = np.take(src, taps.index[:, 0], axis=axis)
    acc *= taps.weight[:, 0].reshape(shape)
    acc += (1 << taps.precision) >> 1
    for j in range(1, taps.index.shape[1]):
        term = np.take(src, taps.index[:, j], axis=axis)
        term *= taps.weight[:, j].reshape(shape)
        acc += term
    acc >>= taps.precision
    return np.clip(acc, 0, 255).astype(np.uint8)


def resize_rgb(rgb: np.ndarray, height: int, width: int | None = None, weights: str = "int16",
               vertical_first: bool = False) -> np.ndarray:
    """Resize RGB8 [H, W, C] uint8 to [height, width, C] (width defaults to height).

    The SAM3 processor's resize is the default: int16 weights, horizontal pass first. ``weights="int32"``
    gives Pillow's weights, and ``vertical_first`` its other pass order (docs/sam3-host.md 3.2). An axis whose
    size does not change is not resampled (its filter would be the identity).

    Raises:
        ValueError: ``rgb`` is not a [H, W, C] uint8 array, a size is not positive, or ``weights`` is unknown.
    """
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or 0 in rgb.shape:
        raise ValueError(f"expected a non-empty [H, W, C] uint8 image, got dtype {rgb.dtype} shape {rgb.shape}")
    width = height if width is None else width
    passes = [(1, rgb.shape[1], width), (0, rgb.shape[0], height)]
    out = rgb
    for axis, size_in, size_out in passes[::-1] if vertical_first else passes:
        if size_out != size_in:
            out = _resample_axis(out, bilinear_taps(size_in, size_out, weights), axis=axis)
    return out if out is not rgb else rgb.copy()


def normalize(rgb: np.ndarray, mean: float = 0.5, std: float = 0.5) -> np.ndarray:
    """RGB8 [H, W, 3] -> CHW float32 (v * (1/255) - mean) / std, in float32 (docs/sam3-host.md 3.3).

    Raises:
        ValueError: ``rgb`` is not a [H, W, C] uint8 array.
    """
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3:
        raise ValueError(f"expected a [H, W, C] uint8 image, got dtype {rgb.dtype} shape {rgb.shape}")
    v = rgb.transpose(2, 0, 1).astype(np.float32)
    return np.ascontiguousarray((v * np.float32(1 / 255) - np.float32(mean)) / np.float32(std))


def preprocess(rgb: np.ndarray, image_size: int) -> np.ndarray:
    """RGB8 [H, W, 3] uint8 -> the model's input, [3, image_size, image_size] float32.

    Raises:
        ValueError: ``rgb`` is not a [H, W, C] uint8 array, or ``image_size`` is not positive.
    """
    return normalize(resize_rgb(rgb, image_size))


def preprocess_file(path: str | Path, image_size: int, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode an image file and preprocess it: [3, image_size, image_size] float32.

    Raises:
        ImageError: the file cannot be decoded or is over ``max_pixels`` (see ``load_rgb``).
        ValueError: ``image_size`` or ``max_pixels`` is not positive.
    """
    return preprocess(load_rgb(path, max_pixels), image_size)


def image_key(rgb: np.ndarray) -> tuple[Any, ...]:
    """What identifies an image for reuse: the dtype, shape and sha256 of the pixels the image side is computed from
    (docs/sam3-segment.md 10.2). `rgb` must be C-contiguous."""
    return (rgb.dtype.str, rgb.shape, hashlib.sha256(rgb.data).digest())
