"""amdxdna_direct.insts: TXN decode/encode against the mlir-aie fixtures decoded by hand (docs/xrt-sequence.md 2.3)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from fixture_files import fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amdxdna_direct import insts
from amdxdna_direct.cli import insts_cmd
from amdxdna_direct.insts import BlockWrite, DdrPatch, InstsError, MaskWrite, Stream, Sync, Write32


def words_of(path: Path) -> list[int]:
    raw = path.read_bytes()
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def pack(words: list[int]) -> bytes:
    return struct.pack(f"<{len(words)}I", *words)


# The npu1_1col insts.bin worked out by hand from its words (docs/xrt-sequence.md 2.3 lists them): header 0x06030100
# = major 0, minor 1, devGen 3, 6 rows; 0x101 = 1 column, 1 memory-tile row; 9 ops; 328 bytes.
BD_NPU1 = (0, 0, 0, 0x80000000, 0x02000000, 0, 0x02000000)
NPU1_OPS = (
    BlockWrite(addr=0x1D020, words=(0x10,) + BD_NPU1),                    # words 4..15: shim BD1
    DdrPatch(reg_addr=0x1D024, arg_idx=2, arg_plus=0),                     # words 16..27
    MaskWrite(addr=0x1D200, value=0xF00, mask=0x1F00),                     # words 28..34: S2MM0 ctrl
    Write32(addr=0x1D204, value=0x80000001),                               # words 35..40: S2MM0 queue, BD1 + token
    BlockWrite(addr=0x1D000, words=(0x11,) + BD_NPU1),                     # words 41..52: shim BD0
    DdrPatch(reg_addr=0x1D004, arg_idx=0, arg_plus=0),                     # words 53..64
    MaskWrite(addr=0x1D210, value=0xF00, mask=0x1F00),                     # words 65..71: MM2S0 ctrl
    Write32(addr=0x1D214, value=0x80000000),                               # words 72..77: MM2S0 queue, BD0 + token
    Sync(direction=0, row=0, col=0, channel=0, row_num=1, col_num=1),      # words 78..81: wait S2MM0
)
NPU1_OP_WORDS = [4, 16, 28, 35, 41, 53, 65, 72, 78]


def test_npu1_fixture_decodes_to_the_hand_worked_ops():
    s = insts.load(fixture("mlir-aie-npu1_1col/insts.bin"))
    assert (s.major, s.minor, s.dev_gen, s.rows, s.cols, s.mem_tile_rows) == (0, 1, 3, 6, 1, 1)
    assert (s.num_ops, s.size_bytes) == (9, 328)
    assert s.ops == NPU1_OPS
    assert insts.layout(s) == NPU1_OP_WORDS


def test_npu2_fixture_header_values():
    s = insts.load(fixture("mlir-aie-npu2_1col/insts.bin"))
    # header 0x06040100, 0x00000101, 8, 300 (docs/xrt-sequence.md 2.3)
    assert (s.major, s.minor, s.dev_gen, s.rows, s.cols, s.mem_tile_rows, s.num_ops, s.size_bytes) == \
        (0, 1, 4, 6, 1, 1, 8, 300)
    assert [type(op).__name__ for op in s.ops] == [
        "BlockWrite", "DdrPatch", "Write32", "BlockWrite", "DdrPatch", "MaskWrite", "Write32", "Sync"]


@pytest.mark.parametrize("rel", ["mlir-aie-npu1_1col/insts.bin", "mlir-aie-npu2_1col/insts.bin"])
def test_fixture_round_trip(rel):
    raw = fixture(rel).read_bytes()
    s = insts.decode(raw)
    assert insts.encode(s) == raw
    assert insts.decode(insts.encode(s)) == s
    assert insts.decode(words_of(fixture(rel))) == s


def test_dma_stream_reproduces_the_npu2_fixture_byte_for_byte():
    raw = fixture("mlir-aie-npu2_1col/insts.bin").read_bytes()
    # BD0: 0x80 words in on MM2S0 from arg 0; BD1: 0x1000 words out on S2MM0 to arg 1 (read off the fixture)
    built = insts.dma_stream(4, [(0, 0x80 * 4, "in"), (1, 0x1000 * 4, "out")])
    assert insts.encode(built) == raw


def test_dma_stream_layout_rtp_channels_tokens_and_column():
    s = insts.dma_stream(3, [(0, 64, "in"), (1, 128, "in"), (2, 256, "out"), (4, 32, "in")], rtp=[7, 9],
                         column=2)
    col = 2 << 25
    bd = (0, 0, 0, 0x80000000, 0x02000000, 0, 0x02000000)
    assert s.ops == (
        BlockWrite(addr=col | (2 << 20), words=(7, 9)),
        BlockWrite(addr=col | 0x1D000, words=(16,) + bd),
        DdrPatch(reg_addr=col | 0x1D004, arg_idx=0, arg_plus=0),
        Write32(addr=col | 0x1D214, value=0),                   # MM2S0 queue, BD0
        BlockWrite(addr=col | 0x1D020, words=(32,) + bd),
        DdrPatch(reg_addr=col | 0x1D024, arg_idx=1, arg_plus=0),
        Write32(addr=col | 0x1D21C, value=1),                   # MM2S1 queue, BD1
        BlockWrite(addr=col | 0x1D040, words=(64,) + bd),
        DdrPatch(reg_addr=col | 0x1D044, arg_idx=2, arg_plus=0),
        MaskWrite(addr=col | 0x1D200, value=0xF00, mask=0x1F00),
        Write32(addr=col | 0x1D204, value=0x80000002),          # S2MM0 queue, BD2 + token
        BlockWrite(addr=col | 0x1D060, words=(8,) + bd),
        DdrPatch(reg_addr=col | 0x1D064, arg_idx=4, arg_plus=0),
        Write32(addr=col | 0x1D214, value=3),                   # MM2S0 again (round robin), BD3
        Sync(direction=0, row=0, col=2, channel=0, row_num=1, col_num=1),
    )
    assert (s.dev_gen, s.cols) == (3, 3)
    assert insts.decode(insts.encode(s)) == s


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((5, [(0, 4, "in")]), {}, "dev_gen 5 unsupported"),
    ((3, [(0, 4, "sideways")]), {}, "direction 'sideways'"),
    ((3, [(0, 6, "in")]), {}, "size 6 bytes"),
    ((3, [(0, 0, "out")]), {}, "size 0 bytes"),
    ((3, [(256, 4, "in")]), {}, "arg_idx 256"),
    ((3, [(0, 4, "in")] * 17), {}, "17 buffers"),
    ((3, [(0, 4, "in")]), {"rtp": [1 << 32]}, "rtp word"),
    ((3, [(0, 4, "in")]), {"column": 200}, "column 200"),
])
def test_dma_stream_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        insts.dma_stream(*args, **kwargs)


def test_2024_encoding_layouts():
    """Major 1 / minor 0 streams use aie-rt's *_opt structs (xaie_txn.h): WRITE32 3 words, DDR_PATCH 6."""
    s = Stream(major=1, minor=0, dev_gen=3, rows=6, cols=1, mem_tile_rows=1, ops=(
        Write32(addr=0x1D204, value=5),
        MaskWrite(addr=0x1D200, value=0xF00, mask=0x1F00),
        BlockWrite(addr=0x1D000, words=(1, 2)),
        DdrPatch(reg_addr=0x1D004, arg_idx=3, arg_plus=0x1_0000_0040),
        Sync(direction=0, row=0, col=1, channel=1, row_num=1, col_num=1),
    ))
    expected = [
        0x06030001, 0x101, 5, 104,
        0x00, 0x1D204, 5,
        0x03, 0x1D200, 0xF00, 0x1F00,
        0x01, 0x1D000, 20, 1, 2,
        0x81, 24, 0x1D004, 3, 0x40, 1,
        0x80, 16, 0x10000, 0x01010100,
    ]
    assert insts.encode_words(s) == expected
    assert s.size_bytes == 4 * len(expected)
    assert insts.decode(pack(expected)) == s


