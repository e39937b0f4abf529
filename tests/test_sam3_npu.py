"""sam3.npu.Npu on the emulator: chunked GEMMs (chained and chunk by chunk), A read in place, conv views, both
attention layouts, the context LRU under a cap and under the driver's "no room", patch_insts surviving an
eviction, failures named by key and chunk. Oracles: numpy over weights the tests make (or decode)."""

from __future__ import annotations

import errno
import math
from contextlib import contextmanager

import numpy as np
import pytest

from amdxdna_direct import cmd, errors
from amdxdna_direct.device import open_device
from amdxdna_direct.emu import DeviceFault, EmuDevice
from amdxdna_direct.emu.models import stream_digest
from sam3 import kernels, pack
from sam3.build import build
from sam3.bundle import Bundle
from sam3.npu import Npu, NpuError

# Runs per ERT_CMD_CHAIN packet: the driver's 4 KiB command list over slots of 52 + 4 * 15 bytes (the largest slot
# header and the 15-word mlir-aie regmap), at most the runtime's sub-command cap (docs/design.md 4).
CHAIN_CAPACITY = min(cmd.CHAIN_MAX_RUNS, 4096 // (52 + 4 * 15))


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Bundle:
    bundle = Bundle.open(build(tmp_path_factory.mktemp("b") / "host", "tiny", variant="host"))
    yield bundle
    bundle.close()


@pytest.fixture()
def npu(host):
    with Npu(host, "emu:npu4") as n:
        yield n


@contextmanager
def emulated(**options):
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


def rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_weights(npu: Npu, key: str, seed: int = 0, bias: bool | None = None):
    """Test-owned weights for GEMM `key`: the float B (and bias) the oracle uses, and their packed upload."""
    g = npu.spec(key)
    rng = np.random.default_rng(seed)
    b = (rng.standard_normal((g.k, g.n)) / np.sqrt(g.k)).astype(np.float32)
    bias_row = rng.standard_normal(g.n).astype(np.float32) if g.bias else None
    packed = pack.pack_b(b, bias_row, g.tile_k, g.tile_n, g.ct_k)
    b, bias_row = pack.unpack_b(packed, g.k, g.n, g.tile_k, g.tile_n, g.ct_k, g.bias)  # the values the device sees
    return b, bias_row, npu.upload(packed)


test_weights.__test__ = False  # a helper, not a test


def oracle(a, b, bias, mode):
    y = pack.round_bf16(a) @ b
    if bias is not None:
        y = y + bias
    return kernels.apply_epilogue(y, mode)


def mode_of(bundle, key):
    return kernels.epilogue_mode(bundle.insts_bytes(key))


def counted(npu, body):
    before = dict(npu.device.stats)
    body()
    return {k: npu.device.stats[k] - before.get(k, 0) for k in ("EXEC_CMD", "SYNCOBJ_TIMELINE_WAIT", "bytes_in")}


@pytest.mark.parametrize("chains", [True, False])
def test_gemm_over_chunks_equals_numpy(host, chains):
    with Npu(host, "emu:npu4", chains=chains) as npu:
        g = npu.spec("v_qkv")
        rows = 3 * g.m + 5  # not a multiple of m: the last chunk is partly padding
        b, bias, w = test_weights(npu, "v_qkv")
        a = np.random.default_rng(1).standard_normal((rows, g.k)).astype(np.float32)
        io = npu.io("v_qkv", rows)
        assert io.rows == 4 * g.m and len(io.chunks) == 4
        io.set_a(a)
        delta = counted(npu, lambda: npu.run(io, w))
        got = pack.from_bf16(io.get_c(rows))
    assert rel(got, oracle(a, b, bias, mode_of(host, "v_qkv"))) < 1e-2
    if chains:  # one chain packet per CHAIN_CAPACITY runs, one wait for the stage
        assert delta["EXEC_CMD"] == math.ceil(4 / CHAIN_CAPACITY) and delta["SYNCOBJ_TIMELINE_WAIT"] == 1
    else:  # the reference's dispatch: every chunk submitted and waited for
        assert delta["EXEC_CMD"] == 4 and delta["SYNCOBJ_TIMELINE_WAIT"] == 4


def test_env_turns_chains_off_and_refuses_nonsense(host, monkeypatch):
    monkeypatch.setenv("SAM3_CHAINS", "0")
    with Npu(host, "emu:npu4") as npu:
        assert npu.chains is False
    monkeypatch.setenv("SAM3_CHAINS", "yes")
    with pytest.raises(ValueError, match="SAM3_CHAINS='yes': expected 0"):
        Npu(host, "emu:npu4")


def test_chained_fc2_reads_fc1_in_place(npu, host):
    b1, bias1, w1 = test_weights(npu, "v_fc1", 2)
    b2, bias2, w2 = test_weights(npu, "v_fc2", 3)
    g = npu.spec("v_fc1")
    a = np.random.default_rng(4).standard_normal((2 * g.m, g.k)).astype(np.float32)
    fc1 = npu.io("v_fc1", 2 * g.m)
    fc2 = npu.io_chained("v_fc2", fc1)
    fc1.set_a(a)
    npu.run(fc1, w1)
    npu.prepare(fc2, w2)  # instructions and packets uploaded ahead: the run itself moves only data
    delta = counted(npu, lambda: npu.run_synced(fc2, w2))  # chained: no sync, nothing pushed
    assert delta["bytes_in"] == 0
    hidden = pack.round_bf16(oracle(a, b1, bias1, mode_of(host, "v_fc1")))
    want = oracle(hidden, b2, bias2, mode_of(host, "v_fc2"))
    assert rel(pack.from_bf16(fc2.get_c(2 * g.m)), want) < 2e-2
    with pytest.raises(NpuError, match="v_fc2: A is v_fc1's C"):
        fc2.set_a(a)


def test_packets_are_built_once_per_operand_set(npu):
    _, _, w = test_weights(npu, "v_o")
    io = npu.io("v_o", npu.spec("v_o").m * 2)
    npu.run_synced(io, w)
    cmd_bos = npu.device.stats["CREATE_BO"]
    npu.run_synced(io, w)
    npu.run_synced(io, w)
    assert npu.device.stats["CREATE_BO"] == cmd_bos  # reused: nothing allocated per dispatch


def direct_conv(x, w):
    """3x3 convolution, zero padding 1: x [H, W, C], w [OC, C, 3, 3] -> [H, W, OC] (numpy, tap by tap)."""
    h, wd, _ = x.shape
    padded = np.pad(x, ((1, 1), (1, 1), (0, 0)))
    out = np.zeros((h, wd, w.shape[0]), np.float32)
    for dy in range(3):
        for dx in range(3):
            out += padded[dy:dy + h, dx:dx + wd] @ w[:, :, dy, dx].T
    return out


@pytest.mark.parametrize("side", [3, 8])
def test_conv_io_equals_a_direct_convolution(npu, side):
    g = npu.spec("conv")
    geom = pack.ConvGeometry.of(g.k, g.lda, g.n)
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((geom.oc, geom.c, 3, 3)) / np.sqrt(9 * geom.c)).astype(np.float32)
    w = pack.round_bf16(w)
    x = pack.round_bf16(rng.standard_normal((side, side, geom.c)).astype(np.float32))
    io = npu.conv_io("conv", side, side)
    io.set_a(pack.conv_input(x, geom, io.rows))
    npu.run(io, npu.upload(pack.pack_b(pack.conv_weights(w, geom.p), None, g.tile_k, g.tile_n, g.ct_k)))
    got = pack.conv_output(io.get_c(io.rows), geom, side, side)
    assert rel(got, direct_conv(x, w)) < 2e-2


