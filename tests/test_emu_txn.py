"""The emulated firmware's TXN walk over every op of aie-rt's encoding it must get past (docs/emulator.md, rule 53).

Hardware runs streams holding MASKPOLL, the custom ops 0x82-0x84 (register reads, timers, merged syncs), the
load-PDI / preemption / state-table ops and non-zero reserved bytes; the walk must skip them by their length
(the size word of custom ops, the fixed encoding of the others) and still model what it models, and must keep
refusing an unknown opcode or a malformed size. The op words below are written by hand from aie-rt's
``XAie_*Hdr`` layouts (xaie_txn.h): the oracle is the plain stream's walk.
"""

from __future__ import annotations

import struct

import pytest
from emu_raw import ERT_START_CU, ERT_STATE_COMPLETED, ERT_STATE_ERROR, Npu, packet, regmap, run_one, txn_stream

from amdxdna_direct.emu import Passthrough, txn

SHIM_QUEUE = 0x1D200            # a shim DMA register of column 0 (row 0)

# One of each op the walk skips, with reserved fields set where the encoding has them.
MASKPOLL = [0x04, 0, SHIM_QUEUE, 0, 0x1, 0x1, 28]
MASKPOLL_BUSY = [0x07, 0, SHIM_QUEUE, 0, 0x0, 0xF, 28]
NOOP = [0xAB000005]                                         # opcode 5, padding bytes 0xAB00 00
PREEMPT = [0x12340206]                                      # opcode 6, level AIE_TILE (2), reserved 0x1234
LOADPDI = [0x00030008, 0x1000, 0x04020000, 0]               # PDI id 3, 4 KiB at device address 0x4020000
LOAD_PM_START = [0x00000109, 7]                             # load sequence count 1, PM id 7
CREATE_SCRATCHPAD = [0x0000000A, 64, 0x100, 0]
UPDATE_STATE_TABLE = [0x0001000B, 5]
UPDATE_REG = [0x0001000C, 5, SHIM_QUEUE]
UPDATE_SCRATCH = [0x0000000D]
READ_REGS = [0x82, 32, 2, 0, SHIM_QUEUE, 0, SHIM_QUEUE + 4, 0]  # count 2, pad, two u64 register addresses
RECORD_TIMER = [0x83, 12, 42]
MERGE_SYNC = [0x84, 12, 0x0102]                              # 2 TCTs over 1 column
SKIPPED = [MASKPOLL, MASKPOLL_BUSY, NOOP, PREEMPT, LOADPDI, LOAD_PM_START, CREATE_SCRATCHPAD, UPDATE_STATE_TABLE,
           UPDATE_REG, UPDATE_SCRATCH, READ_REGS, RECORD_TIMER, MERGE_SYNC]
BUFFERS = [(0, 64), (1, 64)]