def test_txt_loading(tmp_path):
    path = fixture("mlir-aie-npu1_1col/insts.bin")
    text = tmp_path / "insts.txt"
    text.write_text("".join(f"{w:08X}\n" for w in words_of(path)))   # mlir-aie prints %08X
    assert insts.load(text) == insts.load(path)
    assert insts.load(str(text)) == insts.load(path.read_bytes())
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("\n".join(["0x06030100", "101", "", "  0 ", "10"]) + "\r\n")
    assert insts.load(mixed) == Stream(major=0, minor=1, dev_gen=3, rows=6, cols=1, mem_tile_rows=1, ops=())


def test_txt_bad_word_names_word_and_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("06030100\n00000101\n123456789\n")
    with pytest.raises(InstsError, match=r"word 2 \(line 3\): '123456789' is not a 32-bit hex word"):
        insts.load(bad)


NPU1_HEAD = [0x06030100, 0x101, 1, 40]


@pytest.mark.parametrize(("words", "message"), [
    ([0x06030100, 0x101], r"word 2: stream truncated in the 4-word TXN header"),
    ([0x06030002, 0x101, 0, 16], r"word 0: TXN version 2\.0 unknown"),
    ([0x06030100, 0x101, 0, 20, 0], r"word 4: 1 words left after the 0 ops of the header"),
    ([0x06030100, 0x101, 0, 99], r"word 3: header size_bytes 99 disagrees with the stream length 16"),
    ([0x06030100, 0x101, 2, 40, 0, 0, 0x1D204, 0, 5, 24], r"word 10: stream ends after 1 ops, header num_ops says 2"),
    ([0x06030100, 0x101, 1, 44, 0, 0, 0x1D204, 0, 5, 24, 7], r"word 10: 1 words left after the 1 ops"),
    ([0x06030100, 0x101, 1, 40, 0, 0, 0x1D204, 0, 5, 20], r"word 9: WRITE32 size 20 bytes is not a multiple of 4"),
    ([0x06030100, 0x101, 1, 28, 0, 0, 0x1D204], r"word 4: WRITE32 is truncated before its size word 5"),
    ([0x06030100, 0x101, 1, 32, 1, 0, 0x1D000, 18], r"word 7: BLOCKWRITE size 18 bytes is not a multiple of 4"),
    ([0x06030100, 0x101, 1, 32, 1, 0, 0x1D000, 12], r"word 7: BLOCKWRITE size 12 bytes is not a multiple of 4 >= 16"),
    ([0x06030100, 0x101, 1, 36, 1, 0, 0x1D000, 40, 1],
     r"word 7: BLOCKWRITE of 40 bytes runs past the end of the stream \(20 bytes left\)"),
    ([0x06030100, 0x101, 1, 20, 0x04], r"word 4: MASKPOLL is truncated before its size word 6"),
    ([0x06030100, 0x101, 1, 24, 0x83, 4], r"word 5: RECORD_TIMER size 4 bytes is not a multiple of 4 >= 8"),
    ([0x06030100, 0x101, 1, 24, 0x90, 0], r"word 5: custom op 0x90 size 0 bytes"),
    ([0x06030001, 0x101, 1, 20, 0x01], r"word 4: BLOCKWRITE is truncated before its size word 2"),
    # an op of fixed length cut by the end of the stream (an IndexError before; found by test_fuzz_parsers.py)
    ([0x06030001, 0x101, 1, 24, 0x00, 0x1D204], r"^word 4: WRITE32 of 12 bytes runs past the end of the stream "
                                                r"\(8 bytes left\)$"),
    ([0x06030100, 0x101, 1, 24, 0x08, 0], r"^word 4: LOADPDI of 16 bytes runs past the end of the stream \(8 bytes"),
])
def test_decode_errors_name_the_word(words, message):
    for strict in (False, True):
        with pytest.raises(InstsError, match=message):
            insts.decode(pack(words), strict=strict)


