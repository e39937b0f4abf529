"""The tracker's own FPN neck on the host, float32, and the mask decoder's projections of its two finer levels
(docs/sam3-tracker.md 2).

The tracker shares the detector's ViT but not its neck: `tracker_neck.fpn_layers.<i>` has the detector neck's
shape with its own weights. Level i rescales the ViT's map by `scale_factors[i]` (4: ConvT, GELU, ConvT; 2: one
ConvT; 1: nothing), then a 1x1 and a 3x3 convolution. Only the first `levels` levels are used. Levels 0 and 1 are
then projected by the mask decoder's `conv_s0` / `conv_s1` (1x1), once per image, as every prompt reuses them.
Maps are channels-last `[side^2, C]` raster throughout.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sam3 import hostmath, neck
from sam3.bundle import Bundle
from sam3.npu import Io, Npu
from sam3.pack import round_bf16
from sam3.tracker_config import MODEL, NECK, F32Array, TrackerConfig, TrackerError, tensor
from sam3.tracker_layers import conv1x1, conv3x3, conv_transpose2x2
from sam3.vit import reference_gemm

_F32 = np.float32


def level(w: Mapping[str, np.ndarray], cfg: TrackerConfig, i: int, grid_map: np.ndarray) -> F32Array:
    """Level `i` of the neck from the ViT map `[g, g, D]`: `[side, side, fpn_width]`.

    Raises:
        TrackerError: the level's scale factor is not one the decoder uses (4, 2 or 1), or a tensor is missing.
    """
    p = f"{NECK}fpn_layers.{i}."
    scale = cfg.scale_factors[i]
    x = np.asarray(grid_map, dtype=_F32)
    if scale in (4.0, 2.0):
        x = conv_transpose2x2(x, tensor(w, p + "scale_layers.0.weight"), tensor(w, p + "scale_layers.0.bias"))
    if scale == 4.0:
        x = conv_transpose2x2(hostmath.gelu_erf(x), tensor(w, p + "scale_layers.2.weight"),
                              tensor(w, p + "scale_layers.2.bias"))
    elif scale not in (2.0, 1.0):
        raise TrackerError(f"tracker neck level {i}: scale factor {scale} (the mask decoder reads 4, 2 and 1)")
    x = conv1x1(x, tensor(w, p + "proj1.weight", (cfg.fpn_width, x.shape[-1], 1, 1)), tensor(w, p + "proj1.bias"))
    return conv3x3(x, tensor(w, p + "proj2.weight", (cfg.fpn_width, cfg.fpn_width, 3, 3)), tensor(w, p + "proj2.bias"))


def levels(w: Mapping[str, np.ndarray], cfg: TrackerConfig, vit_out: np.ndarray) -> list[F32Array]:
    """The neck's levels the decoder reads, channels-last `[side^2, fpn_width]`, from the ViT's raster output."""
    g = cfg.grid
    grid_map = np.asarray(vit_out, dtype=_F32).reshape(g, g, -1)
    return [level(w, cfg, i, grid_map).reshape(-1, cfg.fpn_width) for i in range(cfg.levels)]


def project(w: Mapping[str, np.ndarray], fpn: list[np.ndarray]) -> list[F32Array]:
    """The decoder's image embeddings from the neck's levels: level 0 through `conv_s0`, level 1 through
    `conv_s1`, level 2 unchanged."""
    dec = MODEL + "mask_decoder."
    s0 = conv1x1(fpn[0], tensor(w, dec + "conv_s0.weight"), tensor(w, dec + "conv_s0.bias"))
    s1 = conv1x1(fpn[1], tensor(w, dec + "conv_s1.weight"), tensor(w, dec + "conv_s1.bias"))
    return [s0, s1, np.asarray(fpn[2], dtype=_F32)]


def image_embeddings(w: Mapping[str, np.ndarray], cfg: TrackerConfig, vit_out: np.ndarray) -> list[F32Array]:
    """`project(levels(...))`: what the mask decoder consumes for every prompt on this image."""
    return project(w, levels(w, cfg, vit_out))


# ---------------------------------------------------------------------------------------------
# From a bundle: the `tn.*` operands on the detector neck's GEMMs (docs/sam3-tracker.md 9)

TN = ("tn.in", "tn.up", "tn.conv0", "tn.conv1", "tn.conv2")


def _keep(bundle: Bundle, levels: list[np.ndarray]) -> list[F32Array]:
    """Each level's first `trk_out_ch[i]` channels: the export folded the skip projections into the convs."""
    out_ch = bundle.params.trk_out_ch or []
    if len(out_ch) != len(levels) or any(c > lvl.shape[1] for c, lvl in zip(out_ch, levels, strict=False)):
        raise TrackerError(f"trk_out_ch {out_ch} does not fit the neck's {[lvl.shape[1] for lvl in levels]} channels")
    return [np.ascontiguousarray(lvl[:, :c], dtype=_F32) for lvl, c in zip(levels, out_ch, strict=True)]


