"""The emulated amdxdna driver: DRM dispatch, fds, handle tables and every ioctl's checks.

Behaviour follows spec/amdxdna-uapi.md (7.0-era AIE2 driver unless a profile option says otherwise)
and the numbered rules of spec/driver-rules.md; comments cite the section. Command execution belongs
to the firmware (``emu/firmware.py``): EXEC_CMD validates, books the job, and hands it over.

Locking: one re-entrant lock per device (``EmuDevice.lock``) guards every table; ``EmuDevice.cond``
wakes waiters (fences, in-flight slots). Nothing blocks while holding the lock except on ``cond``
(which releases it); the firmware worker calls ``Job.complete`` concurrently with user ioctls.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import layouts as L
from . import usermem
from .firmware import Firmware, in_firmware_thread
from .memory import (
    AIE2_DEVM_BASE,
    AMDXDNA_BO_CMD,
    AMDXDNA_BO_DEV,
    AMDXDNA_BO_DEV_HEAP,
    AMDXDNA_BO_SHMEM,
    AMDXDNA_INVALID_ADDR,
    PAGE_SIZE,
    Bo,
    HeapAllocator,
    HeapWindow,
    Memory,
    new_backing,
    page_align,
    release_backing,
)

log = logging.getLogger("amdxdna_direct.emu")

# --- _IOC request layout (asm-generic/ioctl.h; spec 1) ---
IOC_NRBITS, IOC_TYPEBITS, IOC_SIZEBITS = 8, 8, 14
IOC_NRSHIFT = 0
IOC_TYPESHIFT = IOC_NRSHIFT + IOC_NRBITS
IOC_SIZESHIFT = IOC_TYPESHIFT + IOC_TYPEBITS
IOC_DIRSHIFT = IOC_SIZESHIFT + IOC_SIZEBITS
IOC_WRITE, IOC_READ = 1, 2          # IOC_WRITE: user -> kernel ("IN"), IOC_READ: kernel -> user ("OUT")
DRM_IOCTL_BASE = ord("d")
DRM_COMMAND_BASE = 0x40

# --- driver constants (spec 3, 4) ---
HWCTX_MAX_CMDS = 4                  # jobs in flight per context (spec 4.7 step 6)
MAX_HWCTX_ID = 255                  # per-fd cyclic context handles 1..255 (spec 4.1 step 9)
CTX_INTERNAL_BOS = 4                # command-list buffers taken from the heap per context (spec 4.1 step 4)
CTX_INTERNAL_BO_SIZE = 4096
MAX_CMD_BO_SIZE = 32 << 10          # CMD BO limit checked at EXEC_CMD (spec 4.4 CMD, 4.7 step 3)
MAX_ARG_COUNT = 4095
MAX_CONFIG_CU_SIZE = 4096
MAX_CUS = 32
DEV_HEAP_MAX = 64 << 20             # one heap <= 64 MiB per fd (spec 4.4, 7)
MAX_LFS_FILESIZE = (1 << 63) - 1    # shmem_file_setup refuses a larger (negative loff_t) size with EINVAL
DEV_HEAP_CHUNK = 64 << 20           # expandable heap: sizes are multiples of AIE2_DEVM_SIZE (spec 4.4 staging)
ERT_STATE_COMPLETED = 4
AMDXDNA_CMD_SUBMIT_EXEC_BUF = 0
SYNC_DIRECT_FROM_DEVICE = 1
CONFIG_CU, ASSIGN_DBG_BUF, REMOVE_DBG_BUF = 0, 1, 2
POWER_MODE_DEFAULT, POWER_MODE_LOW, POWER_MODE_MEDIUM, POWER_MODE_HIGH, POWER_MODE_TURBO = 0, 1, 2, 3, 4
QOS_PRIORITIES = (0x100, 0x180, 0x200, 0x280)      # REALTIME HIGH NORMAL LOW (spec 3)
QOS_PRIORITY_HIGH = 0x180
AMDXDNA_HWCTX_STATE_ACTIVE = 1
DRM_SYNCOBJ_CREATE_SIGNALED = 1
DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL, DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT = 1, 2
DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE, DRM_SYNCOBJ_WAIT_FLAGS_WAIT_DEADLINE = 4, 8
DRM_SYNCOBJ_QUERY_FLAGS_LAST_SUBMITTED = 1
DRM_CAP_PRIME, DRM_CAP_SYNCOBJ, DRM_CAP_SYNCOBJ_TIMELINE = 0x5, 0x13, 0x14
DRM_PRIME_CAP_IMPORT_EXPORT = 0x3
DRM_CLOEXEC, DRM_RDWR = os.O_CLOEXEC, os.O_RDWR
DRM_VMA_OFFSET_START = 0x100000 << 12   # DRM_FILE_PAGE_OFFSET_START: fake mmap offsets begin at 4 GiB
DRIVER_NAME = "amdxdna_accel_driver"
DRIVER_DESC = "AMD XDNA DRM implementation"
DRIVER_DATE = "0"                   # spec 5: the date string is "0" on >= 6.14
FW_MSG_CREATE_CONTEXT = 0x2         # firmware mailbox opcode named in the failure log (spec 4.1 step 8)
TELEMETRY_DATA_MAX = 4 << 20
TELEMETRY_TYPES = 4                 # emulator choice: telemetry types the firmware knows (spec 10 gives none)
ASYNC_ERROR_SIZE = L.async_error.size
WAIT_SLICE_S = 60.0
CLOSE_DRAIN_S = 10.0                # EmuDevice.close waits this long for ioctls still running on its fds
# kmalloc_array beyond KMALLOC_MAX_SIZE (x86_64: 1 << (MAX_PAGE_ORDER 10 + PAGE_SHIFT)) returns NULL, so DRM
# answers ENOMEM for a user array that large (drm_syncobj_array_find, the timeline points) before copying it.
KMALLOC_MAX_SIZE = 4 << 20


# =====================================================================================================
# Profiles (spec 8)
# =====================================================================================================

@dataclass(frozen=True)
class TileMetadata:
    """amdxdna_drm_query_aie_tile_metadata of one tile kind."""

    row_count: int
    row_start: int
    dma_channel_count: int
    lock_count: int
    event_reg_count: int


@dataclass(frozen=True)
class Profile:
    """One emulated NPU: PCI identity, geometry, firmware answers and driver options.

    Geometry, context limit and placement are spec 8 facts; AIE metadata, clocks, firmware version and
    TOPS are emulator guesses (spec 8: "real values come from firmware").
    """

    name: str
    pci_device: int
    pci_revision: int
    vbnv: str
    columns: int                    # physical columns reported by firmware
    first_col: int                  # first column a partial partition may use
    aligned_placement: bool         # NPU4/5/6: start column is a multiple of the width
    hwctx_limit: int
    txn_dev_gen: int                # TXN header device generation the firmware accepts (H3b)
    aie_version: tuple[int, int]
    aie_arch: tuple[int, int]       # version field of QUERY_AIE_METADATA
    col_size: int                   # bytes of one column's status dump (QUERY_AIE_STATUS)
    core: TileMetadata
    mem: TileMetadata
    shim: TileMetadata
    dpm_clocks: tuple[tuple[int, int], ...]     # (MP-NPU MHz, H-clock MHz) per DPM level
    firmware_version: tuple[int, int, int, int]
    tops_max: int
    rows: int = 6
    core_rows: int = 4
    drm_minor: int = 10             # feature level (spec 11): 0.10 has every ioctl the emulator models
    expandable_heap: bool = False   # True models the 2026 expandable heap: several chunks per fd (spec 4.4)
    dev_heap_max_size: int = 512 << 20  # expandable heap: device window per fd (spec 4.4, 8; NPU1 64 MiB)
    wait_cmd: bool = False          # True models the out-of-tree driver's WAIT_CMD (spec 4.11, 12)
    qos_size: int = 24              # bytes read from qos_p (32 on out-of-tree builds, spec 12)


_AIE2_CORE = TileMetadata(row_count=4, row_start=2, dma_channel_count=4, lock_count=16, event_reg_count=128)
_AIE2_MEM = TileMetadata(row_count=1, row_start=1, dma_channel_count=12, lock_count=64, event_reg_count=128)
_AIE2_SHIM = TileMetadata(row_count=1, row_start=0, dma_channel_count=4, lock_count=16, event_reg_count=128)


def _npu(name: str, revision: int, **overrides) -> Profile:
    base = dict(name=name, pci_device=0x17F0, pci_revision=revision, vbnv=f"RyzenAI-{name}", columns=8, first_col=0,
                aligned_placement=True, hwctx_limit=16, txn_dev_gen=4, aie_version=(1, 1), aie_arch=(2, 1),
                col_size=4096, core=_AIE2_CORE, mem=_AIE2_MEM, shim=_AIE2_SHIM,
                dpm_clocks=((396, 792), (600, 1056), (792, 1152), (975, 1267), (975, 1267), (1056, 1408),
                            (1152, 1584), (1267, 1800)),
                firmware_version=(1, 0, 0, 63), tops_max=50)
    base.update(overrides)
    return Profile(**base)


PROFILES: dict[str, Profile] = {
    "npu1": _npu("npu1", 0x00, pci_device=0x1502, columns=5, first_col=1, aligned_placement=False, hwctx_limit=6,
                 txn_dev_gen=3, aie_arch=(2, 0), dev_heap_max_size=64 << 20,
                 dpm_clocks=((400, 800), (600, 1024), (600, 1024), (600, 1024), (600, 1024), (720, 1309),
                             (720, 1309), (847, 1600)),
                 firmware_version=(1, 5, 5, 391), tops_max=10),
    "npu4": _npu("npu4", 0x10),
    "npu5": _npu("npu5", 0x11),
    "npu6": _npu("npu6", 0x20),
}
DEFAULT_PROFILE = "npu4"


# =====================================================================================================
# Fences, timelines, contexts, jobs
# =====================================================================================================

class Fence:
    """A dma_fence: signalled once."""

    __slots__ = ("signalled",)

    def __init__(self, signalled: bool = False):
        self.signalled = signalled


class Timeline:
    """A DRM syncobj: a chain of (point, fence, prev_seqno) links (dma_fence_chain semantics, spec 5).

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
    dbg_bos: list[Bo] = field(default_factory=list)
    stats: collections.Counter = field(default_factory=collections.Counter)
    next_seq: int = 0
    jobs: dict[int, Job] = field(default_factory=dict)       # seq -> the jobs in flight (fences, BO references)
    destroyed: bool = False

    @property
    def inflight(self) -> int:
        """Jobs submitted and not yet ended (at most HWCTX_MAX_CMDS, spec 4.7 step 6)."""
        return len(self.jobs)


