"""Many images in one run (docs/sam3-segment.md 9): the inputs expanded, every prompt on every image with the
bundle opened once, results written as they come (JSON lines, COCO results, overlays), a progress bar.

`segment_many` is the library's form (`Sam3.segment_many` forwards to it): an iterator of `ImageResult`, one per
image, in order; an image that cannot be read comes with its `error` and the run goes on. `run` is what
`sam3 segment BUNDLE IMAGES... --prompt P` does around it: resume from an earlier JSON-lines file, the outputs,
the progress bar, and a `Summary` (also after Ctrl-C, with what was finished written and the files closed).
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from sam3 import post, preprocess, rle

if TYPE_CHECKING:  # the pipeline imports this module; here it is only a type
    from sam3.pipeline import Prompt, Result, Sam3

# The files a directory contributes: the formats `preprocess.load_rgb` decodes (docs/sam3-host.md 3.1).
SUFFIXES = (".jpg", ".jpeg", ".png")


# ---------------------------------------------------------------------------------------------
# the inputs


def expand(specs: Sequence[str]) -> list[Path]:
    """The image files named by `specs`, in order, each once: a directory gives its .jpg/.jpeg/.png files (not
    recursive) sorted by name; a pattern with `*`, `?` or `[` that names no existing file gives its sorted
    matches (`**` recursive); anything else is taken as one file (a missing one fails on its own line later).

    Raises:
        ValueError: nothing given, a directory without images, or a pattern that matches no file.
    """
    found: list[Path] = []
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.suffix.lower() in SUFFIXES and f.is_file())
            if not files:
                raise ValueError(f"images: directory {spec} holds no {', '.join(SUFFIXES)} file")
        elif glob.has_magic(spec) and not path.exists():
            files = sorted(Path(m) for m in glob.glob(spec, recursive=True) if Path(m).is_file())
            if not files:
                raise ValueError(f"images: no file matches {spec!r}")
        else:
            files = [path]
        found += files
    if not found:
        raise ValueError("images: none given")
    seen: set[Path] = set()
    unique = []
    for f in found:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def image_ids(paths: Sequence[Path]) -> list[int]:
    """COCO image ids (docs/sam3-segment.md 9.3): every file's name stem when all are decimal numbers and no two
    are equal (COCO's own file names, `000000000139.jpg` -> 139), else the images' positions from 1."""
    stems = [p.stem for p in paths]
    if all(s.isascii() and s.isdigit() for s in stems) and len({int(s) for s in stems}) == len(stems):
        return [int(s) for s in stems]
    return list(range(1, len(paths) + 1))


# ---------------------------------------------------------------------------------------------
# the library's iterator


@dataclass
class ImageResult:
    """One image's results: one `Result` per prompt (in prompt order), or the error that stopped it.

    Attributes:
        index: the image's position in the input. image: the image as given (a path or an array).
        results: per prompt; empty when `error` is set. error: the `ImageError` of an unreadable image.
        seconds: wall time spent on the image.
    """

    index: int
    image: Any
    results: list[Result] = field(default_factory=list)
    error: Exception | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """The image was read and every prompt segmented."""
        return self.error is None


def segment_many(sam: Sam3, images: Iterable[Any], prompts: Sequence[str] | str, threshold: float = 0.5,
                 mask_threshold: float = 0.5) -> Iterator[ImageResult]:
    """Every prompt on every image through `sam`, one `ImageResult` per image, lazily and in order. The prompts are
    checked and encoded here, once; each image's encoder outputs serve all its prompts.

    Raises (at the call, before any image):
        ValueError: no prompts. TokenizerError: a prompt the tokenizer cannot encode. PostError: a threshold
            outside [0, 1].
    """
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise ValueError("segment_many: no prompts given")
    sam.check_thresholds(threshold, mask_threshold)
    encoded = [sam.encode_prompt(p) for p in texts]
    return _each(sam, images, encoded, threshold, mask_threshold)


def _each(sam: Sam3, images: Iterable[Any], prompts: list[Prompt], threshold: float,
          mask_threshold: float) -> Iterator[ImageResult]:
    for index, image in enumerate(images):
        start = time.perf_counter()
        try:
            results = [sam.segment(image, p, threshold, mask_threshold) for p in prompts]
        except preprocess.ImageError as e:  # this image only: the next one may be fine
            yield ImageResult(index, image, [], e, time.perf_counter() - start)
            continue
        yield ImageResult(index, image, results, None, time.perf_counter() - start)


def merge(results: Sequence[Result]) -> post.Instances:
    """All prompts' instances of one image as one set, in prompt order (for one overlay)."""
    if len(results) == 1:
        return results[0].instances
    parts = [r.instances for r in results]
    return post.Instances(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("queries", "scores", "boxes",
                                                                                 "masks")))


