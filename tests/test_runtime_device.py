"""Opening devices, the driver check, typed info queries, the heap, stats and teardown order."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CREATE_BO, GET_BO_INFO, GET_INFO, RecordingSeam, emu_open, request_of

from amdxdna_direct import Device, Xclbin, errors, open_device
from amdxdna_direct.device import HEAP_CHUNK_SIZE
from amdxdna_direct.emu import EmuDevice

REPO = Path(__file__).resolve().parents[1]
DRM_VERSION = struct.Struct("<iii4xQQQQQQ")  # docs/uapi.md 5: major minor patch, then len/ptr pairs


@pytest.mark.parametrize("spec, profile", [("emu", "npu4"), ("emu:npu1", "npu1"), ("emu:npu6", "npu6")])
def test_open_emulator_specs(spec, profile):
    with open_device(spec) as dev:
        assert dev.name == f"emu:{profile}" and dev.emulator.profile.name == profile
        assert dev.version.name == "amdxdna_accel_driver" and dev.version.major == 0
        assert dev.stats["VERSION"] == 1
    assert dev.closed


def test_open_from_env_and_from_an_emudevice(monkeypatch):
    monkeypatch.setenv("AMDXDNA_DEVICE", "emu:npu5")
    with open_device() as dev:
        assert dev.name == "emu:npu5"
    emu = EmuDevice("npu1")
    first, second = open_device(emu), open_device(emu)
    assert first.emulator is emu and second.emulator is emu
    first.close()
    second.close()
    assert emu.counters.ioctls["VERSION"] == 2     # two fds on one emulated device; it stays open
    emu.close()


def test_missing_node_says_how_to_use_the_emulator(tmp_path):
    with pytest.raises(errors.NoDeviceError) as info:
        open_device(str(tmp_path / "accel9"))
    assert info.value.errno == errno.ENOENT and "open(path=" in str(info.value) and "emu" in str(info.value)


@pytest.mark.parametrize("err, cls, hint", [
    (errno.EACCES, errors.PermissionDeniedError, "render' group (sudo usermod -aG render $USER"),
    (errno.EPERM, errors.PermissionDeniedError, "--device /dev/accel/accel0 --group-add render"),
    (errno.ENODEV, errors.NoDeviceError, ""),                  # node present, no driver bound to it
])
def test_open_failures_are_typed_and_give_the_fix(monkeypatch, err, cls, hint):
    def refuse(path, flags):
        raise OSError(err, os.strerror(err), path)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(cls) as info:
        open_device("/dev/accel/accel0")
    text = str(info.value)
    assert info.value.errno == err and text.startswith(f"open(path=/dev/accel/accel0): {errno.errorcode[err]} (")
    assert hint in text


def test_no_device_without_env_explains_the_emulator(monkeypatch):
    import glob

    if glob.glob("/dev/accel/accel*"):
        pytest.skip("this machine has accel nodes")
    monkeypatch.delenv("AMDXDNA_DEVICE", raising=False)
    with pytest.raises(errors.NoDeviceError, match=r"open_device\(\): ENODEV .*open_device\('emu'\)") as info:
        open_device()
    assert info.value.errno == errno.ENODEV and "AMDXDNA_DEVICE=emu" in str(info.value)


def test_open_device_rejects_other_types():
    with pytest.raises(TypeError, match="expected 'emu'"):
        open_device(42)
    with pytest.raises(ValueError, match="unknown emulator profile 'npu9'.*npu1"):
        open_device("emu:npu9")
    with pytest.raises(ValueError, match=r"unknown emulator driver 'fast' \(drivers: linux-6.14, .*':coherent' models"):
        open_device("emu:npu1:fast")


def test_coherent_emulator_variant():
    with open_device("emu:npu1:coherent") as dev, open_device("emu:npu1") as plain:
        assert dev.emulator.profile.coherent and not plain.emulator.profile.coherent
        assert dev.name == "emu:npu1" and dev.emulator.profile.name == "npu1"


def test_an_unsynced_input_fails_on_the_emulator_and_the_error_says_where_to_look():
    # The emulator is not cache coherent (docs/emulator.md): an input written after its last sync is a firmware
    # ERROR, whose reason the emulator logs; the coherent variant runs it.
    from amdxdna_direct import insts
    from amdxdna_direct.emu import Passthrough
    from amdxdna_direct.xclbin import build_mlir_aie

    stream = insts.dma_stream(3, [(0, 64, "in"), (1, 64, "out")])
    for spec, fails in (("emu:npu1", True), ("emu:npu1:coherent", False)):
        with open_device(spec) as dev:
            dev.emulator.models.bind(insts.encode(stream), Passthrough())
            ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
            a, b = dev.bo(4096), dev.bo(4096)
            a.write(bytes(range(64)))                      # no a.sync()
            run = ctx.kernel().prepare_npu(stream, [a, b]).start()
            if fails:
                with pytest.raises(errors.CommandError, match=r"command ERROR: EIO .*; emulated firmware: firmware "
                                                              r"error: arg 0: .*written by the CPU after the last "
                                                              r"sync") as info:
                    run.wait()
                assert "SYNC_BO that range" in info.value.reason
            else:
                assert run.wait() == 4


class _OtherDriver(RecordingSeam):
    """Answers DRM_IOCTL_VERSION as i915 would (strings written through the user pointers)."""

    def ioctl(self, request, buf):
        if request & 0xFF != 0x00:
            return super().ioctl(request, buf)
        fields = list(DRM_VERSION.unpack_from(buf))
        for (length_at, ptr_at), text in zip(((3, 4), (5, 6), (7, 8)), (b"i915", b"20250101", b"Intel Graphics"),
                                             strict=True):
            ctypes.memmove(fields[ptr_at], text, min(len(text), fields[length_at]))
            fields[length_at] = len(text)
        fields[0:3] = [1, 6, 0]
        DRM_VERSION.pack_into(buf, 0, *fields)
        return 0


def test_a_driver_that_is_not_amdxdna_is_refused():
    emu = EmuDevice("npu1")
    seam = _OtherDriver(emu.open())
    with pytest.raises(errors.NoDeviceError, match=r"driver 'i915' \(Intel Graphics\) is not amdxdna"):
        Device(seam)
    assert seam.calls[-1] == ("close",)
    emu.close()


def test_typed_info_queries_match_the_npu1_facts(device):
    # docs/uapi.md 8: NPU1 has 5 columns, 6 rows, core rows 2..5 (4 rows).
    md = device.aie_metadata()
    if device.emulator is not None:
        assert (md.cols, md.rows, md.core.row_count, md.core.row_start, md.mem.row_start) == (5, 6, 4, 2, 1)
    assert md.core.row_count == 4 and md.shim.row_start == 0
    assert device.aie_metadata() is md and device.stats["GET_INFO"] == 1        # queried once
    fw = device.firmware_version()
    assert str(fw).count(".") == 3
    clocks = device.clock_metadata()
    assert clocks.mp_npu_clock.freq_mhz > 0 and clocks.h_clock.name
    assert device.power_mode().name in ("DEFAULT", "LOW", "MEDIUM", "HIGH", "TURBO")
    assert device.aie_version().major >= 1


@pytest.mark.emu_only
def test_hw_contexts_lists_ours_and_resource_info(device, npu1_fixture):
    assert device.hw_contexts() == []
    ctx = device.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    entries = device.hw_contexts()
    assert [(e.context_id, e.num_col, e.pid) for e in entries] == [(ctx.handle, 1, os.getpid())]
    assert 1 <= entries[0].start_col <= 4          # NPU1: column 0 is not usable (docs/xrt-sequence.md 1.3)
    assert device.resource_info().npu_task_max == 6


def test_unsupported_query_says_so():
    emu = EmuDevice("npu1", drm_minor=0)   # a 6.14-era driver: no QUERY_RESOURCE_INFO (docs/uapi.md 11)
    with open_device(emu) as dev:
        with pytest.raises(errors.XdnaError) as info:
            dev.resource_info()
    emu.close()
    assert info.value.errno == errno.EOPNOTSUPP
    assert "GET_INFO(param=QUERY_RESOURCE_INFO" in str(info.value) and "not supported by this driver" in str(info.value)


def test_heap_is_created_on_first_need_and_aligned():
    dev, emu, seam = emu_open("npu1")
    shm = dev.bo(4096)
    assert dev.heap == () and "reserve" not in seam.names()
    dev_bo = dev.bo(100, "dev")
    (chunk,) = dev.heap
    assert chunk.xdna_addr == 0x4000000 and chunk.va % HEAP_CHUNK_SIZE == 0     # docs/xrt-sequence.md 1.2
    assert 0x4000000 <= dev_bo.address < 0x4000000 + HEAP_CHUNK_SIZE and dev_bo.address % (32 << 10) == 0
    assert dev_bo.cpu_address == chunk.va + (dev_bo.address - 0x4000000)
    assert shm.address == shm.cpu_address                                       # SVA: the mapping's VA
    dev.close()


def test_dev_bo_eagain_grows_the_heap_by_a_contiguous_chunk():
    # The expandable-heap driver answers EAGAIN for a DEV BO when the heap is short (docs/uapi.md 4.4); the
    # emulator models the one-heap driver, so the EAGAIN is injected and the second heap is refused.
    dev, emu, seam = emu_open("npu1")
    dev.ensure_heap()
    answers = iter([errno.EAGAIN])

    def once(buf):
        return next(answers, None) if CREATE_BO.unpack_from(buf)[3] == 3 else None

    seam.inject[[c for c in seam.calls if c[0] == "ioctl" and c[1] & 0xFF == 0x43][0][1]] = once
    with pytest.raises(errors.XdnaError, match=r"CREATE_BO\(type=DEV_HEAP, size=0x4000000\): EBUSY"):
        dev.bo(4096, "dev")
    created = [CREATE_BO.unpack_from(c[2]) for c in seam.calls if c[0] == "ioctl" and c[1] & 0xFF == 0x43]
    assert [(x[2], x[3]) for x in created[-2:]] == [(4096, 3), (64 << 20, 2)]
    assert emu.counters.live()["bos"] == 1
    dev.close()


def test_close_releases_everything_newest_first(npu1_fixture):
    dev, emu, seam = emu_open("npu1")
    ctx = dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    a = dev.bo(4096)
    b = dev.bo(8192, "cmd")
    n = len(seam.calls)
    dev.close()
    assert seam.names()[n:] == ["munmap", "GEM_CLOSE", "munmap", "GEM_CLOSE",        # b, a
                                "SYNCOBJ_DESTROY", "DESTROY_HWCTX", "GEM_CLOSE",     # context, then its PDI
                                "munmap", "GEM_CLOSE", "munmap", "close"]            # heap, reservation, fd
    assert set(emu.counters.live().values()) == {0}
    assert a.closed and b.closed and ctx.closed
    dev.close()                                                                       # idempotent
    with pytest.raises(errors.XdnaError, match="closed"):
        a.sync()


def test_raw_ioctl_goes_through_stats_and_errors():
    from amdxdna_direct import abi

    with open_device("emu:npu1") as dev:
        req = abi.ffi.new("struct drm_gem_close *")
        req.handle = 999
        with pytest.raises(errors.XdnaError) as info:
            dev.raw_ioctl(abi.DRM_IOCTL_GEM_CLOSE, abi.ffi.buffer(req))
        assert info.value.errno == errno.EINVAL and str(info.value).startswith("GEM_CLOSE(): EINVAL")
        assert dev.stats["GEM_CLOSE"] == 1


def test_os_seam_on_ordinary_files():
    from amdxdna_direct.seam import OsSeam

    seam = OsSeam("/dev/null")
    with pytest.raises(errors.XdnaError) as info:
        Device(seam)                       # not a DRM node: DRM_IOCTL_VERSION answers ENOTTY
    assert info.value.errno == errno.ENOTTY and str(info.value).startswith("VERSION(): ENOTTY")
    assert seam.fd == -1                   # the failed open closed the fd
    zero = OsSeam("/dev/zero")
    addr = zero.mmap(8192, 0)
    ctypes.memmove(addr, b"xdna", 4)
    assert ctypes.string_at(addr, 4) == b"xdna"
    zero.munmap(addr, 8192)
    base = zero.reserve(64 << 20, 64 << 20)
    assert base % (64 << 20) == 0
    fixed = zero.mmap(4096, 0, base)        # MAP_FIXED into the reservation, as the heap is mapped
    assert fixed == base
    zero.munmap(base, 64 << 20)
    zero.close()
    zero.close()
    with pytest.raises(OSError) as closed:
        zero.ioctl(0, bytearray(8))
    assert closed.value.errno == errno.EBADF


@pytest.mark.parametrize("priority, value", [(None, 0), ("low", 0x280), ("realtime", 0x100), (0x200, 0x200)])
def test_qos_buffer_is_32_zeroed_bytes_with_priority(npu1_fixture, priority, value):
    dev, emu, seam = emu_open("npu1")
    seen = []
    request = request_of(0x40)
    seam.inject[request] = lambda buf: seen.append(ctypes.string_at(struct.unpack_from("<Q", buf, 16)[0], 32))
    ctx = dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"), priority=priority)
    # docs/uapi.md 2.1 / 12: six u32 (priority at 20), then user_start_col 0xFF, reserved 0
    assert struct.unpack("<8I", seen[0]) == (0, 0, 0, 0, 0, value, 0xFF, 0)
    assert ctx.priority == value
    with pytest.raises(ValueError, match="priority"):
        dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"), priority="urgent")
    dev.close()


def test_contexts_are_released_on_garbage_collection(npu1_fixture):
    import gc

    dev, emu, seam = emu_open("npu1")
    ctx = dev.hw_context(Xclbin.load(npu1_fixture / "aie.xclbin"))
    ctx.kernel()
    assert emu.counters.live()["hwctx"] == 1
    del ctx
    gc.collect()
    live = emu.counters.live()
    assert (live["hwctx"], live["syncobjs"], live["bos"]) == (0, 0, 1)
    dev.close()


# Payload layouts of docs/uapi.md 2.5, written out independently of abi.py's cdef.
_INFO_LAYOUTS = {
    1: struct.Struct("<IHHII" + "5H6x" * 3),     # QUERY_AIE_METADATA: col_size cols rows version, core mem shim
    2: struct.Struct("<II"),                     # QUERY_AIE_VERSION
    3: struct.Struct("<16sI4x16sI4x"),           # QUERY_CLOCK_METADATA: mp_npu_clock, h_clock
    8: struct.Struct("<4I"),                     # QUERY_FIRMWARE_VERSION
    9: struct.Struct("<B7x"),                    # GET_POWER_MODE
    12: struct.Struct("<5Q"),                    # QUERY_RESOURCE_INFO
}


def test_typed_info_equals_the_bytes_the_driver_wrote():
    dev, emu, seam = emu_open("npu4")
    answers = {}

    def keep(buf):
        param, size, pointer = GET_INFO.unpack_from(buf)
        answers[param] = ctypes.string_at(pointer, size)

    seam.after[request_of(0x47)] = keep
    md, ver, clocks = dev.aie_metadata(), dev.aie_version(), dev.clock_metadata()
    fw, power, res = dev.firmware_version(), dev.power_mode(), dev.resource_info()
    raw = {param: layout.unpack_from(answers[param]) for param, layout in _INFO_LAYOUTS.items()}
    assert (len(answers[1]), len(answers[3]), len(answers[12])) == (64, 48, 40)       # struct sizes, docs/uapi.md 2.5
    assert (md.col_size, md.cols, md.rows, md.version.major, md.version.minor) == raw[1][:5]
    assert [tuple(vars(t).values()) for t in (md.core, md.mem, md.shim)] == [raw[1][5:10], raw[1][10:15], raw[1][15:]]
    assert (md.cols, md.rows, md.core.row_count) == (8, 6, 4)                # NPU4 facts (docs/uapi.md 8)
    assert (ver.major, ver.minor) == raw[2]
    assert (clocks.mp_npu_clock.name.encode(), clocks.mp_npu_clock.freq_mhz) == (raw[3][0].rstrip(b"\0"), raw[3][1])
    assert (clocks.h_clock.name.encode(), clocks.h_clock.freq_mhz) == (raw[3][2].rstrip(b"\0"), raw[3][3])
    assert (fw.major, fw.minor, fw.patch, fw.build) == raw[8] and str(fw) == ".".join(map(str, raw[8]))
    assert power.mode == raw[9][0] and power.name == ("DEFAULT", "LOW", "MEDIUM", "HIGH", "TURBO")[raw[9][0]]
    assert tuple(vars(res).values()) == raw[12] and res.npu_task_max == 16   # hwctx_limit of NPU4 (docs/uapi.md 8)
    dev.close()


def test_shmem_address_is_xdna_addr_when_the_driver_gives_one():
    # IOVA mode (docs/xrt-sequence.md 1.4, docs/uapi.md 7): GET_BO_INFO.xdna_addr != ~0 for a SHMEM BO is what the
    # device uses, not the mapping's VA; sub-buffers add their offset to it.
    dev, emu, seam = emu_open("npu1")
    iova = 0x1_2345_6000

    def as_iova(buf):
        fields = list(GET_BO_INFO.unpack_from(buf))
        if fields[4] != (1 << 64) - 1:              # mappable (SHMEM / CMD), not a heap BO
            fields[6] = iova
            GET_BO_INFO.pack_into(buf, 0, *fields)

    seam.after[request_of(0x44)] = as_iova
    bo = dev.bo(8192)
    assert bo.address == iova and bo.cpu_address != iova and bo.sub(256, 64).address == iova + 256
    bo.array(np.uint32)[:] = 7                      # the CPU still goes through the mapping
    assert bo.read(4) == b"\x07\x00\x00\x00"
    dev.close()


def test_heap_growth_stops_at_512_mib_before_asking_the_driver():
    emu = EmuDevice("npu4", expandable_heap=True)
    dev = open_device(emu)
    chunks = [dev.ensure_heap()] + [dev.grow_heap() for _ in range(7)]
    assert [c.va - chunks[0].va for c in chunks] == [i * HEAP_CHUNK_SIZE for i in range(8)]     # contiguous
    assert [c.xdna_addr for c in chunks] == [0x4000000 + i * HEAP_CHUNK_SIZE for i in range(8)]
    issued = dev.stats["CREATE_BO"]
    with pytest.raises(errors.XdnaError) as info:
        dev.grow_heap()
    assert info.value.errno == errno.ENOSPC and dev.stats["CREATE_BO"] == issued
    assert str(info.value).startswith("CREATE_BO(type=DEV_HEAP, size=0x4000000): ENOSPC")
    assert "512 MiB maximum" in str(info.value)
    dev.close()
    assert set(emu.counters.live().values()) == {0}
    emu.close()


def test_real_device_tier_skips_without_the_node(tmp_path):
    env = dict(os.environ, AMDXDNA_TEST_DEVICE=str(tmp_path / "accel7"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_runtime_bo.py",
                           "-k", "zero_copy or dev_and_cmd"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b2 passed, 2 skipped\b", done.stdout), done.stdout
