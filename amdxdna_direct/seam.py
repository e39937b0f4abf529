"""The syscall seam: the only runtime module that opens, ioctls, maps and closes the device.

``Seam`` is the protocol; ``OsSeam`` is the real implementation on ``/dev/accel/accelN``; the
emulator's ``EmuSeam`` is the other one (docs/design.md section 1). Failures raise
``OSError(errno, strerror)``; the device layer turns them into typed errors.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from . import abi

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["Seam", "OsSeam", "dmabuf_size"]


def dmabuf_size(fd: int) -> int:
    """The size in bytes of the dma-buf ``fd`` (it answers lseek to its end with its size; docs/runtime.md 3.3),
    its offset put back to 0.

    Raises:
        OSError: ``fd`` is not open (EBADF) or cannot seek (ESPIPE: not a dma-buf).
    """
    size = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, 0, os.SEEK_SET)
    return size


@runtime_checkable
class Seam(Protocol):
    """What the runtime needs from a device file: ioctl, shared mappings, VA reservations, close."""

    name: str

    def ioctl(self, request: int, buf: WriteableBuffer) -> int:
        """Issue ``request`` with the writable ``buf`` (results written in place); raise OSError on failure."""
        ...

    def mmap(self, length: int, offset: int, addr: int = 0) -> int:
        """MAP_SHARED the device at ``offset`` (MAP_FIXED at ``addr`` when non-zero); return the address."""
        ...

    def reserve(self, length: int, alignment: int) -> int:
        """Reserve ``length`` bytes of PROT_NONE address space aligned to ``alignment``; return the address."""
        ...

    def munmap(self, addr: int, length: int) -> None:
        """Unmap ``[addr, addr + length)``."""
        ...

    def close(self) -> None:
        """Close the device file (idempotent)."""
        ...


class OsSeam:
    """The real device file: ``os.open`` + ``fcntl.ioctl`` + libc ``mmap``/``munmap`` through ``abi.libc``."""

    def __init__(self, path: str) -> None:
        """Open ``path`` read-write, close-on-exec.

        Raises:
            OSError: from ``open(2)`` (ENOENT, EACCES, ...), unchanged.
        """
        self.name = str(path)
        self.fd = os.open(self.name, os.O_RDWR | os.O_CLOEXEC)

    def __repr__(self) -> str:
        return f"OsSeam({self.name!r}, fd={self.fd})"

    def ioctl(self, request: int, buf: WriteableBuffer) -> int:
        """``ioctl(fd, request, buf)`` with results written back into ``buf``.

        Retried after EINTR (as PEP 475 does for other syscalls): the ioctls that block are safe to
        restart, EXEC_CMD waiting for a free slot has submitted nothing yet (docs/uapi.md 4.7)
        and syncobj waits take an absolute deadline (docs/uapi.md 5). A signal handler that raises still stops it.

        Raises:
            OSError: the ioctl failed (errno set by the driver).
        """
        while True:
            try:
                # a writable buffer with mutate_flag=True makes ioctl return the syscall's int result (fcntl
                # docs); typeshed answers Any because it cannot tell a writable buffer from a read-only one
                return cast(int, fcntl.ioctl(self._live_fd(), request, buf, True))
            except InterruptedError:
                continue

    def mmap(self, length: int, offset: int, addr: int = 0) -> int:
        """Map ``length`` bytes of the device at ``offset``, MAP_SHARED (the shmem GEM refuses private
        mappings, docs/uapi.md 7), MAP_FIXED at ``addr`` when given.

        MAP_LOCKED, which the XRT shim adds, is left out on purpose: it fails with EAGAIN under the
        default RLIMIT_MEMLOCK for a 64 MiB heap, and XRT-lite and ROCr map without it (docs/xrt-sequence.md 1.4).

        Raises:
            OSError: mmap failed.
        """
        flags = abi.MAP_SHARED | (abi.MAP_FIXED if addr else 0)
        return self._mmap(addr, length, abi.PROT_READ | abi.PROT_WRITE, flags, self._live_fd(), offset)

    def reserve(self, length: int, alignment: int) -> int:
        """Reserve an aligned PROT_NONE range: over-map by ``alignment``, then trim both ends.

        Raises:
            ValueError: alignment is not a power of two.
            OSError: mmap/munmap failed.
        """
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"reserve alignment {alignment:#x} is not a power of two")
        flags = abi.MAP_PRIVATE | abi.MAP_ANONYMOUS | abi.MAP_NORESERVE
        base = self._mmap(0, length + alignment, abi.PROT_NONE, flags, -1, 0)
        aligned = (base + alignment - 1) & ~(alignment - 1)
        if aligned > base:
            self.munmap(base, aligned - base)
        tail = base + length + alignment - (aligned + length)
        if tail:
            self.munmap(aligned + length, tail)
        return aligned

    def munmap(self, addr: int, length: int) -> None:
        """Unmap a range.

        Raises:
            OSError: munmap failed.
        """
        if abi.libc.munmap(abi.ffi.cast("void *", addr), length) != 0:
            err = abi.ffi.errno
            raise OSError(err, f"munmap(addr={addr:#x}, length={length:#x}): {os.strerror(err)}")

    def close(self) -> None:
        """Close the file descriptor; later calls raise EBADF."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def _live_fd(self) -> int:
        if self.fd < 0:
            raise OSError(errno.EBADF, f"{self.name} is closed")
        return self.fd

    @staticmethod
    def _mmap(addr: int, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
        ptr = abi.libc.mmap(abi.ffi.cast("void *", addr), length, prot, flags, fd, offset)
        if ptr == abi.MAP_FAILED:
            err = abi.ffi.errno
            raise OSError(err, f"mmap(addr={addr:#x}, length={length:#x}, offset={offset:#x}): {os.strerror(err)}")
        return abi.address_of(ptr)