# ---------------------------------------------------------------------------------------------
# records: one JSON line per image and prompt, COCO results from them


def bbox(box: np.ndarray, width: int, height: int) -> list[float]:
    """COCO's `[x, y, width, height]` of an xyxy pixel box, clamped to the image first (docs/sam3-segment.md 9.3)."""
    x0, y0, x1, y1 = np.clip(np.asarray(box, dtype=np.float64), 0, [width, height, width, height]).tolist()
    return [x0, y0, max(x1 - x0, 0.0), max(y1 - y0, 0.0)]


def records(item: ImageResult, name: str, image_id: int) -> list[dict[str, Any]]:
    """The JSON lines of one image (docs/sam3-segment.md 9.2): one per prompt, or one saying why it failed."""
    if item.error is not None:
        return [{"image": name, "image_id": image_id, "prompt": None, "ok": False, "error": str(item.error)}]
    lines = []
    for k, r in enumerate(item.results):
        found = r.instances
        h, w = r.rgb.shape[:2]
        instances = [{"query": int(q), "score": float(s), "box": [float(v) for v in b], "bbox": bbox(b, w, h),
                      "pixels": int(a), "mask": rle.encode(m)}
                     for q, s, b, a, m in zip(found.queries, found.scores, found.boxes, found.areas(), found.masks,
                                              strict=True)]
        lines.append({"image": name, "image_id": image_id, "prompt": r.prompt, "category_id": k + 1, "ok": True,
                      "width": w, "height": h, "ms": sum(r.timing.stages.values()) * 1e3, "instances": instances})
    return lines


def coco_results(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The COCO results entries of one JSON line: one per instance (none for a failed image)."""
    if not record.get("ok"):
        return []
    return [{"image_id": record["image_id"], "category_id": record["category_id"], "segmentation": i["mask"],
             "bbox": i["bbox"], "score": i["score"]} for i in record["instances"]]


# ---------------------------------------------------------------------------------------------
# the outputs


def read_done(path: Path, prompts: Sequence[str]) -> list[dict[str, Any]]:
    """The lines of an earlier JSON-lines file that `--resume` keeps: the successful ones, except those of an
    image that some prompt of this run has no line for (that image runs again, all prompts). A line that does not
    parse (the last one of a run that was killed) is dropped."""
    lines = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and doc.get("ok") is True and isinstance(doc.get("image"), str):
            lines.append(doc)
    have: dict[str, set[str | None]] = {}
    for doc in lines:
        have.setdefault(doc["image"], set()).add(doc.get("prompt"))
    return [doc for doc in lines if have[doc["image"]] >= set(prompts)]


class Outputs:
    """The files of a run, written as each image finishes and flushed: the JSON lines, the COCO results array
    (closed by `close`, also after Ctrl-C), the overlays.

    Raises:
        OSError: a file or the directory cannot be created.
    """

    def __init__(self, jsonl: Path | None, coco: Path | None, out: Path | None, kept: list[dict[str, Any]]):
        self._files: list[IO[str]] = []
        self.jsonl: IO[str] | None = None
        self.coco: IO[str] | None = None
        self._entries = 0
        self.out = out
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        try:
            if jsonl is not None:
                self.jsonl = self._open(_rewritten(jsonl, kept), "a")
            if coco is not None:
                self.coco = self._open(coco, "w")
                self.coco.write("[")
                self._coco(kept)
        except BaseException:
            self.close()
            raise

    def _open(self, path: Path, mode: str) -> IO[str]:
        f = open(path, mode, encoding="utf-8")  # noqa: SIM115  (closed by close())
        self._files.append(f)
        return f

    def _coco(self, lines: list[dict[str, Any]]) -> None:
        if self.coco is not None:
            for entry in (e for x in lines for e in coco_results(x)):
                self.coco.write(("\n" if self._entries == 0 else ",\n") + json.dumps(entry, allow_nan=False))
                self._entries += 1
            self.coco.flush()

    def write(self, lines: list[dict[str, Any]]) -> None:
        """Appends JSON lines (and their COCO entries)."""
        if self.jsonl is not None:
            self.jsonl.write(_lines(lines))
            self.jsonl.flush()
        self._coco(lines)

    def overlay(self, item: ImageResult, name: str) -> Path | None:
        """Writes the image's overlay (every prompt's instances) as `<out>/<name>.png`."""
        if self.out is None or not item.ok:
            return None
        return post.write_overlay(self.out / f"{name}.png", item.results[0].rgb, merge(item.results))

    def close(self) -> None:
        """Ends the COCO array and closes every file. Idempotent."""
        if self.coco is not None and not self.coco.closed:
            self.coco.write("\n]\n")
        for f in self._files:
            f.close()


def _lines(docs: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(x, allow_nan=False) + "\n" for x in docs)


def _rewritten(path: Path, kept: list[dict[str, Any]]) -> Path:
    """`path` holding exactly the `kept` lines, replaced in one rename (a kill meanwhile leaves the old file)."""
    part = path.with_name(path.name + ".part")
    part.write_text(_lines(kept), encoding="utf-8")
    os.replace(part, path)
    return path


def overlay_names(paths: Sequence[Path], ids: Sequence[int]) -> list[str]:
    """Each image's overlay name: its file stem, or `<stem>-<image id>` for stems two inputs share."""
    stems = [p.stem for p in paths]
    shared = {s for s in stems if stems.count(s) > 1} if len(set(stems)) < len(stems) else set()
    return [f"{s}-{i}" if s in shared else s for s, i in zip(stems, ids, strict=True)]


