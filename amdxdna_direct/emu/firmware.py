"""The emulated firmware: runs the jobs EXEC_CMD queued, asynchronously, and reports as the driver does.

Each hardware context gets a lane: a worker thread that takes the context's jobs in submission
order (so they complete in order) and an engine thread that runs kernel models (a small model that only
computes runs on the worker itself: docs/emulator.md, "Lookups, hand-off and BLAS threads"). A job goes
through two phases, mirroring the driver's run_job and the firmware:

* driver checks (docs/uapi.md 6.1-6.5): the packet header, the opcode, the CU mask, the
  chain's sub-commands and the 4 KiB command-list budget. A failure here leaves the header state
  NEW while the fence still signals (docs/uapi.md 6.6);
* firmware execution: the regmap (mlir-aie layout, docs/xrt-sequence.md 1.7), the TXN stream in the
  heap window, every DDR_PATCH resolved to a BO, then the model bound to the stream's digest.
  A failure is ERROR with the payload 0xFF-filled (docs/uapi.md 6.6).

TDR (docs/uapi.md 6.7; staging's tdr_timeout_ms with progress detection): a model that makes no progress
(its engine thread burns no CPU) for `tdr_timeout` seconds is abandoned: its job ends TIMEOUT with a
context-health record, the context's other in-flight jobs end ABORT, and the lane gets a fresh engine,
so the context stays usable. An injected hang is an Event wait: it burns no CPU, and the task never
calls its model once abandoned, so nothing is written after TDR.
"""

from __future__ import annotations

import collections
import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from . import blas, txn
from .memory import AMDXDNA_BO_CMD, AMDXDNA_BO_DEV, Bo, DeviceFault, Memory
from .models import Model, ModelRegistry, model_name, stream_digest
from .objects import DeviceCore, HwCtx, Job

logger = logging.getLogger(__name__)

# ERT opcodes and states (docs/uapi.md 3, "Kernel-internal").
ERT_START_CU = 0
ERT_START_DPU = 18
ERT_CMD_CHAIN = 19
ERT_START_NPU = 20
ERT_START_NPU_PREEMPT = 21
ERT_START_NPU_PREEMPT_ELF = 22
ERT_CMD_STATE_NEW = 1
ERT_CMD_STATE_COMPLETED = 4
ERT_CMD_STATE_ERROR = 5
ERT_CMD_STATE_ABORT = 6
ERT_CMD_STATE_TIMEOUT = 8
_FAILED_STATES = (ERT_CMD_STATE_ERROR, ERT_CMD_STATE_ABORT, ERT_CMD_STATE_TIMEOUT)

AIE2_EXEC_BUFFER_KERNEL_OP_TXN = 3      # regmap opcode of a TXN stream (docs/xrt-sequence.md 2.2)
MAX_CHAIN_CMDBUF_SIZE = 4096            # the command-list buffer (docs/uapi.md 6.5)
CHAIN_SLOT_CF = 8                       # cmd_chain_slot_execbuf_cf: cu_idx, arg_cnt
CHAIN_SLOT_NPU = 52                     # cmd_chain_slot_npu (packed): type, 3 addresses, 6 u32
MAX_NPU_ARGS_WORDS = 26                 # properties + regmap of an NPU command-list slot (docs/uapi.md 6.3)
# Before 0.6 a lone command skips the command list: one EXECUTE_BUFFER_CF message (START_CU) or EXEC_DPU message
# (START_NPU), whose argument room is smaller / larger (docs/emulator.md, Driver profiles S6).
MAX_CF_MSG_WORDS = 19
MAX_DPU_MSG_WORDS = 35
MAX_LEGACY_DPU_ARGS_WORDS = 34          # the legacy DPU command-list slot (7.0 NPU1, S20)
START_NPU_PREAMBLE = 16                 # u64 instruction address, u32 size in bytes, u32 prop_count
REGMAP_INSTR, REGMAP_NINSTR, REGMAP_SLOTS = 0x08, 0x10, 0x14   # mlir-aie regmap (docs/xrt-sequence.md 1.7)
CHAIN_PREAMBLE = 24                     # command_count, submit_index, error_index, reserved[3]
CHAIN_ERROR_INDEX = 4 + 8               # byte offset of error_index in a chain packet
CTX_HEALTH_V1 = 1                       # struct amdxdna_ctx_health version
NPU_GEN_AIE2 = 0                        # AMDXDNA_CMD_CTX_HEALTH_AIE2
CTX_HEALTH_BYTES = 32                   # version, npu_gen + six u32 of aie2_ctx_health
WATCH_SLICE_S = 60.0                    # longest single wait of the TDR watch (it loops until its deadline)
DESTROY_GRACE_S = 2.0                   # DESTROY_HWCTX waits this long for the last job (docs/uapi.md 4.2)
# A running model must burn at least this share of the TDR period in CPU to count as progress.
PROGRESS_SHARE = 0.05
PROGRAM_CACHE = 1024                    # walked streams kept by digest
# A model that only computes (Model.compute_only) runs on the worker itself when its extents total at most this
# many bytes: a handful of microseconds of work, less than the hand-off to the engine and back costs.
INLINE_BYTES = 1 << 20

# Marks the firmware's own threads (workers, engines, async aborts): the driver never lets them block on a
# job's fence (a finalizer's munmap run by the garbage collector on one of them would wait for itself).
_thread_role = threading.local()


