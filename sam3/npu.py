"""The NPU layer: a bundle's kernels on a device, with the semantics of the seed's `npu.rs`.

Every kernel of the bundle is loaded at open, in sorted key order, until the device has no room
for another hardware context or `SAM3_MAX_CONTEXTS` is reached; the rest load on first use,
evicting least-recently-used contexts (spec/sam3-bundle.md 7). Kernels naming the same xclbin
share one context.

A GEMM is compiled for `m` rows; a stage with more rows owns one A and one C buffer of the padded
height and runs the kernel once per `m`-row chunk over sub-buffer views of them. Unlike the seed,
a stage's chunks go to the device as command chains (ERT_CMD_CHAIN: `ceil(chunks / chain capacity)`
EXEC_CMDs, the capacity being what the runtime's `RunList` packs into one chain, and one wait), and
the command packets of an operand set are built once and reused.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from amdxdna_direct import errors
from amdxdna_direct.bo import FROM_DEVICE, Bo
from amdxdna_direct.device import Device, open_device, release_steps
from amdxdna_direct.hwctx import HwContext
from amdxdna_direct.kernel import RunList
from sam3.bundle import Bundle, GemmSpec, MhaSpec, OpSpec
from sam3.pack import BF16_BYTES, ConvGeometry, copy_wide, round_up, to_bf16

ENV_MAX_CONTEXTS = "SAM3_MAX_CONTEXTS"
# Command units kept per cache, least recently used dropped first: per Io / MhaIo (one per weight buffer) and
# for `run_args` (one per kernel and operand set).
UNIT_CACHE = 8
EVICTION_POLICIES = ("lru", "drain")
# How a host wait for a command reaches the driver (spec/xrt-npu-sequence.md 1.9).
WAIT_IOCTLS = ("SYNCOBJ_TIMELINE_WAIT", "WAIT_CMD")


class NpuError(RuntimeError):
    """A kernel could not be loaded or run; names the kernel `key` and, for a stage, the failing `chunk`."""

    def __init__(self, message: str, key: str | None = None, chunk: int | None = None):
        super().__init__(message)
        self.key = key
        self.chunk = chunk


# ---------------------------------------------------------------------------------------------
# host <-> buffer copies


def push(src: np.ndarray, bo: Bo, offset: int = 0) -> int:
    """Copies `src` into `bo` at byte `offset` with wide parallel copies and syncs that range to the device.

    Counts the bytes in the device's `stats["bytes_in"]` (as `Bo.write` does). Returns the byte count.

    Raises:
        TypeError: `src` holds Python objects.
        ValueError: `src` does not fit.
        XdnaError: SYNC_BO failed.
    """
    data = np.ascontiguousarray(src)
    if data.dtype.hasobject:
        raise TypeError(f"push: expected numeric data, got an array of {data.dtype}")
    nbytes = data.nbytes
    if nbytes == 0:
        return 0
    copy_wide(bo.array(np.uint8, nbytes, offset), data)
    bo.sync(offset, nbytes)
    bo.device.stats["bytes_in"] += nbytes
    return nbytes


def pull(bo: Bo, count: int, dtype: Any = np.uint16, offset: int = 0) -> np.ndarray:
    """The first `count` items of `dtype` of `bo` (synced from the device first), copied to host memory.

    Raises:
        TypeError: `count` or `offset` not an integer, or an object dtype.
        ValueError: the range is outside the buffer.
        XdnaError: SYNC_BO failed.
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"pull: dtype must be numeric, got {dt}")
    count, offset = _integer(count, "pull count"), _integer(offset, "pull offset")
    if count < 0 or offset < 0 or offset + count * dt.itemsize > bo.size:
        raise ValueError(f"pull(count={count}, dtype={dt}, offset={offset}) outside a {bo.size}-byte buffer")
    out = np.empty(count, dtype=dt)
    if count == 0:
        return out
    bo.sync(offset, count * dt.itemsize, direction=FROM_DEVICE)
    copy_wide(out, bo.array(dt, count, offset))
    bo.device.stats["bytes_out"] += out.nbytes
    return out


