"""Command submission and waits: EXEC_CMD, WAIT_CMD and the DRM syncobj ioctls (docs/uapi.md 4.7, 4.11, 5).

EXEC_CMD validates, books the job (seq, timeline point, BO references) and hands it to the firmware
(``emu/firmware.py``); the waits block on the device condition with the lock released.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import cast

from . import usermem
from .memory import AMDXDNA_BO_CMD, Bo
from .objects import Client, Fence, HwCtx, Job, Timeline, fail
from .state import DeviceState

HWCTX_MAX_CMDS = 4                  # jobs in flight per context (docs/uapi.md 4.7 step 6)
MAX_CMD_BO_SIZE = 32 << 10          # CMD BO limit checked at EXEC_CMD (docs/uapi.md 4.4 CMD, 4.7 step 3)
MAX_ARG_COUNT = 4095
AMDXDNA_CMD_SUBMIT_EXEC_BUF = 0
DRM_SYNCOBJ_CREATE_SIGNALED = 1
DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL, DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT = 1, 2
DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE, DRM_SYNCOBJ_WAIT_FLAGS_WAIT_DEADLINE = 4, 8
DRM_SYNCOBJ_QUERY_FLAGS_LAST_SUBMITTED = 1
WAIT_SLICE_S = 60.0
# kmalloc_array beyond KMALLOC_MAX_SIZE (x86_64: 1 << (MAX_PAGE_ORDER 10 + PAGE_SHIFT)) returns NULL, so DRM
# answers ENOMEM for a user array that large (drm_syncobj_array_find, the timeline points) before copying it.
KMALLOC_MAX_SIZE = 4 << 20


class SubmitIoctls(DeviceState):
    """EXEC_CMD, WAIT_CMD and SYNCOBJ_{CREATE,DESTROY,WAIT,TIMELINE_WAIT,RESET,SIGNAL,QUERY,TIMELINE_SIGNAL}
    (rules D8, E1-E7, E13).

    Mixed into ``EmuDevice`` (driver.py), whose ``lock``, ``cond``, ``profile``, ``firmware`` and reference
    counting (``unref_bo``) its methods use (declared by ``DeviceState``); ``driver._driver_table`` names the
    handlers.
    """

    def _ioctl_exec_cmd(self, client: Client, a: dict[str, int]) -> None:
        op = f"EXEC_CMD(hwctx={a['hwctx']}, cmd={a['cmd_handles'] & 0xFFFFFFFF})"
        # rule E1: ext and type (docs/driver-rules.md)
        if a["ext"] or a["ext_flags"]:
            raise fail(errno.EINVAL, op, "ext/ext_flags must be 0")
        if a["type"] != AMDXDNA_CMD_SUBMIT_EXEC_BUF:
            raise fail(errno.EINVAL, op, f"Invalid command type {a['type']}")
        # rule E2: arg_count, cmd_count, the args array (docs/driver-rules.md)
        if a["arg_count"] > MAX_ARG_COUNT:
            raise fail(errno.EINVAL, op, f"arg_count={a['arg_count']} > {MAX_ARG_COUNT}")
        if a["cmd_count"] != 1:
            raise fail(errno.EINVAL, op, f"cmd_count={a['cmd_count']} must be 1")
        raw = usermem.read(a["args"], 4 * a["arg_count"], op + " args")
        arg_handles = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
        with self.lock:
            cmd_bo, arg_bos = self._exec_bos(client, a["cmd_handles"] & 0xFFFFFFFF, arg_handles, op)
            ctx = client.contexts.get(a["hwctx"])
            # rule E5: the context is looked up after the BOs (docs/driver-rules.md)
            if ctx is None:
                raise fail(errno.EINVAL, op, "hwctx not found")
            # The lookups take the references (docs/uapi.md 4.7 step 4), before the wait for a slot: a GEM_CLOSE
            # while this call blocks drops only the handle (rule D7).
            held = (cmd_bo, *arg_bos)
            for bo in held:
                bo.refs += 1
            try:
                self._wait_for_slot(ctx, op)
                _check_unique(arg_bos, arg_handles, op)
            except BaseException:
                for bo in held:
                    self.unref_bo(bo)
                raise
            a["seq"] = self._submit(ctx, cmd_bo, arg_bos)

    def _wait_for_slot(self, ctx: HwCtx, op: str) -> None:
        """Block (lock released) while the context has HWCTX_MAX_CMDS jobs in flight (docs/uapi.md 4.7 step 6)."""
        # rule E6: four jobs in flight, a fifth waits (docs/driver-rules.md)
        while ctx.inflight >= HWCTX_MAX_CMDS and not (ctx.destroyed or self.lost or self.closing):
            self.cond.wait()
        if self.lost or self.closing:
            raise fail(errno.ENODEV, op, "device lost or closed while waiting for an in-flight slot")
        if ctx.destroyed:
            raise fail(errno.EINVAL, op, "hwctx destroyed while waiting for an in-flight slot")

    def _exec_bos(self, client: Client, cmd_handle: int, arg_handles: list[int], op: str) -> tuple[Bo, list[Bo]]:
        cmd_bo = client.bos.get(cmd_handle)
        # rule E3: a CMD BO of at most 32 KiB (docs/driver-rules.md)
        if cmd_bo is None or cmd_bo.kind != AMDXDNA_BO_CMD or cmd_bo.size > MAX_CMD_BO_SIZE:
            raise fail(errno.EINVAL, op, "Failed to get cmd bo (must be a CMD BO <= 32 KiB)")
        arg_bos = []
        for handle in arg_handles:
            bo = client.bos.get(handle)
            if bo is None:
                # rule E4: an unknown arg handle; the job references every arg BO (docs/driver-rules.md)
                raise fail(errno.ENOENT, op, f"arg handle {handle} not found")
            arg_bos.append(bo)
        return cmd_bo, arg_bos

    def _submit(self, ctx: HwCtx, cmd_bo: Bo, arg_bos: list[Bo]) -> int:
        # rule E7: seq from 0, the fence at timeline point seq (docs/driver-rules.md)
        seq = ctx.next_seq
        ctx.next_seq += 1
        fence = Fence()
        ctx.syncobj.add(seq, fence)
        ctx.stats["submissions"] += 1
        # The job owns the references EXEC_CMD took until Job.complete drops them (docs/uapi.md 4.7 step 4, rule D7).
        job = Job(self, ctx, seq, cmd_bo, arg_bos, fence)
        ctx.jobs[seq] = job
        self.firmware.submit(job)
        return seq

    def _ioctl_wait_cmd(self, client: Client, a: dict[str, int]) -> None:
        op = f"WAIT_CMD(hwctx={a['hwctx']}, seq={a['seq']})"
        if not self.profile.wait_cmd:
            raise fail(errno.EOPNOTSUPP, op, "AIE2 has no cmd_wait op upstream; wait on the hwctx syncobj")
        # rule E13: context, seq and timeout checks (docs/driver-rules.md)
        with self.lock:
            ctx = client.contexts.get(a["hwctx"])
            if ctx is None:
                raise fail(errno.EINVAL, op, "hwctx not found")
            if a["seq"] >= ctx.next_seq:
                raise fail(errno.EINVAL, op, "seq never submitted")
            job = ctx.jobs.get(a["seq"])       # None: the job has already ended
            deadline = None if a["timeout"] == 0 else time.monotonic() + a["timeout"] / 1000
            if job is not None and not self._wait_until(lambda: job.fence.signalled, deadline, op):
                raise fail(errno.ETIME, op, f"not done after {a['timeout']} ms")

    def _wait_until(self, predicate: Callable[[], bool], deadline: float | None, op: str) -> bool:
        """Wait on the device condition (lock held) until `predicate()` or `deadline` (time.monotonic).

        Raises:
            OSError: ENODEV when EmuDevice.close starts or the device is lost meanwhile (rule D5), also when the
                loss itself ended the awaited jobs (ABORT): the waiter learns of the loss at the wait
                (docs/emulator.md, Threads).
        """
        while True:
            if self.closing:
                raise fail(errno.ENODEV, op, "the emulated device was closed while waiting")
            if self.lost:
                raise fail(errno.ENODEV, op, "device lost while waiting (drm_dev_is_unplugged)")
            if predicate():
                return True
            remaining = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            # Sliced: INT64_MAX ns deadlines exceed threading.TIMEOUT_MAX; the loop re-checks anyway.
            self.cond.wait(min(remaining, WAIT_SLICE_S))

    # --- syncobjs (docs/uapi.md 5, rule D8) ---

    def _syncobj(self, client: Client, handle: int, op: str, code: int = errno.ENOENT) -> Timeline:
        timeline = client.syncobjs.get(handle)
        if timeline is None:
            raise fail(code, op, f"syncobj handle={handle} unknown")
        return timeline

    def _ioctl_syncobj_create(self, client: Client, a: dict[str, int]) -> None:
        if a["flags"] & ~DRM_SYNCOBJ_CREATE_SIGNALED:
            raise fail(errno.EINVAL, "SYNCOBJ_CREATE", f"flags={a['flags']:#x}")
        with self.lock:
            a["handle"] = Client.lowest_free(client.syncobjs)
            client.syncobjs[a["handle"]] = Timeline(signalled=bool(a["flags"] & DRM_SYNCOBJ_CREATE_SIGNALED))

    def _ioctl_syncobj_destroy(self, client: Client, a: dict[str, int]) -> None:
        op = f"SYNCOBJ_DESTROY(handle={a['handle']})"
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        with self.lock:
            if client.syncobjs.pop(a["handle"], None) is None:
                raise fail(errno.EINVAL, op, "unknown handle")

    def _handles(self, client: Client, a: dict[str, int], op: str) -> list[Timeline]:
        count = a["count_handles"]
        if count == 0:
            raise fail(errno.EINVAL, op, "count_handles is 0")
        raw = _user_array(a["handles"], count, 4, op, "handles")
        with self.lock:
            return [self._syncobj(client, int.from_bytes(raw[i:i + 4], "little"), op) for i in range(0, 4 * count, 4)]

    def _points(self, a: dict[str, int], op: str) -> list[int]:
        raw = _user_array(a["points"], a["count_handles"], 8, op, "points")
        return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]

    def _ioctl_syncobj_wait(self, client: Client, a: dict[str, int]) -> None:
        self._syncobj_wait(client, a, "SYNCOBJ_WAIT", None)

    def _ioctl_syncobj_timeline_wait(self, client: Client, a: dict[str, int]) -> None:
        self._syncobj_wait(client, a, "SYNCOBJ_TIMELINE_WAIT", "points")

    def _syncobj_wait(self, client: Client, a: dict[str, int], op: str, points_key: str | None) -> None:
        flags = a["flags"]
        known = (DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL | DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT
                 | DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE | DRM_SYNCOBJ_WAIT_FLAGS_WAIT_DEADLINE)
        if flags & ~known:
            raise fail(errno.EINVAL, op, f"flags={flags:#x}")
        timelines = self._handles(client, a, op)
        points = self._points(a, op) if points_key else [0] * len(timelines)
        deadline = _deadline(a["timeout_nsec"])
        with self.lock:
            # rule D8: a point not yet submitted needs WAIT_FOR_SUBMIT or WAIT_AVAILABLE, which waits for it (S3)
            if not flags & (DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT | DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE):
                for index, (tl, point) in enumerate(zip(timelines, points, strict=True)):
                    if tl.fences_for(point) is None:
                        raise fail(errno.EINVAL, op, f"entry {index}: point {point} not submitted")
            ready = _wait_predicate(timelines, points, flags)
            if not self._wait_until(lambda: ready() is not None, deadline, op):
                raise fail(errno.ETIME, op, "timeout")
            # Not None: the wait has just seen it so, and the lock has been held since.
            first = cast(int, ready())
            if not flags & DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL:
                a["first_signaled"] = first

    def _ioctl_syncobj_reset(self, client: Client, a: dict[str, int]) -> None:
        self._binary(client, a, "SYNCOBJ_RESET", None)

    def _ioctl_syncobj_signal(self, client: Client, a: dict[str, int]) -> None:
        self._binary(client, a, "SYNCOBJ_SIGNAL", Fence(True))

    def _binary(self, client: Client, a: dict[str, int], op: str, fence: Fence | None) -> None:
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        timelines = self._handles(client, a, op)
        with self.lock:
            for timeline in timelines:
                timeline.replace(fence)
            self.cond.notify_all()

    def _ioctl_syncobj_query(self, client: Client, a: dict[str, int]) -> None:
        op = "SYNCOBJ_QUERY"
        if a["flags"] & ~DRM_SYNCOBJ_QUERY_FLAGS_LAST_SUBMITTED:
            raise fail(errno.EINVAL, op, f"flags={a['flags']:#x}")
        timelines = self._handles(client, a, op)
        with self.lock:
            if a["flags"]:
                points = [tl.latest or 0 for tl in timelines]
            else:
                points = [tl.signalled_point() for tl in timelines]
        usermem.write(a["points"], b"".join(p.to_bytes(8, "little") for p in points), op + " points")

    def _ioctl_syncobj_timeline_signal(self, client: Client, a: dict[str, int]) -> None:
        op = "SYNCOBJ_TIMELINE_SIGNAL"
        if a["flags"]:
            raise fail(errno.EINVAL, op, f"flags={a['flags']:#x}")
        timelines = self._handles(client, a, op)
        points = self._points(a, op)
        with self.lock:
            for timeline, point in zip(timelines, points, strict=True):
                if point == 0:
                    timeline.replace(Fence(True))
                else:
                    timeline.add(point, Fence(True))
            self.cond.notify_all()


def _check_unique(arg_bos: list[Bo], arg_handles: list[int], op: str) -> None:
    """Rule 51 (inferred, docs/emulator.md): the job locks every argument BO's reservation
    (drm_gem_lock_reservations); taking the same BO's ww_mutex twice in one acquire context fails EALREADY.

    Raises:
        OSError: EALREADY naming the repeated handle and its positions.
    """
    first: dict[int, int] = {}
    for index, bo in enumerate(arg_bos):
        seen = first.setdefault(id(bo), index)
        if seen != index:
            raise fail(errno.EALREADY, op, f"arg {index} (handle {arg_handles[index]}) repeats arg {seen}: a BO's "
                                           f"reservation is locked once per job (errno inferred)")


def _user_array(addr: int, count: int, item_size: int, op: str, what: str) -> bytes:
    """kmalloc_array + copy_from_user of `count` items of `item_size` bytes at user address `addr`.

    Raises:
        OSError: ENOMEM (the array exceeds KMALLOC_MAX_SIZE), EFAULT (unreadable).
    """
    size = count * item_size
    if size > KMALLOC_MAX_SIZE:
        raise fail(errno.ENOMEM, op, f"{count} {what} ({size} bytes) exceed kmalloc's {KMALLOC_MAX_SIZE} bytes")
    return usermem.read(addr, size, f"{op} {what}")


def _deadline(timeout_nsec: int) -> float:
    """An absolute CLOCK_MONOTONIC ns timeout as a time.monotonic() deadline (<= now: poll)."""
    now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    return time.monotonic() + max(timeout_nsec - now_ns, 0) / 1e9


def _wait_predicate(timelines: list[Timeline], points: list[int], flags: int) -> Callable[[], int | None]:
    """A function returning the first ready entry's index (WAIT_ALL: 0 once all are), else None."""
    available_only = bool(flags & DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE)

    def ready_one(timeline: Timeline, point: int) -> bool:
        fences = timeline.fences_for(point)
        return fences is not None and (available_only or all(f.signalled for f in fences))

    def ready() -> int | None:
        states = [ready_one(tl, p) for tl, p in zip(timelines, points, strict=True)]
        if flags & DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL:
            return 0 if all(states) else None
        return states.index(True) if True in states else None

    return ready