# Ops the decoder does not decode: strict refuses them (naming the word), the default keeps them raw.
@pytest.mark.parametrize(("words", "message"), [
    ([0x06030100, 0x101, 1, 20, 0x05], r"word 4: opcode 0x05 \(NOOP\) is not decoded"),
    ([0x06030100, 0x101, 1, 40, 0, 9, 0x1D204, 0, 5, 24], r"word 5: WRITE32 reserved word 1 is 0x00000009"),
    ([0x06030100, 0x101, 1, 44, 0, 0, 0x1D204, 0, 5, 28, 0], r"word 9: WRITE32 size field 28 bytes, expected 24"),
    ([0x06030100, 0x101, 1, 40, 0x100, 0, 0x1D204, 0, 5, 24], r"word 4: op header 0x00000100 has non-zero col/row"),
    ([0x06030100, 0x101, 1, 32, 0x80, 16, 0, 0x10101], r"word 6: SYNC reserved bits set"),
    ([0x06030100, 0x101, 1, 64] + [0x81, 48, 0, 0, 1, 0, 0x1D004, 0, 0, 0, 0, 0],
     r"word 8: DDR_PATCH reserved word 4 is 0x00000001"),
    ([0x06030001, 0x101, 1, 40] + [0x81, 24, 0x1D004, 0x100, 0, 0],
     r"word 7: DDR_PATCH argidx word 0x00000100 has non-zero padding"),
    ([0x06030001, 0x101, 1, 28] + [0x300, 0x1D204, 5], r"word 4: op header 0x00000300 has non-zero padding"),
])
def test_ops_not_decoded_are_raw_or_refused_when_strict(words, message):
    with pytest.raises(InstsError, match=message):
        insts.decode(pack(words), strict=True)
    s = insts.decode(pack(words))
    (op,) = s.ops
    assert isinstance(op, insts.RawOp) and re.match(message, op.reason)
    assert op.words == tuple(words[4:]) and op.opcode == words[4] & 0xFF and op.sized
    assert insts.encode(s) == pack(words)


