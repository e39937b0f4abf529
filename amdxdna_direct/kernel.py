"""Kernels, runs and run lists: ERT packets in reused CMD buffers, EXEC_CMD, syncobj waits.

A ``Run`` owns one 4 KiB CMD buffer whose ERT_START_CU packet is built once (regmap laid out from
the xclbin's EMBEDDED_METADATA args, docs/xrt-sequence.md 1.7); ``start`` only rewrites the
state nibble and issues EXEC_CMD, ``wait`` issues one SYNCOBJ_TIMELINE_WAIT (docs/xrt-sequence.md 1.9). A
``RunList`` submits prepared runs as ERT_CMD_CHAIN packets (docs/xrt-sequence.md 1.7, docs/uapi.md 6.5).
"""

from __future__ import annotations

import errno
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import abi, cmd, trace
from . import insts as insts_mod
from .bo import Bo, unhold
from .device import gem_close, release_steps
from .errors import CommandError, CommandTimeout, DeviceLostError, XdnaError, errno_text, ioctl_error

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from .device import CpuMapping
    from .hwctx import ComputeUnit, HwContext, Instructions

__all__ = ["Kernel", "Run", "RunList", "BufferExtent", "CMD_BO_SIZE", "DEFAULT_TIMEOUT", "FOREVER", "MAX_REGMAP_BYTES",
           "NPU_OPCODE_TXN", "check_regmap", "stream_extents"]

CMD_BO_SIZE = 4096  # XRT's exec BO size (docs/xrt-sequence.md 1.4 CREATE_BO)
#: The largest regmap an ERT_START_CU packet carries in one command buffer: the buffer less the header and the
#: CU mask word (docs/runtime.md 1.4); the 11-bit count allows more, the buffer does not.
MAX_REGMAP_BYTES = CMD_BO_SIZE - 8
NPU_OPCODE_TXN = 3  # regmap "opcode" of the mlir-aie convention: execute a TXN stream (docs/xrt-sequence.md 2.2)
#: Seconds a wait lasts unless told otherwise: the proven path's bound (docs/runtime.md 3.4).
DEFAULT_TIMEOUT = 10.0
#: The timeout that waits without bound (``wait(timeout=FOREVER)``); only the driver's TDR ends such a wait.
FOREVER = math.inf
_INT64_MAX = (1 << 63) - 1
_U32_MAX = (1 << 32) - 1
_FAILED_STATES = {cmd.ERT_CMD_STATE_ERROR: errno.EIO, cmd.ERT_CMD_STATE_ABORT: errno.ECANCELED,
                  cmd.ERT_CMD_STATE_TIMEOUT: errno.ETIME, cmd.ERT_CMD_STATE_NORESPONSE: errno.EIO}
# States after which the driver has overwritten the payload with 0xFF (docs/uapi.md 6.6).
_CLOBBERED = {cmd.ERT_CMD_STATE_ERROR, cmd.ERT_CMD_STATE_ABORT, cmd.ERT_CMD_STATE_TIMEOUT}


