"""The non-coherent memory of the emulated NPU: what the device sees of a buffer beside what the CPU sees.

The NPU's DMA does not snoop the CPU caches (docs/emulator.md, Memory coherence): a CPU write reaches the
device only when SYNC_BO flushes the cache lines it is in, and a device write is seen by the CPU only after
SYNC_BO of its lines (the flush invalidates the stale lines; the driver does the same clflush for either
direction). A ``DeviceView`` keeps, for one backing file (a BO's memfd, a heap window), a second copy of its
bytes, the device's, next to the CPU pages every mapping shows, and a per-line flag of the lines the device
wrote since their last sync:

* ``sync(lo, hi)``: over the 64-byte lines covering the range, device-written lines reach the CPU pages, then
  the CPU pages become the device's copy;
* ``stale(lo, hi)``: the first and last byte of the range where the CPU pages differ from the device's copy,
  outside device-written lines: a CPU write since the last sync, which the device would not see;
* ``written(lo, hi, whole)``: after a job, the lines the device wrote: all of the range (a DMA that only
  writes, S2MM, covers its whole buffer descriptor), or the lines whose device copy now differs from the CPU
  pages (the range was checked equal before the job).

Views are shared by every BO over the same file (DEV BOs over their heap, an imported dma-buf over its
exporter's pages, found by ``file_key`` in ``_VIEWS``).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

LINE = 64                   # x86 cache line: the unit clflush works on
_VIEWS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()     # file_key -> DeviceView
_VIEWS_LOCK = threading.Lock()


class DeviceView:
    """The device's copy of one backing's bytes and its device-written lines (see module docstring)."""

    def __init__(self, cpu: memoryview, initial: np.ndarray | None = None):
        """A view over the CPU pages `cpu`; the device's copy starts as `initial` (default zeros, as fresh pages)."""
        self.cpu = np.frombuffer(cpu, dtype=np.uint8)
        self.dev = np.zeros(len(self.cpu), dtype=np.uint8) if initial is None else initial
        self.dirty = np.zeros(-(-len(self.cpu) // LINE), dtype=bool)

    @property
    def size(self) -> int:
        """Bytes of the backing."""
        return len(self.cpu)

    def _lines(self, lo: int, hi: int) -> tuple[int, int, int, int]:
        first, last = lo // LINE, -(-hi // LINE)
        return first, last, first * LINE, min(last * LINE, self.size)

    def _dirty_bytes(self, lo: int, hi: int) -> np.ndarray | None:
        """A byte mask of [lo, hi) covering device-written lines, or None when there are none."""
        first, last, start, _ = self._lines(lo, hi)
        lines = self.dirty[first:last]
        if not lines.any():
            return None
        return np.repeat(lines, LINE)[lo - start:hi - start]

    def sync(self, lo: int, hi: int) -> None:
        """SYNC_BO over [lo, hi): the covering lines are flushed both ways."""
        if hi <= lo:
            return
        first, last, start, end = self._lines(lo, hi)
        mask = self._dirty_bytes(start, end)
        if mask is not None:
            self.cpu[start:end][mask] = self.dev[start:end][mask]
            self.dirty[first:last] = False
        self.dev[start:end] = self.cpu[start:end]

    def stale(self, lo: int, hi: int) -> tuple[int, int] | None:
        """(first, end) of the bytes of [lo, hi) the CPU changed since their last sync, or None."""
        differ = self.cpu[lo:hi] != self.dev[lo:hi]
        mask = self._dirty_bytes(lo, hi)
        if mask is not None:
            differ &= ~mask
        where = np.flatnonzero(differ)
        if not where.size:
            return None
        return lo + int(where[0]), lo + int(where[-1]) + 1

    def written(self, lo: int, hi: int, whole: bool) -> None:
        """Record a job's writes to [lo, hi): the whole range, or the lines whose device copy changed."""
        if hi <= lo:
            return
        first, last, start, end = self._lines(lo, hi)
        if whole:
            self.dirty[first:last] = True
            return
        differ = np.zeros(end - start, dtype=bool)
        differ[lo - start:hi - start] = self.cpu[lo:hi] != self.dev[lo:hi]
        pad = (-len(differ)) % LINE
        self.dirty[first:last] |= np.concatenate([differ, np.zeros(pad, bool)]).reshape(-1, LINE).any(axis=1)


def view_for(key: tuple[int, int], cpu: memoryview) -> DeviceView:
    """The device view of the file `key` (a BO's memfd): the live one when another BO shares the file (an
    import of an export), else a new one whose device copy starts equal to the CPU pages."""
    with _VIEWS_LOCK:
        view = _VIEWS.get(key)
        if view is None or view.size != len(cpu):
            view = DeviceView(cpu, np.frombuffer(cpu, dtype=np.uint8).copy())
            _VIEWS[key] = view
        return view


def register(key: tuple[int, int], view: DeviceView) -> None:
    """Make `view` the device view of file `key` (a new BO's own backing)."""
    with _VIEWS_LOCK:
        _VIEWS[key] = view
