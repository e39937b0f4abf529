"""A firmware-side walker over TXN instruction streams (the aie-rt transaction format of insts.bin).

Format (docs/xrt-sequence.md 2.3, checked against the fixture streams word by word): a 4-word
header `numRows<<24 | devGen<<16 | minor<<8 | major`, `numMemTileRows<<8 | numCols`, op count, total
bytes; then the ops, each self-describing its length:

    WRITE32     [0x00, 0, addr, 0, value, 24]
    BLOCKWRITE  [0x01, 0, addr, bytes, data...]           (bytes counts the 4 header words)
    MASKWRITE   [0x03, 0, addr, 0, value, mask, 28]
    MASKPOLL    [0x04, 0, addr, 0, value, mask, 28]       (MASKPOLL_BUSY 0x07: the same encoding)
    NOOP 0x05, PREEMPT 0x06, UPDATE_SCRATCH 0x0D          one word (opcode byte, then fields; no size)
    LOAD_PM_START 0x09, UPDATE_STATE_TABLE 0x0B            two words
    UPDATE_REG 0x0C                                        three words
    LOADPDI 0x08, CREATE_SCRATCHPAD 0x0A                   four words
    custom      [0x80.., bytes, ...]                      (TCT sync 0x80, DDR_PATCH 0x81, READ_REGS 0x82,
                                                           RECORD_TIMER 0x83, MERGE_SYNC 0x84)
    DDR_PATCH   [0x81, 48, 0, 0, 0, 0, reg_addr, 0, arg_idx, 0, arg_plus, 0]
    SYNC (TCT)  [0x80, 16, dir | row<<8 | col<<16, rownum<<8 | colnum<<16 | chan<<24]

That is version 0.1. A version 1.0 stream (the 2024 "optimized" encoding, docs/runtime.md 1.1) is walked too,
with its shorter ops: WRITE32 [0x00, addr, value], MASKWRITE / MASKPOLL [op, addr, value, mask], BLOCKWRITE
[0x01, addr, bytes, data...] (bytes counting its 3 header words), DDR_PATCH [0x81, 24, reg_addr, arg_idx,
arg_plus (2 words)]; the other ops keep their lengths.

The walker models WRITE32, BLOCKWRITE, MASKWRITE, DDR_PATCH and the TCT sync. A poll's register is checked
against the partition and the poll taken as satisfied; every other known op is skipped by its length (the
size word of custom ops, the fixed encoding of the others) and listed in ``TxnProgram.skipped``. Reserved and
padding bytes are not read (the high word of a 64-bit register offset included), as the firmware ignores
them. An unknown opcode or a malformed size is an error (docs/emulator.md, rule 53).

Register addresses are partition-relative tile addresses `col<<25 | row<<20 | offset`. A shim
buffer descriptor i lives at 0x1D000 + 0x20*i with word 0 its length in 32-bit words; a
DDR_PATCH targets word 1 (the address, +4) of a BD (docs/design.md section 2).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

OP_WRITE32 = 0x00
OP_BLOCKWRITE = 0x01
OP_MASKWRITE = 0x03
OP_MASKPOLL = 0x04
OP_NOOP = 0x05
OP_PREEMPT = 0x06
OP_MASKPOLL_BUSY = 0x07
OP_LOADPDI = 0x08
OP_LOAD_PM_START = 0x09
OP_CREATE_SCRATCHPAD = 0x0A
OP_UPDATE_STATE_TABLE = 0x0B
OP_UPDATE_REG = 0x0C
OP_UPDATE_SCRATCH = 0x0D
OP_TCT = 0x80
OP_DDR_PATCH = 0x81
OP_READ_REGS = 0x82
OP_RECORD_TIMER = 0x83
OP_MERGE_SYNC = 0x84
OP_CUSTOM_LAST = OP_MERGE_SYNC

HEADER_WORDS = 4
TXN_MAJOR, TXN_MINOR = 0, 1
TXN_2024 = (1, 0)            # the 2024 encoding, walked with its own op layouts
AIE_ROWS = 6
SHIM_BD_BASE = 0x1D000
SHIM_BD_STRIDE = 0x20
SHIM_BD_COUNT = 16
# The shim DMA registers the firmware model reads (BDs, channel control, task queues); other writes are checked only.
SHIM_DMA_FIRST, SHIM_DMA_END = 0x1D000, 0x1D300
# Shim DMA task queues (AIE-ML register map): S2MM 0/1 at 0x1D204/0x1D20C, MM2S 0/1 at 0x1D214/0x1D21C.
TASK_QUEUES = {0x1D204: ("s2mm", 0), 0x1D20C: ("s2mm", 1), 0x1D214: ("mm2s", 0), 0x1D21C: ("mm2s", 1)}

# Ops whose last word repeats their size in bytes (version 0.1).
_FIXED_WORDS = {OP_WRITE32: 6, OP_MASKWRITE: 7, OP_MASKPOLL: 7, OP_MASKPOLL_BUSY: 7}


@dataclass(frozen=True)
class _Encoding:
    """Where a version's ops keep their fields: word positions within the op."""

    fixed: dict[int, int]          # opcode -> words, for ops whose last word is their size (none in 1.0)
    unsized: dict[int, int]        # opcode -> words, for ops with no size word
    addr: int                      # the register word of WRITE32 / MASKWRITE / MASKPOLL / BLOCKWRITE
    value: int                     # WRITE32's / MASKWRITE's value word (MASKWRITE's mask is the next one)
    block_size: int                # BLOCKWRITE's size word; its data follows it
    patch_words: int               # DDR_PATCH: its length, and where reg_addr, arg_idx, arg_plus (lo, hi) are
    patch_fields: tuple[int, int, int]


