"""Opening a device, typed info queries, the per-fd device heap, ioctl dispatch and teardown.

``open_device`` finds or builds a seam (real ``/dev/accel/accelN`` or the emulator) and returns a
``Device``; everything else (buffers, contexts, runs) is created from it and closed with it, in
reverse order of creation (docs/xrt-sequence.md 1.10).
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import signal
import struct
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from . import abi, trace
from .errors import DeviceLostError, NoDeviceError, XdnaError, errno_text, format_call, ioctl_error
from .seam import OsSeam, Seam

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

    from .bo import Bo
    from .emu import EmuDevice
    from .hwctx import HwContext

__all__ = [
    "open_device", "Device", "DriverVersion", "AieVersion", "TileMetadata", "AieMetadata", "Clock",
    "ClockMetadata", "FirmwareVersion", "HwContextEntry", "HWCTX_ENTRY_SIZE", "decode_hwctx_entries", "PowerMode",
    "ResourceInfo", "HeapChunk", "BoInfo", "DeviceFile", "CpuMapping", "DRIVER_NAME", "HEAP_CHUNK_SIZE",
    "HEAP_MAX_SIZE", "PCI_GENERATIONS", "POWER_MODES", "TXN_DEV_GEN", "pci_generation", "uninterrupted",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

DRIVER_NAME = "amdxdna_accel_driver"  # DRM_IOCTL_VERSION name (docs/uapi.md 5)
DEFAULT_EMU_PROFILE = "npu4"
# The heap: 64 MiB chunks (AIE2_DEVM_SIZE), mapped at a 64 MiB-aligned VA as XRT, XRT-lite and ROCr do;
# newer drivers grow it contiguously up to 512 MiB (docs/xrt-sequence.md 1.2, docs/uapi.md 4.4).
HEAP_CHUNK_SIZE = 64 << 20
HEAP_MAX_SIZE = 512 << 20
# (PCI device id, revision) -> NPU generation, the driver's PCI table (docs/xrt-sequence.md 1.1).
PCI_GENERATIONS = {(0x1502, 0x00): "npu1", (0x17F0, 0x10): "npu4", (0x17F0, 0x11): "npu5", (0x17F0, 0x20): "npu6"}
# TXN header dev_gen an instruction stream must carry for each generation (docs/xrt-sequence.md 2.3, 4).
TXN_DEV_GEN = {"npu1": 3, "npu4": 4, "npu5": 4, "npu6": 4}
SYSFS_ACCEL = "/sys/class/accel"

_PERMISSION_HINT = ("add your user to the 'render' group (sudo usermod -aG render $USER, then log in again); "
                    "in a container pass --device /dev/accel/accel0 --group-add render")
_NO_DEVICE_HINT = ("no /dev/accel/accel* node bound to the amdxdna driver; to run without an NPU use the "
                   "emulator: open_device('emu') or AMDXDNA_DEVICE=emu (profiles: emu:npu1, emu:npu4, ...)")


def pci_generation(device_id: int, revision: int) -> str | None:
    """The NPU generation of a PCI device id and revision, or None when the driver does not know it."""
    return PCI_GENERATIONS.get((device_id, revision))


# ---------------------------------------------------------------------------------------------
# typed info results (GET_INFO payloads, docs/uapi.md 2.5 and 10)


@dataclass(frozen=True)
class DriverVersion:
    """DRM_IOCTL_VERSION answer: the driver name, feature-level version and description."""

    name: str
    major: int
    minor: int
    patchlevel: int
    date: str
    desc: str


@dataclass(frozen=True)
class AieVersion:
    """QUERY_AIE_VERSION: firmware-reported AIE protocol version."""

    major: int
    minor: int


@dataclass(frozen=True)
class TileMetadata:
    """One tile-row class of QUERY_AIE_METADATA (core, mem or shim)."""

    row_count: int
    row_start: int
    dma_channel_count: int
    lock_count: int
    event_reg_count: int


@dataclass(frozen=True)
class AieMetadata:
    """QUERY_AIE_METADATA: array geometry; ``core.row_count`` sizes contexts (num_tiles)."""

    col_size: int
    cols: int
    rows: int
    version: AieVersion
    core: TileMetadata
    mem: TileMetadata
    shim: TileMetadata


@dataclass(frozen=True)
class Clock:
    """One named clock and its frequency."""

    name: str
    freq_mhz: int


@dataclass(frozen=True)
class ClockMetadata:
    """QUERY_CLOCK_METADATA."""

    mp_npu_clock: Clock
    h_clock: Clock


@dataclass(frozen=True)
class FirmwareVersion:
    """QUERY_FIRMWARE_VERSION."""

    major: int
    minor: int
    patch: int
    build: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}.{self.build}"


HWCTX_STATE_NAMES = {0: "IDLE", 1: "ACTIVE"}   # amdxdna_drm_hwctx_entry.state (docs/runtime.md 2)


@dataclass(frozen=True)
class HwContextEntry:
    """One hardware context of the device, any process's (docs/runtime.md 2).

    From GET_ARRAY(HW_CONTEXT_ALL) (``source == "GET_ARRAY"``): every field the driver's entry holds,
    read up to the ``element_size`` the driver returned (144 bytes on mainline, 160 on staging /
    out-of-tree drivers, which add the process ``name``); a field past that size is None. From
    GET_INFO(QUERY_HW_CONTEXTS) (``source == "QUERY_HW_CONTEXTS"``, drivers without GET_ARRAY): the
    first nine fields; the others are None.
    """

    context_id: int
    start_col: int
    num_col: int
    pid: int
    command_submissions: int
    command_completions: int
    migrations: int
    preemptions: int
    errors: int
    hwctx_id: int | None = None             # the firmware's context id
    priority: int | None = None             # qos priority (AMDXDNA_QOS_*_PRIORITY)
    heap_usage: int | None = None           # bytes of the fd's heap the context's own buffers take
    suspensions: int | None = None
    state: int | None = None                # 0 IDLE, 1 ACTIVE
    pasid: int | None = None
    gops: int | None = None                 # the QoS the context was created with ...
    fps: int | None = None
    dma_bandwidth: int | None = None
    latency: int | None = None
    frame_exec_time: int | None = None      # ... down to here
    txn_op_idx: int | None = None           # health: the TXN op the firmware was at
    ctx_pc: int | None = None
    fatal_error_type: int | None = None
    fatal_error_exception_type: int | None = None
    fatal_error_exception_pc: int | None = None
    fatal_error_app_module: int | None = None
    name: str | None = None                 # the process name (160-byte entries only)
    element_size: int = 0                   # bytes per entry as the driver returned them
    source: str = "GET_ARRAY"

    @property
    def state_name(self) -> str | None:
        """``IDLE`` / ``ACTIVE`` (``STATE_<n>`` for another value), None when the driver did not say."""
        if self.state is None:
            return None
        return HWCTX_STATE_NAMES.get(self.state, f"STATE_{self.state}")


# GET_ARRAY(HW_CONTEXT_ALL) entry fields in struct order, from the cdef (docs/runtime.md 2).
_ENTRY_CTYPE = "struct amdxdna_drm_hwctx_entry"
_QUERY_FIELDS = ("context_id", "start_col", "num_col", "pid", "command_submissions", "command_completions",
                 "migrations", "preemptions", "errors")
HWCTX_ENTRY_SIZE = abi.ffi.sizeof(_ENTRY_CTYPE)
#: GET_ARRAY's element count limit (AMDXDNA_MAX_NUM_ELEMENT, docs/runtime.md 2).
MAX_ARRAY_ELEMENTS = 1024


def _entry_layout() -> tuple[tuple[str, int, str], ...]:
    """(field, offset, struct format) for every field of the entry but ``pad``."""
    formats = {1: "B", 4: "I", 8: "Q"}
    out = []
    for name, field in abi.ffi.typeof(_ENTRY_CTYPE).fields:
        if name == "pad":
            continue
        ctype = field.type
        if ctype.kind == "array":
            out.append((name, field.offset, f"{ctype.length}s"))
        else:
            fmt = formats[abi.ffi.sizeof(ctype)]
            out.append((name, field.offset, fmt.lower() if ctype.cname.startswith("int") else fmt))
    return tuple(out)


_ENTRY_LAYOUT = _entry_layout()


def decode_hwctx_entries(raw: bytes | bytearray | memoryview, element_size: int, count: int) -> list[HwContextEntry]:
    """Decode ``count`` GET_ARRAY(HW_CONTEXT_ALL) entries of ``element_size`` bytes each from ``raw``.

    Entry ``i`` starts at ``i * element_size``; a field is read only if it lies wholly inside the first
    ``element_size`` bytes of the entry (else it is None): 144-byte mainline entries have no ``name``.

    Raises:
        ValueError: ``element_size`` does not cover the nine fields every driver has, or ``raw`` is
            shorter than ``count * element_size``.
    """
    minimum = max(off + struct.calcsize(fmt) for name, off, fmt in _ENTRY_LAYOUT if name in _QUERY_FIELDS)
    if element_size < minimum:
        raise ValueError(f"hwctx entries of {element_size} bytes: an entry holds at least {minimum}")
    if count < 0 or len(raw) < count * element_size:
        raise ValueError(f"{count} hwctx entries of {element_size} bytes need {count * element_size} bytes, "
                         f"got {len(raw)}")
    view = memoryview(raw).cast("B")
    covered = [(name, off, fmt) for name, off, fmt in _ENTRY_LAYOUT if off + struct.calcsize(fmt) <= element_size]
    entries = []
    for i in range(count):
        base = i * element_size
        values = {name: struct.unpack_from("<" + fmt, view, base + off)[0] for name, off, fmt in covered}
        if isinstance(values.get("name"), bytes):
            values["name"] = values["name"].split(b"\0", 1)[0].decode(errors="replace")
        entries.append(HwContextEntry(**values, element_size=element_size, source="GET_ARRAY"))
    return entries


POWER_MODE_NAMES = {0: "DEFAULT", 1: "LOW", 2: "MEDIUM", 3: "HIGH", 4: "TURBO"}
#: Power mode names (lower case) -> amdxdna_power_mode_type values, for ``Device.set_power_mode``.
POWER_MODES = {name.lower(): value for value, name in POWER_MODE_NAMES.items()}
# SET_STATE(SET_POWER_MODE) refusals -> what to do (docs/runtime.md 3.2).
_POWER_MODE_HINTS = {
    errno.EACCES: "SET_STATE is root-only (DRM_ROOT_ONLY): the process needs CAP_SYS_ADMIN (run it as root)",
    errno.EPERM: "SET_STATE is root-only (DRM_ROOT_ONLY): the process needs CAP_SYS_ADMIN (run it as root)",
    errno.EOPNOTSUPP: "the driver supports DEFAULT, HIGH and TURBO only",
}


@dataclass(frozen=True)
class PowerMode:
    """GET_POWER_MODE."""

    mode: int

    @property
    def name(self) -> str:
        """DEFAULT / LOW / MEDIUM / HIGH / TURBO."""
        return POWER_MODE_NAMES.get(self.mode, f"MODE_{self.mode}")


@dataclass(frozen=True)
class ResourceInfo:
    """QUERY_RESOURCE_INFO (driver feature level 0.4+)."""

    npu_clk_max: int
    npu_tops_max: int
    npu_task_max: int
    npu_tops_curr: int
    npu_task_curr: int


@dataclass(frozen=True)
class HeapChunk:
    """One 64 MiB DEV_HEAP BO and where it is mapped."""

    handle: int
    xdna_addr: int
    va: int
    size: int


# ---------------------------------------------------------------------------------------------
# Ctrl-C while a resource is acquired or released (docs/runtime.md 5)

# The C functions behind the ``signal`` module: its wrappers convert every answer to an enum, which costs
# ten times the call itself on a path every buffer creation and close takes.
_csignal: Any = getattr(signal, "_signal", signal)
_MAIN_THREAD = threading.main_thread().ident


class _Deferral:
    """The one deferral in progress (only the main thread receives SIGINT): depth, replaced handler, signal."""

    depth = 0
    previous: Any = None
    caught: tuple[int, Any] | None = None


def _defer_sigint(signum: int, frame: Any) -> None:
    _Deferral.caught = (signum, frame)


class uninterrupted:  # noqa: N801 - used as ``with uninterrupted():``, like a function
    """Defer SIGINT (Ctrl-C) until the block ends: a sequence of syscalls that acquires or releases a
    resource (CREATE_BO + GET_BO_INFO + mmap, munmap + GEM_CLOSE, CREATE_HWCTX + CONFIG_CU ...) then runs
    whole, and the KeyboardInterrupt is raised when it is done, by the handler that was installed
    (docs/runtime.md 5). Nests; does nothing outside the main thread (which is where Python runs signal
    handlers), or when SIGINT's handler was not installed from Python, or is ignored."""

    __slots__ = ("_active",)

    def __enter__(self) -> uninterrupted:
        self._active = False
        if threading.get_ident() != _MAIN_THREAD:
            return self
        if _Deferral.depth:
            _Deferral.depth += 1
            self._active = True
            return self
        previous = _csignal.getsignal(signal.SIGINT)
        if previous is None or previous == signal.SIG_IGN:
            return self
        _csignal.signal(signal.SIGINT, _defer_sigint)
        _Deferral.previous, _Deferral.caught, _Deferral.depth = previous, None, 1
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        _Deferral.depth -= 1
        if _Deferral.depth:
            return
        previous, caught = _Deferral.previous, _Deferral.caught
        _Deferral.previous = _Deferral.caught = None
        _csignal.signal(signal.SIGINT, previous)
        if caught is None:
            return
        if callable(previous):
            previous(*caught)           # signal.default_int_handler raises KeyboardInterrupt here
        else:                           # SIG_DFL: what the signal would have done
            signal.raise_signal(signal.SIGINT)


