"""``amdxdna validate``: latency and throughput of real designs on the device, and their output checked.

The designs: one ``--xclbin``/``--insts`` pair, the kernels of a SAM3 bundle (``--bundle DIR``, through
``sam3.bundle.Bundle.open(dir)``, ``kernel_keys()`` and ``kernel(key)``, whose kernels carry ``.xclbin``,
``.insts`` and ``.name``), and XRT's own validate designs where XRT installs them (``--xrt DIR``:
``share/amdxdna/bins``), which are reported, and run when they come with an instruction stream this
runtime runs (docs/cli.md "amdxdna validate").

Per design: a latency test (``--runs`` single runs: the host's dispatch time, the time from submission
to the completion seen, and end to end; min, median, p99) and a throughput test (``--chain`` runs in
one RunList, ``--repeat`` times). The output of a passthrough design (``--passthrough``, or the
emulator's passthrough model bound with ``--model``) must equal its input; other outputs are "not
checked". Buffers are the ones the stream patches, each as long as its buffer descriptor says.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import extensions, insts, open_device
from ..device import Device
from ..doctor import bind_model, is_emulated
from ..emu.models import Passthrough
from ..errors import Error, XdnaError, errno_text
from ..files import FileRefused
from ..xclbin import Xclbin
from . import Subparsers, add_device_option, command_parser, dump_json, fail, positive_int, shown
from .run_cmd import UsageError, parse_model

if TYPE_CHECKING:
    from ..bo import Bo
    from ..emu.models import Gemm
    from ..hwctx import HwContext
    from ..kernel import Kernel, Run

__all__ = ["Design", "DEFAULT_XRT", "find_bundle_designs", "find_xrt_designs", "read_ar", "validate_design",
           "add_parser", "run"]

DEFAULT_XRT = "/opt/xilinx/xrt"
# XRT's validate designs: per-device directories <devid>_<rev>/ and per-platform archives (docs/cli.md).
XRT_BINS = "share/amdxdna/bins"
XRT_ARCHIVES = {"npu1": "xrt_smi_phx.a", "npu4": "xrt_smi_strx.a", "npu5": "xrt_smi_strx.a",
                "npu6": "xrt_smi_strx.a"}
PCI_DIRS = {"npu1": "1502_00", "npu4": "17f0_10", "npu5": "17f0_11", "npu6": "17f0_20"}
MIN_BUFFER = 4096
TIMEOUT = 10.0

EXIT_CODES = """\
designs (at least one is needed):
  --xclbin X --insts I   one design: an xclbin and its TXN instruction stream
  --bundle DIR           every kernel of a SAM3 bundle (sam3.bundle.Bundle.open)
  --xrt DIR              XRT's validate designs under DIR/share/amdxdna/bins (reported; run when they
                         come with a TXN instruction stream: XRT's own use ELF control code)

exit codes:
  0    every design that ran passed its latency and throughput tests and its output check (or the output
       was not checked); designs that cannot run are reported as skipped
  1    a design failed (a run failed, its output differs, a file cannot be read or is malformed), or the
       device could not be opened (message on stderr)
  2    usage error: no runnable design or every design skipped (the message says what is needed), --xclbin
       without --insts or the reverse, --model on a real device or unknown, bad --runs/--chain/--repeat,
       unknown emulator profile"""


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``validate`` on an ``argparse`` subparsers object."""
    parser = command_parser(
        subparsers, "validate",
        "Run each design (an xclbin and instruction stream, a SAM3 bundle's kernels, XRT's validate "
        "designs) as xrt-smi validate does: a latency test of single runs (min, median, p99 of the host's "
        "dispatch time, the time from submission to completion, and end to end) and a throughput test of "
        "chained runs (a RunList), then check the output (passthrough designs: output == input).", EXIT_CODES)
    add_device_option(parser, "device to validate", "$AMDXDNA_DEVICE, else the first /dev/accel node driven by "
                      "amdxdna")
    parser.add_argument("--xclbin", metavar="X", help="a design's xclbin (with --insts; default: none)")
    parser.add_argument("--insts", metavar="I",
                        help="the design's TXN instruction stream, insts.bin or insts.txt (with --xclbin; "
                             "default: none)")
    parser.add_argument("--kernel", metavar="NAME",
                        help="kernel of the --xclbin to run (default: its first runnable kernel)")
    parser.add_argument("--bundle", metavar="DIR", help="validate every kernel of this SAM3 bundle (default: none)")
    parser.add_argument("--xrt", metavar="DIR", default=None,
                        help=f"where XRT is installed, to find its validate designs (default: {DEFAULT_XRT} when "
                             "neither --xclbin nor --bundle is given)")
    parser.add_argument("--passthrough", action="store_true",
                        help="the --xclbin design copies its lowest patched buffer into its highest: check the "
                             "output equals the input (on the emulator the passthrough model is bound) "
                             "(default: output not checked)")
    parser.add_argument("--model", metavar="MODEL",
                        help="emulator only: bind passthrough or gemm:M,K,N to the design's stream (default: "
                             "none; a stream without a model cannot run on the emulator)")
    parser.add_argument("--runs", type=positive_int, default=100, metavar="N",
                        help="single runs of the latency test (default: 100)")
    parser.add_argument("--chain", type=positive_int, default=24, metavar="N",
                        help="runs chained in one RunList for the throughput test (default: 24)")
    parser.add_argument("--repeat", type=positive_int, default=5, metavar="N",
                        help="submissions of the chain in the throughput test (default: 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON document (default: text)")
    return parser


