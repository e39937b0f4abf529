"""Buffer objects: SHMEM data buffers, DEV (heap) buffers, CMD packet buffers, and sub-buffers.

Facts: spec xrt-npu-sequence.md 1.4-1.6 and amdxdna-uapi.md 4.4-4.6, 7. A ``Bo`` keeps the GEM
handle, size, device address, CPU address and raw GET_BO_INFO together; numpy views over it are
zero-copy. ``close()`` is idempotent and also runs on garbage collection; sub-buffers share the
parent's handle and are closed with it.
"""

from __future__ import annotations

import ctypes
import errno
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from . import abi
from .device import (
    BoInfo,
    CpuMapping,
    DeviceFile,
    create_bo,
    gem_close,
    get_bo_info,
    map_bo,
    prime_fd_to_handle,
    prime_handle_to_fd,
    release_quietly,
    release_steps,
)
from .errors import ioctl_error
from .seam import dmabuf_size

if TYPE_CHECKING:
    from .device import Device

__all__ = ["Bo", "KINDS", "PAGE_SIZE", "TO_DEVICE", "FROM_DEVICE", "unhold"]

PAGE_SIZE = 4096
TO_DEVICE = "to_device"
FROM_DEVICE = "from_device"
_SUB_ALIGN = 4  # the shim DMA's buffer-descriptor address is word granular (spec 1.5)
_U64_MAX = (1 << 64) - 1  # CREATE_BO size is a __u64 (spec amdxdna-uapi.md 2)


# kind -> (amdxdna_bo_type, its name in messages); XRT's placement (spec amdxdna-uapi.md 7): data in
# SHMEM, instructions and PDIs in DEV (heap), command packets in CMD.
_BO_TYPES = {"shmem": (abi.AMDXDNA_BO_SHMEM, "SHMEM"), "dev": (abi.AMDXDNA_BO_DEV, "DEV"),
             "cmd": (abi.AMDXDNA_BO_CMD, "CMD")}
KINDS = tuple(_BO_TYPES)


class _View:
    """Exposes a raw range through ``__array_interface__``; keeps its Bo alive and its mappings mapped
    (``CpuMapping`` defers a close's munmap) while numpy arrays over it exist."""

    def __init__(self, bo: Bo, addr: int, nbytes: int) -> None:
        self.bo = bo
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}
        self._mappings = bo._mappings
        for mapping in self._mappings:
            mapping.add_view()

    def __del__(self) -> None:
        for mapping in self._mappings:
            mapping.drop_view()


def _int_arg(what: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__}")
    return int(value)


