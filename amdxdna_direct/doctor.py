"""Health checks of an amdxdna NPU setup, as a library (``amdxdna doctor`` prints them).

Every check returns a :class:`CheckResult` (pass / info / warn / fail / skip, what was found, and the fix).
Host-side checks read a filesystem root (``/`` normally, a fake ``/dev`` + ``/sys`` + ``/etc`` tree in
tests) described by :class:`Host`; device-side checks go through the runtime (:func:`open_device`), so
they run the same against a real ``/dev/accel/accelN`` and the emulator.

The facts behind every rule, fix and PCI id are in docs/doctor.md: the kernel-log rules and the driver
lines they match (docs/doctor.md 2), the PCI scan (3), the fixes and the reset ladder (4).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import stat
import subprocess
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import abi
from . import insts as insts_mod
from .device import Device, open_device, pci_generation
from .errors import ContextUnavailableError, DeviceLostError, XdnaError, errno_text
from .hwctx import create_hwctx, release_context
from .xclbin import Xclbin, build_mlir_aie

if TYPE_CHECKING:
    from .emu import EmuDevice, Model

__all__ = [
    "PASS", "INFO", "WARN", "FAIL", "SKIP", "DEVICE_CHECKS", "MEMLOCK_NEEDED", "NPU_DEVICE_IDS", "LOG_RULES",
    "CheckResult", "Identity", "Host", "PciDevice", "ModuleState", "LogLine", "LogRule", "Finding", "LogContext",
    "KernelLog",
    "find_nodes", "node_path", "sysfs_attributes", "hex_attribute", "is_emulated", "bind_model", "scan_pci",
    "module_state", "reset_ladder", "stream_extents", "check_node", "check_permission", "check_memlock",
    "check_kernel_log",
    "parse_kernel_log", "parse_kernel_records", "read_kernel_log", "kernel_log", "classify", "kernel_log_result",
    "check_feature_level", "check_firmware", "check_contexts", "check_self_test", "run_checks", "worst",
]

PASS, INFO, WARN, FAIL, SKIP = "pass", "info", "warn", "fail", "skip"
_SEVERITY = {SKIP: 0, PASS: 1, INFO: 2, WARN: 3, FAIL: 4}

# XRT maps the 64 MiB device heap and every buffer MAP_LOCKED (docs/doctor.md 4.3): the locked memory limit
# must cover the heap plus the working set of data buffers when XRT runs; this runtime locks nothing.
HEAP_SIZE = 64 << 20
MEMLOCK_NEEDED = HEAP_SIZE + (64 << 20)

# The PCI vendor id of AMD's NPUs and the device ids of the driver's PCI id table (docs/doctor.md 3).
AMD_VENDOR_ID = 0x1022
NPU_DEVICE_IDS = {0x1502: "NPU1 (Phoenix, Hawk Point)", 0x17F0: "NPU4/5/6 (Strix Point, Strix Halo, Krackan)",
                  0x17F1: "AIE4 NPU", 0x17F2: "AIE4 NPU", 0x17F3: "AIE4 NPU", 0x1B0A: "AIE4 NPU",
                  0x1B0B: "AIE4 NPU", 0x1B0C: "AIE4 NPU"}
# Attributes of the PCI device directory behind /sys/class/accel/accelN (docs/doctor.md 3).
SYSFS_ATTRIBUTES = ("vendor", "device", "subsystem_vendor", "subsystem_device", "revision", "vbnv",
                    "fw_version", "device_type")
# The mainline release that first ships amdxdna (CONFIG_DRM_ACCEL_AMDXDNA).
FIRST_KERNEL = (6, 14)

CAP_IPC_LOCK = 14  # linux/capability.h

# Kernel log of the current boot when /dev/kmsg is restricted (docs/doctor.md 2.1): monotonic timestamps.
JOURNAL_COMMAND = ("journalctl", "-k", "-b", "0", "-o", "short-monotonic", "--no-pager", "-q")
MODINFO_COMMAND = ("modinfo",)
SUBPROCESS_TIMEOUT = 30.0

FIX_NO_NODE = ("load the driver: `sudo modprobe amdxdna` (mainline Linux >= 6.14, or the amd/xdna-driver DKMS "
               "module); check the NPU is listed by `lspci -nn -d 1022:` (1502 or 17f0) and enabled in the "
               "firmware setup")
FIX_CONTAINER_NODE = "start the container with the node passed in: `--device /dev/accel/accel0`"
FIX_UPDATE_DRIVER = ("use Linux >= 6.18 (feature level 0.1+) or the amd/xdna-driver DKMS module; check with "
                     "`modinfo amdxdna`")
UDEV_RULE = 'SUBSYSTEM=="accel", KERNEL=="accel[0-9]*", DRIVERS=="amdxdna", GROUP="render", MODE="0660"'
UDEV_RULE_FILE = "/etc/udev/rules.d/70-amdxdna.rules"


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` is one of PASS, INFO, WARN, FAIL, SKIP; ``fix`` says what to do.

    ``findings`` is the kernel-log check's list of findings (each a dict, :meth:`Finding.to_dict`); empty
    for the other checks.
    """

    name: str
    status: str
    detail: str
    fix: str = ""
    findings: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The result as a plain dict (for ``--json``)."""
        result = asdict(self)
        result["findings"] = list(self.findings)
        return result


@dataclass(frozen=True)
class Identity:
    """Whose permissions the node is checked against: a user id and every group id it belongs to."""

    uid: int
    gids: frozenset[int]
    name: str

    @classmethod
    def current(cls, root: Path = Path("/")) -> Identity:
        """This process: effective uid, effective and supplementary groups; the name from ``root/etc/passwd``.

        Without a passwd entry the name is ``$USER``, so that a fix such as ``usermod -aG render $USER``
        stays a working command.
        """
        uid = os.geteuid()
        try:
            rows = _read_colon_file(root / "etc/passwd", "user lookup")
        except LookupError:
            rows = []
        name = next((row[0] for row in rows if len(row) > 2 and row[2] == str(uid)), "$USER")
        return cls(uid=uid, gids=frozenset([os.getegid(), *os.getgroups()]), name=name)

    @classmethod
    def lookup(cls, root: Path, user: str) -> Identity:
        """The identity of ``user`` (a name or a numeric uid) from ``root/etc/passwd`` and ``root/etc/group``.

        Raises:
            LookupError: the user is not in ``etc/passwd``, or that file is unreadable.
        """
        passwd = _read_colon_file(root / "etc/passwd", "user lookup")
        entry = next((row for row in passwd if len(row) > 3 and user in (row[0], row[2])), None)
        if entry is None:
            raise LookupError(f"user lookup({user!r}): not in {root / 'etc/passwd'}")
        name, uid, primary = entry[0], int(entry[2]), int(entry[3])
        groups = _read_colon_file(root / "etc/group", "group lookup") if (root / "etc/group").exists() else []
        gids = {primary} | {int(row[2]) for row in groups if len(row) > 3 and name in row[3].split(",")}
        return cls(uid=uid, gids=frozenset(gids), name=name)


def _errno_name(err: int | None) -> str:
    """``"ENOENT"`` for an errno value; its number when it has no name, ``"None"`` for an OSError without one."""
    return str(err) if err is None else errno.errorcode.get(err, str(err))


def _read_colon_file(path: Path, what: str) -> list[list[str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise LookupError(f"{what}: cannot read {path}: {_errno_name(exc.errno)}") from exc
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


@dataclass
class Host:
    """The machine the checks look at.

    ``root`` is the filesystem root (``/dev``, ``/sys``, ``/etc``, ``/dev/kmsg``, ``/lib/modules`` are read
    below it); ``identity`` whose permissions are evaluated (``impersonated`` when it is not this process, so
    the node is not actually opened); ``memlock`` the (soft, hard) RLIMIT_MEMLOCK and ``cap_ipc_lock`` whether
    the limit is waived, both of this process. ``journal`` and ``modinfo`` are the commands asked when
    ``/dev/kmsg`` is restricted and for an unloaded module's version; both default to the system's for the
    real root and to None (not asked) for any other root, whose logs are not this machine's.
    """

    root: Path = Path("/")
    identity: Identity = field(default_factory=Identity.current)
    impersonated: bool = False
    memlock: tuple[int, int] = field(default_factory=lambda: resource.getrlimit(resource.RLIMIT_MEMLOCK))
    cap_ipc_lock: bool = False
    journal: Sequence[str] | None = None
    modinfo: Sequence[str] | None = None

    @classmethod
    def probe(cls, root: str | os.PathLike[str] = "/", user: str | None = None) -> Host:
        """Describe this process on ``root``; ``user`` evaluates the node permissions for that user instead.

        Raises:
            LookupError: ``user`` is not known under ``root/etc/passwd``.
        """
        base = Path(root)
        identity = Identity.lookup(base, user) if user is not None else Identity.current(base)
        real = base.resolve() == Path("/")
        return cls(root=base, identity=identity, impersonated=user is not None, cap_ipc_lock=_has_cap_ipc_lock(),
                   journal=JOURNAL_COMMAND if real else None, modinfo=MODINFO_COMMAND if real else None)

    def path(self, absolute: str | os.PathLike[str]) -> Path:
        """``absolute`` (e.g. ``/dev/accel/accel0``) seen below this host's root."""
        return self.root / Path(absolute).relative_to("/") if Path(absolute).is_absolute() else Path(absolute)

    @property
    def container(self) -> str | None:
        """The container runtime the root runs in, from its marker files (docs/doctor.md 4.4), or None.

        One of ``docker``, ``podman``, ``toolbox``, ``kubernetes``, ``containerd``, ``lxc``, ``systemd-nspawn``
        or the name ``/run/systemd/container`` gives.
        """
        if (self.root / "run/.toolboxenv").exists():
            return "toolbox"
        if (self.root / "var/run/secrets/kubernetes.io").exists() or (self.root / "run/secrets/kubernetes.io").exists():
            return "kubernetes"
        if (self.root / ".dockerenv").exists():
            return "docker"
        if (self.root / "run/.containerenv").exists():
            return "podman"
        declared = _read_text(self.root / "run/systemd/container")
        if declared:
            return declared
        cgroup = _read_text(self.root / "proc/1/cgroup") or ""
        for marker, name in (("kubepods", "kubernetes"), ("containerd", "containerd"), ("lxc", "lxc")):
            if marker in cgroup:
                return name
        return None

    @property
    def in_container(self) -> bool:
        """Whether the root is a container's (:attr:`container` names the runtime)."""
        return self.container is not None

    @property
    def xrt_installed(self) -> bool:
        """Whether XRT is installed under the root (``/opt/xilinx/xrt``): its buffers are MAP_LOCKED."""
        return (self.root / "opt/xilinx/xrt").exists()

    @property
    def kernel_release(self) -> str | None:
        """``uname -r`` of the root's running kernel (``proc/sys/kernel/osrelease``), None when unreadable."""
        return _read_text(self.root / "proc/sys/kernel/osrelease")


