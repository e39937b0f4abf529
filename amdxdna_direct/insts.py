"""NPU instruction streams: the aie-rt transaction ("TXN") format that mlir-aie writes as ``insts.bin``.

Pure functions over bytes and word lists; the only I/O is reading a file handed to :func:`load`, through
:mod:`amdxdna_direct.files` (a regular file within the instruction-stream size limit, docs/files.md).
Format facts: ``docs/xrt-sequence.md`` section 2.3 and aie-rt ``driver/src/global/xaie_txn.h``
(``XAie_TxnHeader``, the v0.1 structs ``XAie_Write32Hdr``/``XAie_MaskWrite32Hdr``/``XAie_BlockWrite32Hdr``/
``XAie_CustomOpHdr`` + ``patch_op_t``, and the v1.0 "optimized" structs ``XAie_*Hdr_opt`` + ``patch_op_opt_t``
that 2024 mlir-aie builds emitted with header major 1, minor 0).

Decoding checks the header and walks the ops by their lengths (docs/runtime.md 1.1). The five ops the
runtime understands (WRITE32, BLOCKWRITE, MASKWRITE, SYNC, DDR_PATCH) are decoded; any other op, or one
of those five with a non-zero reserved field, is kept as a :class:`RawOp` holding its words, so that
``encode(decode(b)) == b`` holds for every stream :func:`decode` accepts. ``decode(..., strict=True)``
refuses raw ops instead.
"""

from __future__ import annotations

import array
import os
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

from .errors import Error
from .files import read_file

__all__ = [
    "VERSION_2024", "VERSION_CURRENT", "OP_NAMES", "BdLayout", "BlockWrite", "BufferReach", "DdrPatch", "InstsError",
    "MaskWrite", "Op", "RawOp", "SHIM_BD_LAYOUTS", "ShimBd", "Stream", "Sync", "Write32", "bd_span", "buffer_reach",
    "buffer_reaches", "decode", "dma_stream", "encode", "encode_words", "layout", "load", "raw_ops",
]

U32_MAX = 0xFFFF_FFFF
# The array type code of an unsigned 32-bit item on this platform.
_U32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF

# (major, minor) of the two encodings aie-rt defines (xaie_txn.h; docs/xrt-sequence.md 2.3).
VERSION_CURRENT = (0, 1)
VERSION_2024 = (1, 0)

# XAie_TxnOpcode values (xaie_txn.h): XAIE_IO_WRITE, XAIE_IO_BLOCKWRITE, XAIE_IO_MASKWRITE,
# XAIE_IO_CUSTOM_OP_TCT, XAIE_IO_CUSTOM_OP_DDR_PATCH.
OP_WRITE32 = 0x00
OP_BLOCKWRITE = 0x01
OP_MASKWRITE = 0x03
OP_SYNC = 0x80
OP_DDR_PATCH = 0x81
OP_CUSTOM_FIRST = 0x80

#: aie-rt XAie_TxnOpcode names (docs/runtime.md 1.1).
OP_NAMES = {
    0x00: "WRITE32", 0x01: "BLOCKWRITE", 0x02: "BLOCKSET", 0x03: "MASKWRITE", 0x04: "MASKPOLL", 0x05: "NOOP",
    0x06: "PREEMPT", 0x07: "MASKPOLL_BUSY", 0x08: "LOADPDI", 0x09: "LOAD_PM_START", 0x0A: "CREATE_SCRATCHPAD",
    0x0B: "UPDATE_STATE_TABLE", 0x0C: "UPDATE_REG", 0x0D: "UPDATE_SCRATCH", 0x0E: "CONFIG_SHIMDMA_BD",
    0x0F: "CONFIG_SHIMDMA_DMABUF_BD", 0x80: "SYNC", 0x81: "DDR_PATCH", 0x82: "READ_REGS", 0x83: "RECORD_TIMER",
    0x84: "MERGE_SYNC", 0x85: "CUSTOM_OP_NEXT", 200: "LOAD_PM_END_INTERNAL",
}
# Op lengths (docs/runtime.md 1.1): fixed lengths in words per version, else the word holding the op's size in
# bytes (its position in the op, and the least size it may declare: the op up to and including that word).
_FIXED_LENGTH = {
    VERSION_CURRENT: {0x05: 1, 0x06: 1, 0x08: 4, 0x09: 2, 0x0A: 4, 0x0B: 2, 0x0C: 3, 0x0D: 1},
    VERSION_2024: {0x00: 3, 0x03: 4, 0x04: 4, 0x07: 4, 0x05: 1, 0x06: 1, 0x08: 4, 0x09: 2, 0x0A: 4, 0x0B: 2,
                   0x0C: 3, 0x0D: 1},
}
_SIZE_WORD = {
    VERSION_CURRENT: {0x00: 5, 0x01: 3, 0x02: 3, 0x03: 6, 0x04: 6, 0x07: 6},
    VERSION_2024: {0x01: 2, 0x02: 2},
}
_CUSTOM_SIZE_WORD = 1
_LENGTH_UNKNOWN = frozenset({200})   # LOAD_PM_END_INTERNAL: aie-rt internal, no encoding known

HEADER_WORDS = 4

# Fixed op lengths in 32-bit words per version (v0.1: docs/xrt-sequence.md 2.3; v1.0: the *_opt structs).
_WRITE32_WORDS = {VERSION_CURRENT: 6, VERSION_2024: 3}
_MASKWRITE_WORDS = {VERSION_CURRENT: 7, VERSION_2024: 4}
_BLOCKWRITE_HEADER_WORDS = {VERSION_CURRENT: 4, VERSION_2024: 3}
_DDR_PATCH_WORDS = {VERSION_CURRENT: 12, VERSION_2024: 6}
_SYNC_WORDS = 4

