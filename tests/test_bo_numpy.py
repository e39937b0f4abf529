"""Bo and numpy: every numeric dtype and bf16 through write/read/array, ``np.asarray(bo)``, the buffer protocol,
the bf16 conversions straight into and out of the mapping (bits checked against ``sam3.pack.to_bf16`` and an
integer derivation), and when the copy pool is used."""

from __future__ import annotations

import errno
import math
import sys

import ml_dtypes
import numpy as np
import pytest

from amdxdna_direct import bo as bo_mod
from amdxdna_direct import errors
from sam3.pack import to_bf16

BF16 = np.dtype(ml_dtypes.bfloat16)

NUMERIC = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
           np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128, ml_dtypes.bfloat16,
           ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4, np.dtype("<i4,<f2")]


def _values(dtype, n: int = 37) -> np.ndarray:
    """n items of dtype whose bytes are all different from zero-filled memory (random bytes, NaN-free floats)."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(dt.itemsize * 131 + n)
    if dt.kind in "fc" or dt in (BF16, np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
        return (rng.standard_normal(n) * 3 + 1).astype(dt)
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(dt)
    if dt.names:
        return np.frombuffer(rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).tobytes(), dt)
    return rng.integers(-8 if dt == np.dtype(ml_dtypes.int4) else 0, 8 if dt.itemsize == 1 and dt.kind == "V"
                        else 120, n).astype(dt)


# ---- every dtype through write / read / array -------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: str(np.dtype(d)))
def test_every_numeric_dtype_round_trips_through_write_read_and_array(device, dtype):
    data = _values(dtype)
    bo = device.bo(4096)
    assert bo.write(data, offset=64) == data.nbytes
    assert bo.read(data.nbytes, offset=64) == data.tobytes()               # the bytes numpy itself gives
    back = bo.read(offset=64, dtype=dtype, count=data.size)
    assert back.dtype == data.dtype and back.tobytes() == data.tobytes()
    view = bo.array(dtype, count=data.size, offset=64)
    assert view.tobytes() == data.tobytes() and view.dtype == data.dtype
    assert bo.read(data.nbytes, offset=64, dtype=dtype).size == data.size  # size in bytes -> count implied


def test_bf16_round_trip_views_and_zero_copy(device):
    x = np.array([1.0, -2.5, 3.140625, 65280.0, -0.0, np.inf], np.float32).astype(ml_dtypes.bfloat16)
    bo = device.bo(256)
    bo.write(x, offset=8)
    view = bo.array(ml_dtypes.bfloat16, count=6, offset=8)
    assert view.dtype == BF16 and np.array_equal(view.view(np.uint16), x.view(np.uint16))
    view[0] = 7.0                                                           # the view is the memory
    assert bo.read(2, offset=8) == np.array([7.0], ml_dtypes.bfloat16).tobytes()
    assert bo.array(BF16, shape=(2, 3), offset=8).shape == (2, 3)
    got = bo.read(offset=8, dtype=ml_dtypes.bfloat16, count=6)
    assert got.astype(np.float32).tolist() == [7.0, -2.5, 3.140625, 65280.0, -0.0, np.inf]
    bo.write(x[::2])                                                        # a strided bf16 array is gathered
    assert bo.read(6) == x[::2].tobytes()


def test_write_with_a_dtype_converts_same_kind_only(device):
    bo = device.bo(4096)
    bo.write(np.arange(5, dtype=np.int64), dtype=np.float32)
    assert bo.read(dtype=np.float32, count=5).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    f = np.array([1.0, 1.00390625, 1.01171875], np.float32)                # a tie (even: down), a tie (odd: up)
    assert bo.write(f, 100, dtype=ml_dtypes.bfloat16) == 6
    assert bo.read(offset=100, dtype=np.uint16, count=3).tolist() == to_bf16(f).tolist() == [0x3F80, 0x3F80, 0x3F82]
    bo.write(f, 200, dtype=np.float32)                                      # same dtype: the bytes as they are
    assert bo.read(12, 200) == f.tobytes()
    with pytest.raises(TypeError, match=r"cannot store float32 data as int32 \(not a same-kind cast"):
        bo.write(f, dtype=np.int32)


# ---- np.asarray and the buffer protocol --------------------------------------------------------------


def test_asarray_is_a_zero_copy_uint8_view_honouring_dtype_and_copy(device):
    bo = device.bo(100)
    arr = np.asarray(bo)
    assert arr.dtype == np.uint8 and arr.shape == (100,)
    arr[:4] = [1, 2, 3, 250]
    assert bo.read(4) == bytes([1, 2, 3, 250])                              # same memory
    assert np.array(bo, copy=False).ctypes.data == bo.cpu_address
    copied = np.array(bo, copy=True)
    copied[0] = 99
    assert bo.read(1) == b"\x01"
    as_float = np.asarray(bo, dtype=np.float32)                             # each byte's value, as for bytearray
    assert as_float[:4].tolist() == [1.0, 2.0, 3.0, 250.0]
    assert np.array_equal(as_float, np.asarray(bytearray(bo.read()), dtype=np.float32))
    if sys.version_info < (3, 12):                                          # 3.12 takes the buffer protocol
        with pytest.raises(ValueError, match=r"dtype=float32, copy=False\): a Bo is an array of uint8 bytes"):
            bo.__array__(np.float32, copy=False)
    assert bo.__array__(np.uint8, copy=False).ctypes.data == bo.cpu_address


def test_view_is_a_writable_zero_copy_memoryview(device):
    bo = device.bo(64)
    mv = bo.view()
    assert isinstance(mv, memoryview) and mv.nbytes == 64 and not mv.readonly and mv.format == "B"
    mv[3] = 0x5A
    assert bo.read(1, 3) == b"\x5a"
    part = bo.view(8, 4)
    part[:] = b"wxyz"
    assert bo.read(4, 8) == b"wxyz" and bytes(part) == b"wxyz"
    with pytest.raises(ValueError, match=r"view: 60 bytes at offset 8 do not fit the 64-byte buffer"):
        bo.view(8, 60)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="memoryview(obj) of a Python class needs PEP 688 "
                    "(Python >= 3.12); bo.view() is the same view on 3.11")
def test_memoryview_of_a_bo_uses_the_buffer_protocol(device):
    bo = device.bo(32)
    with memoryview(bo) as mv:
        mv[:3] = b"abc"
        assert mv.nbytes == 32
    assert bo.read(3) == b"abc"
    assert bytes(bo)[:3] == b"abc" and np.frombuffer(bo, np.uint8)[:3].tobytes() == b"abc"


def test_a_closed_buffer_refuses_every_numpy_path(device):
    bo = device.bo(64)
    bo.close()
    for call in (lambda: np.asarray(bo), bo.view, lambda: bo.write_bf16(np.ones(2, np.float32)),
                 lambda: bo.read_f32_from_bf16(2), lambda: bo.read(dtype=np.uint16, count=1),
                 lambda: bo.write(b"ab")):
        with pytest.raises(errors.XdnaError, match="buffer is closed") as info:
            call()
        assert info.value.errno == errno.EBADF


# ---- sizes and dtypes in the messages -----------------------------------------------------------------


def test_messages_say_sizes_and_dtypes(device):
    bo = device.bo(64)
    with pytest.raises(ValueError, match=r"write: 15 x float32 \(60 bytes\) at offset 8 do not fit the "
                                         r"64-byte buffer \(56 bytes from there\)"):
        bo.write(np.zeros(15, np.float32), offset=8)
    with pytest.raises(ValueError, match=r"write_bf16: 30 x bfloat16 \(60 bytes\) at offset 8 do not fit"):
        bo.write_bf16(np.zeros(30, np.float32), offset=8)
    with pytest.raises(ValueError, match=r"array of 3 x bfloat16 \(6 bytes\) at offset 60 exceeds the 64-byte"):
        bo.array(ml_dtypes.bfloat16, count=3, offset=60)
    with pytest.raises(ValueError, match=r"read: size 6 bytes is not a whole number of float32 items \(4 bytes"):
        bo.read(6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"count=3 x float32 \(12 bytes\) contradicts size=8 bytes"):
        bo.read(8, dtype=np.float32, count=3)
    with pytest.raises(ValueError, match=r"read_f32_from_bf16: 40 x bfloat16 \(80 bytes\) at offset 0 do not fit"):
        bo.read_f32_from_bf16(40)
    with pytest.raises(ValueError, match="out holds 4 float32 items, count is 3"):
        bo.read_f32_from_bf16(3, out=np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="out must be a writable C-contiguous float32 array, got float64 array"):
        bo.read_f32_from_bf16(3, out=np.zeros(3))
    with pytest.raises(TypeError, match=r"data of dtype object has no fixed-size bytes"):
        bo.write(np.array([object()]))
    with pytest.raises(TypeError, match="write_bf16: expected real numbers .* got complex64"):
        bo.write_bf16(np.ones(2, np.complex64))
    with pytest.raises(TypeError, match="read: count needs a dtype"):
        bo.read(count=2)
    with pytest.raises(TypeError, match="'not-a-dtype' is not a numpy dtype"):
        bo.read(dtype="not-a-dtype")
    with pytest.raises(TypeError, match="write: data must be bytes-like or a numpy array, got str"):
        bo.write("text")


# ---- bf16 conversions: the bits of sam3.pack.to_bf16 ----------------------------------------------------

EDGE_BITS = np.array([
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,              # +-0, +-inf
    0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF,  # NaNs: payloads, quiet bit, sign
    0x7F810000, 0x7FBF8000, 0xFFA12345,
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,              # ties to even (down, up), either side of a tie
    0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,              # past the largest bf16 -> inf, the last ties
    0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807FFFFF,  # subnormals, their ties
    0x00800000, 0x3F800000, 0x4049_0FDB, 0xC2F6_E979,
], dtype=np.uint32)


def _integer_rne(u: np.ndarray) -> np.ndarray:
    """An independent derivation: add 0x7FFF plus the kept bit's parity, drop 16 bits; NaN -> top bits | 0x40."""
    u = u.astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def test_write_bf16_matches_to_bf16_on_edge_values(device):
    f = EDGE_BITS.view(np.float32)
    bo = device.bo(4096)
    assert bo.write_bf16(f, offset=4) == 2 * f.size
    got = bo.read(offset=4, dtype=np.uint16, count=f.size)
    assert got.tolist() == to_bf16(f).tolist() == _integer_rne(EDGE_BITS).tolist()
    assert got[4:12].tolist() == [0x7FC0, 0x7FC0, 0x7FFF, 0xFFC0, 0xFFFF, 0x7FC1, 0x7FFF, 0xFFE1]
    assert got[16] == 0x7F80 and got[12] == 0x3F80 and got[13] == 0x3F82


