"""The checks of the host: the node, its permission and the locked-memory limit (docs/doctor.md 3, 4)."""

from __future__ import annotations

import errno
import os
import re
import resource
import stat
from collections.abc import Sequence
from pathlib import Path

from ..device import pci_generation
from .host import Host, Identity, _read_colon_file, hex_attribute, sysfs_attributes
from .kernel_log import Finding, _probe_failure
from .pci import NPU_DEVICE_IDS, ModuleState, PciDevice, module_state, reset_ladder, scan_pci
from .results import FAIL, INFO, PASS, SKIP, WARN, CheckResult, _errno_name

# XRT maps the 64 MiB device heap and every buffer MAP_LOCKED (docs/doctor.md 4.3): the locked memory limit
# must cover the heap plus the working set of data buffers when XRT runs; this runtime locks nothing.
HEAP_SIZE = 64 << 20
MEMLOCK_NEEDED = HEAP_SIZE + (64 << 20)
# The mainline release that first ships amdxdna (CONFIG_DRM_ACCEL_AMDXDNA).
FIRST_KERNEL = (6, 14)

FIX_NO_NODE = ("load the driver: `sudo modprobe amdxdna` (mainline Linux >= 6.14, or the amd/xdna-driver DKMS "
               "module); check the NPU is listed by `lspci -nn -d 1022:` (1502 or 17f0) and enabled in the "
               "firmware setup")
FIX_CONTAINER_NODE = "start the container with the node passed in: `--device /dev/accel/accel0`"
UDEV_RULE = 'SUBSYSTEM=="accel", KERNEL=="accel[0-9]*", DRIVERS=="amdxdna", GROUP="render", MODE="0660"'
UDEV_RULE_FILE = "/etc/udev/rules.d/70-amdxdna.rules"


# --- node --------------------------------------------------------------------------------------------------


def check_node(host: Host, node: Path | None, log_findings: Sequence[Finding] = ()) -> CheckResult:
    """Node present and driven by amdxdna (the sysfs driver link of its PCI device).

    Without a node, the PCI scan and the module state say why (docs/doctor.md 3): no NPU, an NPU without a
    driver (module missing or not loaded), a failed probe (the kernel-log finding that explains it is quoted
    from ``log_findings``), the node missing in a container.
    """
    if node is None or not node.exists():
        return _diagnose_missing_node(host, node, log_findings)
    attributes = sysfs_attributes(host.root, node.name)
    driver = attributes.get("driver")
    if driver is None:
        return CheckResult("node", WARN, f"{node} exists but its sysfs driver link is unreadable",
                           "check /sys is mounted (containers: mount sysfs read-only)")
    if driver != "amdxdna":
        return CheckResult("node", FAIL, f"{node} is driven by {driver!r}, not amdxdna",
                           "this node is another accelerator: pass the NPU's node with --device")
    return CheckResult("node", PASS, f"{node} driven by amdxdna ({_describe_pci(attributes)})")


def _diagnose_missing_node(host: Host, node: Path | None, findings: Sequence[Finding]) -> CheckResult:
    where = node if node is not None else host.root / "dev/accel/accel*"
    missing = f"no device node {where}"
    container = host.container
    scan = scan_pci(host.root)
    if scan is None:
        fix = _container_node_fix(container) if container else FIX_NO_NODE
        return CheckResult("node", FAIL, f"{missing}; {host.root / 'sys/bus/pci/devices'} cannot be listed, so "
                           "the PCI bus was not scanned", fix + "; mount sysfs to let the doctor scan the PCI bus")
    npus, scanned = scan
    if not npus:
        if container:
            return CheckResult("node", FAIL, f"{missing}; no NPU among the {scanned} PCI functions this "
                               f"{container} container sees", _container_node_fix(container))
        return CheckResult("node", FAIL, f"{missing}; no AMD NPU among the {scanned} PCI functions of "
                           f"{host.root / 'sys/bus/pci/devices'} (looked for 1022:"
                           f"{'/'.join(f'{d:04x}' for d in NPU_DEVICE_IDS)})",
                           "this machine has no Ryzen AI NPU, or it is disabled in the firmware setup: enable it "
                           "there (an option named IPU, NPU or AMD IPU Device), then `lspci -nn -d 1022:` lists "
                           "1022:1502 or 1022:17f0")
    npu = npus[0]
    if npu.driver == "amdxdna":
        fix = _container_node_fix(container) if container else (
            "the driver is bound but no node appeared: check devtmpfs is mounted on /dev and udev runs "
            "(`ls /sys/class/accel`); reloading the driver recreates it: " + reset_ladder(npu.slot))
        return CheckResult("node", FAIL, f"{missing}, although amdxdna drives the NPU at {npu.slot}", fix)
    if npu.driver is not None:
        return CheckResult("node", FAIL, f"{missing}; the NPU at {npu.slot} ({npu.name}) is bound to "
                           f"{npu.driver!r}, not amdxdna",
                           f"release it from {npu.driver} (e.g. a VM passthrough) and bind amdxdna: `echo "
                           f"{npu.slot} | sudo tee /sys/bus/pci/drivers/{npu.driver}/unbind` then "
                           "`sudo modprobe amdxdna`")
    module = module_state(host)
    cause = _probe_failure(findings)
    if module.loaded or cause is not None:
        detail = (f"{missing}; the NPU at {npu.slot} ({npu.name}) has no driver although {module.describe()}: "
                  "the driver's probe failed")
        if cause is None:
            return CheckResult("node", FAIL, detail, "read why in the kernel log: `sudo dmesg | grep amdxdna` "
                               "(the kernel-log check could not tell); then " + reset_ladder(npu.slot))
        return CheckResult("node", FAIL, f"{detail}: {cause.meaning}", cause.fix)
    return _module_missing(missing, npu, module)