@dataclass
class Design:
    """A design to validate: where it comes from, its files, the kernel, the check to make, a model to bind."""

    name: str
    xclbin: Any
    insts: Any
    kernel: str | None = None
    passthrough: bool = False
    model: Any = None
    skip: str = ""          # why it cannot run (an XRT design without a TXN stream)
    extra: dict[str, Any] = field(default_factory=dict)


def run(args: argparse.Namespace) -> int:
    """Validate every design given; 0 all passed, 1 one failed, 2 usage (no runnable design)."""
    try:
        designs, notes = _designs(args)
    except UsageError as exc:
        return fail("validate", str(exc), args.json, code=2)
    runnable = [d for d in designs if not d.skip]
    if not runnable:
        found = "; ".join([*notes, *(f"{d.name}: {d.skip}" for d in designs)])
        return fail("validate", "no design to run. It needs one of: --xclbin X --insts I (an xclbin and its TXN "
                    "instruction stream), --bundle DIR (a SAM3 bundle), or XRT's validate designs with a TXN stream "
                    f"under --xrt DIR/{XRT_BINS}" + (f" ({found})" if found else ""), args.json, code=2,
                    notes=notes, designs=[_skipped(d) for d in designs])
    try:
        dev = open_device(args.device)
    except XdnaError as exc:
        return fail("validate", str(exc), args.json, device=args.device if isinstance(args.device, str) else None)
    with dev:
        reports = [_skipped(d) if d.skip else validate_design(dev, d, args.runs, args.chain, args.repeat)
                   for d in designs]
        document = {"device": dev.name, "generation": dev.generation, "notes": notes, "designs": reports}
    print(dump_json("validate", document, indent=2) if args.json else _format(document))
    if any(r["status"] == "fail" for r in reports):
        return 1
    if all(r["status"] == "skipped" for r in reports):
        print("amdxdna validate: no design ran: each was skipped (see why above)", file=sys.stderr)
        return 2
    return 0


def _designs(args: argparse.Namespace) -> tuple[list[Design], list[str]]:
    """Raises: UsageError: a design option is wrong (the message names it)."""
    if (args.xclbin is None) != (args.insts is None):
        raise UsageError("--xclbin and --insts go together (a design's xclbin and its instruction stream)")
    model = _model(args)
    designs, notes = [], []
    if args.xclbin is not None:
        name = f"{shown(Path(args.xclbin).name)} + {shown(Path(args.insts).name)}"
        designs.append(Design(name, args.xclbin, args.insts, args.kernel,
                              args.passthrough or isinstance(model, Passthrough), model))
    elif args.passthrough or args.kernel:
        raise UsageError("--passthrough and --kernel describe the --xclbin design: give --xclbin and --insts")
    if args.bundle is not None:
        found, note = find_bundle_designs(args.bundle, model)
        designs += found
        notes += [note] if note else []
    asked = args.xclbin is not None or args.bundle is not None
    xrt = args.xrt if args.xrt is not None else (None if asked else DEFAULT_XRT)
    if xrt is not None:
        found, note = find_xrt_designs(Path(xrt), _generation_hint(args.device))
        designs += found
        notes += [note] if note else []
    return designs, notes


def _model(args: argparse.Namespace) -> Passthrough | Gemm | None:
    if args.model is None:
        return None
    if not is_emulated(args.device):
        raise UsageError(f"--model binds an emulator model; {args.device or 'the default device'} is not the "
                         "emulator")
    return parse_model(args.model)


def _generation_hint(device: Any) -> str | None:
    if isinstance(device, str) and device.startswith("emu"):
        return device.partition(":")[2] or "npu4"
    return None


