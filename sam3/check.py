"""`sam3 check BUNDLE`: the bundle's own references against this runtime, piece by piece (docs/sam3-check.md).

Three sections, in this order, one line per check (`  [ok] name: detail`, `  [FAIL] ...`, `  [skip] ...` when the
bundle lacks what a check compares against, `  [info] ...` for what is reported but never fails):
- host pieces: the bfp16 packer, the tokenizer, resize + normalise, image decoding, the text encoder;
- stages, each fed the float32 reference's own inputs (so a stage is judged alone): ViT, neck, DETR encoder,
  DETR decoder, mask decoder, through one `Sam3` whose contexts load once;
- end to end: every case record's image file and prompt through `Sam3.segment`, its instances matched by mask
  IoU to the reference's.
A tracker bundle (`tracker=1`) adds the tracker's stages (its neck, prompt encoder and two-way decoder on the
`ref.trk.*` references) and its pcase records (points/box prompts end to end through `sam3.points`).
The last line is `ALL CHECKS PASSED` or `FAILED: <name>, ...`.

    from sam3.check import run_check
    report = run_check("bundle/", "emu")
    report.ok, report.failed, report.as_dict()
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from sam3 import demo as demo_mod
from sam3 import post, preprocess, text, tracker_bundle, tracker_decoder, tracker_neck, tracker_post, tracker_prompt
from sam3.bundle import Bundle, BundleError
from sam3.hostmath import cosine
from sam3.npu import DEFAULT_TIMEOUT, NpuError
from sam3.pack import pack_b
from sam3.pipeline import Sam3
from sam3.points import Points
from sam3.points_cli import parse_pcase
from sam3.tokenizer import ClipTokenizer
from sam3.tracker_config import F32Array

SCHEMA = 1
SECTIONS = {
    "host": "host pieces:",
    "stages": "stages, each on the float32 reference's inputs:",
    "cases": "end to end (image file + prompt -> instances) against the reference cases:",
}

# The pass bars (docs/sam3-check.md 2): cosines are strict lower bounds, differences strict upper bounds.
PIXEL_TOL = 1e-4
TEXT_COS = 0.9999
VIT_COS = 0.98
NECK_COS = 0.995
ENC_COS = 0.99
HIDDEN_COS = 0.999
CONFIDENT = 0.1
BOX_TOL = 0.01
LOGIT_TOL = 0.1
PRESENCE_TOL = 0.05
MASK_COS = 0.995
SEMANTIC_COS = 0.99
# A case's defaults when the bundle gives no case.<i>.threshold / .margin / .min_iou (docs/sam3-check.md 3).
CASE_THRESHOLD = 0.5
CASE_MARGIN = 0.0
CASE_MIN_IOU = 0.97
MASK_THRESHOLD = 0.5
SCORE_TOL = 0.03
# The tracker's bars (docs/sam3-check.md 2.1, 3.2). The neck's are the detector neck's (NECK_COS).
TRK_SPARSE_TOL = 1e-4
TRK_MASK_COS = 0.9999
TRK_IOU_TOL = 1e-3
TRK_OBJ_TOL = 1e-2
# A pcase's defaults when the bundle gives no pcase.<i>.min_iou / .other_iou / .iou_tol: candidates the reference
# rates at least WELL_RATED (and its best) are "chosen".
PCASE_MIN_IOU = 0.98
PCASE_OTHER_IOU = 0.85
PCASE_IOU_TOL = 0.03
WELL_RATED = 0.85
# One uint8 level after normalisation ((v / 255 - 0.5) / 0.5): the unit the image-decoding line reports in.
LEVEL = 2.0 / 255.0
# Problems listed in a failing case's line before "and N more".
_SHOWN = 3

# The reference outputs whose presence makes a bundle "carry a reference" (docs/sam3-check.md 1).
REFERENCE_OUTPUTS = ("ref.pixel_values", "ref.text", "ref.vit_out", "ref.fpn0", "ref.fpn1", "ref.fpn2", "ref.enc_out",
                     "ref.dec_hidden", "ref.pred_logits", "ref.pred_boxes", "ref.presence", "ref.pred_masks",
                     "ref.semantic")
TRACKER_OUTPUTS = ("ref.trk.vit_out", "ref.trk.emb0", "ref.trk.emb1", "ref.trk.emb2", "ref.trk.sparse",
                   "ref.trk.multi.masks", "ref.trk.single.masks", "ref.trk.obj")
TRACKER_STAGES = ["tracker neck level 0", "tracker neck level 1", "tracker neck level 2", "tracker prompt encoder",
                  "tracker decoder masks", "tracker decoder IoU", "tracker object score"]


@dataclass
class Line:
    """One check's verdict.

    Attributes:
        section: "host", "stages" or "cases".
        name: the check's name, as the FAILED line lists it.
        status: "ok", "FAIL", "skip" (the bundle lacks what it compares against) or "info" (never fails).
        detail: what was compared and found (for a skip, why).
        seconds: the time its stage took, on the first line of a stage; None otherwise.
    """

    section: str
    name: str
    status: str
    detail: str
    seconds: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the line does not fail the check (ok, skip and info lines)."""
        return self.status != "FAIL"

    def text(self) -> str:
        """`  [status] name: detail`, with ` (<ms> ms)` when timed."""
        timed = "" if self.seconds is None else f" ({self.seconds * 1e3:.0f} ms)"
        return f"  [{self.status}] {self.name}: {self.detail}{timed}"

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"section": self.section, "name": self.name, "status": self.status, "ok": self.ok,
                "detail": self.detail, "seconds": self.seconds}


