"""Instruction streams through the runtime: uploaded as given, checked by header, rewritten in place.

Oracles: the bytes each test writes (the instruction buffer must hold exactly those), aie-rt op
layouts typed in by hand (docs/runtime.md 1.1: MASKPOLL 28 bytes with its size in word 6, custom ops
with theirs in word 1), the shim BD word 0 = transfer length in words that the emulated firmware
honours (docs/design.md 2), and numpy copies of the data.
"""

from __future__ import annotations

import logging
import struct
import threading

import numpy as np
import pytest

from amdxdna_direct import cmd, errors, insts, open_device
from amdxdna_direct.emu import EmuDevice, Passthrough
from amdxdna_direct.xclbin import build_mlir_aie

N = 256                                              # bytes per buffer


def pack(words: list[int]) -> bytes:
    return struct.pack(f"<{len(words)}I", *words)


def unpack(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


# Ops the runtime does not decode, laid out from aie-rt's structs by hand: MASKPOLL (28 bytes, size in word 6),
# READ_REGS / RECORD_TIMER / MERGE_SYNC custom ops (size in word 1), and a WRITE32 with a row byte in its
# op header (a reserved field, kept raw).
EXTRA_OPS = [
    [0x04, 0, 0x1D204, 0, 0x0, 0x0, 28],
    [0x82, 24, 1, 0, 0x1D204, 0],
    [0x83, 12, 9],
    [0x84, 12, 0x00010001],
    [0x00010000, 0, 0x1D1F0, 0, 7, 24],
]


def with_extra_ops(stream: insts.Stream, extra: list[list[int]]) -> bytes:
    """The stream's encoding with ``extra`` ops inserted before its final SYNC; header count and size fixed up."""
    words = insts.encode_words(stream)
    sync_at = insts.layout(stream)[-1]
    body = words[4:sync_at] + [w for op in extra for w in op] + words[sync_at:]
    head = [words[0], words[1], words[2] + len(extra), 4 * (4 + len(body))]
    return pack(head + body)


def bring_up(dev, n_buffers: int = 2):
    ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=n_buffers))
    a, b = dev.bo(N), dev.bo(N)
    data = np.arange(N, dtype=np.uint8)
    a.write(data)
    a.sync()
    return ctx, ctx.kernel(), a, b, data


def test_a_stream_with_maskpoll_and_custom_ops_runs_and_is_uploaded_byte_for_byte(tmp_path, caplog):
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        raw = with_extra_ops(insts.dma_stream(4, [(0, N, "in"), (1, N, "out")]), EXTRA_OPS)
        path = tmp_path / "insts.bin"
        path.write_bytes(raw)
        emu.models.bind(raw, Passthrough())
        ctx, kernel, a, b, data = bring_up(dev)
        creates = dev.stats["CREATE_BO"]
        with caplog.at_level(logging.WARNING, logger="amdxdna_direct"):
            run = kernel.prepare_npu(path, [a, b])
            kernel.prepare_npu(raw, [a, b])                               # same stream: no second warning
        assert dev.stats["CREATE_BO"] == creates + 3                      # instructions once, two packets
        assert run.insts.read() == raw == path.read_bytes()               # the file's bytes, untouched
        assert run.insts.nwords == len(raw) // 4
        assert run.start().wait(10) == cmd.ERT_CMD_STATE_COMPLETED
        b.sync(direction="from_device")
        np.testing.assert_array_equal(b.array(np.uint8), data)
    warnings = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(warnings) == 1
    assert "with 5 op(s) the runtime does not decode: MASKPOLL at word " in warnings[0]
    assert "RECORD_TIMER at word" in warnings[0] and "(12 bytes)" in warnings[0] and "WRITE32 at word" in warnings[0]


def test_a_txn_1_0_stream_is_uploaded_as_given():
    # docs/runtime.md 1.2: the 2024 encoding is accepted like 0.1 (the emulated firmware's side is its own).
    s = insts.dma_stream(3, [(0, N, "in"), (1, N, "out")])
    old = insts.Stream(major=1, minor=0, dev_gen=3, rows=s.rows, cols=s.cols, mem_tile_rows=s.mem_tile_rows,
                       ops=s.ops)
    raw = insts.encode(old)
    assert unpack(raw)[0] & 0xFFFF == 0x0001 and len(raw) < len(insts.encode(s))   # major 1 minor 0, shorter ops
    with open_device("emu:npu1") as dev:
        ctx, kernel, a, b, _ = bring_up(dev)
        assert kernel.prepare_npu(raw, [a, b]).insts.read() == raw