def _check_timeout(timeout: float | None) -> float | None:
    """The timeout in seconds, or None for "no bound": ``FOREVER`` (infinity) waits without bound, None
    means ``DEFAULT_TIMEOUT`` (docs/runtime.md 3.4).

    Raises:
        ValueError: not a number >= 0 (NaN, negative, a string ...).
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    kind = type(timeout)
    if (kind is float or kind is int) and timeout >= 0:     # the common case, without the checks below
        return None if timeout == math.inf else float(timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, FOREVER (math.inf) or None (the default, "
                         f"{DEFAULT_TIMEOUT} s), got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def _monotonic_deadline_ns(timeout: float | None) -> int:
    # SYNCOBJ waits take an absolute CLOCK_MONOTONIC deadline; INT64_MAX waits forever (docs/xrt-sequence.md 1.9).
    # ``timeout`` is what _check_timeout returned: None (or infinity) is no bound here.
    if timeout is None or timeout >= _INT64_MAX / 1e9:
        return _INT64_MAX
    return min(_INT64_MAX, time.clock_gettime_ns(time.CLOCK_MONOTONIC) + int(timeout * 1e9))


# An ERT_START_CU packet's regmap follows its header and one CU mask word (docs/xrt-sequence.md 1.7).
_REGMAP_AT = 8


def _wait_cmd_ms(timeout: float | None) -> int:
    # WAIT_CMD counts milliseconds in a u32 and 0 means forever (docs/uapi.md 2.3, 4.11).
    # ``timeout`` is what _check_timeout returned: None (or infinity) is no bound here.
    if timeout is None or math.isinf(timeout):
        return 0
    return min(_U32_MAX, max(1, math.ceil(timeout * 1000)))


def _dedup(handles: Iterable[int]) -> list[int]:
    # EXEC_CMD arg handles must be unique (ROCr: the driver errors on duplicates; XRT keeps a set).
    return list(dict.fromkeys(handles))


class Kernel:
    """One compute unit of a context, with the argument layout of its xclbin kernel.

    Attributes: ``name``, ``args`` (xclbin ``KernelArg`` by index), ``regmap_size``, ``cu_index``.
    """

    def __init__(self, ctx: HwContext, cu: ComputeUnit) -> None:
        self.ctx = ctx
        self.cu_index = cu.index
        self.name = cu.kernel.name
        # sorted by id, duplicates merged, as XRT does (xclbin parse, docs/xrt-sequence.md 3.7)
        self.args = cu.kernel.args
        self.regmap_size = cu.kernel.regmap_size

    def __repr__(self) -> str:
        return f"<Kernel {self.name} cu={self.cu_index} args={[a.name for a in self.args]}>"

    def prepare(self, *args: Any) -> Run:
        """A run with ``args`` in xclbin argument order (ints for scalars, ``Bo`` or None for buffers).

        Missing trailing arguments are left zero, as XRT leaves unset regmap slots.

        Raises:
            TypeError, ValueError: an argument does not match its declaration.
            XdnaError: the packet buffer could not be allocated, or the context is closed.
        """
        self.ctx.check_open("prepare")
        if len(args) > len(self.args):
            raise ValueError(f"{self.name} takes {len(self.args)} arguments "
                             f"({', '.join(a.name for a in self.args)}), got {len(args)}")
        fields, bos, slots = [], [], []
        for decl, value in zip(self.args, args, strict=False):
            field, bo = _arg_field(self.name, self.ctx.device, decl, value)
            fields.append(field)
            if bo is not None:
                bos.append(bo)
                slots.append(decl.index)
        regmap = cmd.encode_regmap(self.regmap_size, fields)
        return Run(self, regmap, bos, slots)

    def prepare_npu(self, insts: Any, buffers: Sequence[Bo | None]) -> Run:
        """A run in the mlir-aie convention: ``(3, instruction buffer, word count, *buffers)`` (docs/xrt-sequence.md
        2.2).

        ``insts``: bytes, a path, u32 words or an ``insts.Stream``; its bytes are uploaded as given to a
        DEV buffer once per context (cached by digest; ``HwContext.instructions``, docs/runtime.md 1).
        ``buffers`` fill bo0, bo1, ... in order. ``run.insts`` is the uploaded stream.

        A buffer smaller than what the stream's DMA reads or writes through it is refused (its extent, from
        the stream's buffer descriptors: ``stream_extents``, docs/runtime.md 1.4).

        Raises:
            InstsError: the stream's header is malformed or names another device generation.
            TypeError: ``buffers`` is not a sequence.
            ValueError: more buffers than the kernel declares, or a buffer smaller than the stream's DMA reaches
                (names the argument, both sizes and the DDR_PATCH op).
            XdnaError: upload or allocation failed.
        """
        if isinstance(buffers, (Bo, str, bytes)) or not isinstance(buffers, Sequence):
            raise TypeError(f"{self.name}: prepare_npu buffers must be a sequence of Bo or None, "
                            f"got {type(buffers).__name__}")
        prepared = self.ctx.instructions(insts)
        _check_extents(self, prepared.extents, buffers)
        run = self.prepare(NPU_OPCODE_TXN, prepared.bo, prepared.nwords, *buffers)
        run.insts = prepared
        run.npu_buffers = tuple(buffers)
        return run


def check_regmap(kernel: Any) -> None:
    """Refuse an xclbin kernel whose arguments do not fit one command packet, before anything is allocated
    (the regmap is laid out from the metadata's offsets and sizes, docs/runtime.md 1.4).

    Raises:
        XclbinError: an argument ends past ``MAX_REGMAP_BYTES``; names the kernel, the argument, its offset
            and size, and the limit.
    """
    size = kernel.regmap_size
    if size <= MAX_REGMAP_BYTES:
        return
    from .xclbin import XclbinError

    worst = max(kernel.args, key=lambda a: a.offset + a.size)
    raise XclbinError(f"kernel {kernel.name}: argument {worst.index} ({worst.name}) at offset {worst.offset:#x} of "
                      f"{worst.size} bytes ends at byte {worst.offset + worst.size}, but a regmap must fit the "
                      f"{CMD_BO_SIZE}-byte command packet ({MAX_REGMAP_BYTES} bytes after its header and CU mask)")


# One implementation of a stream's buffer reach serves the runtime, the doctor and sam3 (docs/runtime.md 1.4).
BufferExtent = insts_mod.BufferReach
stream_extents = insts_mod.buffer_reaches


def _check_extents(kernel: Kernel, extents: dict[int, BufferExtent], buffers: Sequence[Bo | None]) -> None:
    """Refuse a buffer smaller than what the stream's DMA moves through it (docs/runtime.md 1.4).

    Raises:
        ValueError: names the argument, both sizes and the stream op.
    """
    for k, bo in enumerate(buffers):
        extent = extents.get(k)
        if bo is None or extent is None or bo.size >= extent.nbytes:
            continue
        slot = 3 + k        # opcode, instr, ninstr, then bo0.. (docs/design.md 2)
        decl = kernel.args[slot] if slot < len(kernel.args) else None
        named = f"argument {decl.index} ({decl.name})" if decl is not None else f"buffer slot {k}"
        raise ValueError(f"{kernel.name}: bo{k} ({named}) is a {bo.size}-byte buffer, but the instruction stream's "
                         f"DDR_PATCH (op {extent.op_index}, word {extent.word}) points shim BD {extent.bd} of column "
                         f"{extent.column} at it for {extent.length} bytes at offset {extent.arg_plus}: its DMA "
                         f"reaches {extent.nbytes} bytes (a larger buffer, or a stream for this size)")


def _arg_field(kernel: str, device: Any, decl: Any, value: Any) -> tuple[tuple[int, int, int], Bo | None]:
    if decl.kind == "global":
        if value is None:
            return (decl.offset, decl.size, 0), None
        if not isinstance(value, Bo):
            raise TypeError(f"{kernel} argument {decl.index} ({decl.name}) is a buffer: pass a Bo or None, "
                            f"got {type(value).__name__}")
        if value.closed:
            raise ValueError(f"{kernel} argument {decl.index} ({decl.name}): buffer is closed")
        if value.device is not device:
            raise ValueError(f"{kernel} argument {decl.index} ({decl.name}): buffer belongs to {value.device.name}, "
                             f"not to this context's device (GEM handles are per open file)")
        return (decl.offset, decl.size, value.address), value
    if decl.kind == "scalar":
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{kernel} argument {decl.index} ({decl.name}) is a scalar: pass an int, "
                            f"got {type(value).__name__}")
        bits = 8 * decl.size
        value = int(value)
        if not -(1 << (bits - 1)) <= value < (1 << bits):
            raise ValueError(f"{kernel} argument {decl.index} ({decl.name}) = {value} does not fit {decl.size} bytes")
        return (decl.offset, decl.size, value & ((1 << bits) - 1)), None
    raise ValueError(f"{kernel} argument {decl.index} ({decl.name}) has kind {decl.kind!r}; only scalar and "
                     f"global arguments can be set")


class _Pin:
    """Keeps command packets mapped for the life of the run or run list that reads and writes them.

    One ``Bo.hold`` per packet when the unit is prepared, instead of one per ``start`` and ``wait``
    (docs/runtime.md 5): a close of the packet (its own, its context's or its device's) meanwhile defers
    the munmap until ``release``. ``release`` takes the unit's lock, so it waits for a ``start`` or the
    state check of a ``wait`` in progress; ``closed`` is then the one flag those read. Holds no
    reference to its unit, so that the unit can be collected (its finalizer releases the pin).
    """

    __slots__ = ("lock", "mappings", "closed")

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.mappings: tuple[CpuMapping, ...] = ()
        self.closed = False

    def hold(self, bos: Iterable[Bo], what: str) -> None:
        """Hold every buffer of ``bos`` (released together by ``release``).

        Raises:
            XdnaError: a buffer is closed (what was held so far is released).
        """
        held: list[CpuMapping] = []
        try:
            for bo in bos:
                held.extend(bo.hold(what))
        finally:
            self.mappings = tuple(held)

    def release(self) -> None:
        """Drop the holds (idempotent); the last holder of a closed packet runs its munmap."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            mappings, self.mappings = self.mappings, ()
        unhold(mappings)


def _pinned(owner: object, pin: _Pin, file: Any) -> Any:
    """Release ``pin`` when ``owner`` is closed, collected, or its device file closes (the release the file
    runs, newest first, before the packets' own); returns the idempotent release action."""
    release = file.register(pin.release)
    weakref.finalize(owner, release)
    return release


def _keep_on_device(file: Any, bos: Iterable[Bo], what: str) -> Any:
    """Keep the buffers of a command still on the device (its wait expired before the driver finished or aborted
    it, docs/runtime.md 3.4): one more holder of each GEM handle and of each mapping, so that a close of a buffer
    meanwhile unmaps and GEM_CLOSEs it only when the returned release runs (idempotent; the device file runs it
    too, when it closes)."""
    handles: list[int] = []
    mappings: list[CpuMapping] = []
    for bo in dict.fromkeys(bo.parent or bo for bo in bos):
        if bo.closed:
            continue
        mappings.extend(bo.hold(what))
        file.ref_handle(bo.handle)
        handles.append(bo.handle)
    return file.register(_let_go, file, tuple(handles), tuple(mappings))


def _let_go(file: Any, handles: tuple[int, ...], mappings: tuple[CpuMapping, ...]) -> None:
    # The deferred munmaps first, then GEM_CLOSE of the handles whose Bo was closed meanwhile (docs/runtime.md 3.4).
    release_steps(lambda: unhold(mappings),
                  *(lambda h=h: gem_close(file, h) if file.unref_handle(h) else None for h in handles))


class Run:
    """One prepared kernel invocation with its own reusable command buffer.

    ``start()`` submits it (again and again), ``wait(timeout)`` waits and checks the state.
    ``state`` is the packet's ERT state, ``seq`` the last submission number, ``elapsed`` the
    seconds from the last ``start`` to the completion seen by ``wait``.
    """

    def __init__(self, kernel: Kernel, regmap: bytes | bytearray, bos: Sequence[Bo],
                 slots: Sequence[int] | None = None) -> None:
        ctx = kernel.ctx
        self.kernel = kernel
        self.ctx = ctx
        self.buffers = tuple(bos)  # keeps the argument buffers alive while the run exists
        # argument index -> the buffer in it, for set_arg (None: the buffers' slots are unknown)
        self._slots: dict[int, Bo] | None = None if slots is None else dict(zip(slots, bos, strict=True))
        self._version = 0                           # bumped by every set_arg: a RunList refreshes its handles
        self._regmap = bytearray(regmap)
        self._lock = threading.Lock()
        self._pin = _Pin(self._lock)
        self._unpin: Any = None
        self.packet = ctx.device.bo(CMD_BO_SIZE, "cmd")
        self.chain: Bo | None = None        # the one-command chain it is submitted as, when it must be one
        try:
            self._view = self.packet.owner_view()
            self._head = self._view.cast("I")       # the header word, for the state nibble
            self._state_view = self._view           # the packet the driver writes the outcome into
            self.words = cmd.payload_words(len(self._regmap))
            self._encode()
            # A sub-buffer carries its parent's handle, so the parent is listed once (docs/xrt-sequence.md 1.5).
            self.handles = _dedup(bo.handle for bo in bos)
            self._bos = tuple(dict.fromkeys(bos))   # checked for closed-ness at every start
            self._exec = self._submission(ctx)
            self._wait = _Waiter(ctx)
            self._pin.hold((self.packet,) if self.chain is None else (self.packet, self.chain), "prepare")
            self._unpin = _pinned(self, self._pin, ctx.device.file)
        except BaseException:
            release_steps(self._pin.release, self.packet.close, *(() if self.chain is None else (self.chain.close,)))
            raise
        self.seq: int | None = None
        self.elapsed: float | None = None
        self.insts: Instructions | None = None     # set by prepare_npu
        self.npu_buffers: tuple[Bo | None, ...] = ()  # the buffers given to prepare_npu, bo0 first
        self._t0 = 0.0
        self._clobbered = False
        self._in_flight = False
        self._unsubmitted = False
        self._claimed_by: RunList | None = None     # the RunList whose submission holds this packet
        self._stuck: Any = None     # after a wait expired: the release of the buffers kept for the device
        ctx.track(self)

    def _submission(self, ctx: HwContext) -> _Exec:
        """The EXEC_CMD of this run: its packet, or a one-command chain of it where the driver would refuse the
        packet alone (more payload words than a single firmware message holds before feature level 0.6,
        docs/runtime.md 1.4); the trace says which."""
        version = ctx.device.version
        limit = cmd.lone_command_limit(cmd.ERT_START_CU, version.major, version.minor)
        if limit is None or self.words <= limit:
            return _Exec(ctx, self.packet.handle, self.handles)
        self.chain = ctx.device.bo(CMD_BO_SIZE, "cmd")
        chain_view = self.chain.owner_view()
        cmd.encode_chain(chain_view, [self.packet.handle])
        self._state_view, self._head = chain_view, chain_view.cast("I")
        file = ctx.device.file
        trace.note(file.name, f"{self.kernel.name} run (cmd_handles={self.packet.handle}): {self.words} payload words "
                              f"exceed the {limit} a lone ERT_START_CU carries under driver {version.major}."
                              f"{version.minor}; submitted as a one-command ERT_CMD_CHAIN (cmd_handles="
                              f"{self.chain.handle})")
        # A chain lists its sub-command packet among the arguments (docs/uapi.md 6.5).
        return _Exec(ctx, self.chain.handle, _dedup([*self.handles, self.packet.handle]))

    def _encode(self) -> None:
        cmd.encode_start_cu(self._view, self.kernel.cu_index, self._regmap)
        if self.chain is not None:      # rebuilt with it: the driver writes error_index into the chain
            cmd.encode_chain(self._state_view, [self.packet.handle])

    def __repr__(self) -> str:
        state = "closed" if self.closed else cmd.state_name(cmd.read_state(self._state_view))
        return f"<Run {self.kernel.name} seq={self.seq} state={state}>"

    @property
    def closed(self) -> bool:
        """True once the run, its context or its device was closed."""
        return self._pin.closed or self.packet.closed

    def check_open(self, what: str) -> None:
        """Raise if the packet buffer was released (its mapping is gone: touching it would fault).

        Raises:
            XdnaError: EBADF naming ``what`` and the packet's handle.
        """
        if self._pin.closed or self.packet.closed:
            raise ioctl_error(what, {"cmd_handles": self.packet.handle}, errno.EBADF, "run is closed")

    def check_buffers(self, what: str) -> None:
        """Raise if an argument buffer was closed (the driver would answer ENOENT for its stale handle).

        Raises:
            XdnaError: EBADF naming ``what``, the command and the closed buffer's handle.
        """
        for bo in self.buffers:
            if bo.closed:
                raise ioctl_error(what, {"cmd_handles": self.packet.handle, "arg_handle": bo.handle}, errno.EBADF,
                                  f"an argument buffer of this {self.kernel.name} run is closed")

    def _refuse_closed(self, what: str) -> None:
        """The checks behind the cheap flags of ``start``: raise for what is closed.

        Raises:
            XdnaError: EBADF for a closed context, run or argument buffer.
        """
        self.ctx.check_open(what)
        self.check_open(what)
        self.check_buffers(what)

    def _stale(self) -> bool:
        # One flag per object, read once (docs/runtime.md 5): the pin is released by every close of the
        # run, its context and its device; a buffer closed on its own (or with its parent) sets _closed.
        if self._pin.closed or self.ctx._closed:
            return True
        for bo in self._bos:
            if bo._closed:
                return True
        return False

    @property
    def in_flight(self) -> bool:
        """True from a ``start`` (alone or in a ``RunList``) until the ``wait`` that collects it."""
        return self._in_flight or self._claimed_by is not None

    @property
    def state(self) -> int:
        """The packet's current ERT state (``cmd.ERT_CMD_STATE_*``).

        Raises:
            XdnaError: the run is closed.
        """
        with self._lock:
            self.check_open("state")
            return self._head[0] & 0xF

    @property
    def state_name(self) -> str:
        """The current state's ERT name."""
        return cmd.state_name(self.state)

    def restore(self) -> None:
        """Rebuild the packet if the driver clobbered it (0xFF payload after a failure), else reset to NEW."""
        if self._clobbered:
            self._encode()
            self._clobbered = False
        else:
            head = self._head
            head[0] = (head[0] & ~0xF) | cmd.ERT_CMD_STATE_NEW

    def start(self) -> Run:
        """Submit with EXEC_CMD (no allocation: the packet and the ioctl structs are reused).

        Raises:
            XdnaError: EXEC_CMD failed (names hwctx, the command handle and arg count), or the run, its
                context or an argument buffer is closed.
            RuntimeError: the previous submission (alone or in a ``RunList``) was not waited for.
        """
        with self._lock:
            if self._stale():
                self._refuse_closed("EXEC_CMD")
            with self.ctx._claims:
                if self._in_flight and self._stuck is not None:
                    raise RuntimeError(f"Run of {self.kernel.name} (seq={self.seq}) timed out in wait() and is still "
                                       f"on the device (the driver resets a hung command only at its TDR): wait() "
                                       f"again until it ends")
                if self._in_flight:
                    raise RuntimeError(f"Run of {self.kernel.name} (seq={self.seq}) is still in flight: wait() first")
                if self._claimed_by is not None:
                    raise RuntimeError(f"Run of {self.kernel.name} is in flight in a RunList: wait() for the list "
                                       f"first")
                self._in_flight = True      # claimed: no RunList takes this packet from here on
            self.restore()
            self._unsubmitted = True        # until EXEC_CMD takes it: the packet now says NEW, not the last outcome
            try:
                self.seq = self._exec.submit()
            except BaseException:
                seq = self._exec.landed()
                if seq is None:
                    self._in_flight = False
                else:                       # interrupted after the driver took it: wait() collects it
                    self.seq, self._unsubmitted, self._t0 = seq, False, time.perf_counter()
                raise
            self._unsubmitted = False
            self._t0 = time.perf_counter()
            self.elapsed = None
        return self

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT) -> int:
        """Wait for the last submission and check its state; returns ``ERT_CMD_STATE_COMPLETED``.

        ``timeout``: seconds, ``DEFAULT_TIMEOUT`` (10 s) unless given; ``FOREVER`` (``math.inf``) waits
        without bound; None means the default (docs/runtime.md 3.4).

        One SYNCOBJ_TIMELINE_WAIT (WAIT_FOR_SUBMIT, absolute CLOCK_MONOTONIC deadline) on the
        context syncobj at point ``seq``; WAIT_CMD only if the context has no syncobj (docs/xrt-sequence.md 1.9).
        Unlike XRT, the header is not polled before the wait: the state is read only once the fence
        signalled (docs/uapi.md 6.6), which also catches a malformed command whose state the
        driver leaves NEW. A second ``wait`` after completion re-checks the state without an ioctl.

        Raises:
            CommandTimeout: the wait expired (``state`` is the live one) or the driver's TDR marked the
                command TIMEOUT (with the health record when the driver left one).
            CommandError: any other final state (ERROR, ABORT, or NEW for a malformed command), with the
                firmware's reason when known (docs/runtime.md 4.2).
            DeviceLostError: the device was lost while the command ran (docs/runtime.md 4.3).
            RuntimeError: the run was never started, or its last ``start`` failed.
            XdnaError: the wait ioctl failed, or the run is closed.
        """
        with self._lock:
            if self._pin.closed or self.packet._closed:
                self.check_open("wait")
            seq = self.seq
            if seq is None:
                raise RuntimeError(f"Run of {self.kernel.name} was never started")
            if self._unsubmitted:
                raise RuntimeError(f"Run of {self.kernel.name} is not submitted: its last start() failed")
            flying = self._in_flight
        if flying:      # outside the lock: a close from another thread does not wait for the device
            try:
                self._wait.wait(seq, timeout, self.kernel.name)
            except CommandTimeout:
                self._keep(seq)
                raise
        with self._lock:
            self._let_go()
            if self._pin.closed or self.packet._closed:
                self.check_open("wait")
            if self.seq != seq:
                raise RuntimeError(f"Run of {self.kernel.name} was restarted (seq={self.seq}) while this wait for "
                                   f"seq={seq} ran")
            if flying and self._in_flight:
                self._in_flight = False
                self.elapsed = time.perf_counter() - self._t0
            state = self._head[0] & 0xF
            if state == cmd.ERT_CMD_STATE_COMPLETED:
                return state
            self._clobbered = state in _CLOBBERED
            error = _command_error(self.kernel.name, state, seq, self.ctx, self._state_view, health_packet=self._view)
        raise _classified(error, self.ctx)

    def __call__(self, timeout: float | None = DEFAULT_TIMEOUT) -> int:
        """``start()`` then ``wait(timeout)``; a bad ``timeout`` is refused before submitting."""
        _check_timeout(timeout)
        return self.start().wait(timeout)

    def _keep(self, seq: int) -> None:
        """The wait for ``seq`` expired: the command is still on the device, so its packets and buffers stay
        allocated until a later wait sees it end (docs/runtime.md 3.4)."""
        with self._lock:
            if self._stuck is None and self.seq == seq and not self._pin.closed:
                bos = [self.packet, *(() if self.chain is None else (self.chain,)), *self._bos]
                self._stuck = _keep_on_device(self.ctx.device.file, bos, "wait")

    def _let_go(self) -> None:
        # under self._lock: the command ended (a wait saw it), so what was kept for it goes
        stuck, self._stuck = self._stuck, None
        if stuck is not None:
            stuck()

    def _ended(self) -> bool:
        """Whether the driver is done with the last submission (a wait that does not block)."""
        seq = self.seq
        if seq is None or self.ctx.closed:
            return False
        try:
            self._wait.wait(seq, 0, self.kernel.name)
        except XdnaError:
            return False
        return True

    def set_insts_words(self, words: Sequence[tuple[int, int]]) -> None:
        """Rewrite words of this run's instruction stream (``[(index, value), ...]``, u32 word indices) in
        its instruction buffer and flush them; the next start of every run of that stream executes them
        (``Instructions.set_words``, docs/runtime.md 3.1).

        Raises:
            RuntimeError: the run was not prepared by ``prepare_npu``, or a run of the stream is in flight.
            TypeError, ValueError: malformed pairs, an index outside the stream's words 4.., a value not a u32,
                or a rewritten buffer descriptor that a run's buffer is too small for.
            InstsError: the rewritten stream would be malformed (nothing is written).
            XdnaError: the run or its context is closed, or SYNC_BO failed.
        """
        self.check_open("set_insts_words")
        if self.insts is None:
            raise RuntimeError(f"Run of {self.kernel.name} was not prepared by prepare_npu: it has no instruction "
                               f"stream to rewrite")
        self.insts.set_words(words)

    def set_arg(self, index: int, value: Any) -> None:
        """Rewrite argument ``index`` (xclbin order: an int for a scalar, a ``Bo`` or None for a buffer) in
        this run's packet in place, as XRT's ``run.set_arg``: only the argument's regmap bytes change, and the
        buffer list EXEC_CMD passes follows (docs/runtime.md 3.5). A ``RunList`` holding the run picks the
        change up at its next ``start``. A run prepared by ``prepare_npu`` refuses a buffer smaller than what its
        stream's DMA reaches through that slot.

        Raises:
            RuntimeError: the run is in flight (alone or in a ``RunList``, a timed-out one included: the
                driver may still read the packet), or was built without its buffers' argument indices.
            TypeError, ValueError: ``index`` is not an argument of the kernel, or ``value`` does not match its
                declaration (as ``Kernel.prepare``), or a buffer too small for the stream.
            XdnaError: the run is closed.
        """
        with self._lock:
            self.check_open("set_arg")
            if self.in_flight:
                raise RuntimeError(f"Run of {self.kernel.name} (seq={self.seq}) is in flight: its packet is not "
                                   f"rewritten until wait() collects it")
            slots = self._slots
            if slots is None:
                raise RuntimeError(f"Run of {self.kernel.name} was built without its buffers' argument indices")
            args = self.kernel.args
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(args):
                raise ValueError(f"{self.kernel.name}: set_arg index {index!r} is not one of its {len(args)} "
                                 f"arguments")
            decl = args[int(index)]
            (offset, size, word), bo = _arg_field(self.kernel.name, self.ctx.device, decl, value)
            if bo is not None and self.insts is not None and decl.index >= 3:
                shown: list[Bo | None] = [None] * (decl.index - 3) + [bo]
                _check_extents(self.kernel, self.insts.extents, shown)
            raw = word.to_bytes(size, "little")
            self._regmap[offset:offset + size] = raw
            self._view[_REGMAP_AT + offset:_REGMAP_AT + offset + size] = raw
            if slots.get(decl.index) is not bo:
                self._rebind(slots, decl.index, bo)

    def _rebind(self, slots: dict[int, Bo], index: int, bo: Bo | None) -> None:
        """Argument ``index`` now holds ``bo``: the buffers kept alive, checked and passed to EXEC_CMD follow."""
        if bo is None:
            slots.pop(index, None)
        else:
            slots[index] = bo
        self.buffers = tuple(slots[i] for i in sorted(slots))
        self._bos = tuple(dict.fromkeys(self.buffers))
        self.handles = _dedup(b.handle for b in self.buffers)
        # A one-command chain lists its packet among the buffers too (docs/uapi.md 6.5, _submission).
        self._exec.set_handles(self.handles if self.chain is None else _dedup([*self.handles, self.packet.handle]))
        slot = index - 3        # opcode, instr, ninstr, then bo0.. (docs/design.md 2)
        if self.insts is not None and slot >= 0:
            npu = list(self.npu_buffers)
            npu.extend([None] * (slot + 1 - len(npu)))
            npu[slot] = bo
            self.npu_buffers = tuple(npu)
        self._version += 1

    def close(self) -> None:
        """Release the packet buffer (idempotent); waits for a ``start`` in progress in another thread.

        After a wait that expired, the packet and the run's buffers are unmapped and closed in the driver only
        once the command ended (docs/runtime.md 3.4): now if it has, else by a later wait or the device's close.
        """
        stuck = self._stuck is not None and not self._ended()
        release_steps(self._unpin or self._pin.release, self.packet.close,
                      *(() if self.chain is None else (self.chain.close,)))
        if not stuck:
            with self._lock:
                self._let_go()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _classified(error: CommandError, ctx: HwContext) -> XdnaError:
    """``error``, or the ``DeviceLostError`` behind it: an ABORT is what a lost device leaves on every command it
    had, so the device is asked (docs/runtime.md 4.3)."""
    if error.state == "ABORT":
        try:
            ctx.device.file.confirm_lost(error)
        except DeviceLostError as lost:
            return DeviceLostError(errno.ENODEV, f"{error.message}; the device was lost: {lost}")
    return error


