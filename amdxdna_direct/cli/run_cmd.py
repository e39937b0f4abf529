"""``amdxdna run``: run one kernel of an xclbin with an instruction stream, numpy files in and out.

Buffers follow the mlir-aie call convention (xrt-npu-sequence.md 2.2): ``opcode 3, instr, ninstr,
bo0, bo1, ...``. The instruction stream says which buffer slots it uses (the ``arg_idx`` of its
DDR_PATCH ops, spec 2.3), so ``--in`` and ``--out`` files are placed, in that order, on the slots the
stream patches; ``SLOT=FILE`` places one explicitly. Slots the stream does not patch get no buffer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import abi, insts, open_device
from ..bo import Bo
from ..device import Device
from ..doctor import bind_model, is_emulated
from ..emu.models import Gemm, Passthrough
from ..errors import XdnaError
from ..kernel import Run
from ..xclbin import Xclbin

__all__ = ["BufferSpec", "parse_buffer", "parse_model", "assign_slots", "add_parser", "run"]

EXIT_CODES = """\
exit codes:
  0    every run completed; outputs written
  1    the device, the kernel or a run failed (message on stderr)
  2    usage error (bad option, unreadable or malformed file, --model on a real device)"""


class UsageError(ValueError):
    """A command-line mistake (exit status 2)."""


@dataclass
class BufferSpec:
    """One ``--in``/``--out`` argument: the file, the explicit slot if given, and its direction."""

    path: Path
    slot: int | None
    direction: str


def parse_buffer(text: str, direction: str) -> BufferSpec:
    """``FILE`` or ``SLOT=FILE`` (slot = buffer index bo0, bo1, ... of the mlir-aie convention).

    Raises:
        UsageError: the slot is not a non-negative integer.
    """
    slot_text, sep, path = text.partition("=")
    if not sep or not slot_text.isdigit():
        if sep and slot_text.strip().lstrip("-").isdigit():
            raise UsageError(f"--{direction} {text!r}: slot must be a non-negative integer")
        return BufferSpec(Path(text), None, direction)
    return BufferSpec(Path(path), int(slot_text), direction)


def parse_model(text: str) -> Passthrough | Gemm:
    """The emulator model named by ``passthrough`` or ``gemm:M,K,N`` (bf16, B row-major [K][N], lda = K).

    Raises:
        UsageError: an unknown model or bad GEMM sizes.
    """
    if text == "passthrough":
        return Passthrough()
    kind, _, sizes = text.partition(":")
    if kind == "gemm":
        try:
            m, k, n = (int(v) for v in sizes.split(","))
            return Gemm(m, k, n, k)
        except ValueError as exc:
            raise UsageError(f"--model {text!r}: expected gemm:M,K,N with positive integers ({exc})") from None
    raise UsageError(f"--model {text!r}: unknown model (passthrough, gemm:M,K,N)")


def patched_slots(stream: insts.Stream) -> list[int]:
    """The buffer slots an instruction stream patches (DDR_PATCH arg_idx), ascending."""
    return sorted({op.arg_idx for op in stream.ops if isinstance(op, insts.DdrPatch)})


def assign_slots(specs: list[BufferSpec], patched: list[int]) -> dict[int, BufferSpec]:
    """Place buffers on slots: explicit ones first, the rest in order on the free patched slots.

    A stream that patches nothing takes the buffers on slots 0, 1, ... in order.

    Raises:
        UsageError: two buffers on one slot, more buffers than free patched slots, or a patched slot
            left without a buffer.
    """
    placed: dict[int, BufferSpec] = {}
    for spec in (s for s in specs if s.slot is not None):
        if spec.slot in placed:
            raise UsageError(f"two buffers on slot {spec.slot}: {placed[spec.slot].path} and {spec.path}")
        placed[spec.slot] = spec
    free = [s for s in (patched or range(len(specs))) if s not in placed]
    implicit = [s for s in specs if s.slot is None]
    if len(implicit) > len(free):
        raise UsageError(f"{len(specs)} buffers given but the instruction stream patches slots {patched}; "
                         "name the slot of the extra ones with SLOT=FILE")
    placed.update(zip(free, implicit, strict=False))
    missing = [s for s in patched if s not in placed]
    if missing:
        raise UsageError(f"the instruction stream patches slots {patched}; no buffer for slot(s) {missing}")
    return dict(sorted(placed.items()))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``run`` on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "run", help="run one kernel with numpy inputs and outputs, timing each run",
        description=textwrap.fill(
            "Run one kernel of XCLBIN with the instruction stream INSTS (mlir-aie convention: opcode "
            "3, instruction buffer, word count, then buffers bo0, bo1, ...). --in/--out files are "
            "placed, in that order, on the buffer slots the stream patches (its DDR_PATCH arg_idx); "
            "write SLOT=FILE to choose the slot. Prints the time per run (min/median/max) and the "
            "ioctls each run makes.", 100),
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", metavar="DEV",
                        help="device: /dev/accel/accelN, emu, emu:npu1, emu:npu4, ... (default: $AMDXDNA_DEVICE, "
                             "else the first /dev/accel node)")
    parser.add_argument("--xclbin", required=True, metavar="X", help="the xclbin file (required)")
    parser.add_argument("--insts", required=True, metavar="I",
                        help="the instruction stream, insts.bin or insts.txt (required)")
    parser.add_argument("--kernel", metavar="NAME", help="kernel name in the xclbin (default: its only/first kernel)")
    parser.add_argument("--in", dest="inputs", action="append", default=[], metavar="[SLOT=]FILE.npy",
                        help="input array, copied into a new buffer (repeatable; default: none)")
    parser.add_argument("--out", dest="outputs", action="append", default=[], metavar="[SLOT=]FILE.npy",
                        help="output array written after the last run (repeatable; default: none)")
    parser.add_argument("--out-size", dest="out_sizes", action="append", type=int, default=[], metavar="BYTES",
                        help="byte size of each --out buffer, one per --out or one for all (default: the "
                             "byte size of the first --in)")
    parser.add_argument("--out-dtype", metavar="DTYPE",
                        help="dtype of the outputs, numpy or ml_dtypes name such as bfloat16 (default: the first "
                             "input's dtype, else uint8); an output of the first input's size and dtype also takes "
                             "its shape. .npy files keep bfloat16 as raw 2-byte void: view them as bfloat16")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="number of runs to time (default: 1)")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="wait limit per run (default: 10)")
    parser.add_argument("--model", metavar="MODEL",
                        help="emulator only: bind a built-in model to the instruction stream, 'passthrough' "
                             "(copies the lowest patched buffer into the highest) or 'gemm:M,K,N' (bf16 "
                             "C = A @ B, B row-major [K][N]); refused on a real device (default: none)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (default: text)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the kernel ``args.repeat`` times; return 0, 1 (device/run failure) or 2 (usage)."""
    device = args.device if args.device is not None else os.environ.get("AMDXDNA_DEVICE")
    if args.model and not is_emulated(device):
        print(f"amdxdna run: --model binds an emulator model; {device or 'the default device'} is not the emulator "
              "(use --device emu:npu1, emu:npu4, ...)", file=sys.stderr)
        return 2
    try:
        job = _Job.from_args(args)
    except (UsageError, OSError, ValueError) as exc:
        print(f"amdxdna run: {exc}", file=sys.stderr)
        return 2
    try:
        report = job.execute(device, args.repeat, args.timeout)
    except (UsageError, ValueError) as exc:  # e.g. a kernel name the xclbin lacks, too many buffers
        print(f"amdxdna run: {exc}", file=sys.stderr)
        return 2
    except XdnaError as exc:
        print(f"amdxdna run: {exc}", file=sys.stderr)
        return 1
    _print_report(report, args.json)
    return 0


