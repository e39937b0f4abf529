"""The tracker of a bundle (`tracker=1`, docs/sam3-tracker.md 9): its config from the params and its host tensors
under the checkpoint names the host stages read, by the export's one name table read backwards.
"""

from __future__ import annotations

import numpy as np

from sam3.bundle import Bundle
from sam3.export_tracker import TOKENS, VECTORS, host_names, mlps
from sam3.tracker_config import MODEL, TrackerConfig, TrackerError
from sam3.tracker_prompt import PE

# The upscaling LayerNorm's eps: the bundle carries no eps, and SAM 2's decoder (and so SAM3's) fixes it at 1e-6.
UPSCALE_EPS = 1e-6


def _need_tracker(bundle: Bundle) -> None:
    if not bundle.params.tracker:
        raise TrackerError(f"bundle {bundle.root} has no tracker (param tracker is not 1): export it from a "
                           "checkpoint with a tracker_config")


def config(bundle: Bundle) -> TrackerConfig:
    """The tracker config of `bundle`, from its params and tensor shapes.

    Raises:
        TrackerError: the bundle has no tracker.
        BundleError: a tracker tensor is missing.
    """
    _need_tracker(bundle)
    p, t = bundle.params, bundle.tensors
    width = int(t.get("trk.no_mask", "f32").size)
    cross = int(t.get("trk.0.t2i.q.w", "f32").shape[0])
    return TrackerConfig(width=width, image_size=p.image_size, patch=p.patch, heads=p.trk_heads or 0,
                         layers=p.trk_layers or 0, downsample=width // cross,
                         multimask_outputs=(p.trk_mask_tokens or 1) - 1,
                         stability_delta=float(p.trk_stability_delta or 0.0),
                         stability_thresh=float(p.trk_stability_thresh or 0.0), dynamic_stability=True,
                         scale_factors=(4.0, 2.0, 1.0), levels=3, backbone_width=p.vit_dim, fpn_width=p.d_model,
                         layer_norm_eps=UPSCALE_EPS)


def weights(bundle: Bundle, cfg: TrackerConfig) -> dict[str, np.ndarray]:
    """The prompt encoder's and decoder's tensors of `bundle` under their checkpoint names (float32 copies).

    Raises:
        TrackerError: the bundle has no tracker.
        BundleError: a tracker tensor or MLP depth is missing, or a tensor is not f32.
    """
    _need_tracker(bundle)
    t = bundle.tensors
    layer_names: set[str] = set()
    for name, layers in mlps(cfg, set()):
        prefix = layers[0].removesuffix(".proj_in")
        layer_names |= {f"{prefix}.layers.{k}.weight" for k in range(bundle.params.depth(name) - 2)}
    out: dict[str, np.ndarray] = {}
    for bundle_name, ckpt in host_names(cfg, layer_names):
        a = np.array(t.get(bundle_name, "f32"))
        out[ckpt] = a.reshape(1, -1) if bundle_name in VECTORS else a
    gauss = out[PE + "shared_embedding.positional_embedding"]
    out[MODEL + "shared_image_embedding.positional_embedding"] = gauss
    tokens = np.array(t.get("trk.tokens", "f32")).reshape(-1, cfg.width)
    out[TOKENS[0]], out[TOKENS[1]], out[TOKENS[2]] = tokens[:1], tokens[1:2], tokens[2:]
    return out
