"""The shared ViT backbone on the host in float32, read straight from a checkpoint, for the tracker's host path
(docs/sam3-tracker.md 6). The NPU path runs the bundle's ViT instead (sam3/vit.py).

Patch embedding (a stride-patch convolution without bias) plus the pretraining grid's position table tiled over
the image grid, a LayerNorm, then layers of pre-norm attention with 2-D axial RoPE (windowed, or global on the
layers `global_attn_indexes` names) and a GELU MLP. Output `[grid^2, width]` in raster order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sam3 import hostmath
from sam3.tracker_config import F32Array, TrackerError, tensor

_F32 = np.float32
PREFIXES = ("vision_encoder.backbone.", "detector_model.vision_encoder.backbone.")


@dataclass(frozen=True)
class VitConfig:
    """The backbone's sizes (transformers' `Sam3ViTConfig` names)."""

    width: int
    heads: int
    layers: int
    patch: int
    image_size: int
    window: int
    global_layers: tuple[int, ...]
    eps: float
    rope_theta: float

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VitConfig:
        """From a parsed config.json: the tracker's (or the detector's) `vision_config.backbone_config`.

        Raises:
            TrackerError: there is no backbone config, or it lacks a size.
        """
        for path in (("tracker_config", "vision_config"), ("vision_config",), ("detector_config", "vision_config")):
            node: Any = config
            for key in path:
                node = node.get(key) if isinstance(node, Mapping) else None
            if isinstance(node, Mapping) and isinstance(node.get("backbone_config"), Mapping):
                bc = node["backbone_config"]
                break
        else:
            raise TrackerError("config.json has no vision_config.backbone_config")
        try:
            return cls(width=int(bc["hidden_size"]), heads=int(bc["num_attention_heads"]),
                       layers=int(bc["num_hidden_layers"]), patch=int(bc["patch_size"]),
                       image_size=int(bc["image_size"]), window=int(bc["window_size"]),
                       global_layers=tuple(int(i) for i in bc["global_attn_indexes"]),
                       eps=float(bc["layer_norm_eps"]), rope_theta=float(bc["rope_parameters"]["rope_theta"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TrackerError(f"backbone_config: {e!r} missing or malformed") from e


def prefix(weights: Mapping[str, np.ndarray]) -> str:
    """Where the backbone's tensors are: unprefixed (a `sam3` checkpoint) or under `detector_model.` (`sam3_video`).

    Raises:
        TrackerError: the checkpoint has no backbone.
    """
    for p in PREFIXES:
        if p + "layer_norm.weight" in weights:
            return p
    raise TrackerError("checkpoint has no ViT backbone (vision_encoder.backbone.* or detector_model.vision_encoder."
                       "backbone.*)")


def rope_tables(cfg: VitConfig, side: int) -> tuple[F32Array, F32Array]:
    """cos and sin `[side^2, head]` of the axial RoPE on a `side x side` grid (a window, or the whole grid, whose
    positions are scaled by window / grid): the first half of each head's pairs rotates with x, the second with y."""
    head = cfg.width // cfg.heads
    half = head // 2      # each axis rotates half of the head's pairs
    inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, half, 2, dtype=_F32) / _F32(half)))).astype(_F32)
    ys, xs = np.meshgrid(np.arange(side, dtype=_F32), np.arange(side, dtype=_F32), indexing="ij")
    pos = np.stack([xs.ravel(), ys.ravel()], axis=-1) * _F32(cfg.window / side)
    freqs = (pos[:, :, None] * inv_freq).reshape(side * side, -1)
    angles = np.repeat(freqs, 2, axis=-1)
    return np.cos(angles).astype(_F32), np.sin(angles).astype(_F32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> F32Array:
    """RoPE on adjacent pairs of the last axis: (a, b) -> (a cos - b sin, b cos + a sin)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    turned = np.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    out: F32Array = x * cos + turned * sin
    return out


def windows(x: np.ndarray, w: int) -> tuple[F32Array, int]:
    """`[g, g, C]` to `[n_windows, w*w, C]` (zero-padded to a multiple of w), and the padded side."""
    g, _, c = x.shape
    side = -(-g // w) * w
    padded = np.pad(x, ((0, side - g), (0, side - g), (0, 0)))
    n = side // w
    out: F32Array = padded.reshape(n, w, n, w, c).transpose(0, 2, 1, 3, 4).reshape(n * n, w * w, c)
    return out, side


def unwindow(x: np.ndarray, w: int, side: int, g: int) -> F32Array:
    """The inverse of `windows`: `[g, g, C]`."""
    n = side // w
    out: F32Array = x.reshape(n, n, w, w, -1).transpose(0, 2, 1, 3, 4).reshape(side, side, -1)[:g, :g]
    return out


def attention(w: Mapping[str, np.ndarray], p: str, cfg: VitConfig, x: np.ndarray, cos: np.ndarray,
              sin: np.ndarray) -> F32Array:
    """Self-attention within each group of `x` `[groups, n, C]`, RoPE on q and k."""
    groups, n, c = x.shape
    head = c // cfg.heads

    def proj(name: str) -> F32Array:
        y = hostmath.linear(x, tensor(w, f"{p}{name}.weight"), tensor(w, f"{p}{name}.bias"))
        out: F32Array = y.reshape(groups, n, cfg.heads, head).transpose(0, 2, 1, 3)
        return out

    q, k, v = rotate(proj("q_proj"), cos, sin), rotate(proj("k_proj"), cos, sin), proj("v_proj")
    scores = (q @ k.transpose(0, 1, 3, 2)) * _F32(head ** -0.5)
    out = (hostmath.softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(groups, n, c)
    return hostmath.linear(out, tensor(w, f"{p}o_proj.weight"), tensor(w, f"{p}o_proj.bias"))


def embed(w: Mapping[str, np.ndarray], cfg: VitConfig, pixels: np.ndarray, p: str) -> F32Array:
    """Patch embedding plus the tiled position table, then the pre-layer LayerNorm: `[g, g, C]`."""
    g, ps = cfg.grid, cfg.patch
    proj = tensor(w, p + "embeddings.patch_embeddings.projection.weight", (cfg.width, -1, ps, ps))
    px = np.asarray(pixels, dtype=_F32)
    cin = px.shape[0]
    cells = px[:, :g * ps, :g * ps].reshape(cin, g, ps, g, ps).transpose(1, 3, 0, 2, 4).reshape(g * g, -1)
    x = (cells @ proj.reshape(cfg.width, -1).T).reshape(g, g, cfg.width)
    table = tensor(w, p + "embeddings.position_embeddings", (1, -1, cfg.width))[0]
    pre = int(round(len(table) ** 0.5))
    reps = g // pre + 1
    x = x + np.tile(table.reshape(pre, pre, cfg.width), (reps, reps, 1))[:g, :g]
    return hostmath.layer_norm(x, tensor(w, p + "layer_norm.weight"), tensor(w, p + "layer_norm.bias"), cfg.eps)


def forward(w: Mapping[str, np.ndarray], cfg: VitConfig, pixels: np.ndarray) -> F32Array:
    """The backbone's last hidden state `[grid^2, width]` (raster) from normalised pixels `[3, S, S]`.

    Raises:
        TrackerError: the checkpoint has no backbone, or a tensor is missing or misshapen.
    """
    p = prefix(w)
    g = cfg.grid
    x = embed(w, cfg, pixels, p)
    win_tables = rope_tables(cfg, cfg.window)
    glob_tables = rope_tables(cfg, g)
    for i in range(cfg.layers):
        lp = f"{p}layers.{i}."
        h = hostmath.layer_norm(x, tensor(w, lp + "layer_norm1.weight"), tensor(w, lp + "layer_norm1.bias"), cfg.eps)
        if i in cfg.global_layers:
            a = attention(w, lp + "attention.", cfg, h.reshape(1, g * g, -1), *glob_tables).reshape(g, g, -1)
        else:
            grouped, side = windows(h, cfg.window)
            a = unwindow(attention(w, lp + "attention.", cfg, grouped, *win_tables), cfg.window, side, g)
        x = x + a
        h = hostmath.layer_norm(x, tensor(w, lp + "layer_norm2.weight"), tensor(w, lp + "layer_norm2.bias"), cfg.eps)
        h = hostmath.gelu_erf(hostmath.linear(h, tensor(w, lp + "mlp.fc1.weight"), tensor(w, lp + "mlp.fc1.bias")))
        x = x + hostmath.linear(h, tensor(w, lp + "mlp.fc2.weight"), tensor(w, lp + "mlp.fc2.bias"))
    out: F32Array = x.reshape(g * g, cfg.width)
    return out
