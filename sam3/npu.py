"""The NPU layer: a bundle's kernels on a device, with the semantics of taconite-sam3 0.1.4's `npu.rs`.

Every kernel key (gemm, mha and op together) is loaded at open in sorted order until the device has
no room for another hardware context or `SAM3_MAX_CONTEXTS` is reached; the rest load on first use,
evicting least-recently-used contexts, never the one being loaded (docs/sam3-npu.md 2). GEMMs naming
the same `ctx` xclbin key share one context; each mha and op has its own.

A GEMM is compiled for `m` rows; a stage with more rows owns one A and one C buffer of the padded
height and runs the kernel once per `m`-row chunk over sub-buffer views of them (docs/sam3-npu.md 3).
Beyond the reference: a stage's chunks go to the device as command chains (ERT_CMD_CHAIN, one wait)
unless `SAM3_CHAINS=0` asks for the reference's one-run-at-a-time dispatch, and each kernel's command packets
are built once and rewritten in place for every dispatch (docs/sam3-npu.md 7).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt

from amdxdna_direct import errors
from amdxdna_direct.bo import BF16, FROM_DEVICE, Bo
from amdxdna_direct.device import Device, open_device, release_steps
from amdxdna_direct.hwctx import HwContext
from amdxdna_direct.kernel import Kernel, Run, RunList
from amdxdna_direct.xclbin import Xclbin
from sam3.bundle import Bundle, GemmSpec, KernelSource, MhaSpec, OpSpec
from sam3.pack import BF16_BYTES, ConvGeometry, round_up, to_bf16

ENV_MAX_CONTEXTS = "SAM3_MAX_CONTEXTS"
ENV_CHAINS = "SAM3_CHAINS"
# The reference's run timeout (docs/sam3-npu.md 1): a first run on real hardware never waits without bound.
DEFAULT_TIMEOUT = 10.0
EVICTION_POLICIES = ("lru", "drain")
# How a host wait for a command reaches the driver.
WAIT_IOCTLS = ("SYNCOBJ_TIMELINE_WAIT", "WAIT_CMD")
U32_MAX = 0xFFFF_FFFF


class NpuError(errors.Error, RuntimeError):
    """A kernel could not be loaded or run; names the kernel `key` and, for a stage, the failing `chunk`."""

    def __init__(self, message: str, key: str | None = None, chunk: int | None = None):
        super().__init__(message)
        self.key = key
        self.chunk = chunk


# ---------------------------------------------------------------------------------------------
# host <-> buffer copies


def push(src: np.ndarray, bo: Bo, offset: int = 0, *, dtype: npt.DTypeLike | None = None) -> int:
    """Copies `src` into `bo` at byte `offset` straight into the mapping (`Bo.write`: wide parallel copies from
    4 MiB) and syncs that range to the device.

    With `dtype=bfloat16` float data is rounded to bf16 on the way (`Bo.write_bf16`, `to_bf16`'s bits), with
    no temporary copy of it. Counts the bytes in the device's `stats["bytes_in"]`. Returns the byte count.

    Raises:
        TypeError: `src` holds Python objects, or cannot be stored as `dtype`.
        ValueError: `src` does not fit.
        XdnaError: SYNC_BO failed.
    """
    data = np.asarray(src)
    if data.dtype.hasobject:
        raise TypeError(f"push: expected numeric data, got an array of {data.dtype}")
    held = data.dtype if dtype is None else np.dtype(dtype)
    nbytes = data.size * held.itemsize
    if nbytes == 0:
        return 0
    if offset < 0 or offset + nbytes > bo.size:
        raise ValueError(f"push of {nbytes} bytes at offset {offset} does not fit a {bo.size}-byte buffer")
    bo.write(data, offset, dtype=dtype)
    bo.sync(offset, nbytes)
    return nbytes


def pull(bo: Bo, count: int, dtype: npt.DTypeLike = np.uint16, offset: int = 0, *,
         stored: npt.DTypeLike | None = None) -> np.ndarray:
    """The first `count` items of `dtype` of `bo` at byte `offset` (synced from the device first), copied out
    straight from the mapping (`Bo.read`).

    `stored=bfloat16` with `dtype=float32` reads bf16 values and widens them on the way
    (`Bo.read_f32_from_bf16`, exact as `from_bf16`).

    Raises:
        TypeError: `count` or `offset` not an integer, an object dtype, or a `stored` other than bf16 -> float32.
        ValueError: the range is outside the buffer.
        XdnaError: SYNC_BO failed.
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"pull: dtype must be numeric, got {dt}")
    held = dt if stored is None else np.dtype(stored)
    if stored is not None and (held != BF16 or dt != np.float32):
        raise TypeError(f"pull: stored={held} with dtype={dt}: only bfloat16 widens to float32")
    count, offset = _integer(count, "pull count"), _integer(offset, "pull offset")
    if count < 0 or offset < 0 or offset + count * held.itemsize > bo.size:
        raise ValueError(f"pull(count={count}, dtype={held}, offset={offset}) outside a {bo.size}-byte buffer")
    if count == 0:
        return np.empty(0, dtype=dt)
    bo.sync(offset, count * held.itemsize, direction=FROM_DEVICE)
    if stored is not None:
        return bo.read_f32_from_bf16(count, offset)
    out: np.ndarray = bo.read(offset=offset, dtype=dt, count=count)  # Bo.read is typed Any: bytes without a dtype
    return out