class Job:
    """One EXEC_CMD submission handed to the firmware."""

    def __init__(self, device: EmuDevice, ctx: HwCtx, seq: int, cmd_bo: Bo, arg_bos: list[Bo], fence: Fence):
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
# Counters and faults (docs/design.md section 2)
# =====================================================================================================

class Counters:
    """Ioctl counts by name and live-object counts of one device."""

    def __init__(self, device: EmuDevice):
        self._device = device
        self.ioctls: collections.Counter = collections.Counter()

    def live(self) -> dict[str, int]:
        """Live BOs (backing not yet released), contexts, syncobjs and user mappings."""
        dev = self._device
        with dev.lock:
            return {"bos": dev.live_bos, "hwctx": len(dev.contexts),
                    "syncobjs": sum(len(c.syncobjs) for c in dev.clients),
                    "mappings": sum(len(c.memory.mappings) for c in dev.clients)}

    @property
    def bytes_mapped(self) -> int:
        """Bytes currently mapped by users through the seam's mmap."""
        with self._device.lock:
            return sum(size for c in self._device.clients for size, _, _ in c.memory.mappings.values())


class Faults:
    """Fault injection (an explicit API; docs/design.md section 2)."""

    def __init__(self, device: EmuDevice):
        self._device = device
        self.next_create_hwctx_errno: int | None = None
        self.context_cap: int | None = None

    def fail_next_create_hwctx(self, err: int) -> None:
        """The next CREATE_HWCTX that passes argument checks fails with `err` (at the firmware step).

        Raises:
            ValueError: `err` is not an errno number.
        """
        if isinstance(err, bool) or err not in errno.errorcode:
            raise ValueError(f"fail_next_create_hwctx: {err!r} is not an errno number")
        self.next_create_hwctx_errno = err

    def cap_contexts(self, n: int) -> None:
        """Lower the firmware context limit to `n` (spec 4.1 step 8: the refusal is EINVAL).

        Raises:
            ValueError: `n` is not an int >= 0.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cap_contexts: the context limit must be an int >= 0, got {n!r}")
        self.context_cap = n

    def hang(self, stream, count: int = 1) -> None:
        """The next `count` runs of the stream (its bytes or sha256 hex) hang: the TDR ends them TIMEOUT.

        Raises:
            ValueError: count < 1 or a malformed digest.
        """
        self._device.firmware.inject("hang", stream, count)

    def error(self, stream, count: int = 1) -> None:
        """The next `count` runs of the stream (its bytes or sha256 hex) end with a firmware ERROR.

        Raises:
            ValueError: count < 1 or a malformed digest.
        """
        self._device.firmware.inject("error", stream, count)

    def lose_device(self) -> None:
        """Every later ioctl and mmap answers ENODEV (the device was unplugged, rule D5).

        Calls blocked in the driver (syncobj waits, WAIT_CMD, a fifth EXEC_CMD) wake at once with ENODEV;
        the firmware stops: queued jobs end ABORT, a running one ABORT when its model returns (or at the TDR).
        """
        dev = self._device
        with dev.lock:
            dev.lost = True
            # Under the lock (the order EXEC_CMD's submit takes too): no waiter sees `lost` before every lane has
            # stopped taking jobs, so a munmap it ends cannot pull a buffer from under a queued job.
            dev.firmware.abort_all()
            dev.cond.notify_all()
        log.warning("%s: device lost (fault injected)", dev.profile.name)


# =====================================================================================================
# Errors
# =====================================================================================================

def fail(code: int, op: str, detail: str) -> OSError:
    """The driver's answer: an OSError with the errno; the text names the ioctl, fields and errno name."""
    message = f"{os.strerror(code)} [emu {op}: {errno.errorcode.get(code, code)} ({detail})]"
    log.debug("%s: %s (%s)", op, errno.errorcode.get(code, code), detail)
    return OSError(code, message)


# =====================================================================================================
# Clients (open fds)
# =====================================================================================================

class Client:
    """Per-fd driver state (amdxdna_client + drm_file): handle tables, heap, contexts, syncobjs."""

    def __init__(self, device: EmuDevice):
        self.device = device
        self.pid = os.getpid()
        # SVA binds the process's mm at open: one PASID per process, allocated by the IOMMU (spec 7, open).
        self.pasid = device.pasids.setdefault(self.pid, len(device.pasids) + 1)
        self.memory = Memory(device.lock)
        if device.profile.expandable_heap:
            # drm_mm_init over the whole window at open: DEV BOs are placed before chunks are checked (spec 4.4).
            self.memory.allocator = HeapAllocator(device.profile.dev_heap_max_size)
        self.bos: dict[int, Bo] = {}
        self.syncobjs: dict[int, Timeline] = {}
        self.contexts: dict[int, HwCtx] = {}
        self.closing: list[HwCtx] = []          # contexts being destroyed (still own columns)
        self.last_ctx_handle = 0
        self.closed = False
        # ioctls running on this fd: each holds the file like fget() does, so the release that close
        # triggers runs when the last of them returns (fput), never under a call still using the fd.
        self.users = 0

    @staticmethod
    def lowest_free(table: dict) -> int:
        """idr_alloc(1, 0): the lowest free handle from 1 (GEM and syncobj handles)."""
        handle = 1
        while handle in table:
            handle += 1
        return handle

    def next_ctx_handle(self) -> int | None:
        """xa_alloc_cyclic over 1..MAX_HWCTX_ID (spec 4.1 step 9), None when every id is live."""
        for step in range(1, MAX_HWCTX_ID + 1):
            handle = (self.last_ctx_handle + step - 1) % MAX_HWCTX_ID + 1
            if handle not in self.contexts and all(c.handle != handle for c in self.closing):
                self.last_ctx_handle = handle
                return handle
        return None


# =====================================================================================================
# The device
# =====================================================================================================

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
    # Slot 9: WAIT_CMD is IOWR out of tree (spec 12), IOW in mainline >= 0.10, an empty slot before (spec 1b).
    if profile.wait_cmd or profile.drm_minor >= 10:
        table[DRM_COMMAND_BASE + 9] = IoctlDef("WAIT_CMD", L.wait_cmd, rw if profile.wait_cmd else IOC_WRITE,
                                               "wait_cmd")
    if profile.drm_minor >= 1:
        table[DRM_COMMAND_BASE + 10] = IoctlDef("GET_ARRAY", L.get_array, rw, "get_array")
    return table


