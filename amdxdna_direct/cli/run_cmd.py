"""``amdxdna run``: run one kernel of an xclbin with an instruction stream, numpy files in and out.

Buffers follow the mlir-aie call convention (docs/xrt-sequence.md 2.2): ``opcode 3, instr, ninstr,
bo0, bo1, ...``. The instruction stream says which buffer slots it uses (the ``arg_idx`` of its
DDR_PATCH ops, docs/xrt-sequence.md 2.3), so ``--in`` and ``--out`` files are placed, in that order, on the slots the
stream patches; ``SLOT=FILE`` places one explicitly. Slots the stream does not patch get no buffer.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .. import abi, files, insts, open_device
from ..bo import Bo
from ..device import Device
from ..doctor import bind_model, is_emulated
from ..emu.models import Gemm, Passthrough
from ..errors import Error, XdnaError, errno_text
from ..kernel import Run
from ..xclbin import Xclbin
from . import Subparsers, add_device_option, command_parser, dump_json, fail, shown

__all__ = ["BufferSpec", "parse_buffer", "parse_model", "assign_slots", "add_parser", "run"]

EXIT_CODES = """\
exit codes:
  0    every run completed; outputs written
  1    failure (message on stderr): an input file cannot be read or is malformed (xclbin, instruction
       stream, .npy), an output cannot be written, or the device, the context or a run failed
  2    usage error: bad option or option value, --kernel not in the xclbin, buffers that do not fit the
       slots the stream patches, --model on a real device, unknown emulator profile"""


class UsageError(ValueError):
    """A command-line mistake (exit status 2)."""


class FileError(ValueError):
    """An input file that cannot be read or is malformed, or an output that cannot be written (exit status 1,
    as for a malformed file given to ``amdxdna xclbin`` or ``amdxdna insts``)."""


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
    if not sep or not (slot_text.isascii() and slot_text.isdigit()):  # isdigit alone takes "²"
        if sep and slot_text.strip().lstrip("-").isdigit():
            raise UsageError(f"--{direction} {shown(text)}: slot must be a non-negative integer")
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
        UsageError: two buffers on one slot, an explicit slot the stream does not patch (the device would
            never see that buffer), more buffers than free patched slots, or a patched slot left without a buffer.
    """
    placed: dict[int, BufferSpec] = {}
    for spec in specs:
        slot = spec.slot
        if slot is None:
            continue
        if slot in placed:
            raise UsageError(f"two buffers on slot {slot}: {shown(placed[slot].path)} and {shown(spec.path)}")
        if patched and slot not in patched:
            raise UsageError(f"--{spec.direction} {slot}={shown(spec.path)}: the instruction stream patches "
                             f"slots {patched} only")
        placed[slot] = spec
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


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``run`` on an ``argparse`` subparsers object."""
    parser = command_parser(
        subparsers, "run",
        "Run one kernel of XCLBIN with the instruction stream INSTS (mlir-aie convention: opcode 3, "
        "instruction buffer, word count, then buffers bo0, bo1, ...). --in/--out files are placed, in "
        "that order, on the buffer slots the stream patches (its DDR_PATCH arg_idx); write SLOT=FILE to "
        "choose the slot. Prints the time per run (min/median/max) and the ioctls each run makes.", EXIT_CODES)
    add_device_option(parser, "device to run on", "$AMDXDNA_DEVICE, else the first /dev/accel node driven by amdxdna")
    parser.add_argument("--xclbin", required=True, metavar="X", help="the xclbin file (required)")
    parser.add_argument("--insts", required=True, metavar="I",
                        help="the instruction stream, insts.bin or insts.txt (required)")
    parser.add_argument("--kernel", metavar="NAME",
                        help="kernel name in the xclbin (default: its first kernel of type dpu)")
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
    """Run the kernel ``args.repeat`` times; return 0, 1 (file, device or run failure) or 2 (usage)."""
    try:
        job = _Job.from_args(args)
        report = job.execute(args.device, args.repeat, args.timeout)
    except UsageError as exc:
        return fail("run", str(exc), args.json, code=2)
    except (FileError, XdnaError) as exc:
        return fail("run", str(exc), args.json)
    except (ValueError, Error) as exc:  # the runtime refused the xclbin, e.g. no AIE_PARTITION or no runnable kernel
        return fail("run", f"--xclbin {shown(args.xclbin)}: {exc}", args.json)
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
        """Check the options and read every input file; nothing touches the device yet.

        Raises:
            UsageError: a bad option or option value.
            FileError: an input file cannot be read or is malformed.
        """
        if args.repeat < 1:
            raise UsageError(f"--repeat {args.repeat}: must be at least 1")
        if args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout}: must be positive")
        model = _model_for(args.model, args.device) if args.model else None
        xclbin = _read_input("--xclbin", args.xclbin, Xclbin.load)
        if args.kernel is not None:
            _check_kernel(xclbin, args.kernel)
        stream = _read_input("--insts", args.insts, insts.load)
        specs = [parse_buffer(t, "in") for t in args.inputs] + [parse_buffer(t, "out") for t in args.outputs]
        slots = assign_slots(specs, patched_slots(stream))
        inputs = {slot: _read_input("--in", spec.path, _load_array) for slot, spec in slots.items()
                  if spec.direction == "in"}
        first_in = next((spec for spec in specs if spec.direction == "in"), None)
        like = next((inputs[slot] for slot, spec in slots.items() if spec is first_in), None)
        dtype = _dtype(args.out_dtype) if args.out_dtype else (like.dtype if like is not None else np.dtype(np.uint8))
        out_slots = [slot for slot, spec in slots.items() if spec.direction == "out"]
        out_sizes = _out_sizes(args.out_sizes, out_slots, like, dtype)
        return cls(xclbin, stream, args.kernel, slots, inputs, out_sizes, dtype, like, model)

    def execute(self, device: str | None, repeat: int, timeout: float) -> dict[str, Any]:
        """Open the device, run, write the outputs; return the report.

        Raises:
            XdnaError: any runtime failure.
            ValueError: the runtime cannot load this xclbin (no AIE partition, no runnable DPU kernel).
            FileError: an output file cannot be written.
        """
        with open_device(device) as dev:
            if self.model is not None:
                bind_model(dev.emulator, self.stream, self.model)
            with dev.hw_context(self.xclbin, kernel=self.kernel) as ctx:
                extents = insts.buffer_reach(self.stream)
                buffers = {slot: self._buffer(dev, slot, extents.get(slot, 0)) for slot in self.slots}
                kernel = ctx.kernel(self.kernel)
                slots = range(max(buffers, default=-1) + 1)
                prepared = kernel.prepare_npu(self.stream, [buffers.get(s) for s in slots])
                times, ioctls = _time_runs(dev, prepared, repeat, timeout)
                written = self._write_outputs(buffers)
        return {"device": dev.name, "runs": repeat, "seconds": _spread(times),
                "ioctls_per_run": ioctls, "slots": {s: str(spec.path) for s, spec in self.slots.items()},
                "buffer_bytes": {s: bo.size for s, bo in buffers.items()}, "outputs": written}

    def _buffer(self, dev: Device, slot: int, reach: int) -> Bo:
        """A data buffer for ``slot``: the input's bytes, or zeros of the output size, in a buffer at least as
        long as the stream's DMA reaches through it (``reach``; the rest zeros); flushed for the device."""
        if slot in self.inputs:
            data = np.ascontiguousarray(self.inputs[slot]).reshape(-1).view(np.uint8)
        else:
            data = np.zeros(self.out_sizes[slot], np.uint8)
        bo = dev.bo(max(data.nbytes, reach), kind="shmem")
        bo.write(data)
        if reach > data.nbytes:
            bo.write(np.zeros(reach - data.nbytes, np.uint8), offset=data.nbytes)
        bo.sync()
        return bo

    def _write_outputs(self, buffers: dict[int, Bo]) -> list[dict[str, Any]]:
        """Save each output buffer as .npy, to exactly the path given (``np.save`` of a name would add ``.npy``).

        Raises:
            FileError: an output file cannot be written.
        """
        written: list[dict[str, Any]] = []
        for slot, size in self.out_sizes.items():
            bo = buffers[slot]
            bo.sync()
            array = _shape_output(np.frombuffer(bo.read(size), np.uint8), self.out_dtype, self.like)
            path = self.slots[slot].path
            try:
                with open(path, "wb") as f:
                    np.save(f, array)
            except OSError as exc:
                raise FileError(f"--out {shown(path)}: {errno_text(exc.errno) if exc.errno else exc}") from None
            written.append({"slot": slot, "path": str(path), "bytes": size, "dtype": str(array.dtype),
                            "shape": list(array.shape)})
        return written