# ---------------------------------------------------------------------------------------------
# the open file: what finalizers hold (never the Device itself, so a Device can be collected)


class _Resource:
    """An idempotent release action registered with the file; runs at most once."""

    __slots__ = ("_fn", "_args", "alive")

    def __init__(self, fn: Callable[..., None], *args: Any) -> None:
        self._fn: Callable[..., None] | None = fn
        self._args: tuple[Any, ...] = args
        self.alive = True

    def __call__(self) -> None:
        with uninterrupted():       # a release runs whole; Ctrl-C is raised once it is done
            if self.alive:
                self.alive = False
                fn, args = self._fn, self._args
                self._fn, self._args = None, ()
                if fn is not None:  # always set while alive
                    fn(*args)

    def detach(self) -> None:
        """Forget the action without running it."""
        self.alive = False
        self._fn, self._args = None, ()


class DeviceFile:
    """The open device file: seam, ioctl dispatch (trace, stats, typed errors, lost latch) and the
    ordered registry of everything created on it. Buffers and contexts hold this, not the Device."""

    def __init__(self, seam: Seam, emulator: EmuDevice | None = None, owns_emulator: bool = False) -> None:
        self.seam = seam
        self.name = seam.name
        self.emulator = emulator
        self.owns_emulator = owns_emulator
        self.stats: Counter[str] = Counter()
        self.lost: DeviceLostError | None = None
        self.lock = threading.RLock()
        self.closed = False
        self._children: list[Any] = []
        # GEM handle -> Bo objects holding it: importing a dma-buf this fd already has returns the same handle
        # (docs/runtime.md 3.3), which is closed once, by the last of them.
        self._handle_refs: dict[int, int] = {}
        # Mappings whose munmap waits for numpy views (``CpuMapping``); the seam stays open until they are gone.
        self._pins = 0
        self._finish_pending = False
        self._closing: tuple[int, threading.Event] | None = None    # (closing thread, done)

    def ioctl(self, request: int, cdata: abi.CData, fields: Mapping[str, Any] | None = None, hint: str = "") -> int:
        """Issue ``request`` on the cffi struct ``cdata`` (passed as ``ffi.buffer``).

        Raises:
            DeviceLostError: the device was lost earlier (latched) or answers ENODEV now.
            XdnaError: the typed error for the errno, naming the ioctl and ``fields``.
        """
        return self.ioctl_buffer(request, abi.ffi.buffer(cdata), fields, hint)

    def ioctl_buffer(self, request: int, buf: WriteableBuffer, fields: Mapping[str, Any] | None = None,
                     hint: str = "") -> int:
        """``ioctl`` on a raw writable buffer (same errors)."""
        return self.ioctl_named(request, trace.describe_request(request)[0], buf, fields, hint)

    def ioctl_named(self, request: int, name: str, buf: WriteableBuffer, fields: Mapping[str, Any] | None = None,
                    hint: str = "") -> int:
        """``ioctl_buffer`` for a request whose short ``name`` the caller already knows (the dispatch path:
        EXEC_CMD and the waits), without looking it up per call. Same errors."""
        if self.lost is not None or self.closed:
            self.check_open(name, fields)
        with self.lock:
            self.stats[name] += 1
        try:
            if trace.enabled():
                return trace.TRACER.call(self.name, request, buf, self.seam.ioctl)
            return self.seam.ioctl(request, buf)
        except OSError as exc:
            raise self.error(name, fields, exc, hint) from exc

    def confirm_lost(self, cause: BaseException) -> None:
        """Raise (and latch) ``DeviceLostError`` if the device is gone, else return: a DRM VERSION ioctl, which
        needs nothing but a live device, tells a removed device from a refusal or an aborted command
        (docs/runtime.md 4.3).

        Raises:
            DeviceLostError: the device answered ENODEV (or was lost earlier), chained to ``cause``.
        """
        req = abi.ffi.new("struct drm_version *")
        try:
            self.ioctl(abi.DRM_IOCTL_VERSION, req)
        except DeviceLostError as lost:
            raise lost from cause
        except XdnaError:
            return

    def check_open(self, name: str, fields: Mapping[str, Any] | None = None) -> None:
        """Raise what an ioctl ``name`` would raise now on a lost or closed device, before any work.

        Raises:
            DeviceLostError: the device was lost earlier.
            XdnaError: EBADF, the device is closed.
        """
        if self.lost is not None:
            raise DeviceLostError(errno.ENODEV, f"{format_call(name, fields)}: device lost earlier: {self.lost}")
        if self.closed:
            raise ioctl_error(name, fields, errno.EBADF, "device closed")

    def error(self, name: str, fields: Mapping[str, Any] | None, exc: OSError, hint: str = "") -> XdnaError:
        """The typed error for a failed syscall on this file; a ``DeviceLostError`` is latched here, so
        every later ioctl raises it without reaching the device."""
        err = ioctl_error(name, fields, exc.errno or errno.EIO, hint)
        if isinstance(err, DeviceLostError) and self.lost is None:
            self.lost = err
        return err

    def ref_handle(self, handle: int) -> int:
        """Count one more holder of GEM ``handle``; returns the count."""
        with self.lock:
            self._handle_refs[handle] = self._handle_refs.get(handle, 0) + 1
            return self._handle_refs[handle]

    def unref_handle(self, handle: int) -> bool:
        """Drop a holder of ``handle``; True when it was the last (the handle is then to be closed)."""
        with self.lock:
            left = self._handle_refs.get(handle, 1) - 1
            if left > 0:
                self._handle_refs[handle] = left
                return False
            self._handle_refs.pop(handle, None)
            return True

    def register(self, fn: Callable[..., None], *args: Any) -> _Resource:
        """Record a release action; ``close`` runs the live ones in reverse order of registration."""
        res = _Resource(fn, *args)
        with self.lock:
            if len(self._children) > 64 and len(self._children) % 64 == 0:
                self._children = [c for c in self._children if c.alive]
            self._children.append(res)
        return res

    def close(self) -> None:
        """Release every registered resource (newest first), then close the seam; idempotent.

        A second caller (another thread) waits for the first one to finish instead of closing the seam
        under it; what is registered while closing is released too.

        Raises:
            XdnaError: the first release that failed (the rest still ran).
            KeyboardInterrupt: a release was interrupted (the rest still ran, the seam was closed).
        """
        with self.lock:
            earlier = self._closing
            if earlier is None:
                self._closing = closing = (threading.get_ident(), threading.Event())
        if earlier is not None:     # closed or closing already: by this thread (re-entered), or wait for the other
            if earlier[0] != threading.get_ident():
                earlier[1].wait()
            return
        first: BaseException | None = None
        interrupted: BaseException | None = None
        try:
            while True:
                with self.lock:
                    children, self._children = self._children, []
                if not children:
                    break
                for res in reversed(children):
                    try:
                        res()
                    except XdnaError as exc:
                        first = first or exc
                    except BaseException as exc:  # noqa: BLE001 - a Ctrl-C: release the rest, then re-raise
                        interrupted = interrupted or exc
            with self.lock:
                self.closed = True
                self._finish_pending = self._pins > 0
            if not self._finish_pending:
                self._finish()
        finally:
            closing[1].set()
        if interrupted is not None:
            raise interrupted
        if first is not None:
            raise first

    def pin(self) -> None:
        """Keep the file open (past ``close``) until ``unpin``: a mapping still has numpy views."""
        with self.lock:
            self._pins += 1

    def unpin(self) -> None:
        """Drop a ``pin``; the last one after ``close`` closes the seam (and the owned emulator)."""
        with self.lock:
            self._pins -= 1
            due = self._finish_pending and self._pins == 0
            if due:
                self._finish_pending = False
        if due:
            self._finish()

    def _finish(self) -> None:
        # The emulator unmaps an fd's mappings when it is closed; a real fd close leaves them to
        # munmap. Either way the deferred munmaps must run first, hence the pins.
        self.seam.close()
        if self.owns_emulator and self.emulator is not None:
            self.emulator.close()