def test_a_size_word_decides_the_length_of_a_known_op():
    # A SYNC declaring 12 bytes is walked as 3 words (kept raw: its encoding has 4); the 4th is left over.
    words = [0x06030100, 0x101, 1, 32, 0x80, 12, 0, 0x10100]
    with pytest.raises(InstsError, match=r"word 7: 1 words left after the 1 ops"):
        insts.decode(pack(words))
    with pytest.raises(InstsError, match=r"word 4: SYNC needs 4 words, only 3 left"):
        insts.decode(pack(words), strict=True)


def test_header_pad_is_kept():
    words = [0x06030100, 0x12340101, 0, 16]
    s = insts.decode(pack(words))
    assert (s.pad, s.cols, s.mem_tile_rows) == (0x1234, 1, 1)
    assert insts.encode(s) == pack(words)


# A 0.1 stream with every op the decoder keeps raw, words laid out by hand from aie-rt's structs
# (docs/runtime.md 1.1): MASKPOLL / MASKPOLL_BUSY 28 bytes with the size in word 6; NOOP and PREEMPT one
# word; LOADPDI 4 words; LOAD_PM_START 2; custom ops READ_REGS / RECORD_TIMER / MERGE_SYNC and a later one
# with their size in word 1; BLOCKSET with BLOCKWRITE's header.
RAW_OPS_01 = [
    ("MASKPOLL", [0x04, 0, 0x1D204, 0, 0x1, 0xF, 28]),
    ("NOOP", [0x05]),
    ("PREEMPT", [0x0106]),
    ("LOADPDI", [0x00020008, 0x2000, 0x04020000, 0]),
    ("LOAD_PM_START", [0x00000109, 7]),
    ("MASKPOLL_BUSY", [0x07, 0, 0x1D20C, 0, 0x0, 0x1, 28]),
    ("READ_REGS", [0x82, 24, 1, 0, 0x1D204, 0]),
    ("RECORD_TIMER", [0x83, 12, 5]),
    ("MERGE_SYNC", [0x84, 12, 0x00010002]),
    ("CUSTOM_OP_NEXT", [0x85, 8]),
    ("OP_0x9a", [0x9A, 16, 1, 2]),
    ("BLOCKSET", [0x02, 0, 0x1D000, 20, 0]),
]