# Ops with no size word: their length is their header struct's (aie-rt's XAie_*Hdr).
_HEADER_ONLY_WORDS = {OP_NOOP: 1, OP_PREEMPT: 1, OP_LOADPDI: 4, OP_LOAD_PM_START: 2, OP_CREATE_SCRATCHPAD: 4,
                      OP_UPDATE_STATE_TABLE: 2, OP_UPDATE_REG: 3, OP_UPDATE_SCRATCH: 1}
_TILE_OFFSET_MASK = (1 << 20) - 1
_ENCODINGS = {
    (TXN_MAJOR, TXN_MINOR): _Encoding(fixed=_FIXED_WORDS, unsized=_HEADER_ONLY_WORDS, addr=2, value=4, block_size=3,
                                      patch_words=12, patch_fields=(6, 8, 10)),
    TXN_2024: _Encoding(fixed={}, unsized=_HEADER_ONLY_WORDS | {OP_WRITE32: 3, OP_MASKWRITE: 4, OP_MASKPOLL: 4,
                                                                OP_MASKPOLL_BUSY: 4},
                        addr=1, value=2, block_size=2, patch_words=6, patch_fields=(2, 3, 4)),
}


class TxnError(ValueError):
    """A malformed stream; `op_index` is the op being decoded (-1 for the header)."""

    def __init__(self, message: str, op_index: int = -1):
        super().__init__(message if op_index < 0 else f"op {op_index}: {message}")
        self.op_index = op_index


@dataclass(frozen=True)
class TxnHeader:
    """The 4-word stream header."""

    major: int
    minor: int
    dev_gen: int
    num_rows: int
    num_cols: int
    num_mem_tile_rows: int
    num_ops: int
    size: int


@dataclass(frozen=True)
class DdrPatch:
    """A DDR_PATCH: BD address register `reg_addr` <- regmap slot `arg_idx` + `arg_plus`, over `length` bytes."""

    op_index: int
    reg_addr: int
    arg_idx: int
    arg_plus: int
    length: int
    col: int = 0            # the shim tile (partition-relative column) and BD the patch is for
    bd: int = 0


@dataclass(frozen=True)
class QueuePush:
    """A write to a shim DMA task queue: starts BD `bd` on a channel, `repeat` + 1 times."""

    op_index: int
    col: int
    direction: str
    channel: int
    bd: int
    repeat: int


@dataclass(frozen=True)
class Sync:
    """A TCT sync: firmware waits for the DMA completions of a channel."""

    op_index: int
    direction: int
    row: int
    col: int
    channel: int


@dataclass
class TxnProgram:
    """A walked stream: its header and what firmware acts on, in op order."""

    header: TxnHeader
    registers: dict[int, int] = field(default_factory=dict)   # last value of each shim DMA register written
    patches: list[DdrPatch] = field(default_factory=list)
    pushes: list[QueuePush] = field(default_factory=list)
    syncs: list[Sync] = field(default_factory=list)
    skipped: list[tuple[int, int]] = field(default_factory=list)   # (op index, opcode) walked, not modelled

    def directions(self, patch: DdrPatch) -> set[str]:
        """The DMA directions ("mm2s": the device reads the buffer, "s2mm": it writes it) the patched BD is started
        on by task-queue pushes of this stream; empty when no push names it (a chained BD)."""
        return {push.direction for push in self.pushes if (push.col, push.bd) == (patch.col, patch.bd)}

    @property
    def last_sync_index(self) -> int:
        """Op index of the final sync (where firmware waits for the data), 0xFFFFFFFF when none."""
        return self.syncs[-1].op_index if self.syncs else 0xFFFFFFFF