class _Waiter:
    """A preallocated SYNCOBJ_TIMELINE_WAIT (or WAIT_CMD) request, reused by every wait of its owner."""

    def __init__(self, ctx: HwContext) -> None:
        ffi = abi.ffi
        self.ctx = ctx
        self.generation = ctx.generation
        self.file = ctx.device.file
        self.lock = threading.Lock()     # one wait at a time uses the request
        if ctx.syncobj:
            self.handles = ffi.new("uint32_t[1]", [ctx.syncobj])
            self.points = ffi.new("uint64_t[1]")
            self.req = ffi.new("struct drm_syncobj_timeline_wait *")
            self.req.handles = abi.address_of(self.handles)
            self.req.points = abi.address_of(self.points)
            self.req.count_handles = 1
            self.req.flags = abi.DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT
            self.request, self.name = abi.DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT, "SYNCOBJ_TIMELINE_WAIT"
            self.fields: dict[str, Any] = {"handle": ctx.syncobj, "point": 0, "timeout": DEFAULT_TIMEOUT}
        else:
            self.req = ffi.new("struct amdxdna_drm_wait_cmd *")
            self.req.hwctx = ctx.handle
            self.request, self.name = abi.DRM_IOCTL_AMDXDNA_WAIT_CMD, "WAIT_CMD"
            self.fields = {"hwctx": ctx.handle, "seq": 0, "timeout_ms": 0}
        self.buf = ffi.buffer(self.req)

    def _refresh(self) -> None:
        ctx = self.ctx
        if ctx.syncobj:
            self.handles[0] = self.fields["handle"] = ctx.syncobj
        else:
            self.req.hwctx = self.fields["hwctx"] = ctx.handle
        self.generation = ctx.generation

    def wait(self, seq: int, timeout: float | None, what: str) -> None:
        """Block until submission ``seq`` of the context signalled (docs/xrt-sequence.md 1.9).

        Raises:
            CommandTimeout: the deadline passed first (ETIME); ``state`` is RUNNING.
            XdnaError: EBADF when the context was closed during the wait; the wait ioctl failed otherwise.
        """
        ctx, fields = self.ctx, self.fields
        shown = DEFAULT_TIMEOUT if timeout is None else timeout      # as the caller put it, in messages
        timeout = _check_timeout(timeout)
        with self.lock:
            if self.generation != ctx.generation:   # HwContext.recreate: a new handle and syncobj
                self._refresh()
            try:
                if ctx.syncobj:
                    self.points[0] = seq
                    self.req.timeout_nsec = _monotonic_deadline_ns(timeout)
                    fields["point"] = seq
                    fields["timeout"] = "forever" if timeout is None else shown
                else:
                    self.req.seq = seq
                    self.req.timeout = fields["timeout_ms"] = _wait_cmd_ms(timeout)
                    fields["seq"] = seq
                self.file.ioctl_named(self.request, self.name, self.buf, fields)
            except XdnaError as exc:
                # closed by another thread meanwhile: the syncobj went first (docs/xrt-sequence.md 1.10)
                if ctx.closed:
                    raise ioctl_error("wait", {"hwctx": ctx.handle, "seq": seq}, errno.EBADF,
                                      f"context closed while {what} waited ({exc})") from exc
                if exc.errno == errno.ETIME:
                    raise CommandTimeout(errno.ETIME, f"{what} (hwctx={ctx.handle}, seq={seq}): not finished after "
                                                      f"{shown} s: {exc}", kernel=what, state="RUNNING",
                                         seq=seq) from exc
                raise