@pytest.mark.parametrize(("profile", "gen", "message"), [
    ("npu4", 3, "word 0: TXN header device generation 3, but npu4 runs generation 4 streams"),
    ("npu1", 4, "word 0: TXN header device generation 4, but npu1 runs generation 3 streams"),
])
def test_a_stream_for_another_generation_is_refused_before_any_ioctl(profile, gen, message):
    raw = insts.encode(insts.dma_stream(gen, [(0, N, "in"), (1, N, "out")]))
    with open_device(f"emu:{profile}") as dev:
        ctx, kernel, a, b, _ = bring_up(dev)
        before = sum(dev.stats[k] for k in ("CREATE_BO", "SYNC_BO", "EXEC_CMD"))
        with pytest.raises(insts.InstsError, match=message):
            kernel.prepare_npu(raw, [a, b])
        assert sum(dev.stats[k] for k in ("CREATE_BO", "SYNC_BO", "EXEC_CMD")) == before


@pytest.mark.parametrize(("change", "message"), [
    (lambda w: w[:-1], r"word 3: header size_bytes \d+ disagrees with the stream length"),
    (lambda w: w[:2] + [w[2] + 1] + w[3:], r"stream ends after \d+ ops, header num_ops says"),
    (lambda w: [w[0] | 0x7] + w[1:], r"word 0: TXN version 7\.1 unknown"),
])
def test_header_errors_are_refused_before_any_ioctl(change, message):
    words = insts.encode_words(insts.dma_stream(3, [(0, N, "in"), (1, N, "out")]))
    with open_device("emu:npu1") as dev:
        ctx, kernel, a, b, _ = bring_up(dev)
        creates = dev.stats["CREATE_BO"]
        with pytest.raises(insts.InstsError, match=message):
            kernel.prepare_npu(pack(change(words)), [a, b])
        assert dev.stats["CREATE_BO"] == creates


# --------------------------------------------------------------------------------------------- set_insts_words


def out_length_word(stream: insts.Stream) -> int:
    """Word index of the output BD's length word: data word 0 of the second BLOCKWRITE (v0.1 header: 4 words)."""
    starts = [start for start, op in zip(insts.layout(stream), stream.ops, strict=True)
              if isinstance(op, insts.BlockWrite)]
    return starts[1] + 4


