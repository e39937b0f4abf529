"""`sam3 points BUNDLE IMAGE "x,y[,label];..." [--box x1,y1,x2,y2] [--single] [-o overlay.png] [--json] [--reps N]
[--device D]`: the masks of a point/box prompt through the bundle's tracker (docs/sam3-cli.md, docs/sam3-tracker.md
10).

The prompt's text forms (`parse_points`, `parse_box`, `parse_pcase`) are shared with `sam3 check`'s pcase records;
masks in `--json` are COCO's compressed RLE (`sam3.rle.encode`, docs/sam3-tracker.md 10.3).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sam3 import demo as demo_mod
from sam3 import post, preprocess, rle
from sam3.bundle import BundleError
from sam3.npu import DEFAULT_TIMEOUT, Npu, NpuError
from sam3.points import PointMasks, Points, check_prompt
from sam3.tracker_config import TrackerError

SCHEMA = 1

# COCO's string form of run lengths (docs/sam3-tracker.md 10.3): 5 bits a character, 0x20 "more follows", 0x10 the
# sign of the last group, every character offset by 48 ('0').


# ---------------------------------------------------------------------------------------------
# the prompt's text forms


def _numbers(text: str, what: str) -> list[float]:
    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise TrackerError(f"{what} {text!r}: expected comma-separated numbers") from None
    if not all(math.isfinite(v) for v in values):
        raise TrackerError(f"{what} {text!r}: a coordinate is not finite")
    return values


def parse_points(text: str) -> tuple[list[list[float]], list[int]]:
    """`"x,y[,label];..."` as points `[[x, y], ...]` and labels (1 when left out); `""` is no points.

    Raises:
        TrackerError: an item that is not 2 or 3 numbers, or a label that is not the integer 0 or 1.
    """
    points: list[list[float]] = []
    labels: list[int] = []
    items = [item.strip() for item in text.split(";")]
    for k, item in enumerate(items):
        if not item and (k == len(items) - 1 or len(items) == 1):
            continue  # "" or a trailing ";"
        values = _numbers(item, f"point {k + 1}")
        if len(values) not in (2, 3):
            raise TrackerError(f"point {k + 1} {item!r}: expected x,y or x,y,label")
        label = values[2] if len(values) == 3 else 1.0
        if label not in (0.0, 1.0):
            raise TrackerError(f"point {k + 1} {item!r}: the label must be 1 (object) or 0 (background)")
        points.append(values[:2])
        labels.append(int(label))
    return points, labels


def parse_box(text: str) -> list[float]:
    """`"x1,y1,x2,y2"` as 4 numbers.

    Raises:
        TrackerError: not 4 finite numbers.
    """
    values = _numbers(text.strip(), "box")
    if len(values) != 4:
        raise TrackerError(f"box {text!r}: expected x1,y1,x2,y2")
    return values


def parse_pcase(prompt: str) -> tuple[list[list[float]], list[int], list[float] | None]:
    """A pcase record's prompt, `points=<x,y[,l];...> box=<x1,y1,x2,y2>` (docs/sam3-check.md 3.2), either part
    empty or left out: (points, labels, box or None).

    Raises:
        TrackerError: a word that is not `points=` or `box=`, one given twice, or a malformed value.
    """
    fields: dict[str, str] = {}
    for word in prompt.split():
        key, eq, value = word.partition("=")
        if not eq or key not in ("points", "box"):
            raise TrackerError(f"pcase prompt {prompt!r}: {word!r} is not points=... or box=...")
        if key in fields:
            raise TrackerError(f"pcase prompt {prompt!r}: {key}= given twice")
        fields[key] = value
    points, labels = parse_points(fields.get("points", ""))
    box = fields.get("box", "")
    return points, labels, parse_box(box) if box else None


# ---------------------------------------------------------------------------------------------
# output


def _boxes(masks: np.ndarray) -> npt.NDArray[np.float32]:
    """Each mask's bounding box `[x0, y0, x1, y1]` (inclusive pixels), for the overlay's outline."""
    rows, cols = np.asarray(masks.any(axis=2)), np.asarray(masks.any(axis=1))
    h, w = masks.shape[1:]
    y0, y1 = rows.argmax(1), h - 1 - rows[:, ::-1].argmax(1)
    x0, x1 = cols.argmax(1), w - 1 - cols[:, ::-1].argmax(1)
    return np.stack([x0, y0, x1, y1], axis=1).astype(np.float32)


def overlay_instances(found: PointMasks) -> post.Instances:
    """The output masks as `post.Instances` for `post.write_overlay` (empty masks left out, scores the IoUs)."""
    keep = found.masks.any(axis=(1, 2))
    masks = found.masks[keep]
    return post.Instances(np.asarray(found.candidates)[keep], found.iou[keep], _boxes(masks), masks)


def _prompt_line(points: list[list[float]], box: list[float] | None, found: PointMasks, multimask: bool) -> str:
    where = f"{len(points)} point(s), box " + (f"[{', '.join(f'{v:g}' for v in box)}]" if box else "none")
    if multimask:
        return f"{where}: {len(found.candidates)} candidate mask(s)"
    return (f"{where}: 1 mask (single-mask rule: candidate {found.candidates[0]}, stability "
            f"{found.stability:.3f})")


def as_json(found: PointMasks) -> dict[str, Any]:
    """The masks' part of `--json`: `masks` (candidate, iou, pixels, COCO RLE), `object_score_logit`, `stability`."""
    masks = [{"candidate": c, "iou": float(s), "pixels": n, "mask": rle.encode(m)}
             for c, s, n, m in zip(found.candidates, found.iou.tolist(), found.pixels(), found.masks, strict=True)]
    return {"masks": masks, "object_score_logit": float(found.object_score), "stability": float(found.stability)}


