"""``amdxdna info``: what the device, its driver and its firmware report, and the live hardware contexts.

PCI identity comes from sysfs (``/sys/class/accel/accelN/device/*``, docs/doctor.md 3) on a real node and
from the profile on the emulator; everything else from DRM_IOCTL_VERSION, GET_INFO and GET_ARRAY (the
driver's full context entries: ``Device.hw_contexts``, docs/cli.md "amdxdna info"). A query the driver
does not have (EOPNOTSUPP, e.g. QUERY_RESOURCE_INFO before feature level 0.4) is reported as "not
supported by this driver". ``--json`` prints a JSON document even when the device cannot be opened.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import abi, doctor, open_device
from ..device import Device, HwContextEntry, pci_generation
from ..errors import XdnaError
from . import Subparsers, add_device_option, command_parser, dump_json, fail, shown

__all__ = ["collect", "context_dict", "query", "error_text", "clock_mhz", "format_info", "format_contexts",
           "sysfs_pci", "add_parser", "run", "PRIORITY_NAMES", "HEALTH_FIELDS"]

NOT_SUPPORTED = "not supported by this driver"
DEVICE_TYPES = {"-1": "unknown", "0": "KMQ", "1": "UMQ", "2": "PF"}  # enum amdxdna_device_type (docs/cli.md)
# qos priority of a context entry (the AMDXDNA_QOS_*_PRIORITY values; docs/cli.md "amdxdna info").
PRIORITY_NAMES = {abi.AMDXDNA_QOS_REALTIME_PRIORITY: "realtime", abi.AMDXDNA_QOS_HIGH_PRIORITY: "high",
                  abi.AMDXDNA_QOS_NORMAL_PRIORITY: "normal", abi.AMDXDNA_QOS_LOW_PRIORITY: "low"}
QOS_FIELDS = ("gops", "fps", "dma_bandwidth", "latency", "frame_exec_time")
# The context's health record: where the firmware was when a command failed (docs/cli.md "amdxdna info").
HEALTH_FIELDS = ("txn_op_idx", "ctx_pc", "fatal_error_type", "fatal_error_exception_type",
                 "fatal_error_exception_pc", "fatal_error_app_module")

EXIT_CODES = """\
exit codes:
  0    the device was opened and every query answered (a query this driver lacks is reported, not a failure)
  1    the device could not be opened, or a query failed (message on stderr; with --json the document
       carries the error too; `amdxdna doctor` says why)
  2    usage error (bad option; unknown emulator profile in --device or $AMDXDNA_DEVICE)"""


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``info`` on an ``argparse`` subparsers object."""
    parser = command_parser(
        subparsers, "info",
        "Show the device node, PCI id and generation, driver name and DRM version (feature level), "
        "firmware version, AIE version and geometry, clocks, power mode, resource info and the driver's "
        "full entry for every hardware context of every process (GET_ARRAY: id, columns, pid and process "
        "name, state, priority, QoS, submissions, completions, errors, migrations, preemptions, suspensions, "
        "heap usage and the health record of a failed command).", EXIT_CODES)
    add_device_option(parser, "device to query", "$AMDXDNA_DEVICE, else the first /dev/accel node driven by amdxdna")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object, also when the device cannot be opened (default: text)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Query the device and print; return 0, or 1 when it cannot be opened or a query failed."""
    try:
        dev = open_device(args.device)
    except XdnaError as exc:
        return fail("info", str(exc), args.json, device=_spec_text(args.device), hint="`amdxdna doctor` says why")
    with dev:
        info = collect(dev)
    print(dump_json("info", info, indent=2) if args.json else format_info(info))
    failed = [key for key, value in info.items() if error_text(value) not in (None, NOT_SUPPORTED)]
    if failed:
        print(f"amdxdna info: {shown(dev.name)}: query failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _spec_text(spec: Any) -> str | None:
    if spec is None or isinstance(spec, str):
        return spec
    profile = getattr(getattr(spec, "profile", None), "name", None)
    return f"emu:{profile}" if profile else type(spec).__name__


def collect(dev: Device) -> dict[str, Any]:
    """Everything ``info`` shows, as plain data; failed queries become ``{"error": message}``."""
    version = dev.version
    return {
        "device": dev.name,
        "pci": _pci(dev),
        "driver": {"name": version.name, "version": f"{version.major}.{version.minor}.{version.patchlevel}",
                   "feature_level": version.minor, "desc": version.desc, "date": version.date,
                   "emulator_driver": dev.emulator.profile.driver if dev.emulator is not None else None},
        "firmware": query(lambda: str(dev.firmware_version())),
        "aie": query(lambda: _aie(dev)),
        "clocks": query(lambda: clock_mhz(dev)),
        "power_mode": query(lambda: dev.power_mode().name),
        "resources": query(lambda: vars(dev.resource_info()).copy()),
        "contexts": query(lambda: [context_dict(c) for c in dev.hw_contexts()]),
    }


def context_dict(entry: HwContextEntry) -> dict[str, Any]:
    """Every field of the driver's context entry (None where its entry is too short), plus ``state_name``
    and ``priority_name`` decoded."""
    out = dataclasses.asdict(entry)
    out["state_name"] = entry.state_name
    out["priority_name"] = None if entry.priority is None else PRIORITY_NAMES.get(entry.priority,
                                                                                  f"{entry.priority:#x}")
    return out


def query(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``{"error": message}`` when it raises XdnaError ("not supported by this driver" for EOPNOTSUPP)."""
    try:
        return fn()
    except XdnaError as exc:
        return {"error": NOT_SUPPORTED if exc.errno == errno.EOPNOTSUPP else str(exc)}


