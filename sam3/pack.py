"""Host-side data preparation for the NPU kernels (docs/sam3-packing.md).

bf16 conversion, the bfp16ebs8 packing of GEMM B operands in `flm.GEMM`'s tile order (with the optional
bias chunk), its decoder, the host half of the overlapping-row 3x3 convolution, head and window reshuffles
for attention, and the wide parallel copy that moves data into and out of uncached BO mappings.
"""

from __future__ import annotations

import math
import operator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, SupportsIndex

import ml_dtypes
import numpy as np

from amdxdna_direct.bo import COPY_WORKERS, copy_pool
from amdxdna_direct.errors import Error

BF16_BYTES = 2
BLOCK = 8  # values per bfp16ebs8 block, consecutive along k (docs/sam3-packing.md 2)
BLOCK_BYTES = 9  # the shared exponent, then 8 int8 mantissas
EXP_OFFSET = 133  # value = mantissa * 2^(E - EXP_OFFSET) (docs/sam3-packing.md 2.3)

# Blocks of 4 MiB keep each worker streaming whole cache lines through the uncached mapping (the
# seed copies 64 Ki-element rows per task); below two blocks a single memcpy is faster than a pool.
COPY_BLOCK = 1 << 22
_COPY_WORKERS = COPY_WORKERS

# The encoder works on slabs of about this many values, so its float64 temporaries stay in cache.
_ENCODE_SLAB = 1 << 16


class PackError(Error, ValueError):
    """A B operand, bias, tiling or convolution geometry that the packing rules refuse."""


