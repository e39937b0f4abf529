"""Kernels, runs and run lists: ERT packets in reused CMD buffers, EXEC_CMD, syncobj waits.

A ``Run`` owns one 4 KiB CMD buffer whose ERT_START_CU packet is built once (regmap laid out from
the xclbin's EMBEDDED_METADATA args, spec xrt-npu-sequence.md 1.7); ``start`` only rewrites the
state nibble and issues EXEC_CMD, ``wait`` issues one SYNCOBJ_TIMELINE_WAIT (spec 1.9). A
``RunList`` submits prepared runs as ERT_CMD_CHAIN packets (spec 1.7, amdxdna-uapi.md 6.5).
"""

from __future__ import annotations

import errno
import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import abi, cmd
from .bo import Bo, unhold
from .errors import CommandError, CommandTimeout, XdnaError, errno_text, ioctl_error

if TYPE_CHECKING:
    from .hwctx import ComputeUnit, HwContext, Instructions

__all__ = ["Kernel", "Run", "RunList", "CMD_BO_SIZE", "DEFAULT_TIMEOUT", "FOREVER", "NPU_OPCODE_TXN"]

CMD_BO_SIZE = 4096  # XRT's exec BO size (spec 1.4 CREATE_BO)
NPU_OPCODE_TXN = 3  # regmap "opcode" of the mlir-aie convention: execute a TXN stream (spec 2.2)
#: Seconds a wait lasts unless told otherwise: the proven path's bound (docs/runtime.md 3.4).
DEFAULT_TIMEOUT = 10.0
#: The timeout that waits without bound (``wait(timeout=FOREVER)``); only the driver's TDR ends such a wait.
FOREVER = math.inf
_INT64_MAX = (1 << 63) - 1
_U32_MAX = (1 << 32) - 1
_FAILED_STATES = {cmd.ERT_CMD_STATE_ERROR: errno.EIO, cmd.ERT_CMD_STATE_ABORT: errno.ECANCELED,
                  cmd.ERT_CMD_STATE_TIMEOUT: errno.ETIME, cmd.ERT_CMD_STATE_NORESPONSE: errno.EIO}
# States after which the driver has overwritten the payload with 0xFF (spec amdxdna-uapi.md 6.6).
_CLOBBERED = {cmd.ERT_CMD_STATE_ERROR, cmd.ERT_CMD_STATE_ABORT, cmd.ERT_CMD_STATE_TIMEOUT}


