"""ERT packet encoders/decoders (amdxdna_direct.cmd) against the spec's worked values and the fixture JSON."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from amdxdna_direct import cmd


def test_start_cu_header_matches_xrt_value_for_15_word_regmap():
    # docs/xrt-sequence.md 1.7: header 0x30010001 = state NEW, count 16, opcode START_CU, type 3.
    packet = bytearray(4096)
    used = cmd.encode_start_cu(packet, 0, bytes(60))
    assert struct.unpack_from("<I", packet, 0)[0] == 0x30010001
    assert struct.unpack_from("<I", packet, 4)[0] == 0x1
    assert used == 4 * 17


def test_start_cu_regmap_layout_from_fixture_json(npu1_fixture):
    # Regmap offsets from main_kernels.json (the input xclbinutil used), values placed little endian.
    kernels = json.loads((npu1_fixture / "main_kernels.json").read_text())["ps-kernels"]["kernels"]
    offsets = {a["name"]: int(a["offset"], 16) for a in kernels[0]["arguments"]}
    sizes = {"opcode": 8, "instr": 8, "ninstr": 4} | {f"bo{i}": 8 for i in range(5)}
    values = {"opcode": 3, "instr": 0x04000000, "ninstr": 82, "bo0": 0x7F0011223344, "bo2": 0x7F00AABBCC00}
    size = max(offsets[n] + sizes[n] for n in offsets)
    regmap = cmd.encode_regmap(size, [(offsets[n], sizes[n], v) for n, v in values.items()])
    packet = bytearray(4096)
    cmd.encode_start_cu(packet, 2, regmap)
    words = struct.unpack_from("<17I", packet, 0)
    assert words[1] == 1 << 2
    assert words[2:4] == (3, 0)                                   # opcode u64 at 0x00
    assert words[4:6] == (0x04000000, 0)                          # instr at 0x08
    assert words[6] == 82                                         # ninstr u32 at 0x10
    assert words[7:9] == (0x11223344, 0x7F00)                     # bo0 at 0x14: unaligned u64 as two words
    assert words[9:11] == (0, 0)                                  # bo1 unused stays zero
    assert words[11:13] == (0xAABBCC00, 0x7F00)                   # bo2 at 0x24
    assert cmd.decode_header(words[0]).count == 16


def test_encode_zeroes_the_whole_recycled_packet():
    packet = bytearray(b"\xff" * 256)
    cmd.encode_start_cu(packet, 0, bytes(8))
    assert packet[4 * 4:] == bytes(256 - 16)


def test_odd_short_payload_is_padded_to_even():
    # docs/xrt-sequence.md 1.7 parity quirk: odd arg counts below 15 are aborted by npu4 firmware in chains.
    assert cmd.payload_words(12) == 4      # 3 words -> 4
    assert cmd.payload_words(60) == 15     # the mlir-aie regmap stays 15
    assert cmd.payload_words(16) == 4


def test_chain_packet_layout_and_decode():
    # docs/uapi.md 6.5: count, submit_index, error_index, reserved[3], u64 handles; no cu mask.
    packet = bytearray(4096)
    used = cmd.encode_chain(packet, [7, 9, 11])
    header = cmd.decode_header(struct.unpack_from("<I", packet, 0)[0])
    assert header.opcode == 19 and header.count == 6 + 2 * 3 and header.state == cmd.ERT_CMD_STATE_NEW
    assert struct.unpack_from("<6I", packet, 4) == (3, 0, 0, 0, 0, 0)
    assert struct.unpack_from("<3Q", packet, 28) == (7, 9, 11)
    assert used == 4 + 4 * 12
    struct.pack_into("<I", packet, 12, 2)  # the driver's error_index
    info = cmd.decode_chain(packet)
    assert info.command_count == 3 and info.error_index == 2 and info.handles == (7, 9, 11)


def test_state_read_write_keep_other_fields():
    packet = bytearray(64)
    cmd.encode_start_cu(packet, 0, bytes(8))
    before = struct.unpack_from("<I", packet, 0)[0]
    cmd.write_state(packet, cmd.ERT_CMD_STATE_COMPLETED)
    assert cmd.read_state(packet) == 4
    assert struct.unpack_from("<I", packet, 0)[0] == (before & ~0xF) | 4
    assert cmd.state_name(4) == "COMPLETED" and cmd.state_name(8) == "TIMEOUT" and cmd.state_name(13) == "STATE_13"


@given(opcode=st.integers(0, 31), count=st.integers(0, 0x7FF), state=st.integers(0, 15),
       masks=st.integers(0, 3), kind=st.integers(0, 15))
def test_header_bitfields_roundtrip(opcode, count, state, masks, kind):
    word = cmd.make_header(opcode, count, state=state, extra_cu_masks=masks, type_=kind)
    # bit positions of docs/xrt-sequence.md 1.7 written out independently
    assert word == state | masks << 10 | count << 12 | opcode << 23 | kind << 28
    assert cmd.decode_header(word) == (state, 0, masks, count, opcode, kind)


def test_health_record_decode_and_ff_fill():
    packet = bytearray(64)
    struct.pack_into("<8I", packet, 4, 1, 1, 5, 0x1234, 2, 3, 0x40, 7)
    health = cmd.decode_health(packet)
    assert health == cmd.Health(1, 1, 5, 0x1234, 2, 3, 0x40, 7)
    assert cmd.decode_health(b"\x00\x00\x00\x00" + b"\xff" * 60) is None   # docs/uapi.md 6.6 0xFF payload


def test_slot_cost_and_budget():
    # ROCr: 52 + 4 * arg_cnt per slot in the 4 KiB list, e.g. 44 commands of arg_cnt 10 (docs/xrt-sequence.md 1.7 /
    # docs/uapi.md 6.5);
    # the driver takes at most 64 sub-commands per chain (docs/xrt-sequence.md 1.7).
    assert cmd.chain_slot_cost(15) == 112 and cmd.chain_slot_cost(10) == 92
    assert cmd.CHAIN_SLOT_BUDGET // cmd.chain_slot_cost(10) == 44
    assert cmd.CHAIN_SLOT_BUDGET == 4096 and cmd.CHAIN_MAX_RUNS == 64


@pytest.mark.parametrize("call, message", [
    (lambda: cmd.encode_start_cu(bytearray(16), 0, bytes(60)), "does not fit a 16-byte"),
    (lambda: cmd.encode_start_cu(bytearray(4096), 32, bytes(8)), "cu_index 32"),
    (lambda: cmd.encode_chain(bytearray(4096), []), "at least one"),
    (lambda: cmd.encode_regmap(8, [(4, 8, 1)]), "exceeds regmap size"),
    (lambda: cmd.make_header(32, 0), "opcode=32"),
    (lambda: cmd.decode_chain(bytearray(64)), "not ERT_CMD_CHAIN"),
])
def test_bad_input_is_rejected(call, message):
    with pytest.raises(ValueError, match=message):
        call()
