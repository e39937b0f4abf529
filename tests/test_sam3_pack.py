"""sam3.pack and sam3.reference against hand-written oracles (index formulas of spec/sam3-bundle.md 2, 4, 5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sam3 import pack, reference


def _rne_bits(x: np.ndarray) -> np.ndarray:
    """Oracle: float32 -> bf16 bits by integer round-to-nearest-even on the float32 bit pattern."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bias = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + bias) >> 16).astype(np.uint16)


def test_bf16_hand_values():
    one_half_ulp = np.float32(1 + 2**-8)  # halfway between 1.0 and the next bf16: ties to even (1.0)
    three_half_ulp = np.float32(1 + 3 * 2**-8)  # halfway between 0x3F81 and 0x3F82: ties to even (0x3F82)
    bits = pack.to_bf16(np.array([1.0, -2.0, one_half_ulp, three_half_ulp, 0.0], dtype=np.float32))
    assert bits.tolist() == [0x3F80, 0xC000, 0x3F80, 0x3F82, 0]
    assert pack.from_bf16(np.array([0x3F80, 0x4049], dtype=np.uint16)).tolist() == [1.0, 3.140625]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False, max_value=2.0**127, min_value=-(2.0**127)),
                min_size=1, max_size=32))
def test_bf16_matches_integer_rne(values):
    x = np.array(values, dtype=np.float32)
    assert np.array_equal(pack.to_bf16(x), _rne_bits(x))
    assert np.array_equal(pack.round_bf16(pack.round_bf16(x)), pack.round_bf16(x))


def test_from_bf16_rejects_other_dtypes():
    with pytest.raises(TypeError, match="uint16"):
        pack.from_bf16(np.zeros(3, dtype=np.int32))


def _small_weight(k: int, n: int) -> np.ndarray:
    # Distinct exactly-representable values so any misplaced element is visible.
    return (np.arange(k * n, dtype=np.float32).reshape(k, n) - k * n / 2) / 4


