"""dma-buf export and import of buffers (PRIME), and the power mode (SET_STATE).

Oracles: the bytes each test writes on one side and reads on the other; the DRM rule that an fd importing
a dma-buf it already holds gets its own handle back (docs/runtime.md 3.3), checked through the emulator's
GEM_CLOSE count and live-object counters; the PRIME request layout {u32 handle, u32 flags, s32 fd} with
DRM_RDWR 2 | DRM_CLOEXEC 0x80000 (docs/uapi.md 5); SET_STATE's root-only rule and the
SET_POWER_MODE answers of docs/uapi.md 4.10 / 10.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

import numpy as np
import pytest
from conftest import emu_open

from amdxdna_direct import cmd, errors, insts, open_device
from amdxdna_direct.emu import EmuDevice, Passthrough
from amdxdna_direct.xclbin import build_mlir_aie

N = 4096
PRIME_HANDLE_TO_FD, PRIME_FD_TO_HANDLE = 0xC00C642D, 0xC00C642E     # docs/uapi.md 5
PRIME = struct.Struct("<IIi")


def pattern(seed: int) -> np.ndarray:
    return ((np.arange(N, dtype=np.uint32) * 2654435761 + seed) >> 8).astype(np.uint8)


def run_passthrough(dev, emu, src, dst) -> None:
    """Copy ``src`` into ``dst`` on the device (the emulator's Passthrough over a generated stream)."""
    stream = insts.dma_stream(4, [(0, N, "in"), (1, N, "out")])
    emu.models.bind(insts.encode(stream), Passthrough())
    ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
    assert ctx.kernel().prepare_npu(stream, [src, dst]).start().wait(10) == cmd.ERT_CMD_STATE_COMPLETED
    ctx.close()


def test_export_is_a_cloexec_dma_buf_fd_the_caller_owns():
    dev, emu, seam = emu_open("npu4")
    bo = dev.bo(N)
    fd = bo.export()
    call = next(c for c in seam.calls if c[0] == "ioctl" and c[1] == PRIME_HANDLE_TO_FD)
    assert PRIME.unpack_from(call[2])[:2] == (bo.handle, 2 | 0x80000)
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    assert os.lseek(fd, 0, os.SEEK_END) >= N
    bo.close()
    dev.close()
    os.close(fd)
    emu.close()


def test_export_and_import_between_two_files_of_one_device():
    with EmuDevice("npu4") as emu, open_device(emu) as first, open_device(emu) as second:
        mine = first.bo(N)
        mine.write(pattern(1))
        mine.sync()
        fd = mine.export()
        theirs = second.import_bo(fd)
        os.close(fd)                                          # the import holds the buffer, not the fd
        assert theirs.imported and theirs.kind == "shmem" and theirs.size == N
        theirs.sync()
        np.testing.assert_array_equal(theirs.array(np.uint8), pattern(1))
        out = second.bo(N)
        run_passthrough(second, emu, theirs, out)             # the import is an argument on its own device
        out.sync(direction="from_device")
        np.testing.assert_array_equal(out.array(np.uint8), pattern(1))
        theirs.write(pattern(2))                              # ... and the exporter sees writes through it
        theirs.sync()
        mine.sync(direction="from_device")
        np.testing.assert_array_equal(mine.array(np.uint8), pattern(2))


def test_export_and_import_between_two_devices():
    with EmuDevice("npu4") as one, EmuDevice("npu4") as other, open_device(one) as a, open_device(other) as b:
        src = a.bo(N)
        src.write(pattern(3))
        src.sync()
        fd = src.export()
        try:
            imported = b.import_bo(fd, size=N)
        finally:
            os.close(fd)
        dst = b.bo(N)
        run_passthrough(b, other, imported, dst)
        dst.sync(direction="from_device")
        np.testing.assert_array_equal(dst.array(np.uint8), pattern(3))
        src.close()                                           # the exporter goes; the import keeps the pages
        imported.sync()
        np.testing.assert_array_equal(imported.array(np.uint8), pattern(3))


def test_a_self_import_shares_the_handle_and_closes_it_once():
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        exporter = dev.bo(N)
        exporter.write(pattern(4))
        fd = exporter.export()
        again = dev.import_bo(fd)
        os.close(fd)
        assert again.handle == exporter.handle and again.cpu_address != exporter.cpu_address
        np.testing.assert_array_equal(again.array(np.uint8), pattern(4))
        closes = emu.counters.ioctls["GEM_CLOSE"]
        exporter.close()
        assert emu.counters.ioctls["GEM_CLOSE"] == closes            # the import still holds the handle
        again.write(pattern(5))
        again.sync()                                                 # SYNC_BO on the shared handle still works
        out = dev.bo(N)
        run_passthrough(dev, emu, again, out)
        out.sync(direction="from_device")
        np.testing.assert_array_equal(out.array(np.uint8), pattern(5))
        closes = emu.counters.ioctls["GEM_CLOSE"]
        again.close()
        assert emu.counters.ioctls["GEM_CLOSE"] == closes + 1        # closed once, by the last holder
        fd = out.export()
        twice = [dev.import_bo(fd), dev.import_bo(fd)]               # the device closes all three: once
        os.close(fd)
        assert {bo.handle for bo in twice} == {out.handle}
    # A second GEM_CLOSE of the shared handle would have made the device's close raise (EINVAL, unknown handle).
    assert emu.counters.live()["bos"] == 0


def test_a_self_import_in_one_run_is_one_argument():
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        src = dev.bo(N)
        src.write(pattern(6))
        src.sync()
        fd = src.export()
        alias = dev.import_bo(fd)
        os.close(fd)
        stream = insts.dma_stream(4, [(0, N // 2, "in"), (1, N // 2, "out")])
        emu.models.bind(insts.encode(stream), Passthrough())
        ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        run = ctx.kernel().prepare_npu(stream, [src.sub(0, N // 2), alias.sub(N // 2, N // 2)])
        assert run.handles[1:] == [src.handle]                        # one handle, listed once (rule M8)
        run.start().wait(10)
        src.sync(direction="from_device")
        np.testing.assert_array_equal(src.array(np.uint8)[N // 2:], pattern(6)[:N // 2])


def test_import_and_export_errors(tmp_path):
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        bo = dev.bo(N)
        with pytest.raises(ValueError, match=r"a sub-buffer \(offset 64, 128 bytes\) cannot be exported"):
            bo.sub(64, 128).export()
        with pytest.raises(errors.XdnaError, match=r"PRIME_HANDLE_TO_FD\(handle=\d+, flags=RDWR\|CLOEXEC\)"):
            dev.bo(N, "dev").export()                                  # DEV buffers live in the heap
        fd = bo.export()
        with pytest.raises(ValueError, match=r"size must be an int in 1\.\.4096 \(the dma-buf's size\), got 8192"):
            dev.import_bo(fd, size=2 * N)
        with pytest.raises(ValueError, match="got 0"):
            dev.import_bo(fd, size=0)
        os.close(fd)
        with pytest.raises(errors.XdnaError) as info:
            dev.import_bo(fd)                                          # closed meanwhile
        assert info.value.errno == errno.EBADF and "lseek(fd=" in str(info.value)
        plain = tmp_path / "plain"
        plain.write_bytes(bytes(N))
        with open(plain, "rb") as f, pytest.raises(errors.XdnaError) as info:
            dev.import_bo(f.fileno())                                  # a file, not a dma-buf
        assert info.value.errno == errno.EINVAL and "PRIME_FD_TO_HANDLE(fd=" in str(info.value)
        with pytest.raises(TypeError, match="fd must be an open file descriptor"):
            dev.import_bo(-1)
        bo.close()
        with pytest.raises(errors.XdnaError, match="buffer is closed"):
            bo.export()
    assert emu.counters.live()["bos"] == 0


# --------------------------------------------------------------------------------------------- power mode


def test_set_power_mode_by_name_and_number():
    with EmuDevice("npu4", cap_sys_admin=True) as emu, open_device(emu) as dev:
        assert dev.power_mode().name == "DEFAULT"
        dev.set_power_mode("high")
        assert dev.power_mode().mode == 3
        dev.set_power_mode(4)                                          # TURBO: no context exists
        assert dev.power_mode().name == "TURBO"
        dev.set_power_mode("Default")
        assert dev.power_mode().name == "DEFAULT" and dev.stats["SET_STATE"] == 3


def test_set_power_mode_without_cap_sys_admin_says_so():
    with EmuDevice("npu4", cap_sys_admin=False) as emu, open_device(emu) as dev:
        with pytest.raises(errors.PermissionDeniedError) as info:
            dev.set_power_mode("high")
        assert dev.power_mode().name == "DEFAULT"
    assert info.value.errno == errno.EACCES
    assert str(info.value) == ("SET_STATE(param=SET_POWER_MODE, power_mode=HIGH): EACCES (Permission denied); "
                               "SET_STATE is root-only (DRM_ROOT_ONLY): the process needs CAP_SYS_ADMIN "
                               "(run it as root)")


def test_set_power_mode_refusals():
    with EmuDevice("npu4", cap_sys_admin=True) as emu, open_device(emu) as dev:
        with pytest.raises(errors.XdnaError, match=r"power_mode=LOW\): ENOTSUP.*DEFAULT, HIGH and TURBO only") as info:
            dev.set_power_mode("low")
        assert info.value.errno == errno.EOPNOTSUPP
        ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        with pytest.raises(errors.XdnaError, match=r"EINVAL .*TURBO is refused while any hardware context exists"):
            dev.set_power_mode("turbo")
        ctx.close()
        for bad in (5, -1, "eco", True, 3.0, None):
            with pytest.raises(ValueError, match=r"mode must be one of default, low, medium, high, turbo or 0\.\.4"):
                dev.set_power_mode(bad)
        assert dev.stats["SET_STATE"] == 2