def find_bundle_designs(directory: str, model: Any = None) -> tuple[list[Design], str]:
    """The kernels of the bundle in ``directory``, from the bundle readers other packages register
    (``amdxdna_direct.extensions``: sam3 registers one); ([], why) when none is registered or none reads it.

    Each kernel carries the model of what it computes (the reader's), bound on the emulator so that the
    bundle's own streams run there; ``--model`` overrides it."""
    readers = extensions.bundle_readers()
    if not readers:
        return [], (f"--bundle {directory}: skipped: no bundle reader is registered (install the sam3 extra, whose "
                    f"entry point group {extensions.BUNDLE_READER_GROUP} provides one)")
    reasons = []
    for name, reader in readers.items():
        try:
            kernels = extensions.load_reader(reader)(directory)
        except extensions.BundleUnavailable as exc:
            reasons.append(str(exc) if len(readers) == 1 else f"{name}: {exc}")
            continue
        return [Design(f"bundle {k.key}", k.xclbin, k.insts, k.kernel, isinstance(model, Passthrough),
                       model or k.model) for k in kernels], ""
    return [], f"--bundle {directory}: skipped: {'; '.join(reasons)}"


def read_ar(data: bytes) -> dict[str, bytes]:
    """The members of an ``ar`` archive (the format of XRT's ``xrt_smi_*.a``): name -> bytes.

    GNU long names (``//`` table, ``/offset`` names) are resolved; the symbol table ``/`` is skipped.

    Raises:
        ValueError: not an ar archive, or a member header is malformed (naming its offset).
    """
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (no !<arch> magic)")
    members: dict[str, bytes] = {}
    long_names = b""
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        if header[58:60] != b"`\n":
            raise ValueError(f"ar member header at offset {pos} is malformed")
        name = header[:16].decode(errors="replace").rstrip()
        try:
            size = int(header[48:58].decode().strip())
        except ValueError:
            raise ValueError(f"ar member header at offset {pos}: size {header[48:58]!r} is not a number") from None
        body = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name == "//":
            long_names = body
        elif name.startswith("/") and name[1:].isdigit():
            start = int(name[1:])
            members[long_names[start:long_names.index(b"/\n", start)].decode(errors="replace")] = body
        elif name not in ("/", "/SYM64/"):
            members[name.rstrip("/")] = body
    return members


def find_xrt_designs(xrt: Path, generation: str | None = None) -> tuple[list[Design], str]:
    """XRT's validate designs under ``xrt/share/amdxdna/bins``: per-device directories and the platform
    archives. A design runs here only with a TXN instruction stream beside its xclbin (``*.bin``/``*.txt``
    of the same stem); XRT's use ELF control code or XRT's instruction formats, so they are reported
    with the reason they are not run."""
    bins = xrt / XRT_BINS
    if not bins.is_dir():
        return [], f"XRT validate designs: {bins} does not exist (XRT not installed there)"
    designs = []
    wanted = {PCI_DIRS[generation]} if generation in PCI_DIRS else set(PCI_DIRS.values())
    for sub in sorted(p for p in bins.iterdir() if p.is_dir() and p.name in wanted):
        for xclbin in sorted(sub.glob("*.xclbin")):
            stream = next((p for p in (xclbin.with_suffix(".bin"), xclbin.with_suffix(".txt")) if p.is_file()), None)
            skip = "" if stream else ("no TXN instruction stream beside it (XRT pairs it with ELF control code, "
                                      f"{', '.join(p.name for p in sorted(sub.glob('*.elf'))) or 'not shipped'}), "
                                      "which amdxdna-direct does not run")
            designs.append(Design(f"XRT {sub.name}/{xclbin.name}", xclbin, stream, skip=skip))
    archives = {XRT_ARCHIVES[generation]} if generation in XRT_ARCHIVES else set(XRT_ARCHIVES.values())
    for name in sorted(archives):
        path = bins / name
        if path.is_file():
            designs.append(_archive_design(path))
    return designs, "" if designs else f"XRT validate designs: none for this NPU under {bins}"


def _archive_design(path: Path) -> Design:
    try:
        members = read_ar(path.read_bytes())
    except (OSError, ValueError) as exc:
        return Design(f"XRT {path.name}", None, None, skip=f"unreadable: {exc}")
    listed = ", ".join(sorted(members))
    return Design(f"XRT {path.name}", None, None, skip=f"holds {listed}: its designs run ELF control code "
                  "(nop.elf) through XRT's runner recipes, which amdxdna-direct does not run",
                  extra={"members": sorted(members)})


