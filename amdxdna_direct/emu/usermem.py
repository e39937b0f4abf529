"""copy_from_user / copy_to_user for the emulated driver, plus the libc calls of the mmap path.

The emulator runs in the caller's process, so a user pointer is a plain address of this process.
Accesses go through ``process_vm_readv``/``process_vm_writev`` on our own pid: like the kernel's
user-copy helpers they fail with EFAULT on an unmapped or protected address instead of crashing
(the driver answers EFAULT for an unreadable qos_p, args, param_val ..., docs/uapi.md 4.1/4.3/4.7).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
# The user copies hold the GIL (a PyDLL call does not release it): a copy of a few bytes of our own memory takes a
# microsecond, while releasing and re-taking the GIL lets the firmware threads in and costs tens (bench_emulator.py).
_libc_gil = ctypes.PyDLL(None)


class _iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc_gil, _name)
    _fn.restype = ctypes.c_ssize_t
    _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_iovec), ctypes.c_ulong, ctypes.POINTER(_iovec), ctypes.c_ulong,
                    ctypes.c_ulong]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
MAP_FAILED = ctypes.c_void_p(-1).value


class UserFault(OSError):
    """A user pointer the driver could not read or write (EFAULT)."""

    def __init__(self, what: str, addr: int, length: int):
        super().__init__(errno.EFAULT, f"{what}: cannot access {length} bytes at user address {addr:#x}: EFAULT")


def _transfer(fn: Callable[..., int], what: str, local: int, remote: int, length: int) -> None:
    if length == 0:
        return
    if remote == 0:
        raise UserFault(what, remote, length)
    liov = _iovec(local, length)
    riov = _iovec(remote, length)
    done = fn(os.getpid(), ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
    if done != length:
        raise UserFault(what, remote, length)


def read(addr: int, length: int, what: str = "copy_from_user") -> bytes:
    """Read `length` bytes at user address `addr`.

    Raises:
        UserFault: (EFAULT) the range is not readable, or `addr` is 0.
    """
    buf = ctypes.create_string_buffer(max(length, 1))
    _transfer(_libc_gil.process_vm_readv, what, ctypes.addressof(buf), addr, length)
    return buf.raw[:length]


def write(addr: int, data: bytes, what: str = "copy_to_user") -> None:
    """Write `data` at user address `addr`.

    Raises:
        UserFault: (EFAULT) the range is not writable, or `addr` is 0.
    """
    buf = ctypes.create_string_buffer(bytes(data), max(len(data), 1))
    _transfer(_libc_gil.process_vm_writev, what, ctypes.addressof(buf), addr, len(data))


PR_GET_NAME = 16
TASK_COMM_LEN = 16
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def process_name() -> bytes:
    """The calling task's comm, as the kernel keeps it (at most TASK_COMM_LEN - 1 bytes; no file is read)."""
    buf = ctypes.create_string_buffer(TASK_COMM_LEN)
    if _libc.prctl(PR_GET_NAME, ctypes.addressof(buf), 0, 0, 0) != 0:
        return b""
    return buf.value


def _check(result: int | None, what: str) -> int:
    if result is None or result == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {errno.errorcode.get(err, err)}")
    return result


def mmap(addr: int, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    """libc mmap; returns the mapped address.

    Raises:
        OSError: the kernel's errno.
    """
    return _check(_libc.mmap(addr or None, length, prot, flags, fd, offset), f"mmap(length={length:#x})")


def munmap(addr: int, length: int) -> None:
    """libc munmap.

    Raises:
        OSError: the kernel's errno.
    """
    if _libc.munmap(addr, length) != 0:
        _check(None, f"munmap({addr:#x}, {length:#x})")