def test_pack_kn_nk_tiled_index_formulas():
    k, n = 6, 8
    w = _small_weight(k, n)
    kn = pack.from_bf16(pack.pack_b(w, "kn"))
    nk = pack.from_bf16(pack.pack_b(w, "nk"))
    tiled = pack.from_bf16(pack.pack_b(w, "tiled:3,4"))
    for i in range(k):
        for j in range(n):
            assert kn[i * n + j] == w[i, j]
            assert nk[j * k + i] == w[i, j]
            # [k/KT][n/NT][KT][NT]
            assert tiled[((i // 3) * (n // 4) + j // 4) * 12 + (i % 3) * 4 + j % 4] == w[i, j]
    for layout in ("kn", "nk", "tiled:3,4"):
        assert np.array_equal(pack.b_matrix(pack.pack_b(w, layout), layout, k, n), w)


@pytest.mark.parametrize("text, message", [("tiled:3", "2 positive"), ("conv3x3:0", "positive"),
                                           ("kn:1", "unknown"), ("rowmajor", "unknown"), ("tiled:a,b", "positive")])
def test_parse_layout_errors(text, message):
    with pytest.raises(ValueError, match=message):
        pack.parse_layout(text)


def test_pack_b_errors():
    with pytest.raises(ValueError, match="does not tile"):
        pack.pack_b(np.zeros((6, 8)), "tiled:4,4")
    with pytest.raises(ValueError, match="pack_conv3x3"):
        pack.pack_b(np.zeros((6, 8)), "conv3x3:2")
    with pytest.raises(ValueError, match=r"\[k\]\[n\]"):
        pack.pack_b(np.zeros(6), "kn")


def test_pack_conv3x3_formula():
    cout, d, p = 3, 2, 4
    weight = np.arange(cout * d * 9, dtype=np.float32).reshape(cout, d, 3, 3) + 1
    b = pack.from_bf16(pack.pack_conv3x3(weight, p)).reshape((p + 2) * d, 3 * p * cout)
    for j in range(p + 2):
        for c in range(d):
            for ky in range(3):
                for q in range(p):
                    for co in range(cout):
                        want = weight[co, c, ky, j - q] if 0 <= j - q <= 2 else 0.0
                        assert b[j * d + c, (ky * p + q) * cout + co] == want


def test_conv_geometry():
    g = pack.ConvGeometry.of(k=(4 + 2) * 16, lda=4 * 16, n=3 * 4 * 8)
    assert (g.d, g.p, g.cout) == (16, 4, 8)
    assert g.rows(5, 6, m=4) == 12  # ceil(5*8/4) = 10 -> 12
    assert g.y_elems(12) == (12 * 4 + 2) * 16
    for k, lda, n in [(64, 64, 24), (65, 64, 24), (96, 40, 24), (96, 64, 25)]:
        with pytest.raises(ValueError):
            pack.ConvGeometry.of(k, lda, n)


def _conv_by_overlapping_rows(x: np.ndarray, weight: np.ndarray, p: int, m: int) -> np.ndarray:
    """The conv GEMM done the way the device does it: row i of A = P+2 pixels of Y starting at pixel i*P."""
    h, w, d = x.shape
    cout = weight.shape[0]
    geom = pack.ConvGeometry(d=d, p=p, cout=cout)
    rows = geom.rows(h, w, m)
    y = pack.from_bf16(pack.conv_input(x, geom, rows))
    assert y.size == geom.y_elems(rows)
    a = np.stack([y[i * p * d : i * p * d + (p + 2) * d] for i in range(rows)])
    b = pack.from_bf16(pack.pack_conv3x3(weight, p)).reshape((p + 2) * d, 3 * p * cout)
    c = pack.to_bf16(a @ b)
    return pack.conv_output(c, geom, h, w)


@pytest.mark.parametrize("h, w, d, cout, p, m", [(5, 7, 3, 4, 4, 2), (6, 6, 8, 8, 2, 4), (3, 9, 2, 5, 8, 1)])
def test_conv_host_side_equals_direct_conv(h, w, d, cout, p, m):
    rng = np.random.default_rng(h * 100 + w)
    x = pack.round_bf16(rng.standard_normal((h, w, d)))
    weight = pack.round_bf16(rng.standard_normal((cout, d, 3, 3)))
    got = _conv_by_overlapping_rows(x, weight, p, m)
    want = reference.conv3x3(x, weight)
    # Three bf16-rounded partial sums per output: error bounded by 3 roundings of |partial| (2^-9 each).
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 3 * 2**-8 * scale


def test_reference_conv3x3_matches_naive_loop():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5, 2)).astype(np.float32)
    wt = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    out = reference.conv3x3(x, wt)
    for y in range(4):
        for xx in range(5):
            for co in range(3):
                acc = 0.0
                for ky in range(3):
                    for kx in range(3):
                        sy, sx = y + ky - 1, xx + kx - 1
                        if 0 <= sy < 4 and 0 <= sx < 5:
                            acc += float(np.dot(x[sy, sx], wt[co, :, ky, kx]))
                assert out[y, xx, co] == pytest.approx(acc, rel=1e-5, abs=1e-5)


def test_conv_output_and_input_errors():
    geom = pack.ConvGeometry(d=2, p=4, cout=3)
    with pytest.raises(ValueError, match="cannot hold"):
        pack.conv_input(np.zeros((4, 4, 2)), geom, rows=2)
    with pytest.raises(ValueError, match=r"\[h\]\[w\]\[2\]"):
        pack.conv_input(np.zeros((4, 4, 3)), geom, rows=8)
    with pytest.raises(ValueError, match="do not cover"):
        pack.conv_output(np.zeros(3 * 4 * 3 * 2, dtype=np.uint16), geom, 4, 4)


def test_heads_and_windows():
    x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)  # seq 6, 2 heads of d 4
    heads = pack.split_heads(x, 2)
    assert heads.shape == (2, 6, 4)
    assert heads[1, 3, 2] == x[3, 4 + 2]
    assert np.array_equal(pack.merge_heads(heads), x)
    grid = np.arange(4 * 6 * 2, dtype=np.float32).reshape(4, 6, 2)
    win = pack.window_partition(grid, 2)
    assert win.shape == (6, 4, 2)
    assert np.array_equal(win[4, 3], grid[3, 3])  # window (1, 1), token (1, 1)
    assert np.array_equal(pack.window_merge(win, 2, 4, 6), grid)
    with pytest.raises(ValueError, match="do not tile"):
        pack.window_partition(grid, 4)
    with pytest.raises(ValueError, match="multiple of 3 heads"):
        pack.split_heads(x, 3)