def _integer(value: Any, what: str) -> int:
    """`value` as an int; numpy integers pass, bools, floats and strings are a TypeError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def _bf16_bits(src: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of `src`: uint16 and bfloat16 arrays pass through, floats are rounded (RNE)."""
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

    Keeps the prepared commands of its chunks per weight buffer, so a repeated stage only submits.
    """

    def __init__(self, spec: GemmSpec, a: Bo, c: Bo, chunks: list[tuple[Bo, Bo]], rows: int,
                 chained_from: str | None = None):
        self.key = spec.key
        self.spec = spec
        self.a = a
        self.c = c
        self.chunks = chunks
        self.rows = rows
        self.n = spec.n
        self.chained_from = chained_from
        # id(weights) -> ((weights,), command unit); built by Npu on first use, rebuilt after an eviction.
        self._units: dict[Any, tuple[tuple[Bo, ...], Any]] = {}

    @property
    def chained(self) -> bool:
        """Whether A is another kernel's C (device-produced; never written or synced from the host)."""
        return self.chained_from is not None

    def set_a(self, src: np.ndarray) -> int:
        """Fills the start of A (bf16 bits, or floats rounded to bf16) and syncs it; returns bytes pushed.

        A convolution's A is Y (spec 4), laid out by `pack.conv_input(x, geometry, rows)`: it is filled whole.

        Raises:
            NpuError: A is chained (another kernel's output).
            ValueError: `src` is larger than A, or a convolution's `src` is not a whole Y (a raw map has no pad
                columns: the kernel would read shifted windows).
            TypeError: `src` is neither bf16 bits nor floats.
            XdnaError: SYNC_BO failed.
        """
        if self.chained:
            raise NpuError(f"{self.key}: A is {self.chained_from}'s C (chained); set_a would overwrite a "
                           f"device result", self.key)
        bits = _bf16_bits(src).reshape(-1)
        held = self.a.size // BF16_BYTES
        if bits.size > held:
            raise ValueError(f"{self.key}: set_a of {bits.size} elements, A holds {held}")
        if self.spec.conv is not None and bits.size != held:
            raise ValueError(f"{self.key}: set_a of {bits.size} elements, a convolution's A is Y of {held} "
                             f"(pack.conv_input(x, geometry, {self.rows}))")
        return push(bits, self.a)

    def sync_a(self) -> None:
        """Syncs all of A to the device.

        Raises:
            XdnaError: SYNC_BO failed.
        """
        self.a.sync()

    def get_c(self, rows: int) -> np.ndarray:
        """The first `rows` rows of C as bf16 bits, `[rows][n]`, copied out.

        Raises:
            TypeError: `rows` is not an integer.
            ValueError: more rows than C holds (or negative).
            XdnaError: SYNC_BO failed.
        """
        rows = _integer(rows, f"{self.key}: get_c rows")
        if not 0 <= rows <= self.rows:
            raise ValueError(f"{self.key}: get_c({rows}) outside C's {self.rows} rows")
        return pull(self.c, rows * self.n).reshape(rows, self.n)


