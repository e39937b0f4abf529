"""The emulated amdxdna driver: the ioctl table, DRM dispatch, the device, its fds and the seam.

Behaviour follows docs/uapi.md (7.0-era AIE2 driver unless a profile option says otherwise)
and the numbered rules of docs/driver-rules.md; comments cite the section. The ioctl handlers live by
family (docs/emulator.md, Modules): ``contexts.py`` (CREATE/DESTROY/CONFIG_HWCTX), ``buffers.py``
(CREATE_BO, GET_BO_INFO, SYNC_BO, GEM_CLOSE, PRIME), ``submit.py`` (EXEC_CMD, WAIT_CMD, syncobjs) and
``queries.py`` (VERSION, GET_CAP, GET_INFO, GET_ARRAY, SET_STATE), each a mixin of ``EmuDevice``. This
module keeps the one table from request number to handler (``_driver_table``) and the dispatch through
it (``EmuDevice.ioctl``). Command execution belongs to the firmware (``emu/firmware.py``).

Locking: one re-entrant lock per device (``EmuDevice.lock``) guards every table; ``EmuDevice.cond``
wakes waiters (fences, in-flight slots). Nothing blocks while holding the lock except on ``cond``
(which releases it); the firmware worker calls ``Job.complete`` concurrently with user ioctls.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import operator
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex

from . import layouts as L
from . import usermem
from .buffers import BoIoctls
from .contexts import ContextIoctls
from .firmware import Firmware, in_firmware_thread
from .memory import AMDXDNA_INVALID_ADDR, DEV_HEAP_CHUNK, PAGE_SIZE, Bo, heap_allocator, page_align, release_backing
from .objects import Client, HwCtx, Job, fail
from .profiles import DEFAULT_PROFILE, Profile, resolve
from .queries import POWER_MODE_DEFAULT, POWER_MODE_HIGH, POWER_MODE_TURBO, QueryIoctls
from .state import Counters, Faults
from .submit import WAIT_SLICE_S, SubmitIoctls

if TYPE_CHECKING:
    class Buffer(Protocol):
        """Any object with the buffer protocol (``collections.abc.Buffer`` from Python 3.12; the emulator imports
        nothing beyond the standard library, numpy and ml_dtypes, not even typing_extensions)."""

        def __buffer__(self, flags: int, /) -> memoryview: ...

log = logging.getLogger(__name__)

# --- _IOC request layout (asm-generic/ioctl.h; docs/uapi.md 1) ---
IOC_NRBITS, IOC_TYPEBITS, IOC_SIZEBITS = 8, 8, 14
IOC_NRSHIFT = 0
IOC_TYPESHIFT = IOC_NRSHIFT + IOC_NRBITS
IOC_SIZESHIFT = IOC_TYPESHIFT + IOC_TYPEBITS
IOC_DIRSHIFT = IOC_SIZESHIFT + IOC_SIZEBITS
IOC_WRITE, IOC_READ = 1, 2          # IOC_WRITE: user -> kernel ("IN"), IOC_READ: kernel -> user ("OUT")
DRM_IOCTL_BASE = ord("d")
DRM_COMMAND_BASE = 0x40

# --- device constants ---
DRM_VMA_OFFSET_START = 0x100000 << 12   # DRM_FILE_PAGE_OFFSET_START: fake mmap offsets begin at 4 GiB
CLOSE_DRAIN_S = 10.0                # EmuDevice.close waits this long for ioctls still running on its fds
FAILURES_KEPT = 256                 # failed commands whose reason EmuDevice.command_reason still answers


# =====================================================================================================
# The device
# =====================================================================================================

@dataclass(frozen=True)
class Failure:
    """The firmware's record of one failed command (docs/emulator.md, "Why a command failed")."""

    client: Client
    hwctx: int
    seq: int
    state: int
    reason: str


@dataclass(frozen=True)
class IoctlDef:
    """One entry of the driver's (or DRM core's) ioctl table."""

    name: str
    layout: L.Layout
    direction: int
    handler: str | None             # EmuDevice method "_ioctl_<handler>"; None: known to DRM, not modelled
    root_only: bool = False


_OPAQUE = L.Layout("unmodelled", (), "<")


