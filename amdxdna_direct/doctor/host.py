"""The machine the checks look at: its root, the identity whose permissions count, its nodes and sysfs."""

from __future__ import annotations

import os
import re
import resource
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .results import _errno_name

# Attributes of the PCI device directory behind /sys/class/accel/accelN (docs/doctor.md 3).
SYSFS_ATTRIBUTES = ("vendor", "device", "subsystem_vendor", "subsystem_device", "revision", "vbnv",
                    "fw_version", "device_type")

CAP_IPC_LOCK = 14  # linux/capability.h

# Kernel log of the current boot when /dev/kmsg is restricted (docs/doctor.md 2.1): monotonic timestamps.
JOURNAL_COMMAND = ("journalctl", "-k", "-b", "0", "-o", "short-monotonic", "--no-pager", "-q")
MODINFO_COMMAND = ("modinfo",)
SUBPROCESS_TIMEOUT = 30.0


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



def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None