def _skipped(design: Design) -> dict[str, Any]:
    return {"design": design.name, "status": "skipped", "detail": design.skip, **design.extra}


def validate_design(dev: Device, design: Design, runs: int, chain: int, repeat: int) -> dict[str, Any]:
    """Latency, throughput and the output check of one design on ``dev``; a report dict whose ``status`` is
    ``pass``, ``fail`` (with ``detail``) or ``skipped`` (the emulator has no model for its stream)."""
    report: dict[str, Any] = {"design": design.name}
    try:
        xclbin = _load("xclbin", Xclbin.load, design.xclbin)
        stream = _load("instruction stream", insts.load, design.insts)
        extents = insts.buffer_reach(stream)
    except ValueError as exc:
        return {**report, "status": "fail", "detail": str(exc)}
    report["buffers"] = {f"bo{slot}": size for slot, size in sorted(extents.items())}
    if dev.emulator is not None:
        model = design.model or (Passthrough() if design.passthrough else None)
        if model is not None:
            bind_model(dev.emulator, stream, model)
        elif insts.encode(stream) not in dev.emulator.models:
            return {**report, "status": "skipped", "detail": "the emulator has no model bound to this design's "
                    "stream: give --passthrough or --model (passthrough, gemm:M,K,N)"}
    try:
        report.update(_measure(dev, xclbin, design, stream, extents, runs, chain, repeat))
    except (XdnaError, ValueError, RuntimeError) as exc:
        return {**report, "status": "fail", "detail": f"{exc}"}
    failed = report["check"].startswith("failed") or report["chain_check"].startswith("failed")
    return {**report, "status": "fail" if failed else "pass"}


def _load(what: str, loader: Callable[[Any], Any], source: Any) -> Any:
    """Raises: ValueError: the file cannot be read or is malformed (the message names it)."""
    try:
        return loader(source)
    except OSError as exc:
        raise ValueError(f"{what} {shown(source)}: {errno_text(exc.errno) if exc.errno else exc}") from exc
    except FileRefused as exc:  # its message starts with the path, shown
        raise ValueError(f"{what} {exc}") from exc
    except (ValueError, Error) as exc:
        raise ValueError(f"{what} {shown(source)}: {exc}") from exc


def _pattern(size: int, seed: int = 0) -> np.ndarray:
    # Neither zeros nor a byte ramp: an untouched or index-filled output cannot pass; another seed another pattern,
    # so the chain's check cannot pass on what the single run left behind.
    return ((np.arange(size, dtype=np.uint32) + seed) * 2654435761 >> 7 & 0xFF).astype(np.uint8)


def _measure(dev: Device, xclbin: Xclbin, design: Design, stream: insts.Stream, extents: dict[int, int],
             runs: int, chain: int, repeat: int) -> dict[str, Any]:
    """Raises: XdnaError, ValueError, RuntimeError: the context, a buffer or a run failed."""
    src, dst = min(extents), max(extents)
    with contextlib.ExitStack() as owned, dev.hw_context(xclbin, design.kernel) as ctx:
        bos = {slot: owned.enter_context(dev.bo(max(size, MIN_BUFFER))) for slot, size in extents.items()}
        slots = [bos.get(i) for i in range(dst + 1)]
        kernel = ctx.kernel(design.kernel) if design.kernel else ctx.kernel()
        single = kernel.prepare_npu(stream, slots)
        check = _check_output(lambda: single.start().wait(TIMEOUT), bos, extents, src, dst, design.passthrough)
        latency = _latency(single, runs)
        throughput, chained = _throughput(ctx, kernel, stream, slots, chain, repeat, bos, extents, design.passthrough)
    one_by_one = latency["end_to_end_us"]["median"]
    return {"check": check, "chain_check": chained, "latency": latency, "throughput": throughput,
            "chain_vs_single": throughput["per_dispatch_us"]["median"] / one_by_one if one_by_one > 0 else None}


def _check_output(execute: Callable[[], Any], bos: dict[int, Bo], extents: dict[int, int], src: int, dst: int,
                  passthrough: bool, seed: int = 0) -> str:
    """Fill the source with a pattern and the destination with zeros, ``execute`` (one run, or a chain of
    them), and compare."""
    pattern = _pattern(extents[src], seed)
    bos[src].write(pattern)
    bos[dst].write(bytes(extents[dst]))
    for bo in bos.values():
        bo.sync()
    execute()
    if not passthrough:
        return "not checked (not a passthrough design)"
    bos[dst].sync()
    count = min(extents[src], extents[dst])
    out = np.frombuffer(bos[dst].read(count), dtype=np.uint8)
    wrong = np.flatnonzero(out != pattern[:count])
    if wrong.size:
        return (f"failed: output bo{dst} differs from input bo{src} in {wrong.size} of {count} bytes, first at "
                f"byte {wrong[0]} ({out[wrong[0]]:#04x} != {pattern[wrong[0]]:#04x})")
    return f"passed: bo{dst} == bo{src} ({count} bytes)"