@dataclass
class _Job:
    """Everything read and checked before the device is opened."""

    xclbin: Xclbin
    stream: insts.Stream
    kernel: str | None
    slots: dict[int, BufferSpec]
    inputs: dict[int, np.ndarray]
    out_sizes: dict[int, int]
    out_dtype: np.dtype
    like: np.ndarray | None
    model: Passthrough | Gemm | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> _Job:
        """Parse files and options.

        Raises:
            UsageError, ValueError, OSError: bad options or unreadable/malformed files.
        """
        if args.repeat < 1:
            raise UsageError(f"--repeat {args.repeat}: must be at least 1")
        model = parse_model(args.model) if args.model else None
        stream = insts.load(args.insts)
        specs = [parse_buffer(t, "in") for t in args.inputs] + [parse_buffer(t, "out") for t in args.outputs]
        slots = assign_slots(specs, patched_slots(stream))
        inputs = {slot: _load_array(spec.path) for slot, spec in slots.items() if spec.direction == "in"}
        first_in = next((spec for spec in specs if spec.direction == "in"), None)
        like = next((inputs[slot] for slot, spec in slots.items() if spec is first_in), None)
        out_slots = [slot for slot, spec in slots.items() if spec.direction == "out"]
        out_sizes = _out_sizes(args.out_sizes, out_slots, like)
        dtype = _dtype(args.out_dtype) if args.out_dtype else (like.dtype if like is not None else np.dtype(np.uint8))
        return cls(Xclbin.load(Path(args.xclbin).read_bytes()), stream, args.kernel, slots, inputs, out_sizes,
                   dtype, like, model)

    def execute(self, device: str | None, repeat: int, timeout: float) -> dict:
        """Open the device, run, write the outputs; return the report.

        Raises:
            XdnaError: any runtime failure.
        """
        with open_device(device) as dev:
            if self.model is not None:
                bind_model(dev.emulator, self.stream, self.model)
            ctx = dev.hw_context(self.xclbin, kernel=self.kernel)
            try:
                buffers = {slot: self._buffer(dev, slot) for slot in self.slots}
                kernel = ctx.kernel(self.kernel)
                prepared = kernel.prepare_npu(self.stream, [buffers.get(s) for s in range(max(buffers) + 1)]
                                              if buffers else [])
                times, ioctls = _time_runs(dev, prepared, repeat, timeout)
                written = self._write_outputs(buffers)
            finally:
                ctx.close()
        return {"device": dev.name, "runs": repeat, "seconds": _spread(times),
                "ioctls_per_run": ioctls, "slots": {s: str(spec.path) for s, spec in self.slots.items()},
                "outputs": written}

    def _buffer(self, dev: Device, slot: int) -> Bo:
        """A data buffer for ``slot``: the input's bytes, or zeros of the output size; flushed for the device."""
        if slot in self.inputs:
            data = np.ascontiguousarray(self.inputs[slot]).reshape(-1).view(np.uint8)
        else:
            data = np.zeros(self.out_sizes[slot], np.uint8)
        bo = dev.bo(data.nbytes, kind="shmem")
        bo.write(data)
        bo.sync()
        return bo

    def _write_outputs(self, buffers: dict[int, Bo]) -> list[dict]:
        written = []
        for slot, size in self.out_sizes.items():
            bo = buffers[slot]
            bo.sync()
            raw = np.frombuffer(bo.read(size), np.uint8)
            array = _shape_output(raw, self.out_dtype, self.like)
            np.save(self.slots[slot].path, array)
            written.append({"slot": slot, "path": str(self.slots[slot].path), "bytes": size,
                            "dtype": str(array.dtype), "shape": list(array.shape)})
        return written


