"""The mask decoder (docs/sam3-segment.md 3): the encoder output attends to the prompt through the folded
cross-attention on the `d_s` / `d_c` kernels, the pixel decoder upsamples it with the FPN levels as skips through
3x3 convolutions on the NPU (the `conv` kernel, operand sets shared with the neck) and GroupNorm + ReLU on the
host, and the mask and semantic heads run as one `m_head` GEMM whose B is built from the queries every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from amdxdna_direct.bo import Bo
from sam3.bundle import Bundle
from sam3.decoder import attention, layer_norm, linear, mlp
from sam3.detr import Fold, fold, prompt_softmax
from sam3.neck import conv3x3, reference_conv
from sam3.npu import Io, Npu, NpuError, push
from sam3.pack import pack_b, round_bf16

_F32 = np.float32
# GroupNorm's groups and epsilon are the model's, not bundle params (docs/sam3-segment.md 3.3).
GN_GROUPS = 8
GN_EPS = 1e-5


@dataclass(frozen=True)
class Masks:
    """Mask decoder outputs (float32 logits): `masks` `[Q, S, S]` and `semantic` `[S, S]`, S = mask_size."""

    masks: np.ndarray
    semantic: np.ndarray


class Geometry:
    """The mask decoder's sizes from the params: the pixel decoder doubles the grid `stages` times up to
    mask_size, one `m.conv<i>` / `m.gn<i>` per stage, skip i being FPN level `stages - 1 - i`.

    Raises:
        NpuError: mask_size is not grid times a power of two, d_model is not a multiple of the GroupNorm's groups,
            or a stage's conv weights are missing.
    """

    def __init__(self, bundle: Bundle):
        p = bundle.params
        self.d, self.grid, self.size, self.queries = p.d_model, p.grid, p.mask_size, p.queries
        self.heads, self.length = p.d_heads, p.text_len
        ratio = p.mask_size // p.grid
        if p.mask_size % p.grid or ratio < 2 or ratio & (ratio - 1):
            raise NpuError(f"mask_size {p.mask_size} must be grid {p.grid} times a power of two (>= 2)")
        self.stages = ratio.bit_length() - 1
        if p.d_model % GN_GROUPS:
            raise NpuError(f"d_model {p.d_model} is not a multiple of the GroupNorm's {GN_GROUPS} groups")
        missing = [f"m.conv{i}" for i in range(self.stages) if not bundle.tensors.has(f"m.conv{i}")]
        if missing:
            raise NpuError(f"mask decoder: {self.stages} upsampling stages (grid {p.grid} -> {p.mask_size}) need "
                           f"tensors {', '.join(missing)}, missing from the bundle")

    def side(self, stage: int) -> int:
        """The map side after upsampling stage `stage`."""
        return self.grid << (stage + 1)


def group_norm_relu(x: np.ndarray, w: np.ndarray, b: np.ndarray, groups: int = GN_GROUPS) -> npt.NDArray[np.float32]:
    """relu(GroupNorm(x)) of a channels-last map `[pixels, C]` (docs/sam3-segment.md 3.3): per group, sums of x and
    x^2 over its pixels and channels in float64, var = E[x^2] - mean^2 clamped at 0, eps 1e-5; float32 out."""
    x = np.asarray(x, _F32)
    px, c = x.shape
    xg = x.reshape(px, groups, c // groups)
    n = px * (c // groups)
    mean = xg.sum(axis=(0, 2), dtype=np.float64) / n
    var = np.maximum(np.einsum("pgc,pgc->g", xg, xg, dtype=np.float64) / n - mean * mean, 0.0)
    inv = np.repeat((1.0 / np.sqrt(var + GN_EPS)).astype(_F32), c // groups)
    scale = inv * np.asarray(w, _F32)
    shift = np.asarray(b, _F32) - np.repeat(mean.astype(_F32), c // groups) * scale
    y: npt.NDArray[np.float32] = np.multiply(x, scale)  # (x - mean) * inv * w + b, one pass over the map
    y += shift
    np.maximum(y, _F32(0), out=y)
    return y


def upsample2(x: np.ndarray, side: int) -> np.ndarray:
    """Nearest 2x upsampling of a channels-last `[side^2, C]` map -> `[(2 side)^2, C]`."""
    c = x.shape[1]
    return np.repeat(np.repeat(x.reshape(side, side, c), 2, axis=0), 2, axis=1).reshape(4 * side * side, c)


def embed(bundle: Bundle, hidden: np.ndarray) -> np.ndarray:
    """The queries' mask embeddings `[Q, d]`: the `m.embed.0..` MLP (ReLU between layers) of the decoder's
    normalised queries."""
    return mlp(bundle, "m.embed", hidden, first=0)


def head_operand(bundle: Bundle, hidden: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The mask head folded into one GEMM's B `[d, n]` and bias `[n]` (docs/sam3-segment.md 3.4): column q < Q is
    m.inst.w^T m_q with bias m_q . m.inst.b, column Q is m.sem.w with bias m.sem.b, the rest zero."""
    t = bundle.tensors
    d, q = hidden.shape[1], hidden.shape[0]
    m = embed(bundle, hidden)
    inst_w = t.get("m.inst.w", "f32").reshape(d, d)
    b = np.zeros((d, n), _F32)
    bias = np.zeros(n, _F32)
    b[:, :q] = inst_w.T @ m.T
    bias[:q] = m @ t.get("m.inst.b", "f32")
    b[:, q] = t.get("m.sem.w", "f32").reshape(d)
    bias[q] = t.get("m.sem.b", "f32").reshape(-1)[0]
    return b, bias


