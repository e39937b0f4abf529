"""Post-processing: the model's outputs -> instances in image pixels, their masks as RLE, and the overlay image.

`instances` is HF's `post_process_instance_segmentation` as taconite-sam3 reproduces it (docs/sam3-segment.md 4):
score = sigmoid(logit) * sigmoid(presence), kept when strictly above the threshold, in query order (no sorting, no
NMS); boxes are the normalised xyxy scaled by (w, h, w, h), unclamped; masks are the sigmoid of the mask logits,
upsampled bilinearly (align_corners=False) to the image and kept where strictly above the mask threshold.
`overlay` draws them as the command line does (docs/sam3-segment.md 6); `rle_encode` / `rle_decode` give a mask
the COCO-style run-length form (docs/sam3-segment.md 5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from amdxdna_direct.errors import Error

_F32 = np.float32
# The overlay's colour cycle, instance k taking COLORS[k % 6], and its box outline width in pixels
# (docs/sam3-segment.md 6).
COLORS = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180))
OUTLINE = 3
# Upsampled planes produced per step: bounds the float32 temporaries of a large image with many instances.
_RESIZE_BLOCK = 1 << 24


class PostError(Error, ValueError):
    """Post-processing input that cannot be used: names the argument, the expected shape or range, and the value."""


@dataclass(frozen=True)
class Instances:
    """The kept instances of one image, in query order.

    Attributes:
        queries: int64 `[n]`, the query index of each instance.
        scores: float32 `[n]`, sigmoid(logit) * sigmoid(presence).
        boxes: float32 `[n, 4]`, xyxy in image pixels (not clamped to the image).
        masks: bool `[n, height, width]`.
    """

    queries: np.ndarray
    scores: np.ndarray
    boxes: np.ndarray
    masks: np.ndarray

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @property
    def height(self) -> int:
        """Image height in pixels."""
        return int(self.masks.shape[1])

    @property
    def width(self) -> int:
        """Image width in pixels."""
        return int(self.masks.shape[2])

    def areas(self) -> npt.NDArray[np.int64]:
        """Mask pixels per instance, int64 `[n]`."""
        areas: npt.NDArray[np.int64] = self.masks.sum(axis=(1, 2), dtype=np.int64)
        return areas

    def lines(self) -> list[str]:
        """One line per instance as `sam3 segment` prints it (docs/sam3-segment.md 7):
        `  score 0.983  box [387.0, 69.5, 498.9, 346.2]  mask 17592 px`."""
        return [f"  score {s:.3f}  box [{b[0]:.1f}, {b[1]:.1f}, {b[2]:.1f}, {b[3]:.1f}]  mask {a} px"
                for s, b, a in zip(self.scores.tolist(), self.boxes.tolist(), self.areas().tolist(), strict=True)]


# ---------------------------------------------------------------------------------------------
# validation


def _size(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PostError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise PostError(f"{what} must be positive, got {value}")
    return int(value)


def _unit(value: Any, what: str) -> np.float32:
    """A threshold: a real number in [0, 1] (NaN refused), as float32, the dtype the scores are compared in."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise PostError(f"{what} must be a number in [0, 1], got {type(value).__name__} {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise PostError(f"{what} must be in [0, 1], got {value!r}")
    return _F32(value)


def _floats(value: Any, what: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """`value` as finite float32 of `shape` (None: any positive length on that axis)."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise PostError(f"{what} must be a real-valued array, got dtype {arr.dtype}")
    want = "[" + ", ".join("n" if s is None else str(s) for s in shape) + "]"
    if arr.ndim != len(shape) or any(s is not None and a != s for a, s in zip(arr.shape, shape, strict=True)):
        raise PostError(f"{what} must have shape {want}, got {list(arr.shape)}")
    if 0 in arr.shape:
        raise PostError(f"{what} is empty: shape {list(arr.shape)} (expected {want} with no zero axis)")
    arr = arr.astype(_F32, copy=False)
    bad = ~np.isfinite(arr)
    if bad.any():
        first = [int(i) for i in np.argwhere(bad)[0]]
        raise PostError(f"{what} has {int(bad.sum())} non-finite value(s); the first is {arr[tuple(first)]} at {first}")
    return arr


def sigmoid(x: np.ndarray) -> npt.NDArray[np.float32]:
    """1 / (1 + exp(-x)) in float32 with the real exp (an overflow to inf gives exactly 0)."""
    x = np.asarray(x, dtype=_F32)
    with np.errstate(over="ignore"):
        y: npt.NDArray[np.float32] = (_F32(1) / (_F32(1) + np.exp(-x))).astype(_F32)
    return y


def scores(logits: np.ndarray, presence: np.ndarray | float) -> npt.NDArray[np.float32]:
    """Instance scores `[Q]`: sigmoid(logit) * sigmoid(presence), float32.

    Raises:
        PostError: `logits` is not a finite `[Q]` vector, or `presence` not one finite value.
    """
    lg = _floats(logits, "logits", (None,))
    pr = _floats(np.reshape(np.asarray(presence), -1), "presence", (1,))
    both: npt.NDArray[np.float32] = sigmoid(lg) * sigmoid(pr)[0]
    return both


def _axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source indices (i0, i1) and weight of each destination index, align_corners=False, in float32
    (docs/sam3-segment.md 4.2): src = max((dst + 0.5) * in/out - 0.5, 0), i0 = min(floor(src), in - 1),
    i1 = min(i0 + 1, in - 1), weight = src - i0."""
    scale = _F32(n_in) / _F32(n_out)
    src = np.maximum((np.arange(n_out, dtype=_F32) + _F32(0.5)) * scale - _F32(0.5), _F32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, (src - i0.astype(_F32)).astype(_F32)


def upsample_bilinear(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of planes `[n, h, w]` to `[n, height, width]` (align_corners=False), float32: along the
    width first, then along the height, two taps each (docs/sam3-segment.md 4.2).

    Raises:
        PostError: `x` is not a finite `[n, h, w]` array with no zero axis, or a size is not a positive integer.
    """
    planes = _floats(x, "planes", (None, None, None))
    height, width = _size(height, "height"), _size(width, "width")
    n, h_in, w_in = planes.shape
    y0, y1, wy = _axis(h_in, height)
    x0, x1, wx = _axis(w_in, width)
    out = np.empty((n, height, width), dtype=_F32)
    step = max(1, _RESIZE_BLOCK // (height * max(width, w_in)))
    for s in range(0, n, step):
        block = planes[s:s + step]
        rows = block[:, :, x0] * (_F32(1) - wx) + block[:, :, x1] * wx
        out[s:s + step] = rows[:, y0] * (_F32(1) - wy)[:, None] + rows[:, y1] * wy[:, None]
    return out


def instances(logits: np.ndarray, presence: np.ndarray | float, boxes: np.ndarray, masks: np.ndarray, width: int,
              height: int, threshold: float = 0.5, mask_threshold: float = 0.5) -> Instances:
    """The instances of a `width x height` image from the model's outputs (docs/sam3-segment.md 4).

    Args:
        logits: `[Q]` classification logits.
        presence: the presence logit (a scalar or `[1]`).
        boxes: `[Q, 4]` normalised xyxy boxes.
        masks: `[Q, S, S']` mask logits (any positive plane size).
        width, height: the image size in pixels.
        threshold: keep a query when its score is strictly above this, in [0, 1].
        mask_threshold: a pixel is on when its upsampled probability is strictly above this, in [0, 1].

    Raises:
        PostError: a shape that disagrees (names the argument, the expected and the given shape), an empty or
            non-finite array, a size that is not a positive integer, or a threshold outside [0, 1].
    """
    thr, mthr = _unit(threshold, "threshold"), _unit(mask_threshold, "mask_threshold")
    width, height = _size(width, "width"), _size(height, "height")
    score = scores(logits, presence)
    q = score.shape[0]
    box = _floats(boxes, "boxes", (q, 4))
    planes = _floats(masks, "masks", (q, None, None))
    keep = np.flatnonzero(score > thr)
    scale = np.array([width, height, width, height], dtype=_F32)
    if keep.size:
        on = upsample_bilinear(sigmoid(planes[keep]), height, width) > mthr
    else:
        on = np.zeros((0, height, width), dtype=bool)
    return Instances(queries=keep.astype(np.int64), scores=score[keep], boxes=box[keep] * scale, masks=on)


def match(reference: np.ndarray, found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy matching of reference masks to found ones, in reference order (docs/sam3-segment.md 7): each
    reference mask takes the unused found mask of highest IoU; with none left its IoU is 0 and its match -1. An
    empty union counts as IoU 1. Returns (IoU float64 `[n_ref]`, found index int64 `[n_ref]`).

    Raises:
        PostError: the two are not `[n, H, W]` stacks of the same image size.
    """
    ref, got = np.asarray(reference), np.asarray(found)
    if ref.ndim != 3 or got.ndim != 3 or ref.shape[1:] != got.shape[1:]:
        raise PostError(f"match: reference {list(ref.shape)} and found {list(got.shape)} masks must be [n, H, W] "
                        "of the same image size")
    a = ref.reshape(ref.shape[0], int(np.prod(ref.shape[1:]))).astype(bool)  # -1 cannot size an empty set
    b = got.reshape(got.shape[0], int(np.prod(got.shape[1:]))).astype(bool)
    inter = a.astype(np.float64) @ b.T.astype(np.float64)  # exact: integer counts far below 2^53
    union = a.sum(1)[:, None] + b.sum(1)[None, :] - inter
    iou = np.divide(inter, union, out=np.ones_like(inter), where=union > 0)
    ious = np.zeros(a.shape[0])
    which = np.full(a.shape[0], -1, dtype=np.int64)
    free = np.ones(b.shape[0], dtype=bool)
    for r in range(a.shape[0]):  # greedy: each choice depends on the earlier ones
        if not free.any():
            break
        j = int(np.argmax(np.where(free, iou[r], -1.0)))
        free[j] = False
        ious[r], which[r] = iou[r, j], j
    return ious, which


# ---------------------------------------------------------------------------------------------
# run-length encoding


def rle_encode(mask: np.ndarray) -> dict[str, list[int]]:
    """A mask `[H, W]` as COCO's uncompressed RLE (docs/sam3-segment.md 5): `{"size": [H, W], "counts": [...]}`,
    the pixels read column by column (Fortran order), counts alternating off / on runs starting with off (a
    first count of 0 when the first pixel is on).

    Raises:
        PostError: `mask` is not a 2-D array with no zero axis.
    """
    m = np.asarray(mask)
    if m.ndim != 2 or 0 in m.shape:
        raise PostError(f"rle_encode: mask must be [H, W] with H, W > 0, got shape {list(m.shape)}")
    flat = m.astype(bool).ravel(order="F")
    edges = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate([[0], edges, [flat.size]])
    counts = np.diff(bounds)
    if flat[0]:
        counts = np.concatenate([[0], counts])
    return {"size": [int(m.shape[0]), int(m.shape[1])], "counts": counts.astype(np.int64).tolist()}


def rle_decode(rle: dict[str, Any]) -> np.ndarray:
    """The bool mask `[H, W]` of an uncompressed RLE as `rle_encode` writes it.

    Raises:
        PostError: `size` is not two positive integers, `counts` not non-negative integers, or the counts do not
            sum to H * W.
    """
    if not isinstance(rle, dict) or "size" not in rle or "counts" not in rle:
        raise PostError(f"rle_decode: expected a dict with 'size' and 'counts', got {type(rle).__name__}")
    size = rle["size"]
    if not isinstance(size, (list, tuple)) or len(size) != 2:
        raise PostError(f"rle_decode: size must be [H, W], got {size!r}")
    h, w = _size(size[0], "rle_decode: size[0] (H)"), _size(size[1], "rle_decode: size[1] (W)")
    counts = np.asarray(rle["counts"])
    if counts.ndim != 1 or (counts.size and counts.dtype.kind not in "iu"):
        raise PostError(f"rle_decode: counts must be a list of integers, got {rle['counts']!r:.80}")
    counts = counts.astype(np.int64)
    if (counts < 0).any():
        raise PostError(f"rle_decode: counts must be non-negative, run {int(np.argmax(counts < 0))} is "
                        f"{int(counts[counts < 0][0])}")
    if int(counts.sum()) != h * w:
        raise PostError(f"rle_decode: counts sum to {int(counts.sum())}, size {h}x{w} has {h * w} pixels")
    values = (np.arange(counts.size) % 2).astype(bool)
    return np.repeat(values, counts).reshape((h, w), order="F")


# ---------------------------------------------------------------------------------------------
# the overlay image


def _rgb(rgb: np.ndarray) -> np.ndarray:
    img = np.asarray(rgb)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3 or 0 in img.shape:
        raise PostError(f"overlay: image must be uint8 [H, W, 3], got {img.dtype} {list(img.shape)}")
    return img


def _corners(box: np.ndarray, width: int, height: int) -> tuple[int, int, int, int]:
    """A box's outline corners: each coordinate rounded half away from zero and raised to >= 0, then the high
    corner lowered to the last column / row (docs/sam3-segment.md 6)."""
    x0, y0, x1, y1 = np.maximum(np.floor(box.astype(np.float64) + 0.5), 0).astype(np.int64).tolist()
    return x0, y0, min(x1, width - 1), min(y1, height - 1)


def overlay(rgb: np.ndarray, found: Instances) -> np.ndarray:
    """The image with every instance drawn in order (docs/sam3-segment.md 6): instance k's colour c is
    COLORS[k % 6]; its mask pixels become (pixel + c) // 2, then its box gets a 3-pixel outline in c (rows
    y0..y0+2 and y1-2..y1 across x0..x1, columns x0..x0+2 and x1-2..x1 down y0..y1, inside the image).
    Returns a new uint8 `[H, W, 3]` array.

    Raises:
        PostError: the image is not uint8 `[H, W, 3]`, or the instances' masks are not of its size.
    """
    img = _rgb(rgb).copy()
    h, w = img.shape[:2]
    if found.masks.shape[1:] != (h, w):
        raise PostError(f"overlay: masks are {list(found.masks.shape[1:])}, the image is [{h}, {w}]")
    for k in range(len(found)):  # in order: each blend reads what the earlier instances drew
        col = np.array(COLORS[k % len(COLORS)], dtype=np.uint16)
        on = found.masks[k]
        img[on] = ((img[on].astype(np.uint16) + col) // 2).astype(np.uint8)
        x0, y0, x1, y1 = _corners(found.boxes[k], w, h)
        c8 = col.astype(np.uint8)
        for rows in (slice(y0, y0 + OUTLINE), slice(max(y1 - OUTLINE + 1, 0), y1 + 1)):
            img[rows, x0:x1 + 1] = c8
        for cols in (slice(x0, x0 + OUTLINE), slice(max(x1 - OUTLINE + 1, 0), x1 + 1)):
            img[y0:y1 + 1, cols] = c8
    return img


def write_overlay(path: str | os.PathLike[str], rgb: np.ndarray, found: Instances) -> Path:
    """Writes `overlay(rgb, found)` to `path`, the format chosen by its extension (Pillow's table). Returns the path.

    Raises:
        PostError: as `overlay`, or an extension Pillow cannot write.
        OSError: the file cannot be written.
    """
    from PIL import Image

    out = Path(path)
    ext = out.suffix.lower()
    fmt = Image.registered_extensions().get(ext)
    if fmt is None or fmt not in Image.SAVE:
        raise PostError(f"overlay {out}: no image format writes extension {ext or '(none)'!r} (use .png, .jpg, ...)")
    Image.fromarray(overlay(rgb, found)).save(out, format=fmt)
    return out