# ---------------------------------------------------------------------------------------------
# the progress bar


class Progress:
    """One line on a terminal, redrawn per image: `12/40 [#####.........] 2.3 img/s ETA 0:12 (1 failed)`.
    Disabled, it prints nothing."""

    def __init__(self, total: int, stream: IO[str], enabled: bool):
        self.total, self.stream, self.enabled = total, stream, enabled
        self.start = time.perf_counter()
        self.done = self.failed = 0
        self.shown = False

    def line(self) -> str:
        """The bar's text for the images done so far."""
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = f"{int(left / rate) // 60}:{int(left / rate) % 60:02d}" if rate > 0 else "?"
        failed = f" ({self.failed} failed)" if self.failed else ""
        width = 24
        fill = width * self.done // max(self.total, 1)
        return f"{self.done}/{self.total} [{'#' * fill}{'.' * (width - fill)}] {rate:.2f} img/s ETA {eta}{failed}"

    def step(self, ok: bool) -> None:
        """One more image finished."""
        self.done += 1
        self.failed += not ok
        self.draw()

    def draw(self) -> None:
        if self.enabled:
            columns = shutil.get_terminal_size((80, 24)).columns
            self.stream.write("\r" + self.line()[:max(columns - 1, 1)] + "\x1b[K")
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        """Takes the bar off the line (before other output to the terminal)."""
        if self.enabled and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def finish(self) -> None:
        """Leaves the last state on its own line."""
        if self.enabled and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Summary:
    """What a run did: images given, skipped as done by `--resume`, segmented, failed (image, message), and
    whether Ctrl-C ended it."""

    images: int
    skipped: int = 0
    done: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False
    loads: int = 0
    evictions: int = 0

    def lines(self) -> list[str]:
        """The summary as `sam3 segment` prints it."""
        rate = self.done / self.seconds if self.seconds > 0 else 0.0
        head = (f"{self.done + len(self.failed)} of {self.images} image(s) in {self.seconds:.1f} s ({rate:.2f} img/s): "
                f"{self.done} segmented, {len(self.failed)} failed, {self.skipped} skipped as done; contexts loaded "
                f"{self.loads}, evicted {self.evictions}" + ("; interrupted" if self.interrupted else ""))
        return [head, *(f"failed: {name}: {message}" for name, message in self.failed)]

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"images": self.images, "skipped": self.skipped, "done": self.done,
                "failed": [{"image": n, "error": m} for n, m in self.failed], "seconds": self.seconds,
                "interrupted": self.interrupted, "loads": self.loads, "evictions": self.evictions}