def round_up(x: int, m: int) -> int:
    """The smallest multiple of `m` that is >= `x`."""
    return -(-x // m) * m


# ---------------------------------------------------------------------------------------------
# bf16 (docs/sam3-packing.md 1)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float values -> bf16 bit patterns (uint16, same shape), rounded to nearest even.

    A NaN keeps its top 16 bits with the quiet bit set (`| 0x40`), so no NaN rounds to an infinity
    (docs/sam3-packing.md 1).
    """
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        out = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = (x[nan].view(np.uint32) >> 16).astype(np.uint16) | 0x40
    return out


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16, or an ml_dtypes bfloat16 array) -> float32 (exact: a 16-bit left shift).

    Raises:
        TypeError: any other dtype.
    """
    arr = np.asarray(bits)
    if arr.dtype == ml_dtypes.bfloat16:
        arr = arr.view(np.uint16)
    elif arr.dtype != np.uint16:
        raise TypeError(f"from_bf16: expected uint16 bit patterns or bfloat16, got {arr.dtype}")
    return (arr.astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """`x` rounded to the nearest bf16 value, as float32 (what the device sees of a host tensor)."""
    return from_bf16(to_bf16(x))


# ---------------------------------------------------------------------------------------------
# bfp16ebs8 blocks (docs/sam3-packing.md 2)


def _encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encodes finite float32 `x` [R, 8, C] (each x[r, :, c] one block): E [R, C] uint8, mantissas [R, 8, C] int8.

    Exactly the reference's integer rule, computed in float64 (docs/sam3-packing.md 2.4): the mantissa is
    the value scaled by 2^(133 - E), rounded half to even; a subnormal, whose biased exponent the rule
    takes as 0 rather than 1, scales by one more half; a value 32 or more binades below E takes -1 if its
    sign bit is set, else 0; the result saturates to int8.
    """
    rows, _, cols = x.shape
    exps = np.empty((rows, cols), dtype=np.uint8)
    mants = np.empty(x.shape, dtype=np.int8)
    step = max(1, _ENCODE_SLAB // (BLOCK * max(cols, 1)))
    for r0 in range(0, rows, step):
        xs = x[r0 : r0 + step]
        bits = xs.view(np.uint32)
        e = ((bits >> 23) & 0xFF).astype(np.int16)
        big = e.max(axis=1)
        exps[r0 : r0 + step] = big
        y = xs.astype(np.float64)
        y *= np.ldexp(1.0, EXP_OFFSET - big.astype(np.int32))[:, None, :]
        np.multiply(y, 0.5, out=y, where=e == 0)
        np.rint(y, out=y)
        far = e <= big[:, None, :] - 32
        if far.any():
            y[far] = -(bits[far] >> 31).astype(np.float64)
        np.clip(y, -128, 127, out=y)
        mants[r0 : r0 + step] = y
    return exps, mants


def encode_blocks(values: np.ndarray) -> np.ndarray:
    """Encodes float values [..., 8] as bfp16ebs8 blocks [..., 9] uint8 (byte 0 = E, bytes 1..8 = int8).

    Raises:
        PackError: the last axis is not 8, the dtype is not floating, or a value is not finite.
    """
    x = _finite_f32(values, "encode_blocks: values")
    if x.ndim == 0 or x.shape[-1] != BLOCK:
        raise PackError(f"encode_blocks: values must be [..., {BLOCK}], got shape {x.shape}")
    lead = x.shape[:-1]
    flat = np.ascontiguousarray(x.reshape(-1, BLOCK).T)[None]
    exps, mants = _encode(flat)
    out = np.empty((flat.shape[2], BLOCK_BYTES), dtype=np.uint8)
    out[:, 0] = exps[0]
    out[:, 1:] = mants[0].T.view(np.uint8)
    return out.reshape(*lead, BLOCK_BYTES)


def decode_blocks(blocks: np.ndarray) -> np.ndarray:
    """Decodes bfp16ebs8 blocks [..., 9] (uint8) to float32 [..., 8]: value = int8 * 2^(E - 133) (exact).

    Raises:
        PackError: the dtype is not uint8 or the last axis is not 9.
    """
    b = np.asarray(blocks)
    if b.dtype != np.uint8 or b.ndim == 0 or b.shape[-1] != BLOCK_BYTES:
        raise PackError(f"decode_blocks: expected uint8 [..., {BLOCK_BYTES}], got {b.dtype} {b.shape}")
    mants = np.ascontiguousarray(b[..., 1:]).view(np.int8).astype(np.float32)
    return np.ldexp(mants, b[..., :1].astype(np.int32) - EXP_OFFSET)


# ---------------------------------------------------------------------------------------------
# The packed B operand (docs/sam3-packing.md 3)


def _int(name: str, value: object, minimum: int = 1) -> int:
    """`value` as an int >= `minimum` (numpy integers accepted, bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise PackError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise PackError(f"{name} must be an integer, got {value!r}") from None
    if v < minimum:
        raise PackError(f"{name} must be >= {minimum}, got {v}")
    return v


def check_tiles(k: int, n: int, tile_k: int, tile_n: int, ct_k: int) -> None:
    """Checks the tiling preconditions of a K x N B operand (docs/sam3-packing.md 3.1).

    Raises:
        PackError: a size is not a positive integer, or K % tile_k, N % tile_n, tile_k % ct_k,
            ct_k % 8 or tile_n % 8 is not zero (the message names the values).
    """
    k, n = _int("K", k), _int("N", n)
    tile_k, tile_n, ct_k = _int("tile_k", tile_k), _int("tile_n", tile_n), _int("ct_k", ct_k)
    rules = (
        (k % tile_k, f"K={k} is not a multiple of tile_k={tile_k}"),
        (n % tile_n, f"N={n} is not a multiple of tile_n={tile_n}"),
        (tile_k % ct_k, f"tile_k={tile_k} is not a multiple of ct_k={ct_k}"),
        (ct_k % BLOCK, f"ct_k={ct_k} is not a multiple of {BLOCK}"),
        (tile_n % BLOCK, f"tile_n={tile_n} is not a multiple of {BLOCK}"),
    )
    for bad, message in rules:
        if bad:
            raise PackError(f"B tiling: {message}")


def packed_size(k: int, n: int, ct_k: int, bias: bool) -> int:
    """Bytes of a packed K x N B: 9*N*(K + ct_k*bias)/8 (docs/sam3-packing.md 3.4).

    Raises:
        PackError: a size is not a positive integer, or K, N or ct_k is not a multiple of 8.
    """
    k, n, ct_k = _int("K", k), _int("N", n), _int("ct_k", ct_k)
    for name, v in (("K", k), ("N", n), ("ct_k", ct_k)):
        if v % BLOCK:
            raise PackError(f"packed_size: {name}={v} is not a multiple of {BLOCK}")
    return BLOCK_BYTES * n * (k + (ct_k if bias else 0)) // BLOCK


def _finite_f32(a: object, what: str) -> np.ndarray:
    """`a` as float32, refusing non-floating dtypes and NaN/inf (docs/sam3-packing.md 2.5)."""
    arr = np.asarray(a)
    if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype == ml_dtypes.bfloat16):
        raise PackError(f"{what} must be floating point, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):
        arr = arr.astype(np.float32, copy=False)
    finite = np.isfinite(arr)
    if not finite.all():
        where = np.argwhere(~finite)
        first = tuple(int(i) for i in where[0])
        raise PackError(f"{what} has {len(where)} non-finite value(s) (as float32); the first is "
                        f"{arr[first]} at index {list(first)}")
    return arr


def pack_b(b: np.ndarray, bias: np.ndarray | None, tile_k: int, tile_n: int, ct_k: int) -> np.ndarray:
    """Packs a row-major B [K, N] (C = A @ B) and an optional bias [N] for `flm.GEMM` (docs/sam3-packing.md 3).

    The result is byte-identical to the reference packer: per column block of tile_n columns, the bias
    chunk (when `bias` is given), then K*tile_n/8 bfp16ebs8 blocks in the (kb, ks, tb, i, t_in) order.

    Raises:
        PackError: B is not a 2-D floating array, the bias is not a floating [N] vector, a value of either
            is NaN or infinite, or the tiling preconditions fail (`check_tiles`).
    """
    mat = _finite_f32(b, "pack_b: B")
    if mat.ndim != 2:
        raise PackError(f"pack_b: B must be 2-D [K, N], got shape {mat.shape}")
    k, n = mat.shape
    check_tiles(k, n, tile_k, tile_n, ct_k)
    vec = None
    if bias is not None:
        vec = _finite_f32(bias, "pack_b: bias")
        if vec.shape != (n,):
            raise PackError(f"pack_b: bias must be [N={n}], got shape {vec.shape}")
    ncb, chunk, payload = n // tile_n, _chunk_bytes(tile_n, ct_k, vec is not None), k * tile_n // BLOCK * BLOCK_BYTES
    out = np.empty((ncb, chunk + payload), dtype=np.uint8)
    if vec is not None:
        out[:, : 2 * tile_n] = to_bf16(vec).astype("<u2").reshape(ncb, tile_n).view(np.uint8)
        out[:, 2 * tile_n : chunk] = 0
    exps, mants = _encode(np.ascontiguousarray(mat).reshape(k // BLOCK, BLOCK, n))
    slots = _payload_view(out[:, chunk:], k, tile_k, tile_n, ct_k)
    # (kb, ks, i, s_in) x (cb, tb, t_in) -> (cb, kb, ks, tb, i, t_in, s_in) (docs/sam3-packing.md 3.3)
    dims = (k // tile_k, tile_k // ct_k, ct_k // BLOCK, BLOCK, ncb, tile_n // BLOCK, BLOCK)
    slots[..., 1:] = mants.reshape(dims).transpose(4, 0, 1, 5, 2, 6, 3).view(np.uint8)
    slots[..., 0] = exps.reshape(dims[:3] + dims[4:]).transpose(3, 0, 1, 4, 2, 5)
    return out.reshape(-1)


def _chunk_bytes(tile_n: int, ct_k: int, bias: bool) -> int:
    """Size of a column block's bias chunk: one k-slice of blocks (docs/sam3-packing.md 3.2)."""
    return ct_k * tile_n // BLOCK * BLOCK_BYTES if bias else 0


def _payload_view(payload: np.ndarray, k: int, tile_k: int, tile_n: int, ct_k: int) -> np.ndarray:
    """The payload of every column block [cb, bytes] as [cb, kb, ks, tb, i, t_in, 9]."""
    return payload.reshape(payload.shape[0], k // tile_k, tile_k // ct_k, tile_n // BLOCK, ct_k // BLOCK,
                           BLOCK, BLOCK_BYTES)


def unpack_b(packed: np.ndarray | bytes, k: int, n: int, tile_k: int, tile_n: int, ct_k: int,
             bias: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Decodes a packed B: (B float32 [K, N], bias float32 [N] or None), exactly what the device reads.

    Raises:
        PackError: the tiling preconditions fail, `packed` is not uint8/bytes, its length is not
            `packed_size(k, n, ct_k, bias)`, or a bias chunk's padding is not zero (a sign of another tiling).
    """
    check_tiles(k, n, tile_k, tile_n, ct_k)
    if isinstance(packed, (bytes, bytearray, memoryview)):
        packed = np.frombuffer(packed, dtype=np.uint8)
    raw = np.asarray(packed)
    if raw.dtype != np.uint8:
        raise PackError(f"unpack_b: packed B must be uint8 bytes, got dtype {raw.dtype}")
    want = packed_size(k, n, ct_k, bias)
    if raw.size != want:
        raise PackError(f"unpack_b: {raw.size} bytes packed, {want} expected for K={k} N={n} ct_k={ct_k} "
                        f"bias={int(bool(bias))}")
    ncb, chunk = n // tile_n, _chunk_bytes(tile_n, ct_k, bias)
    cols = raw.reshape(ncb, -1)
    vec = None
    if bias:
        pad = cols[:, 2 * tile_n : chunk]
        if pad.any():
            cb, at = (int(i) for i in np.argwhere(pad)[0])
            raise PackError(f"unpack_b: bias chunk of column block {cb} has nonzero padding at byte "
                            f"{cb * cols.shape[1] + 2 * tile_n + at} (tile_n={tile_n} ct_k={ct_k} wrong?)")
        vec = from_bf16(np.ascontiguousarray(cols[:, : 2 * tile_n]).view("<u2").astype(np.uint16).reshape(-1))
    vals = decode_blocks(_payload_view(cols[:, chunk:], k, tile_k, tile_n, ct_k))
    # (cb, kb, ks, tb, i, t_in, s_in) -> (kb, ks, i, s_in) x (cb, tb, t_in)
    mat = np.ascontiguousarray(vals.transpose(1, 2, 4, 6, 0, 3, 5)).reshape(k, n)
    return mat, vec


class GemmTiling(Protocol):
    """What `pack_spec`/`unpack_spec` read of a GEMM record (the bundle's GemmSpec has these fields)."""

    key: str
    k: int
    n: int
    tile_k: int
    tile_n: int
    ct_k: int
    bias: bool
    b_bytes: int


def _check_b_bytes(spec: GemmTiling) -> int:
    size = packed_size(spec.k, spec.n, spec.ct_k, spec.bias)
    if size != spec.b_bytes:
        raise PackError(f"gemm {spec.key}: b_bytes={spec.b_bytes}, but K={spec.k} N={spec.n} ct_k={spec.ct_k} "
                        f"bias={int(bool(spec.bias))} pack to {size} bytes")
    return size


def pack_spec(spec: GemmTiling, b: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """`pack_b` with a GEMM record's tiling, checking B's shape, the bias's presence and b_bytes.

    Raises:
        PackError: B is not [spec.k, spec.n], a bias is given to a bias=0 GEMM or missing for a bias=1
            one, b_bytes disagrees with the tiling, or `pack_b` refuses the data.
    """
    _check_b_bytes(spec)
    shape = np.shape(b)
    if shape != (spec.k, spec.n):
        raise PackError(f"gemm {spec.key}: B must be [{spec.k}, {spec.n}], got shape {shape}")
    if (bias is not None) != bool(spec.bias):
        raise PackError(f"gemm {spec.key}: bias={int(bool(spec.bias))}, but a bias was "
                        f"{'given' if bias is not None else 'not given'}")
    return pack_b(b, bias, spec.tile_k, spec.tile_n, spec.ct_k)


def unpack_spec(spec: GemmTiling, packed: np.ndarray | bytes) -> tuple[np.ndarray, np.ndarray | None]:
    """`unpack_b` with a GEMM record's tiling, checking b_bytes against the tiling first.

    Raises:
        PackError: b_bytes disagrees with the tiling, or `unpack_b` refuses the bytes.
    """
    _check_b_bytes(spec)
    return unpack_b(packed, spec.k, spec.n, spec.tile_k, spec.tile_n, spec.ct_k, spec.bias)


# ---------------------------------------------------------------------------------------------
# The 3x3 convolution as a GEMM over overlapping rows (docs/sam3-packing.md 4)


@dataclass(frozen=True)
class ConvGeometry:
    """One overlapping-row convolution: D = 3*C wide Y rows, P output pixels per GEMM row, OC channels out.

    K = (P+2)*D, lda = P*D, N = P*OC (docs/sam3-packing.md 4.1).
    """

    d: int
    p: int
    c: int
    oc: int

    @classmethod
    def of(cls, k: int, lda: int, n: int) -> ConvGeometry:
        """Recovers D, P, C and OC from a conv GEMM's K, lda and N.

        Raises:
            PackError: a size is not a positive integer, lda >= K, K - lda is odd, D is not a multiple
                of 3, lda is not a multiple of D, or N is not a multiple of P.
        """
        k, lda, n = _int("conv K", k), _int("conv lda", lda), _int("conv N", n)
        if lda >= k or (k - lda) % 2:
            raise PackError(f"conv GEMM needs K = lda + 2*D with D > 0, got K={k} lda={lda}")
        d = (k - lda) // 2
        if d % 3:
            raise PackError(f"conv GEMM D=(K-lda)/2={d} (K={k} lda={lda}) is not 3*C")
        if lda % d:
            raise PackError(f"conv GEMM lda={lda} is not a multiple of D={d} (K={k})")
        p = lda // d
        if n % p:
            raise PackError(f"conv GEMM N={n} is not a multiple of P=lda/D={p}")
        return cls(d=d, p=p, c=d // 3, oc=n // p)

    @property
    def k(self) -> int:
        return (self.p + 2) * self.d

    @property
    def lda(self) -> int:
        return self.p * self.d

    @property
    def n(self) -> int:
        return self.p * self.oc

    def rows(self, h: int, w: int, m: int) -> int:
        """GEMM rows for an h x w map: round_up(ceil(h*(w+2)/P), m).

        Raises:
            PackError: h, w or m is not a positive integer.
        """
        h, w, m = _int("conv map height", h), _int("conv map width", w), _int("GEMM M", m)
        return round_up(math.ceil(h * (w + 2) / self.p), m)

    def y_elems(self, rows: int) -> int:
        """Elements (bf16) of Y, the conv's A buffer, for `rows` GEMM rows: (rows*P + 2)*D.

        Raises:
            PackError: rows is not a positive integer.
        """
        return (_int("conv rows", rows) * self.p + 2) * self.d


def conv_rows(h: int, w: int, m: int, geom: ConvGeometry) -> int:
    """GEMM rows of an h x w map for `geom` with the kernel's M (`ConvGeometry.rows`).

    Raises:
        PackError: h, w or m is not a positive integer.
    """
    return geom.rows(h, w, m)


def conv_input(x: np.ndarray, geom: ConvGeometry, rows: int, out: np.ndarray | None = None) -> np.ndarray:
    """Builds Y, the conv's A, as bf16 bits: ((rows*P + 2) * D) elements (docs/sam3-packing.md 4.2).

    Row p (D wide) is the zero-bordered map's pixels p, p+Wp and p+2*Wp (Wp = W+2), C channels each; rows
    from H*Wp on are zero. With `out` (a uint16 array of exactly that many elements, e.g. a BO's view) Y is
    written there, whole, and `out` is returned.

    Raises:
        PackError: x is not a floating [H, W, C] map, rows is too small for it, or `out` is not uint16 of
            the right size.
    """
    img = np.asarray(x)
    if img.ndim != 3 or img.shape[2] != geom.c or not np.issubdtype(img.dtype, np.floating):
        raise PackError(f"conv_input: map must be floating [H, W, {geom.c}], got {img.dtype} {img.shape}")
    h, w, c = img.shape
    wp, total = w + 2, geom.y_elems(rows)
    if rows * geom.p < h * wp:
        raise PackError(f"conv_input: {rows} rows of {geom.p} pixels cannot hold {h}x{wp} padded pixels")
    if out is None:
        y = np.empty(total, dtype=np.uint16)
    else:
        if out.dtype != np.uint16 or out.size != total or not out.flags.c_contiguous:
            raise PackError(f"conv_input: out must be contiguous uint16 [{total}], got {out.dtype} {out.shape}")
        y = out.reshape(-1)
    padded = np.zeros((h + 2, wp, c), dtype=np.uint16)
    padded[1 : h + 1, 1 : w + 1] = to_bf16(img)
    flat = padded.reshape(-1, c)
    taps = y[: h * wp * geom.d].reshape(h * wp, 3, c)
    for dy in range(3):
        taps[:, dy] = flat[dy * wp : dy * wp + h * wp]
    y[h * wp * geom.d :] = 0
    return y if out is None else out


def conv_weights(w: np.ndarray, p: int) -> np.ndarray:
    """The banded B [K, N] (float32) of a 3x3 convolution weight [OC, C, 3, 3] for P pixels per GEMM row.

    B[(j+dx)*D + dy*C + c, j*OC + oc] = w[oc, c, dy, dx] for j < P; zero elsewhere. The GEMM over Y's
    overlapping rows then equals the convolution with zero padding 1 (docs/sam3-packing.md 4.3); the
    convolution's bias is added on the host (`conv_output`).

    Raises:
        PackError: w is not a floating [OC, C, 3, 3] array or p is not a positive integer.
    """
    wt = np.asarray(w)
    if wt.ndim != 4 or wt.shape[2:] != (3, 3) or not np.issubdtype(wt.dtype, np.floating):
        raise PackError(f"conv_weights: weight must be floating [OC, C, 3, 3], got {wt.dtype} {wt.shape}")
    p = _int("conv P", p)
    oc, c = wt.shape[:2]
    band = np.zeros((p + 2, 3, c, p, oc), dtype=np.float32)
    j = np.arange(p)
    for dx in range(3):
        band[j + dx, :, :, j, :] = wt[:, :, :, dx].transpose(2, 1, 0)
    return band.reshape((p + 2) * 3 * c, p * oc)


def conv_output(c: np.ndarray, geom: ConvGeometry, h: int, w: int, bias: np.ndarray | None = None) -> np.ndarray:
    """The [H, W, OC] float32 convolution from the GEMM's C (bf16 bits or float32, [rows, P*OC] or flat).

    C read pixel-major is [rows*P, OC]; its first H*(W+2) pixels are the map with two junk columns per
    row, which are dropped; `bias` [OC], if given, is added in float32 (docs/sam3-packing.md 4.4).

    Raises:
        PackError: C is neither uint16 nor float32, holds fewer than H*(W+2) pixels or not whole GEMM
            rows, h or w is not a positive integer, or bias is not [OC].
    """
    h, w = _int("conv map height", h), _int("conv map width", w)
    arr = np.asarray(c)
    if arr.dtype == np.uint16:
        vals = from_bf16(arr.reshape(-1))
    elif arr.dtype == np.float32:
        vals = arr.reshape(-1)
    else:
        raise PackError(f"conv_output: C must be bf16 bits (uint16) or float32, got {arr.dtype}")
    wp, row = w + 2, geom.p * geom.oc
    if vals.size % row or vals.size // geom.oc < h * wp:
        raise PackError(f"conv_output: {vals.size} elements of C are not whole rows of {row} covering "
                        f"{h}x{wp} pixels of {geom.oc} channels")
    out = vals[: h * wp * geom.oc].reshape(h, wp, geom.oc)[:, :w].astype(np.float32)
    if bias is not None:
        bv = np.asarray(bias, dtype=np.float32)
        if bv.shape != (geom.oc,):
            raise PackError(f"conv_output: bias must be [OC={geom.oc}], got shape {bv.shape}")
        out += bv
    return out


# ---------------------------------------------------------------------------------------------
# Attention layouts (docs/sam3-packing.md 5)


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """`[..., seq, heads*d]` -> `[..., heads, seq, d]` (contiguous).

    Raises:
        ValueError: fewer than 2 dimensions, heads not positive, or the width not a multiple of `heads`.
    """
    if x.ndim < 2 or heads <= 0:
        raise ValueError(f"split_heads: expected [..., seq, width] and heads > 0, got shape {x.shape}, {heads} heads")
    *lead, seq, width = x.shape
    if width % heads:
        raise ValueError(f"split_heads: width {width} is not a multiple of {heads} heads")
    y = x.reshape(*lead, seq, heads, width // heads)
    return np.ascontiguousarray(np.moveaxis(y, -2, -3))


def merge_heads(x: np.ndarray) -> np.ndarray:
    """`[..., heads, seq, d]` -> `[..., seq, heads*d]` (contiguous).

    Raises:
        ValueError: fewer than 3 dimensions.
    """
    if x.ndim < 3:
        raise ValueError(f"merge_heads: expected [..., heads, seq, d], got shape {x.shape}")
    *lead, heads, seq, d = x.shape
    return np.ascontiguousarray(np.moveaxis(x, -3, -2)).reshape(*lead, seq, heads * d)


def window_partition(x: np.ndarray, win: int) -> np.ndarray:
    """`[H, W, C]` -> `[windows, win*win, C]`: windows row-major, tokens row-major inside each window.

    Raises:
        ValueError: x is not 3-D, win is not positive, or win does not divide H and W.
    """
    if x.ndim != 3 or win <= 0:
        raise ValueError(f"window_partition: expected [H, W, C] and win > 0, got shape {x.shape}, win {win}")
    hh, ww, c = x.shape
    if hh % win or ww % win:
        raise ValueError(f"window_partition: {win}x{win} windows do not tile a {hh}x{ww} grid")
    y = x.reshape(hh // win, win, ww // win, win, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(y).reshape(-1, win * win, c)


def window_merge(x: np.ndarray, win: int, hh: int, ww: int) -> np.ndarray:
    """Inverse of `window_partition`: `[windows, win*win, C]` -> `[H, W, C]`.

    Raises:
        ValueError: the window count or size does not match an `hh x ww` grid of `win x win` windows.
    """
    if x.ndim != 3 or win <= 0:
        raise ValueError(f"window_merge: expected [windows, win*win, C] and win > 0, got shape {x.shape}, win {win}")
    n, t, c = x.shape
    if hh % win or ww % win or n != (hh // win) * (ww // win) or t != win * win:
        raise ValueError(f"window_merge: {n} windows of {t} tokens do not make a {hh}x{ww} grid")
    y = x.reshape(hh // win, ww // win, win, win, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(y).reshape(hh, ww, c)


def window_perm(grid: int, win: int) -> np.ndarray:
    """The raster index of each window-order token (int32 [grid*grid]), in `window_partition`'s order.

    Raises:
        ValueError: win does not divide grid, or either is not positive.
    """
    if grid <= 0:
        raise ValueError(f"window_perm: grid must be positive, got {grid}")
    raster = np.arange(grid * grid, dtype=np.int32).reshape(grid, grid, 1)
    return window_partition(raster, win).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Wide parallel copies


def _executor() -> ThreadPoolExecutor:
    # the runtime's copy pool: one set of copy threads per process for BO copies and these
    return copy_pool()


def copy_wide(dst: np.ndarray, src: np.ndarray) -> None:
    """Copies `src` into `dst` (same byte size; `dst` contiguous) in large blocks across the copy pool.

    The destination or source is usually a BO's mapping (BO copies themselves go through `Bo.write`/`read`,
    which split the same way over the same pool): streaming whole blocks with numpy's memcpy (which releases
    the GIL) is what makes the copy fast; never element by element. Below two blocks one memcpy on the calling
    thread (no pool hand-off).

    Raises:
        ValueError: the sizes differ, or `dst` is not contiguous (a reshape would copy and lose the data).
    """
    if not dst.flags.c_contiguous:
        raise ValueError(f"copy_wide: destination must be contiguous, got strides {dst.strides}")
    d = dst.reshape(-1).view(np.uint8)
    s = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    if d.size != s.size:
        raise ValueError(f"copy_wide: destination holds {d.size} bytes, source {s.size}")
    if d.size < 2 * COPY_BLOCK or _COPY_WORKERS == 1:
        np.copyto(d, s)
        return
    starts = range(0, d.size, COPY_BLOCK)
    list(_executor().map(lambda o: np.copyto(d[o : o + COPY_BLOCK], s[o : o + COPY_BLOCK]), starts))
