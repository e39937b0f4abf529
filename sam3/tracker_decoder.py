"""The tracker's two-way mask decoder on the host, float32 (docs/sam3-tracker.md 4).

Tokens (object score, IoU, the mask tokens, then the prompt tokens) and the image side (the last neck level plus
the dense prompt) attend to each other through `layers` two-way blocks and a final token-to-image attention;
two transposed convolutions with the neck's projected finer levels as skips upscale the image side; each mask
token's hypernetwork MLP turns it into per-pixel weights, so each candidate mask is one matrix product. The IoU
and object-score heads read their tokens. Every size comes from the weights' shapes and the tracker config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sam3 import hostmath
from sam3.tracker_config import MODEL, F32Array, TrackerConfig, tensor
from sam3.tracker_layers import conv_transpose2x2

_F32 = np.float32
DEC = MODEL + "mask_decoder."
TWO_WAY = DEC + "transformer."
TWO_WAY_EPS = 1e-5      # the two-way transformer's LayerNorms (torch's default); the upscaling one reads the config


@dataclass(frozen=True)
class DecoderOutput:
    """Every candidate before selection and the intermediate stages the checks compare.

    Attributes:
        tokens: the tokens after the final attention and its norm, `[6 + N, width]` for 4 mask tokens.
        image: the image side after the two-way blocks, `[grid^2, width]` raster.
        upscaled: `[C, side, side]` after both transposed convolutions, the skips and GELUs.
        hyper_in: `[mask tokens, C]`, each mask token's hypernetwork output.
        masks: `[mask tokens, side, side]` low-resolution logits, candidate 0 the single-mask one.
        iou: `[mask tokens]` predicted IoU (after the sigmoid).
        object_score: the object-score logit.
    """

    tokens: F32Array
    image: F32Array
    upscaled: F32Array
    hyper_in: F32Array
    masks: F32Array
    iou: F32Array
    object_score: float


def _lin(w: Mapping[str, np.ndarray], prefix: str, x: np.ndarray) -> F32Array:
    return hostmath.linear(x, tensor(w, prefix + ".weight"), tensor(w, prefix + ".bias"))


def _ln(w: Mapping[str, np.ndarray], prefix: str, x: np.ndarray, eps: float) -> F32Array:
    return hostmath.layer_norm(x, tensor(w, prefix + ".weight"), tensor(w, prefix + ".bias"), eps)


def mlp_names(w: Mapping[str, np.ndarray], prefix: str) -> list[str]:
    """An MLP's linear layers in order: `proj_in`, `layers.0 ..`, `proj_out` (as many middle layers as it has)."""
    middle: list[str] = []
    while f"{prefix}.layers.{len(middle)}.weight" in w:
        middle.append(f"{prefix}.layers.{len(middle)}")
    return [prefix + ".proj_in", *middle, prefix + ".proj_out"]


def mlp(w: Mapping[str, np.ndarray], prefix: str, x: np.ndarray) -> F32Array:
    """The decoder's MLP: ReLU after every linear layer but the last."""
    names = mlp_names(w, prefix)
    h = np.asarray(x, dtype=_F32)
    for name in names[:-1]:
        h = np.maximum(_lin(w, name, h), _F32(0))
    return _lin(w, names[-1], h)


