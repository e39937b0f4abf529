"""The DETR decoder and the dot-product scoring: on the host, except the vision keys and values of every layer,
which one NPU GEMM (`dec_kv`) computes from the encoder output (docs/sam3-segment.md 2).

The presence token rides as row 0 of the queries. Per layer: query positions from a sine embedding of the
current boxes, self-attention, text cross-attention over the valid prompt tokens, vision cross-attention with a
separable box relative-position bias, the ReLU MLP, then the box refinement and the presence logit. The scoring
turns the last layer's normalised queries and the prompt into one logit per query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sam3 import hostmath
from sam3.bundle import Bundle
from sam3.npu import Npu, NpuError
from sam3.vit import reference_gemm

_F32 = np.float32
# Fixed by the model, not bundle params (docs/sam3-segment.md 2): every LayerNorm's epsilon, the presence and
# score logit clamps, the inverse sigmoid's floor, the sine embedding's temperature, the box bias's log scale.
LN_EPS = 1e-5
PRESENCE_CLAMP = 10.0
LOGIT_CLAMP = 12.0
INVERSE_SIGMOID_EPS = 1e-3
SINE_TEMPERATURE = 10000.0
RPB_SCALE = 8.0


@dataclass(frozen=True)
class Decoded:
    """What the decoder and the scoring give (float32).

    Attributes:
        hidden: `[Q, d]`, the last layer's queries after the output LayerNorm (the mask decoder's input).
        boxes: `[Q, 4]`, the final boxes, normalised xyxy.
        logits: `[Q]`, the classification logits.
        presence: `[1]`, the last layer's presence logit.
        layer_hidden: `[dec_layers, Q, d]`, every layer's normalised queries.
        layer_boxes: `[dec_layers, Q, 4]`, the cxcywh boxes each layer starts from.
        layer_presence: `[dec_layers]`, every layer's presence logit.
    """

    hidden: np.ndarray
    boxes: np.ndarray
    logits: np.ndarray
    presence: np.ndarray
    layer_hidden: np.ndarray
    layer_boxes: np.ndarray
    layer_presence: np.ndarray


# ---------------------------------------------------------------------------------------------
# host pieces (shared by the stage and the reference)


def linear(bundle: Bundle, name: str, x: np.ndarray) -> np.ndarray:
    """`x @ name.w.T (+ name.b)`, the weight in torch layout `[out, in]` (flat or 2-D), the bias optional."""
    t = bundle.tensors
    w = t.get(f"{name}.w", "f32").reshape(-1, x.shape[-1])
    return hostmath.linear(x, w, t.get(f"{name}.b", "f32") if t.has(f"{name}.b") else None)


def layer_norm(bundle: Bundle, name: str, x: np.ndarray) -> np.ndarray:
    """LayerNorm `name` (`.w`, `.b`) over the last axis, eps 1e-5."""
    t = bundle.tensors
    return hostmath.layer_norm(x, t.get(f"{name}.w", "f32"), t.get(f"{name}.b", "f32"), LN_EPS)


def mlp(bundle: Bundle, name: str, x: np.ndarray, first: int = 1) -> np.ndarray:
    """The MLP `name.<j>` for j = first, first+1, ... while `name.<j>.w` exists, ReLU between layers, none after
    the last (docs/sam3-segment.md 2.1: the DETR and scoring MLPs count from 1, the mask embedder from 0).

    Raises:
        BundleError: not even `name.<first>.w` exists.
    """
    j = first
    h = linear(bundle, f"{name}.{j}", x)
    while bundle.tensors.has(f"{name}.{j + 1}.w"):
        j += 1
        h = linear(bundle, f"{name}.{j}", np.maximum(h, _F32(0)))
    return h


def sigmoid(x: np.ndarray) -> npt.NDArray[np.float32]:
    """1 / (1 + exp(-x)) in float32 with the real exp."""
    x = np.asarray(x, dtype=_F32)
    with np.errstate(over="ignore"):
        y: npt.NDArray[np.float32] = (_F32(1) / (_F32(1) + np.exp(-x))).astype(_F32)
    return y


def inverse_sigmoid(x: np.ndarray) -> npt.NDArray[np.float32]:
    """ln(max(x, 1e-3) / max(1 - x, 1e-3)) with x clamped to [0, 1] first."""
    x = np.clip(np.asarray(x, dtype=_F32), _F32(0), _F32(1))
    eps = _F32(INVERSE_SIGMOID_EPS)
    y: npt.NDArray[np.float32] = np.log(np.maximum(x, eps) / np.maximum(_F32(1) - x, eps)).astype(_F32)
    return y


def xyxy(boxes: np.ndarray) -> np.ndarray:
    """cxcywh `[..., 4]` -> xyxy."""
    c, half = boxes[..., :2], _F32(0.5) * boxes[..., 2:]
    return np.concatenate([c - half, c + half], axis=-1)


def sine_boxes(boxes: np.ndarray, d: int) -> np.ndarray:
    """The sine embedding of cxcywh boxes `[Q, 4]` -> `[Q, 2d]` (docs/sam3-segment.md 2.2): for each coordinate
    in the order (cy, cx, w, h), f = d/2 features c * 2 pi / 10000^(2 floor(i/2) / f), sin at even i and cos at
    odd i."""
    f = d // 2
    i = np.arange(f)
    dim_t = np.power(_F32(SINE_TEMPERATURE), (2 * (i // 2)).astype(_F32) / _F32(f)).astype(_F32)
    coords = boxes[:, [1, 0, 2, 3]].astype(_F32) * _F32(2 * math.pi)
    v = coords[:, :, None] / dim_t
    out: npt.NDArray[np.float32] = np.where(i % 2 == 0, np.sin(v), np.cos(v)).astype(_F32)
    return out.reshape(boxes.shape[0], 4 * f)


def box_bias(bundle: Bundle, boxes: np.ndarray, grid: int) -> tuple[np.ndarray, np.ndarray]:
    """The separable box relative-position bias of cxcywh boxes `[Q, 4]` (docs/sam3-segment.md 2.3): per axis,
    for grid position p = i / grid, the log-scaled offsets enc(p - lo), enc(p - hi) to the box's edges, with
    enc(v) = sign(8v) log2(|8v| + 1) / 3, through `dec.rpb_y` / `dec.rpb_x`. Returns (by, bx), each
    `[heads, Q, grid]`; the bias at key (iy, ix) is by[..., iy] + bx[..., ix]."""
    e = xyxy(boxes.astype(_F32))
    p = np.arange(grid, dtype=_F32) / _F32(grid)

    def axis(lo: int, name: str) -> np.ndarray:
        delta = p[None, :, None] - e[:, None, [lo, lo + 2]]  # [Q, grid, 2]
        v = delta * _F32(RPB_SCALE)
        enc = (np.sign(v) * np.log2(np.abs(v) + _F32(1)) / _F32(math.log2(RPB_SCALE))).astype(_F32)
        return mlp(bundle, name, enc).transpose(2, 0, 1)  # [H, Q, grid]

    return axis(1, "dec.rpb_y"), axis(0, "dec.rpb_x")


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, bias: np.ndarray | None = None,
              valid: np.ndarray | None = None) -> np.ndarray:
    """Multi-head attention of queries `[Nq, d]` over keys and values `[Nk, d]`, scale 1/sqrt(d/heads), plus an
    additive `bias` `[heads, Nq, Nk]`; keys where `valid` is False get weight 0 (a row with none valid is all 0).
    Returns `[Nq, d]`."""
    nq, d = q.shape
    hd = d // heads
    qh = q.reshape(nq, heads, hd).transpose(1, 0, 2)
    kh = k.reshape(-1, heads, hd).transpose(1, 2, 0)
    vh = v.reshape(-1, heads, hd).transpose(1, 0, 2)
    scores = qh @ kh * _F32(1 / math.sqrt(hd))
    if bias is not None:
        scores += bias
    mask = None if valid is None else np.asarray(valid, bool)[None, None, :]
    out: np.ndarray = (hostmath.softmax(scores, mask) @ vh).transpose(1, 0, 2).reshape(nq, d)
    return out


def kv_input(bundle: Bundle, enc: np.ndarray) -> np.ndarray:
    """The A of `dec_kv`: `[enc + d.pos | enc]`, `[T, 2d]` float32."""
    pos = bundle.tensors.get("d.pos", "f32").reshape(enc.shape)
    return np.concatenate([enc + pos, enc], axis=1)


def score(bundle: Bundle, hidden: np.ndarray, feats: np.ndarray, valid: np.ndarray) -> npt.NDArray[np.float32]:
    """The dot-product scoring (docs/sam3-segment.md 2.5): t = score.text_ln(score.text_mlp(feats) + feats),
    pooled as the mean over the valid tokens (of at least one), projected by `score.text_proj`; logits =
    clamp(score.query_proj(hidden) . pooled / sqrt(d), +-12). Returns `[Q]`."""
    t = layer_norm(bundle, "score.text_ln", mlp(bundle, "score.text_mlp", feats) + feats)
    keep = np.asarray(valid, bool).astype(_F32)
    pooled = (t * keep[:, None]).sum(axis=0) / max(_F32(keep.sum()), _F32(1))
    pt = linear(bundle, "score.text_proj", pooled[None])[0]
    logits = linear(bundle, "score.query_proj", hidden) @ pt / _F32(math.sqrt(hidden.shape[1]))
    clamped: npt.NDArray[np.float32] = np.clip(logits, -LOGIT_CLAMP, LOGIT_CLAMP).astype(_F32)
    return clamped


def check_inputs(bundle: Bundle, enc: np.ndarray, feats: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, ...]:
    """`enc` `[grid^2, d]`, `feats` `[text_len, d]` and `valid` `[text_len]`, as float32 / bool.

    Raises:
        ValueError: a shape that differs (naming the input and both shapes), or non-finite values.
    """
    p = bundle.params
    out = []
    for name, arr, shape in (("enc", enc, (p.grid * p.grid, p.d_model)), ("feats", feats, (p.text_len, p.d_model))):
        a = np.asarray(arr, dtype=_F32)
        if a.shape != shape:
            raise ValueError(f"{name} must be [{shape[0]}, {shape[1]}] (grid^2 or text_len rows, d_model "
                             f"{p.d_model} columns), got {list(np.shape(arr))}")
        if not np.isfinite(a).all():
            raise ValueError(f"{name} has {int((~np.isfinite(a)).sum())} non-finite value(s)")
        out.append(a)
    mask = np.asarray(valid)
    if mask.shape != (p.text_len,):
        raise ValueError(f"valid must be [{p.text_len}] (one flag per prompt token), got {list(mask.shape)}")
    return out[0], out[1], mask.astype(bool)


def decode(bundle: Bundle, kv: np.ndarray, feats: np.ndarray, valid: np.ndarray) -> Decoded:
    """The decoder layers, heads and scoring on the host, given `dec_kv`'s output `kv` `[T, >= layers * 2d]`
    (layer l's keys at columns l*2d .. +d, its values at l*2d + d .. +d)."""
    p, t = bundle.params, bundle.tensors
    d, heads, g, q = p.d_model, p.d_heads, p.grid, p.queries
    refb = sigmoid(t.get("dec.reference_points", "f32").reshape(q, 4))
    hs = np.concatenate([t.get("dec.presence_token", "f32").reshape(1, d),
                         t.get("dec.query_embed", "f32").reshape(q, d)]).astype(_F32)
    hiddens, starts, presences = [], [], []
    zero_row = np.zeros((1, d), _F32)
    for layer in range(p.dec_layers):
        name = f"dec.{layer}"
        starts.append(refb)
        qpos = np.concatenate([zero_row, mlp(bundle, "dec.ref_point_head", sine_boxes(refb, d))])
        by, bx = box_bias(bundle, refb, g)
        bias = np.zeros((heads, q + 1, g, g), _F32)
        bias[:, 1:] = by[:, :, :, None] + bx[:, :, None, :]
        # self-attention: q = k = hs + qpos, v = hs
        qk = hs + qpos
        o = attention(linear(bundle, f"{name}.sa.q", qk), linear(bundle, f"{name}.sa.k", qk),
                      linear(bundle, f"{name}.sa.v", hs), heads)
        hs = layer_norm(bundle, f"{name}.sa_ln", hs + linear(bundle, f"{name}.sa.o", o))
        # text cross-attention over the valid prompt tokens
        o = attention(linear(bundle, f"{name}.tca.q", hs + qpos), linear(bundle, f"{name}.tca.k", feats),
                      linear(bundle, f"{name}.tca.v", feats), heads, valid=valid)
        hs = layer_norm(bundle, f"{name}.tca_ln", hs + linear(bundle, f"{name}.tca.o", o))
        # vision cross-attention with the box bias; keys and values from dec_kv
        base = layer * 2 * d
        o = attention(linear(bundle, f"{name}.vca.q", hs + qpos), kv[:, base:base + d], kv[:, base + d:base + 2 * d],
                      heads, bias=bias.reshape(heads, q + 1, g * g))
        hs = layer_norm(bundle, f"{name}.vca_ln", hs + linear(bundle, f"{name}.vca.o", o))
        h = linear(bundle, f"{name}.fc2", np.maximum(linear(bundle, f"{name}.fc1", hs), _F32(0)))
        hs = layer_norm(bundle, f"{name}.mlp_ln", hs + h)
        # heads: box refinement from the normalised queries, presence from the presence token
        normed = layer_norm(bundle, "dec.out_ln", hs[1:])
        refb = sigmoid(mlp(bundle, "dec.box_head", normed) + inverse_sigmoid(refb))
        presence = mlp(bundle, "dec.presence_head", layer_norm(bundle, "dec.presence_ln", hs[:1]))[0]
        hiddens.append(normed)
        presences.append(np.clip(presence, -PRESENCE_CLAMP, PRESENCE_CLAMP).astype(_F32))
    hidden = hiddens[-1]
    return Decoded(hidden=hidden, boxes=xyxy(refb), logits=score(bundle, hidden, feats, valid),
                   presence=presences[-1].reshape(1), layer_hidden=np.stack(hiddens), layer_boxes=np.stack(starts),
                   layer_presence=np.concatenate(presences))


def check_kv(bundle: Bundle) -> None:
    """`dec_kv` must read `[enc + pos | enc]` (K = 2 d_model) and hold every layer's keys and values.

    Raises:
        NpuError: its K or N does not fit (names both).
    """
    p, s = bundle.params, bundle.gemms.get("dec_kv")
    if s is None:
        raise NpuError(f"no GEMM 'dec_kv' in bundle {bundle.root}", "dec_kv")
    if s.k != 2 * p.d_model or s.n < p.dec_layers * 2 * p.d_model:
        raise NpuError(f"dec_kv: K={s.k}, N={s.n}; the decoder needs K = 2 d_model = {2 * p.d_model} and "
                       f"N >= dec_layers * 2 d_model = {p.dec_layers * 2 * p.d_model}", "dec_kv")


# ---------------------------------------------------------------------------------------------
# the stage and its float32 reference


class Decoder:
    """The DETR decoder and scoring on an `Npu`: the `dec_kv` operands allocated once.

    Raises:
        NpuError: `dec_kv` is missing or does not fit the params.
        XdnaError: allocation failed.
    """

    def __init__(self, npu: Npu):
        self.npu = npu
        check_kv(npu.bundle)
        p = npu.bundle.params
        self.tokens = p.grid * p.grid
        self.kv = npu.io("dec_kv", self.tokens)

    def forward(self, enc: np.ndarray, feats: np.ndarray, valid: np.ndarray) -> Decoded:
        """Decodes the encoder output `enc` `[grid^2, d]` for the prompt features `feats` `[text_len, d]` and
        their validity `valid` `[text_len]` (rows past the prompt may hold anything: they are masked).

        Raises:
            ValueError: an input of the wrong shape or with non-finite values.
            NpuError: the GEMM failed.
        """
        b = self.npu.bundle
        enc, feats, valid = check_inputs(b, enc, feats, valid)
        self.kv.set_a(kv_input(b, enc))
        self.npu.run(self.kv, self.npu.weights("dec.kv"))
        return decode(b, self.kv.get_c_f32(self.tokens), feats, valid)


def reference(bundle: Bundle, enc: np.ndarray, feats: np.ndarray, valid: np.ndarray) -> Decoded:
    """The decoder and scoring in float32 numpy over the bundle's weights (`dec.kv` unpacked: exact float32).

    Raises:
        ValueError: as `Decoder.forward`.
        NpuError: `dec_kv` does not fit the params.
    """
    check_kv(bundle)
    enc, feats, valid = check_inputs(bundle, enc, feats, valid)
    return decode(bundle, reference_gemm(bundle, "dec_kv", "dec.kv", kv_input(bundle, enc)), feats, valid)
