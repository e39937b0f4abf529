"""Candidate selection and the tracker's masks at image size (docs/sam3-tracker.md 5).

Multimask output is candidates 1.. (the multimask tokens). Single-mask output is candidate 0 when its stability
score, count(logit > delta) / count(logit > -delta), reaches the threshold, else the multimask candidate with the
highest predicted IoU. Masks go from the low-resolution logits straight to the image size by one bilinear resize
(align_corners=False), then logit > 0.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from sam3.post import upsample_bilinear
from sam3.tracker_config import F32Array, TrackerConfig


def stability(logits: np.ndarray, delta: float) -> float:
    """count(logits > delta) / count(logits > -delta) over one mask's logits; 1 when nothing exceeds -delta."""
    x = np.asarray(logits, dtype=np.float32)
    inner = int(np.count_nonzero(x > np.float32(delta)))
    outer = int(np.count_nonzero(x > np.float32(-delta)))
    return inner / outer if outer else 1.0


def single_choice(masks: np.ndarray, iou: np.ndarray, cfg: TrackerConfig) -> int:
    """The candidate single-mask output takes: 0 if it is stable enough (or the rule is off), else 1 + the
    argmax of the multimask candidates' IoU."""
    if not cfg.dynamic_stability or stability(masks[0], cfg.stability_delta) >= cfg.stability_thresh:
        return 0
    return 1 + int(np.argmax(np.asarray(iou)[1:]))


def choose(masks: np.ndarray, iou: np.ndarray, cfg: TrackerConfig, multimask: bool) -> list[int]:
    """The output candidates, in output order: `[1 .. multimask_outputs]` or the single-mask pick."""
    if multimask:
        return list(range(1, len(masks)))
    return [single_choice(masks, iou, cfg)]


def to_image(logits: np.ndarray, width: int, height: int) -> npt.NDArray[np.bool_]:
    """Low-resolution logits `[n, side, side]` to bool masks `[n, height, width]`: bilinear, then > 0.

    Raises:
        PostError: the logits are not finite, or a size is not a positive integer.
    """
    up: F32Array = upsample_bilinear(np.asarray(logits, dtype=np.float32), height, width)
    return up > 0