def _driver_table(profile: Profile) -> dict[int, IoctlDef]:
    rw = IOC_READ | IOC_WRITE
    table = {
        0x00: IoctlDef("VERSION", L.drm_version, rw, "version"),
        0x09: IoctlDef("GEM_CLOSE", L.gem_close, IOC_WRITE, "gem_close"),
        0x0C: IoctlDef("GET_CAP", L.get_cap, rw, "get_cap"),
        0x2D: IoctlDef("PRIME_HANDLE_TO_FD", L.prime_handle, rw, "prime_handle_to_fd"),
        0x2E: IoctlDef("PRIME_FD_TO_HANDLE", L.prime_handle, rw, "prime_fd_to_handle"),
        0xBF: IoctlDef("SYNCOBJ_CREATE", L.syncobj_create, rw, "syncobj_create"),
        0xC0: IoctlDef("SYNCOBJ_DESTROY", L.syncobj_destroy, rw, "syncobj_destroy"),
        0xC3: IoctlDef("SYNCOBJ_WAIT", L.syncobj_wait, rw, "syncobj_wait"),
        0xC4: IoctlDef("SYNCOBJ_RESET", L.syncobj_array, rw, "syncobj_reset"),
        0xC5: IoctlDef("SYNCOBJ_SIGNAL", L.syncobj_array, rw, "syncobj_signal"),
        0xCA: IoctlDef("SYNCOBJ_TIMELINE_WAIT", L.syncobj_timeline_wait, rw, "syncobj_timeline_wait"),
        0xCB: IoctlDef("SYNCOBJ_QUERY", L.syncobj_timeline_array, rw, "syncobj_query"),
        0xCD: IoctlDef("SYNCOBJ_TIMELINE_SIGNAL", L.syncobj_timeline_array, rw, "syncobj_timeline_signal"),
    }
    # Present in DRM's table but not modelled: a clear EOPNOTSUPP rather than a misleading EINVAL.
    for nr, name in ((0xC1, "SYNCOBJ_HANDLE_TO_FD"), (0xC2, "SYNCOBJ_FD_TO_HANDLE"), (0xCC, "SYNCOBJ_TRANSFER"),
                     (0xCF, "SYNCOBJ_EVENTFD")):
        table[nr] = IoctlDef(name, _OPAQUE, rw, None)
    driver = [("CREATE_HWCTX", L.create_hwctx, rw, "create_hwctx"),
              ("DESTROY_HWCTX", L.destroy_hwctx, rw, "destroy_hwctx"),
              ("CONFIG_HWCTX", L.config_hwctx, rw, "config_hwctx"),
              ("CREATE_BO", L.create_bo, rw, "create_bo"),
              ("GET_BO_INFO", L.get_bo_info, rw, "get_bo_info"),
              ("SYNC_BO", L.sync_bo, rw, "sync_bo"),
              ("EXEC_CMD", L.exec_cmd, rw, "exec_cmd"),
              ("GET_INFO", L.get_info, rw, "get_info")]
    for index, (name, layout, direction, handler) in enumerate(driver):
        table[DRM_COMMAND_BASE + index] = IoctlDef(name, layout, direction, handler)
    table[DRM_COMMAND_BASE + 8] = IoctlDef("SET_STATE", L.set_state, rw, "set_state", root_only=True)
    # Slot 9: WAIT_CMD is IOWR out of tree (docs/uapi.md 12), IOW in mainline >= 0.10, an empty slot before
    # (docs/uapi.md 1b).
    if profile.wait_cmd or profile.drm_minor >= 10:
        table[DRM_COMMAND_BASE + 9] = IoctlDef("WAIT_CMD", L.wait_cmd, rw if profile.wait_cmd else IOC_WRITE,
                                               "wait_cmd")
    if profile.drm_minor >= 1:
        table[DRM_COMMAND_BASE + 10] = IoctlDef("GET_ARRAY", L.get_array, rw, "get_array")
    return table


