"""numpy float32 references for what the NPU computes: the oracle of the demo and of the tests.

Written straight from the definitions (spec/sam3-bundle.md 2, 4, 5, 6), independent of the packing
and chunking code in `sam3.pack` and `sam3.npu`.
"""

from __future__ import annotations

import numpy as np

LAYERNORM_EPS = 1e-6


def layernorm(x: np.ndarray, gamma: np.ndarray | None = None, beta: np.ndarray | None = None,
              eps: float = LAYERNORM_EPS) -> np.ndarray:
    """LayerNorm over the last axis (biased variance), optional affine `gamma`, `beta`."""
    x = np.asarray(x, dtype=np.float32)
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + np.float32(eps))
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y.astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`."""
    x = np.asarray(x, dtype=np.float32)
    c = np.float32(np.sqrt(2.0 / np.pi))
    return (0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU: `x * sigmoid(x)`."""
    x = np.asarray(x, dtype=np.float32)
    return (x / (1.0 + np.exp(-x))).astype(np.float32)


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """`x @ w (+ bias)` with `w` as `[k][n]`, float32 throughout."""
    y = np.asarray(x, dtype=np.float32) @ np.asarray(w, dtype=np.float32)
    return y if bias is None else (y + bias).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """`softmax(q k^T / sqrt(d)) v` per leading index; q, k, v are `[..., seq, d]`, softmax in float32."""
    q, k, v = (np.asarray(t, dtype=np.float32) for t in (q, k, v))
    s = (q @ np.swapaxes(k, -1, -2)) / np.float32(np.sqrt(q.shape[-1]))
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return (s @ v).astype(np.float32)


def conv3x3(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """Direct 3x3 convolution, stride 1, zero padding 1: `x[h][w][D]`, `weight[Cout][D][3][3]` -> `[h][w][Cout]`.

    Raises:
        ValueError: channel counts disagree.
    """
    x = np.asarray(x, dtype=np.float32)
    weight = np.asarray(weight, dtype=np.float32)
    h, w, d = x.shape
    if weight.shape[1:] != (d, 3, 3):
        raise ValueError(f"conv3x3: weight {weight.shape} does not take {d} channels")
    xp = np.zeros((h + 2, w + 2, d), dtype=np.float32)
    xp[1:-1, 1:-1] = x
    out = np.zeros((h, w, weight.shape[0]), dtype=np.float32)
    for ky in range(3):
        for kx in range(3):
            out += xp[ky : ky + h, kx : kx + w] @ weight[:, :, ky, kx].T
    return out if bias is None else (out + bias).astype(np.float32)


def windowed_attention(x: np.ndarray, wq: np.ndarray, heads: int, win: int, grid: tuple[int, int]) -> np.ndarray:
    """Windowed multi-head self-attention over a token grid: QKV projection, per-window attention, heads merged.

    `x` is `[H*W][C]`, `wq` the `[C][3C]` QKV weight; returns `[H*W][C]` before the output projection.
    """
    hh, ww = grid
    c = x.shape[-1]
    d = c // heads
    qkv = linear(x, wq).reshape(hh // win, win, ww // win, win, 3, heads, d)
    # [3][windows][heads][win*win][d]
    qkv = qkv.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, -1, heads, win * win, d)
    o = attention(qkv[0], qkv[1], qkv[2])  # [windows][heads][tokens][d]
    o = o.reshape(hh // win, ww // win, heads, win, win, d).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(o).reshape(hh * ww, c)


def vit_block(x: np.ndarray, weights: dict[str, np.ndarray], heads: int, win: int,
              grid: tuple[int, int]) -> np.ndarray:
    """One pre-norm ViT block with windowed attention, float32.

    `x + proj(attn(ln(x)))`, then `+ fc2(gelu(fc1(ln(.))))`; `weights` holds `qkv`, `proj`, `fc1`,
    `fc2` as `[k][n]` matrices (LayerNorms without affine parameters).
    """
    h = x + linear(windowed_attention(layernorm(x), weights["qkv"], heads, win, grid), weights["proj"])
    return h + linear(gelu(linear(layernorm(h), weights["fc1"])), weights["fc2"])