def test_write_bf16_matches_to_bf16_on_random_bits_and_other_dtypes(device):
    u = np.random.default_rng(16).integers(0, 1 << 32, 200_001, dtype=np.uint32)
    f = u.view(np.float32)
    bo = device.bo(1 << 20)
    bo.write_bf16(f)
    assert np.array_equal(bo.read(dtype=np.uint16, count=f.size), to_bf16(f))
    assert np.array_equal(bo.read(dtype=np.uint16, count=f.size), _integer_rne(u))
    for other in (np.random.default_rng(1).standard_normal(999) * 1e3, np.arange(-500, 499, dtype=np.int32),
                  np.array([True, False]), np.array([1e39, -1e39, 3.0000001], np.float64),
                  np.array([1.5, 2.0], np.float16)):
        bo.write_bf16(other, offset=64)
        with np.errstate(over="ignore"):                                     # to_bf16 warns on 1e39 -> inf
            want = to_bf16(other)
        assert np.array_equal(bo.read(offset=64, dtype=np.uint16, count=other.size), want), other.dtype
    b = np.array([1, 2], np.float32).astype(ml_dtypes.bfloat16)                  # bf16 in: copied as it is
    bo.write_bf16(b)
    assert bo.read(4) == b.tobytes()
    with bo_mod.np.errstate(all="raise"):                                    # no warning leaks from the cast
        bo.write_bf16(np.array([0x7FC12345, 0x7F7FFFFF], np.uint32).view(np.float32))   # NaN, rounds to inf
    assert bo.read(4).hex() == "c17f807f"


