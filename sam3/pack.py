"""Host-side data preparation for the NPU kernels (spec/sam3-bundle.md 2, 4, 5).

bf16 conversion (round to nearest even, through ml_dtypes), packing of GEMM B operands for every
`b_layout`, the host half of the overlapping-row 3x3 convolution, head and window reshuffles for
attention, and the wide parallel copy that moves data into and out of uncached BO mappings.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16_BYTES = 2

# Blocks of 4 MiB keep each worker streaming whole cache lines through the uncached mapping (the
# seed copies 64 Ki-element rows per task); below two blocks a single memcpy is faster than a pool.
COPY_BLOCK = 1 << 22
_COPY_WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def round_up(x: int, m: int) -> int:
    """The smallest multiple of `m` that is >= `x`."""
    return -(-x // m) * m


# ---------------------------------------------------------------------------------------------
# bf16


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float values -> bf16 bit patterns (uint16), rounded to nearest even."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16, or an ml_dtypes bfloat16 array) -> float32 (exact).

    Raises:
        TypeError: any other dtype.
    """
    arr = np.asarray(bits)
    if arr.dtype == np.uint16:
        arr = arr.view(ml_dtypes.bfloat16)
    elif arr.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"from_bf16: expected uint16 bit patterns or bfloat16, got {arr.dtype}")
    return arr.astype(np.float32)


def _bf16_values(bits: np.ndarray, what: str) -> np.ndarray:
    """float32 values of bf16 data given as bit patterns (uint16), bfloat16, or raw bytes (uint8, as read from
    a file), flattened. Anything else is refused: viewing float32 data as uint16 would silently make twice
    as many meaningless values.

    Raises:
        TypeError: another dtype.
        ValueError: an odd number of bytes.
    """
    arr = np.ascontiguousarray(bits).reshape(-1)
    if arr.dtype == np.uint8:
        if arr.size % BF16_BYTES:
            raise ValueError(f"{what}: {arr.size} bytes are not a whole number of bf16 values")
        arr = arr.view(np.uint16)
    if arr.dtype != np.uint16 and arr.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"{what}: expected bf16 data (uint16 bit patterns, bfloat16 or bytes), got {arr.dtype}")
    return from_bf16(arr)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """`x` rounded to the nearest bf16 value, as float32 (what the device sees of a host tensor)."""
    return from_bf16(to_bf16(x))


# ---------------------------------------------------------------------------------------------
# B layouts (spec/sam3-bundle.md 2 and 4)


@dataclass(frozen=True)
class Layout:
    """A parsed `b_layout`: kind is "kn", "nk", "tiled" (kt, nt) or "conv3x3" (p)."""

    kind: str
    kt: int = 0
    nt: int = 0
    p: int = 0

    def __str__(self) -> str:
        if self.kind == "tiled":
            return f"tiled:{self.kt},{self.nt}"
        if self.kind == "conv3x3":
            return f"conv3x3:{self.p}"
        return self.kind


def parse_layout(text: str) -> Layout:
    """Parses a `b_layout` string.

    Raises:
        ValueError: unknown kind or malformed/non-positive parameters.
    """
    if not isinstance(text, str):
        raise ValueError(f"b_layout must be a string, got {type(text).__name__}")
    kind, _, params = text.partition(":")
    if kind in ("kn", "nk") and not params and ":" not in text:
        return Layout(kind)
    if kind == "tiled":
        kt, nt = _positive_ints(text, params, 2)
        return Layout("tiled", kt=kt, nt=nt)
    if kind == "conv3x3":
        (p,) = _positive_ints(text, params, 1)
        return Layout("conv3x3", p=p)
    raise ValueError(f"unknown b_layout {text!r} (expected kn, nk, tiled:KT,NT or conv3x3:P)")


def _positive_ints(text: str, params: str, count: int) -> list[int]:
    parts = params.split(",") if params else []
    # ASCII digits only: str.isdigit also takes superscripts (int() refuses them) and other scripts' digits.
    if len(parts) != count or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"b_layout {text!r}: expected {count} positive integer parameter(s)")
    return [int(p) for p in parts]