def _has_cap_ipc_lock() -> bool:
    # The effective capability mask of this process (proc(5) "CapEff"), not a file of the checked root.
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return False
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", text, re.MULTILINE)
    return match is not None and bool(int(match.group(1), 16) >> CAP_IPC_LOCK & 1)


def _run(command: Sequence[str], *args: str) -> tuple[str | None, str]:
    """Run ``command + args``; (stdout, "") on exit 0, else (None, why it failed)."""
    try:
        done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                              check=False)
    except FileNotFoundError:
        return None, f"`{command[0]}` is not installed"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"`{command[0]}` failed: {exc}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return None, f"`{' '.join(command[:1])}` failed: {why}"
    return done.stdout, ""


def find_nodes(root: Path) -> list[Path]:
    """The ``dev/accel/accelN`` nodes below ``root``, in minor-number order."""
    nodes = [p for p in (root / "dev/accel").glob("accel*") if p.name[5:].isdigit()]
    return sorted(nodes, key=lambda p: int(p.name[5:]))


def node_path(host: Host, device: str | None) -> Path | None:
    """The node to check: ``device`` (a ``/dev/accel/accelN`` path) below the root, else the first one found."""
    if device is not None:
        return host.path(device)
    nodes = find_nodes(host.root)
    return nodes[0] if nodes else None


def sysfs_attributes(root: Path, accel_name: str) -> dict[str, str]:
    """The PCI attributes of ``accelN`` (``/sys/class/accel/accelN/device/*``), plus ``driver`` and ``pci_slot``.

    Attributes the driver or kernel does not provide are absent from the result.
    """
    device_dir = root / "sys/class/accel" / accel_name / "device"
    found: dict[str, str] = {}
    for name in SYSFS_ATTRIBUTES:
        try:
            found[name] = (device_dir / name).read_text().strip()
        except OSError:
            continue
    for name, link in (("driver", device_dir / "driver"), ("pci_slot", device_dir)):
        try:
            found[name] = Path(os.readlink(link)).name
        except OSError:
            continue
    return found


def hex_attribute(attributes: dict[str, str], name: str) -> int | None:
    """Sysfs attribute ``name`` (``"0x1502"``) as an int; None when absent or not hexadecimal."""
    try:
        return int(attributes[name], 16)
    except (KeyError, ValueError):
        return None


# --- the PCI scan and the module (docs/doctor.md 3) --------------------------------------------------------


@dataclass(frozen=True)
class PciDevice:
    """An AMD NPU function found under ``sys/bus/pci/devices``: slot, ids, class and the bound driver."""

    slot: str
    device: int
    revision: int
    pci_class: int | None
    driver: str | None

    @property
    def name(self) -> str:
        """``1022:17f0 rev 10 (NPU4/5/6 ..., npu4)``."""
        gen = pci_generation(self.device, self.revision)
        return (f"1022:{self.device:04x} rev {self.revision:02x} ({NPU_DEVICE_IDS[self.device]}"
                f"{', ' + gen if gen else ''})")


def scan_pci(root: Path) -> tuple[list[PciDevice], int] | None:
    """The AMD NPUs among ``root/sys/bus/pci/devices/*`` and how many PCI functions were looked at.

    None when that directory cannot be listed (sysfs not mounted, as in some containers).
    """
    base = root / "sys/bus/pci/devices"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return None
    found = []
    for slot in entries:
        attributes = {name: _read_text(base / slot / name) for name in ("vendor", "device", "revision", "class")}
        values = {name: _hex(text) for name, text in attributes.items()}
        if values["vendor"] != AMD_VENDOR_ID or values["device"] not in NPU_DEVICE_IDS:
            continue
        try:
            driver = Path(os.readlink(base / slot / "driver")).name
        except OSError:
            driver = None
        found.append(PciDevice(slot, values["device"], values["revision"] or 0, values["class"], driver))
    return found, len(entries)