def _load_array(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise UsageError(f"--in {path}: not a numpy .npy array ({exc})") from None


def _dtype(name: str) -> np.dtype:
    """A numpy dtype name, or an ml_dtypes one (bfloat16, float8_e4m3fn, ...).

    Raises:
        UsageError: neither knows the name.
    """
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    try:
        return np.dtype(name)
    except TypeError:
        raise UsageError(f"--out-dtype {name!r}: not a numpy or ml_dtypes type") from None


def _out_sizes(sizes: list[int], out_slots: list[int], like: np.ndarray | None) -> dict[int, int]:
    if sizes and len(sizes) not in (1, len(out_slots)):
        raise UsageError(f"{len(sizes)} --out-size values for {len(out_slots)} --out files (give one, or one each)")
    if not sizes and out_slots and like is None:
        raise UsageError("--out needs --out-size when there is no --in to take the size from")
    chosen = sizes * len(out_slots) if len(sizes) == 1 else sizes or [like.nbytes] * len(out_slots)
    bad = [n for n in chosen if n <= 0]
    if bad:
        raise UsageError(f"--out-size {bad[0]}: must be positive")
    return dict(zip(out_slots, chosen, strict=True))


def _shape_output(raw: np.ndarray, dtype: np.dtype, like: np.ndarray | None) -> np.ndarray:
    if raw.nbytes % dtype.itemsize:
        raise UsageError(f"output of {raw.nbytes} bytes is not a whole number of {dtype} elements")
    array = raw.view(dtype)
    if like is not None and like.dtype == dtype and like.nbytes == raw.nbytes:
        return array.reshape(like.shape)
    return array


def _ioctl_names() -> set[str]:
    return {name for name, _ctype in abi.IOCTLS.values()}


def _time_runs(dev: Device, prepared: Run, repeat: int, timeout: float) -> tuple[list[float], dict[str, float]]:
    names = _ioctl_names()
    before = Counter({k: v for k, v in dev.stats.items() if k in names})
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        prepared.start()
        prepared.wait(timeout)
        times.append(time.perf_counter() - start)
    after = Counter({k: v for k, v in dev.stats.items() if k in names})
    per_run = {name: count / repeat for name, count in sorted((after - before).items())}
    return times, per_run


def _spread(times: list[float]) -> dict[str, float]:
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def _print_report(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    spread = report["seconds"]
    print(f"device {report['device']}: {report['runs']} run(s)")
    print(f"time per run: min {spread['min'] * 1e3:.3f} ms, median {spread['median'] * 1e3:.3f} ms, "
          f"max {spread['max'] * 1e3:.3f} ms")
    per_run = report["ioctls_per_run"]
    detail = ", ".join(f"{name} {count:g}" for name, count in per_run.items())
    print(f"ioctls per run: {sum(per_run.values()):g} ({detail})")
    for slot, path in report["slots"].items():
        print(f"  bo{slot}: {path}")
    for out in report["outputs"]:
        print(f"wrote {out['path']}: slot {out['slot']}, {out['bytes']} bytes, {out['dtype']} {tuple(out['shape'])}")
