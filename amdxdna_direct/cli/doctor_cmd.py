"""``amdxdna doctor``: check the NPU setup and say how to fix what is wrong (checks in amdxdna_direct.doctor)."""

from __future__ import annotations

import argparse
import os

from .. import doctor
from . import DEVICE_ENV, Subparsers, add_device_option, command_parser, device_spec, dump_json, fail

__all__ = ["add_parser", "run", "format_results"]

EXIT_CODES = """\
checks, in order:
  node           /dev/accel/accelN exists and sysfs says amdxdna drives it; without a node, a PCI scan says
                 why: no NPU (or disabled in the firmware setup), no driver bound (module missing or not
                 loaded for this kernel), or a failed probe (quoting the kernel-log finding)
  permission     the node opens read-write (mode bits and group, a udev rule for a root-only node;
                 container device flags)
  memlock        RLIMIT_MEMLOCK covers XRT's 64 MiB heap plus buffers (info unless XRT is installed:
                 amdxdna-direct maps nothing locked)
  kernel-log     every line of this boot's log (/dev/kmsg, else `journalctl -k -b 0`) against the rule
                 table of docs/doctor.md: IOMMU/PASID/SVA, firmware file, protocol and liveness, context
                 and heap refusals, IOMMU page faults (one or a storm), hung firmware; all findings with
                 counts and the time of the last
  feature-level  VERSION, GET_INFO, GET_ARRAY and timeline syncobjs answer as this runtime expects
  firmware       the firmware version is readable (and agrees with sysfs)
  contexts       contexts are free: live contexts vs the firmware limit, and a real CREATE_HWCTX probe
  self-test      a passthrough kernel returns its input (emulator: built in; real NPU: --xclbin/--insts)

exit codes:
  0    no check failed (warnings and skipped checks allowed)
  1    at least one check failed (a malformed --xclbin/--insts fails the self-test)
  2    usage error (bad option, --xclbin without --insts or the reverse, unknown --user, unknown emulator
       profile in --device or $AMDXDNA_DEVICE)"""

_MARK = {doctor.PASS: "pass", doctor.INFO: "info", doctor.WARN: "WARN", doctor.FAIL: "FAIL", doctor.SKIP: "skip"}


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``doctor`` on an ``argparse`` subparsers object."""
    parser = command_parser(
        subparsers, "doctor",
        "Check everything between this process and a working NPU, printing pass / WARN / FAIL / skip per "
        "check with what was found and, when it is not a pass, the fix.", EXIT_CODES)
    # $AMDXDNA_DEVICE names a device of this machine: run() applies it only to the real root.
    add_device_option(parser, "device to check",
                      "$AMDXDNA_DEVICE, else the first /dev/accel/accel* node under --root", from_env=False)
    parser.add_argument("--root", default="/", metavar="DIR",
                        help="filesystem root holding dev/, sys/, etc/ and dev/kmsg (default: /; a copied or "
                             "fake tree for offline diagnosis)")
    parser.add_argument("--user", metavar="NAME",
                        help="check the node permissions for this user (name or uid, from DIR/etc/passwd and "
                             "DIR/etc/group) instead of this process; device checks are then skipped "
                             "(default: this process)")
    parser.add_argument("--xclbin", metavar="X",
                        help="self-test design for a real NPU: a passthrough xclbin (with --insts; default: "
                             "built-in on the emulator, skipped on a real NPU)")
    parser.add_argument("--insts", metavar="I",
                        help="instruction stream of the --xclbin self-test design (default: none; required with "
                             "--xclbin)")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON: {schema, command, checks: [{name, status, detail, fix, "
                             "findings}]} (default: text)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the checks; return 1 if any failed, else 0 (2 for a usage error: --xclbin without --insts or the
    reverse, an unknown --user, a bad $AMDXDNA_DEVICE)."""
    if (args.xclbin is None) != (args.insts is None):
        return fail("doctor", "--xclbin and --insts go together (the self-test design and its instruction stream)",
                    args.json, code=2)
    try:
        host = doctor.Host.probe(args.root, user=args.user)
        device = args.device if args.device is not None else _env_device(args.root)
    except (LookupError, argparse.ArgumentTypeError) as exc:
        return fail("doctor", str(exc), args.json, code=2)
    results = doctor.run_checks(device, host=host, xclbin=args.xclbin, insts=args.insts)
    if args.json:
        print(dump_json("doctor", {"checks": [r.to_dict() for r in results]}, indent=2))
    else:
        print(format_results(results))
    return 1 if doctor.worst(results) == doctor.FAIL else 0


def _env_device(root: str) -> str | None:
    """``$AMDXDNA_DEVICE`` when checking the real root, else None.

    Raises:
        argparse.ArgumentTypeError: it names an unknown emulator profile.
    """
    text = os.environ.get(DEVICE_ENV) if root == "/" else None
    return device_spec(text) if text else None


def format_results(results: list[doctor.CheckResult]) -> str:
    """One line per check, the fix indented below it, every kernel-log finding below that, and a verdict line."""
    lines = []
    indent = " " * 22
    for r in results:
        lines.append(f"[{_MARK[r.status]}] {r.name:<14} {r.detail}")
        if r.fix and r.status != doctor.PASS:
            lines.append(f"{indent}fix: {r.fix}")
        for finding in r.findings[1:] if r.status != doctor.PASS else r.findings:
            when = f", last at {finding['time']:.3f} s" if finding["time"] is not None else ""
            lines.append(f"{indent}[{_MARK[finding['verdict']]}] {finding['meaning']} ({finding['count']}x{when})")
            if finding["fix"] and finding["verdict"] != doctor.PASS:
                lines.append(f"{indent}       fix: {finding['fix']}")
    counts = {s: sum(r.status == s for r in results) for s in _MARK}
    lines.append(f"{counts[doctor.FAIL]} failed, {counts[doctor.WARN]} warning(s), {counts[doctor.INFO]} info, "
                 f"{counts[doctor.PASS]} passed, {counts[doctor.SKIP]} skipped")
    return "\n".join(lines)
