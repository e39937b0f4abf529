"""Health checks of an amdxdna NPU setup, as a library (``amdxdna doctor`` prints them).

Every check returns a :class:`CheckResult` (pass / warn / fail / skip, what was found, and the fix).
Host-side checks read a filesystem root (``/`` normally, a fake ``/dev`` + ``/sys`` + ``/etc`` tree in
tests) described by :class:`Host`; device-side checks go through the runtime (:func:`open_device`), so
they run the same against a real ``/dev/accel/accelN`` and the emulator.

Facts relied on: spec/amdxdna-uapi.md 5 (DRM VERSION, GET_CAP), 7 (SVA bind at open), 8 (PCI ids,
sysfs attributes, firmware context limits), 10 (GET_INFO / GET_ARRAY), 11 (feature level = DRM minor);
spec/xrt-npu-sequence.md 1.1 (discovery) and 1.2 (64 MiB heap mapped MAP_LOCKED by XRT).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import abi
from . import insts as insts_mod
from .device import Device, open_device, pci_generation
from .errors import ContextUnavailableError, XdnaError, errno_text
from .hwctx import create_hwctx, release_context
from .insts import BlockWrite, DdrPatch
from .xclbin import Xclbin, build_mlir_aie

__all__ = [
    "PASS", "WARN", "FAIL", "SKIP", "DEVICE_CHECKS", "MEMLOCK_NEEDED", "CheckResult", "Identity", "Host",
    "find_nodes", "node_path", "sysfs_attributes", "hex_attribute", "is_emulated", "bind_model",
    "check_node", "check_permission", "check_memlock", "check_kernel_log", "parse_kernel_log", "read_kernel_log",
    "check_feature_level", "check_firmware", "check_contexts", "check_self_test", "run_checks", "worst",
]

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"

# XRT maps the 64 MiB device heap and every buffer MAP_LOCKED (xrt-npu-sequence.md 1.2, 1.4): the locked
# memory limit must cover the heap plus the working set of data buffers; 64 MiB of buffers is a modest one.
HEAP_SIZE = 64 << 20
MEMLOCK_NEEDED = HEAP_SIZE + (64 << 20)

# The PCI vendor id of AMD's NPUs (xrt-npu-sequence.md 1.1; generations by device id: device.PCI_GENERATIONS).
AMD_VENDOR_ID = 0x1022
# Attributes of the PCI device directory behind /sys/class/accel/accelN (spec 8, xrt-npu-sequence 1.1).
SYSFS_ATTRIBUTES = ("vendor", "device", "subsystem_vendor", "subsystem_device", "revision", "vbnv",
                    "fw_version", "device_type")

CAP_IPC_LOCK = 14  # linux/capability.h

CONTAINER_MARKERS = (".dockerenv", "run/.containerenv")

FIX_NO_NODE = ("load the driver: `sudo modprobe amdxdna` (mainline Linux >= 6.14, or the amd/xdna-driver DKMS "
               "module); check the NPU is listed by `lspci -nn -d 1022:` (1502 or 17f0) and enabled in the "
               "firmware setup")
FIX_CONTAINER_NODE = "start the container with the node passed in: `--device /dev/accel/accel0`"


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` is one of PASS, WARN, FAIL, SKIP; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        """The result as a plain dict (for ``--json``)."""
        return asdict(self)


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


def _read_colon_file(path: Path, what: str) -> list[list[str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise LookupError(f"{what}: cannot read {path}: {errno.errorcode.get(exc.errno, exc.errno)}") from exc
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


@dataclass
class Host:
    """The machine the checks look at.

    ``root`` is the filesystem root (``/dev``, ``/sys``, ``/etc``, ``/dev/kmsg`` are read below it);
    ``identity`` whose permissions are evaluated (``impersonated`` when it is not this process, so the
    node is not actually opened); ``memlock`` the (soft, hard) RLIMIT_MEMLOCK and ``cap_ipc_lock`` whether
    the limit is waived, both of this process.
    """

    root: Path = Path("/")
    identity: Identity = field(default_factory=Identity.current)
    impersonated: bool = False
    memlock: tuple[int, int] = field(default_factory=lambda: resource.getrlimit(resource.RLIMIT_MEMLOCK))
    cap_ipc_lock: bool = False

    @classmethod
    def probe(cls, root: str | os.PathLike[str] = "/", user: str | None = None) -> Host:
        """Describe this process on ``root``; ``user`` evaluates the node permissions for that user instead.

        Raises:
            LookupError: ``user`` is not known under ``root/etc/passwd``.
        """
        base = Path(root)
        identity = Identity.lookup(base, user) if user is not None else Identity.current(base)
        return cls(root=base, identity=identity, impersonated=user is not None, cap_ipc_lock=_has_cap_ipc_lock())

    def path(self, absolute: str | os.PathLike[str]) -> Path:
        """``absolute`` (e.g. ``/dev/accel/accel0``) seen below this host's root."""
        return self.root / Path(absolute).relative_to("/") if Path(absolute).is_absolute() else Path(absolute)

    @property
    def in_container(self) -> bool:
        """Whether the root carries a container runtime's marker file (docker, podman)."""
        return any((self.root / marker).exists() for marker in CONTAINER_MARKERS)