def in_firmware_thread() -> bool:
    """Whether the calling thread is one of the firmware's (a worker, an engine or an async abort)."""
    return getattr(_thread_role, "firmware", False)


def _firmware_thread(target: Callable[..., object], *args: object) -> None:
    _thread_role.firmware = True
    target(*args)


class MalformedCommand(Exception):
    """The driver rejects the packet when the job runs: the state stays NEW (docs/uapi.md 6.6)."""


class FirmwareError(Exception):
    """The firmware fails the command: state ERROR."""


@dataclass(frozen=True)
class Packet:
    """A decoded ERT packet: header fields, CU masks and the payload after the masks."""

    state: int
    opcode: int
    count: int
    masks: tuple[int, ...]
    payload: bytes


def decode_header(word: int) -> tuple[int, int, int, int]:
    """Header word -> (state 3:0, extra CU masks 11:10, count 22:12, opcode 27:23) (docs/uapi.md 6.1)."""
    return word & 0xF, (word >> 10) & 0x3, (word >> 12) & 0x7FF, (word >> 23) & 0x1F


def read_packet(mem: memoryview) -> Packet:
    """Decode the packet of a command BO.

    Raises:
        MalformedCommand: count not above the mask words, or the packet does not fit the BO (docs/uapi.md 6.1).
    """
    if len(mem) < 4:
        raise MalformedCommand(f"command BO of {len(mem)} bytes has no header")
    header = struct.unpack_from("<I", mem)[0]
    _, extra, count, opcode = decode_header(header)
    n_masks = 0 if opcode == ERT_CMD_CHAIN else 1 + extra
    # rule E8: count above the mask words, the packet inside its BO, else NEW (docs/driver-rules.md)
    if count <= n_masks or 4 * count + 4 > len(mem):
        raise MalformedCommand(f"header {header:#010x}: count {count} must exceed {n_masks} mask words and "
                               f"fit the {len(mem)}-byte BO")
    words = struct.unpack_from(f"<{n_masks}I", mem, 4)
    return Packet(header & 0xF, opcode, count, words, bytes(mem[4 + 4 * n_masks:4 + 4 * count]))


def cu_index(masks: tuple[int, ...]) -> int:
    """Lowest set bit of the first non-zero CU mask word (its index within that word, docs/uapi.md 6.1).

    Raises:
        MalformedCommand: no bit set.
    """
    # rule E9: the lowest set bit of the first non-zero mask word (docs/driver-rules.md)
    for mask in masks:
        if mask:
            return (mask & -mask).bit_length() - 1
    raise MalformedCommand("no CU bit set in the CU masks")


@dataclass(frozen=True)
class Dispatch:
    """One kernel start that passed the driver checks."""

    bo: Bo
    opcode: int
    cu: int
    regmap: bytes
    slot_bytes: int                      # its cost in the 4 KiB command list
    instr: int | None = None             # START_NPU: from the preamble
    instr_size: int | None = None


@dataclass(frozen=True)
class Extent:
    """The bytes one argument's buffer descriptors cover, in the BO they resolved to."""

    arg_idx: int
    bo: Bo
    offset: int
    length: int
    reads: bool                          # an MM2S (or unknown-direction) BD reads it; else the device only writes it


@dataclass
class Work:
    """What firmware runs for one dispatch."""

    digest: str
    program: txn.TxnProgram
    args: dict[int, np.ndarray]
    model: Model | None
    extents: list[Extent] = field(default_factory=list)


@dataclass
class _Outcome:
    state: int
    error_index: int | None = None
    fill: Bo | None = None
    txn_op_idx: int = 0xFFFFFFFF
    reason: str | None = None           # the firmware's message for a failed command (EmuDevice.command_reason)


class _Task:
    """A model run handed to an engine; `release` ends an injected hang."""

    def __init__(self, model: Model | None, args: dict[int, np.ndarray], hang: bool):
        self.model, self.args, self.hang = model, args, hang
        self.release = threading.Event() if hang else None      # ends an injected hang (only a hang waits on it)
        self.done = False
        self.abandoned = False
        self.error: BaseException | None = None

    def run(self) -> None:
        """Run on an engine, as one more BLAS user beside the host (docs/emulator.md, "BLAS threads")."""
        if self.release is not None:
            self.release.wait()
        # An abandoned task (TDR or teardown) must not touch the buffers any more.
        if not self.abandoned and self.model is not None:
            with blas.limited():
                self.model(self.args)

    def run_inline(self) -> None:
        """Run on the worker itself (a small compute-only model); the error is kept as the engine keeps it."""
        try:
            if not self.abandoned and self.model is not None:
                self.model(self.args)
        except BaseException as exc:  # reported by the worker as the command's failure
            self.error = exc
        self.done = True

    def abandon(self) -> None:
        self.abandoned = True
        if self.release is not None:
            self.release.set()


class _Engine:
    """A thread that runs model tasks; its CPU clock is the TDR's progress signal."""

    def __init__(self, name: str, cond: threading.Condition):
        self._cond = cond
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=_firmware_thread, args=(self._loop,), name=name, daemon=True)
        self.thread.start()
        # start() returns once the thread runs, and a running thread has its ident (threading docs).
        self._clock = time.pthread_getcpuclockid(cast(int, self.thread.ident))

    def cpu_time(self) -> float:
        return time.clock_gettime(self._clock)

    def run(self, task: _Task) -> None:
        self._tasks.put(task)

    def retire(self) -> None:
        """Exit after the current task (an abandoned hang returns at once)."""
        self._tasks.put(None)

    def _loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task.run()
            except BaseException as exc:  # reported by the worker as the command's failure
                task.error = exc
            with self._cond:
                task.done = True
                self._cond.notify_all()