def words_of(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def reserved_set(data: bytes) -> bytes:
    """The stream with reserved bytes set: WRITE32 word 1 (padding), the op header's pad byte, DDR_PATCH words 2-5
    (its op_base and action)."""
    words = words_of(data)
    first = 4                                                # the first op (WRITE32) starts after the header
    words[first] |= 0xCD000000
    words[first + 1] = 0xDEADBEEF
    patch = next(i for i in range(4, len(words)) if words[i] == 0x81 and words[i + 1] == 48)
    words[patch + 2:patch + 6] = [0x11, 0x22, 0x33, 0x44]
    return struct.pack(f"<{len(words)}I", *words)


def summary(program: txn.TxnProgram, shift: int = 0) -> tuple:
    """What the firmware model acts on, with op indices moved back by `shift` (the ops inserted before them)."""
    return ([(p.op_index - shift, p.reg_addr, p.arg_idx, p.arg_plus, p.length) for p in program.patches],
            [(q.op_index - shift, q.direction, q.channel, q.bd, q.repeat) for q in program.pushes],
            [(s.op_index - shift, s.direction, s.col, s.channel) for s in program.syncs])


@pytest.mark.parametrize("gen", [3, 4])
def test_walk_skips_every_known_op_and_models_the_rest_unchanged(gen):
    plain = txn.walk(txn_stream(gen, BUFFERS), gen)
    rich = txn.walk(reserved_set(txn_stream(gen, BUFFERS, extra=SKIPPED)), gen)
    assert rich.header.num_ops == plain.header.num_ops + len(SKIPPED)
    # The ops after the inserted ones keep their meaning; only their indices move.
    assert summary(rich, shift=len(SKIPPED)) == summary(plain)
    assert rich.skipped == [(1 + i, op[0] & 0xFF) for i, op in enumerate(SKIPPED)]
    assert [opcode for _, opcode in rich.skipped] == [0x04, 0x07, 0x05, 0x06, 0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0D,
                                                      0x82, 0x83, 0x84]
    assert plain.skipped == []


def malformed(extra: list[list[int]], cut_words: int = 0) -> bytes:
    data = txn_stream(3, BUFFERS, extra=extra)
    if not cut_words:
        return data
    words = words_of(data)[:-cut_words]
    words[3] = 4 * len(words)                                # the header's size follows the cut
    return struct.pack(f"<{len(words)}I", *words)


@pytest.mark.parametrize("extra, cut, message", [
    ([[0x82, 10, 0, 0]], 0, r"op 1: opcode 0x82 declares a bad size of 10 bytes"),      # not a multiple of 4
    ([[0x83, 4]], 0, r"op 1: opcode 0x83 declares a bad size of 4 bytes"),             # shorter than its header
    ([[0x84, 0x4000, 0]], 0, r"op 1: opcode 0x84 declares a bad size of 16384 bytes"),  # past the stream's end
    ([[0x04, 0, SHIM_QUEUE, 0, 1, 1, 24]], 0, r"op 1: opcode 0x4 declares 24 bytes, its encoding has 28"),
    ([[0x04, 0, 0x2001D200, 0, 1, 1, 28]], 0, r"op 1: register 0x2001d200 .* outside the 1-column partition"),
    ([[0x02, 0, SHIM_QUEUE, 16]], 0, r"op 1: unknown TXN opcode 0x2"),                 # BLOCKSET: never serialized
    ([[0x85, 8]], 0, r"op 1: unknown TXN opcode 0x85"),                                # past MERGE_SYNC
    ([[0x0E, 8]], 0, r"op 1: unknown TXN opcode 0xe"),                                 # CONFIG_SHIMDMA_BD
])
def test_walk_still_refuses_unknown_ops_and_malformed_sizes(extra, cut, message):
    with pytest.raises(txn.TxnError, match=message):
        txn.walk(malformed(extra, cut), 3)


def test_walk_refuses_a_header_only_op_cut_by_the_stream_end():
    # LOADPDI (4 words) as the last op, its last two words cut off: the header's size ends mid-op.
    head = txn_stream(3, [])
    words = words_of(head) + LOADPDI[:2]
    words[2] += 1
    words[3] = 4 * len(words)
    with pytest.raises(txn.TxnError, match=r"op 2: opcode 0x8 is truncated"):
        txn.walk(struct.pack(f"<{len(words)}I", *words), 3)


@pytest.fixture
def npu():
    made = Npu("npu1")
    yield made
    made.close()


def run_stream(npu: Npu, stream: bytes) -> tuple[int, bytes, bytes]:
    """Bind `stream` to Passthrough and run it with a 64-byte input: (state, input, output)."""
    npu.dev.models.bind(stream, Passthrough())
    ctx, syncobj = npu.context()
    ins, iaddr = npu.instr(stream)
    src = bytes(range(7, 71))
    a, a_addr = npu.data(64, src)
    b, b_addr = npu.data(64)
    cmd, cmd_addr = npu.cmd(packet(ERT_START_CU, regmap(iaddr, len(stream) // 4, [a_addr, b_addr], nslots=5)))
    job = dict(cmd=cmd, cmd_addr=cmd_addr, args=[ins, a, b], out=b_addr, out_bo=b, nbytes=64)
    return run_one(npu, ctx, syncobj, job), src, npu.output(job)


def test_stream_with_maskpoll_custom_ops_and_reserved_bytes_runs_on_the_device(npu):
    state, src, out = run_stream(npu, reserved_set(txn_stream(3, BUFFERS, extra=SKIPPED)))
    assert state == ERT_STATE_COMPLETED
    assert out == src


def test_malformed_custom_op_fails_the_command(npu, caplog):
    state, _, out = run_stream(npu, malformed([[0x82, 10, 0, 0]]))
    assert state == ERT_STATE_ERROR
    assert "opcode 0x82 declares a bad size of 10 bytes" in caplog.text
    assert out == bytes(64)


def to_2024(data: bytes) -> bytes:
    """The same ops in the TXN 1.0 encoding (docs/runtime.md 1.1), translated op by op from a 0.1 stream: WRITE32
    [0, addr, value], BLOCKWRITE [1, addr, bytes, data...], MASKWRITE / MASKPOLL [op, addr, value, mask], DDR_PATCH
    [0x81, 24, reg, arg_idx, plus lo, plus hi]; the other ops unchanged."""
    w = words_of(data)
    out, pos = [], 4
    while pos < len(w):
        op = w[pos] & 0xFF
        if op == 0x00:
            out += [0x00, w[pos + 2], w[pos + 4]]
            pos += 6
        elif op == 0x01:
            size = w[pos + 3]
            out += [0x01, w[pos + 2], size - 4, *w[pos + 4:pos + size // 4]]
            pos += size // 4
        elif op in (0x03, 0x04, 0x07):
            out += [op, w[pos + 2], w[pos + 4], w[pos + 5]]
            pos += 7
        elif op == 0x81:
            out += [0x81, 24, w[pos + 6], w[pos + 8], w[pos + 10], w[pos + 11]]
            pos += 12
        elif op >= 0x80:
            out += w[pos:pos + w[pos + 1] // 4]
            pos += w[pos + 1] // 4
        else:
            length = {0x05: 1, 0x06: 1, 0x08: 4, 0x09: 2, 0x0A: 4, 0x0B: 2, 0x0C: 3, 0x0D: 1}[op]
            out += w[pos:pos + length]
            pos += length
    header = [(w[0] & ~0xFFFF) | 0x0001, w[1], w[2], 4 * (4 + len(out))]    # major 1, minor 0
    return struct.pack(f"<{4 + len(out)}I", *header, *out)


@pytest.mark.parametrize("gen", [3, 4])
def test_a_txn_1_0_stream_walks_to_what_its_0_1_encoding_does(gen):
    # docs/runtime.md 1.2: the firmware's side of "1.0 streams are accepted" (they used to be refused).
    current = txn_stream(gen, BUFFERS, extra=SKIPPED)
    old = to_2024(current)
    assert len(old) < len(current) and words_of(old)[0] & 0xFFFF == 0x0001
    walked, expected = txn.walk(old, gen), txn.walk(current, gen)
    assert (walked.header.major, walked.header.minor, walked.header.num_ops) == (1, 0, expected.header.num_ops)
    assert summary(walked) == summary(expected)
    assert walked.registers == expected.registers and walked.skipped == expected.skipped


def test_a_txn_1_0_stream_runs_on_the_device(npu):
    state, src, out = run_stream(npu, to_2024(txn_stream(3, BUFFERS, extra=SKIPPED)))
    assert state == ERT_STATE_COMPLETED
    assert out == src


def test_a_txn_1_0_ddr_patch_of_the_0_1_length_is_refused():
    words = words_of(to_2024(txn_stream(3, BUFFERS)))
    patch = next(i for i in range(4, len(words)) if words[i] == 0x81)
    words[patch + 1] = 48                     # the 0.1 size in a 1.0 stream: the walk would read past the op
    with pytest.raises(txn.TxnError, match=r"DDR_PATCH has 12 words, the encoding has 6|declares a bad size"):
        txn.walk(struct.pack(f"<{len(words)}I", *words), 3)