_NO_SEQ = (1 << 64) - 1     # in EXEC_CMD's seq until the driver answers: tells "taken" from "not taken"


class _Exec:
    """A preallocated EXEC_CMD request for one command BO, reused by every submission (docs/xrt-sequence.md 1.8)."""

    def __init__(self, ctx: HwContext, cmd_handle: int, handles: Sequence[int]) -> None:
        ffi = abi.ffi
        self.ctx = ctx
        self.generation = ctx.generation
        self.file = ctx.device.file
        self.args = ffi.new("uint32_t[]", list(handles) or [0])
        self.req = ffi.new("struct amdxdna_drm_exec_cmd *")
        self.req.hwctx = ctx.handle
        self.req.type = abi.AMDXDNA_CMD_SUBMIT_EXEC_BUF
        self.req.cmd_handles = cmd_handle  # the handle itself, not a pointer, when cmd_count == 1
        self.req.args = abi.address_of(self.args) if handles else 0
        self.req.cmd_count = 1
        self.req.arg_count = len(handles)
        self.buf = ffi.buffer(self.req)
        self.fields = {"hwctx": ctx.handle, "cmd_handles": cmd_handle, "arg_count": len(handles)}

    def set_handles(self, handles: Sequence[int]) -> None:
        """The buffer handles the next EXEC_CMD passes (after an argument was rewritten)."""
        if len(handles) != len(self.args) or not handles:
            self.args = abi.ffi.new("uint32_t[]", list(handles) or [0])
            self.req.args = abi.address_of(self.args) if handles else 0
            self.req.arg_count = len(handles)
            self.fields["arg_count"] = len(handles)
        else:
            self.args[0:len(handles)] = list(handles)

    def submit(self) -> int:
        """EXEC_CMD; returns the submission's ``seq`` (its timeline point).

        Raises:
            XdnaError: the driver refused (the message names hwctx, cmd_handles and arg_count).
        """
        req, ctx = self.req, self.ctx
        if self.generation != ctx.generation:       # HwContext.recreate gave the context a new handle
            req.hwctx = self.fields["hwctx"] = ctx.handle
            self.generation = ctx.generation
        req.seq = _NO_SEQ
        ctx.check_alive("EXEC_CMD", self.fields)    # after a child process: is the context still there?
        try:
            self.file.ioctl_named(abi.DRM_IOCTL_AMDXDNA_EXEC_CMD, "EXEC_CMD", self.buf, self.fields)
        except XdnaError as exc:
            lost = ctx.lost_error("EXEC_CMD", self.fields, exc)     # EINVAL for a context the driver destroyed
            if lost is not None:
                raise lost from exc
            raise
        seq: int = req.seq
        return seq

    def landed(self) -> int | None:
        """After ``submit`` raised: the seq the driver answered when it took the command before the exception
        (a KeyboardInterrupt once the ioctl returned), else None."""
        seq = self.req.seq
        return None if seq == _NO_SEQ else seq


