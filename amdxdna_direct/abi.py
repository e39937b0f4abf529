"""The one cffi FFI over the project's C headers, ioctl request numbers, and libc.

cffi runs in ABI mode: the declarations in ``headers/*.h`` (shipped inside the package as
``amdxdna_direct/headers``) are parsed at import, so no C compiler is needed at install or run
time.  Every ``#define`` and enum value of those headers is re-exported as a module attribute
under its C name (``AMDXDNA_BO_SHMEM``, ``ERT_START_CU``, ``DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT``
...), taken from the cdef, and the request numbers are computed from ``ffi.sizeof`` with the
kernel's ``_IOC`` bit layout (include/uapi/asm-generic/ioctl.h), so a struct that changes size
changes its request number with it.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import cffi

#: Header files in cdef order (a header may use types of the ones before it).
HEADER_FILES: tuple[str, ...] = ("libc.h", "drm.h", "amdxdna_accel.h", "ert.h", "xclbin.h")

_PACKAGE_DIR = Path(__file__).resolve().parent


def header_dir() -> Path:
    """Return the directory holding the headers: the installed package data, else the repo's ``headers/``.

    Raises:
        FileNotFoundError: neither location holds every file of ``HEADER_FILES``.
    """
    candidates = (_PACKAGE_DIR / "headers", _PACKAGE_DIR.parent / "headers")
    for candidate in candidates:
        if all((candidate / name).is_file() for name in HEADER_FILES):
            return candidate
    searched = ", ".join(str(c) for c in candidates)
    wanted = ", ".join(HEADER_FILES)
    raise FileNotFoundError(errno.ENOENT, f"amdxdna_direct.abi: headers {wanted} not found in", searched)


def read_cdef(directory: Path) -> str:
    """Concatenate ``HEADER_FILES`` from ``directory`` into one cdef source, each chunk labelled by file.

    Raises:
        FileNotFoundError: a header file is missing.
    """
    chunks = []
    for name in HEADER_FILES:
        text = (Path(directory) / name).read_text(encoding="utf-8")
        chunks.append(f"/* ==== {name} ==== */\n{text}")
    return "\n".join(chunks)


def build_ffi(directory: Path) -> cffi.FFI:
    """Build a fresh FFI from the headers in ``directory`` (the tests use this on altered copies).

    Raises:
        FileNotFoundError: a header file is missing.
        cffi.CDefError: a header is not valid cffi C.
    """
    new_ffi = cffi.FFI()
    new_ffi.cdef(read_cdef(directory))
    return new_ffi


ffi: cffi.FFI = build_ffi(header_dir())
#: The C library of this process (ABI mode); also the namespace of every integer constant of the cdef.
libc: Any = ffi.dlopen(None)

#: mmap's failure value, ``(void *) -1``.
MAP_FAILED = ffi.cast("void *", -1)


def integer_constants(lib: Any) -> dict[str, int]:
    """Return every ``#define`` and enum value declared in the cdef behind ``lib``, by C name."""
    constants = {}
    for name in dir(lib):
        value = getattr(lib, name)
        if isinstance(value, int):
            constants[name] = value
    return constants


# ---- _IOC bit layout (include/uapi/asm-generic/ioctl.h; x86_64 uses the generic one) ----
_IOC_NRBITS = 8
_IOC_TYPEBITS = 8
_IOC_SIZEBITS = 14
_IOC_DIRBITS = 2

_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS

_IOC_NONE = 0
_IOC_WRITE = 1
_IOC_READ = 2


def _IOC(direction: int, type_: int, nr: int, size: int) -> int:  # noqa: N802 - kernel spelling
    """Encode an ioctl request number exactly as the kernel's ``_IOC`` macro.

    Raises:
        ValueError: a field does not fit its bit width.
    """
    fields = (("direction", direction, _IOC_DIRBITS), ("type", type_, _IOC_TYPEBITS),
              ("nr", nr, _IOC_NRBITS), ("size", size, _IOC_SIZEBITS))
    for label, value, bits in fields:
        if not 0 <= value < (1 << bits):
            raise ValueError(f"_IOC: {label}={value} does not fit in {bits} bits")
    return (direction << _IOC_DIRSHIFT) | (type_ << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT) | (size << _IOC_SIZESHIFT)