class CpuMapping:
    """A CPU mapping of device memory whose munmap waits for the numpy views over it.

    ``Bo.array`` views are raw pointers: unmapping under one would make its next access a segfault.
    ``release`` (from ``Bo.close`` or the device's close) therefore unmaps at once only when no view
    is left, else the last view's collection does. The GEM handle is closed at once either way: a
    mapping keeps the object alive in the driver (docs/uapi.md 7).
    """

    __slots__ = ("file", "addr", "length", "views", "deferred")

    def __init__(self, file: DeviceFile, addr: int, length: int) -> None:
        self.file, self.addr, self.length = file, addr, length
        self.views = 0
        self.deferred = False

    def add_view(self) -> None:
        """Count a view (pair with ``drop_view``, from the view's finalizer)."""
        with self.file.lock:
            self.views += 1

    def drop_view(self) -> None:
        """Forget a view; the last one runs a deferred munmap (a failure is logged: nobody to raise to)."""
        with self.file.lock:
            self.views -= 1
            due = self.deferred and self.views == 0
            if due:
                self.deferred = False
        if due:
            try:
                release_quietly(lambda: unmap(self.file, self.addr, self.length), "buffer mapping")
            finally:
                self.file.unpin()

    def release(self) -> None:
        """munmap now, or when the last view is collected.

        Raises:
            XdnaError: munmap failed.
        """
        with self.file.lock:
            if self.views:
                if not self.deferred:
                    self.deferred = True
                    self.file.pin()
                return
        unmap(self.file, self.addr, self.length)


