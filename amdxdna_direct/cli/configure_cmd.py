"""``amdxdna configure --pmode MODE``: set the NPU's power mode through SET_STATE(SET_POWER_MODE).

SET_STATE is root-only (DRM_ROOT_ONLY: EACCES without CAP_SYS_ADMIN); the driver refuses LOW and MEDIUM
(EOPNOTSUPP) and TURBO while any hardware context exists (EINVAL). Each refusal gets its own message
(docs/cli.md "amdxdna configure").
"""

from __future__ import annotations

import argparse
import errno

from .. import open_device
from ..device import POWER_MODE_NAMES, Device
from ..errors import XdnaError
from . import Subparsers, add_device_option, command_parser, dump_json, fail

__all__ = ["PMODES", "add_parser", "run"]

PMODES = {name.lower(): value for value, name in POWER_MODE_NAMES.items()}

EXIT_CODES = """\
power modes:
  default  the driver's default clock level with clock gating
  low      refused by current drivers (EOPNOTSUPP)
  medium   refused by current drivers (EOPNOTSUPP)
  high     the highest clock level with clock gating
  turbo    the highest clock level, clock gating off; refused while any hardware context exists

exit codes:
  0    the power mode was set (or already was that mode)
  1    the device could not be opened, or the driver refused the mode: EACCES without CAP_SYS_ADMIN
       (run with sudo), EOPNOTSUPP for low/medium, EINVAL for turbo while contexts exist (message on stderr)
  2    usage error (no --pmode or an unknown mode; unknown emulator profile in --device or $AMDXDNA_DEVICE)"""


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``configure`` on an ``argparse`` subparsers object."""
    parser = command_parser(
        subparsers, "configure",
        "Set the NPU's power mode with SET_STATE(SET_POWER_MODE) and print the mode before and after "
        "(GET_POWER_MODE). The driver accepts SET_STATE only from a process with CAP_SYS_ADMIN.", EXIT_CODES)
    add_device_option(parser, "device to configure", "$AMDXDNA_DEVICE, else the first /dev/accel node driven by "
                      "amdxdna")
    parser.add_argument("--pmode", required=True, choices=tuple(PMODES), metavar="MODE",
                        help=f"the power mode to set: {', '.join(PMODES)} (required)")
    parser.add_argument("--json", action="store_true",
                        help="print {device, before, after} or {device, error} as JSON (default: text)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Set the mode; return 0, or 1 when the device cannot be opened or the driver refuses the mode."""
    mode = PMODES[args.pmode]
    try:
        dev = open_device(args.device)
    except XdnaError as exc:
        return _fail(args, None, str(exc))
    with dev:
        try:
            before = dev.power_mode().name
            dev.set_power_mode(mode)
            after = dev.power_mode().name
        except XdnaError as exc:
            return _fail(args, dev.name, _refusal(exc, args.pmode, dev))
    if args.json:
        print(dump_json("configure", {"device": dev.name, "before": before, "after": after}, indent=2))
    else:
        print(f"{dev.name}: power mode {before} -> {after}")
    return 0


def _refusal(exc: XdnaError, pmode: str, dev: Device) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"{exc}; SET_STATE needs CAP_SYS_ADMIN (the driver's DRM_ROOT_ONLY): run "
                f"`sudo amdxdna configure --pmode {pmode}`")
    if exc.errno == errno.EOPNOTSUPP:
        return f"{exc}; power mode {pmode.upper()} is not supported by this driver"
    if exc.errno == errno.EINVAL and pmode == "turbo":
        try:
            live = f"{len(dev.hw_contexts())} live"
        except XdnaError:
            live = "their number unknown"
        return f"{exc}; TURBO is refused while any hardware context exists ({live})"
    return str(exc)


def _fail(args: argparse.Namespace, device: str | None, message: str) -> int:
    return fail("configure", message, args.json, device=device)
