"""Buffer-object backing store and device-address resolution of one emulated fd.

Every BO is backed by real shared pages (a ``memfd``): the kernel side holds a writable ``mmap`` view
(``Bo.mem``), and the user maps the same file through the seam's ``mmap`` path, so host and "device"
see the same bytes. DEV BOs are sub-ranges of the fd's DEV_HEAP and share its pages (docs/uapi.md 7).

With the 2026 expandable heap (docs/uapi.md 4.4) an fd has several heap chunks laid end to end in device space.
They are windows of one sparse per-fd file (``HeapWindow``), so a DEV BO that spans chunks is still one
contiguous range of pages for the device side, as it is for the user through contiguous chunk mappings.

Device addresses resolve as the NPU sees them (docs/uapi.md 7): the heap window ``[0x4000000, 0x4000000 +
heap size)`` (all chunks) for DEV BOs, and for SHMEM BOs the process virtual address of a live user mapping (IOMMU
SVA, <= 7.0). Anything else is a ``DeviceFault``, which fails the command like a bad DMA would.
"""

from __future__ import annotations

import bisect
import mmap as _mmap
import os
import threading
from dataclasses import dataclass, field

from .coherence import DeviceView

AMDXDNA_BO_SHMEM, AMDXDNA_BO_DEV_HEAP, AMDXDNA_BO_DEV, AMDXDNA_BO_CMD = 1, 2, 3, 4
BO_KIND_NAMES = {AMDXDNA_BO_SHMEM: "SHMEM", AMDXDNA_BO_DEV_HEAP: "DEV_HEAP", AMDXDNA_BO_DEV: "DEV",
                 AMDXDNA_BO_CMD: "CMD"}
AMDXDNA_INVALID_ADDR = (1 << 64) - 1
AIE2_DEVM_BASE = 0x4000000          # device address of the heap (docs/uapi.md 4.4 DEV_HEAP)
PAGE_SIZE = 4096
DEV_BO_ALIGN = 32 << 10             # DEV BOs start 32 KiB aligned (docs/uapi.md 4.4 DEV, 7)
DEV_HEAP_CHUNK = 64 << 20           # expandable heap: sizes are multiples of AIE2_DEVM_SIZE (docs/uapi.md 4.4 staging)
BACKING_NAME = "amdxdna-"           # memfd name prefix of every emulated BO's pages (a dma-buf's fd link shows it)


def page_align(size: int) -> int:
    """Round up to a whole page, as shmem GEM objects are."""
    return (size + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)


class DeviceFault(Exception):
    """A device access outside every BO (the command fails with ERROR, as a bad DMA would)."""


@dataclass(eq=False)
class Bo:
    """The driver-side buffer object.

    ``refs`` counts the GEM handle, every job that references the BO, and (for the heap) every DEV BO
    and hardware context carved out of it: the backing is released when it drops to zero (docs/uapi.md 7,
    "Lifetime").
    """

    handle: int
    kind: int
    size: int
    mem: memoryview
    xdna_addr: int = AMDXDNA_INVALID_ADDR
    vaddr: int = AMDXDNA_INVALID_ADDR
    map_offset: int = AMDXDNA_INVALID_ADDR
    memfd: int = -1
    heap: Bo | None = None           # DEV BOs: the heap (chunk) they start in
    heap_offset: int = 0             # DEV BOs: offset in the heap window (device address - 0x4000000)
    more_heaps: tuple[Bo, ...] = ()  # DEV BOs across expandable-heap chunks: the chunks after `heap`
    file_offset: int = 0             # where the BO's pages start in its memfd (expandable-heap chunks)
    internal: bool = False           # driver-owned (context command-list buffers)
    refs: int = 1
    released: bool = False
    dbg_ctx: object = None           # the context this BO is the debug buffer of (ASSIGN_DBG_BUF)
    fd_memory: Memory | None = None  # DEV BOs: the Memory whose heap they live in
    file_key: tuple[int, int] = (-1, -1)  # (st_dev, st_ino) of a standalone BO's memfd: its dma-buf identity
    view: DeviceView | None = None  # what the device sees of the pages (None: coherent, docs/emulator.md)
    view_offset: int = 0            # where the BO's bytes start in `view`
    _backing: object = field(default=None, repr=False)

    @property
    def kind_name(self) -> str:
        """The uAPI name of the BO type."""
        return BO_KIND_NAMES[self.kind]


