"""Buffer-object ioctls: CREATE_BO of each type, GET_BO_INFO, SYNC_BO, GEM_CLOSE and PRIME
(docs/uapi.md 4.4-4.6, 5, 7)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import cast

from . import coherence, usermem
from .coherence import DeviceView
from .memory import (
    AIE2_DEVM_BASE,
    AMDXDNA_BO_CMD,
    AMDXDNA_BO_DEV,
    AMDXDNA_BO_DEV_HEAP,
    AMDXDNA_BO_SHMEM,
    AMDXDNA_INVALID_ADDR,
    BACKING_NAME,
    DEV_HEAP_CHUNK,
    Bo,
    HeapAllocator,
    HeapWindow,
    Memory,
    file_key,
    heap_allocator,
    import_backing,
    is_bo_backing,
    new_backing,
    page_align,
)
from .objects import Client, fail
from .state import DeviceState

DEV_HEAP_MAX = 64 << 20             # one heap <= 64 MiB per fd (docs/uapi.md 4.4, 7)
MAX_LFS_FILESIZE = (1 << 63) - 1    # shmem_file_setup refuses a larger (negative loff_t) size with EINVAL
SYNC_DIRECT_FROM_DEVICE = 1
MAX_CMD_BO_SIZE = 32 << 10          # 6.14-6.17 refuse a larger CMD BO at creation (docs/emulator.md, Driver profiles)
VA_TBL_HEADER = 8                   # struct amdxdna_drm_va_tbl: s32 dmabuf_fd, u32 num_entries (6.18+)
DRM_CLOEXEC, DRM_RDWR = os.O_CLOEXEC, os.O_RDWR


class BoIoctls(DeviceState):
    """CREATE_BO, GET_BO_INFO, SYNC_BO, GEM_CLOSE, PRIME_HANDLE_TO_FD and PRIME_FD_TO_HANDLE (rules B1-B8, D7).

    Mixed into ``EmuDevice`` (driver.py), whose ``lock``, ``cond``, ``profile``, ``firmware`` and reference
    counting (``unref_bo``) its methods use (declared by ``DeviceState``); ``driver._driver_table`` names the
    handlers.
    """

    def _ioctl_gem_close(self, client: Client, a: dict[str, int]) -> None:
        with self.lock:
            bo = client.bos.pop(a["handle"], None)
            # rule D7: an unknown handle; a job keeps its own reference (docs/driver-rules.md)
            if bo is None:
                raise fail(errno.EINVAL, "GEM_CLOSE", f"handle={a['handle']} unknown")
            self.unref_bo(bo)

    def _ioctl_prime_handle_to_fd(self, client: Client, a: dict[str, int]) -> None:
        op = f"PRIME_HANDLE_TO_FD(handle={a['handle']})"
        # rule 54: PRIME export (docs/emulator.md)
        if a["flags"] & ~(DRM_CLOEXEC | DRM_RDWR):
            raise fail(errno.EINVAL, op, f"flags={a['flags']:#x}")
        with self.lock:
            bo = client.bos.get(a["handle"])
            if bo is None:
                raise fail(errno.ENOENT, op, "unknown handle (drm_gem_object_lookup)")
            if bo.memfd < 0:
                raise fail(errno.EOPNOTSUPP, op, f"{bo.kind_name} BOs live inside the heap and are not exported")
            if bo.kind == AMDXDNA_BO_DEV_HEAP and self.profile.expandable_heap:
                # Chunks share one window file, which cannot tell them apart on import.
                raise fail(errno.EOPNOTSUPP, op, "exporting an expandable-heap chunk is not modelled")
            # The exported "dma-buf" is a dup of the BO's memfd: a real fd the caller owns and closes.
            try:
                fd = os.dup(bo.memfd)
            except OSError as exc:      # dma_buf_fd: get_unused_fd_flags fails with EMFILE/ENFILE
                # os.dup raises from errno (posix_error): the OSError always carries one.
                raise fail(cast(int, exc.errno), op, "no free file descriptor for the dma-buf") from exc
            os.set_inheritable(fd, not a["flags"] & DRM_CLOEXEC)
            self.exports[bo.file_key] = bo
            a["fd"] = fd

    def _ioctl_prime_fd_to_handle(self, client: Client, a: dict[str, int]) -> None:
        """drm_gem_prime_fd_to_handle: this fd's handle of the dma-buf if it has one; else the exporting GEM object
        itself when this device exported it (a new handle on it); else a new BO over the dma-buf's pages."""
        op = f"PRIME_FD_TO_HANDLE(fd={a['fd']})"
        try:
            # rule 54: PRIME import (docs/emulator.md)
            key = file_key(a["fd"])
        except OSError as exc:
            raise fail(errno.EBADF, op, "not an open fd (dma_buf_get)") from exc
        with self.lock:
            handle = next((h for h, known in client.bos.items() if known.file_key == key), None)
            if handle is None:
                bo = self.exports.get(key)
                if bo is None or bo.released:
                    bo = self._imported_bo(a["fd"], key, op)
                else:
                    bo.refs += 1
                handle = Client.lowest_free(client.bos)
                bo.handle = bo.handle or handle
                client.bos[handle] = bo
            a["handle"] = handle

    def _imported_bo(self, fd: int, key: tuple[int, int], op: str) -> Bo:
        """A SHMEM BO of this device over another device's exported pages (the importer's GEM object)."""
        if not is_bo_backing(fd):
            raise fail(errno.EINVAL, op, "not a dma-buf (only BOs exported by an emulated device are modelled)")
        try:
            memfd, backing, view, size = import_backing(fd)
        except OSError as exc:
            raise fail(errno.ENOMEM, op, f"mapping the dma-buf: {exc}") from exc
        bo = Bo(handle=0, kind=AMDXDNA_BO_SHMEM, size=size, mem=view, memfd=memfd, _backing=backing,
                map_offset=self.next_map_offset, file_key=key)
        if not self.profile.coherent:
            bo.view = coherence.view_for(key, view)         # one RAM behind both devices' BOs
        self.next_map_offset += size
        self.live_bos += 1
        return bo

    # --- BO ioctls (docs/uapi.md 4.4-4.6, 7) ---

    def _ioctl_create_bo(self, client: Client, a: dict[str, int]) -> None:
        kind, size = a["type"], a["size"]
        op = f"CREATE_BO(type={kind}, size={size:#x})"
        # rule B1: flags and type (docs/driver-rules.md)
        if a["flags"]:
            raise fail(errno.EINVAL, op, "flags must be 0")
        makers: dict[int, Callable[[Client, dict[str, int], str], Bo]] = {
            AMDXDNA_BO_SHMEM: self._create_shmem, AMDXDNA_BO_DEV_HEAP: self._create_heap,
            AMDXDNA_BO_DEV: self._create_dev, AMDXDNA_BO_CMD: self._create_cmd}
        maker = makers.get(kind)
        if maker is None:
            raise fail(errno.EINVAL, op, "unknown BO type")
        if self.profile.drm_minor < 1 and (a["vaddr"] or size == 0):
            # 6.14-6.17 refuse a user pointer and an empty BO of every type (docs/emulator.md, Driver profiles S5).
            raise fail(errno.EINVAL, op, "vaddr must be 0 and size non-zero (feature level 0.0)")
        with self.lock:
            bo = maker(client, a, op)
            bo.handle = Client.lowest_free(client.bos)
            client.bos[bo.handle] = bo
            a["handle"] = bo.handle

    def _backed_bo(self, kind: int, size: int, op: str) -> Bo:
        if size > MAX_LFS_FILESIZE:
            raise fail(errno.EINVAL, op, f"size {size:#x} exceeds MAX_LFS_FILESIZE (shmem_file_setup)")
        try:
            memfd, backing, view = new_backing(size, f"{BACKING_NAME}{kind}")
        except OSError as exc:
            raise fail(errno.ENOMEM, op, f"backing store: {exc}") from exc
        bo = Bo(handle=0, kind=kind, size=size, mem=view, memfd=memfd, _backing=backing,
                map_offset=self.next_map_offset, file_key=file_key(memfd))
        if not self.profile.coherent and kind != AMDXDNA_BO_CMD:
            # The driver reads command BOs through its own kernel mapping: coherent (docs/emulator.md).
            bo.view = DeviceView(view)
            coherence.register(bo.file_key, bo.view)
        self.next_map_offset += size
        self.live_bos += 1
        return bo

    def _create_shmem(self, client: Client, a: dict[str, int], op: str) -> Bo:
        if a["vaddr"]:
            # From 6.18 vaddr points at a va_tbl the driver copies first: unreadable is EINVAL (S5).
            try:
                usermem.read(a["vaddr"], VA_TBL_HEADER, op + " va_tbl")
            except OSError:
                raise fail(errno.EINVAL, op, f"va_tbl at vaddr={a['vaddr']:#x} is unreadable") from None
            raise fail(errno.EOPNOTSUPP, op, "user-pointer / dma-buf BOs (va_tbl) are not modelled")
        if a["size"] == 0:
            raise fail(errno.EINVAL, op, "size 0 (emulator choice; the driver leaves it unchecked)")
        # rule B2: shmem BOs are whole pages (docs/driver-rules.md)
        return self._backed_bo(AMDXDNA_BO_SHMEM, page_align(a["size"]), op)

    def _create_cmd(self, client: Client, a: dict[str, int], op: str) -> Bo:
        # rule B5: room for the header; the 32 KiB ceiling waits for EXEC_CMD (docs/driver-rules.md)
        if a["size"] < 4:
            raise fail(errno.EINVAL, op, "CMD BO smaller than its 4-byte header")
        if self.profile.drm_minor < 1 and a["size"] > MAX_CMD_BO_SIZE:
            # 6.14-6.17 check the 32 KiB ceiling at creation, later drivers at EXEC_CMD (S9).
            raise fail(errno.EINVAL, op, f"CMD BO larger than {MAX_CMD_BO_SIZE:#x} (feature level 0.0)")
        return self._backed_bo(AMDXDNA_BO_CMD, page_align(a["size"]), op)

    def _create_heap(self, client: Client, a: dict[str, int], op: str) -> Bo:
        if self.profile.expandable_heap:
            return self._add_heap_chunk(client, a["size"], op)
        size = a["size"]
        # rule B3: one heap of at most 64 MiB per fd, at 0x4000000 (docs/driver-rules.md)
        if size > DEV_HEAP_MAX or size == 0:
            raise fail(errno.EINVAL, op, f"heap size must be 1..{DEV_HEAP_MAX:#x}")
        if client.memory.heap is not None:
            raise fail(errno.EBUSY, op, "this fd already has a DEV_HEAP")
        bo = self._backed_bo(AMDXDNA_BO_DEV_HEAP, page_align(size), op)
        bo.xdna_addr = AIE2_DEVM_BASE
        bo.refs += 1            # client->dev_heap: the fd keeps its heap until close (docs/uapi.md 7, lifetime)
        client.memory.heaps.append(bo)
        client.memory.allocator = HeapAllocator(bo.size)
        return bo

    def _add_heap_chunk(self, client: Client, size: int, op: str) -> Bo:
        # 2026 expandable heap (docs/uapi.md 4.4 staging): chunks of n x 64 MiB appended at 0x4000000 + cumulative size.
        memory, max_size = client.memory, self.profile.dev_heap_max_size
        if size == 0 or size % DEV_HEAP_CHUNK:
            raise fail(errno.EINVAL, op, f"heap size must be a non-zero multiple of {DEV_HEAP_CHUNK:#x}")
        offset = memory.heap_size
        if offset + size > max_size:
            raise fail(errno.ENOSPC, op, f"heap would grow to {offset + size:#x} > dev_heap_max_size {max_size:#x}")
        if memory.window is None:
            try:
                memory.window = HeapWindow(max_size, coherent=self.profile.coherent)
            except OSError as exc:
                raise fail(errno.ENOMEM, op, f"backing store: {exc}") from exc
        try:
            memfd = memory.window.chunk_fd()
        except OSError as exc:
            raise fail(errno.ENOMEM, op, f"backing store: {exc}") from exc
        bo = Bo(handle=0, kind=AMDXDNA_BO_DEV_HEAP, size=size, mem=memory.window.view[offset:offset + size],
                xdna_addr=AIE2_DEVM_BASE + offset, map_offset=self.next_map_offset, memfd=memfd,
                file_offset=offset, _backing=memory.window.backing, view=memory.window.device, view_offset=offset)
        self.next_map_offset += size
        self.live_bos += 1
        bo.refs += 1            # client->dev_heap_xa keeps every chunk until close (docs/uapi.md 7, lifetime)
        memory.heaps.append(bo)
        return bo

    def _new_dev_bo(self, client: Client, size: int, op: str, internal: bool = False) -> Bo | None:
        if self.profile.expandable_heap:
            return self._new_window_dev_bo(client, size, op, internal)
        memory = client.memory
        heap = memory.heap
        if heap is None:        # the callers refuse a heapless fd first (CREATE_HWCTX ENOENT, CREATE_BO EINVAL)
            raise fail(errno.EINVAL, op, "no DEV_HEAP on this fd")
        size = page_align(size)
        offset = heap_allocator(memory).alloc(size)
        if offset is None:
            return None
        return self._place_dev_bo(memory, offset, size, [heap], internal)

    def _new_window_dev_bo(self, client: Client, size: int, op: str, internal: bool) -> Bo:
        # Expandable heap (docs/uapi.md 4.4 staging): place in the whole window first (drm_mm), then find the chunks
        # under the range; a short, missing or unmapped heap is EAGAIN so the caller can grow it and retry.
        memory, max_size = client.memory, self.profile.dev_heap_max_size
        size = page_align(size)
        if size == 0 or size > max_size:
            raise fail(errno.EINVAL, op, f"size must be 1..{max_size:#x} (dev_heap_max_size)")
        allocator = heap_allocator(memory)
        offset = allocator.alloc(size)
        if offset is None:
            raise fail(errno.ENOSPC, op, f"no free range of {size:#x} in the {max_size:#x} heap window")
        try:
            chunks = self._chunks_under(memory, offset, size, op)
        except OSError:
            allocator.free(offset)
            raise
        return self._place_dev_bo(memory, offset, size, chunks, internal)

    def _place_dev_bo(self, memory: Memory, offset: int, size: int, chunks: list[Bo], internal: bool) -> Bo:
        """The DEV BO at heap-window `offset` (already allocated), over `chunks`: it holds every chunk it spans."""
        for chunk in chunks:
            chunk.refs += 1
        first = chunks[0]       # without a window (one heap per fd), the heap itself
        pages = first.mem if memory.window is None else memory.window.view
        device = first.view if memory.window is None else memory.window.device
        bo = Bo(handle=0, kind=AMDXDNA_BO_DEV, size=size, mem=pages[offset:offset + size], heap=first,
                more_heaps=tuple(chunks[1:]), heap_offset=offset, xdna_addr=AIE2_DEVM_BASE + offset,
                vaddr=first.vaddr + offset - (first.xdna_addr - AIE2_DEVM_BASE), internal=internal, fd_memory=memory,
                view=device, view_offset=offset)
        memory.add_dev_bo(bo)
        self.live_bos += 1
        return bo

    @staticmethod
    def _chunks_under(memory: Memory, offset: int, size: int, op: str) -> list[Bo]:
        """The heap chunks covering window range [offset, offset+size), mapped at contiguous user VAs.

        Raises:
            OSError: EAGAIN (no heap, a chunk unmapped, or the heap ends before the range), EINVAL
                (the chunks' user VAs are not contiguous).
        """
        if not memory.heaps:
            raise fail(errno.EAGAIN, op, "no DEV_HEAP on this fd yet")
        chunks: list[Bo] = []
        for index, chunk in enumerate(memory.heaps):
            start = chunk.xdna_addr - AIE2_DEVM_BASE
            if start + chunk.size <= offset:
                continue
            if chunk.vaddr == AMDXDNA_INVALID_ADDR:
                raise fail(errno.EAGAIN, op, f"heap chunk {index} is not mapped")
            if chunks and chunk.vaddr != chunks[-1].vaddr + chunks[-1].size:
                raise fail(errno.EINVAL, op, f"heap chunk {index} uva is not contiguous")
            chunks.append(chunk)
            if start + chunk.size >= offset + size:
                return chunks
        raise fail(errno.EAGAIN, op, f"heap ({memory.heap_size:#x} bytes) ends before {offset + size:#x}")

    def _create_dev(self, client: Client, a: dict[str, int], op: str) -> Bo:
        if self.profile.expandable_heap:
            return self._new_window_dev_bo(client, a["size"], op, internal=False)
        # rule B4: a mapped heap, a size that fits it, ENOSPC when full (docs/driver-rules.md)
        heap = client.memory.heap
        if heap is None:
            raise fail(errno.EINVAL, op, "no DEV_HEAP on this fd")
        if heap.vaddr == AMDXDNA_INVALID_ADDR:
            raise fail(errno.EINVAL, op, "Invalid dev heap userptr (heap never mapped)")
        if a["size"] == 0 or a["size"] > heap.size:
            raise fail(errno.EINVAL, op, f"size must be 1..{heap.size:#x} (heap size)")
        bo = self._new_dev_bo(client, a["size"], op)
        if bo is None:
            raise fail(errno.ENOSPC, op, "no free heap range")
        return bo

    def _ioctl_get_bo_info(self, client: Client, a: dict[str, int]) -> None:
        op = f"GET_BO_INFO(handle={a['handle']})"
        # rule B6 (docs/driver-rules.md)
        if a["ext"] or a["ext_flags"] or a["pad"]:
            raise fail(errno.EINVAL, op, "ext/ext_flags/pad must be 0")
        with self.lock:
            bo = client.bos.get(a["handle"])
            if bo is None:
                raise fail(errno.ENOENT, op, "unknown handle")
            a.update(map_offset=bo.map_offset, vaddr=bo.vaddr, xdna_addr=bo.xdna_addr)

    def _ioctl_sync_bo(self, client: Client, a: dict[str, int]) -> None:
        op = f"SYNC_BO(handle={a['handle']}, direction={a['direction']})"
        with self.lock:
            bo = client.bos.get(a["handle"])
            if bo is None:
                raise fail(errno.ENOENT, op, "unknown handle")
            if bo.view is not None:
                # drm_clflush of the lines covering [offset, offset+size) inside the BO, whatever the direction
                # (docs/emulator.md, Memory coherence); the EINVAL below comes after the flush (rule B7).
                start = bo.view_offset + min(a["offset"], bo.size)
                bo.view.sync(start, bo.view_offset + min(a["offset"] + a["size"], bo.size))
            if self.profile.staging_reports and a["offset"] >= bo.size:
                # The out-of-tree driver checks the range (S12); mainline up to 7.0 does not.
                raise fail(errno.EINVAL, op, f"offset={a['offset']:#x} >= BO size {bo.size:#x}")
            if self.profile.drm_minor >= 3 and a["direction"] == SYNC_DIRECT_FROM_DEVICE:
                if bo.dbg_ctx is None:
                    raise fail(errno.EINVAL, op, "FROM_DEVICE on a BO that is not an assigned debug buffer")
