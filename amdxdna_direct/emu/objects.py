"""The driver's objects: the errno answer, fences and timelines, hardware contexts, jobs and open fds.

Shared by every ioctl family (``contexts``, ``buffers``, ``submit``, ``queries``) and by the dispatch in
``driver.py``; none of them issues an ioctl itself.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from . import usermem
from .memory import Bo, HeapAllocator, Memory
from .profiles import Profile

log = logging.getLogger(__name__)

MAX_HWCTX_ID = 255                  # per-fd cyclic context handles 1..255 (docs/uapi.md 4.1 step 9)
ERT_STATE_COMPLETED = 4


def fail(code: int, op: str, detail: str) -> OSError:
    """The driver's answer: an OSError with the errno; the text names the ioctl, fields and errno name."""
    message = f"{os.strerror(code)} [emu {op}: {errno.errorcode.get(code, code)} ({detail})]"
    log.debug("%s: %s (%s)", op, errno.errorcode.get(code, code), detail)
    return OSError(code, message)


class DeviceCore(Protocol):
    """What the driver's objects and the firmware use of the device (``EmuDevice``, declared by
    ``state.DeviceState``): they sit below it and never import it."""

    profile: Profile
    lock: threading.RLock
    cond: threading.Condition
    lost: bool
    closing: bool
    pasids: dict[int, int]

    def unref_bo(self, bo: Bo) -> None: ...

    def record_failure(self, job: Job, state: int, reason: str) -> None: ...


# =====================================================================================================
# Fences, timelines, contexts, jobs
# =====================================================================================================

class Fence:
    """A dma_fence: signalled once."""

    __slots__ = ("signalled",)

    def __init__(self, signalled: bool = False):
        self.signalled = signalled


class Timeline:
    """A DRM syncobj: a chain of (point, fence, prev_seqno) links (dma_fence_chain semantics, docs/uapi.md 5).

    A link continues the chain (prev_seqno = the previous point) when its point is later than the latest;
    otherwise dma_fence_chain_init gives it the latest point and a new fence context (prev_seqno 0), and a
    link over a plain fence (CREATE_SIGNALED, a binary signal, an empty syncobj) starts one too. A plain
    fence is stored with prev_seqno -1. Waiting on point P is dma_fence_chain_find_seqno: walking back from
    the head, the first link whose prev_seqno is below P, with every link before it; point 0 waits for the
    latest fence. Signalled links at the head of the list are pruned, remembering their point.
    """

    def __init__(self, signalled: bool = False):
        self.links: list[tuple[int, Fence, int]] = [(0, Fence(True), -1)] if signalled else []
        self.pruned_point: int | None = None

    def add(self, point: int, fence: Fence) -> None:
        """Append a point (EXEC_CMD's job fence, TIMELINE_SIGNAL's stub); the timeline never goes backwards."""
        head = self.links[-1] if self.links else None
        if head is None or head[2] < 0:
            prev = 0                        # no chain before it: a new fence context
        elif point > head[0]:
            prev = head[0]
        else:
            point, prev = head[0], 0        # "make sure that we always have a valid sequence number"
        self.links.append((point, fence, prev))
        while len(self.links) > 1 and self.links[0][1].signalled:
            self.pruned_point = self.links.pop(0)[0]

    @property
    def latest(self) -> int | None:
        """The last submitted point, or None for an empty syncobj."""
        if self.links:
            return self.links[-1][0]
        return self.pruned_point

    def fences_for(self, point: int) -> list[Fence] | None:
        """Fences that must signal for `point`; None when the point was never submitted."""
        latest = self.latest
        if latest is None or point > latest:
            return None
        index = len(self.links) - 1
        if point:
            while index >= 0 and self.links[index][2] >= point:
                index -= 1
        # Walking past the first kept link means the link found was signalled and pruned.
        return [fence for _, fence, _ in self.links[:index + 1]]

    def signalled_point(self) -> int:
        """The last point such that it and every earlier link are signalled (SYNCOBJ_QUERY)."""
        point = self.pruned_point or 0
        for link_point, fence, _ in self.links:
            if not fence.signalled:
                break
            point = link_point
        return point

    def replace(self, fence: Fence | None) -> None:
        """Binary signal (a signalled stub) or reset (no fence)."""
        self.links = [] if fence is None else [(0, fence, -1)]
        self.pruned_point = None