def _spread(seconds: list[float]) -> dict[str, float]:
    us = np.array(seconds) * 1e6
    return {"min": float(us.min()), "median": float(statistics.median(us)), "p99": float(np.percentile(us, 99))}


def _latency(run: Run, runs: int) -> dict[str, Any]:
    host, device, total = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        run.start()
        t1 = time.perf_counter()
        run.wait(TIMEOUT)
        t2 = time.perf_counter()
        host.append(t1 - t0)
        device.append(run.elapsed if run.elapsed is not None else t2 - t1)
        total.append(t2 - t0)
    return {"runs": runs, "host_us": _spread(host), "device_us": _spread(device), "end_to_end_us": _spread(total)}


def _throughput(ctx: HwContext, kernel: Kernel, stream: insts.Stream, slots: list[Bo | None], chain: int,
                repeat: int, bos: dict[int, Bo], extents: dict[int, int],
                passthrough: bool) -> tuple[dict[str, Any], str]:
    """The chained runs' times, and their output checked as the single run's is (the same design dispatched as a
    chain: docs/cli.md "amdxdna validate")."""
    from ..kernel import RunList

    src, dst = min(extents), max(extents)
    prepared = [kernel.prepare_npu(stream, slots) for _ in range(chain)]
    with RunList(ctx, prepared) as runlist:
        try:
            checked = _check_output(lambda: runlist.start().wait(TIMEOUT * chain), bos, extents, src, dst,
                                    passthrough, seed=1)
        except (XdnaError, RuntimeError) as exc:
            raise RuntimeError(f"the chain of {chain} runs failed where single runs passed: {exc} (SAM3 dispatches "
                               f"chains by default; SAM3_CHAINS=0 dispatches one by one)") from exc
        host, device, total = [], [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            runlist.start()
            t1 = time.perf_counter()
            runlist.wait(TIMEOUT * chain)
            t2 = time.perf_counter()
            host.append((t1 - t0) / chain)
            device.append((t2 - t1) / chain)
            total.append((t2 - t0) / chain)
        chains = len(runlist.chains)
    for run in prepared:
        run.close()
    best = min(total)
    return {"runs": chain, "repeat": repeat, "chains": chains, "host_us": _spread(host), "device_us": _spread(device),
            "per_dispatch_us": _spread(total), "runs_per_s": 1.0 / best if best > 0 else None}, checked


def _format(document: dict[str, Any]) -> str:
    lines = [f"device {document['device']} ({document['generation'] or 'unknown generation'})"]
    lines += [f"note: {note}" for note in document["notes"]]
    for r in document["designs"]:
        lines.append(f"[{r['status']}] {r['design']}" + (f": {r['detail']}" if r.get("detail") else ""))
        if "latency" not in r:
            continue
        lat, thr = r["latency"], r["throughput"]
        lines.append(f"    buffers     {', '.join(f'{k} {v} B' for k, v in r['buffers'].items())}")
        lines.append(f"    output      {r['check']}")
        lines.append(f"    chained     {r['chain_check']}")
        lines.append(f"    latency     {lat['runs']} runs: {_us('host dispatch', lat['host_us'])}; "
                     f"{_us('submit to completion', lat['device_us'])}; {_us('end to end', lat['end_to_end_us'])}")
        rate = f"{thr['runs_per_s']:.0f} runs/s" if thr["runs_per_s"] else "rate unknown"
        lines.append(f"    throughput  {thr['runs']} chained runs x {thr['repeat']} ({thr['chains']} chain packet(s)): "
                     f"{_us('per dispatch', thr['per_dispatch_us'])} (host {thr['host_us']['median']:.1f} us, "
                     f"device {thr['device_us']['median']:.1f} us); {rate}")
        if r.get("chain_vs_single") is not None:
            lines.append(f"    chain/one   a chained dispatch takes {r['chain_vs_single']:.2f}x the median end to end "
                         f"of a single run")
    return "\n".join(lines)


def _us(label: str, spread: dict[str, float]) -> str:
    return f"{label} min {spread['min']:.1f} / median {spread['median']:.1f} / p99 {spread['p99']:.1f} us"