def attention_oracle(q, k, v):
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("key", ["mha_win", "mha_glob"])
def test_attention_layouts(npu, key):
    s = npu.mhas[key]
    rng = np.random.default_rng(6)
    q, k, v = (pack.round_bf16(rng.standard_normal((s.heads, s.seq, s.d)).astype(np.float32)) for _ in range(3))
    m = npu.mha_io(key)

    def layout(x):  # [heads, seq, d] or token-major [seq, heads * d]
        return x.transpose(1, 0, 2).reshape(s.seq, -1) if s.token_major else x

    m.set_qkv(layout(q), layout(k), layout(v))
    npu.run_mha(m)
    got = pack.from_bf16(m.get_o(s.heads * s.seq * s.d))
    got = got.reshape(s.seq, s.heads, s.d).transpose(1, 0, 2) if s.token_major else got.reshape(q.shape)
    assert rel(got, attention_oracle(q, k, v)) < 2e-2


def contexts(bundle, *keys):
    return [bundle.kernel(k).ctx for k in keys]


def test_lru_under_a_cap_of_two(host):
    keys = host.kernel_keys()
    order = list(dict.fromkeys(host.kernel(k).ctx for k in keys))  # contexts in sorted-key load order
    with Npu(host, "emu:npu4", max_contexts=2) as npu:
        assert npu.resident == order[:2] and (npu.loads, npu.evictions) == (2, 0)
        first = next(k for k in keys if host.kernel(k).ctx == order[0] and k in host.gemms and k != "conv")
        third = next(k for k in keys if host.kernel(k).ctx == order[2] and k in host.gemms)
        npu.run_synced(npu.io(first, 1), test_weights(npu, first)[2])  # order[0] becomes most recently used
        assert npu.resident == [order[1], order[0]]
        npu.run_synced(npu.io(third, 1), test_weights(npu, third)[2])  # evicts order[1], never its own
        assert npu.resident == [order[0], order[2]] and (npu.loads, npu.evictions) == (3, 1)
        assert npu.device.emulator.counters.live()["hwctx"] == 2