@dataclass(eq=False)
class HwCtx:
    """A hardware context (driver side)."""

    handle: int
    syncobj: Timeline
    syncobj_handle: int
    start_col: int
    num_col: int
    fd: Client
    priority: int
    qos: dict[str, int]
    fw_id: int
    pid: int
    internal_bos: list[Bo] = field(default_factory=list)
    cus: list[tuple[Bo, int]] = field(default_factory=list)
    cu_refs: bool = False           # the context holds a reference to each CU's PDI BO (out of tree only, S1)
    dbg_bos: list[Bo] = field(default_factory=list)
    stats: collections.Counter[str] = field(default_factory=collections.Counter)
    next_seq: int = 0
    jobs: dict[int, Job] = field(default_factory=dict)       # seq -> the jobs in flight (fences, BO references)
    destroyed: bool = False
    # The firmware's app-health report of the context (GET_ARRAY HW_CONTEXT_ALL): set at a TDR timeout.
    health: dict[str, int] = field(default_factory=dict)

    @property
    def inflight(self) -> int:
        """Jobs submitted and not yet ended (at most HWCTX_MAX_CMDS, docs/uapi.md 4.7 step 6)."""
        return len(self.jobs)


class Job:
    """One EXEC_CMD submission handed to the firmware."""

    def __init__(self, device: DeviceCore, ctx: HwCtx, seq: int, cmd_bo: Bo, arg_bos: list[Bo], fence: Fence):
        self.device = device
        self.ctx = ctx
        self.seq = seq
        self.cmd_bo = cmd_bo
        self.arg_bos = arg_bos
        self.memory = ctx.fd.memory
        self.fence = fence
        self.done = False

    def complete(self, state: int | None = None) -> None:
        """End the job (firmware calls this exactly once, whatever the outcome).

        Signals the timeline point ``seq``, frees the in-flight slot, drops the BO references and
        counts the completion (an error unless the state is COMPLETED). `state` defaults to the state
        nibble of the command BO header.

        Raises:
            RuntimeError: the job was already completed.
        """
        dev = self.device
        with dev.lock:
            if self.done:
                raise RuntimeError(f"job seq={self.seq} of context {self.ctx.handle} completed twice")
            self.done = True
            if state is None:
                state = self.cmd_bo.mem[0] & 0xF
            self.ctx.stats["completions"] += 1
            if state != ERT_STATE_COMPLETED:
                self.ctx.stats["errors"] += 1
            self.fence.signalled = True
            del self.ctx.jobs[self.seq]
            for bo in (self.cmd_bo, *self.arg_bos):
                dev.unref_bo(bo)
            dev.cond.notify_all()


# =====================================================================================================
# Clients (open fds)
# =====================================================================================================

class Client:
    """Per-fd driver state (amdxdna_client + drm_file): handle tables, heap, contexts, syncobjs."""

    def __init__(self, device: DeviceCore):
        self.device = device
        self.pid = os.getpid()
        self.comm = usermem.process_name()      # the opener's task comm (the OOT hwctx entry's name)
        # SVA binds the process's mm at open: one PASID per process, allocated by the IOMMU (docs/uapi.md 7, open).
        self.pasid = device.pasids.setdefault(self.pid, len(device.pasids) + 1)
        self.memory = Memory(device.lock)
        if device.profile.expandable_heap:
            # drm_mm_init over the whole window at open: DEV BOs are placed before chunks are checked (docs/uapi.md
            # 4.4).
            self.memory.allocator = HeapAllocator(device.profile.dev_heap_max_size)
        self.bos: dict[int, Bo] = {}
        self.syncobjs: dict[int, Timeline] = {}
        self.contexts: dict[int, HwCtx] = {}
        self.closing: list[HwCtx] = []          # contexts being destroyed (still own columns)
        self.last_ctx_handle = 0
        self.closed = False
        self.descriptors = 1                    # fds sharing this open file (EmuSeam.dup)
        self.listed = True                      # on the device's client list (amdxdna_flush unlinks it)
        self.flushes = 0                        # amdxdna_flush runs that destroyed contexts of this file
        # ioctls running on this fd: each holds the file like fget() does, so the release that close
        # triggers runs when the last of them returns (fput), never under a call still using the fd.
        self.users = 0

    @staticmethod
    def lowest_free(table: Mapping[int, object]) -> int:
        """idr_alloc(1, 0): the lowest free handle from 1 (GEM and syncobj handles)."""
        handle = 1
        while handle in table:
            handle += 1
        return handle

    def next_ctx_handle(self) -> int | None:
        """xa_alloc_cyclic over 1..MAX_HWCTX_ID (docs/uapi.md 4.1 step 9), None when every id is live."""
        for step in range(1, MAX_HWCTX_ID + 1):
            handle = (self.last_ctx_handle + step - 1) % MAX_HWCTX_ID + 1
            if handle not in self.contexts and all(c.handle != handle for c in self.closing):
                self.last_ctx_handle = handle
                return handle
        return None