@dataclass
class CheckReport:
    """Everything `sam3 check` found: the lines in order, where it ran, and the hardware contexts the one `Sam3`
    loaded and evicted over the whole check."""

    bundle: str
    device: str
    load_seconds: float
    reference: bool = True
    lines: list[Line] = field(default_factory=list)
    loads: int = 0
    evictions: int = 0

    @property
    def ok(self) -> bool:
        """True when no line failed (skips and infos do not fail)."""
        return all(line.ok for line in self.lines)

    @property
    def failed(self) -> list[str]:
        """The names of the failed checks, in order."""
        return [line.name for line in self.lines if not line.ok]

    @property
    def skipped(self) -> list[str]:
        """The names of the skipped checks, in order."""
        return [line.name for line in self.lines if line.status == "skip"]

    def last_line(self) -> str:
        """`ALL CHECKS PASSED` or `FAILED: a, b, ...`."""
        return "ALL CHECKS PASSED" if self.ok else "FAILED: " + ", ".join(self.failed)

    def as_dict(self) -> dict[str, Any]:
        """The JSON document of `sam3 check --json`."""
        return {"schema": SCHEMA, "command": "check", "bundle": self.bundle, "device": self.device,
                "load_seconds": self.load_seconds, "loads": self.loads, "evictions": self.evictions,
                "reference": self.reference, "ok": self.ok,
                "failed": self.failed, "skipped": self.skipped, "lines": [line.as_dict() for line in self.lines]}


class _Missing(Exception):
    """A reference tensor the check needs is not in the bundle: the check is skipped."""


# ---------------------------------------------------------------------------------------------
# verdict wording


def _above(value: float, bar: float, digits: int = 6) -> tuple[bool, str]:
    ok = bool(value > bar)
    return ok, f"{value:.{digits}f} {'>' if ok else '<='} {bar:g}"


def _below(value: float, bar: float) -> tuple[bool, str]:
    ok = bool(value < bar)
    return ok, f"{value:.4g} {'<' if ok else '>='} {bar:g}"


# ---------------------------------------------------------------------------------------------
# case matching (docs/sam3-check.md 3)


@dataclass(frozen=True)
class CaseMatch:
    """How a case's found instances compare with its reference instances.

    Attributes:
        ok: the verdict.
        detail: the line's detail (the problems when it failed).
        ious: float64 `[n_ref]`, each reference instance's IoU with its match (0 when unmatched).
        which: int64 `[n_ref]`, the found index matched to each reference instance, -1 when none.
        absent: reference indices left unmatched within the margin of the threshold.
        extra: found indices matched to no reference instance, within the margin.
    """

    ok: bool
    detail: str
    ious: np.ndarray
    which: np.ndarray
    absent: list[int]
    extra: list[int]


def iou_matrix(reference: np.ndarray, found: np.ndarray) -> npt.NDArray[np.float64]:
    """IoU of every reference mask with every found mask, float64 `[n_ref, n_found]`; an empty union counts as 1.

    Raises:
        ValueError: the two are not `[n, H, W]` stacks of one image size.
    """
    ref, got = np.asarray(reference), np.asarray(found)
    if ref.ndim != 3 or got.ndim != 3 or ref.shape[1:] != got.shape[1:]:
        raise ValueError(f"reference masks {list(ref.shape)} and found masks {list(got.shape)} must be [n, H, W] "
                         "of one image size")
    pixels = ref.shape[1] * ref.shape[2]
    a = ref.reshape(ref.shape[0], pixels).astype(bool).astype(np.float64)
    b = got.reshape(got.shape[0], pixels).astype(bool).astype(np.float64)
    inter = a @ b.T  # exact: integer pixel counts far below 2^53
    union = a.sum(1)[:, None] + b.sum(1)[None, :] - inter
    iou: npt.NDArray[np.float64] = np.divide(inter, union, out=np.ones_like(inter), where=union > 0)
    return iou


def match_case(ref_scores: np.ndarray, ref_masks: np.ndarray, found: post.Instances, threshold: float,
               margin: float = CASE_MARGIN, min_iou: float = CASE_MIN_IOU, score_tol: float = SCORE_TOL) -> CaseMatch:
    """Judges a case's found instances against its reference instances (docs/sam3-check.md 3).

    First the reference's rule: greedily in reference order, each reference instance takes the unused found
    instance of highest IoU (`post.match`); the case passes with equal counts, every IoU above `min_iou` and every
    pair's scores within `score_tol`. When that fails and `margin` is positive, the queries near the threshold are
    let go: pairs are matched best IoU first (only above `min_iou`), and the case passes when every reference
    instance left unmatched has its reference score, and every found instance left unmatched its own score, within
    `margin` of `threshold`, and every pair's scores are within `score_tol`.

    Raises:
        ValueError: `ref_scores` is not `[n]` for `ref_masks` `[n, H, W]`, or the masks' image sizes differ.
    """
    rs = np.asarray(ref_scores, np.float64).reshape(-1)
    fs = np.asarray(found.scores, np.float64).reshape(-1)
    if np.ndim(ref_masks) != 3 or np.shape(ref_masks)[0] != rs.shape[0]:
        raise ValueError(f"reference scores [{rs.shape[0]}] and masks {list(np.shape(ref_masks))} disagree")
    iou = iou_matrix(ref_masks, found.masks)
    queries = np.asarray(found.queries).reshape(-1)
    if rs.size and fs.size:
        ious, which = post.match(ref_masks, found.masks)
    else:  # nothing to pair (post.match wants at least one mask on each side)
        ious, which = np.zeros(rs.size), np.full(rs.size, -1, dtype=np.int64)
    problems = _plain_problems(rs, fs, queries, ious, which, min_iou)
    problems += _score_problems(rs, fs, which, score_tol)
    counts = f"{fs.size} instance(s) at threshold {threshold:.4g}, reference {rs.size}"
    if not problems:
        return CaseMatch(True, _passed(counts, rs, fs, ious, which, min_iou, score_tol), ious, which, [], [])
    if margin > 0:
        which = _best_first(iou, min_iou)
        ious = np.zeros(rs.size)
        ious[which >= 0] = iou[np.flatnonzero(which >= 0), which[which >= 0]]
        unmatched_ref = [r for r in range(rs.size) if which[r] < 0]
        unmatched_found = sorted(set(range(fs.size)) - set(which[which >= 0].tolist()))
        absent = [r for r in unmatched_ref if abs(rs[r] - threshold) <= margin]
        extra = [j for j in unmatched_found if abs(fs[j] - threshold) <= margin]
        problems = [f"reference instance {r} (score {rs[r]:.4f}) unmatched ("
                    + (f"best IoU {float(iou[r].max()):.3f} <= {min_iou:g}" if fs.size else "nothing found") + ")"
                    for r in unmatched_ref if r not in absent]
        problems += [f"query {int(queries[j])} (score {fs[j]:.4f}) matches no reference instance"
                     for j in unmatched_found if j not in extra]
        problems += _score_problems(rs, fs, which, score_tol)
        if not problems:
            near = [f"reference instance {r} ({rs[r]:.4f}) absent" for r in absent]
            near += [f"query {int(queries[j])} ({fs[j]:.4f}) extra" for j in extra]
            detail = (_passed(counts, rs, fs, ious, which, min_iou, score_tol)
                      + f", within the margin {margin:g} of the threshold: " + ", ".join(near))
            return CaseMatch(True, detail, ious, which, absent, extra)
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return CaseMatch(False, f"{counts}: " + "; ".join(problems[:_SHOWN]) + more, ious, which, [], [])