@pytest.mark.parametrize("cap", [0, -1, "2", 1.5, True])
def test_a_cap_below_one_or_not_an_integer_is_refused(host, cap):
    with pytest.raises(ValueError, match="expected a positive integer"):
        Npu(host, "emu:npu4", max_contexts=cap)


@pytest.mark.parametrize("text", ["0", "two", "²"])
def test_env_cap_is_checked(host, monkeypatch, text):
    monkeypatch.setenv("SAM3_MAX_CONTEXTS", text)
    with pytest.raises(ValueError, match="SAM3_MAX_CONTEXTS"):
        Npu(host, "emu:npu4")


def test_no_room_is_the_drivers_answer(host):
    order = list(dict.fromkeys(host.kernel(k).ctx for k in host.kernel_keys()))
    with emulated() as (emu, dev):
        emu.faults.cap_contexts(3)  # the firmware refuses a 4th context: open stops loading there
        with Npu(host, dev) as npu:
            assert npu.resident == order[:3] and npu.evictions == 0
            late = next(k for k in host.kernel_keys() if host.kernel(k).ctx == order[3] and k in host.gemms)
            npu.run_synced(npu.io(late, 1), test_weights(npu, late)[2])  # refused again: evicts the LRU
            assert npu.resident == [*order[1:3], order[3]] and (npu.loads, npu.evictions) == (4, 1)


def test_open_when_the_device_refuses_the_first_context(host):
    with emulated() as (emu, dev):
        emu.faults.fail_next_create_hwctx(errno.ENODEV)
        with Npu(host, dev) as npu:
            assert npu.loads == 0  # "no room" at open: everything loads on first use
            npu.run_mha(npu.mha_io("mha_glob"))
            assert npu.resident == [host.kernel("mha_glob").ctx]


def gelu_off(words: np.ndarray) -> list[tuple[int, int]]:
    """taconite's patch: for each of the stream's core blocks whose mode op writes RTP + 8, mode 5 -> 0."""
    return [(20 + 24 * i, 0) for i in range(kernels.CORES)
            if 21 + 24 * i < len(words) and words[18 + 24 * i] & 0xFFF == 0x408 and words[20 + 24 * i] == 5]