def _push_bf16(src: np.ndarray, bo: Bo, what: str) -> int:
    """Pushes bf16 bits as they are, or floats rounded to bf16 straight into the mapping (no bits temporary)."""
    arr = np.asarray(src)
    rounded = arr.dtype.kind == "f" and arr.dtype.name != "bfloat16"
    flat = arr.reshape(-1) if rounded else bf16_bits(arr).reshape(-1)
    if flat.size > bo.size // BF16_BYTES:
        raise ValueError(f"{what} of {flat.size} elements, the buffer holds {bo.size // BF16_BYTES}")
    return push(flat, bo, dtype=BF16 if rounded else None)


def _integer(value: Any, what: str) -> int:
    """`value` as an int; numpy integers pass, bools, floats and strings are a TypeError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def bf16_bits(src: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of `src`: uint16 and bfloat16 arrays pass through, floats are rounded (RNE).

    Raises:
        TypeError: neither bf16 bits nor floats.
    """
    arr = np.asarray(src)
    if arr.dtype == np.uint16:
        return arr
    if arr.dtype.name == "bfloat16":
        return arr.view(np.uint16)
    if arr.dtype.kind == "f":
        return to_bf16(arr)
    raise TypeError(f"expected bf16 bits (uint16), bfloat16 or float data, got {arr.dtype}")


# ---------------------------------------------------------------------------------------------
# operand sets


class Io:
    """A GEMM's operands for a row count: `a` (rows `lda` apart), `c`, and per-chunk views of both.

    `rows` is the padded row count (a multiple of the GEMM's m); `n` the width of C. Keeps the prepared
    commands of its chunks per weight buffer, so a repeated stage only submits.
    """

    def __init__(self, spec: GemmSpec, a: Bo, c: Bo, chunks: list[tuple[Bo, Bo]], rows: int,
                 chained_from: str | None = None, conv: ConvGeometry | None = None):
        self.key = spec.key
        self.spec = spec
        self.a = a
        self.c = c
        self.chunks = chunks
        self.rows = rows
        self.n = spec.n
        self.chained_from = chained_from
        self.conv = conv

    def conv_geometry(self) -> ConvGeometry:
        """The 3x3 convolution layout of an operand set made by `Npu.conv_io`.

        Raises:
            NpuError: this operand set is not a convolution's (made by `Npu.io` or `Npu.io_chained`).
        """
        if self.conv is None:
            raise NpuError(f"{self.key}: this operand set of {self.rows} rows has no convolution geometry (make it "
                           "with Npu.conv_io)", self.key)
        return self.conv

    @property
    def chained(self) -> bool:
        """Whether A is another kernel's C (device-produced; never written or synced from the host)."""
        return self.chained_from is not None

    def set_a(self, src: np.ndarray) -> int:
        """Fills the start of A (bf16 bits, or floats rounded to bf16) and syncs what it wrote; returns bytes.

        Rows beyond `src` are left as they are (zero from allocation: padded rows are never written).

        Raises:
            NpuError: A is chained (another kernel's output).
            ValueError: `src` is larger than A.
            TypeError: `src` is neither bf16 bits nor floats.
            XdnaError: SYNC_BO failed.
        """
        if self.chained:
            raise NpuError(f"{self.key}: A is {self.chained_from}'s C (chained); set_a would overwrite a "
                           "device result", self.key)
        return _push_bf16(src, self.a, f"{self.key}: set_a")

    def sync_a(self) -> None:
        """Syncs all of A to the device.

        Raises:
            XdnaError: SYNC_BO failed.
        """
        self.a.sync()

    def get_c(self, rows: int) -> np.ndarray:
        """The first `rows` rows of C as bf16 bits, `[rows, n]`, copied out.

        Raises:
            TypeError: `rows` is not an integer.
            ValueError: more rows than C holds (or negative).
            XdnaError: SYNC_BO failed.
        """
        rows = self._c_rows(rows, "get_c")
        return pull(self.c, rows * self.n).reshape(rows, self.n)

    def get_c_f32(self, rows: int) -> np.ndarray:
        """The first `rows` rows of C widened to float32 straight out of the mapping, `[rows, n]`.

        Raises:
            TypeError: `rows` is not an integer.
            ValueError: more rows than C holds (or negative).
            XdnaError: SYNC_BO failed.
        """
        rows = self._c_rows(rows, "get_c_f32")
        return pull(self.c, rows * self.n, np.float32, stored=BF16).reshape(rows, self.n)

    def _c_rows(self, rows: int, what: str) -> int:
        rows = _integer(rows, f"{self.key}: {what} rows")
        if not 0 <= rows <= self.rows:
            raise ValueError(f"{self.key}: {what}({rows}) outside C's {self.rows} rows")
        return rows