def release_steps(*steps: Callable[[], Any]) -> None:
    """Run teardown steps in order; a lost device ends the ioctl steps quietly (closing the fd frees
    everything in the driver, docs/xrt-sequence.md 1.10); any other failure is raised after all steps ran. A
    KeyboardInterrupt (or another non-``XdnaError`` exception) in a step does not skip the later ones
    either: it is re-raised once they ran (docs/runtime.md 5).

    Raises:
        XdnaError: the first step that failed for another reason than a lost device.
        KeyboardInterrupt: a step was interrupted (the steps after it still ran).
    """
    first: XdnaError | None = None
    interrupted: BaseException | None = None
    for step in steps:
        try:
            step()
        except DeviceLostError:
            continue
        except XdnaError as exc:
            first = first or exc
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the remaining steps
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
    if first is not None:
        raise first


# ---------------------------------------------------------------------------------------------


class Device:
    """An open amdxdna device (real or emulated).

    Use ``open_device``. Creates buffers (``bo``), hardware contexts (``hw_context``), answers typed
    info queries, owns the per-fd device heap, and closes everything in reverse order on ``close``.
    ``stats`` counts ioctls by name plus ``bytes_in`` / ``bytes_out`` copied through ``Bo.write`` / ``read``.
    """

    def __init__(self, seam: Seam, *, emulator: EmuDevice | None = None, owns_emulator: bool = False) -> None:
        """Wrap an open seam and check that the driver behind it is amdxdna.

        Raises:
            NoDeviceError: the driver is not amdxdna (named in the message).
            XdnaError: DRM_IOCTL_VERSION failed.
        """
        self.file = DeviceFile(seam, emulator, owns_emulator)
        self._heap_state = _HeapState()
        self._metadata: AieMetadata | None = None
        self._finalizer = weakref.finalize(self, release_quietly, self.file.close, "device")
        try:
            self.version = self._query_version()
        except BaseException:
            self._finalizer()
            raise
        if self.version.name != DRIVER_NAME:
            self._finalizer()
            raise NoDeviceError(errno.ENODEV, f"{self.name}: driver {self.version.name!r} "
                                              f"({self.version.desc}) is not amdxdna ({DRIVER_NAME!r})")

    # -- identity ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The node path, or ``emu:<profile>``."""
        return self.file.name

    @property
    def driver(self) -> str:
        """Which driver runs: DRM_IOCTL_VERSION's name and version, then the emulator's NPU and driver profile
        (``amdxdna_accel_driver 0.6.0 (emulator npu4:linux-7.0)``, docs/emulator.md "Driver profiles") or the
        running kernel's release."""
        v = self.version
        where = (f"emulator {self.emulator.profile.name}:{self.emulator.profile.driver}" if self.emulator is not None
                 else f"kernel {os.uname().release}")
        return f"{v.name} {v.major}.{v.minor}.{v.patchlevel} ({where})"

    @property
    def generation(self) -> str | None:
        """``npu1`` / ``npu4`` / ``npu5`` / ``npu6``: the emulator's profile, else the node's PCI id and
        revision from sysfs; None when they cannot be read or are not in the driver's table."""
        if self.emulator is not None:
            return self.emulator.profile.name
        pci = os.path.join(SYSFS_ACCEL, os.path.basename(self.name), "device")
        try:
            with open(os.path.join(pci, "device")) as f_id, open(os.path.join(pci, "revision")) as f_rev:
                return pci_generation(int(f_id.read(), 16), int(f_rev.read(), 16))
        except (OSError, ValueError):
            return None

    @property
    def txn_dev_gen(self) -> int | None:
        """The TXN header device generation this device's instruction streams must carry (3 NPU1, 4 NPU4/5/6):
        the emulator's firmware setting, else ``TXN_DEV_GEN`` of ``generation``; None when that is unknown."""
        if self.emulator is not None:
            return self.emulator.profile.txn_dev_gen
        return TXN_DEV_GEN.get(self.generation or "")

    @property
    def emulator(self) -> EmuDevice | None:
        """The ``EmuDevice`` behind this device, or None on real hardware."""
        return self.file.emulator

    @property
    def stats(self) -> Counter[str]:
        """ioctls issued by name, plus ``bytes_in`` / ``bytes_out``."""
        return self.file.stats

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran."""
        return self.file.closed

    def __repr__(self) -> str:
        return f"<Device {self.name} {self.version.name} {self.version.major}.{self.version.minor}>"

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every buffer, context and run created here (newest first), the heap, then the fd.

        numpy views (``Bo.array``) that outlive the close keep their memory mapped, and the fd open,
        until they are collected: reading a stale view never touches unmapped memory.

        Raises:
            XdnaError: a release ioctl failed (everything else was still released).
        """
        self._finalizer.detach()
        self.file.close()

    # -- ioctls --------------------------------------------------------------------------------

    def raw_ioctl(self, request: int, buf: WriteableBuffer) -> int:
        """Issue any ioctl with a writable buffer, through the trace, stats and error mapping.

        Raises:
            TypeError: ``request`` is not an int or ``buf`` not a writable buffer.
            ValueError: ``buf`` is shorter than the size encoded in ``request``.
            XdnaError: typed by errno (DeviceLostError latches).
        """
        if isinstance(request, bool) or not isinstance(request, int) or not 0 <= request <= 0xFFFFFFFF:
            raise TypeError(f"raw_ioctl: request must be an ioctl number (u32 int), got {request!r}")
        try:
            view = memoryview(buf)
        except TypeError as exc:
            raise TypeError(f"raw_ioctl: buf must be a writable buffer (bytearray, ffi.buffer ...), "
                            f"got {type(buf).__name__}") from exc
        if view.readonly:
            raise TypeError("raw_ioctl: buf is read-only; the driver writes its answer into it")
        # The driver copies _IOC_SIZE bytes in and out of the caller's buffer: a shorter one would be
        # read and written past its end.
        size = (request >> abi._IOC_SIZESHIFT) & ((1 << abi._IOC_SIZEBITS) - 1)
        if view.nbytes < size:
            raise ValueError(f"raw_ioctl: request {request:#010x} carries {size} bytes, buf has {view.nbytes}")
        return self.file.ioctl_buffer(request, buf)

    def _query_version(self) -> DriverVersion:
        ffi = abi.ffi
        strings = {key: ffi.new("char[]", 128) for key in ("name", "date", "desc")}
        ver = ffi.new("struct drm_version *")
        for key, buf in strings.items():
            setattr(ver, key, buf)
            setattr(ver, f"{key}_len", len(buf))
        self.file.ioctl(abi.DRM_IOCTL_VERSION, ver)
        text = {key: ffi.string(buf, min(getattr(ver, f"{key}_len"), len(buf))).decode(errors="replace")
                for key, buf in strings.items()}
        return DriverVersion(text["name"], ver.version_major, ver.version_minor, ver.version_patchlevel,
                             text["date"], text["desc"])

    def _get_info(self, param_name: str, ctype: str, count: int = 1) -> abi.CData:
        ffi = abi.ffi
        param = getattr(abi, param_name)
        out = ffi.new(f"{ctype}[]", count)
        req = ffi.new("struct amdxdna_drm_get_info *")
        req.param = param
        req.buffer_size = ffi.sizeof(out)
        req.buffer = abi.address_of(out)
        short = param_name.removeprefix("DRM_AMDXDNA_")
        try:
            self.file.ioctl(abi.DRM_IOCTL_AMDXDNA_GET_INFO, req, {"param": short, "buffer_size": req.buffer_size})
        except XdnaError as exc:
            if exc.errno == errno.EOPNOTSUPP:
                raise XdnaError(exc.errno, f"{exc}: {short} is not supported by this driver") from exc
            raise
        return out

    # -- typed info ----------------------------------------------------------------------------

    def aie_version(self) -> AieVersion:
        """GET_INFO QUERY_AIE_VERSION.

        Raises:
            XdnaError: the query failed (EOPNOTSUPP says "not supported by this driver").
        """
        v = self._get_info("DRM_AMDXDNA_QUERY_AIE_VERSION", "struct amdxdna_drm_query_aie_version")[0]
        return AieVersion(v.major, v.minor)

    def aie_metadata(self) -> AieMetadata:
        """GET_INFO QUERY_AIE_METADATA (cached: XRT queries it once, docs/xrt-sequence.md 0 step 4).

        Raises:
            XdnaError: the query failed.
        """
        if self._metadata is None:
            m = self._get_info("DRM_AMDXDNA_QUERY_AIE_METADATA", "struct amdxdna_drm_query_aie_metadata")[0]
            tiles = [TileMetadata(t.row_count, t.row_start, t.dma_channel_count, t.lock_count, t.event_reg_count)
                     for t in (m.core, m.mem, m.shim)]
            self._metadata = AieMetadata(m.col_size, m.cols, m.rows, AieVersion(m.version.major, m.version.minor),
                                         *tiles)
        return self._metadata

    def clock_metadata(self) -> ClockMetadata:
        """GET_INFO QUERY_CLOCK_METADATA.

        Raises:
            XdnaError: the query failed.
        """
        c = self._get_info("DRM_AMDXDNA_QUERY_CLOCK_METADATA", "struct amdxdna_drm_query_clock_metadata")[0]
        ffi = abi.ffi
        return ClockMetadata(*(Clock(ffi.string(k.name).decode(errors="replace"), k.freq_mhz)
                               for k in (c.mp_npu_clock, c.h_clock)))

    def firmware_version(self) -> FirmwareVersion:
        """GET_INFO QUERY_FIRMWARE_VERSION.

        Raises:
            XdnaError: the query failed.
        """
        f = self._get_info("DRM_AMDXDNA_QUERY_FIRMWARE_VERSION", "struct amdxdna_drm_query_firmware_version")[0]
        return FirmwareVersion(f.major, f.minor, f.patch, f.build)

    def power_mode(self) -> PowerMode:
        """GET_INFO GET_POWER_MODE.

        Raises:
            XdnaError: the query failed.
        """
        return PowerMode(self._get_info("DRM_AMDXDNA_GET_POWER_MODE", "struct amdxdna_drm_get_power_mode")[0]
                         .power_mode)

    def set_power_mode(self, mode: int | str) -> None:
        """SET_STATE(SET_POWER_MODE): set the device-wide power mode (docs/runtime.md 3.2).

        ``mode``: 0..4 or its name (``"default"``, ``"low"``, ``"medium"``, ``"high"``, ``"turbo"``, any case).
        The driver takes it from a process with CAP_SYS_ADMIN only; setting the current mode does nothing.

        Raises:
            ValueError: ``mode`` is not one of the five modes.
            PermissionDeniedError: the process lacks CAP_SYS_ADMIN (EACCES; EPERM), the message says so.
            XdnaError: EOPNOTSUPP for LOW / MEDIUM (unsupported by the driver); EINVAL for TURBO while any
                hardware context exists (every process's); another failure.
        """
        value = _power_mode_value(mode)
        payload = abi.new("struct amdxdna_drm_set_power_mode", power_mode=value)
        req = abi.new("struct amdxdna_drm_set_state", param=abi.DRM_AMDXDNA_SET_POWER_MODE,
                      buffer_size=abi.ffi.sizeof(payload[0]), buffer=abi.address_of(payload))
        fields = {"param": "SET_POWER_MODE", "power_mode": POWER_MODE_NAMES[value]}
        try:
            self.file.ioctl(abi.DRM_IOCTL_AMDXDNA_SET_STATE, req, fields)
        except XdnaError as exc:
            hint = _POWER_MODE_HINTS.get(exc.errno)
            if hint is None and exc.errno == errno.EINVAL and value == abi.POWER_MODE_TURBO:
                hint = "TURBO is refused while any hardware context exists (of any process): close them first"
            if hint is None:
                raise
            raise ioctl_error("SET_STATE", fields, exc.errno, hint) from exc

    def resource_info(self) -> ResourceInfo:
        """GET_INFO QUERY_RESOURCE_INFO (feature level 0.4+).

        Raises:
            XdnaError: the query failed; EOPNOTSUPP on older drivers ("not supported by this driver").
        """
        r = self._get_info("DRM_AMDXDNA_QUERY_RESOURCE_INFO", "struct amdxdna_drm_get_resource_info")[0]
        return ResourceInfo(r.npu_clk_max, r.npu_tops_max, r.npu_task_max, r.npu_tops_curr, r.npu_task_curr)

    def hw_contexts(self, max_entries: int = 64) -> list[HwContextEntry]:
        """Every hardware context on the device (all processes'), as the driver describes them.

        GET_ARRAY(HW_CONTEXT_ALL) with room for ``max_entries`` entries of ``HWCTX_ENTRY_SIZE`` (160)
        bytes; the driver writes min(160, its entry size) bytes per entry and returns that size, which
        indexes the entries (144 on mainline, 160 on staging / out-of-tree drivers). A driver without
        GET_ARRAY (feature level 0.0, Linux 6.14-6.17: EINVAL for the absent ioctl; EOPNOTSUPP) is asked
        GET_INFO(QUERY_HW_CONTEXTS) instead: its entries carry ``source == "QUERY_HW_CONTEXTS"`` and only
        the nine fields that query has (docs/runtime.md 2).

        Raises:
            ValueError: ``max_entries`` is not an int in 1..1024 (the driver's GET_ARRAY limit).
            XdnaError: the query failed, or the driver answered an element size or count that does not fit
                what was asked (EPROTO, naming the values).
        """
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) \
                or not 1 <= max_entries <= MAX_ARRAY_ELEMENTS:
            raise ValueError(f"hw_contexts: max_entries must be an int in 1..{MAX_ARRAY_ELEMENTS}, got {max_entries!r}")
        try:
            return self._context_array(max_entries)
        except XdnaError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
        out = self._get_info("DRM_AMDXDNA_QUERY_HW_CONTEXTS", "struct amdxdna_drm_query_hwctx", max_entries)
        size = abi.ffi.sizeof("struct amdxdna_drm_query_hwctx")
        # The returned buffer_size changed meaning across versions (docs/uapi.md 10): entries are counted by what
        # can be verified, context ids start at 1 and a zeroed slot is unused.
        return [HwContextEntry(**{name: getattr(e, name) for name in _QUERY_FIELDS}, element_size=size,
                               source="QUERY_HW_CONTEXTS")
                for e in out if e.context_id != 0]

    def _context_array(self, max_entries: int) -> list[HwContextEntry]:
        ffi = abi.ffi
        buf = ffi.new("uint8_t[]", HWCTX_ENTRY_SIZE * max_entries)
        req = abi.new("struct amdxdna_drm_get_array", param=abi.DRM_AMDXDNA_HW_CONTEXT_ALL,
                      element_size=HWCTX_ENTRY_SIZE, num_element=max_entries, buffer=abi.address_of(buf))
        fields = {"param": "HW_CONTEXT_ALL", "element_size": HWCTX_ENTRY_SIZE, "num_element": max_entries}
        self.file.ioctl(abi.DRM_IOCTL_AMDXDNA_GET_ARRAY, req, fields)
        size, count = int(req.element_size), int(req.num_element)
        if count and not 0 < size <= HWCTX_ENTRY_SIZE or count > max_entries:
            raise ioctl_error("GET_ARRAY", fields, errno.EPROTO,
                              f"the driver answered element_size={size}, num_element={count}")
        if not count:
            return []
        try:
            return decode_hwctx_entries(ffi.buffer(buf), size, count)
        except ValueError as exc:
            raise ioctl_error("GET_ARRAY", fields, errno.EPROTO, str(exc)) from exc

    # -- the device heap -----------------------------------------------------------------------

    @property
    def heap(self) -> tuple[HeapChunk, ...]:
        """The heap chunks created so far (empty until the first DEV BO or context)."""
        return tuple(self._heap_state.chunks)

    def ensure_heap(self) -> HeapChunk:
        """Create and map the first 64 MiB heap chunk if this fd has none; return the first chunk.

        XRT order (docs/xrt-sequence.md 0 step 2): CREATE_BO DEV_HEAP, GET_BO_INFO, reserve a
        64 MiB-aligned VA range, mmap MAP_FIXED into it. The whole growth range (512 MiB, PROT_NONE,
        no memory committed) is reserved at once so that later chunks land at contiguous VAs, which
        expandable-heap drivers require ("uva is not contiguous", docs/uapi.md 4.4).

        Raises:
            XdnaError: an ioctl or mapping failed (nothing is left behind).
        """
        with self.file.lock:
            if not self._heap_state.chunks:
                self._add_heap_chunk()
            return self._heap_state.chunks[0]

    def grow_heap(self) -> HeapChunk:
        """Append one contiguous 64 MiB chunk (what XRT does when a DEV BO allocation answers EAGAIN).

        Raises:
            XdnaError: ENOSPC when the heap is at its 512 MiB maximum, or the driver refused the chunk.
        """
        with self.file.lock:
            if not self._heap_state.chunks:
                return self.ensure_heap()
            if len(self._heap_state.chunks) * HEAP_CHUNK_SIZE >= HEAP_MAX_SIZE:
                raise ioctl_error("CREATE_BO", {"type": "DEV_HEAP", "size": HEAP_CHUNK_SIZE}, errno.ENOSPC,
                                  f"device heap is at its {HEAP_MAX_SIZE >> 20} MiB maximum")
            return self._add_heap_chunk()

    def growing_heap(self, allocate: Callable[[], T]) -> T:
        """``allocate()``, growing the heap and retrying while the driver answers EAGAIN.

        Expandable-heap drivers answer EAGAIN when the heap is short (a DEV BO, or a context's internal
        buffers): XRT then adds a contiguous 64 MiB chunk and retries (docs/uapi.md 4.4). Older
        drivers answer ENOSPC and nothing grows. The loop ends: ``grow_heap`` raises ENOSPC at the
        512 MiB maximum, or the driver refuses the chunk.

        Raises:
            XdnaError: what ``allocate`` or ``grow_heap`` raised, other than EAGAIN.
        """
        while True:
            chunks = len(self.heap)
            try:
                return allocate()
            except XdnaError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
            with self.file.lock:
                if len(self.heap) == chunks:      # another thread may have grown it meanwhile
                    self.grow_heap()

    def heap_cpu_address(self, xdna_addr: int) -> int:
        """The CPU address of a device address inside the heap (heap VA + offset, docs/xrt-sequence.md 1.2).

        Raises:
            ValueError: the address is outside every mapped chunk.
        """
        for chunk in self._heap_state.chunks:
            if chunk.xdna_addr <= xdna_addr < chunk.xdna_addr + chunk.size:
                return chunk.va + (xdna_addr - chunk.xdna_addr)
        raise ValueError(f"device address {xdna_addr:#x} is outside the mapped heap")

    def _add_heap_chunk(self) -> HeapChunk:
        file, state = self.file, self._heap_state
        handle = create_bo(file, HEAP_CHUNK_SIZE, abi.AMDXDNA_BO_DEV_HEAP, "DEV_HEAP")
        try:
            info = get_bo_info(file, handle)
            if state.reservation is None:
                state.reservation = (_reserve(file, HEAP_MAX_SIZE, HEAP_CHUNK_SIZE), HEAP_MAX_SIZE)
                file.register(_release_reservation, file, state)
            va = state.reservation[0] + len(state.chunks) * HEAP_CHUNK_SIZE
            map_bo(file, HEAP_CHUNK_SIZE, info.map_offset, va)
        except BaseException:
            release_steps(lambda: gem_close(file, handle))
            raise
        chunk = HeapChunk(handle, info.xdna_addr, va, HEAP_CHUNK_SIZE)
        mapping = CpuMapping(file, va, HEAP_CHUNK_SIZE)
        state.chunks.append(chunk)
        state.mappings.append(mapping)
        file.register(_release_heap_chunk, file, chunk, mapping)
        return chunk

    def heap_mappings(self, cpu_address: int, size: int) -> list[CpuMapping]:
        """The heap chunk mappings that ``[cpu_address, cpu_address + size)`` touches (for DEV buffer views)."""
        state = self._heap_state
        return [m for c, m in zip(state.chunks, state.mappings, strict=True)
                if c.va < cpu_address + size and cpu_address < c.va + c.size]

    # -- factories -----------------------------------------------------------------------------

    def bo(self, size: int, kind: str = "shmem") -> Bo:
        """Allocate a buffer object: ``"shmem"`` (data), ``"dev"`` (heap: instructions, PDIs) or ``"cmd"``.

        Raises:
            TypeError, ValueError: bad size or kind.
            XdnaError: the driver refused (message names CREATE_BO and its fields).
        """
        from .bo import Bo

        with uninterrupted():       # CREATE_BO + GET_BO_INFO + mmap + flush run whole (docs/runtime.md 5)
            return Bo(self, size, kind)

    def import_bo(self, fd: int, size: int | None = None) -> Bo:
        """Import a dma-buf (``Bo.export`` of this or another device) as a SHMEM buffer of this device.

        See ``Bo.imported_from`` (docs/runtime.md 3.3): the import of this file's own export shares its
        handle, closed by the last of the two.

        Raises:
            TypeError, ValueError: a bad ``fd`` or ``size``.
            XdnaError: not an open dma-buf, or the driver refused it.
        """
        from .bo import Bo

        with uninterrupted():
            return Bo.imported_from(self, fd, size)

    def hw_context(self, xclbin: Any, kernel: str | None = None, priority: int | str | None = None) -> HwContext:
        """Create a hardware context for ``xclbin`` (CREATE_HWCTX + PDI DEV BOs + CONFIG_CU).

        Raises:
            ContextUnavailableError: the device has no room (ENODEV / EINVAL / EBUSY from CREATE_HWCTX).
            XdnaError: another step failed (nothing is left behind).
        """
        from .hwctx import HwContext

        self.file.check_open("hw_context")
        with uninterrupted():       # CREATE_HWCTX + PDI buffers + CONFIG_CU run whole (docs/runtime.md 5)
            return HwContext(self, xclbin, kernel=kernel, priority=priority)