def test_rewritten_words_are_what_the_next_run_executes():
    stream = insts.dma_stream(4, [(0, N, "in"), (1, N, "out")])
    raw = insts.encode(stream)
    at = out_length_word(stream)
    assert unpack(raw)[at] == N // 4
    patched = unpack(raw)
    patched[at] = N // 8                                             # the output BD moves half the bytes
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        emu.models.bind(raw, Passthrough())
        emu.models.bind(pack(patched), Passthrough())
        ctx, kernel, a, b, data = bring_up(dev)
        run = kernel.prepare_npu(raw, [a, b])
        other = kernel.prepare_npu(raw, [a, b])                       # shares the uploaded stream
        run.start().wait(10)
        b.sync(direction="from_device")
        np.testing.assert_array_equal(b.array(np.uint8), data)
        b.write(np.zeros(N, np.uint8))
        b.sync()
        syncs = dev.stats["SYNC_BO"]
        run.set_insts_words([(at, N // 8)])
        assert dev.stats["SYNC_BO"] == syncs + 1                      # flushed for the device
        assert run.insts.read() == other.insts.read() == pack(patched)
        other.start().wait(10)
        b.sync(direction="from_device")
        np.testing.assert_array_equal(b.array(np.uint8), np.r_[data[:N // 2], np.zeros(N // 2, np.uint8)])
        fresh = kernel.prepare_npu(raw, [a, b])                       # the original bytes: a new upload
        assert fresh.insts is not run.insts and fresh.insts.read() == raw
        assert kernel.prepare_npu(pack(patched), [a, b]).insts is run.insts
        fresh.start().wait(10)
        b.sync(direction="from_device")
        np.testing.assert_array_equal(b.array(np.uint8), data)


def test_set_insts_words_refuses_bad_words_before_writing():
    stream = insts.dma_stream(4, [(0, N, "in"), (1, N, "out")])
    raw = insts.encode(stream)
    nwords = len(raw) // 4
    with open_device("emu:npu4") as dev:
        ctx, kernel, a, b, _ = bring_up(dev)
        run = kernel.prepare_npu(raw, [a, b])
        for words, cls, message in [
            ([(3, 0)], ValueError, r"entry 0: index 3 is outside words 4\.\.\d+ .*words 0-3 are the TXN header"),
            ([(4, 0), (nwords, 0)], ValueError, rf"entry 1: index {nwords} is outside words 4\.\.{nwords - 1}"),
            ([(4, 1 << 32)], ValueError, r"entry 0: value 4294967296 at index 4 is not a u32"),
            ([(4, -1)], ValueError, r"value -1 at index 4 is not a u32"),
            ([(4.0, 1)], TypeError, r"entry 0 must be an \(index, value\) pair of ints"),
            ([(4, True)], TypeError, r"entry 0 must be an \(index, value\) pair of ints"),
            ([4, 1], TypeError, r"entry 0 must be an \(index, value\) pair"),
            ({4: 1}, TypeError, r"words must be a sequence of \(index, value\) pairs, got dict"),
            ([(7, 3)], insts.InstsError, r"word 7: BLOCKWRITE size 3 bytes is not a multiple of 4"),
        ]:
            with pytest.raises(cls, match=message):
                run.set_insts_words(words)
            assert run.insts.read() == raw
        with pytest.raises(RuntimeError, match="was not prepared by prepare_npu"):
            kernel.prepare(3, a, 0, a, b).set_insts_words([(4, 0)])
        run.close()
        with pytest.raises(errors.XdnaError, match="run is closed"):
            run.set_insts_words([(4, 0)])


def test_set_insts_words_waits_for_no_one_in_flight():
    stream = insts.dma_stream(4, [(0, N, "in"), (1, N, "out")])
    raw = insts.encode(stream)
    gate = _Gate()
    with EmuDevice("npu4") as emu, open_device(emu) as dev:
        emu.models.bind(raw, gate)
        ctx, kernel, a, b, _ = bring_up(dev)
        run = kernel.prepare_npu(raw, [a, b])
        other = kernel.prepare_npu(raw, [a, b])
        run.start()
        assert gate.entered.wait(10)
        with pytest.raises(RuntimeError, match=r"1 run\(s\) of this instruction stream are in flight"):
            other.set_insts_words([(out_length_word(stream), 1)])
        gate.release.set()
        run.wait(10)
        other.set_insts_words([(out_length_word(stream), 1)])
        assert unpack(run.insts.read())[out_length_word(stream)] == 1


class _Gate:
    """A model that holds its job until released, then copies like Passthrough."""

    name = "gate"

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, args) -> None:
        self.entered.set()
        self.release.wait(10)
        Passthrough()(args)


# -- buffer reach from every BD word (docs/runtime.md 1.4) -------------------------------------------------


def _conv_stream(dev_gen: int, m: int = 16, k: int = 3072, lda: int = 1536) -> bytes:
    """dma_stream's two buffers, BD 0 rewritten as SAM3's overlapping-row conv A: M rows of K bf16 at row stride
    lda in one BD (length M*K*2 bytes; D0 768 words, D1 2 x 768 words, D2 lda/2 words; hand-encoded fields)."""
    stream = insts.dma_stream(dev_gen, [(0, m * k * 2, "in"), (1, 256, "out")])
    bd0 = stream.ops[0]
    words = list(bd0.words)
    words[3] = 768 << 20 | 0                        # D0 wrap 768, step 1
    words[4] = words[4] & 0xC000_0000 | 2 << 20 | (768 - 1)   # burst kept; D1 wrap 2, step 768
    words[5] = words[5] & 0x0F00_0000 | (lda // 2 - 1)      # AxCache kept; D2 step lda/2 words
    ops = (insts.BlockWrite(addr=bd0.addr, words=tuple(words)),) + stream.ops[1:]
    return insts.encode(insts.Stream(**{**stream.__dict__, "ops": ops}))


@pytest.mark.parametrize("profile, dev_gen", [("npu1", 3), ("npu4", 4)])
def test_the_overlapping_row_conv_view_is_accepted_and_a_short_one_refused(profile, dev_gen):
    m, k, lda = 16, 3072, 1536
    view = ((m - 1) * lda + k) * 2                  # 52224 bytes, where the BD's length says 98304
    stream = _conv_stream(dev_gen, m, k, lda)
    with open_device(f"emu:{profile}") as dev:
        ctx = dev.hw_context(build_mlir_aie(b"pdi", column_width=1, n_buffers=2))
        kernel = ctx.kernel()
        parent = dev.bo(2 * view)
        out = dev.bo(256)
        kernel.prepare_npu(stream, [parent.sub(view // 2 // 4096 * 4096, view), out])       # accepted
        before = {name: dev.stats[name] for name in ("CREATE_BO", "EXEC_CMD")}
        with pytest.raises(ValueError, match=rf"bo0 .* is a {view - 4}-byte buffer, .* its DMA reaches {view} bytes"):
            kernel.prepare_npu(stream, [parent.sub(0, view - 4), out])
        assert {name: dev.stats[name] for name in before} == before     # refused before any ioctl of the run