class EmuDevice(ContextIoctls, BoIoctls, SubmitIoctls, QueryIoctls):
    """One emulated PCI NPU with the amdxdna driver bound (docs/design.md section 2)."""

    def __init__(self, profile: str | Profile = DEFAULT_PROFILE, *, cap_sys_admin: bool | None = None,
                 time_scale: float = 1.0, **options: Any):
        """Bring up the device: driver state, then the firmware worker.

        Args:
            profile: a Profile, or a name ``<npu>[:<driver>][:coherent]`` (``npu1``, ``npu4:linux-6.18``; the
                driver defaults to the newest mainline kernel modelled, docs/emulator.md "Driver profiles").
            cap_sys_admin: whether callers count as root for DRM_ROOT_ONLY ioctls (default: euid 0).
            time_scale: the emulator's clock against the wall clock: every timeout the driver or firmware waits
                out (TDR, DESTROY_HWCTX's grace) lasts `time_scale` times its modelled length, so a test sees a
                60 s drm_sched timeout in 60 x time_scale seconds (messages give the modelled seconds).
            options: Profile field overrides, e.g. ``tdr_timeout=2.0`` (seconds), ``drm_minor=10``,
                ``wait_cmd=True``, ``expandable_heap=True``, ``coherent=True`` (no device copy of buffers: SYNC_BO
                changes nothing), ``hwctx_entry_size=160``.

        Raises:
            KeyError: unknown profile, NPU or driver name.
            TypeError: unknown option, or a tdr_timeout / time_scale that is not a number.
            ValueError: dev_heap_max_size is not a positive multiple of 64 MiB, hwctx_entry_size is not 144 or 160,
                or tdr_timeout / time_scale is not > 0.
        """
        base = profile if isinstance(profile, Profile) else resolve(profile)
        # `options` are Any: each has its own Profile field's type (dataclasses.replace refuses an unknown name).
        self.profile = dataclasses.replace(base, **options) if options else base
        max_size = self.profile.dev_heap_max_size
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= 0 or max_size % DEV_HEAP_CHUNK:
            raise ValueError(f"dev_heap_max_size must be a positive multiple of 64 MiB, got {max_size!r}")
        if self.profile.hwctx_entry_size not in (L.hwctx_entry.size, L.hwctx_entry_oot.size):
            raise ValueError(f"hwctx_entry_size must be {L.hwctx_entry.size} (mainline) or {L.hwctx_entry_oot.size} "
                             f"(staging/out-of-tree), got {self.profile.hwctx_entry_size!r}")
        self.cap_sys_admin = os.geteuid() == 0 if cap_sys_admin is None else cap_sys_admin
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        # The process's mmap_lock as far as the seam's mmap/munmap go: a munmap waiting for a job's fence keeps
        # mmap/munmap of other threads (and the fd release's unmapping) out of its range until it is done.
        self.mm_lock = threading.RLock()
        self.clients: list[Client] = []
        self.lost = False
        self.live_bos = 0
        self.power_mode = POWER_MODE_DEFAULT
        self.preempt_state = {"force": 0, "frame_boundary": 0}
        self.last_async_error = {"err_code": 0, "ts_us": 0, "ex_err_code": 0}
        self.next_map_offset = DRM_VMA_OFFSET_START
        self.next_fw_id = 0
        self.pasids: dict[int, int] = {}                # pid -> PASID of its SVA binding
        self.exports: dict[tuple[int, int], Bo] = {}    # (st_dev, st_ino) of exported memfds -> BO
        self.table = _driver_table(self.profile)
        self.counters = Counters(self)
        self.faults = Faults(self)
        self.firmware = Firmware(self, tdr_timeout=self.profile.tdr_timeout, time_scale=time_scale)
        self.models = self.firmware.models
        self.closing = False            # close() started: blocked ioctls give up (ENODEV)
        self.closed = False
        self.failures: collections.deque[Failure] = collections.deque(maxlen=FAILURES_KEPT)
        if self.profile.flush_on_close:
            _watch_children(self)

    # --- why a command failed (docs/emulator.md, "Why a command failed") ---

    def command_reason(self, hwctx: int, seq: int, seam: EmuSeam | None = None) -> str | None:
        """The emulated firmware's reason for the failure of command `seq` of context `hwctx`, or None.

        Kept for the last FAILURES_KEPT failed commands of the device (any state but COMPLETED: ERROR, ABORT,
        TIMEOUT, and NEW for a packet the driver refused), from before the command's fence signals, so a wait
        that returns finds it. Context handles are per fd: give the `seam` the context belongs to (as
        ``EmuSeam.command_reason`` does); without one, the newest record of any fd with that handle and seq.
        A record goes when its fd is released or a new context of the fd reuses the handle.

        Raises:
            TypeError: `hwctx` or `seq` is not an int, or `seam` is not an EmuSeam of this device.
        """
        hwctx, seq = _ints("command_reason", hwctx=hwctx, seq=seq)
        if seam is not None and (not isinstance(seam, EmuSeam) or seam.device is not self):
            raise TypeError(f"command_reason: seam must be an EmuSeam of this device, got {type(seam).__name__}")
        with self.lock:
            for failure in reversed(self.failures):
                if (failure.hwctx == hwctx and failure.seq == seq
                        and (seam is None or failure.client is seam.client)):
                    return failure.reason
        return None

    def record_failure(self, job: Job, state: int, reason: str) -> None:
        """Keep the reason of a failed job (the firmware calls this before the job completes)."""
        with self.lock:
            self.failures.append(Failure(job.ctx.fd, job.ctx.handle, job.seq, state, reason))

    def forget_failures(self, client: Client, hwctx: int | None = None) -> None:
        """Drop the records of `client` (of its context handle `hwctx` only, when given)."""
        with self.lock:
            kept = [f for f in self.failures if not (f.client is client and hwctx in (None, f.hwctx))]
            if len(kept) != len(self.failures):
                self.failures = collections.deque(kept, maxlen=FAILURES_KEPT)

    # --- life cycle ---

    def open(self) -> EmuSeam:
        """A new fd on this device.

        Raises:
            OSError: ENODEV when the device was lost or closed.
        """
        with self.lock:
            if self.lost or self.closing:
                raise fail(errno.ENODEV, "open", f"device {self.profile.name} is gone")
            client = Client(self)
            self.clients.append(client)
        return EmuSeam(self, client)

    def close(self) -> None:
        """Close every fd (destroying their contexts) and stop the firmware worker. Idempotent.

        Ioctls blocked in a wait give up with ENODEV; an fd with an ioctl still running is released when that
        ioctl returns, which close waits for (up to CLOSE_DRAIN_S).
        """
        with self.lock:
            if self.closing:
                return
            self.closing = True
            self.cond.notify_all()
        for client in list(self.clients):
            self.close_client(client)
        with self.lock:
            # An fd whose last ioctl is still returning is released by that ioctl (bounded: waits give up).
            deadline = time.monotonic() + CLOSE_DRAIN_S
            while self.clients and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
        self.firmware.stop()
        self.closed = True

    def __enter__(self) -> EmuDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def contexts(self) -> list[HwCtx]:
        """Every live context of every fd (including ones being destroyed: they still hold columns)."""
        return [ctx for c in self.clients for ctx in (*c.contexts.values(), *c.closing)]

    @property
    def listed_contexts(self) -> list[HwCtx]:
        """The contexts the driver's queries walk: those of the fds still on the device's client list."""
        return [ctx for ctx in self.contexts if ctx.fd.listed]

    def current_clocks(self) -> tuple[int, int]:
        """(MP-NPU, H-clock) MHz at the current power mode: top DPM level unless DEFAULT."""
        levels = self.profile.dpm_clocks
        return levels[-1] if self.power_mode in (POWER_MODE_HIGH, POWER_MODE_TURBO) else levels[0]

    def hwctx_limit(self) -> int:
        """The firmware context limit (the profile's, or lower by fault injection)."""
        cap = self.faults.context_cap
        return self.profile.hwctx_limit if cap is None else min(cap, self.profile.hwctx_limit)

    # --- user mappings (docs/uapi.md 7, lifetime) ---

    def may_block(self) -> bool:
        """Whether the calling thread may wait for jobs: not a firmware thread, not inside the driver's lock
        (a finalizer's munmap run by the garbage collector there would wait for what its thread holds up)."""
        # _is_owned is CPython's own (the C RLock has it, threading.Condition relies on it) but private, so
        # typeshed leaves it out of RLock.
        return not in_firmware_thread() and not self.lock._is_owned()  # type: ignore[attr-defined]

    def mm_locked(self) -> contextlib.AbstractContextManager[object]:
        """The mm lock (mmap, munmap, the fd release's unmapping), or no lock where waiting is not allowed."""
        return self.mm_lock if self.may_block() else contextlib.nullcontext()

    def wait_for_mapped_jobs(self, client: Client, addr: int, length: int) -> bool:
        """Wait (lock released) for the in-flight jobs taking as an argument a BO that `client` maps in
        [addr, addr+length), as the MMU notifier waits on the BO's fences (docs/uapi.md 7). A lost or closing device
        ends the wait: its jobs end without resolving addresses. Returns whether it waited."""
        with self.lock:
            mapped = {id(bo) for _, _, bo, _ in client.memory.overlapping(addr, length)}
            fences = [job.fence for ctx in self.contexts for job in ctx.jobs.values()
                      if any(id(bo) in mapped for bo in job.arg_bos)]
            waited = False
            while not all(fence.signalled for fence in fences) and not (self.lost or self.closing):
                self.cond.wait(WAIT_SLICE_S)
                waited = True
            return waited

    # --- BO references ---

    def unref_bo(self, bo: Bo) -> None:
        """Drop one reference; the last one releases the backing (and a DEV BO's heap range)."""
        with self.lock:
            bo.refs -= 1
            if bo.refs > 0:
                return
            self.live_bos -= 1
            if bo.heap is not None:
                memory = bo.fd_memory
                if memory is None:      # every DEV BO gets its fd's Memory where it is placed (BoIoctls._place_dev_bo)
                    raise RuntimeError(f"DEV BO at heap offset {bo.heap_offset:#x} has no fd memory (an emulator bug)")
                heap_allocator(memory).free(bo.heap_offset)
                memory.remove_dev_bo(bo.heap_offset)
                bo.released = True
                for heap in (bo.heap, *bo.more_heaps):
                    self.unref_bo(heap)
            else:
                release_backing(bo)
                for key in [k for k, exported in self.exports.items() if exported is bo]:
                    del self.exports[key]

    # --- ioctl dispatch (docs/uapi.md 4.0) ---

    def ioctl(self, client: Client, request: int, buf: Buffer, descriptor_closed: bool = False) -> int:
        """Dispatch one raw ioctl like drm_ioctl(); returns 0 (`descriptor_closed`: the caller's dup is closed).

        Raises:
            OSError: the driver's errno (ENOTTY, EINVAL, ENODEV, EACCES, EFAULT and per-ioctl errnos).
        """
        nr = (request >> IOC_NRSHIFT) & ((1 << IOC_NRBITS) - 1)
        type_byte = (request >> IOC_TYPESHIFT) & ((1 << IOC_TYPEBITS) - 1)
        entry = self.table.get(nr) if type_byte == DRM_IOCTL_BASE else None
        op = entry.name if entry is not None else f"ioctl({request:#x})"
        with self.lock:
            if client.closed or descriptor_closed:
                raise fail(errno.EBADF, op, "fd closed")
            client.users += 1
        try:
            return self._dispatch(client, entry, op, request, buf)
        finally:
            self._put_client(client)

    def _dispatch(self, client: Client, entry: IoctlDef | None, op: str, request: int, buf: Buffer) -> int:
        # rule D5: an unplugged device answers every ioctl ENODEV (docs/driver-rules.md)
        if self.lost:
            raise fail(errno.ENODEV, op, "device lost (drm_dev_is_unplugged)")
        if entry is None:
            type_byte = (request >> IOC_TYPESHIFT) & ((1 << IOC_TYPEBITS) - 1)
            if type_byte != DRM_IOCTL_BASE:
                # rule D1: the type byte must be DRM's 'd' (docs/driver-rules.md)
                raise fail(errno.ENOTTY, op, f"type byte {type_byte:#x} is not 'd'")
            nr = (request >> IOC_NRSHIFT) & ((1 << IOC_NRBITS) - 1)
            # rule D2: a nr outside the table, or an empty slot (docs/driver-rules.md)
            raise fail(errno.EINVAL, op, f"nr {nr:#x} not in the driver's table")
        user_size = (request >> IOC_SIZESHIFT) & ((1 << IOC_SIZEBITS) - 1)
        user_dir = request >> IOC_DIRSHIFT
        with self.lock:
            self.counters.ioctls[entry.name] += 1
        # rule D4: DRM_ROOT_ONLY (SET_STATE) needs CAP_SYS_ADMIN (docs/driver-rules.md)
        if entry.root_only and not self.cap_sys_admin:
            raise fail(errno.EACCES, entry.name, "DRM_ROOT_ONLY without CAP_SYS_ADMIN")
        if entry.handler is None:
            raise fail(errno.EOPNOTSUPP, entry.name, "sync-file / eventfd / transfer are not modelled by the emulator")
        kdata, view, out_size = self._copy_in(entry, user_dir, user_size, buf)
        args = entry.layout.unpack(kdata)
        getattr(self, "_ioctl_" + entry.handler)(client, args)
        entry.layout.pack_into(kdata, 0, args)
        if out_size:
            view[:out_size] = kdata[:out_size]
        return 0

    @staticmethod
    def _copy_in(entry: IoctlDef, user_dir: int, user_size: int, buf: Buffer) -> tuple[bytearray, memoryview, int]:
        """The kernel copy of the argument: (kdata, the caller's bytes, bytes to copy back).

        Raises:
            TypeError: `buf` is not a C-contiguous buffer, or is read-only while the ioctl writes back
                (checked before the handler runs, so a bad buffer has no side effect).
            OSError: EFAULT when `buf` is shorter than the request's size field.
        """
        # drm_ioctl: copy in only if both sides say IN, out only if both say OUT; the kernel buffer is
        # max(user, kernel) bytes with the tail zero-filled (docs/uapi.md 4.0, rule D3).
        in_size = user_size if user_dir & entry.direction & IOC_WRITE else 0
        out_size = user_size if user_dir & entry.direction & IOC_READ else 0
        try:
            view = memoryview(buf).cast("B")
        except TypeError as exc:
            raise TypeError(f"{entry.name}: the argument must be a C-contiguous writable buffer "
                            f"(bytearray, ffi.buffer, memoryview), got {type(buf).__name__}: {exc}") from exc
        if out_size and view.readonly:
            raise TypeError(f"{entry.name}: the argument buffer is read-only, the ioctl writes {out_size} bytes back")
        kdata = bytearray(max(in_size, out_size, entry.layout.size))
        if len(view) < max(in_size, out_size):
            raise fail(errno.EFAULT, entry.name, f"argument buffer of {len(view)} bytes < {user_size}")
        kdata[:in_size] = view[:in_size]
        return kdata, view, out_size

    # --- fds ---

    def close_client(self, client: Client) -> None:
        """fd close: no new ioctl gets in (EBADF); once none runs, release the fd (idempotent).

        The release destroys every context of the fd (rule H14) and drops its handles and mappings; with
        ioctls still running on the fd it is left to the last of them (the kernel's fput).
        """
        with self.lock:
            if client.closed:
                return
            client.closed = True
            self.cond.notify_all()
            if client.users:
                return
        self._release_client(client)

    def dup(self, client: Client) -> None:
        """dup(2) of an fd of `client`: one more descriptor on the same open file.

        Raises:
            OSError: EBADF when the file is closed.
        """
        with self.lock:
            if client.closed:
                raise fail(errno.EBADF, "dup", "fd closed")
            client.descriptors += 1

    def close_descriptor(self, client: Client) -> None:
        """close(2) of one descriptor of `client`'s open file: the last one releases the file (rule H14); any
        other runs the driver's flush on profiles that have one (docs/emulator.md, The shared open file)."""
        with self.lock:
            client.descriptors -= 1
            last = client.descriptors <= 0
        if last:
            self.close_client(client)
        elif self.profile.flush_on_close:
            self.flush_client(client, "a duplicate of the fd was closed")

    def flush_client(self, client: Client, cause: str) -> None:
        """amdxdna_flush (6.14-6.19): unlink the file from the device's client list and destroy every context
        of it; the handles then answer EINVAL (docs/emulator.md, The shared open file)."""
        with self.lock:
            if client.closed:
                return
            client.listed = False
            contexts = list(client.contexts.values())
            if contexts:
                client.flushes += 1
        for ctx in contexts:
            self.destroy_context(ctx)
        if contexts:
            log.info("%s: amdxdna_flush destroyed %d hardware context(s) of an fd: %s", self.profile.name,
                     len(contexts), cause)

    def flush_all(self, cause: str) -> None:
        """Every open file of the device is closed once in a child process (a fork or a spawn)."""
        with self.lock:
            clients = [c for c in self.clients if not c.closed]
        for client in clients:
            self.flush_client(client, cause)

    def _put_client(self, client: Client) -> None:
        with self.lock:
            client.users -= 1
            if client.users or not client.closed:
                return
        self._release_client(client)

    def _release_client(self, client: Client) -> None:
        with self.lock:
            contexts = list(client.contexts.values())
        # rule H14: the fd's release destroys its contexts (docs/driver-rules.md)
        for ctx in contexts:
            self.destroy_context(ctx)
        with self.mm_locked(), self.lock:
            client.syncobjs.clear()
            for start, (size, _, _) in list(client.memory.mappings.items()):
                # The pages go, the addresses stay the user's (an inaccessible reservation): a munmap the user
                # still owes, or a stray access, must not land in memory mmap has handed to someone else since.
                try:
                    flags = usermem.MAP_PRIVATE | usermem.MAP_ANONYMOUS | usermem.MAP_FIXED | _MAP_NORESERVE
                    usermem.mmap(start, size, usermem.PROT_NONE, flags, -1, 0)
                except OSError:     # no room for the reservation (map count): unmap rather than keep the pages
                    usermem.munmap(start, size)
                for _, _, bo in client.memory.remove_range(start, size):
                    self.unref_bo(bo)
            for bo in client.bos.values():
                self.unref_bo(bo)
            client.bos.clear()
            for heap in client.memory.heaps:
                self.unref_bo(heap)
            client.memory.heaps.clear()
            if client.memory.window is not None:
                client.memory.window.close()
            self.forget_failures(client)
            self.clients.remove(client)
            self.cond.notify_all()