def _read_input(option: str, path: str | Path, loader: Callable[[Any], Any]) -> Any:
    """``loader(path)``, its failures turned into a FileError naming the option, the file and the errno.

    Raises:
        FileError: the file cannot be read (OSError) or its content is malformed (ValueError, EOFError).
    """
    try:
        return loader(path)
    except files.FileRefused as exc:  # its message starts with the path, shown
        raise FileError(f"{option} {exc}") from None
    except OSError as exc:
        raise FileError(f"{option} {shown(path)}: {errno_text(exc.errno) if exc.errno else exc}") from None
    except (ValueError, EOFError, Error) as exc:  # XclbinError, InstsError, a malformed .npy
        raise FileError(f"{option} {shown(path)}: {exc}") from None


NPY_MAGIC = b"\x93NUMPY"  # numpy.lib.format: every .npy file starts with it
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _load_array(path: Path) -> np.ndarray:
    """A .npy array (no pickled objects), read through ``amdxdna_direct.files`` (a regular file within the
    ``npy`` size limit, docs/files.md). The header's shape and dtype must account for exactly the bytes after
    it, checked before the data is read, so a header claiming terabytes allocates nothing.

    Raises:
        OSError: the file cannot be opened or read.
        files.FileRefused: not a regular file, or over the size limit.
        ValueError: not a .npy file, an unknown version, a malformed header, an object dtype, or a data size
            that is not the header's.
    """
    fd = files.open_fd(path, "npy")
    try:
        with open(fd, "rb", closefd=False) as f:
            if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
                raise ValueError(f"not a .npy file (it does not start with {NPY_MAGIC!r})")
            f.seek(0)
            version = np.lib.format.read_magic(f)
            if version not in _NPY_HEADERS:
                raise ValueError(f".npy format version {version[0]}.{version[1]} is not read here (1.0, 2.0)")
            shape, fortran, dtype = _NPY_HEADERS[version](f)
            offset = f.tell()
        if dtype.hasobject:
            raise ValueError(f"dtype {dtype} holds Python objects (pickles are not loaded)")
        claimed = math.prod(shape) * dtype.itemsize   # Python integers: no overflow for any header
        size = os.fstat(fd).st_size - offset
        if claimed != size:
            raise ValueError(f"the header says shape {tuple(shape)} of {dtype}, {claimed} bytes, but the file holds "
                             f"{size} bytes after its {offset}-byte header")
        os.lseek(fd, offset, os.SEEK_SET)
        data = files.read_fd(fd, path, "npy")
    finally:
        os.close(fd)
    if len(data) != claimed:
        raise ValueError(f"changed while read: {len(data)} bytes after the header, not {claimed}")
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")


