"""Health checks of an amdxdna NPU setup, as a library (``amdxdna doctor`` prints them).

Every check returns a :class:`CheckResult` (pass / info / warn / fail / skip, what was found, and the fix).
Host-side checks read a filesystem root (``/`` normally, a fake ``/dev`` + ``/sys`` + ``/etc`` tree in
tests) described by :class:`Host`; device-side checks go through the runtime (:func:`open_device`), so
they run the same against a real ``/dev/accel/accelN`` and the emulator.

The facts behind every rule, fix and PCI id are in docs/doctor.md: the kernel-log rules and the driver
lines they match (docs/doctor.md 2), the PCI scan (3), the fixes and the reset ladder (4).

The package's modules, bottom up: ``results`` (statuses, :class:`CheckResult`), ``host`` (the machine: root,
identity, nodes, sysfs), ``pci`` (the PCI scan, the module, the reset ladder), ``kernel_log`` (reading the log,
its rules and findings), ``host_checks`` (node, permission, memlock), ``device_checks`` (through the runtime);
this module runs them all in order (:func:`run_checks`) and re-exports their public names.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..device import Device, open_device
from ..errors import DeviceLostError, XdnaError

# Every name of the former single module stays importable from here (the "as" ones are not in __all__).
from .device_checks import CONTEXT_LIMITS as CONTEXT_LIMITS
from .device_checks import SELF_TEST_BYTES as SELF_TEST_BYTES
from .device_checks import SELF_TEST_TIMEOUT as SELF_TEST_TIMEOUT
from .device_checks import (
    bind_model,
    check_contexts,
    check_feature_level,
    check_firmware,
    check_self_test,
    is_emulated,
    stream_extents,
)
from .host import CAP_IPC_LOCK as CAP_IPC_LOCK
from .host import JOURNAL_COMMAND as JOURNAL_COMMAND
from .host import MODINFO_COMMAND as MODINFO_COMMAND
from .host import SUBPROCESS_TIMEOUT as SUBPROCESS_TIMEOUT
from .host import SYSFS_ATTRIBUTES as SYSFS_ATTRIBUTES
from .host import (
    Host,
    Identity,
    find_nodes,
    hex_attribute,
    node_path,
    sysfs_attributes,
)
from .host_checks import FIRST_KERNEL as FIRST_KERNEL
from .host_checks import FIX_CONTAINER_NODE as FIX_CONTAINER_NODE
from .host_checks import FIX_NO_NODE as FIX_NO_NODE
from .host_checks import HEAP_SIZE as HEAP_SIZE
from .host_checks import (
    MEMLOCK_NEEDED,
    check_memlock,
    check_node,
    check_permission,
)
from .host_checks import UDEV_RULE as UDEV_RULE
from .host_checks import UDEV_RULE_FILE as UDEV_RULE_FILE
from .host_checks import _permission_fix as _permission_fix
from .kernel_log import FW_OPCODES as FW_OPCODES
from .kernel_log import FW_STATUSES as FW_STATUSES
from .kernel_log import (
    LOG_RULES,
    Finding,
    KernelLog,
    LogContext,
    LogLine,
    LogRule,
    check_kernel_log,
    classify,
    kernel_log,
    kernel_log_result,
    parse_kernel_log,
    parse_kernel_records,
    read_kernel_log,
)
from .kernel_log import PAGE_FAULT_STORM as PAGE_FAULT_STORM
from .kernel_log import _probe_failure as _probe_failure
from .pci import AMD_VENDOR_ID as AMD_VENDOR_ID
from .pci import NPU_DEVICE_IDS, ModuleState, PciDevice, module_state, reset_ladder, scan_pci
from .results import FAIL, INFO, PASS, SKIP, WARN, CheckResult, worst
from .results import FIX_UPDATE_DRIVER as FIX_UPDATE_DRIVER

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

# --- the whole run -------------------------------------------------------------------------------------

DEVICE_CHECKS = ("feature-level", "firmware", "contexts", "self-test")


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