def check_inputs(bundle: Bundle, hidden: np.ndarray, fpn: list[np.ndarray], enc: np.ndarray,
                 valid: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
    """The mask decoder's inputs as float32 / bool, their shapes checked against the params.

    Raises:
        ValueError: a shape that differs (naming the input and both shapes), too few FPN levels, or non-finite
            values.
    """
    g = Geometry(bundle)
    want = {"hidden": (g.queries, g.d), "enc": (g.grid * g.grid, g.d)}
    arrays = {"hidden": hidden, "enc": enc}
    if len(fpn) < g.stages:
        raise ValueError(f"fpn must hold at least {g.stages} levels (the skips of the {g.stages} upsamplings), "
                         f"got {len(fpn)}")
    for j in range(g.stages):  # level j is the skip of the stage that makes side grid * 2^(stages - j)
        side = g.side(g.stages - 1 - j)
        want[f"fpn[{j}]"] = (side * side, g.d)
        arrays[f"fpn[{j}]"] = fpn[j]
    out = {}
    for name, arr in arrays.items():
        a = np.asarray(arr, _F32)
        if a.shape != want[name]:
            hint = "queries x d_model" if name == "hidden" else "channels-last"
            raise ValueError(f"{name} must be [{want[name][0]}, {want[name][1]}] ({hint}), got {list(np.shape(arr))}")
        if not np.isfinite(a).all():
            raise ValueError(f"{name} has {int((~np.isfinite(a)).sum())} non-finite value(s)")
        out[name] = a
    mask = np.asarray(valid)
    if mask.shape != (g.length,):
        raise ValueError(f"valid must be [{g.length}] (one flag per prompt token), got {list(mask.shape)}")
    levels = [out[f"fpn[{i}]"] for i in range(g.stages)]
    return out["hidden"], levels, out["enc"], mask.astype(bool)


def _split(c: np.ndarray, q: int, size: int) -> Masks:
    return Masks(masks=np.ascontiguousarray(c[:, :q].T).reshape(q, size, size), semantic=c[:, q].reshape(size, size))


class MaskDecoder:
    """The mask decoder on an `Npu`. `convs` (map side -> conv `Io`) is shared with the neck's and `cross` (the
    `d_s`, `d_c` operands) may be the DETR encoder's, so each exists once; the cross-attention's weight slots are
    its own, filled per prompt (`set_prompt`), the head's per forward.

    Raises:
        NpuError: a kernel's shape does not fit the params (d_s, d_c, conv, m_head), or the sizes do not
            (`Geometry`).
        XdnaError: allocation failed.
    """

    def __init__(self, npu: Npu, convs: dict[int, Io] | None = None, cross: tuple[Io, Io] | None = None):
        self.npu = npu
        b = npu.bundle
        self.g = g = Geometry(b)
        self.tokens = g.grid * g.grid
        for key, k, n in (("d_s", g.d, g.heads * g.length), ("d_c", g.heads * g.length, g.d)):
            spec = npu.spec(key)
            if (spec.k, spec.n) != (k, n):
                raise NpuError(f"{key}: K={spec.k}, N={spec.n}; the mask decoder's cross-attention needs K={k}, "
                               f"N={n}", key)
        head = npu.spec("m_head")
        if head.k != g.d or head.n < g.queries + 1:
            raise NpuError(f"m_head: K={head.k}, N={head.n}; the mask head needs K = d_model = {g.d} and "
                           f"N >= queries + 1 = {g.queries + 1}", "m_head")
        if cross is None:
            self.s, self.c = npu.io("d_s", self.tokens), npu.io("d_c", self.tokens)
        else:
            self.s, self.c = cross
            for io, key in ((self.s, "d_s"), (self.c, "d_c")):
                if not isinstance(io, Io) or io.key != key or io.rows < self.tokens:
                    raise NpuError(f"mask decoder: cross operands must be the {key} Io of at least {self.tokens} "
                                   f"rows (as the DETR encoder's), got {getattr(io, 'key', type(io).__name__)}", key)
        self.slots = (npu.weight_slot("d_s"), npu.weight_slot("d_c"))
        self.head = npu.io("m_head", g.size * g.size)
        self.head_slot = npu.weight_slot("m_head")
        self.convs = convs if convs is not None else {}
        self.folded: Fold | None = None

    def set_prompt(self, feats: np.ndarray) -> None:
        """Folds `m.ca` for prompt features `feats` `[text_len, d]` and packs it into the slots (docs/sam3-segment.md
        3.1; a bias goes inside B where the GEMM record says bias=1, else it is added on the host).

        Raises:
            ValueError: `feats` is not `[text_len, d]`.
        """
        b, g = self.npu.bundle, self.g
        f = np.asarray(feats, _F32)
        if f.shape != (g.length, g.d):
            raise ValueError(f"feats must be [{g.length}, {g.d}] (text_len x d_model), got {list(np.shape(feats))}")
        self.folded = folded = fold(b, 0, f, "m.ca")
        ds, dc = b.gemms["d_s"], b.gemms["d_c"]
        _fill(self.slots[0], pack_b(folded.s, folded.s_bias if ds.bias else None, ds.tile_k, ds.tile_n, ds.ct_k),
              "d_s")
        _fill(self.slots[1], pack_b(folded.c, folded.c_bias if dc.bias else None, dc.tile_k, dc.tile_n, dc.ct_k),
              "d_c")

    def _gemm(self, io: Io, a: np.ndarray, weights: Bo, rows: int) -> np.ndarray:
        io.set_a(a)
        self.npu.run(io, weights)
        return io.get_c_f32(rows)

    def cross(self, enc: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """p = enc + cross-attention(m.ca_ln(enc)) to the prompt last set, on d_s / d_c.

        Raises:
            NpuError: no prompt was set, or a kernel failed.
        """
        b, f = self.npu.bundle, self.folded
        if f is None:
            raise NpuError("mask decoder: set_prompt(feats) first (the cross-attention is folded per prompt)")
        scores = self._gemm(self.s, layer_norm(b, "m.ca_ln", enc), self.slots[0], self.tokens)
        if not b.gemms["d_s"].bias:
            scores = scores + f.s_bias
        probs = round_bf16(prompt_softmax(scores, valid, self.g.heads))
        out = self._gemm(self.c, probs, self.slots[1], self.tokens)
        if not b.gemms["d_c"].bias:
            out = out + f.c_bias
        p: np.ndarray = enc + out
        return p

    def conv(self, side: int, x: np.ndarray, stage: int) -> np.ndarray:
        """3x3 convolution `m.conv<stage>` (zero padding 1) of a `[side^2, d]` map on the NPU, + `m.conv<stage>.b`.

        Raises:
            NpuError: the operand set kept for `side` is not a convolution's, or the kernel failed.
        """
        return conv3x3(self.npu, self.convs, side, x, f"m.conv{stage}", f"m.conv{stage}.b")

    def forward(self, hidden: np.ndarray, fpn: list[np.ndarray], enc: np.ndarray, valid: np.ndarray) -> Masks:
        """Mask logits for the decoder's normalised queries `hidden` `[Q, d]`, the FPN levels `fpn` (channels-last
        `[(4g)^2, d]`, `[(2g)^2, d]`, ...; a further level is ignored), the encoder output `enc` `[g^2, d]` and the
        prompt's validity `valid` `[text_len]` (the prompt itself given to `set_prompt`).

        Raises:
            NpuError: no prompt was set, or a kernel failed.
            ValueError: an input of the wrong shape or with non-finite values.
        """
        if self.folded is None:
            raise NpuError("mask decoder: set_prompt(feats) first (the cross-attention is folded per prompt)")
        b, g = self.npu.bundle, self.g
        hidden, levels, enc, valid = check_inputs(b, hidden, fpn, enc, valid)
        p, side = self.cross(enc, valid), g.grid
        for i in range(g.stages):
            x = upsample2(p, side) + levels[g.stages - 1 - i]
            side *= 2
            p = group_norm_relu(self.conv(side, x, i), *_gn(b, i))
        spec = b.gemms["m_head"]
        hb, hbias = head_operand(b, hidden, spec.n)
        push(pack_b(hb, hbias if spec.bias else None, spec.tile_k, spec.tile_n, spec.ct_k), self.head_slot)
        c = self._gemm(self.head, p, self.head_slot, side * side)
        if not spec.bias:
            c = c + hbias
        return _split(c, g.queries, side)


def _gn(bundle: Bundle, stage: int) -> tuple[np.ndarray, np.ndarray]:
    t = bundle.tensors
    return t.get(f"m.gn{stage}.w", "f32"), t.get(f"m.gn{stage}.b", "f32")


def _fill(slot: Bo, packed: np.ndarray, key: str) -> None:
    if packed.nbytes > slot.size:
        raise NpuError(f"{key}: folded weights of {packed.nbytes} bytes, the slot holds {slot.size}", key)
    push(packed, slot)


def reference(bundle: Bundle, hidden: np.ndarray, fpn: list[np.ndarray], enc: np.ndarray, feats: np.ndarray,
              valid: np.ndarray) -> Masks:
    """The mask decoder in float32 numpy over the bundle's weights: the cross-attention unfolded (softmax of the
    per-head scores against the prompt's keys), the convolutions from their packed operands (`neck.reference_conv`),
    and the head as the dot product of the query embeddings with the instance projection of the pixel embedding.

    Raises:
        ValueError: as `MaskDecoder.forward`, or `feats` is not `[text_len, d]`.
        NpuError: the sizes do not fit (`Geometry`).
    """
    g = Geometry(bundle)
    hidden, levels, enc, valid = check_inputs(bundle, hidden, fpn, enc, valid)
    f = np.asarray(feats, _F32)
    if f.shape != (g.length, g.d):
        raise ValueError(f"feats must be [{g.length}, {g.d}] (text_len x d_model), got {list(np.shape(feats))}")
    h = layer_norm(bundle, "m.ca_ln", enc)
    att = attention(linear(bundle, "m.ca.q", h), linear(bundle, "m.ca.k", f), linear(bundle, "m.ca.v", f), g.heads,
                    valid=valid)
    p, side = enc + linear(bundle, "m.ca.o", att), g.grid
    for i in range(g.stages):
        x = upsample2(p, side) + levels[g.stages - 1 - i]
        side *= 2
        p = group_norm_relu(reference_conv(bundle, x, side, f"m.conv{i}", f"m.conv{i}.b"), *_gn(bundle, i))
    inst = linear(bundle, "m.inst", p)  # [S^2, d]
    masks = embed(bundle, hidden) @ inst.T  # [Q, S^2]
    t = bundle.tensors
    semantic = p @ t.get("m.sem.w", "f32").reshape(g.d) + t.get("m.sem.b", "f32").reshape(-1)[0]
    return Masks(masks=masks.reshape(g.queries, side, side), semantic=semantic.reshape(side, side))
