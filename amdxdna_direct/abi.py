"""The one cffi FFI over the project's C headers, ioctl request numbers, and libc.

cffi runs in ABI mode, so no C compiler is needed at install or run time. The declarations of
``headers/*.h`` (shipped inside the package as ``amdxdna_direct/headers``) are compiled once, when
the headers change, into cffi's out-of-line ABI module ``amdxdna_direct/_abi_decl.py`` (committed;
regenerate it with ``write_decl_module()``, a test checks it is current), so importing this module
parses no C: pycparser is not even imported. Without that module, or when it was generated from
other headers than the ones beside it, the headers are parsed at import (in-line ABI mode), and a
log line says so. Every ``#define`` and enum value of those headers is re-exported as a module
attribute under its C name (``AMDXDNA_BO_SHMEM``, ``ERT_START_CU``,
``DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT`` ...), taken from the cdef, and the request numbers are
computed from ``ffi.sizeof`` with the kernel's ``_IOC`` bit layout (include/uapi/asm-generic/ioctl.h),
so a struct that changes size changes its request number with it.

Static checkers cannot see names added at import, so ``write_decl_module()`` also writes
``amdxdna_direct/_abi_constants.py``: every one of those constants as a typed declaration
(``NAME: Final = value``, in header order, with the cdef's digest), imported here for type checking
only. It is generated and committed like ``_abi_decl.py`` and the same test checks it is current;
at run time the values still come from the cdef in use.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import importlib
import importlib.util
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import cffi

    # every header constant, typed, for static checkers (see the module docstring); the import exports them at
    # run time. F403: the generated module is exactly the set of names wanted here.
    from amdxdna_direct._abi_constants import *  # noqa: F403

#: Header files in cdef order (a header may use types of the ones before it).
HEADER_FILES: tuple[str, ...] = ("libc.h", "drm.h", "amdxdna_accel.h", "ert.h", "xclbin.h")
#: The out-of-line ABI module ``write_decl_module`` generates from the headers.
DECL_MODULE = "amdxdna_direct._abi_decl"

_PACKAGE_DIR = Path(__file__).resolve().parent
_DECL_PATH = _PACKAGE_DIR / "_abi_decl.py"
_CONSTANTS_FILE = "_abi_constants.py"
_log = logging.getLogger(__name__)


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


def cdef_digest(source: str) -> str:
    """The sha256 (hex) of a cdef source: what ties ``_abi_decl.py`` to the headers it was generated from."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def build_ffi(directory: Path) -> cffi.FFI:
    """Build a fresh FFI from the headers in ``directory``, parsing them (in-line ABI mode; needs pycparser).

    The tests use this on altered copies of the headers; the import uses it only without a current
    ``_abi_decl.py``.

    Raises:
        FileNotFoundError: a header file is missing.
        cffi.CDefError: a header is not valid cffi C.
    """
    import cffi

    new_ffi = cffi.FFI()
    new_ffi.cdef(read_cdef(directory))
    return new_ffi


def decl_module_source(directory: Path | None = None) -> str:
    """The text of ``amdxdna_direct/_abi_decl.py`` for the headers in ``directory`` (default ``header_dir()``):
    cffi's out-of-line ABI-mode module (``set_source(DECL_MODULE, None)``, no C compiler involved) plus
    the digest of the cdef it holds.

    Raises:
        FileNotFoundError: a header file is missing.
        cffi.CDefError: a header is not valid cffi C.
    """
    import cffi

    source = read_cdef(header_dir() if directory is None else directory)
    builder = cffi.FFI()
    builder.cdef(source)
    builder.set_source(DECL_MODULE, None)
    with tempfile.TemporaryDirectory(prefix="amdxdna-abi-") as tmp:
        target = Path(tmp) / "_abi_decl.py"
        builder.emit_python_code(str(target))
        generated = target.read_text(encoding="utf-8")
    return ("# Generated by amdxdna_direct.abi.write_decl_module() from headers/*.h (cffi out-of-line ABI mode):\n"
            "# do not edit; regenerate after changing a header (tests/test_abi.py checks it is current).\n"
            "# ruff: noqa\n"
            f"{generated}\nCDEF_SHA256 = {cdef_digest(source)!r}\n")