def test_reference_attention_matches_loop():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 5, 4)).astype(np.float32) for _ in range(3))
    out = reference.attention(q, k, v)
    for h in range(2):
        for i in range(5):
            s = np.array([np.dot(q[h, i], k[h, j]) / 2.0 for j in range(5)])
            wts = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            assert np.allclose(out[h, i], wts @ v[h], rtol=1e-5, atol=1e-6)


def test_reference_windowed_attention_uses_windows():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 8)).astype(np.float32)  # a 4x4 grid, width 8, 2 heads
    wq = rng.standard_normal((8, 24)).astype(np.float32) / 4
    out = reference.windowed_attention(x, wq, heads=2, win=2, grid=(4, 4))
    qkv = x @ wq
    tokens = [0, 1, 4, 5]  # window (0, 0)
    q, k, v = (qkv[tokens, i * 8 : (i + 1) * 8] for i in range(3))
    want = pack.merge_heads(reference.attention(pack.split_heads(q, 2), pack.split_heads(k, 2),
                                                pack.split_heads(v, 2)))
    assert np.allclose(out[tokens], want, rtol=1e-5, atol=1e-6)


def test_reference_elementwise():
    x = np.array([-1.0, 0.0, 2.0], dtype=np.float32)
    assert np.allclose(reference.gelu(x), [-0.158808, 0.0, 1.954597], atol=1e-6)
    assert np.allclose(reference.silu(x), [-0.268941, 0.0, 1.761594], atol=1e-6)
    ln = reference.layernorm(np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32))
    assert np.allclose(ln, np.array([-3, -1, 1, 3]) / np.sqrt(5.0 + 4e-6), atol=1e-6)


def test_copy_wide_large_and_small():
    src = np.random.default_rng(4).integers(0, 255, size=3 * pack.COPY_BLOCK + 123, dtype=np.uint8)
    dst = np.zeros_like(src)
    pack.copy_wide(dst, src)
    assert np.array_equal(dst, src)
    small = np.zeros(10, dtype=np.uint16)
    pack.copy_wide(small, np.arange(10, dtype=np.uint16))
    assert small.tolist() == list(range(10))
    with pytest.raises(ValueError, match="holds 20 bytes"):
        pack.copy_wide(small, np.zeros(11, dtype=np.uint16))


def test_copy_wide_copies_whole_blocks_in_parallel(monkeypatch):
    """Above two blocks the copy is one memcpy per COPY_BLOCK bytes, mapped over the worker pool; below, one
    memcpy on the calling thread (never element by element: each task is a whole block)."""
    starts = []

    class Recorder:
        def map(self, fn, offsets):
            offsets = list(offsets)
            starts.extend(offsets)
            return [fn(o) for o in offsets]

    monkeypatch.setattr(pack, "_executor", Recorder)
    monkeypatch.setattr(pack, "_COPY_WORKERS", 2)
    size = 2 * pack.COPY_BLOCK + 5
    src = np.random.default_rng(5).integers(0, 255, size=size, dtype=np.uint8)
    dst = np.zeros_like(src)
    pack.copy_wide(dst, src)
    assert starts == [0, pack.COPY_BLOCK, 2 * pack.COPY_BLOCK] and np.array_equal(dst, src)
    starts.clear()
    pack.copy_wide(dst[: 2 * pack.COPY_BLOCK - 1], src[1 : 2 * pack.COPY_BLOCK])
    assert starts == [] and np.array_equal(dst[: 2 * pack.COPY_BLOCK - 1], src[1 : 2 * pack.COPY_BLOCK])
