"""Buffer-object backing store and device-address resolution of one emulated fd.

Every BO is backed by real shared pages (a ``memfd``): the kernel side holds a writable ``mmap`` view
(``Bo.mem``), and the user maps the same file through the seam's ``mmap`` path, so host and "device"
see the same bytes. DEV BOs are sub-ranges of the fd's DEV_HEAP and share its pages (spec 7).

With the 2026 expandable heap (spec 4.4) an fd has several heap chunks laid end to end in device space.
They are windows of one sparse per-fd file (``HeapWindow``), so a DEV BO that spans chunks is still one
contiguous range of pages for the device side, as it is for the user through contiguous chunk mappings.

Device addresses resolve as the NPU sees them (spec 7): the heap window ``[0x4000000, 0x4000000 +
heap size)`` (all chunks) for DEV BOs, and for SHMEM BOs the process virtual address of a live user mapping (IOMMU
SVA, <= 7.0). Anything else is a ``DeviceFault``, which fails the command like a bad DMA would.
"""

from __future__ import annotations

import mmap as _mmap
import os
import threading
from dataclasses import dataclass, field

from .coherence import DeviceView

AMDXDNA_BO_SHMEM, AMDXDNA_BO_DEV_HEAP, AMDXDNA_BO_DEV, AMDXDNA_BO_CMD = 1, 2, 3, 4
BO_KIND_NAMES = {AMDXDNA_BO_SHMEM: "SHMEM", AMDXDNA_BO_DEV_HEAP: "DEV_HEAP", AMDXDNA_BO_DEV: "DEV",
                 AMDXDNA_BO_CMD: "CMD"}
AMDXDNA_INVALID_ADDR = (1 << 64) - 1
AIE2_DEVM_BASE = 0x4000000          # device address of the heap (spec 4.4 DEV_HEAP)
PAGE_SIZE = 4096
DEV_BO_ALIGN = 32 << 10             # DEV BOs start 32 KiB aligned (spec 4.4 DEV, 7)
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
    and hardware context carved out of it: the backing is released when it drops to zero (spec 7,
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
    """First-fit placement in the DEV_HEAP (drm_mm in the driver), 32 KiB-aligned starts (spec 4.4)."""

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
        self._mapping = self.view = self.device = None


class Memory:
    """The BO address spaces of one fd: its heap chunks, DEV placements and live user mappings."""

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self.heaps: list[Bo] = []                         # DEV_HEAP chunks in device-address order
        self.window: HeapWindow | None = None             # expandable heap only
        self.allocator: HeapAllocator | None = None
        self.dev_bos: dict[int, Bo] = {}                  # heap offset -> DEV BO
        self.mappings: dict[int, tuple[int, Bo, int]] = {}    # user VA -> (length, BO, offset in BO)

    @property
    def heap(self) -> Bo | None:
        """The first DEV_HEAP (the only one on <= 7.0 drivers), or None."""
        return self.heaps[0] if self.heaps else None

    @property
    def heap_size(self) -> int:
        """Bytes of device window covered by heap chunks."""
        return sum(chunk.size for chunk in self.heaps)

    def add_mapping(self, addr: int, length: int, bo: Bo) -> None:
        """Record a live user mapping of `bo` (the VA the device uses for SHMEM BOs under SVA)."""
        with self._lock:
            self.mappings[addr] = (length, bo, 0)

    def remove_range(self, addr: int, length: int) -> list[tuple[int, int, Bo]]:
        """Forget mappings overlapping [addr, addr+length).

        Returns one (addr, length, bo) per mapping entry dropped; each held one BO reference, which the
        caller drops. Pieces left on either side become new entries and take a reference each.
        """
        removed = []
        with self._lock:
            for start, (size, bo, bo_offset) in list(self.mappings.items()):
                lo, hi = max(start, addr), min(start + size, addr + length)
                if lo >= hi:
                    continue
                del self.mappings[start]
                removed.append((lo, hi - lo, bo))
                if start < lo:
                    self.mappings[start] = (lo - start, bo, bo_offset)
                    bo.refs += 1
                if hi < start + size:
                    self.mappings[hi] = (start + size - hi, bo, bo_offset + hi - start)
                    bo.refs += 1
        return removed

    def resolve(self, addr: int, length: int) -> tuple[Bo, int]:
        """Find the BO a device access [addr, addr+length) lands in: (bo, offset in bo).

        Raises:
            DeviceFault: the range is not inside one BO (heap window or a live SHMEM mapping).
        """
        with self._lock:
            if self.heaps and AIE2_DEVM_BASE <= addr and addr + length <= AIE2_DEVM_BASE + self.heap_size:
                return self._resolve_heap(addr - AIE2_DEVM_BASE, length)
            for start, (size, bo, bo_offset) in self.mappings.items():
                if start <= addr and addr + length <= start + size:
                    return bo, bo_offset + addr - start
        raise DeviceFault(f"device access [{addr:#x}, {addr + length:#x}) is outside every BO")

    def _resolve_heap(self, offset: int, length: int) -> tuple[Bo, int]:
        for start, bo in self.dev_bos.items():
            if start <= offset and offset + length <= start + bo.size:
                return bo, offset - start
        for chunk in self.heaps:
            start = chunk.xdna_addr - AIE2_DEVM_BASE
            if start <= offset and offset + length <= start + chunk.size:
                return chunk, offset - start
        # Only a DEV BO gives a view across chunks; a raw access straddling two chunks is not modelled.
        raise DeviceFault(f"heap access [{offset:#x}, {offset + length:#x}) straddles heap chunks outside a DEV BO")

