"""Shared fixtures: the ``device`` under test, the shared fixture files, a recording seam.

``device`` is always the emulator (``emu:npu1``, the generation of the mlir-aie npu1_1col fixture);
with ``AMDXDNA_TEST_DEVICE=/dev/accel/accel0`` the same tests also run on that real device (skipped,
saying so, when the node does not exist). Tests that need the emulator itself (models, fault
injection, counters) are marked ``emu_only`` and skipped there.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import pytest
from fixture_files import REPO_FIXTURES

NPU1_1COL = REPO_FIXTURES / "xdna" / "mlir-aie-npu1_1col"
EMU_SPEC = "emu:npu1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "emu_only: needs the emulator itself (models, faults, counters)")


CLEAN_CLONE = "test_clean_clone.py"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The clean-clone test waits for a second run of the suite: it goes last, so that run overlaps this one. In
    that run (the clone's), the tests the outer session covers on the same tree are deselected
    (tests/test_clean_clone.py)."""
    listing = os.environ.get("AMDXDNA_CLEAN_CLONE_COVERED")
    if listing and os.environ.get("AMDXDNA_CLEAN_CLONE_RUN"):
        covered = set(Path(listing).read_text().splitlines())
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in covered])
        items[:] = [item for item in items if item.nodeid not in covered]
    items.sort(key=lambda item: item.path.name == CLEAN_CLONE)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.path.name == CLEAN_CLONE for item in session.items):
        import test_clean_clone

        test_clean_clone.start([(item.nodeid, item.path) for item in session.items])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ended before the clean-clone test (-x, Ctrl-C) leaves no run of the clone's suite behind."""
    module = sys.modules.get("test_clean_clone")
    if module is not None:
        module.stop()


def _device_specs() -> list[str]:
    specs = [EMU_SPEC]
    real = os.environ.get("AMDXDNA_TEST_DEVICE")
    if real:
        specs.append(real)
    return specs


@pytest.fixture(params=_device_specs())
def device(request: pytest.FixtureRequest):
    """An open Device: the emulator, and a real NPU when AMDXDNA_TEST_DEVICE names one."""
    from amdxdna_direct import open_device

    spec = request.param
    if not spec.startswith("emu"):
        if request.node.get_closest_marker("emu_only"):
            pytest.skip("needs the emulator (models, fault injection or counters)")
        if not os.path.exists(spec):
            pytest.skip(f"AMDXDNA_TEST_DEVICE={spec}: no such device node on this machine")
    dev = open_device(spec)
    yield dev
    dev.close()


@pytest.fixture
def npu1_fixture() -> Path:
    """The mlir-aie npu1_1col fixture directory (aie.xclbin, insts.bin, JSON inputs)."""
    if not (NPU1_1COL / "aie.xclbin").is_file():
        pytest.skip(f"shared fixtures not found at {NPU1_1COL}")
    return NPU1_1COL


def txn_dev_gen(dev) -> int:
    """TXN header device generation for a device: 3 on NPU1 (5 columns), 4 on NPU4/5/6 (docs/xrt-sequence.md 2.3, 4)."""
    return 3 if dev.aie_metadata().cols == 5 else 4


def passthrough_stream(dev, fixture: Path) -> bytes:
    """The npu1_1col ``insts.bin``, bound to a Passthrough model on the emulator; on a real device the
    test is skipped unless it is an NPU1 (the stream's TXN generation is 3)."""
    stream = (fixture / "insts.bin").read_bytes()
    if dev.emulator is not None:
        from amdxdna_direct.emu import Passthrough

        dev.emulator.models.bind(stream, Passthrough())
    elif txn_dev_gen(dev) != 3:
        pytest.skip("the npu1_1col fixture needs an NPU1 (Phoenix / Hawk Point)")
    return stream