def image_line(name: str, lines: list[dict[str, Any]]) -> str:
    """One image's line on stdout: `name: "a cat" 2, "a dog" 0 instance(s)` or `name: FAILED: message`."""
    if not lines[0]["ok"]:
        return f"{name}: FAILED: {lines[0]['error']}"
    return f"{name}: " + ", ".join(f"{json.dumps(x['prompt'])} {len(x['instances'])}" for x in lines) + " instance(s)"


def _same_ids(kept: list[dict[str, Any]], names: list[str], ids: list[int], jsonl: Path | None) -> None:
    """Refuses to give a new image an id that a kept line gives another image (inputs that differ from the run
    being resumed would mix two images under one COCO id)."""
    taken = {x.get("image_id"): x["image"] for x in kept}
    for name, image_id in zip(names, ids, strict=True):
        other = taken.get(image_id, name)
        if other != name:
            raise ValueError(f"--resume: image id {image_id} of {name} is {other}'s in {jsonl}: resume with the same "
                             "inputs, or write a new file")


@dataclass
class Plan:
    """What a run does: every input's name (its path as given), COCO id and overlay name; the positions of the
    images to segment; the lines kept from the file being resumed."""

    names: list[str]
    ids: list[int]
    stems: list[str]
    todo: list[int]
    kept: list[dict[str, Any]]


def plan(paths: Sequence[Path], prompts: Sequence[str], jsonl: Path | None, resume: bool) -> Plan:
    """The run's plan; with `resume`, the images `jsonl` has done for every prompt left out (docs/sam3-segment.md
    9.1).

    Raises:
        ValueError: `resume` without `jsonl`, or a new image given an id a kept line gives another image.
    """
    if resume and jsonl is None:
        raise ValueError("--resume needs --jsonl FILE: the results it reads back")
    kept = read_done(jsonl, prompts) if resume and jsonl is not None and jsonl.exists() else []
    done = {x["image"] for x in kept}
    names, ids = [str(p) for p in paths], image_ids(paths)
    todo = [k for k, n in enumerate(names) if n not in done]
    _same_ids(kept, [names[k] for k in todo], [ids[k] for k in todo], jsonl)
    return Plan(names, ids, overlay_names(paths, ids), todo, kept)


def run(sam: Sam3, paths: Sequence[Path], prompts: Sequence[str], *, jsonl: Path | None = None,
        coco: Path | None = None, out: Path | None = None, resume: bool = False, threshold: float = 0.5,
        mask_threshold: float = 0.5, progress: IO[str] | None = None,
        say: Callable[[str], None] = lambda line: None) -> Summary:
    """Segments `paths` with `prompts`, writing the outputs as each image finishes; `say` gets each image's line;
    with `progress` (a terminal) the bar is drawn there. Ctrl-C ends it early: what was finished stays written,
    the files are closed, the summary says so.

    Raises:
        ValueError: as `plan`, or no prompts. TokenizerError, PostError: as `segment_many`.
        OSError: an output cannot be written. NpuError: a kernel failed.
    """
    p = plan(paths, prompts, jsonl, resume)
    summary = Summary(len(paths), skipped=len(paths) - len(p.todo))
    bar = Progress(len(p.todo), progress or io.StringIO(), progress is not None)
    loads, evictions = sam.npu.loads, sam.npu.evictions
    start = time.perf_counter()
    items = segment_many(sam, (paths[k] for k in p.todo), prompts, threshold, mask_threshold)
    outputs = Outputs(jsonl, coco, out, p.kept)
    try:
        for item in items:
            k = p.todo[item.index]
            lines = _written(item, p.names[k], p.ids[k], p.stems[k], outputs)
            summary.done += item.ok
            summary.failed += [] if item.ok else [(p.names[k], str(item.error))]
            bar.clear()
            say(image_line(p.names[k], lines))
            bar.step(item.ok)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        outputs.close()
        bar.finish()
        summary.seconds = time.perf_counter() - start
        summary.loads, summary.evictions = sam.npu.loads - loads, sam.npu.evictions - evictions
    return summary


def _written(item: ImageResult, name: str, image_id: int, stem: str, outputs: Outputs) -> list[dict[str, Any]]:
    """One image's overlay and lines written; returns the lines."""
    lines = records(item, name, image_id)
    overlay = outputs.overlay(item, stem)
    for x in lines if overlay is not None else []:
        x["overlay"] = str(overlay)
    outputs.write(lines)
    return lines
