"""The non-coherent memory of the emulated NPU: what the device sees of a buffer beside what the CPU sees.

The NPU's DMA does not snoop the CPU caches (docs/emulator.md, Memory coherence): a CPU write reaches the
device only when SYNC_BO flushes the cache lines it is in, and a device write is seen by the CPU only after
SYNC_BO of its lines (the flush invalidates the stale lines; the driver does the same clflush for either
direction). A ``DeviceView`` keeps, for one backing file (a BO's memfd, a heap window), a second copy of its
bytes, the device's, next to the CPU pages every mapping shows, and a per-line flag of the lines the device
wrote since their last sync:

* ``sync(lo, hi)``: over the 64-byte lines covering the range, device-written lines reach the CPU pages (unless
  the CPU wrote the line meanwhile: its write-back wins, as clflush of a dirty line does), then the CPU pages
  become the device's copy;
* ``stale(lo, hi)``: the first and last byte of the range the CPU wrote since its last sync (its pages differ
  from the device's copy, or for a device-written line from what the CPU held when the device wrote it): a
  write the device would not see;
* ``written(lo, hi, whole)``: after a job, the lines the device wrote: all of the range (a DMA that only
  writes, S2MM, covers its whole buffer descriptor), or the lines whose device copy now differs from the CPU
  pages (the range was checked equal before the job).

Views are shared by every BO over the same file (DEV BOs over their heap, an imported dma-buf over its
exporter's pages, found by ``file_key`` in ``_VIEWS``).
"""

from __future__ import annotations

import threading
import weakref
from typing import cast

import numpy as np

LINE = 64                   # x86 cache line: the unit clflush works on
# Ranges up to this size are first compared as bytes (a memcmp): several times cheaper than numpy's elementwise
# compare on the small buffers of a small dispatch, which are nearly always equal (bench/bench_emulator.py).
_BYTES_COMPARE = 64 << 10
_VIEWS: weakref.WeakValueDictionary[tuple[int, int], DeviceView] = weakref.WeakValueDictionary()  # file_key -> view
_VIEWS_LOCK = threading.Lock()


class DeviceView:
    """The device's copy of one backing's bytes and its device-written lines (see module docstring)."""

    def __init__(self, cpu: memoryview, initial: np.ndarray | None = None):
        """A view over the CPU pages `cpu`; the device's copy starts as `initial` (default zeros, as fresh pages)."""
        self.cpu = np.frombuffer(cpu, dtype=np.uint8)
        self.dev = np.zeros(len(self.cpu), dtype=np.uint8) if initial is None else initial
        self.dirty = np.zeros(-(-len(self.cpu) // LINE), dtype=bool)
        # What the CPU held of each device-written line when the device wrote it (its cache's copy): a CPU write
        # since shows as a difference from it (allocated on the first device write; zero pages until touched).
        self.base: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Bytes of the backing."""
        return len(self.cpu)

    def _lines(self, lo: int, hi: int) -> tuple[int, int, int, int]:
        first, last = lo // LINE, -(-hi // LINE)
        return first, last, first * LINE, min(last * LINE, self.size)

    def _per_line(self, mask: np.ndarray) -> np.ndarray:
        """Byte mask of whole lines (the last one maybe short) -> one bool per line: any byte set."""
        pad = (-len(mask)) % LINE
        # numpy's stubs type any(axis=...) as scalar-or-array: over axis 1 of a 2-D array it is a 1-D array
        return cast("np.ndarray", np.concatenate([mask, np.zeros(pad, dtype=bool)]).reshape(-1, LINE).any(axis=1))

    def _same(self, lo: int, hi: int) -> bool:
        """Whether the CPU pages and the device copy hold the same bytes in [lo, hi) (small ranges only: False
        for a large one, which the caller compares element by element)."""
        return hi - lo <= _BYTES_COMPARE and self.cpu[lo:hi].tobytes() == self.dev[lo:hi].tobytes()

    def _dirty_bytes(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A byte mask of [lo, hi) covering device-written lines and ``base`` (the CPU's bytes when the device wrote
        them), or None when there are none."""
        first, last, start, _ = self._lines(lo, hi)
        lines = self.dirty[first:last]
        if self.base is None or not _any(lines):        # base is allocated with the first device-written line
            return None
        return np.repeat(lines, LINE)[lo - start:hi - start], self.base

    def sync(self, lo: int, hi: int) -> None:
        """SYNC_BO over [lo, hi): per covering line, clflush writes back a line the CPU wrote since its last sync
        and otherwise drops the CPU's copy, so a device-written line reaches the CPU unless the CPU wrote it."""
        if hi <= lo:
            return
        first, last, start, end = self._lines(lo, hi)
        dirty = self._dirty_bytes(start, end)
        if dirty is not None:
            mask, base = dirty
            cpu_wrote = self._per_line(self.cpu[start:end] != base[start:end])
            take = mask & ~np.repeat(cpu_wrote, LINE)[:end - start]
            self.cpu[start:end][take] = self.dev[start:end][take]
            self.dirty[first:last] = False
        self.dev[start:end] = self.cpu[start:end]

    def stale(self, lo: int, hi: int) -> tuple[int, int] | None:
        """(first, end) of the bytes of [lo, hi) the CPU changed since their last sync, or None."""
        dirty = self._dirty_bytes(lo, hi)
        if dirty is None and self._same(lo, hi):
            return None
        reference = self.dev[lo:hi] if dirty is None else np.where(dirty[0], dirty[1][lo:hi], self.dev[lo:hi])
        where = np.flatnonzero(self.cpu[lo:hi] != reference)
        if not where.size:
            return None
        return lo + int(where[0]), lo + int(where[-1]) + 1

    def written(self, lo: int, hi: int, whole: bool) -> None:
        """Record a job's writes to [lo, hi): the whole range, or the lines whose device copy changed."""
        if hi <= lo:
            return
        first, last, start, end = self._lines(lo, hi)
        if whole:
            lines = np.ones(last - first, dtype=bool)
        elif self._same(lo, hi):
            return                      # the device changed nothing there
        else:
            differ = np.zeros(end - start, dtype=bool)
            differ[lo - start:hi - start] = self.cpu[lo:hi] != self.dev[lo:hi]
            lines = self._per_line(differ)
        new = lines & ~self.dirty[first:last]
        if new.any():
            if self.base is None:
                self.base = np.zeros(self.size, dtype=np.uint8)
            take = np.repeat(new, LINE)[:end - start]
            self.base[start:end][take] = self.cpu[start:end][take]
        self.dirty[first:last] |= lines


def _any(flags: np.ndarray) -> bool:
    """Whether any of the bools is set (a byte search for the short arrays of small ranges: cheaper than .any())."""
    return b"\x01" in flags.tobytes() if len(flags) <= _BYTES_COMPARE else bool(flags.any())


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