class MhaIo:
    """q, k, v, o of an attention kernel, each `batch` items of `heads x seq x d` bf16 (one item per run)."""

    def __init__(self, spec: MhaSpec, buffers: list[Bo], batch: int, item_bytes: int):
        self.key = spec.key
        self.spec = spec
        self.batch = batch
        self.q, self.k, self.v, self.o = buffers
        self.items = [[b.sub(i * item_bytes, item_bytes) for b in buffers] for i in range(batch)]
        self._units: dict[Any, tuple[tuple[Bo, ...], Any]] = {}

    def set_qkv(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
        """Pushes q, k, v (`[batch][heads][seq][d]`, bf16 bits or floats); returns bytes pushed.

        Raises:
            ValueError: a tensor of the wrong size.
            TypeError: a tensor neither bf16 bits nor floats.
            XdnaError: SYNC_BO failed.
        """
        want = self.batch * self.spec.elems
        total = 0
        for name, src, bo in (("q", q, self.q), ("k", k, self.k), ("v", v, self.v)):
            bits = _bf16_bits(src).reshape(-1)
            if bits.size != want:
                raise ValueError(f"{self.key}: {name} has {bits.size} elements, {want} expected")
            total += push(bits, bo)
        return total

    def get_o(self) -> np.ndarray:
        """o as bf16 bits, `[batch][heads][seq][d]`.

        Raises:
            XdnaError: SYNC_BO failed.
        """
        s = self.spec
        return pull(self.o, self.batch * s.elems).reshape(self.batch, s.heads, s.seq, s.d)


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
    max_rel_err: float | None = None

    def row(self) -> dict[str, Any]:
        """The stage as the demo's JSON object; `max_rel_err` is null when unchecked or not finite (a NaN
        or infinite result: JSON has no such numbers)."""
        err = self.max_rel_err
        return {"name": self.name, "kind": self.kind, "rows": self.rows, "chunks": self.chunks,
                "exec_cmds": self.exec_cmds, "waits": self.waits, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "seconds": self.seconds,
                "max_rel_err": err if err is None or math.isfinite(err) else None}


@dataclass
class _Source:
    key: str
    ctx: str
    xclbin: Path
    name: str
    insts: bytes


# ---------------------------------------------------------------------------------------------


def device_generation(device: Device) -> str:
    """The NPU generation name of `device` ("npu1", "npu4", "npu5", "npu6"), from `Device.generation`.

    Raises:
        NpuError: the generation cannot be determined (no readable or known PCI id).
    """
    gen = device.generation
    if gen is None:
        raise NpuError(f"{device.name}: cannot tell the NPU generation (PCI id under /sys/class/accel unreadable "
                       "or not an amdxdna NPU)")
    return gen


def _max_contexts(value: int | None) -> int | None:
    """The resident-context cap: `value`, else env SAM3_MAX_CONTEXTS, else None (as many as the driver grants)."""
    source = "max_contexts"
    if value is None:
        text = os.environ.get(ENV_MAX_CONTEXTS, "").strip()
        if not text:
            return None
        source = ENV_MAX_CONTEXTS
        value = int(text) if text.isascii() and text.isdigit() else text  # isdigit alone takes "²"
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}={value!r}: expected a positive integer")
    return value


def _exclusive(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs `method` holding the Npu's lock: loading, evicting and running share the context table and the LRU,
    and an eviction must not destroy a context another thread is about to submit to or wait on (the seed's
    `&mut self`)."""
    @functools.wraps(method)
    def locked(self: Npu, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


_Unit = Any  # a Run (one command) or a RunList (ERT_CMD_CHAIN packets over several)
_UnitCache = dict[Any, tuple[tuple[Bo, ...], _Unit]]


def _release_unit(unit: _Unit) -> None:
    """Closes a command unit's packets (a RunList's chains and runs). A submission still on the device keeps
    its buffers: the driver's job holds references to them until it completes (spec amdxdna-uapi.md 4.7)."""
    if isinstance(unit, RunList):
        unit.close()
        for run in unit.runs:
            run.close()
    else:
        unit.close()


