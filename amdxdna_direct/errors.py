"""The package's exception hierarchy and the one errno -> class table.

``Error`` is the base of every error the package raises (``amdxdna_direct.Error``; sam3's errors derive
from it too), with the builtin class callers already catch as a second base: device errors are
``XdnaError(Error, OSError)`` and keep ``errno``, format errors (``XclbinError``, ``InstsError``) are
``ValueError`` too (docs/runtime.md 4). A device error's message names the operation, the key fields
and the errno name, e.g. ``CREATE_HWCTX(num_tiles=16, max_opc=2048): ENODEV (No such device)``.
"""

from __future__ import annotations

import errno as errno_mod
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "Error",
    "XdnaError",
    "NoDeviceError",
    "PermissionDeniedError",
    "ContextUnavailableError",
    "ContextLostError",
    "CommandError",
    "CommandTimeout",
    "DeviceLostError",
    "errno_text",
    "error_class",
    "format_call",
    "format_fields",
    "ioctl_error",
]


class Error(Exception):
    """Base of every error of amdxdna-direct and sam3: ``except amdxdna_direct.Error`` catches them all.

    Each subclass also derives from the builtin class it stands for (``OSError`` for device errors,
    ``ValueError`` for malformed input), so code catching those keeps working.
    """


class XdnaError(Error, OSError):
    """Root of every device error; an ``OSError`` whose ``errno`` is the driver's answer.

    ``str()`` is the full message (operation, fields, errno name), not OSError's ``[Errno n]`` form.
    """

    errno: int      # always set: the constructor takes it

    def __init__(self, err: int, message: str) -> None:
        super().__init__(err, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Callable[..., XdnaError], tuple[object, ...]]:
        # keep pickling (multiprocessing, pytest-xdist) working with our __init__
        return (type(self), (self.errno, self.message))


class NoDeviceError(XdnaError):
    """No amdxdna device node was found or the named one does not exist."""


class PermissionDeniedError(XdnaError):
    """The device node exists but this process may not open or use it."""


class ContextUnavailableError(XdnaError):
    """CREATE_HWCTX refused: no free columns, firmware context limit or handle exhaustion."""


class ContextLostError(XdnaError):
    """The driver destroyed a hardware context this program still uses (docs/runtime.md 4.4).

    On Linux 6.14-6.19 every close() of a copy of the device file destroys all of that file's contexts: a child
    process closing its inherited copy (``subprocess``, ``multiprocessing`` with fork, ``os.fork``) or a closed
    ``dup``; Linux 7.0 keeps them. ``errno`` is EINVAL, what the driver answers for the old handle. Attributes:
    ``hwctx`` (the lost handle) and ``cause`` (what most likely destroyed it). ``HwContext.recreate`` makes the
    context again in place.
    """

    def __init__(self, err: int, message: str, *, hwctx: int | None = None, cause: str | None = None) -> None:
        super().__init__(err, message)
        self.hwctx = hwctx
        self.cause = cause

    def __reduce__(self) -> tuple[Callable[..., ContextLostError], tuple[object, ...]]:
        return (_rebuild_context_lost, (type(self), self.errno, self.message, self.hwctx, self.cause))


def _rebuild_context_lost(cls: type[ContextLostError], err: int, message: str, hwctx: int | None,
                          cause: str | None) -> ContextLostError:
    return cls(err, message, hwctx=hwctx, cause=cause)


class CommandError(XdnaError):
    """A submitted command ended in a state other than COMPLETED.

    Attributes: ``kernel`` (name), ``state`` (ERT state name), ``seq`` (submission number),
    ``index`` (position in a run list, or None), ``health`` (decoded context health record or None) and
    ``reason`` (why the firmware failed it, when known: on the emulator the emulated firmware's or the
    kernel model's message; None otherwise). The message carries the state, the health record and the
    reason too (docs/runtime.md 4).
    """

    def __init__(self, err: int, message: str, *, kernel: str | None = None, state: str | None = None,
                 seq: int | None = None, index: int | None = None, health: Any = None,
                 reason: str | None = None) -> None:
        super().__init__(err, message)
        self.kernel = kernel
        self.state = state
        self.seq = seq
        self.index = index
        self.health = health
        self.reason = reason

    def __reduce__(self) -> tuple[Callable[..., CommandError], tuple[object, ...]]:
        return (_rebuild_command_error, (type(self), self.errno, self.message,
                                         (self.kernel, self.state, self.seq, self.index, self.health, self.reason)))