def test_patch_insts_is_reapplied_after_an_eviction(host):
    with Npu(host, "emu:npu4", max_contexts=1) as npu:
        assert mode_of(host, "v_fc1") == kernels.EPILOGUE_GELU_TANH
        b, bias, w = test_weights(npu, "v_fc1", 7)
        a = np.random.default_rng(8).standard_normal((4, npu.spec("v_fc1").k)).astype(np.float32)
        io = npu.io("v_fc1", 4)
        io.set_a(a)
        npu.run(io, w)
        with_gelu = pack.from_bf16(io.get_c(4))
        patch = gelu_off(npu.insts("v_fc1"))
        assert len(patch) == kernels.CORES
        npu.patch_insts("v_fc1", patch)
        npu.run(io, w)
        plain = pack.from_bf16(io.get_c(4))
        assert rel(plain, oracle(a, b, bias, kernels.EPILOGUE_NONE)) < 1e-2
        assert rel(with_gelu, oracle(a, b, bias, kernels.EPILOGUE_GELU_TANH)) < 1e-2
        evictions = npu.evictions
        npu.run_mha(npu.mha_io("mha_glob"))  # cap 1: v_fc1's context goes
        assert npu.evictions == evictions + 1
        npu.run(io, w)  # reloaded: the recorded words are applied again
        assert np.array_equal(pack.from_bf16(io.get_c(4)), plain)
        assert npu.insts("v_fc1").tobytes() == host.insts_bytes("v_fc1")  # the bundle's stream is untouched


def test_patch_insts_refusals(npu):
    words = len(npu.insts("v_o"))
    with pytest.raises(ValueError, match=f"v_o: word index {words} outside the stream's {words} words"):
        npu.patch_insts("v_o", [(words, 0)])
    with pytest.raises(ValueError, match="is not a u32"):
        npu.patch_insts("v_o", [(0, 1 << 32)])
    with pytest.raises(TypeError, match=r"\(word index, value\) pairs"):
        npu.patch_insts("v_o", [5])
    with pytest.raises(NpuError, match="no kernel 'nope'"):
        npu.patch_insts("nope", [])
    with pytest.raises(NpuError, match="no kernel 'nope'"):
        npu.insts("nope")


class FailOnCall:
    """Wraps a model; raises a device fault on its `n`-th call (0-based)."""

    def __init__(self, inner, n):
        self.inner, self.n, self.calls = inner, n, 0
        self.name = f"failing {inner.name}"

    def __call__(self, args):
        self.calls += 1
        if self.calls - 1 == self.n:
            raise DeviceFault("injected fault")
        self.inner(args)


@pytest.mark.parametrize("chains", [True, False])
def test_a_chunk_failing_mid_stage_names_key_and_chunk(host, chains):
    with Npu(host, "emu:npu4", chains=chains) as npu:
        registry = npu.device.emulator.models
        stream = host.insts_bytes("v_fc1")
        inner = registry.lookup(stream_digest(stream))
        registry.unbind(stream)
        registry.bind(stream, FailOnCall(inner, 2))
        w = test_weights(npu, "v_fc1")[2]
        io = npu.io("v_fc1", 4 * npu.spec("v_fc1").m)
        with pytest.raises(NpuError, match=r"v_fc1: chunk 2 of 4 failed") as e:
            npu.run_synced(io, w)
        assert (e.value.key, e.value.chunk) == ("v_fc1", 2)
        assert isinstance(e.value.__cause__, errors.CommandError)
        registry.unbind(stream)
        registry.bind(stream, inner)
        npu.run_synced(io, w)  # the same operand set runs again after the failure


def test_a_hung_stage_times_out_naming_the_key(host):
    with emulated(tdr_timeout=0.2) as (emu, dev), Npu(host, dev) as npu:
        emu.faults.hang(host.insts_bytes("v_o"))
        with pytest.raises(NpuError, match=r"v_o: chunk 0 of 1 failed.*TIMEOUT") as e:
            npu.run_synced(npu.io("v_o", 1), test_weights(npu, "v_o")[2])
        assert isinstance(e.value.__cause__, errors.CommandTimeout)