def _check_timeout(timeout: float | None) -> float | None:
    """The timeout in seconds, or None for "no bound": ``FOREVER`` (infinity) waits without bound, None
    means ``DEFAULT_TIMEOUT`` (docs/runtime.md 3.4).

    Raises:
        ValueError: not a number >= 0 (NaN, negative, a string ...).
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, FOREVER (math.inf) or None (the default, "
                         f"{DEFAULT_TIMEOUT} s), got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def _monotonic_deadline_ns(timeout: float | None) -> int:
    # SYNCOBJ waits take an absolute CLOCK_MONOTONIC deadline; INT64_MAX waits forever (spec 1.9).
    # ``timeout`` is what _check_timeout returned: None (or infinity) is no bound here.
    if timeout is None or timeout >= _INT64_MAX / 1e9:
        return _INT64_MAX
    return min(_INT64_MAX, time.clock_gettime_ns(time.CLOCK_MONOTONIC) + int(timeout * 1e9))


def _wait_cmd_ms(timeout: float | None) -> int:
    # WAIT_CMD counts milliseconds in a u32 and 0 means forever (spec amdxdna-uapi.md 2.3, 4.11).
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
        self.args = cu.kernel.args      # sorted by id, duplicates merged, as XRT does (xclbin parse, spec 3.7)
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
        fields, bos = [], []
        for decl, value in zip(self.args, args, strict=False):
            field, bo = _arg_field(self.name, self.ctx.device, decl, value)
            fields.append(field)
            if bo is not None:
                bos.append(bo)
        regmap = cmd.encode_regmap(self.regmap_size, fields)
        return Run(self, regmap, bos)

    def prepare_npu(self, insts: Any, buffers: Sequence[Bo | None]) -> Run:
        """A run in the mlir-aie convention: ``(3, instruction buffer, word count, *buffers)`` (spec 2.2).

        ``insts``: bytes, a path, u32 words or an ``insts.Stream``; its bytes are uploaded as given to a
        DEV buffer once per context (cached by digest; ``HwContext.instructions``, docs/runtime.md 1).
        ``buffers`` fill bo0, bo1, ... in order. ``run.insts`` is the uploaded stream.

        Raises:
            InstsError: the stream's header is malformed or names another device generation.
            TypeError: ``buffers`` is not a sequence.
            ValueError: more buffers than the kernel declares.
            XdnaError: upload or allocation failed.
        """
        if isinstance(buffers, (Bo, str, bytes)) or not isinstance(buffers, Sequence):
            raise TypeError(f"{self.name}: prepare_npu buffers must be a sequence of Bo or None, "
                            f"got {type(buffers).__name__}")
        prepared = self.ctx.instructions(insts)
        run = self.prepare(NPU_OPCODE_TXN, prepared.bo, prepared.nwords, *buffers)
        run.insts = prepared
        return run


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


class Run:
    """One prepared kernel invocation with its own reusable command buffer.

    ``start()`` submits it (again and again), ``wait(timeout)`` waits and checks the state.
    ``state`` is the packet's ERT state, ``seq`` the last submission number, ``elapsed`` the
    seconds from the last ``start`` to the completion seen by ``wait``.
    """

    def __init__(self, kernel: Kernel, regmap: bytes | bytearray, bos: Sequence[Bo]) -> None:
        ctx = kernel.ctx
        self.kernel = kernel
        self.ctx = ctx
        self.buffers = tuple(bos)  # keeps the argument buffers alive while the run exists
        self._regmap = bytes(regmap)
        self._lock = threading.Lock()
        self.packet = ctx.device.bo(CMD_BO_SIZE, "cmd")
        try:
            self._view = self.packet.owner_view()
            self.words = cmd.payload_words(len(self._regmap))
            self._encode()
            # A sub-buffer carries its parent's handle, so the parent is listed once (spec 1.5).
            self.handles = _dedup(bo.handle for bo in bos)
            self._exec = _Exec(ctx, self.packet.handle, self.handles)
            self._wait = _Waiter(ctx)
        except BaseException:
            self.packet.close()
            raise
        self.seq: int | None = None
        self.elapsed: float | None = None
        self.insts: Instructions | None = None     # set by prepare_npu
        self._t0 = 0.0
        self._clobbered = False
        self._in_flight = False
        self._unsubmitted = False
        self._claimed_by: RunList | None = None     # the RunList whose submission holds this packet
        ctx.track(self)

    def _encode(self) -> None:
        cmd.encode_start_cu(self._view, self.kernel.cu_index, self._regmap)

    def __repr__(self) -> str:
        state = "closed" if self.packet.closed else cmd.state_name(self.state)
        return f"<Run {self.kernel.name} seq={self.seq} state={state}>"

    def check_open(self, what: str) -> None:
        """Raise if the packet buffer was released (its mapping is gone: touching it would fault).

        Raises:
            XdnaError: EBADF naming ``what`` and the packet's handle.
        """
        if self.packet.closed:
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

    @property
    def state(self) -> int:
        """The packet's current ERT state (``cmd.ERT_CMD_STATE_*``).

        Raises:
            XdnaError: the run is closed.
        """
        held = self._hold("state")
        try:
            return cmd.read_state(self._view)
        finally:
            unhold(held)

    def _hold(self, what: str) -> tuple:
        # The packet is read and written through its mapping: keep it mapped while another thread
        # may close the run, its context or the device.
        try:
            return self.packet.hold(what)
        except XdnaError:
            self.check_open(what)
            raise

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
            cmd.write_state(self._view, cmd.ERT_CMD_STATE_NEW)

    def start(self) -> Run:
        """Submit with EXEC_CMD (no allocation: the packet and the ioctl structs are reused).

        Raises:
            XdnaError: EXEC_CMD failed (names hwctx, the command handle and arg count), or the run or
                its context is closed.
            RuntimeError: the previous submission (alone or in a ``RunList``) was not waited for.
        """
        self.ctx.check_open("EXEC_CMD")
        self.check_open("EXEC_CMD")
        self.check_buffers("EXEC_CMD")
        with self._lock:
            if self._in_flight:
                raise RuntimeError(f"Run of {self.kernel.name} (seq={self.seq}) is still in flight: wait() first")
            if self._claimed_by is not None:
                raise RuntimeError(f"Run of {self.kernel.name} is in flight in a RunList: wait() for the list first")
            held = self._hold("EXEC_CMD")
            try:
                self.restore()
                self._unsubmitted = True    # until EXEC_CMD takes it: the packet now says NEW, not the last outcome
                self.seq = self._exec.submit()
                self._unsubmitted = False
            finally:
                unhold(held)
            self._in_flight = True
            self._t0 = time.perf_counter()
            self.elapsed = None
        return self

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT) -> int:
        """Wait for the last submission and check its state; returns ``ERT_CMD_STATE_COMPLETED``.

        ``timeout``: seconds, ``DEFAULT_TIMEOUT`` (10 s) unless given; ``FOREVER`` (``math.inf``) waits
        without bound; None means the default (docs/runtime.md 3.4).

        One SYNCOBJ_TIMELINE_WAIT (WAIT_FOR_SUBMIT, absolute CLOCK_MONOTONIC deadline) on the
        context syncobj at point ``seq``; WAIT_CMD only if the context has no syncobj (spec 1.9).
        Unlike XRT, the header is not polled before the wait: the state is read only once the fence
        signalled (spec amdxdna-uapi.md 6.6), which also catches a malformed command whose state the
        driver leaves NEW. A second ``wait`` after completion re-checks the state without an ioctl.

        Raises:
            CommandTimeout: the wait expired (``state`` is the live one) or the driver's TDR marked the
                command TIMEOUT (with the health record when the driver left one).
            CommandError: any other final state (ERROR, ABORT, or NEW for a malformed command).
            RuntimeError: the run was never started, or its last ``start`` failed.
            XdnaError: the wait ioctl failed, or the run is closed.
        """
        self.check_open("wait")
        with self._lock:
            if self.seq is None:
                raise RuntimeError(f"Run of {self.kernel.name} was never started")
            if self._unsubmitted:
                raise RuntimeError(f"Run of {self.kernel.name} is not submitted: its last start() failed")
            if self._in_flight:
                self._wait.wait(self.seq, timeout, self.kernel.name)
                self._in_flight = False
                self.elapsed = time.perf_counter() - self._t0
            held = self._hold("wait")
            try:
                state = cmd.read_state(self._view)
                if state == cmd.ERT_CMD_STATE_COMPLETED:
                    return state
                self._clobbered = state in _CLOBBERED
                raise _command_error(self.kernel.name, state, self.seq, self.ctx.handle, self._view,
                                     emulated=self.ctx.device.emulator is not None)
            finally:
                unhold(held)

    def __call__(self, timeout: float | None = DEFAULT_TIMEOUT) -> int:
        """``start()`` then ``wait(timeout)``; a bad ``timeout`` is refused before submitting."""
        _check_timeout(timeout)
        return self.start().wait(timeout)

    def set_insts_words(self, words: Sequence[tuple[int, int]]) -> None:
        """Rewrite words of this run's instruction stream (``[(index, value), ...]``, u32 word indices) in
        its instruction buffer and flush them; the next start of every run of that stream executes them
        (``Instructions.set_words``, docs/runtime.md 3.1).

        Raises:
            RuntimeError: the run was not prepared by ``prepare_npu``, or a run of the stream is in flight.
            TypeError, ValueError: malformed pairs, an index outside the stream's words 4.., a value not a u32.
            InstsError: the rewritten stream would be malformed (nothing is written).
            XdnaError: the run or its context is closed, or SYNC_BO failed.
        """
        self.check_open("set_insts_words")
        if self.insts is None:
            raise RuntimeError(f"Run of {self.kernel.name} was not prepared by prepare_npu: it has no instruction "
                               f"stream to rewrite")
        self.insts.set_words(words)

    def close(self) -> None:
        """Release the packet buffer (idempotent)."""
        self.packet.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Waiter:
    """A preallocated SYNCOBJ_TIMELINE_WAIT (or WAIT_CMD) request, reused by every wait of its owner."""

    def __init__(self, ctx: HwContext) -> None:
        ffi = abi.ffi
        self.ctx = ctx
        if ctx.syncobj:
            self.handles = ffi.new("uint32_t[1]", [ctx.syncobj])
            self.points = ffi.new("uint64_t[1]")
            self.req = ffi.new("struct drm_syncobj_timeline_wait *")
            self.req.handles = abi.address_of(self.handles)
            self.req.points = abi.address_of(self.points)
            self.req.count_handles = 1
            self.req.flags = abi.DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT
        else:
            self.req = ffi.new("struct amdxdna_drm_wait_cmd *")
            self.req.hwctx = ctx.handle
        self.buf = ffi.buffer(self.req)

    def wait(self, seq: int, timeout: float | None, what: str) -> None:
        """Block until submission ``seq`` of the context signalled (spec xrt-npu-sequence.md 1.9).

        Raises:
            CommandTimeout: the deadline passed first (ETIME); ``state`` is RUNNING.
            XdnaError: EBADF when the context was closed during the wait; the wait ioctl failed otherwise.
        """
        ctx, file = self.ctx, self.ctx.device.file
        shown = DEFAULT_TIMEOUT if timeout is None else timeout      # as the caller put it, in messages
        timeout = _check_timeout(timeout)
        try:
            if ctx.syncobj:
                self.points[0] = seq
                self.req.timeout_nsec = _monotonic_deadline_ns(timeout)
                file.ioctl_buffer(abi.DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT, self.buf,
                                  {"handle": ctx.syncobj, "point": seq,
                                   "timeout": "forever" if timeout is None else shown})
            else:
                self.req.seq = seq
                self.req.timeout = _wait_cmd_ms(timeout)
                file.ioctl_buffer(abi.DRM_IOCTL_AMDXDNA_WAIT_CMD, self.buf,
                                  {"hwctx": ctx.handle, "seq": seq, "timeout_ms": self.req.timeout})
        except XdnaError as exc:
            if ctx.closed:      # closed by another thread meanwhile: the syncobj went first (spec 1.10)
                raise ioctl_error("wait", {"hwctx": ctx.handle, "seq": seq}, errno.EBADF,
                                  f"context closed while {what} waited ({exc})") from exc
            if exc.errno == errno.ETIME:
                raise CommandTimeout(errno.ETIME, f"{what} (hwctx={ctx.handle}, seq={seq}): not finished after "
                                                  f"{shown} s: {exc}", kernel=what, state="RUNNING",
                                     seq=seq) from exc
            raise


class _Exec:
    """A preallocated EXEC_CMD request for one command BO, reused by every submission (spec 1.8)."""

    def __init__(self, ctx: HwContext, cmd_handle: int, handles: Sequence[int]) -> None:
        ffi = abi.ffi
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

    def submit(self) -> int:
        """EXEC_CMD; returns the submission's ``seq`` (its timeline point).

        Raises:
            XdnaError: the driver refused (the message names hwctx, cmd_handles and arg_count).
        """
        self.file.ioctl_buffer(abi.DRM_IOCTL_AMDXDNA_EXEC_CMD, self.buf, self.fields)
        return self.req.seq


_EMULATOR_NOTE = "the emulated firmware logged why (logger amdxdna_direct.emu, level ERROR)"


def _command_error(kernel: str, state: int, seq: int, hwctx: int, packet, index: int | None = None,
                   health_packet=None, emulated: bool = False) -> CommandError:
    name = cmd.state_name(state)
    err = _FAILED_STATES.get(state, errno.EINVAL)
    health = cmd.decode_health(health_packet if health_packet is not None else packet) \
        if state == cmd.ERT_CMD_STATE_TIMEOUT else None
    where = f", index={index}" if index is not None else ""
    detail = "the driver rejected the packet (state left NEW)" if state == cmd.ERT_CMD_STATE_NEW else errno_text(err)
    message = f"{kernel} (hwctx={hwctx}, seq={seq}{where}): command {name}: {detail}"
    if health is not None:
        message += (f"; health: txn_op_idx={health.txn_op_idx} ctx_pc={health.ctx_pc:#x} "
                    f"fatal_error_type={health.fatal_error_type:#x}")
    if emulated and state == cmd.ERT_CMD_STATE_ERROR:
        message += f"; {_EMULATOR_NOTE}"
    cls = CommandTimeout if state == cmd.ERT_CMD_STATE_TIMEOUT else CommandError
    return cls(err, message, kernel=kernel, state=name, seq=seq, index=index, health=health)


class _Chain:
    """One ERT_CMD_CHAIN packet over a slice of the run list."""

    def __init__(self, ctx: HwContext, runs: Sequence[Run], first: int) -> None:
        self.runs = tuple(runs)
        self.first = first
        self.bo = ctx.device.bo(CMD_BO_SIZE, "cmd")
        try:
            self.view = self.bo.owner_view()
            self.handles = [run.packet.handle for run in runs]
            cmd.encode_chain(self.view, self.handles)
            # EXEC_CMD lists every BO of every sub-command, then the sub-command packets (spec 6.5).
            arg_handles = _dedup([h for run in runs for h in run.handles] + self.handles)
            self.exec = _Exec(ctx, self.bo.handle, arg_handles)
        except BaseException:
            self.bo.close()
            raise
        self.seq: int | None = None
        self.failed = False

    def reset(self) -> None:
        """Make the packets submittable again: rebuild them after a failure (the driver 0xFF-fills the
        first sub-command's payload, spec 6.6), else only set every state back to NEW."""
        if self.failed:
            cmd.encode_chain(self.view, self.handles)
            self.failed = False
        else:
            cmd.write_state(self.view, cmd.ERT_CMD_STATE_NEW)
        for run in self.runs:
            run.restore()


class RunList:
    """Prepared runs of one context submitted together as ERT_CMD_CHAIN packets.

    Runs are packed in order into as few chains as the driver takes: each chain's sub-command slots
    fit the driver's 4 KiB command list and it holds at most ``cmd.CHAIN_MAX_RUNS`` runs (see
    ``cmd.CHAIN_MAX_RUNS`` for why not XRT's 24); 36 mlir-aie runs fit one chain. Every sub-command
    is an ERT_START_CU packet, so a chain always has the one opcode the driver requires
    (spec amdxdna-uapi.md 6.5). ``start()`` submits every chain, ``wait()`` waits once (the last
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
        self._wait = _Waiter(ctx)
        self._in_flight = False
        try:
            for first, group in _split(runs):
                self.chains.append(_Chain(ctx, group, first))
        except BaseException:
            self.close()
            raise
        ctx.track(self)

    def __len__(self) -> int:
        return len(self.runs)

    def __repr__(self) -> str:
        return f"<RunList runs={len(self.runs)} chains={len(self.chains)}>"

    def start(self) -> RunList:
        """Submit every chain packet (one EXEC_CMD each).

        Raises:
            XdnaError: EXEC_CMD failed (the chains submitted before it still run: ``wait`` drains
                them) or the context is closed.
            RuntimeError: the list, or one of its runs (alone or in another list), is still in flight
                (``wait`` first).
        """
        self.ctx.check_open("EXEC_CMD")
        self._check_open("EXEC_CMD")
        with self._lock:
            if self._in_flight:
                raise RuntimeError(f"RunList of {len(self.runs)} runs is still in flight: wait() first")
            held = self._hold("EXEC_CMD")
            try:
                self._claim_runs()
                self._submit()
            finally:
                unhold(held)
        return self

    def _submit(self) -> None:
        try:
            for chain in self.chains:
                chain.reset()
                chain.seq = None
            self.states = [cmd.ERT_CMD_STATE_NEW] * len(self.runs)
            for chain in self.chains:
                chain.seq = chain.exec.submit()
                self._in_flight = True
        except BaseException:
            if not self._in_flight:
                self._release_runs()
            raise

    def _claim_runs(self) -> None:
        # One CMD BO cannot be in two submissions: the driver writes each one's outcome into it, and a
        # restart rewrites the state the other is about to report. Runs are claimed while the list flies.
        claimed = []
        try:
            for i, run in enumerate(self.runs):
                with run._lock:
                    if run._in_flight or run._claimed_by is not None:
                        where = "on its own" if run._in_flight else "in another RunList"
                        raise RuntimeError(f"RunList entry {i} ({run.kernel.name}) is still in flight {where}: "
                                           f"wait() for it first")
                    run._claimed_by = self
                claimed.append(run)
        except RuntimeError:
            for run in claimed:
                run._claimed_by = None
            raise

    def _release_runs(self) -> None:
        for run in self.runs:
            if run._claimed_by is self:
                run._claimed_by = None

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT) -> list[int]:
        """Wait once for the last chain submitted, then check every submitted chain; returns the
        per-run states. ``timeout`` as ``Run.wait`` (default 10 s, ``FOREVER`` for no bound).

        Raises:
            CommandError: a chain failed; ``index`` is the failing run's position in this list
                (runs before it COMPLETED, after it ABORT, as XRT reports).
            CommandTimeout: the wait expired or the failing run TIMEOUT.
            RuntimeError: not started.
            XdnaError: the wait ioctl failed, or the list or one of its runs is closed.
        """
        self._check_open("wait")
        with self._lock:
            submitted = [chain for chain in self.chains if chain.seq is not None]
            if not submitted:
                raise RuntimeError("RunList was never started")
            what = f"RunList of {len(self.runs)} runs"
            if self._in_flight:
                # Timeline points signal in order: the last chain's point covers the earlier ones.
                # WAIT_CMD waits for one seq only, so without a syncobj every chain is waited for.
                for chain in (submitted[-1:] if self.ctx.syncobj else submitted):
                    self._wait.wait(chain.seq, timeout, what)
                self._in_flight = False
                self._release_runs()
            held = self._hold("wait")
            try:
                failures = [f for f in (self._collect(chain) for chain in submitted) if f is not None]
            finally:
                unhold(held)
            if failures:
                raise failures[0]
            return list(self.states)

    def _hold(self, what: str) -> tuple:
        # Every chain and run packet stays mapped while it is used (see Run._hold).
        held: list = []
        try:
            for bo in [chain.bo for chain in self.chains] + [run.packet for run in self.runs]:
                held.extend(bo.hold(what))
        except XdnaError:
            unhold(tuple(held))
            self._check_open(what)
            raise
        return tuple(held)

    def _collect(self, chain: _Chain) -> CommandError | None:
        state = cmd.read_state(chain.view)
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
        # On failure the driver writes the health record into the first sub-command's payload (spec 6.6).
        return _command_error(run.kernel.name, state, chain.seq, self.ctx.handle, chain.view, index=index,
                              health_packet=chain.runs[0]._view, emulated=self.ctx.device.emulator is not None)

    def _check_open(self, what: str) -> None:
        # The chain packets and the runs' packets are written and read through their mappings.
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
        """Release the chain packet buffers (the runs stay usable); idempotent."""
        for chain in self.chains:
            chain.bo.close()

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