# =====================================================================================================
# The seam
# =====================================================================================================

class EmuSeam:
    """One open fd of an EmuDevice, implementing the Seam protocol (docs/design.md section 1)."""

    def __init__(self, device: EmuDevice, client: Client):
        self.device = device
        self.client = client
        self.name = f"emu:{device.profile.name}"
        self.closed = False                 # this descriptor (the open file may have others: dup)

    def ioctl(self, request: int, buf: Buffer) -> int:
        """Run a raw ioctl on this fd; results are written into `buf`.

        Raises:
            OSError: the driver's errno (EBADF once this descriptor is closed).
        """
        return self.device.ioctl(self.client, request, buf, self.closed)

    def dup(self) -> EmuSeam:
        """A new descriptor on the same open file, as dup(2): same handles, contexts and mappings. On the
        6.14-6.19 profiles closing either while the other stays open destroys the file's contexts
        (docs/emulator.md, The shared open file).

        Raises:
            OSError: EBADF when this descriptor is closed.
        """
        if self.closed:
            raise fail(errno.EBADF, "dup", "this descriptor is closed")
        self.device.dup(self.client)
        return EmuSeam(self.device, self.client)

    def mmap(self, length: int, offset: int, addr: int = 0, *, private: bool = False) -> int:
        """Map the BO whose map_offset is `offset` (MAP_SHARED, MAP_FIXED when `addr` != 0).

        `private=True` models a MAP_PRIVATE request, which shmem GEM objects refuse (rule B2).

        Raises:
            TypeError: `length`, `offset` or `addr` is not an int.
            OSError: ENODEV (device lost), EBADF (fd closed), EINVAL (no BO at `offset` on this fd,
                `length` 0 or larger than the BO, private mapping), or mmap's own errno.
        """
        length, offset, addr = _ints("mmap", length=length, offset=offset, addr=addr)
        dev = self.device
        op = f"mmap(length={length:#x}, offset={offset:#x})"
        blocking = dev.may_block()
        with dev.mm_locked(), dev.lock:
            bo = self._mappable(op, length, offset, private)
            # MAP_FIXED unmaps what it replaces first, with munmap's wait for the jobs using it; the wait
            # released the lock, so the BO is looked up again.
            fixed = addr and not addr % PAGE_SIZE and blocking
            if fixed and dev.wait_for_mapped_jobs(self.client, addr, page_align(length)):
                bo = self._mappable(op, length, offset, private)
            return self._map(bo, length, addr)

    def _mappable(self, op: str, length: int, offset: int, private: bool) -> Bo:
        dev, client = self.device, self.client
        if dev.lost:
            raise fail(errno.ENODEV, op, "device lost")
        if client.closed or self.closed:
            raise fail(errno.EBADF, op, "fd closed")
        bo = next((b for b in client.bos.values() if b.map_offset == offset and b.memfd >= 0), None)
        # rule B8: an offset of no BO of this fd (docs/driver-rules.md); offsets are device-wide, and one of
        # another fd's BO is refused by drm_gem_mmap's access check (S2)
        if bo is None:
            if any(b.map_offset == offset and b.memfd >= 0 for other in dev.clients if other is not client
                   for b in other.bos.values()):
                raise fail(errno.EACCES, op, "that map_offset belongs to a BO of another fd")
            raise fail(errno.EINVAL, op, "no BO of this fd has that map_offset")
        if private:
            raise fail(errno.EINVAL, op, "shmem GEM objects need MAP_SHARED")
        if not 0 < length <= bo.size:
            raise fail(errno.EINVAL, op, f"length must be 1..{bo.size:#x} (BO size)")
        return bo

    def _map(self, bo: Bo, length: int, addr: int) -> int:
        """mmap `bo` (lock held) and record the mapping, which holds a BO reference."""
        dev, client = self.device, self.client
        flags = usermem.MAP_SHARED | (usermem.MAP_FIXED if addr else 0)
        mapped = usermem.mmap(addr, length, usermem.PROT_READ | usermem.PROT_WRITE, flags, bo.memfd,
                              bo.file_offset)
        bo.refs += 1        # a mapping keeps the GEM object alive (docs/uapi.md 7, lifetime)
        # The new mapping replaces whatever was mapped in its range (MAP_FIXED unmaps it first): the
        # device must no longer resolve those addresses to the old BO, whose mapping reference goes.
        for _, _, old in client.memory.remove_range(mapped, page_align(length)):
            dev.unref_bo(old)
        client.memory.add_mapping(mapped, page_align(length), bo)
        if bo.vaddr == AMDXDNA_INVALID_ADDR:
            bo.vaddr = mapped
        return mapped

    def reserve(self, length: int, alignment: int) -> int:
        """An anonymous PROT_NONE reservation of `length` bytes aligned to `alignment`.

        Raises:
            TypeError: `length` or `alignment` is not an int.
            ValueError: `alignment` is not a power of two multiple of the page size, or `length` <= 0.
            OSError: mmap's errno.
        """
        length, alignment = _ints("reserve", length=length, alignment=alignment)
        if alignment < PAGE_SIZE or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= {PAGE_SIZE}, got {alignment:#x}")
        if length <= 0:
            raise ValueError(f"reserve: length must be > 0, got {length}")
        length = page_align(length)
        flags = usermem.MAP_PRIVATE | usermem.MAP_ANONYMOUS | _MAP_NORESERVE
        base = usermem.mmap(0, length + alignment, usermem.PROT_NONE, flags, -1, 0)
        aligned = (base + alignment - 1) & ~(alignment - 1)
        if aligned > base:
            usermem.munmap(base, aligned - base)
        tail = base + length + alignment - (aligned + length)
        if tail:
            usermem.munmap(aligned + length, tail)
        return aligned

    def munmap(self, addr: int, length: int) -> None:
        """Unmap [addr, addr+length) (a BO mapping or a reservation).

        Unmapping any part of a mapping of a BO that in-flight jobs take as an argument first waits for those
        jobs to end, as the driver's MMU notifier waits on the BO's fences (docs/uapi.md 7, lifetime): the device
        resolves SHMEM addresses through the mapping (SVA). The wait holds no device lock; the TDR bounds it,
        and EmuDevice.close or a lost device ends it (their jobs end without resolving addresses).

        Raises:
            TypeError: `addr` or `length` is not an int.
            OSError: munmap's errno (EINVAL for an unaligned address or an empty range, before any wait).
        """
        addr, length = _ints("munmap", addr=addr, length=length)
        dev = self.device
        length_pages = page_align(length)
        if addr % PAGE_SIZE or length_pages <= 0:
            # do_munmap's own checks come first: a bad call must not wait for the device.
            raise OSError(errno.EINVAL, f"munmap({addr:#x}, {length:#x}): EINVAL (address not page aligned "
                                        f"or empty range)")
        blocking = dev.may_block()          # asked before taking the lock, which it checks for
        with dev.mm_locked(), dev.lock:
            if blocking:
                dev.wait_for_mapped_jobs(self.client, addr, length_pages)
            # Unmap and forget under one lock, as mmap maps and records: else another thread's mmap can be
            # given the freed addresses in between, and this call would then forget that new mapping.
            usermem.munmap(addr, length)
            for _, _, bo in self.client.memory.remove_range(addr, length_pages):
                dev.unref_bo(bo)

    def command_reason(self, hwctx: int, seq: int) -> str | None:
        """Why command `seq` of this fd's context `hwctx` failed, in the emulated firmware's words, or None
        (EmuDevice.command_reason; docs/emulator.md, "Why a command failed").

        Raises:
            TypeError: `hwctx` or `seq` is not an int.
        """
        return self.device.command_reason(hwctx, seq, self)

    def close(self) -> None:
        """Close the fd (idempotent). The last descriptor of the open file destroys every context of it and drops
        its handles; closing a duplicate does so only on the profiles with amdxdna_flush."""
        if self.closed:
            return
        self.closed = True
        self.device.close_descriptor(self.client)

    def __enter__(self) -> EmuSeam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MAP_NORESERVE = 0x4000

# --- child processes (docs/emulator.md, The shared open file) ---
# A child holds a copy of every descriptor and closes it (at exit, at exec for O_CLOEXEC, or by close_fds), which
# runs the driver's flush once in the parent's open file. The emulator's files are not kernel files, so it sees
# the child being made: the audit events of every way Python starts one (subprocess and os.posix_spawn run no
# at-fork hook), and os.register_at_fork for a fork from C.
_SPAWN_EVENTS = frozenset({"os.fork", "os.forkpty", "subprocess.Popen", "os.posix_spawn", "os.posix_spawnp",
                           "os.system"})
_FLUSHING: weakref.WeakSet[EmuDevice] = weakref.WeakSet()
_hooks_installed = False


def _watch_children(device: EmuDevice) -> None:
    global _hooks_installed
    _FLUSHING.add(device)
    if not _hooks_installed:
        _hooks_installed = True
        sys.addaudithook(_audit)
        os.register_at_fork(after_in_parent=lambda: _child_made("fork"))


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _SPAWN_EVENTS:
        _child_made(event)


def _child_made(event: str) -> None:
    # An exception here would fail the caller's fork or spawn: log it instead.
    for device in list(_FLUSHING):
        if device.closing:
            continue
        try:
            device.flush_all(f"a child process ({event}) closed its copy")
        except Exception:
            log.exception("%s: flush after %s failed", device.profile.name, event)


def _ints(op: str, **values: SupportsIndex) -> list[int]:
    """The seam's address and size arguments as Python ints (numpy integers included; libc takes only ints).

    Raises:
        TypeError: one is not an integer (named, rather than failing deep in formatting or ctypes).
    """
    ints = []
    for name, value in values.items():
        try:
            ints.append(operator.index(value))
        except TypeError:
            raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}") from None
    return ints