_CommandFields = tuple[str | None, str | None, int | None, int | None, Any, str | None]


def _rebuild_command_error(cls: type[CommandError], err: int, message: str, fields: _CommandFields) -> CommandError:
    kernel, state, seq, index, health, reason = fields
    return cls(err, message, kernel=kernel, state=state, seq=seq, index=index, health=health, reason=reason)


class CommandTimeout(CommandError, TimeoutError):
    """The command did not finish: the driver's TDR marked it TIMEOUT, or the host wait expired (ETIME)."""


class DeviceLostError(XdnaError):
    """The device answered ENODEV (removed, reset or wedged). Latched: every later call raises it."""


# One table: (operation name or None for any, errno) -> class. docs/uapi.md 4.1 for
# CREATE_HWCTX: step 8 ENODEV (no free or shareable partition) and EINVAL (firmware refused: the
# context limit), step 9 EBUSY (<= 7.0) / ENOSPC (staging) when context handles run out, step 4
# ENOSPC when the fd's heap has no room for the context's command-list buffers. 4.0: ENODEV after
# unplug, EACCES for root-only requests. open(2) answers ENOENT/ENXIO/ENODEV for a missing or
# unbound node.
_ERRNO_CLASSES: dict[tuple[str | None, int], type[XdnaError]] = {
    ("CREATE_HWCTX", errno_mod.ENODEV): ContextUnavailableError,
    ("CREATE_HWCTX", errno_mod.EINVAL): ContextUnavailableError,
    ("CREATE_HWCTX", errno_mod.EBUSY): ContextUnavailableError,
    ("CREATE_HWCTX", errno_mod.ENOSPC): ContextUnavailableError,
    ("open", errno_mod.ENOENT): NoDeviceError,
    ("open", errno_mod.ENXIO): NoDeviceError,
    ("open", errno_mod.ENODEV): NoDeviceError,
    (None, errno_mod.ENODEV): DeviceLostError,
    (None, errno_mod.EACCES): PermissionDeniedError,
    (None, errno_mod.EPERM): PermissionDeniedError,
}


def errno_text(err: int) -> str:
    """``"ENODEV (No such device)"`` for an errno value."""
    return f"{errno_mod.errorcode.get(err, f'errno {err}')} ({os.strerror(err)})"


def _format_value(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0xFFFF:
        return hex(value)
    return str(value)


def format_fields(fields: Mapping[str, Any] | None) -> str:
    """``"a=1, b=0x4000000"``: key fields as messages and the trace show them (large ints in hex)."""
    return ", ".join(f"{k}={_format_value(v)}" for k, v in (fields or {}).items())


def format_call(name: str, fields: Mapping[str, Any] | None = None) -> str:
    """``"NAME(a=1, b=0x4000000)"``: an operation with its key fields, as used in every message."""
    return f"{name}({format_fields(fields)})"


def error_class(name: str | None, err: int) -> type[XdnaError]:
    """The exception class for ``err`` answered by operation ``name`` (the one table above);
    ``XdnaError`` for an errno the table does not single out."""
    return _ERRNO_CLASSES.get((name, err)) or _ERRNO_CLASSES.get((None, err)) or XdnaError


def ioctl_error(name: str, fields: Mapping[str, Any] | None, err: int, hint: str = "") -> XdnaError:
    """Build the typed error for operation ``name`` that failed with ``err``.

    The message is ``NAME(fields): ENAME (strerror)`` followed by ``hint`` (what to do) when given.
    """
    message = f"{format_call(name, fields)}: {errno_text(err)}"
    if hint:
        message = f"{message}; {hint}"
    return error_class(name, err)(err, message)