def test_read_f32_from_bf16_is_exact_for_every_pattern(device):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bo = device.bo(1 << 17)
    bo.write(bits)
    got = bo.read_f32_from_bf16()
    assert got.dtype == np.float32 and got.size == 1 << 16
    assert np.array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)   # NaN payloads kept
    out = np.full(10, -1.0, np.float32)
    assert bo.read_f32_from_bf16(out=out, offset=2 * 0x3F80) is out and out[0] == 1.0
    assert device.stats["bytes_out"] == (1 << 17) + 20


def test_copies_count_bytes(device):
    bo = device.bo(4096)
    before_in, before_out = device.stats["bytes_in"], device.stats["bytes_out"]
    bo.write(np.zeros(10, np.float32))
    bo.write_bf16(np.zeros(10, np.float32))
    bo.read(dtype=BF16, count=7)
    bo.read_f32_from_bf16(5)
    assert device.stats["bytes_in"] - before_in == 60 and device.stats["bytes_out"] - before_out == 24


# ---- the copy pool: below the thresholds no hand-off; above, whole parts --------------------------------


class _RecordingPool:
    def __init__(self):
        self.parts: list[tuple[int, int]] = []

    def submit(self, fn, *args):
        from concurrent.futures import Future
        self.parts.append(args[1:])
        done: Future[None] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed back as the pool would
            done.set_exception(exc)
        return done