def _emulator_reason(ctx: HwContext, seq: int) -> str | None:
    """Why the emulated firmware failed submission ``seq`` of ``ctx`` (its own message, the kernel model's
    included), or None on real hardware or when the emulator kept nothing (docs/runtime.md 4). Asked of the
    fd's seam when it answers (context handles are per fd), else of the emulated device."""
    emulator = ctx.device.emulator
    if emulator is None:
        return None
    lookup: Callable[[int, int], str | None] | None = getattr(ctx.device.file.seam, "command_reason", None)
    if lookup is not None:
        return lookup(ctx.handle, seq)
    return emulator.command_reason(ctx.handle, seq)


def _command_error(kernel: str, state: int, seq: int, ctx: HwContext, packet: ReadableBuffer,
                   index: int | None = None, health_packet: ReadableBuffer | None = None) -> CommandError:
    name = cmd.state_name(state)
    err = _FAILED_STATES.get(state, errno.EINVAL)
    health = cmd.decode_health(health_packet if health_packet is not None else packet) \
        if state == cmd.ERT_CMD_STATE_TIMEOUT else None
    reason = _emulator_reason(ctx, seq)
    where = f", index={index}" if index is not None else ""
    detail = "the driver rejected the packet (state left NEW)" if state == cmd.ERT_CMD_STATE_NEW else errno_text(err)
    message = f"{kernel} (hwctx={ctx.handle}, seq={seq}{where}): command {name}: {detail}"
    if health is not None:
        message += (f"; health: txn_op_idx={health.txn_op_idx} ctx_pc={health.ctx_pc:#x} "
                    f"fatal_error_type={health.fatal_error_type:#x}")
    if reason:
        message += f"; emulated firmware: {reason}"
    cls = CommandTimeout if state == cmd.ERT_CMD_STATE_TIMEOUT else CommandError
    return cls(err, message, kernel=kernel, state=name, seq=seq, index=index, health=health, reason=reason)


