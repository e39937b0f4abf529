"""Test support for the command-line tests, and its own tests.

``no_system_files``: the CLI tests must not read the machine they run on (issue 6: doctor is "testable
against the emulator and a fake /dev + /sys tree passed in"). An audit hook (PEP 578; the ``open``,
``os.scandir``, ``os.listdir`` and ``glob.glob`` events) records every path under /dev, /sys, /etc or
/proc (except /proc/self, this process's own state) opened or listed while the fixture is active, refuses
it with EACCES before anything is read, and fails the test at teardown. Metadata calls (stat, readlink)
raise no audit event, so they are not seen.

``AlteredDriver``: an ``EmuDevice`` whose file descriptors answer some requests as another driver would
(an older ioctl numbering, a missing capability, a failing query), for the failing paths of doctor and
info. Request numbers and struct offsets are the spec's (docs/uapi.md A.3, docs/uapi.md 1a, 2.4),
not abi.py's.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from amdxdna_direct import open_device

SYSTEM_PREFIXES = ("/dev/", "/sys/", "/etc/", "/proc/")
OWN_STATE_PREFIX = "/proc/self/"
_WATCHED_EVENTS = frozenset({"open", "os.scandir", "os.listdir", "glob.glob"})
_guard: dict = {"active": False, "touched": []}

DRM_IOCTL_GET_CAP = 0xC010640C                # docs/uapi.md A.3
DRM_IOCTL_AMDXDNA_CREATE_HWCTX = 0xC0386440   # docs/uapi.md 1a
DRM_IOCTL_AMDXDNA_GET_INFO = 0xC0106447       # docs/uapi.md 1a
QUERY_FIRMWARE_VERSION = 8                    # docs/uapi.md 10


def _system_path(path: object) -> str | None:
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None  # a file descriptor
    text = os.path.abspath(os.fsdecode(path)) + "/"
    if text.startswith(SYSTEM_PREFIXES) and not text.startswith(OWN_STATE_PREFIX):
        return text.rstrip("/")
    return None


def _audit(event: str, args: tuple) -> None:
    if not _guard["active"] or event not in _WATCHED_EVENTS or not args:
        return
    path = _system_path(args[0])
    if path is not None:
        _guard["touched"].append((event, path))
        raise PermissionError(errno.EACCES, f"test guard: {event} of system path refused", path)


sys.addaudithook(_audit)  # hooks cannot be removed; it does nothing unless a test activates it


@pytest.fixture
def no_system_files():
    """Fail the test if it opened or listed a file of the real system (see the module docstring)."""
    _guard["active"], _guard["touched"] = True, []
    try:
        yield _guard["touched"]
    finally:
        _guard["active"] = False
    assert _guard["touched"] == [], f"the test touched system files: {_guard['touched']}"


def test_guard_refuses_and_records_system_paths(no_system_files):
    with pytest.raises(PermissionError):
        Path("/etc/passwd").read_text()
    with pytest.raises(PermissionError):
        os.listdir("/dev")
    assert no_system_files == [("open", "/etc/passwd"), ("os.listdir", "/dev")]
    no_system_files.clear()  # proven; let the teardown pass


def test_guard_allows_own_state_and_temporary_files(no_system_files, tmp_path):
    assert "CapEff" in Path("/proc/self/status").read_text()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text("x")
    assert os.listdir(tmp_path / "etc") == ["passwd"]


# --- a driver that answers differently -------------------------------------------------------------------


class AlteredSeam:
    """A seam that fails or edits the emulator's answer to chosen requests; everything else is the emulator's."""

    def __init__(self, inner, fail: dict[int, Callable[[bytes], int]], edit: dict[int, Callable]) -> None:
        self.inner, self.fail, self.edit = inner, fail, edit

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def ioctl(self, request: int, buf) -> int:
        err = self.fail[request](bytes(buf)) if request in self.fail else 0
        if err:
            raise OSError(err, os.strerror(err))
        result = self.inner.ioctl(request, buf)
        if request in self.edit:
            self.edit[request](buf)
        return result


class AlteredDriver:
    """Stands for an ``EmuDevice`` in ``open_device``: every fd it opens is an ``AlteredSeam``.

    ``fail``: request -> fn(request bytes) returning the errno to answer (0: let the emulator answer);
    ``edit``: request -> fn(writable buffer) applied to the emulator's answer.
    """

    def __init__(self, emu, fail: dict | None = None, edit: dict | None = None) -> None:
        self.emu, self.fail, self.edit = emu, fail or {}, edit or {}

    def __getattr__(self, name: str):
        return getattr(self.emu, name)

    def open(self) -> AlteredSeam:
        return AlteredSeam(self.emu.open(), self.fail, self.edit)


def get_info_param(request: bytes) -> int:
    """``param`` of a struct amdxdna_drm_get_info (u32 at offset 0, docs/uapi.md 2.4)."""
    return struct.unpack_from("<I", request, 0)[0]


def failing_query(param: int, err: int) -> dict[int, Callable[[bytes], int]]:
    """``fail`` for an AlteredDriver: GET_INFO ``param`` answers ``err``, other params reach the emulator."""
    return {DRM_IOCTL_AMDXDNA_GET_INFO: lambda request: err if get_info_param(request) == param else 0}


def zero_cap_value(buf) -> None:
    """struct drm_get_cap {u64 capability; u64 value}: answer value 0."""
    struct.pack_into("<Q", buf, 8, 0)


def test_altered_driver_answers_as_told():
    from amdxdna_direct.emu import EmuDevice
    from amdxdna_direct.errors import XdnaError

    with EmuDevice("npu1") as emu, open_device(AlteredDriver(emu, fail=failing_query(QUERY_FIRMWARE_VERSION,
                                                                                    errno.EIO))) as dev:
        assert dev.aie_metadata().cols == 5  # other GET_INFO params reach the emulator
        with pytest.raises(XdnaError) as info:
            dev.firmware_version()
    assert info.value.errno == errno.EIO
