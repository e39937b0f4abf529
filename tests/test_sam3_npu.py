"""sam3.npu.Npu on the emulator: chunked GEMMs in command chains, chained operands, the conv and attention
paths against numpy, the context LRU (cap, driver "no room", drain), fault reporting per chunk."""

from __future__ import annotations

import errno
from contextlib import contextmanager

import numpy as np
import pytest

from amdxdna_direct import cmd, errors
from amdxdna_direct.device import open_device
from amdxdna_direct.emu import DeviceFault, EmuDevice
from amdxdna_direct.emu.models import Gemm, stream_digest
from sam3 import pack, reference
from sam3.build import build
from sam3.bundle import Bundle, BundleError
from sam3.npu import Npu, NpuError

TOL = 1e-2  # bf16 output rounding (2^-9 of a value) plus accumulation order, relative to max|reference|
# Runs per ERT_CMD_CHAIN packet: the driver's 4 KiB command list over slots of 52 + 4 * 15 bytes (the largest
# slot header and the 15-word mlir-aie regmap: spec amdxdna-uapi.md 6.5, xrt-npu-sequence.md 1.7 and 2.2),
# at most the runtime's sub-command cap.
CHAIN_CAPACITY = min(cmd.CHAIN_MAX_RUNS, 4096 // (52 + 4 * 15))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Bundle:
    return Bundle.load(build(tmp_path_factory.mktemp("bundle") / "tiny", "tiny"))


@pytest.fixture()
def npu(tiny):
    with Npu(tiny, "emu") as n:
        yield n


@contextmanager
def _emulated(**options):
    """An emulated NPU4 (for fault injection) and a Device on it, both closed after."""
    emu = EmuDevice("npu4", **options)
    try:
        dev = open_device(emu)
        try:
            yield emu, dev
        finally:
            dev.close()
    finally:
        emu.close()


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def _weights(npu: Npu, key: str, seed: int = 0):
    """Test-owned weights: a float matrix (the oracle's) and its packed upload (the device's)."""
    g = npu.spec(key)
    w = pack.round_bf16(np.random.default_rng(seed).standard_normal((g.k, g.n), dtype=np.float32) / np.sqrt(g.k))
    bo = npu.weight_slot(key)
    npu.push(pack.pack_b(w, g.b_layout), bo)
    return w, bo


def test_gemm_stage_chunks_in_one_chain(npu):
    w, wbo = _weights(npu, "blk0.qkv")
    x = pack.round_bf16(np.random.default_rng(1).standard_normal((250, 64), dtype=np.float32))
    io = npu.io("blk0.qkv", 250)
    assert io.rows == 256 and len(io.chunks) == 8  # padded to m = 32
    npu.prepare(io, wbo)
    with npu.stage("qkv", "gemm", 250, len(io.chunks)) as st:
        io.set_a(x)
        npu.run_synced(io, wbo)
    got = pack.from_bf16(io.get_c(250))
    assert _rel(got, x @ w) < TOL
    assert (st.exec_cmds, st.waits, st.bytes_in) == (1, 1, 250 * 64 * 2)


def test_more_chunks_than_a_chain_holds(npu):
    w, wbo = _weights(npu, "blk0.proj")
    rows = (CHAIN_CAPACITY + 6) * 32  # m = 32
    x = pack.round_bf16(np.random.default_rng(2).standard_normal((rows, 64), dtype=np.float32))
    io = npu.io("blk0.proj", rows)
    io.set_a(x)
    with npu.stage("proj", "gemm", io.rows, len(io.chunks)) as st:
        npu.run(io, wbo)
    # Two ERT_CMD_CHAIN packets (a full one and 6 runs), one wait.
    assert (len(io.chunks), st.exec_cmds, st.waits) == (CHAIN_CAPACITY + 6, 2, 1)
    assert _rel(pack.from_bf16(io.get_c(io.rows)), x @ w) < TOL


def test_packets_built_once_per_operand_set(npu):
    _, wbo = _weights(npu, "blk0.qkv")
    _, other = _weights(npu, "blk0.qkv", seed=5)
    io = npu.io("blk0.qkv", 64)
    io.set_a(np.ones((64, 64), np.float32))
    npu.run(io, wbo)
    stats = npu.device.stats
    before = stats["CREATE_BO"]
    npu.run(io, wbo)
    assert stats["CREATE_BO"] == before  # the same operands reuse their packets
    npu.run(io, other)
    assert stats["CREATE_BO"] > before  # new weights: new packets (kept alongside)
    before = stats["CREATE_BO"]
    npu.run(io, wbo)
    npu.run(io, other)
    assert stats["CREATE_BO"] == before
    m = npu.mha_io("blk0.attn", batch=2)
    act = npu.device.bo(npu.ops["blk0.gelu"].elems * 2)
    npu.run_mha(m)
    npu.run_args("blk0.gelu", [act])
    before = stats["CREATE_BO"]
    npu.run_mha(m)
    npu.run_args("blk0.gelu", [act])
    assert stats["CREATE_BO"] == before
    npu.run_args("blk0.gelu", [npu.device.bo(npu.ops["blk0.gelu"].elems * 2)])
    assert stats["CREATE_BO"] == before + 2  # the new buffer and the packet of a new operand set


def test_chained_fc2_moves_nothing_through_the_host(npu):
    w1, w1bo = _weights(npu, "blk0.fc1")
    w2, w2bo = _weights(npu, "blk0.fc2")
    x = pack.round_bf16(np.random.default_rng(3).standard_normal((256, 64), dtype=np.float32))
    fc1 = npu.io("blk0.fc1", 256)
    fc2 = npu.io_chained("blk0.fc2", fc1)
    assert fc2.chained
    fc1.set_a(x)
    npu.run_synced(fc1, w1bo)
    npu.run_args("blk0.gelu", [fc1.c])
    npu.prepare(fc2, w2bo)
    stats = npu.device.stats
    syncs = stats["SYNC_BO"]
    with npu.stage("fc2", "gemm", 256, len(fc2.chunks)) as st:
        npu.run_synced(fc2, w2bo)
    assert st.bytes_in == 0 and st.bytes_out == 0
    assert stats["SYNC_BO"] == syncs  # the chained A (fc1's device-written C) was not synced over
    hidden = reference.gelu(pack.round_bf16(x @ w1))
    assert _rel(pack.from_bf16(fc2.get_c(256)), pack.round_bf16(hidden) @ w2) < TOL
    with pytest.raises(NpuError, match=r"blk0\.fc2: A is blk0\.fc1's C \(chained\)"):
        fc2.set_a(x)


def test_conv_io_plus_tap_sum_equals_direct_conv(npu):
    geom = npu.conv_geometry("neck.conv16")
    rng = np.random.default_rng(4)
    x = pack.round_bf16(rng.standard_normal((16, 16, geom.d), dtype=np.float32))
    weight = pack.round_bf16(rng.standard_normal((geom.cout, geom.d, 3, 3), dtype=np.float32) / 10)
    wbo = npu.upload(pack.pack_conv3x3(weight, geom.p))
    io = npu.conv_io("neck.conv16", 16, 16)
    assert io.rows == 80 and len(io.chunks) == 5  # ceil(16*18/4) = 72 -> 80 (m = 16)
    io.set_a(pack.conv_input(x, geom, io.rows))
    npu.run_synced(io, wbo)
    out = pack.conv_output(io.get_c(io.rows), geom, 16, 16)
    assert _rel(out, reference.conv3x3(x, weight)) < TOL


def test_windowed_attention_batch(npu):
    spec = npu.mhas["blk0.attn"]
    rng = np.random.default_rng(6)
    q, k, v = (pack.round_bf16(rng.standard_normal((4, spec.heads, spec.seq, spec.d), dtype=np.float32))
               for _ in range(3))
    m = npu.mha_io("blk0.attn", batch=4)
    m.set_qkv(q, k, v)
    with npu.stage("attn", "mha", 0, 4) as st:
        npu.run_mha(m)
    assert (st.exec_cmds, st.waits) == (1, 1)
    assert _rel(pack.from_bf16(m.get_o()), reference.attention(q, k, v)) < TOL


def test_models_bound_from_manifest(npu, tiny):
    registry = npu.device.emulator.models
    qkv = tiny.gemms["blk0.qkv"]
    bound = registry.lookup(stream_digest(qkv.insts.read_bytes()))
    assert repr(bound) == repr(Gemm(qkv.m, qkv.k, qkv.n, qkv.lda, qkv.b_layout))
    assert all(registry.lookup(stream_digest(tiny.kernel(k).insts.read_bytes())) is not None for k in tiny.keys())


def test_lru_with_context_cap(tiny):
    with Npu(tiny, "emu", max_contexts=2) as npu:
        # Sorted keys: blk0.attn (mha), blk0.fc1 / blk0.fc2 (mlp_gemm), then blk0.gelu would be a third.
        assert npu.resident == ["xclbin/mha.xclbin", "xclbin/mlp_gemm.xclbin"]
        assert (npu.loads, npu.evictions) == (2, 0)
        _, wbo = _weights(npu, "blk0.qkv")
        io = npu.io("blk0.qkv", 32)
        npu.run_synced(io, wbo)
        assert npu.resident == ["xclbin/mlp_gemm.xclbin", "xclbin/attn_gemm.xclbin"]
        npu.run_mha(npu.mha_io("blk0.attn"))
        assert npu.resident == ["xclbin/attn_gemm.xclbin", "xclbin/mha.xclbin"]
        assert (npu.loads, npu.evictions) == (4, 2)
        assert npu.device.emulator.counters.live()["hwctx"] == 2
        npu.run_synced(io, wbo)  # attn_gemm still resident: its packets are reused, nothing loads
        assert (npu.loads, npu.evictions) == (4, 2)


def test_env_cap_and_drain(tiny, monkeypatch):
    monkeypatch.setenv("SAM3_MAX_CONTEXTS", "2")
    with Npu(tiny, "emu", evict="drain") as npu:
        assert npu.loads == 2
        npu.run_args("blk0.gelu", [npu.device.bo(tiny.ops["blk0.gelu"].elems * 2)])
        assert npu.resident == ["xclbin/ew.xclbin"]  # drained both before loading
        assert npu.evictions == 2
    monkeypatch.setenv("SAM3_MAX_CONTEXTS", "lots")
    with pytest.raises(ValueError, match="SAM3_MAX_CONTEXTS='lots'"):
        Npu(tiny, "emu")


def test_no_room_is_the_drivers_answer(tiny):
    with _emulated() as (emu, dev):
        emu.faults.cap_contexts(3)  # firmware context limit: CREATE_HWCTX refuses the 4th
        with Npu(tiny, dev) as npu:
            # Sorted keys: blk0.attn (mha), blk0.fc1, blk0.fc2 (mlp_gemm), blk0.gelu (ew), then blk0.proj's
            # attn_gemm is refused and open stops there.
            assert npu.resident == ["xclbin/mha.xclbin", "xclbin/mlp_gemm.xclbin", "xclbin/ew.xclbin"]
            npu.run_mha(npu.mha_io("glb.attn"))  # not loaded at open, but its context is resident
            assert (npu.loads, npu.evictions) == (3, 0)
            _, wbo = _weights(npu, "blk0.qkv")
            npu.run_synced(npu.io("blk0.qkv", 32), wbo)  # attn_gemm refused again: evicts the LRU (mlp_gemm)
            assert npu.resident == ["xclbin/ew.xclbin", "xclbin/mha.xclbin", "xclbin/attn_gemm.xclbin"]
            assert (npu.loads, npu.evictions) == (4, 1)


def test_open_when_device_refuses_first_context(tiny):
    with _emulated() as (emu, dev):
        emu.faults.fail_next_create_hwctx(errno.ENODEV)
        with Npu(tiny, dev) as npu:
            assert npu.loads == 0  # "no room" at open: everything loads on first use
            npu.run_mha(npu.mha_io("blk0.attn"))
            assert npu.resident == ["xclbin/mha.xclbin"]


class _FailOnCall:
    """Wraps a model; raises a device fault on its `n`-th call (0-based)."""

    def __init__(self, inner, n):
        self.inner, self.n, self.calls = inner, n, 0
        self.name = f"failing {inner.name}"

    def __call__(self, args):
        self.calls += 1
        if self.calls - 1 == self.n:
            raise DeviceFault("injected fault")
        self.inner(args)


def test_kernel_failing_mid_stage_names_key_and_chunk(npu, tiny):
    registry = npu.device.emulator.models
    stream = tiny.gemms["blk0.fc1"].insts.read_bytes()
    inner = registry.lookup(stream_digest(stream))
    registry.unbind(stream)
    registry.bind(stream, _FailOnCall(inner, 2))
    _, wbo = _weights(npu, "blk0.fc1")
    io = npu.io("blk0.fc1", 256)
    with pytest.raises(NpuError, match=r"blk0\.fc1: chunk 2 of 8 failed") as e:
        npu.run_synced(io, wbo)
    assert (e.value.key, e.value.chunk) == ("blk0.fc1", 2)
    assert isinstance(e.value.__cause__, errors.CommandError) and e.value.__cause__.index == 2
    npu.device.emulator.models.unbind(stream)
    npu.device.emulator.models.bind(stream, inner)
    npu.run_synced(io, wbo)  # the same packets run again after the failure (rebuilt by the runtime)


def test_firmware_error_on_a_single_run(npu, tiny):
    npu.device.emulator.faults.error(tiny.ops["blk0.gelu"].insts.read_bytes())
    with pytest.raises(NpuError, match=r"blk0\.gelu: chunk 0 of 1 failed.*ERROR") as e:
        npu.run_args("blk0.gelu", [npu.device.bo(tiny.ops["blk0.gelu"].elems * 2)])
    assert (e.value.key, e.value.chunk) == ("blk0.gelu", 0)
    assert isinstance(e.value.__cause__, errors.CommandError)


def test_wrong_generation_names_both(tiny):
    with pytest.raises(BundleError, match=r"targets npu4 \(AIE2P\) but the device is npu1 \(AIE2\)"):
        Npu(tiny, "emu:npu1")


def test_argument_errors(npu):
    with pytest.raises(NpuError, match="neck.conv16: overlapping A"):
        npu.io("neck.conv16", 32)
    with pytest.raises(NpuError, match="blk0.qkv: b_layout kn is not a 3x3 convolution"):
        npu.conv_io("blk0.qkv", 4, 4)
    with pytest.raises(NpuError, match=r"blk0\.proj: A width 192 \(C of blk0\.qkv\) != K 64"):
        npu.io_chained("blk0.proj", npu.io("blk0.qkv", 32))
    with pytest.raises(NpuError, match="no GEMM 'nope'"):
        npu.io("nope", 1)
    with pytest.raises(NpuError, match="no kernel 'nope'"):
        npu.run_args("nope", [])
    with pytest.raises(ValueError, match="evict must be one of"):
        Npu(npu.bundle, npu.device, evict="fifo")


def test_hung_stage_reports_timeout_with_key(tiny):
    with _emulated(tdr_timeout=0.2) as (emu, dev), Npu(tiny, dev) as npu:
        emu.faults.hang(tiny.gemms["blk0.fc1"].insts.read_bytes())
        with pytest.raises(NpuError, match=r"blk0\.fc1: chunk 0 of 8 failed.*TIMEOUT") as e:
            npu.run_synced(npu.io("blk0.fc1", 256), npu.weight_slot("blk0.fc1"))
        assert isinstance(e.value.__cause__, errors.CommandTimeout)


def test_chunk_views_follow_the_spec(npu):
    """Chunk i of a plain GEMM views m*k elements of A from i*m*k; of a conv, (m-1)*lda + k from i*m*lda;
    a chained A is the source's C; C rows come m at a time (spec 2-4, the seed's io / conv_io / io_chained)."""
    def extents(bo, base):
        return [(v.address - base.address, v.size) for v in bo]

    q = npu.spec("blk0.qkv")  # m 32, k 64, n 192
    io = npu.io("blk0.qkv", 70)
    assert io.rows == 96 and io.a.size == 96 * 64 * 2 and io.c.size == 96 * 192 * 2
    assert extents([a for a, _ in io.chunks], io.a) == [(i * 32 * 64 * 2, 32 * 64 * 2) for i in range(3)]
    assert extents([c for _, c in io.chunks], io.c) == [(i * 32 * 192 * 2, 32 * 192 * 2) for i in range(3)]
    assert q.m == 32
    fc1 = npu.io("blk0.fc1", 64)  # n = 160 = fc2's k
    fc2 = npu.io_chained("blk0.fc2", fc1)
    assert (fc2.a.address, fc2.a.size, fc2.rows) == (fc1.c.address, fc1.c.size, 64)
    assert extents([a for a, _ in fc2.chunks], fc1.c) == [(i * 32 * 160 * 2, 32 * 160 * 2) for i in range(2)]
    # neck.conv16: D 32, P 4, m 16, K = 6*32 = 192, lda = 128; a 16x16 map: ceil(16*18/4) = 72 -> 80 rows.
    conv = npu.conv_io("neck.conv16", 16, 16)
    assert (conv.rows, conv.a.size) == (80, (80 * 4 + 2) * 32 * 2)
    views = extents([a for a, _ in conv.chunks], conv.a)
    assert views == [(i * 16 * 128 * 2, (15 * 128 + 192) * 2) for i in range(5)]
    assert views[-1][0] + views[-1][1] <= conv.a.size  # the last view stays inside Y
    m = npu.mha_io("blk0.attn", batch=3)  # 4 heads x 64 x 16
    assert [(it[0].address - m.q.address, it[3].size) for it in m.items] == [(i * 4096 * 2, 4096 * 2) for i in range(3)]


def test_operand_errors(npu, monkeypatch):
    io = npu.io("blk0.qkv", 40)
    with pytest.raises(ValueError, match=r"blk0\.qkv: get_c\(65\) outside C's 64 rows"):
        io.get_c(65)
    with pytest.raises(ValueError, match=r"blk0\.qkv: get_c\(-1\)"):
        io.get_c(-1)
    with pytest.raises(ValueError, match=r"blk0\.qkv: set_a of 4160 elements, A holds 4096"):
        io.set_a(np.zeros((65, 64), np.float32))
    with pytest.raises(TypeError, match="expected bf16 bits"):
        io.set_a(np.zeros((4, 64), np.int32))
    with pytest.raises(ValueError, match=r"blk0\.qkv: rows must be positive, got 0"):
        npu.io("blk0.qkv", 0)
    with pytest.raises(ValueError, match=r"neck\.conv16: map size 0x4 must be positive"):
        npu.conv_io("neck.conv16", 0, 4)
    with pytest.raises(ValueError, match=r"blk0\.attn: batch must be positive, got 0"):
        npu.mha_io("blk0.attn", batch=0)
    m = npu.mha_io("blk0.attn")
    good = np.zeros(m.spec.elems, np.float32)
    with pytest.raises(ValueError, match=r"blk0\.attn: k has 3 elements, 4096 expected"):
        m.set_qkv(good, good[:3], good)
    with pytest.raises(NpuError, match=r"neck\.conv16: overlapping A \(lda 128 != k 192\) cannot read"):
        npu.io_chained("neck.conv16", io)
    with pytest.raises(NpuError, match="no MHA 'nope'"):
        npu.mha_io("nope")
    closed = npu.device.bo(64)
    closed.close()
    with pytest.raises(NpuError, match=r"blk0\.gelu: preparing commands failed: .*buffer is closed") as e:
        npu.run_args("blk0.gelu", [closed])
    assert isinstance(e.value.__cause__, ValueError) and e.value.key == "blk0.gelu"
    with pytest.raises(ValueError, match="upload: no data"):
        npu.upload(b"")
    for bad in (0, -2, True, "2"):
        with pytest.raises(ValueError, match=f"max_contexts={bad!r}: expected a positive integer"):
            Npu(npu.bundle, npu.device, max_contexts=bad)
    monkeypatch.setenv("SAM3_MAX_CONTEXTS", "0")
    with pytest.raises(ValueError, match="SAM3_MAX_CONTEXTS=0: expected a positive integer"):
        Npu(npu.bundle, npu.device)


def test_no_context_at_all_names_the_key_and_the_drivers_answer(tiny):
    with _emulated() as (emu, dev):
        emu.faults.cap_contexts(0)  # every CREATE_HWCTX refused (EINVAL from the firmware limit)
        with Npu(tiny, dev) as npu:
            assert (npu.loads, npu.resident) == (0, [])
            with pytest.raises(NpuError, match=r"blk0\.qkv: no hardware context available \(0 resident\)") as e:
                npu.run_synced(npu.io("blk0.qkv", 32), npu.weight_slot("blk0.qkv"))
            assert e.value.key == "blk0.qkv"
            assert isinstance(e.value.__cause__, errors.ContextUnavailableError)
            assert e.value.__cause__.errno == errno.EINVAL and "CREATE_HWCTX" in str(e.value)
            assert npu.evictions == 0


def test_other_create_failures_are_not_no_room(tiny):
    with _emulated() as (emu, dev):
        emu.faults.fail_next_create_hwctx(errno.ENOMEM)
        with pytest.raises(NpuError, match=r"loading blk0\.attn: CREATE_HWCTX.*ENOMEM") as e:
            Npu(tiny, dev)  # blk0.attn is the first key in sorted order
        assert e.value.key == "blk0.attn" and e.value.__cause__.errno == errno.ENOMEM
        assert emu.counters.live()["hwctx"] == 0


def test_evictions_release_command_packets(tiny):
    """With one resident context, alternating two kernels evicts on every use: command packets (Run and
    chain BOs) are rebuilt on the new context and the old ones released, so live BOs do not grow."""
    with Npu(tiny, "emu", max_contexts=1) as npu:
        counters = npu.device.emulator.counters
        _, wbo = _weights(npu, "blk0.qkv")
        io = npu.io("blk0.qkv", 256)  # 8 chunks: a RunList
        act = npu.device.bo(tiny.ops["blk0.gelu"].elems * 2)
        live = []
        for _ in range(3):
            npu.run(io, wbo)
            npu.run_args("blk0.gelu", [act])
            live.append(counters.live()["bos"])
        assert counters.live()["hwctx"] == 1 and npu.resident == ["xclbin/ew.xclbin"]
        assert live[0] == live[1] == live[2]
        assert (npu.loads, npu.evictions) == (7, 6)  # open preloaded mha; each of the 6 uses evicts one