class _Chain:
    """One ERT_CMD_CHAIN packet over a slice of the run list."""

    def __init__(self, ctx: HwContext, runs: Sequence[Run], first: int) -> None:
        self.runs = tuple(runs)
        self.first = first
        self.bo = ctx.device.bo(CMD_BO_SIZE, "cmd")
        try:
            self.view = self.bo.owner_view()
            self.head = self.view.cast("I")
            self.handles = [run.packet.handle for run in runs]
            cmd.encode_chain(self.view, self.handles)
            self.exec = _Exec(ctx, self.bo.handle, self.arg_handles())
        except BaseException:
            self.bo.close()
            raise
        self.seq: int | None = None
        self.failed = False

    def arg_handles(self) -> list[int]:
        """EXEC_CMD lists every BO of every sub-command, then the sub-command packets (docs/uapi.md 6.5)."""
        return _dedup([h for run in self.runs for h in run.handles] + self.handles)

    def reset(self) -> None:
        """Make the packets submittable again: rebuild them after a failure (the driver 0xFF-fills the
        first sub-command's payload, docs/uapi.md 6.6), else only set every state back to NEW."""
        if self.failed:
            cmd.encode_chain(self.view, self.handles)
            self.failed = False
        else:
            head = self.head
            head[0] = (head[0] & ~0xF) | cmd.ERT_CMD_STATE_NEW
        for run in self.runs:
            run.restore()


