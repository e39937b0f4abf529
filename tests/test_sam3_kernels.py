"""sam3.kernels: the emulator models of the IRON kernels against independent numpy computations, the streams
generated bundles carry (decoded, walked, the epilogue patch rule), the decoded-B cache, binding a bundle's keys,
and a GEMM run end to end on the emulator."""

from __future__ import annotations

import math
import struct
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from amdxdna_direct import Xclbin, errors, insts, open_device, xclbin
from amdxdna_direct.emu import DeviceFault, ModelRegistry
from amdxdna_direct.emu import txn as emu_txn
from amdxdna_direct.emu.models import stream_digest
from sam3 import kernels, pack
from sam3.kernels import (
    EPILOGUE_GELU_TANH,
    EPILOGUE_NONE,
    EPILOGUE_RELU,
    AddLn,
    BCache,
    FlmGemm,
    IronMha,
    Rope,
    StreamError,
)

BF16 = ml_dtypes.bfloat16
DEV_GEN = 4                        # NPU4 (the emulator profile of the end-to-end test)
# bf16 keeps 8 significant bits: one unit in the last place is 2^-7 relative; rounding order differences in f32
# may move a result across one rounding boundary.
BF16_RTOL = 2.0 ** -7


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(BF16)


def _u8(array: np.ndarray) -> np.ndarray:
    """A writable uint8 view of a contiguous copy (what the firmware hands a model)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _exact_b(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    """B whose every 8-block along K holds a value in [1, 2) * 2^s: bfp16ebs8 stores it without rounding
    (shared exponent 127 + s, mantissas q = value * 2^(6 - s), docs/sam3-packing.md)."""
    q = rng.integers(-127, 128, (k, n))
    q[::8] = rng.choice([-1, 1], (k // 8, n)) * rng.integers(64, 128, (k // 8, n))
    scale = 2.0 ** (rng.integers(-3, 3, n) - 6)
    return (q * scale).astype(np.float32)


def _geom(m: int, k: int, n: int, lda: int, b_bytes: int) -> SimpleNamespace:
    return SimpleNamespace(m=m, k=k, n=n, lda=lda, b_bytes=b_bytes)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, rtol=2 * BF16_RTOL, atol=1e-3)


# ------------------------------------------------------------------------------------------------- FlmGemm


def _gemm_case(rng, m, k, n, lda, tiles, bias):
    tile_k, tile_n, ct_k = tiles
    b = _exact_b(rng, k, n)
    vec = rng.standard_normal(n).astype(BF16).astype(np.float32) if bias else None
    packed = pack.pack_b(b, vec, tile_k, tile_n, ct_k)
    a_buf = _bf16(rng, ((m - 1) * lda + k,))
    rows = a_buf.astype(np.float64)[np.arange(m)[:, None] * lda + np.arange(k)[None, :]]
    want = rows @ b.astype(np.float64) + (0.0 if vec is None else vec)
    return a_buf, packed, want


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


ACTS = {EPILOGUE_NONE: lambda x: x, EPILOGUE_RELU: lambda x: np.maximum(x, 0.0), EPILOGUE_GELU_TANH: _gelu_tanh}


@pytest.mark.parametrize("mode", sorted(ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_equals_numpy_with_each_epilogue(mode, bias):
    rng = np.random.default_rng(mode * 2 + bias)
    m, k, n, tiles = 8, 64, 32, (32, 16, 16)
    a_buf, packed, want = _gemm_case(rng, m, k, n, k, tiles, bias)
    model = FlmGemm(m, k, n, k, *tiles, bias, mode, cache=BCache())
    c = np.zeros((m, n), BF16)
    model({0: _u8(a_buf), 1: packed, 2: c.reshape(-1).view(np.uint8)})
    _close(c, ACTS[mode](want))
    assert model.b_bytes == packed.nbytes == 9 * n * (k + 16 * bias) // 8
    if mode == EPILOGUE_RELU:
        assert (c.astype(np.float32) >= 0).all() and (want < 0).any()


def test_apply_epilogue():
    x = np.linspace(-4, 4, 33).astype(np.float32)
    for mode, act in ACTS.items():
        got = kernels.apply_epilogue(x, mode)
        assert got.dtype == np.float32 and got is not x
        np.testing.assert_allclose(got, act(x.astype(np.float64)), rtol=1e-6, atol=1e-6)
    assert x[0] == -4.0
    with pytest.raises(ValueError, match="epilogue mode 7 unknown"):
        kernels.apply_epilogue(x, 7)


def test_gemm_overlapping_rows_conv_form():
    """lda < k: row i of A is elements i*lda .. i*lda + k of the buffer (the 3x3 convolution, P = 2)."""
    rng = np.random.default_rng(7)
    d, p, oc, m = 24, 2, 8, 6
    k, lda, n = (p + 2) * d, p * d, p * oc
    a_buf, packed, want = _gemm_case(rng, m, k, n, lda, (k, n, 8), True)
    model = FlmGemm(m, k, n, lda, k, n, 8, True, EPILOGUE_NONE, cache=BCache())
    assert model.a_bytes == a_buf.nbytes == ((m - 1) * lda + k) * 2
    c = np.zeros((m, n), BF16)
    model({0: _u8(a_buf), 1: packed, 2: c.reshape(-1).view(np.uint8)})
    _close(c, want)


def test_gemm_rounds_to_bf16_nearest_even():
    # A = one row of ones, B = one column: C is the column sum, exact in f32, then rounded to bf16.
    k, n = 8, 8
    b = np.zeros((k, n), np.float32)
    b[0, 0], b[1, 0] = 1.0, 2.0 ** -8          # 1 + 2^-8: a tie between 1 and 1 + 2^-7 -> 1 (even)
    b[0, 1], b[1, 1] = 1.0, 3 * 2.0 ** -8      # 1 + 3*2^-8: a tie -> 1 + 2^-6 (even mantissa)
    model = FlmGemm(1, k, n, k, k, n, 8, False, EPILOGUE_NONE, cache=BCache())
    c = np.zeros(n, BF16)
    model({0: _u8(np.ones(k, BF16)), 1: pack.pack_b(b, None, k, n, 8), 2: c.view(np.uint8)})
    assert c[0] == 1.0 and c[1] == 1.0 + 2.0 ** -6


def test_gemm_faults_name_the_argument():
    model = FlmGemm(4, 16, 8, 16, 16, 8, 8, True, EPILOGUE_NONE, cache=BCache())
    a, b, c = np.zeros(model.a_bytes, np.uint8), np.zeros(model.b_bytes, np.uint8), np.zeros(model.c_bytes, np.uint8)
    with pytest.raises(DeviceFault, match=rf"B \(arg 1\) needs {model.b_bytes} bytes, got {model.b_bytes - 4}"):
        model({0: a, 1: b[:-4], 2: c})
    with pytest.raises(DeviceFault, match=r"A \(arg 0\) needs 128 bytes, got 126"):
        model({0: a[:-2], 1: b, 2: c})
    with pytest.raises(DeviceFault, match=r"C \(arg 2\) is not patched into the stream \(args \[0, 1\]\)"):
        model({0: a, 1: b})
    b[2 * 8] = 1                                # bias chunk padding: bytes of another tiling
    with pytest.raises(DeviceFault, match=r"B \(arg 1\) does not decode: .*nonzero padding"):
        model({0: a, 1: b, 2: c})


def test_gemm_refuses_bad_geometry():
    with pytest.raises(ValueError, match="epilogue mode 3 unknown"):
        FlmGemm(4, 16, 8, 16, 16, 8, 8, False, 3)
    with pytest.raises(pack.PackError, match="tile_k=16 is not a multiple of ct_k=24"):
        FlmGemm(4, 16, 8, 16, 16, 8, 24, False, 0)
    with pytest.raises(ValueError, match="lda must be a positive int, got 0"):
        FlmGemm(4, 16, 8, 0, 16, 8, 8, False, 0)


def test_b_is_decoded_once_per_buffer_content():
    rng = np.random.default_rng(3)
    m, k, n = 4, 32, 16
    a_buf, packed, want = _gemm_case(rng, m, k, n, k, (k, n, 8), False)
    model = FlmGemm(m, k, n, k, k, n, 8, False, EPILOGUE_NONE, cache=BCache())
    c = np.zeros((m, n), BF16)
    args = {0: _u8(a_buf), 1: packed, 2: c.reshape(-1).view(np.uint8)}
    for _ in range(5):
        model(args)
    assert model.decodes == 1
    _close(c, want)
    # Rewrite the buffer in place (same address and length): a mantissa byte of the first block of B[0..7, 0].
    packed[1] ^= 0x01
    model(args)
    assert model.decodes == 2
    b_new, _ = pack.unpack_b(packed, k, n, k, n, 8, False)
    _close(c, a_buf.astype(np.float64).reshape(m, k) @ b_new)
    model(args)
    assert model.decodes == 2


def test_b_cache_is_bounded():
    rng = np.random.default_rng(4)
    k, n = 32, 16
    bufs = [pack.pack_b(_exact_b(rng, k, n), None, k, n, 8) for _ in range(2)]
    cache = BCache(budget=k * n * 4)            # room for one decoded B
    model = FlmGemm(1, k, n, k, k, n, 8, False, EPILOGUE_NONE, cache=cache)
    for packed in bufs * 2:
        model.weights(packed)
    assert model.decodes == 4 and len(cache) == 1 and cache.nbytes == k * n * 4
    model.weights(bufs[1])
    assert model.decodes == 4
    with pytest.raises(ValueError, match="budget must be a non-negative int"):
        BCache(-1)


# ------------------------------------------------------------------------------------------------- MHA


def _softmax_attention(q, k, v, mask=None):
    """float64 attention over [..., seq, d] with an optional boolean [seq, seq] mask of allowed keys."""
    s = np.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("...qk,...kd->...qd", s / s.sum(axis=-1, keepdims=True), v)


def test_mha_heads_seq_d_layout():
    rng = np.random.default_rng(10)
    heads, seq, d = 3, 20, 16
    q, k, v = (_bf16(rng, (heads, seq, d)) for _ in range(3))
    o = np.zeros((heads, seq, d), BF16)
    IronMha(heads, seq, d)({0: _u8(q), 1: _u8(k), 2: _u8(v), 3: o.reshape(-1).view(np.uint8)})
    _close(o, _softmax_attention(*(x.astype(np.float64) for x in (q, k, v))))


def test_mha_token_major_layout():
    rng = np.random.default_rng(11)
    heads, seq, d = 2, 24, 8
    q, k, v = (_bf16(rng, (seq, heads * d)) for _ in range(3))
    o = np.zeros((seq, heads * d), BF16)
    IronMha(heads, seq, d, token_major=True)({0: _u8(q), 1: _u8(k), 2: _u8(v), 3: o.reshape(-1).view(np.uint8)})
    for h in range(heads):                      # the oracle takes each head's columns by hand
        cols = slice(h * d, (h + 1) * d)
        want = _softmax_attention(*(x[:, cols].astype(np.float64) for x in (q, k, v)))
        _close(o[:, cols], want)


def test_mha_windowed_host_form_is_the_heads_layout():
    """[n_windows*heads, window^2, d]: row r holds token (wh // heads)*window^2 + si, head wh % heads, with
    wh = r // window^2 and si = r % window^2; attention stays inside each window."""
    rng = np.random.default_rng(12)
    heads, win2, windows, d = 2, 9, 4, 8
    t = windows * win2
    tok = {name: _bf16(rng, (t, heads * d)) for name in "qkv"}
    r = np.arange(windows * heads * win2)
    wh, si = r // win2, r % win2
    token, head = (wh // heads) * win2 + si, wh % heads
    cols = head[:, None] * d + np.arange(d)[None, :]
    bufs = {name: x[token[:, None], cols] for name, x in tok.items()}
    o = np.zeros((windows * heads * win2, d), BF16)
    IronMha(windows * heads, win2, d)({0: _u8(bufs["q"]), 1: _u8(bufs["k"]), 2: _u8(bufs["v"]),
                                       3: o.reshape(-1).view(np.uint8)})
    same_window = (np.arange(t)[:, None] // win2) == (np.arange(t)[None, :] // win2)
    for h in range(heads):
        hc = slice(h * d, (h + 1) * d)
        want = _softmax_attention(*(x[:, hc].astype(np.float64) for x in tok.values()), mask=same_window)
        _close(o[head == h], want[token[head == h]])


@pytest.mark.parametrize("windowed", [True, False])
def test_mha_strided_device_form(windowed):
    """[rope_out, rope_out, v_qkv C, v_o A]: q at column 0 and k at column D of rope_out, v at column 2D of
    the qkv output (padded rows past T), o token-major; windows of window^2 tokens in window order."""
    rng = np.random.default_rng(13 + windowed)
    heads, d, win2, windows = 2, 8, 9, 4
    dim, t = heads * d, win2 * windows
    rope_out = _bf16(rng, (t, 2 * dim))
    qkv = _bf16(rng, (t + 5, 3 * dim))                          # rows = round_up(T, M) > T
    o = np.full((t + 5, dim), 7.0, BF16)                        # v_o's A has padded rows too
    model = (IronMha(windows * heads, win2, d, False, "strided", dim=dim) if windowed
             else IronMha(heads, t, d, True, "strided", dim=dim))
    assert model.tokens == t
    model({0: _u8(rope_out), 1: _u8(rope_out), 2: _u8(qkv), 3: o.reshape(-1).view(np.uint8)})
    tokens = np.arange(t)
    mask = (tokens[:, None] // win2) == (tokens[None, :] // win2) if windowed else None
    for h in range(heads):
        q = rope_out[:, h * d:(h + 1) * d].astype(np.float64)
        k = rope_out[:, dim + h * d:dim + (h + 1) * d].astype(np.float64)
        v = qkv[:t, 2 * dim + h * d:2 * dim + (h + 1) * d].astype(np.float64)
        _close(o[:t, h * d:(h + 1) * d], _softmax_attention(q, k, v, mask))
    assert (o[t:].astype(np.float32) == 7.0).all()


def test_mha_faults_and_geometry():
    model = IronMha(2, 4, 8, False, "strided", dim=16)
    need = model.needs()
    assert need == [4 * 32 * 2] * 2 + [4 * 48 * 2, 4 * 16 * 2]
    args = {i: np.zeros(n, np.uint8) for i, n in enumerate(need)}
    args[2] = args[2][:-2]
    with pytest.raises(DeviceFault, match=rf"v \(arg 2\) needs {need[2]} bytes, got {need[2] - 2}"):
        model(args)
    with pytest.raises(ValueError, match="dim=24 must be a multiple of d=16"):
        IronMha(2, 4, 16, False, "strided", dim=24)
    with pytest.raises(ValueError, match="form 'windowed' unknown"):
        IronMha(2, 4, 16, False, "windowed")
    with pytest.raises(ValueError, match="dim is for the strided form only"):
        IronMha(2, 4, 16, dim=32)


def test_mha_blocks_the_queries(monkeypatch):
    """A score budget smaller than one group's matrix still gives the unblocked result."""
    rng = np.random.default_rng(15)
    q, k, v = (_bf16(rng, (2, 33, 8)) for _ in range(3))
    outs = []
    for budget in (1 << 24, 2 * 33 * 5):
        monkeypatch.setattr(kernels, "_SCORE_ELEMS", budget)
        o = np.zeros((2, 33, 8), BF16)
        IronMha(2, 33, 8)({0: _u8(q), 1: _u8(k), 2: _u8(v), 3: o.reshape(-1).view(np.uint8)})
        outs.append(o)
    np.testing.assert_array_equal(outs[0], outs[1])


# ------------------------------------------------------------------------------------------------- rope


def test_rope_rotates_q_and_k_per_head():
    rng = np.random.default_rng(20)
    t, heads, d = 12, 2, 8
    dim, half = heads * d, d // 2
    qkv = _bf16(rng, (t + 4, 3 * dim))
    angle = rng.uniform(-3, 3, (t, half))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    out = np.zeros((t, 2 * dim), BF16)
    Rope(t, dim, heads)({0: _u8(qkv), 1: np.frombuffer(kernels.rope_table(cos, sin), np.uint8).copy(),
                         2: out.reshape(-1).view(np.uint8)})
    x = qkv[:t].astype(np.float64)
    want = np.zeros((t, 2 * dim))
    for base in (0, dim):                        # q, then k
        for h in range(heads):
            j = np.arange(half)
            i1, i2 = base + h * d + j, base + h * d + half + j
            want[:, i1] = x[:, i1] * cos - x[:, i2] * sin
            want[:, i2] = x[:, i2] * cos + x[:, i1] * sin
    _close(out, want)


def test_rope_table_layout_and_inverse():
    cos = np.arange(6, dtype=np.float32).reshape(3, 2)
    sin = -cos - 0.5
    table = kernels.rope_table(cos, sin)
    assert len(table) == 48 and struct.unpack("<12f", table) == tuple(cos.ravel()) + tuple(sin.ravel())
    c, s = kernels.split_rope_table(table, 3, 2)
    np.testing.assert_array_equal(c, cos)
    np.testing.assert_array_equal(s, sin)
    with pytest.raises(ValueError, match="rope table of 48 bytes, 4 tokens x half 2 need 64"):
        kernels.split_rope_table(table, 4, 2)
    with pytest.raises(ValueError, match="cos has 6 values and sin 4"):
        kernels.rope_table(cos, sin[:2])


def test_rope_faults_and_geometry():
    model = Rope(4, 16, 2)
    args = {0: np.zeros(4 * 48 * 2, np.uint8), 1: np.zeros(4 * 4 * 8 - 4, np.uint8), 2: np.zeros(4 * 32 * 2, np.uint8)}
    with pytest.raises(DeviceFault, match=r"table \(arg 1\) needs 128 bytes, got 124"):
        model(args)
    for dim, heads in ((18, 2), (16, 3)):
        with pytest.raises(ValueError, match=f"dim={dim} / heads={heads} must be an even integer head width"):
            Rope(4, dim, heads)


# ------------------------------------------------------------------------------------------------- addln


@pytest.mark.parametrize("res_f32", [True, False])
def test_addln(res_f32):
    rng = np.random.default_rng(30 + res_f32)
    t, dim, eps = 10, 32, 1e-6
    res_dtype = np.float32 if res_f32 else BF16
    # Around 256 the bf16 step is 2: a bf16 residual stores a visibly coarser sum than the f32 one.
    res_in = (rng.standard_normal((t, dim)) * 3 + 256).astype(res_dtype)
    c = _bf16(rng, (t + 6, dim))
    res_out = np.zeros((t, dim), res_dtype)
    ln = np.zeros((t, dim), BF16)
    AddLn(t, dim, eps, res_f32)({0: _u8(res_in), 1: _u8(c), 2: res_out.reshape(-1).view(np.uint8),
                                 3: ln.reshape(-1).view(np.uint8)})
    r = res_in.astype(np.float64) + c[:t].astype(np.float64)
    stored = r.astype(np.float32) if res_f32 else r.astype(BF16).astype(np.float64)
    np.testing.assert_array_equal(res_out, stored.astype(res_dtype))
    def layer_norm(x):
        mu = x.mean(axis=1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=1, keepdims=True) + eps)

    _close(ln, layer_norm(stored.astype(np.float64)))
    if not res_f32:                             # the LayerNorm of what residual_out holds, not of the f32 sum
        assert np.abs(ln.astype(np.float64) - layer_norm(r)).max() > 0.1


def test_addln_faults():
    model = AddLn(4, 8, 1e-6, True)
    args = {0: np.zeros(128, np.uint8), 1: np.zeros(64, np.uint8), 2: np.zeros(64, np.uint8),
            3: np.zeros(64, np.uint8)}
    with pytest.raises(DeviceFault, match=r"residual out \(arg 2\) needs 128 bytes, got 64"):
        model(args)
    with pytest.raises(ValueError, match="eps must be finite"):
        AddLn(4, 8, float("nan"), True)


# ------------------------------------------------------------------------------------------------- streams


def _taconite_patch(stream: bytes) -> bytes:
    """The NPU+GPU runtime's rewrite of v_fc1's mode 5 -> 0, as docs/sam3-kernels.md 2.2 states its rule."""
    w = list(struct.unpack(f"<{len(stream) // 4}I", stream))
    for i in range(32):
        assert w[18 + 24 * i] & 0xFFF == 0x408 and w[20 + 24 * i] == 5 and w[21 + 24 * i] == 0x18, i
    for i in range(32):
        w[20 + 24 * i] = 0
    return struct.pack(f"<{len(w)}I", *w)


def test_gemm_stream_layout():
    m, k, n, lda, b_bytes = 70, 64, 32, 64, 9 * 32 * 64 // 8
    raw = kernels.gemm_stream(DEV_GEN, _geom(m, k, n, lda, b_bytes), EPILOGUE_GELU_TANH, key="v_fc1")
    stream = insts.decode(raw)
    assert (stream.dev_gen, stream.cols, stream.rows) == (DEV_GEN, 8, 6)
    writes = stream.ops[:4 * 32]
    for core in range(32):
        tile = (core // 4) << 25 | (2 + core % 4) << 20
        block = writes[4 * core:4 * core + 4]
        assert [op.addr for op in block] == [tile | 0x400, tile | 0x404, tile | 0x408, tile | 0x40C]
        assert [op.value for op in block] == [m // 32 + (core < m % 32), n, 5, 1]
    tag = stream.ops[4 * 32]
    assert isinstance(tag, insts.BlockWrite) and tag.addr == 2 << 20 | 0x600
    assert tag.words[0] == 5 and struct.pack("<2I", *tag.words[1:])[:5] == b"v_fc1"
    assert kernels.stream_extents(raw) == {0: ((m - 1) * lda + k) * 2, 1: b_bytes, 2: m * n * 2}
    program = emu_txn.walk(raw, DEV_GEN)         # the emulated firmware accepts it
    assert [(p.arg_idx, p.length) for p in program.patches] == [(0, 8960), (1, b_bytes), (2, m * n * 2)]


@pytest.mark.parametrize("mode", [EPILOGUE_NONE, EPILOGUE_RELU, EPILOGUE_GELU_TANH])
def test_epilogue_mode_reads_the_stream(mode):
    raw = kernels.gemm_stream(DEV_GEN, _geom(16, 32, 16, 32, 9 * 16 * 32 // 8), mode, key="g")
    assert kernels.epilogue_mode(raw) == mode
    assert kernels.epilogue_mode(np.frombuffer(raw, np.uint32).copy()) == mode
    assert kernels.epilogue_mode(kernels.gemm_stream(DEV_GEN, _geom(16, 32, 16, 32, 576), mode, 3, key="g")) == mode


def test_epilogue_patch_rule_rewrites_gelu_to_none():
    raw = kernels.gemm_stream(DEV_GEN, _geom(64, 64, 64, 64, 9 * 64 * 64 // 8), EPILOGUE_GELU_TANH, key="v_fc1")
    patched = _taconite_patch(raw)
    assert kernels.epilogue_mode(patched) == EPILOGUE_NONE
    assert len(patched) == len(raw) and insts.decode(patched).num_ops == insts.decode(raw).num_ops
    emu_txn.walk(patched, DEV_GEN)


def test_epilogue_mode_errors():
    with pytest.raises(StreamError, match="no per-core RTP block: word 18 is 0x"):
        kernels.epilogue_mode(kernels.mha_stream(DEV_GEN, 64, key="mha_d"))
    w = np.frombuffer(kernels.gemm_stream(DEV_GEN, _geom(8, 8, 8, 8, 72), 5, 4, key="g"), np.uint32).copy()
    w[20 + 24 * 2] = 1
    with pytest.raises(StreamError, match=r"the 4 cores disagree on the epilogue mode: \[5, 5, 1, 5\]"):
        kernels.epilogue_mode(w)
    with pytest.raises(StreamError, match="not a whole number of 32-bit words"):
        kernels.epilogue_mode(b"\0" * 6)
    with pytest.raises(TypeError, match="uint32 words"):
        kernels.epilogue_mode(w.astype(np.int64))


def test_streams_are_distinct_per_key():
    gemms = {key: kernels.gemm_stream(DEV_GEN, _geom(8, 16, 8, 16, 144), 0, key=key) for key in ("d_s", "d_c")}
    mhas = {key: kernels.mha_stream(DEV_GEN, 256, key=key) for key in ("mha_win", "mha_glob")}
    assert gemms["d_s"] != gemms["d_c"] and mhas["mha_win"] != mhas["mha_glob"]
    assert gemms["d_s"] == kernels.gemm_stream(DEV_GEN, _geom(8, 16, 8, 16, 144), 0, key="d_s")


def test_mha_and_op_streams():
    assert kernels.stream_extents(kernels.mha_stream(DEV_GEN, 100, key="m")) == {i: 200 for i in range(4)}
    strided = kernels.mha_stream(DEV_GEN, 100, [400, 400, 600, 200], key="m")
    assert kernels.stream_extents(strided) == {0: 400, 1: 400, 2: 600, 3: 200}
    rope = kernels.op_stream(DEV_GEN, [96, 64, 64], key="rope")
    addln = kernels.op_stream(DEV_GEN, [64, 32, 64, 32], key="addln")
    assert kernels.stream_extents(rope) == {0: 96, 1: 64, 2: 64}
    for raw, outs in ((rope, 1), (addln, 2)):
        program = emu_txn.walk(raw, DEV_GEN)
        assert len(program.syncs) == outs and len(program.patches) == len(kernels.stream_extents(raw))


def test_stream_argument_errors():
    with pytest.raises(ValueError, match=r"stream 'g': A extent of 6 bytes is not a positive multiple of 4"):
        kernels.gemm_stream(DEV_GEN, _geom(1, 3, 2, 3, 72), 0, key="g")
    with pytest.raises(ValueError, match="epilogue mode 2 unknown"):
        kernels.gemm_stream(DEV_GEN, _geom(8, 8, 8, 8, 72), 2, key="g")
    with pytest.raises(ValueError, match="cores 33 out of range 1..32"):
        kernels.gemm_stream(DEV_GEN, _geom(8, 8, 8, 8, 72), 0, 33, key="g")
    with pytest.raises(ValueError, match="needs 4 extents"):
        kernels.mha_stream(DEV_GEN, 8, [16, 16, 16], key="m")
    with pytest.raises(ValueError, match="non-empty str"):
        kernels.op_stream(DEV_GEN, [16], key="")
    with pytest.raises(ValueError, match="dev_gen 5 unsupported"):
        kernels.op_stream(5, [16], key="op")


# ------------------------------------------------------------------------------------------------- binding


def _fake_bundle(vit_device: bool) -> SimpleNamespace:
    """The attributes of the contract's Bundle that bind_bundle reads (a manifest of the small preset shape)."""
    gemm = SimpleNamespace(key="v_fc1", m=16, k=64, n=128, lda=64, tile_k=64, tile_n=32, ct_k=8, bias=True,
                           b_bytes=pack.packed_size(64, 128, 8, True))
    params = SimpleNamespace(grid=8, window=4, vit_dim=64, vit_heads=2, vit_eps=1e-6, vit_device=vit_device,
                             vit_res_f32=True)
    mhas = {"mha_win": SimpleNamespace(heads=8, seq=16, d=32, token_major=False, elems=64 * 64),
            "mha_glob": SimpleNamespace(heads=2, seq=64, d=32, token_major=True, elems=64 * 64)}
    ops = {"rope": SimpleNamespace(), "addln": SimpleNamespace()} if vit_device else {}
    streams = {"v_fc1": kernels.gemm_stream(DEV_GEN, gemm, EPILOGUE_GELU_TANH, key="v_fc1")}
    streams |= {key: kernels.mha_stream(DEV_GEN, 4096, key=key) for key in mhas}
    streams |= {key: kernels.op_stream(DEV_GEN, [64], key=key) for key in ops}
    return SimpleNamespace(gemms={"v_fc1": gemm}, mhas=mhas, ops=ops, params=params, insts_bytes=streams.__getitem__)


@pytest.mark.parametrize("vit_device", [False, True])
def test_bind_bundle(vit_device):
    bundle = _fake_bundle(vit_device)
    registry = ModelRegistry()
    digests = kernels.bind_bundle(bundle, registry)
    assert sorted(digests) == sorted(["v_fc1", "mha_win", "mha_glob"] + (["addln", "rope"] if vit_device else []))
    assert all(digests[key] == stream_digest(bundle.insts_bytes(key)) for key in digests)
    models = {key: registry.lookup(digest) for key, digest in digests.items()}
    assert repr(models["v_fc1"]) == ("FlmGemm(m=16, k=64, n=128, lda=64, tile_k=64, tile_n=32, ct_k=8, bias=True, "
                                     "mode=5)")
    form, dim = ("strided", 64) if vit_device else ("packed", None)
    assert repr(models["mha_win"]) == f"IronMha(heads=8, seq=16, d=32, token_major=False, form={form!r}, dim={dim})"
    assert models["mha_glob"].tokens == 64 and models["mha_glob"].form == form
    if vit_device:
        assert repr(models["rope"]) == "Rope(tokens=64, dim=64, heads=2)"
        assert repr(models["addln"]) == "AddLn(tokens=64, dim=64, eps=1e-06, residual_f32=True)"
    assert kernels.bind_bundle(bundle, registry) == digests and len(registry) == len(digests)   # a no-op


def test_bind_stream_after_the_epilogue_patch():
    bundle, registry = _fake_bundle(False), ModelRegistry()
    kernels.bind_bundle(bundle, registry)
    patched = _taconite_patch(bundle.insts_bytes("v_fc1"))
    digest = kernels.bind_stream(registry, "v_fc1", patched, bundle)
    assert digest == stream_digest(patched) and registry.lookup(digest).mode == EPILOGUE_NONE
    assert registry.lookup(stream_digest(bundle.insts_bytes("v_fc1"))).mode == EPILOGUE_GELU_TANH


def test_bind_errors_name_the_key():
    bundle, registry = _fake_bundle(True), ModelRegistry()
    bundle.ops["gelu"] = SimpleNamespace()
    with pytest.raises(ValueError, match="kernel gelu: no emulator model for this op"):
        kernels.bind_stream(registry, "gelu", b"", bundle)
    with pytest.raises(ValueError, match="kernel nope: not a gemm, mha or op key"):
        kernels.bind_stream(registry, "nope", b"", bundle)
    with pytest.raises(StreamError, match="kernel v_fc1: no per-core RTP block"):
        kernels.bind_stream(registry, "v_fc1", bundle.insts_bytes("mha_win"), bundle)
    registry.bind(bundle.insts_bytes("mha_glob"), IronMha(1, 1, 1))
    with pytest.raises(ValueError, match="already bound"):
        kernels.bind_stream(registry, "mha_glob", bundle.insts_bytes("mha_glob"), bundle)


# ------------------------------------------------------------------------------------------------- emulator


def test_gemm_runs_on_the_emulator_end_to_end(caplog):
    rng = np.random.default_rng(40)
    m, k, n, tiles = 16, 64, 32, (32, 16, 8)
    a_buf, packed, want = _gemm_case(rng, m, k, n, k, tiles, True)
    stream = kernels.gemm_stream(DEV_GEN, _geom(m, k, n, k, packed.nbytes), EPILOGUE_RELU, key="d_fc1")
    assert insts.encode(insts.decode(stream)) == stream
    dev = open_device("emu:npu4")
    try:
        model = FlmGemm(m, k, n, k, *tiles, True, kernels.epilogue_mode(stream), cache=BCache())
        dev.emulator.models.bind(stream, model)
        a, b, c = dev.bo(a_buf.nbytes), dev.bo(packed.nbytes), dev.bo(m * n * 2)
        a.array(np.uint8)[:] = _u8(a_buf)
        b.array(np.uint8)[:] = packed
        for bo in (a, b, c):
            bo.sync()
        ctx = dev.hw_context(Xclbin.load(xclbin.write(xclbin.build_mlir_aie(bytes(range(256)) * 4))))
        run = ctx.kernel().prepare_npu(stream, [a, b, c])
        for _ in range(3):
            run.start().wait(30)
        c.sync(direction="from_device")
        _close(c.array(BF16).reshape(m, n), np.maximum(want, 0.0))
        assert model.decodes == 1
        short = kernels.gemm_stream(DEV_GEN, _geom(m, k, n, k, packed.nbytes - 8), EPILOGUE_RELU, key="d_fc1")
        dev.emulator.models.bind(short, model)
        with caplog.at_level("ERROR", logger="amdxdna_direct.emu"), pytest.raises(errors.CommandError, match="ERROR"):
            ctx.kernel().prepare_npu(short, [a, b, c]).start().wait(30)
        assert f"device fault in {model.name}: {model.name}: B (arg 1) needs {packed.nbytes} bytes, got " \
               f"{packed.nbytes - 8}" in caplog.text
        ctx.close()
    finally:
        dev.close()