def _blank_comments(source: str) -> str:
    """``source`` with every C comment turned into spaces (newlines kept), so offsets still match the original."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", lambda found: re.sub(r"[^\n]", " ", found.group()), source, flags=re.S)


def constants_in_header_order(source: str, constants: dict[str, int]) -> list[tuple[str, str, int]]:
    """``(header file, name, value)`` of every constant, in the order the cdef ``source`` defines them.

    A constant is defined by its ``#define`` line or by its enumerator in an ``enum {...}`` body; the
    header is the ``/* ==== name ==== */`` chunk of ``read_cdef`` it falls in (``""`` before the first).

    Raises:
        ValueError: the definitions found in ``source`` are not exactly the names of ``constants``.
    """
    code = _blank_comments(source)
    found: dict[str, int] = {}
    for define in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", code, flags=re.M):
        found.setdefault(define.group(1), define.start(1))
    for body in re.finditer(r"\benum\b[^{};]*\{([^}]*)\}", code):
        for enumerator in re.finditer(r"(?:^|,)\s*(\w+)", body.group(1)):
            found.setdefault(enumerator.group(1), body.start(1) + enumerator.start(1))
    if set(found) != set(constants):
        raise ValueError(f"constants_in_header_order: definitions {sorted(set(found) - set(constants))} are not "
                         f"cdef constants, cdef constants {sorted(set(constants) - set(found))} have no definition")
    labels = [(0, "")] + [(label.start(), label.group(1))
                          for label in re.finditer(r"^/\* ==== (\S+) ==== \*/$", source, flags=re.M)]
    starts = [start for start, _ in labels]
    ordered = sorted(found, key=found.__getitem__)
    return [(labels[bisect.bisect_right(starts, found[name]) - 1][1], name, constants[name]) for name in ordered]


def constants_module_source(directory: Path | None = None) -> str:
    """The text of ``amdxdna_direct/_abi_constants.py`` for the headers in ``directory`` (default ``header_dir()``):
    one ``NAME: Final = value`` line per ``#define`` and enum value, in header order, plus the cdef's digest.

    Raises:
        FileNotFoundError: a header file is missing.
        cffi.CDefError: a header is not valid cffi C.
        ValueError: a constant's definition cannot be located in the headers.
    """
    directory = header_dir() if directory is None else directory
    source = read_cdef(directory)
    constants = integer_constants(build_ffi(directory).dlopen(None))
    lines = ["# Generated by amdxdna_direct.abi.write_decl_module() from headers/*.h: do not edit; regenerate after",
             "# changing a header (tests/test_abi.py checks it is current).",
             '"""Every ``#define`` and enum value of headers/*.h as a typed declaration, in header order.',
             "",
             "amdxdna_direct.abi imports this module for static checkers only; at run time it exports the same",
             "names from its cdef.",
             '"""',
             "",
             "from typing import Final",
             "",
             f"_CDEF_SHA256: Final = {cdef_digest(source)!r}"]
    current = None
    for header, name, value in constants_in_header_order(source, constants):
        if header != current:
            lines += ["", f"# ---- {header} ----"]
            current = header
        lines.append(f"{name}: Final = {value}")
    return "\n".join(lines) + "\n"


def write_decl_module(target: Path | None = None, directory: Path | None = None) -> Path:
    """Write ``decl_module_source(directory)`` to ``target`` (default: this package's ``_abi_decl.py``), and
    ``constants_module_source(directory)`` beside it as ``_abi_constants.py``; returns ``target``.

    Run after changing a header: ``python -c "from amdxdna_direct import abi; abi.write_decl_module()"``.

    Raises:
        FileNotFoundError: a header file is missing.
        cffi.CDefError: a header is not valid cffi C.
        ValueError: a constant's definition cannot be located in the headers.
        OSError: a file cannot be written.
    """
    target = _DECL_PATH if target is None else Path(target)
    decl, constants = decl_module_source(directory), constants_module_source(directory)
    target.write_text(decl, encoding="utf-8")
    target.with_name(_CONSTANTS_FILE).write_text(constants, encoding="utf-8")
    return target