def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


@dataclass(frozen=True)
class ModuleState:
    """The amdxdna module for the running kernel: loaded or not, where it comes from, its version.

    ``origin`` is ``in-tree`` (under ``kernel/`` of ``lib/modules/<release>``, or no out-of-tree taint when
    loaded), ``out-of-tree`` (``updates/``, ``extra/``, DKMS; taint ``O``), ``built-in`` or None (no module
    for this kernel).
    """

    kernel: str | None
    loaded: bool
    origin: str | None
    version: str | None
    path: str | None

    def describe(self) -> str:
        """``in-tree amdxdna of Linux 6.18.2 (loaded)`` and the like."""
        if self.origin is None:
            return f"no amdxdna module for kernel {self.kernel or '?'}"
        version = f" version {self.version}" if self.version else ""
        state = "loaded" if self.loaded else "not loaded"
        return f"{self.origin} amdxdna{version} for kernel {self.kernel or '?'} ({state})"


def module_state(host: Host) -> ModuleState:
    """What ``root/sys/module/amdxdna``, ``root/lib/modules/<release>/modules.{dep,builtin}`` and, for the real
    root, ``modinfo`` say about the amdxdna module of the running kernel."""
    release = host.kernel_release
    sysmod = host.root / "sys/module/amdxdna"
    loaded = sysmod.is_dir()
    path, origin = _module_file(host.root, release)
    version = _read_text(sysmod / "version") if loaded else None
    if loaded:
        taint = _read_text(sysmod / "taint") or ""
        origin = "out-of-tree" if "O" in taint else origin or "in-tree"
    if version is None and host.modinfo is not None and release and origin not in (None, "built-in"):
        fields = _modinfo(host.modinfo, release)
        version = fields.get("version")
        path = path or fields.get("filename")
    return ModuleState(release, loaded, origin, version, path)


def _module_file(root: Path, release: str | None) -> tuple[str | None, str | None]:
    if not release:
        return None, None
    base = root / "lib/modules" / release
    for line in (_read_text(base / "modules.dep") or "").splitlines():
        path = line.partition(":")[0]
        if re.search(r"(^|/)amdxdna\.ko(\.[a-z]+)?$", path):
            return path, "in-tree" if path.startswith("kernel/") else "out-of-tree"
    if re.search(r"(^|/)amdxdna\.ko$", _read_text(base / "modules.builtin") or "", re.MULTILINE):
        return None, "built-in"
    return None, None