def _plain_problems(rs: np.ndarray, fs: np.ndarray, queries: np.ndarray, ious: np.ndarray, which: np.ndarray,
                    min_iou: float) -> list[str]:
    """What breaks the reference's rule, given `post.match`'s pairs."""
    out = []
    for r in range(rs.size):
        if which[r] < 0:
            out.append(f"reference instance {r} (score {rs[r]:.4f}) unmatched (no found instance left)")
        elif ious[r] <= min_iou:
            out.append(f"reference instance {r} (score {rs[r]:.4f}): IoU {ious[r]:.3f} <= {min_iou:g} with query "
                       f"{int(queries[which[r]])}")
    for j in sorted(set(range(fs.size)) - set(which[which >= 0].tolist())):
        out.append(f"query {int(queries[j])} (score {fs[j]:.4f}) matches no reference instance")
    return out


def _score_problems(rs: np.ndarray, fs: np.ndarray, which: np.ndarray, score_tol: float) -> list[str]:
    pairs = np.flatnonzero(which >= 0)
    if not pairs.size:
        return []
    diffs = np.abs(rs[pairs] - fs[which[pairs]])
    k = int(np.argmax(diffs))
    if diffs[k] < score_tol:
        return []
    r = int(pairs[k])
    return [f"reference instance {r}: score {rs[r]:.4f}, found {fs[which[r]]:.4f} (|diff| {diffs[k]:.4f} >= "
            f"{score_tol:g})"]


def _passed(counts: str, rs: np.ndarray, fs: np.ndarray, ious: np.ndarray, which: np.ndarray, min_iou: float,
            score_tol: float) -> str:
    pairs = np.flatnonzero(which >= 0)
    if not pairs.size:
        return counts
    worst = float(np.abs(rs[pairs] - fs[which[pairs]]).max())
    return (f"{counts}, min IoU {float(ious[pairs].min()):.3f} > {min_iou:g}, max |score diff| {worst:.4f} < "
            f"{score_tol:g}")


def _best_first(iou: np.ndarray, min_iou: float) -> np.ndarray:
    """Pairs matched best IoU first (ties in reference, then found order), only above `min_iou`: the found index of
    each reference instance, -1 when none."""
    n, m = iou.shape
    which = np.full(n, -1, dtype=np.int64)
    taken = np.zeros(m, dtype=bool)
    r_idx, j_idx = np.nonzero(iou > min_iou)
    order = np.lexsort((j_idx, r_idx, -iou[r_idx, j_idx]))
    for r, j in zip(r_idx[order].tolist(), j_idx[order].tolist(), strict=True):  # greedy: depends on earlier pairs
        if which[r] < 0 and not taken[j]:
            which[r], taken[j] = j, True
    return which