@dataclass(eq=False)
class _Lane:
    """The execution state of one hardware context."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    jobs: deque[Job] = field(default_factory=deque)
    running: Job | None = None
    task: _Task | None = None           # the model run of `running`, while the engine has it
    closing: bool = False
    engine: _Engine = field(init=False)             # set by Firmware._start_lane, before the worker starts
    worker: threading.Thread = field(init=False)    # set by Firmware._start_lane


class Firmware:
    """The device worker of one EmuDevice (see module docstring).

    `models` is the device's ModelRegistry; `inject` arms hang and error faults per stream.
    """

    def __init__(self, device: DeviceCore, *, tdr_timeout: float = 2.0, time_scale: float = 1.0):
        """Firmware of `device` (an EmuDevice) with a TDR of `tdr_timeout` seconds; lanes start on demand.

        `time_scale` scales every wait for a timeout against the wall clock (EmuDevice's test clock).

        Raises:
            TypeError: the TDR timeout or the time scale is not a number.
            ValueError: a non-positive TDR timeout or time scale, or a profile whose TXN generation is not positive.
        """
        for name, value in (("tdr_timeout", tdr_timeout), ("time_scale", time_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number{' of seconds' * (name == 'tdr_timeout')}, "
                                f"got {type(value).__name__}")
            if not value > 0:
                raise ValueError(f"{name} must be > 0{' seconds' * (name == 'tdr_timeout')}, got {value!r}")
        self.device = device
        self.tdr_timeout = float(tdr_timeout)
        self.time_scale = float(time_scale)
        self.models = ModelRegistry()
        self.dev_gen = _txn_dev_gen(device)
        self._lock = threading.Lock()
        self._lanes: dict[int, _Lane] = {}
        self._faults: dict[str, dict[str, int]] = {"hang": {}, "error": {}}
        self._programs: dict[str, txn.TxnProgram] = {}     # digest -> walked stream (streams are immutable)
        self._stopped = False
        self.inline_bytes = INLINE_BYTES    # compute-only models with extents up to this run on the worker
        self.runs: collections.Counter[str] = collections.Counter()     # model runs: "inline" / "engine"

    # -- fault injection -------------------------------------------------------------------------

    def inject(self, kind: str, stream: bytes | str, count: int) -> None:
        """The next `count` runs of the stream (its bytes or sha256 hex) "hang" (the TDR ends them TIMEOUT) or
        end with a firmware "error".

        Raises:
            ValueError: count < 1 or a malformed digest.
        """
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"{kind} count must be a positive int, got {count!r}")
        digest = stream_digest(stream)
        with self._lock:
            self._faults[kind][digest] = self._faults[kind].get(digest, 0) + count

    def _take_fault(self, digest: str) -> str | None:
        with self._lock:
            for kind, pending in self._faults.items():
                if pending.get(digest, 0) > 0:
                    pending[digest] -= 1
                    if not pending[digest]:
                        del pending[digest]
                    return kind
        return None

    # -- driver-facing API -----------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a validated job on its context's lane; never blocks on execution."""
        with self._lock:
            lane = self._lanes.get(id(job.ctx))
            if lane is None and not self._stopped:
                lane = self._start_lane(job.ctx)
        if lane is None:
            self._end_async(job)
            return
        with lane.cond:
            if not lane.closing:
                lane.jobs.append(job)
                lane.cond.notify_all()
                return
        self._end_async(job)

    def destroy_context(self, ctx: HwCtx) -> None:
        """Wait up to 2 s for the context's last job, then end the rest ABORT; returns when none runs."""
        with self._lock:
            lane = self._lanes.pop(id(ctx), None)
        if lane is not None:
            self._close_lane(lane, DESTROY_GRACE_S * self.time_scale)

    def stop(self) -> None:
        """End every lane at once (queued and running jobs ABORT) and stop the threads."""
        with self._lock:
            self._stopped = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            self._close_lane(lane, 0.0)

    def abort_all(self) -> None:
        """The device is gone (Faults.lose_device): every lane stops at once, without waiting.

        Queued jobs end ABORT, a running model is abandoned (ABORT when it returns, or at the TDR if it makes
        no progress: a Python thread cannot be interrupted), later submissions end ABORT. The lanes stay
        known, so destroy_context and stop still join their threads.
        """
        with self._lock:
            lanes = list(self._lanes.values())
        queued: list[Job] = []
        for lane in lanes:              # every lane stops taking jobs before any job ends
            with lane.cond:
                lane.closing = True
                if lane.task is not None:
                    lane.task.abandon()         # whatever it does now, the job ends ABORT
                queued += lane.jobs
                lane.jobs.clear()
                lane.cond.notify_all()
        for job in queued:
            self._end(job, _Outcome(ERT_CMD_STATE_ABORT, reason=self._abort_reason("before it ran")))

    def _abort_reason(self, when: str) -> str:
        """Why a job ends ABORT without a failure of its own: the device went, or its context did."""
        if self.device.lost:
            cause = "the device was lost"
        elif self._stopped or self.device.closing:
            cause = "the emulated device was closed"
        else:
            cause = "its hardware context was destroyed"
        return f"aborted {when}: {cause}"

    def _start_lane(self, ctx: HwCtx) -> _Lane:
        lane = _Lane()
        name = f"emu-ctx{ctx.handle}"
        lane.engine = _Engine(f"{name}-engine", lane.cond)
        lane.worker = threading.Thread(target=_firmware_thread, args=(self._work_loop, lane), name=name, daemon=True)
        self._lanes[id(ctx)] = lane
        lane.worker.start()
        return lane

    def _close_lane(self, lane: _Lane, grace: float) -> None:
        deadline = time.monotonic() + grace
        with lane.cond:
            while (lane.jobs or lane.running is not None) and (left := deadline - time.monotonic()) > 0:
                lane.cond.wait(left)
            lane.closing = True
            lane.cond.notify_all()
        lane.worker.join()
        lane.engine.retire()

    def _end_async(self, job: Job) -> None:
        # A job for a context already torn down: ABORT, off the submitting thread (it may hold driver locks).
        outcome = _Outcome(ERT_CMD_STATE_ABORT, reason=self._abort_reason("at submission"))
        threading.Thread(target=_firmware_thread, args=(self._end, job, outcome), daemon=True).start()

    # -- the worker ------------------------------------------------------------------------------

    def _work_loop(self, lane: _Lane) -> None:
        while (job := self._next_job(lane)) is not None:
            try:
                outcome = self._execute(lane, job)
            except Exception as exc:
                # An emulator defect must not wedge the context: report it and answer as a bad response.
                logger.exception("%s: internal firmware failure, command ends ABORT", _job_name(job))
                outcome = _Outcome(ERT_CMD_STATE_ABORT, reason=f"internal emulator failure: {type(exc).__name__}: "
                                                               f"{exc}")
            aborted = self._restart(lane) if outcome.state == ERT_CMD_STATE_TIMEOUT else []
            self._end(job, outcome)
            for other in aborted:
                self._end(other, _Outcome(ERT_CMD_STATE_ABORT, reason=f"aborted: the TDR reset the context after seq "
                                                                      f"{job.seq} timed out"))
            with lane.cond:
                lane.running = None
                lane.cond.notify_all()

    def _next_job(self, lane: _Lane) -> Job | None:
        with lane.cond:
            while not lane.jobs and not lane.closing:
                lane.cond.wait()
            if not lane.closing:
                lane.running = lane.jobs.popleft()
                return lane.running
            pending = list(lane.jobs)
            lane.jobs.clear()
        for job in pending:
            self._end(job, _Outcome(ERT_CMD_STATE_ABORT, reason=self._abort_reason("before it ran")))
        return None

    def _restart(self, lane: _Lane) -> list[Job]:
        """After a TDR: a fresh engine, and the context's other in-flight jobs to ABORT (docs/uapi.md 6.7)."""
        with lane.cond:
            old, lane.engine = lane.engine, _Engine(lane.engine.thread.name, lane.cond)
            aborted = list(lane.jobs)
            lane.jobs.clear()
        old.retire()
        return aborted

    def _execute(self, lane: _Lane, job: Job) -> _Outcome:
        _set_state(job.cmd_bo.mem, ERT_CMD_STATE_NEW)
        try:
            packet = read_packet(job.cmd_bo.mem)
            dispatches = self._dispatches(job, packet)
        except MalformedCommand as exc:
            logger.warning("%s: malformed command, state left NEW: %s", _job_name(job), exc)
            return _Outcome(ERT_CMD_STATE_NEW, reason=f"malformed command (the driver left it NEW): {exc}")
        if job.device.profile.null_firmware:
            # The null firmware (docs/emulator.md): a well-formed command completes as it is, nothing read or run.
            return _Outcome(ERT_CMD_STATE_COMPLETED)
        chain = packet.opcode == ERT_CMD_CHAIN
        for index, dispatch in enumerate(dispatches):
            state, op_idx, reason = self._run_dispatch(lane, job, dispatch)
            if state != ERT_CMD_STATE_COMPLETED:
                if chain:
                    reason = f"chain sub-command {index} (CMD BO handle {dispatch.bo.handle}): {reason}"
                return _Outcome(state, index if chain else None, dispatches[0].bo, op_idx, reason)
        return _Outcome(ERT_CMD_STATE_COMPLETED)

    def _end(self, job: Job, outcome: _Outcome) -> None:
        """Write the outcome into the command BO(s) and complete the job (exactly once per job)."""
        try:
            if outcome.state != ERT_CMD_STATE_COMPLETED:
                # Kept before the fence signals: a waiter woken by it finds the reason (EmuDevice.command_reason).
                job.device.record_failure(job, outcome.state, outcome.reason or "no reason recorded")
            if outcome.state in _FAILED_STATES:
                self._report_failure(job, outcome)
            _set_state(job.cmd_bo.mem, outcome.state)
        finally:
            job.complete()

    def _report_failure(self, job: Job, outcome: _Outcome) -> None:
        if outcome.state == ERT_CMD_STATE_TIMEOUT:
            # The app-health report GET_ARRAY HW_CONTEXT_ALL reads back; the emulated firmware has no program
            # counter or exception codes to give.
            job.ctx.health = {"txn_op_idx": outcome.txn_op_idx}
        # rule E11: error_index names the failed sub-command (docs/driver-rules.md)
        if outcome.error_index is not None:
            struct.pack_into("<I", job.cmd_bo.mem, CHAIN_ERROR_INDEX, outcome.error_index)
        # rule E12: the 0xFF payload and the health record are the out-of-tree driver's (amdxdna_cmd_set_error);
        # mainline up to 7.0 leaves the payload as it was (docs/emulator.md, Driver profiles).
        if not job.device.profile.staging_reports:
            return
        target = outcome.fill if outcome.fill is not None else self._fill_target(job)
        if target is None:
            return
        _fill_payload(target.mem)
        if outcome.state == ERT_CMD_STATE_TIMEOUT:
            _write_health(target.mem, outcome.txn_op_idx)

    def _fill_target(self, job: Job) -> Bo | None:
        """The BO whose payload a failure overwrites: a chain's first sub-command, else the command
        (docs/uapi.md 6.6)."""
        try:
            packet = read_packet(job.cmd_bo.mem)
            if packet.opcode != ERT_CMD_CHAIN:
                return job.cmd_bo
            return self._cmd_bo(job, _chain_handles(packet)[0])
        except MalformedCommand:
            return None

    # -- driver checks ---------------------------------------------------------------------------

    def _dispatches(self, job: Job, packet: Packet) -> list[Dispatch]:
        if packet.opcode != ERT_CMD_CHAIN:
            return [self._dispatch(job.ctx, job.cmd_bo, packet, lone=job.device.profile.single_cmd_path)]
        dispatches: list[Dispatch] = []
        for handle in _chain_handles(packet):
            bo = self._cmd_bo(job, handle)
            sub = read_packet(bo.mem)
            if sub.opcode == ERT_CMD_CHAIN or (dispatches and sub.opcode != dispatches[0].opcode):
                raise MalformedCommand(f"chain sub-command BO {handle} has opcode {sub.opcode}, the chain needs "
                                       f"one kernel opcode ({dispatches[0].opcode if dispatches else 'any'})")
            dispatches.append(self._dispatch(job.ctx, bo, sub))
        # rule E11: the chain's sub-commands share one opcode and fit the command list (docs/driver-rules.md)
        used = sum(d.slot_bytes for d in dispatches)
        if used > MAX_CHAIN_CMDBUF_SIZE:
            raise MalformedCommand(f"chain of {len(dispatches)} sub-commands needs {used} bytes of command list, "
                                   f"the buffer has {MAX_CHAIN_CMDBUF_SIZE}")
        return dispatches

    def _dispatch(self, ctx: HwCtx, bo: Bo, packet: Packet, lone: bool = False) -> Dispatch:
        """The driver's checks of one kernel packet; `lone`: sent as a single message, not through the command
        list (a command outside a chain before 0.6)."""
        if packet.opcode == ERT_START_CU:
            return self._start_cu(ctx, bo, packet, lone)
        if packet.opcode == ERT_START_NPU:
            return self._start_npu(ctx, bo, packet, lone)
        # rule E10: START_DPU is refused (docs/driver-rules.md)
        if packet.opcode == ERT_START_DPU:
            raise MalformedCommand("ERT_START_DPU is not accepted by AIE2 devices")
        if packet.opcode in (ERT_START_NPU_PREEMPT, ERT_START_NPU_PREEMPT_ELF):
            raise MalformedCommand(f"opcode {packet.opcode} (preemptible ELF flow) is not modelled by the emulator")
        raise MalformedCommand(f"unsupported ERT opcode {packet.opcode}")

    def _start_cu(self, ctx: HwCtx, bo: Bo, packet: Packet, lone: bool) -> Dispatch:
        cu = _configured_cu(ctx, packet.masks)
        if lone and len(packet.payload) > 4 * MAX_CF_MSG_WORDS:
            raise MalformedCommand(f"ERT_START_CU with {len(packet.payload) // 4} payload words: the single "
                                   f"EXECUTE_BUFFER_CF message holds {MAX_CF_MSG_WORDS} (feature level < 0.6 sends a "
                                   f"lone command outside the command list; a chain of one goes through it)")
        slot = CHAIN_SLOT_CF + len(packet.payload)
        if slot > MAX_CHAIN_CMDBUF_SIZE:
            raise MalformedCommand(f"ERT_START_CU with {len(packet.payload) // 4} args does not fit the command list")
        return Dispatch(bo, ERT_START_CU, cu, packet.payload, slot)

    def _start_npu(self, ctx: HwCtx, bo: Bo, packet: Packet, lone: bool) -> Dispatch:
        cu = _configured_cu(ctx, packet.masks)
        payload = packet.payload
        if len(payload) < START_NPU_PREAMBLE:
            raise MalformedCommand(f"ERT_START_NPU payload of {len(payload)} bytes lacks its 16-byte preamble")
        instr, size, prop_count = struct.unpack_from("<QII", payload)
        args_words = (len(payload) - START_NPU_PREAMBLE) // 4
        # rule E10: the NPU slot's argument budget (docs/driver-rules.md); a lone one before 0.6: the message's
        legacy = self.device.profile.legacy_dpu_slot
        limit = MAX_DPU_MSG_WORDS if lone else MAX_LEGACY_DPU_ARGS_WORDS if legacy else MAX_NPU_ARGS_WORDS
        if prop_count > args_words or args_words > limit:
            raise MalformedCommand(f"ERT_START_NPU: {prop_count} properties in {args_words} argument words "
                                   f"(at most {limit}{' in the single EXEC_DPU message' if lone else ''})")
        regmap = payload[START_NPU_PREAMBLE + 4 * prop_count:]
        return Dispatch(bo, ERT_START_NPU, cu, regmap, CHAIN_SLOT_NPU + 4 * args_words, instr, size)

    def _cmd_bo(self, job: Job, handle: int) -> Bo:
        # A chain names its sub-commands by handle, looked up when the job runs (docs/uapi.md 6.5), under the
        # driver's lock as the user may be closing handles meanwhile.
        with job.device.lock:
            bo = job.ctx.fd.bos.get(handle)
        if bo is None or bo.kind != AMDXDNA_BO_CMD:
            raise MalformedCommand(f"chain entry {handle} is not a command BO of this fd")
        return bo

    # -- firmware execution ----------------------------------------------------------------------

    def _run_dispatch(self, lane: _Lane, job: Job, dispatch: Dispatch) -> tuple[int, int, str | None]:
        """Run one kernel start -> (state, txn_op_idx for the health record, the reason of a failure)."""
        try:
            work = self._prepare(job, dispatch)
        except (FirmwareError, DeviceFault, txn.TxnError) as exc:
            return self._failed(job, f"firmware error: {exc}")
        fault = self._take_fault(work.digest)
        if fault == "error":
            return self._failed(job, f"injected firmware error for stream {work.digest}")
        if work.model is None and fault is None:
            return self._failed(job, f"no model bound to instruction stream sha256 {work.digest}")
        task = _Task(work.model, work.args, hang=fault == "hang")
        inline = fault is None and _runs_inline(work, self.inline_bytes)
        self.runs["inline" if inline else "engine"] += 1
        verdict = self._inline(lane, task) if inline else self._await(lane, task)
        if verdict == "done":
            self._record_writes(job, work)
        if verdict == "hung":
            reason = f"TDR: stream {work.digest} made no progress for {self.tdr_timeout:.3g} s"
            logger.error("%s: %s", _job_name(job), reason)
            return ERT_CMD_STATE_TIMEOUT, work.program.last_sync_index, reason
        if verdict == "closed":
            return ERT_CMD_STATE_ABORT, 0xFFFFFFFF, self._abort_reason("while its model ran")
        if task.error is None:
            return ERT_CMD_STATE_COMPLETED, 0xFFFFFFFF, None
        return ERT_CMD_STATE_ERROR, 0xFFFFFFFF, self._model_failure(job, work, task.error)

    @staticmethod
    def _failed(job: Job, reason: str) -> tuple[int, int, str]:
        logger.error("%s: %s", _job_name(job), reason)
        return ERT_CMD_STATE_ERROR, 0xFFFFFFFF, reason

    @staticmethod
    def _model_failure(job: Job, work: Work, error: BaseException) -> str:
        """Log a model's failure; the reason names the model and its message."""
        name = model_name(work.model)
        if isinstance(error, DeviceFault):
            reason = f"device fault in {name}: {error}"
            logger.error("%s: %s", _job_name(job), reason)
            return reason
        logger.error("%s: model %s raised", _job_name(job), name, exc_info=error)
        return f"model {name} raised {type(error).__name__}: {error}"

    def _prepare(self, job: Job, dispatch: Dispatch) -> Work:
        """Read what the dispatch runs from device memory: PDI, instructions, argument extents (under the driver's
        lock, so no SYNC_BO interleaves with the reads).

        Raises:
            FirmwareError: a refused stream or buffer (including one the CPU wrote after its last sync).
            DeviceFault: an address outside every BO.
            txn.TxnError: a malformed stream.
        """
        instr, claimed, what, slots = _regmap(dispatch)
        with job.device.lock:
            pdi = job.ctx.cus[dispatch.cu][0]
            _check_synced(pdi, 0, pdi.size, f"the PDI of CU {dispatch.cu}")
            bo, offset = job.memory.resolve(instr, txn.HEADER_WORDS * 4)
            if bo.kind != AMDXDNA_BO_DEV:
                raise FirmwareError(f"instruction stream at {instr:#x} is in a {bo.kind_name} BO, not in the heap "
                                    f"window")
            _check_synced(bo, offset, txn.HEADER_WORDS * 4, "the instruction stream")
            # The firmware takes the stream's length from its TXN header; the command's count only has to cover
            # it (rule 52: ninstr in words, as the mlir-aie C++ harnesses pass it, or in bytes, as IRON does).
            nbytes = txn.parse_header(_device_bytes(bo, offset, txn.HEADER_WORDS * 4).data).size
            if claimed < nbytes:
                raise FirmwareError(f"{what} is shorter than the TXN header's size of {nbytes} bytes")
            bo, offset = job.memory.resolve(instr, nbytes)
            _check_synced(bo, offset, nbytes, "the instruction stream")
            stream = _device_bytes(bo, offset, nbytes).data  # hashed in place; copied when first walked
            digest = stream_digest(stream)
            program = self._walk(digest, stream)
            extents = _patched_extents(job.memory, program, slots)
            for extent in extents:
                if extent.reads:
                    _check_synced(extent.bo, extent.offset, extent.length, f"arg {extent.arg_idx}")
            args = {e.arg_idx: _device_bytes(e.bo, e.offset, e.length) for e in extents}
        return Work(digest, program, args, self.models.lookup(digest), extents)

    @staticmethod
    def _record_writes(job: Job, work: Work) -> None:
        """After a model ran: the lines it wrote stay in device memory until a SYNC_BO over them (Memory
        coherence). A buffer the stream only writes (S2MM) counts as written whole, as its DMA covers it."""
        with job.device.lock:
            for extent in work.extents:
                view = extent.bo.view
                if view is not None:
                    start = extent.bo.view_offset + extent.offset
                    view.written(start, start + extent.length, whole=not extent.reads)

    def _walk(self, digest: str, stream: memoryview) -> txn.TxnProgram:
        """Walk a stream once per digest (a walk depends only on the bytes and the device generation).

        Raises:
            txn.TxnError: the stream is malformed or for another device generation.
        """
        with self._lock:
            program = self._programs.get(digest)
        if program is None:
            program = txn.walk(bytes(stream), self.dev_gen)
            with self._lock:
                if len(self._programs) >= PROGRAM_CACHE:
                    self._programs.pop(next(iter(self._programs)))
                self._programs[digest] = program
        return program

    @staticmethod
    def _inline(lane: _Lane, task: _Task) -> str:
        """Run a small compute-only model on the worker -> "done", or "closed" when the lane was torn down (or the
        device lost) while it ran. Nothing to watch: a model that computes is never timed out (TDR)."""
        with lane.cond:
            lane.task = task
        try:
            task.run_inline()
        finally:
            with lane.cond:
                lane.task = None
        return "closed" if task.abandoned else "done"

    def _await(self, lane: _Lane, task: _Task) -> str:
        """Run a task on the lane's engine -> "done", "hung" (TDR) or "closed" (context torn down)."""
        engine = lane.engine
        with lane.cond:
            lane.task = task
        engine.run(task)
        try:
            return self._watch(lane, engine, task)
        finally:
            with lane.cond:
                lane.task = None

    def _watch(self, lane: _Lane, engine: _Engine, task: _Task) -> str:
        with lane.cond:
            period = self.tdr_timeout * self.time_scale
            last, deadline = engine.cpu_time(), time.monotonic() + period
            while not task.done:
                if lane.closing and not task.abandoned:
                    task.abandon()
                if (left := deadline - time.monotonic()) > 0:
                    # Sliced: a huge (or infinite: never time out) TDR exceeds threading.TIMEOUT_MAX.
                    lane.cond.wait(min(left, WATCH_SLICE_S))
                    continue
                now = engine.cpu_time()
                # rule E12: the TDR times out a job without progress (docs/driver-rules.md)
                if now - last < period * PROGRESS_SHARE:
                    task.abandon()
                    return "closed" if lane.closing else "hung"
                last, deadline = now, time.monotonic() + period
            return "closed" if task.abandoned else "done"


def _runs_inline(work: Work, limit: int) -> bool:
    """Whether the dispatch's model may run on the worker: it says it only computes, and its buffers are small."""
    return (getattr(work.model, "compute_only", False) is True
            and sum(extent.length for extent in work.extents) <= limit)


def _txn_dev_gen(device: DeviceCore) -> int:
    gen = device.profile.txn_dev_gen
    if not isinstance(gen, int) or gen <= 0:
        raise ValueError(f"profile {device.profile.name!r} has no TXN device generation")
    return gen


def _job_name(job: Job) -> str:
    return f"hwctx {job.ctx.handle} seq {job.seq}"


def _configured_cu(ctx: HwCtx, masks: tuple[int, ...]) -> int:
    cu = cu_index(masks)
    if cu >= len(ctx.cus):
        raise MalformedCommand(f"CU {cu} is not configured on this context ({len(ctx.cus)} CUs)")
    return cu


def _chain_handles(packet: Packet) -> list[int]:
    """The sub-command BO handles of a chain payload (low 32 bits of each u64, docs/uapi.md 6.5).

    Raises:
        MalformedCommand: no sub-commands, or fewer handles than command_count.
    """
    payload = packet.payload
    if len(payload) < CHAIN_PREAMBLE:
        raise MalformedCommand(f"chain payload of {len(payload)} bytes lacks its {CHAIN_PREAMBLE}-byte preamble")
    count = struct.unpack_from("<I", payload)[0]
    if count == 0 or len(payload) < CHAIN_PREAMBLE + 8 * count:
        raise MalformedCommand(f"chain of {count} sub-commands in a {len(payload)}-byte payload")
    return [h & 0xFFFFFFFF for h in struct.unpack_from(f"<{count}Q", payload, CHAIN_PREAMBLE)]


def _regmap(dispatch: Dispatch) -> tuple[int, int, str, dict[int, int]]:
    """(instruction address, the most bytes the command's count can mean, that count named, buffer slots).

    Raises:
        FirmwareError: a regmap too short for the TXN kernel, another kernel opcode, an empty stream.
    """
    regmap = dispatch.regmap
    if dispatch.opcode == ERT_START_NPU:
        if dispatch.instr is None or dispatch.instr_size is None:     # _start_npu sets both from the preamble
            raise FirmwareError("ERT_START_NPU dispatch without its preamble's instruction address and size")
        instr, claimed = dispatch.instr, dispatch.instr_size
        if claimed == 0 or claimed % 4:
            raise FirmwareError(f"ERT_START_NPU instruction size {claimed} is not a positive multiple of 4")
        what = f"ERT_START_NPU instruction size {claimed}"
    elif len(regmap) < REGMAP_SLOTS:
        raise FirmwareError(f"regmap of {len(regmap)} bytes lacks opcode, instr and ninstr ({REGMAP_SLOTS} bytes)")
    else:
        instr = struct.unpack_from("<Q", regmap, REGMAP_INSTR)[0]
        ninstr = struct.unpack_from("<I", regmap, REGMAP_NINSTR)[0]
        if ninstr == 0:
            raise FirmwareError("regmap ninstr is 0")
        claimed, what = 4 * ninstr, f"regmap ninstr {ninstr} (words or bytes)"
    if len(regmap) >= 8 and (op := struct.unpack_from("<Q", regmap)[0]) != AIE2_EXEC_BUFFER_KERNEL_OP_TXN:
        raise FirmwareError(f"regmap kernel opcode {op} is not {AIE2_EXEC_BUFFER_KERNEL_OP_TXN} (TXN)")
    count = max(0, (len(regmap) - REGMAP_SLOTS) // 8)
    slots = {k: struct.unpack_from("<Q", regmap, REGMAP_SLOTS + 8 * k)[0] for k in range(count)}
    return instr, claimed, what, slots


def _patched_extents(memory: Memory, program: txn.TxnProgram, slots: dict[int, int]) -> list[Extent]:
    """Per arg_idx, the union of its BD extents resolved to one BO (docs/design.md 2), and whether any BD reads it.

    Raises:
        FirmwareError: a patch names a slot beyond the regmap, or one argument's extents span BOs.
        DeviceFault: an extent outside every BO.
    """
    extents: dict[int, tuple[int, int]] = {}
    reads: dict[int, bool] = {}
    for patch in program.patches:
        if patch.arg_idx not in slots:
            raise FirmwareError(f"TXN op {patch.op_index}: DDR_PATCH arg_idx {patch.arg_idx} has no regmap slot "
                                f"({len(slots)} slots)")
        start = slots[patch.arg_idx] + patch.arg_plus
        try:
            memory.resolve(start, patch.length)
        except DeviceFault as exc:
            # The BD's whole transfer must stay in the BO its address resolves to (docs/emulator.md, "DMA extents").
            raise DeviceFault(f"arg {patch.arg_idx}: the DMA of TXN op {patch.op_index} (DDR_PATCH of shim BD "
                              f"{patch.bd}, column {patch.col}: {patch.length} bytes at regmap slot "
                              f"{slots[patch.arg_idx]:#x} + arg_plus {patch.arg_plus}) faults: {exc}") from exc
        lo, hi = extents.get(patch.arg_idx, (start, start + patch.length))
        extents[patch.arg_idx] = (min(lo, start), max(hi, start + patch.length))
        directions = program.directions(patch)
        reads[patch.arg_idx] = reads.get(patch.arg_idx, False) or not directions or "mm2s" in directions
    resolved = []
    for arg_idx, (lo, hi) in sorted(extents.items()):
        try:
            bo, offset = memory.resolve(lo, hi - lo)
        except DeviceFault as exc:
            raise FirmwareError(f"arg {arg_idx}: its BD extents [{lo:#x}, {hi:#x}) span more than one BO") from exc
        resolved.append(Extent(arg_idx, bo, offset, hi - lo, reads[arg_idx]))
    return resolved


def _device_bytes(bo: Bo, offset: int, length: int) -> np.ndarray:
    """A writable uint8 view of `length` bytes at `offset` of `bo` as the device sees them."""
    if bo.view is None:                 # coherent: the pages themselves
        return np.frombuffer(bo.mem, dtype=np.uint8, count=length, offset=offset)
    start = bo.view_offset + offset
    return bo.view.dev[start:start + length]


def _check_synced(bo: Bo, offset: int, length: int, what: str) -> None:
    """Refuse device reads of bytes the CPU wrote after their last SYNC_BO (the device would read stale memory).

    Raises:
        FirmwareError: naming `what`, the BO's handle and type, and the byte range within the BO.
    """
    # rule 56: the device reads a buffer as of its last SYNC_BO (docs/emulator.md)
    if bo.view is None:
        return
    start = bo.view_offset + offset
    stale = bo.view.stale(start, start + length)
    if stale is not None:
        lo, hi = stale[0] - bo.view_offset, stale[1] - bo.view_offset
        raise FirmwareError(f"{what}: {bo.kind_name} BO handle {bo.handle}, bytes [{lo:#x}, {hi:#x}) were written by "
                            f"the CPU after the last sync (SYNC_BO that range before submitting)")


def _set_state(mem: memoryview, state: int) -> None:
    header = struct.unpack_from("<I", mem)[0]
    struct.pack_into("<I", mem, 0, (header & ~0xF & 0xFFFFFFFF) | state)


def _fill_payload(mem: memoryview) -> None:
    """0xFF over everything after the header, to the end of the BO (docs/uapi.md 6.6, the 2026-02 "fill invalid
    payload" fix), whatever the header's count says."""
    mem[4:] = b"\xff" * (len(mem) - 4)


def _write_health(mem: memoryview, txn_op_idx: int) -> None:
    """The context-health record at the start of the payload (docs/uapi.md 6.6, docs/xrt-sequence.md 1.9)."""
    if len(mem) - 4 >= CTX_HEALTH_BYTES:
        # version, npu_gen, txn_op_idx, ctx_pc, fatal_error_{type, exception_type, exception_pc, app_module}
        struct.pack_into("<8I", mem, 4, CTX_HEALTH_V1, NPU_GEN_AIE2, txn_op_idx, 0, 0, 0, 0, 0)