def _power_mode_value(mode: int | str) -> int:
    if isinstance(mode, str) and mode.lower() in POWER_MODES:
        return POWER_MODES[mode.lower()]
    if isinstance(mode, int) and not isinstance(mode, bool) and mode in POWER_MODE_NAMES:
        return mode
    raise ValueError(f"set_power_mode: mode must be one of {', '.join(POWER_MODES)} or 0..4, got {mode!r}")


# ---------------------------------------------------------------------------------------------
# BO primitives shared by bo.py and the heap


@dataclass(frozen=True)
class BoInfo:
    """GET_BO_INFO answer."""

    handle: int
    map_offset: int
    vaddr: int
    xdna_addr: int


def create_bo(file: DeviceFile, size: int, bo_type: int, type_name: str) -> int:
    """CREATE_BO; returns the GEM handle.

    Raises:
        XdnaError: the driver refused.
    """
    req = abi.ffi.new("struct amdxdna_drm_create_bo *")
    req.size = size
    req.type = bo_type
    try:
        file.ioctl(abi.DRM_IOCTL_AMDXDNA_CREATE_BO, req, {"type": type_name, "size": size})
    except BaseException:
        # Interrupted (Ctrl-C) after the driver made the buffer: nobody will see its handle, close it here.
        if req.handle:
            release_steps(lambda: gem_close(file, req.handle))
        raise
    return int(req.handle)


