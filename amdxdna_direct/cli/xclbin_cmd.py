"""``amdxdna xclbin FILE [--json]``: summarise an xclbin, like ``xclbinutil --info``."""

from __future__ import annotations

import argparse
import uuid as uuidlib
from typing import Any

from ..xclbin import IP_PS_KERNEL, IP_TYPES, MEM_TYPES, AiePartition, Kernel, Xclbin, XclbinError, parse
from . import Subparsers, add_file_parser, inspect_file

__all__ = ["add_parser", "describe", "render", "run"]


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``xclbin`` on an ``argparse`` subparsers object."""
    return add_file_parser(
        subparsers, "xclbin", "xclbin",
        description="Print what an xclbin holds: header (uuid, version, platform), the section table, "
                    "memory topology, IP layout, kernels with their arguments (regmap offset and size) "
                    "and the AIE partition (columns, PDIs and their CDO groups).")


def run(args: argparse.Namespace) -> int:
    """Parse ``args.file`` and print its summary; 0 on success, 1 if it cannot be read or parsed."""
    return inspect_file("xclbin", args, parse, XclbinError, describe, render)


# --------------------------------------------------------------------------------------------- JSON


def describe(x: Xclbin) -> dict[str, Any]:
    """The stable JSON document of issue 2 item 7 (uuids as 32 hex digits, section kinds by enum name)."""
    return {
        "uuid": x.uuid.hex(),
        "length": x.length,
        "sections": [{"kind": s.kind_name, "name": s.name, "offset": s.offset, "size": s.size} for s in x.sections],
        "kernels": [_kernel_json(k) for k in x.kernels],
        "partition": _partition_json(x.partition) if x.partition is not None else None,
    }


def _kernel_json(k: Kernel) -> dict[str, Any]:
    return {
        "name": k.name, "type": k.type, "dpu_kernel_id": k.dpu_kernel_id, "instances": list(k.instances),
        "args": [{"name": a.name, "index": a.index, "offset": a.offset, "size": a.size, "kind": a.kind}
                 for a in k.args],
    }


def _partition_json(p: AiePartition) -> dict[str, Any]:
    return {
        "column_width": p.column_width, "start_columns": list(p.start_columns), "ops_per_cycle": p.ops_per_cycle,
        "pdis": [{"uuid": pdi.uuid.hex(), "size": pdi.size, "sha256": pdi.sha256,
                  "cdo_groups": [{"name": g.name, "type": g.type_name, "pdi_id": g.pdi_id,
                                  "dpu_kernel_ids": list(g.dpu_kernel_ids), "pre_cdo_groups": list(g.pre_cdo_groups)}
                                 for g in pdi.cdo_groups]}
                 for pdi in p.pdis],
    }


# --------------------------------------------------------------------------------------------- text


def render(x: Xclbin) -> str:
    """A human-readable summary, section by section."""
    lines = _header_lines(x) + _section_lines(x) + _memory_lines(x) + _ip_lines(x) + _kernel_lines(x)
    lines += _partition_lines(x.partition)
    return "\n".join(lines)


def _header_lines(x: Xclbin) -> list[str]:
    h = x.header
    return [
        "xclbin",
        f"  uuid             {uuidlib.UUID(bytes=h.uuid)}",
        f"  length           {h.length} bytes",
        f"  version          {h.version}",
        f"  mode             {h.mode}",
        f"  action mask      0x{h.action_mask:x}",
        f"  platform VBNV    {h.platform_vbnv or '(none)'}",
        f"  timestamp        {h.timestamp}",
        f"  signature        {'none' if h.signature_length < 0 else f'{h.signature_length} bytes'}",
    ]


def _section_lines(x: Xclbin) -> list[str]:
    lines = [f"sections ({len(x.sections)})", f"  {'kind':<28}{'name':<18}{'offset':>10}{'size':>10}"]
    for s in x.sections:
        lines.append(f"  {f'{s.kind_name} ({s.kind})':<28}{s.name or '-':<18}{s.offset:>#10x}{s.size:>10}")
    return lines


def _memory_lines(x: Xclbin) -> list[str]:
    topology = x.mem_topology
    if topology is None:
        return []
    lines = ["memory topology"]
    for i, m in enumerate(topology.entries):
        lines.append(f"  [{i}] {MEM_TYPES.get(m.type, m.type)} {'used' if m.used else 'unused'} "
                     f"{m.size_kb:#x} KiB at {m.base_address:#x} tag {m.tag or '-'}")
    return lines


def _ip_lines(x: Xclbin) -> list[str]:
    layout = x.ip_layout
    if layout is None:
        return []
    lines = ["IP layout"]
    for i, ip in enumerate(layout.entries):
        line = f"  [{i}] {ip.name} {IP_TYPES.get(ip.type, ip.type)} properties {ip.properties:#010x}"
        if ip.type == IP_PS_KERNEL:
            line += f" (subtype {ip.subtype}, functional {ip.functional}, kernel id {ip.kernel_id:#x})"
        lines.append(line)
    return lines


def _kernel_lines(x: Xclbin) -> list[str]:
    lines = [f"kernels ({len(x.kernels)})"]
    for k in x.kernels:
        dpu = f" dpu_kernel_id {k.dpu_kernel_id:#x}" if k.dpu_kernel_id is not None else ""
        lines.append(f"  {k.name} type {k.type or '-'}{dpu} instances {', '.join(k.instances) or '-'}")
        lines.append(f"    {'index':>5}  {'name':<12}{'offset':>8}{'size':>6}  {'kind':<8}type")
        lines.extend(f"    {a.index:>5}  {a.name:<12}{a.offset:>#8x}{a.size:>6}  {a.kind:<8}{a.type}" for a in k.args)
    return lines


def _partition_lines(p: AiePartition | None) -> list[str]:
    if p is None:
        return ["AIE partition: none"]
    lines = ["AIE partition",
             f"  column width     {p.column_width}",
             f"  start columns    {', '.join(str(c) for c in p.start_columns) or '-'}",
             f"  ops per cycle    {p.ops_per_cycle}",
             f"  fingerprints     inference {p.inference_fingerprint}, pre/post {p.pre_post_fingerprint}"]
    for i, pdi in enumerate(p.pdis):
        lines.append(f"  PDI {i}: uuid {uuidlib.UUID(bytes=pdi.uuid)} size {pdi.size} sha256 {pdi.sha256}")
        for g in pdi.cdo_groups:
            ids = ", ".join(f"{v:#x}" for v in g.dpu_kernel_ids) or "-"
            pre = ", ".join(f"{v:#x}" for v in g.pre_cdo_groups) or "-"
            lines.append(f"    cdo group {g.name or '-'} {g.type_name} pdi_id {g.pdi_id:#x} "
                         f"dpu_kernel_ids {ids} pre_cdo_groups {pre}")
    return lines
