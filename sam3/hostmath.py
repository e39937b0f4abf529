"""Float32 host math shared by the SAM3 stages: LayerNorm, erf GELU, masked softmax, linear layers, bf16.

Every function works on whole arrays (numpy, BLAS matmuls) and returns float32. The conventions are
those of docs/sam3-host.md 2: two-pass LayerNorm variance, the exact (erf) GELU, a softmax whose masked
entries are 0 and whose fully masked rows are all 0, and bf16 rounding to nearest even with NaN kept NaN.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

_F32 = np.float32
# ml_dtypes' scalar types carry no static type; the dtype is named so views of it stay typed as arrays
_BF16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)

# Numerical Recipes' erfc fit (fractional error < 1.2e-7 everywhere): erfc(z) = t*exp(-z^2 + P(t)),
# t = 1 / (1 + z/2), z >= 0; P's coefficients from the constant term up (docs/sam3-host.md 2.2).
_ERFC_COEFS = (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
    0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277,
)


def f32(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``x`` as float32; bf16 input (an ml_dtypes ``bfloat16`` array or uint16 bit patterns) is widened exactly.

    uint16 always means bf16 bit patterns here, never integers.

    Raises:
        TypeError: ``x`` has a dtype that is not numeric (object, string, complex ...).
    """
    arr = np.asarray(x)
    if arr.dtype == _F32:
        return arr
    if arr.dtype.name == "bfloat16" or arr.dtype == np.uint16:
        return from_bf16(arr)
    if arr.dtype.kind in "fiub":
        return arr.astype(_F32)
    raise TypeError(f"expected a numeric, bfloat16 or uint16 (bf16 bits) array, got dtype {arr.dtype}")


def to_bf16(x: np.ndarray) -> npt.NDArray[np.uint16]:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even; a NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(x, dtype=_F32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(x)
    if np.any(nan):
        rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def from_bf16(bits: np.ndarray) -> npt.NDArray[np.float32]:
    """bf16 (uint16 bit patterns or an ml_dtypes ``bfloat16`` array) -> float32, exactly (a 16-bit left shift)."""
    # ml_dtypes' widening is the same exact shift, several times faster than doing it in numpy
    return np.ascontiguousarray(bits).view(_BF16).astype(_F32)


def round_bf16(x: np.ndarray) -> npt.NDArray[np.float32]:
    """``x`` rounded through bf16 and back to float32."""
    return from_bf16(to_bf16(x))


def layer_norm(x: np.ndarray, w: npt.ArrayLike, b: npt.ArrayLike, eps: float) -> npt.NDArray[np.float32]:
    """LayerNorm over the last axis: mean, then the two-pass biased variance, then (x - mean)/sqrt(var + eps)*w + b."""
    x = f32(x)
    centred = x - x.mean(axis=-1, keepdims=True, dtype=_F32)
    var = np.mean(centred * centred, axis=-1, keepdims=True, dtype=_F32)
    out: npt.NDArray[np.float32] = centred / np.sqrt(var + _F32(eps)) * f32(w) + f32(b)
    return out


def erfc(x: np.ndarray) -> npt.NDArray[np.float32]:
    """The complementary error function, elementwise, in float32 (the fit of docs/sam3-host.md 2.2)."""
    x = f32(x)
    z = np.abs(x)
    t = _F32(1) / (_F32(1) + _F32(0.5) * z)
    poly = np.full_like(t, _ERFC_COEFS[-1])
    for coef in _ERFC_COEFS[-2::-1]:
        poly = poly * t + _F32(coef)
    ans = t * np.exp(poly - z * z)
    out: npt.NDArray[np.float32] = np.where(x >= 0, ans, _F32(2) - ans)
    return out


def gelu_erf(x: np.ndarray) -> npt.NDArray[np.float32]:
    """The exact GELU, x * Phi(x) = x/2 * erfc(-x/sqrt(2)), in float32."""
    x = f32(x)
    out: npt.NDArray[np.float32] = _F32(0.5) * x * erfc(-x * _F32(np.sqrt(0.5)))
    return out


def softmax(x: np.ndarray, mask: np.ndarray | None = None, axis: int = -1) -> npt.NDArray[np.float32]:
    """Softmax along ``axis``; entries where ``mask`` is False, or that are -inf, get 0; an all-masked row is all 0.

    Args:
        x: scores (any shape).
        mask: booleans broadcastable to ``x`` (True = attend), or None.
        axis: the axis normalised over.

    A NaN score (unmasked) makes its whole row NaN: it is never hidden.
    """
    x = f32(x)
    if mask is not None:
        x = np.where(mask, x, _F32(-np.inf))
    peak = np.max(x, axis=axis, keepdims=True)
    peak[~np.isfinite(peak)] = 0  # an all-masked row: exp(-inf - 0) = 0 everywhere
    e: npt.NDArray[np.float32] = x - peak  # one full-size temporary, exponentiated and normalised in place
    np.exp(e, out=e)
    total = e.sum(axis=axis, keepdims=True, dtype=_F32)
    total[total == 0] = 1
    e /= total
    return e


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> npt.NDArray[np.float32]:
    """x @ w.T (+ b) in float32, ``w`` in torch layout [out, in] (float32 or bf16)."""
    y = f32(x) @ f32(w).T
    if b is not None:
        y += f32(b)
    return y


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two arrays flattened, in float64, with a denominator floor of 1e-30."""
    a64 = np.asarray(a, dtype=np.float64).ravel()
    b64 = np.asarray(b, dtype=np.float64).ravel()
    return float(a64 @ b64 / max(float(np.linalg.norm(a64) * np.linalg.norm(b64)), 1e-30))
