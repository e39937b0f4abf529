"""`sam3 demo`: the whole pipeline on a generated bundle through the NPU layer, its stages checked against numpy.

Two generated bundles of small random weights (cached): a host-ViT one and a device-resident-ViT one with an
f32 residual stream. The ViT runs on both paths, then the neck and the DETR encoder (with random prompt
features) on the device bundle's outputs. Each stage is compared with the same stage computed in float32 numpy
over the bundle's own weights (the packed ones decoded), from the same inputs (docs/sam3-pipeline.md 6).
Then the whole pipeline segments the bundle's reference image for its prompt, and the overlay is drawn enlarged
with each instance's score (docs/sam3-cli.md "sam3 demo"). With `--bundle DIR` all this runs on that bundle
instead (on a real NPU, a compiled one).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from amdxdna_direct import errors
from amdxdna_direct.device import Device, open_device
from sam3 import detr, hostmath, neck, vit
from sam3.build import build_cached
from sam3.bundle import Bundle
from sam3.npu import DEFAULT_TIMEOUT, Npu, NpuError, Stage

# Tolerances on max|npu - numpy float32| / max|numpy|. bf16 keeps 8 significant bits (2^-9 per rounding); a
# stage rounds every activation it hands to the device, and the ViT compounds that over every layer.
TOLERANCE = {"vit": 2e-2, "neck": 2e-2, "detr_enc": 2e-2}
PREBUILT = "brishen/iron-sam3-npu2 (hf download brishen/iron-sam3-npu2 --local-dir sam3)"
VARIANTS = ("host", "device-f32")
# A launch on the emulator runs a numpy model: full-size attention over 5184 tokens takes tens of seconds on a
# small machine, where the hardware takes milliseconds and the 10 s default is the right bound.
EMULATOR_TIMEOUT = 900.0
# The demo's overlay (docs/sam3-cli.md "sam3 demo"): its longer side at least this many pixels; the score threshold
# of the instances it counts; how many queries it shows instead when none is above (random weights); the score
# labels' font size and padding in pixels.
OVERLAY_SIDE = 512
THRESHOLD = 0.5
BEST = 3
LABEL_FONT = 16
LABEL_PAD = 3


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max|got - want| / max|want| (0-safe)."""
    scale = float(np.abs(want).max()) if want.size else 0.0
    return float(np.abs(got - want).max()) / (scale if scale > 0 else 1.0)


def cache_dir() -> Path:
    """Where generated bundles are cached: $SAM3_CACHE, else $XDG_CACHE_HOME/sam3, else ~/.cache/sam3."""
    base = os.environ.get("SAM3_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sam3")
    return Path(base) / "bundles"


def choose_device(device: Any, bundle: str | os.PathLike[str] | None, say: Callable[[str], None]) -> Device:
    """The device to run on: `device` when given; else a real NPU when there is one and a compiled bundle is
    given; else the emulator (saying why when an NPU is present but no bundle).

    Raises:
        XdnaError: the named device cannot be opened.
    """
    if device is not None:
        return open_device(device)
    try:
        dev = open_device(None)
    except errors.NoDeviceError:
        if os.environ.get("AMDXDNA_DEVICE"):
            raise
        return open_device("emu")
    if dev.emulator is None and bundle is None:
        say(f"{dev.name} is an NPU, but generated bundles carry placeholder kernels only the emulator runs: pass "
            f"--bundle DIR with a compiled bundle, e.g. {PREBUILT}. Running on the emulator now.")
        dev.close()
        return open_device("emu")
    return dev