def _stream_with(ops: list[list[int]], version: tuple[int, int] = (0, 1), dev_gen: int = 4) -> list[int]:
    body = [w for op in ops for w in op]
    return [0x06000000 | dev_gen << 16 | version[1] << 8 | version[0], 0x101, len(ops), 4 * (4 + len(body))] + body


def test_raw_ops_keep_their_words_names_and_sizes():
    write = [0, 0, 0x1D204, 0, 5, 24]
    words = _stream_with([write] + [op for _, op in RAW_OPS_01] + [write])
    s = insts.decode(pack(words))
    assert s.ops[0] == s.ops[-1] == Write32(addr=0x1D204, value=5)
    raw = s.ops[1:-1]
    assert [(op.name, op.words, op.size_bytes) for op in raw] == [(n, tuple(w), 4 * len(w)) for n, w in RAW_OPS_01]
    assert all("is not decoded" in op.reason for op in raw)
    starts = insts.layout(s)
    assert insts.raw_ops(s) == list(zip(starts[1:-1], raw, strict=True))
    assert starts[2] == 4 + 6 + 7                   # after the WRITE32 and the 7-word MASKPOLL
    assert insts.encode(s) == pack(words) and s.num_ops == len(RAW_OPS_01) + 2
    with pytest.raises(InstsError, match=r"word 10: opcode 0x04 \(MASKPOLL\) is not decoded"):
        insts.decode(pack(words), strict=True)


def test_raw_ops_in_the_2024_encoding():
    ops = [[0x04, 0x1D204, 1, 0xF], [0x05], [0x0C, 0, 0x1D204], [0x83, 12, 5], [0x00, 0x1D204, 5]]
    s = insts.decode(pack(_stream_with(ops, version=(1, 0))))
    assert [type(op).__name__ for op in s.ops] == ["RawOp"] * 4 + ["Write32"]
    assert [op.name for op in s.ops[:4]] == ["MASKPOLL", "NOOP", "UPDATE_REG", "RECORD_TIMER"]
    assert insts.layout(s) == [4, 8, 9, 12, 15]
    assert insts.encode(s) == pack(_stream_with(ops, version=(1, 0)))


def test_an_op_of_unknown_length_takes_the_rest_and_the_count_is_not_checked():
    ops = [[0, 0, 0x1D204, 0, 5, 24], [0x20, 1, 2, 3], [0x05], [0x05]]
    words = _stream_with(ops)
    s = insts.decode(pack(words))
    assert s.ops[0] == Write32(addr=0x1D204, value=5)
    tail = s.ops[1]
    assert (tail.opcode, tail.sized, tail.words, tail.name) == (0x20, False, (0x20, 1, 2, 3, 5, 5), "OP_0x20")
    assert "has no length the runtime knows; the op count is not checked" in tail.reason
    assert (s.unwalked_ops, s.num_ops) == (2, 4)
    assert insts.encode(s) == pack(words)
    with pytest.raises(InstsError, match=r"word 10: opcode 0x20 \(0x20\) has no length"):
        insts.decode(pack(words), strict=True)
    with pytest.raises(InstsError, match="needs a final RawOp of unknown length"):
        insts.encode(Stream(0, 1, 4, 6, 1, 1, (s.ops[0],), unwalked_ops=2))
    with pytest.raises(InstsError, match="op 0 is a RawOp of unknown length; only the last op may be"):
        insts.encode(Stream(0, 1, 4, 6, 1, 1, (tail, s.ops[0])))


