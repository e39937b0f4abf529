"""amdxdna doctor: host checks over a fake /dev + /sys + /etc tree, device checks on the emulator.

Oracles: the sysfs layout and PCI ids of spec/amdxdna-uapi.md 8 and xrt-npu-sequence.md 1.1, access(2)
rules for the mode bits, kmsg(4) record format, the feature levels of spec 1b and 11, the emulator's
profiles and fault switches, and drivers that answer differently (test_cli_isolation.AlteredDriver).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import resource
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_cli_isolation
from fixture_files import SHARED
from test_cli_isolation import (
    DRM_IOCTL_AMDXDNA_CREATE_HWCTX,
    DRM_IOCTL_AMDXDNA_GET_INFO,
    DRM_IOCTL_GET_CAP,
    QUERY_FIRMWARE_VERSION,
    AlteredDriver,
    failing_query,
    zero_cap_value,
)

from amdxdna_direct import doctor, insts, open_device
from amdxdna_direct.cli import doctor_cmd, main
from amdxdna_direct.device import pci_generation
from amdxdna_direct.doctor import FAIL, PASS, SKIP, WARN, Host, Identity
from amdxdna_direct.emu import EmuDevice
from amdxdna_direct.xclbin import build_mlir_aie, write

# Every test here runs under the guard: no file of the real system is read (test_cli_isolation).
no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")

NPU1_1COL = SHARED / "fixtures/xdna/mlir-aie-npu1_1col"
needs_fixture = pytest.mark.skipif(not (NPU1_1COL / "aie.xclbin").exists(), reason=f"fixtures absent: {NPU1_1COL}")

NPU_SLOT = "0000:c5:00.1"


def make_tree(tmp_path: Path, *, node: bool = True, mode: int = 0o660, driver: str = "amdxdna",
              device: str = "0x1502", revision: str = "0x00", kmsg: str | None = None,
              container: bool = False) -> Path:
    """A fake root: dev/accel/accel0, its sysfs PCI device dir with a driver link, etc/passwd and etc/group.

    The node's group is this process's group, named ``render``; ``bob`` is in it, ``alice`` is not.
    """
    root = tmp_path / "root"
    pci = root / "sys/devices/pci0000:00/0000:00:08.2" / NPU_SLOT
    pci.mkdir(parents=True)
    drivers = root / "sys/bus/pci/drivers" / driver
    drivers.mkdir(parents=True)
    (pci / "driver").symlink_to(os.path.relpath(drivers, pci))
    for name, value in (("vendor", "0x1022"), ("device", device), ("revision", revision),
                        ("vbnv", "RyzenAI-npu1"), ("fw_version", "1.5.2.380"), ("device_type", "0")):
        (pci / name).write_text(value + "\n")
    accel = root / "sys/class/accel/accel0"
    accel.mkdir(parents=True)
    (accel / "device").symlink_to(os.path.relpath(pci, accel))
    (root / "dev/accel").mkdir(parents=True)
    if node:
        (root / "dev/accel/accel0").write_bytes(b"")
        os.chmod(root / "dev/accel/accel0", mode)
    gid = os.getegid()
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("alice:x:4242:4242::/home/alice:/bin/sh\nbob:x:4343:4343::/home/bob:/bin/sh\n")
    (root / "etc/group").write_text(f"render:x:{gid}:bob\nalice:x:4242:\nbob:x:4343:\n")
    if kmsg is not None:
        (root / "dev/kmsg").write_text(kmsg)
    if container:
        (root / ".dockerenv").write_text("")
    return root


def host_for(root: Path, user: str | None = None, memlock: tuple[int, int] | None = None,
             cap_ipc_lock: bool = False) -> Host:
    host = Host.probe(root, user=user)
    host.memlock = memlock or (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    host.cap_ipc_lock = cap_ipc_lock
    return host


# --- node ---------------------------------------------------------------------------------------------


def test_node_present_and_driven_by_amdxdna(tmp_path):
    root = make_tree(tmp_path)
    result = doctor.check_node(host_for(root), doctor.node_path(host_for(root), None))
    assert result.status == PASS
    assert f"PCI {NPU_SLOT} 1502 rev 00: npu1" in result.detail


def test_node_missing_names_the_fix(tmp_path):
    root = make_tree(tmp_path, node=False)
    host = host_for(root)
    result = doctor.check_node(host, doctor.node_path(host, None))
    assert result.status == FAIL
    assert "modprobe amdxdna" in result.fix
    assert "--device" not in result.fix  # not a container


def test_node_missing_in_container_names_device_flag(tmp_path):
    root = make_tree(tmp_path, node=False, container=True)
    host = host_for(root)
    result = doctor.check_node(host, doctor.node_path(host, "/dev/accel/accel0"))
    assert result.status == FAIL
    assert "--device /dev/accel/accel0" in result.fix


def test_node_driven_by_another_driver(tmp_path):
    root = make_tree(tmp_path, driver="habanalabs")
    host = host_for(root)
    result = doctor.check_node(host, doctor.node_path(host, None))
    assert result.status == FAIL
    assert "'habanalabs'" in result.detail


def test_sysfs_attributes_and_generation(tmp_path):
    root = make_tree(tmp_path, device="0x17f0", revision="0x11")
    attributes = doctor.sysfs_attributes(root, "accel0")
    assert attributes["driver"] == "amdxdna"
    assert attributes["pci_slot"] == NPU_SLOT
    assert attributes["fw_version"] == "1.5.2.380"
    # spec 8: 17f0 rev 10/11/20 are NPU4/5/6, 1502 rev 0 is NPU1
    assert pci_generation(int(attributes["device"], 16), int(attributes["revision"], 16)) == "npu5"
    assert pci_generation(0x1502, 0) == "npu1"
    assert pci_generation(0x17F0, 0x20) == "npu6"
    assert pci_generation(0x17F0, 0x00) is None


def test_find_nodes_in_minor_order(tmp_path):
    root = make_tree(tmp_path)
    for n in (10, 2):
        (root / f"dev/accel/accel{n}").write_bytes(b"")
    (root / "dev/accel/accelX").write_bytes(b"")
    assert [p.name for p in doctor.find_nodes(root)] == ["accel0", "accel2", "accel10"]


# --- permission ----------------------------------------------------------------------------------------


def test_permission_denied_for_user_outside_the_group(tmp_path):
    root = make_tree(tmp_path, mode=0o660)
    host = host_for(root, user="alice")
    result = doctor.check_permission(host, doctor.node_path(host, None))
    assert result.status == FAIL
    assert "'render'" in result.detail and "crw" not in result.detail
    assert "usermod -aG render alice" in result.fix


def test_permission_in_container_adds_group_flag(tmp_path):
    root = make_tree(tmp_path, mode=0o660, container=True)
    host = host_for(root, user="alice")
    result = doctor.check_permission(host, doctor.node_path(host, None))
    assert result.status == FAIL
    assert f"--group-add {os.getegid()}" in result.fix


def test_permission_granted_through_the_group(tmp_path):
    root = make_tree(tmp_path, mode=0o660)
    host = host_for(root, user="bob")
    assert host.identity == Identity(uid=4343, gids=frozenset({4343, os.getegid()}), name="bob")
    result = doctor.check_permission(host, doctor.node_path(host, None))
    assert result.status == PASS
    assert "not opened" in result.detail


def test_permission_world_writable_node(tmp_path):
    root = make_tree(tmp_path, mode=0o666)
    host = host_for(root, user="alice")
    assert doctor.check_permission(host, doctor.node_path(host, None)).status == PASS


def test_permission_real_open_for_this_process(tmp_path):
    root = make_tree(tmp_path, mode=0o600)  # owned by this process
    host = host_for(root)
    result = doctor.check_permission(host, doctor.node_path(host, None))
    assert result.status == PASS
    assert "opens read-write" in result.detail


def test_unknown_user_is_refused(tmp_path):
    root = make_tree(tmp_path)
    with pytest.raises(LookupError, match="'mallory'"):
        Host.probe(root, user="mallory")


# --- memlock --------------------------------------------------------------------------------------------


def test_memlock_default_8mib_warns(tmp_path):
    host = host_for(make_tree(tmp_path), memlock=(8 << 20, 8 << 20))
    result = doctor.check_memlock(host)
    assert result.status == WARN
    assert "8192 KiB < 128 MiB" in result.detail
    assert "ulimit -l unlimited" in result.fix


def test_memlock_enough_or_waived(tmp_path):
    root = make_tree(tmp_path)
    assert doctor.check_memlock(host_for(root, memlock=(256 << 20, 256 << 20))).status == PASS
    assert doctor.check_memlock(host_for(root, memlock=(64 << 10, 64 << 10), cap_ipc_lock=True)).status == PASS
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert doctor.check_memlock(host_for(root, memlock=unlimited)).status == PASS


# --- kernel log -----------------------------------------------------------------------------------------

KMSG_SVA = (
    "6,1020,5123456,-;amdxdna 0000:c5:00.1: enabling device (0000 -> 0002)\n"
    " SUBSYSTEM=pci\n"
    "3,1021,5123999,-;amdxdna 0000:c5:00.1: SVA bind device failed, ret -95\n"
)
KMSG_FAULT = (
    "3,2001,7000000,-;amd_iommu: AMD-Vi: Event logged [IO_PAGE_FAULT device=c5:00.1 domain=0x0002 "
    "address=0x7f0000000000 flags=0x0020]\n"
)
KMSG_CTX = "[  100.5] amdxdna 0000:c5:00.1: aie2_create_context: create context failed, ret -22\n"


def test_kernel_log_parses_kmsg_records():
    messages = doctor.parse_kernel_log(KMSG_SVA.encode())
    assert messages == ["amdxdna 0000:c5:00.1: enabling device (0000 -> 0002)",
                        "amdxdna 0000:c5:00.1: SVA bind device failed, ret -95"]


@pytest.mark.parametrize("log, status, words", [
    (KMSG_SVA, FAIL, "enable the IOMMU"),
    (KMSG_FAULT, WARN, "AMDXDNA_TRACE=1"),
    (KMSG_CTX, WARN, "context limit"),
    ("6,1,1,-;Linux version 6.18.0\n", PASS, ""),
])
def test_kernel_log_findings(tmp_path, log, status, words):
    host = host_for(make_tree(tmp_path, kmsg=log))
    result = doctor.check_kernel_log(host)
    assert result.status == status
    assert words in result.fix


def test_kernel_log_unreadable_is_skipped(tmp_path):
    host = host_for(make_tree(tmp_path))  # no dev/kmsg in the tree
    result = doctor.check_kernel_log(host)
    assert result.status == SKIP
    assert "ENOENT" in result.detail
    assert "dmesg" in result.fix


# --- device checks on the emulator ----------------------------------------------------------------------


def by_name(results) -> dict[str, doctor.CheckResult]:
    return {r.name: r for r in results}


def test_all_checks_pass_on_the_emulator():
    results = by_name(doctor.run_checks("emu:npu4", host=host_for(Path("/nonexistent"))))
    assert [results[n].status for n in doctor.DEVICE_CHECKS] == [PASS] * 4
    assert results["node"].status == results["kernel-log"].status == SKIP
    assert results["contexts"].detail.startswith("0 context(s) live of 16")  # NPU4 firmware limit (spec 8)
    assert "bo0 -> bo1" in results["self-test"].detail


def test_contexts_held_by_another_fd_fail_and_name_the_pid():
    with EmuDevice("npu1") as emu:
        held = []
        with open_device(emu) as other:
            xclbin = build_mlir_aie(b"pdi", column_width=1, n_buffers=2)
            for _ in range(6):  # the NPU1 firmware limit (spec 8)
                held.append(other.hw_context(xclbin))
            results = by_name(doctor.run_checks(emu, host=host_for(Path("/nonexistent"))))
            live = other.hw_contexts()
    result = results["contexts"]
    assert len(live) == 6
    assert result.status == FAIL
    assert f"6 live; held by pid(s) {os.getpid()}" in result.detail
    assert "allows 6 context(s)" in result.fix


@needs_fixture
def test_self_test_with_the_npu1_fixture():
    with EmuDevice("npu1") as emu:
        with open_device(emu) as dev:
            result = doctor.check_self_test(dev, NPU1_1COL / "aie.xclbin", NPU1_1COL / "insts.bin")
    assert result.status == PASS
    assert "64 bytes (bo0 -> bo2)" in result.detail  # patches slots 0 and 2; output BD 16 words (spec 2.3)


def test_context_probe_asks_one_column_with_the_runtimes_qos():
    # Spec 2.1 create_hwctx: qos_p u64 @16, max_opc u32 @32, num_tiles u32 @36; spec 12: the out-of-tree
    # driver reads a 32-byte qos_info whose u32 user_start_col @24 must be 0xFF ("not requested").
    seen = []

    def record(request: bytes) -> int:
        qos_p, = struct.unpack_from("<Q", request, 16)
        max_opc, num_tiles = struct.unpack_from("<II", request, 32)
        seen.append((ctypes.string_at(qos_p, 32), max_opc, num_tiles))
        return 0

    with EmuDevice("npu4") as emu:
        with open_device(AlteredDriver(emu, fail={DRM_IOCTL_AMDXDNA_CREATE_HWCTX: record})) as dev:
            result = doctor.check_contexts(dev)
            live_after = dev.hw_contexts()
    assert result.status == PASS and live_after == []  # created and destroyed again
    assert seen == [(bytes(24) + (0xFF).to_bytes(4, "little") + bytes(4), 0, 4)]  # one column = 4 core rows (spec 8)


def test_self_test_design_with_one_buffer_is_unusable():
    one_slot = insts.encode(insts.dma_stream(3, [(0, 64, "in")]))
    with EmuDevice("npu1") as emu:
        with open_device(emu) as dev:
            result = doctor.check_self_test(dev, write(build_mlir_aie(b"pdi", column_width=1, n_buffers=1)), one_slot)
    assert result.status == FAIL
    assert result.detail == ("self-test design unusable: self-test stream patches buffer slots [0]; "
                             "a passthrough needs two")


def test_self_test_skipped_on_a_real_device_without_a_design():
    real = SimpleNamespace(emulator=None)
    result = doctor.check_self_test(real)
    assert result.status == SKIP
    assert "--xclbin and --insts" in result.fix


# --- the command line -------------------------------------------------------------------------------------


def test_cli_missing_node(tmp_path, capsys):
    root = make_tree(tmp_path, node=False)
    assert main(["doctor", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] node" in out
    assert "fix: load the driver: `sudo modprobe amdxdna`" in out
    assert "[skip] contexts       not run: the node checks failed" in out


def test_cli_permission_denied(tmp_path, capsys):
    root = make_tree(tmp_path, mode=0o660)
    assert main(["doctor", "--root", str(root), "--user", "alice", "--json"]) == 1
    results = by_name(doctor.CheckResult(**r) for r in json.loads(capsys.readouterr().out))
    assert results["node"].status == PASS
    assert results["permission"].status == FAIL
    assert "usermod -aG render alice" in results["permission"].fix


def test_cli_node_that_is_not_a_drm_device(tmp_path, capsys):
    root = make_tree(tmp_path, mode=0o600)
    assert main(["doctor", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "[pass] permission" in out
    assert "[FAIL] feature-level  open failed: VERSION" in out and "ENOTTY" in out
    assert "not a DRM device" in out


def test_cli_unknown_user_is_a_usage_error(tmp_path, capsys):
    assert main(["doctor", "--root", str(make_tree(tmp_path)), "--user", "mallory"]) == 2
    assert "'mallory'" in capsys.readouterr().err


def test_cli_emulator_passes(tmp_path, capsys):
    root = make_tree(tmp_path, node=False)  # the emulator needs no node; the root only names the user
    assert main(["doctor", "--device", "emu:npu1", "--root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [
        ["[skip]", "node"], ["[skip]", "permission"], ["[pass]", "memlock"], ["[skip]", "kernel-log"],
        ["[pass]", "feature-level"], ["[pass]", "firmware"], ["[pass]", "contexts"], ["[pass]", "self-test"]]
    assert "firmware 1.5.5.391" in lines[5]  # the npu1 profile's firmware, read back through GET_INFO
    assert "0 context(s) live of 6" in lines[6]  # NPU1 firmware limit (spec 8)
    assert lines[-1] == "0 failed, 0 warning(s), 5 passed, 3 skipped"


def doctor_args(device, **overrides) -> argparse.Namespace:
    values = dict(root="/nonexistent", user=None, device=device, xclbin=None, insts=None, json=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def run_doctor(device, capsys, **overrides) -> tuple[int, dict[str, doctor.CheckResult]]:
    """``doctor --json`` on ``device`` (an EmuDevice or a stand-in); returns the exit code and the results."""
    rc = doctor_cmd.run(doctor_args(device, json=True, **overrides))
    return rc, by_name(doctor.CheckResult(**r) for r in json.loads(capsys.readouterr().out))


def test_cli_old_driver_numbering_fails_and_skips_the_rest(capsys):
    # A pre-December-2024 out-of-tree driver: nr 0x47 is its WAIT_CMD, so GET_INFO is refused (spec 1b).
    with EmuDevice("npu1") as emu:
        old = AlteredDriver(emu, fail={DRM_IOCTL_AMDXDNA_GET_INFO: lambda req: errno.EINVAL})
        rc, results = run_doctor(old, capsys)
    assert rc == 1
    feature = results["feature-level"]
    assert feature.status == FAIL
    assert "0.10: GET_INFO(QUERY_AIE_METADATA) failed" in feature.detail and "EINVAL" in feature.detail
    assert "predates the December 2024 ioctl numbering" in feature.fix and "Linux >= 6.18" in feature.fix
    assert [results[n].status for n in doctor.DEVICE_CHECKS[1:]] == [SKIP] * 3
    assert results["firmware"].detail == "not run: the driver failed the feature-level check"


def test_cli_driver_without_timeline_syncobjs_fails(capsys):
    with EmuDevice("npu4") as emu:
        rc, results = run_doctor(AlteredDriver(emu, edit={DRM_IOCTL_GET_CAP: zero_cap_value}), capsys)
    assert rc == 1
    assert results["feature-level"].status == FAIL
    assert "DRM_CAP_SYNCOBJ_TIMELINE is 0" in results["feature-level"].detail
    assert "amd/xdna-driver DKMS" in results["feature-level"].fix


def test_cli_linux_6_14_driver_warns_but_passes(capsys):
    with EmuDevice("npu1", drm_minor=0) as emu:  # Linux 6.14-6.17 feature level (spec 11)
        assert doctor_cmd.run(doctor_args(emu)) == 0  # a warning is not a failure
    out = capsys.readouterr().out
    assert "[WARN] feature-level  amdxdna_accel_driver 0.0: GET_ARRAY unavailable (EINVAL)" in out
    assert "fix: use Linux >= 6.18" in out
    assert "[pass] self-test" in out  # kernels still run at feature level 0.0
    assert "0 context(s) live of 6;" in out  # no QUERY_RESOURCE_INFO before 0.4: the NPU1 limit of spec 8


def test_cli_unreadable_firmware_version_fails(capsys):
    with EmuDevice("npu4") as emu:
        rc, results = run_doctor(AlteredDriver(emu, fail=failing_query(QUERY_FIRMWARE_VERSION, errno.EIO)), capsys)
    assert rc == 1
    assert results["feature-level"].status == PASS
    firmware = results["firmware"]
    assert firmware.status == FAIL
    assert "firmware version unreadable: GET_INFO(" in firmware.detail and "EIO" in firmware.detail
    assert "amdnpu/<devid>_<rev>/npu.sbin" in firmware.fix


def test_firmware_disagreeing_with_sysfs_warns():
    with EmuDevice("npu4") as emu:
        with open_device(emu) as dev:
            agree = doctor.check_firmware(dev, "1.0.0.63")  # the npu4 profile's version (emulator)
            differ = doctor.check_firmware(dev, "1.0.0.50")
    assert agree.status == PASS
    assert differ.status == WARN
    assert differ.detail == "firmware 1.0.0.63, but sysfs fw_version says 1.0.0.50"
    assert "modprobe -r amdxdna" in differ.fix


@needs_fixture
def test_cli_self_test_failure_names_the_command_state(capsys):
    with EmuDevice("npu1") as emu:
        emu.faults.error(insts.encode(insts.load(NPU1_1COL / "insts.bin")))
        rc, results = run_doctor(emu, capsys, xclbin=str(NPU1_1COL / "aie.xclbin"),
                                 insts=str(NPU1_1COL / "insts.bin"))
    assert rc == 1
    assert results["self-test"].status == FAIL
    detail = results["self-test"].detail
    assert detail.startswith("passthrough kernel failed:") and "ERROR" in detail


def test_cli_malformed_self_test_design_fails_with_exit_1(tmp_path, capsys):
    (tmp_path / "bad.xclbin").write_bytes(b"not an xclbin at all")
    (tmp_path / "insts.bin").write_bytes(b"")
    with EmuDevice("npu1") as emu:
        rc, results = run_doctor(emu, capsys, xclbin=str(tmp_path / "bad.xclbin"), insts=str(tmp_path / "insts.bin"))
    assert rc == 1
    result = results["self-test"]
    assert result.status == FAIL
    assert result.detail.startswith(f"self-test design unusable: xclbin {tmp_path / 'bad.xclbin'}: axlf header")
    assert "amdxdna xclbin X" in result.fix


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    root = str(make_tree(tmp_path))
    assert main(["doctor", "--root", root, "--device", "emu:npu9"]) == 2
    assert "unknown emulator profile 'npu9' (profiles: npu1, npu4, npu5, npu6)" in capsys.readouterr().err
    assert main(["doctor", "--root", root, "--device", "emu:npu1", "--xclbin", "x.xclbin"]) == 2
    assert "--xclbin and --insts go together" in capsys.readouterr().err


def test_cli_environment_device_ignored_for_another_root(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AMDXDNA_DEVICE", "emu:npu1")  # names a device of this machine, not of the copied tree
    assert main(["doctor", "--root", str(make_tree(tmp_path, node=False))]) == 1
    assert "[FAIL] node" in capsys.readouterr().out


def test_cli_no_free_contexts_exit_1(capsys):
    with EmuDevice("npu4") as emu:
        emu.faults.cap_contexts(0)  # the firmware refuses every context (spec 4.1: EINVAL from the firmware step)
        assert doctor_cmd.run(doctor_args(emu)) == 1
    out = capsys.readouterr().out
    contexts = out[out.index("[FAIL] contexts"):].splitlines()
    assert "no context available: CREATE_HWCTX(num_tiles=4" in contexts[0] and "EINVAL" in contexts[0]
    assert contexts[1].strip() == ("fix: close the programs holding NPU contexts (`amdxdna info` lists them) or wait "
                                   "for them to finish; the firmware allows 0 context(s)")  # QUERY_RESOURCE_INFO
    assert contexts[2] == "[skip] self-test      not run: no hardware context is available"


def test_kernel_log_permission_denied_names_root(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file; the EACCES path needs an unprivileged user")
    host = host_for(make_tree(tmp_path, kmsg=KMSG_SVA))
    os.chmod(host.root / "dev/kmsg", 0)
    result = doctor.check_kernel_log(host)
    assert result.status == SKIP and "EACCES" in result.detail and result.fix.startswith("run as root")


def test_current_identity_is_named_from_the_roots_passwd(tmp_path):
    root = make_tree(tmp_path)
    assert Identity.current(root).name == "$USER"  # this process's uid is not in the fake passwd
    with open(root / "etc/passwd", "a") as passwd:
        passwd.write(f"carol:x:{os.geteuid()}:{os.getegid()}::/home/carol:/bin/sh\n")
    me = Identity.current(root)
    assert (me.name, me.uid) == ("carol", os.geteuid()) and os.getegid() in me.gids