def _IOW(type_: int, nr: int, ctype: str) -> int:  # noqa: N802 - kernel spelling
    """``_IOW(type, nr, ctype)``: userspace writes ``sizeof(ctype)`` bytes to the kernel.

    Raises:
        ValueError: a field does not fit its bit width, or ``ctype`` is an undeclared struct (unknown size).
        cffi.CDefError: ``ctype`` names no type at all.
    """
    return _IOC(_IOC_WRITE, type_, nr, ffi.sizeof(ctype))


def _IOR(type_: int, nr: int, ctype: str) -> int:  # noqa: N802 - kernel spelling
    """``_IOR(type, nr, ctype)``: the kernel writes ``sizeof(ctype)`` bytes back.

    Raises:
        ValueError: a field does not fit its bit width, or ``ctype`` is an undeclared struct (unknown size).
        cffi.CDefError: ``ctype`` names no type at all.
    """
    return _IOC(_IOC_READ, type_, nr, ffi.sizeof(ctype))


def _IOWR(type_: int, nr: int, ctype: str) -> int:  # noqa: N802 - kernel spelling
    """``_IOWR(type, nr, ctype)``: copied in and back out.

    Raises:
        ValueError: a field does not fit its bit width, or ``ctype`` is an undeclared struct (unknown size).
        cffi.CDefError: ``ctype`` names no type at all.
    """
    return _IOC(_IOC_READ | _IOC_WRITE, type_, nr, ffi.sizeof(ctype))


def _amdxdna_nr(index: int) -> int:
    """Request nr of an amdxdna ioctl: driver-private ioctls start at DRM_COMMAND_BASE (spec 1a)."""
    return libc.DRM_COMMAND_BASE + index


def _amdxdna_iowr(index: int, ctype: str) -> int:
    """``DRM_IOWR(DRM_COMMAND_BASE + index, ctype)``, the encoding of every amdxdna ioctl but upstream WAIT_CMD."""
    return _IOWR(libc.DRM_IOCTL_BASE, _amdxdna_nr(index), ctype)


_D = libc.DRM_IOCTL_BASE

# ---- amdxdna (spec/amdxdna-uapi.md 1a; all IOWR except the upstream WAIT_CMD) ----
DRM_IOCTL_AMDXDNA_CREATE_HWCTX = _amdxdna_iowr(libc.DRM_AMDXDNA_CREATE_HWCTX, "struct amdxdna_drm_create_hwctx")
DRM_IOCTL_AMDXDNA_DESTROY_HWCTX = _amdxdna_iowr(libc.DRM_AMDXDNA_DESTROY_HWCTX, "struct amdxdna_drm_destroy_hwctx")
DRM_IOCTL_AMDXDNA_CONFIG_HWCTX = _amdxdna_iowr(libc.DRM_AMDXDNA_CONFIG_HWCTX, "struct amdxdna_drm_config_hwctx")
DRM_IOCTL_AMDXDNA_CREATE_BO = _amdxdna_iowr(libc.DRM_AMDXDNA_CREATE_BO, "struct amdxdna_drm_create_bo")
DRM_IOCTL_AMDXDNA_GET_BO_INFO = _amdxdna_iowr(libc.DRM_AMDXDNA_GET_BO_INFO, "struct amdxdna_drm_get_bo_info")
DRM_IOCTL_AMDXDNA_SYNC_BO = _amdxdna_iowr(libc.DRM_AMDXDNA_SYNC_BO, "struct amdxdna_drm_sync_bo")
DRM_IOCTL_AMDXDNA_EXEC_CMD = _amdxdna_iowr(libc.DRM_AMDXDNA_EXEC_CMD, "struct amdxdna_drm_exec_cmd")
DRM_IOCTL_AMDXDNA_GET_INFO = _amdxdna_iowr(libc.DRM_AMDXDNA_GET_INFO, "struct amdxdna_drm_get_info")
DRM_IOCTL_AMDXDNA_SET_STATE = _amdxdna_iowr(libc.DRM_AMDXDNA_SET_STATE, "struct amdxdna_drm_set_state")
DRM_IOCTL_AMDXDNA_WAIT_CMD = _IOW(_D, _amdxdna_nr(libc.DRM_AMDXDNA_WAIT_CMD), "struct amdxdna_drm_wait_cmd")
#: The out-of-tree driver's IOWR encoding of WAIT_CMD; DRM dispatches by nr, so both reach the handler (spec 4.0).
DRM_IOCTL_AMDXDNA_WAIT_CMD_OOT = _amdxdna_iowr(libc.DRM_AMDXDNA_WAIT_CMD, "struct amdxdna_drm_wait_cmd")
DRM_IOCTL_AMDXDNA_GET_ARRAY = _amdxdna_iowr(libc.DRM_AMDXDNA_GET_ARRAY, "struct amdxdna_drm_get_array")