def _module_missing(missing: str, npu: PciDevice, module: ModuleState) -> CheckResult:
    detail = f"{missing}; the NPU at {npu.slot} ({npu.name}) has no driver: {module.describe()}"
    if module.origin is not None:
        return CheckResult("node", FAIL, detail, "load it: `sudo modprobe amdxdna` (and add amdxdna to "
                           "/etc/modules-load.d/ if it does not load at boot)")
    too_old = _kernel_version(module.kernel) < FIRST_KERNEL if module.kernel else False
    why = (f"Linux {module.kernel} predates amdxdna (mainline from 6.14): install a kernel >= 6.14 or build the "
           "amd/xdna-driver DKMS module for it" if too_old else
           f"install the amdxdna module for kernel {module.kernel or '$(uname -r)'}: the distribution's extra-modules "
           "package of that kernel (CONFIG_DRM_ACCEL_AMDXDNA=m), or the amd/xdna-driver DKMS module built for it")
    return CheckResult("node", FAIL, detail, why)


def _kernel_version(release: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _container_node_fix(container: str | None) -> str:
    fixes = {
        "docker": "start the container with the node: `--device /dev/accel/accel0 --group-add <gid of the node>`",
        "podman": "start the container with the node: `--device /dev/accel/accel0 --group-add keep-groups`",
        "toolbox": "a toolbox container sees the host's /dev: fix the host (run `amdxdna doctor` there)",
        "kubernetes": "expose /dev/accel/accel0 to the pod through a device plugin or a CDI device, and add the "
                      "node's gid to securityContext.supplementalGroups",
        "containerd": "give the container the node through a CDI device (or `ctr run --device /dev/accel/accel0`)",
        "lxc": "allow and bind the node in the container's config: `lxc.cgroup2.devices.allow = c 261:* rwm` and "
               "`lxc.mount.entry = /dev/accel dev/accel none bind,optional,create=dir`",
        "systemd-nspawn": "start it with `--bind=/dev/accel/accel0 --property=DeviceAllow='/dev/accel/accel0 rw'`",
    }
    return fixes.get(container or "", FIX_CONTAINER_NODE)


def _describe_pci(attributes: dict[str, str]) -> str:
    device_id, revision = hex_attribute(attributes, "device"), hex_attribute(attributes, "revision")
    if device_id is None:
        return "PCI id unknown"
    gen = pci_generation(device_id, revision or 0) or "unknown generation"
    return f"PCI {attributes.get('pci_slot', '?')} {device_id:04x} rev {revision or 0:02x}: {gen}"


# --- permission --------------------------------------------------------------------------------------------


def _group_name(host: Host, gid: int) -> str | None:
    try:
        rows = _read_colon_file(host.root / "etc/group", "group lookup")
    except LookupError:
        return None
    return next((row[0] for row in rows if len(row) > 2 and row[2] == str(gid)), None)


def _mode_allows(st: os.stat_result, identity: Identity) -> bool:
    # access(2) rules for read+write: root bypasses, else the owner, group or other bits apply (first match).
    if identity.uid == 0:
        return True
    if st.st_uid == identity.uid:
        bits = stat.S_IRUSR | stat.S_IWUSR
    elif st.st_gid in identity.gids:
        bits = stat.S_IRGRP | stat.S_IWGRP
    else:
        bits = stat.S_IROTH | stat.S_IWOTH
    return st.st_mode & bits == bits


def _permission_fix(host: Host, st: os.stat_result, name: str | None) -> str:
    """The group fix, or a udev rule when the node's group gives nobody access (root's group or no group bits)."""
    user = host.identity.name
    if st.st_gid == 0 or not st.st_mode & stat.S_IRGRP or not st.st_mode & stat.S_IWGRP:
        fix = (f"the node belongs to {'root' if st.st_gid == 0 else f'group {name or st.st_gid}'} with mode "
               f"{stat.filemode(st.st_mode)}, so no group membership opens it: add a udev rule, "
               f"`echo '{UDEV_RULE}' | sudo tee {UDEV_RULE_FILE}`, then `sudo udevadm control --reload && sudo "
               f"udevadm trigger --subsystem-match=accel`, and `sudo usermod -aG render {user}` (log in again)")
    else:
        group = f"{name!r} (gid {st.st_gid})" if name else f"gid {st.st_gid}"
        fix = (f"add {user} to the node's group {group}: `sudo usermod -aG {name or st.st_gid} {user}` then log "
               "in again")
    container = host.container
    if container in ("docker", "podman"):
        fix += f"; in a container also pass `--group-add {st.st_gid}`" if container == "docker" else \
            "; in a podman container also pass `--group-add keep-groups`"
    elif container is not None:
        fix += f"; in this {container} container: " + _container_node_fix(container)
    return fix


def check_permission(host: Host, node: Path | None) -> CheckResult:
    """Whether the identity may open the node read-write (mode bits, then a real open unless impersonating)."""
    if node is None or not node.exists():
        return CheckResult("permission", SKIP, "no device node to check")
    st = node.stat()
    name = _group_name(host, st.st_gid)
    group = f"{name!r} (gid {st.st_gid})" if name else f"gid {st.st_gid}"
    fix = _permission_fix(host, st, name)
    if not _mode_allows(st, host.identity):
        return CheckResult("permission", FAIL, f"{host.identity.name} may not open {node} read-write "
                           f"(mode {stat.filemode(st.st_mode)}, group {group})", fix)
    if host.impersonated:
        return CheckResult("permission", PASS, f"{host.identity.name} may open {node} (mode bits; not opened)")
    return _try_open(node, fix, host)


def _try_open(node: Path, fix: str, host: Host) -> CheckResult:
    try:
        fd = os.open(node, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        name = _errno_name(exc.errno)
        if exc.errno == errno.EPERM:
            cgroup_fix = (_container_node_fix(host.container) if host.in_container
                          else "a device cgroup or LSM policy denies the node")
            return CheckResult("permission", FAIL, f"open({node}): EPERM", cgroup_fix)
        if exc.errno == errno.EACCES:
            return CheckResult("permission", FAIL, f"open({node}): EACCES", fix)
        if exc.errno == errno.ENODEV:
            return CheckResult("permission", FAIL, f"open({node}): ENODEV ({exc.strerror}): the device is gone "
                               "or its driver refused the open (see the kernel-log check: SVA bind)",
                               reset_ladder(sysfs_attributes(host.root, node.name).get("pci_slot")))
        return CheckResult("permission", FAIL, f"open({node}): {name} ({exc.strerror})",
                           "the driver refused the open: see the kernel-log check (SVA bind) below")
    os.close(fd)
    return CheckResult("permission", PASS, f"{node} opens read-write")


# --- memlock -----------------------------------------------------------------------------------------------


def check_memlock(host: Host) -> CheckResult:
    """RLIMIT_MEMLOCK against a 64 MiB heap plus buffers: only XRT maps MAP_LOCKED (docs/doctor.md 4.3).

    This runtime maps nothing locked, so a low limit is INFO; it is a WARN when XRT is installed under the
    root too (its programs share the limit).
    """
    soft, _hard = host.memlock
    if soft == resource.RLIM_INFINITY:
        return CheckResult("memlock", PASS, "locked-memory limit unlimited")
    if host.cap_ipc_lock:
        return CheckResult("memlock", PASS, f"limit {soft >> 10} KiB, waived by CAP_IPC_LOCK")
    if soft >= MEMLOCK_NEEDED:
        return CheckResult("memlock", PASS, f"locked-memory limit {soft >> 20} MiB")
    fix = ("for XRT programs raise it: `ulimit -l unlimited`, `* - memlock unlimited` in "
           "/etc/security/limits.conf, LimitMEMLOCK=infinity for services, `--ulimit memlock=-1:-1` for containers")
    limit = f"locked-memory limit {soft >> 10} KiB < {MEMLOCK_NEEDED >> 20} MiB (XRT's 64 MiB heap + buffers)"
    if host.xrt_installed:
        return CheckResult("memlock", WARN, f"{limit}, and XRT is installed ({host.root / 'opt/xilinx/xrt'}): "
                           "XRT maps the heap and its buffers MAP_LOCKED, so its programs fail to allocate", fix)
    return CheckResult("memlock", INFO, f"{limit}: enough for amdxdna-direct, which maps nothing locked; it "
                       "matters only for XRT", fix)