def new_backing(size: int, name: str) -> tuple[int, object, memoryview]:
    """A memfd of `size` bytes and the kernel's writable view of it: (memfd, mmap object, memoryview).

    Raises:
        OSError: memfd_create, ftruncate or mmap failed (the memfd is closed again).
    """
    memfd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(memfd, size)
        mapping = _mmap.mmap(memfd, size, _mmap.MAP_SHARED, _mmap.PROT_READ | _mmap.PROT_WRITE)
    except OSError:
        os.close(memfd)
        raise
    return memfd, mapping, memoryview(mapping)


def file_key(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of an open file: the same for every dup of a BO's memfd (its exported dma-buf).

    Raises:
        OSError: `fd` is not an open descriptor.
    """
    stat = os.fstat(fd)
    return stat.st_dev, stat.st_ino



def is_bo_backing(fd: int) -> bool:
    """Whether `fd` is the memfd of an emulated BO, of any EmuDevice (an exported dma-buf)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{BACKING_NAME}")
    except OSError:
        return False


def import_backing(fd: int) -> tuple[int, object, memoryview, int]:
    """The importer's own descriptor, kernel view and size of a dma-buf's pages: (memfd, mmap object, view, size).

    Raises:
        OSError: dup, fstat or mmap failed (the dup is closed again).
    """
    memfd = os.dup(fd)
    try:
        os.set_inheritable(memfd, False)
        size = os.fstat(memfd).st_size
        mapping = _mmap.mmap(memfd, size, _mmap.MAP_SHARED, _mmap.PROT_READ | _mmap.PROT_WRITE)
    except OSError:
        os.close(memfd)
        raise
    return memfd, mapping, memoryview(mapping), size


def release_backing(bo: Bo) -> None:
    """Drop the kernel's view and memfd of a standalone BO.

    The mmap object itself is left to the garbage collector: a model may still hold a numpy view of
    the pages (the pages live as long as any mapping does, as in the kernel).
    """
    bo.released = True
    bo.view = None          # the device copy goes with the last BO over the file (an import may keep it)
    if bo.memfd >= 0:
        os.close(bo.memfd)
        bo.memfd = -1
    bo._backing = None


class HeapAllocator:
    """First-fit placement in the DEV_HEAP (drm_mm in the driver), 32 KiB-aligned starts (docs/uapi.md 4.4)."""

    def __init__(self, size: int):
        self.size = size
        self.ranges: dict[int, int] = {}     # offset -> size

    def alloc(self, size: int, align: int = DEV_BO_ALIGN) -> int | None:
        """Offset of a free, aligned range of `size` bytes, or None when the heap has no room."""
        cursor = 0
        for start in sorted(self.ranges):
            if start - cursor >= size:
                break
            cursor = (start + self.ranges[start] + align - 1) // align * align
        if cursor + size > self.size:
            return None
        self.ranges[cursor] = size
        return cursor

    def free(self, offset: int) -> None:
        """Return a range to the heap."""
        del self.ranges[offset]

    @property
    def used(self) -> int:
        """Bytes of the heap in use."""
        return sum(self.ranges.values())


class HeapWindow:
    """The pages behind an fd's expandable heap: one sparse memfd of the whole device window.

    A chunk's pages start at file offset (its device address - 0x4000000), the sum of the chunks before
    it; each chunk BO owns a dup of the memfd (user mmap at that offset) and the kernel keeps one view.
    """

    def __init__(self, size: int, coherent: bool = True):
        self.memfd, self._mapping, self.view = new_backing(size, BACKING_NAME + "heap-window")
        self.device = None if coherent else DeviceView(self.view)

    def chunk_fd(self) -> int:
        """A descriptor of the window file for one chunk BO (closed when the chunk is released)."""
        return os.dup(self.memfd)

    @property
    def backing(self) -> object:
        """The kernel's mmap object (chunk BOs keep it alive like their own backing)."""
        return self._mapping

    def close(self) -> None:
        """Drop the window's descriptor and view; the pages live on while any chunk or view holds them."""
        if self.memfd >= 0:
            os.close(self.memfd)
            self.memfd = -1
            del self.view               # a closed window has no view (nothing reads it after the fd's release)
        self._mapping = self.device = None


class Memory:
    """The BO address spaces of one fd: its heap chunks, DEV placements and live user mappings.

    Lookups are O(log n) in the number of mappings and DEV BOs: beside each table a sorted list of its start
    addresses is kept in step with it (``bisect``), as neither kind of range overlaps another of its kind
    (a new mapping replaces what it covers; DEV BOs are disjoint heap placements).
    """

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self.heaps: list[Bo] = []                         # DEV_HEAP chunks in device-address order
        self.window: HeapWindow | None = None             # expandable heap only
        self.allocator: HeapAllocator | None = None
        self.dev_bos: dict[int, Bo] = {}                  # heap offset -> DEV BO (add_dev_bo / remove_dev_bo)
        self._dev_starts: list[int] = []                  # sorted keys of dev_bos
        self.mappings: dict[int, tuple[int, Bo, int]] = {}    # user VA -> (length, BO, offset in BO)
        self._map_starts: list[int] = []                  # sorted keys of mappings
        self.lookups = 0                                  # resolve calls (bench/bench_emulator.py counts them)

    @property
    def heap(self) -> Bo | None:
        """The first DEV_HEAP (the only one on <= 7.0 drivers), or None."""
        return self.heaps[0] if self.heaps else None

    @property
    def heap_size(self) -> int:
        """Bytes of device window covered by heap chunks (laid end to end from 0x4000000: the last one's end)."""
        if not self.heaps:
            return 0
        last = self.heaps[-1]
        return last.xdna_addr - AIE2_DEVM_BASE + last.size

    # -- tables --

    def add_dev_bo(self, bo: Bo) -> None:
        """Record a DEV BO placed at `bo.heap_offset` of the heap window."""
        with self._lock:
            if bo.heap_offset not in self.dev_bos:
                bisect.insort(self._dev_starts, bo.heap_offset)
            self.dev_bos[bo.heap_offset] = bo

    def remove_dev_bo(self, offset: int) -> None:
        """Forget the DEV BO at heap offset `offset` (no-op when none is there)."""
        with self._lock:
            if self.dev_bos.pop(offset, None) is not None:
                del self._dev_starts[bisect.bisect_left(self._dev_starts, offset)]

    def add_mapping(self, addr: int, length: int, bo: Bo) -> None:
        """Record a live user mapping of `bo` (the VA the device uses for SHMEM BOs under SVA).

        The caller has removed whatever mapping overlapped [addr, addr+length) first (remove_range).
        """
        self._put(addr, length, bo, 0)

    def _put(self, addr: int, length: int, bo: Bo, bo_offset: int) -> None:
        if addr not in self.mappings:
            bisect.insort(self._map_starts, addr)
        self.mappings[addr] = (length, bo, bo_offset)

    def _drop(self, addr: int) -> None:
        del self.mappings[addr]
        del self._map_starts[bisect.bisect_left(self._map_starts, addr)]

    def overlapping(self, addr: int, length: int) -> list[tuple[int, int, Bo, int]]:
        """(start, length, bo, offset in bo) of every mapping overlapping [addr, addr+length), in address order."""
        with self._lock:
            starts = self._map_starts
            index = max(bisect.bisect_right(starts, addr) - 1, 0)
            found = []
            while index < len(starts) and starts[index] < addr + length:
                start = starts[index]
                size, bo, bo_offset = self.mappings[start]
                if start + size > addr:
                    found.append((start, size, bo, bo_offset))
                index += 1
            return found

    def remove_range(self, addr: int, length: int) -> list[tuple[int, int, Bo]]:
        """Forget mappings overlapping [addr, addr+length).

        Returns one (addr, length, bo) per mapping entry dropped; each held one BO reference, which the
        caller drops. Pieces left on either side become new entries and take a reference each.
        """
        removed = []
        with self._lock:
            for start, size, bo, bo_offset in self.overlapping(addr, length):
                lo, hi = max(start, addr), min(start + size, addr + length)
                self._drop(start)
                removed.append((lo, hi - lo, bo))
                if start < lo:
                    self._put(start, lo - start, bo, bo_offset)
                    bo.refs += 1
                if hi < start + size:
                    self._put(hi, start + size - hi, bo, bo_offset + hi - start)
                    bo.refs += 1
        return removed

    # -- device-address resolution --

    def resolve(self, addr: int, length: int) -> tuple[Bo, int]:
        """Find the BO a device access [addr, addr+length) lands in: (bo, offset in bo).

        The BO is the one holding the first byte; the access must end inside it (a DMA running past a BO's
        edge faults, as the IOMMU does there, rather than reaching the neighbour: docs/emulator.md, "DMA
        extents").

        Raises:
            DeviceFault: no BO holds `addr` (heap window or a live SHMEM mapping), or the access runs past the
                end of the BO (or of the mapping) that holds it.
        """
        with self._lock:
            self.lookups += 1
            if self.heaps and AIE2_DEVM_BASE <= addr < AIE2_DEVM_BASE + self.heap_size:
                return self._resolve_heap(addr, length)
            index = bisect.bisect_right(self._map_starts, addr) - 1
            if index >= 0:
                start = self._map_starts[index]
                size, bo, bo_offset = self.mappings[start]
                if addr < start + size:
                    offset = bo_offset + addr - start
                    _check_edge(addr, length, bo, offset, start + size - addr, "its user mapping")
                    return bo, offset
        raise DeviceFault(f"device access [{addr:#x}, {addr + length:#x}) is outside every BO")

    def _resolve_heap(self, addr: int, length: int) -> tuple[Bo, int]:
        offset = addr - AIE2_DEVM_BASE
        index = bisect.bisect_right(self._dev_starts, offset) - 1
        if index >= 0:
            start = self._dev_starts[index]
            bo = self.dev_bos[start]
            if offset < start + bo.size:
                _check_edge(addr, length, bo, offset - start, None, None)
                return bo, offset - start
        for chunk in self.heaps:
            start = chunk.xdna_addr - AIE2_DEVM_BASE
            if start <= offset < start + chunk.size:
                if offset + length <= start + chunk.size:
                    return chunk, offset - start
                break
        # Only a DEV BO gives a view across chunks; a raw access past its chunk is a fault.
        raise DeviceFault(f"heap access [{addr:#x}, {addr + length:#x}) runs past its heap chunk outside a DEV BO")


def _check_edge(addr: int, length: int, bo: Bo, offset: int, mapped: int | None, what: str | None) -> None:
    """Fault an access of `length` bytes at `offset` of `bo` that ends past the BO (or past `mapped` bytes).

    Raises:
        DeviceFault: naming the access, the BO's type, handle and size, and by how many bytes it overruns.
    """
    if offset + length > bo.size:
        raise DeviceFault(f"device access [{addr:#x}, {addr + length:#x}) runs {offset + length - bo.size} bytes "
                          f"past the end of {bo.kind_name} BO handle {bo.handle} ({bo.size:#x} bytes, the access "
                          f"starts at offset {offset:#x})")
    if mapped is not None and length > mapped:
        raise DeviceFault(f"device access [{addr:#x}, {addr + length:#x}) runs {length - mapped} bytes past the end "
                          f"of {what} of {bo.kind_name} BO handle {bo.handle} (the rest of the BO is not mapped "
                          f"there)")


def heap_allocator(memory: Memory) -> HeapAllocator:
    """The allocator of an fd's heap window: made with its DEV_HEAP, or at open for an expandable heap.

    Raises:
        RuntimeError: the fd has none, yet a DEV BO is being placed or freed in its heap (an emulator bug).
    """
    if memory.allocator is None:
        raise RuntimeError("a DEV BO placed or freed in the heap of an fd that has no heap allocator")
    return memory.allocator