# ---- DRM core (spec/amdxdna-uapi.md section 5) ----
DRM_IOCTL_VERSION = _IOWR(_D, libc.DRM_NR_VERSION, "struct drm_version")
DRM_IOCTL_GEM_CLOSE = _IOW(_D, libc.DRM_NR_GEM_CLOSE, "struct drm_gem_close")
DRM_IOCTL_GET_CAP = _IOWR(_D, libc.DRM_NR_GET_CAP, "struct drm_get_cap")
DRM_IOCTL_PRIME_HANDLE_TO_FD = _IOWR(_D, libc.DRM_NR_PRIME_HANDLE_TO_FD, "struct drm_prime_handle")
DRM_IOCTL_PRIME_FD_TO_HANDLE = _IOWR(_D, libc.DRM_NR_PRIME_FD_TO_HANDLE, "struct drm_prime_handle")
DRM_IOCTL_SYNCOBJ_CREATE = _IOWR(_D, libc.DRM_NR_SYNCOBJ_CREATE, "struct drm_syncobj_create")
DRM_IOCTL_SYNCOBJ_DESTROY = _IOWR(_D, libc.DRM_NR_SYNCOBJ_DESTROY, "struct drm_syncobj_destroy")
DRM_IOCTL_SYNCOBJ_WAIT = _IOWR(_D, libc.DRM_NR_SYNCOBJ_WAIT, "struct drm_syncobj_wait")
DRM_IOCTL_SYNCOBJ_RESET = _IOWR(_D, libc.DRM_NR_SYNCOBJ_RESET, "struct drm_syncobj_array")
DRM_IOCTL_SYNCOBJ_SIGNAL = _IOWR(_D, libc.DRM_NR_SYNCOBJ_SIGNAL, "struct drm_syncobj_array")
DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT = _IOWR(_D, libc.DRM_NR_SYNCOBJ_TIMELINE_WAIT, "struct drm_syncobj_timeline_wait")
DRM_IOCTL_SYNCOBJ_QUERY = _IOWR(_D, libc.DRM_NR_SYNCOBJ_QUERY, "struct drm_syncobj_timeline_array")
DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL = _IOWR(_D, libc.DRM_NR_SYNCOBJ_TIMELINE_SIGNAL, "struct drm_syncobj_timeline_array")

