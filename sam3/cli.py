"""The `sam3` command (also `python -m sam3`): `demo`, `bundle`, `build` (docs/cli.md).

Exit codes as `amdxdna`'s: 0 success, 1 a failure (an error, a stage out of tolerance), 2 a usage error;
130 on Ctrl-C. Errors print one line, `sam3 <command>: <message>`; with `--json` the JSON error object on
stdout too. A closed or full stdout and an ASCII-only one as `amdxdna` (docs/cli.md "Conventions").

The stages, numpy and Pillow are imported by the command that needs them, inside `guarded`, so that a Ctrl-C
during those imports (about a second) is one line and 130 too; every name, path and value printed has its
control characters escaped (docs/sam3-cli.md "Hostile text").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from amdxdna_direct.cli import guarded, one_line, shown
from amdxdna_direct.errors import Error

SCHEMA = 1


class UsageParser(argparse.ArgumentParser):
    """argparse that exits 2 with one line on a usage error (as `amdxdna`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {one_line(message)}\n")  # "unrecognized arguments: ..." quotes them raw


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("amdxdna-direct")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    """The `sam3` argument parser."""
    p = UsageParser(prog="sam3", description="Segment Anything 3 with its heavy layers on an AMD XDNA NPU "
                                         "(or the emulator), reading IRON's kernel bundles.")
    p.add_argument("--version", action="version", version=f"sam3 (amdxdna-direct) {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=UsageParser)
    d = sub.add_parser("demo", help="the whole pipeline on a generated bundle: stages checked, an image segmented",
                       description="Runs the whole SAM3 pipeline through the NPU layer on the emulator (or the NPU "
                                   "with --bundle): first the ViT (host and device-resident paths), the neck and the "
                                   "DETR encoder of generated random-weight bundles, each stage checked against "
                                   "numpy float32; then the bundle's reference image and prompt from pixels to "
                                   "instances (text encoder, DETR decoder, mask decoder, post-processing), drawn "
                                   "into an overlay enlarged to at least 512 px with each instance's score (with "
                                   "random weights no instance passes 0.5: the best 3 queries are drawn).")
    d.add_argument("--device", help="emu, emu:<profile> or /dev/accel/N (default: the NPU when a compiled --bundle "
                                    "is given and an NPU is present, else the emulator)")
    d.add_argument("--bundle", help="run the stages of this bundle directory instead of generated ones")
    d.add_argument("--geometry", choices=("tiny", "sam3"), default="tiny",
                   help="sizes of the generated bundles (sam3: full size, 1008 px; slow on the emulator)")
    d.add_argument("--max-contexts", type=int, help="resident hardware context cap (default: env SAM3_MAX_CONTEXTS)")
    d.add_argument("--no-chains", action="store_true", help="dispatch chunk by chunk, as the reference (SAM3_CHAINS=0)")
    d.add_argument("--seed", type=int, default=0, help="seed of the generated weights and inputs")
    d.add_argument("-o", "--overlay", default="overlay.png",
                   help="where the overlay goes: the instances and their scores on the reference image, "
                        "enlarged (default overlay.png; '' for none)")
    d.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    b = sub.add_parser("bundle", help="summarise a bundle: params, xclbins, kernels, tensors, problems",
                       description="Reads a bundle (manifest.txt, tensors.txt, tensors.bin) and lists what its files "
                                   "say, as `amdxdna xclbin` does for an xclbin. Exit 1 when a problem is found.")
    b.add_argument("bundle", help="the bundle directory, or owner/name[@revision] in the Hugging Face cache")
    b.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    s = sub.add_parser("segment", help="every instance of text prompts in one image or many: score, box, mask",
                       usage="sam3 segment BUNDLE IMAGE PROMPT [PROMPT ...] [options]\n"
                             "       sam3 segment BUNDLE IMAGES... --prompt P [--prompt Q ...] [--jsonl FILE] "
                             "[--coco FILE] [--out DIR] [--resume] [--quiet] [options]",
                       description="One image: segments IMAGE for each PROMPT (several prompts reuse the image's "
                                   "encoder outputs) and prints the instances in query order, per-stage and "
                                   "per-kernel times, contexts loaded and evicted. Many images (the form with "
                                   "--prompt): IMAGES are files, directories (their .jpg/.jpeg/.png) and glob "
                                   "patterns, run with the bundle opened once; results are written as each image "
                                   "finishes, a progress bar shows on a terminal, an image that fails is reported "
                                   "and the run goes on (exit 1 at the end).")
    s.add_argument("bundle", help="the bundle directory, or owner/name[@revision] in the Hugging Face cache")
    s.add_argument("inputs", nargs="+", metavar="IMAGE_OR_PROMPT",
                   help="without --prompt: the image, then its prompt(s); with --prompt: the images")
    s.add_argument("--prompt", action="append", metavar="P", help="a text prompt (repeat for more): the many-image "
                                                                  "form, every positional after BUNDLE an image")
    s.add_argument("-o", "--output", help="write an overlay image (masks blended, boxes drawn); format by extension")
    s.add_argument("--threshold", type=float, default=0.5, help="keep instances scoring above this (default 0.5)")
    s.add_argument("--mask-threshold", type=float, default=0.5, help="mask probability cut (default 0.5)")
    s.add_argument("--reps", type=int, default=1, help="forwards per prompt, each timed (default 1)")
    s.add_argument("--device", help="emu, emu:<profile> or /dev/accel/N (default: the NPU, else the emulator)")
    s.add_argument("--json", action="store_true", help="one JSON document; masks as run-length encodings")
    s.add_argument("--jsonl", metavar="FILE", help="many images: one JSON line per image and prompt, as they finish")
    s.add_argument("--coco", metavar="FILE", help="many images: the instances as COCO results (RLE masks)")
    s.add_argument("--out", metavar="DIR", help="many images: one overlay per image, DIR/<name>.png")
    s.add_argument("--resume", action="store_true", help="many images: skip the images the --jsonl file has done")
    s.add_argument("-q", "--quiet", action="store_true", help="many images: no progress bar, no per-image lines")
    s.add_argument("--max-pixels", type=_pixels, metavar="N", help="refuse an image of more than N pixels, from its "
                   "header (default 67108864, 8192 x 8192: docs/sam3-segment.md 11.2)")
    dl = sub.add_parser("download", help="fetch a bundle from the Hugging Face Hub into its cache",
                        description="Fetches the repository OWNER/NAME with huggingface_hub (the hub extra) into the "
                                    "Hugging Face cache and prints its snapshot directory; bundle arguments then "
                                    "accept OWNER/NAME[@REVISION].")
    dl.add_argument("repo", help="owner/name[@revision]")
    dl.add_argument("--revision", help="branch, tag or commit (default main)")
    dl.add_argument("--json", action="store_true", help="print one JSON document")
    sub.add_parser("build", help="write a generated bundle (sam3 build --help)", add_help=False)
    sub.add_parser("check", help="check a bundle against its own float32 reference (sam3 check --help)",
                   add_help=False)
    sub.add_parser("export", help="write a bundle from a transformers SAM3 checkpoint (sam3 export --help)",
                   add_help=False)
    sub.add_parser("points", help="masks of a point/box prompt (sam3 points --help)", add_help=False)
    return p


def _fail(command: str, message: str, as_json: bool) -> int:
    """One line ``sam3 COMMAND: message`` on stderr and, with ``--json``, the JSON error object on stdout (the
    conventions of ``amdxdna``, docs/cli.md "Conventions")."""
    if as_json:
        print(json.dumps({"schema": SCHEMA, "command": command, "ok": False, "error": message}))
    print(f"sam3 {command}: {one_line(message)}", file=sys.stderr)
    return 1


def _pixels(text: str) -> int:
    """--max-pixels N: a positive whole number."""
    value = int(text) if text.strip().isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number of pixels, got {text!r}")
    return value


def _escaped(value: Any) -> Any:
    """``value`` with every string in it (keys too) through ``one_line``: for the text forms only, which print
    names and values read from files (JSON escapes control characters itself)."""
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escaped(v) for v in value]
    return value


def _line(text: str) -> None:
    """One line on stdout, its control characters escaped."""
    print(one_line(text))


def _note(text: str) -> None:
    """One ``sam3: ...`` line on stderr (the device chosen), its control characters escaped."""
    print(f"sam3: {one_line(text)}", file=sys.stderr)


def _demo(args: argparse.Namespace) -> int:
    from sam3 import demo as demo_mod

    say = demo_mod.progress(not args.json or args.geometry != "tiny")
    start = time.perf_counter()
    doc = demo_mod.run_demo(args.device, args.bundle, geometry=args.geometry, max_contexts=args.max_contexts,
                            chains=False if args.no_chains else None, seed=args.seed,
                            overlay=args.overlay or None, say=say)
    print(json.dumps(doc, allow_nan=False) if args.json else demo_mod.format_table(_escaped(doc)))
    say(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if doc["ok"] else 1


_MANY_ONLY = ("jsonl", "coco", "out", "resume", "quiet")


def _usage(message: str) -> NoReturn:
    """A usage error found after parsing: one line, exit 2 (as the parser's own)."""
    sys.stderr.write(f"sam3 segment: {message}\n")
    raise SystemExit(2)


def _check_prompts(prompts: Sequence[str]) -> None:
    """Refuse, before the bundle is opened, a prompt that is not UTF-8 text (argv bytes that did not decode reach
    Python as lone surrogates: docs/sam3-cli.md "Hostile text"), then a blank one.

    Raises:
        ValueError: names the prompt (escaped) and the first byte that is not UTF-8.
    """
    for prompt in prompts:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            code = ord(prompt[e.start])
            what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"code point U+{code:04X}"
            raise ValueError(f"prompt {shown(prompt)} is not UTF-8 text ({what} at character {e.start})") from None
    _refuse_blank(prompts)


def _refuse_blank(prompts: Sequence[str]) -> None:
    """The tokenizer frames an empty prompt as the reference does; on the command line it is a mistake
    (docs/sam3-host.md 4.3). split_fields splits on the White_Space the tokenizer drops.

    Raises:
        ValueError: a prompt with no characters but white space, before the bundle is opened.
    """
    from sam3.bundle import split_fields

    blank = next((p for p in prompts if not split_fields(p)), None)
    if blank is not None:
        raise ValueError(f"prompt {blank!r} is empty: nothing to segment")


def _segment(args: argparse.Namespace) -> int:
    from sam3 import demo as demo_mod
    from sam3 import many, post
    from sam3.npu import DEFAULT_TIMEOUT
    from sam3.pipeline import Sam3

    if args.prompt:
        _check_prompts(args.prompt)
        return _segment_many(args)
    given = [f"--{o}" for o in _MANY_ONLY if getattr(args, o)]
    if given:
        _usage(f"{', '.join(given)}: only in the many-image form, BUNDLE IMAGES... --prompt P")
    if len(args.inputs) < 2:
        _usage("give an image and its prompt(s), BUNDLE IMAGE PROMPT..., or images and --prompt P")
    args.image, prompts = args.inputs[0], args.inputs[1:]
    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    _check_prompts(prompts)
    start = time.perf_counter()
    device = demo_mod.choose_device(args.device, args.bundle, _note)
    try:
        timeout = demo_mod.EMULATOR_TIMEOUT if device.emulator is not None else DEFAULT_TIMEOUT
        with Sam3(args.bundle, device, timeout=timeout, max_pixels=_max_pixels(args)) as sam:
            where = f"emulator ({device.name})" if device.emulator is not None else f"NPU ({device.name})"
            loaded = time.perf_counter() - start
            if not args.json:
                print(f"loaded {shown(args.bundle)} ({loaded:.1f} s); mode npu on {where}")
            doc: dict[str, Any] = {"schema": SCHEMA, "command": "segment", "bundle": str(args.bundle),
                                   "image": str(args.image), "device": device.name, "load_seconds": loaded,
                                   "prompts": []}
            results = []
            for prompt in prompts:
                forwards = []
                for rep in range(args.reps):
                    begin = time.perf_counter()
                    result = sam.segment(args.image, prompt, args.threshold, args.mask_threshold)
                    ms = (time.perf_counter() - begin) * 1e3
                    forwards.append({"ms": ms, **result.timing.as_dict(), "loads": result.loads,
                                     "evictions": result.evictions})
                    if not args.json:
                        print(f"forward {rep}: {ms:.0f} ms ({result.timing.line()}; contexts loaded {result.loads}, "
                              f"evicted {result.evictions})")
                found = result.instances
                results.append(result)
                if not args.json:
                    print(f"{json.dumps(prompt)}: {len(found)} instance(s)")
                    print("\n".join(found.lines())) if len(found) else None
                doc["prompts"].append({"prompt": prompt, "forwards": forwards, "instances": [
                    {"query": int(q), "score": float(sc), "box": [float(v) for v in box], "pixels": int(area),
                     "mask": post.rle_encode(m)}
                    for q, sc, box, area, m in zip(found.queries, found.scores, found.boxes, found.areas(),
                                                   found.masks, strict=True)]})
            if args.output:
                path = post.write_overlay(args.output, result.rgb, many.merge(results))
                doc["overlay"] = str(path)
                if not args.json:
                    print(f"wrote {shown(path)}")
    finally:
        device.close()
    if args.json:
        print(json.dumps(doc, allow_nan=False))
    return 0


def _segment_many(args: argparse.Namespace) -> int:
    """`sam3 segment BUNDLE IMAGES... --prompt P ...` (docs/sam3-cli.md): the bundle opened once, `many.run`."""
    from sam3 import demo as demo_mod
    from sam3 import many
    from sam3.npu import DEFAULT_TIMEOUT
    from sam3.pipeline import Sam3

    if args.output:
        _usage("-o/--output is the one-image form's: with --prompt, write overlays with --out DIR")
    if args.reps != 1:
        _usage("--reps is the one-image form's")
    if args.resume and not args.jsonl:
        _usage("--resume needs --jsonl FILE: the results it reads back")
    paths = many.expand(args.inputs)
    chatty = not (args.quiet or args.json)
    start = time.perf_counter()
    device = demo_mod.choose_device(args.device, args.bundle, _note)
    try:
        timeout = demo_mod.EMULATOR_TIMEOUT if device.emulator is not None else DEFAULT_TIMEOUT
        with Sam3(args.bundle, device, timeout=timeout, max_pixels=_max_pixels(args)) as sam:
            loaded = time.perf_counter() - start
            if chatty:
                where = "emulator" if device.emulator is not None else "NPU"
                print(f"loaded {shown(args.bundle)} ({loaded:.1f} s); mode npu on {where} ({device.name}); "
                      f"{len(paths)} image(s), {len(args.prompt)} prompt(s)")
            bar = sys.stderr if chatty and sys.stderr.isatty() else None
            summary = many.run(sam, paths, args.prompt, jsonl=_path(args.jsonl), coco=_path(args.coco),
                               out=_path(args.out), resume=args.resume, threshold=args.threshold,
                               mask_threshold=args.mask_threshold, progress=bar, say=_line if chatty else _silent)
    finally:
        device.close()
    if args.json:
        print(json.dumps({"schema": SCHEMA, "command": "segment", "bundle": str(args.bundle), "device": device.name,
                          "load_seconds": loaded, "prompts": args.prompt, "jsonl": args.jsonl, "coco": args.coco,
                          "out": args.out, **summary.as_dict(), "ok": not summary.failed}, allow_nan=False))
    else:
        print("\n".join(map(one_line, summary.lines())))
    if summary.interrupted:
        raise KeyboardInterrupt  # what was done is written: guarded() says "interrupted" and exits 130
    if summary.failed:
        print(f"sam3 segment: {len(summary.failed)} of {summary.images} image(s) failed", file=sys.stderr)
        return 1
    return 0


def _max_pixels(args: argparse.Namespace) -> int:
    """--max-pixels, else the library's default (preprocess.MAX_PIXELS)."""
    from sam3 import preprocess

    return preprocess.MAX_PIXELS if args.max_pixels is None else int(args.max_pixels)


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


def _silent(line: str) -> None:
    """Per-image lines under --quiet or --json: none."""


def _bundle(args: argparse.Namespace) -> int:
    from sam3.bundle import Bundle, format_summary, summarize

    bundle = Bundle.open(args.bundle)
    try:
        summary = summarize(bundle)
    finally:
        bundle.close()
    if args.json:
        print(json.dumps({"schema": SCHEMA, **summary}, allow_nan=False))
    else:
        print(format_summary(_escaped(summary)))  # a manifest's values and names may hold terminal escapes
    return 1 if summary.get("problems") else 0


def _download(args: argparse.Namespace) -> int:
    from sam3.bundle import hub

    try:
        where = hub.download(args.repo, args.revision)
    except hub.HubError as e:  # its own line, without the "bundle:" of a bundle's errors
        return _fail("download", str(e), args.json)
    revision = args.revision or args.repo.partition("@")[2] or hub.DEFAULT_REVISION
    doc = {"schema": SCHEMA, "command": "download", "ok": True, "repo": args.repo.partition("@")[0],
           "revision": revision, "commit": where.name, "path": str(where)}
    print(json.dumps(doc) if args.json else shown(where))
    return 0


def _log_warnings() -> None:
    """The library's warnings (a truncated prompt, ...) as one stderr line each, unless the caller configured
    logging itself."""
    log = logging.getLogger("sam3")
    own = [h for h in log.handlers if not isinstance(h, logging.NullHandler)]
    if not own and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("sam3: warning: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """The `sam3` console script: exit codes, Ctrl-C, a closed or full stdout and an ASCII-only stdout handled as
    by `amdxdna` (`amdxdna_direct.cli.guarded`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded("sam3", lambda: _interruptible(argv), argv, _COMMANDS)


def interrupted(argv: Sequence[str] | None = None) -> int:
    """What a Ctrl-C before `main` could run ends in (`python -m sam3` while importing this module): the line
    ``sam3 COMMAND: interrupted`` on stderr; returns 130."""
    return guarded("sam3", _raise_interrupt, list(sys.argv[1:] if argv is None else argv), _COMMANDS)


def _raise_interrupt() -> int:
    raise KeyboardInterrupt


def _interruptible(argv: list[str]) -> int:
    """`_main`, with a Ctrl-C that an import turned into another error (numpy's C API reports an interrupted
    import of numpy as an ImportError) raised as the KeyboardInterrupt it was."""
    try:
        return _main(argv)
    except Exception as e:
        if _from_interrupt(e):
            raise KeyboardInterrupt from None
        raise


def _from_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while handling a KeyboardInterrupt (its cause or context chain holds one)."""
    seen: BaseException | None = exc
    for _ in range(64):  # a chain is short; a cycle is not followed for ever
        if seen is None:
            return False
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_COMMANDS = ("demo", "bundle", "segment", "download", "build", "check", "export", "points")


def _main(argv: list[str]) -> int:
    _log_warnings()
    if argv[:1] == ["build"]:
        from sam3 import build as build_mod

        return build_mod.main(argv[1:], prog="sam3 build")
    if argv[:1] == ["check"]:
        from sam3 import check

        return check.main(argv[1:], prog="sam3 check")
    if argv[:1] == ["export"]:
        from sam3 import export

        return export.main(argv[1:], prog="sam3 export")
    if argv[:1] == ["points"]:
        from sam3 import points_cli
        return points_cli.main(argv[1:], prog="sam3 points")
    args = parser().parse_args(argv)
    as_json = getattr(args, "json", False)
    from sam3.bundle import BundleError
    from sam3.npu import NpuError

    try:
        handler: Any = {"demo": _demo, "bundle": _bundle, "segment": _segment, "download": _download}[args.command]
        return int(handler(args))
    except BrokenPipeError:
        raise  # stdout's own failures: guarded() ends quietly or says so in one line
    except BundleError as e:
        return _fail(args.command, f"bundle: {e}", as_json)
    except NpuError as e:
        return _fail(args.command, f"NPU: {e}", as_json)
    except (ValueError, OSError, Error) as e:  # OSError: XdnaError, an unreadable or unwritable file
        return _fail(args.command, str(e), as_json)
    except (MemoryError, OverflowError) as e:  # a size no file should claim, met before the reader refused it
        return _fail(args.command, f"{type(e).__name__}: {e or 'a size too large to allocate'}", as_json)


if __name__ == "__main__":
    sys.exit(main())
