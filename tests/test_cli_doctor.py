"""amdxdna doctor: host checks over a fake /dev + /sys + /etc tree, device checks on the emulator.

Oracles: the sysfs layout and PCI ids of spec/amdxdna-uapi.md 8 and xrt-npu-sequence.md 1.1, access(2)
rules for the mode bits, kmsg(4) record format, and the emulator's own fault switches.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path
from types import SimpleNamespace

import pytest

from amdxdna_direct import doctor, open_device
from amdxdna_direct.cli import doctor_cmd, main
from amdxdna_direct.device import pci_generation
from amdxdna_direct.doctor import FAIL, PASS, SKIP, WARN, Host, Identity
from amdxdna_direct.emu import EmuDevice
from amdxdna_direct.xclbin import build_mlir_aie

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
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


def test_old_driver_without_get_array_warns():
    emu = EmuDevice("npu1", drm_minor=0)  # Linux 6.14-6.17 feature level (spec 11)
    try:
        result = by_name(doctor.run_checks(emu, host=host_for(Path("/nonexistent"))))["feature-level"]
    finally:
        emu.close()
    assert result.status == WARN
    assert "0.0: GET_ARRAY unavailable (EINVAL)" in result.detail  # empty table slot -> EINVAL (spec 4.0)
    assert "Linux >= 6.18" in result.fix


def test_firmware_context_limit_reached_fails():
    emu = EmuDevice("npu1")
    emu.faults.cap_contexts(0)
    try:
        results = by_name(doctor.run_checks(emu, host=host_for(Path("/nonexistent"))))
    finally:
        emu.close()
    assert results["contexts"].status == FAIL
    assert "CREATE_HWCTX(num_tiles=4" in results["contexts"].detail and "EINVAL" in results["contexts"].detail
    assert "close the programs holding NPU contexts" in results["contexts"].fix
    assert results["self-test"].status == SKIP


def test_contexts_held_by_another_fd_fail_and_name_the_pid():
    emu = EmuDevice("npu1")
    held = []
    try:
        with open_device(emu) as other:
            xclbin = build_mlir_aie(b"pdi", column_width=1, n_buffers=2)
            for _ in range(6):  # the NPU1 firmware limit (spec 8)
                held.append(other.hw_context(xclbin))
            results = by_name(doctor.run_checks(emu, host=host_for(Path("/nonexistent"))))
            live = other.hw_contexts()
    finally:
        emu.close()
    result = results["contexts"]
    assert len(live) == 6
    assert result.status == FAIL
    assert f"6 live; held by pid(s) {os.getpid()}" in result.detail
    assert "allows 6 context(s)" in result.fix


@needs_fixture
def test_self_test_with_the_npu1_fixture():
    emu = EmuDevice("npu1")
    try:
        with open_device(emu) as dev:
            result = doctor.check_self_test(dev, NPU1_1COL / "aie.xclbin", NPU1_1COL / "insts.bin")
    finally:
        emu.close()
    assert result.status == PASS
    assert "64 bytes (bo0 -> bo2)" in result.detail  # patches slots 0 and 2; output BD 16 words (spec 2.3)


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


def test_cli_emulator_passes(capsys):
    assert main(["doctor", "--device", "emu:npu1"]) == 0
    out = capsys.readouterr().out
    assert "[pass] self-test" in out
    assert out.splitlines()[-1].startswith("0 failed")


def test_cli_no_free_contexts_exit_1(capsys):
    emu = EmuDevice("npu4")
    emu.faults.cap_contexts(0)
    args = argparse.Namespace(root="/nonexistent", user=None, device=emu, xclbin=None, insts=None, json=False)
    try:
        assert doctor_cmd.run(args) == 1
    finally:
        emu.close()
    out = capsys.readouterr().out
    assert "[FAIL] contexts" in out
    assert "fix: close the programs holding NPU contexts" in out


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