# ---------------------------------------------------------------------------------------------
# the command


def _forwards(pts: Points, npu: Npu, reps: int, say: bool, *prompt: Any) -> tuple[PointMasks, list[dict[str, Any]]]:
    """`reps` timed forwards of one prompt (the image side computed by the first); the last one's masks."""
    forwards = []
    for rep in range(reps):
        begin = time.perf_counter()
        found = pts.segment_points(*prompt)
        ms = (time.perf_counter() - begin) * 1e3
        stages = {k: v * 1e3 for k, v in found.timing.items()}
        forwards.append({"ms": ms, "stages_ms": stages, "loads": npu.loads, "evictions": npu.evictions})
        if say:
            times = " ".join(f"{k} {v:.0f}" for k, v in stages.items())
            print(f"forward {rep}: {ms:.0f} ms (stages: {times} ms; contexts loaded {npu.loads}, evicted "
                  f"{npu.evictions})")
    return found, forwards


def _run(args: Any, prog: str) -> int:
    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    points, labels = parse_points(args.points)
    box = parse_box(args.box) if args.box is not None else None
    multimask = not args.single
    rgb = preprocess.load_rgb(args.image)
    check_prompt(points, labels, box, rgb.shape[1], rgb.shape[0])  # before the bundle loads
    start = time.perf_counter()
    device = demo_mod.choose_device(args.device, args.bundle, lambda m: print(f"{prog}: {m}", file=sys.stderr))
    try:
        timeout = demo_mod.EMULATOR_TIMEOUT if device.emulator is not None else DEFAULT_TIMEOUT
        with Npu(args.bundle, device, timeout=timeout) as npu:
            pts = Points.on_npu(npu)
            where = f"emulator ({device.name})" if device.emulator is not None else f"NPU ({device.name})"
            loaded = time.perf_counter() - start
            if not args.json:
                print(f"loaded {args.bundle} ({loaded:.1f} s); mode npu on {where}")
            found, forwards = _forwards(pts, npu, args.reps, not args.json, rgb, points, labels, box, multimask)
    finally:
        device.close()
    doc: dict[str, Any] = {"schema": SCHEMA, "command": "points", "bundle": str(args.bundle), "image": str(args.image),
                           "device": device.name, "load_seconds": loaded, "points": points, "labels": labels,
                           "box": box, "multimask": multimask, "forwards": forwards, **as_json(found)}
    if not args.json:
        print(_prompt_line(points, box, found, multimask))
        print("\n".join(found.lines()))
    if args.overlay:
        path = post.write_overlay(args.overlay, rgb, overlay_instances(found))
        doc["overlay"] = str(path)
        if not args.json:
            print(f"wrote {path}")
    if args.json:
        print(json.dumps(doc, allow_nan=False))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "sam3 points") -> int:
    """`sam3 points`: 0 on success; 1 on bad input or an error (one line `sam3 points: <msg>` on stderr, and with
    --json the JSON error object on stdout); 2 on a usage error."""
    from sam3.cli import UsageParser, _fail

    p = UsageParser(prog=prog, description="The masks of a point/box prompt through the bundle's tracker: 3 "
                                       "candidates, or one by the single-mask stability rule (--single).")
    p.add_argument("bundle", help="the bundle directory (exported with a tracker, tracker=1)")
    p.add_argument("image", help="a JPEG or PNG image")
    p.add_argument("points", help='points in the image\'s pixels, "x,y[,label];..." (label 1 object, the default, '
                                  'or 0 background); "" for a box alone')
    p.add_argument("--box", help="a box x1,y1,x2,y2 in the image's pixels")
    p.add_argument("--single", action="store_true", help="one mask by the stability rule (default: 3 candidates)")
    p.add_argument("-o", "--output", dest="overlay", help="write an overlay image of the masks; format by extension")
    p.add_argument("--reps", type=int, default=1, help="forwards, each timed; later ones reuse the image side")
    p.add_argument("--device", help="emu, emu:<profile> or /dev/accel/N (default: the NPU, else the emulator)")
    p.add_argument("--json", action="store_true", help="one JSON document; masks as COCO compressed RLE")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    def fail(message: str) -> int:       # sam3's one error convention (the JSON object, then the line)
        return _fail("points", message, args.json)

    try:
        return _run(args, prog)
    except BrokenPipeError:
        raise
    except BundleError as e:
        return fail(f"bundle: {e}")
    except NpuError as e:
        return fail(f"NPU: {e}")
    except (ValueError, OSError) as e:  # TrackerError, ImageError, PostError; XdnaError, an unwritable overlay
        return fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
