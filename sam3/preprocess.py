"""SAM3 image preprocessing: decode to RGB8, resize to image_size x image_size, normalise to CHW float32.

The resize is the antialiased bilinear resampler of docs/sam3-host.md 3.2: two separable passes in
integer fixed point (horizontal first, uint8 between the passes). Two weight formats exist and differ
by one level on some pixels: ``"int16"`` (adaptive precision, what the SAM3 processor computes, so the
default) and ``"int32"`` (a fixed 22 bits, bit-exact with Pillow's ``Image.resize(..., BILINEAR)``).
Each pass is vectorised over the whole image; the only Python loop is over the filter's taps (a handful).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from amdxdna_direct.errors import Error

# docs/sam3-host.md 3.2: 22 fraction bits at most (8-bit samples, 2 bits of headroom in an int32 sum);
# int16 weights lower the precision until the largest weight fits 15 bits.
_MAX_PRECISION = 22
_WEIGHT_LIMIT = 1 << 15
WEIGHT_FORMATS = ("int16", "int32")
_FORMATS = ("JPEG", "PNG")


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


def load_rgb(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode a JPEG or PNG file to RGB8, [H, W, 3] uint8 (alpha composited over white, docs/sam3-host.md 3.1).

    Raises:
        ImageError: the file is missing or unreadable, not an image, corrupt or truncated, or neither JPEG nor PNG.
    """
    path = Path(path)
    try:
        with Image.open(path) as img:
            if img.format not in _FORMATS:
                raise ImageError(f"image {path}: format {img.format} is not supported (expected JPEG or PNG)")
            img.load()
            return to_rgb(img)
    except ImageError:
        raise
    except FileNotFoundError as exc:
        raise ImageError(f"image {path}: no such file") from exc
    except UnidentifiedImageError as exc:
        raise ImageError(f"image {path}: not a recognised image file") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow reports corrupt or truncated data with these
        raise ImageError(f"image {path}: cannot decode: {exc}") from exc


def to_rgb(img: Image.Image) -> np.ndarray:
    """A decoded Pillow image as RGB8 [H, W, 3] uint8; any other mode goes through RGBA over a white background."""
    if img.mode != "RGB":
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba).convert("RGB")
    return np.asarray(img, dtype=np.uint8).copy()


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


def preprocess_file(path: str | Path, image_size: int) -> np.ndarray:
    """Decode an image file and preprocess it: [3, image_size, image_size] float32.

    Raises:
        ImageError: the file cannot be decoded (see ``load_rgb``).
        ValueError: ``image_size`` is not positive.
    """
    return preprocess(load_rgb(path), image_size)