def _modinfo(command: Sequence[str], release: str) -> dict[str, str]:
    out, _why = _run(command, "-k", release, "amdxdna")
    fields: dict[str, str] = {}
    for line in (out or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def reset_ladder(slot: str | None = None) -> str:
    """The fix for a hung, wedged or lost NPU: one step after the other until the device answers again."""
    where = slot or "<slot>"
    return ("reset the NPU, one step at a time until it answers (close the programs using it first): "
            "1. reload the driver: `sudo modprobe -r amdxdna && sudo modprobe amdxdna`; "
            f"2. remove and rescan the PCI function: `echo 1 | sudo tee /sys/bus/pci/devices/{where}/remove` then "
            "`echo 1 | sudo tee /sys/bus/pci/rescan`; 3. reboot (shut down fully if a reboot does not help)")


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


# --- kernel log (docs/doctor.md 2) -------------------------------------------------------------------------


@dataclass(frozen=True)
class LogLine:
    """One kernel message: its text and its time in seconds since boot (None when the format has none)."""

    text: str
    time: float | None = None


_KMSG_PREFIX = re.compile(r"(\d+),(\d+),(\d+)(,[^;]*)?;")
_BRACKET_TIME = re.compile(r"\[\s*(\d+\.\d+)\]\s?")
_JOURNAL_HOST = re.compile(r"\S+ kernel: ")


def parse_kernel_records(data: bytes, journal: bool = False) -> list[LogLine]:
    """The messages of a kernel log with their times.

    Formats: ``/dev/kmsg`` records (``pri,seq,usec,flags;text``, continuation lines skipped), ``dmesg`` lines
    (``[  5.512969] text``) and, with ``journal``, ``journalctl -o short-monotonic`` lines (``[  5.512969]
    host kernel: text``). Anything else is kept as one message without a time.
    """
    lines = []
    for raw in data.decode("utf-8", "replace").splitlines():
        if not raw.strip() or raw[0] == " ":  # /dev/kmsg continuation lines carry key=value metadata
            continue
        kmsg = _KMSG_PREFIX.match(raw)
        if kmsg:
            lines.append(LogLine(raw[kmsg.end():], int(kmsg.group(3)) / 1e6))
            continue
        stamp = _BRACKET_TIME.match(raw)
        if stamp:
            text = raw[stamp.end():]
            if journal:
                host = _JOURNAL_HOST.match(text)
                text = text[host.end():] if host else text
            lines.append(LogLine(text, float(stamp.group(1))))
            continue
        lines.append(LogLine(raw))
    return lines


def parse_kernel_log(data: bytes) -> list[str]:
    """The message texts of a kernel log (see :func:`parse_kernel_records`)."""
    return [line.text for line in parse_kernel_records(data)]


def read_kernel_log(path: Path, limit: int = 16 << 20) -> bytes:
    """Read ``path`` to its end without blocking (``/dev/kmsg`` returns one record per read, then EAGAIN).

    Raises:
        OSError: the log cannot be opened (EACCES/EPERM under kernel.dmesg_restrict, ENOENT).
    """
    chunks, total = [], 0
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        while total < limit:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # kmsg(4): the record was overwritten; the next read continues
                continue
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


@dataclass(frozen=True)
class KernelLog:
    """The kernel log of the current boot as read: its lines and where they came from, or why it could not be."""

    lines: tuple[LogLine, ...]
    source: str
    error: str = ""
    denied: bool = False


def kernel_log(host: Host, log: Path | None = None) -> KernelLog:
    """The current boot's kernel log: ``log`` if given, else ``root/dev/kmsg`` (the ring buffer holds only this
    boot), else, when that is restricted or absent, ``host.journal`` (``journalctl -k -b 0``)."""
    path = log if log is not None else host.root / "dev/kmsg"
    try:
        return KernelLog(tuple(parse_kernel_records(read_kernel_log(path))), str(path))
    except OSError as exc:
        name = _errno_name(exc.errno)
        denied = exc.errno in (errno.EACCES, errno.EPERM)  # kernel.dmesg_restrict=1 needs CAP_SYSLOG
        kmsg_error = f"{path} not readable ({name})"
    if log is not None or host.journal is None:
        return KernelLog((), str(path), kmsg_error, denied)
    out, why = _run(host.journal)
    if out is None:
        return KernelLog((), "journalctl -k -b 0", f"{kmsg_error}; {why}", True)
    return KernelLog(tuple(parse_kernel_records(out.encode(), journal=True)), "journalctl -k -b 0")


@dataclass(frozen=True)
class LogContext:
    """What the verdict of some rules depends on: the live context count (None: unknown), the driver in use,
    and the NPU's PCI slots (to tell its IOMMU faults from other devices')."""

    live_contexts: int | None = None
    driver: str = "the amdxdna driver"
    npu_slots: tuple[str, ...] = ()


@dataclass(frozen=True)
class LogRule:
    """A kernel-log rule: a regular expression, a verdict, what a matching line means and the fix.

    ``meaning`` and ``fix`` are ``str.format`` templates over the match's named groups plus ``driver``,
    ``reset`` (the reset ladder), ``opname`` and ``statusname`` (the firmware opcode and status decoded);
    ``resolve`` may change verdict, meaning and fix from the count and the :class:`LogContext`. ``probe``
    marks the lines of a failed probe (no node). ``source`` is the driver function or kernel file printing it.
    """

    key: str
    pattern: str
    verdict: str
    meaning: str
    fix: str
    source: str
    probe: bool = False
    resolve: Callable[[LogRule, int, dict[str, str], LogContext], tuple[str, str, str]] | None = None

    @property
    def regex(self) -> re.Pattern[str]:
        """The compiled pattern."""
        return _compiled(self.pattern)


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    if pattern not in _PATTERNS:
        _PATTERNS[pattern] = re.compile(pattern)
    return _PATTERNS[pattern]


# The firmware's mailbox opcodes and status codes a failed command names (docs/doctor.md 2.3).
FW_OPCODES = {0x2: "CREATE_CONTEXT", 0x3: "DESTROY_CONTEXT", 0x7: "SYNC_BO", 0x11: "CONFIG_CU",
              0x14: "CONFIG_DEBUG_BO", 0x101: "SUSPEND", 0x102: "RESUME", 0x103: "ASSIGN_MGMT_PASID",
              0x106: "MAP_HOST_BUFFER", 0x301: "GET_PROTOCOL_VERSION"}
FW_STATUSES = {0x2000001: "MGMT_ERT_SELF_TEST_FAILURE", 0x2000002: "MGMT_ERT_HASH_MISMATCH",
               0x2000003: "MGMT_ERT_NOAVAIL", 0x2000004: "MGMT_ERT_INVALID_PARAM",
               0x2000005: "MGMT_ERT_ENTER_SUSPEND_FAILURE", 0x2000006: "MGMT_ERT_BUSY",
               0x2000007: "MGMT_ERT_APPLICATION_ACTIVE", 0x3000001: "APP_ERT_FIRST_ERROR",
               0x3000002: "APP_INVALID_INSTR", 0x3000003: "APP_LOAD_PDI_FAIL", 0x4000001: "INVALID_INPUT_BUFFER",
               0x4000002: "INVALID_COMMAND", 0x4000003: "INVALID_PARAM", 0x4000006: "INVALID_OPERATION"}
# IOMMU faults of the NPU beyond this count are a storm: every command faults, not one stale address.
PAGE_FAULT_STORM = 10


def _context_refused(rule: LogRule, count: int, groups: dict[str, str], ctx: LogContext) -> tuple[str, str, str]:
    if ctx.live_contexts == 0:
        return (FAIL, "the firmware refuses new contexts although none is live: the firmware is wedged",
                reset_ladder(ctx.npu_slots[0] if ctx.npu_slots else None))
    if ctx.live_contexts is not None:
        return (FAIL, f"the firmware had no room for another context ({ctx.live_contexts} live): the context "
                "limit was reached", "close programs holding NPU contexts (`amdxdna info` lists them with their "
                "pids) or make fewer contexts per process")
    return (FAIL, "the firmware refused a context: its context limit was reached, or, if no context was live, "
            "the firmware is wedged", "close the programs holding contexts (`amdxdna info`); if none holds one: "
            + reset_ladder(ctx.npu_slots[0] if ctx.npu_slots else None))


def _page_faults(rule: LogRule, count: int, groups: dict[str, str], ctx: LogContext) -> tuple[str, str, str]:
    device = groups.get("device") or ""
    if device and ctx.npu_slots and not any(slot.endswith(device) for slot in ctx.npu_slots):
        return INFO, f"IOMMU page faults of another device ({device}), not the NPU", "not an NPU problem"
    if count >= PAGE_FAULT_STORM:
        return (WARN, f"a storm of NPU IOMMU page faults ({count}): the NPU's DMA misses its mappings on every "
                "access, so commands crawl, time out or return stale data",
                "if every program's commands fault, the kernel's IOMMU handling is at fault: try another kernel; if "
                "one program's do, it passes wrong buffers (group ids, stale handles): rerun it with "
                "AMDXDNA_TRACE=1; a storm can leave the NPU wedged: " + reset_ladder(
                    ctx.npu_slots[0] if ctx.npu_slots else None))
    return (WARN, f"{count} NPU IOMMU page fault(s): a command touched an address no buffer maps",
            "a command used a stale or wrong buffer address: rerun it with AMDXDNA_TRACE=1 and check its buffers")


def _protocol_mismatch(rule: LogRule, count: int, groups: dict[str, str], ctx: LogContext) -> tuple[str, str, str]:
    major, minor = groups["major"], groups["minor"]
    return (FAIL, f"driver/firmware mismatch: the firmware speaks protocol {major}.{minor}, which {ctx.driver} "
            "does not accept (it requires its own protocol major, and a minor at least its own)",
            f"make driver and firmware match: either install the npu.sbin for {ctx.driver} (the linux-firmware "
            f"release of that kernel's time, amdnpu/<devid>_<rev>/) or a driver that speaks protocol {major} (a "
            "newer kernel, or the amd/xdna-driver DKMS module with the firmware it ships); then reload amdxdna")


_IOMMU_FIX = ("enable the IOMMU in the firmware setup (IOMMU / AMD-Vi), remove `amd_iommu=off`, `iommu=off` and "
              "`iommu=pt` from the kernel command line and reboot; in a VM the NPU needs a PASID-capable vIOMMU, "
              "which hypervisors do not offer: run on the host")

LOG_RULES: tuple[LogRule, ...] = (
    LogRule("pasid", r"Enable PASID failed", FAIL,
            "the IOMMU or its PASID support is unavailable (the driver cannot bind the NPU)", _IOMMU_FIX,
            "aie2_init (out-of-tree driver)", probe=True),
    LogRule("sva-bind", r"SVA bind device failed", FAIL,
            "the IOMMU refused shared virtual addressing for this process, so every open of the node fails",
            _IOMMU_FIX + "; newer drivers fall back to IOVA mode", "amdxdna_drm_open"),
    LogRule("firmware-missing", r"Direct firmware load for (?P<file>amdnpu/\S+) failed with error (?P<err>-?\d+)"
            r"|failed to request_firmware (?P<file2>amdnpu/\S+?),? ret (?P<err2>-?\d+)", FAIL,
            "the NPU firmware file {file} is missing (error {err})",
            "install it: the linux-firmware package (or the amd/xdna-driver firmware) must provide "
            "/lib/firmware/{file} (or its .zst/.xz); then `sudo modprobe -r amdxdna && sudo modprobe amdxdna`",
            "firmware loader (drivers/base/firmware_loader) and aie2_init", probe=True),
    LogRule("protocol", r"Incompatible firmware protocol (?:version )?major (?P<major>\d+),? minor (?P<minor>\d+)",
            FAIL, "driver/firmware mismatch", "", "aie2_check_protocol", probe=True, resolve=_protocol_mismatch),
    LogRule("protocol-minor", r"Firmware minor version smaller than supported", FAIL,
            "driver/firmware mismatch: the firmware is older than {driver} requires",
            "install a newer npu.sbin (linux-firmware) for this driver, then reload amdxdna",
            "aie2_check_protocol", probe=True),
    LogRule("firmware-dead", r"firmware is not alive|Invalid mbox magic", FAIL,
            "the NPU firmware did not start (no alive handshake): a firmware file that does not belong to this "
            "NPU or driver, or an NPU left wedged",
            "check the firmware file of this NPU (amdnpu/<devid>_<rev>/npu.sbin from linux-firmware, matching the "
            "driver) and look for a protocol line; then {reset}", "aie2_hw_start / aie2_get_mgmt_chann_info",
            probe=True),
    LogRule("smu", r"smu cmd (?P<cmd>\d+) failed|Power off failed|Power on failed", FAIL,
            "the NPU's power controller (SMU) refused a command during bring-up",
            "reported with firmware newer than the driver supports: check for a protocol line, install matching "
            "firmware; then {reset}", "aie2_smu_exec / aie2_smu_fini", probe=True),
    LogRule("ctx-refused", r"command opcode 0x2 failed, status 0x2000003|Alloc hw resource failed", FAIL,
            "the firmware refused a context", "", "aie2_send_mgmt_msg_wait (CREATE_CONTEXT, MGMT_ERT_NOAVAIL) / "
            "aie2_hwctx_init", resolve=_context_refused),
    LogRule("heap-refused", r"Map host buffer failed", FAIL,
            "the firmware refused to map the process's device heap (MAP_HOST_BUFFER)",
            "the program's device heap is not what the firmware takes: XRT and amdxdna-direct map one 64 MiB "
            "DEV_HEAP BO at a 64 MiB-aligned address; fix the program that made it", "aie2_hwctx_init"),
    LogRule("fw-command", r"command opcode (?P<op>0x[0-9a-fA-F]+) failed, status (?P<status>0x[0-9a-fA-F]+)",
            FAIL, "the firmware failed {opname} ({statusname})",
            "the lines after it say which operation failed; if it repeats for every program: {reset}",
            "aie2_send_mgmt_msg_wait"),
    LogRule("mailbox-timeout", r"Wait for completion timeout|Mailbox channel stopped", FAIL,
            "the firmware stopped answering the driver (mailbox timeout): the NPU is hung", "{reset}",
            "xdna_send_msg_wait / xdna_mailbox"),
    LogRule("probe-failed", r"Hardware init failed|probe with driver amdxdna failed with error (?P<err>-?\d+)"
            r"|start npu failed", FAIL,
            "the driver's probe failed, so there is no /dev/accel node (the lines before it say why)",
            "fix the cause the lines before it name; then `sudo modprobe -r amdxdna && sudo modprobe amdxdna`",
            "amdxdna_probe / PCI core", probe=True),
    LogRule("page-fault-storm", r"amd_iommu_report_page_fault: (?P<n>\d+) callbacks suppressed", WARN,
            "IOMMU page faults", "", "amd_iommu_report_page_fault (drivers/iommu/amd)", resolve=_page_faults),
    LogRule("page-fault", r"amdxdna .*IO_PAGE_FAULT|IO_PAGE_FAULT device=(?P<device>[0-9a-fA-F:.]+)", WARN,
            "IOMMU page faults", "", "AMD-Vi event log (drivers/iommu/amd)", resolve=_page_faults),
    LogRule("debug-bo", r"aie2_hwctx_cfg_debug_bo: Get bo \d+ failed", PASS,
            "a known, harmless XRT message (a debug buffer detached after it was freed)", "",
            "aie2_hwctx_cfg_debug_bo (amd/xdna-driver issue 1355)"),
    LogRule("pmf", r"PMF get npu data failed", INFO,
            "power and utilization sensors are unavailable (AMD PMF); the NPU works without them", "",
            "npu4_update_counters / aie2_query_sensors"),
    LogRule("unsigned-module", r"amdxdna: module verification failed", INFO,
            "the amdxdna module is unsigned (an out-of-tree build): it loads only with Secure Boot off or its "
            "key enrolled", "with Secure Boot on, enroll the DKMS signing key (`sudo mokutil --import "
            "/var/lib/dkms/mok.pub`)", "kernel module loader"),
    LogRule("out-of-tree", r"amdxdna: loading out-of-tree module taints kernel", INFO,
            "amdxdna is an out-of-tree module (the amd/xdna-driver DKMS build)", "", "kernel module loader"),
    LogRule("iommu-passthrough", r"iommu: Default domain type: Passthrough", INFO,
            "the IOMMU runs in passthrough mode (iommu=pt): amdxdna still needs its PASID/SVA support",
            "if opening the node fails with an SVA bind error, boot without `iommu=pt`",
            "iommu_subsys_init (drivers/iommu/iommu.c)"),
    LogRule("iommu-translated", r"iommu: Default domain type: Translated", PASS,
            "the IOMMU translates DMA, as amdxdna needs", "", "iommu_subsys_init (drivers/iommu/iommu.c)"),
    LogRule("initialized", r"\[drm\] Initialized amdxdna_accel_driver (?P<version>\S+)", PASS,
            "amdxdna bound an NPU (DRM version {version})", "", "drm_dev_register"),
    LogRule("driver-error", r"amdxdna .*(\*ERROR\*|failed|timeout|timed out)", WARN,
            "other amdxdna errors", "read them: `sudo dmesg | grep amdxdna`", "amdxdna (XDNA_ERR)"),
)


@dataclass(frozen=True)
class Finding:
    """Every line one rule matched with the same meaning: verdict, meaning, fix, count, the last line and its time."""

    rule: str
    verdict: str
    meaning: str
    fix: str
    count: int
    last: str
    time: float | None
    probe: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The finding as a plain dict (for ``--json``)."""
        return asdict(self)

    def describe(self) -> str:
        """``meaning (3x, last at 5.573 s): line``."""
        when = f", last at {self.time:.3f} s" if self.time is not None else ""
        return f"{self.meaning} ({self.count}x{when}): {self.last.strip()}"


def _format(template: str, groups: dict[str, str], ctx: LogContext) -> str:
    values = {"driver": ctx.driver, "reset": reset_ladder(ctx.npu_slots[0] if ctx.npu_slots else None),
              "opname": FW_OPCODES.get(_hex(groups.get("op")) or -1, f"opcode {groups.get('op')}"),
              "statusname": FW_STATUSES.get(_hex(groups.get("status")) or -1, f"status {groups.get('status')}"),
              **groups}
    return template.format(**values)


def classify(lines: Iterable[LogLine], rules: Sequence[LogRule] = LOG_RULES,
             context: LogContext | None = None) -> list[Finding]:
    """Apply ``rules`` to every line: each line counts for the first (most specific) rule it matches.

    Lines with the same rule and the same captured values make one :class:`Finding` with their count and the
    time of the last; a ``callbacks suppressed`` line adds its number to the NPU's page-fault count. Findings
    come most severe first, in rule order within a verdict.
    """
    ctx = context or LogContext()
    hits: dict[tuple[str, str | tuple[tuple[str, str], ...]], list[Any]] = {}
    for line in lines:
        for rule in rules:
            match = rule.regex.search(line.text)
            if match is None:
                continue
            groups = _merge_alternatives({k: v for k, v in match.groupdict().items() if v is not None})
            weight = int(groups.pop("n", 1)) if rule.key == "page-fault-storm" else 1
            fault = rule.key.startswith("page-fault")
            key = ("page-fault", groups.get("device", "")) if fault else (rule.key, tuple(sorted(groups.items())))
            entry = hits.setdefault(key, [_rule("page-fault") if fault else rule, groups, 0, line])
            entry[2] += weight
            entry[3] = line
            break
    findings = [_finding(rule, groups, count, last, ctx) for rule, groups, count, last in hits.values()]
    order = {rule.key: i for i, rule in enumerate(rules)}
    return sorted(findings, key=lambda f: (-_SEVERITY[f.verdict], order.get(f.rule, len(order))))


def _merge_alternatives(groups: dict[str, str]) -> dict[str, str]:
    # A pattern with alternatives names a value twice (file / file2): keep the one that matched.
    for name in [k for k in groups if k[-1].isdigit()]:
        groups.setdefault(name.rstrip("0123456789"), groups.pop(name))
    return groups


def _rule(key: str) -> LogRule:
    return next(rule for rule in LOG_RULES if rule.key == key)


def _finding(rule: LogRule, groups: dict[str, str], count: int, last: LogLine, ctx: LogContext) -> Finding:
    if rule.resolve is not None:
        verdict, meaning, fix = rule.resolve(rule, count, groups, ctx)
    else:
        verdict, meaning, fix = rule.verdict, _format(rule.meaning, groups, ctx), _format(rule.fix, groups, ctx)
    storm = rule.key == "page-fault" and count >= PAGE_FAULT_STORM and verdict == WARN
    return Finding("page-fault-storm" if storm else rule.key, verdict, meaning, fix, count, last.text, last.time,
                   rule.probe)


def _probe_failure(findings: Sequence[Finding]) -> Finding | None:
    """The most specific failed-probe finding: a cause (PASID, firmware, protocol) before the generic line."""
    failed = [f for f in findings if f.probe and f.verdict == FAIL]
    specific = [f for f in failed if f.rule != "probe-failed"]
    chosen = specific or failed
    return chosen[0] if chosen else None


def kernel_log_result(log: KernelLog, findings: Sequence[Finding]) -> CheckResult:
    """The kernel-log check from what was read and classified: the most severe finding leads."""
    if log.error:
        return CheckResult("kernel-log", SKIP, log.error, ("run as root, or " if log.denied else "")
                           + "read the log yourself: `sudo dmesg | grep -iE 'amdxdna|iommu'`")
    where = f"{len(log.lines)} messages of this boot ({log.source})"
    dicts = tuple(f.to_dict() for f in findings)
    notable = [f for f in findings if f.verdict != PASS]
    if not notable:
        return CheckResult("kernel-log", PASS, f"no NPU, IOMMU or firmware problem in {where}", "", dicts)
    head = notable[0]
    others = f" (+{len(notable) - 1} more finding(s))" if len(notable) > 1 else ""
    return CheckResult("kernel-log", head.verdict, f"{head.describe()}{others}; in {where}", head.fix, dicts)


def check_kernel_log(host: Host, log: Path | None = None, context: LogContext | None = None) -> CheckResult:
    """The kernel-log rules over the current boot's log (``root/dev/kmsg``, ``journalctl -k`` or ``log``)."""
    read = kernel_log(host, log)
    return kernel_log_result(read, classify(read.lines, context=context))


# --- device checks (through the runtime, the same on a real NPU and on the emulator) -------------------------

# Firmware context limits per generation (docs/doctor.md 5), used when QUERY_RESOURCE_INFO is missing.
CONTEXT_LIMITS = {"npu1": 6, "npu4": 16, "npu5": 16, "npu6": 16}


def check_feature_level(dev: Device) -> CheckResult:
    """The ioctls this runtime relies on answer as expected: VERSION, GET_INFO, timeline syncobjs; GET_ARRAY.

    The DRM minor is the uAPI feature level; 0.0 (Linux 6.14-6.17) lacks GET_ARRAY, which only the context
    table needs; a pre-December-2024 out-of-tree driver numbers GET_INFO differently (docs/doctor.md 5).
    """
    version = dev.version
    level = f"{version.name} {version.major}.{version.minor}"
    try:
        dev.aie_metadata()
    except DeviceLostError:
        raise
    except XdnaError as exc:
        return CheckResult("feature-level", FAIL, f"{level}: GET_INFO(QUERY_AIE_METADATA) failed: {exc}",
                           "the driver predates the December 2024 ioctl numbering or its firmware is not "
                           "running: " + FIX_UPDATE_DRIVER)
    if not _get_cap(dev, "DRM_CAP_SYNCOBJ_TIMELINE"):
        return CheckResult("feature-level", FAIL, f"{level}: DRM_CAP_SYNCOBJ_TIMELINE is 0 (commands are "
                           "awaited on the context's timeline syncobj)", FIX_UPDATE_DRIVER)
    array_error = _get_array_error(dev)
    if array_error is not None:
        return CheckResult("feature-level", WARN, f"{level}: GET_ARRAY unavailable ({array_error}); kernels, "
                           "buffers and contexts work, per-context details and async error reports do not",
                           FIX_UPDATE_DRIVER)
    return CheckResult("feature-level", PASS, f"{level}: VERSION, GET_INFO, GET_ARRAY and timeline syncobjs answer")


def _get_cap(dev: Device, name: str) -> int:
    req = abi.new("struct drm_get_cap", capability=getattr(abi, name))
    dev.file.ioctl(abi.DRM_IOCTL_GET_CAP, req, {"capability": name})
    return int(req.value)


def _get_array_error(dev: Device) -> str | None:
    """None when GET_ARRAY(HW_CONTEXT_ALL) answers, else the errno name it failed with."""
    ffi = abi.ffi
    entries = ffi.new("struct amdxdna_drm_hwctx_entry[]", 16)
    req = abi.new("struct amdxdna_drm_get_array", param=abi.DRM_AMDXDNA_HW_CONTEXT_ALL,
                  element_size=ffi.sizeof("struct amdxdna_drm_hwctx_entry"), num_element=16,
                  buffer=abi.address_of(entries))
    try:
        dev.file.ioctl(abi.DRM_IOCTL_AMDXDNA_GET_ARRAY, req, {"param": "HW_CONTEXT_ALL"})
    except XdnaError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY):
            return errno.errorcode[exc.errno]
        raise
    return None