def get_bo_info(file: DeviceFile, handle: int) -> BoInfo:
    """GET_BO_INFO.

    Raises:
        XdnaError: the driver refused.
    """
    req = abi.ffi.new("struct amdxdna_drm_get_bo_info *")
    req.handle = handle
    file.ioctl(abi.DRM_IOCTL_AMDXDNA_GET_BO_INFO, req, {"handle": handle})
    return BoInfo(handle, req.map_offset, req.vaddr, req.xdna_addr)


def gem_close(file: DeviceFile, handle: int) -> None:
    """DRM_IOCTL_GEM_CLOSE.

    Raises:
        XdnaError: the driver refused.
    """
    req = abi.ffi.new("struct drm_gem_close *")
    req.handle = handle
    file.ioctl(abi.DRM_IOCTL_GEM_CLOSE, req, {"handle": handle})


def prime_handle_to_fd(file: DeviceFile, handle: int) -> int:
    """DRM_IOCTL_PRIME_HANDLE_TO_FD with DRM_RDWR | DRM_CLOEXEC; returns the new dma-buf fd.

    Raises:
        XdnaError: the driver refused.
    """
    req = abi.new("struct drm_prime_handle", handle=handle, flags=abi.DRM_RDWR | abi.DRM_CLOEXEC, fd=-1)
    file.ioctl(abi.DRM_IOCTL_PRIME_HANDLE_TO_FD, req, {"handle": handle, "flags": "RDWR|CLOEXEC"})
    return int(req.fd)


