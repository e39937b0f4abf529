"""The emulated firmware: execution rules E1-E13, the XRT sequence end to end, chains, TDR, models, TXN walking.

Oracles: numpy reference results for the models, words decoded by hand from the fixture
`mlir-aie-npu1_1col/insts.bin` (header 0x06030100 0x101 9 328; BLOCKWRITE of shim BD1 at 0x1D020 with
length 0x10 words, DDR_PATCH of 0x1D024 from arg 2; BD0 at 0x1D000 with length 0x11 words, DDR_PATCH of
0x1D004 from arg 0; queue pushes at 0x1D204 (S2MM 0, BD 1) and 0x1D214 (MM2S 0, BD 0); a final TCT sync
as op 8), the ERT packet layout of docs/uapi.md 6 and the errnos of docs/driver-rules.md E.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import struct
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from emu_raw import (
    BO_CMD,
    BO_SHMEM,
    ERT_CMD_CHAIN,
    ERT_START_CU,
    ERT_START_NPU,
    ERT_STATE_ABORT,
    ERT_STATE_COMPLETED,
    ERT_STATE_ERROR,
    ERT_STATE_NEW,
    ERT_STATE_TIMEOUT,
    Gate,
    Npu,
    UserMem,
    call,
    chain_packet,
    check_released,
    ert_header,
    packet,
    read_addr,
    regmap,
    run_one,
    state_of,
    txn_stream,
    write_addr,
)
from fixture_files import REPO_FIXTURES
from hypothesis import given
from hypothesis import strategies as st

from amdxdna_direct.emu import EmuDevice, txn
from amdxdna_direct.emu.firmware import MalformedCommand, decode_header, read_packet
from amdxdna_direct.emu.memory import DeviceFault
from amdxdna_direct.emu.models import Elementwise, Gemm, Mha, ModelRegistry, Passthrough, stream_digest

BF16 = ml_dtypes.bfloat16
NPU1_1COL = REPO_FIXTURES / "xdna" / "mlir-aie-npu1_1col"
NPU2_1COL = REPO_FIXTURES / "xdna" / "mlir-aie-npu2_1col"


def fixture(path: Path) -> bytes:
    if not path.exists():
        pytest.skip(f"shared fixtures not present at {path}")
    return path.read_bytes()


# --------------------------------------------------------------------------------------------------
# TXN walker against the hand-decoded fixtures
# --------------------------------------------------------------------------------------------------

def test_txn_walk_npu1_fixture():
    program = txn.walk(fixture(NPU1_1COL / "insts.bin"), dev_gen=3)
    h = program.header
    assert (h.major, h.minor, h.dev_gen, h.num_rows, h.num_cols, h.num_mem_tile_rows) == (0, 1, 3, 6, 1, 1)
    assert (h.num_ops, h.size) == (9, 328)
    assert [(p.op_index, p.reg_addr, p.arg_idx, p.arg_plus, p.length) for p in program.patches] == [
        (1, 0x1D024, 2, 0, 0x10 * 4), (5, 0x1D004, 0, 0, 0x11 * 4)]
    pushes = [(q.op_index, q.direction, q.channel, q.bd) for q in program.pushes]
    assert pushes == [(3, "s2mm", 0, 1), (7, "mm2s", 0, 0)]
    assert [s.op_index for s in program.syncs] == [8] and program.last_sync_index == 8
    assert program.registers[0x1D200] == 0xF00 & 0x1F00   # MASKWRITE of 0xF00 under mask 0x1F00 over 0


def test_txn_walk_npu2_fixture_and_generation_check():
    data = fixture(NPU2_1COL / "insts.bin")
    program = txn.walk(data, dev_gen=4)
    assert (program.header.num_ops, program.header.size) == (8, 300)
    assert [(p.arg_idx, p.length) for p in program.patches] == [(0, 0x80 * 4), (1, 0x1000 * 4)]
    with pytest.raises(txn.TxnError, match="generation 4, this device is generation 3"):
        txn.walk(data, dev_gen=3)


@pytest.mark.parametrize("mutate, message", [
    (lambda w: w.__setitem__(4, 0x7F), "unknown TXN opcode 0x7f"),
    (lambda w: w.__setitem__(4, 0x07), "opcode 0x7 declares 1 bytes"),     # MASKPOLL_BUSY: 7 words, size in the 7th
    (lambda w: w.__setitem__(9, 28), "declares 28 bytes"),
    (lambda w: w.__setitem__(2, 99), "ends after"),
    (lambda w: w.__setitem__(3, 400), "does not fit"),
    (lambda w: w.__setitem__(0, 0x06030002), "TXN version 2.0 is neither 0.1 nor 1.0"),
    (lambda w: w.__setitem__(6, 0x2001D000), "outside the 1-column partition"),
])
def test_txn_walk_rejects_malformed(mutate, message):
    data = txn_stream(3, [(0, 64)])     # words 4-9 WRITE32, 10-21 BLOCKWRITE, 22-33 DDR_PATCH, 34-39, 40-43 sync
    words = list(struct.unpack(f"<{len(data) // 4}I", data))
    mutate(words)
    with pytest.raises(txn.TxnError, match=message):
        txn.walk(struct.pack(f"<{len(words)}I", *words), dev_gen=3)


def test_txn_patch_needs_bd_length_and_bd_register():
    good = txn_stream(3, [(0, 64)])
    words = list(struct.unpack(f"<{len(good) // 4}I", good))
    no_length = words[:]
    no_length[10 + 2] = 0x1D040       # BLOCKWRITE now writes BD 2, the patch still targets BD 0
    with pytest.raises(txn.TxnError, match="before its length was written"):
        txn.walk(struct.pack(f"<{len(words)}I", *no_length), dev_gen=3)
    not_bd = words[:]
    not_bd[10 + 12 + 6] = 0x1D200     # DDR_PATCH of a queue register
    with pytest.raises(txn.TxnError, match="not a shim BD address word"):
        txn.walk(struct.pack(f"<{len(words)}I", *not_bd), dev_gen=3)


# --------------------------------------------------------------------------------------------------
# Models against numpy oracles
# --------------------------------------------------------------------------------------------------

def bf16_bytes(values: np.ndarray) -> np.ndarray:
    """uint8 view of a fresh bf16 copy of `values`."""
    return np.ascontiguousarray(values.astype(BF16)).view(np.uint8).reshape(-1).copy()


def as_f64(raw: np.ndarray, shape) -> np.ndarray:
    return raw.view(BF16).astype(np.float64).reshape(shape)


def close(got: np.ndarray, want: np.ndarray) -> None:
    # bf16 output: 8 bits of mantissa; compare within a few ulps of the result's scale.
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1.6e-2, atol=1.6e-2 * scale)


RNG = np.random.default_rng(7)


def test_gemm_row_major():
    m, k, n = 6, 32, 12
    a = RNG.standard_normal((m, k)).astype(BF16).astype(np.float64)
    b = RNG.standard_normal((k, n)).astype(BF16).astype(np.float64)
    args = {0: bf16_bytes(a), 1: bf16_bytes(b), 2: np.zeros(m * n * 2, np.uint8)}
    Gemm(m, k, n, k)(args)
    close(as_f64(args[2], (m, n)), a @ b)


def test_gemm_lda_rows_and_short_views():
    m, k, n, lda = 4, 8, 3, 5
    flat = RNG.standard_normal((m - 1) * lda + k).astype(BF16).astype(np.float64)
    a = np.stack([flat[i * lda:i * lda + k] for i in range(m)])
    b = RNG.standard_normal((k, n)).astype(BF16).astype(np.float64)
    args = {0: bf16_bytes(flat), 1: bf16_bytes(b), 2: np.zeros(m * n * 2 + 6, np.uint8)}
    Gemm(m, k, n, lda)(args)
    close(as_f64(args[2][:m * n * 2], (m, n)), a @ b)
    assert not args[2][m * n * 2:].any()                      # nothing written past C
    with pytest.raises(DeviceFault, match=r"A \(arg 0\) has 30 bytes, needs 46"):
        Gemm(m, k, n, lda)({0: args[0][:30], 1: args[1], 2: args[2]})
    with pytest.raises(DeviceFault, match=r"C \(arg 2\) is not patched"):
        Gemm(m, k, n, lda)({0: args[0], 1: args[1]})


def test_gemm_rejects_bad_sizes():
    with pytest.raises(ValueError, match="must be a positive int"):
        Gemm(2, 0, 4, 4)


def test_mha_against_softmax_attention():
    heads, seq, d = 2, 40, 8
    q, k, v = (RNG.standard_normal((heads, seq, d)).astype(BF16).astype(np.float64) for _ in range(3))
    args = {0: bf16_bytes(q), 1: bf16_bytes(k), 2: bf16_bytes(v), 3: np.zeros(heads * seq * d * 2, np.uint8)}
    Mha(heads, seq, d)(args)
    s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
    e = np.exp(s - s.max(axis=2, keepdims=True))
    close(as_f64(args[3], (heads, seq, d)), (e / e.sum(axis=2, keepdims=True)) @ v)


@pytest.mark.parametrize("fn", ["gelu", "silu", "copy", "add", "layernorm"])
def test_elementwise_fns(fn):
    elems, n = 48, 16
    x = (RNG.standard_normal(elems) * 2).astype(BF16).astype(np.float64)
    y = RNG.standard_normal(elems).astype(BF16).astype(np.float64)
    want = {
        "gelu": 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
        "silu": x / (1 + np.exp(-x)),
        "copy": x,
        "add": x + y,
        "layernorm": ((x.reshape(-1, n) - x.reshape(-1, n).mean(1, keepdims=True))
                      / np.sqrt(x.reshape(-1, n).var(1, keepdims=True) + 1e-6)).reshape(-1),
    }[fn]
    inputs = [bf16_bytes(x), bf16_bytes(y)] if fn == "add" else [bf16_bytes(x)]
    args = dict(enumerate([*inputs, np.zeros(elems * 2, np.uint8)]))
    Elementwise(fn, elems, n=n if fn == "layernorm" else None)(args)
    close(as_f64(args[len(inputs)], elems), want)


def test_elementwise_in_place_and_errors():
    x = np.linspace(-3, 3, 8).astype(BF16).astype(np.float64)
    buf = bf16_bytes(x)
    Elementwise("silu", 8)({0: buf})
    close(as_f64(buf, 8), x / (1 + np.exp(-x)))
    with pytest.raises(DeviceFault, match="needs 2 patched buffers"):
        Elementwise("add", 8)({0: buf})
    with pytest.raises(DeviceFault, match="has 16 bytes, needs 32"):
        Elementwise("gelu", 16)({0: buf})
    with pytest.raises(ValueError, match="layernorm needs n"):
        Elementwise("layernorm", 8)
    with pytest.raises(ValueError, match="unknown element-wise fn"):
        Elementwise("tanh", 8)


def test_passthrough_copies_lowest_into_highest():
    src, dst = np.arange(68, dtype=np.uint8), np.zeros(64, np.uint8)
    Passthrough()({2: dst, 0: src})
    assert np.array_equal(dst, src[:64])
    with pytest.raises(DeviceFault, match="two patched buffers"):
        Passthrough()({0: src})


def test_registry_binding_rules():
    reg = ModelRegistry()
    stream = b"\x00\x01\x03\x06" * 4
    model = Passthrough()
    digest = reg.bind(stream, model)
    assert digest == hashlib.sha256(stream).hexdigest() == stream_digest(digest.upper())
    assert reg.bind(digest, model) == digest and len(reg) == 1          # same model again: no-op
    assert reg.bind(stream, Passthrough()) == digest                      # an equal built-in model: no-op
    with pytest.raises(ValueError, match=f"{digest} is already bound to model 'passthrough'"):
        reg.bind(stream, Gemm(1, 1, 1, 1))
    with pytest.raises(ValueError, match="already bound"):
        reg.bind(stream, lambda args: None)
    assert reg.lookup(digest) is model and stream in reg
    reg.unbind(digest)
    assert reg.lookup(digest) is None
    with pytest.raises(KeyError, match="no model bound"):
        reg.unbind(stream)
    with pytest.raises(ValueError, match="64 hex digits"):
        reg.bind("abc", model)


# --------------------------------------------------------------------------------------------------
# Driving the emulated device with raw ioctls
# --------------------------------------------------------------------------------------------------


ERT_START_DPU = 18


def words_at(addr: int, count: int, offset: int = 0) -> tuple[int, ...]:
    return struct.unpack(f"<{count}I", read_addr(addr + offset, 4 * count))


@pytest.fixture
def npus():
    made: list[Npu] = []

    def make(*args, **kwargs) -> Npu:
        made.append(Npu(*args, **kwargs))
        return made[-1]

    yield make
    for npu in made:
        npu.close()


def xclbin_pdi(data: bytes) -> bytes:
    """The first PDI image of the AIE_PARTITION section, following the offsets (docs/xrt-sequence.md 3.1-3.8)."""
    count = struct.unpack_from("<I", data, 0x1C0)[0]
    for i in range(count):
        kind, offset = struct.unpack_from("<I20xQ", data, 0x1C8 + 40 * i)
        if kind == 32:
            pdis, pdis_off = struct.unpack_from("<II", data, offset + 0x78)
            size, image_off = struct.unpack_from("<II", data, offset + pdis_off + 0x10)
            return data[offset + image_off:offset + image_off + size]
    raise AssertionError("no AIE_PARTITION section")


def test_xrt_sequence_npu1_passthrough_fixture(npus, caplog):
    """docs/xrt-sequence.md section 0, steps 1-13, with the real npu1_1col xclbin and insts.bin."""
    insts = fixture(NPU1_1COL / "insts.bin")
    pdi = xclbin_pdi(fixture(NPU1_1COL / "aie.xclbin"))
    assert len(pdi) == 2640 and pdi[:8] == bytes.fromhex("DD00000044332211")
    npu = npus("npu1")
    raw = npu.raw
    metadata, _ = raw.get_info(1, 64)                                   # QUERY_AIE_METADATA
    core_rows = struct.unpack_from("<H", metadata, 16)[0]
    ctx, syncobj = raw.create_hwctx(num_tiles=1 * core_rows)
    pdi_bo, pdi_info = raw.dev_bo(len(pdi))
    write_addr(pdi_info.vaddr, pdi)
    raw.sync(pdi_bo, len(pdi))
    raw.config_cu(ctx, [(pdi_bo, 0)])
    npu.dev.models.bind(insts, Passthrough())
    ins_bo, ins_info = raw.dev_bo(len(insts))
    write_addr(ins_info.vaddr, insts)
    call(npu.seam, "SYNC_BO", ins_bo, 0, 0, len(insts))
    src = bytes(range(1, 69))                                             # BD0 reads 0x11 words
    bo_in, in_addr = raw.shmem(4096)
    bo_out, out_addr = raw.shmem(4096)
    write_addr(in_addr, src)
    raw.sync(bo_in, 4096)                                                 # xrt::bo::sync(TO_DEVICE)
    exec_bo, exec_addr = raw.shmem(4096, BO_CMD)
    # Header 0x30010001 as XRT writes it (state NEW, count 16, ERT_START_CU, type 3), CU mask 1, 15-word regmap.
    words = [0x30010001, 1, *regmap(ins_info.xdna_addr, len(insts) // 4, [in_addr, 0, out_addr], nslots=5)]
    assert len(words) == 17
    write_addr(exec_addr, struct.pack("<17I", *words))
    seq = raw.exec_cmd(ctx, exec_bo, [ins_bo, bo_in, bo_out])
    assert seq == 0
    raw.timeline_wait(syncobj, seq)
    assert words_at(exec_addr, 1)[0] == 0x30010004                         # COMPLETED, the rest of the header kept
    raw.sync(bo_out, 4096)                                                # xrt::bo::sync(FROM_DEVICE)
    assert read_addr(out_addr, 64) == src[:64]                              # BD1 writes 0x10 words
    assert read_addr(out_addr + 64, 64) == bytes(64)
    for handle, addr in ((bo_in, in_addr), (bo_out, out_addr), (exec_bo, exec_addr)):
        npu.seam.munmap(addr, 4096)
        raw.gem_close(handle)
    raw.gem_close(ins_bo)
    raw.gem_close(pdi_bo)
    raw.syncobj_destroy(syncobj)
    raw.destroy_hwctx(ctx)
    npu.seam.munmap(npu.heap_va, 64 << 20)
    raw.gem_close(npu.heap)
    npu.seam.close()
    check_released(npu.dev)


def test_rule_E1(npus):
    npu = npus()
    ctx, _ = npu.context()
    job = npu.passthrough()
    args = UserMem(struct.pack("<3I", *job["args"]))
    for ext, ext_flags, kind in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):
        with pytest.raises(OSError) as err:
            call(npu.seam, "EXEC_CMD", ext, ext_flags, ctx, kind, job["cmd"], args.addr, 1, 3, 0)
        assert err.value.errno == errno.EINVAL


def test_rule_E2(npus):
    npu = npus()
    ctx, _ = npu.context()
    job = npu.passthrough()
    args = UserMem(struct.pack("<3I", *job["args"]))
    for cmd_count, arg_count, errno_ in ((1, 4096, errno.EINVAL), (2, 3, errno.EINVAL), (0, 3, errno.EINVAL)):
        with pytest.raises(OSError) as err:
            call(npu.seam, "EXEC_CMD", 0, 0, ctx, 0, job["cmd"], args.addr, cmd_count, arg_count, 0)
        assert err.value.errno == errno_
    with pytest.raises(OSError) as err:
        call(npu.seam, "EXEC_CMD", 0, 0, ctx, 0, job["cmd"], 0, 1, 3, 0)
    assert err.value.errno == errno.EFAULT


def test_rule_E3(npus):
    npu = npus()
    ctx, _ = npu.context()
    job = npu.passthrough()
    big, big_addr = npu.raw.shmem(64 << 10, BO_CMD)
    write_addr(big_addr, packet(ERT_START_CU, job["words"]))
    shmem, shmem_addr = npu.data(4096, packet(ERT_START_CU, job["words"]))
    for handle in (big, shmem, 999):
        with pytest.raises(OSError) as err:
            npu.raw.exec_cmd(ctx, handle, job["args"])
        assert err.value.errno == errno.EINVAL
    # The handle is taken from the low 32 bits of cmd_handles.
    seq = npu.raw.exec_cmd(ctx, job["cmd"] | (7 << 32), job["args"])
    assert seq == 0


def test_rule_E4(npus):
    npu = npus(tdr=0.3)
    ctx, syncobj = npu.context()
    job = npu.passthrough()
    with pytest.raises(OSError) as err:
        npu.raw.exec_cmd(ctx, job["cmd"], [*job["args"], 4242])
    assert err.value.errno == errno.ENOENT
    # A DEV BO passed as an argument stays referenced by the job after its handle is closed.
    extra, _ = npu.raw.dev_bo(4096)
    npu.dev.faults.hang(job["stream"])
    seq = npu.raw.exec_cmd(ctx, job["cmd"], [*job["args"], extra])
    before = npu.dev.counters.live()["bos"]
    npu.raw.gem_close(extra)
    assert npu.dev.counters.live()["bos"] == before
    npu.raw.timeline_wait(syncobj, seq)
    assert state_of(job["cmd_addr"]) == ERT_STATE_TIMEOUT
    assert npu.dev.counters.live()["bos"] == before - 1


def test_rule_E5(npus):
    npu = npus()
    npu.context()
    job = npu.passthrough()
    with pytest.raises(OSError) as err:
        npu.raw.exec_cmd(77, job["cmd"], job["args"])
    assert err.value.errno == errno.EINVAL


def test_rule_E6(npus):
    """At most 4 jobs in flight per context: the fifth EXEC_CMD blocks until one ends."""
    npu = npus()
    ctx, syncobj = npu.context()
    gate = Gate()
    jobs = [npu.passthrough(tag=0, model=gate)] + [npu.passthrough(tag=i) for i in range(1, 5)]
    seqs = [npu.exec(ctx, job) for job in jobs[:4]]
    assert gate.entered.wait(2)
    fifth: list[int] = []
    thread = threading.Thread(target=lambda: fifth.append(npu.exec(ctx, jobs[4])))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not fifth
    # The blocked call holds no driver lock: other ioctls on the device go through at once. It already
    # holds its BOs: closing the fifth job's instruction BO (a DEV BO nothing else keeps) drops the handle only.
    started = time.monotonic()
    npu.raw.gem_close(npu.raw.create_bo(4096, BO_SHMEM))
    npu.raw.get_info(2, 8)
    npu.raw.gem_close(jobs[4]["args"][0])
    assert time.monotonic() - started < 1.0 and thread.is_alive()       # held, they would wait for the gate
    gate.release.set()
    thread.join(2)
    assert fifth == [4] and seqs == [0, 1, 2, 3]
    npu.raw.timeline_wait(syncobj, 4)
    for job in jobs:
        assert state_of(job["cmd_addr"]) == ERT_STATE_COMPLETED
        assert npu.output(job) == job["src"]


def test_rule_E7(npus):
    npu = npus()
    (ctx_a, sync_a), (ctx_b, sync_b) = npu.context(), npu.context()
    job = npu.passthrough()
    seqs_a = [npu.exec(ctx_a, job) for _ in range(3)]
    npu.raw.timeline_wait(sync_a, 2)
    seq_b = npu.exec(ctx_b, job)
    npu.raw.timeline_wait(sync_b, seq_b)
    assert seqs_a == [0, 1, 2] and seq_b == 0
    assert npu.raw.query(sync_a) == 2 and npu.raw.query(sync_b) == 0


def test_exec_cmd_returns_before_the_job_ends(npus):
    """EXEC_CMD only queues the job: the header, the outputs and the timeline change when the worker ends it."""
    npu = npus()
    ctx, syncobj = npu.context()
    first = npu.passthrough(tag=1)
    assert run_one(npu, ctx, syncobj, first) == ERT_STATE_COMPLETED
    gate = Gate()
    job = npu.passthrough(tag=2, model=gate)
    assert npu.exec(ctx, job) == 1
    assert gate.entered.wait(2)
    assert state_of(job["cmd_addr"]) == ERT_STATE_NEW and npu.output(job, 64) == bytes(64)
    assert (npu.raw.query(syncobj), npu.raw.query(syncobj, flags=1)) == (0, 1)     # signalled 0, submitted 1
    with pytest.raises(OSError) as err:
        npu.raw.timeline_wait(syncobj, 1, timeout_s=0.05)
    assert err.value.errno == errno.ETIME
    gate.release.set()
    npu.raw.timeline_wait(syncobj, 1)
    assert state_of(job["cmd_addr"]) == ERT_STATE_COMPLETED and npu.output(job, 64) == job["src"]
    assert npu.raw.query(syncobj) == 1


def test_concurrent_submitters_on_shared_contexts(npus):
    """Four threads, two contexts, one fd: every job completes with its own data and each context's
    seqs are exactly 0..n-1 (no lost update in the driver's tables or the in-flight accounting)."""
    npu = npus()
    contexts = [npu.context(), npu.context()]
    rounds, seqs, failures = 12, {0: [], 1: []}, []
    jobs = [npu.passthrough(tag=t) for t in range(4)]

    def submitter(index: int) -> None:
        ctx, syncobj = contexts[index % 2]
        job = jobs[index]
        try:
            for _ in range(rounds):
                seq = npu.exec(ctx, job)
                seqs[index % 2].append(seq)
                npu.raw.timeline_wait(syncobj, seq)
                if state_of(job["cmd_addr"]) != ERT_STATE_COMPLETED or npu.output(job, 64) != job["src"]:
                    failures.append((index, seq))
        except OSError as exc:
            failures.append((index, exc))

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not failures and not any(thread.is_alive() for thread in threads)
    assert sorted(seqs[0]) == sorted(seqs[1]) == list(range(2 * rounds))


def test_rule_E8(npus):
    npu = npus()
    ctx, syncobj = npu.context()
    job = npu.passthrough()
    bad = [
        packet(ERT_START_CU, job["words"], count=1),             # count does not exceed the one mask word
        packet(ERT_START_CU, job["words"], count=1024),          # 4 * count + 4 > the 4096-byte BO
    ]
    for content in bad:
        write_addr(job["cmd_addr"], content)
        seq = npu.exec(ctx, job)
        npu.raw.timeline_wait(syncobj, seq)                       # the fence still signals
        assert read_addr(job["cmd_addr"], len(content)) == bytes([content[0] & 0xF0 | ERT_STATE_NEW]) + content[1:]
        assert npu.output(job, 64) == bytes(64)
    # Two mask words (extra_cu_masks 1): the first is empty, CU 0 is bit 0 of the second; type bits ignored.
    write_addr(job["cmd_addr"], packet(ERT_START_CU, job["words"], masks=(0, 1), type_bits=3))
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
    assert npu.output(job, 64) == job["src"]


def test_rule_E9(npus):
    npu = npus()
    ctx, syncobj = npu.context(cus=2)
    job = npu.passthrough()
    for masks, want in (((0,), ERT_STATE_NEW), ((0x4,), ERT_STATE_NEW), ((0x6,), ERT_STATE_COMPLETED)):
        write_addr(job["cmd_addr"], packet(ERT_START_CU, job["words"], masks=masks))
        assert run_one(npu, ctx, syncobj, job) == want, masks      # 0x4 = CU 2, only 2 CUs configured


def npu_words(instr: int, nbytes: int, props: list[int], rmap: list[int]) -> list[int]:
    return [instr & 0xFFFFFFFF, instr >> 32, nbytes, len(props), *props, *rmap]


def test_rule_E10(npus):
    npu = npus()
    ctx, syncobj = npu.context()
    job = npu.passthrough()
    instr = job["words"][2] | job["words"][3] << 32
    nbytes = len(job["stream"])
    # Instruction address and size in bytes from the preamble; one property; the regmap carries the buffers.
    write_addr(job["cmd_addr"], packet(ERT_START_NPU, npu_words(instr, nbytes, [0], job["words"])))
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
    assert npu.output(job, 64) == job["src"]
    too_long = npu_words(instr, nbytes, [0] * 12, job["words"])   # 12 + 15 = 27 words > 26
    write_addr(job["cmd_addr"], packet(ERT_START_NPU, too_long))
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_NEW
    write_addr(job["cmd_addr"], packet(ERT_START_DPU, npu_words(instr, nbytes, [], job["words"])))
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_NEW


def chain_of(npu: Npu, n: int, short: bool = False, model=None,
             opcode: int = ERT_START_CU) -> tuple[list[dict], int, int, list[int]]:
    """n passthrough sub-commands (or, with `short`, 5-word regmaps whose stream patches nothing, sent as
    ERT_START_CU or as ERT_START_NPU without properties)."""
    subs = []
    for i in range(n):
        if short:
            stream = txn_stream(npu.gen, [], tag=i)
            npu.dev.models.bind(stream, model)
            ins, iaddr = npu.instr(stream)
            words = regmap(iaddr, len(stream) // 4, [])
            if opcode == ERT_START_NPU:
                words = npu_words(iaddr, len(stream), [], words)
            cmd, cmd_addr = npu.cmd(packet(opcode, words))
            subs.append(dict(cmd=cmd, cmd_addr=cmd_addr, args=[ins]))
        else:
            subs.append(npu.passthrough(tag=i))
    chain, chain_addr = npu.cmd(chain_packet([s["cmd"] for s in subs]))
    args = sorted({h for s in subs for h in (s["cmd"], *s["args"])})
    return subs, chain, chain_addr, args


class Recorder:
    name = "recorder"

    def __init__(self):
        self.calls = 0

    def __call__(self, args):
        assert args == {}
        self.calls += 1


@pytest.mark.parametrize("n", [1, 24])
def test_chain_runs_every_sub_command(npus, n):
    npu = npus()
    ctx, syncobj = npu.context()
    subs, chain, chain_addr, args = chain_of(npu, n)
    seq = npu.raw.exec_cmd(ctx, chain, args)
    npu.raw.timeline_wait(syncobj, seq)
    assert state_of(chain_addr) == ERT_STATE_COMPLETED
    for sub in subs:
        assert npu.output(sub, 64) == sub["src"]


@pytest.mark.parametrize("opcode, fits", [(ERT_START_CU, 146), (ERT_START_NPU, 56)])
def test_chain_slot_budget(npus, opcode, fits):
    """A slot costs its header (CF 8, NPU 52 bytes) + 4 per argument word: five-word regmaps fit the 4 KiB
    command list 146 times as ERT_START_CU (8 + 20), 56 times as ERT_START_NPU (52 + 20); one more does
    not, and the chain is rejected whole (state NEW, no sub-command run; docs/uapi.md 6.5)."""
    npu = npus()
    ctx, syncobj = npu.context()
    recorder = Recorder()
    for n, want in ((fits, ERT_STATE_COMPLETED), (fits + 1, ERT_STATE_NEW)):
        recorder.calls = 0
        subs, chain, chain_addr, args = chain_of(npu, n, short=True, model=recorder, opcode=opcode)
        seq = npu.raw.exec_cmd(ctx, chain, args)
        npu.raw.timeline_wait(syncobj, seq)
        assert (state_of(chain_addr), recorder.calls) == (want, n if want == ERT_STATE_COMPLETED else 0)
        for sub in subs:
            npu.seam.munmap(sub["cmd_addr"], 4096)
            npu.raw.gem_close(sub["cmd"])
            npu.raw.gem_close(sub["args"][0])
        for stream_tag in range(n):
            npu.dev.models.unbind(txn_stream(npu.gen, [], tag=stream_tag))


def test_rule_E11(npus):
    """Chain: failing sub-command index, 0xFF over the first sub-command's payload (the out-of-tree driver's
    fill), same-opcode rule."""
    npu = npus("npu4:xdna-oot")
    ctx, syncobj = npu.context()
    subs, chain, chain_addr, args = chain_of(npu, 24)
    npu.dev.faults.error(subs[7]["stream"])
    first_len = 4 * 16
    seq = npu.raw.exec_cmd(ctx, chain, args)
    npu.raw.timeline_wait(syncobj, seq)
    assert state_of(chain_addr) == ERT_STATE_ERROR
    assert words_at(chain_addr, 3, 4) == (24, 0, 7)                  # command_count, submit_index, error_index
    assert read_addr(subs[0]["cmd_addr"] + 4, first_len) == b"\xff" * first_len
    assert [npu.output(s, 64) == s["src"] for s in subs] == [True] * 7 + [False] * 17
    # A sub-command of another opcode, a handle that is not a CMD BO, an empty chain: rejected, state NEW.
    odd = npu.passthrough(tag=99)
    instr = odd["words"][2] | odd["words"][3] << 32
    write_addr(odd["cmd_addr"], packet(ERT_START_NPU, npu_words(instr, len(odd["stream"]), [], odd["words"])))
    data_bo = subs[1]["args"][1]
    for handles in ([subs[1]["cmd"], odd["cmd"]], [subs[1]["cmd"], data_bo], []):
        write_addr(chain_addr, chain_packet(handles))          # [] -> command_count 0
        seq = npu.raw.exec_cmd(ctx, chain, sorted({*args, odd["cmd"], *odd["args"]}))
        npu.raw.timeline_wait(syncobj, seq)
        assert state_of(chain_addr) == ERT_STATE_NEW, handles


def test_rule_E12(npus, caplog):
    """COMPLETED 4; firmware errors ERROR 5; TDR TIMEOUT 8 and the others ABORT 6; failures 0xFF the payload
    (out of tree; tests/test_driver_profiles.py checks that 6.x/7.0 leave it)."""
    npu = npus("npu4:xdna-oot", tdr=0.2)
    ctx, syncobj = npu.context()
    ok = npu.passthrough(tag=1)
    assert run_one(npu, ctx, syncobj, ok) == ERT_STATE_COMPLETED
    payload_len = 4 * 16

    def expect_error(job, pattern):
        with caplog.at_level(logging.ERROR, logger="amdxdna_direct.emu"):
            caplog.clear()
            assert run_one(npu, ctx, syncobj, job) == ERT_STATE_ERROR
        assert read_addr(job["cmd_addr"] + 4, 4096 - 4) == b"\xff" * (4096 - 4)   # the payload and the rest of the BO
        assert any(pattern in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]

    injected = npu.passthrough(tag=2)
    npu.dev.faults.error(hashlib.sha256(injected["stream"]).hexdigest())
    expect_error(injected, "injected firmware error")
    unbound = npu.passthrough(tag=3)
    npu.dev.models.unbind(unbound["stream"])
    digest = hashlib.sha256(unbound["stream"]).hexdigest()
    expect_error(unbound, f"no model bound to instruction stream sha256 {digest}")
    other_gen = txn_stream(3, [(0, 64), (1, 64)])                      # an npu1 stream on npu4
    npu.dev.models.bind(other_gen, Passthrough())
    wrong = npu.passthrough(tag=4)
    ins, iaddr = npu.instr(other_gen)
    write_addr(wrong["cmd_addr"], packet(ERT_START_CU, regmap(iaddr, len(other_gen) // 4, [0x1000, 0x2000], nslots=5)))
    expect_error(wrong, "generation 3, this device is generation 4")
    # A buffer slot that resolves to no BO is a device fault (a bad DMA).
    fault = npu.passthrough(tag=5)
    words = list(fault["words"])
    words[5:7] = [0x10000, 0]
    write_addr(fault["cmd_addr"], packet(ERT_START_CU, words))
    expect_error(fault, "outside every BO")
    # A model whose buffers are shorter than it needs (or missing) reports what is short: a device fault.
    short_a = npu.passthrough(tag=6, nbytes=128, model=Gemm(8, 16, 2, 16))
    expect_error(short_a, "A (arg 0) has 128 bytes, needs 256")
    expect_error(npu.passthrough(tag=8, nbytes=128, model=Gemm(8, 4, 2, 4)), "C (arg 2) is not patched")
    # Instructions outside the heap window (a SHMEM BO) fail too.
    shm = npu.passthrough(tag=7)
    s_bo, s_addr = npu.data(len(shm["stream"]), shm["stream"])
    write_addr(shm["cmd_addr"], packet(ERT_START_CU, regmap(s_addr, len(shm["stream"]) // 4, [0, 0], nslots=5)))
    expect_error(shm, "not in the heap window")
    hung, queued = npu.passthrough(tag=9), npu.passthrough(tag=10)
    npu.dev.faults.hang(hung["stream"])
    npu.exec(ctx, hung)
    npu.raw.timeline_wait(syncobj, npu.exec(ctx, queued))
    assert (state_of(hung["cmd_addr"]), state_of(queued["cmd_addr"])) == (ERT_STATE_TIMEOUT, ERT_STATE_ABORT)
    assert read_addr(queued["cmd_addr"] + 4, payload_len) == b"\xff" * payload_len


def test_ddr_patch_resolves_slot_plus_arg_plus(npus, caplog):
    """DDR_PATCH(arg_idx=k, arg_plus): regmap slot k + arg_plus over the BD length, inside one BO (docs/design.md 2)."""
    npu = npus()
    ctx, syncobj = npu.context()
    src = bytes(range(256)) * 16
    bo_in, in_addr = npu.data(4096, src)
    bo_out, out_addr = npu.data(4096)

    def run(arg_plus: int, slots: list[int], tag: int) -> int:
        stream = txn_stream(npu.gen, [(0, 64), (1, 64)], tag=tag, arg_plus=arg_plus)
        npu.dev.models.bind(stream, Passthrough())
        ins, iaddr = npu.instr(stream)
        cmd, cmd_addr = npu.cmd(packet(ERT_START_CU, regmap(iaddr, len(stream) // 4, slots)))
        npu.raw.timeline_wait(syncobj, npu.raw.exec_cmd(ctx, cmd, [ins, bo_in, bo_out]))
        return state_of(cmd_addr)

    assert run(96, [in_addr, out_addr], tag=1) == ERT_STATE_COMPLETED
    npu.raw.sync(bo_out, 4096)
    assert read_addr(out_addr, 4096) == bytes(96) + src[96:160] + bytes(4096 - 160)
    with caplog.at_level(logging.ERROR, logger="amdxdna_direct.emu"):
        assert run(0, [in_addr], tag=2) == ERT_STATE_ERROR                  # arg 1 has no regmap slot
        assert run(4096 - 32, [in_addr, out_addr], tag=3) == ERT_STATE_ERROR    # runs 32 bytes past the BO
    messages = [r.getMessage() for r in caplog.records]
    assert any("DDR_PATCH arg_idx 1 has no regmap slot (1 slots)" in m for m in messages), messages
    assert any(f"[{in_addr + 4096 - 32:#x}, {in_addr + 4096 + 32:#x}) runs 32 bytes past the end of SHMEM BO handle "
               f"{bo_in} (0x1000 bytes, the access starts at offset 0xfe0)" in m for m in messages), messages


def test_tdr_timeout_aborts_the_others_and_the_context_recovers(npus):
    npu = npus("npu4:xdna-oot", tdr=0.2)       # the health record in the payload is the out-of-tree driver's
    ctx, syncobj = npu.context()
    hung, queued = npu.passthrough(tag=1), [npu.passthrough(tag=t) for t in (2, 3)]
    npu.dev.faults.hang(hung["stream"])
    seqs = [npu.exec(ctx, job) for job in (hung, *queued)]
    started = time.monotonic()
    npu.raw.timeline_wait(syncobj, seqs[-1])
    assert 0.15 < time.monotonic() - started < 1.5
    payload = read_addr(hung["cmd_addr"] + 4, 4 * 16)
    # Health record: version 1, npu_gen 0 (AIE2), txn_op_idx = the final sync (op 7 of the stream), ctx_pc and
    # fatal fields 0; 0xFF after it.
    assert struct.unpack_from("<8I", payload) == (1, 0, 7, 0, 0, 0, 0, 0)
    assert payload[32:] == b"\xff" * 32
    assert state_of(hung["cmd_addr"]) == ERT_STATE_TIMEOUT
    for job in queued:
        assert state_of(job["cmd_addr"]) == ERT_STATE_ABORT
        assert read_addr(job["cmd_addr"] + 4, 4 * 16) == b"\xff" * 64
    time.sleep(0.1)
    assert npu.output(hung, 64) == bytes(64)                       # the hung model never wrote
    again = npu.passthrough(tag=4)
    assert run_one(npu, ctx, syncobj, again) == ERT_STATE_COMPLETED
    assert npu.output(again, 64) == again["src"]


def test_slow_model_that_progresses_is_not_timed_out(npus):
    npu = npus(tdr=0.1)
    ctx, syncobj = npu.context()

    def busy(args):
        end = time.thread_time() + 0.35                                  # burns CPU for 3.5 TDR periods
        while time.thread_time() < end:
            pass
        Passthrough()(args)

    busy.name = "busy"
    job = npu.passthrough(model=busy)
    assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED


def test_tdr_default_is_two_seconds_and_must_be_positive(npus):
    npu = npus("npu4:xdna-oot", tdr=None)      # the out-of-tree default; 6.x/7.0: tests/test_driver_profiles.py
    ctx, syncobj = npu.context()
    hung = npu.passthrough(tag=1)
    npu.dev.faults.hang(hung["stream"])
    started = time.monotonic()
    npu.raw.timeline_wait(syncobj, npu.exec(ctx, hung), timeout_s=10)
    # staging tdr_timeout_ms = 2000 (docs/uapi.md 6.7)
    assert 1.9 < time.monotonic() - started < 3.5
    assert state_of(hung["cmd_addr"]) == ERT_STATE_TIMEOUT
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="tdr_timeout must be > 0"):
            EmuDevice("npu4", tdr_timeout=bad)


def test_tdr_timeout_may_be_huge_or_infinite_but_must_be_a_number(npus):
    """An infinite TDR never times out; it used to overflow the watch's wait, ending every job ABORT as an
    internal firmware failure."""
    for tdr in (math.inf, 1e300):
        npu = npus(tdr=tdr)
        ctx, syncobj = npu.context()
        job = npu.passthrough()
        assert run_one(npu, ctx, syncobj, job) == ERT_STATE_COMPLETED
        assert npu.output(job) == job["src"]
    for bad in ("2", None, True):
        with pytest.raises(TypeError, match="tdr_timeout must be a number of seconds"):
            EmuDevice("npu4", tdr_timeout=bad)


def test_device_loss(npus):
    npu = npus()
    ctx, syncobj = npu.context()
    gate = Gate()
    job = npu.passthrough(model=gate)
    seqs = [npu.exec(ctx, job) for _ in range(4)]
    assert gate.entered.wait(2)
    blocked: list[BaseException] = []

    def fifth() -> None:
        try:
            npu.exec(ctx, job)
        except OSError as exc:
            blocked.append(exc)

    thread = threading.Thread(target=fifth)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive()
    npu.dev.faults.lose_device()
    thread.join(2)
    assert [exc.errno for exc in blocked] == [errno.ENODEV]             # the blocked submission wakes up
    assert "EXEC_CMD" in str(blocked[0]) and "ENODEV" in str(blocked[0])
    for attempt in (lambda: npu.exec(ctx, job), lambda: npu.raw.create_bo(4096, BO_SHMEM),
                    lambda: npu.raw.timeline_wait(syncobj, seqs[0], timeout_s=0)):
        with pytest.raises(OSError) as err:
            attempt()
        assert err.value.errno == errno.ENODEV
    with pytest.raises(OSError) as err:
        npu.seam.mmap(4096, 1 << 32)
    assert err.value.errno == errno.ENODEV and "ENODEV" in str(err.value)
    gate.release.set()            # Npu.close checks every BO is released: the refused call gave back its references


def test_rule_E13(npus):
    npu = npus(tdr=0.3, wait_cmd=True)
    ctx, syncobj = npu.context()
    job = npu.passthrough()

    def wait_cmd(hwctx, seq, timeout_ms):
        call(npu.seam, "WAIT_CMD", hwctx, timeout_ms, seq)

    for hwctx, seq, want in ((99, 0, errno.EINVAL), (ctx, 0, errno.EINVAL)):
        with pytest.raises(OSError) as err:
            wait_cmd(hwctx, seq, 10)
        assert err.value.errno == want
    npu.dev.faults.hang(job["stream"])
    seq = npu.exec(ctx, job)
    with pytest.raises(OSError) as err:
        wait_cmd(ctx, seq, 20)
    assert err.value.errno == errno.ETIME
    wait_cmd(ctx, seq, 0)                                                # 0 = forever; returns 0 after TDR
    assert state_of(job["cmd_addr"]) == ERT_STATE_TIMEOUT


def test_gemm_through_the_device(npus):
    """A bf16 GEMM stream run by EXEC_CMD: A, B, C patched from three regmap slots."""
    npu = npus()
    ctx, syncobj = npu.context()
    m, k, n = 16, 64, 32
    stream = txn_stream(npu.gen, [(0, m * k * 2), (1, k * n * 2), (2, m * n * 2)])
    npu.dev.models.bind(stream, Gemm(m, k, n, k))
    a = RNG.standard_normal((m, k)).astype(BF16)
    b = RNG.standard_normal((k, n)).astype(BF16)
    ins, iaddr = npu.instr(stream)
    bo_a, a_addr = npu.data(a.nbytes, a.tobytes())
    bo_b, b_addr = npu.data(b.nbytes, b.tobytes())
    bo_c, c_addr = npu.data(m * n * 2)
    cmd, cmd_addr = npu.cmd(packet(ERT_START_CU, regmap(iaddr, len(stream) // 4, [a_addr, b_addr, c_addr], nslots=5)))
    seq = npu.raw.exec_cmd(ctx, cmd, [ins, bo_a, bo_b, bo_c])
    npu.raw.timeline_wait(syncobj, seq)
    assert state_of(cmd_addr) == ERT_STATE_COMPLETED
    npu.raw.sync(bo_c, m * n * 2)
    got = np.frombuffer(read_addr(c_addr, m * n * 2), dtype=BF16).astype(np.float64).reshape(m, n)
    close(got, a.astype(np.float64) @ b.astype(np.float64))


def test_counters_back_at_zero_after_device_close_with_jobs_in_flight():
    npu = Npu(tdr=30.0)
    ctx, _ = npu.context()
    hung, queued = npu.passthrough(tag=1), npu.passthrough(tag=2)
    npu.dev.faults.hang(hung["stream"])
    npu.exec(ctx, hung)
    npu.exec(ctx, queued)
    npu.dev.close()                  # fd close destroys the context: 2 s grace, then both jobs end ABORT
    check_released(npu.dev)
    with pytest.raises(OSError) as err:
        npu.dev.open()
    assert err.value.errno == errno.ENODEV


@given(state=st.integers(0, 15), extra=st.integers(0, 3), count=st.integers(0, 2047), opcode=st.integers(0, 31),
       size=st.integers(4, 9000))
def test_packet_header_fields_and_validity(state, extra, count, opcode, size):
    """docs/uapi.md 6.1: fields at 3:0, 11:10, 22:12, 27:23; valid iff count > mask words and 4*count + 4 <= BO size."""
    header = ert_header(opcode, count, extra_cu_masks=extra, state=state) | 0x3 << 28
    assert decode_header(header) == (state, extra, count, opcode)
    mem = memoryview(bytearray(struct.pack("<I", header) + bytes(size - 4)))
    masks = 0 if opcode == ERT_CMD_CHAIN else 1 + extra
    if count > masks and 4 * count + 4 <= size:
        packet_ = read_packet(mem)
        assert (len(packet_.masks), len(packet_.payload)) == (masks, 4 * (count - masks))
    else:
        with pytest.raises(MalformedCommand):
            read_packet(mem)
