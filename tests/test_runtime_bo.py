"""Buffer objects: kinds, zero-copy views, sub-buffers, sync, close and garbage collection."""

from __future__ import annotations

import errno
import gc
import threading

import numpy as np
import pytest
from conftest import SYNC_BO, RecordingSeam, emu_open

from amdxdna_direct import Device, errors
from amdxdna_direct.emu import EmuDevice


def test_shmem_view_is_zero_copy_and_counts_copies(device):
    bo = device.bo(1000)
    assert bo.size == 1000 and bo.kind == "shmem" and bo.handle > 0
    view = bo.array(np.float32)
    assert view.size == 250 and view.flags.writeable
    view[:] = np.arange(250, dtype=np.float32)
    again = bo.array(np.float32, count=10, offset=40)
    assert again.tolist() == list(range(10, 20))                 # same memory, no copy
    assert bo.array(np.uint16, shape=(2, 3)).shape == (2, 3)
    bo.write(b"\x01\x02", offset=998)
    assert bo.read(2, offset=998) == b"\x01\x02"
    assert device.stats["bytes_in"] == 2 and device.stats["bytes_out"] == 2


def test_dev_and_cmd_buffers(device):
    dev_bo = device.bo(5000, "dev")
    cmd_bo = device.bo(4096, "cmd")
    dev_bo.array()[:] = 7
    assert dev_bo.read(3) == b"\x07\x07\x07"
    assert dev_bo.address == dev_bo.info.xdna_addr and dev_bo.info.map_offset == (1 << 64) - 1
    cmd_bo.write(b"abcd")
    assert cmd_bo.read(4) == b"abcd"


def test_sub_buffers_share_the_handle_and_are_bounded(device):
    parent = device.bo(4096)
    sub = parent.sub(256, 512)
    subsub = sub.sub(64, 128)
    assert sub.handle == subsub.handle == parent.handle
    assert sub.address == parent.address + 256 and subsub.address == parent.address + 320
    assert subsub.offset == 320 and subsub.parent is parent
    subsub.array(np.uint8)[:] = 9
    assert parent.read(1, offset=320) == b"\x09" and parent.read(1, offset=319) == b"\x00"
    with pytest.raises(ValueError, match="outside"):
        parent.sub(4000, 200)
    with pytest.raises(ValueError, match="aligned"):
        parent.sub(2, 8)
    with pytest.raises(ValueError, match="exceeds"):
        sub.array(np.uint8, count=513)


@pytest.mark.parametrize("kind, size", [("shmem", 0), ("shmem", -4), ("heap", 4096)])
def test_bad_buffers_are_rejected_before_any_ioctl(device, kind, size):
    before = sum(v for k, v in device.stats.items() if k.isupper())
    with pytest.raises(ValueError):
        device.bo(size, kind)
    with pytest.raises(TypeError):
        device.bo(4096.0)
    assert sum(v for k, v in device.stats.items() if k.isupper()) == before


def test_sync_uses_to_device_for_both_directions_with_sub_ranges():
    dev, emu, seam = emu_open("npu1")
    parent = dev.bo(8192)
    assert SYNC_BO.unpack_from(seam.calls[-1][2]) == (parent.handle, 0, 0, 8192)    # initial flush
    sub = parent.sub(4096, 1024)
    sub.sync(direction="from_device")
    sub.sync(16, 32)
    decoded = [SYNC_BO.unpack_from(c[2]) for c in seam.calls[-2:]]
    # FROM_DEVICE trap (docs/uapi.md 4.6): the runtime always sends direction 0 (TO_DEVICE)
    assert decoded == [(parent.handle, 0, 4096, 1024), (parent.handle, 0, 4112, 32)]
    with pytest.raises(ValueError, match="direction"):
        sub.sync(direction="sideways")
    with pytest.raises(ValueError, match="outside"):
        sub.sync(1000, 100)
    dev.close()


def test_close_is_idempotent_and_closes_children_first():
    dev, emu, seam = emu_open("npu1")
    parent = dev.bo(4096)
    sub = parent.sub(0, 64)
    live = emu.counters.live()["bos"]
    sub.close()
    assert sub.closed and not parent.closed and emu.counters.live()["bos"] == live
    other = parent.sub(64, 64)
    parent.close()
    parent.close()
    assert other.closed and emu.counters.live()["bos"] == live - 1
    with pytest.raises(errors.XdnaError, match="buffer is closed"):
        other.array()
    dev.close()


def test_garbage_collection_closes_but_views_keep_the_buffer_alive():
    dev, emu, seam = emu_open("npu1")
    base = emu.counters.live()
    view = dev.bo(4096).array(np.uint32)
    gc.collect()
    assert emu.counters.live()["bos"] == base["bos"] + 1        # the view holds its buffer
    view[:] = 5
    del view
    gc.collect()
    assert emu.counters.live() == base
    dev.bo(4096, "dev")
    gc.collect()
    dev.close()
    assert set(emu.counters.live().values()) == {0}


class _EagainTogether(RecordingSeam):
    """Holds every thread that got EAGAIN for a DEV BO until all of them have, so they race to grow."""

    def __init__(self, inner, parties: int) -> None:
        super().__init__(inner)
        self.barrier = threading.Barrier(parties)

    def ioctl(self, request: int, buf) -> int:
        try:
            return super().ioctl(request, buf)
        except OSError as exc:
            if exc.errno == errno.EAGAIN and not self.barrier.broken:
                self.barrier.wait(10)
            raise


def test_threads_short_of_heap_grow_it_once():
    # Expandable-heap driver (docs/uapi.md 4.4): four threads whose DEV BOs overflow the first
    # chunk all get EAGAIN together; one chunk is added for all of them, not one each.
    emu = EmuDevice("npu4", expandable_heap=True)
    seam = _EagainTogether(emu.open(), 4)
    dev = Device(seam, emulator=emu)
    filler = dev.bo(60 << 20, "dev")
    made, failures = [], []

    def allocate():
        try:
            made.append(dev.bo(8 << 20, "dev"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=allocate) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures and len(made) == 4 and not seam.barrier.broken
    assert len(dev.heap) == 2
    spans = sorted((bo.address, bo.address + bo.size) for bo in [filler, *made])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))   # disjoint
    assert spans[-1][1] <= 0x4000000 + 2 * (64 << 20)
    dev.close()
    emu.close()
