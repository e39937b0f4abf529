"""Exporting a transformers SAM3 checkpoint as a bundle in the real format (docs/sam3-export.md).

`export(model_dir, out_dir)` reads `config.json` and `model.safetensors` (through safetensors' numpy API, one
tensor at a time) and writes every param, kernel record and tensor the pipeline reads (docs/sam3-bundle.md 5):
the NPU weights transformed as the kernels compute (window order, the RoPE half-split, LayerNorm folds,
transposed-convolution folds, padded DETR heads) and packed bfp16 for their GEMM records; the host tensors in
float32, torch layout; the text encoder through `sam3.export_text`; the tokenizer files. Kernels are copied from
a compiled bundle of the same shapes (`kernels=`), else the emulator's placeholder kernels are written as
`sam3.build` writes them. With `reference=` a reference.npz (docs/sam3-export.md 9) becomes the bundle's
`ref.*`, `case` and `tok_test` records and tensors, so that `sam3 check` runs on the bundle.

Every size comes from the checkpoint's config (or, for the kernels' compile-time choices, from the compiled
bundle); a checkpoint the bundle cannot hold is refused before anything is written.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from sam3 import build, export_text, export_tracker, pack, userfiles
from sam3.build import GemmShape, Geometry, GeometryError, MhaShape
from sam3.bundle import GEMM_KEYS, MHA_KEYS, OP_KEYS, Bundle, BundleError, BundleWriter, consistency
from sam3.export_text import ExportError
from sam3.hostmath import f32
from sam3.kernels import rope_table
from sam3.tokenizer import ClipTokenizer, TokenizerError

__all__ = ["RESIDUALS", "VIT_MODES", "ExportError", "Model", "export", "geometry", "main", "read_model",
           "rope_angles", "sine_position", "tiled_position"]

VIT_MODES = ("device", "host")
RESIDUALS = ("f32", "bf16")
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER_FILES = ("vocab.json", "merges.txt")
# The kernels' compile-time choices when no compiled bundle is given (docs/sam3-export.md 3): rows per GEMM
# dispatch, the largest tile (of these) that divides a dimension, the k-slice, the DETR MHA's head width, and
# the width the ViT MLP and the patch embedding's K are padded to.
GEMM_M = 64
TILES = (64, 32, 16, 8)
CT_K = 32
MHA_D_HEAD = 64
PAD = 64
# The placeholder kernels' device generation and seed (their PDI bytes): the emulator's default target.
KERNEL_TARGET = "npu4"
KERNEL_SEED = 0
# The neck levels the bundle holds, by transformers' scale factor, and the last level, which the model drops.
NECK_SCALES = (4.0, 2.0, 1.0)
DROPPED_SCALE = 0.5
# The sine position embedding of the neck's levels (docs/sam3-export.md 6.1).
SINE_TEMPERATURE = 10000.0
SINE_EPS = 1e-6

_BACKBONE = "vision_encoder.backbone."
_NECK = "vision_encoder.neck.fpn_layers.{l}."
_ENC = "detr_encoder.layers.{i}."
_DEC = "detr_decoder."
_MASK = "mask_decoder."
_SCORE = "dot_product_scoring."

ProgressFn = Callable[[str], None]


# ---------------------------------------------------------------------------------------------
# The model's sizes, from config.json


@dataclass(frozen=True)
class Model:
    """The sizes of a SAM3 checkpoint that the bundle holds, read from its config (docs/sam3-export.md 2)."""

    image_size: int
    patch: int
    grid: int
    window: int
    vit_dim: int
    vit_heads: int
    vit_layers: int
    vit_ffn: int
    vit_global: tuple[int, ...]
    vit_eps: float
    rope_theta: float
    pos_side: int
    d_model: int
    d_heads: int
    d_layers: int
    d_ffn: int
    dec_layers: int
    queries: int
    text: Mapping[str, int | float]

    @property
    def tokens(self) -> int:
        """T = grid^2."""
        return self.grid * self.grid

    @property
    def head_dim(self) -> int:
        """Width of a ViT head."""
        return self.vit_dim // self.vit_heads

    @property
    def d_head(self) -> int:
        """Width of a DETR head."""
        return self.d_model // self.d_heads

    @property
    def neck_splits(self) -> tuple[int, int, int]:
        """n_in's column groups: level 0's first transposed conv (4 taps x vit_dim/2), level 1's folded with its
        1x1 (4 taps x d_model), level 2's 1x1 (d_model)."""
        return 2 * self.vit_dim, 4 * self.d_model, self.d_model


class _Config:
    """Typed reads of config.json, each error naming the key path."""

    def __init__(self, path: Path, data: Mapping[str, Any]):
        self.path, self.data = path, data

    def get(self, *keys: str) -> Any:
        node: Any = self.data
        for depth, key in enumerate(keys):
            if not isinstance(node, Mapping) or key not in node:
                raise ExportError(f"{self.path}: key {'.'.join(keys[:depth + 1])} missing")
            node = node[key]
        return node

    def int(self, *keys: str) -> int:
        value = self.get(*keys)
        if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            value = value[0]  # a square size given as [h, w]
        if type(value) is not int or value <= 0:
            raise ExportError(f"{self.path}: {'.'.join(keys)} = {value!r}, expected a positive integer")
        return value

    def float(self, *keys: str) -> float:
        value = self.get(*keys)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ExportError(f"{self.path}: {'.'.join(keys)} = {value!r}, expected a positive number")
        return float(value)

    def expect(self, keys: tuple[str, ...], want: object, why: str) -> None:
        value = self.get(*keys)
        if value != want:
            raise ExportError(f"{self.path}: {'.'.join(keys)} = {value!r}, expected {want!r} ({why})")

    def refuse(self, keys: str, detail: str) -> ExportError:
        return ExportError(f"{self.path}: {keys}: {detail}")


def read_model(model_dir: str | Path) -> Model:
    """The sizes of the SAM3 checkpoint in `model_dir`, checked against what a bundle can hold.

    Raises:
        ExportError: config.json is missing or not a SAM3 config (model_type), a key is missing or malformed,
            or a size breaks a rule of the bundle (docs/sam3-export.md 2): image_size not grid * patch, grid not
            a multiple of window, T not a multiple of 8, a ViT head dim not a multiple of 4, a width the packed
            GEMMs cannot tile, neck scale factors other than 4, 2, 1 (and 0.5), DETR widths that disagree; the
            message names the key and the values.
    """
    root = Path(model_dir)
    c = _Config(root / CONFIG, export_text.sam3_config(root))
    vit = _vit_sizes(c)
    _check_neck(c, vit["grid"])
    _check_processor(root, vit["image_size"], 4 * vit["grid"])
    return Model(**vit, **_detr_sizes(c), text=export_text.text_params(root))


_BB = ("vision_config", "backbone_config")


