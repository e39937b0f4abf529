"""The DETR encoder: projections on the NPU, LayerNorm and the prompt softmax on the host (docs/sam3-pipeline.md 4).

Per layer: the prompt's cross-attention folded into two GEMM operands (`d_s`: scores, `d_c`: the weighted values
through the output projection), LN1 -> d_qkv over [h + pos | h] -> mha_d -> d_o -> residual, LN2 -> d_s ->
per-head softmax over the valid prompt tokens -> d_c -> residual, LN3 -> d_fc1 (ReLU epilogue) -> d_fc2 reading
fc1's C in place -> residual + `d.<i>.fc2.b`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from amdxdna_direct.bo import Bo
from sam3 import hostmath
from sam3.bundle import Bundle
from sam3.npu import Io, Npu, NpuError, push
from sam3.pack import from_bf16, pack_b, round_bf16
from sam3.vit import attention, reference_gemm

# The encoder's LayerNorm epsilon (docs/sam3-pipeline.md 4): fixed by the model, not a bundle param.
LN_EPS = 1e-5


@dataclass(frozen=True)
class Fold:
    """One layer's prompt cross-attention as two GEMM operands: scores = h @ s + s_bias `[T, H*L]`, out =
    probs @ c + c_bias `[T, d]` (float32, before packing)."""

    s: np.ndarray
    s_bias: np.ndarray
    c: np.ndarray
    c_bias: np.ndarray


def fold(bundle: Bundle, layer: int, feats: np.ndarray, prefix: str | None = None) -> Fold:
    """Folds cross-attention `prefix` (default `d.<layer>.ca`) for prompt features `feats` `[L, d]`
    (docs/sam3-pipeline.md 4.2): B_s[i, h*L + j] = sum_e Wq[h*hd + e, i] K[j, h*hd + e] / sqrt(hd), its bias from
    bq; B_c[h*L + j, o] = sum_e V[j, h*hd + e] Wo[o, h*hd + e], its bias `o.b`."""
    p = bundle.params
    t = bundle.tensors
    name = prefix or f"d.{layer}.ca"
    d, heads = p.d_model, p.d_heads
    hd = d // heads
    length = feats.shape[0]
    k = hostmath.linear(feats, t.get(f"{name}.k.w", "f32"), _bias(bundle, f"{name}.k.b")).reshape(length, heads, hd)
    v = hostmath.linear(feats, t.get(f"{name}.v.w", "f32"), _bias(bundle, f"{name}.v.b")).reshape(length, heads, hd)
    wq = t.get(f"{name}.q.w", "f32").reshape(heads, hd, d)
    bq = _bias(bundle, f"{name}.q.b")
    scale = np.float32(1 / np.sqrt(hd))
    s = np.einsum("hei,jhe->ihj", wq, k).reshape(d, heads * length) * scale
    s_bias = (np.zeros(heads * length, np.float32) if bq is None
              else np.einsum("he,jhe->hj", bq.reshape(heads, hd), k).reshape(-1) * scale)
    wo = t.get(f"{name}.o.w", "f32").reshape(d, heads, hd)
    c = np.einsum("jhe,ohe->hjo", v, wo).reshape(heads * length, d)
    c_bias = _bias(bundle, f"{name}.o.b")
    return Fold(s.astype(np.float32), s_bias.astype(np.float32), c.astype(np.float32),
                np.zeros(d, np.float32) if c_bias is None else c_bias)


def _bias(bundle: Bundle, name: str) -> np.ndarray | None:
    return bundle.tensors.get(name, "f32") if name in bundle.tensors else None


def prompt_softmax(scores: np.ndarray, valid: np.ndarray, heads: int) -> np.ndarray:
    """Softmax of `[T, H*L]` scores per head over the valid prompt tokens; invalid ones get 0, an all-masked row 0."""
    t = scores.shape[0]
    length = valid.size
    probs = hostmath.softmax(scores.reshape(t, heads, length), np.asarray(valid, bool)[None, None, :])
    return probs.reshape(t, heads * length)


def _ln(bundle: Bundle, name: str, x: np.ndarray) -> np.ndarray:
    t = bundle.tensors
    return hostmath.layer_norm(x, t.get(f"{name}.w", "f32"), t.get(f"{name}.b", "f32"), LN_EPS)


class Encoder:
    """The DETR encoder on an `Npu`: operands allocated once; the folded weights re-packed per prompt."""

    def __init__(self, npu: Npu):
        self.npu = npu
        b = npu.bundle
        p = b.params
        self.tokens = p.grid * p.grid
        self.d, self.heads, self.layers, self.length = p.d_model, p.d_heads, p.d_layers, p.text_len
        mha = npu.mhas["mha_d"]
        if not mha.token_major or mha.heads != p.d_heads or mha.seq != self.tokens:
            raise NpuError(f"mha_d: heads={mha.heads} seq={mha.seq} token_major={mha.token_major}; the encoder needs "
                           f"token-major {p.d_heads} heads over {self.tokens} tokens", "mha_d")
        self.pd = mha.d * p.d_heads
        for key, k, n in (("d_qkv", 2 * self.d, 3 * self.pd), ("d_o", self.pd, self.d),
                          ("d_s", self.d, self.heads * self.length), ("d_c", self.heads * self.length, self.d)):
            spec = npu.spec(key)
            if (spec.k, spec.n) != (k, n):
                raise NpuError(f"{key}: K={spec.k}, N={spec.n}; the encoder needs K={k}, N={n}", key)
        self.pos = b.tensors.get("d.pos", "f32").reshape(self.tokens, self.d)
        self.qkv = npu.io("d_qkv", self.tokens)
        self.mha = npu.mha_io("mha_d")
        self.o = npu.io("d_o", self.tokens)
        self.s = npu.io("d_s", self.tokens)
        self.c = npu.io("d_c", self.tokens)
        self.fc1 = npu.io("d_fc1", self.tokens)
        self.fc2 = npu.io_chained("d_fc2", self.fc1)
        self.slots = [(npu.weight_slot("d_s"), npu.weight_slot("d_c")) for _ in range(self.layers)]
        self.folds: list[Fold] = []

    def set_prompt(self, feats: np.ndarray) -> None:
        """Folds and packs every layer's cross-attention for prompt features `feats` `[L, d]` into the slots
        (a bias goes inside B where the GEMM record says bias=1, else it is added on the host)."""
        b = self.npu.bundle
        ds, dc = b.gemms["d_s"], b.gemms["d_c"]
        self.folds = [fold(b, i, feats) for i in range(self.layers)]
        for f, (slot_s, slot_c) in zip(self.folds, self.slots, strict=True):
            _fill(slot_s, pack_b(f.s, f.s_bias if ds.bias else None, ds.tile_k, ds.tile_n, ds.ct_k), "d_s")
            _fill(slot_c, pack_b(f.c, f.c_bias if dc.bias else None, dc.tile_k, dc.tile_n, dc.ct_k), "d_c")

    def _gemm(self, io: Io, a: np.ndarray, weights: Bo) -> np.ndarray:
        io.set_a(a)
        self.npu.run(io, weights)
        return io.get_c_f32(self.tokens)

    def forward(self, x: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """The encoder over the image features `x` `[T, d]` (fpn level 2, raster) for the prompt last set.

        Raises:
            NpuError: no prompt was set, or a kernel failed.
        """
        b, npu = self.npu.bundle, self.npu
        if not self.folds:
            raise NpuError("DETR encoder: set_prompt(feats) first (the cross-attention is folded per prompt)")
        t = b.tensors
        for i in range(self.layers):
            h = _ln(b, f"d.{i}.ln1", x)
            qkv = self._gemm(self.qkv, np.concatenate([h + self.pos, h], axis=1), npu.weights(f"d.{i}.qkv"))
            pd = self.pd
            self.mha.set_qkv(qkv[:, :pd], qkv[:, pd:2 * pd], qkv[:, 2 * pd:])
            npu.run_mha(self.mha)
            o = from_bf16(self.mha.get_o(self.tokens * pd)).reshape(self.tokens, pd)
            x = x + self._gemm(self.o, o, npu.weights(f"d.{i}.o"))
            scores = self._gemm(self.s, _ln(b, f"d.{i}.ln2", x), self.slots[i][0])
            if not b.gemms["d_s"].bias:
                scores = scores + self.folds[i].s_bias
            out = self._gemm(self.c, round_bf16(prompt_softmax(scores, valid, self.heads)), self.slots[i][1])
            if not b.gemms["d_c"].bias:
                out = out + self.folds[i].c_bias
            x = x + out
            self.fc1.set_a(_ln(b, f"d.{i}.ln3", x))
            npu.run(self.fc1, npu.weights(f"d.{i}.fc1"))
            npu.run(self.fc2, npu.weights(f"d.{i}.fc2"))
            x = x + self.fc2.get_c_f32(self.tokens) + t.get(f"d.{i}.fc2.b", "f32")
        return x


def _fill(slot: Bo, packed: np.ndarray, key: str) -> None:
    if packed.nbytes > slot.size:
        raise NpuError(f"{key}: folded weights of {packed.nbytes} bytes, the slot holds {slot.size}", key)
    push(packed, slot)


def reference(bundle: Bundle, x: np.ndarray, feats: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """The encoder in float32 numpy over the bundle's weights (the fold unpacked: exact float32)."""
    p = bundle.params
    t = bundle.tensors
    tokens, d = p.grid * p.grid, p.d_model
    mha = bundle.mhas["mha_d"]
    pd = mha.d * p.d_heads
    pos = t.get("d.pos", "f32").reshape(tokens, d)
    for i in range(p.d_layers):
        h = _ln(bundle, f"d.{i}.ln1", x)
        qkv = reference_gemm(bundle, "d_qkv", f"d.{i}.qkv", np.concatenate([h + pos, h], axis=1))
        o = attention(qkv[:, :pd], qkv[:, pd:2 * pd], qkv[:, 2 * pd:], p.d_heads)
        x = x + reference_gemm(bundle, "d_o", f"d.{i}.o", o)
        f = fold(bundle, i, feats)
        probs = prompt_softmax(_ln(bundle, f"d.{i}.ln2", x) @ f.s + f.s_bias, valid, p.d_heads)
        x = x + probs @ f.c + f.c_bias
        hid = reference_gemm(bundle, "d_fc1", f"d.{i}.fc1", _ln(bundle, f"d.{i}.ln3", x))
        x = x + reference_gemm(bundle, "d_fc2", f"d.{i}.fc2", hid) + t.get(f"d.{i}.fc2.b", "f32")
    return x