class Demo:
    """Runs the stages of one bundle on an Npu and records each stage's cost and error."""

    def __init__(self, npu: Npu, label: str, seed: int, say: Callable[[str], None]):
        self.npu, self.label, self.say = npu, label, say
        self.rng = np.random.default_rng(seed)
        self.bundle: Bundle = npu.bundle
        self.ok = True

    def _check(self, st: Stage, kind: str, got: np.ndarray, want: np.ndarray) -> None:
        st.max_rel_err = rel_err(got, want)
        st.extra["cosine"] = hostmath.cosine(got, want)
        st.extra["tolerance"] = TOLERANCE[kind]
        st.extra["bundle"] = self.label
        if not st.max_rel_err <= TOLERANCE[kind]:
            self.ok = False
        self.say(f"{st.name}: max rel err {st.max_rel_err:.2e}, cosine {st.extra['cosine']:.6f}")

    def pixels(self) -> np.ndarray:
        side = self.bundle.params.grid * self.bundle.params.patch
        return self.rng.uniform(-1, 1, (3, side, side)).astype(np.float32)

    def vit(self, pixels: np.ndarray) -> np.ndarray:
        path = "device" if self.bundle.params.vit_device else "host"
        encoder = vit.Vit(self.npu)
        g = encoder.g
        with self.npu.stage(f"vit ({path})", "vit", g.tokens, len(encoder.qkv.chunks)) as st:
            out = encoder.forward(pixels)
        self._check(st, "vit", out, vit.reference(self.bundle, pixels))
        return out

    def neck(self, vit_out: np.ndarray) -> list[np.ndarray]:
        stage = neck.Neck(self.npu)
        with self.npu.stage("neck", "neck", stage.s.grid ** 2, len(stage.n_in.chunks)) as st:
            levels = stage.forward(vit_out)
        want = neck.reference(self.bundle, vit_out)
        self._check(st, "neck", np.concatenate([x.ravel() for x in levels]),
                    np.concatenate([x.ravel() for x in want]))
        return levels

    def detr(self, fpn2: np.ndarray) -> np.ndarray:
        p = self.bundle.params
        feats = self.rng.standard_normal((p.text_len, p.d_model)).astype(np.float32)
        valid = np.arange(p.text_len) < max(1, p.text_len // 4)
        feats[~valid] = 0
        enc = detr.Encoder(self.npu)
        with self.npu.stage("detr_enc", "detr_enc", enc.tokens, len(enc.qkv.chunks)) as st:
            enc.set_prompt(feats)
            out = enc.forward(fpn2, valid)
        self._check(st, "detr_enc", out, detr.reference(self.bundle, fpn2, feats, valid))
        return out


def segment_reference_image(root: Path, dev: Device, timeout: float, overlay: str | os.PathLike[str] | None,
                            max_contexts: int | None, chains: bool | None) -> dict[str, Any]:
    """The whole pipeline on the bundle's reference image and prompt; writes the large overlay when asked
    (docs/sam3-cli.md "sam3 demo"): the instances above the threshold or, when none is (random weights), the
    best-scoring queries, each labelled with its score."""
    from PIL import Image

    from sam3.pipeline import Sam3

    with Sam3(root, dev, max_contexts=max_contexts, chains=chains, timeout=timeout) as sam:
        if sam.bundle.ref_image is None or not sam.bundle.ref_prompt:
            raise NpuError(f"{root}: no ref_image / ref_prompt record to segment")
        image, prompt = sam.bundle.ref_image, sam.bundle.ref_prompt
        result = sam.segment(image, prompt, threshold=0.0)  # every query; the kept ones are those above THRESHOLD
    every = result.instances
    found = subset(every, np.flatnonzero(every.scores > np.float32(THRESHOLD)))
    shown, which = found, f"above {THRESHOLD}"
    if not len(found):
        best = np.sort(np.argsort(-every.scores, kind="stable")[:BEST])
        shown, which = subset(every, best), f"the best {len(best)} queries (none above {THRESHOLD})"
    doc: dict[str, Any] = {"image": str(image), "prompt": prompt, "instances": len(found),
                           "scores": [float(x) for x in found.scores], "timing": result.timing.as_dict(),
                           "timing_line": result.timing.line(), "lines": found.lines(), "overlay": None,
                           "shown": {"which": which, "queries": shown.queries.tolist(),
                                     "scores": [float(x) for x in shown.scores]}}
    if overlay:
        picture, labels, scale = large_overlay(result.rgb, shown)
        out = Path(overlay)
        Image.fromarray(picture).save(out, format=overlay_format(out))
        doc.update(overlay=str(out), overlay_size=[picture.shape[1], picture.shape[0]], scale=scale, labels=labels)
    return doc


def overlay_format(path: str | os.PathLike[str]) -> str:
    """The Pillow format that writes `path`'s extension.

    Raises:
        ValueError: no format writes it.
    """
    from PIL import Image

    ext = Path(path).suffix.lower()
    fmt = Image.registered_extensions().get(ext)
    if fmt is None or fmt not in Image.SAVE:
        raise ValueError(f"overlay {path}: no image format writes extension {ext or '(none)'!r} (use .png, .jpg, ...)")
    return fmt


def subset(found: Any, keep: np.ndarray) -> Any:
    """The instances at positions `keep` (query order kept)."""
    from sam3.post import Instances

    return Instances(found.queries[keep], found.scores[keep], found.boxes[keep], found.masks[keep])


def large_overlay(rgb: np.ndarray, found: Any, side: int = OVERLAY_SIDE) -> tuple[np.ndarray, list[dict[str, Any]],
                                                                                  int]:
    """The overlay at a size a person can see (docs/sam3-cli.md "sam3 demo"): the picture enlarged by the
    smallest whole factor k that makes its longer side at least `side` (bilinear, Pillow), the masks by k
    (nearest: each pixel a k x k block) and the boxes times k, drawn as `post.overlay` draws; then each
    instance's score in a label of its colour at its box's top-left corner. Returns (picture, labels
    [{"query", "score", "rect": [x0, y0, x1, y1]}] inclusive, k)."""
    from PIL import Image, ImageDraw, ImageFont

    from sam3 import post

    h, w = rgb.shape[:2]
    k = max(1, -(-side // max(h, w)))
    big = np.asarray(Image.fromarray(rgb).resize((w * k, h * k), Image.Resampling.BILINEAR))
    masks = np.repeat(np.repeat(found.masks, k, axis=1), k, axis=2)
    drawn = post.overlay(big, post.Instances(found.queries, found.scores, found.boxes * np.float32(k), masks))
    img = Image.fromarray(drawn)
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=LABEL_FONT)
    labels = []
    for n, (q, score, box) in enumerate(zip(found.queries.tolist(), found.scores.tolist(), found.boxes.tolist(),
                                            strict=True)):  # one label per instance, each over the earlier ones
        text = f"{score:.2f}"
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        tw, th = right - left + 2 * LABEL_PAD, bottom - top + 2 * LABEL_PAD
        x0 = int(min(max(round(box[0] * k), 0), w * k - tw))
        y0 = int(min(max(round(box[1] * k), 0), h * k - th))
        rect = [x0, y0, x0 + tw - 1, y0 + th - 1]
        colour = post.COLORS[n % len(post.COLORS)]
        draw.rectangle(rect, fill=colour)
        draw.text((x0 + LABEL_PAD - left, y0 + LABEL_PAD - top), text, fill=_ink(colour), font=font)
        labels.append({"query": q, "score": score, "rect": rect})
    return np.asarray(img), labels, k


def _ink(colour: tuple[int, int, int]) -> tuple[int, int, int]:
    """Black text on a light label, white on a dark one (ITU-R BT.601 luma)."""
    r, g, b = colour
    return (0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b > 128 else (255, 255, 255)


def run_demo(device: Any = None, bundle: str | os.PathLike[str] | None = None, *, geometry: str = "tiny",
             max_contexts: int | None = None, chains: bool | None = None, seed: int = 0,
             overlay: str | os.PathLike[str] | None = None,
             say: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Runs the demo and returns its JSON document: the stage checks, then the whole pipeline (image and prompt
    to instances) on the last bundle's reference image, with its overlay written to `overlay` when given.

    Raises:
        BundleError: a bundle is invalid.
        NpuError: a kernel failed to load or run, or the bundle lacks what a stage needs.
        XdnaError: the device could not be opened.
        ValueError: no image format writes the overlay's extension.
    """
    if overlay:
        overlay_format(overlay)  # before any work
    dev = choose_device(device, bundle, say)
    stages: list[dict[str, Any]] = []
    totals = {"loads": 0, "evictions": 0}
    ok = True
    try:
        target = dev.generation or "npu4"
        roots = [Path(bundle)] if bundle is not None else [
            build_cached(cache_dir(), geometry, variant, seed, target=target) for variant in VARIANTS]
        pixels = None
        for root in roots:
            timeout = EMULATOR_TIMEOUT if dev.emulator is not None else DEFAULT_TIMEOUT
            with Npu(root, dev, max_contexts=max_contexts, chains=chains, timeout=timeout) as npu:
                label = root.name
                say(f"{label}: {npu.loads} context(s) loaded on {dev.name}")
                demo = Demo(npu, label, seed, say)
                pixels = demo.pixels() if pixels is None else pixels
                out = demo.vit(pixels)
                if npu.bundle.params.vit_device or bundle is not None:
                    levels = demo.neck(out)
                    demo.detr(levels[2])
                stages += [s.row() for s in npu.stages]
                totals["loads"] += npu.loads
                totals["evictions"] += npu.evictions
                ok = ok and demo.ok
        say("the whole pipeline: the reference image and prompt to instances")
        segment = segment_reference_image(roots[-1], dev, timeout, overlay, max_contexts, chains)
        return {"schema": 1, "device": dev.name, "emulated": dev.emulator is not None,
                "weights": "random (generated)" if bundle is None else "from the bundle",
                "bundles": [str(r) for r in roots], "stages": stages, **totals, "segment": segment, "ok": ok}
    finally:
        dev.close()


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def format_table(doc: dict[str, Any]) -> str:
    """The human-readable report of a demo document."""
    head = (f"{'stage':<14}{'rows':>7}{'chunks':>7}{'EXEC':>7}{'waits':>7}{'in':>11}{'out':>11}{'seconds':>9}"
            f"{'host s':>8}{'max rel err':>13}{'cosine':>10}")
    lines = [f"sam3 demo on {doc['device']} ({'emulator' if doc['emulated'] else 'NPU'}); weights: {doc['weights']}",
             head, "-" * len(head)]
    for s in doc["stages"]:
        err = "n/a" if s["max_rel_err"] is None else f"{s['max_rel_err']:.2e}"
        lines.append(f"{s['name']:<14}{s['rows']:>7}{s['chunks']:>7}{s['exec_cmds']:>7}{s['waits']:>7}"
                     f"{_size(s['bytes_in']):>11}{_size(s['bytes_out']):>11}{s['seconds']:>9.3f}"
                     f"{s['host_seconds']:>8.3f}{err:>13}{s.get('cosine', float('nan')):>10.6f}")
    tol = ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
    lines.append(f"tolerance: max|npu - numpy float32| / max|numpy| <= {tol}")
    lines.append(f"contexts: {doc['loads']} loaded, {doc['evictions']} evicted")
    seg = doc.get("segment")
    if seg:
        weights = "random weights: the instances mean nothing" if doc["weights"].startswith("random") else "weights"
        lines.append(f"segment {seg['image']} {seg['prompt']!r} ({weights}): {seg['instances']} instance(s)")
        lines.append(f"  {seg['timing_line']}")
        lines.extend(seg["lines"])
        if seg["overlay"]:
            w, h = seg["overlay_size"]
            scores = " ".join(f"{x:.2f}" for x in seg["shown"]["scores"])
            lines.append(f"wrote {seg['overlay']} ({w} x {h} px, the image x{seg['scale']}): "
                         f"{seg['shown']['which']}" + (f", scores {scores}" if scores else ""))
    lines.append("result: " + ("OK" if doc["ok"] else "FAILED"))
    return "\n".join(lines)


def progress(enabled: bool) -> Callable[[str], None]:
    """A progress printer to stderr (a no-op when disabled)."""
    def say(message: str) -> None:
        if enabled:
            print(f"sam3: {message}", file=sys.stderr, flush=True)
    return say
