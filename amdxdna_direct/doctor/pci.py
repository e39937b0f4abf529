"""The PCI scan for AMD NPUs, the amdxdna module of the running kernel, and the reset ladder (docs/doctor.md 3)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..device import pci_generation
from .host import Host, _hex, _read_text, _run

# The PCI vendor id of AMD's NPUs and the device ids of the driver's PCI id table (docs/doctor.md 3).
AMD_VENDOR_ID = 0x1022
NPU_DEVICE_IDS = {0x1502: "NPU1 (Phoenix, Hawk Point)", 0x17F0: "NPU4/5/6 (Strix Point, Strix Halo, Krackan)",
                  0x17F1: "AIE4 NPU", 0x17F2: "AIE4 NPU", 0x17F3: "AIE4 NPU", 0x1B0A: "AIE4 NPU",
                  0x1B0B: "AIE4 NPU", 0x1B0C: "AIE4 NPU"}

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
