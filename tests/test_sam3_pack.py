"""sam3.pack against independent oracles: a slow loop-by-loop transcription of the bfp16ebs8 packing rules
(docs/sam3-packing.md 2 and 3), blocks and byte offsets worked out by hand, and a direct numpy convolution.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from sam3 import pack

# ---------------------------------------------------------------------------------------------
# The oracle: the packing rules followed one value at a time, with Python integers.


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _ref_bf16(x: float) -> int:
    u = _bits(x)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _ref_block(values: list[float]) -> bytes:
    fields = []
    for x in values:
        u = _bits(x)
        neg, e, m = u >> 31, (u >> 23) & 0xFF, u & 0x7FFFFF
        if e:
            m |= 1 << 23
        fields.append((neg, e, -m if neg else m))
    top = max(e for _, e, _ in fields)
    out = [top]
    for neg, e, v in fields:
        shift = top - e
        if shift >= 32:
            q = -1 if neg else 0
        else:
            total = min(max(17 + shift, 0), 62)
            q = v >> total
            rem, half = v - (q << total), 1 << (total - 1)
            if rem > half or (rem == half and q % 2 == 1):
                q += 1
        out.append(min(max(q, -128), 127) & 0xFF)
    return bytes(out)


def _ref_pack(b: np.ndarray, bias: np.ndarray | None, tile_k: int, tile_n: int, ct_k: int) -> bytes:
    k, n = b.shape
    vals = b.astype(np.float32).tolist()
    out = bytearray()
    for cb in range(n // tile_n):
        if bias is not None:
            chunk = bytearray(ct_k * tile_n // 8 * 9)
            for j in range(tile_n):
                chunk[2 * j : 2 * j + 2] = struct.pack("<H", _ref_bf16(float(bias[cb * tile_n + j])))
            out += chunk
        for kb in range(k // tile_k):
            for ks in range(tile_k // ct_k):
                for tb in range(tile_n // 8):
                    for i in range(ct_k // 8):
                        k0 = kb * tile_k + ks * ct_k + 8 * i
                        for t_in in range(8):
                            col = cb * tile_n + 8 * tb + t_in
                            out += _ref_block([vals[k0 + s][col] for s in range(8)])
    return bytes(out)


def _nasty(k: int, n: int, seed: int) -> np.ndarray:
    """A [k, n] f32 matrix that reaches every branch of the block rule: wide exponent ranges inside blocks
    (shift >= 32), exact ties, carries that saturate, zeros of both signs and subnormals."""
    rng = np.random.default_rng(seed)
    shape = (k // 8, n, 8)  # [k-block, column, 8 consecutive k]
    blocks = rng.standard_normal(shape) * np.exp2(rng.integers(-40, 40, shape))
    kinds = rng.integers(0, 6, shape[:2])
    scale = np.exp2(rng.integers(-30, 30, shape[:2]))[:, :, None]
    grid = (rng.integers(-127, 128, shape) + rng.choice([0.0, 0.5], shape)) * scale
    grid[:, :, 0] = 100 * scale[:, :, 0]
    sat = grid.copy()
    sat[:, :, 1] = rng.choice([127.5, 127.75, -127.5, -127.75], shape[:2]) * scale[:, :, 0]
    tiny = rng.choice([0.0, -0.0, 1e-40, -3e-42, 2.0**-149, -(2.0**-126)], shape)
    mixed = blocks.copy()
    mixed[:, :, 3:6] = tiny[:, :, 3:6]
    for kind, source in ((1, grid), (2, sat), (3, tiny), (4, mixed)):
        blocks[kinds == kind] = source[kinds == kind]
    return np.ascontiguousarray(blocks.transpose(0, 2, 1)).reshape(k, n).astype(np.float32)


def _q(values: list[float]) -> tuple[int, list[int]]:
    block = pack.encode_blocks(np.array(values, dtype=np.float32))
    return int(block[0]), block[1:].view(np.int8).tolist()


# ---------------------------------------------------------------------------------------------
# bf16


def _rne_bits(x: np.ndarray) -> np.ndarray:
    """Oracle: float32 -> bf16 bits by integer round-to-nearest-even on the bit pattern, NaN | 0x40."""
    return np.array([_ref_bf16(v) for v in np.asarray(x, dtype=np.float32).tolist()], dtype=np.uint16)


def test_bf16_hand_values():
    one_half_ulp = np.float32(1 + 2**-8)  # halfway between 1.0 and the next bf16: ties to even (1.0)
    three_half_ulp = np.float32(1 + 3 * 2**-8)  # halfway between 0x3F81 and 0x3F82: ties to even (0x3F82)
    bits = pack.to_bf16(np.array([1.0, -2.0, one_half_ulp, three_half_ulp, 0.0, -0.0, 3.4e38], dtype=np.float32))
    assert bits.tolist() == [0x3F80, 0xC000, 0x3F80, 0x3F82, 0, 0x8000, 0x7F80]
    assert pack.from_bf16(np.array([0x3F80, 0x4049, 0x8000], dtype=np.uint16)).tolist() == [1.0, 3.140625, -0.0]
    assert pack.from_bf16(np.array([1.5], dtype=ml_dtypes.bfloat16)).tolist() == [1.5]


def test_bf16_nan_keeps_a_mantissa_bit():
    # 0x7F80FFFF would round to 0x7F81; 0x7F800001 would round to 0x7F80 (infinity): both stay NaN, top bits | 0x40.
    nans = np.array([0x7F800001, 0x7F80FFFF, 0xFFC00001, 0x7FFFFFFF, 0x7FC00000], dtype=np.uint32).view(np.float32)
    assert pack.to_bf16(nans).tolist() == [0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC0]
    assert np.isnan(pack.round_bf16(nans)).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=32))
def test_bf16_matches_integer_rne(values):
    x = np.array(values, dtype=np.float32)
    assert np.array_equal(pack.to_bf16(x), _rne_bits(x))
    finite = np.isfinite(x)
    assert np.array_equal(pack.round_bf16(pack.round_bf16(x[finite])), pack.round_bf16(x[finite]))


def test_from_bf16_rejects_other_dtypes():
    with pytest.raises(TypeError, match="expected uint16 bit patterns or bfloat16, got int32"):
        pack.from_bf16(np.zeros(3, dtype=np.int32))


# ---------------------------------------------------------------------------------------------
# Blocks


def test_unit_block_bytes():
    block = pack.encode_blocks(np.array([64, 14.9375, 106.5, 94.5, 0, -1.5, -2.5, 3], dtype=np.float32))
    assert block.tolist() == [133, 64, 15, 106, 94, 0, 0xFE, 0xFE, 3]
    assert pack.decode_blocks(block).tolist() == [64, 15, 106, 94, 0, -2, -2, 3]


@pytest.mark.parametrize(("values", "exp", "mants"), [
    # E = 127 (1.0): -2^-31 is 31 binades down (rounded: 0), -2^-32 and -0.0 are >= 32 down (-1); +tiny -> 0
    ([1.0, -(2.0**-31), -(2.0**-32), -0.0, 0.0, 1e-10, -1e-10, 0.5], 127, [64, 0, -1, -1, 0, 0, -1, 32]),
    # E = 133: carries to 128 saturate at 127; -127.75 floors to -128; ties go to the even neighbour
    ([127.75, 127.5, -127.75, -127.5, 64, 126.5, -0.5, 0.5], 133, [127, 127, -128, -128, 64, 126, 0, 0]),
    ([64, 2.5, 3.5, -2.5, -3.5, 1.5, -1.5, 0.75], 133, [64, 2, 4, -2, -4, 2, -2, 1]),
    # subnormals only: E = 0, mantissa bits / 2^17 (no implicit bit): 2^17 -> 1, 3*2^16 (1.5) -> 2, -2^16 -> 0
    ([2.0**-132, 3 * 2.0**-132, 2.0**-127, -(2.0**-133), 3 * 2.0**-133, 0.0, -0.0, (2**23 - 1) * 2.0**-149],
     0, [1, 3, 32, 0, 2, 0, 0, 64]),
    # the smallest normal (E = 1, mantissa 64) beside a subnormal 2^-127 (bits 2^22, shift 1 -> 16)
    ([2.0**-126, 2.0**-127, 0, 0, 0, 0, 0, 0], 1, [64, 16, 0, 0, 0, 0, 0, 0]),
    ([-0.0] * 8, 0, [0] * 8),
    ([0.0] * 8, 0, [0] * 8),
    ([3e38, -3e38, 1.0, 0, 0, 0, 0, 0], 254, [113, -113, 0, 0, 0, 0, 0, 0]),
])
def test_hand_decoded_blocks(values, exp, mants):
    assert _q(values) == (exp, mants)
    assert pack.encode_blocks(np.array(values, dtype=np.float32)).tobytes() == _ref_block(values)
    block = np.array([exp] + [m & 0xFF for m in mants], dtype=np.uint8)
    assert pack.decode_blocks(block).tolist() == [m * 2.0 ** (exp - 133) for m in mants]


def test_subnormals_decode_to_half_their_value():
    # The rule gives a subnormal the biased exponent 0, not 1: it comes back halved (docs/sam3-packing.md 2.4).
    x = np.array([2.0**-127, 2.0**-130, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    assert pack.decode_blocks(pack.encode_blocks(x)).tolist() == (x / 2).tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=8, max_size=8))
def test_block_matches_oracle(values):
    x = np.array(values, dtype=np.float32)
    assert pack.encode_blocks(x).tobytes() == _ref_block(x.tolist())


def test_blocks_match_oracle_on_nasty_data():
    b = _nasty(64, 64, seed=1)
    blocks = np.ascontiguousarray(b.reshape(8, 8, 64).transpose(0, 2, 1))  # [k/8, n, 8 consecutive k]
    got = pack.encode_blocks(blocks)
    assert got.shape == (8, 64, 9)
    want = b"".join(_ref_block(v) for v in blocks.reshape(-1, 8).tolist())
    assert got.tobytes() == want


def test_block_errors():
    with pytest.raises(pack.PackError, match=r"must be \[\.\.\., 8\], got shape \(7,\)"):
        pack.encode_blocks(np.zeros(7, dtype=np.float32))
    with pytest.raises(pack.PackError, match=r"expected uint8 \[\.\.\., 9\], got int8 \(9,\)"):
        pack.decode_blocks(np.zeros(9, dtype=np.int8))
    with pytest.raises(pack.PackError, match=r"1 non-finite value\(s\) .* nan at index \[1, 2\]"):
        pack.encode_blocks(np.array([[0] * 8, [0, 0, np.nan] + [0] * 5], dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# Tile order and bias chunk


def _distinct(k: int, n: int) -> np.ndarray:
    """Every 8-value k-block different (its first value is 64 + the block number, mod 64)."""
    b = np.tile(np.arange(8, dtype=np.float32), (k // 8, n, 1))  # [k/8, n, 8]
    b[:, :, 0] = 64 + (np.arange(k // 8 * n) % 64).reshape(k // 8, n)
    return np.ascontiguousarray(b.transpose(0, 2, 1)).reshape(k, n)


# (K, N, tile_k, tile_n, ct_k), then (k0, col, offset without bias, offset with bias), worked out by hand from
# offset = cb*(chunk + K*tile_n*9/8) + chunk + 9*index,
# index = ((((kb*(tile_k/ct_k) + ks)*(tile_n/8) + tb)*(ct_k/8) + i)*8 + t_in)
HAND_OFFSETS = [
    ((16, 16, 16, 8, 8), [(0, 0, 0, 72), (0, 7, 63, 135), (8, 0, 72, 144), (8, 3, 99, 171), (0, 8, 144, 288),
                          (8, 9, 225, 369), (8, 15, 279, 423)]),
    ((32, 32, 16, 16, 16), [(24, 21, 981, 1557), (0, 13, 189, 477), (8, 2, 90, 378), (16, 0, 288, 576)]),
]


@pytest.mark.parametrize(("dims", "cases"), HAND_OFFSETS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_block_offsets_by_hand(dims, cases, with_bias):
    k, n, tile_k, tile_n, ct_k = dims
    b = _distinct(k, n)
    bias = np.linspace(-1, 1, n, dtype=np.float32) if with_bias else None
    packed = pack.pack_b(b, bias, tile_k, tile_n, ct_k)
    assert packed.dtype == np.uint8 and packed.shape == (pack.packed_size(k, n, ct_k, with_bias),)
    for k0, col, plain, biased in cases:
        at = biased if with_bias else plain
        assert packed[at : at + 9].tobytes() == _ref_block(b[k0 : k0 + 8, col].tolist()), (k0, col)


def test_bias_chunk_bytes():
    # K=16 N=16 tile_n=8 ct_k=8: chunk = 8*8/8*9 = 72 bytes, column block = 72 + 144 bytes
    bias = np.array([1.0, -2.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.0, -0.0, 0.5, 65280.0,
                     -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 4.0, -8.0], dtype=np.float32)
    packed = pack.pack_b(_distinct(16, 16), bias, 16, 8, 8)
    first = bytes([0x80, 0x3F, 0x00, 0xC0, 0x80, 0x3F, 0x82, 0x3F, 0x40, 0x40, 0x00, 0x80, 0x00, 0x3F, 0x7F, 0x47])
    second = bytes([0x80, 0xBF, 0x00, 0x40, 0x00, 0x00, 0xC0, 0x3F, 0x00, 0xBF, 0x80, 0x3E, 0x80, 0x40, 0x00, 0xC1])
    assert packed[:72].tobytes() == first + bytes(56)
    assert packed[216 : 216 + 72].tobytes() == second + bytes(56)
    _, back = pack.unpack_b(packed, 16, 16, 16, 8, 8, True)
    assert back.tolist() == [1.0, -2.0, 1.0, 1 + 2**-6, 3.0, -0.0, 0.5, 65280.0,
                             -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 4.0, -8.0]


TILINGS = [
    (16, 16, 16, 8, 8),
    (32, 16, 32, 8, 8),  # the synthetic bundle's d_s: K = d_model 32, N = d_heads*text_len 16
    (32, 16, 16, 16, 16),
    (64, 48, 32, 16, 16),
    (48, 24, 24, 24, 8),
    (96, 32, 48, 16, 24),
]


@pytest.mark.parametrize("dims", TILINGS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_pack_matches_oracle(dims, with_bias):
    k, n, tile_k, tile_n, ct_k = dims
    b = _nasty(k, n, seed=k * n + tile_k)
    bias = np.random.default_rng(n).standard_normal(n).astype(np.float32) if with_bias else None
    assert pack.pack_b(b, bias, tile_k, tile_n, ct_k).tobytes() == _ref_pack(b, bias, tile_k, tile_n, ct_k)


def _spec(key, k, n, tile_k, tile_n, ct_k, bias, b_bytes=None):
    b_bytes = pack.packed_size(k, n, ct_k, bias) if b_bytes is None else b_bytes
    return SimpleNamespace(key=key, k=k, n=n, tile_k=tile_k, tile_n=tile_n, ct_k=ct_k, bias=bias, b_bytes=b_bytes)


def test_pack_test_reproduction_at_the_real_d_s_size():
    # d_s: K = N = 256 with bias and ct_k = 32 is 82944 bytes; pack_test.packed is written by the reference packer.
    spec = _spec("d_s", 256, 256, 64, 64, 32, True)
    assert spec.b_bytes == 82944
    pack_test_b = _nasty(256, 256, seed=7)
    pack_test_bias = np.random.default_rng(8).standard_normal(256).astype(np.float32)
    pack_test_packed = np.frombuffer(_ref_pack(pack_test_b, pack_test_bias, 64, 64, 32), dtype=np.uint8)
    assert np.array_equal(pack.pack_spec(spec, pack_test_b, pack_test_bias), pack_test_packed)
    # the same bytes under another tiling of the same size are a different order (a silent failure on device)
    other = pack.pack_b(pack_test_b, pack_test_bias, 256, 32, 32)
    assert other.size == pack_test_packed.size and not np.array_equal(other, pack_test_packed)


# ---------------------------------------------------------------------------------------------
# Round trips


def _steps(b: np.ndarray) -> np.ndarray:
    """The step 2^(E-133) of the block every element of b falls in (oracle from the bit patterns)."""
    k, n = b.shape
    e = (b.view(np.uint32) >> 23) & 0xFF
    top = e.reshape(k // 8, 8, n).max(axis=1).astype(np.float64)
    return np.repeat(np.exp2(top - 133), 8, axis=0)


def test_round_trip_error_bound():
    rng = np.random.default_rng(11)
    b = (rng.standard_normal((64, 96)) * np.exp2(rng.integers(-6, 1, (64, 96)))).astype(np.float32)
    b[::8, ::3] = 127.9 * np.exp2(rng.integers(0, 6, (8, 32)))  # ~1.998 * 2^e, the block's largest: it saturates
    bias = rng.standard_normal(96).astype(np.float32)
    back, back_bias = pack.unpack_b(pack.pack_b(b, bias, 32, 32, 16), 64, 96, 32, 32, 16, True)
    step = _steps(b)
    err = np.abs(back.astype(np.float64) - b)
    saturated = b > 127.5 * step
    assert saturated.sum() >= 256
    assert (err[~saturated] <= step[~saturated] / 2).all()
    assert (err[saturated] <= step[saturated]).all() and (back[saturated] == 127 * step[saturated]).all()
    assert np.array_equal(back_bias, pack.round_bf16(bias))


def test_round_trip_exact_for_representable_values():
    rng = np.random.default_rng(12)
    k, n = 48, 40
    q = rng.integers(-127, 128, (k // 8, 8, n))
    q[:, 0] = rng.choice([-1, 1], (k // 8, n)) * rng.integers(64, 128, (k // 8, n))  # sets the block's exponent
    top = rng.integers(20, 240, (k // 8, 1, n))
    b = (q * np.exp2(top - 133.0)).reshape(k, n).astype(np.float32)
    packed = pack.pack_b(b, None, 24, 8, 8)
    back, none = pack.unpack_b(packed, k, n, 24, 8, 8, False)
    assert none is None and np.array_equal(back, b)
    assert np.array_equal(pack.pack_b(back, None, 24, 8, 8), packed)


def test_unpack_matches_slow_decode():
    k, n, tile_k, tile_n, ct_k = 32, 32, 16, 16, 16
    packed = pack.pack_b(_nasty(k, n, seed=3), None, tile_k, tile_n, ct_k)
    want = np.zeros((k, n))
    for cb in range(n // tile_n):
        for kb in range(k // tile_k):
            for tb in range(tile_n // 8):
                for i in range(ct_k // 8):
                    for t_in in range(8):
                        at = cb * k * tile_n * 9 // 8 + 9 * ((((kb * 2 + tb) * 2) + i) * 8 + t_in)
                        exp, mants = packed[at], packed[at + 1 : at + 9].view(np.int8)
                        k0, col = kb * tile_k + 8 * i, cb * tile_n + 8 * tb + t_in
                        want[k0 : k0 + 8, col] = mants * 2.0 ** (int(exp) - 133)
    back, _ = pack.unpack_b(packed.tobytes(), k, n, tile_k, tile_n, ct_k, False)
    assert np.array_equal(back, want)


# ---------------------------------------------------------------------------------------------
# Preconditions

GOOD = dict(b=np.zeros((16, 16), dtype=np.float32), bias=None, tile_k=16, tile_n=8, ct_k=8)


@pytest.mark.parametrize(("change", "message"), [
    (dict(b=np.zeros(16, dtype=np.float32)), r"B must be 2-D \[K, N\], got shape \(16,\)"),
    (dict(b=np.zeros((16, 16), dtype=np.int32)), "B must be floating point, got dtype int32"),
    (dict(b=np.where(np.eye(16) > 0, np.nan, 0.0)), r"B has 16 non-finite value\(s\) .*is nan at index \[0, 0\]"),
    (dict(b=np.full((16, 16), 1e39)), r"B has 256 non-finite value\(s\) \(as float32\); the first is inf"),
    (dict(bias=np.zeros(15, dtype=np.float32)), r"bias must be \[N=16\], got shape \(15,\)"),
    (dict(bias=np.array([0.0] * 15 + [-np.inf])), r"bias has 1 non-finite .* -inf at index \[15\]"),
    (dict(bias=np.zeros(16, dtype=np.int64)), "bias must be floating point, got dtype int64"),
    (dict(tile_k=32, ct_k=8), "K=16 is not a multiple of tile_k=32"),
    (dict(tile_n=24), "N=16 is not a multiple of tile_n=24"),
    (dict(tile_k=8, ct_k=16), "tile_k=8 is not a multiple of ct_k=16"),
    (dict(tile_k=16, ct_k=4), "ct_k=4 is not a multiple of 8"),
    (dict(b=np.zeros((16, 12), dtype=np.float32), tile_n=4), "tile_n=4 is not a multiple of 8"),
    (dict(tile_k=0), "tile_k must be >= 1, got 0"),
    (dict(ct_k=8.0), "ct_k must be an integer, got 8.0"),
    (dict(tile_n=True), "tile_n must be an integer, got True"),
])
def test_pack_b_refuses(change, message):
    args = {**GOOD, **change}
    with pytest.raises(pack.PackError, match=message):
        pack.pack_b(args["b"], args["bias"], args["tile_k"], args["tile_n"], args["ct_k"])
    assert issubclass(pack.PackError, ValueError)


def test_pack_b_takes_other_float_dtypes():
    b = _nasty(16, 16, seed=5)
    want = pack.pack_b(b, None, 16, 8, 8)
    assert np.array_equal(pack.pack_b(b.astype(np.float64), None, np.int64(16), 8, 8), want)
    half = b.astype(ml_dtypes.bfloat16)
    assert np.array_equal(pack.pack_b(half, None, 16, 8, 8), pack.pack_b(half.astype(np.float32), None, 16, 8, 8))


def test_packed_size():
    assert pack.packed_size(256, 256, 32, True) == 82944
    assert pack.packed_size(1024, 4736, 64, False) == 1024 * 4736 // 8 * 9
    assert pack.packed_size(1024, 4736, 64, True) == 9 * 4736 * (1024 + 64) // 8
    with pytest.raises(pack.PackError, match="packed_size: N=12 is not a multiple of 8"):
        pack.packed_size(16, 12, 8, False)
    with pytest.raises(pack.PackError, match="K must be >= 1, got -8"):
        pack.packed_size(-8, 16, 8, False)


def test_unpack_b_refuses():
    packed = pack.pack_b(_distinct(16, 16), np.ones(16, dtype=np.float32), 16, 8, 8)
    with pytest.raises(pack.PackError, match="431 bytes packed, 432 expected for K=16 N=16 ct_k=8 bias=1"):
        pack.unpack_b(packed[:-1], 16, 16, 16, 8, 8, True)
    with pytest.raises(pack.PackError, match="432 bytes packed, 288 expected .* bias=0"):
        pack.unpack_b(packed, 16, 16, 16, 8, 8, False)
    with pytest.raises(pack.PackError, match="must be uint8 bytes, got dtype int8"):
        pack.unpack_b(packed.view(np.int8), 16, 16, 16, 8, 8, True)
    with pytest.raises(pack.PackError, match="N=16 is not a multiple of tile_n=24"):
        pack.unpack_b(packed, 16, 16, 16, 24, 8, True)
    bad = packed.copy()
    bad[216 + 40] = 1
    with pytest.raises(pack.PackError, match="bias chunk of column block 1 has nonzero padding at byte 256"):
        pack.unpack_b(bad, 16, 16, 16, 8, 8, True)


def test_pack_spec_refuses():
    b = np.zeros((16, 16), dtype=np.float32)
    with pytest.raises(pack.PackError, match="gemm d_s: b_bytes=400, but K=16 N=16 ct_k=8 bias=1 pack to 432 bytes"):
        pack.pack_spec(_spec("d_s", 16, 16, 16, 8, 8, True, 400), b, np.zeros(16, dtype=np.float32))
    with pytest.raises(pack.PackError, match="gemm d_c: bias=1, but a bias was not given"):
        pack.pack_spec(_spec("d_c", 16, 16, 16, 8, 8, True), b)
    with pytest.raises(pack.PackError, match="gemm m_head: bias=0, but a bias was given"):
        pack.pack_spec(_spec("m_head", 16, 16, 16, 8, 8, False), b, np.zeros(16, dtype=np.float32))
    with pytest.raises(pack.PackError, match=r"gemm m_head: B must be \[16, 24\], got shape \(16, 16\)"):
        pack.pack_spec(_spec("m_head", 16, 24, 16, 8, 8, False), b)
    with pytest.raises(pack.PackError, match="gemm x: b_bytes=1"):
        pack.unpack_spec(_spec("x", 16, 16, 16, 8, 8, False, 1), bytes(288))
    spec = _spec("x", 16, 16, 16, 8, 8, False)
    back, none = pack.unpack_spec(spec, pack.pack_spec(spec, _distinct(16, 16)))
    assert none is None and np.array_equal(back, _distinct(16, 16))


# ---------------------------------------------------------------------------------------------
# The 3x3 convolution as a GEMM over overlapping rows


def test_conv_geometry_of_the_neck_conv():
    geom = pack.ConvGeometry.of(3072, 1536, 512)  # d_model 256, P = 2: K = 4D at row stride 2D
    assert (geom.d, geom.p, geom.c, geom.oc) == (768, 2, 256, 256)
    assert (geom.k, geom.lda, geom.n) == (3072, 1536, 512)
    assert geom.rows(288, 288, 256) == 41984  # ceil(288*290/2) = 41760 pixel pairs, up to 164 chunks of 256
    assert geom.rows(3, 5, 4) == 12  # 3*7 = 21 padded pixels, 11 rows of 2, up to 12
    assert geom.y_elems(12) == (12 * 2 + 2) * 768
    assert pack.conv_rows(3, 5, 4, geom) == 12


@pytest.mark.parametrize(("k", "lda", "n", "message"), [
    (3072, 3072, 512, "needs K = lda \\+ 2\\*D with D > 0, got K=3072 lda=3072"),
    (3071, 1536, 512, "needs K = lda \\+ 2\\*D with D > 0, got K=3071 lda=1536"),
    (3068, 1536, 512, r"D=\(K-lda\)/2=766 \(K=3068 lda=1536\) is not 3\*C"),
    (2304, 1000, 512, r"D=\(K-lda\)/2=652 .* is not 3\*C"),
    (2304, 1002, 512, "lda=1002 is not a multiple of D=651"),
    (3072, 1536, 511, "N=511 is not a multiple of P=lda/D=2"),
    (3072, 0, 512, "conv lda must be >= 1, got 0"),
])
def test_conv_geometry_refuses(k, lda, n, message):
    with pytest.raises(pack.PackError, match=message):
        pack.ConvGeometry.of(k, lda, n)


def _direct_conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Oracle: a 3x3 convolution, zero padding 1, [H, W, C] x [OC, C, 3, 3] -> [H, W, OC], tap by tap."""
    h, wd, _ = x.shape
    xp = np.pad(x.astype(np.float64), ((1, 1), (1, 1), (0, 0)))
    out = np.zeros((h, wd, w.shape[0]))
    for dy in range(3):
        for dx in range(3):
            out += xp[dy : dy + h, dx : dx + wd] @ w[:, :, dy, dx].T.astype(np.float64)
    return out