def check_firmware(dev: Device, sysfs_version: str | None = None, slot: str | None = None) -> CheckResult:
    """GET_INFO QUERY_FIRMWARE_VERSION answers (and agrees with sysfs ``fw_version`` when that is known)."""
    try:
        version = str(dev.firmware_version())
    except DeviceLostError as exc:
        return CheckResult("firmware", FAIL, f"firmware version unreadable: {exc}: the device is lost",
                           reset_ladder(slot))
    except XdnaError as exc:
        return CheckResult("firmware", FAIL, f"firmware version unreadable: {exc}",
                           "the NPU firmware is not running: check `sudo dmesg | grep amdxdna` and install a "
                           "current linux-firmware (amdnpu/<devid>_<rev>/npu.sbin)")
    if sysfs_version is not None and sysfs_version != version:
        return CheckResult("firmware", WARN, f"firmware {version}, but sysfs fw_version says {sysfs_version}",
                           "reload the driver (`sudo modprobe -r amdxdna && sudo modprobe amdxdna`)")
    return CheckResult("firmware", PASS, f"firmware {version}")


def check_contexts(dev: Device, slot: str | None = None) -> CheckResult:
    """Contexts still available: the live count against the firmware limit, then a real CREATE_HWCTX probe.

    The probe asks for one column (num_tiles = core rows), then destroys its syncobj and the context
    (docs/doctor.md 5). It needs this fd's device heap, which it creates if missing. A refusal while no
    context is live means the firmware is wedged: the fix is the reset ladder (``slot`` names the PCI function).
    """
    live, limit, note = _context_load(dev)
    limit_text = "?" if limit is None else limit
    try:
        _probe_context(dev)
    except ContextUnavailableError as exc:
        pids = sorted({c.pid for c in live})
        holders = f"; held by pid(s) {', '.join(map(str, pids))}" if pids else ""
        detail = f"no context available: {exc}; {len(live)} live{holders}{note}"
        if not live and not note:
            return CheckResult("contexts", FAIL, f"{detail}: the firmware refuses contexts although none is live "
                               f"(it allows {limit_text}), so it is wedged", reset_ladder(slot))
        return CheckResult("contexts", FAIL, detail,
                           "close the programs holding NPU contexts (`amdxdna info` lists them) or wait for them "
                           f"to finish; the firmware allows {limit_text} context(s)")
    except DeviceLostError as exc:
        return CheckResult("contexts", FAIL, f"context probe failed: {exc}: the device is lost", reset_ladder(slot))
    except XdnaError as exc:
        return CheckResult("contexts", FAIL, f"context probe failed: {exc}",
                           "see the feature-level and kernel-log checks")
    return CheckResult("contexts", PASS, f"{len(live)} context(s) live of {limit_text}; a 1-column context was "
                       f"created and destroyed{note}")


