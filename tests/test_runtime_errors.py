"""The error hierarchy and the errno -> class table (amdxdna_direct.errors)."""

from __future__ import annotations

import errno
import pickle

import pytest

from amdxdna_direct import errors


def test_hierarchy_is_rooted_in_oserror():
    for cls in (errors.NoDeviceError, errors.PermissionDeniedError, errors.ContextUnavailableError,
                errors.CommandError, errors.CommandTimeout, errors.DeviceLostError):
        assert issubclass(cls, errors.XdnaError) and issubclass(cls, OSError)
    assert issubclass(errors.CommandTimeout, errors.CommandError)
    assert issubclass(errors.CommandTimeout, TimeoutError)


def test_message_names_ioctl_fields_and_errno():
    err = errors.ioctl_error("CREATE_HWCTX", {"num_tiles": 16, "max_opc": 2048}, errno.ENODEV)
    assert str(err) == "CREATE_HWCTX(num_tiles=16, max_opc=2048): ENODEV (No such device)"
    assert err.errno == errno.ENODEV
    assert isinstance(err, errors.ContextUnavailableError)


@pytest.mark.parametrize("name, err, cls", [
    ("CREATE_HWCTX", errno.ENODEV, errors.ContextUnavailableError),
    ("CREATE_HWCTX", errno.EINVAL, errors.ContextUnavailableError),
    ("CREATE_HWCTX", errno.EBUSY, errors.ContextUnavailableError),
    ("CREATE_HWCTX", errno.ENOSPC, errors.ContextUnavailableError),
    ("CREATE_BO", errno.ENOSPC, errors.XdnaError),
    ("mmap", errno.ENODEV, errors.DeviceLostError),
    ("open", errno.ENODEV, errors.NoDeviceError),
    ("open", errno.ENXIO, errors.NoDeviceError),
    ("EXEC_CMD", errno.ENODEV, errors.DeviceLostError),
    ("GET_INFO", errno.EACCES, errors.PermissionDeniedError),
    ("open", errno.EPERM, errors.PermissionDeniedError),
    ("open", errno.ENOENT, errors.NoDeviceError),
    ("CREATE_BO", errno.EINVAL, errors.XdnaError),
])
def test_one_table_maps_errnos(name, err, cls):
    assert type(errors.ioctl_error(name, None, err)) is cls


def test_hint_and_hex_fields():
    err = errors.ioctl_error("open", {"path": "/dev/accel/accel0"}, errno.EACCES, "add your user to 'render'")
    assert str(err) == "open(path=/dev/accel/accel0): EACCES (Permission denied); add your user to 'render'"
    assert errors.format_call("SYNC_BO", {"offset": 0x10000}) == "SYNC_BO(offset=0x10000)"


def test_command_error_carries_fields_and_pickles():
    err = errors.CommandTimeout(errno.ETIME, "k: TIMEOUT", kernel="k", state="TIMEOUT", seq=3, index=5, health=None)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.CommandTimeout
    assert (back.kernel, back.state, back.seq, back.index, back.errno, str(back)) == \
        ("k", "TIMEOUT", 3, 5, errno.ETIME, "k: TIMEOUT")