def _model_for(text: str, device: str | None) -> Passthrough | Gemm:
    """The ``--model`` to bind, refused unless ``device`` is the emulator.

    Raises:
        UsageError: not the emulator, or an unknown model.
    """
    if not is_emulated(device):
        raise UsageError(f"--model binds an emulator model; {device or 'the default device'} is not the emulator "
                         "(use --device emu:npu1, emu:npu4, ...)")
    return parse_model(text)


def _check_kernel(xclbin: Xclbin, name: str) -> None:
    """Raises: UsageError: the xclbin has no kernel ``name`` (the message lists its kernels)."""
    try:
        xclbin.kernel(name)
    except ValueError as exc:
        raise UsageError(f"--kernel {name!r}: {exc}") from None


def _dtype(name: str) -> np.dtype:
    """A numpy dtype name, or an ml_dtypes one (bfloat16, float8_e4m3fn, ...).

    Raises:
        UsageError: neither knows the name.
    """
    if hasattr(ml_dtypes, name):
        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))  # getattr is untyped: say what np.dtype made
        return found
    try:
        return np.dtype(name)
    except TypeError:
        raise UsageError(f"--out-dtype {name!r}: not a numpy or ml_dtypes type") from None


def _out_sizes(sizes: list[int], out_slots: list[int], like: np.ndarray | None, dtype: np.dtype) -> dict[int, int]:
    """Byte size of each output buffer: ``--out-size`` values, else the first input's size.

    Raises:
        UsageError: a count that fits neither rule, no size to take, a non-positive size, or a size that is
            not a whole number of ``dtype`` elements.
    """
    if sizes and len(sizes) not in (1, len(out_slots)):
        raise UsageError(f"{len(sizes)} --out-size values for {len(out_slots)} --out files (give one, or one each)")
    if not sizes and out_slots and like is None:
        raise UsageError("--out needs --out-size when there is no --in to take the size from")
    if len(sizes) == 1:
        chosen = sizes * len(out_slots)
    elif sizes or like is None:  # no sizes and no input: no --out either (checked above)
        chosen = sizes
    else:
        chosen = [like.nbytes] * len(out_slots)
    for size in chosen:
        if size <= 0:
            raise UsageError(f"--out-size {size}: must be positive")
        if size % dtype.itemsize:
            raise UsageError(f"--out-size {size}: not a whole number of {dtype} elements ({dtype.itemsize} bytes)")
    return dict(zip(out_slots, chosen, strict=True))


