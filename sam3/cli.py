"""The `sam3` command (also `python -m sam3`): `demo`, `bundle`, `build` (docs/cli.md).

Exit codes as `amdxdna`'s: 0 success, 1 a failure (an error, a stage out of tolerance), 2 a usage error;
130 on Ctrl-C. Errors print one line, `sam3 <command>: <message>`; with `--json` the JSON error object on
stdout too. A closed or full stdout and an ASCII-only one as `amdxdna` (docs/cli.md "Conventions").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from amdxdna_direct.cli import guarded, one_line
from amdxdna_direct.errors import Error
from sam3 import build as build_mod
from sam3 import demo as demo_mod
from sam3.bundle import Bundle, BundleError, format_summary, hub, split_fields, summarize
from sam3.npu import DEFAULT_TIMEOUT, NpuError

SCHEMA = 1


class UsageParser(argparse.ArgumentParser):
    """argparse that exits 2 with one line on a usage error (as `amdxdna`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


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
    d = sub.add_parser("demo", help="the image encoder of a generated bundle on the NPU, checked against numpy",
                       description="Runs the ViT (host and device-resident paths), the neck and the DETR encoder "
                                   "of generated random-weight bundles through the NPU layer on the emulator (or "
                                   "the NPU with --bundle), each stage checked against numpy float32.")
    d.add_argument("--device", help="emu, emu:<profile> or /dev/accel/N (default: the NPU when a compiled --bundle "
                                    "is given and an NPU is present, else the emulator)")
    d.add_argument("--bundle", help="run the stages of this bundle directory instead of generated ones")
    d.add_argument("--geometry", choices=("tiny", "sam3"), default="tiny",
                   help="sizes of the generated bundles (sam3: full size, 1008 px; slow on the emulator)")
    d.add_argument("--max-contexts", type=int, help="resident hardware context cap (default: env SAM3_MAX_CONTEXTS)")
    d.add_argument("--no-chains", action="store_true", help="dispatch chunk by chunk, as the reference (SAM3_CHAINS=0)")
    d.add_argument("--seed", type=int, default=0, help="seed of the generated weights and inputs")
    d.add_argument("-o", "--overlay", default="overlay.png",
                   help="where the whole pipeline's overlay goes (default overlay.png; '' for none)")
    d.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    b = sub.add_parser("bundle", help="summarise a bundle: params, xclbins, kernels, tensors, problems",
                       description="Reads a bundle (manifest.txt, tensors.txt, tensors.bin) and lists what its files "
                                   "say, as `amdxdna xclbin` does for an xclbin. Exit 1 when a problem is found.")
    b.add_argument("bundle", help="the bundle directory, or owner/name[@revision] in the Hugging Face cache")
    b.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    s = sub.add_parser("segment", help="every instance of a text prompt in an image: score, box, mask",
                       description="Segments IMAGE for each PROMPT (several prompts reuse the image's encoder "
                                   "outputs) and prints the instances in query order, per-stage and per-kernel "
                                   "times, contexts loaded and evicted.")
    s.add_argument("bundle", help="the bundle directory, or owner/name[@revision] in the Hugging Face cache")
    s.add_argument("image", help="a JPEG or PNG image")
    s.add_argument("prompt", nargs="+", help="the text prompt(s)")
    s.add_argument("-o", "--output", help="write an overlay image (masks blended, boxes drawn); format by extension")
    s.add_argument("--threshold", type=float, default=0.5, help="keep instances scoring above this (default 0.5)")
    s.add_argument("--mask-threshold", type=float, default=0.5, help="mask probability cut (default 0.5)")
    s.add_argument("--reps", type=int, default=1, help="forwards per prompt, each timed (default 1)")
    s.add_argument("--device", help="emu, emu:<profile> or /dev/accel/N (default: the NPU, else the emulator)")
    s.add_argument("--json", action="store_true", help="one JSON document; masks as run-length encodings")
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
    return p


def _fail(command: str, message: str, as_json: bool) -> int:
    """One line ``sam3 COMMAND: message`` on stderr and, with ``--json``, the JSON error object on stdout (the
    conventions of ``amdxdna``, docs/cli.md "Conventions")."""
    if as_json:
        print(json.dumps({"schema": SCHEMA, "command": command, "ok": False, "error": message}))
    print(f"sam3 {command}: {one_line(message)}", file=sys.stderr)
    return 1


def _demo(args: argparse.Namespace) -> int:
    say = demo_mod.progress(not args.json or args.geometry != "tiny")
    start = time.perf_counter()
    doc = demo_mod.run_demo(args.device, args.bundle, geometry=args.geometry, max_contexts=args.max_contexts,
                            chains=False if args.no_chains else None, seed=args.seed,
                            overlay=args.overlay or None, say=say)
    print(json.dumps(doc, allow_nan=False) if args.json else demo_mod.format_table(doc))
    say(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if doc["ok"] else 1


def _segment(args: argparse.Namespace) -> int:
    from sam3 import post
    from sam3.pipeline import Sam3

    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    # The tokenizer frames an empty prompt as the reference does; on the command line it is a mistake
    # (docs/sam3-host.md 4.3). split_fields splits on the White_Space the tokenizer drops.
    blank = next((p for p in args.prompt if not split_fields(p)), None)
    if blank is not None:
        raise ValueError(f"prompt {blank!r} is empty: nothing to segment")
    start = time.perf_counter()
    device = demo_mod.choose_device(args.device, args.bundle, lambda m: print(f"sam3: {m}", file=sys.stderr))
    try:
        timeout = demo_mod.EMULATOR_TIMEOUT if device.emulator is not None else DEFAULT_TIMEOUT
        with Sam3(args.bundle, device, timeout=timeout) as sam:
            where = f"emulator ({device.name})" if device.emulator is not None else f"NPU ({device.name})"
            loaded = time.perf_counter() - start
            if not args.json:
                print(f"loaded {args.bundle} ({loaded:.1f} s); mode npu on {where}")
            doc: dict[str, Any] = {"schema": SCHEMA, "command": "segment", "bundle": str(args.bundle),
                                   "image": str(args.image), "device": device.name, "load_seconds": loaded,
                                   "prompts": []}
            results = []
            for prompt in args.prompt:
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
                results.append(found)
                if not args.json:
                    print(f"{json.dumps(prompt)}: {len(found)} instance(s)")
                    print("\n".join(found.lines())) if len(found) else None
                doc["prompts"].append({"prompt": prompt, "forwards": forwards, "instances": [
                    {"query": int(q), "score": float(sc), "box": [float(v) for v in box], "pixels": int(area),
                     "mask": post.rle_encode(m)}
                    for q, sc, box, area, m in zip(found.queries, found.scores, found.boxes, found.areas(),
                                                   found.masks, strict=True)]})
            if args.output:
                path = post.write_overlay(args.output, result.rgb, _merge(results))
                doc["overlay"] = str(path)
                if not args.json:
                    print(f"wrote {path}")
    finally:
        device.close()
    if args.json:
        print(json.dumps(doc, allow_nan=False))
    return 0


def _merge(results: list[Any]) -> Any:
    """All prompts' instances as one set, for one overlay."""
    import numpy as np

    from sam3.post import Instances

    if len(results) == 1:
        return results[0]
    return Instances(*(np.concatenate([getattr(r, f) for r in results]) for f in ("queries", "scores", "boxes",
                                                                              "masks")))


def _bundle(args: argparse.Namespace) -> int:
    bundle = Bundle.open(args.bundle)
    try:
        summary = summarize(bundle)
    finally:
        bundle.close()
    if args.json:
        print(json.dumps({"schema": SCHEMA, **summary}, allow_nan=False))
    else:
        print(format_summary(summary))
    return 1 if summary.get("problems") else 0


def _download(args: argparse.Namespace) -> int:
    try:
        where = hub.download(args.repo, args.revision)
    except hub.HubError as e:  # its own line, without the "bundle:" of a bundle's errors
        return _fail("download", str(e), args.json)
    revision = args.revision or args.repo.partition("@")[2] or hub.DEFAULT_REVISION
    doc = {"schema": SCHEMA, "command": "download", "ok": True, "repo": args.repo.partition("@")[0],
           "revision": revision, "commit": where.name, "path": str(where)}
    print(json.dumps(doc) if args.json else where)
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
    return guarded("sam3", lambda: _main(argv), argv, _COMMANDS)


_COMMANDS = ("demo", "bundle", "segment", "download", "build", "check", "export")


def _main(argv: list[str]) -> int:
    _log_warnings()
    if argv[:1] == ["build"]:
        return build_mod.main(argv[1:], prog="sam3 build")
    if argv[:1] == ["check"]:
        from sam3 import check

        return check.main(argv[1:], prog="sam3 check")
    if argv[:1] == ["export"]:
        from sam3 import export

        return export.main(argv[1:], prog="sam3 export")
    args = parser().parse_args(argv)
    as_json = getattr(args, "json", False)
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