class Bo:
    """A buffer object on a ``Device``; create with ``device.bo(size, kind)``.

    Attributes: ``handle`` (GEM handle, the parent's for a sub-buffer), ``size``, ``kind``,
    ``address`` (what goes into commands), ``cpu_address``, ``offset`` (within the parent),
    ``info`` (GET_BO_INFO of the parent).
    """

    def __init__(self, device: Device, size: int, kind: str = "shmem") -> None:
        """Allocate, look up and map a buffer; SHMEM buffers get XRT's initial flush.

        Raises:
            TypeError, ValueError: bad size or kind.
            XdnaError: an ioctl or the mapping failed (nothing is left allocated).
        """
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"Bo size must be an int, got {type(size).__name__}")
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"Bo kind must be one of {KINDS}, got {kind!r}")
        size = int(size)
        if not 0 < size <= _U64_MAX - PAGE_SIZE + 1:
            raise ValueError(f"Bo size must be positive and fit CREATE_BO's u64 once page aligned, got {size}")
        device.file.check_open("CREATE_BO", {"type": _BO_TYPES[kind][1], "size": size})
        self._start(device, size, kind)
        handle, info, cpu, map_len = _allocate(device, size, kind)
        self._attach(handle, info, cpu, map_len)
        if kind == "shmem":
            # "new pages may carry dirty cache lines that would later overwrite device output": the
            # shim flushes every new SHARE BO (spec 1.4 "Initial flush").
            try:
                self.sync()
            except BaseException:
                self.close()
                raise

    def _start(self, device: Device, size: int, kind: str) -> None:
        self.device = device
        self.size = size
        self.kind = kind
        self.offset = 0
        self.parent: Bo | None = None
        self.imported = False
        self._subs: weakref.WeakSet[Bo] = weakref.WeakSet()
        self._closed = False
        self._release = None
        self._finalizer = None
        self._mappings: list[CpuMapping] = []

    def _attach(self, handle: int, info: BoInfo, cpu: int, map_len: int) -> None:
        """Take over a handle counted with ``file.ref_handle``: addresses, mappings, the release action."""
        file = self.device.file
        self.handle = handle
        self.info = info
        self.cpu_address = cpu
        # XRT's device-address rule (spec 1.4): xdna_addr unless it is ~0, else the mapping's VA (SVA).
        self.address = info.xdna_addr if info.xdna_addr != abi.AMDXDNA_INVALID_ADDR else cpu
        self._mappings = ([CpuMapping(file, cpu, map_len)] if map_len
                          else self.device.heap_mappings(cpu, self.size) if self.kind == "dev" else [])
        self._release = file.register(_release_bo, file, handle, self._mappings[0] if map_len else None)
        self._finalizer = weakref.finalize(self, release_quietly, self._release, "buffer")

    @classmethod
    def imported_from(cls, device: Device, fd: int, size: int | None = None) -> Bo:
        """Import the dma-buf ``fd`` (another device's or this one's export): PRIME_FD_TO_HANDLE, GET_BO_INFO,
        mmap of ``size`` bytes (default: the whole dma-buf). Use ``device.import_bo``.

        The caller keeps ``fd`` (close it when convenient: the import holds the buffer). Importing a buffer
        this device file already holds (its own export) returns the same GEM handle: both Bo objects share
        it, and the last one closed closes it (docs/runtime.md 3.3).

        Raises:
            TypeError, ValueError: ``fd`` is not an int >= 0, or ``size`` is not in 1..the dma-buf's size.
            XdnaError: ``fd`` is not an open dma-buf (EBADF / ESPIPE from lseek), the driver refused the
                import, the buffer is not mappable (EINVAL), or the mapping failed (nothing is left held).
        """
        if isinstance(fd, bool) or not isinstance(fd, (int, np.integer)) or fd < 0:
            raise TypeError(f"import_bo: fd must be an open file descriptor (int >= 0), got {fd!r}")
        fd = int(fd)
        file = device.file
        file.check_open("PRIME_FD_TO_HANDLE", {"fd": fd})
        try:
            total = dmabuf_size(fd)
        except OSError as exc:
            raise file.error("lseek", {"fd": fd}, exc, "not an open dma-buf") from exc
        if size is None:
            size = total
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 0 < size <= total:
            raise ValueError(f"import_bo: size must be an int in 1..{total} (the dma-buf's size), got {size!r}")
        bo = object.__new__(cls)
        bo._start(device, int(size), "shmem")
        handle = prime_fd_to_handle(file, fd)
        file.ref_handle(handle)
        try:
            info = get_bo_info(file, handle)
            if info.map_offset == abi.AMDXDNA_INVALID_ADDR:
                raise ioctl_error("mmap", {"handle": handle}, errno.EINVAL,
                                  "the imported buffer has no map offset (a DEV buffer cannot be mapped)")
            map_len = (bo.size + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)
            cpu = map_bo(file, map_len, info.map_offset)
        except BaseException:
            release_steps(lambda: _close_handle(file, handle))
            raise
        bo._attach(handle, info, cpu, map_len)
        bo.imported = True
        return bo

    def export(self) -> int:
        """Export this buffer as a dma-buf: PRIME_HANDLE_TO_FD (DRM_RDWR | DRM_CLOEXEC); returns the fd.

        The caller owns the fd and closes it (``os.close``); the dma-buf keeps the memory alive as long as
        it, or an import of it, exists (docs/runtime.md 3.3).

        Raises:
            ValueError: a sub-buffer (it shares its parent's handle: export the parent).
            XdnaError: the buffer is closed, or the driver refused (a DEV buffer lives inside the heap).
        """
        if self.parent is not None:
            raise ValueError(f"export: a sub-buffer (offset {self.offset}, {self.size} bytes) cannot be exported; "
                             f"export its parent (handle {self.handle})")
        self._check_open("PRIME_HANDLE_TO_FD")
        return prime_handle_to_fd(self.device.file, self.handle)

    # -- sub-buffers ---------------------------------------------------------------------------

    def sub(self, offset: int, size: int) -> Bo:
        """A sub-buffer ``[offset, offset + size)``: same handle, address = parent address + offset.

        Offsets must be 4-byte aligned (the shim DMA addresses words).

        Raises:
            ValueError: out of bounds or misaligned.
            XdnaError: this buffer is closed.
        """
        self._check_open("sub")
        offset, size = _int_arg("sub", "offset", offset), _int_arg("sub", "size", size)
        if offset < 0 or size <= 0 or offset + size > self.size:
            raise ValueError(f"sub(offset={offset}, size={size}) outside a {self.size}-byte buffer")
        if offset % _SUB_ALIGN:
            raise ValueError(f"sub(offset={offset}): offsets must be {_SUB_ALIGN}-byte aligned for the shim DMA")
        sub = object.__new__(Bo)
        sub.device, sub.size, sub.kind = self.device, size, self.kind
        sub.parent = self.parent or self
        sub.offset = self.offset + offset
        sub.handle, sub.info = self.handle, self.info
        sub.cpu_address = self.cpu_address + offset
        sub.address = self.address + offset
        sub._subs, sub._closed = weakref.WeakSet(), False
        sub._mappings = self._mappings
        sub._release = sub._finalizer = None
        sub.imported = self.imported
        sub.parent._subs.add(sub)
        return sub

    # -- state ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once this buffer (or its parent) was closed or its device closed (or is closing)."""
        if self._closed or self.device.file.closed:
            return True
        if self.parent is not None:
            return self.parent.closed
        return self._release is not None and not self._release.alive

    def hold(self, what: str) -> tuple[CpuMapping, ...]:
        """Keep this buffer's memory mapped for one access: a close from another thread meanwhile
        (of the buffer or its device) defers its munmap to ``unhold``. Pair with ``unhold``.

        Raises:
            XdnaError: EBADF naming ``what``, the buffer is closed.
        """
        with self.device.file.lock:
            self._check_open(what)
            for mapping in self._mappings:
                mapping.add_view()
        return tuple(self._mappings)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"address={self.address:#x}"
        where = f" offset={self.offset}" if self.parent is not None else ""
        return f"<Bo {self.kind} handle={self.handle} size={self.size}{where} {state}>"

    def __enter__(self) -> Bo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap and GEM_CLOSE (sub-buffers only mark themselves closed); idempotent.

        Sub-buffers of this buffer are closed first.

        Raises:
            XdnaError: GEM_CLOSE failed (other than on a lost device).
        """
        if self._closed:
            return
        for sub in list(self._subs):
            sub._closed = True
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
            self._release()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ioctl_error(what, {"handle": self.handle}, errno.EBADF, "buffer is closed")

    # -- CPU access ----------------------------------------------------------------------------

    def array(self, dtype: Any = np.uint8, count: int | None = None, offset: int = 0,
              shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A zero-copy numpy view of ``count`` items of ``dtype`` starting ``offset`` bytes in.

        ``count`` defaults to as many whole items as fit; ``shape`` (an extension) reshapes the view
        and implies ``count``. The view keeps this buffer alive.

        Raises:
            ValueError: the range is outside the buffer.
            XdnaError: the buffer is closed.
        """
        self._check_open("array")
        dt = np.dtype(dtype)
        if dt.itemsize == 0 or dt.hasobject:
            raise TypeError(f"array: dtype {dt} cannot view raw device memory (zero-size or Python objects)")
        offset = _int_arg("array", "offset", offset)
        if shape is not None:
            shape = tuple(_int_arg("array", "shape", n) for n in np.atleast_1d(np.asarray(shape, dtype=object)))
            if any(n < 0 for n in shape):
                raise ValueError(f"array: shape {shape} has a negative dimension")
            implied = int(np.prod(shape, dtype=object))
            if count is not None and _int_arg("array", "count", count) != implied:
                raise ValueError(f"array: count={count} contradicts shape {shape} ({implied} items)")
            count = implied
        elif count is not None:
            count = _int_arg("array", "count", count)
        if offset < 0 or offset > self.size:
            raise ValueError(f"array offset {offset} outside a {self.size}-byte buffer")
        if count is None:
            count = (self.size - offset) // dt.itemsize
        nbytes = count * dt.itemsize
        if count < 0 or offset + nbytes > self.size:
            raise ValueError(f"array of {count} x {dt} at offset {offset} exceeds the {self.size}-byte buffer")
        if not nbytes:
            raw = np.empty(0, np.uint8)
        else:
            with self.device.file.lock:     # a close in another thread unmaps now, or after this view
                self._check_open("array")
                raw = np.asarray(_View(self, self.cpu_address + offset, nbytes))
        view = raw.view(dt)
        return view.reshape(shape) if shape is not None else view

    def owner_view(self) -> memoryview:
        """A byte view of the whole buffer that does not hold its munmap back (``array`` views do).

        For the objects that own a buffer and check ``closed`` before each access (runs and run
        lists over their packet buffers), so that their close unmaps at once.

        Raises:
            XdnaError: the buffer is closed.
        """
        self._check_open("owner_view")
        return memoryview((ctypes.c_ubyte * self.size).from_address(self.cpu_address)).cast("B")

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy bytes (or any buffer / numpy array) into the buffer at ``offset``; counts ``bytes_in``.

        Raises:
            ValueError: the data does not fit.
            XdnaError: the buffer is closed.
        """
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data)
        try:
            src = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        except TypeError as exc:
            raise TypeError(f"write: data must be bytes-like or a numpy array, got {type(data).__name__} "
                            f"({exc})") from exc
        self.array(np.uint8, src.size, offset)[:] = src
        with self.device.file.lock:
            self.device.stats["bytes_in"] += src.size

    def read(self, size: int | None = None, offset: int = 0) -> bytes:
        """Copy ``size`` bytes out of the buffer (default: to the end); counts ``bytes_out``.

        Raises:
            ValueError: the range is outside the buffer.
            XdnaError: the buffer is closed.
        """
        out = self.array(np.uint8, size, offset).tobytes()
        with self.device.file.lock:
            self.device.stats["bytes_out"] += len(out)
        return out

    # -- cache maintenance ---------------------------------------------------------------------

    def sync(self, offset: int = 0, size: int | None = None, direction: str = TO_DEVICE) -> None:
        """Cache maintenance for ``[offset, offset + size)`` of this buffer (default: all of it).

        Call it after CPU writes (before the device reads) and after the device wrote (before CPU
        reads). Both directions issue SYNC_BO with direction TO_DEVICE: the kernel does the same
        clflush (write-back + invalidate) for either direction, and on upstream drivers >= 0.3 a
        FROM_DEVICE sync of anything but a debug buffer flushes and then fails with EINVAL
        (spec xrt-npu-sequence.md 1.6, amdxdna-uapi.md 4.6). XRT flushes from userspace instead,
        which Python cannot do.

        Raises:
            ValueError: bad direction or range.
            XdnaError: SYNC_BO failed or the buffer is closed.
        """
        if direction not in (TO_DEVICE, FROM_DEVICE):
            raise ValueError(f"sync direction must be {TO_DEVICE!r} or {FROM_DEVICE!r}, got {direction!r}")
        offset = _int_arg("sync", "offset", offset)
        size = self.size - offset if size is None else _int_arg("sync", "size", size)
        if offset < 0 or size <= 0 or offset + size > self.size:
            raise ValueError(f"sync(offset={offset}, size={size}) outside a {self.size}-byte buffer")
        self._check_open("SYNC_BO")
        req = abi.ffi.new("struct amdxdna_drm_sync_bo *")
        req.handle = self.handle
        req.direction = abi.SYNC_DIRECT_TO_DEVICE
        req.offset = self.offset + offset
        req.size = size
        self.device.file.ioctl(abi.DRM_IOCTL_AMDXDNA_SYNC_BO, req,
                               {"handle": self.handle, "offset": req.offset, "size": size})


def unhold(mappings: tuple[CpuMapping, ...]) -> None:
    """End a ``Bo.hold``: the last holder of a closed buffer runs its deferred munmap."""
    for mapping in mappings:
        mapping.drop_view()


def _allocate(device: Device, size: int, kind: str) -> tuple[int, BoInfo, int, int]:
    """CREATE_BO + GET_BO_INFO + CPU address; returns (handle, info, cpu address, mapped length)."""
    file = device.file
    bo_type, type_name = _BO_TYPES[kind]
    if kind == "dev":
        device.ensure_heap()
        handle = device.growing_heap(lambda: create_bo(file, size, abi.AMDXDNA_BO_DEV, "DEV"))
    else:
        handle = create_bo(file, size, bo_type, type_name)
    file.ref_handle(handle)
    try:
        info = get_bo_info(file, handle)
        if kind == "dev":
            # DEV BOs are not mappable (map_offset ~0); the CPU reaches them through the heap mapping.
            return handle, info, device.heap_cpu_address(info.xdna_addr), 0
        map_len = (size + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)
        return handle, info, map_bo(file, map_len, info.map_offset), map_len
    except BaseException:
        release_steps(lambda: _close_handle(file, handle))
        raise


def _close_handle(file: DeviceFile, handle: int) -> None:
    # A handle shared by an export and its import into the same file is closed by its last holder.
    if file.unref_handle(handle):
        gem_close(file, handle)


def _release_bo(file: DeviceFile, handle: int, mapping: CpuMapping | None) -> None:
    # munmap, then GEM_CLOSE (spec xrt-npu-sequence.md 1.10); DEV BOs have no mapping of their own.
    # With numpy views left the munmap waits for them (CpuMapping); the GEM handle goes now.
    steps = [mapping.release] if mapping is not None else []
    release_steps(*steps, lambda: _close_handle(file, handle))