def prime_fd_to_handle(file: DeviceFile, fd: int) -> int:
    """DRM_IOCTL_PRIME_FD_TO_HANDLE; returns this fd's GEM handle of the dma-buf (an existing one if it has it).

    Raises:
        XdnaError: the driver refused (EBADF: not an open fd; EINVAL: not a dma-buf it can import).
    """
    req = abi.new("struct drm_prime_handle", fd=fd)
    file.ioctl(abi.DRM_IOCTL_PRIME_FD_TO_HANDLE, req, {"fd": fd})
    return int(req.handle)


def map_bo(file: DeviceFile, length: int, offset: int, addr: int = 0) -> int:
    """mmap a BO through the seam (MAP_FIXED at ``addr`` when non-zero).

    Raises:
        XdnaError: the mapping failed; the message names mmap, length, offset, addr and the errno.
    """
    try:
        return file.seam.mmap(length, offset, addr)
    except OSError as exc:
        raise file.error("mmap", {"length": length, "offset": offset, "addr": addr}, exc) from exc


def _reserve(file: DeviceFile, length: int, alignment: int) -> int:
    try:
        return file.seam.reserve(length, alignment)
    except OSError as exc:
        raise file.error("reserve", {"length": length, "alignment": alignment}, exc) from exc


class _HeapState:
    """The heap's VA reservation and chunks (shared with the release actions, not the Device)."""

    def __init__(self) -> None:
        self.reservation: tuple[int, int] | None = None
        self.chunks: list[HeapChunk] = []
        self.mappings: list[CpuMapping] = []


