"""Point and box prompts: SAM3's tracker path end to end on the host, from a transformers checkpoint
(docs/sam3-tracker.md 7).

    from sam3.points import Points
    pts = Points.from_checkpoint("facebook-sam3/")
    found = pts.segment_points("field.png", [[126, 81], [194, 109]], [1, 0])          # 3 candidates
    found = pts.segment_points("field.png", [], [], box=[90, 67, 126, 90], multimask=False)
    found.masks, found.iou, found.candidates, found.object_score

The image side (preprocess, ViT, tracker neck and the decoder's skip projections) runs once per image and is
kept for the next prompt on the same image; each prompt runs the prompt encoder, the two-way decoder and the
candidate selection. Coordinates are the image's pixels: labels 1 (object) and 0 (background), a box as
x1, y1, x2, y2.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from sam3 import (
    preprocess,
    tracker_bundle,
    tracker_decoder,
    tracker_neck,
    tracker_post,
    tracker_prompt,
    tracker_vit,
    vit,
)
from sam3.bundle import Bundle
from sam3.npu import Npu
from sam3.post import rle_encode
from sam3.tracker_config import F32Array, TrackerConfig, TrackerError, has_tracker, read_config, read_weights

LABELS = (0, 1)


@dataclass(frozen=True)
class PointMasks:
    """One prompt's masks.

    Attributes:
        masks: bool `[n, H, W]`, n = 3 (multimask) or 1.
        iou: float32 `[n]`, the predicted IoU of each mask.
        candidates: which decoder candidate each mask is (0 the single-mask token, 1.. the multimask ones).
        object_score: the object-score logit (positive: an object is there).
        low_res: float32 `[n, side, side]`, the masks' low-resolution logits.
        stability: candidate 0's stability score, which the single-mask rule compares with its threshold.
        timing: seconds per stage of this call (the image side only when it was not reused).
    """

    masks: npt.NDArray[np.bool_]
    iou: F32Array
    candidates: list[int]
    object_score: float
    low_res: F32Array
    stability: float
    timing: dict[str, float] = field(default_factory=dict)

    def pixels(self) -> list[int]:
        """Mask pixels per mask."""
        return [int(n) for n in self.masks.sum(axis=(1, 2))]

    def lines(self) -> list[str]:
        """One line per mask, then the object score: `  candidate 1  iou 0.812  mask 18024 px`."""
        rows = [f"  candidate {c}  iou {s:.3f}  mask {n} px"
                for c, s, n in zip(self.candidates, self.iou.tolist(), self.pixels(), strict=True)]
        return [*rows, f"  object score logit {self.object_score:.3f}"]

    def as_json(self) -> dict[str, Any]:
        """`{"masks": [{"candidate", "iou", "pixels", "mask": COCO RLE}...], "object_score_logit", "stability"}`."""
        masks = [{"candidate": c, "iou": float(s), "pixels": n, "mask": rle_encode(m)}
                 for c, s, n, m in zip(self.candidates, self.iou.tolist(), self.pixels(), self.masks, strict=True)]
        return {"masks": masks, "object_score_logit": self.object_score, "stability": self.stability}


@dataclass(frozen=True)
class ImageSide:
    """What every prompt on one image reuses: the decoder's image embeddings and the image's size."""

    embeddings: list[F32Array]
    width: int
    height: int


def _floats(value: Any, what: str, shape: tuple[int, ...]) -> F32Array:
    arr = np.asarray(value, dtype=np.float64)
    if arr.size == 0 and shape[0] == -1:
        return np.zeros((0, shape[-1]), np.float32)
    arr = arr.reshape(shape)
    if not np.isfinite(arr).all():
        raise TrackerError(f"{what}: not finite: {arr.tolist()}")
    return arr.astype(np.float32)


def check_prompt(points: Any, labels: Any, box: Any, width: int, height: int) -> tuple[F32Array, npt.NDArray[np.int64],
                                                                                       F32Array | None]:
    """The prompt as arrays in image pixels: points `[n, 2]`, labels `[n]`, box `[4]` or None.

    Raises:
        TrackerError: the prompt is empty, a point lies outside the image, a label is not 0 or 1, the counts of
            points and labels differ, or the box is not x1 <= x2, y1 <= y2 inside the image.
    """
    try:
        pts = _floats(points, "points", (-1, 2))
        lab = np.asarray(labels, dtype=np.float64).reshape(-1)
        bx = None if box is None else _floats(box, "box", (4,))
    except (TypeError, ValueError) as e:
        raise TrackerError(f"prompt: points must be [[x, y], ...] and a box [x1, y1, x2, y2] ({e})") from e
    if len(pts) != len(lab):
        raise TrackerError(f"prompt: {len(pts)} point(s) but {len(lab)} label(s)")
    if len(pts) == 0 and bx is None:
        raise TrackerError("prompt: empty (give at least one point or a box)")
    if len(lab) and not np.isin(lab, LABELS).all():
        raise TrackerError(f"prompt: labels must be 1 (object) or 0 (background), got {lab.tolist()}")
    outside = (pts[:, 0] < 0) | (pts[:, 0] >= width) | (pts[:, 1] < 0) | (pts[:, 1] >= height)
    if outside.any():
        x, y = pts[int(np.argmax(outside))].tolist()
        raise TrackerError(f"prompt: point ({x:g}, {y:g}) is outside the {width}x{height} image")
    if bx is not None:
        x1, y1, x2, y2 = bx.tolist()
        if not (0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height):
            raise TrackerError(f"prompt: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) must have x1 <= x2, y1 <= y2 inside "
                               f"the {width}x{height} image")
    return pts, lab.astype(np.int64), bx


class HostImage:
    """The image side on the host from a checkpoint: the float32 ViT (`tracker_vit`) and tracker neck."""

    def __init__(self, weights: Mapping[str, np.ndarray], config: Mapping[str, Any], cfg: TrackerConfig):
        self.weights, self.cfg = weights, cfg
        self.vit_cfg = tracker_vit.VitConfig.from_config(config)
        tracker_vit.prefix(weights)

    def __call__(self, pixels: np.ndarray, timing: dict[str, float]) -> list[F32Array]:
        t0 = time.perf_counter()
        vit_out = tracker_vit.forward(self.weights, self.vit_cfg, pixels)
        t1 = time.perf_counter()
        emb = tracker_neck.image_embeddings(self.weights, self.cfg, vit_out)
        timing.update(vit=t1 - t0, neck=time.perf_counter() - t1)
        return emb


class NpuImage:
    """The image side from a bundle on an `Npu`: the bundle's ViT and the tracker neck on the neck's kernels."""

    def __init__(self, npu: Npu):
        self.vit = vit.Vit(npu)
        self.neck = tracker_neck.NpuNeck(npu)

    def __call__(self, pixels: np.ndarray, timing: dict[str, float]) -> list[F32Array]:
        t0 = time.perf_counter()
        vit_out = self.vit.forward(pixels)
        t1 = time.perf_counter()
        emb = self.neck.forward(vit_out)
        timing.update(vit=t1 - t0, neck=time.perf_counter() - t1)
        return emb


class Points:
    """The tracker path: an image side (`HostImage` or `NpuImage`) and the host prompt encoder, decoder and
    selection over the tracker's tensors (a dict of arrays by checkpoint name).

    Use `Points.from_checkpoint(dir)` (all on the host), `Points.from_bundle(dir, device)` (ViT and neck on the
    NPU, owning its `Npu`; close it) or `Points.on_npu(npu)` (sharing an open one).
    """

    def __init__(self, weights: Mapping[str, np.ndarray], cfg: TrackerConfig,
                 encode: Callable[[np.ndarray, dict[str, float]], list[F32Array]],
                 image_pe: np.ndarray | None = None, owned: Npu | None = None):
        self.weights, self.cfg, self.encode, self._owned = weights, cfg, encode, owned
        self.image_pe = tracker_prompt.image_pe(weights, cfg) if image_pe is None else image_pe
        self.dense = tracker_prompt.dense(weights, cfg)
        self._key: object = None
        self._lock = threading.RLock()
        self._side: ImageSide | None = None

    @classmethod
    def from_tensors(cls, weights: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> Points:
        """All on the host, from a checkpoint's tensors and its parsed config.json.

        Raises:
            TrackerError: the checkpoint has no tracker (config or tensors), or no ViT backbone.
        """
        if not has_tracker(weights):
            raise TrackerError("checkpoint has no tracker tensors (tracker_model.*, tracker_neck.*)")
        cfg = TrackerConfig.from_config(config)
        return cls(weights, cfg, HostImage(weights, config, cfg))

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike[str], *more_dirs: str | os.PathLike[str]) -> Points:
        """All on the host, from a checkpoint directory (config.json and its safetensors files); `more_dirs` add
        tensors kept elsewhere (a checkpoint split in two).

        Raises:
            TrackerError: unreadable config, no tracker, no backbone.
        """
        return cls.from_tensors(read_weights(model_dir, *more_dirs), read_config(model_dir))

    @classmethod
    def on_npu(cls, npu: Npu) -> Points:
        """On an open `Npu` whose bundle has the tracker (`tracker=1`); the `Npu` stays the caller's.

        Raises:
            TrackerError: the bundle has no tracker.
            BundleError: a tracker tensor is missing.
        """
        cfg = tracker_bundle.config(npu.bundle)
        image_pe = np.array(npu.bundle.tensors.get("trk.image_pe", "f32")).reshape(-1, cfg.width)
        return cls(tracker_bundle.weights(npu.bundle, cfg), cfg, NpuImage(npu), image_pe)

    @classmethod
    def from_bundle(cls, bundle: Bundle | str | os.PathLike[str], device: Any = None) -> Points:
        """On a bundle (a directory or an open `Bundle`) on `device` (as `sam3.npu.Npu` takes it); close() it.

        Raises:
            TrackerError: the bundle has no tracker.
            BundleError: the bundle is invalid or lacks a tracker tensor.
            XdnaError: the device could not be opened.
        """
        npu = Npu(bundle, device)
        try:
            out = cls.on_npu(npu)
        except BaseException:
            npu.close()
            raise
        out._owned = npu
        return out

    def close(self) -> None:
        """Releases the `Npu` this object opened (from_bundle). Idempotent."""
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __enter__(self) -> Points:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rgb(self, image: Any) -> tuple[np.ndarray, object]:
        """The pixels and their content key (`preprocess.image_key`: dtype, shape, sha256 of the pixels, as
        `Sam3`'s cache; docs/sam3-segment.md 10.2): a file is decoded each call, so one rewritten with its size
        and mtime kept is not served the old image side."""
        if isinstance(image, (str, os.PathLike)):
            rgb = np.ascontiguousarray(preprocess.load_rgb(Path(image)))
        else:
            rgb = np.ascontiguousarray(np.asarray(image))
            if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
                raise TrackerError(f"image must be a file or an RGB8 [H, W, 3] uint8 array, got {rgb.dtype} "
                                   f"{rgb.shape}")
        return rgb, preprocess.image_key(rgb)

    def image_side(self, image: Any, timing: dict[str, float] | None = None) -> ImageSide:
        """The image side of `image` (a path or an RGB8 array), reused when it is the last image seen.

        Raises:
            ImageError: the file cannot be decoded.
            TrackerError: the array is not RGB8.
        """
        rgb, key = self._rgb(image)
        with self._lock:
            if key == self._key and self._side is not None:
                return self._side
            timing = {} if timing is None else timing
            t0 = time.perf_counter()
            pixels = preprocess.preprocess(rgb, self.cfg.image_size)
            timing["preprocess"] = time.perf_counter() - t0
            emb = self.encode(pixels, timing)
            self._key, self._side = key, ImageSide(emb, int(rgb.shape[1]), int(rgb.shape[0]))
            return self._side

    def decode(self, side: ImageSide, points: Any, labels: Any, box: Any = None, multimask: bool = True,
               timing: dict[str, float] | None = None) -> PointMasks:
        """One prompt on an image side already computed (coordinates in that image's pixels).

        Raises:
            TrackerError: a bad prompt (see `check_prompt`).
        """
        timing = {} if timing is None else timing
        pts, lab, bx = check_prompt(points, labels, box, side.width, side.height)
        t0 = time.perf_counter()
        frame = (side.width, side.height, self.cfg.image_size)
        sparse = tracker_prompt.sparse(self.weights, self.cfg, tracker_prompt.model_frame(pts, *frame), lab,
                                       None if bx is None else tracker_prompt.model_frame(bx.reshape(2, 2), *frame))
        t1 = time.perf_counter()
        out = tracker_decoder.decode(self.weights, self.cfg, side.embeddings, self.image_pe, sparse, self.dense)
        t2 = time.perf_counter()
        chosen = tracker_post.choose(out.masks, out.iou, self.cfg, multimask)
        masks = tracker_post.to_image(out.masks[chosen], side.width, side.height)
        timing.update(prompt=t1 - t0, decoder=t2 - t1, post=time.perf_counter() - t2)
        return PointMasks(masks=masks, iou=out.iou[chosen], candidates=chosen, object_score=out.object_score,
                          low_res=out.masks[chosen], stability=tracker_post.stability(out.masks[0],
                                                                                      self.cfg.stability_delta),
                          timing=timing)

    def segment_points(self, image: Any, points: Sequence[Sequence[float]] | np.ndarray,
                       labels: Sequence[int] | np.ndarray, box: Sequence[float] | np.ndarray | None = None,
                       multimask: bool = True) -> PointMasks:
        """Masks for a point/box prompt on `image` (a JPEG/PNG path or an RGB8 `[H, W, 3]` array).

        Args:
            image: the image; the last one's image side is reused.
            points: `[[x, y], ...]` in the image's pixels (may be empty when a box is given).
            labels: one per point, 1 object or 0 background.
            box: `[x1, y1, x2, y2]` in pixels, or None.
            multimask: three candidates (True), or one by the stability rule (False).

        Raises:
            ImageError: the image file cannot be decoded.
            TrackerError: a bad prompt: empty, a point outside the image, a label other than 0/1, a bad box.
        """
        timing: dict[str, float] = {}
        if not isinstance(image, (str, os.PathLike)):
            rgb = np.asarray(image)
            if rgb.ndim == 3:
                check_prompt(points, labels, box, rgb.shape[1], rgb.shape[0])
        with self._lock:     # one call at a time shares the NPU layer and the cached image side
            side = self.image_side(image, timing)
            return self.decode(side, points, labels, box, multimask, timing)