class RecordingSeam:
    """Wraps a seam and records every call in order: ("ioctl", request, bytes in) / ("mmap", ...) ...

    Lets tests check the exact syscall sequence and decode struct bytes independently of abi.py.
    ``inject`` maps a request number (or "mmap" / "reserve") to a function of the call's arguments
    returning an errno to fail it with, or None to let it through; ``after`` maps a request number to
    a function(buf) run once the driver answered (to read or alter what it wrote).
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple] = []
        self.inject: dict[int | str, object] = {}
        self.after: dict[int, object] = {}

    def _fail(self, key, *args) -> None:
        hook = self.inject.get(key)
        err = hook(*args) if hook is not None else None
        if err:
            raise OSError(err, os.strerror(err))

    def ioctl(self, request: int, buf) -> int:
        self.calls.append(("ioctl", request, bytes(buf)))
        self._fail(request, buf)
        result = self.inner.ioctl(request, buf)
        if request in self.after:
            self.after[request](buf)
        return result

    def mmap(self, length: int, offset: int, addr: int = 0) -> int:
        self._fail("mmap", length, offset, addr)
        result = self.inner.mmap(length, offset, addr)
        self.calls.append(("mmap", length, offset, addr, result))
        return result

    def reserve(self, length: int, alignment: int) -> int:
        self._fail("reserve", length, alignment)
        result = self.inner.reserve(length, alignment)
        self.calls.append(("reserve", length, alignment, result))
        return result

    def munmap(self, addr: int, length: int) -> None:
        self.calls.append(("munmap", addr, length))
        self.inner.munmap(addr, length)

    def close(self) -> None:
        self.calls.append(("close",))
        self.inner.close()

    def names(self) -> list[str]:
        """The calls as names: ioctl short names (from the request nr) and mmap/munmap/reserve/close."""
        return [IOCTL_NAMES.get(c[1] & 0xFF, hex(c[1])) if c[0] == "ioctl" else c[0] for c in self.calls]

    def ioctls(self) -> list[str]:
        """Only the ioctl names, in order."""
        return [IOCTL_NAMES.get(c[1] & 0xFF, hex(c[1])) for c in self.calls if c[0] == "ioctl"]


# Request nr -> name, from docs/uapi.md 1a and 5 (independent of abi.py).
IOCTL_NAMES = {0x40: "CREATE_HWCTX", 0x41: "DESTROY_HWCTX", 0x42: "CONFIG_HWCTX", 0x43: "CREATE_BO",
               0x44: "GET_BO_INFO", 0x45: "SYNC_BO", 0x46: "EXEC_CMD", 0x47: "GET_INFO", 0x48: "SET_STATE",
               0x49: "WAIT_CMD", 0x4A: "GET_ARRAY", 0x00: "VERSION", 0x09: "GEM_CLOSE", 0xBF: "SYNCOBJ_CREATE",
               0xC0: "SYNCOBJ_DESTROY", 0xCA: "SYNCOBJ_TIMELINE_WAIT"}

# Struct formats from docs/uapi.md 2 (x86_64), for decoding recorded calls.
CREATE_BO = struct.Struct("<QQQII")          # flags vaddr size type handle
SYNC_BO = struct.Struct("<IIQQ")             # handle direction offset size
CREATE_HWCTX = struct.Struct("<QQQ8I")       # ext ext_flags qos_p umq_bo log_buf_bo max_opc num_tiles mem_size ...
EXEC_CMD = struct.Struct("<QQIIQQIIQ")       # ext ext_flags hwctx type cmd_handles args cmd_count arg_count seq
TIMELINE_WAIT = struct.Struct("<QQqIIII")    # handles points timeout_nsec count_handles flags first_signaled pad
GET_BO_INFO = struct.Struct("<QQIIQQQ")      # ext ext_flags handle pad map_offset vaddr xdna_addr
CONFIG_HWCTX = struct.Struct("<IIQII")       # handle param_type param_val param_val_size pad
GET_INFO = struct.Struct("<IIQ")             # param buffer_size buffer


def request_of(nr: int) -> int:
    """The request number the runtime issues for ioctl ``nr`` (to key ``RecordingSeam.inject``)."""
    from amdxdna_direct import abi

    return next(r for r in abi.IOCTLS if r & 0xFF == nr)


def emu_open(profile: str = "npu1", **options):
    """A Device on a fresh EmuDevice wrapped in a RecordingSeam; returns (device, emulator, seam)."""
    from amdxdna_direct import Device
    from amdxdna_direct.emu import EmuDevice

    emu = EmuDevice(profile, **options)
    seam = RecordingSeam(emu.open())
    return Device(seam, emulator=emu, owns_emulator=True), emu, seam


@pytest.fixture(scope="session")
def fixture_bundle(tmp_path_factory):
    """The sam3-tiny checkpoint exported as a host-ViT bundle, and its reference.npz as a dict (once a session)."""
    import numpy as np
    from fixture_files import SAM3_TINY

    from sam3.bundle import Bundle
    from sam3.export import export

    if not (SAM3_TINY / "reference.npz").is_file():
        pytest.skip(f"fixture {SAM3_TINY} absent (tests/fixtures incomplete in this checkout)")
    b = Bundle.open(export(SAM3_TINY / "hf", tmp_path_factory.mktemp("fix") / "b", vit="host"))
    with np.load(SAM3_TINY / "reference.npz") as z:
        ref = {k: z[k] for k in z.files}
    yield b, ref
    b.close()