class MhaIo:
    """q, k, v, o of an attention kernel, each `elems` bf16 in the kernel's layout (docs/sam3-npu.md 4)."""

    def __init__(self, spec: MhaSpec, buffers: list[Bo]):
        self.key = spec.key
        self.spec = spec
        self.q, self.k, self.v, self.o = buffers

    def set_qkv(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
        """Pushes q, k, v (bf16 bits or floats, at most `elems` each, in the kernel's layout); returns bytes.

        Raises:
            ValueError: a tensor larger than the buffers.
            TypeError: a tensor neither bf16 bits nor floats.
            XdnaError: SYNC_BO failed.
        """
        return sum(_push_bf16(src, bo, f"{self.key}: {name}")
                   for name, src, bo in (("q", q, self.q), ("k", k, self.k), ("v", v, self.v)))

    def get_o(self, count: int | None = None) -> np.ndarray:
        """The first `count` (default `elems`) elements of o as bf16 bits.

        Raises:
            ValueError: more than `elems`.
            XdnaError: SYNC_BO failed.
        """
        count = self.spec.elems if count is None else _integer(count, f"{self.key}: get_o count")
        if not 0 <= count <= self.spec.elems:
            raise ValueError(f"{self.key}: get_o({count}) outside o's {self.spec.elems} elements")
        return pull(self.o, count)


@dataclass
class Stage:
    """What one stage cost: device commands, host copies and time (filled by `Npu.stage`)."""

    name: str
    kind: str
    rows: int = 0
    chunks: int = 0
    exec_cmds: int = 0
    waits: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    device_seconds: float = 0.0
    max_rel_err: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The stage as a JSON object; `max_rel_err` is null when unchecked or not finite."""
        err = self.max_rel_err
        return {"name": self.name, "kind": self.kind, "rows": self.rows, "chunks": self.chunks,
                "exec_cmds": self.exec_cmds, "waits": self.waits, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "seconds": self.seconds, "device_seconds": self.device_seconds,
                "host_seconds": max(self.seconds - self.device_seconds, 0.0),
                "max_rel_err": err if err is None or math.isfinite(err) else None, **self.extra}


def _max_contexts(value: int | None) -> int | None:
    """The resident-context cap: `value`, else env SAM3_MAX_CONTEXTS, else None (as many as the driver grants).

    A cap below 1 is refused: the reference's pre-eviction loop could never make room and would spin.
    """
    source = "max_contexts"
    given: object = value
    if value is None:
        text = os.environ.get(ENV_MAX_CONTEXTS, "").strip()
        if not text:
            return None
        source = ENV_MAX_CONTEXTS
        given = int(text) if text.isascii() and text.isdigit() else text  # isdigit alone takes "²"
    if isinstance(given, bool) or not isinstance(given, int) or given <= 0:
        raise ValueError(f"{source}={given!r}: expected a positive integer (at least one resident context)")
    return given


def _chains(value: bool | None) -> bool:
    """Whether a stage's chunks go out as command chains: `value`, else env SAM3_CHAINS (0 or 1), else on."""
    if value is not None:
        return bool(value)
    text = os.environ.get(ENV_CHAINS, "").strip()
    if text in ("", "1"):
        return True
    if text == "0":
        return False
    raise ValueError(f"{ENV_CHAINS}={text!r}: expected 0 (one run at a time, as the reference) or 1 (chains)")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _exclusive(method: Callable[Concatenate[Npu, _P], _R]) -> Callable[Concatenate[Npu, _P], _R]:
    """Runs `method` holding the Npu's lock: loading, evicting and running share the context table and the
    LRU, and an eviction must not destroy a context another thread is about to submit to (the reference's
    `&mut self`)."""
    @functools.wraps(method)
    def locked(self: Npu, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


# A command unit: one Run, a RunList (ERT_CMD_CHAIN packets over several), or a tuple of Runs (SAM3_CHAINS=0).
_Unit = Run | RunList | tuple[Run, ...]
# The argument index of bo0 in the mlir-aie convention: opcode, instruction buffer, word count (docs/sam3-npu.md 1).
_BO0 = 3


def _parts(unit: _Unit) -> tuple[Run | RunList, ...]:
    """What a unit submits and waits for: itself, or its runs one by one (chains off)."""
    return (unit,) if isinstance(unit, (Run, RunList)) else unit


def _flying(part: Run | RunList) -> bool:
    """Whether the driver may still read `part`'s packets: a RunList in flight claims every run of it."""
    return (part.runs[0] if isinstance(part, RunList) else part).in_flight


class _Pool:
    """Kernel `key`'s persistent command packets (docs/sam3-npu.md 7): runs built once each, as many as the largest
    operand set dispatched on the kernel has chunks, and rewritten in place (`Run.set_arg`) to each dispatch's
    buffers; a RunList over the first n runs per chunk count n seen. Tied to one loaded kernel and one stream."""

    def __init__(self, kernel: Kernel, ctx: HwContext, stream: bytes):
        self.kernel = kernel
        self.ctx = ctx
        self.stream = stream
        self.runs: list[Run] = []
        self.bound: list[tuple[Bo | None, ...]] = []     # what each run's bo0.. hold now
        self.lists: dict[int, RunList] = {}
        self.last: _Unit | None = None                   # the unit submitted last (maybe still on the device)
        self.built = 0                                   # packets built: runs and chain packets

    @property
    def packets(self) -> int:
        """Command buffers this pool holds (its runs' packets and its chains')."""
        return len(self.runs) + sum(len(lst.chains) for lst in self.lists.values())

    def unit(self, buffers: Sequence[Sequence[Bo]], chains: bool) -> _Unit:
        """The unit over `buffers` (bo0.. of each chunk, in order): runs rewritten where their buffers differ,
        runs built for chunks beyond the largest set seen so far.

        Raises:
            ValueError: a buffer the stream's DMA reaches beyond; XdnaError: allocation failed.
        """
        runs, bound = self.runs, self.bound
        for i in range(min(len(buffers), len(runs))):
            want = tuple(buffers[i])
            if bound[i] != want:
                self._rewrite(i, want)
        for more in buffers[len(runs):]:
            runs.append(self.kernel.prepare_npu(self.stream, list(more)))
            bound.append(tuple(more))
            self.built += 1
        n = len(buffers)
        unit: _Unit
        if n == 1:
            unit = runs[0]
        elif not chains:
            unit = tuple(runs[:n])
        else:
            listed = self.lists.get(n)
            if listed is None:
                listed = self.lists[n] = RunList(self.ctx, runs[:n])
                self.built += len(listed.chains)
            unit = listed
        self.last = unit
        return unit

    def _rewrite(self, i: int, want: tuple[Bo, ...]) -> None:
        held = list(self.bound[i])
        width = max(len(held), len(want))
        held += [None] * (width - len(held))
        run = self.runs[i]
        try:
            for j in range(width):
                new = want[j] if j < len(want) else None
                if held[j] is not new:
                    run.set_arg(_BO0 + j, new)
                    held[j] = new
        finally:
            self.bound[i] = tuple(held)

    def close(self) -> None:
        """Closes the pool's packets. A submission still on the device keeps its buffers: the driver's job holds
        references to them until it completes."""
        release_steps(*(lst.close for lst in self.lists.values()), *(run.close for run in self.runs))


@dataclass
class _Resident:
    """A loaded kernel: the context's kernel object and the stream generation its packets were built for."""

    kernel: Kernel
    ctx: HwContext


class Npu:
    """A bundle's kernels on a device (real or emulated), with the resident-context LRU and eviction.

    Args:
        bundle: an open `Bundle` or a bundle directory.
        device: an open `Device`, or anything `open_device` accepts ("emu", "emu:npu4", "/dev/accel/accel0",
            an EmuDevice, None for the default device); a device opened here is closed by `close`.
        max_contexts: at most this many resident contexts (default: env `SAM3_MAX_CONTEXTS`, else as many as
            the driver grants). Below 1 is refused.
        chains: submit a stage's chunks as command chains with one wait (default: env `SAM3_CHAINS`, else
            on); off dispatches chunk by chunk, each waited for, as the reference does.
        evict: "lru" drops least-recently-used contexts one at a time until a new one fits; "drain" destroys
            every resident context before loading one that does not fit.
        timeout: seconds a stage may take (default 10 s, the reference's; `math.inf` waits without bound).

    Raises:
        NpuError: a kernel failed to load for another reason than "no room", or needs more AIE columns than the
            device has; (emulator) a stream is already bound to another computation.
        BundleError: the bundle is invalid.
        ValueError: bad `max_contexts` / `SAM3_MAX_CONTEXTS` / `SAM3_CHAINS` / `evict` / `timeout`.
        XdnaError: the device could not be opened.
    """

    def __init__(self, bundle: Bundle | str | os.PathLike[str], device: Any = None, *, max_contexts: int | None = None,
                 chains: bool | None = None, evict: str = "lru", timeout: float = DEFAULT_TIMEOUT):
        if evict not in EVICTION_POLICIES:
            raise ValueError(f"evict must be one of {EVICTION_POLICIES}, got {evict!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0 (math.inf: no bound), got {timeout!r}")
        self.cap = _max_contexts(max_contexts)
        self.chains = _chains(chains)
        self.evict = evict
        # math.inf is the runtime's FOREVER: a wait without bound, only when asked for (docs/sam3-npu.md 1).
        self.timeout = float(timeout)
        self._owns_bundle = not isinstance(bundle, Bundle)
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
        self._owns_device = not isinstance(device, Device)
        self._closed = False
        self._lock = threading.RLock()
        self._contexts: dict[str, HwContext] = {}
        self._weights: dict[str, Bo] = {}
        try:
            self.device = device if isinstance(device, Device) else open_device(device)
        except BaseException:
            self._owns_device = False
            self.close()
            raise
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        self._sources: dict[str, KernelSource] = {key: self.bundle.kernel(key) for key in self.bundle.kernel_keys()}
        self._streams: dict[str, bytes] = {key: self.bundle.insts_bytes(key) for key in self._sources}
        self._patches: dict[str, dict[int, int]] = {}
        self._xclbins: dict[Path, Xclbin] = {}
        self._check_widths()
        self._kernels: dict[str, _Resident] = {}
        self._pools: dict[str, _Pool] = {}
        self.packets_built = 0  # command packets built over the Npu's life (runs and chains), as of the last dispatch
        self._lru: list[str] = []  # resident contexts, least recently used first
        self.loads = 0
        self.evictions = 0
        self.stages: list[Stage] = []
        # Seconds from each submission to its completion, in all and by kernel key (the "npu" part of a timing).
        self.device_seconds = 0.0
        self.kernel_seconds: defaultdict[str, float] = defaultdict(float)
        if self.device.emulator is not None:
            from sam3 import kernels

            try:
                kernels.bind_bundle(self.bundle, self.device.emulator.models)
            except ValueError as e:
                raise NpuError(f"binding the emulator's kernel models: {e}") from e
        self._preload()

    def _xclbin(self, key: str) -> Xclbin:
        path = self._sources[key].xclbin
        if path not in self._xclbins:
            try:
                # Read through the bundle: its files are opened relative to its directory, never through a link out.
                self._xclbins[path] = Xclbin.load(self.bundle.file_bytes(path))
            except (OSError, ValueError) as e:
                raise NpuError(f"{key}: xclbin {path}: {e}", key) from e
        return self._xclbins[path]

    def _check_widths(self) -> None:
        """A context wider than the array can never load: CREATE_HWCTX would refuse it the way it refuses a full
        device, and loading it would evict every resident context first."""
        cols = self.device.aie_metadata().cols
        for key in self._sources:
            partition = self._xclbin(key).partition
            if partition is not None and partition.column_width > cols:
                raise NpuError(f"{key}: {self._sources[key].xclbin.name} needs {partition.column_width} AIE "
                               f"columns, the device has {cols}", key)

    @property
    def gemms(self) -> dict[str, GemmSpec]:
        """The bundle's GEMMs by key."""
        return self.bundle.gemms

    @property
    def mhas(self) -> dict[str, MhaSpec]:
        """The bundle's attention kernels by key."""
        return self.bundle.mhas

    @property
    def ops(self) -> dict[str, OpSpec]:
        """The bundle's other kernels (rope, addln) by key."""
        return self.bundle.ops

    # -- contexts (the reference's open / kernel / try_load / evict_lru) ------------------------

    def _preload(self) -> None:
        for key in self._sources:  # kernel_keys() is sorted by name, as the reference loads them
            if self._full(self._sources[key].ctx):
                break
            try:
                self._try_load(key)
            except errors.ContextUnavailableError:
                break
            except (errors.XdnaError, ValueError) as e:  # ValueError: the xclbin's kernel is unusable
                raise NpuError(f"loading {key}: {e}", key) from e

    def _full(self, ctx: str) -> bool:
        """Loading `ctx` would exceed the resident-context cap."""
        return ctx not in self._lru and self.cap is not None and len(self._lru) >= self.cap

    def _try_load(self, key: str) -> None:
        src = self._sources[key]
        if src.ctx not in self._contexts:
            self._contexts[src.ctx] = self.device.hw_context(self._xclbin(key), kernel=src.name)
            self._lru.append(src.ctx)
            self.loads += 1
        context = self._contexts[src.ctx]
        self._kernels[key] = _Resident(context.kernel(src.name), context)

    def _check_open(self, key: str | None) -> None:
        """After `close` nothing may load a context (it would outlive the Npu) or allocate on its device."""
        if self._closed:
            raise NpuError(f"{key or 'Npu'}: the Npu is closed", key)

    def _kernel(self, key: str) -> _Resident:
        """Kernel `key`, loaded if not resident (evicting while the device has no room); marks it used."""
        self._check_open(key)
        src = self._sources.get(key) if isinstance(key, str) else None
        if src is None:
            raise NpuError(f"no kernel {key!r} in bundle {self.bundle.root}", key)
        if key not in self._kernels:
            while self._full(src.ctx):
                self._make_room(key, src.ctx)
            self._load_evicting(key, src)
        self._lru.remove(src.ctx)
        self._lru.append(src.ctx)
        return self._kernels[key]

    def _load_evicting(self, key: str, src: KernelSource) -> None:
        while True:
            try:
                self._try_load(key)
                return
            except errors.ContextUnavailableError as e:
                if not self._make_room(key, src.ctx):
                    raise NpuError(f"{key}: no hardware context available ({len(self._lru)} resident): {e}",
                                   key) from e
            except (errors.XdnaError, ValueError) as e:
                raise NpuError(f"loading {key}: {e}", key) from e

    def _make_room(self, key: str, keep: str) -> bool:
        """Evicts the LRU context other than `keep` ("drain": all of them) to load `key`; False if there is none."""
        victims = [c for c in self._lru if c != keep]
        for victim in victims if self.evict == "drain" else victims[:1]:
            self._lru.remove(victim)
            self.evictions += 1
            try:
                self._release_context(victim)
            except errors.XdnaError as e:
                raise NpuError(f"{key}: evicting context {victim} failed: {e}", key) from e
        return bool(victims)

    def _release_context(self, ctx: str) -> None:
        """Destroys context `ctx` (closing it closes the Runs and RunLists built on it) and forgets its kernels."""
        context = self._contexts.pop(ctx)
        for key in [k for k, r in self._kernels.items() if r.ctx is context]:
            del self._kernels[key]
        self._pools = {k: p for k, p in self._pools.items() if p.ctx is not context}
        context.close()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Holds this Npu's lock over a sequence of calls (a stage's buffers written, run and read back): no other
        thread's call on this Npu runs in between, so the counters' changes over the body are the body's own
        (docs/sam3-npu.md 8). Re-entrant; the calls inside take it again."""
        with self._lock:
            yield

    @property
    def resident(self) -> list[str]:
        """Resident contexts (their ctx ids), least recently used first."""
        return list(self._lru)

    # -- instruction streams (0.1.4's patch_insts / insts) --------------------------------------

    def insts(self, key: str) -> np.ndarray:
        """Kernel `key`'s instruction stream as little-endian u32 words, as the bundle's file holds it.

        Raises:
            NpuError: no such kernel.
        """
        self._check_open(key)
        if not isinstance(key, str) or key not in self._sources:
            raise NpuError(f"no kernel {key!r} in bundle {self.bundle.root}", key)
        return np.frombuffer(self.bundle.insts_bytes(key), dtype="<u4").copy()

    @_exclusive
    def patch_insts(self, key: str, words: Sequence[tuple[int, int]]) -> None:
        """Rewrites instruction words `(index, value)` of kernel `key`, now and after every reload.

        The words are recorded, so a context evicted and loaded again runs the patched stream too. The next
        run of `key` uses them (its command packets are rebuilt over the patched instruction buffer).

        Raises:
            NpuError: no such kernel, or the Npu is closed.
            TypeError: a word that is not an (int, int) pair.
            ValueError: an index outside the stream or a value outside u32.
        """
        self._check_open(key)
        if not isinstance(key, str) or key not in self._sources:
            raise NpuError(f"no kernel {key!r} in bundle {self.bundle.root}", key)
        count = len(self.bundle.insts_bytes(key)) // 4
        patch = dict(self._patches.get(key, {}))
        for item in words:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"{key}: patch_insts takes (word index, value) pairs, got {item!r}")
            index, value = _integer(item[0], f"{key}: word index"), _integer(item[1], f"{key}: word value")
            if not 0 <= index < count:
                raise ValueError(f"{key}: word index {index} outside the stream's {count} words")
            if not 0 <= value <= U32_MAX:
                raise ValueError(f"{key}: word {index} value {value:#x} is not a u32")
            patch[index] = value
        stream = np.frombuffer(self.bundle.insts_bytes(key), dtype="<u4").copy()
        stream[list(patch)] = list(patch.values())
        data = stream.astype("<u4").tobytes()
        if self.device.emulator is not None:
            from sam3 import kernels

            try:
                kernels.bind_stream(self.device.emulator.models, key, data, self.bundle)
            except ValueError as e:
                raise NpuError(f"{key}: binding the patched stream's model: {e}", key) from e
        self._patches[key] = patch
        self._streams[key] = data

    # -- buffers -----------------------------------------------------------------------------

    def spec(self, key: str) -> GemmSpec:
        """The GEMM `key`.

        Raises:
            NpuError: no such GEMM.
        """
        self._check_open(key)
        if not isinstance(key, str) or key not in self.gemms:
            raise NpuError(f"no GEMM {key!r} in bundle {self.bundle.root}", key)
        return self.gemms[key]

    def upload(self, data: bytes | np.ndarray) -> Bo:
        """A device buffer holding `data` (packed weights), synced.

        Raises:
            TypeError: `data` is a str (a path?) or holds Python objects.
            ValueError: `data` is empty.
            XdnaError: allocation or sync failed.
        """
        self._check_open(None)
        if isinstance(data, str):
            raise TypeError(f"upload: expected bytes or a numeric array, got str {data[:80]!r} (read the file first)")
        arr = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data)
        if arr.dtype.hasobject:
            raise TypeError(f"upload: expected numeric data, got an array of {arr.dtype}")
        if arr.nbytes == 0:
            raise ValueError("upload: no data (a buffer must hold at least one byte)")
        bo = self.device.bo(arr.nbytes)
        try:
            push(arr, bo)
        except BaseException:
            bo.close()
            raise
        return bo

    @_exclusive
    def weights(self, name: str) -> Bo:
        """The bundle tensor `name` (a packed B, a RoPE table) in a device buffer, uploaded on first use.

        Raises:
            BundleError: no such tensor.
            XdnaError: allocation or sync failed.
        """
        self._check_open(name)
        bo = self._weights.get(name)
        if bo is None or bo.closed:
            bo = self._weights[name] = self.upload(self.bundle.tensors.raw(name))
        return bo

    def weight_slot(self, key: str) -> Bo:
        """A weight buffer sized for GEMM `key`'s packed B (`b_bytes`), to be filled per prompt or forward.

        Raises:
            NpuError: no such GEMM.
            XdnaError: allocation failed.
        """
        return self.device.bo(self.spec(key).b_bytes)

    def io(self, key: str, rows: int) -> Io:
        """Operands of GEMM `key` for `rows` rows (plain row-major A, `lda == K`), padded to a multiple of m.

        Raises:
            NpuError: `key` has an overlapping A (`lda < K`: use `conv_io`), or the Npu is closed.
            TypeError: `rows` not an integer.
            ValueError: `rows` not positive.
            XdnaError: allocation failed.
        """
        g = self.spec(key)
        if g.lda != g.k:
            raise NpuError(f"{key}: overlapping A (lda {g.lda} < K {g.k}), use conv_io", key)
        rows = _integer(rows, f"{key}: rows")
        if rows <= 0:
            raise ValueError(f"{key}: rows must be positive, got {rows}")
        rows = round_up(rows, g.m)
        a = self.device.bo(rows * g.k * BF16_BYTES)
        try:
            return self._operands(g, a, rows, g.m * g.k)
        except BaseException:
            a.close()
            raise

    def io_chained(self, key: str, src: Io) -> Io:
        """Operands of GEMM `key` whose A is `src`'s C, read in place (never written or synced by the host).

        Raises:
            NpuError: `src.n != K`, `key` has an overlapping A, or `src`'s rows are not a multiple of m.
            TypeError: `src` is not an Io.
            XdnaError: allocation failed.
        """
        g = self.spec(key)
        self._operand(key, src, Io, "io_chained source")
        if g.lda != g.k:
            raise NpuError(f"{key}: overlapping A (lda {g.lda} < K {g.k}) cannot read {src.key}'s C in place", key)
        if src.n != g.k:
            raise NpuError(f"{key}: A width {src.n} (C of {src.key}) != K {g.k}", key)
        if src.rows % g.m:
            raise NpuError(f"{key}: {src.rows} rows of {src.key} are not a multiple of m={g.m}", key)
        return self._operands(g, src.c.sub(0, src.rows * g.k * BF16_BYTES), src.rows, g.m * g.k, src.key)

    def conv_io(self, key: str, h: int, w: int) -> Io:
        """Operands of the overlapping-row 3x3 convolution `key` for an `h x w` map (docs/sam3-packing.md).

        A is Y (`(rows*P + 2) x D` bf16); chunk i's A view starts `i*m*lda` elements in and reaches
        `(m-1)*lda + K` elements.

        Raises:
            NpuError: `key` is not an overlapping-A GEMM, or the Npu is closed.
            TypeError: `h` or `w` not an integer.
            ValueError: `h` or `w` not positive, or the GEMM's shape is not a 3x3 convolution's.
            XdnaError: allocation failed.
        """
        g = self.spec(key)
        if g.lda >= g.k:
            raise NpuError(f"{key}: lda {g.lda} >= K {g.k} is not an overlapping-row convolution, use io", key)
        geom = ConvGeometry.of(g.k, g.lda, g.n)
        h, w = _integer(h, f"{key}: map height"), _integer(w, f"{key}: map width")
        if h <= 0 or w <= 0:
            raise ValueError(f"{key}: map size {h}x{w} must be positive")
        rows = geom.rows(h, w, g.m)
        a = self.device.bo(geom.y_elems(rows) * BF16_BYTES)
        try:
            io = self._operands(g, a, rows, g.m * g.lda)
        except BaseException:
            a.close()
            raise
        io.conv = geom
        return io

    def _operands(self, g: GemmSpec, a: Bo, rows: int, a_step: int, chained_from: str | None = None) -> Io:
        """C for `rows` rows and the per-chunk (A, C) views; chunk i's A view starts `i * a_step` elements in."""
        a_extent = ((g.m - 1) * g.lda + g.k) * BF16_BYTES
        c_chunk = g.m * g.n * BF16_BYTES
        c = self.device.bo(rows * g.n * BF16_BYTES)
        chunks = [(a.sub(i * a_step * BF16_BYTES, a_extent), c.sub(i * c_chunk, c_chunk)) for i in range(rows // g.m)]
        return Io(g, a, c, chunks, rows, chained_from)

    def mha_io(self, key: str) -> MhaIo:
        """q, k, v, o buffers (`elems` bf16 each) of attention kernel `key`.

        Raises:
            NpuError: no such attention kernel, or the Npu is closed.
            XdnaError: allocation failed.
        """
        self._check_open(key)
        if not isinstance(key, str) or key not in self.mhas:
            raise NpuError(f"no MHA {key!r} in bundle {self.bundle.root}", key)
        nbytes = self.mhas[key].elems * BF16_BYTES
        buffers: list[Bo] = []
        try:
            for _ in range(4):
                buffers.append(self.device.bo(nbytes))
        except BaseException:
            release_steps(*(b.close for b in buffers))
            raise
        return MhaIo(self.mhas[key], buffers)

    # -- command units (built once per kernel, context and stream; rewritten per dispatch) ---------

    def _unit(self, key: str, buffers: Sequence[Sequence[Bo]]) -> _Unit:
        """Kernel `key`'s command unit over `buffers` (bo0.. of each chunk): its persistent packets, rebuilt only
        after an eviction or a patch, with each run's buffer addresses rewritten where they changed."""
        resident = self._kernel(key)
        stream = self._streams[key]
        pool = self._pools.get(key)
        if pool is None or pool.kernel is not resident.kernel or pool.stream is not stream:
            if pool is not None:
                self._pools.pop(key)
                pool.close()
            pool = self._pools[key] = _Pool(resident.kernel, resident.ctx, stream)
        self._settle(key, pool)
        before = pool.built
        try:
            return pool.unit(buffers, self.chains)
        except (errors.XdnaError, ValueError) as e:  # ValueError: a malformed stream, or a buffer too small for it
            raise NpuError(f"{key}: preparing commands failed: {e}", key) from e
        finally:
            self.packets_built += pool.built - before

    def _settle(self, key: str, pool: _Pool) -> None:
        """A unit whose wait timed out may still be read by the driver: wait for it (bounded by `timeout`) before
        any of its packets is rewritten (docs/sam3-npu.md 7)."""
        flying = [part for part in _parts(pool.last) if _flying(part)] if pool.last is not None else []
        for part in flying:
            try:
                part.wait(self.timeout)
            except errors.XdnaError:
                pass
        if any(_flying(part) for part in flying):
            raise NpuError(f"{key}: its previous submission timed out and is still running after another "
                           f"{self.timeout} s; its command buffers are not rewritten until it completes", key)

    @property
    def command_bos(self) -> int:
        """Command buffers the resident kernels' units hold (bounded by the bundle's operand sets, not by forwards)."""
        return sum(pool.packets for pool in self._pools.values())

    def _operand(self, key: str | None, obj: object, cls: type[Io] | type[MhaIo], what: str) -> None:
        """`obj` must be a `cls` (Io or MhaIo) made on this Npu's device."""
        if not isinstance(obj, cls):
            raise TypeError(f"{key or 'Npu'}: {what} must be an {cls.__name__}, got {type(obj).__name__}")
        self._own_bo(obj.key, obj.c if isinstance(obj, Io) else obj.o, what)

    def _own_bo(self, key: str | None, bo: Any, what: str) -> None:
        if not isinstance(bo, Bo):
            raise TypeError(f"{key}: {what} must be a Bo, got {type(bo).__name__}")
        if bo.device is not self.device:
            raise ValueError(f"{key}: {what} belongs to device {bo.device.name}, not this Npu's {self.device.name}")

    def _check_weights(self, g: GemmSpec, w: Any) -> None:
        """`w` must hold at least GEMM `g`'s packed B (the kernel reads `b_bytes`). A longer buffer is accepted,
        as the reference uploads a tensor's bytes whatever their length; a shorter one would fault the DMA."""
        self._own_bo(g.key, w, "weights")
        if w.size < g.b_bytes:
            raise ValueError(f"{g.key}: weights of {w.size} bytes, the kernel reads b_bytes={g.b_bytes}")

    def _check_args(self, key: str, args: tuple[Any, ...]) -> None:
        if key in self.gemms:
            want = 3
        elif key in self.mhas:
            want = 4
        else:
            want = len(args)
        if len(args) != want or not 1 <= len(args) <= 5:
            raise ValueError(f"{key}: run_args takes {want} buffer(s) in the kernel's argument order (at most 5), "
                             f"got {len(args)}")
        for i, bo in enumerate(args):
            self._own_bo(key, bo, f"argument {i}")

    def _gemm_unit(self, io: Io, w: Bo) -> _Unit:
        self._operand(getattr(io, "key", None), io, Io, "operands")
        self._check_weights(io.spec, w)
        return self._unit(io.key, [(a, w, c) for a, c in io.chunks])

    def _mha_unit(self, m: MhaIo) -> _Unit:
        self._operand(getattr(m, "key", None), m, MhaIo, "attention operands")
        return self._unit(m.key, [(m.q, m.k, m.v, m.o)])

    def _args_unit(self, key: str, args: Sequence[Bo]) -> _Unit:
        pins = tuple(args)
        self._check_open(key)
        if isinstance(key, str) and key in self._sources:
            self._check_args(key, pins)
        return self._unit(key, [pins])

    @_exclusive
    def prepare(self, io: Io, w: Bo) -> None:
        """Loads `io`'s kernel and builds its command unit for weights `w` ahead of `run` (so a measured stage
        moves only its data).

        Raises:
            NpuError: loading or building the commands failed.
        """
        self._gemm_unit(io, w)

    # -- running -----------------------------------------------------------------------------

    @_exclusive
    def run(self, io: Io, w: Bo) -> float:
        """Runs `io`'s kernel over every chunk with weights `w` (A must be synced); returns seconds.

        Raises:
            TypeError: `io` is not an Io or `w` not a Bo.
            ValueError: `w` is shorter than `b_bytes`, or a buffer belongs to another device.
            NpuError: the Npu is closed, loading failed or a chunk failed (naming the key and the chunk index).
        """
        return self._execute(io.key, self._gemm_unit(io, w), len(io.chunks))

    @_exclusive
    def run_synced(self, io: Io, w: Bo) -> float:
        """`run` with A synced first, unless A is another kernel's output (a sync would push the host's stale
        copy over it).

        Raises:
            NpuError: as `run`, or syncing A failed.
        """
        self._operand(getattr(io, "key", None), io, Io, "operands")
        if not io.chained:
            try:
                io.sync_a()
            except errors.XdnaError as e:
                raise NpuError(f"{io.key}: syncing A failed: {e}", io.key) from e
        return self.run(io, w)

    @_exclusive
    def run_args(self, key: str, args: Sequence[Bo]) -> float:
        """Runs kernel `key` once over `args` (its argument order), none synced: for kernels over
        device-produced buffers (rope, addln, the device ViT's attention); returns seconds.

        Raises:
            TypeError: an argument is not a Bo.
            ValueError: the wrong number of buffers (GEMM: A, B, C; attention: q, k, v, o; at most 5), or one of
                another device.
            NpuError: the Npu is closed, loading or the run failed.
        """
        return self._execute(key, self._args_unit(key, args), 1)

    @_exclusive
    def run_mha(self, m: MhaIo) -> float:
        """Runs attention over q/k/v already pushed; returns seconds.

        Raises:
            TypeError: `m` is not an MhaIo.
            NpuError: the Npu is closed, loading or the run failed.
        """
        return self._execute(m.key, self._mha_unit(m), 1)

    def _execute(self, key: str, unit: _Unit, chunks: int) -> float:
        """Submits a stage's command unit and waits: a Run or RunList once; runs one by one with chains off."""
        start = time.perf_counter()
        parts = _parts(unit)
        for i, part in enumerate(parts):
            try:
                self._submit(key, part, chunks)
            except errors.XdnaError as e:
                raise NpuError(f"{key}: submitting {chunks} chunk(s) failed: {e}", key) from e
            try:
                part.wait(self.timeout)
            except errors.CommandError as e:
                chunk = i if len(parts) > 1 else (e.index or 0)
                raise NpuError(f"{key}: chunk {chunk} of {chunks} failed: {e}", key, chunk) from e
            except errors.XdnaError as e:
                raise NpuError(f"{key}: waiting for {chunks} chunk(s) failed: {e}", key) from e
        elapsed = time.perf_counter() - start
        self.device_seconds += elapsed
        self.kernel_seconds[key] += elapsed
        return elapsed

    def _submit(self, key: str, unit: Run | RunList, chunks: int) -> None:
        """`unit.start()`; when the unit's last submission timed out it is still on the device (start refuses
        with RuntimeError): wait for it first, bounded by `timeout`."""
        try:
            unit.start()
            return
        except RuntimeError:
            pass
        try:
            unit.wait(self.timeout)
        except errors.CommandError:
            pass
        try:
            unit.start()
        except RuntimeError as e:
            raise NpuError(f"{key}: its previous submission of {chunks} chunk(s) timed out and is still running "
                           f"after another {self.timeout} s", key) from e

    # -- accounting --------------------------------------------------------------------------

    @contextmanager
    def stage(self, name: str, kind: str, rows: int = 0, chunks: int = 0) -> Iterator[Stage]:
        """Measures what the body costs into a `Stage`, appended to `stages` when the body ends without error:
        EXEC_CMD ioctls, waits, bytes copied into and out of buffers (deltas of `Device.stats`), wall time and the
        part of it spent from submissions to their completions (`device_seconds`; the rest is the host's)."""
        record = Stage(name, kind, rows, chunks)
        before, start, device = Counter(self.device.stats), time.perf_counter(), self.device_seconds
        yield record
        delta = Counter(self.device.stats)
        delta.subtract(before)
        record.seconds = time.perf_counter() - start
        record.device_seconds = self.device_seconds - device
        record.exec_cmds = delta["EXEC_CMD"]
        record.waits = sum(delta[w] for w in WAIT_IOCTLS)
        record.bytes_in = delta["bytes_in"]
        record.bytes_out = delta["bytes_out"]
        self.stages.append(record)

    # -- teardown ----------------------------------------------------------------------------

    @_exclusive
    def close(self) -> None:
        """Destroys the resident contexts (with their command packets), frees the uploaded weights and, if this
        object opened them, closes the device and the bundle. Idempotent.

        Raises:
            XdnaError: a release ioctl failed (everything else was still released).
        """
        self._closed = True
        release = self._release_context
        steps: list[Callable[[], None]] = [functools.partial(release, ctx) for ctx in list(self._contexts)]
        steps += [bo.close for bo in self._weights.values()]
        self._weights = {}
        self._lru = []
        self._pools = {}
        if self._owns_device and hasattr(self, "device"):
            steps.append(self.device.close)
        if self._owns_bundle and hasattr(self, "bundle"):
            steps.append(self.bundle.close)
        release_steps(*steps)

    def __enter__(self) -> Npu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
