"""A seam that answers EXEC_CMD and the waits inline: what is left of a dispatch is the runtime's own cost.

``NullSeam(inner)`` passes every call to ``inner`` (an emulator fd, so buffers, contexts and mappings are
real) except three ioctls it answers itself, without any device work:

- EXEC_CMD: the command packet's state becomes COMPLETED at once and the request gets the next
  submission number (per context, from 1), as the driver's answer would carry it;
- SYNCOBJ_TIMELINE_WAIT and WAIT_CMD: return at once (every submission has already completed).

It finds a command packet's CPU address by recording each GET_BO_INFO answer (handle -> map offset) and
each mmap of that offset. Nothing is executed, so the output buffers are untouched: a tool for measuring
host cost (``bench/bench_host_cost.py``), not a device. ``calls`` counts the ioctls it answered itself.

Its own cost is kept small, since every figure measured through it includes it: precompiled structs, the
packet's first word as a memoryview of the mapping (not a ctypes object), plain dict counters.
"""

from __future__ import annotations

import ctypes
import struct
from collections import Counter

from amdxdna_direct import abi

__all__ = ["NullSeam"]

_ERT_STATE_COMPLETED = 4        # ERT_CMD_STATE_COMPLETED (docs/design.md 4; amdxdna_direct.cmd)
_STATE_MASK = 0xF
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _offset(ctype: str, member: str) -> int:
    return abi.ffi.offsetof(ctype, member)


class NullSeam:
    """Wraps a seam; answers EXEC_CMD and the two waits inline (see the module docstring)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"null:{inner.name}"
        self.calls: Counter[str] = Counter({"EXEC_CMD": 0, "wait": 0})
        self._exec = abi.DRM_IOCTL_AMDXDNA_EXEC_CMD
        self._waits = {abi.DRM_IOCTL_SYNCOBJ_TIMELINE_WAIT, abi.DRM_IOCTL_AMDXDNA_WAIT_CMD}
        self._bo_info = abi.DRM_IOCTL_AMDXDNA_GET_BO_INFO
        exec_ctype = "struct amdxdna_drm_exec_cmd"
        self._exec_hwctx = _offset(exec_ctype, "hwctx")
        self._exec_cmd = _offset(exec_ctype, "cmd_handles")
        self._exec_seq = _offset(exec_ctype, "seq")
        info_ctype = "struct amdxdna_drm_get_bo_info"
        self._info_handle = _offset(info_ctype, "handle")
        self._info_map = _offset(info_ctype, "map_offset")
        self._map_offsets: dict[int, int] = {}          # map offset -> GEM handle
        self._headers: dict[int, tuple[int, memoryview]] = {}  # GEM handle -> (address, its first word, mapped)
        self._seqs: dict[int, int] = {}                        # hwctx -> last seq handed out

    def ioctl(self, request: int, buf) -> int:
        """EXEC_CMD and the waits answered here; anything else by the inner seam.

        Raises:
            OSError: from the inner seam; EINVAL for an EXEC_CMD whose packet was never mapped.
        """
        if request == self._exec:
            handle = _U64.unpack_from(buf, self._exec_cmd)[0]
            mapped = self._headers.get(handle)
            if mapped is None:
                raise OSError(22, f"null seam: command handle {handle} was never mapped")
            word = mapped[1]
            word[0] = (word[0] & ~_STATE_MASK) | _ERT_STATE_COMPLETED
            hwctx = _U32.unpack_from(buf, self._exec_hwctx)[0]
            seq = self._seqs[hwctx] = self._seqs.get(hwctx, 0) + 1
            _U64.pack_into(buf, self._exec_seq, seq)
            self.calls["EXEC_CMD"] += 1
            return 0
        if request in self._waits:
            self.calls["wait"] += 1
            return 0
        result = self.inner.ioctl(request, buf)
        if request == self._bo_info:
            handle = _U32.unpack_from(buf, self._info_handle)[0]
            self._map_offsets[_U64.unpack_from(buf, self._info_map)[0]] = handle
        return result

    def mmap(self, length: int, offset: int, addr: int = 0) -> int:
        """Map through the inner seam, remembering where a buffer's first word is.

        Raises:
            OSError: from the inner seam.
        """
        result = self.inner.mmap(length, offset, addr)
        handle = self._map_offsets.get(offset)
        if handle is not None:
            self._headers[handle] = (result, memoryview((ctypes.c_uint32 * 1).from_address(result)).cast("B").cast("I"))
        return result

    def reserve(self, length: int, alignment: int) -> int:
        """As the inner seam."""
        return self.inner.reserve(length, alignment)

    def munmap(self, addr: int, length: int) -> None:
        """As the inner seam; a packet unmapped is forgotten."""
        for handle, (address, word) in list(self._headers.items()):
            if address == addr:
                word.release()
                del self._headers[handle]
        self.inner.munmap(addr, length)

    def close(self) -> None:
        """As the inner seam."""
        self._headers.clear()
        self.inner.close()