def _vit_sizes(c: _Config) -> dict[str, Any]:
    """The ViT's sizes, refusing the ones the bundle cannot take (docs/sam3-export.md 2)."""
    bb = _BB
    image, patch = c.int(*bb, "image_size"), c.int(*bb, "patch_size")
    if image % patch:
        raise c.refuse("vision_config.backbone_config.image_size", f"{image} is not a multiple of patch_size {patch}")
    grid, window = image // patch, c.int(*bb, "window_size")
    if grid % window:
        raise c.refuse("vision_config.backbone_config.window_size",
                       f"the {grid}x{grid} patch grid ({image} px / {patch}) is not a multiple of window {window}")
    if grid * grid % 8:
        raise c.refuse("vision_config.backbone_config.image_size",
                       f"T = grid^2 = {grid * grid} tokens is not a multiple of 8 (the decoder's attention needs it)")
    dim, heads = c.int(*bb, "hidden_size"), c.int(*bb, "num_attention_heads")
    if dim % heads or (dim // heads) % 4:
        raise c.refuse("vision_config.backbone_config.num_attention_heads",
                       f"head dim = hidden_size {dim} / {heads} heads must be a whole multiple of 4 (axial RoPE "
                       "rotates pairs of dims, a quarter of the head per image axis)")
    if dim % 16:
        raise c.refuse("vision_config.backbone_config.hidden_size",
                       f"{dim} is not a multiple of 16 (the neck's n_up GEMM takes hidden_size/2 = {dim // 2} "
                       "input columns, which the packing needs in multiples of 8)")
    layers = c.int(*bb, "num_hidden_layers")
    glob = c.get(*bb, "global_attn_indexes")
    if (not isinstance(glob, list) or any(type(i) is not int or not 0 <= i < layers for i in glob)
            or len(set(glob)) != len(glob)):
        raise c.refuse("vision_config.backbone_config.global_attn_indexes",
                       f"{glob!r}: expected distinct layer indices below num_hidden_layers {layers}")
    c.expect(bb + ("hidden_act",), "gelu", "the ViT MLP's GELU")
    c.expect(bb + ("num_channels",), 3, "RGB patches")
    rope = c.get(*bb, "rope_parameters")
    if not isinstance(rope, Mapping) or rope.get("rope_type") != "axial":
        raise c.refuse("vision_config.backbone_config.rope_parameters", f"{rope!r}: only axial RoPE is exported")
    pretrain = c.int(*bb, "pretrain_image_size")
    if pretrain % patch:
        raise c.refuse("vision_config.backbone_config.pretrain_image_size",
                       f"{pretrain} is not a multiple of patch_size {patch}")
    return dict(image_size=image, patch=patch, grid=grid, window=window, vit_dim=dim, vit_heads=heads,
                vit_layers=layers, vit_ffn=c.int(*bb, "intermediate_size"), vit_global=tuple(glob),
                vit_eps=c.float(*bb, "layer_norm_eps"), rope_theta=c.float(*bb, "rope_parameters", "rope_theta"),
                pos_side=pretrain // patch)


def _detr_sizes(c: _Config) -> dict[str, Any]:
    """The DETR, neck and mask-decoder widths, which the bundle's one d_model, d_heads and d_ffn must cover."""
    d = c.int("vision_config", "fpn_hidden_size")
    for section in ("detr_encoder_config", "detr_decoder_config", "mask_decoder_config"):
        if c.int(section, "hidden_size") != d:
            raise c.refuse(f"{section}.hidden_size", f"{c.int(section, 'hidden_size')} differs from "
                           f"vision_config.fpn_hidden_size {d} (one d_model serves the neck, DETR and masks)")
    d_heads = c.int("detr_encoder_config", "num_attention_heads")
    for section in ("detr_decoder_config", "mask_decoder_config"):
        if c.int(section, "num_attention_heads") != d_heads:
            raise c.refuse(f"{section}.num_attention_heads", f"{c.int(section, 'num_attention_heads')} differs "
                           f"from detr_encoder_config.num_attention_heads {d_heads} (one d_heads param)")
    if d % d_heads or (d // d_heads) % 8:
        raise c.refuse("detr_encoder_config.num_attention_heads",
                       f"head dim = hidden_size {d} / {d_heads} heads must be a whole multiple of 8")
    d_ffn = c.int("detr_encoder_config", "intermediate_size")
    if c.int("detr_decoder_config", "intermediate_size") != d_ffn:
        raise c.refuse("detr_decoder_config.intermediate_size", f"{c.int('detr_decoder_config', 'intermediate_size')}"
                       f" differs from detr_encoder_config.intermediate_size {d_ffn} (one d_ffn param)")
    if d_ffn % 8:
        raise c.refuse("detr_encoder_config.intermediate_size", f"{d_ffn} is not a multiple of 8 (packed GEMM width)")
    for section in ("detr_encoder_config", "detr_decoder_config"):
        c.expect((section, "hidden_act"), "relu", "the DETR MLPs' ReLU")
    if c.int("mask_decoder_config", "num_upsampling_stages") < 2:
        raise c.refuse("mask_decoder_config.num_upsampling_stages", "at least 2 (the pixel decoder's two upsamplings)")
    return dict(d_model=d, d_heads=d_heads, d_layers=c.int("detr_encoder_config", "num_layers"), d_ffn=d_ffn,
                dec_layers=c.int("detr_decoder_config", "num_layers"),
                queries=c.int("detr_decoder_config", "num_queries"))


# What the pipeline's preprocessing does (docs/sam3-export.md 2): resize to image_size, v / 255, (v - 0.5) / 0.5.
_PROCESSOR = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "do_normalize": True,
              "do_resize": True}


def _check_processor(root: Path, image: int, mask: int) -> None:
    """processor_config.json, when the checkpoint has one, asks for the preprocessing the pipeline implements."""
    path = root / "processor_config.json"
    if not os.path.lexists(path):  # absent; anything else named so is read, and refused unless a regular file
        return
    try:
        data = userfiles.read_json(path)
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: cannot read: {e}") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    c = _Config(path, data)
    proc = ("image_processor",)
    for key, want in _PROCESSOR.items():
        c.expect(proc + (key,), want, "the pipeline's preprocessing")
    rescale = c.float(*proc, "rescale_factor")
    if abs(rescale - 1 / 255) > 1e-9:
        raise c.refuse("image_processor.rescale_factor", f"{rescale!r}, expected 1/255 (the pipeline's preprocessing)")
    for key, want in (("size", image), ("mask_size", mask)):
        for side in ("height", "width"):
            if c.int(*proc, key, side) != want:
                raise c.refuse(f"image_processor.{key}.{side}", f"{c.int(*proc, key, side)}, expected {want} (the "
                               f"model's {'image_size' if key == 'size' else 'mask size, 4 grid'})")


def _check_neck(c: _Config, grid: int) -> None:
    """The neck's levels in the checkpoint, checked against the bundle's: transformers drops the last level (the
    0.5 max-pool one) before the DETR encoder and the mask decoder, so the three before it are the bundle's."""
    scales = c.get("vision_config", "scale_factors")
    want = [*NECK_SCALES, DROPPED_SCALE]
    if not isinstance(scales, list) or [float(s) for s in scales if isinstance(s, int | float)] != want:
        raise c.refuse("vision_config.scale_factors", f"{scales!r}, expected {want} (the model drops the last level; "
                       "the bundle's neck is the three before it)")
    sizes = c.get("vision_config", "backbone_feature_sizes")
    want_sizes = [[4 * grid] * 2, [2 * grid] * 2, [grid] * 2]
    if sizes != want_sizes:
        raise c.refuse("vision_config.backbone_feature_sizes",
                       f"{sizes!r}, expected {want_sizes} for a {grid}x{grid} grid")


# ---------------------------------------------------------------------------------------------
# Kernel shapes


def _variant(vit: str, residual: str) -> str:
    if vit not in VIT_MODES:
        raise ExportError(f"vit {vit!r}: expected one of {', '.join(VIT_MODES)}")
    if residual not in RESIDUALS:
        raise ExportError(f"residual {residual!r}: expected one of {', '.join(RESIDUALS)}")
    return "host" if vit == "host" else "device-f32" if residual == "f32" else "device"


def _params(m: Model, vit_ffn_pad: int) -> dict[str, Any]:
    t = m.text
    return dict(image_size=m.image_size, patch=m.patch, grid=m.grid, window=m.window, vit_dim=m.vit_dim,
                vit_heads=m.vit_heads, vit_layers=m.vit_layers, vit_ffn_pad=vit_ffn_pad, vit_global=m.vit_global,
                vit_eps=m.vit_eps, d_model=m.d_model, d_heads=m.d_heads, d_layers=m.d_layers, d_ffn=m.d_ffn,
                dec_layers=m.dec_layers, queries=m.queries, mask_size=4 * m.grid, neck_splits=m.neck_splits,
                text_len=int(t["text_len"]), text_dim=int(t["text_dim"]), text_heads=int(t["text_heads"]),
                text_layers=int(t["text_layers"]), text_ffn=int(t["text_ffn"]), text_eps=float(t["text_eps"]))


def _tile(key: str, dim: str, n: int) -> int:
    tile = next((t for t in TILES if n % t == 0), None)
    if tile is None:
        raise ExportError(f"gemm {key}: {dim} = {n} is not a multiple of 8, which the packed B needs (the model's "
                          "sizes give it; docs/sam3-export.md 3)")
    return tile


def geometry(m: Model, variant: str, kernels: Bundle | None = None) -> Geometry:
    """The bundle's geometry: the model's sizes and, per GEMM and MHA, the kernel shape (docs/sam3-export.md 3).

    Without `kernels`: M = 64 rows, the largest tile of 64, 32, 16, 8 dividing each K and N, ct_k = min(32,
    tile_k), the ViT MLP and the patch embedding's K padded to multiples of 64, m_head N to 64, DETR heads
    padded to 64 (or the head width, if larger). With `kernels` (an open compiled bundle): its records' shapes,
    each checked against what the checkpoint needs.

    Raises:
        ExportError: a kernel record of `kernels` has another shape than the checkpoint needs (the message names
            the record, the field and both values), lacks a kernel, or the geometry breaks a consistency rule.
    """
    if kernels is not None:
        g = _kernel_geometry(m, variant, kernels)
    else:
        pad = pack.round_up(m.vit_ffn, PAD)
        fixed = {"v_embed": {"tile_k": PAD}, "m_head": {"tile_n": PAD}}
        params = _params(m, pad)
        first = Geometry.derive("export", m=GEMM_M, tile_k=8, tile_n=8, ct_k=8, mha_d_head=max(MHA_D_HEAD, m.d_head),
                                overrides=fixed, **params)
        tiles = {key: {"tile_k": _tile(key, "K", s.k), "tile_n": _tile(key, "N", s.n),
                       "ct_k": min(CT_K, _tile(key, "K", s.k))} for key, s in first.gemms.items()}
        g = Geometry.derive("export", m=GEMM_M, tile_k=8, tile_n=8, ct_k=8, mha_d_head=max(MHA_D_HEAD, m.d_head),
                            overrides=tiles, **params).for_variant(variant)
    try:
        g.check(variant)
    except GeometryError as e:
        raise ExportError(f"the bundle's geometry: {e}") from e
    return g


def _kernel_geometry(m: Model, variant: str, kb: Bundle) -> Geometry:
    where = f"kernels {kb.root}"
    device = variant != "host"
    p = kb.params
    if p.vit_device != device or (device and p.vit_res_f32 != (variant == "device-f32")):
        raise ExportError(f"{where}: param vit_device={int(p.vit_device)} vit_res_f32={int(p.vit_res_f32)}; this "
                          f"export writes vit_device={int(device)} vit_res_f32={int(variant == 'device-f32')} (the "
                          "device ViT's MHA and addln kernels are compiled for one form)")
    missing = [k for k in GEMM_KEYS if k not in kb.gemms] + [k for k in MHA_KEYS if k not in kb.mhas]
    missing += [k for k in OP_KEYS if device and k not in kb.ops]
    if missing:
        raise ExportError(f"{where}: no kernel record for {', '.join(missing)}")
    gemms = {k: GemmShape(m=s.m, k=s.k, n=s.n, lda=s.lda, tile_k=s.tile_k, tile_n=s.tile_n, ct_k=s.ct_k,
                          bias=s.bias) for k, s in ((k, kb.gemms[k]) for k in GEMM_KEYS)}
    mhas = {k: MhaShape(heads=s.heads, seq=s.seq, d=s.d, token_major=s.token_major, elems=s.elems)
            for k, s in ((k, kb.mhas[k]) for k in MHA_KEYS)}
    _check_kernel_shapes(m, variant, kb, where)
    params = _params(m, gemms["v_fc1"].n)
    return Geometry(name="export", **params, gemms=gemms, mhas=mhas)


def _check_kernel_shapes(m: Model, variant: str, kb: Bundle, where: str) -> None:
    """Each record field the checkpoint fixes equals (or, for padded widths, reaches) what it needs."""
    T, D, d, hd = m.tokens, m.vit_dim, m.d_model, m.head_dim  # noqa: N806
    s0, s1, s2 = m.neck_splits
    mha_d = kb.mhas["mha_d"]
    pd = mha_d.d * m.d_heads
    length = int(m.text["text_len"])
    ffn = kb.gemms["v_fc1"].n
    # (record, field, wanted, "eq" | "ge"); a padded width only has to hold the model's.
    rules: list[tuple[str, str, int, str]] = [
        ("v_embed", "K", 3 * m.patch ** 2, "ge"), ("v_embed", "N", D, "eq"),
        ("v_qkv", "K", D, "eq"), ("v_qkv", "N", 3 * D, "eq"), ("v_o", "K", D, "eq"), ("v_o", "N", D, "eq"),
        ("v_fc1", "K", D, "eq"), ("v_fc1", "N", m.vit_ffn, "ge"), ("v_fc2", "K", ffn, "eq"), ("v_fc2", "N", D, "eq"),
        ("n_in", "K", D, "eq"), ("n_in", "N", s0 + s1 + s2, "eq"), ("n_up", "K", s0 // 4, "eq"),
        ("n_up", "N", 4 * d, "ge"), ("d_qkv", "K", 2 * d, "eq"), ("d_qkv", "N", 3 * pd, "eq"),
        ("d_o", "K", pd, "eq"), ("d_o", "N", d, "eq"), ("d_s", "K", d, "eq"), ("d_s", "N", m.d_heads * length, "eq"),
        ("d_c", "K", m.d_heads * length, "eq"), ("d_c", "N", d, "eq"), ("d_fc1", "K", d, "eq"),
        ("d_fc1", "N", m.d_ffn, "eq"), ("d_fc2", "K", m.d_ffn, "eq"), ("d_fc2", "N", d, "eq"),
        ("dec_kv", "K", 2 * d, "eq"), ("dec_kv", "N", m.dec_layers * 2 * d, "ge"),
        ("m_head", "K", d, "eq"), ("m_head", "N", m.queries + 1, "ge"),
    ]
    for key, fld, want, how in rules:
        have = getattr(kb.gemms[key], fld.lower())
        if (have != want) if how == "eq" else (have < want):
            need = f"{want}" if how == "eq" else f"at least {want}"
            raise ExportError(f"{where}: gemm {key} field {fld}={have}, the checkpoint needs {fld}={need}")
    conv = kb.gemms["conv"]
    try:
        cg = pack.ConvGeometry.of(conv.k, conv.lda, conv.n)
    except pack.PackError as e:
        raise ExportError(f"{where}: gemm conv: {e}") from e
    if (cg.c, cg.oc) != (d, d):
        raise ExportError(f"{where}: gemm conv convolves {cg.c} -> {cg.oc} channels (K={conv.k} lda={conv.lda} "
                          f"N={conv.n}), the checkpoint's 3x3 convs are {d} -> {d}")
    for key in GEMM_KEYS:
        s = kb.gemms[key]
        if key != "conv" and s.lda != s.k:
            raise ExportError(f"{where}: gemm {key} field lda={s.lda}, the checkpoint needs lda=K={s.k}")
        if s.b_bytes != pack.packed_size(s.k, s.n, s.ct_k, s.bias):
            raise ExportError(f"{where}: gemm {key} field b_bytes={s.b_bytes}, its shape packs to "
                              f"{pack.packed_size(s.k, s.n, s.ct_k, s.bias)}")
    # Where the checkpoint has a bias the kernel has to add it; v_fc2's follows the ViT form.
    for key in ("v_qkv", "v_o", "v_fc1", "n_in", "n_up", "d_qkv", "d_o", "d_fc1", "dec_kv"):
        if not kb.gemms[key].bias:
            raise ExportError(f"{where}: gemm {key} field bias=0, the checkpoint's bias needs bias=1")
    want_fc2 = variant != "host"
    if kb.gemms["v_fc2"].bias != want_fc2:
        raise ExportError(f"{where}: gemm v_fc2 field bias={int(kb.gemms['v_fc2'].bias)}, a {variant} ViT needs "
                          f"bias={int(want_fc2)}")
    mha_rules = [("mha_win", "heads", (T // m.window ** 2) * m.vit_heads), ("mha_win", "seq", m.window ** 2),
                 ("mha_win", "d", hd), ("mha_win", "token_major", 0), ("mha_glob", "heads", m.vit_heads),
                 ("mha_glob", "seq", T), ("mha_glob", "d", hd), ("mha_glob", "token_major", 1),
                 ("mha_d", "heads", m.d_heads), ("mha_d", "seq", T), ("mha_d", "token_major", 1)]
    for key, fld, want in mha_rules:
        have = int(getattr(kb.mhas[key], fld))
        if have != want:
            raise ExportError(f"{where}: mha {key} field {fld}={have}, the checkpoint needs {fld}={want}")
    if mha_d.d < m.d_head:
        raise ExportError(f"{where}: mha mha_d field d={mha_d.d}, the checkpoint needs d >= {m.d_head} (head dim)")
    for key, least in (("mha_win", T * D), ("mha_glob", T * D), ("mha_d", T * pd)):
        if kb.mhas[key].elems < least:
            raise ExportError(f"{where}: mha {key} field elems={kb.mhas[key].elems}, the checkpoint needs at least "
                              f"{least}")


# ---------------------------------------------------------------------------------------------
# Transformations (docs/sam3-export.md 4-6)


def half_split(head_dim: int) -> np.ndarray:
    """The order of a head's dims in the bundle: transformers rotates interleaved pairs (2i, 2i+1), the rope
    kernel rotates (i, i + head_dim/2), so bundle dim i is checkpoint dim 2i and bundle dim i + half is 2i + 1."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def rope_angles(m: Model, perm: np.ndarray, windowed: bool) -> np.ndarray:
    """The RoPE angles `[T, half]` of the window-order tokens, as transformers' axial RoPE computes them: pair i
    of a head turns by x * f_i for i < head_dim/4, by y * f_(i - head_dim/4) after, f_j = theta^(-4j / head_dim);
    positions (x, y) count within the window in a windowed layer and are the grid's scaled by window / grid in a
    global one (docs/sam3-export.md 4.3)."""
    y, x = np.divmod(perm.astype(np.int64), m.grid)
    if windowed:
        y, x = y % m.window, x % m.window
    scale = np.float32(1.0 if windowed else m.window / m.grid)
    half = m.head_dim // 2
    inv = (np.float32(1.0) / np.float32(m.rope_theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    xs, ys = x.astype(np.float32) * scale, y.astype(np.float32) * scale
    return np.concatenate([xs[:, None] * inv, ys[:, None] * inv], axis=1).astype(np.float32)


def tiled_position(pos: np.ndarray, grid: int, perm: np.ndarray) -> np.ndarray:
    """The ViT's position embedding `[side^2, D]` (pretrained on a side x side grid) tiled over the grid as
    transformers tiles it (row y, column x takes (y % side, x % side)), then in window order `[T, D]`."""
    side = math.isqrt(pos.shape[0])
    reps = grid // side + 1
    tiled = np.tile(pos.reshape(side, side, -1), (reps, reps, 1))[:grid, :grid]
    return np.ascontiguousarray(tiled.reshape(grid * grid, -1)[perm])


def sine_position(side: int, width: int) -> np.ndarray:
    """The neck's normalised sine position embedding of a side x side level, raster channels-last `[side^2,
    width]`: [y features | x features], width/2 each, sin of the even and cos of the odd ones, coordinates (1..side)
    / (side + 1e-6) * 2 pi over 10000^(2 floor(j/2) / (width/2)) (docs/sam3-export.md 6.1)."""
    feats = width // 2
    coords = np.arange(1, side + 1, dtype=np.float32) / np.float32(side + SINE_EPS) * np.float32(2 * math.pi)
    dim_t = np.float32(SINE_TEMPERATURE) ** (np.float32(2) * (np.arange(feats) // 2).astype(np.float32)
                                             / np.float32(feats))
    angles = coords[:, None] / dim_t
    enc = np.where(np.arange(feats) % 2 == 0, np.sin(angles), np.cos(angles)).astype(np.float32)
    y = np.broadcast_to(enc[:, None, :], (side, side, feats))
    x = np.broadcast_to(enc[None, :, :], (side, side, feats))
    return np.ascontiguousarray(np.concatenate([y, x], axis=2).reshape(side * side, width))


def fold_affine(b: np.ndarray, bias: np.ndarray, scale: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray,
                                                                                                np.ndarray]:
    """B and bias of `(LN0(x) * scale + shift) @ B + bias` as one GEMM on LN0(x): diag(scale) B, shift B + bias."""
    b64 = b.astype(np.float64)
    return (b64 * scale[:, None]).astype(np.float32), (shift.astype(np.float64) @ b64 + bias).astype(np.float32)


def convt_taps(w: np.ndarray) -> np.ndarray:
    """A 2x2 stride-2 transposed convolution's weight `[in, out, 2, 2]` as a GEMM B `[in, 4 out]`, tap-major
    (tap = ky * 2 + kx), channel-minor: tap t's columns give the output pixel (2y + ky, 2x + kx)."""
    cin, cout = w.shape[:2]
    return np.ascontiguousarray(w.reshape(cin, cout, 4).transpose(0, 2, 1).reshape(cin, 4 * cout))


def convt_then_1x1(w: np.ndarray, b: np.ndarray, proj: np.ndarray, proj_b: np.ndarray) -> tuple[np.ndarray,
                                                                                                np.ndarray]:
    """A 2x2 transposed convolution (`w` `[in, mid, 2, 2]`, `b`) followed by a 1x1 convolution (`proj` `[out, mid,
    1, 1]`, `proj_b`) as one GEMM: B `[in, 4 out]` tap-major, bias tiled per tap (nothing non-linear between)."""
    cin, mid = w.shape[:2]
    p = proj.reshape(proj.shape[0], mid).astype(np.float64)
    taps = np.einsum("ick,oc->iko", w.reshape(cin, mid, 4).astype(np.float64), p)
    bias = p @ b.astype(np.float64) + proj_b
    return taps.reshape(cin, -1).astype(np.float32), np.tile(bias, 4).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The checkpoint's tensors


class _Checkpoint:
    """Shape-checked float32 reads from model.safetensors, one tensor at a time.

    safetensors maps the file: every page a read touches stays in the process's resident set while the file is
    open, so `release()` (after each ViT layer and each stage) closes and reopens it, and the export's resident
    memory stays near one layer's weights instead of growing to the checkpoint's size (docs/sam3-export.md 1).
    """

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise ExportError(f"{path}: no such file (the checkpoint's weights)")
        self._file: Any = None
        self._open()
        self.names = set(self._st.keys())
        self.read: set[str] = set()

    def _open(self) -> None:
        try:
            self._file = safe_open(str(self.path), framework="numpy")
        except SafetensorError as e:  # a malformed header: safetensors checks it (docs/sam3-export.md 1)
            raise ExportError(f"{self.path}: not a safetensors file: {e}") from e
        self._st = self._file.__enter__()

    def release(self) -> None:
        self.close()
        self._open()

    def close(self) -> None:
        if self._file is not None:
            self._file.__exit__(None, None, None)
            self._file = None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._st.get_slice(name).get_shape())

    def bound(self, m: Model) -> None:
        """Every layer count of the config against the checkpoint's own tensors, before a list of the wanted tensors
        is built from them: each layer holds tensors of its own, so a count above the tensor count is absurd.

        Raises:
            ExportError: names the config key, its value and the checkpoint's tensor count.
        """
        counts = (("vision_config.backbone_config.num_hidden_layers", m.vit_layers),
                  ("detr_encoder_config.num_layers", m.d_layers), ("detr_decoder_config.num_layers", m.dec_layers),
                  ("text_config.num_hidden_layers", int(m.text["text_layers"])))
        for key, value in counts:
            if value > len(self.names):
                raise ExportError(f"{self.path.parent / CONFIG}: {key} = {value}, more than the {len(self.names)} "
                                  f"tensors of {self.path.name} hold")

    def check(self, wanted: Mapping[str, tuple[int, ...]]) -> None:
        """Every tensor of `wanted` is present with its shape.

        Raises:
            ExportError: the first missing tensor (and how many more are missing), or a shape that differs.
        """
        missing = [n for n in wanted if n not in self.names]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ExportError(f"{self.path}: tensor {missing[0]} missing{more}")
        for name, shape in wanted.items():
            found = self.shape(name)
            if found != tuple(shape):
                raise ExportError(f"{self.path}: tensor {name} has shape {list(found)}, expected {list(shape)}")

    def get(self, name: str) -> np.ndarray:
        self.read.add(name)
        return np.ascontiguousarray(f32(self._st.get_tensor(name)))


def _linear(prefix: str, out: int, inp: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "weight": (out, inp), prefix + "bias": (out,)}


def _norm(prefix: str, n: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "weight": (n,), prefix + "bias": (n,)}


def _attention(prefix: str, d: int) -> dict[str, tuple[int, ...]]:
    return {k: v for part in "qkvo" for k, v in _linear(f"{prefix}{part}_proj.", d, d).items()}


def _mlp(prefix: str, widths: Sequence[int]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for j, (inp, width) in enumerate(zip(widths, widths[1:], strict=False)):
        out |= _linear(f"{prefix}layer{j + 1}.", width, inp)
    return out


def image_tensors(m: Model) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the image side of the bundle reads, with its shape (the text side is
    `sam3.export_text`'s)."""
    D, d, p = m.vit_dim, m.d_model, m.patch  # noqa: N806
    want: dict[str, tuple[int, ...]] = {
        _BACKBONE + "embeddings.patch_embeddings.projection.weight": (D, 3, p, p),
        _BACKBONE + "embeddings.position_embeddings": (1, m.pos_side ** 2, D),
        **_norm(_BACKBONE + "layer_norm.", D),
    }
    for i in range(m.vit_layers):
        pre = f"{_BACKBONE}layers.{i}."
        want |= _norm(pre + "layer_norm1.", D) | _norm(pre + "layer_norm2.", D) | _attention(pre + "attention.", D)
        want |= _linear(pre + "mlp.fc1.", m.vit_ffn, D) | _linear(pre + "mlp.fc2.", D, m.vit_ffn)
    n0, n1, n2 = (_NECK.format(l=i) for i in range(3))
    want |= {n0 + "scale_layers.0.weight": (D, D // 2, 2, 2), n0 + "scale_layers.0.bias": (D // 2,),
             n0 + "scale_layers.2.weight": (D // 2, D // 4, 2, 2), n0 + "scale_layers.2.bias": (D // 4,),
             n0 + "proj1.weight": (d, D // 4, 1, 1), n1 + "scale_layers.0.weight": (D, D // 2, 2, 2),
             n1 + "scale_layers.0.bias": (D // 2,), n1 + "proj1.weight": (d, D // 2, 1, 1),
             n2 + "proj1.weight": (d, D, 1, 1)}
    for n in (n0, n1, n2):
        want |= {n + "proj1.bias": (d,), n + "proj2.weight": (d, d, 3, 3), n + "proj2.bias": (d,)}
    for i in range(m.d_layers):
        pre = _ENC.format(i=i)
        for ln in ("layer_norm1.", "layer_norm2.", "layer_norm3."):
            want |= _norm(pre + ln, d)
        want |= _attention(pre + "self_attn.", d) | _attention(pre + "cross_attn.", d)
        want |= _linear(pre + "mlp.fc1.", m.d_ffn, d) | _linear(pre + "mlp.fc2.", d, m.d_ffn)
    want |= {_DEC + "reference_points.weight": (m.queries, 4), _DEC + "presence_token.weight": (1, d),
             _DEC + "query_embed.weight": (m.queries, d)}
    want |= _mlp(_DEC + "ref_point_head.", (2 * d, d, d)) | _mlp(_DEC + "box_rpb_embed_y.", (2, d, m.d_heads))
    want |= _mlp(_DEC + "box_rpb_embed_x.", (2, d, m.d_heads))
    for layer in range(m.dec_layers):
        pre = f"{_DEC}layers.{layer}."
        for att in ("self_attn.", "text_cross_attn.", "vision_cross_attn."):
            want |= _attention(pre + att, d) | _norm(pre + att.rstrip(".") + "_layer_norm.", d)
        want |= _linear(pre + "mlp.fc1.", m.d_ffn, d) | _linear(pre + "mlp.fc2.", d, m.d_ffn)
        want |= _norm(pre + "mlp_layer_norm.", d)
    want |= _norm(_DEC + "output_layer_norm.", d) | _mlp(_DEC + "box_head.", (d, d, d, 4))
    want |= _norm(_DEC + "presence_layer_norm.", d) | _mlp(_DEC + "presence_head.", (d, d, d, 1))
    want |= _mlp(_SCORE + "text_mlp.", (d, m.d_ffn, d)) | _norm(_SCORE + "text_mlp_out_norm.", d)
    want |= _linear(_SCORE + "text_proj.", d, d) | _linear(_SCORE + "query_proj.", d, d)
    want |= _attention(_MASK + "prompt_cross_attn.", d) | _norm(_MASK + "prompt_cross_attn_norm.", d)
    for i in range(2):
        want |= {f"{_MASK}pixel_decoder.conv_layers.{i}.weight": (d, d, 3, 3),
                 f"{_MASK}pixel_decoder.conv_layers.{i}.bias": (d,)} | _norm(f"{_MASK}pixel_decoder.norms.{i}.", d)
    for j in range(3):
        want |= _linear(f"{_MASK}mask_embedder.layers.{j}.", d, d)
    want |= {_MASK + "instance_projection.weight": (d, d, 1, 1), _MASK + "instance_projection.bias": (d,),
             _MASK + "semantic_projection.weight": (1, d, 1, 1), _MASK + "semantic_projection.bias": (1,)}
    return want


# ---------------------------------------------------------------------------------------------
# Export


def export(model_dir: str | Path, out_dir: str | Path, *, vit: str = "device", residual: str = "f32",
           kernels: str | Path | None = None, reference: str | Path | None = None,
           progress: ProgressFn | None = None) -> Path:
    """Write the bundle of the SAM3 checkpoint in `model_dir` into `out_dir` (format 2; created, must not exist or
    be empty). Returns `out_dir`.

    Args:
        model_dir: a transformers SAM3 checkpoint: config.json, model.safetensors, vocab.json, merges.txt,
            tokenizer_config.json.
        out_dir: the bundle directory.
        vit: "device" (the device-resident ViT, `vit_device=1`) or "host".
        residual: the device ViT's residual stream, "f32" (`vit_res_f32=1`) or "bf16" (ignored for a host ViT).
        kernels: a compiled bundle of the same shapes whose kernel files and records are copied; without it the
            emulator's placeholder kernels are written (as `sam3.build` writes them).
        reference: a reference.npz laid out as docs/sam3-export.md 9 describes, with cases.json beside it.
        progress: called with a line of text as each stage starts.

    Raises:
        ExportError: not a SAM3 checkpoint, a missing or malformed config key or file, a missing tensor or one of
            the wrong shape (named, with both shapes), sizes the bundle cannot take, kernels of other shapes, a
            reference that does not match the checkpoint; nothing is left in `out_dir` then.
        BundleError: `out_dir` is not empty, or `kernels` is not a valid bundle.
        OSError: a file cannot be read or written.
    """
    say = progress or (lambda line: None)
    variant = _variant(vit, residual)
    root, model = Path(model_dir), read_model(model_dir)
    for name in TOKENIZER_FILES:
        if not (root / name).is_file():
            raise ExportError(f"{root / name}: no such file (the tokenizer's)")
    kb = Bundle.open(kernels) if kernels is not None else None
    try:
        g = geometry(model, variant, kb)
        ref = _Reference.load(reference, model) if reference is not None else None
        ckpt = _Checkpoint(root / WEIGHTS)
        try:
            ckpt.bound(model)
            ckpt.check(image_tensors(model))
            say(f"{root}: SAM3 {model.image_size} px, ViT {model.vit_dim} x {model.vit_layers}, DETR "
                f"{model.d_model} x {model.d_layers}/{model.dec_layers}, text {model.text['text_dim']} x "
                f"{model.text['text_layers']}; writing a {variant} bundle")
            out = Path(out_dir)
            existed = out.exists()
            w = BundleWriter(out, version=2)  # refuses a directory that is not empty: nothing of it is touched
            try:
                with w:
                    _Exporter(w, ckpt, root, model, g, variant, kb, ref, say).write()
                _check_written(out)
            except BaseException:
                _remove_partial(out, existed)
                raise
        finally:
            ckpt.close()
    finally:
        if kb is not None:
            kb.close()
    return out


def _check_written(out: Path) -> None:
    """The written bundle opens, keeps the rules a run relies on and its tokenizer builds (docs/sam3-export.md 1).

    Raises:
        ExportError: "the written bundle does not open: ..." with the reader's or tokenizer's one line.
    """
    try:
        with Bundle.open(out) as b:
            consistency.check(b)
            ClipTokenizer.from_bundle(b)
    except (BundleError, TokenizerError) as e:
        raise ExportError(f"{out}: the written bundle does not open: {e}") from e


def _remove_partial(out: Path, existed: bool) -> None:
    """Remove what a failed export wrote (the directory itself when the export created it)."""
    if not out.is_dir():
        return
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return
    for child in out.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


class _Exporter:
    """Writes one bundle from an open checkpoint: header, kernels, records, then every tensor, stage by stage."""

    def __init__(self, w: BundleWriter, ckpt: _Checkpoint, root: Path, m: Model, g: Geometry, variant: str,
                 kb: Bundle | None, ref: _Reference | None, say: ProgressFn):
        self.w, self.ck, self.root, self.m, self.g, self.variant = w, ckpt, root, m, g, variant
        self.kb, self.ref, self.say = kb, ref, say
        self.device = variant != "host"
        self.text_names: set[str] = set()

    def write(self) -> None:
        self.header()
        self.kernels()
        if self.ref is not None:
            self.ref.records(self.w)
        for stage in (self.vit, self.neck, self.detr_encoder, self.detr_decoder, self.scoring, self.mask_decoder,
                      lambda: export_tracker.write(self),
                      self.text, self.tokenizer):
            stage()
            self.ck.release()
        if self.ref is not None:
            self.say("reference")
            self.ref.tensors(self.w)
        unused = Counter(n.split(".", 1)[0] for n in self.ck.names - self.ck.read - self.text_names)
        left = ", ".join(f"{k} {v}" for k, v in sorted(unused.items()))
        self.say(f"done; checkpoint tensors not in the bundle (docs/sam3-export.md 10): {left}" if unused else "done")

    # -- manifest

    def header(self) -> None:
        w, t = self.w, self.m.text
        w.comment(f"SAM3 bundle exported by sam3.export from {self.root.name}: {self.variant} ViT.")
        w.comment(f"Kernels copied from {self.kb.root}." if self.kb is not None else
                  "Kernels: placeholders (sam3.build's), for the emulator only.")
        for name, value in self.g.params().items():
            w.param(name, value)
        for name in ("bos", "eos", "pad"):
            w.param(name, int(t[name]))
        if self.device:
            w.param("vit_device", True)
        if self.variant == "device-f32":
            w.param("vit_res_f32", True)

    def kernels(self) -> None:
        self.say("kernels" + (f" from {self.kb.root}" if self.kb is not None else " (placeholders for the emulator)"))
        if self.kb is None:
            build.write_kernels(self.w, self.g, self.variant, KERNEL_SEED, KERNEL_TARGET)
            return
        kb, w = self.kb, self.w
        copied: set[str] = set()

        def copy(path: Path) -> str:
            rel = kb.relative(path)
            if rel not in copied:
                w.file(rel, kb.file_bytes(path))
                copied.add(rel)
            return rel

        for ctx in sorted({kb.gemms[k].ctx for k in GEMM_KEYS}):
            x = kb.xclbins[ctx]
            w.xclbin(ctx, copy(x.path), x.kernel)
        for key in GEMM_KEYS:
            s = kb.gemms[key]
            w.record("gemm", key, ctx=s.ctx, insts=copy(s.insts), M=s.m, K=s.k, N=s.n, lda=s.lda, tile_k=s.tile_k,
                     tile_n=s.tile_n, ct_k=s.ct_k, bias=int(s.bias), b_bytes=s.b_bytes)
        for key in MHA_KEYS:
            h = kb.mhas[key]
            w.record("mha", key, xclbin=copy(h.xclbin), insts=copy(h.insts), name=h.name, heads=h.heads, seq=h.seq,
                     d=h.d, token_major=int(h.token_major), elems=h.elems)
        for key in OP_KEYS if self.device else ():
            o = kb.ops[key]
            w.record("op", key, xclbin=copy(o.xclbin), insts=copy(o.insts), name=o.name)

    # -- tensor helpers

    def f32(self, name: str, array: np.ndarray) -> None:
        self.w.tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    def copy(self, name: str, source: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Checkpoint tensor `source` as host tensor `name` (f32; reshaped to `shape` when given)."""
        a = self.ck.get(source)
        a = a.reshape(shape) if shape is not None else a
        self.f32(name, a)
        return a

    def linear(self, name: str, source: str) -> None:
        """A linear layer, torch layout: `name.w` [out, in], `name.b` [out]."""
        self.copy(name + ".w", source + "weight")
        self.copy(name + ".b", source + "bias")

    def norm(self, name: str, source: str) -> tuple[np.ndarray, np.ndarray]:
        return self.copy(name + ".w", source + "weight"), self.copy(name + ".b", source + "bias")

    def mlp(self, name: str, source: str, layers: int, first: int = 1) -> None:
        for j in range(layers):
            self.linear(f"{name}.{j + first}", f"{source}layer{j + 1}.")

    def packed(self, name: str, key: str, b: np.ndarray, bias: np.ndarray | None = None) -> None:
        """`b` `[k, n]` zero-padded to GEMM `key`'s K x N and packed with its tiling; `bias` (zero-padded) goes in
        B when the record has bias=1 (zeros when None); a bias=0 GEMM takes none."""
        s = self.g.gemms[key]
        if b.shape[0] > s.k or b.shape[1] > s.n:
            raise ExportError(f"{name}: B of shape {list(b.shape)} does not fit gemm {key} K={s.k} N={s.n}")
        full = np.zeros((s.k, s.n), np.float32)
        full[:b.shape[0], :b.shape[1]] = b
        vec = None
        if s.bias:
            vec = np.zeros(s.n, np.float32)
            if bias is not None:
                vec[:bias.shape[0]] = bias
        elif bias is not None:
            raise ExportError(f"{name}: gemm {key} has bias=0, a bias cannot go into its B")
        data = pack.pack_b(full, vec, s.tile_k, s.tile_n, s.ct_k)
        if data.size != pack.packed_size(s.k, s.n, s.ct_k, s.bias):
            raise ExportError(f"{name}: packed {data.size} bytes, gemm {key} needs "
                              f"{pack.packed_size(s.k, s.n, s.ct_k, s.bias)}")
        self.w.raw_tensor(name, data)

    # -- stages (docs/sam3-export.md 4-8)

    def vit(self) -> None:
        m = self.m
        self.say("ViT")
        perm = pack.window_perm(m.grid, m.window)
        self.w.tensor("v.perm", perm.astype(np.int32))
        pos = self.ck.get(_BACKBONE + "embeddings.position_embeddings")[0]
        self.f32("v.pos", tiled_position(pos, m.grid, perm))
        self.norm("v.ln_pre", _BACKBONE + "layer_norm.")
        proj = self.ck.get(_BACKBONE + "embeddings.patch_embeddings.projection.weight")
        self.packed("v.embed", "v_embed", proj.reshape(m.vit_dim, -1).T)
        for kind, windowed in (("win", True), ("glob", False)):
            angles = rope_angles(m, perm, windowed)
            cos, sin = np.cos(angles), np.sin(angles)
            if self.device:
                self.w.raw_tensor(f"v.rope_tab.{kind}", np.frombuffer(rope_table(cos, sin), np.uint8))
            else:
                self.f32(f"v.rope.{kind}.cos", cos)
                self.f32(f"v.rope.{kind}.sin", sin)
        rows = (np.arange(m.vit_heads)[:, None] * m.head_dim + half_split(m.head_dim)[None]).ravel()
        for i in range(m.vit_layers):
            if i == 0 or (i + 1) % 8 == 0 or i + 1 == m.vit_layers:
                self.say(f"ViT layer {i + 1}/{m.vit_layers}")
            self.vit_layer(i, rows)
            self.ck.release()

    def vit_layer(self, i: int, rows: np.ndarray) -> None:
        pre, p = f"{_BACKBONE}layers.{i}.", f"v.{i}"
        get = self.ck.get
        att = pre + "attention."
        w = np.concatenate([get(att + "q_proj.weight")[rows], get(att + "k_proj.weight")[rows],
                            get(att + "v_proj.weight")])
        b = np.concatenate([get(att + "q_proj.bias")[rows], get(att + "k_proj.bias")[rows], get(att + "v_proj.bias")])
        qkv = (w.T, b)
        fc1 = (get(pre + "mlp.fc1.weight").T, get(pre + "mlp.fc1.bias"))
        ln1 = (get(pre + "layer_norm1.weight"), get(pre + "layer_norm1.bias"))
        ln2 = (get(pre + "layer_norm2.weight"), get(pre + "layer_norm2.bias"))
        if self.device:  # addln normalises without an affine: each LN's affine goes into the GEMM after it
            qkv, fc1 = fold_affine(*qkv, *ln1), fold_affine(*fc1, *ln2)
        else:
            for name, (scale, shift) in (("ln1", ln1), ("ln2", ln2)):
                self.f32(f"{p}.{name}.w", scale)
                self.f32(f"{p}.{name}.b", shift)
        self.packed(f"{p}.qkv", "v_qkv", *qkv)
        self.packed(f"{p}.o", "v_o", get(att + "o_proj.weight").T, get(att + "o_proj.bias"))
        self.packed(f"{p}.fc1", "v_fc1", *fc1)
        fc2_b = get(pre + "mlp.fc2.bias")
        if self.device:  # no host work between the device ViT's GEMMs: the bias rides in v_fc2's B
            self.packed(f"{p}.fc2", "v_fc2", get(pre + "mlp.fc2.weight").T, fc2_b)
        else:
            self.packed(f"{p}.fc2", "v_fc2", get(pre + "mlp.fc2.weight").T)
            self.f32(f"{p}.fc2.b", fc2_b)

    def neck(self) -> None:
        m, get = self.m, self.ck.get
        self.say("neck")
        n0, n1, n2 = (_NECK.format(l=i) for i in range(3))
        t0 = convt_taps(get(n0 + "scale_layers.0.weight"))
        b0 = np.tile(get(n0 + "scale_layers.0.bias"), 4)
        t1, b1 = convt_then_1x1(get(n1 + "scale_layers.0.weight"), get(n1 + "scale_layers.0.bias"),
                                get(n1 + "proj1.weight"), get(n1 + "proj1.bias"))
        t2 = get(n2 + "proj1.weight").reshape(m.d_model, m.vit_dim).T
        self.packed("n.in", "n_in", np.concatenate([t0, t1, t2], axis=1),
                    np.concatenate([b0, b1, get(n2 + "proj1.bias")]))
        up, up_b = convt_then_1x1(get(n0 + "scale_layers.2.weight"), get(n0 + "scale_layers.2.bias"),
                                  get(n0 + "proj1.weight"), get(n0 + "proj1.bias"))
        self.packed("n.up", "n_up", up, up_b)
        for i, n in enumerate((n0, n1, n2)):
            self.conv(f"n.conv{i}", n + "proj2.")

    def conv(self, name: str, source: str) -> None:
        """A 3x3 conv as the conv GEMM's banded B; its bias `name.b` is the host's."""
        self.packed(name, "conv", pack.conv_weights(self.ck.get(source + "weight"), self.g.conv_p))
        self.copy(name + ".b", source + "bias")

    def detr_encoder(self) -> None:
        m, g, d, get = self.m, self.g, self.m.d_model, self.ck.get
        self.say("DETR encoder")
        self.f32("d.pos", sine_position(m.grid, d))
        hd, dp = m.d_head, g.mhas["mha_d"].d
        cols = (np.arange(m.d_heads)[:, None] * dp + np.arange(hd)).ravel()  # head h's dims in its padded slot
        q_scale = np.float32(math.sqrt(dp / hd))  # mha_d scales by 1/sqrt(dp); the model by 1/sqrt(hd)
        for i in range(m.d_layers):
            pre, p = _ENC.format(i=i), f"d.{i}"
            for j in (1, 2, 3):
                self.norm(f"{p}.ln{j}", f"{pre}layer_norm{j}.")
            b, bias = np.zeros((2 * d, 3 * g.pd), np.float32), np.zeros(3 * g.pd, np.float32)
            att = pre + "self_attn."
            for j, (part, rows) in enumerate((("q", slice(0, d)), ("k", slice(0, d)), ("v", slice(d, 2 * d)))):
                scale = q_scale if part == "q" else np.float32(1)  # A = [LN1(x) + pos | LN1(x)]
                b[rows, j * g.pd + cols] = get(f"{att}{part}_proj.weight").T * scale
                bias[j * g.pd + cols] = get(f"{att}{part}_proj.bias") * scale
            self.packed(f"{p}.qkv", "d_qkv", b, bias)
            o = np.zeros((g.pd, d), np.float32)
            o[cols] = get(att + "o_proj.weight").T
            self.packed(f"{p}.o", "d_o", o, get(att + "o_proj.bias"))
            self.packed(f"{p}.fc1", "d_fc1", get(pre + "mlp.fc1.weight").T, get(pre + "mlp.fc1.bias"))
            self.packed(f"{p}.fc2", "d_fc2", get(pre + "mlp.fc2.weight").T)
            self.copy(f"{p}.fc2.b", pre + "mlp.fc2.bias")
            for part in "qkvo":
                self.linear(f"{p}.ca.{part}", f"{pre}cross_attn.{part}_proj.")

    def detr_decoder(self) -> None:
        m, d, get = self.m, self.m.d_model, self.ck.get
        self.say("DETR decoder")
        kv = self.g.gemms["dec_kv"]
        b, bias = np.zeros((kv.k, kv.n), np.float32), np.zeros(kv.n, np.float32)
        for layer in range(m.dec_layers):  # A = [enc + pos | enc]: layer l's K at l 2d.., its V at l 2d + d..
            c, att = layer * 2 * d, f"{_DEC}layers.{layer}.vision_cross_attn."
            b[:d, c:c + d] = get(att + "k_proj.weight").T
            b[d:, c + d:c + 2 * d] = get(att + "v_proj.weight").T
            bias[c:c + d], bias[c + d:c + 2 * d] = get(att + "k_proj.bias"), get(att + "v_proj.bias")
        self.packed("dec.kv", "dec_kv", b, bias)
        self.copy("dec.reference_points", _DEC + "reference_points.weight")
        self.copy("dec.presence_token", _DEC + "presence_token.weight", (d,))
        self.copy("dec.query_embed", _DEC + "query_embed.weight")
        self.mlp("dec.ref_point_head", _DEC + "ref_point_head.", 2)
        self.mlp("dec.rpb_y", _DEC + "box_rpb_embed_y.", 2)
        self.mlp("dec.rpb_x", _DEC + "box_rpb_embed_x.", 2)
        for layer in range(m.dec_layers):
            pre, p = f"{_DEC}layers.{layer}.", f"dec.{layer}"
            for short, att in (("sa", "self_attn"), ("tca", "text_cross_attn"), ("vca", "vision_cross_attn")):
                for part in ("qo" if short == "vca" else "qkvo"):
                    self.linear(f"{p}.{short}.{part}", f"{pre}{att}.{part}_proj.")
                self.norm(f"{p}.{short}_ln", f"{pre}{att}_layer_norm.")
            self.linear(f"{p}.fc1", pre + "mlp.fc1.")
            self.linear(f"{p}.fc2", pre + "mlp.fc2.")
            self.norm(f"{p}.mlp_ln", pre + "mlp_layer_norm.")
        self.norm("dec.out_ln", _DEC + "output_layer_norm.")
        self.mlp("dec.box_head", _DEC + "box_head.", 3)
        self.norm("dec.presence_ln", _DEC + "presence_layer_norm.")
        self.mlp("dec.presence_head", _DEC + "presence_head.", 3)

    def scoring(self) -> None:
        self.say("scoring")
        self.mlp("score.text_mlp", _SCORE + "text_mlp.", 2)
        self.norm("score.text_ln", _SCORE + "text_mlp_out_norm.")
        self.linear("score.text_proj", _SCORE + "text_proj.")
        self.linear("score.query_proj", _SCORE + "query_proj.")

    def mask_decoder(self) -> None:
        d = self.m.d_model
        self.say("mask decoder")
        for part in "qkvo":
            self.linear(f"m.ca.{part}", f"{_MASK}prompt_cross_attn.{part}_proj.")
        self.norm("m.ca_ln", _MASK + "prompt_cross_attn_norm.")
        for i in range(2):  # stage 0 upsamples onto fpn1 (2g), stage 1 onto fpn0 (4g); stage 2 is never run
            self.conv(f"m.conv{i}", f"{_MASK}pixel_decoder.conv_layers.{i}.")
            self.norm(f"m.gn{i}", f"{_MASK}pixel_decoder.norms.{i}.")
        for j in range(3):
            self.linear(f"m.embed.{j}", f"{_MASK}mask_embedder.layers.{j}.")
        self.copy("m.inst.w", _MASK + "instance_projection.weight", (d, d))
        self.copy("m.inst.b", _MASK + "instance_projection.bias")
        self.copy("m.sem.w", _MASK + "semantic_projection.weight", (d,))
        self.copy("m.sem.b", _MASK + "semantic_projection.bias")

    def text(self) -> None:
        self.say("text encoder")
        for name, array in export_text.text_tensors(self.root):
            self.w.tensor(name, array)
        # sam3.export_text reads the CLIP text model and the projection to the DETR width
        self.text_names = {n for n in self.ck.names if n.startswith(("text_encoder.text_model.", "text_projection."))}

    def tokenizer(self) -> None:
        """vocab.json and merges.txt as the checkpoint has them; the pack check's operands for d_s."""
        self.say("tokenizer and pack check")
        for name in TOKENIZER_FILES:
            self.w.file(name, userfiles.read_bytes(self.root / name, "text"))
        s = self.g.gemms["d_s"]
        rng = np.random.default_rng(0)
        b = (rng.standard_normal((s.k, s.n), dtype=np.float32) / np.float32(math.sqrt(s.k))).astype(np.float32)
        b[:8, 0] = _PACK_EDGE  # the rounding rule's ties, a negative tie, a zero (docs/sam3-packing.md 2.4)
        bias = (rng.standard_normal(s.n, dtype=np.float32) * np.float32(0.1)).astype(np.float32)
        self.f32("pack_test.B", b)
        self.f32("pack_test.bias", bias)
        self.w.raw_tensor("pack_test.packed", pack.pack_b(b, bias if s.bias else None, s.tile_k, s.tile_n, s.ct_k))


_PACK_EDGE = np.array([64, 14.9375, 106.5, 94.5, 0, -1.5, -2.5, 3], np.float32)


# ---------------------------------------------------------------------------------------------
# The reference


def _inside(directory: Path, name: str) -> Path | None:
    """`directory / name` with links resolved, or None when that leaves `directory` (docs/sam3-export.md 9)."""
    base = directory.resolve()
    path = (base / name).resolve()
    return path if path != base and path.is_relative_to(base) else None


class _Reference:
    """A reference.npz and its cases.json (docs/sam3-export.md 9), checked against the model's sizes."""

    def __init__(self, path: Path, npz: np.lib.npyio.NpzFile, cases: list[dict[str, Any]], m: Model):
        self.path, self.npz, self.cases, self.m = path, npz, cases, m

    @classmethod
    def load(cls, path: str | Path, m: Model) -> _Reference:
        """Raises ExportError for a missing file or key, a case without image or prompt, or a shape that differs."""
        path = Path(path)
        try:
            npz = np.load(userfiles.open_binary(path, "npy"), allow_pickle=False)  # the archive keeps the file open
        except (OSError, ValueError) as e:
            raise ExportError(f"{path}: cannot read the reference: {e}") from e
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ExportError(f"{path}: holds a single .npy array, expected the reference's .npz archive")
        cases_path = path.parent / "cases.json"
        try:
            doc = userfiles.read_json(cases_path)
        except (OSError, ValueError) as e:
            raise ExportError(f"{cases_path}: cannot read the cases beside the reference: {e}") from e
        cases = doc.get("cases") if isinstance(doc, dict) else None
        if not isinstance(cases, list) or not cases:
            raise ExportError(f"{cases_path}: expected an object with a non-empty list 'cases'")
        ref = cls(path, npz, cases, m)
        ref.check()
        return ref

    def key(self, i: int, name: str) -> str:
        return f"case.{i}.{name}"

    def get(self, i: int, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        k = self.key(i, name)
        if k not in self.npz.files:
            raise ExportError(f"{self.path}: key {k} missing")
        a = self.npz[k]
        if shape is not None and a.shape != shape:
            raise ExportError(f"{self.path}: {k} has shape {list(a.shape)}, expected {list(shape)}")
        return a

    def shapes(self) -> dict[str, tuple[int, ...]]:
        m, d, length, side, q = self.m, self.m.d_model, int(self.m.text["text_len"]), 4 * self.m.grid, self.m.queries
        g = m.grid
        return {"pixel_values": (3, m.image_size, m.image_size), "input_ids": (length,), "attention_mask": (length,),
                "text": (length, d), "vit_out": (m.tokens, m.vit_dim), "fpn0": (d, 4 * g, 4 * g),
                "fpn1": (d, 2 * g, 2 * g), "fpn2": (d, g, g), "enc_out": (m.tokens, d),
                "dec.intermediate_hidden_states": (m.dec_layers, 1, q, d), "pred_logits": (q,),
                "pred_boxes": (q, 4), "presence": (1,), "pred_masks": (q, side, side), "semantic": (1, side, side)}

    def check(self) -> None:
        for i, case in enumerate(self.cases):
            where = f"{self.path.parent / 'cases.json'}: case {i}"
            if not isinstance(case, dict) or case.get("index", i) != i:
                raise ExportError(f"{where}: expected an object with index {i}")
            for fld in ("image", "prompt"):
                if not isinstance(case.get(fld), str) or not case[fld].strip():
                    raise ExportError(f"{where}: field {fld!r} missing or empty")
            inside = _inside(self.path.parent, case["image"])
            if inside is None:
                raise ExportError(f"{where}: image {case['image']!r} is not a file inside the reference's directory "
                                  f"{self.path.parent}")
            if not inside.is_file():
                raise ExportError(f"{where}: image {self.path.parent / case['image']} not found")
            rgb = self.get(i, "rgb")
            if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
                raise ExportError(f"{self.path}: case.{i}.rgb is {rgb.dtype} {list(rgb.shape)}, expected u8 [H, W, 3]")
            n = self.get(i, "thrx.scores").shape
            self.get(i, "thrx.masks", (n[0], rgb.shape[0], rgb.shape[1]))
            for name in ("thrx.threshold", "thrx.margin", "thrx.min_iou", "input_ids", "attention_mask"):
                self.get(i, name)
        for name, shape in self.shapes().items():
            self.get(0, name, shape)

    def image_path(self, i: int) -> str:
        return "cases/" + Path(self.cases[i]["image"]).name

    def records(self, w: BundleWriter) -> None:
        """ref_image, ref_prompt, a case per case and a tok_test per case's prompt (images copied once each)."""
        written: set[str] = set()
        for i, case in enumerate(self.cases):
            rel = self.image_path(i)
            if rel not in written:
                w.file(rel, userfiles.read_bytes(self.path.parent / case["image"], "image"))
                written.add(rel)
        w.record("ref_image", self.image_path(0))
        w.record("ref_prompt", self.cases[0]["prompt"])
        for i, case in enumerate(self.cases):
            w.record("case", i, self.image_path(i), case["prompt"])
        for i, case in enumerate(self.cases):
            w.record("tok_test", i, build.escape_prompt(case["prompt"]))

    def tensors(self, w: BundleWriter) -> None:
        """ref.* from case 0; case.<i>.* and tok.<i>.* from every case (docs/sam3-export.md 9)."""
        for name, array in self.ref_tensors():
            w.tensor(name, array)
        for i in range(len(self.cases)):
            w.tensor(f"case.{i}.scores", self.get(i, "thrx.scores").astype(np.float32))
            w.tensor(f"case.{i}.masks", (self.get(i, "thrx.masks") != 0).astype(np.uint8))
            for name in ("threshold", "margin", "min_iou"):
                w.tensor(f"case.{i}.{name}", self.get(i, f"thrx.{name}").astype(np.float32).reshape(1))
            w.tensor(f"tok.{i}.ids", self.get(i, "input_ids").astype(np.int32))
            w.tensor(f"tok.{i}.mask", self.get(i, "attention_mask").astype(np.int32))

    def ref_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        g = self.get
        yield "ref.rgb", np.ascontiguousarray(g(0, "rgb"))
        yield "ref.pixel_values", g(0, "pixel_values").astype(np.float32)
        yield "ref.input_ids", g(0, "input_ids").astype(np.int32)
        yield "ref.attention_mask", g(0, "attention_mask").astype(np.int32)
        yield "ref.text", g(0, "text").astype(np.float32)
        yield "ref.vit_out", g(0, "vit_out").astype(np.float32)
        for level in range(3):  # channels first in the reference, channels last in the bundle
            yield f"ref.fpn{level}", np.ascontiguousarray(g(0, f"fpn{level}").astype(np.float32).transpose(1, 2, 0))
        yield "ref.enc_out", g(0, "enc_out").astype(np.float32)
        yield "ref.dec_hidden", g(0, "dec.intermediate_hidden_states").astype(np.float32)[:, 0]
        yield "ref.pred_logits", g(0, "pred_logits").astype(np.float32)
        yield "ref.pred_boxes", g(0, "pred_boxes").astype(np.float32)
        yield "ref.presence", g(0, "presence").astype(np.float32)
        yield "ref.pred_masks", g(0, "pred_masks").astype(np.float32)
        yield "ref.semantic", g(0, "semantic").astype(np.float32)[0]


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None, prog: str = "sam3 export") -> int:
    """`sam3 export --model HF_DIR --out BUNDLE [--vit device|host] [--residual f32|bf16] [--kernels DIR]
    [--reference NPZ]`: export a checkpoint, print the bundle directory. Progress lines go to stderr.

    Returns 0 on success, 1 when the export fails (the message on stderr); argparse exits with 2 on bad usage.
    """
    p = argparse.ArgumentParser(prog=prog, description="Export a transformers SAM3 checkpoint as a bundle.")
    p.add_argument("--model", required=True, help="the checkpoint directory (config.json, model.safetensors, ...)")
    p.add_argument("--out", required=True, help="bundle directory to create (must not exist or be empty)")
    p.add_argument("--vit", choices=VIT_MODES, default="device", help="the ViT on the device (default) or the host")
    p.add_argument("--residual", choices=RESIDUALS, default="f32", help="the device ViT's residual stream")
    p.add_argument("--kernels", help="a compiled bundle of the same shapes whose kernels are copied (default: "
                                     "placeholder kernels for the emulator)")
    p.add_argument("--reference", help="a reference.npz (cases.json beside it) to embed for `sam3 check`")
    args = p.parse_args(argv)
    start = time.monotonic()

    def progress(line: str) -> None:
        print(f"{prog}: [{time.monotonic() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    try:
        root = export(args.model, args.out, vit=args.vit, residual=args.residual, kernels=args.kernels,
                      reference=args.reference, progress=progress)
    except (ValueError, OSError) as e:  # ExportError, BundleError, PackError are ValueErrors
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())