def test_operand_errors(npu):
    with pytest.raises(NpuError, match=r"conv: overlapping A \(lda 192 < K 384\), use conv_io"):
        npu.io("conv", 16)
    with pytest.raises(NpuError, match="v_qkv: lda 64 >= K 64 is not an overlapping-row convolution"):
        npu.conv_io("v_qkv", 4, 4)
    with pytest.raises(NpuError, match=r"v_o: A width 192 \(C of v_qkv\) != K 64"):
        npu.io_chained("v_o", npu.io("v_qkv", 16))
    with pytest.raises(NpuError, match="no GEMM 'nope'"):
        npu.io("nope", 1)
    with pytest.raises(NpuError, match="no MHA 'v_o'"):
        npu.mha_io("v_o")
    with pytest.raises(ValueError, match="v_o: rows must be positive"):
        npu.io("v_o", 0)
    with pytest.raises(TypeError, match="v_o: rows must be an integer"):
        npu.io("v_o", 2.0)
    short = npu.device.bo(npu.spec("v_o").b_bytes - 64)
    with pytest.raises(ValueError, match=r"v_o: weights of \d+ bytes, the kernel reads b_bytes=5184"):
        npu.run(npu.io("v_o", 1), short)
    with pytest.raises(ValueError, match="v_o: run_args takes 3 buffer"):
        npu.run_args("v_o", [short])
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        Npu(npu.bundle, npu.device, timeout=-1)


def test_closed_npu_refuses_and_releases_everything(host):
    emu = EmuDevice("npu4")
    try:
        dev = open_device(emu)
        npu = Npu(host, dev)
        npu.run_synced(npu.io("v_o", 1), npu.weights("v.0.o"))
        npu.close()
        npu.close()  # idempotent
        with pytest.raises(NpuError, match="the Npu is closed"):
            npu.io("v_o", 1)
        assert emu.counters.live()["hwctx"] == 0
        dev.close()
        assert emu.counters.live() == {"bos": 0, "hwctx": 0, "syncobjs": 0, "mappings": 0}
    finally:
        emu.close()


def test_weights_are_uploaded_once(npu):
    first = npu.weights("v.0.qkv")
    assert npu.weights("v.0.qkv") is first
    assert first.size == len(npu.bundle.tensors.raw("v.0.qkv"))


@pytest.mark.parametrize("skipped", ["weights", "A", "C"])
def test_each_sync_of_a_stage_is_needed(npu, caplog, skipped):
    """The emulator's memory is not coherent (docs/emulator.md): leave out any one of a GEMM stage's syncs and
    the stage fails (an input the device never saw) or reads stale data (an output never synced back)."""
    g = npu.spec("v_o")
    b, bias, _ = test_weights(npu, "v_o", 9)
    a = np.random.default_rng(10).standard_normal((g.m, g.k)).astype(np.float32)
    packed = pack.pack_b(b, bias, g.tile_k, g.tile_n, g.ct_k)
    w = npu.device.bo(packed.nbytes)
    w.array(np.uint8)[:] = packed
    if skipped != "weights":
        w.sync()
    io = npu.io("v_o", g.m)
    io.a.array(np.uint16)[:a.size] = pack.to_bf16(a).ravel()
    if skipped != "A":
        io.a.sync()
    if skipped in ("weights", "A"):
        with pytest.raises(NpuError, match="v_o: chunk 0 of 1 failed"):
            npu.run(io, w)
        assert "written by the CPU after the last sync" in caplog.text
        return
    npu.run(io, w)
    stale = pack.from_bf16(io.c.array(np.uint16, g.m * g.n).copy())
    assert not stale.any()  # the device's result has not reached the CPU's pages
    assert rel(pack.from_bf16(io.get_c(g.m)), oracle(a, b, bias, mode_of(npu.bundle, "v_o"))) < 1e-2


def test_an_unbounded_timeout_reaches_the_wait_as_forever(host, monkeypatch):
    """`Npu(timeout=math.inf)` waits without bound: the runtime reads None as its 10 s default, so math.inf (its
    FOREVER) must be what reaches the wait."""
    from amdxdna_direct import FOREVER
    from amdxdna_direct.kernel import Run

    seen = []
    real = Run.wait

    def spy(self, timeout=None):
        seen.append(timeout)
        return real(self, timeout)

    monkeypatch.setattr(Run, "wait", spy)
    with Npu(host, "emu:npu4", timeout=math.inf) as npu:
        npu.run_mha(npu.mha_io("mha_glob"))
    assert seen and all(t == FOREVER for t in seen)