def _gemm_rows(y: np.ndarray, geom: pack.ConvGeometry, rows: int) -> np.ndarray:
    """The A the kernel reads: GEMM row m is Y elements [m*lda, m*lda + K) (overlapping rows)."""
    assert y.size == geom.y_elems(rows)
    return as_strided(y, shape=(rows, geom.k), strides=(geom.lda * y.itemsize, y.itemsize), writeable=False)


@pytest.mark.parametrize(("h", "w", "c", "oc", "p", "m"), [
    (4, 5, 3, 4, 2, 4), (3, 3, 2, 5, 1, 1), (5, 2, 4, 3, 3, 8), (6, 7, 1, 2, 4, 2), (1, 1, 2, 2, 2, 1),
])
def test_conv_through_the_gemm_equals_direct_conv(h, w, c, oc, p, m):
    rng = np.random.default_rng(h * 100 + w * 10 + p)
    x = pack.round_bf16(rng.standard_normal((h, w, c)).astype(np.float32))
    wt = rng.standard_normal((oc, c, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(oc).astype(np.float32)
    band = pack.conv_weights(wt, p)
    geom = pack.ConvGeometry.of(band.shape[0], p * 3 * c, band.shape[1])
    assert (geom.d, geom.p, geom.c, geom.oc) == (3 * c, p, c, oc)
    rows = geom.rows(h, w, m)
    y = pack.from_bf16(pack.conv_input(x, geom, rows))
    c_out = _gemm_rows(y, geom, rows) @ band
    assert c_out.shape == (rows, p * oc)
    got = pack.conv_output(c_out.astype(np.float32), geom, h, w, bias)
    assert np.allclose(got, _direct_conv(x, wt) + bias, rtol=1e-5, atol=1e-5)
    bits = pack.conv_output(pack.to_bf16(c_out), geom, h, w)
    assert np.array_equal(bits, pack.round_bf16(c_out).reshape(-1, oc)[: h * (w + 2)].reshape(h, w + 2, oc)[:, :w])


def test_conv_through_packed_weights():
    # conv_weights -> pack_b -> unpack_b: the GEMM then computes the conv of the weights as the device holds them
    rng = np.random.default_rng(21)
    x = pack.round_bf16(rng.standard_normal((4, 6, 8)).astype(np.float32))
    wt = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    band = pack.conv_weights(wt, 2)  # K = 4*24 = 96, N = 16
    geom = pack.ConvGeometry.of(96, 48, 16)
    device_band, _ = pack.unpack_b(pack.pack_b(band, None, 96, 16, 8), 96, 16, 96, 16, 8, False)
    rows = geom.rows(4, 6, 4)
    got = pack.conv_output(_gemm_rows(pack.from_bf16(pack.conv_input(x, geom, rows)), geom, rows) @ device_band,
                           geom, 4, 6)
    device_wt = np.stack([device_band[dx * 24 : dx * 24 + 24, :8].reshape(3, 8, 8) for dx in range(3)], axis=-1)
    assert np.allclose(got, _direct_conv(x, device_wt.transpose(2, 1, 0, 3)), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, _direct_conv(x, wt), rtol=1e-5, atol=1e-5)  # quantisation is visible


def test_conv_input_rows_by_hand():
    geom = pack.ConvGeometry.of(12, 6, 2)  # C = 1, D = 3, P = 2, OC = 1
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3, 1)  # 2x3 map, pitch Wp = 5
    y = pack.from_bf16(pack.conv_input(x, geom, 6)).reshape(-1, 3)
    # padded frame (4 rows of 5): row 0 zeros; row 1: 0 1 2 3 0; row 2: 0 4 5 6 0; row 3 zeros
    padded = np.zeros((4, 5))
    padded[1:3, 1:4] = x[:, :, 0]
    flat = padded.reshape(-1)
    assert y.shape == (6 * 2 + 2, 3)
    for p in range(10):  # H*Wp = 10 rows: pixels p, p+5, p+10
        assert y[p].tolist() == [flat[p], flat[p + 5], flat[p + 10]]
    assert not y[10:].any()
    assert y[6].tolist() == [1.0, 4.0, 0.0]


def test_conv_input_writes_into_out():
    geom = pack.ConvGeometry.of(12, 6, 2)
    x = np.ones((2, 3, 1), dtype=np.float32)
    out = np.full(geom.y_elems(6), 0xFFFF, dtype=np.uint16)
    assert pack.conv_input(x, geom, 6, out=out) is out
    assert np.array_equal(out, pack.conv_input(x, geom, 6))
    with pytest.raises(pack.PackError, match=r"out must be contiguous uint16 \[42\], got uint16 \(40,\)"):
        pack.conv_input(x, geom, 6, out=np.zeros(40, dtype=np.uint16))
    with pytest.raises(pack.PackError, match="out must be contiguous uint16"):
        pack.conv_input(x, geom, 6, out=np.zeros(84, dtype=np.uint16)[::2])


def test_conv_errors():
    geom = pack.ConvGeometry.of(12, 6, 2)
    with pytest.raises(pack.PackError, match=r"map must be floating \[H, W, 1\], got float64 \(2, 3, 2\)"):
        pack.conv_input(np.zeros((2, 3, 2)), geom, 6)
    with pytest.raises(pack.PackError, match="4 rows of 2 pixels cannot hold 2x5 padded pixels"):
        pack.conv_input(np.zeros((2, 3, 1)), geom, 4)
    with pytest.raises(pack.PackError, match="C must be bf16 bits"):
        pack.conv_output(np.zeros(12, dtype=np.float64), geom, 2, 3)
    with pytest.raises(pack.PackError, match="8 elements of C are not whole rows of 2 covering 2x5 pixels"):
        pack.conv_output(np.zeros(8, dtype=np.uint16), geom, 2, 3)
    with pytest.raises(pack.PackError, match="11 elements of C are not whole rows"):
        pack.conv_output(np.zeros(11, dtype=np.uint16), geom, 1, 3)
    with pytest.raises(pack.PackError, match=r"bias must be \[OC=1\], got shape \(2,\)"):
        pack.conv_output(np.zeros(12, dtype=np.float32), geom, 2, 3, np.zeros(2))
    with pytest.raises(pack.PackError, match="conv map width must be >= 1, got 0"):
        pack.conv_output(np.zeros(12, dtype=np.float32), geom, 2, 0)
    with pytest.raises(pack.PackError, match=r"weight must be floating \[OC, C, 3, 3\], got float32 \(2, 1, 3\)"):
        pack.conv_weights(np.zeros((2, 1, 3), dtype=np.float32), 2)
    with pytest.raises(pack.PackError, match="conv P must be >= 1, got 0"):
        pack.conv_weights(np.zeros((2, 1, 3, 3), dtype=np.float32), 0)
    with pytest.raises(pack.PackError, match="GEMM M must be >= 1, got 0"):
        geom.rows(2, 3, 0)


# ---------------------------------------------------------------------------------------------
# Heads and windows


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
    with pytest.raises(ValueError, match="2x2 windows do not tile"):
        pack.window_partition(grid[:3], 2)
    with pytest.raises(ValueError, match="multiple of 3 heads"):
        pack.split_heads(x, 3)
    with pytest.raises(ValueError, match="5 windows of 4 tokens do not make a 4x6 grid"):
        pack.window_merge(win[:5], 2, 4, 6)


def test_window_order_is_mha_win_layout():
    # mha_win row r: window-head wh = r // win^2, token (wh // heads)*win^2 + r % win^2, head wh % heads
    grid, win, heads, d = 4, 2, 2, 3
    perm = pack.window_perm(grid, win)
    assert perm.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    tokens = np.arange(grid * grid * heads * d, dtype=np.float32).reshape(grid * grid, heads * d)
    wo = tokens[perm]  # window order, each window's tokens contiguous
    mha = pack.split_heads(wo.reshape(-1, win * win, heads * d), heads).reshape(-1, d)
    for r in range(mha.shape[0]):
        wh, si = divmod(r, win * win)
        token, head = (wh // heads) * win * win + si, wh % heads
        assert mha[r].tolist() == wo[token, head * d : head * d + d].tolist()
    with pytest.raises(ValueError, match="3x3 windows do not tile a 4x4 grid"):
        pack.window_perm(4, 3)


# ---------------------------------------------------------------------------------------------
# Wide copies


def test_copy_wide_large_and_small():
    src = np.random.default_rng(4).integers(0, 255, size=3 * pack.COPY_BLOCK + 123, dtype=np.uint8)
    dst = np.zeros_like(src)
    pack.copy_wide(dst, src)
    assert np.array_equal(dst, src)
    small = np.zeros(10, dtype=np.uint16)
    pack.copy_wide(small, np.arange(10, dtype=np.uint16))
    assert small.tolist() == list(range(10))
    with pytest.raises(ValueError, match="holds 20 bytes, source 22"):
        pack.copy_wide(small, np.zeros(11, dtype=np.uint16))
    with pytest.raises(ValueError, match="destination must be contiguous"):
        pack.copy_wide(np.zeros(20, dtype=np.uint16)[::2], np.zeros(10, dtype=np.uint16))


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