def parse_header(data: bytes | memoryview) -> TxnHeader:
    """Decode the 4-word header.

    Raises:
        TxnError: shorter than a header.
    """
    if len(data) < HEADER_WORDS * 4:
        raise TxnError(f"stream of {len(data)} bytes is shorter than the {HEADER_WORDS * 4}-byte TXN header")
    w0, w1, num_ops, size = struct.unpack_from("<4I", data)
    return TxnHeader(major=w0 & 0xFF, minor=(w0 >> 8) & 0xFF, dev_gen=(w0 >> 16) & 0xFF, num_rows=w0 >> 24,
                     num_cols=w1 & 0xFF, num_mem_tile_rows=(w1 >> 8) & 0xFF, num_ops=num_ops, size=size)


def walk(data: bytes | memoryview, dev_gen: int) -> TxnProgram:
    """Walk a stream as firmware does: header checks, then every op in order.

    Raises:
        TxnError: another device generation or TXN version, a size that does not match the
            stream, an unknown or truncated op, an address outside the partition, a DDR_PATCH
            of something other than a shim BD address or of a BD whose length was never written.
    """
    header = _checked_header(data, dev_gen)
    encoding = _ENCODINGS[header.major, header.minor]
    words = memoryview(bytes(data[:header.size])).cast("I")
    program = TxnProgram(header)
    pos = HEADER_WORDS
    for index in range(header.num_ops):
        if pos >= len(words):
            raise TxnError(f"stream ends after {index} of {header.num_ops} ops", index)
        length = _op_words(words, pos, index, encoding)
        _apply(program, words[pos:pos + length], index, encoding)
        pos += length
    if pos != len(words):
        raise TxnError(f"{(len(words) - pos) * 4} bytes follow the last of {header.num_ops} ops")
    return program


def _checked_header(data: bytes | memoryview, dev_gen: int) -> TxnHeader:
    header = parse_header(data)
    if header.dev_gen != dev_gen:
        raise TxnError(f"TXN stream is for device generation {header.dev_gen}, this device is generation {dev_gen}")
    if (header.major, header.minor) not in _ENCODINGS:
        raise TxnError(f"TXN version {header.major}.{header.minor} is neither {TXN_MAJOR}.{TXN_MINOR} nor "
                       f"{TXN_2024[0]}.{TXN_2024[1]}")
    if header.num_rows != AIE_ROWS or header.num_cols == 0:
        raise TxnError(f"TXN header geometry rows={header.num_rows} cols={header.num_cols} is not an AIE2 partition")
    if header.size % 4 or header.size < HEADER_WORDS * 4 or header.size > len(data):
        raise TxnError(f"TXN header size {header.size} does not fit the {len(data)}-byte stream")
    return header


def _op_words(words: memoryview, pos: int, index: int, encoding: _Encoding) -> int:
    """Length in words of the op at `pos`."""
    opcode = words[pos] & 0xFF
    fixed = encoding.fixed
    if opcode in encoding.unsized:
        length = encoding.unsized[opcode]
        if pos + length > len(words):
            raise TxnError(f"opcode {opcode:#x} is truncated", index)
        return length
    if opcode in fixed:
        length = fixed[opcode]
        size_pos = pos + length - 1
    elif opcode == OP_BLOCKWRITE:
        size_pos = pos + encoding.block_size
    elif OP_TCT <= opcode <= OP_CUSTOM_LAST:
        size_pos = pos + 1
    else:
        raise TxnError(f"unknown TXN opcode {opcode:#x}", index)
    if size_pos >= len(words):
        raise TxnError(f"opcode {opcode:#x} is truncated", index)
    size = words[size_pos]
    if opcode in fixed and size != fixed[opcode] * 4:
        raise TxnError(f"opcode {opcode:#x} declares {size} bytes, its encoding has {fixed[opcode] * 4}", index)
    if size % 4 or size < (size_pos - pos + 1) * 4 or pos + size // 4 > len(words):
        raise TxnError(f"opcode {opcode:#x} declares a bad size of {size} bytes", index)
    return size // 4


