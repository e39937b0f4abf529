"""SAM3's CLIP text encoder on the host, float32 numpy with BLAS matmuls (docs/sam3-host.md 5).

Only the valid (mask != 0) prefix of the tokens is encoded: token + position embeddings, ``text_layers``
pre-LN blocks (causal multi-head attention over ``text_heads`` heads, exact-GELU MLP), the final
LayerNorm and the projection to the DETR width. Heads run as one batched matmul; the only Python loop is
over layers. Weights are the bundle's tensors (docs/sam3-host.md 5.1), from a dict or straight from the
bundle's tensor store; bf16 matrices are widened one at a time as each linear layer uses them.
"""

from __future__ import annotations

from typing import Any, Protocol

import ml_dtypes
import numpy as np

from amdxdna_direct.errors import Error
from sam3.hostmath import f32, gelu_erf, layer_norm, linear, softmax


class TextParams(Protocol):
    """The sizes the encoder reads (bundle params of the same names)."""

    text_len: int
    text_dim: int
    text_heads: int
    text_layers: int
    text_ffn: int
    text_eps: float
    d_model: int


class Weights(Protocol):
    """Where the tensors come from: a dict of name -> array, or a bundle's tensor store (``in`` and ``get``)."""

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> Any: ...


class TextError(Error, ValueError):
    """Bad token ids or mask, or a text-encoder weight that is missing or of the wrong size (named)."""