def test_raw_op_words_must_start_with_its_opcode():
    with pytest.raises(InstsError, match=r"op 0 RawOp words must start with its opcode 0x04"):
        insts.encode(Stream(0, 1, 4, 6, 1, 1, (insts.RawOp(0x04, (0x05,), "made up"),)))


def test_decode_rejects_partial_words_and_out_of_range_ints():
    with pytest.raises(InstsError, match=r"word 1: stream length 6 bytes is not a multiple of 4"):
        insts.decode(b"\0" * 6)
    with pytest.raises(InstsError, match=r"word 1: -1 is not a 32-bit word"):
        insts.decode([0x06030100, -1, 0, 16])


@pytest.mark.parametrize(("stream", "message"), [
    (Stream(1, 0, 3, 6, 1, 1, (DdrPatch(0x1D004, 256, 0),)), r"op 0 field arg_idx=256"),
    (Stream(1, 0, 3, 6, 1, 1, (Write32(1 << 32, 0),)), r"op 0 field addr=4294967296"),
    (Stream(0, 1, 3, 6, 1, 1, (Write32(0, 1 << 32),)), r"op 0 field value=4294967296"),
    (Stream(0, 1, 3, 6, 1, 1, (Sync(0, 0, 256, 0, 1, 1),)), r"op 0 field col=256"),
    (Stream(0, 1, 300, 6, 1, 1, ()), r"header dev_gen 300"),
    (Stream(2, 2, 3, 6, 1, 1, ()), r"TXN version 2\.2 unknown"),
])
def test_encode_errors(stream, message):
    with pytest.raises(InstsError, match=message):
        insts.encode(stream)


def test_layout_and_size_of_an_unknown_version_name_the_operation():
    s = Stream(2, 2, 3, 6, 1, 1, (Write32(0, 0),))
    with pytest.raises(InstsError, match=r"^layout: TXN version 2\.2 unknown"):
        insts.layout(s)
    with pytest.raises(InstsError, match=r"^size_bytes: TXN version 2\.2 unknown"):
        s.size_bytes  # noqa: B018 - the property raises


def test_load_rejects_other_inputs(tmp_path):
    with pytest.raises(TypeError, match="expected bytes or a path"):
        insts.load(1234)
    with pytest.raises(FileNotFoundError):
        insts.load(tmp_path / "missing.bin")


# --------------------------------------------------------------------------------------------- fuzzing


def _mutations(raw: bytes) -> st.SearchStrategy[bytes]:
    n = len(raw)
    flip = st.tuples(st.integers(0, n - 1), st.integers(1, 255)).map(
        lambda t: raw[:t[0]] + bytes([raw[t[0]] ^ t[1]]) + raw[t[0] + 1:])
    truncate = st.integers(0, n - 1).map(lambda k: raw[:k])
    insert = st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=8)).map(
        lambda t: raw[:t[0]] + t[1] + raw[t[0]:])
    big = st.tuples(st.integers(0, n // 4 - 1), st.sampled_from([0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0x10000, 4])).map(
        lambda t: raw[:4 * t[0]] + struct.pack("<I", t[1]) + raw[4 * t[0] + 4:])
    return st.one_of(flip, truncate, insert, big)


def _check_only_documented(data: bytes) -> None:
    try:
        s = insts.decode(data)
    except InstsError:
        return
    assert insts.encode(s) == data      # whatever decodes, re-encodes to the same bytes
    json.dumps(insts_cmd.describe(s))    # ... and the CLI can describe and list it
    insts_cmd.render(s)


@pytest.mark.parametrize("rel", ["mlir-aie-npu1_1col/insts.bin", "mlir-aie-npu2_1col/insts.bin"])
def test_fuzz_mutated_fixtures_raise_only_insts_error(rel):
    raw = fixture(rel).read_bytes()

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_mutations(raw))
    def check(data):
        _check_only_documented(data)

    check()


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.text(alphabet="0123456789abcdefABxX \t\r\n", max_size=120).map(str.encode)))
def test_fuzz_loading_raises_only_insts_error(data):
    try:
        s = insts.load(data)
    except InstsError:
        return
    assert insts.decode(insts.encode(s)) == s