def _release_reservation(file: DeviceFile, state: _HeapState) -> None:
    # Chunks are unmapped by their own release actions (registered later, so run earlier); what is
    # left of the reservation is its untouched tail.
    if state.reservation is None:
        return
    base, length = state.reservation
    used = len(state.chunks) * HEAP_CHUNK_SIZE
    state.reservation = None
    state.chunks.clear()
    state.mappings.clear()
    if length > used:
        unmap(file, base + used, length - used)


def _release_heap_chunk(file: DeviceFile, chunk: HeapChunk, mapping: CpuMapping) -> None:
    release_steps(mapping.release, lambda: gem_close(file, chunk.handle))


def release_quietly(release: Callable[[], None], what: str) -> None:
    """Run the release of a ``what`` nobody closed, from its garbage-collection finalizer: a failure
    cannot be raised to anyone there, so it is logged (logger ``amdxdna_direct``, WARNING)."""
    try:
        release()
    except XdnaError as exc:
        log.warning("releasing a garbage-collected %s failed: %s", what, exc)


def unmap(file: DeviceFile, addr: int, length: int) -> None:
    """munmap through the seam.

    Raises:
        XdnaError: munmap failed (names addr, length and the errno).
    """
    try:
        file.seam.munmap(addr, length)
    except OSError as exc:
        raise file.error("munmap", {"addr": addr, "length": length}, exc) from exc


# ---------------------------------------------------------------------------------------------
# opening


def open_device(spec: str | os.PathLike[str] | EmuDevice | None = None) -> Device:
    """Open a device.

    ``spec``: ``"emu"`` / ``"emu:<npu>[:<driver>]"`` (a new emulated device owned by the Device: ``emu:npu1``,
    ``emu:npu4:linux-6.18``; the driver defaults to the newest mainline kernel modelled; the emulator is
    not cache coherent, a trailing ``:coherent`` models the caches away), an
    ``EmuDevice`` (a new fd on it), a path such as ``"/dev/accel/accel0"``, or None: the environment
    variable ``AMDXDNA_DEVICE`` if set, else the first ``/dev/accel/accel*`` bound to amdxdna.

    Raises:
        TypeError, ValueError: an unsupported ``spec`` or an unknown emulator profile.
        NoDeviceError: nothing to open (the message says how to use the emulator), or not amdxdna.
        PermissionDeniedError: the node exists but may not be opened (the message gives the fix).
        XdnaError: another failure while opening.
    """
    if spec is None:
        spec = os.environ.get("AMDXDNA_DEVICE")
        if not spec:
            return _discover()
    if isinstance(spec, str) and (spec == "emu" or spec.startswith("emu:")):
        from .emu import EmuDevice, resolve

        _, _, rest = spec.partition(":")
        try:
            chosen = resolve(rest)      # <npu>[:<driver>][:coherent] (docs/emulator.md, Driver profiles)
        except KeyError as exc:
            raise ValueError(f"open_device({spec!r}): {exc.args[0]}") from None
        emu = EmuDevice(chosen)
        try:
            return Device(emu.open(), emulator=emu, owns_emulator=True)
        except BaseException:
            emu.close()
            raise
    if isinstance(spec, (str, os.PathLike)):
        return Device(_open_path(os.fspath(spec)))
    if hasattr(spec, "open") and hasattr(spec, "models"):
        try:
            seam = spec.open()
        except OSError as exc:
            profile = getattr(getattr(spec, "profile", None), "name", "?")
            raise ioctl_error("open", {"path": f"emu:{profile}"}, exc.errno or errno.EIO) from exc
        return Device(seam, emulator=spec)
    raise TypeError(f"open_device: expected 'emu', 'emu:<profile>', a device path, an EmuDevice or None, "
                    f"got {type(spec).__name__}")


def _open_path(path: str) -> OsSeam:
    try:
        return OsSeam(path)
    except OSError as exc:
        hint = _PERMISSION_HINT if exc.errno in (errno.EACCES, errno.EPERM) else ""
        if exc.errno in (errno.ENOENT, errno.ENXIO):
            hint = _NO_DEVICE_HINT
        raise ioctl_error("open", {"path": path}, exc.errno or errno.EIO, hint) from exc


def _discover() -> Device:
    """The first ``/dev/accel/accel*`` driven by amdxdna: sysfs names the driver where it is readable;
    where it is not (containers often lack ``/sys/class/accel``), DRM_IOCTL_VERSION decides."""
    others = []
    for node in sorted(glob.glob("/dev/accel/accel*"), key=_node_number):
        link = os.path.join(SYSFS_ACCEL, os.path.basename(node), "device", "driver")
        if os.path.lexists(link) and os.path.basename(os.path.realpath(link)) != "amdxdna":
            others.append(f"{node} ({os.path.basename(os.path.realpath(link))})")
            continue
        try:
            return Device(_open_path(node))
        except NoDeviceError as exc:            # VERSION named another driver
            others.append(str(exc))
    found = f" (other accel nodes: {'; '.join(others)})" if others else ""
    raise NoDeviceError(errno.ENODEV, f"open_device(): {errno_text(errno.ENODEV)}{found}; {_NO_DEVICE_HINT}")


def _node_number(node: str) -> int:
    digits = node.rsplit("accel", 1)[-1]
    return int(digits) if digits.isdigit() else 1 << 30
