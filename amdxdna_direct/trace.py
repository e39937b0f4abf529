"""The ioctl trace: ``AMDXDNA_TRACE=1`` logs every ioctl decoded, plus a per-process summary.

Each record (logger ``amdxdna_direct.trace``, level INFO) reads
``CREATE_HWCTX(qos_p=0x7f.., max_opc=2048, num_tiles=4) -> 0 {handle=1, syncobj_handle=1} 41.2us``
or ``... -> ENODEV (No such device) 12.0us``: the name, the decoded input fields, the result (and
the output fields the driver changed) or the errno, and the duration. The summary (count and total
time per ioctl) is logged at interpreter exit; ``amdxdna trace`` (the CLI) reuses ``Tracer``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO, TypedDict

from . import abi
from .errors import errno_text, format_call, format_fields

if TYPE_CHECKING:
    import cffi
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["Tracer", "TRACER", "enabled", "enable", "disable", "decode", "describe_request", "note"]

log = logging.getLogger(__name__)
# The line format; `amdxdna trace` finds these lines in a program's stderr by the prefix (docs/cli.md).
TRACE_FORMAT = "amdxdna-trace: %(message)s"


def describe_request(request: int) -> tuple[str, str | None]:
    """``(short name, C struct type)`` of a request number; unknown requests get a hex name."""
    entry = abi.IOCTLS.get(request)
    if entry is None:
        return f"IOCTL_{request:#010x}", None
    return entry[0], entry[1]


def decode(ctype: str | None, buf: ReadableBuffer) -> dict[str, object]:
    """The top-level fields of ``buf`` read as C struct ``ctype`` (integers and pointers as ints).

    Nested structs and arrays are shown by their cffi repr; an unknown type yields ``{}``, a buffer
    shorter than the struct ``{"short_buffer": its length}``.
    """
    if ctype is None:
        return {}
    ffi = abi.ffi
    nbytes = memoryview(buf).nbytes
    if nbytes < ffi.sizeof(ctype):      # never read past the caller's buffer (raw ioctls pass any)
        return {"short_buffer": nbytes}
    ptr = ffi.from_buffer(ctype + " *", buf)
    fields: dict[str, object] = {}
    for name, field in ffi.typeof(ctype).fields:
        value = getattr(ptr, name)
        kind = field.type.kind
        if kind == "pointer":
            value = int(ffi.cast("uintptr_t", value))
        elif kind not in ("primitive", "enum"):
            value = _compound(ffi, value, field.type)
        fields[name] = value
    return fields


def _compound(ffi: Any, value: abi.CData, ctype: cffi.FFI.CType) -> object:
    if ctype.kind == "array" and ctype.item.kind == "primitive":
        return list(value)
    return ffi.string(value) if ctype.kind == "array" and ctype.item.cname == "char" else repr(value)


def note(seam_name: str, text: str) -> None:
    """Log a line about what the runtime chose beside the ioctls it explains, when tracing is on:
    ``emu:npu1 note: ...`` (not an ioctl record: ``amdxdna trace`` passes it through, docs/cli.md)."""
    if _state["enabled"]:
        log.info("%s note: %s", seam_name, text)


class Tracer:
    """Per-process ioctl statistics and decoded log lines.

    ``call`` wraps one ioctl; ``summary()`` gives ``{name: (count, total_seconds)}``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}
        self.errors: Counter[str] = Counter()

    def call(self, seam_name: str, request: int, buf: WriteableBuffer,
             issue: Callable[[int, WriteableBuffer], int]) -> int:
        """Run ``issue(request, buf)``, timing it and logging it decoded.

        Raises:
            OSError: whatever ``issue`` raises, unchanged (after it is logged).
        """
        name, ctype = describe_request(request)
        before = decode(ctype, buf)
        start = time.perf_counter()
        try:
            result = issue(request, buf)
        except OSError as exc:
            elapsed = time.perf_counter() - start
            self._record(name, elapsed, failed=True)
            log.info("%s %s -> %s %s", seam_name, format_call(name, before),
                     errno_text(exc.errno) if exc.errno else exc, _duration(elapsed))
            raise
        elapsed = time.perf_counter() - start
        self._record(name, elapsed, failed=False)
        after = decode(ctype, buf)
        changed = {k: v for k, v in after.items() if before.get(k) != v}
        log.info("%s %s -> %s {%s} %s", seam_name, format_call(name, before), result,
                 format_fields(changed), _duration(elapsed))
        return result

    def _record(self, name: str, elapsed: float, failed: bool) -> None:
        with self._lock:
            self.counts[name] += 1
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            if failed:
                self.errors[name] += 1

    def summary(self) -> dict[str, tuple[int, float]]:
        """``{ioctl name: (count, total seconds)}`` for this process so far."""
        with self._lock:
            return {name: (self.counts[name], self.seconds[name]) for name in sorted(self.counts)}

    def format_summary(self) -> str:
        """A small table: name, count, errors, total and mean time."""
        lines = [f"{'ioctl':<24}{'count':>8}{'errors':>8}{'total ms':>12}{'mean us':>10}"]
        for name, (count, seconds) in self.summary().items():
            lines.append(f"{name:<24}{count:>8}{self.errors[name]:>8}{seconds * 1e3:>12.3f}"
                         f"{seconds / count * 1e6:>10.1f}")
        return "\n".join(lines)

    def reset(self) -> None:
        """Forget the counters."""
        with self._lock:
            self.counts.clear()
            self.seconds.clear()
            self.errors.clear()


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}us"