# -- buffer reach from the whole shim BD (docs/runtime.md 1.4) --------------------------------------------------
#
# The BD words are encoded here by hand from the shim BD layout of AIE2 and AIE2P (docs/runtime.md 1.4): word 0
# length in words; word 3 D0 wrap bits 29:20, D0 step-1 bits 19:0; word 4 D1 wrap 29:20, D1 step-1 19:0 (burst
# length 31:30); word 5 D2 step-1 19:0 (AxCache 27:24); word 6 iteration wrap-1 25:20, step-1 19:0; word 7 valid.
# The oracle walks every element's address one by one.


def bd_words(length, d0=(0, 1), d1=(0, 1), d2_step=1, iteration=(1, 1), burst=0x8000_0000):
    return (length, 0, 0, d0[0] << 20 | (d0[1] - 1), burst | d1[0] << 20 | (d1[1] - 1), 0x0200_0000 | (d2_step - 1),
            (iteration[0] - 1) << 20 | (iteration[1] - 1), 0x0200_0000)


def walked_span(length, d0=(0, 1), d1=(0, 1), d2_step=1, iteration=(1, 1)):
    furthest = -1
    for k in range(iteration[0]):
        for n in range(length):
            if d0[0] == 0:
                offset = n * d0[1]
            elif d1[0] == 0:
                offset = n % d0[0] * d0[1] + n // d0[0] * d1[1]
            else:
                offset = n % d0[0] * d0[1] + n // d0[0] % d1[0] * d1[1] + n // (d0[0] * d1[0]) * d2_step
            furthest = max(furthest, offset + k * iteration[1])
    return 4 * (furthest + 1) if length else 0


def bd_stream(dev_gen, bds, arg_plus=0):
    """A stream that BLOCKWRITEs each BD i of ``bds`` and patches its address with buffer i."""
    ops = []
    for i, words in enumerate(bds):
        base = insts.SHIM_BD_BASE + insts.SHIM_BD_STRIDE * i
        ops += [BlockWrite(addr=base, words=words), DdrPatch(reg_addr=base + 4, arg_idx=i, arg_plus=arg_plus)]
    return Stream(major=0, minor=1, dev_gen=dev_gen, rows=6, cols=1, mem_tile_rows=1, ops=tuple(ops))


STRIDED_BDS = [
    dict(length=64),
    dict(length=48, d0=(4, 1), d1=(3, 10), d2_step=40),                  # 3-D tile of a row-major matrix
    dict(length=37, d0=(5, 2), d1=(3, 7), d2_step=3),                    # a partial last D2 step
    dict(length=24, d0=(8, 1), d1=(0, 16)),                              # D1 never wraps
    dict(length=30, d0=(6, 1), d1=(5, 100), d2_step=1),                  # D2 steps back below D1's reach
    dict(length=16, iteration=(4, 64)),                                  # four iterations 256 bytes apart
    dict(length=12, d0=(3, 4), d1=(2, 1), d2_step=2, iteration=(3, 5)),
    dict(length=0),
]


