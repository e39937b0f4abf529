"""The tracker's part of `sam3 export` (docs/sam3-tracker.md 9): when config.json has a `tracker_config`, the
bundle gets `tracker=1`, the tracker params, the tracker neck packed for the detector neck's GEMMs (`tn.*`) and
the prompt encoder's and two-way decoder's host tensors (`trk.*`).

The neck is packed exactly as the detector's (`n_in` for the three levels' first steps, `n_up`, the 3x3 convs as
the `conv` GEMM's banded B), with one difference: the decoder's 1x1 projections of levels 0 and 1 (`conv_s0`,
`conv_s1`) are folded into those levels' 3x3 convs, which then keep only `trk_out_ch[i]` of their channels (the
others are zero columns). `host_names` is the one table of host tensors, read both ways: the export writes
bundle names from checkpoint names, `tracker_bundle` maps them back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from sam3 import pack
from sam3.bundle import BundleWriter
from sam3.export_text import ExportError
from sam3.tracker_config import MODEL, NECK, TrackerConfig, TrackerError, read_config
from sam3.tracker_decoder import DEC, TWO_WAY
from sam3.tracker_prompt import PE, image_pe

ATTENTIONS = (("sa", "self_attn"), ("t2i", "cross_attn_token_to_image"), ("i2t", "cross_attn_image_to_token"))
VECTORS = ("trk.not_a_point", "trk.no_mask")    # [1, c] embedding tables, written as [c]
TOKENS = (DEC + "obj_score_token.weight", DEC + "iou_token.weight", DEC + "mask_tokens.weight")


class Checkpoint(Protocol):
    """What the export reads the checkpoint through (sam3.export's reader)."""

    names: set[str]

    def get(self, name: str) -> np.ndarray: ...


class Exporter(Protocol):
    """The parts of sam3.export's writer the tracker stage uses."""

    say: Callable[[str], None]

    @property
    def w(self) -> BundleWriter: ...

    @property
    def ck(self) -> Checkpoint: ...

    @property
    def root(self) -> Any: ...

    @property
    def g(self) -> Any: ...

    def packed(self, name: str, key: str, b: np.ndarray, bias: np.ndarray | None = None) -> None: ...

    def f32(self, name: str, array: np.ndarray) -> None: ...


def _mlp_layers(names: set[str] | Mapping[str, Any], prefix: str) -> list[str]:
    middle: list[str] = []
    while f"{prefix}.layers.{len(middle)}.weight" in names:
        middle.append(f"{prefix}.layers.{len(middle)}")
    return [prefix + ".proj_in", *middle, prefix + ".proj_out"]


def mlps(cfg: TrackerConfig, names: set[str] | Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """Each tracker MLP: its bundle name and its checkpoint layers in order (bundle layer j = list item j)."""
    out = [(f"trk.{i}.mlp", _mlp_layers(names, f"{TWO_WAY}layers.{i}.mlp")) for i in range(cfg.layers)]
    out += [(f"trk.hyper{i}", _mlp_layers(names, f"{DEC}output_hypernetworks_mlps.{i}"))
            for i in range(cfg.multimask_outputs + 1)]
    out += [("trk.iou_head", _mlp_layers(names, DEC + "iou_prediction_head")),
            ("trk.obj_head", _mlp_layers(names, DEC + "pred_obj_score_head"))]
    return out


def host_names(cfg: TrackerConfig, names: set[str] | Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(bundle name, checkpoint name) of every host tensor copied as it is (a vector flattened to 1-D)."""
    yield from (("trk.pe_gauss", PE + "shared_embedding.positional_embedding"),
                ("trk.point_embed", PE + "point_embed.weight"),
                ("trk.not_a_point", PE + "not_a_point_embed.weight"),
                ("trk.no_mask", PE + "no_mask_embed.weight"))

    def pair(bundle: str, ckpt: str) -> Iterator[tuple[str, str]]:
        yield bundle + ".w", ckpt + ".weight"
        yield bundle + ".b", ckpt + ".bias"

    for i in range(cfg.layers):
        for short, long in ATTENTIONS:
            for part in "qkvo":
                yield from pair(f"trk.{i}.{short}.{part}", f"{TWO_WAY}layers.{i}.{long}.{part}_proj")
        for j in range(1, 5):
            yield from pair(f"trk.{i}.ln{j}", f"{TWO_WAY}layers.{i}.layer_norm{j}")
    for part in "qkvo":
        yield from pair(f"trk.final.{part}", f"{TWO_WAY}final_attn_token_to_image.{part}_proj")
    yield from pair("trk.final_ln", TWO_WAY + "layer_norm_final_attn")
    yield from pair("trk.up1", DEC + "upscale_conv1")
    yield from pair("trk.up2", DEC + "upscale_conv2")
    yield from pair("trk.up_ln", DEC + "upscale_layer_norm")
    for name, layers in mlps(cfg, names):
        for j, layer in enumerate(layers):
            yield from pair(f"{name}.{j}", layer)


def out_channels(ck: Checkpoint) -> list[int]:
    """`trk_out_ch`: the channels each neck level keeps (conv_s0's and conv_s1's outputs, then level 2's)."""
    return [int(ck.get(DEC + "conv_s0.weight").shape[0]), int(ck.get(DEC + "conv_s1.weight").shape[0]),
            int(ck.get(NECK + "fpn_layers.2.proj2.weight").shape[0])]


def params(cfg: TrackerConfig, ck: Checkpoint) -> dict[str, Any]:
    """The tracker params (docs/sam3-bundle.md 4): sizes, the stability rule, each MLP's depth."""
    out: dict[str, Any] = {"tracker": True, "trk_heads": cfg.heads, "trk_layers": cfg.layers,
                           "trk_mask_tokens": cfg.multimask_outputs + 1, "trk_out_ch": out_channels(ck),
                           "trk_stability_delta": cfg.stability_delta, "trk_stability_thresh": cfg.stability_thresh}
    out |= {f"{name}.depth": len(layers) for name, layers in mlps(cfg, ck.names)}
    return out


def _taps(w: np.ndarray) -> np.ndarray:
    """A 2x2 transposed conv weight `[in, out, 2, 2]` as B `[in, 4 out]`, tap-major (docs/sam3-export.md 5)."""
    cin, cout = w.shape[:2]
    return np.ascontiguousarray(w.reshape(cin, cout, 4).transpose(0, 2, 1).reshape(cin, 4 * cout))


def _taps_then_1x1(w: np.ndarray, b: np.ndarray, proj: np.ndarray, proj_b: np.ndarray) -> tuple[np.ndarray,
                                                                                                 np.ndarray]:
    """A transposed conv followed by a 1x1 conv (nothing non-linear between) as one B and its per-tap bias."""
    cin, mid = w.shape[:2]
    p = proj.reshape(proj.shape[0], mid).astype(np.float64)
    taps = np.einsum("ick,oc->iko", w.reshape(cin, mid, 4).astype(np.float64), p)
    return taps.reshape(cin, -1).astype(np.float32), np.tile(p @ b + proj_b, 4).astype(np.float32)


def folded_conv(w3: np.ndarray, b3: np.ndarray, proj: np.ndarray | None, proj_b: np.ndarray | None,
                width: int) -> tuple[np.ndarray, np.ndarray]:
    """A 3x3 conv `[C, C, 3, 3]` followed by a 1x1 `[OC, C, 1, 1]` (or nothing) as one 3x3 conv of `width` output
    channels and its bias, both zero beyond OC (so the neck's conv code runs it unchanged)."""
    if proj is None or proj_b is None:
        return w3, b3
    p = proj.reshape(proj.shape[0], -1).astype(np.float64)
    full, bias = np.zeros((width, *w3.shape[1:]), np.float32), np.zeros(width, np.float32)
    full[:len(p)] = np.einsum("oc,cikl->oikl", p, w3.astype(np.float64))
    bias[:len(p)] = p @ b3 + proj_b
    return full, bias


def neck(e: Exporter, cfg: TrackerConfig) -> None:
    """`tn.in`, `tn.up`, `tn.conv0..2` (+ `.b`): the tracker neck packed as the detector's."""
    get = e.ck.get
    n0, n1, n2 = (f"{NECK}fpn_layers.{i}." for i in range(3))
    t0, b0 = _taps(get(n0 + "scale_layers.0.weight")), np.tile(get(n0 + "scale_layers.0.bias"), 4)
    t1, b1 = _taps_then_1x1(get(n1 + "scale_layers.0.weight"), get(n1 + "scale_layers.0.bias"),
                            get(n1 + "proj1.weight"), get(n1 + "proj1.bias"))
    t2 = get(n2 + "proj1.weight").reshape(cfg.fpn_width, -1).T
    e.packed("tn.in", "n_in", np.concatenate([t0, t1, t2], axis=1), np.concatenate([b0, b1, get(n2 + "proj1.bias")]))
    up, up_b = _taps_then_1x1(get(n0 + "scale_layers.2.weight"), get(n0 + "scale_layers.2.bias"),
                              get(n0 + "proj1.weight"), get(n0 + "proj1.bias"))
    e.packed("tn.up", "n_up", up, up_b)
    for i, n in enumerate((n0, n1, n2)):
        pw, pb = (get(f"{DEC}conv_s{i}.weight"), get(f"{DEC}conv_s{i}.bias")) if i < 2 else (None, None)
        w3, b3 = folded_conv(get(n + "proj2.weight"), get(n + "proj2.bias"), pw, pb, cfg.fpn_width)
        e.packed(f"tn.conv{i}", "conv", pack.conv_weights(w3, e.g.conv_p))
        e.f32(f"tn.conv{i}.b", b3)


def host(e: Exporter, cfg: TrackerConfig) -> None:
    """The `trk.*` host tensors, plus the learned tokens in the decoder's order and the image PE."""
    get = e.ck.get
    for bundle, ckpt in host_names(cfg, e.ck.names):
        a = get(ckpt)
        e.f32(bundle, a.reshape(-1) if bundle in VECTORS else a)
    e.f32("trk.tokens", np.concatenate([get(n) for n in TOKENS]))
    e.f32("trk.image_pe", image_pe({n: get(n) for n in (MODEL + "shared_image_embedding.positional_embedding",)},
                                   cfg))


def needed(cfg: TrackerConfig, names: set[str]) -> Iterator[str]:
    """Every checkpoint tensor the tracker stage reads."""
    yield from (ckpt for _, ckpt in host_names(cfg, names))
    yield from TOKENS
    yield MODEL + "shared_image_embedding.positional_embedding"
    for i in range(3):
        n = f"{NECK}fpn_layers.{i}."
        layers = ("scale_layers.0", "scale_layers.2")[:2 - i] + ("proj1", "proj2")
        yield from (f"{n}{layer}.{kind}" for layer in layers for kind in ("weight", "bias"))
    yield from (f"{DEC}conv_s{i}.{kind}" for i in range(2) for kind in ("weight", "bias"))


def write(e: Exporter) -> None:
    """The tracker stage of an export: nothing when config.json has no `tracker_config`.

    Raises:
        ExportError: a tracker config the bundle cannot take, a tracker tensor missing from the checkpoint, or a
            packed operand that does not fit.
    """
    config = read_config(e.root)
    if "tracker_config" not in config:
        return
    try:
        cfg = TrackerConfig.from_config(config)
    except TrackerError as err:
        raise ExportError(str(err)) from err
    if cfg.scale_factors[:3] != (4.0, 2.0, 1.0) or cfg.levels != 3:
        raise ExportError(f"tracker neck: scale_factors {list(cfg.scale_factors)} with {cfg.levels} levels (the "
                           "bundle packs the detector neck's 4, 2, 1)")
    missing = sorted(set(needed(cfg, e.ck.names)) - e.ck.names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ExportError(f"{e.root}: tracker tensor {missing[0]} missing from the checkpoint{more}")
    e.say("tracker")
    for name, value in params(cfg, e.ck).items():
        e.w.param(name, value)
    neck(e, cfg)
    host(e, cfg)
