"""`Sam3`: an image and a text prompt in, every matching instance's score, box and mask out (docs/sam3-pipeline.md 7).

    from sam3 import Sam3
    with Sam3("bundle/", device="emu") as sam:
        found = sam.segment("cats.jpg", "cat", threshold=0.5)
        found.scores, found.boxes, found.masks        # numpy, in query order
        for item in sam.segment_many(["a.jpg", "b.png"], ["cat", "dog"]):   # one ImageResult per image
            item.ok, item.error, [r.instances for r in item.results]

The image side (preprocess, ViT, neck) runs once per image and is reused by every prompt on it; the prompt side
(tokenizer, text encoder, DETR encoder and decoder, mask decoder, post-processing) runs per prompt. With a
device-resident ViT the text encoder runs on a side thread while the NPU runs the ViT, as taconite-sam3 does.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import numpy as np
import numpy.typing as npt

from sam3 import decoder as decoder_mod
from sam3 import detr, many, mask, neck, post, preprocess, text, vit
from sam3.bundle import Bundle, consistency
from sam3.npu import DEFAULT_TIMEOUT, Npu
from sam3.tokenizer import ClipTokenizer

_Args = TypeVarTuple("_Args")
_R = TypeVar("_R")


@dataclass
class Timing:
    """Seconds per stage (in first-seen order) and NPU seconds per kernel key, as `sam3 segment` prints them."""

    stages: dict[str, float] = field(default_factory=dict)
    npu: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        """Adds `seconds` to `stage`."""
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def line(self) -> str:
        """`stages: <key> <ms> ... ms; npu <total> ms: <kernel> <ms> ...`."""
        stages = " ".join(f"{k} {v * 1e3:.0f}" for k, v in self.stages.items())
        kernels = " ".join(f"{k} {v * 1e3:.0f}" for k, v in self.npu.items())
        return f"stages: {stages} ms; npu {sum(self.npu.values()) * 1e3:.0f} ms: {kernels}"

    def as_dict(self) -> dict[str, Any]:
        """JSON form, in milliseconds."""
        return {"stages_ms": {k: v * 1e3 for k, v in self.stages.items()},
                "npu_ms": {k: v * 1e3 for k, v in self.npu.items()}}


@dataclass
class ImageFeatures:
    """What the image side gives every prompt on that image: its RGB, the ViT output, the neck's levels."""

    rgb: np.ndarray
    vit_out: np.ndarray
    fpn: list[np.ndarray]
    timing: Timing


@dataclass
class Prompt:
    """A tokenised, encoded prompt: ids, mask, validity and the text features `[text_len, d_model]`."""

    text: str
    ids: np.ndarray
    mask: np.ndarray
    feats: np.ndarray

    @property
    def valid(self) -> npt.NDArray[np.bool_]:
        """Booleans `[text_len]`: the valid prefix of the prompt."""
        valid: npt.NDArray[np.bool_] = self.mask != 0
        return valid


@dataclass
class Result:
    """One prompt's instances and what the forward cost."""

    prompt: str
    instances: post.Instances
    rgb: np.ndarray
    timing: Timing
    loads: int
    evictions: int
    decoded: decoder_mod.Decoded | None = None
    mask_logits: mask.Masks | None = None

    @property
    def scores(self) -> np.ndarray:
        """float32 `[n]`: each kept instance's score, in query order."""
        return self.instances.scores

    @property
    def boxes(self) -> np.ndarray:
        """float32 `[n, 4]`: xyxy boxes in image pixels (not clamped)."""
        return self.instances.boxes

    @property
    def masks(self) -> np.ndarray:
        """bool `[n, height, width]`: each instance's mask at the image's size."""
        return self.instances.masks

    def __len__(self) -> int:
        return len(self.instances)