def _has_cap_ipc_lock() -> bool:
    # The effective capability mask of this process (proc(5) "CapEff"), not a file of the checked root.
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return False
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", text, re.MULTILINE)
    return bool(match) and bool(int(match.group(1), 16) >> CAP_IPC_LOCK & 1)


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


def check_node(host: Host, node: Path | None) -> CheckResult:
    """Node present and driven by amdxdna (the sysfs driver link of its PCI device)."""
    container_fix = f"; {FIX_CONTAINER_NODE}" if host.in_container else ""
    if node is None or not node.exists():
        where = node if node is not None else host.root / "dev/accel/accel*"
        return CheckResult("node", FAIL, f"no device node {where}", FIX_NO_NODE + container_fix)
    attributes = sysfs_attributes(host.root, node.name)
    driver = attributes.get("driver")
    if driver is None:
        return CheckResult("node", WARN, f"{node} exists but its sysfs driver link is unreadable",
                           "check /sys is mounted (containers: mount sysfs read-only)")
    if driver != "amdxdna":
        return CheckResult("node", FAIL, f"{node} is driven by {driver!r}, not amdxdna",
                           "this node is another accelerator: pass the NPU's node with --device")
    return CheckResult("node", PASS, f"{node} driven by amdxdna ({_describe_pci(attributes)})")


def _describe_pci(attributes: dict[str, str]) -> str:
    device_id, revision = hex_attribute(attributes, "device"), hex_attribute(attributes, "revision")
    if device_id is None:
        return "PCI id unknown"
    gen = pci_generation(device_id, revision or 0) or "unknown generation"
    return f"PCI {attributes.get('pci_slot', '?')} {device_id:04x} rev {revision or 0:02x}: {gen}"


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


def check_permission(host: Host, node: Path | None) -> CheckResult:
    """Whether the identity may open the node read-write (mode bits, then a real open unless impersonating)."""
    if node is None or not node.exists():
        return CheckResult("permission", SKIP, "no device node to check")
    st = node.stat()
    name = _group_name(host, st.st_gid)
    group = f"{name!r} (gid {st.st_gid})" if name else f"gid {st.st_gid}"
    fix = (f"add {host.identity.name} to the node's group {group}: `sudo usermod -aG {name or st.st_gid} "
           f"{host.identity.name}` then log in again")
    if host.in_container:
        fix += f"; in a container also pass `--group-add {st.st_gid}`"
    if not _mode_allows(st, host.identity):
        return CheckResult("permission", FAIL, f"{host.identity.name} may not open {node} read-write "
                           f"(mode {stat.filemode(st.st_mode)}, group {group})", fix)
    if host.impersonated:
        return CheckResult("permission", PASS, f"{host.identity.name} may open {node} (mode bits; not opened)")
    return _try_open(node, fix, host.in_container)