def _context_load(dev: Device) -> tuple[list[Any], int | None, str]:
    try:
        live = dev.hw_contexts()
    except XdnaError as exc:
        return [], None, f" (context list unavailable: {exc})"
    try:
        return live, dev.resource_info().npu_task_max, ""
    except XdnaError:
        return live, CONTEXT_LIMITS.get(dev.generation or ""), ""


def _probe_context(dev: Device) -> None:
    """CREATE_HWCTX of one column with the runtime's QoS and max_opc 0 (docs/doctor.md 5), then its release.

    Raises:
        ContextUnavailableError: the firmware or the columns have no room (ENODEV / EINVAL / EBUSY).
        XdnaError: another failure of the heap, the query or an ioctl.
    """
    dev.ensure_heap()  # CREATE_HWCTX needs a mapped heap on this fd (docs/doctor.md 5)
    handle, syncobj = create_hwctx(dev, dev.aie_metadata().core.row_count, 0)
    release_context(dev.file, handle, syncobj)


SELF_TEST_BYTES = 4096
# A passthrough takes microseconds; reporting a hang after 10 s beats the driver's 60 s TDR (docs/doctor.md 5).
SELF_TEST_TIMEOUT = 10.0


def check_self_test(dev: Device, xclbin: str | os.PathLike[str] | bytes | None = None,
                    insts: str | os.PathLike[str] | bytes | None = None) -> CheckResult:
    """Run a passthrough kernel and compare the output with the input.

    With ``xclbin`` and ``insts`` (a passthrough design: the stream's lowest patched buffer is copied into its
    highest) that design runs, on any device. Without them only the emulator has a self-test: a one-column
    mlir-aie xclbin and a DMA stream built here, with the emulator's Passthrough model bound to the stream.
    """
    if (xclbin is None) != (insts is None):
        return CheckResult("self-test", SKIP, "give both --xclbin and --insts for a self-test design")
    if xclbin is None and dev.emulator is None:
        return CheckResult("self-test", SKIP, "no self-test design is bundled for a real NPU",
                           "pass a passthrough design (e.g. mlir-aie passthrough_dmas) with --xclbin and --insts")
    try:
        design, stream = _load_design(xclbin, insts) if xclbin is not None else _emulator_design(dev)
        extents = _passthrough_extents(stream)
    except ValueError as exc:
        return CheckResult("self-test", FAIL, f"self-test design unusable: {exc}",
                           "give a passthrough design: `amdxdna xclbin X` and `amdxdna insts I` show what is wrong")
    try:
        return _run_passthrough(dev, design, stream, extents)
    except (XdnaError, ValueError) as exc:
        return CheckResult("self-test", FAIL, f"passthrough kernel failed: {exc}",
                           "see the contexts and kernel-log checks; on a real NPU check that the design matches "
                           "the NPU generation")