def _split(x: np.ndarray, heads: int) -> F32Array:
    n, width = x.shape
    out: F32Array = x.reshape(n, heads, width // heads).transpose(1, 0, 2)
    return out


def attention(w: Mapping[str, np.ndarray], prefix: str, heads: int, q: np.ndarray, k: np.ndarray,
              v: np.ndarray) -> F32Array:
    """Multi-head attention with q/k/v projections to the layer's own width (full for self-attention, the
    narrower cross width otherwise, read from the weights), softmax(q k^T / sqrt(head)) v, and the output
    projection back to the model width."""
    qh = _split(_lin(w, prefix + ".q_proj", q), heads)
    kh = _split(_lin(w, prefix + ".k_proj", k), heads)
    vh = _split(_lin(w, prefix + ".v_proj", v), heads)
    scores = (qh @ kh.transpose(0, 2, 1)) * _F32(qh.shape[-1] ** -0.5)
    out = hostmath.softmax(scores) @ vh
    return _lin(w, prefix + ".o_proj", out.transpose(1, 0, 2).reshape(len(q), -1))


def two_way_block(w: Mapping[str, np.ndarray], i: int, heads: int, q: np.ndarray, k: np.ndarray,
                  q_pe: np.ndarray, k_pe: np.ndarray) -> tuple[F32Array, F32Array]:
    """Block `i`: token self-attention (block 0 without positions or residual), tokens to image, the token MLP,
    image to tokens, each followed by a LayerNorm."""
    p = f"{TWO_WAY}layers.{i}."
    if i == 0:
        q = attention(w, p + "self_attn", heads, q, q, q)
    else:
        qp = q + q_pe
        q = q + attention(w, p + "self_attn", heads, qp, qp, q)
    q = _ln(w, p + "layer_norm1", q, TWO_WAY_EPS)
    q = q + attention(w, p + "cross_attn_token_to_image", heads, q + q_pe, k + k_pe, k)
    q = _ln(w, p + "layer_norm2", q, TWO_WAY_EPS)
    q = _ln(w, p + "layer_norm3", q + mlp(w, p + "mlp", q), TWO_WAY_EPS)
    k = k + attention(w, p + "cross_attn_image_to_token", heads, k + k_pe, q + q_pe, q)
    return q, _ln(w, p + "layer_norm4", k, TWO_WAY_EPS)


def two_way(w: Mapping[str, np.ndarray], cfg: TrackerConfig, tokens: np.ndarray, image: np.ndarray,
            image_pe: np.ndarray) -> tuple[F32Array, F32Array]:
    """The two-way transformer: `(tokens_out, image_out)`. The tokens as they came in are their own positions."""
    q, k = np.asarray(tokens, dtype=_F32), np.asarray(image, dtype=_F32)
    for i in range(cfg.layers):
        q, k = two_way_block(w, i, cfg.heads, q, k, tokens, image_pe)
    q = q + attention(w, TWO_WAY + "final_attn_token_to_image", cfg.heads, q + tokens, k + image_pe, k)
    return _ln(w, TWO_WAY + "layer_norm_final_attn", q, TWO_WAY_EPS), k


def output_tokens(w: Mapping[str, np.ndarray], cfg: TrackerConfig) -> F32Array:
    """The learned tokens in the decoder's order: object score, IoU, then the mask tokens."""
    out: F32Array = np.concatenate([tensor(w, DEC + "obj_score_token.weight", (1, cfg.width)),
                                    tensor(w, DEC + "iou_token.weight", (1, cfg.width)),
                                    tensor(w, DEC + "mask_tokens.weight", (cfg.multimask_outputs + 1, cfg.width))])
    return out


def upscale(w: Mapping[str, np.ndarray], cfg: TrackerConfig, image: np.ndarray, skips: list[np.ndarray]) -> F32Array:
    """The image side `[grid^2, width]` to `[side^2, C]` channels-last: ConvT + the level-1 skip, LayerNorm (the
    config's eps), GELU; ConvT + the level-0 skip, GELU. `skips` are the projected levels 0 and 1, channels-last
    `[side^2, C0]` and `[(side/2)^2, C1]`."""
    g = cfg.grid
    c1 = tensor(w, DEC + "upscale_conv1.weight", (cfg.width, -1, 2, 2))
    x = conv_transpose2x2(np.asarray(image, dtype=_F32).reshape(g, g, -1), c1, tensor(w, DEC + "upscale_conv1.bias"))
    x = x.reshape(4 * g * g, -1) + skips[1]
    x = hostmath.gelu_erf(_ln(w, DEC + "upscale_layer_norm", x, cfg.layer_norm_eps))
    c2 = tensor(w, DEC + "upscale_conv2.weight", (x.shape[1], -1, 2, 2))
    y = conv_transpose2x2(x.reshape(2 * g, 2 * g, -1), c2, tensor(w, DEC + "upscale_conv2.bias"))
    return hostmath.gelu_erf(y.reshape(16 * g * g, -1) + skips[0])


def hypernetworks(w: Mapping[str, np.ndarray], mask_tokens: np.ndarray) -> F32Array:
    """Each mask token through its own MLP (`output_hypernetworks_mlps.<i>`), batched over the tokens."""
    n = len(mask_tokens)
    layers = [mlp_names(w, f"{DEC}output_hypernetworks_mlps.{i}") for i in range(n)]
    h = np.asarray(mask_tokens, dtype=_F32)[:, None, :]
    for depth in range(len(layers[0])):
        wt = np.stack([tensor(w, layers[i][depth] + ".weight") for i in range(n)])
        b = np.stack([tensor(w, layers[i][depth] + ".bias") for i in range(n)])
        h = h @ wt.transpose(0, 2, 1) + b[:, None, :]
        if depth < len(layers[0]) - 1:
            h = np.maximum(h, _F32(0))
    out: F32Array = h[:, 0, :]
    return out


def decode(w: Mapping[str, np.ndarray], cfg: TrackerConfig, embeddings: list[np.ndarray], image_pe: np.ndarray,
           sparse: np.ndarray, dense: np.ndarray) -> DecoderOutput:
    """All candidates for one prompt.

    Args:
        w: the checkpoint's tensors.
        cfg: the tracker config.
        embeddings: the image embeddings, channels-last raster: projected level 0 `[side^2, C0]`, projected
            level 1 `[(side/2)^2, C1]`, level 2 `[grid^2, width]`.
        image_pe: `[grid^2, width]`.
        sparse: the prompt tokens `[N, width]`.
        dense: the dense prompt `[grid^2, width]`.

    Raises:
        TrackerError: a checkpoint tensor is missing or of an unexpected shape.
    """
    tokens = np.concatenate([output_tokens(w, cfg), np.asarray(sparse, dtype=_F32)])
    q, k = two_way(w, cfg, tokens, np.asarray(embeddings[2], dtype=_F32) + dense, image_pe)
    n_masks = cfg.multimask_outputs + 1
    up = upscale(w, cfg, k, [embeddings[0], embeddings[1]])
    hyper = hypernetworks(w, q[2:2 + n_masks])
    side = cfg.mask_side
    masks = (hyper @ up.T).reshape(n_masks, side, side)
    iou = 1 / (1 + np.exp(-mlp(w, DEC + "iou_prediction_head", q[1])))
    obj = mlp(w, DEC + "pred_obj_score_head", q[0])
    return DecoderOutput(tokens=q, image=k, upscaled=up.T.reshape(-1, side, side), hyper_in=hyper,
                         masks=masks.astype(_F32), iou=iou.astype(_F32), object_score=float(obj[0]))
