"""Buffer objects: SHMEM data buffers, DEV (heap) buffers, CMD packet buffers, and sub-buffers.

Facts: docs/xrt-sequence.md 1.4-1.6 and docs/uapi.md 4.4-4.6, 7. A ``Bo`` keeps the GEM
handle, size, device address, CPU address and raw GET_BO_INFO together; numpy views over it are
zero-copy. ``close()`` is idempotent and also runs on garbage collection; sub-buffers share the
parent's handle and are closed with it.

Host copies (``Bo.write``/``read``, ``write_bf16``/``read_f32_from_bf16`` and the module functions
``copy_bytes``, ``store_bf16``, ``load_bf16``) go straight into or out of the mapping, converting on the
way where asked, split over one small thread pool when large and on the calling thread when small.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, overload

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
    import numpy.typing as npt

    from .device import Device, _Resource

__all__ = ["Bo", "KINDS", "PAGE_SIZE", "TO_DEVICE", "FROM_DEVICE", "unhold", "copy_bytes", "store_bf16", "load_bf16",
           "copy_pool", "COPY_WORKERS", "POOL_MIN_BYTES", "POOL_MIN_ELEMENTS"]

PAGE_SIZE = 4096
TO_DEVICE = "to_device"
FROM_DEVICE = "from_device"
_SUB_ALIGN = 4  # the shim DMA's buffer-descriptor address is word granular (docs/xrt-sequence.md 1.5)
_U64_MAX = (1 << 64) - 1  # CREATE_BO size is a __u64 (docs/uapi.md 2)


# kind -> (amdxdna_bo_type, its name in messages); XRT's placement (docs/uapi.md 7): data in
# SHMEM, instructions and PDIs in DEV (heap), command packets in CMD.
_BO_TYPES = {"shmem": (abi.AMDXDNA_BO_SHMEM, "SHMEM"), "dev": (abi.AMDXDNA_BO_DEV, "DEV"),
             "cmd": (abi.AMDXDNA_BO_CMD, "CMD")}
KINDS = tuple(_BO_TYPES)

_BF16_BYTES = 2
_U16 = np.dtype(np.uint16)
_bf16_dtype: np.dtype | None = None


def _bf16() -> np.dtype:
    """ml_dtypes' bfloat16, imported on first use: ``import amdxdna_direct`` does not pay for ml_dtypes."""
    global _bf16_dtype
    if _bf16_dtype is None:
        import ml_dtypes

        _bf16_dtype = np.dtype(ml_dtypes.bfloat16)
    return _bf16_dtype


def _is_bf16(dt: np.dtype) -> bool:
    # an array or dtype of bfloat16 exists only once ml_dtypes is imported, so this never imports it;
    # (dtype.name is computed in Python, microseconds per call; the scalar type's names are plain attributes)
    return dt.type.__name__ == "bfloat16" and dt.type.__module__ == "ml_dtypes"


def __getattr__(name: str) -> Any:
    if name == "BF16":  # ``bo.BF16``: numpy's dtype of ml_dtypes.bfloat16
        return _bf16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _data_dtype(what: str, dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype that can live in raw device memory (fixed size, no Python objects)."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{what}: {dtype!r} is not a numpy dtype ({exc})") from exc
    if dt.itemsize == 0 or dt.hasobject:
        raise TypeError(f"{what}: dtype {dt} cannot view raw device memory (zero-size or Python objects)")
    return dt


def _source(what: str, data: Any) -> np.ndarray:
    """``data`` (a numpy array of any fixed-size dtype, a ``Bo``, or bytes-like) as a 1-D C-contiguous array."""
    if isinstance(data, np.ndarray):
        arr = data
    elif isinstance(data, Bo):
        arr = data.array()
    elif isinstance(data, str):
        raise TypeError(f"{what}: data must be bytes-like or a numpy array, got str (encode it first)")
    else:
        try:
            arr = np.frombuffer(data, np.uint8)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{what}: data must be bytes-like or a numpy array, got {type(data).__name__} "
                            f"({exc})") from exc
    if arr.dtype.hasobject or arr.dtype.itemsize == 0:
        raise TypeError(f"{what}: data of dtype {arr.dtype} has no fixed-size bytes to copy (Python objects "
                        f"or zero-size items)")
    return np.ascontiguousarray(arr).reshape(-1)