def clock_mhz(dev: Device) -> dict[str, int]:
    """The two clocks of GET_INFO QUERY_CLOCK_METADATA: name -> MHz.

    Raises:
        XdnaError: the query failed.
    """
    clocks = dev.clock_metadata()
    return {c.name: c.freq_mhz for c in (clocks.mp_npu_clock, clocks.h_clock)}


def _pci(dev: Device) -> dict[str, Any]:
    if dev.emulator is not None:
        profile = dev.emulator.profile
        return {"source": "emulator profile", "vendor": f"{doctor.AMD_VENDOR_ID:04x}",
                "device": f"{profile.pci_device:04x}", "revision": f"{profile.pci_revision:02x}",
                "generation": profile.name, "vbnv": profile.vbnv, "device_type": DEVICE_TYPES["0"]}
    return sysfs_pci(Path("/"), Path(dev.name).name)


def sysfs_pci(root: Path, accel_name: str) -> dict[str, Any]:
    """The PCI identity of ``accelN`` from ``root/sys/class/accel/accelN/device`` (docs/uapi.md 8); missing items are
    None."""
    attributes = doctor.sysfs_attributes(root, accel_name)
    vendor, device_id, revision = (doctor.hex_attribute(attributes, k) for k in ("vendor", "device", "revision"))
    return {"source": f"/sys/class/accel/{accel_name}/device", "slot": attributes.get("pci_slot"),
            "vendor": _hex_text(vendor, 4), "device": _hex_text(device_id, 4), "revision": _hex_text(revision, 2),
            "generation": pci_generation(device_id, revision or 0) if device_id is not None else None,
            "vbnv": attributes.get("vbnv"), "fw_version": attributes.get("fw_version"),
            "device_type": DEVICE_TYPES.get(attributes.get("device_type", ""), attributes.get("device_type")),
            "driver": attributes.get("driver")}


def _hex_text(value: int | None, digits: int) -> str | None:
    return None if value is None else f"{value:0{digits}x}"


def _aie(dev: Device) -> dict[str, Any]:
    version, meta = dev.aie_version(), dev.aie_metadata()
    rows = {kind: {"row_start": t.row_start, "row_count": t.row_count, "dma_channels": t.dma_channel_count,
                   "locks": t.lock_count} for kind, t in (("shim", meta.shim), ("mem", meta.mem), ("core", meta.core))}
    return {"version": f"{version.major}.{version.minor}", "arch": f"{meta.version.major}.{meta.version.minor}",
            "columns": meta.cols, "rows": meta.rows, "col_size": meta.col_size, "tiles": rows}


def error_text(value: Any) -> str | None:
    """The message of a failed query's ``{"error": message}``, None for an answer."""
    return value["error"] if isinstance(value, dict) and set(value) == {"error"} else None


def format_info(info: dict[str, Any]) -> str:
    """The text form: one labelled line per item, then the context table."""
    lines = [f"{'device':<12}{info['device']}", f"{'pci':<12}{_format_pci(info['pci'])}"]
    driver = info["driver"]
    emulated = f"; emulator driver profile {driver['emulator_driver']}" if driver.get("emulator_driver") else ""
    lines.append(f"{'driver':<12}{driver['name']} {driver['version']} (feature level 0.{driver['feature_level']}; "
                 f"{driver['desc']}{emulated})")
    for label, key, fmt in (("firmware", "firmware", str), ("aie", "aie", _format_aie),
                            ("clocks", "clocks", _format_clocks), ("power mode", "power_mode", str),
                            ("resources", "resources", _format_resources)):
        value = info[key]
        lines.append(f"{label:<12}{error_text(value) or fmt(value)}")
    lines += _format_contexts(info["contexts"])
    return "\n".join(lines)