# Shim tile registers used by dma_stream, mirrored from the mlir-aie fixtures (docs/xrt-sequence.md 2.3 worked example):
# shim DMA buffer descriptor i at 0x1D000 + 0x20*i (8 words, word 0 = length in words, word 1 = address low),
# channel control / start-queue registers S2MM0 0x1D200/0x1D204, S2MM1 0x1D208/0x1D20C,
# MM2S0 0x1D210/0x1D214, MM2S1 0x1D218/0x1D21C.
SHIM_BD_BASE = 0x1D000
SHIM_BD_STRIDE = 0x20
SHIM_BD_COUNT = 16
SHIM_CHANNELS = 2
_CTRL_BASE = {"out": 0x1D200, "in": 0x1D210}
_QUEUE_TOKEN = 0x8000_0000
# The fixtures program the channel controller id before a token-issuing push: MASKWRITE 0xF00 / 0x1F00.
_CTRL_VALUE = 0xF00
_CTRL_MASK = 0x1F00
# BD words 4..7 as both fixtures write them: burst length in word 4 bits 31:30 (NPU1 fixture 2, NPU2 fixture 3),
# AXI cache 0x2 in word 5 bits 27:24, valid-BD bit 25 in word 7.
_BD_BURST = {3: 0x8000_0000, 4: 0xC000_0000}
_BD_AXCACHE = 0x0200_0000
_BD_VALID = 0x0200_0000
# Tile address = col << 25 | row << 20 | offset (docs/xrt-sequence.md 2.3); row 2 is the first core tile.
COL_SHIFT = 25
ROW_SHIFT = 20
CORE_ROW = 2
# Header geometry mlir-aie writes for npu1/npu2 single-column designs: 6 rows, 1 memory-tile row.
_NUM_ROWS = 6
_MEM_TILE_ROWS = 1
# aie-rt XAie_DmaDirection: DMA_S2MM = 0, DMA_MM2S = 1.
DIRECTION_S2MM = 0
DIRECTION_MM2S = 1


class InstsError(Error, ValueError):
    """A malformed instruction stream; the message names the word index."""


@dataclass(frozen=True)
class Write32:
    """XAIE_IO_WRITE: store ``value`` at tile address ``addr``."""

    addr: int
    value: int


@dataclass(frozen=True)
class BlockWrite:
    """XAIE_IO_BLOCKWRITE: store ``words`` at consecutive addresses from ``addr``."""

    addr: int
    words: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", tuple(self.words))


@dataclass(frozen=True)
class MaskWrite:
    """XAIE_IO_MASKWRITE: ``*addr = (*addr & ~mask) | (value & mask)``."""

    addr: int
    value: int
    mask: int


@dataclass(frozen=True)
class Sync:
    """XAIE_IO_CUSTOM_OP_TCT: wait for task-completion tokens of a DMA channel."""

    direction: int
    row: int
    col: int
    channel: int
    row_num: int
    col_num: int


@dataclass(frozen=True)
class DdrPatch:
    """XAIE_IO_CUSTOM_OP_DDR_PATCH: write the address of buffer ``arg_idx`` + ``arg_plus`` to ``reg_addr``."""

    reg_addr: int
    arg_idx: int
    arg_plus: int


@dataclass(frozen=True)
class RawOp:
    """An op kept as its words, as given: not one of the decoded ops, or one with a non-zero reserved field.

    ``words`` is the whole op, its header word first. ``sized`` is False for an op whose length the runtime
    does not know: its words then run to the end of the stream (docs/runtime.md 1.1). ``reason`` says why
    the op was not decoded.
    """

    opcode: int
    words: tuple[int, ...]
    reason: str
    sized: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", tuple(self.words))

    @property
    def name(self) -> str:
        """The aie-rt name of the opcode (``MASKPOLL``, ``RECORD_TIMER`` ...), else ``OP_0x<nn>``."""
        return OP_NAMES.get(self.opcode, f"OP_0x{self.opcode:02x}")

    @property
    def size_bytes(self) -> int:
        """Bytes of the op in the stream."""
        return 4 * len(self.words)


Op = Write32 | BlockWrite | MaskWrite | Sync | DdrPatch | RawOp


@dataclass(frozen=True)
class Stream:
    """A decoded TXN stream: the header fields and the ops in order.

    ``num_ops`` and ``size_bytes`` are derived from ``ops`` (the header copies are checked on decode).
    ``pad`` is the header's reserved u16 (word 1 bits 31:16), kept as given. ``unwalked_ops`` counts the
    ops of the header count that lie inside a final unsized :class:`RawOp` (their boundaries are unknown).
    """

    major: int
    minor: int
    dev_gen: int
    rows: int
    cols: int
    mem_tile_rows: int
    ops: tuple[Op, ...]
    pad: int = 0
    unwalked_ops: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))

    @property
    def version(self) -> tuple[int, int]:
        """``(major, minor)``."""
        return (self.major, self.minor)

    @property
    def num_ops(self) -> int:
        """Number of ops (header word 2)."""
        return len(self.ops) + self.unwalked_ops

    @property
    def size_bytes(self) -> int:
        """Total encoded size in bytes (header word 3).

        Raises:
            InstsError: the version is not one aie-rt defines.
        """
        version = _check_version(self.version, "size_bytes")
        return 4 * (HEADER_WORDS + sum(_op_length(op, version) for op in self.ops))


# --------------------------------------------------------------------------------------------- loading


def load(data: bytes | str | os.PathLike[str], strict: bool = False) -> Stream:
    """Load an instruction stream from bytes or a file, ``.bin`` (LE u32 words) or ``.txt`` (hex word per line).

    The format is detected from the content (docs/xrt-sequence.md 2.3): a binary TXN stream starts with the byte of the
    major version (0 or 1), which is never an ASCII hex digit or whitespace.

    Raises:
        InstsError: the content is neither format, or the stream is malformed.
        FileRefused: the path is not a regular file or is over the size limit of its kind (docs/files.md).
        OSError: the file cannot be read.
        TypeError: ``data`` is neither bytes nor a path.
    """
    return decode(stream_bytes(read_input(data, "load")), strict=strict)


def stream_bytes(raw: bytes) -> bytes:
    """The binary stream of a file's content: ``.txt`` words (one hex word per line) as little-endian bytes,
    binary content as is.

    Raises:
        InstsError: a text line is not a 32-bit hex word.
    """
    if _looks_like_text(raw):
        words = array.array(_U32_CODE, _text_words(raw))
        if sys.byteorder == "big":
            words.byteswap()
        return words.tobytes()
    return bytes(raw)