class RunList:
    """Prepared runs of one context submitted together as ERT_CMD_CHAIN packets.

    Runs are packed in order into as few chains as the driver takes: each chain's sub-command slots
    fit the driver's 4 KiB command list and it holds at most ``cmd.CHAIN_MAX_RUNS`` runs (see
    ``cmd.CHAIN_MAX_RUNS`` for why not XRT's 24); 36 mlir-aie runs fit one chain. Every sub-command
    is an ERT_START_CU packet, so a chain always has the one opcode the driver requires
    (docs/uapi.md 6.5). ``start()`` submits every chain, ``wait()`` waits once (the last
    chain's timeline point) and checks each chain in order. ``states`` holds the per-run ERT states
    after ``wait``. Reusable: restarting rewrites only states, except after a failure, when the
    clobbered packets are rebuilt. Closed with its context.
    """

    def __init__(self, ctx: HwContext, runs: Sequence[Run]) -> None:
        """Build the chain packets.

        Raises:
            ValueError: empty list, runs of another context, a repeated run, or a run too large for a chain.
            TypeError: an entry is not a ``Run``.
            XdnaError: the context is closed, or a chain buffer could not be allocated (nothing is left
                allocated).
        """
        ctx.check_open("RunList")
        runs = list(runs)
        _check_runs(ctx, runs)
        self.ctx = ctx
        self.runs = tuple(runs)
        self.chains: list[_Chain] = []
        self.states: list[int] = [cmd.ERT_CMD_STATE_NEW] * len(runs)
        self._lock = threading.Lock()
        self._pin = _Pin(self._lock)
        self._unpin: Any = None
        self._wait = _Waiter(ctx)
        self._in_flight = False
        self._submission = 0
        self._stuck: Any = None     # after a wait expired: the release of the buffers kept for the device
        # Checked for closed-ness at every start: each buffer once, however many runs share it.
        self._bos = tuple(dict.fromkeys(bo for run in runs for bo in run._bos))
        self._versions = sum(run._version for run in runs)    # changes when a run's argument is rewritten
        try:
            for first, group in _split(runs):
                self.chains.append(_Chain(ctx, group, first))
            # The runs' packets too: a run closed meanwhile keeps its packet mapped until the list lets go.
            self._pin.hold([chain.bo for chain in self.chains] + [run.packet for run in runs], "RunList")
            self._unpin = _pinned(self, self._pin, ctx.device.file)
        except BaseException:
            self.close()
            raise
        ctx.track(self)

    def __len__(self) -> int:
        return len(self.runs)

    def __repr__(self) -> str:
        return f"<RunList runs={len(self.runs)} chains={len(self.chains)}>"

    @property
    def closed(self) -> bool:
        """True once the list, its context or its device was closed."""
        return self._pin.closed

    def _stale(self) -> bool:
        # The cheap flags of Run._stale, for every run and buffer of the list once.
        if self._pin.closed or self.ctx._closed:
            return True
        for run in self.runs:
            if run._pin.closed:
                return True
        for bo in self._bos:
            if bo._closed:
                return True
        return False

    def start(self) -> RunList:
        """Submit every chain packet (one EXEC_CMD each).

        Raises:
            XdnaError: EXEC_CMD failed (the chains submitted before it still run: ``wait`` drains
                them), or the list, its context, one of its runs or an argument buffer is closed.
            RuntimeError: the list, or one of its runs (alone or in another list), is still in flight
                (``wait`` first).
        """
        with self._lock:
            if self._stale():
                self.ctx.check_open("EXEC_CMD")
                self._check_open("EXEC_CMD")
            if self._in_flight and self._stuck is not None:
                raise RuntimeError(f"RunList of {len(self.runs)} runs timed out in wait() and is still on the device "
                                   f"(the driver resets a hung command only at its TDR): wait() again until it ends")
            if self._in_flight:
                raise RuntimeError(f"RunList of {len(self.runs)} runs is still in flight: wait() first")
            versions = sum(run._version for run in self.runs)
            if versions != self._versions:
                self._refresh(versions)
            self._claim_runs()
            self._submit()
        return self

    def _refresh(self, versions: int) -> None:
        # A run's argument was rewritten (Run.set_arg): the buffers checked and each chain's EXEC_CMD list follow.
        self._bos = tuple(dict.fromkeys(bo for run in self.runs for bo in run._bos))
        for chain in self.chains:
            chain.exec.set_handles(chain.arg_handles())
        self._versions = versions

    def _submit(self) -> None:
        self._submission += 1
        try:
            for chain in self.chains:
                chain.reset()
                chain.seq = None
            self.states = [cmd.ERT_CMD_STATE_NEW] * len(self.runs)
            for chain in self.chains:
                try:
                    chain.seq = chain.exec.submit()
                except BaseException:
                    chain.seq = chain.exec.landed()     # taken before an interrupt: wait() drains it
                    if chain.seq is not None:
                        self._in_flight = True
                    raise
                self._in_flight = True
        except BaseException:
            if not self._in_flight:
                self._release_runs()
            raise

    def _claim_runs(self) -> None:
        # One CMD BO cannot be in two submissions: the driver writes each one's outcome into it, and a
        # restart rewrites the state the other is about to report. Runs are claimed while the list flies,
        # all under the context's claim lock (Run.start takes it to mark a run in flight).
        with self.ctx._claims:
            for i, run in enumerate(self.runs):
                if run._in_flight or run._claimed_by is not None:
                    where = "on its own" if run._in_flight else "in another RunList"
                    raise RuntimeError(f"RunList entry {i} ({run.kernel.name}) is still in flight {where}: "
                                       f"wait() for it first")
            for run in self.runs:
                run._claimed_by = self

    def _release_runs(self) -> None:
        with self.ctx._claims:
            for run in self.runs:
                if run._claimed_by is self:
                    run._claimed_by = None

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT) -> list[int]:
        """Wait once for the last chain submitted, then check every submitted chain; returns the
        per-run states. ``timeout`` as ``Run.wait`` (default 10 s, ``FOREVER`` for no bound).

        Raises:
            CommandError: a chain failed; ``index`` is the failing run's position in this list
                (runs before it COMPLETED, after it ABORT, as XRT reports), with the firmware's reason
                when known (docs/runtime.md 4.2).
            CommandTimeout: the wait expired or the failing run TIMEOUT.
            DeviceLostError: the device was lost while the chains ran (docs/runtime.md 4.3).
            RuntimeError: not started.
            XdnaError: the wait ioctl failed, or the list or one of its runs is closed.
        """
        with self._lock:
            if self._stale():
                self._check_open("wait")
            # each chain's seq as of now: a restart from another thread rewrites chain.seq (None first) while this
            # wait runs outside the lock, and is caught by the submission count below
            submitted = [(chain, chain.seq) for chain in self.chains if chain.seq is not None]
            if not submitted:
                raise RuntimeError("RunList was never started")
            flying, submission = self._in_flight, self._submission
        what = f"RunList of {len(self.runs)} runs"
        if flying:
            # Timeline points signal in order: the last chain's point covers the earlier ones.
            # WAIT_CMD waits for one seq only, so without a syncobj every chain is waited for.
            try:
                for _, seq in (submitted[-1:] if self.ctx.syncobj else submitted):
                    self._wait.wait(seq, timeout, what)
            except CommandTimeout:
                self._keep(submission)
                raise
        with self._lock:
            stuck, self._stuck = self._stuck, None
            if stuck is not None:       # the chains ended: what was kept for them goes (docs/runtime.md 3.4)
                stuck()
            if self._stale():
                self._check_open("wait")
            if self._submission != submission:
                raise RuntimeError(f"{what} was restarted while this wait ran")
            if flying and self._in_flight:
                self._in_flight = False
                self._release_runs()
            failures = [f for f in (self._collect(chain, seq) for chain, seq in submitted) if f is not None]
            if not failures:
                return list(self.states)
            error = failures[0]
        raise _classified(error, self.ctx)

    def _keep(self, submission: int) -> None:
        """A wait expired with the chains still on the device: their packets and buffers stay allocated until a
        later wait sees them end (docs/runtime.md 3.4)."""
        with self._lock:
            if self._stuck is None and self._submission == submission and not self._pin.closed:
                bos = [chain.bo for chain in self.chains] + [run.packet for run in self.runs] + list(self._bos)
                self._stuck = _keep_on_device(self.ctx.device.file, bos, "wait")

    def _collect(self, chain: _Chain, seq: int) -> CommandError | None:
        state = chain.head[0] & 0xF
        n = len(chain.runs)
        if state == cmd.ERT_CMD_STATE_COMPLETED:
            self.states[chain.first:chain.first + n] = [state] * n
            return None
        info = cmd.decode_chain(chain.view) if state != cmd.ERT_CMD_STATE_NEW else None
        error_index = info.error_index if info is not None and info.error_index < n else 0
        self.states[chain.first:chain.first + n] = ([cmd.ERT_CMD_STATE_COMPLETED] * error_index + [state]
                                                    + [cmd.ERT_CMD_STATE_ABORT] * (n - error_index - 1))
        chain.failed = True
        for sub in chain.runs:
            sub._clobbered = True   # rebuilt by the next start, of this list or of the run alone
        run = chain.runs[error_index]
        index = chain.first + error_index
        # On failure the driver writes the health record into the first sub-command's payload (docs/uapi.md 6.6).
        return _command_error(run.kernel.name, state, seq, self.ctx, chain.view, index=index,
                              health_packet=chain.runs[0]._view)

    def _check_open(self, what: str) -> None:
        # The chain packets and the runs' packets are written and read through their mappings.
        if self._pin.closed:
            handle = self.chains[0].bo.handle if self.chains else None
            raise ioctl_error(what, {"cmd_handles": handle}, errno.EBADF, "run list is closed")
        for chain in self.chains:
            if chain.bo.closed:
                raise ioctl_error(what, {"cmd_handles": chain.bo.handle}, errno.EBADF, "run list is closed")
        for run in self.runs:
            run.check_open(what)
            run.check_buffers(what)

    def __call__(self, timeout: float | None = DEFAULT_TIMEOUT) -> list[int]:
        """``start()`` then ``wait(timeout)``; a bad ``timeout`` is refused before submitting."""
        _check_timeout(timeout)
        return self.start().wait(timeout)

    def close(self) -> None:
        """Release the chain packet buffers (the runs stay usable); idempotent. Waits for a ``start`` in
        progress in another thread."""
        release_steps(self._unpin or self._pin.release, *(chain.bo.close for chain in self.chains))

    def __enter__(self) -> RunList:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_runs(ctx: HwContext, runs: Sequence[Run]) -> None:
    if not runs:
        raise ValueError("RunList needs at least one run")
    for i, run in enumerate(runs):
        if not isinstance(run, Run):
            raise TypeError(f"RunList entry {i} is a {type(run).__name__}, not a Run")
        if run.ctx is not ctx:
            raise ValueError(f"RunList entry {i} belongs to another hardware context")
        run.check_open("RunList")
    if len({id(run) for run in runs}) != len(runs):
        raise ValueError("RunList contains the same Run twice (one command buffer cannot be two sub-commands)")


def _split(runs: Sequence[Run]) -> Iterable[tuple[int, list[Run]]]:
    group: list[Run] = []
    used = 0
    first = 0
    for i, run in enumerate(runs):
        cost = cmd.chain_slot_cost(run.words)
        if cost > cmd.CHAIN_SLOT_BUDGET:
            raise ValueError(f"run {i} ({run.kernel.name}) takes {cost} bytes of the driver's "
                             f"{cmd.CHAIN_SLOT_BUDGET}-byte command list on its own")
        if group and (len(group) == cmd.CHAIN_MAX_RUNS or used + cost > cmd.CHAIN_SLOT_BUDGET):
            yield first, group
            group, used, first = [], 0, i
        group.append(run)
        used += cost
    yield first, group