def judge_pcase(ref_masks: np.ndarray, ref_iou: np.ndarray, masks: np.ndarray, iou: np.ndarray,
                candidates: Sequence[int], min_iou: float = PCASE_MIN_IOU, other_iou: float = PCASE_OTHER_IOU,
                iou_tol: float = PCASE_IOU_TOL) -> tuple[bool, str]:
    """Judges a point/box prompt's masks `[n, H, W]` and predicted IoUs against the reference's, mask k with
    reference mask k (docs/sam3-check.md 3.2): (verdict, the line's detail).

    The reference's best-rated candidate, and any it rates at least WELL_RATED, need a mask IoU above `min_iou`,
    the others above `other_iou`; every predicted IoU must be within `iou_tol` of the reference's.

    Raises:
        ValueError: the reference's masks and IoUs disagree in count, or the masks' image sizes differ.
    """
    want, rs = np.asarray(ref_masks, bool), np.asarray(ref_iou, np.float64).reshape(-1)
    if want.ndim != 3 or want.shape[0] != rs.size:
        raise ValueError(f"reference IoUs [{rs.size}] and masks {list(want.shape)} disagree")
    n, cands = rs.size, list(candidates)
    if len(cands) != n:
        return False, f"{len(cands)} mask(s), reference {n}"
    ious = np.diag(iou_matrix(want, masks))
    chosen = (rs >= WELL_RATED) | (np.arange(n) == int(np.argmax(rs)))
    diffs = np.abs(np.asarray(iou, np.float64).reshape(-1) - rs)
    problems = [f"candidate {c}: mask IoU {x:.3f} <= {b:g}"
                for c, x, b in zip(cands, ious.tolist(), np.where(chosen, min_iou, other_iou).tolist(), strict=True)
                if not x > b]
    k = int(np.argmax(diffs))
    if not diffs[k] < iou_tol:
        problems.append(f"candidate {cands[k]}: IoU score {float(np.reshape(iou, -1)[k]):.4f}, reference "
                        f"{rs[k]:.4f} (|diff| {diffs[k]:.4f} >= {iou_tol:g})")
    head = (f"{n} mask(s) (candidate{'s' if n > 1 else ''} {', '.join(map(str, cands))}), mask IoU "
            + " ".join(f"{x:.3f}" for x in ious.tolist()))
    if problems:
        return False, f"{head}: " + "; ".join(problems)
    picked = ", ".join(str(c) for c, ch in zip(cands, chosen.tolist(), strict=True) if ch)
    others = f", the others > {other_iou:g}" if not chosen.all() else ""
    return True, (f"{head}; chosen ({picked}) > {min_iou:g}{others}; max |IoU-score diff| {diffs[k]:.4f} < "
                  f"{iou_tol:g}")


# ---------------------------------------------------------------------------------------------
# the checks


class _TrackerImage:
    """The tracker's image side on the check's own pipeline: its ViT (no second set of operand buffers) and the
    tracker neck."""

    def __init__(self, sam: Sam3):
        self.vit, self.neck = sam.vit, tracker_neck.NpuNeck(sam.npu)

    def __call__(self, pixels: np.ndarray, timing: dict[str, float]) -> list[F32Array]:
        return self.neck.forward(self.vit.forward(pixels))