def _load_design(xclbin: Any, insts: Any) -> tuple[Xclbin, insts_mod.Stream]:
    """Raises: ValueError: a file cannot be read or is malformed (the message names it)."""
    return _load("xclbin", Xclbin.load, xclbin), _load("instruction stream", insts_mod.load, insts)


def _load(what: str, loader: Any, source: Any) -> Any:
    name = source if isinstance(source, (str, os.PathLike)) else f"<{len(source)} bytes>"
    try:
        return loader(source)
    except OSError as exc:
        raise ValueError(f"{what} {name}: {errno_text(exc.errno) if exc.errno is not None else exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{what} {name}: {exc}") from exc


def _emulator_design(dev: Device) -> tuple[Xclbin, insts_mod.Stream]:
    if dev.emulator is None:        # check_self_test asks for it on the emulator only
        raise ValueError(f"{dev.name}: only the emulator has a bundled self-test design")
    dev_gen = dev.emulator.profile.txn_dev_gen
    stream = insts_mod.dma_stream(dev_gen, [(0, SELF_TEST_BYTES, "in"), (1, SELF_TEST_BYTES, "out")])
    # The emulator does not interpret the PDI; a recognisable filler keeps the design self-describing.
    return build_mlir_aie(b"amdxdna doctor self-test PDI\0\0\0\0", column_width=1, n_buffers=2), stream


def stream_extents(stream: insts_mod.Stream) -> dict[int, int]:
    """Deprecated: :func:`amdxdna_direct.insts.buffer_reach` (the one buffer-reach computation, docs/runtime.md
    1.4), with the self-test's check that at least two buffers are patched.

    Raises:
        ValueError: fewer than two buffers are patched (no passthrough).
    """
    warnings.warn("amdxdna_direct.doctor.stream_extents is deprecated: use amdxdna_direct.insts.buffer_reach",
                  DeprecationWarning, stacklevel=2)
    return _passthrough_extents(stream)


def _passthrough_extents(stream: insts_mod.Stream) -> dict[int, int]:
    """Bytes each patched buffer must hold (docs/doctor.md 5). Raises: ValueError: fewer than two are patched."""
    extents = insts_mod.buffer_reach(stream)
    if len(extents) < 2:
        raise ValueError(f"self-test stream patches buffer slots {sorted(extents)}; a passthrough needs two")
    return extents


def bind_model(emulator: EmuDevice | None, stream: insts_mod.Stream, model: Model) -> str:
    """Bind ``model`` to the instruction stream on ``emulator``, replacing a model bound to it before.

    Returns the stream digest. Raises:
        ValueError, TypeError: from the emulator's registry (malformed stream or model).
        TypeError: ``emulator`` is None (a real device: models exist on the emulator only).
    """
    if emulator is None:
        raise TypeError("bind_model: models bind on the emulator only; this device has no emulator (a real NPU)")
    data = insts_mod.encode(stream)
    if data in emulator.models:
        emulator.models.unbind(data)
    return emulator.models.bind(data, model)


