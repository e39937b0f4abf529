"""Hardware contexts: CREATE_HWCTX, one PDI DEV BO per CU, one CONFIG_CU, the context syncobj.

Sequence and values as XRT (docs/xrt-sequence.md 0 steps 4-5 and 1.3): num_tiles = partition
column_width x core rows (QUERY_AIE_METADATA), max_opc = the partition's operations_per_cycle, a
zeroed 32-byte QoS buffer, PDIs chosen by dpu_kernel_id, CU index = position in the CONFIG_CU array.
Teardown: SYNCOBJ_DESTROY before DESTROY_HWCTX (docs/xrt-sequence.md 1.10), then the PDI buffers.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import abi
from . import insts as insts_mod
from .device import DeviceFile, release_quietly, release_steps
from .errors import ContextLostError, ContextUnavailableError, XdnaError, errno_text, format_call, ioctl_error

if TYPE_CHECKING:
    from .bo import Bo
    from .device import Device, _Resource
    from .kernel import Kernel, Run, RunList

__all__ = ["HwContext", "ComputeUnit", "Instructions", "PRIORITIES", "QOS_BUFFER_SIZE", "as_xclbin", "create_hwctx",
           "instruction_bytes", "release_context", "children_started"]

log = logging.getLogger(__name__)

# Out-of-tree drivers copy a 32-byte qos_info (adds user_start_col, reserved), upstream 24 bytes:
# a 32-byte buffer works with both (docs/uapi.md 12). user_start_col 0xFF = "not requested".
QOS_BUFFER_SIZE = 32
_QOS_PRIORITY_OFFSET = 20
_QOS_USER_START_COL_OFFSET = 24
_USER_START_COL_NONE = 0xFF
MAX_NUM_CUS = 32  # driver limit for CONFIG_CU (docs/xrt-sequence.md 1.3)


# qos.priority values (docs/uapi.md 3; the driver maps any other value, 0 included, to HIGH).
_PRIORITY_VALUES = {"realtime": abi.AMDXDNA_QOS_REALTIME_PRIORITY, "high": abi.AMDXDNA_QOS_HIGH_PRIORITY,
                    "normal": abi.AMDXDNA_QOS_NORMAL_PRIORITY, "low": abi.AMDXDNA_QOS_LOW_PRIORITY}
PRIORITIES = tuple(_PRIORITY_VALUES)


# --- child processes (docs/runtime.md 4.4) ---
# On Linux 6.14-6.19 a child's close of its inherited copy of the device file destroys every context of the file.
# The runtime counts the children this process starts: the audit events of every way Python starts one
# (subprocess and os.posix_spawn run no at-fork hook) and os.register_at_fork for a fork from C.
_SPAWN_EVENTS = frozenset({"os.fork", "os.forkpty", "subprocess.Popen", "os.posix_spawn", "os.posix_spawnp",
                           "os.system"})
_children = [0]
_watch_lock = threading.Lock()
_watching = [False]
_LOST_HINT = ("on Linux 6.14-6.19 every close() of a copy of the device file destroys all of its hardware contexts: "
              "a child process (subprocess, multiprocessing with fork, os.fork) closes its inherited copy, and so "
              "does closing a dup of the fd; Linux 7.0 keeps them. Fix: HwContext.recreate(), or start child "
              "processes before creating contexts (or from a process without the device open: multiprocessing "
              "'spawn' / 'forkserver' started first), or run Linux >= 7.0")


def _count_child() -> None:
    _children[0] += 1


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _SPAWN_EVENTS:
        _count_child()


def _watch_children() -> None:
    with _watch_lock:
        if not _watching[0]:
            _watching[0] = True
            sys.addaudithook(_audit)
            os.register_at_fork(after_in_parent=_count_child)


def children_started() -> int:
    """How many times this process has started a child since the first context was created (a fork or a spawn
    may count twice: only a change matters)."""
    return _children[0]


@dataclass(frozen=True)
class ComputeUnit:
    """One configured CU: its xclbin kernel, the index used in cu_mask, and its PDI buffer."""

    index: int
    kernel: Any
    pdi: Bo
    cu_func: int


def as_xclbin(xclbin: Any) -> Any:
    """An ``Xclbin`` from an Xclbin, bytes or a path.

    Raises:
        XclbinError: the file is not a valid xclbin.
        OSError: the file cannot be read.
    """
    from .xclbin import Xclbin

    if isinstance(xclbin, Xclbin):
        return xclbin
    return Xclbin.load(xclbin)


def create_hwctx(device: Device, num_tiles: int, max_opc: int, priority: int = 0) -> tuple[int, int]:
    """CREATE_HWCTX with the 32-byte QoS buffer (priority at its offset, user_start_col "not requested");
    returns (context handle, timeline syncobj handle). The driver copies the QoS during the call.

    Raises:
        ContextUnavailableError: the device has no room (ENODEV / EINVAL / EBUSY).
        DeviceLostError: the device is gone (an ENODEV that a VERSION ioctl confirms).
        XdnaError: another failure (the heap is grown and the call retried on EAGAIN).
    """
    ffi = abi.ffi
    qos_buf = ffi.new("uint8_t[]", QOS_BUFFER_SIZE)
    qos = np.frombuffer(ffi.buffer(qos_buf), np.uint32)
    qos[_QOS_PRIORITY_OFFSET // 4] = priority
    qos[_QOS_USER_START_COL_OFFSET // 4] = _USER_START_COL_NONE
    req = abi.new("struct amdxdna_drm_create_hwctx", qos_p=abi.address_of(qos_buf), max_opc=max_opc,
                  num_tiles=num_tiles)
    fields = {"num_tiles": num_tiles, "max_opc": max_opc}
    if priority:
        fields["priority"] = priority
    # A context takes 4 x 32 KiB of heap for its command lists (docs/uapi.md 4.1): short heap, grow it.
    try:
        device.growing_heap(lambda: device.file.ioctl(abi.DRM_IOCTL_AMDXDNA_CREATE_HWCTX, req, fields))
    except BaseException as exc:
        if req.handle:      # made by the driver, but interrupted (Ctrl-C) before the caller got its handle
            release_context(device.file, req.handle, req.syncobj_handle)
        if isinstance(exc, ContextUnavailableError) and exc.errno == errno.ENODEV:
            # ENODEV is both "no free columns" and a removed device (docs/uapi.md 4.0, 4.1 step 8):
            # a lost device is reported (and latched) as one, not as a full device to retry.
            device.file.confirm_lost(exc)
        raise
    return req.handle, req.syncobj_handle


def _select_kernels(xclbin: Any, kernel: str | None) -> list[tuple[Any, bytes]]:
    """(kernel, PDI image) per CU: the named kernel, or every ``dpu`` kernel with a PDI, in xclbin order.

    XRT skips a CU whose dpu_kernel_id matches no PDI and fails only when none is left (docs/xrt-sequence.md 1.3).
    """
    from .xclbin import XclbinError

    if xclbin.partition is None:
        raise ValueError("hw_context: the xclbin has no AIE_PARTITION section (nothing to load on an NPU)")
    if kernel is not None:
        return [(xclbin.kernel(kernel), xclbin.pdi_for(kernel).image)]
    chosen = []
    for k in xclbin.kernels:
        if k.type != "dpu":
            continue
        try:
            chosen.append((k, xclbin.pdi_for(k.name).image))
        except XclbinError:
            continue
    if not chosen:
        names = ", ".join(k.name for k in xclbin.kernels) or "none"
        raise ValueError(f"hw_context: no valid DPU kernel found (kernels: {names}; none has a dpu_kernel_id "
                         f"matching a PDI in AIE_PARTITION)")
    if len(chosen) > MAX_NUM_CUS:
        raise ValueError(f"hw_context: {len(chosen)} CUs, the driver accepts at most {MAX_NUM_CUS}")
    return chosen


def _priority_value(priority: int | str | None) -> int:
    if priority is None:
        return 0
    if isinstance(priority, str):
        if priority.lower() not in _PRIORITY_VALUES:
            raise ValueError(f"priority must be one of {PRIORITIES} or an int, got {priority!r}")
        return _PRIORITY_VALUES[priority.lower()]
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 0xFFFFFFFF:
        raise ValueError(f"priority must be one of {PRIORITIES} or a u32, got {priority!r}")
    return priority


class HwContext:
    """A hardware context on a device, configured with the PDIs of an xclbin.

    Create with ``device.hw_context(xclbin, kernel=None, priority=None)``. ``handle`` and
    ``syncobj`` are the driver's; ``cus`` the configured compute units; ``num_tiles`` and
    ``max_opc`` what CREATE_HWCTX was given.
    """

    def __init__(self, device: Device, xclbin: Any, kernel: str | None = None,
                 priority: int | str | None = None) -> None:
        """CREATE_HWCTX, PDI buffers, CONFIG_CU.

        Raises:
            ValueError: the xclbin has no usable kernel, or a bad priority.
            XclbinError: the named kernel or its PDI is not in the xclbin, or a kernel's arguments do not fit
                a command packet (refused before any allocation).
            ContextUnavailableError: CREATE_HWCTX answered ENODEV / EINVAL / EBUSY (device full).
            XdnaError: another step failed; everything created so far is released.
        """
        from .kernel import check_regmap

        self.device = device
        self.xclbin = as_xclbin(xclbin)
        chosen = _select_kernels(self.xclbin, kernel)
        for chosen_kernel, _ in chosen:     # sizes checked before anything is allocated (docs/runtime.md 1.4)
            check_regmap(chosen_kernel)
        self.priority = _priority_value(priority)
        device.ensure_heap()  # XRT creates the heap first; the driver needs it mapped before CREATE_HWCTX (1.2)
        metadata = device.aie_metadata()
        self.column_width = int(self.xclbin.partition.column_width)
        self.num_tiles = self.column_width * metadata.core.row_count
        self.max_opc = int(self.xclbin.partition.ops_per_cycle)
        self._lock = threading.Lock()
        self._claims = threading.Lock()     # who holds each run's packet: a start alone, or a RunList
        self._insts: dict[str, Instructions] = {}      # by sha256 of the current bytes
        self._uploads: list[Instructions] = []           # every upload, closed with the context
        self._kernels: dict[str, Kernel] = {}
        self._runs: weakref.WeakSet[Run | RunList] = weakref.WeakSet()
        self._closed = False
        self._release: _Resource | None = None
        self.cus: list[ComputeUnit] = []
        self.handle = self.syncobj = 0
        self.generation = 0                 # bumped by recreate: runs refresh the handles in their requests
        self._chosen = chosen
        _watch_children()
        self._children_seen = children_started()
        self._finalizer = weakref.finalize(self, release_quietly, self._bring_up(), "hardware context")

    def _bring_up(self) -> _Resource:
        """CREATE_HWCTX, the PDI buffers and CONFIG_CU; on failure everything created so far is released."""
        device = self.device
        self._release = None
        try:
            self.handle, self.syncobj = create_hwctx(device, self.num_tiles, self.max_opc, self.priority)
            self._configure(self._chosen)
            # Registered after the PDI buffers so that device close (newest first) destroys the context
            # before its PDIs.
            self._held = _Held(self.handle, self.syncobj, [cu.pdi for cu in self.cus])
            self._release = release = device.file.register(_release_held, device.file, self._held)
        except BaseException:
            if self._release is None and self.handle:
                release_context(device.file, self.handle, self.syncobj, [cu.pdi for cu in self.cus])
            raise
        return release

    # -- bring-up ------------------------------------------------------------------------------

    def _configure(self, chosen: Sequence[tuple[Any, bytes]]) -> None:
        for index, (kernel, pdi) in enumerate(chosen):
            bo = self.device.bo(len(pdi), "dev")
            self.cus.append(ComputeUnit(index, kernel, bo, kernel.functional or 0))
            bo.write(pdi)
            bo.sync()
        ffi = abi.ffi
        n = len(self.cus)
        raw = ffi.new("uint8_t[]", ffi.sizeof("struct amdxdna_hwctx_param_config_cu")
                      + n * ffi.sizeof("struct amdxdna_cu_config"))
        cfg = ffi.cast("struct amdxdna_hwctx_param_config_cu *", raw)
        cfg.num_cus = n
        for i, cu in enumerate(self.cus):
            cfg.cu_configs[i].cu_bo = cu.pdi.handle
            cfg.cu_configs[i].cu_func = cu.cu_func
        req = ffi.new("struct amdxdna_drm_config_hwctx *")
        req.handle = self.handle
        req.param_type = abi.DRM_AMDXDNA_HWCTX_CONFIG_CU
        req.param_val = abi.address_of(raw)
        req.param_val_size = len(raw)
        self.device.file.ioctl(abi.DRM_IOCTL_AMDXDNA_CONFIG_HWCTX, req,
                               {"handle": self.handle, "param_type": "CONFIG_CU", "num_cus": n})

    # -- use -----------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (f"<HwContext handle={self.handle} syncobj={self.syncobj} num_tiles={self.num_tiles} "
                f"cus={[cu.kernel.name for cu in self.cus]}{' closed' if self.closed else ''}>")

    @property
    def closed(self) -> bool:
        """True once closed (or its device closed, or closing)."""
        return self._closed or self.device.file.closed or (self._release is not None and not self._release.alive)

    def check_open(self, what: str) -> None:
        """Raise if the context is closed.

        Raises:
            XdnaError: EBADF naming ``what`` and the context handle.
        """
        if self.closed:
            raise ioctl_error(what, {"hwctx": self.handle}, errno.EBADF, "context is closed")

    def cu(self, name: str | None = None) -> ComputeUnit:
        """The CU of kernel ``name`` (default: the first).

        Raises:
            ValueError: no such kernel in this context.
        """
        for cu in self.cus:
            if name is None or cu.kernel.name == name:
                return cu
        raise ValueError(f"kernel {name!r} is not configured in this context "
                         f"(have: {', '.join(cu.kernel.name for cu in self.cus)})")

    def kernel(self, name: str | None = None) -> Kernel:
        """The ``Kernel`` of CU ``name`` (default: the first CU).

        Raises:
            ValueError: no such kernel in this context.
            XdnaError: the context is closed.
        """
        from .kernel import Kernel

        self.check_open("kernel")
        cu = self.cu(name)
        with self._lock:
            if cu.kernel.name not in self._kernels:
                self._kernels[cu.kernel.name] = Kernel(self, cu)
            return self._kernels[cu.kernel.name]

    def instructions(self, stream: Any) -> Instructions:
        """Upload an instruction stream once per context (cached by the sha256 of its bytes).

        ``stream``: bytes (binary or text), a path, u32 words or an ``insts.Stream``. Its bytes go into the
        DEV buffer as given (docs/runtime.md 1): only the header is checked, against this device's TXN
        generation too; ops the runtime does not decode are logged once per stream (WARNING), not refused.

        Raises:
            InstsError: the header is malformed, the ops do not add up to it, or the stream is for another
                device generation.
            TypeError: unsupported input type.
            XdnaError: allocation or sync failed, or the context is closed.
        """
        self.check_open("instructions")
        data, parsed = instruction_bytes(stream)
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            cached = self._insts.get(digest)
            if cached is not None and not cached.bo.closed:
                return cached
            parsed = parsed if parsed is not None else insts_mod.decode(data)
            check_generation(parsed, self.device.txn_dev_gen, self.device.generation)
            _warn_raw_ops(parsed, digest)
            prepared = Instructions(self, data, digest, _extents(parsed))
            self._insts[digest] = prepared
            self._uploads.append(prepared)
            return prepared

    def _rekey(self, prepared: Instructions, old: str) -> None:
        """``prepared`` was rewritten: file it under its new digest (a later upload of the old bytes gets a
        buffer of its own)."""
        if self._insts.get(old) is prepared:
            del self._insts[old]
        current = self._insts.get(prepared.digest)
        if current is None or current.bo.closed:
            self._insts[prepared.digest] = prepared

    def track(self, unit: Run | RunList) -> None:
        """Remember a run or run list so that ``close`` releases its packet buffers first."""
        self._runs.add(unit)

    # -- a context the driver destroyed (docs/runtime.md 4.4) -------------------------------------

    def check_alive(self, what: str, fields: dict[str, Any]) -> None:
        """Before a submission: when this process has started a child since the last look, ask the driver
        whether the context is still there (it lists the contexts of the files on its client list).

        Raises:
            ContextLostError: the driver no longer has the context.
        """
        started = children_started()
        if started == self._children_seen:
            return
        self._children_seen = started
        if not self._listed():
            raise self._lost(what, fields, "a child process was started since it was created (the child's close "
                                           "of its copy of the device file destroyed it)")

    def lost_error(self, what: str, fields: dict[str, Any], exc: XdnaError) -> ContextLostError | None:
        """The ContextLostError for an EINVAL a submission got, if the driver no longer has the context."""
        if exc.errno != errno.EINVAL or self._listed():
            return None
        return self._lost(what, fields, "a child process or a closed duplicate of the device file destroyed it")

    def _listed(self) -> bool:
        """Whether the driver's context table has this context of this process (True when it cannot tell)."""
        try:
            entries = self.device.hw_contexts()
        except XdnaError:
            return True
        pid = os.getpid()
        return any(e.context_id == self.handle and e.pid == pid for e in entries)

    def _lost(self, what: str, fields: dict[str, Any], cause: str) -> ContextLostError:
        message = (f"{format_call(what, fields)}: {errno_text(errno.EINVAL)}; hardware context {self.handle} was "
                   f"destroyed by the driver: {cause}; {_LOST_HINT}")
        self._held.lost = True          # its DESTROY_HWCTX at close answers EINVAL: expected now
        return ContextLostError(errno.EINVAL, message, hwctx=self.handle, cause=cause)

    def recreate(self) -> None:
        """Make the context again in place: the same xclbin and CUs (new PDI buffers, CONFIG_CU), a new handle
        and syncobj. Kernels, runs, run lists and instruction buffers are kept (they belong to the device file,
        which lives on) and submit to the new context. For a context the driver destroyed (ContextLostError);
        on a live one it destroys it first.

        Raises:
            XdnaError: the context is closed (EBADF), or re-creating it failed (it is then closed).
            RuntimeError: a run of the context is still in flight.
        """
        with self._lock:
            self.check_open("recreate")
            busy = [unit for unit in list(self._runs) if getattr(unit, "_in_flight", False)]
            if busy:
                raise RuntimeError(f"recreate: {len(busy)} run(s) of hwctx {self.handle} still in flight: wait() first")
            # The old handle answers EINVAL once the driver destroyed it; its syncobj and PDIs are still ours.
            self._held.lost = True
            self._finalizer.detach()
            if self._release is not None:
                self._release()
            self.cus = []
            self.handle = self.syncobj = 0
            try:
                release = self._bring_up()
            except BaseException:
                self._closed = True
                raise
            self.generation += 1
            self._children_seen = children_started()
            self._finalizer = weakref.finalize(self, release_quietly, release, "hardware context")
        log.info("hardware context re-created: handle %d, syncobj %d", self.handle, self.syncobj)

    # -- teardown ------------------------------------------------------------------------------

    def __enter__(self) -> HwContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release runs and instruction buffers, then SYNCOBJ_DESTROY, DESTROY_HWCTX, PDI buffers.

        Idempotent. Raises:
            XdnaError: a release ioctl failed (the rest still ran).
        """
        if self._closed:
            return
        self._closed = True
        steps: list[Callable[[], Any]] = [run.close for run in list(self._runs)]
        steps += [prepared.bo.close for prepared in self._uploads]
        if self._release is not None:       # None only while __init__ runs
            steps.append(self._release)
        try:
            release_steps(*steps)    # every step runs, a Ctrl-C in one included
        finally:
            self._finalizer.detach()


def instruction_bytes(stream: Any) -> tuple[bytes, insts_mod.Stream | None]:
    """The bytes to upload for an instruction stream, and its decoded form when the input was one.

    Bytes and files go as given (a ``.txt`` stream becomes its little-endian words), u32 words as their
    little-endian bytes, an ``insts.Stream`` as its encoding (docs/runtime.md 1).

    Raises:
        InstsError: words that are not u32 values, a text line that is not a hex word, or a Stream that
            does not encode.
        TypeError: unsupported input type.
        OSError: the file cannot be read.
    """
    if isinstance(stream, insts_mod.Stream):
        return insts_mod.encode(stream), stream
    if isinstance(stream, (bytes, bytearray, memoryview, str, os.PathLike)):
        return insts_mod.stream_bytes(insts_mod.read_input(stream, "instructions")), None
    if isinstance(stream, (np.ndarray, Sequence)):
        words = np.asarray(stream)
        if words.ndim != 1 or not (words.size == 0 or np.issubdtype(words.dtype, np.integer)) \
                or (words.size and (int(words.min()) < 0 or int(words.max()) > 0xFFFFFFFF)):
            raise insts_mod.InstsError(f"instruction words must be a flat sequence of u32 values (0..0xFFFFFFFF), "
                                       f"got {words.dtype} of shape {words.shape}")
        return words.astype("<u4").tobytes(), None
    raise TypeError(f"instruction stream must be an insts.Stream, bytes, a path or u32 words, "
                    f"got {type(stream).__name__}")


def check_generation(stream: insts_mod.Stream, expected: int | None, generation: str | None) -> None:
    """Refuse a stream whose TXN header names another device generation than ``expected``, the one of
    the device (``Device.txn_dev_gen``; ``generation`` names it); nothing is checked when it is None.

    Raises:
        InstsError: the generations differ (names both).
    """
    if expected is not None and stream.dev_gen != expected:
        raise insts_mod.InstsError(f"word 0: TXN header device generation {stream.dev_gen}, but {generation} runs "
                                   f"generation {expected} streams (3 = NPU1, 4 = NPU4/5/6)")


_warned: set[str] = set()
_warned_lock = threading.Lock()
_WARN_LISTED = 6


def _warn_raw_ops(stream: insts_mod.Stream, digest: str) -> None:
    """One WARNING per stream (sha256) and process naming the ops uploaded without being decoded."""
    raw = insts_mod.raw_ops(stream)
    if not raw:
        return
    with _warned_lock:
        if digest in _warned:
            return
        _warned.add(digest)
    listed = ", ".join(f"{op.name} at word {start} ({op.size_bytes} bytes{'' if op.sized else ', length unknown'})"
                       for start, op in raw[:_WARN_LISTED])
    more = f" and {len(raw) - _WARN_LISTED} more" if len(raw) > _WARN_LISTED else ""
    unchecked = "; its op count could not be checked" if stream.unwalked_ops or not raw[-1][1].sized else ""
    log.warning("instruction stream %s (%d bytes) uploaded as given with %d op(s) the runtime does not decode: "
                "%s%s%s; the firmware decides what they do", digest[:16], stream.size_bytes, len(raw), listed, more,
                unchecked)


class Instructions:
    """An instruction stream uploaded to a DEV buffer of one context: the prepared stream of its runs.

    Attributes: ``bo`` (the DEV buffer; its xdna_addr goes into the packets), ``nwords`` (the regmap's
    ninstr, in words), ``digest`` (sha256 of the current bytes), ``extents`` (per buffer argument, how far
    the stream's DMA reaches: ``kernel.stream_extents``). Every run prepared from the same bytes in the
    context shares it, so ``set_words`` changes the stream of all of them.
    """

    def __init__(self, ctx: HwContext, data: bytes, digest: str, extents: dict[int, Any] | None = None) -> None:
        """Allocate the DEV buffer, copy the bytes in and flush them for the device.

        Raises:
            XdnaError: allocation or sync failed (nothing is left allocated).
        """
        self.ctx = ctx
        self.nwords = len(data) // 4
        self.digest = digest
        self.extents = extents if extents is not None else {}
        self.bo = ctx.device.bo(len(data), "dev")
        try:
            self.bo.write(data)
            self.bo.sync()
        except BaseException:
            self.bo.close()
            raise

    def __repr__(self) -> str:
        return f"<Instructions {self.digest[:16]} words={self.nwords} bo={self.bo.handle}>"

    def read(self) -> bytes:
        """The bytes in the instruction buffer now.

        Raises:
            XdnaError: the buffer (or its context) is closed.
        """
        return self.bo.read()

    def set_words(self, words: Sequence[tuple[int, int]]) -> None:
        """Rewrite instruction words: ``[(index, value), ...]``, ``index`` counted in u32 words from the
        start of the stream; flushed for the device, so the next run executes them (docs/runtime.md 3.1).

        The result must still be a well-formed stream (its header and op lengths as ``insts.decode``
        checks them); nothing is written otherwise. The header (words 0-3) is not rewritable.

        Raises:
            TypeError: ``words`` is not a sequence of (int, int) pairs.
            ValueError: an index outside words 4..nwords-1, or a value that is not a u32.
            InstsError: the rewritten stream would be malformed.
            ValueError: the rewritten stream's DMA would reach past a buffer of a run of it (nothing is written).
            RuntimeError: a run of this stream is in flight (wait for it first).
            XdnaError: the buffer (or its context) is closed, or SYNC_BO failed.
        """
        from .kernel import Run

        index, values = _word_pairs(words, self.nwords)
        ctx = self.ctx
        ctx.check_open("set_insts_words")
        with ctx._lock, contextlib.ExitStack() as held:
            # Holding the runs' locks keeps them from starting while the words change.
            runs = [run for run in list(ctx._runs) if isinstance(run, Run) and run.insts is self]
            for run in runs:
                held.enter_context(run._lock)
            held.enter_context(ctx._claims)
            busy = [run for run in runs if run._in_flight or run._claimed_by is not None]
            if busy:
                raise RuntimeError(f"set_insts_words: {len(busy)} run(s) of this instruction stream are in flight: "
                                   f"wait() first")
            if not index.size:
                return
            view = self.bo.array(np.dtype("<u4"))
            new = view.copy()
            new[index] = values
            extents = _extents(insts_mod.decode(new.tobytes()))
            for run in runs:        # a rewritten BD length must still fit every run's buffers (docs/runtime.md 1.4)
                _check_extents(run.kernel, extents, run.npu_buffers)
            view[index] = values
            lo, hi = int(index.min()), int(index.max()) + 1
            self.bo.sync(4 * lo, 4 * (hi - lo))
            old, self.digest = self.digest, hashlib.sha256(new.tobytes()).hexdigest()
            self.extents = extents
            ctx._rekey(self, old)


def _extents(stream: insts_mod.Stream) -> dict[int, Any]:
    from .kernel import stream_extents

    return stream_extents(stream)


def _check_extents(kernel: Any, extents: dict[int, Any], buffers: Sequence[Any]) -> None:
    from .kernel import _check_extents as check

    check(kernel, extents, buffers)


def _word_pairs(words: Any, nwords: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, values) of ``[(index, value), ...]``, checked (see ``Instructions.set_words``)."""
    if isinstance(words, (str, bytes, bytearray)) or not isinstance(words, Sequence):
        raise TypeError(f"set_insts_words: words must be a sequence of (index, value) pairs, "
                        f"got {type(words).__name__}")
    index, values = [], []
    for n, pair in enumerate(words):
        if not isinstance(pair, Sequence) or isinstance(pair, (str, bytes)) or len(pair) != 2 \
                or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in pair):
            raise TypeError(f"set_insts_words: entry {n} must be an (index, value) pair of ints, got {pair!r}")
        i, v = int(pair[0]), int(pair[1])
        if not insts_mod.HEADER_WORDS <= i < nwords:
            raise ValueError(f"set_insts_words: entry {n}: index {i} is outside words {insts_mod.HEADER_WORDS}.."
                             f"{nwords - 1} of the {nwords}-word stream (words 0-3 are the TXN header)")
        if not 0 <= v <= 0xFFFFFFFF:
            raise ValueError(f"set_insts_words: entry {n}: value {v} at index {i} is not a u32")
        index.append(i)
        values.append(v)
    return np.asarray(index, np.int64), np.asarray(values, np.uint32)


