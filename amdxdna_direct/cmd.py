"""ERT command packets: pure encoders and decoders over ``memoryview``/``bytearray``.

The packet lives in a CMD BO and is read by the driver (docs/xrt-sequence.md 1.7,
docs/uapi.md 6). Layout of the u32 header word (little endian):
state 3:0, stat_enabled 4, extra_cu_masks 11:10, count 22:12 (payload words after the header),
opcode 27:23, type 31:28 (XRT writes ERT_CU = 3; the driver ignores it).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = [
    "ERT_START_CU", "ERT_START_DPU", "ERT_CMD_CHAIN", "ERT_START_NPU", "ERT_START_NPU_PREEMPT",
    "ERT_START_NPU_PREEMPT_ELF", "ERT_CU",
    "ERT_CMD_STATE_NEW", "ERT_CMD_STATE_QUEUED", "ERT_CMD_STATE_RUNNING", "ERT_CMD_STATE_COMPLETED",
    "ERT_CMD_STATE_ERROR", "ERT_CMD_STATE_ABORT", "ERT_CMD_STATE_SUBMITTED", "ERT_CMD_STATE_TIMEOUT",
    "ERT_CMD_STATE_NORESPONSE", "STATE_NAMES", "state_name",
    "Header", "Health", "make_header", "decode_header", "read_state", "write_state",
    "encode_regmap", "encode_start_cu", "payload_words", "encode_chain", "decode_chain", "ChainInfo", "decode_health",
    "chain_slot_cost", "CHAIN_SLOT_BUDGET", "CHAIN_MAX_RUNS", "MAX_PACKET_WORDS", "LONE_COMMAND_WORDS",
    "lone_command_limit",
]

# Opcodes (bits 27:23), docs/xrt-sequence.md 1.7 / docs/uapi.md 3.
ERT_START_CU = 0
ERT_START_DPU = 18
ERT_CMD_CHAIN = 19
ERT_START_NPU = 20
ERT_START_NPU_PREEMPT = 21
ERT_START_NPU_PREEMPT_ELF = 22
ERT_CU = 3  # header type XRT writes for kernel starts

# States (bits 3:0).
ERT_CMD_STATE_NEW = 1
ERT_CMD_STATE_QUEUED = 2
ERT_CMD_STATE_RUNNING = 3
ERT_CMD_STATE_COMPLETED = 4
ERT_CMD_STATE_ERROR = 5
ERT_CMD_STATE_ABORT = 6
ERT_CMD_STATE_SUBMITTED = 7
ERT_CMD_STATE_TIMEOUT = 8
ERT_CMD_STATE_NORESPONSE = 9

STATE_NAMES = {
    0: "INVALID", ERT_CMD_STATE_NEW: "NEW", ERT_CMD_STATE_QUEUED: "QUEUED", ERT_CMD_STATE_RUNNING: "RUNNING",
    ERT_CMD_STATE_COMPLETED: "COMPLETED", ERT_CMD_STATE_ERROR: "ERROR", ERT_CMD_STATE_ABORT: "ABORT",
    ERT_CMD_STATE_SUBMITTED: "SUBMITTED", ERT_CMD_STATE_TIMEOUT: "TIMEOUT", ERT_CMD_STATE_NORESPONSE: "NORESPONSE",
}

MAX_PACKET_WORDS = 0x7FF  # count is an 11-bit field
_CHAIN_HEADER_WORDS = 6  # command_count, submit_index, error_index, reserved[3] (docs/uapi.md 6.5)

# Chain limits. The driver packs every sub-command into one 4 KiB list buffer; a slot costs a
# per-slot header plus 4 bytes per argument word. Which header a slot gets depends on the firmware
# (CF 8 B, legacy DPU 24 B, NPU 52 B; docs/uapi.md 6.5), so the budget is counted with the
# largest, as ROCr does (52 + 4 * arg_cnt, docs/xrt-sequence.md 1.7): a 15-word mlir-aie slot
# costs 112 B and 36 of them fit. The count cap is the driver's 64 sub-commands (docs/xrt-sequence.md 1.7; docs/uapi.md
# 6.5 says
# KMQ has no count cap, so 64 satisfies both readings). XRT's 24 runs per chain is a choice of its
# runlist, not a driver limit: following the budget instead costs a 100-run stage 3 EXEC_CMDs, not 5.
CHAIN_SLOT_BUDGET = 4096
_CHAIN_SLOT_HEADER = 52
CHAIN_MAX_RUNS = 64

# Before feature level 0.6 (Linux 6.14-6.18) the driver sends a command outside a chain as one firmware message,
# not through the command list: EXECUTE_BUFFER_CF holds 19 payload words after the CU mask (ERT_START_CU), EXEC_DPU
# 35 argument words (ERT_START_NPU); a larger packet stays NEW. A chain goes through the command list on every
# version (docs/runtime.md 1.4, docs/driver-rules.md E10).
LONE_COMMAND_WORDS = {ERT_START_CU: 19, ERT_START_NPU: 35}
_CMDLIST_ALWAYS_MINOR = 6

_U32 = struct.Struct("<I")


def state_name(state: int) -> str:
    """The ERT name of a state value (``"COMPLETED"``), or ``"STATE_<n>"`` for an unknown one."""
    return STATE_NAMES.get(state, f"STATE_{state}")


class Header(NamedTuple):
    """A decoded packet header word."""

    state: int
    stat_enabled: int
    extra_cu_masks: int
    count: int  # type: ignore[assignment]  # the ERT field's name; shadowing tuple.count is intended
    opcode: int
    type: int


def make_header(opcode: int, count: int, *, state: int = ERT_CMD_STATE_NEW, extra_cu_masks: int = 0,
                type_: int = ERT_CU) -> int:
    """Encode a header word.

    Raises:
        ValueError: a field does not fit its bit width.
    """
    for name, value, width in (("opcode", opcode, 5), ("count", count, 11), ("state", state, 4),
                               ("extra_cu_masks", extra_cu_masks, 2), ("type", type_, 4)):
        if not 0 <= value < (1 << width):
            raise ValueError(f"ERT header {name}={value} does not fit {width} bits")
    return state | (extra_cu_masks << 10) | (count << 12) | (opcode << 23) | (type_ << 28)


def decode_header(word: int) -> Header:
    """Split a header word into its fields."""
    return Header(word & 0xF, (word >> 4) & 1, (word >> 10) & 0x3, (word >> 12) & 0x7FF,
                  (word >> 23) & 0x1F, (word >> 28) & 0xF)


def read_state(packet: ReadableBuffer) -> int:
    """The state nibble of the packet header (driver-written result)."""
    word: int = _U32.unpack_from(packet, 0)[0]
    return word & 0xF


def write_state(packet: WriteableBuffer, state: int) -> None:
    """Set the state nibble, keeping the other header fields (resubmission writes NEW, docs/uapi.md 6.6)."""
    word = _U32.unpack_from(packet, 0)[0]
    _U32.pack_into(packet, 0, (word & ~0xF) | (state & 0xF))


def encode_regmap(size: int, fields: Iterable[tuple[int, int, int]]) -> bytearray:
    """Lay out a kernel regmap of ``size`` bytes from ``(offset, size, value)`` fields.

    Values are written little endian, truncated to the field size as XRT's arg setter does
    (docs/xrt-sequence.md 1.7: only min(arg size, value size) bytes are copied); unused
    bytes stay zero. Fields need no alignment (mlir-aie u64 slots start at 0x14).

    Raises:
        ValueError: a field lies outside the regmap or a value is negative.
    """
    regmap = bytearray(size)
    for offset, width, value in fields:
        if offset < 0 or width <= 0 or offset + width > size:
            raise ValueError(f"regmap field at offset {offset:#x} size {width} exceeds regmap size {size}")
        if value < 0:
            raise ValueError(f"regmap value {value} at offset {offset:#x} is negative")
        regmap[offset:offset + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    return regmap


def payload_words(regmap_bytes: int) -> int:
    """Words of regmap sent after the cu mask: the regmap size rounded up to words.

    An odd count below 15 is padded by one zero word: the npu4 firmware aborts a chain slot with
    an odd argument count below 15 (docs/xrt-sequence.md 1.7 "parity quirk", ROCr pads too).
    """
    words = (regmap_bytes + 3) // 4
    if words % 2 and words < 15:
        words += 1
    return words


def encode_start_cu(packet: WriteableBuffer, cu_index: int, regmap: bytes | bytearray) -> int:
    """Write an ERT_START_CU packet (header, one cu mask word, regmap) into ``packet``.

    The whole ``packet`` is zeroed first: XRT does not clear recycled exec BOs, we do
    (docs/xrt-sequence.md 1.7). Returns the number of bytes used.

    Raises:
        ValueError: bad cu index, or the packet does not fit ``packet`` or the 11-bit count.
    """
    if not 0 <= cu_index < 32:
        raise ValueError(f"cu_index {cu_index} out of range 0..31 (the driver reads one cu mask word)")
    words = payload_words(len(regmap))
    count = 1 + words
    used = 4 * (1 + count)
    _check_fits(packet, used, count)
    view = memoryview(packet).cast("B")
    view[:] = bytes(len(view))
    _U32.pack_into(view, 0, make_header(ERT_START_CU, count))
    _U32.pack_into(view, 4, 1 << cu_index)
    view[8:8 + len(regmap)] = regmap
    return used


def encode_chain(packet: WriteableBuffer, handles: Sequence[int]) -> int:
    """Write an ERT_CMD_CHAIN packet listing sub-command CMD BO ``handles`` (docs/uapi.md 6.5).

    Payload: command_count, submit_index, error_index, reserved[3], then one u64 per handle.
    Returns the number of bytes used.

    Raises:
        ValueError: no handles, or the packet does not fit.
    """
    if not handles:
        raise ValueError("a command chain needs at least one sub-command")
    count = _CHAIN_HEADER_WORDS + 2 * len(handles)
    used = 4 * (1 + count)
    _check_fits(packet, used, count)
    view = memoryview(packet).cast("B")
    view[:] = bytes(len(view))
    _U32.pack_into(view, 0, make_header(ERT_CMD_CHAIN, count, type_=0))
    _U32.pack_into(view, 4, len(handles))
    for i, handle in enumerate(handles):
        struct.pack_into("<Q", view, 4 + 4 * _CHAIN_HEADER_WORDS + 8 * i, handle)
    return used


class ChainInfo(NamedTuple):
    """Decoded chain payload."""

    command_count: int
    submit_index: int
    error_index: int
    handles: tuple[int, ...]


def decode_chain(packet: ReadableBuffer) -> ChainInfo:
    """Decode an ERT_CMD_CHAIN packet's payload.

    Raises:
        ValueError: the header opcode is not ERT_CMD_CHAIN.
    """
    header = decode_header(_U32.unpack_from(packet, 0)[0])
    if header.opcode != ERT_CMD_CHAIN:
        raise ValueError(f"packet opcode {header.opcode} is not ERT_CMD_CHAIN ({ERT_CMD_CHAIN})")
    command_count, submit_index, error_index = struct.unpack_from("<3I", packet, 4)
    n = min(command_count, max(0, (header.count - _CHAIN_HEADER_WORDS) // 2))
    handles = tuple(struct.unpack_from("<Q", packet, 4 + 4 * _CHAIN_HEADER_WORDS + 8 * i)[0] & 0xFFFFFFFF
                    for i in range(n))
    return ChainInfo(command_count, submit_index, error_index, handles)


def lone_command_limit(opcode: int, version_major: int, version_minor: int) -> int | None:
    """The most payload words a packet of ``opcode`` may carry when submitted on its own under the driver whose
    DRM_IOCTL_VERSION is ``version_major.version_minor``, or None when a lone command goes through the command
    list like a chain (upstream 0.6 and later, the out-of-tree driver: major 1). See ``LONE_COMMAND_WORDS``."""
    if version_major != 0 or version_minor >= _CMDLIST_ALWAYS_MINOR:
        return None
    return LONE_COMMAND_WORDS.get(opcode)


def chain_slot_cost(arg_words: int) -> int:
    """Bytes one sub-command of ``arg_words`` argument words takes in the driver's 4 KiB list."""
    return _CHAIN_SLOT_HEADER + 4 * arg_words