def _run_passthrough(dev: Device, xclbin: Xclbin, stream: insts_mod.Stream, extents: dict[int, int]) -> CheckResult:
    """Copy a pattern through the design (the lowest patched slot in, the highest out) and compare.

    Raises:
        XdnaError: the context, a buffer or the run failed.
        ValueError: the runtime refused the xclbin (no AIE partition, no runnable kernel).
    """
    from .emu.models import Passthrough

    src, dst = min(extents), max(extents)
    if dev.emulator is not None:
        bind_model(dev.emulator, stream, Passthrough())
    # Neither zeros nor a byte ramp: an untouched or index-filled output buffer cannot pass.
    pattern = (np.arange(extents[src], dtype=np.uint32) * 2654435761 & 0xFF).astype(np.uint8)
    count = min(extents[src], extents[dst])
    with contextlib.ExitStack() as owned, dev.hw_context(xclbin) as ctx:
        bos = {slot: owned.enter_context(dev.bo(max(size, SELF_TEST_BYTES))) for slot, size in extents.items()}
        bos[src].write(pattern)
        for bo in bos.values():
            bo.sync()
        run = ctx.kernel().prepare_npu(stream, [bos.get(i) for i in range(dst + 1)])
        run.start()
        run.wait(SELF_TEST_TIMEOUT)
        bos[dst].sync()
        same = bos[dst].read(count) == pattern[:count].tobytes()
    if not same:
        return CheckResult("self-test", FAIL, f"passthrough of {count} bytes completed but the output differs",
                           "the design is not a passthrough of its lowest into its highest buffer, or the NPU "
                           "corrupted data: rerun with AMDXDNA_TRACE=1 and check the kernel log")
    return CheckResult("self-test", PASS, f"passthrough of {count} bytes (bo{src} -> bo{dst}) returned the input")


# --- the whole run -------------------------------------------------------------------------------------

DEVICE_CHECKS = ("feature-level", "firmware", "contexts", "self-test")


def is_emulated(device: Any) -> bool:
    """Whether ``device`` (what ``open_device`` takes) names the emulator: ``emu``, ``emu:<profile>``, an EmuDevice."""
    if isinstance(device, str):
        return device == "emu" or device.startswith("emu:")
    return device is not None and hasattr(device, "models") and hasattr(device, "open")


def run_checks(device: Any = None, *, host: Host | None = None, xclbin: Any = None,
               insts: Any = None) -> list[CheckResult]:
    """Every check, in order: node, permission, memlock, kernel log, feature level, firmware, contexts, self-test.

    ``device`` is what :func:`open_device` takes; None means the first node under ``host.root``. For the
    emulator the node, permission and kernel-log checks are skipped (there is no node or kernel driver).
    Device checks are skipped when the node checks or the open failed, or when impersonating a user; the
    checks after a failed feature level are skipped too (the driver does not speak this runtime's uAPI),
    and the self-test after a failed contexts check (it needs a context). The kernel log is read first (a
    missing node quotes its finding) and judged last (some verdicts depend on the live context count).

    Raises:
        ValueError, TypeError: ``device`` is not something :func:`open_device` takes (e.g. an unknown profile).
    """
    host = host if host is not None else Host.probe()
    if is_emulated(device):
        reason = f"emulated device {device if isinstance(device, str) else 'EmuDevice'}: no node or kernel log"
        results = [CheckResult("node", SKIP, reason), CheckResult("permission", SKIP, reason), check_memlock(host),
                   CheckResult("kernel-log", SKIP, reason)]
        return results + _device_checks(device, host, xclbin, insts, None)[0]
    node = node_path(host, device)
    log = kernel_log(host)
    driver = _driver_text(host)
    first = classify(log.lines, context=LogContext(driver=driver))
    results = [check_node(host, node, first), check_permission(host, node), check_memlock(host)]
    slot = sysfs_attributes(host.root, node.name).get("pci_slot") if node is not None else None
    if FAIL in (results[0].status, results[1].status) or host.impersonated:
        why = f"checking for {host.identity.name}" if host.impersonated else "the node checks failed"
        device_results, live = _skipped(DEVICE_CHECKS, why), None
    else:
        device_results, live = _device_checks(str(node), host, xclbin, insts, slot)
    context = LogContext(live, driver, tuple(dict.fromkeys(s for s in (slot, *_npu_slots(host)) if s)))
    return [*results, kernel_log_result(log, classify(log.lines, context=context)), *device_results]


def _npu_slots(host: Host) -> list[str]:
    scan = scan_pci(host.root)
    return [npu.slot for npu in scan[0]] if scan else []


def _driver_text(host: Host) -> str:
    module = module_state(host)
    if module.origin is None:
        return "the amdxdna driver"
    version = f" {module.version}" if module.version else ""
    return f"the {module.origin} amdxdna{version} (kernel {module.kernel or '?'})"


def _device_checks(target: Any, host: Host, xclbin: Any, insts: Any,
                   slot: str | None) -> tuple[list[CheckResult], int | None]:
    """feature-level, firmware, contexts and self-test on an opened ``target``, each only if the previous allows;
    and the live context count (None when unknown)."""
    try:
        dev = open_device(target)
    except XdnaError as exc:
        return [CheckResult("feature-level", FAIL, f"open failed: {exc}", _open_fix(exc, slot)),
                *_skipped(DEVICE_CHECKS[1:], "the device did not open")], None
    with dev:
        try:
            return _opened_checks(dev, host, xclbin, insts, slot)
        except DeviceLostError as exc:
            return [CheckResult("feature-level", FAIL, f"the device is lost: {exc}", reset_ladder(slot)),
                    *_skipped(DEVICE_CHECKS[1:], "the device is lost")], None


def _opened_checks(dev: Device, host: Host, xclbin: Any, insts: Any,
                   slot: str | None) -> tuple[list[CheckResult], int | None]:
    """Raises: DeviceLostError: the device answered ENODEV to a query (removed, reset or wedged)."""
    feature = check_feature_level(dev)
    if feature.status == FAIL:
        return [feature, *_skipped(DEVICE_CHECKS[1:], "the driver failed the feature-level check")], None
    attributes = {} if dev.emulator is not None else sysfs_attributes(host.root, Path(dev.name).name)
    results = [feature, check_firmware(dev, attributes.get("fw_version"), slot), check_contexts(dev, slot)]
    try:
        live = len(dev.hw_contexts())
    except XdnaError:
        live = None
    if results[-1].status == FAIL:
        return [*results, CheckResult("self-test", SKIP, "not run: no hardware context is available")], live
    return [*results, check_self_test(dev, xclbin, insts)], live


def _skipped(names: Iterable[str], why: str) -> list[CheckResult]:
    return [CheckResult(name, SKIP, f"not run: {why}") for name in names]


def _open_fix(exc: Exception, slot: str | None = None) -> str:
    if getattr(exc, "errno", None) == errno.ENOTTY:
        return "the node is not a DRM device: pass the amdxdna node with --device"
    if getattr(exc, "errno", None) == errno.ENODEV:
        return "the node exists but its device is gone (ENODEV), or the open's SVA bind failed (see the " \
               "kernel-log check): " + reset_ladder(slot)
    return "see the kernel-log check; " + FIX_UPDATE_DRIVER


def worst(results: Iterable[CheckResult]) -> str:
    """The most severe status among ``results`` (FAIL > WARN > INFO > PASS/SKIP)."""
    seen = {r.status for r in results}
    return FAIL if FAIL in seen else WARN if WARN in seen else INFO if INFO in seen else PASS
