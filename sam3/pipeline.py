"""`Sam3`: an image and a text prompt in, every matching instance's score, box and mask out (docs/sam3-pipeline.md 7).

    from sam3 import Sam3
    with Sam3("bundle/", device="emu") as sam:
        found = sam.segment("cats.jpg", "cat", threshold=0.5)
        found.scores, found.boxes, found.masks        # numpy, in query order
        for item in sam.segment_many(["a.jpg", "b.png"], ["cat", "dog"]):   # one ImageResult per image
            item.ok, item.error, [r.instances for r in item.results]

The image side (preprocess, ViT, neck) runs once per image and is reused by every prompt on it (the same pixels:
the cache is keyed on a digest of them); the prompt side (tokenizer, text encoder, DETR encoder and decoder, mask
decoder, post-processing) runs per prompt. With a device-resident ViT the text encoder runs on a side thread while
the NPU runs the ViT, as taconite-sam3 does. One `Sam3` may be called from several threads: the NPU stretches of
the calls take turns, the host work around them overlaps, and every call gives what it gives alone
(docs/sam3-segment.md 10).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, TypeVarTuple

import numpy as np
import numpy.typing as npt

from sam3 import decoder as decoder_mod
from sam3 import detr, many, mask, neck, post, preprocess, text, vit
from sam3.bundle import Bundle, consistency
from sam3.npu import DEFAULT_TIMEOUT, Npu, NpuError
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

    def copy(self) -> Timing:
        """Another `Timing` with the same seconds."""
        return Timing(dict(self.stages), dict(self.npu))


@dataclass
class _Spent:
    """One call's NPU work, summed over its stretches under the Npu's lock: seconds per kernel key, contexts loaded
    and evicted."""

    kernels: dict[str, float] = field(default_factory=dict)
    loads: int = 0
    evictions: int = 0


@dataclass
class ImageFeatures:
    """What the image side gives every prompt on that image: its RGB, the ViT output, the neck's levels (never
    written after they are made, so any number of threads may read them)."""

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

    Threads: `segment`, `segment_many`, `encode_image` and `encode_prompt` may be called on one object from any
    number of threads at once, and each call gives exactly what it gives alone. The stages' device buffers and
    per-prompt state serve one call at a time (each NPU stretch of a call holds `Npu.exclusive()`); decoding and
    preprocessing the image, its digest, the text encoder and post-processing run outside it and overlap. `close`
    comes after every call has returned (docs/sam3-segment.md 10).

    A change to any bundle file on disk after the bundle was opened is refused before and after each call that reads
    weights, so no result comes from two bundles' weights (docs/sam3-bundle.md 8.1).

    Args:
        bundle: a bundle directory or an open `Bundle`.
        device: anything `sam3.npu.Npu` accepts ("emu", "/dev/accel/accel0", None: the default device).
        max_contexts, chains, timeout: as `Npu`.
        max_pixels: the largest image file decoded, in pixels (`preprocess.load_rgb`, docs/sam3-segment.md 11.2).

    Raises:
        BundleError: the bundle is invalid or lacks a tensor a stage needs.
        NpuError: a kernel failed to load, or does not fit the params.
        XdnaError: the device could not be opened.
        ValueError: `max_pixels` is not a positive integer (before anything is opened).
    """

    def __init__(self, bundle: Bundle | str | os.PathLike[str], device: Any = None, *, max_contexts: int | None = None,
                 chains: bool | None = None, timeout: float = DEFAULT_TIMEOUT,
                 max_pixels: int = preprocess.MAX_PIXELS):
        self.max_pixels = preprocess.pixel_limit(max_pixels)
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
        # The last image side computed, under its key: replaced by one assignment, so a thread reading it sees
        # one pair or the other, never one image's key with another's features.
        self._cached: tuple[tuple[Any, ...], ImageFeatures] | None = None
        self._closed = False

    def check_bundle(self) -> None:
        """Refuses a call after `close`, and a bundle file changed on disk since the bundle was opened
        (docs/sam3-bundle.md 8.1).

        Raises:
            NpuError: "Sam3: closed".
            BundleError: "<file> changed on disk since the bundle was opened: reopen it".
        """
        if self._closed:
            raise NpuError("Sam3: closed")
        self.bundle.check_unchanged()

    @contextmanager
    def _on_npu(self, spent: _Spent) -> Iterator[None]:
        """One NPU stretch of a call: the stages' buffers and per-prompt state are the call's until it ends, and
        what the Npu's counters gained meanwhile is the call's cost (docs/sam3-segment.md 10.1)."""
        npu = self.npu
        with npu.exclusive():
            seconds, loads, evictions = dict(npu.kernel_seconds), npu.loads, npu.evictions
            try:
                yield
            finally:
                for key, total in npu.kernel_seconds.items():
                    if total != seconds.get(key, 0.0):
                        spent.kernels[key] = spent.kernels.get(key, 0.0) + total - seconds.get(key, 0.0)
                spent.loads += npu.loads - loads
                spent.evictions += npu.evictions - evictions

    # -- the prompt side ------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> Prompt:
        """Tokenises and encodes `prompt` on the host.

        Raises:
            TypeError: a prompt that is not a str. (An empty prompt is framed as [bos, eos]; one longer than
                text_len is truncated with a warning: docs/sam3-host.md 4.3.)
            BundleError: a bundle file changed on disk since the bundle was opened (checked before and after).
            NpuError: "Sam3: closed".
        """
        self.check_bundle()
        encoded = self._encode_prompt(prompt)
        self.check_bundle()
        return encoded

    def _encode_prompt(self, prompt: str) -> Prompt:
        ids, m = self.tokenizer.encode(prompt)
        return Prompt(prompt, ids, m, text.encode_text(ids, m, self.bundle.tensors, self.params))

    # -- the image side -------------------------------------------------------------------------

    def _pixels(self, image: Any) -> tuple[np.ndarray, tuple[Any, ...]]:
        """The image's RGB (a file decoded, or a copy of the array) and its key: the digest of those very pixels,
        so what is reused is what was computed from them (docs/sam3-segment.md 10.2).

        Raises:
            ImageError: a missing, unreadable or corrupt file, or an array that is not uint8 [H, W, 3].
        """
        if isinstance(image, (str, os.PathLike)):
            rgb = preprocess.load_rgb(image, self.max_pixels)
        else:
            rgb = np.asarray(image)
            if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
                raise preprocess.ImageError(f"an image array must be uint8 [H, W, 3], got {rgb.dtype} "
                                            f"{list(rgb.shape)}")
            # A copy: the caller (or another of its threads) writing into the array later cannot change the
            # pixels behind a key.
            rgb = np.array(rgb, order="C", copy=True)
        return rgb, preprocess.image_key(rgb)

    def encode_image(self, image: Any, prompt: str | None = None) -> tuple[ImageFeatures, Prompt | None]:
        """Runs the image side on `image` (a file path or uint8 `[H, W, 3]`); with `prompt`, encodes it meanwhile
        (on a side thread when the ViT is device-resident, so the host works while the NPU does).

        Raises:
            ImageError: a missing, unreadable or corrupt image.
            BundleError: a bundle file changed on disk since the bundle was opened (checked before and after).
            NpuError: a kernel failed, or "Sam3: closed".
        """
        self.check_bundle()
        start = time.perf_counter()
        rgb, key = self._pixels(image)
        out = self._image_side(rgb, key, prompt, _Spent(), time.perf_counter() - start)
        self.check_bundle()
        return out

    def _image_side(self, rgb: np.ndarray, key: tuple[Any, ...], prompt: str | None, spent: _Spent,
                    loaded: float) -> tuple[ImageFeatures, Prompt | None]:
        timing = Timing()
        start = time.perf_counter()
        pixels = preprocess.preprocess(rgb, self.params.image_size)
        timing.add("preprocess", loaded + time.perf_counter() - start)
        pending = None
        if prompt is not None and self.params.vit_device:
            pending = self._side.submit(self._timed_prompt, prompt)
        with self._on_npu(spent):
            start = time.perf_counter()
            vit_out = self.vit.forward(pixels)
            timing.add("vit", time.perf_counter() - start)
            start = time.perf_counter()
            fpn = self.neck.forward(vit_out)
            timing.add("neck", time.perf_counter() - start)
        encoded = None
        if pending is not None:
            encoded, seconds = pending.result()
            timing.add("text", seconds)
        features = ImageFeatures(rgb, vit_out, fpn, timing)
        self._cached = (key, features)
        return features, encoded

    def _timed_prompt(self, prompt: str) -> tuple[Prompt, float]:
        start = time.perf_counter()
        return self._encode_prompt(prompt), time.perf_counter() - start

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

        A second prompt on the same image (the same pixels, from a file or an array) reuses the image side's
        outputs; `prompt` may be one `encode_prompt` returned, which is then not encoded again. Safe from several
        threads at once on one object, each call's result its own (docs/sam3-segment.md 10).

        Raises:
            ImageError: a bad image. PostError: a threshold outside [0, 1]. (An empty prompt is encoded, as by
                `encode_prompt`.)
            BundleError: "<file> changed on disk since the bundle was opened: reopen it" (checked before the
                forward and again before its result is returned).
            NpuError: a kernel failed, or "Sam3: closed".
        """
        self.check_thresholds(threshold, mask_threshold)
        self.check_bundle()
        spent = _Spent()
        start = time.perf_counter()
        rgb, key = self._pixels(image)
        loaded = time.perf_counter() - start
        encoded = prompt if isinstance(prompt, Prompt) else None
        cached = self._cached
        if cached is not None and cached[0] == key:
            features, timing = cached[1], Timing()
            timing.add("preprocess", loaded)
        else:
            features, pending = self._image_side(rgb, key, None if encoded is not None else str(prompt), spent, loaded)
            encoded, timing = encoded or pending, features.timing.copy()
        if encoded is None:
            start = time.perf_counter()
            encoded = self._encode_prompt(str(prompt))
            timing.add("text", time.perf_counter() - start)
        result = self._prompt_side(features, encoded, timing, threshold, mask_threshold, spent)
        self.check_bundle()
        timing.npu = {k: v for k, v in spent.kernels.items() if v > 0}
        result.loads, result.evictions = spent.loads, spent.evictions
        return result

    def segment_many(self, images: Iterable[Any], prompts: Sequence[str] | str, threshold: float = 0.5,
                     mask_threshold: float = 0.5) -> Iterator[many.ImageResult]:
        """Every prompt on every image, one `many.ImageResult` per image in order, the bundle's contexts kept
        loaded throughout (docs/sam3-segment.md 9). The prompts are encoded once, before the first image. An
        image that cannot be read is yielded with its `error` set, and the iteration goes on. Several iterators
        may run on one object from several threads at once (docs/sam3-segment.md 10).

        Raises:
            TokenizerError: a prompt that cannot be encoded (before any image). PostError: a threshold outside
                [0, 1].
            ValueError: no prompts. NpuError: a kernel failed. BundleError: a bundle file changed on disk.
        """
        return many.segment_many(self, images, prompts, threshold, mask_threshold)

    def _prompt_side(self, features: ImageFeatures, prompt: Prompt, timing: Timing, threshold: float,
                     mask_threshold: float, spent: _Spent) -> Result:
        def timed(stage: str, fn: Callable[[*_Args], _R], *args: *_Args) -> _R:
            start = time.perf_counter()
            out = fn(*args)
            timing.add(stage, time.perf_counter() - start)
            return out

        valid = prompt.valid
        # The encoder and the mask decoder hold the prompt set last, and share operand sets with each other and
        # the neck: the whole stretch is one call's.
        with self._on_npu(spent):
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
        """Releases the NPU (contexts, buffers; the device and bundle when opened here). Idempotent. Call it once
        every call on other threads has returned."""
        self._closed = True
        self._side.shutdown(wait=True)
        self.npu.close()

    def __enter__(self) -> Sam3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
