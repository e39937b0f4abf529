"""``amdxdna insts FILE [--json]``: disassemble an NPU instruction stream (TXN, ``.bin`` or ``.txt``)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from ..insts import (
    DIRECTION_MM2S,
    DIRECTION_S2MM,
    BlockWrite,
    DdrPatch,
    InstsError,
    MaskWrite,
    Op,
    RawOp,
    Stream,
    Sync,
    Write32,
    layout,
    load,
)
from . import Subparsers, add_file_parser, inspect_file

__all__ = ["add_parser", "describe", "render", "run"]

_OP_NAMES = {Write32: "write32", BlockWrite: "blockwrite", MaskWrite: "maskwrite", Sync: "sync",
             DdrPatch: "ddr_patch", RawOp: "raw"}
_DIRECTIONS = {DIRECTION_S2MM: "S2MM", DIRECTION_MM2S: "MM2S"}
_WORDS_PER_LINE = 8


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``insts`` on an ``argparse`` subparsers object."""
    return add_file_parser(
        subparsers, "insts", "TXN stream",
        description="Decode an mlir-aie instruction stream (aie-rt TXN format, binary or one hex word per "
                    "line) and list its header and ops with the word offset of each op. Ops the runtime does not "
                    "decode (MASKPOLL, custom ops, ...) are listed as their raw words with their size.")


def run(args: argparse.Namespace) -> int:
    """Decode ``args.file`` and print it; 0 on success, 1 if it cannot be read or decoded."""
    return inspect_file("insts", args, load, InstsError, describe, render)


def describe(stream: Stream) -> dict[str, Any]:
    """The stable JSON document of `amdxdna insts --json`: header fields and ops with their field names
    (docs/xrt-sequence.md 2.3)."""
    doc: dict[str, Any] = {"format": "txn"}
    for name in ("major", "minor", "dev_gen", "rows", "cols", "mem_tile_rows", "num_ops", "size_bytes", "pad"):
        doc[name] = getattr(stream, name)
    doc["ops"] = [_op_json(op) for op in stream.ops]
    return doc


def _op_json(op: Op) -> dict[str, Any]:
    """An op's fields (docs/xrt-sequence.md 2.3); a raw op (not decoded) adds its aie-rt ``name`` and
    ``size_bytes`` to its ``opcode``, ``words``, ``reason`` and ``sized`` (False: the length is unknown, the words
    run to the end)."""
    out: dict[str, Any] = {"op": _OP_NAMES[type(op)]}
    for f in fields(op):
        value = getattr(op, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    if isinstance(op, RawOp):
        out["name"], out["size_bytes"] = op.name, op.size_bytes
    return out


def render(stream: Stream) -> str:
    """A listing: the header, then one line per op prefixed with its word offset."""
    pad = f"  pad {stream.pad:#06x}" if stream.pad else ""
    lines = [f"TXN {stream.major}.{stream.minor}  dev_gen {stream.dev_gen}  rows {stream.rows}  cols {stream.cols}"
             f"  mem_tile_rows {stream.mem_tile_rows}  ops {stream.num_ops}  size {stream.size_bytes} bytes{pad}",
             f"{'word':>6}  op"]
    for start, op in zip(layout(stream), stream.ops, strict=True):
        lines.append(f"{start:>6}  {_op_text(op)}")
        if isinstance(op, (BlockWrite, RawOp)):
            for i in range(0, len(op.words), _WORDS_PER_LINE):
                lines.append(" " * 8 + "  " + " ".join(f"{w:08x}" for w in op.words[i:i + _WORDS_PER_LINE]))
    if stream.unwalked_ops:
        lines.append(f"{'':>6}  ({stream.unwalked_ops} more op(s) of the header inside the last raw op)")
    return "\n".join(lines)


def _reason(op: RawOp) -> str:
    # The reason starts "word N: ..." (the decoder's message); the listing shows the word already.
    head, sep, rest = op.reason.partition(": ")
    return rest if sep and head.startswith("word ") else op.reason


def _tile(addr: int) -> str:
    # Tile address = col << 25 | row << 20 | offset (docs/xrt-sequence.md 2.3).
    return f"(col {addr >> 25} row {(addr >> 20) & 0x1F} +{addr & 0xFFFFF:#x})"


def _op_text(op: Op) -> str:
    if isinstance(op, RawOp):
        if op.sized:
            size = f"{op.size_bytes} bytes"
            note = "" if op.reason.endswith("is not decoded") else f"  kept raw: {_reason(op)}"
        else:
            size, note = f"{op.size_bytes} bytes to the end (length unknown, op count not checked)", ""
        return f"RAW {op.name:<8} opcode {op.opcode:#04x}  {size}{note}"
    if isinstance(op, Write32):
        return f"WRITE32     addr {op.addr:#010x} {_tile(op.addr)}  value {op.value:#010x}"
    if isinstance(op, MaskWrite):
        return f"MASKWRITE   addr {op.addr:#010x} {_tile(op.addr)}  value {op.value:#010x}  mask {op.mask:#010x}"
    if isinstance(op, BlockWrite):
        return f"BLOCKWRITE  addr {op.addr:#010x} {_tile(op.addr)}  {len(op.words)} words"
    if isinstance(op, DdrPatch):
        return f"DDR_PATCH   reg_addr {op.reg_addr:#010x} {_tile(op.reg_addr)}  arg_idx {op.arg_idx}  " \
               f"arg_plus {op.arg_plus:#x}"
    return (f"SYNC        direction {_DIRECTIONS.get(op.direction, op.direction)}  row {op.row}  col {op.col}  "
            f"channel {op.channel}  row_num {op.row_num}  col_num {op.col_num}")