#: request number -> (short name as in the kernel's ioctl name minus its prefix, C struct type).
#: Both WAIT_CMD encodings map to "WAIT_CMD".
IOCTLS: dict[int, tuple[str, str]] = {
    DRM_IOCTL_AMDXDNA_CREATE_HWCTX: ("CREATE_HWCTX", "struct amdxdna_drm_create_hwctx"),
    DRM_IOCTL_AMDXDNA_DESTROY_HWCTX: ("DESTROY_HWCTX", "struct amdxdna_drm_destroy_hwctx"),
    DRM_IOCTL_AMDXDNA_CONFIG_HWCTX: ("CONFIG_HWCTX", "struct amdxdna_drm_config_hwctx"),
    DRM_IOCTL_AMDXDNA_CREATE_BO: ("CREATE_BO", "struct amdxdna_drm_create_bo"),
    DRM_IOCTL_AMDXDNA_GET_BO_INFO: ("GET_BO_INFO", "struct amdxdna_drm_get_bo_info"),
    DRM_IOCTL_AMDXDNA_SYNC_BO: ("SYNC_BO", "struct amdxdna_drm_sync_bo"),
    DRM_IOCTL_AMDXDNA_EXEC_CMD: ("EXEC_CMD", "struct amdxdna_drm_exec_cmd"),
    DRM_IOCTL_AMDXDNA_GET_INFO: ("GET_INFO", "struct amdxdna_drm_get_info"),
    DRM_IOCTL_AMDXDNA_SET_STATE: ("SET_STATE", "struct amdxdna_drm_set_state"),
    DRM_IOCTL_AMDXDNA_WAIT_CMD: ("WAIT_CMD", "struct amdxdna_drm_wait_cmd"),
    DRM_IOCTL_AMDXDNA_WAIT_CMD_OOT: ("WAIT_CMD", "struct amdxdna_drm_wait_cmd"),
    DRM_IOCTL_AMDXDNA_GET_ARRAY: ("GET_ARRAY", "struct amdxdna_drm_get_array"),
    DRM_IOCTL_VERSION: ("VERSION", "struct drm_version"),
    DRM_IOCTL_GEM_CLOSE: ("GEM_CLOSE", "struct drm_gem_close"),
    DRM_IOCTL_GET_CAP: ("GET_CAP", "struct drm_get_cap"),
    DRM_IOCTL_PRIME_HANDLE_TO_FD: ("PRIME_HANDLE_TO_FD", "struct drm_prime_handle"),
    DRM_IOCTL_PRIME_FD_TO_HANDLE: ("PRIME_FD_TO_HANDLE", "struct drm_prime_handle"),
    DRM_IOCTL_SYNCOBJ_CREATE: ("SYNCOBJ_CREATE", "struct drm_syncobj_create"),
    DRM_IOCTL_SYNCOBJ_DESTROY: ("SYNCOBJ_DESTROY", "struct drm_syncobj_destroy"),
    DRM_IOCTL_SYNCOBJ_WAIT: ("SYNCOBJ_WAIT", "struct drm_syncobj_wait"),
    DRM_IOCTL_SYNCOBJ_RESET: ("SYNCOBJ_RESET", "struct drm_syncobj_array"),
    DRM_IOCTL_SYNCOBJ_SIGNAL: ("SYNCOBJ_SIGNAL", "struct drm_syncobj_array"),
    DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT: ("SYNCOBJ_TIMELINE_WAIT", "struct drm_syncobj_timeline_wait"),
    DRM_IOCTL_SYNCOBJ_QUERY: ("SYNCOBJ_QUERY", "struct drm_syncobj_timeline_array"),
    DRM_IOCTL_SYNCOBJ_TIMELINE_SIGNAL: ("SYNCOBJ_TIMELINE_SIGNAL", "struct drm_syncobj_timeline_array"),
}


def new(ctype: str, **fields: Any) -> Any:
    """Allocate a zeroed ``ctype`` (e.g. ``"struct amdxdna_drm_create_bo"``) and set ``fields``; returns the pointer.

    The memory lives as long as the returned cdata; pass ``ffi.buffer(p)`` to an ioctl.

    Raises:
        TypeError: ``ctype`` is not a declared struct, or has no field of that name / type.
        ValueError: a value does not fit its field.
    """
    try:
        pointer = ffi.new(f"{ctype} *")
    except (TypeError, cffi.CDefError) as err:
        raise TypeError(f"new({ctype!r}): not a declared C type of known size") from err
    for name, value in fields.items():
        try:
            setattr(pointer, name, value)
        except AttributeError as err:
            raise TypeError(f"new({ctype!r}): no field {name!r}") from err
        except TypeError as err:
            raise TypeError(f"new({ctype!r}): {name}={value!r} has the wrong type ({err})") from err
        except OverflowError as err:
            raise ValueError(f"new({ctype!r}): {name}={value!r} does not fit the field") from err
    return pointer


def address_of(cdata: Any) -> int:
    """Return the process address a cdata pointer or array refers to (for the u64 pointer fields of the uAPI).

    Raises:
        TypeError: ``cdata`` is not a cffi pointer or array.
    """
    if not isinstance(cdata, ffi.CData):
        raise TypeError(f"address_of: expected a cffi pointer or array, got {type(cdata).__name__}")
    return int(ffi.cast("uintptr_t", cdata))


def _export_constants() -> None:
    """Make every header constant a module attribute under its C name, refusing to shadow a name defined here."""
    constants = integer_constants(libc)
    clashes = sorted(set(constants) & set(globals()))
    if clashes:
        raise ImportError(f"amdxdna_direct.abi: header constants {clashes} clash with names of the module")
    globals().update(constants)


_export_constants()