class NpuNeck:
    """The tracker neck on an `Npu`: the detector neck's code with the `tn.*` operands; conv operand sets are
    shared with whoever else passes the same `convs` dict."""

    def __init__(self, npu: Npu, convs: dict[int, Io] | None = None):
        if not npu.bundle.params.tracker:
            raise TrackerError(f"bundle {npu.bundle.root} has no tracker (param tracker is not 1)")
        self.neck = neck.Neck(npu, convs)

    def forward(self, vit_out: np.ndarray) -> list[F32Array]:
        """The decoder's image embeddings `[(4g)^2, C0]`, `[(2g)^2, C1]`, `[g^2, C]` from the ViT's raster output.

        Raises:
            NpuError: a kernel failed.
        """
        nk, s, g = self.neck, self.neck.s, self.neck.s.grid
        nk.n_in.set_a(vit_out)
        nk.npu.run(nk.n_in, nk.npu.weights("tn.in"))
        y = nk.n_in.get_c_f32(g * g)
        lvl0 = round_bf16(hostmath.gelu_erf(round_bf16(neck.shuffle(y[:, :s.s0], g, s.mid))))
        nk.n_up.set_a(lvl0)
        nk.npu.run(nk.n_up, nk.npu.weights("tn.up"))
        up = nk.n_up.get_c_f32(4 * g * g)[:, :4 * s.d]
        levels = [nk.conv(4 * g, neck.shuffle(up, 2 * g, s.d), "tn.conv0", "tn.conv0.b"),
                  nk.conv(2 * g, neck.shuffle(y[:, s.s0:s.s0 + 4 * s.d], g, s.d), "tn.conv1", "tn.conv1.b"),
                  nk.conv(g, y[:, s.s0 + s.s1:s.s0 + s.s1 + s.d], "tn.conv2", "tn.conv2.b")]
        return _keep(nk.npu.bundle, levels)


def bundle_reference(bundle: Bundle, vit_out: np.ndarray) -> list[F32Array]:
    """`NpuNeck.forward` in float32 numpy over the bundle's packed `tn.*` operands (unpacked)."""
    s = neck.Splits(bundle)
    g = s.grid
    y = reference_gemm(bundle, "n_in", "tn.in", vit_out)
    lvl0 = hostmath.gelu_erf(neck.shuffle(y[:, :s.s0], g, s.mid))
    up = reference_gemm(bundle, "n_up", "tn.up", lvl0)[:, :4 * s.d]
    levels = [neck.reference_conv(bundle, neck.shuffle(up, 2 * g, s.d), 4 * g, "tn.conv0", "tn.conv0.b"),
              neck.reference_conv(bundle, neck.shuffle(y[:, s.s0:s.s0 + 4 * s.d], g, s.d), 2 * g, "tn.conv1",
                                  "tn.conv1.b"),
              neck.reference_conv(bundle, y[:, s.s0 + s.s1:s.s0 + s.s1 + s.d], g, "tn.conv2", "tn.conv2.b")]
    return _keep(bundle, levels)