class Sam3:
    """SAM3 over a bundle on a device (the NPU, or the emulator).

    Args:
        bundle: a bundle directory or an open `Bundle`.
        device: anything `sam3.npu.Npu` accepts ("emu", "/dev/accel/accel0", None: the default device).
        max_contexts, chains, timeout: as `Npu`.

    Raises:
        BundleError: the bundle is invalid or lacks a tensor a stage needs.
        NpuError: a kernel failed to load, or does not fit the params.
        XdnaError: the device could not be opened.
    """

    def __init__(self, bundle: Bundle | str | os.PathLike[str], device: Any = None, *, max_contexts: int | None = None,
                 chains: bool | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.npu = Npu(bundle, device, max_contexts=max_contexts, chains=chains, timeout=timeout)
        try:
            self.bundle = self.npu.bundle
            self.params = self.bundle.params
            consistency.check(self.bundle)  # before any stage divides by a param (docs/sam3-bundle.md 12)
            self.tokenizer = ClipTokenizer.from_bundle(self.bundle)
            self.vit = vit.Vit(self.npu)
            self.neck = neck.Neck(self.npu)
            self.encoder = detr.Encoder(self.npu)
            self.decoder = decoder_mod.Decoder(self.npu)
            self.mask_decoder = mask.MaskDecoder(self.npu, convs=self.neck.convs,
                                                 cross=(self.encoder.s, self.encoder.c))
            self._side = ThreadPoolExecutor(1, thread_name_prefix="sam3-text")
        except BaseException:
            self.npu.close()
            raise
        self._image_key: tuple[Any, ...] | None = None
        self._image: ImageFeatures | None = None

    # -- the prompt side ------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> Prompt:
        """Tokenises and encodes `prompt` on the host.

        Raises:
            TypeError: a prompt that is not a str. (An empty prompt is framed as [bos, eos]; one longer than
                text_len is truncated with a warning: docs/sam3-host.md 4.3.)
        """
        ids, m = self.tokenizer.encode(prompt)
        return Prompt(prompt, ids, m, text.encode_text(ids, m, self.bundle.tensors, self.params))

    # -- the image side -------------------------------------------------------------------------

    @staticmethod
    def _key(image: Any) -> tuple[Any, ...]:
        """What identifies an image's content for reuse: a file's path, mtime and size; an array's shape and crc32.

        Raises:
            ImageError: a missing file, or an array that is not uint8 [H, W, 3].
        """
        if isinstance(image, (str, os.PathLike)):
            path = Path(image)
            try:
                st = path.stat()
            except OSError as e:
                raise preprocess.ImageError(f"{path}: {e.strerror or e}") from e
            return ("file", str(path.resolve()), st.st_mtime_ns, st.st_size)
        rgb = np.asarray(image)
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
            raise preprocess.ImageError(f"an image array must be uint8 [H, W, 3], got {rgb.dtype} {list(rgb.shape)}")
        return ("array", rgb.shape, zlib.crc32(np.ascontiguousarray(rgb).data))

    @staticmethod
    def _load(image: Any) -> np.ndarray:
        if isinstance(image, (str, os.PathLike)):
            return preprocess.load_rgb(image)
        return np.ascontiguousarray(image)

    def encode_image(self, image: Any, prompt: str | None = None) -> tuple[ImageFeatures, Prompt | None]:
        """Runs the image side on `image` (a file path or uint8 `[H, W, 3]`); with `prompt`, encodes it meanwhile
        (on a side thread when the ViT is device-resident, so the host works while the NPU does).

        Raises:
            ImageError: a missing, unreadable or corrupt image.
            NpuError: a kernel failed.
        """
        return self._encode_image(image, prompt, self._key(image))

    def _encode_image(self, image: Any, prompt: str | None,
                      key: tuple[Any, ...]) -> tuple[ImageFeatures, Prompt | None]:
        timing = Timing()
        start = time.perf_counter()
        rgb = self._load(image)
        pixels = preprocess.preprocess(rgb, self.params.image_size)
        timing.add("preprocess", time.perf_counter() - start)
        pending = None
        if prompt is not None and self.params.vit_device:
            pending = self._side.submit(self._timed_prompt, prompt)
        start = time.perf_counter()
        vit_out = self.vit.forward(pixels)
        timing.add("vit", time.perf_counter() - start)
        encoded = None
        if pending is not None:
            encoded, seconds = pending.result()
            timing.add("text", seconds)
        start = time.perf_counter()
        fpn = self.neck.forward(vit_out)
        timing.add("neck", time.perf_counter() - start)
        self._image_key, self._image = key, ImageFeatures(rgb, vit_out, fpn, timing)
        return self._image, encoded

    def _timed_prompt(self, prompt: str) -> tuple[Prompt, float]:
        start = time.perf_counter()
        return self.encode_prompt(prompt), time.perf_counter() - start

    # -- both -----------------------------------------------------------------------------------

    @staticmethod
    def check_thresholds(threshold: float, mask_threshold: float) -> None:
        """Refuses a threshold that is not a number in [0, 1].

        Raises:
            PostError: names the threshold and the value.
        """
        for name, value in (("threshold", threshold), ("mask threshold", mask_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise post.PostError(f"{name} must be a number in [0, 1], got {value!r}")

    def segment(self, image: Any, prompt: str | Prompt, threshold: float = 0.5, mask_threshold: float = 0.5) -> Result:
        """Every instance of `prompt` in `image`, in query order, with its score, box (pixels) and mask.

        A second prompt on the same image (the same file unchanged, or the same array object) reuses the image
        side's outputs. `prompt` may be one `encode_prompt` returned, which is then not encoded again.

        Raises:
            ImageError: a bad image. PostError: a threshold outside [0, 1]. (An empty prompt is encoded, as by
                `encode_prompt`.)
            NpuError: a kernel failed.
        """
        self.check_thresholds(threshold, mask_threshold)
        npu_before = dict(self.npu.kernel_seconds)
        loads, evictions = self.npu.loads, self.npu.evictions
        encoded = prompt if isinstance(prompt, Prompt) else None
        key = self._key(image)
        if self._image is not None and self._image_key == key:
            features, timing = self._image, Timing()
        else:
            features, pending = self._encode_image(image, None if encoded is not None else str(prompt), key)
            encoded, timing = encoded or pending, features.timing
        if encoded is None:
            start = time.perf_counter()
            encoded = self.encode_prompt(str(prompt))
            timing.add("text", time.perf_counter() - start)
        result = self._prompt_side(features, encoded, timing, threshold, mask_threshold)
        spent = {k: v - npu_before.get(k, 0.0) for k, v in self.npu.kernel_seconds.items()}
        timing.npu = {k: v for k, v in spent.items() if v > 0}
        result.loads, result.evictions = self.npu.loads - loads, self.npu.evictions - evictions
        return result

    def segment_many(self, images: Iterable[Any], prompts: Sequence[str] | str, threshold: float = 0.5,
                     mask_threshold: float = 0.5) -> Iterator[many.ImageResult]:
        """Every prompt on every image, one `many.ImageResult` per image in order, the bundle's contexts kept
        loaded throughout (docs/sam3-segment.md 9). The prompts are encoded once, before the first image. An
        image that cannot be read is yielded with its `error` set, and the iteration goes on.

        Raises:
            TokenizerError: a prompt that cannot be encoded (before any image). PostError: a threshold outside
                [0, 1].
            ValueError: no prompts. NpuError: a kernel failed.
        """
        return many.segment_many(self, images, prompts, threshold, mask_threshold)

    def _prompt_side(self, features: ImageFeatures, prompt: Prompt, timing: Timing, threshold: float,
                     mask_threshold: float) -> Result:
        def timed(stage: str, fn: Callable[[*_Args], _R], *args: *_Args) -> _R:
            start = time.perf_counter()
            out = fn(*args)
            timing.add(stage, time.perf_counter() - start)
            return out

        valid = prompt.valid
        self.encoder.set_prompt(prompt.feats)
        enc = timed("detr_enc", self.encoder.forward, features.fpn[2], valid)
        dec = timed("detr_dec", self.decoder.forward, enc, prompt.feats, valid)
        self.mask_decoder.set_prompt(prompt.feats)
        out = timed("mask_dec", self.mask_decoder.forward, dec.hidden, features.fpn, enc, valid)
        h, w = features.rgb.shape[:2]
        found = timed("post", post.instances, dec.logits, dec.presence, dec.boxes, out.masks, w, h, threshold,
                      mask_threshold)
        return Result(prompt.text, found, features.rgb, timing, 0, 0, dec, out)

    def close(self) -> None:
        """Releases the NPU (contexts, buffers; the device and bundle when opened here). Idempotent."""
        self._side.shutdown(wait=True)
        self.npu.close()

    def __enter__(self) -> Sam3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