def _load_ffi() -> tuple[Any, tuple[type[BaseException], ...]]:
    """The generated declarations when they match the headers beside them, else the headers parsed now;
    with what ``ffi.new`` raises for an unknown type (``ffi.error``; also ``cffi.CDefError`` in line)."""
    # Loaded from the file beside this one, not through the import system: an editable install's finder would
    # otherwise answer for the package name with another tree's module.
    if not _DECL_PATH.is_file():
        _log.debug("%s is missing: parsing the headers in %s at import (in-line ABI mode, pycparser)",
                   _DECL_PATH, header_dir())
        return _in_line(header_dir())
    spec = importlib.util.spec_from_file_location(DECL_MODULE, _DECL_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {_DECL_PATH}")
    _abi_decl = importlib.util.module_from_spec(spec)
    sys.modules[DECL_MODULE] = _abi_decl
    spec.loader.exec_module(_abi_decl)
    try:
        directory = header_dir()
    except FileNotFoundError:
        # the declarations alone are enough; there is nothing to compare them with
        return _abi_decl.ffi, (TypeError, _abi_decl.ffi.error)
    if cdef_digest(read_cdef(directory)) != getattr(_abi_decl, "CDEF_SHA256", None):
        _log.warning("%s was generated from other headers than %s: parsing the headers at import instead "
                     "(run amdxdna_direct.abi.write_decl_module())", _DECL_PATH, directory)
        return _in_line(directory)
    return _abi_decl.ffi, (TypeError, _abi_decl.ffi.error)


def _in_line(directory: Path) -> tuple[Any, tuple[type[BaseException], ...]]:
    import cffi

    parsed = build_ffi(directory)
    return parsed, (TypeError, cffi.CDefError, cffi.FFIError)


#: A cffi cdata (struct pointer, array, ...) of this FFI. Its fields and items are the cdef's, which no static type
#: describes (cffi's own ``FFI.CData`` declares none), so to a type checker it is ``Any``.
CData: TypeAlias = Any

#: The FFI: cffi's out-of-line ABI object from ``_abi_decl.py`` (or an in-line ``cffi.FFI``, see above).
ffi: Any
ffi, _TYPE_ERRORS = _load_ffi()
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
        ffi.error: ``ctype`` names no type at all.
    """
    return _IOC(_IOC_WRITE, type_, nr, ffi.sizeof(ctype))


def _IOR(type_: int, nr: int, ctype: str) -> int:  # noqa: N802 - kernel spelling
    """``_IOR(type, nr, ctype)``: the kernel writes ``sizeof(ctype)`` bytes back.

    Raises:
        ValueError: a field does not fit its bit width, or ``ctype`` is an undeclared struct (unknown size).
        ffi.error: ``ctype`` names no type at all.
    """
    return _IOC(_IOC_READ, type_, nr, ffi.sizeof(ctype))


def _IOWR(type_: int, nr: int, ctype: str) -> int:  # noqa: N802 - kernel spelling
    """``_IOWR(type, nr, ctype)``: copied in and back out.

    Raises:
        ValueError: a field does not fit its bit width, or ``ctype`` is an undeclared struct (unknown size).
        ffi.error: ``ctype`` names no type at all.
    """
    return _IOC(_IOC_READ | _IOC_WRITE, type_, nr, ffi.sizeof(ctype))


def _amdxdna_nr(index: int) -> int:
    """Request nr of an amdxdna ioctl: driver-private ioctls start at DRM_COMMAND_BASE (docs/uapi.md 1a)."""
    return int(libc.DRM_COMMAND_BASE) + index


def _amdxdna_iowr(index: int, ctype: str) -> int:
    """``DRM_IOWR(DRM_COMMAND_BASE + index, ctype)``, the encoding of every amdxdna ioctl but upstream WAIT_CMD."""
    return _IOWR(libc.DRM_IOCTL_BASE, _amdxdna_nr(index), ctype)


_D = libc.DRM_IOCTL_BASE

# ---- amdxdna (docs/uapi.md 1a; all IOWR except the upstream WAIT_CMD) ----
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
#: The out-of-tree driver's IOWR encoding of WAIT_CMD; DRM dispatches by nr, so both reach the handler (docs/uapi.md
#: 4.0).
DRM_IOCTL_AMDXDNA_WAIT_CMD_OOT = _amdxdna_iowr(libc.DRM_AMDXDNA_WAIT_CMD, "struct amdxdna_drm_wait_cmd")
DRM_IOCTL_AMDXDNA_GET_ARRAY = _amdxdna_iowr(libc.DRM_AMDXDNA_GET_ARRAY, "struct amdxdna_drm_get_array")

# ---- DRM core (docs/uapi.md section 5) ----
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
    except _TYPE_ERRORS as err:
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