def _shape_output(raw: np.ndarray, dtype: np.dtype, like: np.ndarray | None) -> np.ndarray:
    """``raw`` bytes as ``dtype`` (sizes were checked by _out_sizes), in the first input's shape when it matches."""
    array = raw.view(dtype)
    if like is not None and like.dtype == dtype and like.nbytes == raw.nbytes:
        return array.reshape(like.shape)
    return array


def _time_runs(dev: Device, prepared: Run, repeat: int, timeout: float) -> tuple[list[float], dict[str, float]]:
    """Wall time of each start+wait, and the ioctls per run (the device's ioctl counters before and after)."""
    names = {name for name, _ctype in abi.IOCTLS.values()}
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


def _print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(dump_json("run", report, indent=2))
        return
    spread = report["seconds"]
    print(f"device {report['device']}: {report['runs']} run(s)")
    print(f"time per run: min {spread['min'] * 1e3:.3f} ms, median {spread['median'] * 1e3:.3f} ms, "
          f"max {spread['max'] * 1e3:.3f} ms")
    per_run = report["ioctls_per_run"]
    detail = ", ".join(f"{name} {count:g}" for name, count in per_run.items())
    print(f"ioctls per run: {sum(per_run.values()):g} ({detail})")
    for slot, path in report["slots"].items():
        print(f"  bo{slot}: {shown(path)} ({report['buffer_bytes'][slot]}-byte buffer)")
    for out in report["outputs"]:
        print(f"wrote {shown(out['path'])}: slot {out['slot']}, {out['bytes']} bytes, {out['dtype']} "
              f"{tuple(out['shape'])}")
