"""amdxdna doctor: host checks over a fake /dev + /sys + /etc tree, device checks on the emulator.

Oracles: the sysfs layout and PCI ids of docs/uapi.md 8 and docs/xrt-sequence.md 1.1, access(2)
rules for the mode bits, kmsg(4) record format, the feature levels of docs/uapi.md 1b and 11, the emulator's
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
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_cli_isolation
from fixture_files import REPO_FIXTURES
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
from amdxdna_direct.doctor import FAIL, INFO, PASS, SKIP, WARN, Host, Identity
from amdxdna_direct.emu import EmuDevice
from amdxdna_direct.xclbin import build_mlir_aie, write

# Every test here runs under the guard: no file of the real system is read (test_cli_isolation).
no_system_files = test_cli_isolation.no_system_files
pytestmark = pytest.mark.usefixtures("no_system_files")

NPU1_1COL = REPO_FIXTURES / "xdna/mlir-aie-npu1_1col"
needs_fixture = pytest.mark.skipif(not (NPU1_1COL / "aie.xclbin").exists(), reason=f"fixtures absent: {NPU1_1COL}")

NPU_SLOT = "0000:c5:00.1"
# The fake node's group, named render: this process's group, or (running as root, whose group is root's) 992.
RENDER_GID = os.getegid() if os.geteuid() != 0 else 992


def make_tree(tmp_path: Path, *, node: bool = True, mode: int = 0o660, driver: str | None = "amdxdna",
              device: str = "0x1502", revision: str = "0x00", kmsg: str | None = None,
              container: bool = False, release: str = "6.18.2-arch1-1", module: str | None = None,
              loaded: bool = False, node_gid: int | None = None) -> Path:
    """A fake root: dev/accel/accel0, its sysfs PCI device dir (linked from sys/bus/pci/devices, with a driver
    link unless ``driver`` is None), etc/passwd and etc/group, proc/sys/kernel/osrelease = ``release``.

    ``module``: the path of amdxdna.ko in lib/modules/<release>/modules.dep (None: no module for the kernel);
    ``loaded``: sys/module/amdxdna exists. The node's group is this process's group, named ``render``; ``bob``
    is in it, ``alice`` is not.
    """
    root = tmp_path / "root"
    pci = root / "sys/devices/pci0000:00/0000:00:08.2" / NPU_SLOT
    pci.mkdir(parents=True)
    if driver is not None:
        drivers = root / "sys/bus/pci/drivers" / driver
        drivers.mkdir(parents=True)
        (pci / "driver").symlink_to(os.path.relpath(drivers, pci))
    for name, value in (("vendor", "0x1022"), ("device", device), ("revision", revision), ("class", "0x118000"),
                        ("vbnv", "RyzenAI-npu1"), ("fw_version", "1.5.2.380"), ("device_type", "0")):
        (pci / name).write_text(value + "\n")
    add_pci_function(root, "0000:00:00.0", "0x1022", "0x14e8")  # an AMD host bridge: not an NPU
    bus = root / "sys/bus/pci/devices"
    (bus / NPU_SLOT).symlink_to(os.path.relpath(pci, bus))
    accel = root / "sys/class/accel/accel0"
    accel.mkdir(parents=True)
    (accel / "device").symlink_to(os.path.relpath(pci, accel))
    (root / "dev/accel").mkdir(parents=True)
    if node:
        (root / "dev/accel/accel0").write_bytes(b"")
        os.chmod(root / "dev/accel/accel0", mode)
        if RENDER_GID != os.getegid():
            os.chown(root / "dev/accel/accel0", -1, RENDER_GID)
    gid = RENDER_GID
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("alice:x:4242:4242::/home/alice:/bin/sh\nbob:x:4343:4343::/home/bob:/bin/sh\n")
    (root / "etc/group").write_text(f"render:x:{gid}:bob\nalice:x:4242:\nbob:x:4343:\n")
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text(release + "\n")
    if module is not None:
        (root / "lib/modules" / release).mkdir(parents=True)
        (root / "lib/modules" / release / "modules.dep").write_text(
            "kernel/drivers/gpu/drm/scheduler/gpu-sched.ko.zst:\n" f"{module}: kernel/drivers/gpu/drm/scheduler/"
            "gpu-sched.ko.zst\n")
    if loaded:
        (root / "sys/module/amdxdna").mkdir(parents=True)
    if kmsg is not None:
        (root / "dev/kmsg").write_text(kmsg)
    if container:
        (root / ".dockerenv").write_text("")
    return root


def add_pci_function(root: Path, slot: str, vendor: str, device: str) -> None:
    """Another PCI function under sys/bus/pci/devices (a plain directory, as the scan only reads attributes)."""
    function = root / "sys/bus/pci/devices" / slot
    function.mkdir(parents=True)
    for name, value in (("vendor", vendor), ("device", device), ("revision", "0x00"), ("class", "0x060000")):
        (function / name).write_text(value + "\n")


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
    # docs/uapi.md 8: 17f0 rev 10/11/20 are NPU4/5/6, 1502 rev 0 is NPU1
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
    assert f"--group-add {RENDER_GID}" in result.fix


def test_permission_granted_through_the_group(tmp_path):
    root = make_tree(tmp_path, mode=0o660)
    host = host_for(root, user="bob")
    assert host.identity == Identity(uid=4343, gids=frozenset({4343, RENDER_GID}), name="bob")
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


def test_memlock_default_8mib_is_info_without_xrt(tmp_path):
    host = host_for(make_tree(tmp_path), memlock=(8 << 20, 8 << 20))
    result = doctor.check_memlock(host)
    assert result.status == INFO  # amdxdna-direct maps nothing MAP_LOCKED (docs/doctor.md 4.3)
    assert "8192 KiB < 128 MiB" in result.detail and "maps nothing locked" in result.detail
    assert "ulimit -l unlimited" in result.fix


def test_memlock_default_8mib_warns_when_xrt_is_installed(tmp_path):
    root = make_tree(tmp_path)
    (root / "opt/xilinx/xrt").mkdir(parents=True)
    result = doctor.check_memlock(host_for(root, memlock=(8 << 20, 8 << 20)))
    assert result.status == WARN
    assert "XRT is installed" in result.detail and "MAP_LOCKED" in result.detail
    assert "LimitMEMLOCK=infinity" in result.fix


def test_memlock_enough_or_waived(tmp_path):
    root = make_tree(tmp_path)
    assert doctor.check_memlock(host_for(root, memlock=(256 << 20, 256 << 20))).status == PASS
    assert doctor.check_memlock(host_for(root, memlock=(64 << 10, 64 << 10), cap_ipc_lock=True)).status == PASS
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert doctor.check_memlock(host_for(root, memlock=unlimited)).status == PASS


# --- kernel log: the rule table against real lines (tests/doctor_kmsg_lines.txt) --------------------------

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
LINES_FILE = Path(__file__).with_name("doctor_kmsg_lines.txt")


def fixture_lines() -> list[tuple[str, str, str]]:
    """(verdict, rule, line) of every entry of doctor_kmsg_lines.txt."""
    rows = []
    for raw in LINES_FILE.read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            verdict, rule, line = (part.strip() for part in raw.split("|", 2))
            rows.append((verdict, rule, line))
    return rows


# What each rule must say: words of its meaning and of its fix (checked on the fixture line's finding).
RULE_TEXTS = {
    "iommu-translated": ("translates DMA", None),
    "iommu-passthrough": ("passthrough mode", "iommu=pt"),
    "out-of-tree": ("out-of-tree module", None),
    "unsigned-module": ("unsigned", "mokutil"),
    "pasid": ("IOMMU or its PASID support is unavailable", "enable the IOMMU in the firmware setup"),
    "probe-failed": ("probe failed", "modprobe -r amdxdna"),
    "firmware-missing": ("firmware file amdnpu/", "linux-firmware"),
    "protocol": ("driver/firmware mismatch: the firmware speaks protocol 7.", "a driver that speaks protocol 7"),
    "protocol-minor": ("firmware is older than the amdxdna driver requires", "newer npu.sbin"),
    "firmware-dead": ("did not start", "npu.sbin"),
    "smu": ("power controller (SMU)", "protocol line"),
    "sva-bind": ("shared virtual addressing", "IOVA"),
    "page-fault": ("NPU IOMMU page fault", "AMDXDNA_TRACE=1"),
    "page-fault-storm": ("a storm of NPU IOMMU page faults (1029)", "another kernel"),
    "ctx-refused": ("context limit was reached, or, if no context was live, the firmware is wedged",
                    "modprobe -r amdxdna"),
    "fw-command": ("the firmware failed MAP_HOST_BUFFER (INVALID_PARAM)", "repeats for every program"),
    "heap-refused": ("refused to map the process's device heap", "64 MiB-aligned"),
    "driver-error": ("other amdxdna errors", "dmesg | grep amdxdna"),
    "mailbox-timeout": ("stopped answering", "pci/rescan"),
    "debug-bo": ("harmless", None),
    "pmf": ("sensors are unavailable", None),
    "initialized": ("amdxdna bound an NPU (DRM version 0.0.0)", None),
}


@pytest.mark.parametrize("verdict, rule, line", fixture_lines(), ids=lambda v: v[:40] if isinstance(v, str) else v)
def test_each_real_line_gets_its_verdict_and_fix(verdict, rule, line):
    findings = doctor.classify(doctor.parse_kernel_records((line + "\n").encode()))
    if verdict == "none":
        assert findings == []
        return
    assert [(f.rule, f.verdict, f.count) for f in findings] == [(rule, verdict, 1029 if "suppressed" in line else 1)]
    meaning_words, fix_words = RULE_TEXTS[rule]
    assert meaning_words in findings[0].meaning
    if fix_words is None:
        assert findings[0].verdict in (PASS, INFO)
    else:
        assert fix_words in findings[0].fix


def test_every_rule_has_a_real_line_and_its_texts():
    covered = {rule for _, rule, _ in fixture_lines()}
    assert {rule.key for rule in doctor.LOG_RULES} == covered - {"-"} == set(RULE_TEXTS)


def test_the_iommu_boot_lines_are_not_page_faults(tmp_path):
    # "Default" contains "fault": neither boot line may give a page-fault warning.
    log = ("6,10,417023,-;iommu: Default domain type: Translated\n"
           "6,11,418000,-;iommu: DMA domain TLB invalidation policy: lazy mode\n")
    result = doctor.check_kernel_log(host_for(make_tree(tmp_path, kmsg=log)))
    assert result.status == PASS
    assert [f["rule"] for f in result.findings] == ["iommu-translated"]
    assert "fault" not in result.detail.replace("Default", "")


def test_every_match_is_reported_deduplicated_with_counts_and_last_time(tmp_path):
    log = ("3,1,5573771,-;amdxdna 0000:c6:00.1: [drm] *ERROR* aie2_get_mgmt_chann_info: Invalid mbox magic 0x30ec000\n"
           "3,2,5573807,-;amdxdna 0000:c6:00.1: [drm] *ERROR* aie2_hw_start: firmware is not alive\n"
           "6,3,6000000,-;iommu: Default domain type: Passthrough (set via kernel command line)\n"
           "3,4,9100000,-;amdxdna 0000:c6:00.1: [drm] *ERROR* aie2_hw_start: firmware is not alive\n"
           "3,5,9200000,-;amdxdna 0000:c6:00.1: [drm] *ERROR* amdxdna_probe: Hardware init failed, ret -22\n")
    result = doctor.check_kernel_log(host_for(make_tree(tmp_path, kmsg=log)))
    found = {f["rule"]: (f["verdict"], f["count"], f["time"]) for f in result.findings}
    assert found == {"firmware-dead": (FAIL, 3, 9.1), "probe-failed": (FAIL, 1, 9.2),
                     "iommu-passthrough": (INFO, 1, 6.0)}
    assert result.status == FAIL
    assert result.detail.startswith("the NPU firmware did not start") and "(3x, last at 9.100 s)" in result.detail
    assert "(+2 more finding(s))" in result.detail and "5 messages of this boot" in result.detail


def test_pasid_and_hardware_init_say_the_iommu_is_missing():
    lines = [doctor.LogLine(text) for _, rule, text in fixture_lines() if rule in ("pasid", "probe-failed")][:2]
    findings = doctor.classify(lines)
    assert [f.rule for f in findings] == ["pasid", "probe-failed"]  # the cause leads, the generic line follows
    assert doctor._probe_failure(findings).rule == "pasid"


def test_context_refusal_depends_on_the_live_contexts():
    lines = [doctor.LogLine(text) for _, rule, text in fixture_lines() if rule == "ctx-refused"]
    idle, busy = (doctor.classify(lines, context=doctor.LogContext(live_contexts=n, npu_slots=(NPU_SLOT,)))
                  for n in (0, 16))
    assert [(f.rule, f.verdict, f.count) for f in idle] == [("ctx-refused", FAIL, 2)]
    assert "wedged" in idle[0].meaning
    assert f"/sys/bus/pci/devices/{NPU_SLOT}/remove" in idle[0].fix and "reboot" in idle[0].fix
    assert busy[0].verdict == FAIL and "context limit was reached" in busy[0].meaning and "16 live" in busy[0].meaning
    assert "close programs holding NPU contexts" in busy[0].fix and "modprobe" not in busy[0].fix


def test_one_page_fault_is_not_a_storm():
    fault = ("amdxdna 0000:c5:00.1: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0001 address=0x7f5f245a{:x}000 "
             "flags=0x0007]")
    one = doctor.classify([doctor.LogLine(fault.format(0), 1.0)])
    many = doctor.classify([doctor.LogLine(fault.format(i), 1.0 + i) for i in range(doctor.PAGE_FAULT_STORM)])
    assert [(f.verdict, f.count) for f in one] == [(WARN, 1)] and "storm" not in one[0].meaning
    assert [(f.verdict, f.count, f.time) for f in many] == [(WARN, doctor.PAGE_FAULT_STORM, 10.0)]
    assert many[0].meaning.startswith("a storm of NPU IOMMU page faults (10)")


def test_another_devices_page_faults_are_not_the_npus():
    line = ("iommu ivhd0: AMD-Vi: Event logged [IO_PAGE_FAULT device=0000:c6:00.0 domain=0x000b "
            "address=0x1000 flags=0x0020]")
    gpu, npu = (doctor.classify([doctor.LogLine(line.replace("c6:00.0", dev))],
                                context=doctor.LogContext(npu_slots=(NPU_SLOT,))) for dev in ("c6:00.0", "c5:00.1"))
    assert (gpu[0].verdict, npu[0].verdict) == (INFO, WARN)
    assert "another device (0000:c6:00.0)" in gpu[0].meaning


def test_protocol_mismatch_names_driver_and_firmware():
    line = next(text for _, rule, text in fixture_lines() if rule == "protocol")
    driver = "the in-tree amdxdna (kernel 6.19.3)"
    finding, = doctor.classify([doctor.LogLine(line)], context=doctor.LogContext(driver=driver))
    assert finding.meaning == (f"driver/firmware mismatch: the firmware speaks protocol 7.3, which {driver} does not "
                               "accept (it requires its own protocol major, and a minor at least its own)")
    assert driver in finding.fix and "protocol 7" in finding.fix


def test_kernel_log_parses_kmsg_records():
    messages = doctor.parse_kernel_log(KMSG_SVA.encode())
    assert messages == ["amdxdna 0000:c5:00.1: enabling device (0000 -> 0002)",
                        "amdxdna 0000:c5:00.1: SVA bind device failed, ret -95"]
    records = doctor.parse_kernel_records(b"[ 2497.518269] host kernel: x\n", journal=True)
    assert records == [doctor.LogLine("x", 2497.518269)]


@pytest.mark.parametrize("log, status, words", [
    (KMSG_SVA, FAIL, "enable the IOMMU"),
    (KMSG_FAULT, WARN, "AMDXDNA_TRACE=1"),
    (KMSG_CTX, WARN, "dmesg | grep amdxdna"),
    ("6,1,1,-;Linux version 6.18.0\n", PASS, ""),
])
def test_kernel_log_findings(tmp_path, log, status, words):
    host = host_for(make_tree(tmp_path, kmsg=log))
    result = doctor.check_kernel_log(host)
    assert result.status == status
    assert words in result.fix


def test_kernel_log_unreadable_is_skipped(tmp_path):
    host = host_for(make_tree(tmp_path))  # no dev/kmsg in the tree, no journal for a copied root
    assert host.journal is None
    result = doctor.check_kernel_log(host)
    assert result.status == SKIP
    assert "ENOENT" in result.detail
    assert "dmesg" in result.fix


def fake_command(stdout: str, status: int = 0) -> list[str]:
    """A command printing ``stdout`` and exiting with ``status`` (stands for journalctl or modinfo)."""
    return [sys.executable, "-c", f"import sys; sys.stdout.write({stdout!r}); sys.exit({status})"]


def test_kernel_log_falls_back_to_the_journal_of_this_boot(tmp_path):
    host = host_for(make_tree(tmp_path))  # dev/kmsg absent: as restricted, the journal is asked
    host.journal = fake_command("[    5.573807] npu-host kernel: amdxdna 0000:c6:00.1: [drm] *ERROR* aie2_hw_start: "
                                "firmware is not alive\n")
    result = doctor.check_kernel_log(host)
    assert result.status == FAIL
    assert "in 1 messages of this boot (journalctl -k -b 0)" in result.detail
    assert [(f["rule"], f["time"], f["last"]) for f in result.findings] == [
        ("firmware-dead", 5.573807, "amdxdna 0000:c6:00.1: [drm] *ERROR* aie2_hw_start: firmware is not alive")]
    assert doctor.JOURNAL_COMMAND[:4] == ("journalctl", "-k", "-b", "0")  # the kernel log of the current boot only


def test_kernel_log_journal_refused_is_skipped_with_both_reasons(tmp_path):
    host = host_for(make_tree(tmp_path))
    host.journal = fake_command("", status=1)
    result = doctor.check_kernel_log(host)
    assert result.status == SKIP
    assert "dev/kmsg not readable (ENOENT)" in result.detail and "exit status 1" in result.detail
    assert result.fix.startswith("run as root")


# --- device checks on the emulator ----------------------------------------------------------------------


def by_name(results) -> dict[str, doctor.CheckResult]:
    return {r.name: r for r in results}


def test_all_checks_pass_on_the_emulator():
    results = by_name(doctor.run_checks("emu:npu4", host=host_for(Path("/nonexistent"))))
    assert [results[n].status for n in doctor.DEVICE_CHECKS] == [PASS] * 4
    assert results["node"].status == results["kernel-log"].status == SKIP
    assert results["contexts"].detail.startswith("0 context(s) live of 16")  # NPU4 firmware limit (docs/uapi.md 8)
    assert "bo0 -> bo1" in results["self-test"].detail


def test_contexts_held_by_another_fd_fail_and_name_the_pid():
    with EmuDevice("npu1") as emu:
        held = []
        with open_device(emu) as other:
            xclbin = build_mlir_aie(b"pdi", column_width=1, n_buffers=2)
            for _ in range(6):  # the NPU1 firmware limit (docs/uapi.md 8)
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
    # patches slots 0 and 2; output BD 16 words (docs/xrt-sequence.md 2.3)
    assert "64 bytes (bo0 -> bo2)" in result.detail


def test_context_probe_asks_one_column_with_the_runtimes_qos():
    # docs/uapi.md 2.1 create_hwctx: qos_p u64 @16, max_opc u32 @32, num_tiles u32 @36; docs/uapi.md 12: the out-of-tree
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
    # one column = 4 core rows (docs/uapi.md 8)
    assert seen == [(bytes(24) + (0xFF).to_bytes(4, "little") + bytes(4), 0, 4)]


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


def test_cli_missing_node_with_the_module_not_loaded(tmp_path, capsys):
    root = make_tree(tmp_path, node=False, driver=None, module="kernel/drivers/accel/amdxdna/amdxdna.ko.zst")
    assert main(["doctor", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] node" in out
    assert f"the NPU at {NPU_SLOT} (1022:1502 rev 00 (NPU1 (Phoenix, Hawk Point), npu1)) has no driver: in-tree " \
           "amdxdna for kernel 6.18.2-arch1-1 (not loaded)" in out
    assert "fix: load it: `sudo modprobe amdxdna`" in out
    assert "[skip] contexts       not run: the node checks failed" in out


def test_cli_permission_denied(tmp_path, capsys):
    root = make_tree(tmp_path, mode=0o660)
    assert main(["doctor", "--root", str(root), "--user", "alice", "--json"]) == 1
    results = by_name(doctor.CheckResult(**r) for r in json.loads(capsys.readouterr().out)["checks"])
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
    assert "0 context(s) live of 6" in lines[6]  # NPU1 firmware limit (docs/uapi.md 8)
    assert lines[-1] == "0 failed, 0 warning(s), 0 info, 5 passed, 3 skipped"


def doctor_args(device, **overrides) -> argparse.Namespace:
    values = dict(root="/nonexistent", user=None, device=device, xclbin=None, insts=None, json=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def run_doctor(device, capsys, **overrides) -> tuple[int, dict[str, doctor.CheckResult]]:
    """``doctor --json`` on ``device`` (an EmuDevice or a stand-in); returns the exit code and the results."""
    rc = doctor_cmd.run(doctor_args(device, json=True, **overrides))
    return rc, by_name(doctor.CheckResult(**r) for r in json.loads(capsys.readouterr().out)["checks"])


def test_cli_old_driver_numbering_fails_and_skips_the_rest(capsys):
    # A pre-December-2024 out-of-tree driver: nr 0x47 is its WAIT_CMD, so GET_INFO is refused (docs/uapi.md 1b).
    with EmuDevice("npu1", drm_minor=10) as emu:     # an old driver claiming feature level 0.10
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
    with EmuDevice("npu1", drm_minor=0) as emu:  # Linux 6.14-6.17 feature level (docs/uapi.md 11)
        assert doctor_cmd.run(doctor_args(emu)) == 0  # a warning is not a failure
    out = capsys.readouterr().out
    assert "[WARN] feature-level  amdxdna_accel_driver 0.0: GET_ARRAY unavailable (EINVAL)" in out
    assert "fix: use Linux >= 6.18" in out
    assert "[pass] self-test" in out  # kernels still run at feature level 0.0
    assert "0 context(s) live of 6;" in out  # no QUERY_RESOURCE_INFO before 0.4: the NPU1 limit of docs/uapi.md 8


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
        # the firmware refuses every context (docs/uapi.md 4.1: EINVAL from the firmware step)
        emu.faults.cap_contexts(0)
        assert doctor_cmd.run(doctor_args(emu)) == 1
    out = capsys.readouterr().out
    contexts = out[out.index("[FAIL] contexts"):].splitlines()
    assert "no context available: CREATE_HWCTX(num_tiles=4" in contexts[0] and "EINVAL" in contexts[0]
    assert "the firmware refuses contexts although none is live (it allows 0), so it is wedged" in contexts[0]
    assert contexts[1].strip().startswith("fix: reset the NPU, one step at a time")  # QUERY_RESOURCE_INFO: 0
    assert "modprobe -r amdxdna" in contexts[1] and "pci/rescan" in contexts[1] and "reboot" in contexts[1]
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


# --- no node: the PCI scan tells the cases apart (docs/doctor.md 3) ------------------------------------------

KMSG_PASSTHROUGH_AND_PROTOCOL = (
    "6,120,718807,-;iommu: Default domain type: Passthrough (set via kernel command line)\n"
    "6,900,6900000,-;amdxdna 0000:c5:00.1: enabling device (0000 -> 0002)\n"
    "3,901,6913201,-;amdxdna 0000:c5:00.1: [drm] *ERROR* aie2_check_protocol: Incompatible firmware protocol "
    "major 7 minor 3\n"
    "3,902,6913300,-;amdxdna 0000:c5:00.1: [drm] *ERROR* amdxdna_probe: Hardware init failed, ret -22\n"
)


def test_no_npu_on_the_pci_bus_says_enable_it_in_the_firmware_setup(tmp_path):
    root = make_tree(tmp_path, node=False, device="0x14e8")  # the only AMD functions are not NPUs
    add_pci_function(root, "0000:c5:00.0", "0x1002", "0x15bf")  # an AMD GPU (vendor 1002)
    result = doctor.check_node(host_for(root), None)
    assert result.status == FAIL
    assert "no AMD NPU among the 3 PCI functions" in result.detail and "1022:1502/17f0/" in result.detail
    assert "disabled in the firmware setup" in result.fix and "lspci -nn -d 1022:" in result.fix
    assert "modprobe" not in result.fix


def test_npu_without_a_module_for_the_running_kernel(tmp_path):
    root = make_tree(tmp_path, node=False, driver=None, release="6.17.9-200.fc42.x86_64")
    result = doctor.check_node(host_for(root), None)
    assert result.status == FAIL
    assert f"the NPU at {NPU_SLOT}" in result.detail
    assert "no amdxdna module for kernel 6.17.9-200.fc42.x86_64" in result.detail  # uname -r of the root
    assert "install the amdxdna module for kernel 6.17.9-200.fc42.x86_64" in result.fix and "DKMS" in result.fix
    assert "modprobe" not in result.fix


def test_npu_on_a_kernel_older_than_amdxdna(tmp_path):
    root = make_tree(tmp_path, node=False, driver=None, release="6.8.0-49-generic")
    result = doctor.check_node(host_for(root), None)
    assert "Linux 6.8.0-49-generic predates amdxdna (mainline from 6.14)" in result.fix


def test_out_of_tree_module_version_from_modinfo(tmp_path):
    root = make_tree(tmp_path, node=False, driver=None, module="updates/dkms/amdxdna.ko.zst")
    host = host_for(root)
    host.modinfo = fake_command("filename:       /lib/modules/x/updates/dkms/amdxdna.ko.zst\n"
                                "version:        2.21.0_20251110\nlicense:        GPL\n")
    state = doctor.module_state(host)
    assert state == doctor.ModuleState("6.18.2-arch1-1", False, "out-of-tree", "2.21.0_20251110",
                                       "updates/dkms/amdxdna.ko.zst")
    result = doctor.check_node(host, None)
    assert "out-of-tree amdxdna version 2.21.0_20251110 for kernel 6.18.2-arch1-1 (not loaded)" in result.detail
    assert result.fix.startswith("load it: `sudo modprobe amdxdna`")


def test_probe_failed_points_at_the_log_finding(tmp_path):
    root = make_tree(tmp_path, node=False, driver=None, loaded=True, kmsg=KMSG_PASSTHROUGH_AND_PROTOCOL,
                     module="kernel/drivers/accel/amdxdna/amdxdna.ko.zst")
    host = host_for(root)
    result = doctor.check_node(host, None, doctor.classify(doctor.kernel_log(host).lines))
    assert result.status == FAIL
    assert "although in-tree amdxdna for kernel 6.18.2-arch1-1 (loaded): the driver's probe failed: " \
           "driver/firmware mismatch: the firmware speaks protocol 7.3" in result.detail
    assert "modprobe amdxdna`" not in result.fix.replace("modprobe -r amdxdna && sudo modprobe amdxdna`", "")
    assert "protocol 7" in result.fix


def test_probe_failed_without_a_readable_log_says_read_it(tmp_path):
    root = make_tree(tmp_path, node=False, driver=None, loaded=True)
    result = doctor.check_node(host_for(root), None, ())
    assert "the driver's probe failed" in result.detail
    assert result.fix.startswith("read why in the kernel log: `sudo dmesg | grep amdxdna`")


def test_cli_passthrough_and_protocol_mismatch_without_a_node_report_the_mismatch(tmp_path, capsys):
    # The case: no node, an IOMMU passthrough line and the protocol line; nothing about modprobe.
    root = make_tree(tmp_path, node=False, driver=None, loaded=True, kmsg=KMSG_PASSTHROUGH_AND_PROTOCOL)
    assert main(["doctor", "--root", str(root), "--json"]) == 1
    results = by_name(doctor.CheckResult(**r) for r in json.loads(capsys.readouterr().out)["checks"])
    node, log = results["node"], results["kernel-log"]
    assert node.status == FAIL and "driver/firmware mismatch" in node.detail
    assert "sudo modprobe amdxdna`" not in node.fix and "load it" not in node.fix
    assert log.status == FAIL and log.detail.startswith("driver/firmware mismatch: the firmware speaks protocol 7.3")
    assert [(f["rule"], f["verdict"]) for f in log.findings] == [
        ("protocol", FAIL), ("probe-failed", FAIL), ("iommu-passthrough", INFO)]
    assert all("page fault" not in f["meaning"] for f in log.findings)


def test_cli_text_lists_every_finding(tmp_path, capsys):
    root = make_tree(tmp_path, node=False, driver=None, loaded=True, kmsg=KMSG_PASSTHROUGH_AND_PROTOCOL)
    assert main(["doctor", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    block = out[out.index("[FAIL] kernel-log"):out.index("[skip] feature-level")].splitlines()
    assert block[0].startswith("[FAIL] kernel-log     driver/firmware mismatch") and "(1x, last at 6.913 s)" in block[0]
    assert block[1].strip().startswith("fix: make driver and firmware match")
    assert block[2].strip().startswith("[FAIL] the driver's probe failed")
    assert block[2].endswith("(1x, last at 6.913 s)")
    assert block[4].strip() == ("[info] the IOMMU runs in passthrough mode (iommu=pt): amdxdna still needs its "
                                "PASID/SVA support (1x, last at 0.719 s)")


def test_bound_npu_without_a_node_in_a_container(tmp_path):
    root = make_tree(tmp_path, node=False, container=True)
    result = doctor.check_node(host_for(root), None)
    assert "although amdxdna drives the NPU" in result.detail
    assert "--device /dev/accel/accel0" in result.fix


def test_npu_bound_to_vfio(tmp_path):
    root = make_tree(tmp_path, node=False, driver="vfio-pci")
    result = doctor.check_node(host_for(root), None)
    assert "is bound to 'vfio-pci', not amdxdna" in result.detail
    assert f"echo {NPU_SLOT} | sudo tee /sys/bus/pci/drivers/vfio-pci/unbind" in result.fix


# --- the right fixes ---------------------------------------------------------------------------------------


def test_root_only_node_gets_a_udev_rule_not_the_root_group(tmp_path):
    root = make_tree(tmp_path, mode=0o600)
    node = root / "dev/accel/accel0"
    host = host_for(root, user="alice")
    st = os.stat(node)
    fake = os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, 0, 0, *st[6:]))  # root:root 0600
    fix = doctor._permission_fix(host, fake, "root")
    assert doctor.UDEV_RULE_FILE in fix and 'DRIVERS=="amdxdna", GROUP="render", MODE="0660"' in fix
    assert "udevadm trigger" in fix and "usermod -aG render alice" in fix
    assert "-aG root" not in fix
    result = doctor.check_permission(host, node)  # this process owns the file: alice sees mode 0600, other bits 0
    assert result.status == FAIL and "udev rule" in result.fix


def test_group_node_still_gets_the_group_fix(tmp_path):
    root = make_tree(tmp_path, mode=0o660)
    host = host_for(root, user="alice")
    fix = doctor.check_permission(host, doctor.node_path(host, None)).fix
    assert "usermod -aG render alice" in fix and "udev" not in fix


def test_a_lost_device_gets_the_reset_ladder(capsys):
    with EmuDevice("npu4") as emu:
        emu.faults.lose_device()
        rc, results = run_doctor(emu, capsys)
    feature = results["feature-level"]
    assert rc == 1 and feature.status == FAIL and "ENODEV" in feature.detail
    assert "modprobe -r amdxdna" in feature.fix and "/remove" in feature.fix and "pci/rescan" in feature.fix
    assert "reboot" in feature.fix and "Linux >= 6.18" not in feature.fix  # not "update the driver"


def test_a_device_lost_during_the_checks_gets_the_reset_ladder(capsys):
    with EmuDevice("npu4") as emu:
        lost = AlteredDriver(emu, fail={DRM_IOCTL_AMDXDNA_GET_INFO: lambda req: errno.ENODEV})
        rc, results = run_doctor(lost, capsys)
    assert rc == 1
    assert results["feature-level"].detail.startswith("the device is lost: ")
    assert "pci/rescan" in results["feature-level"].fix and "DKMS" not in results["feature-level"].fix
    assert results["firmware"].detail == "not run: the device is lost"


@pytest.mark.parametrize("marker, content, name, words", [
    (".dockerenv", "", "docker", "--device /dev/accel/accel0 --group-add"),
    ("run/.containerenv", 'engine="podman-5.2"', "podman", "--group-add keep-groups"),
    ("run/.toolboxenv", "", "toolbox", "sees the host's /dev"),
    ("var/run/secrets/kubernetes.io/serviceaccount/token", "t", "kubernetes", "device plugin or a CDI device"),
    ("run/systemd/container", "lxc", "lxc", "lxc.cgroup2.devices.allow = c 261:* rwm"),
    ("run/systemd/container", "systemd-nspawn", "systemd-nspawn", "--bind=/dev/accel/accel0"),
    ("proc/1/cgroup", "0::/system.slice/containerd.service/abc", "containerd", "CDI device"),
])
def test_containers_are_recognised_with_their_own_fix(tmp_path, marker, content, name, words):
    root = make_tree(tmp_path, node=False)
    (root / marker).parent.mkdir(parents=True, exist_ok=True)
    (root / marker).write_text(content)
    host = host_for(root)
    assert host.container == name
    assert words in doctor.check_node(host, None).fix


def test_reset_ladder_is_in_order():
    ladder = doctor.reset_ladder(NPU_SLOT)
    steps = [ladder.index(s) for s in ("modprobe -r amdxdna", f"/sys/bus/pci/devices/{NPU_SLOT}/remove",
                                       "/sys/bus/pci/rescan", "reboot")]
    assert steps == sorted(steps)


def test_pci_scan_finds_the_npu_and_its_driver(tmp_path):
    root = make_tree(tmp_path, device="0x17f0", revision="0x10")
    npus, scanned = doctor.scan_pci(root)
    assert scanned == 2
    assert npus == [doctor.PciDevice(NPU_SLOT, 0x17F0, 0x10, 0x118000, "amdxdna")]
    assert npus[0].name == "1022:17f0 rev 10 (NPU4/5/6 (Strix Point, Strix Halo, Krackan), npu4)"
    assert doctor.scan_pci(tmp_path / "nothing") is None


def test_doctor_stream_extents_is_a_deprecated_alias_of_the_one_buffer_reach():
    stream = insts.dma_stream(4, [(0, 128, "in"), (1, 64, "out")])
    with pytest.warns(DeprecationWarning, match="insts.buffer_reach"):
        assert doctor.stream_extents(stream) == insts.buffer_reach(stream) == {0: 128, 1: 64}