def _apply(program: TxnProgram, op: memoryview, index: int, encoding: _Encoding) -> None:
    opcode = op[0] & 0xFF
    a, value = encoding.addr, encoding.value
    if opcode == OP_WRITE32:
        _write(program, op[a], op[value], index)
    elif opcode == OP_MASKWRITE:
        old, mask = program.registers.get(op[a], 0), op[value + 1]
        _write(program, op[a], (old & ~mask) | (op[value] & mask), index)
    elif opcode == OP_BLOCKWRITE:
        _block_write(program, op[a], op[encoding.block_size + 1:], index)
    elif opcode == OP_DDR_PATCH:
        program.patches.append(_patch(program, op, index, encoding))
    elif opcode == OP_TCT:
        program.syncs.append(_sync(op, index))
    else:
        if opcode in (OP_MASKPOLL, OP_MASKPOLL_BUSY):
            _check_addr(program, op[a], index)
        program.skipped.append((index, opcode))


def _check_addr(program: TxnProgram, addr: int, index: int) -> None:
    col, row = addr >> 25, (addr >> 20) & 0x1F
    if col >= program.header.num_cols or row >= program.header.num_rows:
        raise TxnError(f"register {addr:#x} (col {col}, row {row}) is outside the "
                       f"{program.header.num_cols}-column partition", index)


def _block_write(program: TxnProgram, addr: int, values: memoryview, index: int) -> None:
    """A BLOCKWRITE, one tile's register space at a time, keeping only the shim DMA words.

    The firmware model reads nothing but shim BDs and task queues, so the rest of a block is checked per tile,
    not stored word by word: a stream of millions of words costs neither memory nor time.
    """
    end = addr + 4 * len(values)
    start = addr
    while start < end:
        stop = min(end, (start | _TILE_OFFSET_MASK) + 1)
        _check_addr(program, start, index)
        tile = start & ~_TILE_OFFSET_MASK
        lo, hi = max(start, tile + SHIM_DMA_FIRST), min(stop, tile + SHIM_DMA_END)
        if not (start >> 20) & 0x1F and lo < hi:
            for i in range(-(-(lo - addr) // 4), -(-(hi - addr) // 4)):
                _write(program, addr + 4 * i, values[i], index)
        start = stop


def _write(program: TxnProgram, addr: int, value: int, index: int) -> None:
    _check_addr(program, addr, index)
    if (addr >> 20) & 0x1F or not SHIM_DMA_FIRST <= addr & _TILE_OFFSET_MASK < SHIM_DMA_END:
        return              # not a shim DMA register: nothing the firmware model reads (see _block_write)
    program.registers[addr] = value & 0xFFFFFFFF
    queue = TASK_QUEUES.get(addr & _TILE_OFFSET_MASK)
    if queue is not None:
        program.pushes.append(QueuePush(index, addr >> 25, queue[0], queue[1], value & 0xF, (value >> 16) & 0xFF))


def _patch(program: TxnProgram, op: memoryview, index: int, encoding: _Encoding) -> DdrPatch:
    if len(op) != encoding.patch_words:
        raise TxnError(f"DDR_PATCH has {len(op)} words, the encoding has {encoding.patch_words}", index)
    reg, idx, plus = encoding.patch_fields
    if encoding.patch_words == 12:
        reg_addr, arg_idx = op[reg] | (op[reg + 1] << 32), op[idx] | (op[idx + 1] << 32)
    else:                      # 1.0: a 32-bit register, a u8 argument index with 3 padding bytes
        reg_addr, arg_idx = op[reg], op[idx] & 0xFF
    arg_plus = op[plus] | (op[plus + 1] << 32)
    _check_addr(program, reg_addr, index)
    offset = reg_addr & _TILE_OFFSET_MASK
    bd, word = divmod(offset - SHIM_BD_BASE, SHIM_BD_STRIDE)
    if (reg_addr >> 20) & 0x1F or not 0 <= bd < SHIM_BD_COUNT or word != 4:
        raise TxnError(f"DDR_PATCH register {reg_addr:#x} is not a shim BD address word", index)
    length_words = program.registers.get(reg_addr - 4)
    if length_words is None:
        raise TxnError(f"DDR_PATCH of shim BD {bd} before its length was written", index)
    return DdrPatch(index, reg_addr, arg_idx, arg_plus, length_words * 4, col=reg_addr >> 25, bd=bd)


def _sync(op: memoryview, index: int) -> Sync:
    if len(op) != 4:
        raise TxnError(f"TCT sync has {len(op)} words, the encoding has 4", index)
    where, what = op[2], op[3]
    return Sync(index, direction=where & 0xFF, row=(where >> 8) & 0xFF, col=(where >> 16) & 0xFF,
                channel=(what >> 24) & 0xFF)
