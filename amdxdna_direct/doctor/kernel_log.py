"""The kernel-log check: reading the log, the rules that match the driver's lines, the findings (docs/doctor.md 2)."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .host import Host, _hex, _run
from .pci import reset_ladder
from .results import _SEVERITY, FAIL, INFO, PASS, SKIP, WARN, CheckResult, _errno_name

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