def _format_pci(pci: dict[str, Any]) -> str:
    parts = [f"{pci.get('slot')} " if pci.get("slot") else "",
             f"{pci.get('vendor') or '?'}:{pci.get('device') or '?'} rev {pci.get('revision') or '?'}",
             f", {pci.get('generation') or 'unknown generation'}", f", {pci.get('vbnv')}" if pci.get("vbnv") else "",
             f", {pci['device_type']}" if pci.get("device_type") else "", f" (from {pci['source']})"]
    return "".join(parts)


def _format_aie(aie: dict[str, Any]) -> str:
    tiles = aie["tiles"]
    kinds = ", ".join(f"{kind} {_rows(t['row_start'], t['row_count'])}" for kind, t in tiles.items())
    return f"version {aie['version']}, arch {aie['arch']}; {aie['columns']} columns x {aie['rows']} rows ({kinds})"


def _rows(start: int, count: int) -> str:
    return f"row {start}" if count == 1 else f"rows {start}-{start + count - 1}"


def _format_clocks(clocks: dict[str, int]) -> str:
    return ", ".join(f"{name} {mhz} MHz" for name, mhz in clocks.items())


def _format_resources(r: dict[str, int]) -> str:
    return (f"clock max {r['npu_clk_max']} MHz, TOPS {r['npu_tops_curr']} now / {r['npu_tops_max']} max, "
            f"contexts {r['npu_task_curr']} of {r['npu_task_max']}")


def _format_contexts(contexts: Any) -> list[str]:
    if error_text(contexts):
        return [f"{'contexts':<12}{error_text(contexts)}"]
    if not contexts:
        return [f"{'contexts':<12}none"]
    return [f"{'contexts':<12}{len(contexts)}", *format_contexts(contexts)]


def format_contexts(contexts: list[dict[str, Any]], rates: dict[int, dict[str, float]] | None = None) -> list[str]:
    """The context table: one row per entry (with ``rates[context_id]`` per second when given), and below a
    row its QoS and heap when the driver reports them, and its health record when a command failed."""
    rate_head = f" {'sub/s':>8} {'done/s':>8}" if rates is not None else ""
    lines = [f"  {'id':>4} {'columns':>9} {'pid':>8} {'process':<16} {'state':<7} {'prio':<8} {'submitted':>10} "
             f"{'completed':>10} {'errors':>7}{rate_head}"]
    for c in contexts:
        cols = f"{c['start_col']}-{c['start_col'] + c['num_col'] - 1}"
        rate = ""
        if rates is not None:
            r = rates.get(c["context_id"], {})
            rate = f" {_rate(r.get('command_submissions')):>8} {_rate(r.get('command_completions')):>8}"
        lines.append(f"  {c['context_id']:>4} {cols:>9} {c['pid']:>8} {shown(c['name']) if c.get('name') else '-':<16} "
                     f"{c.get('state_name') or '-':<7} {c.get('priority_name') or '-':<8} "
                     f"{c['command_submissions']:>10} {c['command_completions']:>10} {c['errors']:>7}{rate}")
        lines += _context_details(c)
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _context_details(c: dict[str, Any]) -> list[str]:
    details = []
    if c.get("hwctx_id") is not None:
        qos = ", ".join(f"{name} {c[name]}" for name in QOS_FIELDS if c.get(name))
        details.append(f"{'':8}fw ctx {c['hwctx_id']}, pasid {c.get('pasid')}, heap {c.get('heap_usage')} B, "
                       f"migrations {c['migrations']}, preemptions {c['preemptions']}, suspensions "
                       f"{c.get('suspensions')}; QoS {qos or 'none requested'}")
    if any(c.get(name) for name in HEALTH_FIELDS):
        details.append(f"{'':8}health: TXN op {c['txn_op_idx']}, pc {c['ctx_pc']:#x}, fatal error type "
                       f"{c['fatal_error_type']}, exception type {c['fatal_error_exception_type']} at pc "
                       f"{c['fatal_error_exception_pc']:#x}, app module {c['fatal_error_app_module']}")
    return details