def pack_b(w: np.ndarray, layout: str | Layout) -> np.ndarray:
    """Packs a `[k][n]` float weight (C = A @ w) as bf16 bits in `layout` (kn, nk, tiled:KT,NT).

    Raises:
        ValueError: `w` is not 2-D, the layout is conv3x3 (use `pack_conv3x3`), or tiles do not divide.
    """
    lay = layout if isinstance(layout, Layout) else parse_layout(layout)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"pack_b: weight must be [k][n], got shape {w.shape}")
    k, n = w.shape
    if lay.kind == "kn":
        return to_bf16(w).reshape(-1)
    if lay.kind == "nk":
        return to_bf16(np.ascontiguousarray(w.T)).reshape(-1)
    if lay.kind == "tiled":
        if k % lay.kt or n % lay.nt:
            raise ValueError(f"pack_b: {lay} does not tile a {k}x{n} weight")
        tiles = w.reshape(k // lay.kt, lay.kt, n // lay.nt, lay.nt).transpose(0, 2, 1, 3)
        return to_bf16(np.ascontiguousarray(tiles)).reshape(-1)
    raise ValueError(f"pack_b: {lay} weights come from a conv kernel, use pack_conv3x3")


def pack_conv3x3(weight: np.ndarray, p: int) -> np.ndarray:
    """Packs a conv weight `W[co][c][3][3]` as the `conv3x3:P` B (bf16 bits, `[(P+2)*D][3*P*Cout]`).

    `B[j*D + c][(ky*P + q)*Cout + co] = W[co][c][ky][j - q]` for `0 <= j - q <= 2` (spec 4).

    Raises:
        ValueError: the weight is not `[Cout][D][3][3]` or `p` is not positive.
    """
    weight = np.asarray(weight, dtype=np.float32)
    if weight.ndim != 4 or weight.shape[2:] != (3, 3):
        raise ValueError(f"pack_conv3x3: weight must be [Cout][D][3][3], got shape {weight.shape}")
    if p <= 0:
        raise ValueError(f"pack_conv3x3: P must be positive, got {p}")
    cout, d = weight.shape[:2]
    b = np.zeros((p + 2, d, 3, p, cout), dtype=np.float32)
    for kx in range(3):
        tap = weight[:, :, :, kx].transpose(1, 2, 0)  # [c][ky][co]
        for q in range(p):
            b[q + kx, :, :, q, :] = tap
    return to_bf16(b).reshape(-1)


def unpack_conv3x3(packed: np.ndarray, d: int, p: int, cout: int) -> np.ndarray:
    """The conv weight `W[Cout][D][3][3]` (float32) a `conv3x3:P` B was packed from (its output pixel 0 taps).

    Raises:
        TypeError: `packed` is not bf16 data.
        ValueError: the packed size is not `(P+2)*D x 3*P*Cout`.
    """
    vals = _bf16_values(packed, "unpack_conv3x3")
    if vals.size != (p + 2) * d * 3 * p * cout:
        raise ValueError(f"unpack_conv3x3: {vals.size} elements packed, {(p + 2) * d}x{3 * p * cout} expected")
    b = vals.reshape(p + 2, d, 3, p, cout)
    # B[j*D + c][(ky*P + q)*Cout + co] = W[co][c][ky][j - q]; take q = 0, j = kx.
    return np.ascontiguousarray(b[:3, :, :, 0, :].transpose(3, 1, 2, 0))


def b_matrix(packed: np.ndarray, layout: str | Layout, k: int, n: int) -> np.ndarray:
    """The `[k][n]` float32 matrix a packed B stands for (inverse of `pack_b`; conv3x3 is already [K][N]).

    Raises:
        TypeError: `packed` is not bf16 data.
        ValueError: the packed size is not k*n or the layout does not tile k x n.
    """
    lay = layout if isinstance(layout, Layout) else parse_layout(layout)
    vals = _bf16_values(packed, "b_matrix")
    if vals.size != k * n:
        raise ValueError(f"b_matrix: {vals.size} elements packed, {k}x{n} expected")
    if lay.kind in ("kn", "conv3x3"):
        return vals.reshape(k, n)
    if lay.kind == "nk":
        return np.ascontiguousarray(vals.reshape(n, k).T)
    if k % lay.kt or n % lay.nt:
        raise ValueError(f"b_matrix: {lay} does not tile a {k}x{n} weight")
    tiles = vals.reshape(k // lay.kt, n // lay.nt, lay.kt, lay.nt).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(tiles).reshape(k, n)


# ---------------------------------------------------------------------------------------------
# The 3x3 convolution as a GEMM over overlapping rows (spec/sam3-bundle.md 4)


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one overlapping-row convolution: `K = (P+2)*D`, `lda = P*D`, `N = 3*P*Cout`."""

    d: int
    p: int
    cout: int

    @classmethod
    def of(cls, k: int, lda: int, n: int) -> ConvGeometry:
        """Recovers D, P and Cout from a conv GEMM's K, lda and N.

        Raises:
            ValueError: the sizes are not those of a conv GEMM.
        """
        if lda <= 0 or k <= lda or (k - lda) % 2:
            raise ValueError(f"conv GEMM needs K = lda + 2*D with D > 0, got K={k} lda={lda}")
        d = (k - lda) // 2
        if lda % d:
            raise ValueError(f"conv GEMM lda={lda} is not a multiple of D={d}")
        p = lda // d
        if n % (3 * p):
            raise ValueError(f"conv GEMM N={n} is not a multiple of 3*P={3 * p}")
        return cls(d=d, p=p, cout=n // (3 * p))

    def rows(self, h: int, w: int, m: int) -> int:
        """GEMM rows for an `h x w` map, rounded up to the kernel's `m`.

        Raises:
            ValueError: `m` is not positive.
        """
        if m <= 0:
            raise ValueError(f"ConvGeometry.rows: m must be positive, got {m}")
        return round_up(math.ceil(h * (w + 2) / self.p), m)

    def y_elems(self, rows: int) -> int:
        """Elements of Y for `rows` GEMM rows: `(rows*P + 2) * D`."""
        return (rows * self.p + 2) * self.d


def conv_input(x: np.ndarray, geom: ConvGeometry, rows: int) -> np.ndarray:
    """Builds Y (bf16 bits) from an `[h][w][D]` map: one zero column each side, rows flattened, zero tail.

    Raises:
        ValueError: the channel count is not D or `rows` is too small for the map.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 3 or x.shape[2] != geom.d:
        raise ValueError(f"conv_input: map must be [h][w][{geom.d}], got shape {x.shape}")
    h, w, _ = x.shape
    if rows * geom.p < h * (w + 2):
        raise ValueError(f"conv_input: {rows} rows of {geom.p} pixels cannot hold {h}x{w + 2} pixels")
    y = np.zeros((rows * geom.p + 2, geom.d), dtype=np.float32)
    y[: h * (w + 2)].reshape(h, w + 2, geom.d)[:, 1 : w + 1] = x
    return to_bf16(y).reshape(-1)


def conv_output(c: np.ndarray, geom: ConvGeometry, h: int, w: int) -> np.ndarray:
    """The `[h][w][Cout]` float32 conv result from the GEMM's C (bf16 bits, `rows x 3*P*Cout`; not floats).

    Sums the three kernel rows (`out[y] = part0[y-1] + part1[y] + part2[y+1]`) and drops the two
    pad columns of each row (spec 4).

    Raises:
        TypeError: C is not bf16 data.
        ValueError: C is too small for an `h x w` map, or the map size is not positive.
    """
    if h <= 0 or w <= 0:
        raise ValueError(f"conv_output: map size {h}x{w} must be positive")
    vals = _bf16_values(c, "conv_output")
    width = 3 * geom.p * geom.cout
    if vals.size % width or (vals.size // width) * geom.p < h * (w + 2):
        raise ValueError(f"conv_output: {vals.size} elements of C do not cover a {h}x{w} map")
    rows = vals.size // width
    parts = vals.reshape(rows, 3, geom.p, geom.cout).transpose(1, 0, 2, 3).reshape(3, rows * geom.p, geom.cout)
    parts = parts[:, : h * (w + 2)].reshape(3, h, w + 2, geom.cout)[:, :, :w]
    out = parts[1].copy()
    out[1:] += parts[0][:-1]
    out[:-1] += parts[2][1:]
    return out


# ---------------------------------------------------------------------------------------------
# Attention (spec/sam3-bundle.md 5)


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """`[..., seq, heads*d]` -> `[..., heads, seq, d]` (contiguous).

    Raises:
        ValueError: the width is not a multiple of `heads`.
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
    """`[H][W][C]` -> `[windows][win*win][C]`, windows in row-major order.

    Raises:
        ValueError: `win` does not divide H and W.
    """
    if x.ndim != 3 or win <= 0:
        raise ValueError(f"window_partition: expected [H][W][C] and win > 0, got shape {x.shape}, win {win}")
    hh, ww, c = x.shape
    if hh % win or ww % win:
        raise ValueError(f"window_partition: {win}x{win} windows do not tile a {hh}x{ww} grid")
    y = x.reshape(hh // win, win, ww // win, win, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(y).reshape(-1, win * win, c)


def window_merge(x: np.ndarray, win: int, hh: int, ww: int) -> np.ndarray:
    """Inverse of `window_partition`: `[windows][win*win][C]` -> `[H][W][C]`.

    Raises:
        ValueError: the window count does not match an `hh x ww` grid.
    """
    if x.ndim != 3 or win <= 0:
        raise ValueError(f"window_merge: expected [windows][win*win][C] and win > 0, got shape {x.shape}, win {win}")
    n, t, c = x.shape
    if hh % win or ww % win or n != (hh // win) * (ww // win) or t != win * win:
        raise ValueError(f"window_merge: {n} windows of {t} tokens do not make a {hh}x{ww} grid")
    y = x.reshape(hh // win, ww // win, win, win, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(y).reshape(hh, ww, c)


# ---------------------------------------------------------------------------------------------
# Wide parallel copies


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:  # two first copies from two threads must not start two pools (one would never shut down)
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_COPY_WORKERS, thread_name_prefix="sam3-copy")
        return _pool


def copy_wide(dst: np.ndarray, src: np.ndarray) -> None:
    """Copies `src` into `dst` (same byte size, 1-D) in large blocks across a small thread pool.

    The destination or source is usually a BO's uncached mapping: streaming whole blocks with
    numpy's memcpy (which releases the GIL) is what makes the copy fast; never element by element.

    Raises:
        ValueError: the sizes differ.
    """
    d = dst.reshape(-1).view(np.uint8)
    s = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    if d.size != s.size:
        raise ValueError(f"copy_wide: destination holds {d.size} bytes, source {s.size}")
    if d.size < 2 * COPY_BLOCK or _COPY_WORKERS == 1:
        d[:] = s
        return
    starts = range(0, d.size, COPY_BLOCK)
    list(_executor().map(lambda o: np.copyto(d[o : o + COPY_BLOCK], s[o : o + COPY_BLOCK]), starts))