class _State(TypedDict):
    enabled: bool
    atexit: bool
    handlers: list[logging.Handler]     # the ones enable() attached
    propagate: bool | None              # the trace logger's propagate before enable() turned it off


TRACER = Tracer()
_state: _State = {"enabled": False, "atexit": False, "handlers": [], "propagate": None}
_OWN = "_amdxdna_trace_handler"  # marks the handlers enable() attached, so that none is attached twice


def _trace_handler(stream: TextIO) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(TRACE_FORMAT))
    setattr(handler, _OWN, True)
    return handler


def enabled() -> bool:
    """Whether ioctls are traced (``AMDXDNA_TRACE=1`` at import, or ``enable()``)."""
    return _state["enabled"]


def enable(stream: TextIO | None = None) -> logging.Handler | None:
    """Start tracing; with ``stream``, also attach a handler writing the log lines to it.

    Without ``stream``, a handler writing to stderr is attached when the trace logger has none yet (so
    ``AMDXDNA_TRACE=1`` shows output without any logging setup); calling ``enable()`` again, or
    reloading this module, attaches no second one. While a handler of ``enable`` is attached the
    records do not propagate to the application's handlers (a ``logging.basicConfig`` before or after
    import would print each line twice otherwise; docs/cli.md "Logging"). The summary is logged at
    exit. Returns the handler attached, if any (``disable`` removes it and restores propagation).
    """
    handler = None
    if stream is not None or not log.handlers:
        handler = _trace_handler(stream if stream is not None else sys.stderr)
        if not any(getattr(h, _OWN, False) for h in log.handlers):
            _state["propagate"] = log.propagate
        log.addHandler(handler)
        log.propagate = False
        _state["handlers"].append(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    _state["enabled"] = True
    if not _state["atexit"]:
        atexit.register(_log_summary)
        _state["atexit"] = True
    return handler


def disable() -> None:
    """Stop tracing and detach the handlers ``enable`` attached (counters are kept)."""
    _state["enabled"] = False
    while _state["handlers"]:
        log.removeHandler(_state["handlers"].pop())
    if _state["propagate"] is not None and not any(getattr(h, _OWN, False) for h in log.handlers):
        log.propagate = _state["propagate"]
        _state["propagate"] = None


def _log_summary() -> None:
    if TRACER.counts:
        log.info("ioctl summary for pid %d:\n%s", os.getpid(), TRACER.format_summary())


def _package_null_handler() -> None:
    """A NullHandler on the package logger (``amdxdna_direct``), once: a library's records go nowhere until
    the application configures logging (Python's logging HOWTO for libraries)."""
    package = logging.getLogger(__name__.rpartition(".")[0])
    if not any(isinstance(h, logging.NullHandler) for h in package.handlers):
        package.addHandler(logging.NullHandler())


_package_null_handler()
if os.environ.get("AMDXDNA_TRACE", "") not in ("", "0"):
    enable()