@dataclass(frozen=True)
class Health:
    """Context health record the driver writes over a TIMEOUT packet's payload (docs/xrt-sequence.md 1.9, docs/uapi.md
    6.6)."""

    version: int
    npu_gen: int
    txn_op_idx: int
    ctx_pc: int
    fatal_error_type: int
    fatal_error_exception_type: int
    fatal_error_exception_pc: int
    fatal_error_app_module: int


_HEALTH = struct.Struct("<8I")


def decode_health(packet: ReadableBuffer) -> Health | None:
    """The health record at payload word 1, or None when the driver left none.

    None when the payload is the driver's 0xFF fill (docs/uapi.md 6.6) or the version word is 0.
    """
    if len(memoryview(packet).cast("B")) < 4 + _HEALTH.size:
        return None
    values = _HEALTH.unpack_from(packet, 4)
    if values[0] in (0, 0xFFFFFFFF):
        return None
    return Health(*values)


def _check_fits(packet: ReadableBuffer, used: int, count: int) -> None:
    size = len(memoryview(packet).cast("B"))
    if count > MAX_PACKET_WORDS:
        raise ValueError(f"ERT packet of {count} payload words exceeds the 11-bit count ({MAX_PACKET_WORDS})")
    if used > size:
        raise ValueError(f"ERT packet of {used} bytes does not fit a {size}-byte command buffer")