class EmuDevice:
    """One emulated PCI NPU with the amdxdna driver bound (docs/design.md section 2)."""

    def __init__(self, profile: str | Profile = DEFAULT_PROFILE, *, tdr_timeout: float = 2.0,
                 cap_sys_admin: bool | None = None, **options):
        """Bring up the device: driver state, then the firmware worker.

        Args:
            profile: a name of PROFILES or a Profile.
            tdr_timeout: seconds before a hung job is timed out (staging default 2 s, spec 6.7).
            cap_sys_admin: whether callers count as root for DRM_ROOT_ONLY ioctls (default: euid 0).
            options: Profile field overrides, e.g. ``drm_minor=6``, ``wait_cmd=True``, ``expandable_heap=True``.

        Raises:
            KeyError: unknown profile name.
            TypeError: unknown option.
            ValueError: dev_heap_max_size is not a positive multiple of 64 MiB, or tdr_timeout is not > 0.
        """
        if not isinstance(profile, Profile) and profile not in PROFILES:
            raise KeyError(f"unknown emulator profile {profile!r} (profiles: {', '.join(PROFILES)})")
        base = profile if isinstance(profile, Profile) else PROFILES[profile]
        self.profile = dataclasses.replace(base, **options) if options else base
        max_size = self.profile.dev_heap_max_size
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= 0 or max_size % DEV_HEAP_CHUNK:
            raise ValueError(f"dev_heap_max_size must be a positive multiple of 64 MiB, got {max_size!r}")
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
        self.firmware = Firmware(self, tdr_timeout=tdr_timeout)
        self.models = self.firmware.models
        self.closing = False            # close() started: blocked ioctls give up (ENODEV)
        self.closed = False

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

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def contexts(self) -> list[HwCtx]:
        """Every live context of every fd (including ones being destroyed: they still hold columns)."""
        return [ctx for c in self.clients for ctx in (*c.contexts.values(), *c.closing)]

    def current_clocks(self) -> tuple[int, int]:
        """(MP-NPU, H-clock) MHz at the current power mode: top DPM level unless DEFAULT."""
        levels = self.profile.dpm_clocks
        return levels[-1] if self.power_mode in (POWER_MODE_HIGH, POWER_MODE_TURBO) else levels[0]

    def hwctx_limit(self) -> int:
        """The firmware context limit (the profile's, or lower by fault injection)."""
        cap = self.faults.context_cap
        return self.profile.hwctx_limit if cap is None else min(cap, self.profile.hwctx_limit)

    # --- user mappings (spec 7, lifetime) ---

    def may_block(self) -> bool:
        """Whether the calling thread may wait for jobs: not a firmware thread, not inside the driver's lock
        (a finalizer's munmap run by the garbage collector there would wait for what its thread holds up)."""
        return not in_firmware_thread() and not self.lock._is_owned()

    def mm_locked(self):
        """The mm lock (mmap, munmap, the fd release's unmapping), or no lock where waiting is not allowed."""
        return self.mm_lock if self.may_block() else contextlib.nullcontext()

    def wait_for_mapped_jobs(self, client: Client, addr: int, length: int) -> bool:
        """Wait (lock released) for the in-flight jobs taking as an argument a BO that `client` maps in
        [addr, addr+length), as the MMU notifier waits on the BO's fences (spec 7). A lost or closing device
        ends the wait: its jobs end without resolving addresses. Returns whether it waited."""
        with self.lock:
            mapped = {id(bo) for start, (size, bo, _) in client.memory.mappings.items()
                      if start < addr + length and addr < start + size}
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
                memory.allocator.free(bo.heap_offset)
                memory.dev_bos.pop(bo.heap_offset, None)
                bo.released = True
                for heap in (bo.heap, *bo.more_heaps):
                    self.unref_bo(heap)
            else:
                release_backing(bo)
                for key in [k for k, exported in self.exports.items() if exported is bo]:
                    del self.exports[key]

    # --- ioctl dispatch (spec 4.0) ---

    def ioctl(self, client: Client, request: int, buf) -> int:
        """Dispatch one raw ioctl like drm_ioctl(); returns 0.

        Raises:
            OSError: the driver's errno (ENOTTY, EINVAL, ENODEV, EACCES, EFAULT and per-ioctl errnos).
        """
        nr = (request >> IOC_NRSHIFT) & ((1 << IOC_NRBITS) - 1)
        type_byte = (request >> IOC_TYPESHIFT) & ((1 << IOC_TYPEBITS) - 1)
        entry = self.table.get(nr) if type_byte == DRM_IOCTL_BASE else None
        op = entry.name if entry is not None else f"ioctl({request:#x})"
        with self.lock:
            if client.closed:
                raise fail(errno.EBADF, op, "fd closed")
            client.users += 1
        try:
            return self._dispatch(client, entry, op, request, buf)
        finally:
            self._put_client(client)

    def _dispatch(self, client: Client, entry: IoctlDef | None, op: str, request: int, buf) -> int:
        if self.lost:
            raise fail(errno.ENODEV, op, "device lost (drm_dev_is_unplugged)")
        if entry is None:
            type_byte = (request >> IOC_TYPESHIFT) & ((1 << IOC_TYPEBITS) - 1)
            if type_byte != DRM_IOCTL_BASE:
                raise fail(errno.ENOTTY, op, f"type byte {type_byte:#x} is not 'd'")
            nr = (request >> IOC_NRSHIFT) & ((1 << IOC_NRBITS) - 1)
            raise fail(errno.EINVAL, op, f"nr {nr:#x} not in the driver's table")
        user_size = (request >> IOC_SIZESHIFT) & ((1 << IOC_SIZEBITS) - 1)
        user_dir = request >> IOC_DIRSHIFT
        with self.lock:
            self.counters.ioctls[entry.name] += 1
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
    def _copy_in(entry: IoctlDef, user_dir: int, user_size: int, buf) -> tuple[bytearray, memoryview, int]:
        """The kernel copy of the argument: (kdata, the caller's bytes, bytes to copy back).

        Raises:
            TypeError: `buf` is not a C-contiguous buffer, or is read-only while the ioctl writes back
                (checked before the handler runs, so a bad buffer has no side effect).
            OSError: EFAULT when `buf` is shorter than the request's size field.
        """
        # drm_ioctl: copy in only if both sides say IN, out only if both say OUT; the kernel buffer is
        # max(user, kernel) bytes with the tail zero-filled (spec 4.0, rule D3).
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

    # --- DRM core ioctls (spec 5) ---

    def _ioctl_version(self, client: Client, a: dict) -> None:
        a.update(version_major=0, version_minor=self.profile.drm_minor, version_patchlevel=0)
        for key, value in (("name", DRIVER_NAME), ("date", DRIVER_DATE), ("desc", DRIVER_DESC)):
            data = value.encode()
            length = min(len(data), a[key + "_len"])        # drm_copy_field: truncate, report full length
            if length and a[key]:
                usermem.write(a[key], data[:length], f"VERSION({key})")
            a[key + "_len"] = len(data)

    def _ioctl_gem_close(self, client: Client, a: dict) -> None:
        with self.lock:
            bo = client.bos.pop(a["handle"], None)
            if bo is None:
                raise fail(errno.EINVAL, "GEM_CLOSE", f"handle={a['handle']} unknown")
            self.unref_bo(bo)

    def _ioctl_get_cap(self, client: Client, a: dict) -> None:
        values = {DRM_CAP_SYNCOBJ: 1, DRM_CAP_SYNCOBJ_TIMELINE: 1, DRM_CAP_PRIME: DRM_PRIME_CAP_IMPORT_EXPORT}
        if a["capability"] not in values:
            raise fail(errno.EINVAL, "GET_CAP", f"capability={a['capability']:#x} not modelled")
        a["value"] = values[a["capability"]]

    def _ioctl_prime_handle_to_fd(self, client: Client, a: dict) -> None:
        op = f"PRIME_HANDLE_TO_FD(handle={a['handle']})"
        if a["flags"] & ~(DRM_CLOEXEC | DRM_RDWR):
            raise fail(errno.EINVAL, op, f"flags={a['flags']:#x}")
        with self.lock:
            bo = client.bos.get(a["handle"])
            if bo is None:
                raise fail(errno.ENOENT, op, "unknown handle")
            if bo.memfd < 0:
                raise fail(errno.EOPNOTSUPP, op, f"{bo.kind_name} BOs live inside the heap and are not exported")
            if bo.kind == AMDXDNA_BO_DEV_HEAP and self.profile.expandable_heap:
                # Chunks share one window file, which cannot tell them apart on import.
                raise fail(errno.EOPNOTSUPP, op, "exporting an expandable-heap chunk is not modelled")
            # The exported "dma-buf" is a dup of the BO's memfd: a real fd the caller owns and closes.
            try:
                fd = os.dup(bo.memfd)
            except OSError as exc:      # dma_buf_fd: get_unused_fd_flags fails with EMFILE/ENFILE
                raise fail(exc.errno, op, "no free file descriptor for the dma-buf") from exc
            os.set_inheritable(fd, not a["flags"] & DRM_CLOEXEC)
            stat = os.fstat(fd)
            self.exports[(stat.st_dev, stat.st_ino)] = bo
            a["fd"] = fd

    def _ioctl_prime_fd_to_handle(self, client: Client, a: dict) -> None:
        op = f"PRIME_FD_TO_HANDLE(fd={a['fd']})"
        try:
            stat = os.fstat(a["fd"])
        except OSError as exc:
            raise fail(errno.EBADF, op, "not an open fd") from exc
        with self.lock:
            bo = self.exports.get((stat.st_dev, stat.st_ino))
            if bo is None or bo.released:
                raise fail(errno.EINVAL, op, "not a live BO exported by this device (foreign dma-bufs not modelled)")
            handle = next((h for h, known in client.bos.items() if known is bo), None)
            if handle is None:
                handle = Client.lowest_free(client.bos)
                client.bos[handle] = bo
                bo.refs += 1
            a["handle"] = handle

    # --- context ioctls (spec 4.1-4.3) ---

    def _ioctl_create_hwctx(self, client: Client, a: dict) -> None:
        op = f"CREATE_HWCTX(num_tiles={a['num_tiles']})"
        if a["ext"] or a["ext_flags"]:
            raise fail(errno.EINVAL, op, "ext/ext_flags must be 0")
        qos = L.qos_info.unpack(usermem.read(a["qos_p"], self.profile.qos_size, op + " qos_p"))
        with self.lock:
            heap = client.memory.heap
            if heap is None:
                raise fail(errno.ENOENT, op, "The client dev heap object not exist")
            if heap.vaddr == AMDXDNA_INVALID_ADDR:
                raise fail(errno.EINVAL, op, "Invalid dev heap userptr (heap never mapped)")
            internal = self._alloc_ctx_bos(client, op)
            try:
                ctx = self._admit(client, a, qos, op)
            except OSError:
                for bo in internal:
                    self.unref_bo(bo)
                raise
            ctx.internal_bos = internal
            client.contexts[ctx.handle] = ctx
            a["handle"], a["syncobj_handle"] = ctx.handle, ctx.syncobj_handle
            if self.profile.drm_minor >= 10:
                a["umq_doorbell"] = 0xFFFFFFFF      # AMDXDNA_INVALID_DOORBELL_OFFSET on AIE2 (spec 2.1)

    def _alloc_ctx_bos(self, client: Client, op: str) -> list[Bo]:
        bos = []
        try:
            for _ in range(CTX_INTERNAL_BOS):
                bo = self._new_dev_bo(client, CTX_INTERNAL_BO_SIZE, op, internal=True)
                if bo is None:
                    raise fail(errno.ENOSPC, op, "no heap room for the context's 4 command-list buffers")
                bos.append(bo)
        except OSError:
            for done in bos:
                self.unref_bo(done)
            raise
        return bos

    def _admit(self, client: Client, a: dict, qos: dict, op: str) -> HwCtx:
        num_tiles = a["num_tiles"]
        if num_tiles == 0:
            raise fail(errno.EINVAL, op, "Number of tiles is zero")
        num_col = num_tiles // self.profile.core_rows
        if num_col == 0 or num_col > self.profile.columns:
            raise fail(errno.EINVAL, op, f"Invalid num_col {num_col}")
        self._check_qos(qos, a["max_opc"], op)
        start = self._place(num_col, op)
        injected = self.faults.next_create_hwctx_errno
        if injected is not None:
            self.faults.next_create_hwctx_errno = None
            raise fail(injected, op, "fault injected by faults.fail_next_create_hwctx")
        if len(self.contexts) >= self.hwctx_limit():
            log.error("%s: command opcode %#x failed, status %#x (firmware context limit %d reached)",
                      self.profile.name, FW_MSG_CREATE_CONTEXT, errno.EINVAL, self.hwctx_limit())
            log.error("%s: create context failed", self.profile.name)
            raise fail(errno.EINVAL, op, f"firmware refused CREATE_CONTEXT (limit {self.hwctx_limit()})")
        handle = client.next_ctx_handle()
        if handle is None:
            raise fail(errno.EBUSY, op, f"all {MAX_HWCTX_ID} context handles of this fd are live")
        syncobj_handle = Client.lowest_free(client.syncobjs)
        timeline = Timeline()
        client.syncobjs[syncobj_handle] = timeline
        self.next_fw_id += 1
        return HwCtx(handle=handle, syncobj=timeline, syncobj_handle=syncobj_handle, start_col=start, num_col=num_col,
                     fd=client, priority=map_priority(qos["priority"]), qos=qos, fw_id=self.next_fw_id,
                     pid=client.pid)

    def _check_qos(self, qos: dict, max_opc: int, op: str) -> None:
        # QoS solver (<= 7.0, spec 4.1 step 7): needed GOPS must fit max_opc at the top H-clock.
        if qos["gops"] == 0:
            return
        rate = max(qos["fps"], 1000 // qos["latency"] if qos["latency"] else 0)
        capacity = max_opc * self.profile.dpm_clocks[-1][1] // 1000
        if qos["gops"] * rate > capacity:
            raise fail(errno.EINVAL, op, f"invalid request: {qos['gops']} GOPS x {rate}/s > {capacity}")

    def _starts(self, num_col: int) -> list[int]:
        prof = self.profile
        if prof.aligned_placement:
            return list(range(0, prof.columns - num_col + 1, num_col))
        if num_col == prof.columns:
            return [0]          # only a full-width partition may use the reserved first column (spec 4.1 step 6)
        return list(range(prof.first_col, prof.columns - num_col + 1))

    def _place(self, num_col: int, op: str) -> int:
        used = {col for ctx in self.contexts for col in range(ctx.start_col, ctx.start_col + ctx.num_col)}
        starts = self._starts(num_col)
        if not starts:
            raise fail(errno.EINVAL, op, f"no legal start column for {num_col} columns")
        for start in starts:
            if used.isdisjoint(range(start, start + num_col)):
                return start
        for ctx in self.contexts:       # time-share a partition of identical start and width (spec 4.1 step 8)
            if ctx.num_col == num_col and ctx.start_col in starts:
                return ctx.start_col
        raise fail(errno.ENODEV, op, f"no free range of {num_col} columns and no partition to share")

    def _ioctl_destroy_hwctx(self, client: Client, a: dict) -> None:
        op = f"DESTROY_HWCTX(handle={a['handle']})"
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        with self.lock:
            ctx = client.contexts.get(a["handle"])
            if ctx is None:
                raise fail(errno.EINVAL, op, "HW context not exist")
        self.destroy_context(ctx)

    def destroy_context(self, ctx: HwCtx) -> None:
        """Tear a context down (DESTROY_HWCTX, fd close): firmware ends its jobs, then resources go."""
        client = ctx.fd
        with self.lock:
            if client.contexts.pop(ctx.handle, None) is None:
                return
            ctx.destroyed = True
            client.closing.append(ctx)
            self.cond.notify_all()
        self.firmware.destroy_context(ctx)      # waits for the last job, aborts the rest (spec 4.2)
        with self.lock:
            client.closing.remove(ctx)
            for bo in (*ctx.internal_bos, *(cu for cu, _ in ctx.cus), *ctx.dbg_bos):
                self.unref_bo(bo)
            for bo in ctx.dbg_bos:
                bo.dbg_ctx = None
            ctx.internal_bos, ctx.cus, ctx.dbg_bos = [], [], []
            self.cond.notify_all()

    def _ioctl_config_hwctx(self, client: Client, a: dict) -> None:
        op = f"CONFIG_HWCTX(handle={a['handle']}, param_type={a['param_type']})"
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        param = a["param_type"]
        data = b""
        if param == CONFIG_CU:
            if a["param_val_size"] > MAX_CONFIG_CU_SIZE:
                raise fail(errno.E2BIG, op, f"param_val_size={a['param_val_size']} > {MAX_CONFIG_CU_SIZE}")
            data = usermem.read(a["param_val"], a["param_val_size"], op + " param_val")
        elif param not in (ASSIGN_DBG_BUF, REMOVE_DBG_BUF) or self.profile.drm_minor < 3:
            raise fail(errno.EINVAL, op, "unknown param_type")
        with self.lock:
            ctx = client.contexts.get(a["handle"])
            if ctx is None:
                raise fail(errno.EINVAL, op, "HW context not exist")
            if param == CONFIG_CU:
                self._config_cu(client, ctx, data, a["param_val_size"], op)
            elif param == ASSIGN_DBG_BUF:
                self._assign_dbg(client, ctx, a["param_val"], op)
            else:
                self._remove_dbg(client, ctx, a["param_val"], op)

    def _config_cu(self, client: Client, ctx: HwCtx, data: bytes, size: int, op: str) -> None:
        padded = data.ljust(L.config_cu_header.size, b"\0")
        header = L.config_cu_header.unpack(padded)
        num = header["num_cus"]
        if header["pad0"] or header["pad1"] or header["pad2"]:
            raise fail(errno.EINVAL, op, "config pad must be 0")
        if ctx.cus:
            raise fail(errno.EINVAL, op, "Not support re-config CU")
        if num == 0:
            raise fail(errno.EINVAL, op, "num_cus is 0")
        if L.config_cu_header.size + L.cu_config.size * num > size:
            raise fail(errno.EINVAL, op, f"num_cus={num} does not fit param_val_size={size}")
        if num > MAX_CUS:
            raise fail(errno.EINVAL, op, f"num_cus={num} > {MAX_CUS}")
        cus = [L.cu_config.unpack(data, L.config_cu_header.size + L.cu_config.size * i) for i in range(num)]
        for i, cu in enumerate(cus):
            if cu["pad0"] or cu["pad1"] or cu["pad2"]:
                raise fail(errno.EINVAL, op, f"cu {i} pad must be 0")
            bo = client.bos.get(cu["cu_bo"])
            if bo is None or bo.kind != AMDXDNA_BO_DEV:
                raise fail(errno.EINVAL, op, f"cu {i}: cu_bo={cu['cu_bo']} is not a DEV BO")
        for cu in cus:
            bo = client.bos[cu["cu_bo"]]
            bo.refs += 1
            ctx.cus.append((bo, cu["cu_func"]))

    def _dbg_bo(self, client: Client, handle: int, op: str) -> Bo:
        bo = client.bos.get(handle)
        if bo is None or bo.kind != AMDXDNA_BO_DEV:
            raise fail(errno.EINVAL, op, f"debug BO handle={handle} is not a DEV BO")
        return bo

    def _assign_dbg(self, client: Client, ctx: HwCtx, handle: int, op: str) -> None:
        bo = self._dbg_bo(client, handle, op)
        if bo.dbg_ctx is not None:
            raise fail(errno.EBUSY, op, f"BO {handle} is already a debug buffer")
        bo.dbg_ctx = ctx
        bo.refs += 1
        ctx.dbg_bos.append(bo)

    def _remove_dbg(self, client: Client, ctx: HwCtx, handle: int, op: str) -> None:
        bo = self._dbg_bo(client, handle, op)
        if bo.dbg_ctx is not ctx:
            raise fail(errno.EINVAL, op, f"BO {handle} is not a debug buffer of context {ctx.handle}")
        bo.dbg_ctx = None
        ctx.dbg_bos.remove(bo)
        self.unref_bo(bo)

    # --- BO ioctls (spec 4.4-4.6, 7) ---

    def _ioctl_create_bo(self, client: Client, a: dict) -> None:
        kind, size = a["type"], a["size"]
        op = f"CREATE_BO(type={kind}, size={size:#x})"
        if a["flags"]:
            raise fail(errno.EINVAL, op, "flags must be 0")
        makers: dict[int, Callable] = {AMDXDNA_BO_SHMEM: self._create_shmem, AMDXDNA_BO_DEV_HEAP: self._create_heap,
                                       AMDXDNA_BO_DEV: self._create_dev, AMDXDNA_BO_CMD: self._create_cmd}
        maker = makers.get(kind)
        if maker is None:
            raise fail(errno.EINVAL, op, "unknown BO type")
        with self.lock:
            bo = maker(client, a, op)
            bo.handle = Client.lowest_free(client.bos)
            client.bos[bo.handle] = bo
            a["handle"] = bo.handle

    def _backed_bo(self, kind: int, size: int, op: str) -> Bo:
        if size > MAX_LFS_FILESIZE:
            raise fail(errno.EINVAL, op, f"size {size:#x} exceeds MAX_LFS_FILESIZE (shmem_file_setup)")
        try:
            memfd, backing, view = new_backing(size, f"amdxdna-{kind}")
        except OSError as exc:
            raise fail(errno.ENOMEM, op, f"backing store: {exc}") from exc
        bo = Bo(handle=0, kind=kind, size=size, mem=view, memfd=memfd, _backing=backing,
                map_offset=self.next_map_offset)
        self.next_map_offset += size
        self.live_bos += 1
        return bo

    def _create_shmem(self, client: Client, a: dict, op: str) -> Bo:
        if a["vaddr"]:
            raise fail(errno.EOPNOTSUPP, op, "user-pointer / dma-buf BOs (va_tbl) are not modelled")
        if a["size"] == 0:
            raise fail(errno.EINVAL, op, "size 0 (emulator choice; the driver leaves it unchecked)")
        return self._backed_bo(AMDXDNA_BO_SHMEM, page_align(a["size"]), op)

    def _create_cmd(self, client: Client, a: dict, op: str) -> Bo:
        if a["size"] < 4:
            raise fail(errno.EINVAL, op, "CMD BO smaller than its 4-byte header")
        return self._backed_bo(AMDXDNA_BO_CMD, page_align(a["size"]), op)

    def _create_heap(self, client: Client, a: dict, op: str) -> Bo:
        if self.profile.expandable_heap:
            return self._add_heap_chunk(client, a["size"], op)
        size = a["size"]
        if size > DEV_HEAP_MAX or size == 0:
            raise fail(errno.EINVAL, op, f"heap size must be 1..{DEV_HEAP_MAX:#x}")
        if client.memory.heap is not None:
            raise fail(errno.EBUSY, op, "this fd already has a DEV_HEAP")
        bo = self._backed_bo(AMDXDNA_BO_DEV_HEAP, page_align(size), op)
        bo.xdna_addr = AIE2_DEVM_BASE
        bo.refs += 1            # client->dev_heap: the fd keeps its heap until close (spec 7, lifetime)
        client.memory.heaps.append(bo)
        client.memory.allocator = HeapAllocator(bo.size)
        return bo

    def _add_heap_chunk(self, client: Client, size: int, op: str) -> Bo:
        # 2026 expandable heap (spec 4.4 staging): chunks of n x 64 MiB appended at 0x4000000 + cumulative size.
        memory, max_size = client.memory, self.profile.dev_heap_max_size
        if size == 0 or size % DEV_HEAP_CHUNK:
            raise fail(errno.EINVAL, op, f"heap size must be a non-zero multiple of {DEV_HEAP_CHUNK:#x}")
        offset = memory.heap_size
        if offset + size > max_size:
            raise fail(errno.ENOSPC, op, f"heap would grow to {offset + size:#x} > dev_heap_max_size {max_size:#x}")
        if memory.window is None:
            try:
                memory.window = HeapWindow(max_size)
            except OSError as exc:
                raise fail(errno.ENOMEM, op, f"backing store: {exc}") from exc
        try:
            memfd = memory.window.chunk_fd()
        except OSError as exc:
            raise fail(errno.ENOMEM, op, f"backing store: {exc}") from exc
        bo = Bo(handle=0, kind=AMDXDNA_BO_DEV_HEAP, size=size, mem=memory.window.view[offset:offset + size],
                xdna_addr=AIE2_DEVM_BASE + offset, map_offset=self.next_map_offset, memfd=memfd,
                file_offset=offset, _backing=memory.window.backing)
        self.next_map_offset += size
        self.live_bos += 1
        bo.refs += 1            # client->dev_heap_xa keeps every chunk until close (spec 7, lifetime)
        memory.heaps.append(bo)
        return bo

    def _new_dev_bo(self, client: Client, size: int, op: str, internal: bool = False) -> Bo | None:
        if self.profile.expandable_heap:
            return self._new_window_dev_bo(client, size, op, internal)
        memory = client.memory
        size = page_align(size)
        offset = memory.allocator.alloc(size)
        if offset is None:
            return None
        return self._place_dev_bo(memory, offset, size, [memory.heap], internal)

    def _new_window_dev_bo(self, client: Client, size: int, op: str, internal: bool) -> Bo:
        # Expandable heap (spec 4.4 staging): place in the whole window first (drm_mm), then find the chunks
        # under the range; a short, missing or unmapped heap is EAGAIN so the caller can grow it and retry.
        memory, max_size = client.memory, self.profile.dev_heap_max_size
        size = page_align(size)
        if size == 0 or size > max_size:
            raise fail(errno.EINVAL, op, f"size must be 1..{max_size:#x} (dev_heap_max_size)")
        offset = memory.allocator.alloc(size)
        if offset is None:
            raise fail(errno.ENOSPC, op, f"no free range of {size:#x} in the {max_size:#x} heap window")
        try:
            chunks = self._chunks_under(memory, offset, size, op)
        except OSError:
            memory.allocator.free(offset)
            raise
        return self._place_dev_bo(memory, offset, size, chunks, internal)

    def _place_dev_bo(self, memory: Memory, offset: int, size: int, chunks: list[Bo], internal: bool) -> Bo:
        """The DEV BO at heap-window `offset` (already allocated), over `chunks`: it holds every chunk it spans."""
        for chunk in chunks:
            chunk.refs += 1
        first = chunks[0]
        pages = memory.heap.mem if memory.window is None else memory.window.view
        bo = Bo(handle=0, kind=AMDXDNA_BO_DEV, size=size, mem=pages[offset:offset + size], heap=first,
                more_heaps=tuple(chunks[1:]), heap_offset=offset, xdna_addr=AIE2_DEVM_BASE + offset,
                vaddr=first.vaddr + offset - (first.xdna_addr - AIE2_DEVM_BASE), internal=internal, fd_memory=memory)
        memory.dev_bos[offset] = bo
        self.live_bos += 1
        return bo

    @staticmethod
    def _chunks_under(memory: Memory, offset: int, size: int, op: str) -> list[Bo]:
        """The heap chunks covering window range [offset, offset+size), mapped at contiguous user VAs.

        Raises:
            OSError: EAGAIN (no heap, a chunk unmapped, or the heap ends before the range), EINVAL
                (the chunks' user VAs are not contiguous).
        """
        if not memory.heaps:
            raise fail(errno.EAGAIN, op, "no DEV_HEAP on this fd yet")
        chunks: list[Bo] = []
        for index, chunk in enumerate(memory.heaps):
            start = chunk.xdna_addr - AIE2_DEVM_BASE
            if start + chunk.size <= offset:
                continue
            if chunk.vaddr == AMDXDNA_INVALID_ADDR:
                raise fail(errno.EAGAIN, op, f"heap chunk {index} is not mapped")
            if chunks and chunk.vaddr != chunks[-1].vaddr + chunks[-1].size:
                raise fail(errno.EINVAL, op, f"heap chunk {index} uva is not contiguous")
            chunks.append(chunk)
            if start + chunk.size >= offset + size:
                return chunks
        raise fail(errno.EAGAIN, op, f"heap ({memory.heap_size:#x} bytes) ends before {offset + size:#x}")

    def _create_dev(self, client: Client, a: dict, op: str) -> Bo:
        if self.profile.expandable_heap:
            return self._new_dev_bo(client, a["size"], op)
        heap = client.memory.heap
        if heap is None:
            raise fail(errno.EINVAL, op, "no DEV_HEAP on this fd")
        if heap.vaddr == AMDXDNA_INVALID_ADDR:
            raise fail(errno.EINVAL, op, "Invalid dev heap userptr (heap never mapped)")
        if a["size"] == 0 or a["size"] > heap.size:
            raise fail(errno.EINVAL, op, f"size must be 1..{heap.size:#x} (heap size)")
        bo = self._new_dev_bo(client, a["size"], op)
        if bo is None:
            raise fail(errno.ENOSPC, op, "no free heap range")
        return bo

    def _ioctl_get_bo_info(self, client: Client, a: dict) -> None:
        op = f"GET_BO_INFO(handle={a['handle']})"
        if a["ext"] or a["ext_flags"] or a["pad"]:
            raise fail(errno.EINVAL, op, "ext/ext_flags/pad must be 0")
        with self.lock:
            bo = client.bos.get(a["handle"])
            if bo is None:
                raise fail(errno.ENOENT, op, "unknown handle")
            a.update(map_offset=bo.map_offset, vaddr=bo.vaddr, xdna_addr=bo.xdna_addr)

    def _ioctl_sync_bo(self, client: Client, a: dict) -> None:
        op = f"SYNC_BO(handle={a['handle']}, direction={a['direction']})"
        with self.lock:
            bo = client.bos.get(a["handle"])
            if bo is None:
                raise fail(errno.ENOENT, op, "unknown handle")
            # The pages are ordinary shared memory here: the flush of [offset, offset+size) has nothing to do.
            if self.profile.drm_minor >= 3 and a["direction"] == SYNC_DIRECT_FROM_DEVICE:
                if bo.dbg_ctx is None:
                    raise fail(errno.EINVAL, op, "FROM_DEVICE on a BO that is not an assigned debug buffer")

    # --- execution (spec 4.7, 4.11) ---

    def _ioctl_exec_cmd(self, client: Client, a: dict) -> None:
        op = f"EXEC_CMD(hwctx={a['hwctx']}, cmd={a['cmd_handles'] & 0xFFFFFFFF})"
        if a["ext"] or a["ext_flags"]:
            raise fail(errno.EINVAL, op, "ext/ext_flags must be 0")
        if a["type"] != AMDXDNA_CMD_SUBMIT_EXEC_BUF:
            raise fail(errno.EINVAL, op, f"Invalid command type {a['type']}")
        if a["arg_count"] > MAX_ARG_COUNT:
            raise fail(errno.EINVAL, op, f"arg_count={a['arg_count']} > {MAX_ARG_COUNT}")
        if a["cmd_count"] != 1:
            raise fail(errno.EINVAL, op, f"cmd_count={a['cmd_count']} must be 1")
        raw = usermem.read(a["args"], 4 * a["arg_count"], op + " args")
        arg_handles = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
        with self.lock:
            cmd_bo, arg_bos = self._exec_bos(client, a["cmd_handles"] & 0xFFFFFFFF, arg_handles, op)
            ctx = client.contexts.get(a["hwctx"])
            if ctx is None:
                raise fail(errno.EINVAL, op, "hwctx not found")
            # The lookups take the references (spec 4.7 step 4), before the wait for a slot: a GEM_CLOSE
            # while this call blocks drops only the handle (rule D7).
            held = (cmd_bo, *arg_bos)
            for bo in held:
                bo.refs += 1
            try:
                self._wait_for_slot(ctx, op)
            except BaseException:
                for bo in held:
                    self.unref_bo(bo)
                raise
            a["seq"] = self._submit(ctx, cmd_bo, arg_bos)

    def _wait_for_slot(self, ctx: HwCtx, op: str) -> None:
        """Block (lock released) while the context has HWCTX_MAX_CMDS jobs in flight (spec 4.7 step 6)."""
        while ctx.inflight >= HWCTX_MAX_CMDS and not (ctx.destroyed or self.lost or self.closing):
            self.cond.wait()
        if self.lost or self.closing:
            raise fail(errno.ENODEV, op, "device lost or closed while waiting for an in-flight slot")
        if ctx.destroyed:
            raise fail(errno.EINVAL, op, "hwctx destroyed while waiting for an in-flight slot")

    def _exec_bos(self, client: Client, cmd_handle: int, arg_handles: list[int], op: str) -> tuple[Bo, list[Bo]]:
        cmd_bo = client.bos.get(cmd_handle)
        if cmd_bo is None or cmd_bo.kind != AMDXDNA_BO_CMD or cmd_bo.size > MAX_CMD_BO_SIZE:
            raise fail(errno.EINVAL, op, "Failed to get cmd bo (must be a CMD BO <= 32 KiB)")
        arg_bos = []
        for handle in arg_handles:
            bo = client.bos.get(handle)
            if bo is None:
                raise fail(errno.ENOENT, op, f"arg handle {handle} not found")
            arg_bos.append(bo)
        return cmd_bo, arg_bos

    def _submit(self, ctx: HwCtx, cmd_bo: Bo, arg_bos: list[Bo]) -> int:
        seq = ctx.next_seq
        ctx.next_seq += 1
        fence = Fence()
        ctx.syncobj.add(seq, fence)
        ctx.stats["submissions"] += 1
        # The job owns the references EXEC_CMD took until Job.complete drops them (spec 4.7 step 4, rule D7).
        job = Job(self, ctx, seq, cmd_bo, arg_bos, fence)
        ctx.jobs[seq] = job
        self.firmware.submit(job)
        return seq

    def _ioctl_wait_cmd(self, client: Client, a: dict) -> None:
        op = f"WAIT_CMD(hwctx={a['hwctx']}, seq={a['seq']})"
        if not self.profile.wait_cmd:
            raise fail(errno.EOPNOTSUPP, op, "AIE2 has no cmd_wait op upstream; wait on the hwctx syncobj")
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
            OSError: ENODEV when EmuDevice.close starts or the device is lost meanwhile (rule D5).
        """
        while not predicate():
            if self.closing:
                raise fail(errno.ENODEV, op, "the emulated device was closed while waiting")
            if self.lost:
                raise fail(errno.ENODEV, op, "device lost while waiting (drm_dev_is_unplugged)")
            remaining = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            # Sliced: INT64_MAX ns deadlines exceed threading.TIMEOUT_MAX; the loop re-checks anyway.
            self.cond.wait(min(remaining, WAIT_SLICE_S))
        return True

    # --- GET_INFO (spec 4.8, 10) ---

    def _param_handler(self, table: dict[int, tuple], param: int, op: str) -> Callable:
        """The handler of a GET_INFO / GET_ARRAY / SET_STATE param at this feature level (spec 10, 11).

        Raises:
            OSError: EOPNOTSUPP for a param the driver does not know (or not yet, at this DRM minor).
        """
        entry = table.get(param)
        if entry is None or self.profile.drm_minor < entry[1]:
            raise fail(errno.EOPNOTSUPP, op, f"Not supported request parameter (DRM minor {self.profile.drm_minor})")
        return functools.partial(getattr(self, entry[0]), *entry[2:])

    def _ioctl_get_info(self, client: Client, a: dict) -> None:
        op = f"GET_INFO(param={a['param']})"
        handler = self._param_handler(_GET_INFO, a["param"], op)
        with self.lock:
            handler(a, op)

    def _copy_result(self, a: dict, data: bytes, op: str) -> None:
        # <= 7.0 copies fixed-size results whole, whatever buffer_size says (spec 4.8, rule I1).
        usermem.write(a["buffer"], data, op + " buffer")

    def _info_aie_status(self, a: dict, op: str) -> None:
        status = L.query_aie_status.unpack(usermem.read(a["buffer"], L.query_aie_status.size, op))
        prof = self.profile
        if status["buffer_size"] > prof.columns * prof.col_size:
            raise fail(errno.EINVAL, op, f"status buffer_size={status['buffer_size']} > cols x col_size")
        cols = sorted({c for ctx in self.contexts for c in range(ctx.start_col, ctx.start_col + ctx.num_col)})
        if len(cols) * prof.col_size > status["buffer_size"]:
            raise fail(errno.EINVAL, op, f"{len(cols)} columns of status do not fit {status['buffer_size']} bytes")
        # The emulated array has no tile registers to dump: each live column's record is zeros.
        usermem.write(status["buffer"], bytes(len(cols) * prof.col_size), op + " status.buffer")
        status["cols_filled"] = sum(1 << c for c in cols)
        usermem.write(a["buffer"], L.query_aie_status.pack(status), op)

    def _info_aie_metadata(self, a: dict, op: str) -> None:
        prof = self.profile
        values = {"col_size": prof.col_size, "cols": prof.columns, "rows": prof.rows,
                  "version_major": prof.aie_arch[0], "version_minor": prof.aie_arch[1]}
        for kind in ("core", "mem", "shim"):
            values.update({f"{kind}_{k}": v for k, v in dataclasses.asdict(getattr(prof, kind)).items()})
        self._copy_result(a, L.query_aie_metadata.pack(values), op)

    def _info_aie_version(self, a: dict, op: str) -> None:
        major, minor = self.profile.aie_version
        self._copy_result(a, L.query_aie_version.pack({"major": major, "minor": minor}), op)

    def _info_clock_metadata(self, a: dict, op: str) -> None:
        mp_npu, h_clock = self.current_clocks()
        self._copy_result(a, L.query_clock_metadata.pack({
            "mp_npu_name": b"MP-NPU Clock", "mp_npu_freq_mhz": mp_npu, "h_name": b"H Clock", "h_freq_mhz": h_clock}),
            op)

    def _info_sensors(self, a: dict, op: str) -> None:
        raise fail(errno.EOPNOTSUPP, op, "no sensors on AIE2 (7.0; PMF unavailable)")

    def _info_hw_contexts(self, a: dict, op: str) -> None:
        entries = b"".join(L.query_hwctx.pack({
            "context_id": ctx.handle, "start_col": ctx.start_col, "num_col": ctx.num_col, "pid": ctx.pid,
            "command_submissions": ctx.stats["submissions"], "command_completions": ctx.stats["completions"],
            "errors": ctx.stats["errors"]}) for ctx in self.contexts)
        if len(entries) > a["buffer_size"]:
            raise fail(errno.EINVAL, op, f"{len(entries)} bytes of contexts do not fit {a['buffer_size']}")
        usermem.write(a["buffer"], entries, op + " buffer")
        # Since 6.18 the returned size is what is left of the input (spec 10 quirk); before, bytes written.
        a["buffer_size"] = a["buffer_size"] - len(entries) if self.profile.drm_minor >= 1 else len(entries)

    def _info_firmware_version(self, a: dict, op: str) -> None:
        major, minor, patch, build = self.profile.firmware_version
        self._copy_result(a, L.query_firmware_version.pack(
            {"major": major, "minor": minor, "patch": patch, "build": build}), op)

    def _info_power_mode(self, a: dict, op: str) -> None:
        self._copy_result(a, L.get_power_mode.pack({"power_mode": self.power_mode}), op)

    def _info_telemetry(self, a: dict, op: str) -> None:
        header_size = L.query_telemetry_header.size + 4 * self.profile.hwctx_limit
        if a["buffer_size"] <= header_size:
            raise fail(errno.EINVAL, op, f"buffer_size={a['buffer_size']} must exceed the {header_size}-byte header")
        header = L.query_telemetry_header.unpack(usermem.read(a["buffer"], L.query_telemetry_header.size, op))
        if header["type"] >= TELEMETRY_TYPES:
            raise fail(errno.EINVAL, op, f"telemetry type {header['type']} unknown to firmware")
        data_size = min(a["buffer_size"] - header_size, TELEMETRY_DATA_MAX)
        slots = [0] * self.profile.hwctx_limit
        for slot, ctx in enumerate(self.contexts[:len(slots)]):
            slots[slot] = ctx.handle
        header.update(major=1, minor=0, map_num_elements=len(slots))
        # The emulated firmware keeps no telemetry counters: the data part is zeros.
        payload = L.query_telemetry_header.pack(header) + b"".join(s.to_bytes(4, "little") for s in slots)
        usermem.write(a["buffer"], payload + bytes(data_size), op + " buffer")
        a["buffer_size"] = header_size + data_size

    def _info_preempt(self, key: str, a: dict, op: str) -> None:
        self._copy_result(a, L.attribute_state.pack({"state": self.preempt_state[key], "pad": b""}), op)

    def _info_resource(self, a: dict, op: str) -> None:
        prof = self.profile
        top = prof.dpm_clocks[-1][1]
        self._copy_result(a, L.get_resource_info.pack({
            "npu_clk_max": top, "npu_tops_max": prof.tops_max, "npu_task_max": self.hwctx_limit(),
            "npu_tops_curr": prof.tops_max * self.current_clocks()[1] // top, "npu_task_curr": len(self.contexts)}), op)

    # --- GET_ARRAY (spec 4.9, 10) ---

    def _ioctl_get_array(self, client: Client, a: dict) -> None:
        op = f"GET_ARRAY(param={a['param']})"
        if a["pad"] or a["num_element"] == 0 or a["element_size"] == 0:
            raise fail(errno.EINVAL, op, "pad must be 0, num_element and element_size non-zero")
        handler = self._param_handler(_GET_ARRAY, a["param"], op)
        with self.lock:
            handler(client, a, op)

    def _array_hwctx_all(self, client: Client, a: dict, op: str) -> None:
        if a["element_size"] > 4096 or a["num_element"] > 1024:
            raise fail(errno.EINVAL, op, "element_size must be 1..4096 and num_element <= 1024")
        size = min(a["element_size"], L.hwctx_entry.size)
        entries = [self._hwctx_entry(ctx)[:size] for ctx in self.contexts[:a["num_element"]]]
        usermem.write(a["buffer"], b"".join(entries), op + " buffer")
        a["element_size"], a["num_element"] = size, len(entries)

    def _hwctx_entry(self, ctx: HwCtx) -> bytes:
        qos = ctx.qos
        return L.hwctx_entry.pack({
            "context_id": ctx.handle, "start_col": ctx.start_col, "num_col": ctx.num_col, "hwctx_id": ctx.fw_id,
            "pid": ctx.pid, "command_submissions": ctx.stats["submissions"],
            "command_completions": ctx.stats["completions"], "errors": ctx.stats["errors"],
            "priority": ctx.priority, "heap_usage": sum(bo.size for bo in ctx.internal_bos),
            "state": AMDXDNA_HWCTX_STATE_ACTIVE, "pasid": ctx.fd.pasid, "gops": qos["gops"], "fps": qos["fps"],
            "dma_bandwidth": qos["dma_bandwidth"], "latency": qos["latency"],
            "frame_exec_time": qos["frame_exec_time"]})

    def _array_async_err(self, client: Client, a: dict, op: str) -> None:
        usermem.write(a["buffer"], L.async_error.pack(self.last_async_error), op + " buffer")
        a["element_size"], a["num_element"] = ASYNC_ERROR_SIZE, 1

    def _array_bo_usage(self, client: Client, a: dict, op: str) -> None:
        if a["num_element"] != 1:
            raise fail(errno.EINVAL, op, "BO_USAGE takes exactly one element")
        size = min(a["element_size"], L.bo_usage.size)
        query = L.bo_usage.unpack(usermem.read(a["buffer"], size, op).ljust(L.bo_usage.size, b"\0"))
        if query["pid"] == 0:
            raise fail(errno.EINVAL, op, "pid must be non-zero")
        usage = {"pid": query["pid"], "total_usage": 0, "internal_usage": 0, "heap_usage": 0}
        for other in self.clients:
            if other.pid == query["pid"]:
                _add_usage(usage, other)
        usermem.write(a["buffer"], L.bo_usage.pack(usage)[:size], op + " buffer")
        a["element_size"] = size

    # --- SET_STATE (spec 4.10, 10) ---

    def _ioctl_set_state(self, client: Client, a: dict) -> None:
        op = f"SET_STATE(param={a['param']})"
        handler = self._param_handler(_SET_STATE, a["param"], op)
        with self.lock:
            handler(a, op)

    def _set_power_mode(self, a: dict, op: str) -> None:
        request = L.set_power_mode.unpack(usermem.read(a["buffer"], L.set_power_mode.size, op + " buffer"))
        mode = request["power_mode"]
        if any(request["pad"]):
            raise fail(errno.EINVAL, op, "pad must be 0")
        if mode > POWER_MODE_TURBO:
            raise fail(errno.EINVAL, op, f"power_mode={mode} > TURBO")
        if mode in (POWER_MODE_LOW, POWER_MODE_MEDIUM):
            raise fail(errno.EOPNOTSUPP, op, "LOW/MEDIUM power modes are not supported")
        if mode == POWER_MODE_TURBO and self.contexts and self.power_mode != POWER_MODE_TURBO:
            raise fail(errno.EINVAL, op, "TURBO while hardware contexts exist")
        self.power_mode = mode

    def _set_preempt(self, key: str, a: dict, op: str) -> None:
        request = L.attribute_state.unpack(usermem.read(a["buffer"], L.attribute_state.size, op + " buffer"))
        if request["state"] > 1:
            raise fail(errno.EINVAL, op, f"state={request['state']} > 1")
        if any(request["pad"]):
            raise fail(errno.EINVAL, op, "pad must be 0")
        self.preempt_state[key] = request["state"]

    # --- syncobjs (spec 5, rule D8) ---

    def _syncobj(self, client: Client, handle: int, op: str, code: int = errno.ENOENT) -> Timeline:
        timeline = client.syncobjs.get(handle)
        if timeline is None:
            raise fail(code, op, f"syncobj handle={handle} unknown")
        return timeline

    def _ioctl_syncobj_create(self, client: Client, a: dict) -> None:
        if a["flags"] & ~DRM_SYNCOBJ_CREATE_SIGNALED:
            raise fail(errno.EINVAL, "SYNCOBJ_CREATE", f"flags={a['flags']:#x}")
        with self.lock:
            a["handle"] = Client.lowest_free(client.syncobjs)
            client.syncobjs[a["handle"]] = Timeline(signalled=bool(a["flags"] & DRM_SYNCOBJ_CREATE_SIGNALED))

    def _ioctl_syncobj_destroy(self, client: Client, a: dict) -> None:
        op = f"SYNCOBJ_DESTROY(handle={a['handle']})"
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        with self.lock:
            if client.syncobjs.pop(a["handle"], None) is None:
                raise fail(errno.EINVAL, op, "unknown handle")

    def _handles(self, client: Client, a: dict, op: str) -> list[Timeline]:
        count = a["count_handles"]
        if count == 0:
            raise fail(errno.EINVAL, op, "count_handles is 0")
        raw = _user_array(a["handles"], count, 4, op, "handles")
        with self.lock:
            return [self._syncobj(client, int.from_bytes(raw[i:i + 4], "little"), op) for i in range(0, 4 * count, 4)]

    def _points(self, a: dict, op: str) -> list[int]:
        raw = _user_array(a["points"], a["count_handles"], 8, op, "points")
        return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]

    def _ioctl_syncobj_wait(self, client: Client, a: dict) -> None:
        self._syncobj_wait(client, a, "SYNCOBJ_WAIT", None)

    def _ioctl_syncobj_timeline_wait(self, client: Client, a: dict) -> None:
        self._syncobj_wait(client, a, "SYNCOBJ_TIMELINE_WAIT", "points")

    def _syncobj_wait(self, client: Client, a: dict, op: str, points_key: str | None) -> None:
        flags = a["flags"]
        known = (DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL | DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT
                 | DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE | DRM_SYNCOBJ_WAIT_FLAGS_WAIT_DEADLINE)
        if flags & ~known:
            raise fail(errno.EINVAL, op, f"flags={flags:#x}")
        timelines = self._handles(client, a, op)
        points = self._points(a, op) if points_key else [0] * len(timelines)
        deadline = _deadline(a["timeout_nsec"])
        with self.lock:
            if not flags & DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT:
                for index, (tl, point) in enumerate(zip(timelines, points, strict=True)):
                    if tl.fences_for(point) is None:
                        raise fail(errno.EINVAL, op, f"entry {index}: point {point} not submitted")
            ready = _wait_predicate(timelines, points, flags)
            if not self._wait_until(lambda: ready() is not None, deadline, op):
                raise fail(errno.ETIME, op, "timeout")
            first = ready()
            if not flags & DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL:
                a["first_signaled"] = first

    def _ioctl_syncobj_reset(self, client: Client, a: dict) -> None:
        self._binary(client, a, "SYNCOBJ_RESET", None)

    def _ioctl_syncobj_signal(self, client: Client, a: dict) -> None:
        self._binary(client, a, "SYNCOBJ_SIGNAL", Fence(True))

    def _binary(self, client: Client, a: dict, op: str, fence: Fence | None) -> None:
        if a["pad"]:
            raise fail(errno.EINVAL, op, "pad must be 0")
        timelines = self._handles(client, a, op)
        with self.lock:
            for timeline in timelines:
                timeline.replace(fence)
            self.cond.notify_all()

    def _ioctl_syncobj_query(self, client: Client, a: dict) -> None:
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

    def _ioctl_syncobj_timeline_signal(self, client: Client, a: dict) -> None:
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

    def _put_client(self, client: Client) -> None:
        with self.lock:
            client.users -= 1
            if client.users or not client.closed:
                return
        self._release_client(client)

    def _release_client(self, client: Client) -> None:
        with self.lock:
            contexts = list(client.contexts.values())
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
            self.clients.remove(client)
            self.cond.notify_all()


# Dispatch tables: param -> (method, minimum DRM minor, leading arguments) (spec 10, 11).
_GET_INFO = {0: ("_info_aie_status", 0), 1: ("_info_aie_metadata", 0), 2: ("_info_aie_version", 0),
             3: ("_info_clock_metadata", 0), 4: ("_info_sensors", 0), 5: ("_info_hw_contexts", 0),
             8: ("_info_firmware_version", 0), 9: ("_info_power_mode", 0), 10: ("_info_telemetry", 5),
             11: ("_info_preempt", 6, "force"), 12: ("_info_resource", 4), 13: ("_info_preempt", 6, "frame_boundary")}
_GET_ARRAY = {0: ("_array_hwctx_all", 1), 2: ("_array_async_err", 2), 6: ("_array_bo_usage", 8)}
_SET_STATE = {0: ("_set_power_mode", 0), 3: ("_set_preempt", 6, "force"),
              4: ("_set_preempt", 6, "frame_boundary")}


def map_priority(priority: int) -> int:
    """QoS priority as the driver keeps it: one of the four defines, anything else HIGH (rule H9)."""
    return priority if priority in QOS_PRIORITIES else QOS_PRIORITY_HIGH


def _add_usage(usage: dict, client: Client) -> None:
    # Heap and CMD count as internal, SHMEM as external, DEV only in heap_usage (spec 10 BO_USAGE).
    for bo in client.bos.values():
        if bo.kind == AMDXDNA_BO_DEV:
            usage["heap_usage"] += bo.size
            continue
        usage["total_usage"] += bo.size
        if bo.kind in (AMDXDNA_BO_DEV_HEAP, AMDXDNA_BO_CMD):
            usage["internal_usage"] += bo.size


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


# =====================================================================================================
# The seam
# =====================================================================================================

class EmuSeam:
    """One open fd of an EmuDevice, implementing the Seam protocol (docs/design.md section 1)."""

    def __init__(self, device: EmuDevice, client: Client):
        self.device = device
        self.client = client
        self.name = f"emu:{device.profile.name}"

    def ioctl(self, request: int, buf) -> int:
        """Run a raw ioctl on this fd; results are written into `buf`.

        Raises:
            OSError: the driver's errno.
        """
        return self.device.ioctl(self.client, request, buf)

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
        if client.closed:
            raise fail(errno.EBADF, op, "fd closed")
        bo = next((b for b in client.bos.values() if b.map_offset == offset and b.memfd >= 0), None)
        if bo is None:
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
        bo.refs += 1        # a mapping keeps the GEM object alive (spec 7, lifetime)
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
        jobs to end, as the driver's MMU notifier waits on the BO's fences (spec 7, lifetime): the device
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

    def close(self) -> None:
        """Close the fd: every context of it is destroyed, its handles dropped (idempotent)."""
        self.device.close_client(self.client)

    def __enter__(self) -> EmuSeam:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_MAP_NORESERVE = 0x4000


def _ints(op: str, **values) -> list[int]:
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