def weight(weights: Weights, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``weights[name]`` viewed as ``shape`` (flat or shaped storage both accepted), dtype unchanged.

    Raises:
        TextError: the tensor is missing, or does not hold prod(shape) values.
    """
    arr = _tensor(weights, name)
    if arr.size != int(np.prod(shape)):
        raise TextError(f"text encoder: tensor {name} has shape {list(arr.shape)} ({arr.size} values), "
                        f"expected {list(shape)} ({int(np.prod(shape))} values)")
    return arr.reshape(shape)


def _tensor(weights: Weights, name: str) -> np.ndarray:
    if name not in weights:
        raise TextError(f"text encoder: tensor {name} missing from the weights")
    arr = np.asarray(weights.get(name))
    # Weights are floats, bfloat16 or its uint16 bits (docs/sam3-host.md 5.1): other integers would be read as
    # other numbers.
    if arr.dtype.kind != "f" and arr.dtype not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)):
        raise TextError(f"text encoder: tensor {name} is {arr.dtype}, expected float32 or bfloat16")
    return arr


def valid_length(ids: np.ndarray, mask: np.ndarray, length: int) -> int:
    """The number n of valid tokens: ``mask`` must be non-zero on a non-empty prefix [0, n) and zero after.

    Raises:
        TextError: ids or mask is not 1-D of ``length``, or the mask is empty or not a prefix.
    """
    for what, arr in (("ids", ids), ("mask", mask)):
        if arr.shape != (length,):
            raise TextError(f"token {what}: shape {list(arr.shape)}, expected [{length}] (text_len)")
    valid = mask != 0
    n = int(valid.sum())
    if n == 0 or not valid[:n].all():
        raise TextError(f"attention mask must be a non-empty prefix of ones, got {mask.tolist()}")
    return n


def encode_text(ids: np.ndarray, mask: np.ndarray, weights: Weights, params: TextParams) -> np.ndarray:
    """Text features [text_len, d_model] float32 for one prompt; rows of invalid tokens are zero.

    Args:
        ids: token ids [text_len] (e.g. ``ClipTokenizer.encode``).
        mask: [text_len], non-zero on the valid prefix.
        weights: bundle tensor name -> array (``t.tok_emb``, ``t.<i>.qkv.w``, ...; docs/sam3-host.md 5.1): a
            dict, or a bundle's ``TensorStore``.
        params: the sizes (``TextParams``).

    Raises:
        TextError: bad ids/mask, an id outside the vocabulary, a missing or mis-sized weight, or
            text_dim not divisible by text_heads.
    """
    p = params
    dim, heads = p.text_dim, p.text_heads
    if heads <= 0 or dim % heads:
        raise TextError(f"text_dim {dim} is not divisible by text_heads {heads}")
    ids, mask = np.asarray(ids), np.asarray(mask)
    n = valid_length(ids, mask, p.text_len)
    x = _embed(ids[:n], weights, p)
    for i in range(p.text_layers):
        x = _block(x, weights, f"t.{i}", p)
    x = layer_norm(x, weight(weights, "t.final_ln.w", (dim,)), weight(weights, "t.final_ln.b", (dim,)), p.text_eps)
    out = np.zeros((p.text_len, p.d_model), dtype=np.float32)
    out[:n] = linear(x, weight(weights, "t.proj.w", (p.d_model, dim)), weight(weights, "t.proj.b", (p.d_model,)))
    return out


def _embed(ids: np.ndarray, weights: Weights, p: TextParams) -> np.ndarray:
    """tok_emb[id] (bf16 -> f32) + pos_emb[t] for the n valid tokens."""
    table = _tensor(weights, "t.tok_emb")
    if table.size % p.text_dim:
        raise TextError(f"text encoder: tensor t.tok_emb has {table.size} values, not a multiple of text_dim "
                        f"{p.text_dim}")
    table = table.reshape(-1, p.text_dim)
    bad = (ids < 0) | (ids >= table.shape[0])
    if bad.any():
        raise TextError(f"token id {int(ids[bad][0])} outside the vocabulary of {table.shape[0]} tokens")
    return f32(table[ids]) + f32(_positions(weights, ids.shape[0], p.text_dim))


def _positions(weights: Weights, n: int, dim: int) -> np.ndarray:
    """The first n rows of t.pos_emb: the table may be longer than text_len, as CLIP's 77 rows are, and only
    the rows the prompt's tokens reach are read (docs/sam3-host.md 5.1)."""
    flat = _tensor(weights, "t.pos_emb").reshape(-1)
    if flat.size < n * dim:
        raise TextError(f"text encoder: tensor t.pos_emb has {flat.size} values, fewer than the prompt's {n} "
                        f"tokens x text_dim {dim} = {n * dim}")
    return flat[:n * dim].reshape(n, dim)


def _block(x: np.ndarray, weights: Weights, key: str, p: TextParams) -> np.ndarray:
    """One pre-LN block: x + o(MHA(LN1 x)), then + fc2(GELU(fc1(LN2 x)))."""
    dim, ffn = p.text_dim, p.text_ffn

    def lin(name: str, n_out: int, n_in: int, h: np.ndarray) -> np.ndarray:
        w = weight(weights, f"{key}.{name}.w", (n_out, n_in))
        return linear(h, w, weight(weights, f"{key}.{name}.b", (n_out,)))

    def ln(name: str, h: np.ndarray) -> np.ndarray:
        return layer_norm(h, weight(weights, f"{key}.{name}.w", (dim,)), weight(weights, f"{key}.{name}.b", (dim,)),
                          p.text_eps)

    x = x + lin("o", dim, dim, causal_attention(lin("qkv", 3 * dim, dim, ln("ln1", x)), p.text_heads))
    out: np.ndarray = x + lin("fc2", dim, ffn, gelu_erf(lin("fc1", ffn, dim, ln("ln2", x))))
    return out


def causal_attention(qkv: np.ndarray, heads: int) -> np.ndarray:
    """Causal multi-head attention of packed [n, 3*D] rows (q | k | v, heads in order within each) -> [n, D]."""
    n, width = qkv.shape
    hd = width // (3 * heads)
    q, k, v = qkv.reshape(n, 3, heads, hd).transpose(1, 2, 0, 3)
    scores = (q @ k.transpose(0, 2, 1)) * np.float32(hd ** -0.5)
    probs = softmax(scores, np.tril(np.ones((n, n), dtype=bool)))
    out: np.ndarray = (probs @ v).transpose(1, 0, 2).reshape(n, heads * hd)
    return out