class Npu:
    """A bundle's kernels on a device (real or emulated), with resident-context LRU and eviction.

    Args:
        bundle: a loaded `Bundle` or a bundle directory.
        device: an open `Device`, or anything `open_device` accepts ("emu", "/dev/accel/accel0",
            an EmuDevice, None for the default device); a device opened here is closed by `close`.
        max_contexts: at most this many resident contexts (default: env `SAM3_MAX_CONTEXTS`, else as
            many as the driver grants).
        evict: "lru" drops least-recently-used contexts one at a time until a new one fits; "drain"
            destroys every resident context before loading one that does not fit (the Phoenix
            firmware workaround of spec/xrt-npu-sequence.md 1.9).
        timeout: seconds to wait for a stage (None: forever).

    Raises:
        BundleError: the bundle targets another NPU generation (or is invalid).
        NpuError: a kernel failed to load for another reason than "no room", needs more AIE columns than the
            device has, the device's generation is unknown, or (emulator) a stream is already bound to another
            computation.
        ValueError: bad `max_contexts` / `SAM3_MAX_CONTEXTS` / `evict` / `timeout`.
        XdnaError: the device could not be opened.
    """

    def __init__(self, bundle: Bundle | str | os.PathLike, device: Any = None, *, max_contexts: int | None = None,
                 evict: str = "lru", timeout: float | None = None):
        if evict not in EVICTION_POLICIES:
            raise ValueError(f"evict must be one of {EVICTION_POLICIES}, got {evict!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):  # checked here: a stage's wait comes after its submit
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
        self.cap = _max_contexts(max_contexts)
        self.evict = evict
        self.timeout = timeout
        self._owns_device = not isinstance(device, Device)
        self.device = device if isinstance(device, Device) else open_device(device)
        self._contexts: dict[str, HwContext] = {}
        self._closed = False
        self._lock = threading.RLock()
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        self.generation = device_generation(self.device)
        self.bundle.check_target(self.generation)
        self._sources = {key: self._source(key) for key in self.bundle.keys()}
        self._check_widths()
        self._kernels: dict[str, Any] = {}
        self._arg_units: _UnitCache = {}
        self._lru: list[str] = []  # resident contexts, least recently used first
        self.loads = 0
        self.evictions = 0
        self.stages: list[Stage] = []
        if self.device.emulator is not None:
            self._bind_models()
        self._preload()

    def _check_widths(self) -> None:
        """A context wider than the array can never load: CREATE_HWCTX would refuse it the way it refuses a full
        device, and loading it would evict every resident context first ("no room" is the driver's answer)."""
        cols = self.device.aie_metadata().cols
        for key in self.bundle.keys():
            partition = self.bundle.xclbin(key).partition
            if partition is not None and partition.column_width > cols:
                raise NpuError(f"{key}: {self._sources[key].ctx} needs {partition.column_width} AIE columns, the "
                               f"device has {cols}", key)

    def _source(self, key: str) -> _Source:
        k = self.bundle.kernel(key)
        return _Source(key, k.ctx, k.xclbin, k.name, k.insts.read_bytes())

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
        """The bundle's element-wise kernels by key."""
        return self.bundle.ops

    # -- emulator models (spec/sam3-bundle.md 8) ----------------------------------------------

    def _bind_models(self) -> None:
        """Tells the emulated firmware what each instruction stream computes, from its manifest entry."""
        from amdxdna_direct.emu.models import Elementwise, Gemm, Mha

        registry = self.device.emulator.models
        for key, src in self._sources.items():
            if key in self.gemms:
                g = self.gemms[key]
                model = Gemm(g.m, g.k, g.n, g.lda, g.b_layout)
            elif key in self.mhas:
                h = self.mhas[key]
                model = Mha(h.heads, h.seq, h.d)
            else:
                o = self.ops[key]
                model = Elementwise(o.fn, o.elems, n=o.n)
            try:  # an equal model already bound (same stream of another key, or another Npu) is a no-op
                registry.bind(src.insts, model)
            except ValueError as e:
                raise NpuError(f"{key}: its instruction stream is bound to another computation: {e}", key) from e

    # -- contexts (the seed's open / kernel / try_load / evict_lru, spec 7) --------------------

    def _preload(self) -> None:
        for key in self.bundle.keys():
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
            self._contexts[src.ctx] = self.device.hw_context(self.bundle.xclbin(key), kernel=src.name)
            self._lru.append(src.ctx)
            self.loads += 1
        self._kernels[key] = self._contexts[src.ctx].kernel(src.name)

    def _check_open(self, key: str | None) -> None:
        """After `close` nothing may load a context (it would outlive the Npu) or allocate on its device."""
        if self._closed:
            raise NpuError(f"{key or 'Npu'}: the Npu is closed", key)

    def _kernel(self, key: str) -> tuple[Any, _Source]:
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
        return self._kernels[key], src

    def _load_evicting(self, key: str, src: _Source) -> None:
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
        for key in [k for k in self._kernels if self._sources[k].ctx == ctx]:
            del self._kernels[key]
        self._arg_units = {k: v for k, v in self._arg_units.items() if v[1].ctx is not context}
        context.close()

    @property
    def resident(self) -> list[str]:
        """Resident contexts (xclbin paths), least recently used first."""
        return list(self._lru)

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
        if isinstance(data, str):  # most likely a weights file's path: its text is not the weights
            raise TypeError(f"upload: expected bytes or a numeric array, got str {data[:80]!r} (read the file first)")
        arr = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data)
        if arr.nbytes == 0:
            raise ValueError("upload: no data")
        bo = self.device.bo(arr.nbytes)
        push(arr, bo)
        return bo

    def weight_slot(self, key: str) -> Bo:
        """A buffer sized for GEMM `key`'s packed B, to be filled per forward.

        Raises:
            NpuError: no such GEMM.
            XdnaError: allocation failed.
        """
        return self.device.bo(self.spec(key).b_bytes)

    def _operands(self, g: GemmSpec, a: Bo, rows: int, a_step: int, chained_from: str | None = None) -> Io:
        """An Io of `rows` rows over A and a new C: chunk `i` views `(m-1)*lda + k` elements of A from element
        `i*a_step` (`m*k` for a plain GEMM) and the `m` rows of C from row `i*m` (spec 2, 4)."""
        a_bytes = ((g.m - 1) * g.lda + g.k) * BF16_BYTES
        c_step = g.m * g.n * BF16_BYTES
        c = self.device.bo(rows * g.n * BF16_BYTES)
        try:
            chunks = [(a.sub(i * a_step * BF16_BYTES, a_bytes), c.sub(i * c_step, c_step))
                      for i in range(rows // g.m)]
        except ValueError as e:  # a view the shim DMA cannot address (not word aligned)
            raise NpuError(f"{g.key}: chunk views of A/C: {e}", g.key) from e
        return Io(g, a, c, chunks, rows, chained_from)

    def io(self, key: str, rows: int) -> Io:
        """Operands of GEMM `key` for `rows` rows (plain row-major A, `lda == k`), padded to a multiple of m.

        Raises:
            NpuError: `key` is a convolution GEMM (use `conv_io`) or unknown, or the Npu is closed.
            TypeError: `rows` is not an integer.
            ValueError: `rows` is not positive.
            XdnaError: allocation failed.
        """
        g = self.spec(key)
        if g.lda != g.k:
            raise NpuError(f"{key}: overlapping A (lda {g.lda} != k {g.k}), use conv_io", key)
        rows = _integer(rows, f"{key}: rows")
        if rows <= 0:
            raise ValueError(f"{key}: rows must be positive, got {rows}")
        rows = round_up(rows, g.m)
        return self._operands(g, self.device.bo(rows * g.k * BF16_BYTES), rows, g.m * g.k)

    def io_chained(self, key: str, src: Io) -> Io:
        """Operands of GEMM `key` whose A is `src`'s C, read in place (spec 3).

        Raises:
            NpuError: `src.n != k`, `key` is a convolution GEMM, or `src`'s rows are not a multiple of `key`'s m.
            TypeError: `src` is not an Io.
            XdnaError: allocation failed.
        """
        g = self.spec(key)
        self._operand(key, src, Io, "io_chained source")
        if g.lda != g.k:
            raise NpuError(f"{key}: overlapping A (lda {g.lda} != k {g.k}) cannot read {src.key}'s C in place", key)
        if src.n != g.k:
            raise NpuError(f"{key}: A width {src.n} (C of {src.key}) != K {g.k}", key)
        if src.rows % g.m:
            raise NpuError(f"{key}: {src.rows} rows of {src.key} are not a multiple of m={g.m}", key)
        return self._operands(g, src.c.sub(0, src.rows * g.k * BF16_BYTES), src.rows, g.m * g.k, src.key)

    def conv_io(self, key: str, h: int, w: int) -> Io:
        """Operands of the overlapping-row 3x3 convolution `key` for an `h x w` map (spec 4).

        A is Y (`(rows*P + 2) x D`); each chunk's A view starts `i*m*lda` elements in and reaches
        `(m-1)*lda + K` elements.

        Raises:
            NpuError: `key` is not a conv3x3 GEMM, or the Npu is closed.
            TypeError: `h` or `w` not an integer.
            ValueError: `h` or `w` not positive.
            XdnaError: allocation failed.
        """
        g = self.spec(key)
        geom = g.conv
        if geom is None:
            raise NpuError(f"{key}: b_layout {g.b_layout} is not a 3x3 convolution, use io", key)
        h, w = _integer(h, f"{key}: map height"), _integer(w, f"{key}: map width")
        if h <= 0 or w <= 0:
            raise ValueError(f"{key}: map size {h}x{w} must be positive")
        rows = geom.rows(h, w, g.m)
        return self._operands(g, self.device.bo(geom.y_elems(rows) * BF16_BYTES), rows, g.m * g.lda)

    def conv_geometry(self, key: str) -> ConvGeometry:
        """D, P, Cout of conv GEMM `key`.

        Raises:
            NpuError: not a conv GEMM.
        """
        geom = self.spec(key).conv
        if geom is None:
            raise NpuError(f"{key}: not a 3x3 convolution GEMM", key)
        return geom

    def mha_io(self, key: str, batch: int = 1) -> MhaIo:
        """q, k, v, o buffers of attention `key` for `batch` independent items (windows).

        Raises:
            NpuError: no such attention kernel, or the Npu is closed.
            TypeError: `batch` not an integer.
            ValueError: `batch` not positive.
            XdnaError: allocation failed.
        """
        self._check_open(key)
        if not isinstance(key, str) or key not in self.mhas:
            raise NpuError(f"no MHA {key!r} in bundle {self.bundle.root}", key)
        batch = _integer(batch, f"{key}: batch")
        if batch <= 0:
            raise ValueError(f"{key}: batch must be positive, got {batch}")
        item = self.mhas[key].elems * BF16_BYTES
        return MhaIo(self.mhas[key], [self.device.bo(batch * item) for _ in range(4)], batch, item)

    def push(self, src: np.ndarray, bo: Bo, offset: int = 0) -> int:
        """The module-level `push` (the seed's `push`, kept as a method for callers holding an `Npu`).

        Raises:
            ValueError: `src` does not fit.
            XdnaError: SYNC_BO failed.
        """
        return push(src, bo, offset)

    def pull(self, bo: Bo, count: int, dtype: Any = np.uint16, offset: int = 0) -> np.ndarray:
        """The module-level `pull`.

        Raises:
            ValueError: the range is outside the buffer.
            XdnaError: SYNC_BO failed.
        """
        return pull(bo, count, dtype, offset)

    # -- command units (built once per operand set and context, spec 7 and the "better") --

    def _unit(self, key: str, cache: _UnitCache, ident: Any, pins: tuple[Bo, ...],
              make: Callable[[Any, bytes], list[Any]]) -> _Unit:
        """The command unit of kernel `key` cached in `cache[ident]`: reused while its context is resident,
        else built (one Run, or a RunList for several). `ident` names the `pins` by id: an entry keeps its
        pinned buffers alive, so no other buffer can take their ids while it is cached."""
        kernel, src = self._kernel(key)
        entry = cache.pop(ident, None)
        if entry is not None and entry[1].ctx is kernel.ctx:
            cache[ident] = entry  # most recently used last
            return entry[1]
        try:
            runs = make(kernel, src.insts)
            unit = runs[0] if len(runs) == 1 else RunList(kernel.ctx, runs)
        except (errors.XdnaError, ValueError) as e:  # ValueError: a malformed stream, or too many buffers
            raise NpuError(f"{key}: preparing commands failed: {e}", key) from e
        cache[ident] = (pins, unit)
        # A unit pins its buffers and holds command BOs: a caller that runs fresh buffers every forward (new
        # weights for one Io, a new Io's C for an op) would otherwise keep every one of them alive.
        while len(cache) > UNIT_CACHE:
            _release_unit(cache.pop(next(iter(cache)))[1])
        return unit

    # -- operand checks (before any ioctl: a wrong buffer would otherwise surface as a device fault) -----

    def _operand(self, key: str | None, obj: Any, cls: type, what: str) -> None:
        """`obj` must be a `cls` (Io or MhaIo) made on this Npu's device."""
        if not isinstance(obj, cls):
            raise TypeError(f"{key or 'Npu'}: {what} must be an {cls.__name__}, got {type(obj).__name__}")
        self._own_bo(obj.key, obj.c if isinstance(obj, Io) else obj.o, what)

    def _own_bo(self, key: str | None, bo: Any, what: str) -> None:
        if not isinstance(bo, Bo):
            raise TypeError(f"{key}: {what} must be a Bo, got {type(bo).__name__}")
        if bo.device is not self.device:
            raise ValueError(f"{key}: {what} belongs to device {bo.device.name}, not this Npu's {self.device.name}")

    def _weights(self, g: GemmSpec, w: Any) -> None:
        """`w` must hold exactly GEMM `g`'s packed B (the kernel reads `b_bytes`; a wrong-sized buffer is
        another kernel's weights, or too short for the device to read)."""
        self._own_bo(g.key, w, "weights")
        if w.size != g.b_bytes:
            raise ValueError(f"{g.key}: weights of {w.size} bytes, B takes b_bytes={g.b_bytes} ({g.b_layout})")

    def _arg_bytes(self, key: str, count: int) -> list[tuple[str, int]]:
        """(name, bytes the kernel reads) of each of `count` `run_args` buffers of kernel `key` (spec 2, 5, 6)."""
        if key in self.gemms:
            g = self.gemms[key]
            need = [("A", ((g.m - 1) * g.lda + g.k) * BF16_BYTES), ("B", g.b_bytes), ("C", g.m * g.n * BF16_BYTES)]
        elif key in self.mhas:
            need = [(name, self.mhas[key].elems * BF16_BYTES) for name in ("q", "k", "v", "o")]
        else:
            need = [(f"argument {i}", self.ops[key].elems * BF16_BYTES) for i in range(max(count, 1))]
        if count != len(need):
            raise ValueError(f"{key}: run_args takes {len(need)} buffer(s) ({', '.join(n for n, _ in need)}), "
                             f"got {count}")
        return need

    def _check_args(self, key: str, args: tuple[Any, ...]) -> None:
        for (name, nbytes), bo in zip(self._arg_bytes(key, len(args)), args, strict=True):
            self._own_bo(key, bo, name)
            if not bo.closed and bo.size < nbytes:  # a closed buffer is reported by Kernel.prepare_npu
                raise ValueError(f"{key}: {name} has {bo.size} bytes, the kernel reads {nbytes}")

    def _gemm_unit(self, io: Io, w: Bo) -> _Unit:
        self._operand(getattr(io, "key", None), io, Io, "operands")
        self._weights(io.spec, w)
        return self._unit(io.key, io._units, id(w), (w,),
                          lambda k, insts: [k.prepare_npu(insts, [a, w, c]) for a, c in io.chunks])

    def _mha_unit(self, m: MhaIo) -> _Unit:
        self._operand(getattr(m, "key", None), m, MhaIo, "attention operands")
        return self._unit(m.key, m._units, None, (), lambda k, insts: [k.prepare_npu(insts, it) for it in m.items])

    def _args_unit(self, key: str, args: Sequence[Bo]) -> _Unit:
        pins = tuple(args)
        self._check_open(key)
        if isinstance(key, str) and key in self._sources:
            self._check_args(key, pins)
        return self._unit(key, self._arg_units, (key, tuple(map(id, pins))), pins,
                          lambda k, insts: [k.prepare_npu(insts, list(pins))])

    @_exclusive
    def prepare(self, io: Io, w: Bo) -> None:
        """Loads `io`'s kernel and builds its command unit for weights `w` ahead of `run` (uploads the
        instruction stream once per context, so a measured stage moves only its data).

        Raises:
            NpuError: loading or building the commands failed.
        """
        self._gemm_unit(io, w)

    @_exclusive
    def prepare_mha(self, m: MhaIo) -> None:
        """`prepare` for an attention operand set.

        Raises:
            NpuError: loading or building the commands failed.
        """
        self._mha_unit(m)

    @_exclusive
    def prepare_args(self, key: str, args: Sequence[Bo]) -> None:
        """`prepare` for `run_args`.

        Raises:
            NpuError: loading or building the command failed.
        """
        self._args_unit(key, args)

    # -- running -----------------------------------------------------------------------------

    @_exclusive
    def run(self, io: Io, w: Bo) -> float:
        """Runs `io`'s kernel over every chunk with weights `w` (A must be synced); returns seconds.

        Raises:
            TypeError: `io` is not an Io or `w` not a Bo.
            ValueError: `w` is not `b_bytes` long, or a buffer belongs to another device.
            NpuError: the Npu is closed, loading failed or a chunk failed (naming the key and the chunk index).
        """
        unit = self._gemm_unit(io, w)
        return self._execute(io.key, unit, len(io.chunks))

    @_exclusive
    def run_synced(self, io: Io, w: Bo) -> float:
        """`run` with A synced first, unless A is another kernel's output (a sync would push the host's
        stale copy over it, spec 3).

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
        """Runs kernel `key` once over `args` (its argument order), none synced; returns seconds.

        Raises:
            TypeError: an argument is not a Bo.
            ValueError: the wrong number of buffers for a GEMM (A, B, C) or attention (q, k, v, o) kernel, none
                for an op, a buffer smaller than the kernel reads, or one of another device.
            NpuError: the Npu is closed, loading or the run failed.
        """
        return self._execute(key, self._args_unit(key, args), 1)

    @_exclusive
    def run_mha(self, m: MhaIo) -> float:
        """Runs attention over q/k/v already pushed, every batch item in one chain; returns seconds.

        Raises:
            TypeError: `m` is not an MhaIo.
            NpuError: the Npu is closed, loading or a run failed (naming the item as the chunk).
        """
        unit = self._mha_unit(m)
        return self._execute(m.key, unit, m.batch)

    def _execute(self, key: str, unit: _Unit, chunks: int) -> float:
        """Submits a stage's command unit (a Run, or a RunList: one EXEC_CMD per chain packet) and waits once."""
        start = time.perf_counter()
        try:
            self._submit(key, unit, chunks)
        except errors.XdnaError as e:
            raise NpuError(f"{key}: submitting {chunks} chunk(s) failed: {e}", key) from e
        try:
            unit.wait(self.timeout)
        except errors.CommandError as e:
            chunk = e.index or 0
            raise NpuError(f"{key}: chunk {chunk} of {chunks} failed: {e}", key, chunk) from e
        except errors.XdnaError as e:
            raise NpuError(f"{key}: waiting for {chunks} chunk(s) failed: {e}", key) from e
        return time.perf_counter() - start

    def _submit(self, key: str, unit: _Unit, chunks: int) -> None:
        """`unit.start()`; when the unit's last submission timed out it is still on the device (start refuses
        with RuntimeError): wait for it first, bounded by `timeout`. Its outcome was that stage's (reported
        as a timeout then), so only whether it is still running matters here."""
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
        """Measures what the body costs into a `Stage`, appended to `stages` when the body ends without
        error: EXEC_CMD ioctls, wait ioctls (SYNCOBJ_TIMELINE_WAIT or WAIT_CMD), bytes copied into and
        out of buffers (all deltas of `Device.stats`) and wall time."""
        record = Stage(name, kind, rows, chunks)
        before, start = Counter(self.device.stats), time.perf_counter()
        yield record
        delta = Counter(self.device.stats)
        delta.subtract(before)
        record.seconds = time.perf_counter() - start
        record.exec_cmds = delta["EXEC_CMD"]
        record.waits = sum(delta[name] for name in WAIT_IOCTLS)
        record.bytes_in = delta["bytes_in"]
        record.bytes_out = delta["bytes_out"]
        self.stages.append(record)

    # -- teardown ----------------------------------------------------------------------------

    @_exclusive
    def close(self) -> None:
        """Destroys the resident contexts (with their command packets) and, if this object opened the device,
        closes it. Idempotent.

        Raises:
            XdnaError: a release ioctl failed (everything else was still released).
        """
        self._closed = True
        steps = [lambda ctx=ctx: self._release_context(ctx) for ctx in list(self._contexts)]
        self._lru = []
        if self._owns_device:
            steps.append(self.device.close)
        release_steps(*steps)

    def __enter__(self) -> Npu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