class _Checker:
    """Runs every check of one bundle on one `Sam3`, emitting each line as it is decided."""

    def __init__(self, sam: Sam3, report: CheckReport, emit: Callable[[str], None]):
        self.sam, self.report, self.emit = sam, report, emit
        self.bundle: Bundle = sam.bundle
        self.t = sam.bundle.tensors
        self.p = sam.bundle.params

    # -- plumbing -------------------------------------------------------------------------------

    def add(self, section: str, name: str, status: str, detail: str, seconds: float | None = None) -> None:
        line = Line(section, name, status, detail, seconds)
        self.report.lines.append(line)
        self.emit(line.text())

    def verdict(self, section: str, name: str, ok: bool, detail: str, seconds: float | None = None) -> None:
        self.add(section, name, "ok" if ok else "FAIL", detail, seconds)

    def need(self, *names: str) -> None:
        """Raises `_Missing` naming the first of `names` the bundle lacks."""
        for name in names:
            if not self.t.has(name):
                raise _Missing(f"no {name} in the bundle")

    def ref(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> np.ndarray:
        """Reference tensor `name` as `shape` (its stored shape may be flat).

        Raises:
            _Missing: not in the bundle. BundleError: another dtype. ValueError: another element count.
        """
        self.need(name)
        arr = self.t.get(name, dtype)
        if arr.size != math.prod(shape):
            raise ValueError(f"{name} holds {arr.size} values {list(arr.shape)}, the params need "
                             f"{list(shape)} = {math.prod(shape)}")
        return arr.reshape(shape)

    def run(self, section: str, names: Sequence[str], fn: Callable[[], None]) -> None:
        """Runs `fn` (which adds the lines of `names`); a missing tensor skips every one of them, an error fails
        them all, naming it."""
        before = len(self.report.lines)
        try:
            fn()
        except _Missing as e:
            for name in names[len(self.report.lines) - before:]:
                self.add(section, name, "skip", str(e))
        except (ValueError, NpuError) as e:
            kind = "NPU: " if isinstance(e, NpuError) else ""
            for name in names[len(self.report.lines) - before:]:
                self.add(section, name, "FAIL", f"{kind}{e}")

    def section(self, key: str) -> None:
        self.emit(SECTIONS[key])

    # -- host pieces ----------------------------------------------------------------------------

    def host(self) -> None:
        self.section("host")
        self.run("host", ["bfp16 packing"], self.packing)
        self.run("host", ["tokenizer"], self.tokenizer)
        self.run("host", ["resize + normalise"], self.resize)
        self.run("host", ["image decoding"], self.decoding)
        self.run("host", ["text encoder"], self.text_encoder)

    def packing(self) -> None:
        self.need("pack_test.B", "pack_test.packed")
        if "d_s" not in self.bundle.gemms:
            raise _Missing("no gemm d_s record (the pack test's tiling) in the bundle")
        s = self.bundle.gemms["d_s"]
        start = time.perf_counter()
        b = self.ref("pack_test.B", (s.k, s.n))
        bias = self.ref("pack_test.bias", (s.n,)) if self.t.has("pack_test.bias") else None
        got = pack_b(b, bias, s.tile_k, s.tile_n, s.ct_k)
        want = self.t.raw("pack_test.packed")
        seconds = time.perf_counter() - start
        tiling = f"d_s tile_k {s.tile_k}, tile_n {s.tile_n}, ct_k {s.ct_k}"
        if got.size != want.size:
            self.verdict("host", "bfp16 packing", False, f"packed {got.size} bytes, pack_test.packed holds "
                         f"{want.size} ({tiling})", seconds)
            return
        bad = np.flatnonzero(got != want)
        first = ""
        if bad.size:
            k = int(bad[0])
            first = f", the first at byte {k} (0x{int(got[k]):02x}, want 0x{int(want[k]):02x})"
        self.verdict("host", "bfp16 packing", bad.size == 0, f"{bad.size} of {want.size} bytes differ{first} "
                     f"({tiling})", seconds)

    def tokenizer(self) -> None:
        tests = self.bundle.tok_tests
        if not tests:
            raise _Missing("no tok_test records in the bundle")
        start = time.perf_counter()
        tok = ClipTokenizer.from_bundle(self.bundle)
        length = self.p.text_len
        wrong = []
        for test in tests:
            ids = self.ref(f"tok.{test.index}.ids", (length,), "i32")
            mask = self.ref(f"tok.{test.index}.mask", (length,), "i32")
            got_ids, got_mask = tok.encode(test.prompt)
            for what, got, want in (("ids", got_ids, ids), ("mask", got_mask, mask)):
                at = np.flatnonzero(np.asarray(got) != want)
                if at.size:
                    k = int(at[0])
                    wrong.append(f"tok_test {test.index} {json.dumps(test.prompt)}: {what} differ at token {k} "
                                 f"(got {int(got[k])}, want {int(want[k])})")
                    break
        seconds = time.perf_counter() - start
        same = len(tests) - len(wrong)
        detail = f"{same}/{len(tests)} prompts identical" + ("; " + "; ".join(wrong[:_SHOWN]) if wrong else "")
        self.verdict("host", "tokenizer", not wrong, detail, seconds)

    def rgb(self) -> np.ndarray:
        self.need("ref.rgb")
        rgb = self.t.get("ref.rgb", "u8")
        if rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ValueError(f"ref.rgb is {list(rgb.shape)}, expected [H, W, 3]")
        return rgb

    def pixels(self) -> np.ndarray:
        size = self.p.image_size
        return self.ref("ref.pixel_values", (3, size, size))

    def resize(self) -> None:
        rgb, want = self.rgb(), self.pixels()
        start = time.perf_counter()
        got = preprocess.preprocess(rgb, self.p.image_size)
        seconds = time.perf_counter() - start
        diff = np.abs(got.astype(np.float64) - want)
        bad = int((diff > PIXEL_TOL).sum())
        self.verdict("host", "resize + normalise", bad == 0, f"{bad} of {diff.size} values with |diff| > "
                     f"{PIXEL_TOL:g} (max {float(diff.max()):.3g})", seconds)

    def decoding(self) -> None:
        if self.bundle.ref_image is None:
            raise _Missing("no ref_image record in the bundle")
        want = self.rgb()
        decoded = preprocess.load_rgb(self.bundle.ref_image)
        name = os.path.relpath(self.bundle.ref_image, self.bundle.root)
        if decoded.shape != want.shape:
            self.add("host", "image decoding", "info", f"{name} decodes to {list(decoded.shape)}, ref.rgb is "
                     f"{list(want.shape)}")
            return
        differ = int((decoded != want).sum())
        size = self.p.image_size
        after = np.abs(preprocess.preprocess(decoded, size).astype(np.float64) - preprocess.preprocess(want, size))
        self.add("host", "image decoding", "info", f"{name}: {differ} of {want.size} bytes differ from ref.rgb; "
                 f"max diff after resize {float(after.max()) / LEVEL:.3g} levels of 2/255")

    def text_encoder(self) -> None:
        length, d = self.p.text_len, self.p.d_model
        ids = self.ref("ref.input_ids", (length,), "i32")
        mask = self.ref("ref.attention_mask", (length,), "i32")
        want = self.ref("ref.text", (length, d))
        start = time.perf_counter()
        got = text.encode_text(ids, mask, self.t, self.p)
        seconds = time.perf_counter() - start
        valid = mask != 0
        ok, how = _above(cosine(got[valid], want[valid]), TEXT_COS)
        self.verdict("host", "text encoder", ok, f"cosine {how} over {int(valid.sum())} valid rows", seconds)

    # -- stages ---------------------------------------------------------------------------------

    def stages(self) -> None:
        self.section("stages")
        self.run("stages", ["ViT backbone"], self.vit)
        self.run("stages", [f"neck level {i}" for i in range(3)], self.neck)
        self.run("stages", ["DETR encoder"], self.encoder)
        self.run("stages", ["DETR decoder hidden", "DETR decoder boxes", "DETR decoder logits", "presence"],
                 self.decoder)
        self.run("stages", ["mask decoder masks", "mask decoder semantic"], self.mask_decoder)
        if self.p.tracker:
            self.run("stages", TRACKER_STAGES[:3], self.tracker_neck)
            self.run("stages", TRACKER_STAGES[3:4], self.tracker_prompt)
            self.run("stages", TRACKER_STAGES[4:], self.tracker_decoder)

    def timed(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - start

    def tokens(self) -> int:
        return self.p.grid * self.p.grid

    def vit(self) -> None:
        want = self.ref("ref.vit_out", (self.tokens(), self.p.vit_dim))
        got, seconds = self.timed(self.sam.vit.forward, self.pixels())
        ok, how = _above(cosine(got, want), VIT_COS)
        self.verdict("stages", "ViT backbone", ok, f"cosine {how}", seconds)

    def level_side(self, i: int) -> int:
        return self.p.grid * 4 >> i  # levels 0, 1, 2 are 4g, 2g, g on a side (docs/sam3-check.md 2)

    def level(self, i: int) -> np.ndarray:
        side = self.level_side(i)
        return self.ref(f"ref.fpn{i}", (side * side, self.p.d_model))

    def neck(self) -> None:
        x = self.ref("ref.vit_out", (self.tokens(), self.p.vit_dim))
        levels, seconds = self.timed(self.sam.neck.forward, x)
        for i, got in enumerate(levels):
            try:
                want = self.level(i)
            except _Missing as e:
                self.add("stages", f"neck level {i}", "skip", str(e))
                continue
            ok, how = _above(cosine(got, want), NECK_COS)
            self.verdict("stages", f"neck level {i}", ok, f"cosine {how}", seconds if i == 0 else None)

    def prompt(self) -> tuple[np.ndarray, np.ndarray]:
        """The reference prompt: text features `[L, d]` and validity `[L]`."""
        feats = self.ref("ref.text", (self.p.text_len, self.p.d_model))
        valid = self.ref("ref.attention_mask", (self.p.text_len,), "i32") != 0
        return feats, valid

    def enc_out(self) -> np.ndarray:
        return self.ref("ref.enc_out", (self.tokens(), self.p.d_model))

    def encoder(self) -> None:
        x, (feats, valid), want = self.level(2), self.prompt(), self.enc_out()
        start = time.perf_counter()
        self.sam.encoder.set_prompt(feats)
        got = self.sam.encoder.forward(x, valid)
        seconds = time.perf_counter() - start
        ok, how = _above(cosine(got, want), ENC_COS)
        self.verdict("stages", "DETR encoder", ok, f"cosine {how}", seconds)

    def last_hidden(self) -> np.ndarray:
        p = self.p
        last: np.ndarray = self.ref("ref.dec_hidden", (p.dec_layers, p.queries, p.d_model))[-1]
        return last

    def decoder(self) -> None:
        (feats, valid), enc = self.prompt(), self.enc_out()
        q = self.p.queries
        dec, seconds = self.timed(self.sam.decoder.forward, enc, feats, valid)
        lines = [("DETR decoder hidden", self.hidden_line, dec), ("DETR decoder boxes", self.boxes_line, dec),
                 ("DETR decoder logits", self.logits_line, dec), ("presence", self.presence_line, dec)]
        for k, (name, fn, out) in enumerate(lines):
            try:
                ok, detail = fn(out, q)
            except _Missing as e:
                self.add("stages", name, "skip", str(e))
                continue
            self.verdict("stages", name, ok, detail, seconds if k == 0 else None)

    def hidden_line(self, dec: Any, q: int) -> tuple[bool, str]:
        ok, how = _above(cosine(dec.hidden, self.last_hidden()), HIDDEN_COS)
        return ok, f"cosine {how} (the last of {self.p.dec_layers} layers)"

    def confident(self, q: int) -> np.ndarray:
        return post.sigmoid(self.ref("ref.pred_logits", (q,))) > CONFIDENT

    def boxes_line(self, dec: Any, q: int) -> tuple[bool, str]:
        want = self.ref("ref.pred_boxes", (q, 4))
        sure = self.confident(q)
        worst = float(np.abs(dec.boxes[sure].astype(np.float64) - want[sure]).max()) if sure.any() else 0.0
        ok, how = _below(worst, BOX_TOL)
        return ok, f"max |diff| {how} over {int(sure.sum())} confident queries (sigmoid(ref logit) > {CONFIDENT:g})"

    def logits_line(self, dec: Any, q: int) -> tuple[bool, str]:
        want = self.ref("ref.pred_logits", (q,))
        sure = self.confident(q)
        worst = float(np.abs(dec.logits[sure].astype(np.float64) - want[sure]).max()) if sure.any() else 0.0
        ok, how = _below(worst, LOGIT_TOL)
        return ok, f"max |diff| {how} over the same {int(sure.sum())} queries"

    def presence_line(self, dec: Any, q: int) -> tuple[bool, str]:
        want = float(self.ref("ref.presence", (1,))[0])
        got = float(np.reshape(dec.presence, -1)[0])
        ok, how = _below(abs(got - want), PRESENCE_TOL)
        return ok, f"logit {got:.4f}, reference {want:.4f}: |diff| {how}"

    def mask_decoder(self) -> None:
        m = self.sam.mask_decoder
        hidden, (feats, valid), enc = self.last_hidden(), self.prompt(), self.enc_out()
        levels = [self.level(i) for i in range(m.g.stages)]
        size, q = self.p.mask_size, self.p.queries
        start = time.perf_counter()
        m.set_prompt(feats)
        out = m.forward(hidden, levels, enc, valid)
        seconds = time.perf_counter() - start
        for k, (name, ref_name, shape, bar, got) in enumerate((
                ("mask decoder masks", "ref.pred_masks", (q, size, size), MASK_COS, out.masks),
                ("mask decoder semantic", "ref.semantic", (size, size), SEMANTIC_COS, out.semantic))):
            try:
                want = self.ref(ref_name, shape)
            except _Missing as e:
                self.add("stages", name, "skip", str(e))
                continue
            ok, how = _above(cosine(got, want), bar)
            self.verdict("stages", name, ok, f"cosine {how}", seconds if k == 0 else None)

    # -- the tracker's stages (docs/sam3-check.md 2.1) ------------------------------------------

    @functools.cached_property
    def trk_image(self) -> _TrackerImage:
        return _TrackerImage(self.sam)

    @functools.cached_property
    def points(self) -> Points:
        """The tracker on this check's pipeline, built on first use.

        Raises:
            TrackerError, BundleError (ValueErrors): a tracker param or tensor is missing.
        """
        cfg = tracker_bundle.config(self.bundle)
        image_pe = np.array(self.t.get("trk.image_pe", "f32")).reshape(-1, cfg.width)
        return Points(tracker_bundle.weights(self.bundle, cfg), cfg, self.trk_image, image_pe)

    def trk_level(self, i: int) -> np.ndarray:
        cfg, channels = self.points.cfg, self.p.trk_out_ch or []  # 3 of them in a tracker bundle (the reader's rule)
        side = (cfg.mask_side, cfg.mask_side // 2, cfg.grid)[i]
        return self.ref(f"ref.trk.emb{i}", (side * side, int(channels[i])))

    def tracker_neck(self) -> None:
        x = self.ref("ref.trk.vit_out", (self.tokens(), self.p.vit_dim))
        levels, seconds = self.timed(self.trk_image.neck.forward, x)
        for i, got in enumerate(levels):
            name = TRACKER_STAGES[i]
            try:
                want = self.trk_level(i)
            except _Missing as e:
                self.add("stages", name, "skip", str(e))
                continue
            ok, how = _above(cosine(got, want), NECK_COS)
            self.verdict("stages", name, ok, f"cosine {how}", seconds if i == 0 else None)

    def trk_prompt(self) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """The stage prompt in the model frame: points `[n, 2]` and labels, and the box, each None when absent."""
        points = labels = box = None
        if self.t.has("ref.trk.points"):
            points = self.t.get("ref.trk.points", "f32").reshape(-1, 2)
            labels = self.ref("ref.trk.labels", (len(points),), "i32")
        if self.t.has("ref.trk.box"):
            box = self.ref("ref.trk.box", (4,))
        if points is None and box is None:
            raise _Missing("no ref.trk.points in the bundle")
        return points, labels, box

    def tracker_prompt(self) -> None:
        p = self.points
        points, labels, box = self.trk_prompt()
        got, seconds = self.timed(tracker_prompt.sparse, p.weights, p.cfg, points, labels, box)
        want = self.ref("ref.trk.sparse", got.shape)
        ok, how = _below(float(np.abs(got.astype(np.float64) - want).max()), TRK_SPARSE_TOL)
        self.verdict("stages", "tracker prompt encoder", ok, f"max |diff| {how} over {got.shape[0]} tokens", seconds)

    def tracker_decoder(self) -> None:
        p = self.points
        n, side = p.cfg.multimask_outputs, p.cfg.mask_side
        embeddings = [self.trk_level(i) for i in range(3)]
        self.need("ref.trk.sparse")
        sparse = self.t.get("ref.trk.sparse", "f32").reshape(-1, p.cfg.width)
        multi, multi_iou = self.ref("ref.trk.multi.masks", (n, side, side)), self.ref("ref.trk.multi.iou", (n,))
        single, single_iou = self.ref("ref.trk.single.masks", (1, side, side)), self.ref("ref.trk.single.iou", (1,))
        obj = float(self.ref("ref.trk.obj", (1,))[0])
        out, seconds = self.timed(tracker_decoder.decode, p.weights, p.cfg, embeddings, p.image_pe, sparse, p.dense)
        pick = tracker_post.single_choice(out.masks, out.iou, p.cfg)
        cm, cs = cosine(out.masks[1:], multi), cosine(out.masks[pick], single)
        ok, how = _above(min(cm, cs), TRK_MASK_COS)
        self.verdict("stages", "tracker decoder masks", ok, f"cosine {how} (multimask {cm:.6f}, single mask "
                     f"{cs:.6f}: candidate {pick})", seconds)
        diffs = np.abs(np.concatenate([out.iou[1:] - multi_iou, out.iou[pick:pick + 1] - single_iou]))
        ok, how = _below(float(diffs.max()), TRK_IOU_TOL)
        self.verdict("stages", "tracker decoder IoU", ok, f"max |diff| {how} over {n} + 1 scores")
        ok, how = _below(abs(out.object_score - obj), TRK_OBJ_TOL)
        self.verdict("stages", "tracker object score", ok, f"logit {out.object_score:.4f}, reference {obj:.4f}: "
                     f"|diff| {how}")

    # -- cases ----------------------------------------------------------------------------------

    def cases(self) -> None:
        self.section("cases")
        if not self.bundle.cases:
            self.add("cases", "cases", "skip", "no case records in the bundle")
        for case in self.bundle.cases:
            name = f"{os.path.relpath(case.image, self.bundle.root)} / {json.dumps(case.prompt)}"
            self.run("cases", [name], functools.partial(self.case, case, name))
        self.pcases()

    def scalar(self, name: str, default: float) -> float:
        return float(self.ref(name, (1,))[0]) if self.t.has(name) else default

    def case(self, case: Any, name: str) -> None:
        i = case.index
        self.need(f"case.{i}.scores", f"case.{i}.masks")
        scores = self.t.get(f"case.{i}.scores", "f32").reshape(-1)
        threshold = self.scalar(f"case.{i}.threshold", CASE_THRESHOLD)
        margin = self.scalar(f"case.{i}.margin", CASE_MARGIN)
        bar = self.scalar(f"case.{i}.min_iou", CASE_MIN_IOU)
        result, seconds = self.timed(self.sam.segment, case.image, case.prompt, threshold, MASK_THRESHOLD)
        found = result.instances
        h, w = found.height, found.width
        masks = self.t.get(f"case.{i}.masks", "u8")
        if masks.size != scores.size * h * w:
            raise ValueError(f"case.{i}.masks holds {masks.size} values {list(masks.shape)}, but {scores.size} "
                             f"instance(s) of the {w} x {h} image need {scores.size * h * w}")
        verdict = match_case(scores, masks.reshape(scores.size, h, w) != 0, found, threshold, margin, bar)
        self.verdict("cases", name, verdict.ok, verdict.detail, seconds)

    def pcases(self) -> None:
        """One line per pcase record of a tracker bundle (docs/sam3-check.md 3.2); nothing for other bundles."""
        pcases = self.bundle.pcases
        if not self.p.tracker:
            if pcases:
                self.add("cases", "pcases", "FAIL", f"{len(pcases)} pcase record(s), but the bundle has no tracker "
                         "(param tracker is not 1)")
            return
        if not pcases:
            self.add("cases", "pcases", "skip", "no pcase records in the bundle")
        for case in pcases:
            name = f"{os.path.relpath(case.image, self.bundle.root)} / {case.prompt}"
            self.run("cases", [name], functools.partial(self.pcase, case, name))

    def pcase(self, case: Any, name: str) -> None:
        i = case.index
        points, labels, box = parse_pcase(case.prompt)
        self.need(f"pcase.{i}.masks", f"pcase.{i}.iou")
        ref_iou = self.t.get(f"pcase.{i}.iou", "f32").reshape(-1).astype(np.float64)
        n = ref_iou.size
        found, seconds = self.timed(self.points.segment_points, case.image, points, labels, box, n > 1)
        h, w = found.masks.shape[1:]
        masks = self.t.get(f"pcase.{i}.masks", "u8")
        if masks.size != n * h * w:
            raise ValueError(f"pcase.{i}.masks holds {masks.size} values {list(masks.shape)}, but {n} mask(s) of "
                             f"the {w} x {h} image need {n * h * w}")
        bars = (self.scalar(f"pcase.{i}.min_iou", PCASE_MIN_IOU), self.scalar(f"pcase.{i}.other_iou", PCASE_OTHER_IOU),
                self.scalar(f"pcase.{i}.iou_tol", PCASE_IOU_TOL))
        ok, detail = judge_pcase(masks.reshape(n, h, w) != 0, ref_iou, found.masks, found.iou, found.candidates, *bars)
        self.verdict("cases", name, ok, detail, seconds)

    # -- all ------------------------------------------------------------------------------------

    def all(self) -> None:
        self.report.reference = (bool(self.bundle.cases) or bool(self.bundle.pcases)
                                 or any(self.t.has(n) for n in (*REFERENCE_OUTPUTS, *TRACKER_OUTPUTS)))
        if not self.report.reference:
            self.emit(f"note: {self.report.bundle} carries no float32 reference (no ref.* outputs, no case "
                      "records): only the host pieces it holds are checked")
        self.host()
        self.stages()
        self.cases()


def run_check(bundle_dir: str | os.PathLike[str], device: Any = None, *, out: TextIO | None = sys.stdout,
              say: Callable[[str], None] | None = None) -> CheckReport:
    """Checks the bundle in `bundle_dir` against its own references on `device` (docs/sam3-check.md), printing
    each line to `out` (None: nowhere) as it is decided, the last being `ALL CHECKS PASSED` or `FAILED: ...`.

    Args:
        bundle_dir: the bundle directory.
        device: "emu", "emu:<profile>", "/dev/accel/N", or None: a real NPU when there is one, else the emulator.
        out: where the lines go.
        say: where notes on the device choice go (None: nowhere).

    Raises:
        BundleError: the bundle cannot be opened, or lacks what the pipeline needs to load.
        NpuError: a kernel failed to load.
        XdnaError (an OSError): the device could not be opened, or failed while running.
    """
    def emit(line: str) -> None:
        if out is not None:
            print(line, file=out, flush=True)

    start = time.perf_counter()
    dev = demo_mod.choose_device(device, bundle_dir, say or (lambda message: None))
    try:
        timeout = demo_mod.EMULATOR_TIMEOUT if dev.emulator is not None else DEFAULT_TIMEOUT
        with Sam3(bundle_dir, dev, timeout=timeout) as sam:
            where = f"emulator ({dev.name})" if dev.emulator is not None else f"NPU ({dev.name})"
            report = CheckReport(str(bundle_dir), dev.name, time.perf_counter() - start)
            emit(f"loaded {bundle_dir} ({report.load_seconds:.1f} s); mode npu on {where}")
            _Checker(sam, report, emit).all()
            report.loads, report.evictions = sam.npu.loads, sam.npu.evictions
    finally:
        dev.close()
    emit(f"contexts loaded {report.loads}, evicted {report.evictions}")
    skipped = len(report.skipped)
    if skipped:
        emit(f"{skipped} check(s) skipped: the bundle lacks what they compare against")
    emit(report.last_line())
    return report


def main(argv: Sequence[str] | None = None, prog: str = "sam3 check") -> int:
    """`sam3 check BUNDLE [--device D] [--json]`: 0 when every check passes, 1 when one fails or on an error
    (one line, `sam3 check: <msg>`, on stderr; with --json a JSON error object), 2 on a usage error."""
    from sam3.cli import UsageParser

    p = UsageParser(prog=prog, description="Check a bundle against its own references: the host pieces, each stage on "
                                       "the float32 reference's inputs, and every case end to end.")
    p.add_argument("bundle", help="the bundle directory")
    p.add_argument("--device", help="emu, emu:<profile> or /dev/accel/N (default: the NPU, else the emulator)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the lines")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    def fail(message: str) -> int:
        if args.json:
            print(json.dumps({"schema": SCHEMA, "command": "check", "ok": False, "error": message}))
        else:
            print(f"{prog}: {message}", file=sys.stderr)
        return 1

    try:
        report = run_check(args.bundle, args.device, out=None if args.json else sys.stdout,
                           say=lambda message: print(f"{prog}: {message}", file=sys.stderr))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BundleError as e:
        return fail(f"bundle: {e}")
    except NpuError as e:
        return fail(f"NPU: {e}")
    except (ValueError, OSError) as e:
        return fail(str(e))
    if args.json:
        print(json.dumps(report.as_dict(), allow_nan=False))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