def _what(count: int, dt: np.dtype | None, name: str | None = None) -> str:
    """How a range's contents read in messages: ``12 x float32 (48 bytes)``, or ``48 bytes`` without a dtype."""
    if dt is None:
        return f"{count} bytes"
    return f"{count} x {name or dt} ({count * dt.itemsize} bytes)"


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
            # shim flushes every new SHARE BO (docs/xrt-sequence.md 1.4 "Initial flush").
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
        self._release: _Resource | None = None
        self._finalizer: weakref.finalize[[Callable[[], None], str], Bo] | None = None
        self._mappings: list[CpuMapping] = []
        self._flat_cache: np.ndarray | None = None

    def _attach(self, handle: int, info: BoInfo, cpu: int, map_len: int) -> None:
        """Take over a handle counted with ``file.ref_handle``: addresses, mappings, the release action."""
        file = self.device.file
        self.handle = handle
        self.info = info
        self.cpu_address = cpu
        # XRT's device-address rule (docs/xrt-sequence.md 1.4): xdna_addr unless it is ~0, else the mapping's VA (SVA).
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
        sub._flat_cache = None
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
        if self._finalizer is not None and self._release is not None:     # both set by _attach
            self._finalizer.detach()
            self._release()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ioctl_error(what, {"handle": self.handle}, errno.EBADF, "buffer is closed")

    # -- CPU access ----------------------------------------------------------------------------

    def array(self, dtype: Any = np.uint8, count: int | None = None, offset: int = 0,
              shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A zero-copy numpy view of ``count`` items of ``dtype`` starting ``offset`` bytes in.

        Any fixed-size dtype without Python objects works: every numeric numpy dtype, ml_dtypes'
        ``bfloat16`` (the NPU's main dtype) and the other ml_dtypes floats, structured dtypes.
        ``count`` defaults to as many whole items as fit; ``shape`` (an extension) reshapes the view
        and implies ``count``. The view keeps this buffer alive.

        Raises:
            TypeError: ``dtype`` is zero-sized or holds Python objects; an argument is not an int.
            ValueError: the range is outside the buffer (the message gives items, dtype, bytes and size).
            XdnaError: the buffer is closed.
        """
        self._check_open("array")
        dt = _data_dtype("array", dtype)
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
            raise ValueError(f"array of {count} x {dt} ({nbytes} bytes) at offset {offset} exceeds the "
                             f"{self.size}-byte buffer")
        if not nbytes:
            raw = np.empty(0, np.uint8)
        else:
            with self.device.file.lock:     # a close in another thread unmaps now, or after this view
                self._check_open("array")
                raw = np.asarray(_View(self, self.cpu_address + offset, nbytes))
        view = raw.view(dt)
        return view.reshape(shape) if shape is not None else view

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """numpy's protocol: ``np.asarray(bo)`` is a zero-copy uint8 view of the whole buffer (``bo.array()``).

        As for any bytes-like object, ``dtype`` converts each byte's value (a copy: use ``bo.array(dtype)``
        to reinterpret the bytes instead); ``copy=True`` returns a copy, ``copy=False`` refuses to copy.

        Raises:
            ValueError: ``copy=False`` with a ``dtype`` other than uint8 (that needs a copy).
            XdnaError: the buffer is closed.
        """
        view = self.array(np.uint8)
        if dtype is not None and np.dtype(dtype) != np.uint8:
            if copy is False:
                raise ValueError(f"np.asarray(<Bo {self.size} bytes>, dtype={np.dtype(dtype)}, copy=False): a Bo is "
                                 "an array of uint8 bytes; another dtype needs a copy (bo.array(dtype) views the "
                                 "bytes as that dtype without one)")
            return view.astype(dtype)
        return view.copy() if copy else view

    def view(self, offset: int = 0, size: int | None = None) -> memoryview:
        """A writable byte ``memoryview`` of ``[offset, offset + size)`` (default: to the end), zero-copy.

        The same object ``memoryview(bo)`` gives on Python >= 3.12 (``__buffer__``), for any Python; like
        ``array`` views it keeps the buffer alive and its mapping mapped until released.

        Raises:
            TypeError: an argument is not an int.
            ValueError: the range is outside the buffer.
            XdnaError: the buffer is closed.
        """
        offset = _int_arg("view", "offset", offset)
        size = self.size - offset if size is None else _int_arg("view", "size", size)
        self._check_range("view", offset, size, size, None)
        # ndarray has the buffer protocol; numpy's stubs declare it (__buffer__) for Python >= 3.12 only
        return memoryview(self.array(np.uint8, size, offset))  # type: ignore[arg-type]

    def __buffer__(self, flags: int) -> memoryview:
        """The buffer protocol (PEP 688, Python >= 3.12): ``memoryview(bo)`` is ``bo.view()``.

        Raises:
            XdnaError: the buffer is closed.
        """
        return self.view()

    def __release_buffer__(self, view: memoryview) -> None:
        """End a ``memoryview(bo)``: drops its hold on the mapping at once, not at garbage collection."""
        view.release()

    def owner_view(self) -> memoryview:
        """A byte view of the whole buffer that does not hold its munmap back (``array`` views do).

        For the objects that own a buffer and check ``closed`` before each access (runs and run
        lists over their packet buffers), so that their close unmaps at once.

        Raises:
            XdnaError: the buffer is closed.
        """
        self._check_open("owner_view")
        return memoryview((ctypes.c_ubyte * self.size).from_address(self.cpu_address)).cast("B")

    def write(self, data: Any, offset: int = 0, *, dtype: Any = None) -> int:
        """Copy ``data`` into the buffer at byte ``offset``; returns the bytes written and counts ``bytes_in``.

        ``data`` is bytes-like or a numpy array of any fixed-size dtype (bfloat16 and every numeric dtype;
        a non-contiguous array is gathered first). Without ``dtype`` its bytes are copied as they are;
        with ``dtype`` its values are stored as that dtype: ``dtype=bfloat16`` rounds as ``write_bf16``,
        any other conversion must be a numpy "same_kind" cast (no float -> int truncation). Copies go
        straight into the mapping, split over the copy pool from ``POOL_MIN_BYTES``.

        Raises:
            TypeError: ``data`` is neither bytes-like nor an array, holds Python objects, or cannot be cast
                to ``dtype`` (the message names both dtypes).
            ValueError: the data does not fit (the message gives items, dtype, bytes, offset and size).
            XdnaError: the buffer is closed.
        """
        src = _source("write", data)
        offset = _int_arg("write", "offset", offset)
        if dtype is not None:
            dt = _data_dtype("write", dtype)
            if _is_bf16(dt) and not _is_bf16(src.dtype):
                return self.write_bf16(src, offset)
            if src.dtype != dt:
                return self._write_cast(src, dt, offset)
        nbytes = src.nbytes
        self._check_range("write", offset, nbytes, src.size, src.dtype)
        maps = self.hold("write")
        try:
            _copy_bytes(self._flat()[offset:offset + nbytes], src.view(np.uint8))
        finally:
            unhold(maps)
        self._count("bytes_in", nbytes)
        return nbytes

    def _write_cast(self, src: np.ndarray, dt: np.dtype, offset: int) -> int:
        if not np.can_cast(src.dtype, dt, "same_kind"):
            raise TypeError(f"write: cannot store {src.dtype} data as {dt} (not a same-kind cast: convert it "
                            f"explicitly)")
        nbytes = src.size * dt.itemsize
        self._check_range("write", offset, nbytes, src.size, dt)
        maps = self.hold("write")
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                np.copyto(self._flat()[offset:offset + nbytes].view(dt), src, casting="same_kind")
        finally:
            unhold(maps)
        self._count("bytes_in", nbytes)
        return nbytes

    def write_bf16(self, data: Any, offset: int = 0) -> int:
        """Store ``data`` as bf16 at byte ``offset``: float32 (or any real numbers) rounded to nearest even,
        converted straight into the mapping (``store_bf16``); bfloat16 arrays are copied as they are.
        Returns the bytes written (2 per value) and counts them in ``bytes_in``.

        The rounding is ``sam3.pack.to_bf16``'s, bit for bit: round to nearest even, a value that rounds
        past the largest bf16 becomes infinity, a NaN keeps its top 16 bits with the quiet bit set (``| 0x40``).

        Raises:
            TypeError: ``data`` is not real numbers (complex, objects, strings ...).
            ValueError: the values do not fit (the message gives their count, bytes, offset and size).
            XdnaError: the buffer is closed.
        """
        src = _source("write_bf16", data)
        offset = _int_arg("write_bf16", "offset", offset)
        if not _is_bf16(src.dtype) and src.dtype.kind not in "fiub":
            raise TypeError(f"write_bf16: expected real numbers (float, int, bool) or bfloat16, got {src.dtype}")
        nbytes = src.size * _BF16_BYTES
        self._check_range("write_bf16", offset, nbytes, src.size, _U16, "bfloat16")
        maps = self.hold("write_bf16")
        try:
            dst = self._flat()[offset:offset + nbytes]
            if _is_bf16(src.dtype):
                _copy_bytes(dst, src.view(np.uint8))
            else:
                _store_bf16(dst.view(np.uint16), src)
        finally:
            unhold(maps)
        self._count("bytes_in", nbytes)
        return nbytes

    @overload
    def read(self, size: int | None = None, offset: int = 0, *, dtype: None = None, count: None = None) -> bytes: ...
    @overload
    def read(self, size: int | None = None, offset: int = 0, *, dtype: npt.DTypeLike,
             count: int | None = None) -> np.ndarray: ...

    def read(self, size: int | None = None, offset: int = 0, *, dtype: npt.DTypeLike | None = None,
             count: int | None = None) -> bytes | np.ndarray:
        """Copy data out of the buffer from byte ``offset``; counts ``bytes_out``.

        Without ``dtype``: ``size`` bytes (default: to the end) as ``bytes``. With ``dtype`` (any fixed-size
        dtype, bfloat16 included): a new 1-D numpy array of ``count`` items (default: ``size // itemsize``,
        or as many as fit to the end), copied straight from the mapping.

        Raises:
            TypeError: an argument is not an int, ``count`` without ``dtype``, or a dtype with Python objects.
            ValueError: the range is outside the buffer, or ``size`` and ``count`` disagree (the message says both).
            XdnaError: the buffer is closed.
        """
        offset = _int_arg("read", "offset", offset)
        if dtype is None:
            if count is not None:
                raise TypeError("read: count needs a dtype (size counts bytes)")
            size = self.size - offset if size is None else _int_arg("read", "size", size)
            self._check_range("read", offset, size, size, None)
            maps = self.hold("read")
            try:
                out = self._flat()[offset:offset + size].tobytes()
            finally:
                unhold(maps)
            self._count("bytes_out", size)
            return out
        dt = _data_dtype("read", dtype)
        count = self._count_of("read", dt, size, count, offset)
        arr = np.empty(count, dt)
        if count:
            nbytes = arr.nbytes
            maps = self.hold("read")
            try:
                _copy_bytes(arr.view(np.uint8), self._flat()[offset:offset + nbytes])
            finally:
                unhold(maps)
            self._count("bytes_out", nbytes)
        return arr

    def read_f32_from_bf16(self, count: int | None = None, offset: int = 0, *,
                           out: np.ndarray | None = None) -> np.ndarray:
        """``count`` bf16 values from byte ``offset`` (default: to the end), widened to float32 straight out of
        the mapping (exact: ``load_bf16``); into ``out`` when given (a C-contiguous float32 array of ``count``
        items, e.g. a stage buffer reused across forwards), else into a new array. Counts ``bytes_out``
        (2 per value).

        Raises:
            TypeError: an argument is not an int, or ``out`` is not a C-contiguous float32 array.
            ValueError: the range is outside the buffer, or ``out`` holds another number of items.
            XdnaError: the buffer is closed.
        """
        offset = _int_arg("read_f32_from_bf16", "offset", offset)
        if count is None and out is not None:
            count = out.size
        count = self._count_of("read_f32_from_bf16", np.dtype(np.uint16), None, count, offset, "bfloat16")
        if out is None:
            out = np.empty(count, np.float32)
        elif not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous \
                or not out.flags.writeable:
            what = f"{out.dtype} array" if isinstance(out, np.ndarray) else type(out).__name__
            raise TypeError(f"read_f32_from_bf16: out must be a writable C-contiguous float32 array, got {what}")
        elif out.size != count:
            raise ValueError(f"read_f32_from_bf16: out holds {out.size} float32 items, count is {count}")
        if count:
            nbytes = count * _BF16_BYTES
            maps = self.hold("read_f32_from_bf16")
            try:
                _load_bf16(out.reshape(-1), self._flat()[offset:offset + nbytes].view(np.uint16))
            finally:
                unhold(maps)
            self._count("bytes_out", nbytes)
        return out

    def _count_of(self, what: str, dt: np.dtype, size: int | None, count: int | None, offset: int,
                  name: str | None = None) -> int:
        """Items of ``dt`` (called ``name`` in messages) a read covers: ``count``, else ``size`` bytes' worth, else
        as many as fit; range-checked."""
        if size is not None:
            size = _int_arg(what, "size", size)
            if size < 0 or size % dt.itemsize:
                raise ValueError(f"{what}: size {size} bytes is not a whole number of {dt} items "
                                 f"({dt.itemsize} bytes each)")
            if count is not None and _int_arg(what, "count", count) * dt.itemsize != size:
                raise ValueError(f"{what}: count={count} x {dt} ({count * dt.itemsize} bytes) contradicts "
                                 f"size={size} bytes")
            count = size // dt.itemsize
        elif count is not None:
            count = _int_arg(what, "count", count)
        else:
            if not 0 <= offset <= self.size:
                raise ValueError(f"{what}: offset {offset} outside a {self.size}-byte buffer")
            count = (self.size - offset) // dt.itemsize
        if count < 0:
            raise ValueError(f"{what}: count {count} is negative")
        self._check_range(what, offset, count * dt.itemsize, count, dt, name)
        return count

    def _check_range(self, what: str, offset: int, nbytes: int, count: int, dt: np.dtype | None,
                     name: str | None = None) -> None:
        """``nbytes`` at ``offset`` fit, else a ValueError naming ``count`` items of ``dt`` (called ``name``)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            room = f"{self.size - offset} bytes from there" if 0 <= offset <= self.size else "offset outside it"
            raise ValueError(f"{what}: {_what(count, dt, name)} at offset {offset} do not fit the {self.size}-byte "
                             f"buffer ({room})")

    def _flat(self) -> np.ndarray:
        """The whole buffer as a uint8 array, for copies made under ``hold`` (it does not hold the mapping
        itself, so it never leaves this class)."""
        flat = self._flat_cache
        if flat is None:
            # a ctypes array has the buffer protocol; numpy's stubs accept any buffer for Python >= 3.12 only
            flat = np.frombuffer((ctypes.c_ubyte * self.size).from_address(self.cpu_address),  # type: ignore[call-overload]
                                 np.uint8)
            self._flat_cache = flat
        return flat

    def _count(self, key: str, nbytes: int) -> None:
        with self.device.file.lock:
            self.device.stats[key] += nbytes

    # -- cache maintenance ---------------------------------------------------------------------

    def sync(self, offset: int = 0, size: int | None = None, direction: str = TO_DEVICE) -> None:
        """Cache maintenance for ``[offset, offset + size)`` of this buffer (default: all of it).

        Call it after CPU writes (before the device reads) and after the device wrote (before CPU
        reads). Both directions issue SYNC_BO with direction TO_DEVICE: the kernel does the same
        clflush (write-back + invalidate) for either direction, and on upstream drivers >= 0.3 a
        FROM_DEVICE sync of anything but a debug buffer flushes and then fails with EINVAL
        (docs/xrt-sequence.md 1.6, docs/uapi.md 4.6). XRT flushes from userspace instead,
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


# -- host copies ---------------------------------------------------------------------------------
# A pool hand-off costs tens of microseconds, a 64 KiB copy about one: copies split over the pool
# only from POOL_MIN_BYTES (memcpy) or POOL_MIN_ELEMENTS (a conversion costs several memcpys per byte).
# Each part is a contiguous range for one thread, its first on the calling thread. Conversions walk
# their part in steps of _STEP values, so that a step's source and destination stay in the L2 cache
# between the cast and the NaN check that reads the source again.

#: Threads a large copy is split over (the calling thread is one of them).
COPY_WORKERS = max(1, min(4, os.cpu_count() or 1))
#: A memcpy of at least this many bytes is split over the copy pool.
POOL_MIN_BYTES = 1 << 22
#: A bf16 conversion of at least this many values is split over the copy pool.
POOL_MIN_ELEMENTS = 1 << 18
_STEP = 1 << 15
_ALIGN = 1 << 12  # part boundaries in items: whole cache lines, whole steps of the small dtypes

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()
_QUIET_NAN = 0x40  # the bf16 quiet bit (docs/sam3-packing.md 1)


def copy_pool() -> ThreadPoolExecutor:
    """The process's copy pool (``COPY_WORKERS`` threads, started on demand), shared with sam3's copies."""
    global _pool
    with _pool_lock:  # two first copies from two threads must not start two pools
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=COPY_WORKERS, thread_name_prefix="amdxdna-copy")
        return _pool


def _in_part(fn: Callable[[int, int], None], start: int, stop: int) -> None:
    _local.in_pool = True
    try:
        fn(start, stop)
    finally:
        _local.in_pool = False


def _split(n: int, minimum: int, fn: Callable[[int, int], None]) -> None:
    """Run ``fn(start, stop)`` over ``[0, n)``: in one call below ``minimum``, else in up to ``COPY_WORKERS``
    parts of at least ``minimum // 2`` items, the first on the calling thread."""
    if n < minimum:
        fn(0, n)
        return
    parts = min(COPY_WORKERS, n // max(1, minimum // 2))
    if parts < 2 or getattr(_local, "in_pool", False):
        fn(0, n)
        return
    step = -(-n // parts)
    step = -(-step // _ALIGN) * _ALIGN
    bounds = [(start, min(n, start + step)) for start in range(0, n, step)]
    pool = copy_pool()
    futures: list[Future[None]] = [pool.submit(_in_part, fn, a, b) for a, b in bounds[1:]]
    try:
        fn(*bounds[0])
    finally:
        # every part writes into the caller's buffer (often a held mapping): wait for all before returning
        errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst``, both 1-D contiguous uint8 arrays of one size, with numpy's memcpy (which
    releases the GIL), split over the copy pool from ``POOL_MIN_BYTES``.

    Raises:
        ValueError: the arrays are not 1-D contiguous uint8 of one size, or ``dst`` is read-only.
    """
    _check_pair("copy_bytes", dst, np.uint8, src, (np.dtype(np.uint8),))
    _copy_bytes(dst, src)


def _copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    if dst.size < POOL_MIN_BYTES:
        np.copyto(dst, src)
    else:
        _split(dst.size, POOL_MIN_BYTES, lambda a, b: np.copyto(dst[a:b], src[a:b]))


def store_bf16(dst: np.ndarray, src: np.ndarray) -> None:
    """Round ``src`` (1-D contiguous real numbers) to bf16 into ``dst`` (1-D contiguous uint16 of one size),
    in place: no temporary larger than one step; split over the copy pool from ``POOL_MIN_ELEMENTS``.

    The bits are ``sam3.pack.to_bf16``'s (docs/sam3-packing.md 1): other dtypes go through float32 first,
    then round to nearest even (ml_dtypes' cast, straight into ``dst``); a NaN keeps its top 16 bits with
    the quiet bit set (``| 0x40``), where the cast would give the canonical NaN.

    Raises:
        ValueError: the arrays are not 1-D contiguous, ``dst`` is not uint16 or is read-only, or their sizes differ.
        TypeError: ``src`` is not real numbers.
    """
    if not isinstance(src, np.ndarray) or src.dtype.kind not in "fiub":
        raise TypeError(f"store_bf16: expected real numbers, got {getattr(src, 'dtype', type(src).__name__)}")
    _check_pair("store_bf16", dst, np.uint16, src, (src.dtype,))
    _store_bf16(dst, src)


def _store_bf16(dst: np.ndarray, src: np.ndarray) -> None:
    out = dst.view(_bf16())
    widen = src.dtype != np.float32

    def part(a: int, b: int) -> None:
        for o in range(a, b, _STEP):
            e = min(b, o + _STEP)
            s = src[o:e]
            if widen:
                with np.errstate(over="ignore", invalid="ignore"):
                    s = s.astype(np.float32)
            # max propagates NaN without a warning; the cast warns only for a signalling NaN, so the
            # errstate (microseconds) is entered only for a step that holds a NaN
            if math.isnan(s.max()):
                with np.errstate(invalid="ignore"):
                    np.copyto(out[o:e], s, casting="unsafe")
                _nan_bits(dst[o:e], s)
            else:
                np.copyto(out[o:e], s, casting="unsafe")

    _split(dst.size, POOL_MIN_ELEMENTS, part)


def _nan_bits(dst: np.ndarray, src: np.ndarray) -> None:
    nan = np.isnan(src)
    dst[nan] = (src[nan].view(np.uint32) >> 16).astype(np.uint16) | _QUIET_NAN


def load_bf16(dst: np.ndarray, src: np.ndarray) -> None:
    """Widen bf16 bit patterns ``src`` (1-D contiguous uint16 or bfloat16) into ``dst`` (1-D contiguous float32
    of one size): exact, a 16-bit left shift of each pattern, NaN payloads kept; split over the copy pool
    from ``POOL_MIN_ELEMENTS``.

    Raises:
        ValueError: the arrays are not 1-D contiguous of those dtypes, their sizes differ, or ``dst`` is read-only.
    """
    _check_pair("load_bf16", dst, np.float32, src, (_U16, _bf16()))
    _load_bf16(dst, src)


def _load_bf16(dst: np.ndarray, src: np.ndarray) -> None:
    bits = src.view(_bf16())
    if dst.size < POOL_MIN_ELEMENTS:
        np.copyto(dst, bits)
    else:
        _split(dst.size, POOL_MIN_ELEMENTS, lambda a, b: np.copyto(dst[a:b], bits[a:b]))


def _check_pair(what: str, dst: np.ndarray, dst_dtype: Any, src: np.ndarray, src_dtypes: tuple[np.dtype, ...]) -> None:
    for name, arr, dtypes in (("destination", dst, (np.dtype(dst_dtype),)), ("source", src, src_dtypes)):
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or not arr.flags.c_contiguous or arr.dtype not in dtypes:
            got = f"{arr.dtype} array of shape {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
            want = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{what}: {name} must be a 1-D contiguous {want} array, got a {got}")
    if dst.size != src.size:
        raise ValueError(f"{what}: destination holds {dst.size} x {dst.dtype}, source {src.size} x {src.dtype}")
    if not dst.flags.writeable:
        raise ValueError(f"{what}: destination is read-only")


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
    # munmap, then GEM_CLOSE (docs/xrt-sequence.md 1.10); DEV BOs have no mapping of their own.
    # With numpy views left the munmap waits for them (CpuMapping); the GEM handle goes now.
    steps = [mapping.release] if mapping is not None else []
    release_steps(*steps, lambda: _close_handle(file, handle))