def _try_open(node: Path, fix: str, in_container: bool) -> CheckResult:
    try:
        fd = os.open(node, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        if exc.errno == errno.EPERM:
            cgroup_fix = FIX_CONTAINER_NODE if in_container else "a device cgroup or LSM policy denies the node"
            return CheckResult("permission", FAIL, f"open({node}): EPERM", cgroup_fix)
        if exc.errno == errno.EACCES:
            return CheckResult("permission", FAIL, f"open({node}): EACCES", fix)
        return CheckResult("permission", FAIL, f"open({node}): {name} ({exc.strerror})",
                           "the driver refused the open: see the kernel log check (SVA bind) below")
    os.close(fd)
    return CheckResult("permission", PASS, f"{node} opens read-write")


def check_memlock(host: Host) -> CheckResult:
    """RLIMIT_MEMLOCK of this process against a 64 MiB heap plus buffers (waived by CAP_IPC_LOCK)."""
    soft, _hard = host.memlock
    if soft == resource.RLIM_INFINITY:
        return CheckResult("memlock", PASS, "locked-memory limit unlimited")
    if host.cap_ipc_lock:
        return CheckResult("memlock", PASS, f"limit {soft >> 10} KiB, waived by CAP_IPC_LOCK")
    if soft < MEMLOCK_NEEDED:
        return CheckResult("memlock", WARN,
                           f"locked-memory limit {soft >> 10} KiB < {MEMLOCK_NEEDED >> 20} MiB (64 MiB heap + "
                           "buffers, which XRT maps MAP_LOCKED and user-pointer buffers pin)",
                           "raise it: `ulimit -l unlimited`, `* - memlock unlimited` in "
                           "/etc/security/limits.conf, LimitMEMLOCK=infinity for services, "
                           "`--ulimit memlock=-1:-1` for containers")
    return CheckResult("memlock", PASS, f"locked-memory limit {soft >> 20} MiB")


# Kernel log lines worth reporting, most severe first: (pattern, status, what it means, fix).
_LOG_RULES = (
    (re.compile(r"SVA bind device failed", re.IGNORECASE), FAIL,
     "the IOMMU refused shared virtual addressing for the NPU, so every open fails",
     "enable the IOMMU in the firmware setup and do not boot with iommu=off/amd_iommu=off; update the BIOS "
     "(newer drivers fall back to IOVA mode)"),
    (re.compile(r"amdxdna.*(firmware|fw).*(fail|error)|(fail|error).*(load|request).*firmware.*npu", re.IGNORECASE),
     FAIL, "the NPU firmware failed to load or boot",
     "install a current linux-firmware (amdnpu/<devid>_<rev>/npu.sbin) and reload amdxdna"),
    (re.compile(r"IO_PAGE_FAULT|iommu.*fault|fault.*iommu", re.IGNORECASE), WARN,
     "the IOMMU reported a device page fault (an NPU DMA to an unmapped address)",
     "a command used a stale or wrong buffer address: rerun it with AMDXDNA_TRACE=1 and check its buffers"),
    (re.compile(r"amdxdna.*(fail|error|timeout|timed out)", re.IGNORECASE), WARN,
     "the driver logged errors",
     "read them with `sudo dmesg | grep amdxdna`; firmware command failures at context creation mean the "
     "context limit was reached"),
)


def parse_kernel_log(data: bytes) -> list[str]:
    """The messages of a kernel log: ``/dev/kmsg`` records (``pri,seq,ts,flags;text``) or ``dmesg`` lines."""
    messages = []
    for raw in data.decode("utf-8", "replace").splitlines():
        if not raw or raw[0] == " ":  # /dev/kmsg continuation lines carry key=value metadata
            continue
        prefix, sep, text = raw.partition(";")
        messages.append(text if sep and re.fullmatch(r"\d+,\d+,\d+(,[^;]*)?", prefix) else raw)
    return messages


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


def check_kernel_log(host: Host, log: Path | None = None) -> CheckResult:
    """IOMMU/SVA faults and amdxdna errors in the kernel log (``root/dev/kmsg`` unless ``log`` is given)."""
    path = log if log is not None else host.root / "dev/kmsg"
    try:
        messages = parse_kernel_log(read_kernel_log(path))
    except OSError as exc:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        denied = exc.errno in (errno.EACCES, errno.EPERM)  # kernel.dmesg_restrict=1 needs CAP_SYSLOG
        return CheckResult("kernel-log", SKIP, f"{path} not readable ({name})",
                           ("run as root, or " if denied else "") + "read the log yourself: "
                           "`sudo dmesg | grep -iE 'amdxdna|iommu'`")
    for pattern, status, meaning, fix in _LOG_RULES:
        hits = [m for m in messages if pattern.search(m)]
        if hits:
            return CheckResult("kernel-log", status, f"{meaning}: {len(hits)} line(s), last: {hits[-1].strip()}", fix)
    return CheckResult("kernel-log", PASS, f"no IOMMU/SVA faults or amdxdna errors in {len(messages)} messages")


# --- device checks (through the runtime, the same on a real NPU and on the emulator) -------------------------

# Firmware context limits per generation (spec 8: hwctx_limit), used when QUERY_RESOURCE_INFO is missing.
CONTEXT_LIMITS = {"npu1": 6, "npu4": 16, "npu5": 16, "npu6": 16}
FIX_UPDATE_DRIVER = ("use Linux >= 6.18 (feature level 0.1+) or the amd/xdna-driver DKMS module; check with "
                     "`modinfo amdxdna`")


def check_feature_level(dev: Device) -> CheckResult:
    """The ioctls this runtime relies on answer as expected: VERSION, GET_INFO, timeline syncobjs; GET_ARRAY.

    Spec 11: the DRM minor is the uAPI feature level; 0.0 (Linux 6.14-6.17) lacks GET_ARRAY, which only
    the context table needs. Spec 1b: a pre-December-2024 out-of-tree driver numbers GET_INFO differently.
    """
    version = dev.version
    level = f"{version.name} {version.major}.{version.minor}"
    try:
        dev.aie_metadata()
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


def check_firmware(dev: Device, sysfs_version: str | None = None) -> CheckResult:
    """GET_INFO QUERY_FIRMWARE_VERSION answers (and agrees with sysfs ``fw_version`` when that is known)."""
    try:
        version = str(dev.firmware_version())
    except XdnaError as exc:
        return CheckResult("firmware", FAIL, f"firmware version unreadable: {exc}",
                           "the NPU firmware is not running: check `sudo dmesg | grep amdxdna` and install a "
                           "current linux-firmware (amdnpu/<devid>_<rev>/npu.sbin)")
    if sysfs_version is not None and sysfs_version != version:
        return CheckResult("firmware", WARN, f"firmware {version}, but sysfs fw_version says {sysfs_version}",
                           "reload the driver (`sudo modprobe -r amdxdna && sudo modprobe amdxdna`)")
    return CheckResult("firmware", PASS, f"firmware {version}")


def check_contexts(dev: Device) -> CheckResult:
    """Contexts still available: the live count against the firmware limit, then a real CREATE_HWCTX probe.

    The probe asks for one column (num_tiles = core rows, spec 4.1), then destroys its syncobj and the
    context (spec 4.2). It needs this fd's device heap, which it creates if missing.
    """
    live, limit, note = _context_load(dev)
    try:
        _probe_context(dev)
    except ContextUnavailableError as exc:
        pids = sorted({c.pid for c in live})
        holders = f"; held by pid(s) {', '.join(map(str, pids))}" if pids else ""
        return CheckResult("contexts", FAIL, f"no context available: {exc}; {len(live)} live{holders}{note}",
                           "close the programs holding NPU contexts (`amdxdna info` lists them) or wait for them "
                           f"to finish; the firmware allows {'?' if limit is None else limit} context(s)")
    except XdnaError as exc:
        return CheckResult("contexts", FAIL, f"context probe failed: {exc}",
                           "see the feature-level and kernel-log checks")
    limit_text = "?" if limit is None else limit
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
    """CREATE_HWCTX of one column with the runtime's QoS and max_opc 0 (spec 9 step 4), then its release.

    Raises:
        ContextUnavailableError: the firmware or the columns have no room (ENODEV / EINVAL / EBUSY).
        XdnaError: another failure of the heap, the query or an ioctl.
    """
    dev.ensure_heap()  # CREATE_HWCTX needs a mapped heap on this fd (spec 4.1 step 3)
    handle, syncobj = create_hwctx(dev, dev.aie_metadata().core.row_count, 0)
    release_context(dev.file, handle, syncobj)


SELF_TEST_BYTES = 4096
# A passthrough takes microseconds; reporting a hang after 10 s beats the driver's 60 s TDR (spec amdxdna-uapi.md 6.7).
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
        extents = _extents(stream)
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
        raise ValueError(f"{what} {name}: {errno_text(exc.errno)}") from exc
    except ValueError as exc:
        raise ValueError(f"{what} {name}: {exc}") from exc


def _emulator_design(dev: Device) -> tuple[Xclbin, insts_mod.Stream]:
    dev_gen = dev.emulator.profile.txn_dev_gen
    stream = insts_mod.dma_stream(dev_gen, [(0, SELF_TEST_BYTES, "in"), (1, SELF_TEST_BYTES, "out")])
    # The emulator does not interpret the PDI; a recognisable filler keeps the design self-describing.
    return build_mlir_aie(b"amdxdna doctor self-test PDI\0\0\0\0", column_width=1, n_buffers=2), stream


def _extents(stream: insts_mod.Stream) -> dict[int, int]:
    """Byte length of each patched buffer: word 0 of the BD whose address word the patch targets (spec 2.3).

    Raises:
        ValueError: a patched BD is not written by a BLOCKWRITE of the stream (its length is unknown), or
            fewer than two buffers are patched (no passthrough).
    """
    lengths = {op.addr: 4 * op.words[0] for op in stream.ops if isinstance(op, BlockWrite) and op.words}
    extents = {}
    for op in (op for op in stream.ops if isinstance(op, DdrPatch)):
        if op.reg_addr - 4 not in lengths:
            raise ValueError(f"self-test stream: the BD patched at {op.reg_addr:#x} (slot {op.arg_idx}) is not "
                             "written by a BLOCKWRITE, so its length is unknown")
        extents[op.arg_idx] = lengths[op.reg_addr - 4]
    if len(extents) < 2:
        raise ValueError(f"self-test stream patches buffer slots {sorted(extents)}; a passthrough needs two")
    return extents


def bind_model(emulator: Any, stream: Any, model: Any) -> str:
    """Bind ``model`` to the instruction stream on ``emulator``, replacing a model bound to it before.

    Returns the stream digest. Raises:
        ValueError, TypeError: from the emulator's registry (malformed stream or model).
    """
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
    and the self-test after a failed contexts check (it needs a context).

    Raises:
        ValueError, TypeError: ``device`` is not something :func:`open_device` takes (e.g. an unknown profile).
    """
    host = host if host is not None else Host.probe()
    if is_emulated(device):
        reason = f"emulated device {device if isinstance(device, str) else 'EmuDevice'}: no node or kernel log"
        results = [CheckResult("node", SKIP, reason), CheckResult("permission", SKIP, reason), check_memlock(host),
                   CheckResult("kernel-log", SKIP, reason)]
        return results + _device_checks(device, host, xclbin, insts)
    node = node_path(host, device)
    results = [check_node(host, node), check_permission(host, node), check_memlock(host), check_kernel_log(host)]
    if FAIL in (results[0].status, results[1].status) or host.impersonated:
        why = f"checking for {host.identity.name}" if host.impersonated else "the node checks failed"
        return results + _skipped(DEVICE_CHECKS, why)
    return results + _device_checks(str(node), host, xclbin, insts)


def _device_checks(target: Any, host: Host, xclbin: Any, insts: Any) -> list[CheckResult]:
    """feature-level, firmware, contexts and self-test on an opened ``target``, each only if the previous allows."""
    try:
        dev = open_device(target)
    except XdnaError as exc:
        return [CheckResult("feature-level", FAIL, f"open failed: {exc}", _open_fix(exc)),
                *_skipped(DEVICE_CHECKS[1:], "the device did not open")]
    with dev:
        feature = check_feature_level(dev)
        if feature.status == FAIL:
            return [feature, *_skipped(DEVICE_CHECKS[1:], "the driver failed the feature-level check")]
        attributes = {} if dev.emulator is not None else sysfs_attributes(host.root, Path(dev.name).name)
        results = [feature, check_firmware(dev, attributes.get("fw_version")), check_contexts(dev)]
        if results[-1].status == FAIL:
            return [*results, CheckResult("self-test", SKIP, "not run: no hardware context is available")]
        return [*results, check_self_test(dev, xclbin, insts)]


def _skipped(names: Iterable[str], why: str) -> list[CheckResult]:
    return [CheckResult(name, SKIP, f"not run: {why}") for name in names]


def _open_fix(exc: Exception) -> str:
    if getattr(exc, "errno", None) == errno.ENOTTY:
        return "the node is not a DRM device: pass the amdxdna node with --device"
    return "see the kernel-log check; " + FIX_UPDATE_DRIVER


def worst(results: Iterable[CheckResult]) -> str:
    """The most severe status among ``results`` (FAIL > WARN > PASS/SKIP)."""
    seen = {r.status for r in results}
    return FAIL if FAIL in seen else WARN if WARN in seen else PASS