@pytest.fixture
def pool(monkeypatch):
    recorder = _RecordingPool()
    monkeypatch.setattr(bo_mod, "copy_pool", lambda: recorder)
    monkeypatch.setattr(bo_mod, "COPY_WORKERS", 3)
    return recorder


def test_small_copies_stay_on_the_calling_thread(device, pool):
    bo = device.bo(1 << 17)
    x = np.random.default_rng(3).standard_normal(1 << 15).astype(np.float32)      # 64 KiB of bf16
    bo.write_bf16(x)
    bo.read_f32_from_bf16(x.size)
    bo.write(np.zeros(1 << 16, np.uint8))
    bo.read(dtype=np.uint8)
    assert pool.parts == []


def test_large_copies_split_in_parts_over_the_pool_with_nans_anywhere(device, pool):
    n = 2 * bo_mod.POOL_MIN_ELEMENTS + 12_345                                # 3 parts of at least half the minimum
    u = np.random.default_rng(5).integers(0, 1 << 32, n, dtype=np.uint32)
    u[[0, n // 3, n // 3 + 1, n - 1]] = [0x7F800001, 0xFFFFFFFF, 0x7FBF8000, 0x7FC12345]
    bo = device.bo(4 * n)
    bo.write_bf16(u.view(np.float32))
    step = math.ceil(math.ceil(n / 3) / bo_mod._ALIGN) * bo_mod._ALIGN
    assert pool.parts == [(step, 2 * step), (2 * step, n)]                  # the caller ran [0, step)
    assert np.array_equal(bo.read(dtype=np.uint16, count=n), to_bf16(u.view(np.float32)))
    pool.parts.clear()
    wide = bo.read_f32_from_bf16(n)
    assert len(pool.parts) == 2
    assert np.array_equal(wide.view(np.uint32), to_bf16(u.view(np.float32)).astype(np.uint32) << 16)
    pool.parts.clear()
    raw = np.random.default_rng(6).integers(0, 256, bo_mod.POOL_MIN_BYTES + 3, dtype=np.uint8)
    big = device.bo(raw.size)
    big.write(raw)                                                          # 2 parts: one on the pool
    assert len(pool.parts) == 1 and big.read() == raw.tobytes()


def test_a_failing_part_is_raised_after_every_part_finished(device, pool):
    seen = []

    def part(a, b):
        seen.append((a, b))
        if a:
            raise RuntimeError(f"part {a} failed")

    with pytest.raises(RuntimeError, match="part .* failed"):
        bo_mod._split(2 * bo_mod.POOL_MIN_BYTES, bo_mod.POOL_MIN_BYTES, part)
    assert len(seen) == 3


def test_module_copy_functions_check_their_arrays():
    with pytest.raises(ValueError, match=r"store_bf16: destination must be a 1-D contiguous uint16 array, got a "
                                         r"float32 array of shape \(4,\)"):
        bo_mod.store_bf16(np.zeros(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="load_bf16: destination holds 3 x float32, source 4 x uint16"):
        bo_mod.load_bf16(np.zeros(3, np.float32), np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="copy_bytes: source must be a 1-D contiguous uint8 array"):
        bo_mod.copy_bytes(np.zeros(4, np.uint8), np.zeros(4, np.uint8)[::1].reshape(2, 2))
    with pytest.raises(TypeError, match="store_bf16: expected real numbers, got complex128"):
        bo_mod.store_bf16(np.zeros(2, np.uint16), np.zeros(2, complex))
    out = np.zeros(3, np.uint16)
    bo_mod.store_bf16(out, np.array([1.0, -2.0, np.nan], np.float32))
    assert out.tolist() == [0x3F80, 0xC000, 0x7FC0]