def read_input(data: bytes | bytearray | memoryview | str | os.PathLike[str], operation: str,
               kind: str = "insts") -> bytes:
    """The bytes of ``data``: a bytes-like object as is, or the content of the file it names, read by
    :func:`amdxdna_direct.files.read_file` as a file of ``kind`` (a regular file within that kind's size
    limit, docs/files.md).

    Shared by the two file-format parsers (this module's :func:`load`, :func:`amdxdna_direct.xclbin.parse`).

    Raises:
        FileRefused: the file is not a regular file or is over the size limit of ``kind``.
        OSError: the file cannot be opened or read.
        TypeError: ``data`` is neither bytes nor a path (the message starts with ``operation``).
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, (str, os.PathLike)):
        return read_file(data, kind)
    raise TypeError(f"{operation}: expected bytes or a path, got {type(data).__name__}")


_TEXT_BYTES = b"0123456789abcdefABCDEFxX \t\r\n"


def _looks_like_text(raw: bytes) -> bool:
    return bool(raw.strip()) and not raw.translate(None, _TEXT_BYTES)


def _text_words(raw: bytes) -> list[int]:
    """Parse one hex word per line (mlir-aie prints ``%08X``); blank lines are ignored."""
    words: list[int] = []
    for line_no, line in enumerate(raw.decode("ascii").splitlines(), start=1):
        text = line.strip()
        if not text:
            continue
        digits = text[2:] if text[:2] in ("0x", "0X") else text
        if not 1 <= len(digits) <= 8 or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise InstsError(f"word {len(words)} (line {line_no}): {text!r} is not a 32-bit hex word")
        words.append(int(digits, 16))
    return words


# --------------------------------------------------------------------------------------------- decoding


def decode(words: bytes | bytearray | memoryview | Sequence[int], strict: bool = False) -> Stream:
    """Decode a TXN stream given as little-endian bytes or as a sequence of 32-bit words.

    The header is checked and the ops are walked by their lengths (docs/runtime.md 1.1); ops that are not
    decoded are kept as :class:`RawOp`. With ``strict`` a raw op is an error instead.

    Raises:
        InstsError: truncation, an unknown version, a header size or op count that disagrees with the
            stream, an op whose size field is malformed or that runs past the end; with ``strict``, an op
            that is not decoded. The message names the word index.
    """
    w = _as_words(words)
    if len(w) < HEADER_WORDS:
        raise InstsError(f"word {len(w)}: stream truncated in the {HEADER_WORDS}-word TXN header ({len(w)} words)")
    header = _decode_header(w)
    version = (header["major"], header["minor"])
    num_ops, size_bytes = w[2], w[3]
    if size_bytes != 4 * len(w):
        raise InstsError(f"word 3: header size_bytes {size_bytes} disagrees with the stream length {4 * len(w)}")
    ops: list[Op] = []
    index, unwalked = HEADER_WORDS, 0
    for n in range(num_ops):
        if index >= len(w):
            raise InstsError(f"word {index}: stream ends after {n} ops, header num_ops says {num_ops}")
        length = _op_words(w, index, version)
        if length is None:
            ops.append(_unsized(w, index, strict))
            unwalked, index = num_ops - n - 1, len(w)
            break
        ops.append(_decode_op(_Bounded(w, index + length), index, version, strict))
        index += length
    if index != len(w):
        raise InstsError(f"word {index}: {len(w) - index} words left after the {num_ops} ops of the header")
    return Stream(ops=tuple(ops), unwalked_ops=unwalked, **header)


def raw_ops(stream: Stream) -> list[tuple[int, RawOp]]:
    """The ops of ``stream`` that are kept raw, with the word index where each starts."""
    return [(start, op) for start, op in zip(layout(stream), stream.ops, strict=True) if isinstance(op, RawOp)]


def _as_words(words: bytes | bytearray | memoryview | Sequence[int]) -> Sequence[int]:
    if isinstance(words, (bytes, bytearray, memoryview)):
        raw = memoryview(words).cast("B")
        if len(raw) % 4:
            raise InstsError(f"word {len(raw) // 4}: stream length {len(raw)} bytes is not a multiple of 4")
        # An array of u32 holds the stream in its own size; a list of ints would take ~9 times it (docs/files.md 5).
        packed = array.array(_U32_CODE)
        packed.frombytes(raw)
        if sys.byteorder == "big":
            packed.byteswap()
        return packed
    out = [int(x) for x in words]
    for i, x in enumerate(out):
        if not 0 <= x <= U32_MAX:
            raise InstsError(f"word {i}: {x} is not a 32-bit word")
    return out


def _decode_header(w: Sequence[int]) -> dict[str, int]:
    """XAie_TxnHeader: u8 Major, Minor, DevGen, NumRows, NumCols, NumMemTileRows, u16 pad, u32 NumOps, TxnSize."""
    major, minor, dev_gen, rows = w[0] & 0xFF, (w[0] >> 8) & 0xFF, (w[0] >> 16) & 0xFF, w[0] >> 24
    if (major, minor) not in (VERSION_CURRENT, VERSION_2024):
        raise InstsError(f"word 0: TXN version {major}.{minor} unknown (expected 0.1 or 1.0); not a TXN stream?")
    return {"major": major, "minor": minor, "dev_gen": dev_gen, "rows": rows,
            "cols": w[1] & 0xFF, "mem_tile_rows": (w[1] >> 8) & 0xFF, "pad": w[1] >> 16}


def _op_words(w: Sequence[int], i: int, version: tuple[int, int]) -> int | None:
    """Length in words of the op at word ``i`` (docs/runtime.md 1.1), None when the runtime does not know it.

    Raises:
        InstsError: the op (of fixed length, or by its size word) runs past the end; its size word is past the
            end, not a multiple of 4, or smaller than the op up to it.
    """
    opcode = w[i] & 0xFF
    fixed = _FIXED_LENGTH[version].get(opcode)
    if fixed is not None:
        if i + fixed > len(w):
            raise InstsError(f"word {i}: {OP_NAMES.get(opcode, f'op 0x{opcode:02x}')} of {4 * fixed} bytes runs past "
                             f"the end of the stream ({4 * (len(w) - i)} bytes left)")
        return fixed
    at = _SIZE_WORD[version].get(opcode)
    if at is None and opcode >= OP_CUSTOM_FIRST and opcode not in _LENGTH_UNKNOWN:
        at = _CUSTOM_SIZE_WORD
    if at is None:
        return None
    name = OP_NAMES.get(opcode, f"custom op 0x{opcode:02x}")
    if i + at >= len(w):
        raise InstsError(f"word {i}: {name} is truncated before its size word {at}")
    size = w[i + at]
    if size % 4 or size < 4 * (at + 1):
        raise InstsError(f"word {i + at}: {name} size {size} bytes is not a multiple of 4 >= {4 * (at + 1)}")
    if i + size // 4 > len(w):
        raise InstsError(f"word {i + at}: {name} of {size} bytes runs past the end of the stream "
                         f"({4 * (len(w) - i)} bytes left)")
    return size // 4


class _Bounded(Sequence[int]):
    """The words of a stream seen only up to ``end`` (an op's last word + 1), without copying them.

    The decoders check every read against ``len`` first (``_take``), so indexing needs no check of its own."""

    __slots__ = ("words", "end")

    def __init__(self, words: Sequence[int], end: int) -> None:
        self.words, self.end = words, end

    def __len__(self) -> int:
        return self.end

    def __iter__(self) -> Iterator[int]:
        return iter(self.words[:self.end])

    @overload
    def __getitem__(self, key: int) -> int: ...
    @overload
    def __getitem__(self, key: slice) -> Sequence[int]: ...
    def __getitem__(self, key: int | slice) -> int | Sequence[int]:
        return self.words[key]


def _decode_op(w: _Bounded, i: int, version: tuple[int, int], strict: bool) -> Op:
    """Decode the op at word ``i`` that ends at ``len(w)``, else keep it raw."""
    opcode = w[i] & 0xFF
    decoder = _DECODERS.get(opcode)
    try:
        if decoder is None:
            raise InstsError(f"word {i}: opcode 0x{opcode:02x} ({OP_NAMES.get(opcode, 'unnamed')}) is not decoded")
        if version == VERSION_CURRENT and w[i] >> 8:
            raise InstsError(f"word {i}: op header 0x{w[i]:08x} has non-zero col/row/padding bytes")
        if version == VERSION_2024 and w[i] >> 8:
            raise InstsError(f"word {i}: op header 0x{w[i]:08x} has non-zero padding bytes")
        op, end = decoder(w, i, version)
        if end != len(w):
            raise InstsError(f"word {i}: {OP_NAMES[opcode]} is {len(w) - i} words long, its encoding has {end - i}")
        return op
    except InstsError as exc:
        if strict:
            raise
        return RawOp(opcode, tuple(w[i:len(w)]), str(exc))


def _unsized(w: Sequence[int], i: int, strict: bool) -> RawOp:
    opcode = w[i] & 0xFF
    name = OP_NAMES.get(opcode, f"0x{opcode:02x}")
    reason = f"word {i}: opcode 0x{opcode:02x} ({name}) has no length the runtime knows; the op count is not checked"
    if strict:
        raise InstsError(reason)
    return RawOp(opcode, tuple(w[i:]), reason, sized=False)


def _take(w: Sequence[int], i: int, n: int, name: str) -> Sequence[int]:
    if i + n > len(w):
        raise InstsError(f"word {i}: {name} needs {n} words, only {len(w) - i} left")
    return w[i:i + n]


def _zero(w: Sequence[int], i: int, positions: Sequence[int], name: str) -> None:
    for p in positions:
        if w[i + p]:
            raise InstsError(f"word {i + p}: {name} reserved word {p} is 0x{w[i + p]:08x}, expected 0")


def _size_field(w: Sequence[int], i: int, at: int, expected: int, name: str) -> None:
    if w[i + at] != expected:
        raise InstsError(f"word {i + at}: {name} size field {w[i + at]} bytes, expected {expected}")


def _decode_write32(w: Sequence[int], i: int, version: tuple[int, int]) -> tuple[Op, int]:
    n = _WRITE32_WORDS[version]
    f = _take(w, i, n, "WRITE32")
    if version == VERSION_2024:
        return Write32(addr=f[1], value=f[2]), i + n
    # XAie_Write32Hdr: OpHdr, pad, u64 RegOff, u32 Value, u32 Size.
    _zero(w, i, (1,), "WRITE32")
    _size_field(w, i, 5, 4 * n, "WRITE32")
    return Write32(addr=f[2] | f[3] << 32, value=f[4]), i + n


def _decode_maskwrite(w: Sequence[int], i: int, version: tuple[int, int]) -> tuple[Op, int]:
    n = _MASKWRITE_WORDS[version]
    f = _take(w, i, n, "MASKWRITE")
    if version == VERSION_2024:
        return MaskWrite(addr=f[1], value=f[2], mask=f[3]), i + n
    # XAie_MaskWrite32Hdr: OpHdr, pad, u64 RegOff, u32 Value, u32 Mask, u32 Size.
    _zero(w, i, (1,), "MASKWRITE")
    _size_field(w, i, 6, 4 * n, "MASKWRITE")
    return MaskWrite(addr=f[2] | f[3] << 32, value=f[4], mask=f[5]), i + n


def _decode_blockwrite(w: Sequence[int], i: int, version: tuple[int, int]) -> tuple[Op, int]:
    head = _BLOCKWRITE_HEADER_WORDS[version]
    f = _take(w, i, head, "BLOCKWRITE header")
    if version == VERSION_2024:
        addr, size = f[1], f[2]          # XAie_BlockWrite32Hdr_opt: OpHdr, RegOff, Size
    else:
        _zero(w, i, (1,), "BLOCKWRITE")  # XAie_BlockWrite32Hdr: OpHdr + Col/Row bytes, RegOff, Size
        addr, size = f[2], f[3]
    size_at = head - 1
    if size % 4 or size < 4 * head:
        raise InstsError(f"word {i + size_at}: BLOCKWRITE size {size} bytes is not a multiple of 4 >= {4 * head}")
    data = _take(w, i + head, size // 4 - head, "BLOCKWRITE data")
    return BlockWrite(addr=addr, words=tuple(data)), i + size // 4


def _decode_sync(w: Sequence[int], i: int, version: tuple[int, int]) -> tuple[Op, int]:
    # XAie_CustomOpHdr(_opt) {op, u32 Size} + tct_op_t {u32 word, u32 config}; same in both versions.
    f = _take(w, i, _SYNC_WORDS, "SYNC")
    _size_field(w, i, 1, 4 * _SYNC_WORDS, "SYNC")
    word, config = f[2], f[3]
    if word >> 24 or config & 0xFF:
        raise InstsError(f"word {i + 2}: SYNC reserved bits set (word 0x{word:08x}, config 0x{config:08x})")
    op = Sync(direction=word & 0xFF, row=(word >> 8) & 0xFF, col=(word >> 16) & 0xFF,
              channel=config >> 24, row_num=(config >> 8) & 0xFF, col_num=(config >> 16) & 0xFF)
    return op, i + _SYNC_WORDS


def _decode_ddr_patch(w: Sequence[int], i: int, version: tuple[int, int]) -> tuple[Op, int]:
    n = _DDR_PATCH_WORDS[version]
    f = _take(w, i, n, "DDR_PATCH")
    _size_field(w, i, 1, 4 * n, "DDR_PATCH")
    if version == VERSION_2024:
        # patch_op_opt_t: u32 regaddr, u8 argidx + 3 pad, u64 argplus.
        if f[3] >> 8:
            raise InstsError(f"word {i + 3}: DDR_PATCH argidx word 0x{f[3]:08x} has non-zero padding")
        return DdrPatch(reg_addr=f[2], arg_idx=f[3], arg_plus=f[4] | f[5] << 32), i + n
    # patch_op_t: op_base {type, size}, u32 action, pad, u64 regaddr, u64 argidx, u64 argplus.
    _zero(w, i, (2, 3, 4, 5), "DDR_PATCH")
    return DdrPatch(reg_addr=f[6] | f[7] << 32, arg_idx=f[8] | f[9] << 32, arg_plus=f[10] | f[11] << 32), i + n


_DECODERS = {
    OP_WRITE32: _decode_write32,
    OP_BLOCKWRITE: _decode_blockwrite,
    OP_MASKWRITE: _decode_maskwrite,
    OP_SYNC: _decode_sync,
    OP_DDR_PATCH: _decode_ddr_patch,
}


# --------------------------------------------------------------------------------------------- encoding


def encode(stream: Stream) -> bytes:
    """Encode a stream to little-endian bytes (the ``insts.bin`` layout); inverse of :func:`decode`.

    Raises:
        InstsError: the version is unknown, or an op field does not fit its encoding (names the op index).
    """
    words = encode_words(stream)
    return struct.pack(f"<{len(words)}I", *words)


def encode_words(stream: Stream) -> list[int]:
    """Encode a stream to a list of 32-bit words.

    Raises:
        InstsError: as :func:`encode`.
    """
    version = _check_version(stream.version, "encode")
    for name in ("dev_gen", "rows", "cols", "mem_tile_rows"):
        if not 0 <= getattr(stream, name) <= 0xFF:
            raise InstsError(f"encode: header {name} {getattr(stream, name)} does not fit a byte")
    if not 0 <= stream.pad <= 0xFFFF:
        raise InstsError(f"encode: header pad {stream.pad} does not fit 16 bits")
    final = stream.ops[-1] if stream.ops else None
    if stream.unwalked_ops and not (isinstance(final, RawOp) and not final.sized):
        raise InstsError(f"encode: unwalked_ops={stream.unwalked_ops} needs a final RawOp of unknown length")
    body: list[int] = []
    for n, op in enumerate(stream.ops):
        if isinstance(op, RawOp) and not op.sized and n != len(stream.ops) - 1:
            raise InstsError(f"encode: op {n} is a RawOp of unknown length; only the last op may be")
        body.extend(_encode_op(op, version, n))
    head = [stream.major | stream.minor << 8 | stream.dev_gen << 16 | stream.rows << 24,
            stream.cols | stream.mem_tile_rows << 8 | stream.pad << 16, stream.num_ops,
            4 * (HEADER_WORDS + len(body))]
    return head + body


def layout(stream: Stream) -> list[int]:
    """Word index at which each op of ``stream`` starts in its encoding.

    Raises:
        InstsError: the version is unknown.
    """
    version = _check_version(stream.version, "layout")
    starts, index = [], HEADER_WORDS
    for op in stream.ops:
        starts.append(index)
        index += _op_length(op, version)
    return starts


def _check_version(version: tuple[int, int], operation: str) -> tuple[int, int]:
    if version not in (VERSION_CURRENT, VERSION_2024):
        raise InstsError(f"{operation}: TXN version {version[0]}.{version[1]} unknown (expected 0.1 or 1.0)")
    return version


def _op_length(op: Op, version: tuple[int, int]) -> int:
    if isinstance(op, Write32):
        return _WRITE32_WORDS[version]
    if isinstance(op, MaskWrite):
        return _MASKWRITE_WORDS[version]
    if isinstance(op, BlockWrite):
        return _BLOCKWRITE_HEADER_WORDS[version] + len(op.words)
    if isinstance(op, Sync):
        return _SYNC_WORDS
    if isinstance(op, DdrPatch):
        return _DDR_PATCH_WORDS[version]
    if isinstance(op, RawOp):
        return len(op.words)
    raise InstsError(f"encode: {type(op).__name__} is not a TXN op")


def _fit(n: int, name: str, value: int, limit: int) -> int:
    if not isinstance(value, int) or not 0 <= value <= limit:
        raise InstsError(f"encode: op {n} field {name}={value!r} does not fit 0..0x{limit:x}")
    return value


def _encode_op(op: Op, version: tuple[int, int], n: int) -> list[int]:
    old = version == VERSION_2024
    addr_limit = U32_MAX if old else U64_MAX
    if isinstance(op, Write32):
        addr, value = _fit(n, "addr", op.addr, addr_limit), _fit(n, "value", op.value, U32_MAX)
        return [OP_WRITE32, addr, value] if old else [OP_WRITE32, 0, addr & U32_MAX, addr >> 32, value, 24]
    if isinstance(op, MaskWrite):
        addr = _fit(n, "addr", op.addr, addr_limit)
        value, mask = _fit(n, "value", op.value, U32_MAX), _fit(n, "mask", op.mask, U32_MAX)
        if old:
            return [OP_MASKWRITE, addr, value, mask]
        return [OP_MASKWRITE, 0, addr & U32_MAX, addr >> 32, value, mask, 28]
    if isinstance(op, BlockWrite):
        return _encode_blockwrite(op, version, n)
    if isinstance(op, Sync):
        return _encode_sync(op, n)
    if isinstance(op, DdrPatch):
        return _encode_ddr_patch(op, version, n)
    if isinstance(op, RawOp):
        return _encode_raw(op, n)
    raise InstsError(f"encode: op {n} is a {type(op).__name__}, not a TXN op")


def _encode_raw(op: RawOp, n: int) -> list[int]:
    words = [_fit(n, "words", x, U32_MAX) for x in op.words]
    if not words or words[0] & 0xFF != op.opcode:
        raise InstsError(f"encode: op {n} RawOp words must start with its opcode 0x{op.opcode:02x}")
    return words


def _encode_blockwrite(op: BlockWrite, version: tuple[int, int], n: int) -> list[int]:
    addr = _fit(n, "addr", op.addr, U32_MAX)
    data = [_fit(n, "words", x, U32_MAX) for x in op.words]
    head = _BLOCKWRITE_HEADER_WORDS[version]
    size = 4 * (head + len(data))
    _fit(n, "size", size, U32_MAX)
    prefix = [OP_BLOCKWRITE, addr, size] if version == VERSION_2024 else [OP_BLOCKWRITE, 0, addr, size]
    return prefix + data


def _encode_sync(op: Sync, n: int) -> list[int]:
    b = {name: _fit(n, name, getattr(op, name), 0xFF)
         for name in ("direction", "row", "col", "channel", "row_num", "col_num")}
    word = b["direction"] | b["row"] << 8 | b["col"] << 16
    config = b["row_num"] << 8 | b["col_num"] << 16 | b["channel"] << 24
    return [OP_SYNC, 4 * _SYNC_WORDS, word, config]


def _encode_ddr_patch(op: DdrPatch, version: tuple[int, int], n: int) -> list[int]:
    plus = _fit(n, "arg_plus", op.arg_plus, U64_MAX)
    if version == VERSION_2024:
        reg, idx = _fit(n, "reg_addr", op.reg_addr, U32_MAX), _fit(n, "arg_idx", op.arg_idx, 0xFF)
        return [OP_DDR_PATCH, 24, reg, idx, plus & U32_MAX, plus >> 32]
    reg, idx = _fit(n, "reg_addr", op.reg_addr, U64_MAX), _fit(n, "arg_idx", op.arg_idx, U64_MAX)
    return [OP_DDR_PATCH, 48, 0, 0, 0, 0, reg & U32_MAX, reg >> 32, idx & U32_MAX, idx >> 32,
            plus & U32_MAX, plus >> 32]


# --------------------------------------------------------------------------------------------- building


def dma_stream(dev_gen: int, buffers: Sequence[tuple[int, int, str]], *, rtp: Sequence[int] = (),
               column: int = 0) -> Stream:
    """Build the TXN stream of a design that moves ``buffers`` through the shim DMA of one column.

    Mirrors the field order and encodings of the mlir-aie fixtures (docs/xrt-sequence.md 2.3): optional runtime
    parameters ``rtp`` written with a BLOCKWRITE to core tile (column, row 2) data memory offset 0;
    then for buffer i: a BLOCKWRITE of shim BD i (word 0 = length in words), a DDR_PATCH of the BD's
    address word with the buffer's ``arg_idx``, and a push of BD i on the next MM2S ("in") or S2MM ("out")
    channel (round robin over the two channels); outputs push with the task-completion token bit after
    setting the channel controller id, as the fixtures do; finally one SYNC per output.

    Args:
        dev_gen: TXN device generation, 3 (NPU1) or 4 (NPU4/5/6).
        buffers: ``(arg_idx, nbytes, "in" | "out")`` per buffer; ``nbytes`` a positive multiple of 4.
        rtp: 32-bit words identifying the computation.
        column: partition-relative shim column.

    Raises:
        ValueError: an argument is out of range (more than 16 buffers, bad direction, size, dev_gen).
    """
    if dev_gen not in _BD_BURST:
        raise ValueError(f"dma_stream: dev_gen {dev_gen} unsupported (3 = NPU1, 4 = NPU4/5/6)")
    if not 0 <= column <= 0x7F:
        raise ValueError(f"dma_stream: column {column} out of range 0..127")
    if len(buffers) > SHIM_BD_COUNT:
        raise ValueError(f"dma_stream: {len(buffers)} buffers, a shim tile has {SHIM_BD_COUNT} buffer descriptors")
    tile = column << COL_SHIFT
    ops: list[Op] = []
    if rtp:
        ops.append(BlockWrite(addr=tile | (CORE_ROW << ROW_SHIFT), words=tuple(_rtp_word(x) for x in rtp)))
    used = {"in": 0, "out": 0}
    syncs: list[Op] = []
    for bd_id, (arg_idx, nbytes, direction) in enumerate(buffers):
        channel = _channel(direction, used)
        ops.extend(_buffer_ops(dev_gen, tile, bd_id, arg_idx, nbytes, direction, channel))
        if direction == "out":
            syncs.append(Sync(direction=DIRECTION_S2MM, row=0, col=column, channel=channel, row_num=1, col_num=1))
    return Stream(major=VERSION_CURRENT[0], minor=VERSION_CURRENT[1], dev_gen=dev_gen, rows=_NUM_ROWS,
                  cols=column + 1, mem_tile_rows=_MEM_TILE_ROWS, ops=tuple(ops + syncs))


def _rtp_word(x: int) -> int:
    if not 0 <= int(x) <= U32_MAX:
        raise ValueError(f"dma_stream: rtp word {x} is not a 32-bit value")
    return int(x)


def _channel(direction: str, used: dict[str, int]) -> int:
    if direction not in used:
        raise ValueError(f"dma_stream: direction {direction!r} must be 'in' or 'out'")
    channel = used[direction] % SHIM_CHANNELS
    used[direction] += 1
    return channel


def _buffer_ops(dev_gen: int, tile: int, bd_id: int, arg_idx: int, nbytes: int, direction: str,
                channel: int) -> list[Op]:
    if nbytes <= 0 or nbytes % 4 or nbytes // 4 > U32_MAX:
        raise ValueError(f"dma_stream: buffer {bd_id} size {nbytes} bytes must be a positive multiple of 4")
    if not 0 <= arg_idx <= 0xFF:
        raise ValueError(f"dma_stream: buffer {bd_id} arg_idx {arg_idx} out of range 0..255")
    bd = tile | (SHIM_BD_BASE + SHIM_BD_STRIDE * bd_id)
    ctrl = tile | (_CTRL_BASE[direction] + 8 * channel)
    ops: list[Op] = [
        BlockWrite(addr=bd, words=(nbytes // 4, 0, 0, 0, _BD_BURST[dev_gen], _BD_AXCACHE, 0, _BD_VALID)),
        DdrPatch(reg_addr=bd + 4, arg_idx=arg_idx, arg_plus=0),
    ]
    if direction == "out":
        ops.append(MaskWrite(addr=ctrl, value=_CTRL_VALUE, mask=_CTRL_MASK))
        ops.append(Write32(addr=ctrl + 4, value=bd_id | _QUEUE_TOKEN))
    else:
        ops.append(Write32(addr=ctrl + 4, value=bd_id))
    return ops


# --------------------------------------------------------------------------------------------- buffer reach
#
# How far a stream's shim DMA reaches into each buffer argument, from every word of the buffer descriptor the
# generation defines (docs/runtime.md 1.4). A DDR_PATCH writes "buffer arg_idx + arg_plus" into word 1 of a shim
# BD; the BD's other words, as the stream last wrote them before the patch, say which words from that address
# the DMA moves: its length, three address dimensions (D0, D1 with a wrap and a step, D2 with a step) and the
# iteration dimension (a wrap and a step applied between repeats of the BD).

TILE_OFFSET_MASK = (1 << 20) - 1     # a tile's register offset within its address (docs/xrt-sequence.md 2.3)
SHIM_BD_WORDS = 8


class _Field(NamedTuple):
    word: int
    shift: int
    bits: int

    def get(self, words: Sequence[int]) -> int:
        return (words[self.word] >> self.shift) & ((1 << self.bits) - 1)


@dataclass(frozen=True)
class BdLayout:
    """Where one generation's shim BD keeps the fields that decide the DMA's reach (docs/runtime.md 1.4).

    Steps and the iteration wrap are stored less one; a D0/D1 wrap of 0 means the dimension does not wrap.
    """

    name: str
    length: _Field
    d0_wrap: _Field
    d0_step: _Field
    d1_wrap: _Field
    d1_step: _Field
    d2_step: _Field
    iter_wrap: _Field
    iter_step: _Field


# The shim (NOC module) BD of AIE2 (NPU1, TXN dev_gen 3) and AIE2P (NPU4/5/6, dev_gen 4): the same eight words
# in both (aie-rt's XAIEMLGBL_ / XAIE2PGBL_NOC_MODULE_DMA_BD0_* fields; docs/runtime.md 1.4).
_AIE_ML_SHIM_BD = dict(length=_Field(0, 0, 32), d0_wrap=_Field(3, 20, 10), d0_step=_Field(3, 0, 20),
                       d1_wrap=_Field(4, 20, 10), d1_step=_Field(4, 0, 20), d2_step=_Field(5, 0, 20),
                       iter_wrap=_Field(6, 20, 6), iter_step=_Field(6, 0, 20))
#: TXN dev_gen -> the shim BD layout of that generation.
SHIM_BD_LAYOUTS = {3: BdLayout("aie2", **_AIE_ML_SHIM_BD), 4: BdLayout("aie2p", **_AIE_ML_SHIM_BD)}


@dataclass(frozen=True)
class ShimBd:
    """The reach-deciding fields of one shim BD, decoded: all in 32-bit words, steps and wraps as counts.

    ``d0_wrap``/``d1_wrap`` 0 = that dimension never wraps; ``iter_wrap`` is the number of iteration offsets (1 =
    none). ``layout`` is None for a generation whose BD layout is not known: then only ``length`` is read.
    """

    length: int
    d0_wrap: int = 0
    d0_step: int = 1
    d1_wrap: int = 0
    d1_step: int = 1
    d2_step: int = 1
    iter_wrap: int = 1
    iter_step: int = 1
    layout: str | None = None

    @classmethod
    def decode(cls, words: Sequence[int], dev_gen: int) -> ShimBd:
        """The BD of ``words`` (its eight words, unwritten ones 0) in generation ``dev_gen``'s layout."""
        layout = SHIM_BD_LAYOUTS.get(dev_gen)
        if layout is None:
            return cls(length=words[0])
        return cls(length=layout.length.get(words), d0_wrap=layout.d0_wrap.get(words),
                   d0_step=layout.d0_step.get(words) + 1, d1_wrap=layout.d1_wrap.get(words),
                   d1_step=layout.d1_step.get(words) + 1, d2_step=layout.d2_step.get(words) + 1,
                   iter_wrap=layout.iter_wrap.get(words) + 1, iter_step=layout.iter_step.get(words) + 1,
                   layout=layout.name)


def bd_span(bd: ShimBd) -> int:
    """Bytes from the BD's address to one past the furthest byte its DMA moves (0 for a length of 0).

    Element n of the BD's ``length`` words sits at ``i0*d0_step + i1*d1_step + i2*d2_step`` words, with n split
    by the wraps (i0 = n mod d0_wrap, i1 = n / d0_wrap mod d1_wrap, i2 the rest; a wrap of 0 ends the split
    there), plus ``k*iter_step`` for iteration k < ``iter_wrap``. The maximum is computed, not walked.
    """
    if bd.length <= 0:
        return 0
    dims: list[tuple[int, int]] = []
    for wrap, step in ((bd.d0_wrap, bd.d0_step), (bd.d1_wrap, bd.d1_step)):
        if wrap == 0:
            dims.append((0, step))
            break
        dims.append((wrap, step))
    else:
        dims.append((0, bd.d2_step))
    furthest = _furthest(bd.length - 1, dims) + (bd.iter_wrap - 1) * bd.iter_step
    return 4 * (furthest + 1)


def _furthest(last: int, dims: Sequence[tuple[int, int]]) -> int:
    """Max over n in 0..last of n's word offset, n split innermost-first by ``dims`` ((wrap, step); the last
    dimension's wrap is 0: unbounded). Either n's outer part is last's with the inner index at last's, or the
    outer part is one less with the inner index at its top (every step is positive)."""
    wrap, step = dims[0]
    if wrap == 0:
        return last * step
    outer, inner = divmod(last, wrap)
    best = inner * step + _furthest(outer, dims[1:])
    if outer:
        best = max(best, (wrap - 1) * step + _furthest(outer - 1, dims[1:]))
    return best


class BufferReach(NamedTuple):
    """How far a stream's DMA reaches into one buffer argument (docs/runtime.md 1.4).

    ``nbytes`` (= ``arg_plus + span``) is what the buffer must hold, from the DDR_PATCH that reaches furthest:
    ``op_index`` (its position among the stream's ops) at word ``word``, patching the address of shim buffer
    descriptor ``bd`` of column ``column``, whose length word says ``length`` bytes and whose strides, wraps and
    iterations spread them over ``span`` bytes. ``layout`` names the BD layout read (None: only the length).
    """

    arg_idx: int
    nbytes: int
    op_index: int
    word: int
    bd: int
    column: int
    length: int
    arg_plus: int
    span: int = 0
    layout: str | None = None


def buffer_reaches(stream: Stream | bytes | bytearray | memoryview) -> dict[int, BufferReach]:
    """Per buffer argument (DDR_PATCH ``arg_idx``), how far the stream's DMA reads or writes into it, with the
    patch and BD that decide it.

    The BD words are the last values the stream wrote there before the patch (WRITE32, MASKWRITE, BLOCKWRITE),
    as the firmware sees them; a word never written is 0. A patch of a BD whose length word the stream never
    wrote is left out (the firmware refuses such a stream; nothing to compare a buffer with). One pass over the
    ops; a BLOCKWRITE is compared with the few BD words patched, not walked.

    Raises:
        InstsError: the stream's bytes are malformed, or its version is unknown.
    """
    if not isinstance(stream, Stream):
        stream = decode(stream)
    bases = {op.reg_addr - 4 for op in stream.ops if isinstance(op, DdrPatch)}
    if not bases:
        return {}
    wanted = {base + 4 * k: (base, k) for base in bases for k in range(SHIM_BD_WORDS)}
    starts = layout(stream)
    bds: dict[int, list[int | None]] = {}
    out: dict[int, BufferReach] = {}
    for index, op in enumerate(stream.ops):
        if isinstance(op, DdrPatch):
            reach = _patch_reach(stream, op, index, starts[index], bds.get(op.reg_addr - 4))
            if reach is not None and (op.arg_idx not in out or reach.nbytes > out[op.arg_idx].nbytes):
                out[op.arg_idx] = reach
        else:
            _record_bd_words(op, wanted, bds)
    return out


def buffer_reach(stream: Stream | bytes | bytearray | memoryview) -> dict[int, int]:
    """Per buffer argument, the bytes the buffer must hold for the stream's DMA: ``buffer_reaches`` in bytes.

    Raises:
        InstsError: as :func:`buffer_reaches`.
    """
    return {arg: reach.nbytes for arg, reach in buffer_reaches(stream).items()}


def _record_bd_words(op: Op, wanted: dict[int, tuple[int, int]], bds: dict[int, list[int | None]]) -> None:
    def store(addr: int, value: int) -> None:
        base, k = wanted[addr]
        bds.setdefault(base, [None] * SHIM_BD_WORDS)[k] = value & U32_MAX

    if isinstance(op, Write32):
        if op.addr in wanted:
            store(op.addr, op.value)
    elif isinstance(op, MaskWrite):
        if op.addr in wanted:
            base, k = wanted[op.addr]
            old = bds.get(base, [None] * SHIM_BD_WORDS)[k] or 0
            store(op.addr, (old & ~op.mask) | (op.value & op.mask))
    elif isinstance(op, BlockWrite):
        end = op.addr + 4 * len(op.words)
        if len(op.words) < len(wanted):
            for i, value in enumerate(op.words):
                if op.addr + 4 * i in wanted:
                    store(op.addr + 4 * i, value)
        else:
            for addr in wanted:
                if op.addr <= addr < end and not (addr - op.addr) % 4:
                    store(addr, op.words[(addr - op.addr) // 4])


def _patch_reach(stream: Stream, op: DdrPatch, index: int, word: int,
                 words: list[int | None] | None) -> BufferReach | None:
    if words is None or words[0] is None:
        return None
    bd = ShimBd.decode([w or 0 for w in words], stream.dev_gen)
    span = bd_span(bd)
    bd_id = ((op.reg_addr & TILE_OFFSET_MASK) - SHIM_BD_BASE) // SHIM_BD_STRIDE
    return BufferReach(op.arg_idx, op.arg_plus + span, index, word, bd_id, op.reg_addr >> COL_SHIFT,
                       4 * bd.length, op.arg_plus, span, bd.layout)