@pytest.mark.parametrize("dev_gen", [3, 4])
@pytest.mark.parametrize("bd", STRIDED_BDS)
def test_buffer_reach_follows_every_bd_word(dev_gen, bd):
    stream = bd_stream(dev_gen, [bd_words(**bd)], arg_plus=8)
    reach = insts.buffer_reaches(stream)[0]
    assert reach.span == walked_span(**bd)
    assert reach.nbytes == 8 + walked_span(**bd) and insts.buffer_reach(stream) == {0: reach.nbytes}
    assert (reach.length, reach.arg_plus, reach.bd, reach.layout) == (4 * bd["length"], 8, 0,
                                                                       {3: "aie2", 4: "aie2p"}[dev_gen])
    assert insts.buffer_reach(insts.encode(stream)) == {0: reach.nbytes}          # bytes decode the same


@pytest.mark.parametrize("dev_gen", [3, 4])
def test_buffer_reach_of_the_sam3_overlapping_row_conv(dev_gen):
    """C=256: D=768, K=3072, lda=1536 (bf16): an M-row chunk view is ((M-1)*lda + K)*2 bytes. One BD moves all M
    rows: rows of K elements = 1536 words, as D0 768 words x D1 2 steps of 768 words (D0's wrap has 10 bits), and
    D2 steps lda = 768 words to the next row. Its length (M*K*2 bytes) is twice the view; its reach is the view."""
    m, k, lda = 16, 3072, 1536
    words = bd_words(m * k // 2, d0=(768, 1), d1=(2, 768), d2_step=lda // 2)
    reach = insts.buffer_reaches(bd_stream(dev_gen, [words]))[0]
    assert reach.nbytes == ((m - 1) * lda + k) * 2 == 52224
    assert reach.length == m * k * 2


def test_buffer_reach_reads_the_last_write_of_each_bd_word_before_the_patch():
    base = insts.SHIM_BD_BASE
    stream = bd_stream(4, [bd_words(16)])
    ops = list(stream.ops)
    ops.insert(1, Write32(addr=base + 12, value=4 << 20 | 9))                  # D0: wrap 4, step 10
    ops.insert(2, MaskWrite(addr=base + 16, value=2 << 20, mask=0x3FF0_0000))  # D1: wrap 2 (step 1 kept)
    ops.append(Write32(addr=base, value=1 << 20))                             # after the patch: not read
    reach = insts.buffer_reaches(Stream(**{**stream.__dict__, "ops": tuple(ops)}))[0]
    assert reach.span == walked_span(16, d0=(4, 10), d1=(2, 1)) == 4 * (3 * 10 + 1 + 1 + 1)


def test_buffer_reach_of_unknown_generations_and_unwritten_bds():
    words = bd_words(16, d0=(4, 1), d1=(2, 100))
    assert insts.buffer_reaches(bd_stream(7, [words]))[0][1:] == (64, 1, 16, 0, 0, 64, 0, 64, None)  # length only
    unwritten = Stream(major=0, minor=1, dev_gen=4, rows=6, cols=1, mem_tile_rows=1,
                       ops=(DdrPatch(reg_addr=insts.SHIM_BD_BASE + 4, arg_idx=0, arg_plus=0),))
    assert insts.buffer_reach(unwritten) == {}
    # Two BDs for one buffer: the one reaching furthest decides.
    two = bd_stream(4, [bd_words(16), bd_words(8, iteration=(3, 100))])
    two = Stream(**{**two.__dict__, "ops": two.ops[:3] + (DdrPatch(reg_addr=0x1D024, arg_idx=0, arg_plus=0),)})
    assert insts.buffer_reaches(two)[0].bd == 1 and insts.buffer_reach(two) == {0: 4 * (200 + 8)}
    with pytest.raises(InstsError):
        insts.buffer_reach(b"\1\0\0")


def test_buffer_reach_of_the_fixtures():
    assert insts.buffer_reach(insts.load(fixture("mlir-aie-npu1_1col/insts.bin"))) == {0: 0x11 * 4, 2: 0x10 * 4}
    assert insts.buffer_reach(insts.dma_stream(4, [(0, 1024, "in"), (1, 512, "out")])) == {0: 1024, 1: 512}