def _destroy_syncobj(file: DeviceFile, syncobj: int) -> None:
    if syncobj:
        req = abi.ffi.new("struct drm_syncobj_destroy *")
        req.handle = syncobj
        file.ioctl(abi.DRM_IOCTL_SYNCOBJ_DESTROY, req, {"handle": syncobj})


def _destroy_hwctx(file: DeviceFile, handle: int) -> None:
    req = abi.ffi.new("struct amdxdna_drm_destroy_hwctx *")
    req.handle = handle
    file.ioctl(abi.DRM_IOCTL_AMDXDNA_DESTROY_HWCTX, req, {"handle": handle})


@dataclass
class _Held:
    """What a context's release frees; ``lost`` once the driver destroyed the context itself."""

    handle: int
    syncobj: int
    pdis: list[Bo]
    lost: bool = False


def _release_held(file: DeviceFile, held: _Held) -> None:
    destroy = _destroy_lost_hwctx if held.lost else _destroy_hwctx
    release_steps(lambda: _destroy_syncobj(file, held.syncobj), lambda: destroy(file, held.handle),
                  *(pdi.close for pdi in held.pdis))


def _destroy_lost_hwctx(file: DeviceFile, handle: int) -> None:
    """DESTROY_HWCTX of a context the driver may have destroyed already (EINVAL then)."""
    try:
        _destroy_hwctx(file, handle)
    except XdnaError as exc:
        if exc.errno != errno.EINVAL:
            raise


def release_context(file: DeviceFile, handle: int, syncobj: int, pdis: Sequence[Bo] = ()) -> None:
    """SYNCOBJ_DESTROY, DESTROY_HWCTX, then close the PDI buffers; every step runs.

    Raises:
        XdnaError: the first step that failed (the rest still ran).
    """
    # XRT order (docs/xrt-sequence.md 1.10): the syncobj belongs to userspace and goes first; DESTROY_HWCTX waits
    # for the context to idle; the PDIs the firmware context used are freed last.
    release_steps(lambda: _destroy_syncobj(file, syncobj), lambda: _destroy_hwctx(file, handle),
                  *(pdi.close for pdi in pdis))
