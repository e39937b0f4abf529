"""Writing a SAM3 bundle in the real format (docs/sam3-bundle.md) for given model sizes, with seeded weights.

The real bundle comes from IRON's exporter, which compiles every kernel and packs SAM3's trained weights.
This module writes the same files for any consistent `Geometry` without either: random float32 weights
drawn from the seed, packed by `sam3.pack` as the exporter packs them; placeholder xclbins from the
project's own writer (`amdxdna_direct.xclbin.build_mlir_aie`: an AIE_PARTITION sized for the target, the
MLIR_AIE kernel's argument metadata) around a seeded PDI that is no executable design; and for every kernel
key a TXN instruction stream from `sam3.kernels`, which the emulator binds to the model of that kernel. So a
built bundle runs the whole pipeline on the emulator, never on a real NPU.

Nothing downstream depends on a geometry's numbers: they reach the pipeline only through the manifest.
Weights are N(0, 1/fan_in) for matrices, with perturbed biases and norms, each tensor drawn from its own
stream of the seed (`numpy.random.default_rng([seed, crc32(name)])`), so a tensor does not change when
another one is added. Every host tensor the pipeline reads is written, in float32 (the text encoder's
matrices in bf16, as the real bundle stores them); every NPU weight only packed, and a device ViT's bundle
keeps the host ViT's tensors (its LayerNorm affines, fc2 biases, RoPE tables) too. The packed form unpacks
(`sam3.pack.unpack_b`) to the f32 matrix the NPU computes with, so the bundle's own tensors are enough to
compute a float32 reference of each stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from amdxdna_direct import xclbin
from amdxdna_direct.device import TXN_DEV_GEN
from amdxdna_direct.errors import Error
from sam3 import kernels, pack
from sam3.bundle import GEMM_KEYS, MHA_KEYS, OP_KEYS, BundleWriter

# Bumped whenever the bytes a build writes change for the same inputs: it is part of build_cached's key.
BUILDER_VERSION = 1
VARIANTS = ("host", "device", "device-f32")
PRESETS = ("tiny", "sam3")
TARGETS = ("npu1", "npu4", "npu5", "npu6")
KERNEL_NAME = "MLIR_AIE"
# The device ViT's per-layer GEMMs: rope and addln run once over whole buffers of their rows (docs/sam3-pipeline.md
# 2.3), so the four must agree on M.
_VIT_LAYER_GEMMS = ("v_qkv", "v_o", "v_fc1", "v_fc2")
# Placement of every placeholder xclbin: the whole array of the generation, so that a GEMM's stream drives the
# per-core runtime parameters of all its cores (32 on NPU4/5/6: 8 columns x 4 core rows; NPU1: the 4 columns
# after the shim-less column 0), and so that the kernels' contexts time-share one partition.
_PARTITIONS = {"npu1": (4, (1,)), "npu4": (8, (0,)), "npu5": (8, (0,)), "npu6": (8, (0,))}
_CORE_ROWS = 4
_PDI_BYTES = 1024
_STD_PERTURB = 0.1    # spread of biases and norm affines around 0 and 1

ProgressFn = Callable[[str], None]


class GeometryError(Error, ValueError):
    """A geometry that breaks a consistency rule the pipeline relies on; `rule` names it."""

    def __init__(self, name: str, rule: str, detail: str):
        super().__init__(f"geometry {name}: {rule}: {detail}")
        self.rule = rule


# ---------------------------------------------------------------------------------------------
# Geometry


@dataclass(frozen=True)
class GemmShape:
    """One compiled flm.GEMM: `C[M, N] = A[M, K] B[K, N] (+ bias in B)`, A rows `lda` apart, B packed with
    (tile_k, tile_n, ct_k) (docs/sam3-packing.md 3)."""

    m: int
    k: int
    n: int
    lda: int
    tile_k: int
    tile_n: int
    ct_k: int
    bias: bool

    @property
    def b_bytes(self) -> int:
        """Length of the packed B: 9 N (K + ct_k bias) / 8."""
        return 9 * self.n * (self.k + self.ct_k * self.bias) // 8

    @property
    def tiles(self) -> tuple[int, int, int, int, bool]:
        """The compile-time choices a hardware context fixes: (M, tile_k, tile_n, ct_k, bias) without K and N,
        which the instruction stream carries."""
        return self.m, self.tile_k, self.tile_n, self.ct_k, self.bias


@dataclass(frozen=True)
class MhaShape:
    """One compiled non-causal MHA over `elems` bf16 per buffer, `[heads, seq, d]` or token-major."""

    heads: int
    seq: int
    d: int
    token_major: bool
    elems: int


@dataclass(frozen=True)
class Geometry:
    """The model sizes of a bundle (its required params) and the kernels' compile-time choices.

    `gemms` maps each of the 16 GEMM keys to its `GemmShape`, `mhas` each MHA key to its `MhaShape`. Build one
    with `Geometry.tiny()`, `Geometry.sam3()` or `Geometry.derive(...)`; `check()` enforces the consistency
    rules. The geometry holds v_fc2's bias flag for the host ViT; `for_variant` sets it for a device one.
    """

    name: str
    image_size: int
    patch: int
    grid: int
    window: int
    vit_dim: int
    vit_heads: int
    vit_layers: int
    vit_ffn_pad: int
    vit_global: tuple[int, ...]
    vit_eps: float
    d_model: int
    d_heads: int
    d_layers: int
    d_ffn: int
    dec_layers: int
    queries: int
    mask_size: int
    neck_splits: tuple[int, ...]
    text_len: int
    text_dim: int
    text_heads: int
    text_layers: int
    text_ffn: int
    text_eps: float
    gemms: Mapping[str, GemmShape] = field(default_factory=dict)
    mhas: Mapping[str, MhaShape] = field(default_factory=dict)

    # -- derived sizes

    @property
    def tokens(self) -> int:
        """T = grid^2 image tokens."""
        return self.grid * self.grid

    @property
    def vit_head_dim(self) -> int:
        """Width of one ViT head."""
        return self.vit_dim // self.vit_heads

    @property
    def rope_half(self) -> int:
        """Columns of the RoPE tables: half a ViT head."""
        return self.vit_head_dim // 2

    @property
    def windows(self) -> int:
        """Attention windows per image."""
        return (self.grid // self.window) ** 2

    @property
    def pd(self) -> int:
        """Width of the DETR encoder's padded heads, mha_d.d * d_heads."""
        return self.mhas["mha_d"].d * self.d_heads

    @property
    def conv_p(self) -> int:
        """Output pixels per row of the conv GEMM: lda / D."""
        c = self.gemms["conv"]
        return c.lda // ((c.k - c.lda) // 2)

    # -- presets

    @classmethod
    def tiny(cls) -> Geometry:
        """A model small enough for each stage to run in a fraction of a second on the emulator: 8x8 tokens in
        4x4 windows, widths 64 (ViT) and 32 (DETR, text), one or two layers of each."""
        return cls.derive(
            "tiny", image_size=16, patch=2, grid=8, window=4, vit_dim=64, vit_heads=2, vit_layers=2, vit_ffn_pad=96,
            vit_global=(1,), vit_eps=1e-6, d_model=32, d_heads=2, d_layers=1, d_ffn=64, dec_layers=1, queries=4,
            mask_size=32, neck_splits=(64, 128, 32), text_len=8, text_dim=32, text_heads=2, text_layers=1,
            text_ffn=64, text_eps=1e-5,
            m=16, tile_k=16, tile_n=16, ct_k=8, mha_d_head=32,
            overrides={"d_s": {"ct_k": 16}, "m_head": {"tile_n": 8, "m": 32}, "v_fc1": {"tile_n": 32}})

    @classmethod
    def sam3(cls) -> Geometry:
        """SAM3's sizes: 1008 px in 14 px patches (72x72 tokens, 24x24 windows), a 1024-wide 32-layer ViT with
        global layers 7, 15, 23, 31 and MLP 4736, the 256-wide DETR (8 heads, 6 + 6 layers, MLP 2048), 200
        queries, 288 px masks, the 1024-wide 24-layer text encoder over 32 tokens. d_s packs with ct_k 32,
        which makes its B 82944 bytes long, as the real bundle's pack check reports."""
        return cls.derive(
            "sam3", image_size=1008, patch=14, grid=72, window=24, vit_dim=1024, vit_heads=16, vit_layers=32,
            vit_ffn_pad=4736, vit_global=(7, 15, 23, 31), vit_eps=1e-6, d_model=256, d_heads=8, d_layers=6,
            d_ffn=2048, dec_layers=6, queries=200, mask_size=288, neck_splits=(2048, 1024, 256), text_len=32,
            text_dim=1024, text_heads=16, text_layers=24, text_ffn=4096, text_eps=1e-5,
            m=64, tile_k=64, tile_n=64, ct_k=32, mha_d_head=64, overrides={"v_embed": {"k": 768}, "m_head": {"m": 256}})

    @classmethod
    def named(cls, name: str) -> Geometry:
        """The preset called `name` ("tiny" or "sam3").

        Raises:
            ValueError: an unknown name.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown geometry {name!r} (expected one of {', '.join(PRESETS)})")
        preset: Callable[[], Geometry] = getattr(cls, name)  # a classmethod named in PRESETS
        return preset()

    @classmethod
    def derive(cls, name: str, *, m: int, tile_k: int, tile_n: int, ct_k: int, mha_d_head: int, conv_p: int = 2,
               overrides: Mapping[str, Mapping[str, int]] | None = None, **params: Any) -> Geometry:
        """A geometry whose kernels follow from the model sizes `params` (every field but gemms and mhas).

        Every GEMM gets (m, tile_k, tile_n, ct_k) and the shape the pipeline feeds it (docs/sam3-build.md 2):
        v_embed's K is 3 patch^2 rounded up to its tile_k, n_up's N is 4 d_model, dec_kv's N is dec_layers 2
        d_model, m_head's N is queries + 1 rounded up to its tile_n, the conv computes `conv_p` pixels per row;
        the DETR heads are padded to `mha_d_head`. `overrides` replaces single fields of single GEMMs (key ->
        {field: value}); the v_embed K and m_head N follow an overridden tile, unless overridden themselves.

        Raises:
            GeometryError: an override names an unknown GEMM or field.
        """
        g = cls(name=name, **params)
        shapes = _gemm_shapes(g, m, tile_k, tile_n, ct_k, conv_p, mha_d_head, overrides or {})
        return dataclasses.replace(g, gemms=shapes, mhas=_mha_shapes(g, mha_d_head))

    def with_gemm(self, key: str, **changes: Any) -> Geometry:
        """This geometry with fields of GEMM `key` replaced (ints; `bias` a bool), no other GEMM changed."""
        return dataclasses.replace(self, gemms={**self.gemms, key: dataclasses.replace(self.gemms[key], **changes)})

    def with_mha(self, key: str, **changes: Any) -> Geometry:
        """This geometry with fields of MHA `key` replaced (ints; `token_major` a bool)."""
        return dataclasses.replace(self, mhas={**self.mhas, key: dataclasses.replace(self.mhas[key], **changes)})

    def for_variant(self, variant: str) -> Geometry:
        """The geometry a `variant` bundle is built with: a device ViT has no host work between its GEMMs, so
        v_fc2 carries the fc2 bias in its B (bias=1); the host ViT adds `v.<i>.fc2.b` itself (bias=0).

        Raises:
            ValueError: an unknown variant.
        """
        _check_variant(variant)
        return self.with_gemm("v_fc2", bias=variant != "host")

    def params(self) -> dict[str, object]:
        """The required params of the manifest, by name (tokenizer ids excluded: the vocabulary fixes them)."""
        names = ("grid", "window", "vit_dim", "vit_heads", "vit_layers", "vit_ffn_pad", "vit_global", "patch",
                 "image_size", "d_model", "d_heads", "d_layers", "d_ffn", "text_len", "text_dim", "text_heads",
                 "text_layers", "text_ffn", "text_eps", "vit_eps", "queries", "dec_layers", "neck_splits",
                 "mask_size")
        values = {n: getattr(self, n) for n in names}
        return {n: list(v) if isinstance(v, tuple) else v for n, v in values.items()}

    def to_json(self) -> dict[str, Any]:
        """Every field as JSON-ready data (the cache key hashes it)."""
        return dataclasses.asdict(self)

    # -- consistency

    def check(self, variant: str | None = None) -> None:
        """Enforce every consistency rule the pipeline relies on (docs/sam3-build.md 3), with the builder's own:
        positive sizes, one shape per kernel key, pack_b's tiling preconditions, the MHA layouts.

        With `variant`, also the device ViT's rules (its four layer GEMMs share M; v_fc2's bias flag matches).

        Raises:
            GeometryError: the first rule broken, named, with the values.
            ValueError: an unknown variant.
        """
        _Rules(self).check(variant)


def _gemm_shapes(g: Geometry, m: int, tile_k: int, tile_n: int, ct_k: int, conv_p: int, mha_d_head: int,
                 overrides: Mapping[str, Mapping[str, int]]) -> dict[str, GemmShape]:
    unknown = sorted(set(overrides) - set(GEMM_KEYS))
    if unknown:
        raise GeometryError(g.name, "overrides name GEMM keys", f"unknown {unknown}")
    names = {f.name for f in dataclasses.fields(GemmShape)}
    shapes = {}
    for key in GEMM_KEYS:
        choice = {"m": m, "tile_k": tile_k, "tile_n": tile_n, "ct_k": ct_k, **overrides.get(key, {})}
        bad = sorted(set(choice) - names)
        if bad:
            raise GeometryError(g.name, f"overrides of {key} name GemmShape fields", f"unknown {bad}")
        k, n, bias = _gemm_size(g, key, choice, conv_p, mha_d_head)
        fields: dict[str, Any] = {"k": k, "n": n, "bias": bias} | choice
        if "lda" not in fields:  # only the conv's A rows overlap: lda = P D of K = (P + 2) D
            fields["lda"] = conv_p * fields["k"] // (conv_p + 2) if key == "conv" else fields["k"]
        shapes[key] = GemmShape(**fields)
    return shapes


def _gemm_size(g: Geometry, key: str, tiles: Mapping[str, int], conv_p: int, mha_d_head: int) -> tuple[int, int, bool]:
    """(K, N, bias) of GEMM `key` as the pipeline shapes it (docs/sam3-build.md 2). Bias: in B where
    the host adds none (the ViT's, neck's and DETR's projections, the folded cross-attention, the mask head);
    not for v_embed (no patch-embedding bias), the convs (bias added on the host after readback), d_fc2 (the
    host adds d.<i>.fc2.b) and the host ViT's v_fc2 (the host adds v.<i>.fc2.b; see Geometry.for_variant)."""
    d, vd = g.d_model, g.vit_dim
    pd = mha_d_head * g.d_heads
    s0, s1, s2 = (tuple(g.neck_splits) + (0, 0, 0))[:3]
    sizes = {
        "v_embed": (pack.round_up(3 * g.patch * g.patch, tiles["tile_k"]), vd, False),
        "v_qkv": (vd, 3 * vd, True), "v_o": (vd, vd, True),
        "v_fc1": (vd, g.vit_ffn_pad, True), "v_fc2": (g.vit_ffn_pad, vd, False),
        "n_in": (vd, s0 + s1 + s2, True), "n_up": (s0 // 4, 4 * d, True),
        "conv": ((conv_p + 2) * 3 * d, conv_p * d, False),
        "d_qkv": (2 * d, 3 * pd, True), "d_o": (pd, d, True),
        "d_s": (d, g.d_heads * g.text_len, True), "d_c": (g.d_heads * g.text_len, d, True),
        "d_fc1": (d, g.d_ffn, True), "d_fc2": (g.d_ffn, d, False),
        "dec_kv": (2 * d, g.dec_layers * 2 * d, True),
        "m_head": (d, pack.round_up(g.queries + 1, tiles["tile_n"]), True),
    }
    return sizes[key]


def _mha_shapes(g: Geometry, mha_d_head: int) -> dict[str, MhaShape]:
    hd, T = g.vit_dim // max(g.vit_heads, 1), g.tokens  # noqa: N806 (check() refuses a zero before any use)
    win = g.window * g.window
    n_win = (g.grid // max(g.window, 1)) ** 2
    return {
        "mha_win": MhaShape(heads=n_win * g.vit_heads, seq=win, d=hd, token_major=False,
                            elems=n_win * g.vit_heads * win * hd),
        "mha_glob": MhaShape(heads=g.vit_heads, seq=T, d=hd, token_major=True, elems=T * g.vit_heads * hd),
        "mha_d": MhaShape(heads=g.d_heads, seq=T, d=mha_d_head, token_major=True, elems=T * g.d_heads * mha_d_head),
    }


class _Rules:
    """The consistency rules, checked in order (a later rule may divide by what an earlier one proved nonzero)."""

    def __init__(self, g: Geometry):
        self.g = g

    def need(self, ok: bool, rule: str, detail: str) -> None:
        if not ok:
            raise GeometryError(self.g.name, rule, detail)

    def check(self, variant: str | None) -> None:
        if variant is not None:
            _check_variant(variant)
        self.sizes()
        self.image()
        self.widths()
        self.vit()
        self.neck()
        self.detr()
        self.heads()
        self.tiling()
        if variant is not None:
            self.variant(variant)

    def sizes(self) -> None:
        g = self.g
        for f in dataclasses.fields(g):
            v = getattr(g, f.name)
            if isinstance(v, int) and not isinstance(v, bool):
                self.need(v > 0, f"{f.name} is a positive integer", f"{f.name} = {v}")
        for eps in ("vit_eps", "text_eps"):
            v = getattr(g, eps)
            self.need(isinstance(v, float) and 0 < v < 1, f"{eps} is a small positive float", f"{eps} = {v!r}")
        self.need(set(g.gemms) == set(GEMM_KEYS), "one GemmShape per GEMM key",
                  f"missing {sorted(set(GEMM_KEYS) - set(g.gemms))}, unknown {sorted(set(g.gemms) - set(GEMM_KEYS))}")
        self.need(set(g.mhas) == set(MHA_KEYS), "one MhaShape per MHA key",
                  f"missing {sorted(set(MHA_KEYS) - set(g.mhas))}, unknown {sorted(set(g.mhas) - set(MHA_KEYS))}")
        shapes: dict[str, GemmShape | MhaShape] = {**g.gemms, **g.mhas}
        for key, s in shapes.items():
            for f in dataclasses.fields(s):
                v = getattr(s, f.name)
                if not isinstance(v, bool):
                    self.need(v > 0, f"{key}.{f.name} is a positive integer", f"{key}.{f.name} = {v}")
        self.need(g.text_len >= 2, "text_len >= 2 (bos and eos)", f"text_len = {g.text_len}")

    def image(self) -> None:
        g = self.g
        self.need(g.image_size == g.grid * g.patch, "image_size = grid * patch",
                  f"{g.image_size} != {g.grid} * {g.patch}")
        self.need(g.grid % g.window == 0, "grid % window = 0", f"grid {g.grid}, window {g.window}")
        self.need(g.tokens % 8 == 0, "T = grid^2 is a multiple of 8", f"T = {g.tokens}")
        self.need(g.mask_size == 4 * g.grid, "mask_size = 4 * grid", f"{g.mask_size} != 4 * {g.grid}")

    def vit(self) -> None:
        g, s = self.g, self.g.gemms
        bad = [i for i in g.vit_global if not 0 <= i < g.vit_layers]
        self.need(bool(g.vit_global) and not bad and len(set(g.vit_global)) == len(g.vit_global),
                  "vit_global lists distinct layers < vit_layers, at least one (a param value cannot be empty)",
                  f"vit_global {list(g.vit_global)}")
        self.kn("v_embed", None, "vit_dim")
        self.need(s["v_embed"].k >= 3 * g.patch ** 2, "v_embed K >= 3 * patch^2", f"K {s['v_embed'].k}")
        self.kn("v_qkv", "vit_dim", "3 * vit_dim")
        self.kn("v_o", "vit_dim", "vit_dim")
        self.kn("v_fc1", "vit_dim", "vit_ffn_pad")
        self.kn("v_fc2", "v_fc1 N", "vit_dim")

    def neck(self) -> None:
        g, s = self.g, self.g.gemms
        self.need(len(g.neck_splits) == 3, "neck_splits has 3 widths", f"neck_splits {list(g.neck_splits)}")
        s0, s1, s2 = g.neck_splits
        self.need(s1 == 4 * g.d_model and s2 == g.d_model, "neck_splits s1 = 4 * d_model and s2 = d_model",
                  f"s1 {s1}, s2 {s2}, d_model {g.d_model}")
        self.need(s0 % 4 == 0, "neck_splits s0 % 4 = 0", f"s0 {s0}")
        self.kn("n_in", "vit_dim", "s0 + s1 + s2")
        self.kn("n_up", "s0 / 4", None)
        self.need(s["n_up"].n >= 4 * g.d_model, "n_up N >= 4 * d_model", f"N {s['n_up'].n}")
        c = s["conv"]
        self.need(c.lda < c.k and (c.k - c.lda) % 2 == 0, "conv (K - lda) is even and positive",
                  f"K {c.k}, lda {c.lda}")
        dd = (c.k - c.lda) // 2
        self.need(dd % 3 == 0 and c.lda % dd == 0, "conv D = (K - lda) / 2 is divisible by 3 and lda a multiple of D",
                  f"D {dd}, lda {c.lda}")
        self.need(dd // 3 == g.d_model, "conv C = D / 3 = d_model", f"C {dd // 3}, d_model {g.d_model}")
        self.need(c.n == (c.lda // dd) * g.d_model, "conv N = P * d_model", f"N {c.n}, P {c.lda // dd}")

    def detr(self) -> None:
        g, s = self.g, self.g.gemms
        d, mha_d = g.d_model, g.mhas["mha_d"]
        self.need(mha_d.d >= d // g.d_heads, "mha_d.d holds a DETR head", f"mha_d.d {mha_d.d}, head {d // g.d_heads}")
        self.kn("d_qkv", "2 * d_model", "3 * pd")
        self.kn("d_o", "pd", "d_model")
        self.kn("d_s", "d_model", "d_heads * text_len")
        self.kn("d_c", "d_heads * text_len", "d_model")
        self.kn("d_fc1", "d_model", None)
        self.kn("d_fc2", "d_fc1 N", "d_model")
        self.kn("dec_kv", "2 * d_model", None)
        self.need(s["dec_kv"].n >= g.dec_layers * 2 * d, "dec_kv N >= dec_layers * 2 * d_model", f"N {s['dec_kv'].n}")
        self.kn("m_head", "d_model", None)
        self.need(s["m_head"].n >= g.queries + 1, "m_head N >= queries + 1", f"N {s['m_head'].n}")

    def widths(self) -> None:
        g = self.g
        self.need(g.vit_dim % g.vit_heads == 0, "vit_dim % vit_heads = 0", f"{g.vit_dim} % {g.vit_heads}")
        self.need(g.vit_head_dim % 2 == 0, "the ViT head dim is even", f"head dim {g.vit_head_dim}")
        self.need(g.d_model % g.d_heads == 0 and (g.d_model // g.d_heads) % 8 == 0,
                  "d_model % d_heads = 0 with a head dim that is a multiple of 8", f"{g.d_model} / {g.d_heads}")
        self.need(g.d_model % 8 == 0, "d_model % 8 = 0 (GroupNorm)", f"d_model {g.d_model}")
        self.need(g.text_dim % g.text_heads == 0, "text_dim % text_heads = 0", f"{g.text_dim} % {g.text_heads}")

    def heads(self) -> None:
        g = self.g
        T, hd = g.tokens, g.vit_head_dim  # noqa: N806
        win = g.mhas["mha_win"]
        self.need((win.heads, win.seq, win.d, win.token_major) == (g.windows * g.vit_heads, g.window ** 2, hd, False),
                  "mha_win is [windows * vit_heads, window^2, head dim]", f"{win}")
        glob = g.mhas["mha_glob"]
        self.need((glob.heads, glob.seq, glob.d, glob.token_major) == (g.vit_heads, T, hd, True),
                  "mha_glob is token-major [T, vit_heads * head dim]", f"{glob}")
        mha_d = g.mhas["mha_d"]
        self.need((mha_d.heads, mha_d.seq, mha_d.token_major) == (g.d_heads, T, True),
                  "mha_d is token-major [T, d_heads * mha_d.d]", f"{mha_d}")
        for key, least in (("mha_win", T * g.vit_dim), ("mha_glob", T * g.vit_dim), ("mha_d", T * g.pd)):
            m = g.mhas[key]
            self.need(m.elems >= least and m.elems >= m.heads * m.seq * m.d,
                      f"{key} elems >= {'T * pd' if key == 'mha_d' else 'T * vit_dim'} and heads * seq * d",
                      f"elems {m.elems}, need {max(least, m.heads * m.seq * m.d)}")

    def tiling(self) -> None:
        for key, s in self.g.gemms.items():
            self.need(s.k % s.tile_k == 0 and s.n % s.tile_n == 0, f"{key}: K % tile_k = 0 and N % tile_n = 0",
                      f"K {s.k}, tile_k {s.tile_k}, N {s.n}, tile_n {s.tile_n}")
            self.need(s.tile_k % s.ct_k == 0 and s.ct_k % 8 == 0 and s.tile_n % 8 == 0,
                      f"{key}: tile_k % ct_k = 0, ct_k % 8 = 0 and tile_n % 8 = 0",
                      f"tile_k {s.tile_k}, ct_k {s.ct_k}, tile_n {s.tile_n}")
            if key != "conv":
                self.need(s.lda == s.k, f"{key}: lda = K (only conv overlaps its A rows)", f"lda {s.lda}, K {s.k}")

    def variant(self, variant: str) -> None:
        s = self.g.gemms
        self.need(s["v_fc2"].bias == (variant != "host"),
                  f"v_fc2 bias = {int(variant != 'host')} in a {variant} bundle (see Geometry.for_variant)",
                  f"bias {int(s['v_fc2'].bias)}")
        if variant != "host":
            ms = {key: s[key].m for key in _VIT_LAYER_GEMMS}
            self.need(len(set(ms.values())) == 1, "the device ViT's layer GEMMs share M", f"{ms}")

    def kn(self, key: str, k: str | None, n: str | None) -> None:
        """GEMM `key`'s K and N equal the named sizes (expressions over the geometry's fields and other GEMMs)."""
        s = self.g.gemms[key]
        for what, name in (("k", k), ("n", n)):
            if name is not None:
                want = self.size(name)
                self.need(getattr(s, what) == want, f"{key} {what.upper()} = {name}",
                          f"{what.upper()} {getattr(s, what)}, {name} = {want}")

    def size(self, name: str) -> int:
        g = self.g
        sizes = {"vit_dim": g.vit_dim, "3 * vit_dim": 3 * g.vit_dim, "vit_ffn_pad": g.vit_ffn_pad,
                 "v_fc1 N": g.gemms["v_fc1"].n, "s0 + s1 + s2": sum(g.neck_splits), "s0 / 4": g.neck_splits[0] // 4,
                 "d_model": g.d_model, "2 * d_model": 2 * g.d_model, "pd": g.pd, "3 * pd": 3 * g.pd,
                 "d_heads * text_len": g.d_heads * g.text_len, "d_fc1 N": g.gemms["d_fc1"].n}
        return sizes[name]


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (expected one of {', '.join(VARIANTS)})")


# ---------------------------------------------------------------------------------------------
# Vocabulary and tokenizer tests
#
# A real bundle carries CLIP's 49408-token vocabulary. A built one carries a small vocabulary of the same shape
# (docs/sam3-build.md 5): the 256 byte symbols of GPT-2's byte-to-unicode table, the same with the
# end-of-word mark, one token per merge, then the start and end tokens; so every word still tokenizes, mostly
# into single bytes, and the few merges below cover the words of the test prompts.

_MERGES = (("c", "a"), ("ca", "t</w>"), ("ca", "r</w>"), ("ca", "t"), ("cat", "s</w>"), ("d", "o"), ("do", "g</w>"),
           ("e", "r"), ("p", "er"), ("s", "o"), ("so", "n</w>"), ("per", "son</w>"), ("'", "s</w>"))
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"
# Tokenizer tests: escapes of every kind the manifest's unescape handles (\t, \xNN, \uNNNN, \\), whitespace runs,
# upper case, a contraction, digits, a symbol run and, at text_len 8, a prompt that fills every row and one that
# is cut.
TOK_TESTS = ("a cat", "  Cats\tand DOGS  ", "CAF\xc9\t5", "\u20ac\\zz", "cat's car", "PERSON 42!")
REF_PROMPT = "cat"
# The pre-tokenizer's alternatives, tried in order at each position: contractions, a run of letters, one
# digit, a run of anything else but whitespace. (Python's classes approximate Unicode's letter and number
# properties; the test prompts stay within ASCII and Latin-1 letters, where they agree.)
_PIECE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|(?:[^\s\w]|_)+")


def _byte_symbols() -> tuple[dict[int, str], list[str]]:
    """GPT-2's byte -> unicode table, and the symbols in CLIP's vocabulary order (printable bytes first)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    rest = [b for b in range(256) if b not in set(keep)]
    table = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(rest)}
    return table, [table[b] for b in keep + rest]


class _Vocabulary:
    """The small CLIP-style vocabulary of a built bundle and a CLIP BPE over it."""

    def __init__(self) -> None:
        self.byte_table, symbols = _byte_symbols()
        tokens = symbols + [s + "</w>" for s in symbols] + [a + b for a, b in _MERGES]
        self.ids = {t: i for i, t in enumerate(tokens + [_BOS, _EOS])}
        self.bos, self.eos = self.ids[_BOS], self.ids[_EOS]
        self.pad = self.eos  # CLIP pads with its end token
        self.ranks = {pair: r for r, pair in enumerate(_MERGES)}

    def vocab_json(self) -> bytes:
        return (json.dumps(self.ids, ensure_ascii=False, indent=0) + "\n").encode()

    def merges_txt(self) -> bytes:
        return ("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in _MERGES)).encode()

    def encode(self, text: str, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) as int32 [length]: bos, the BPE tokens (cut at length - 1), eos, then pad."""
        text = " ".join(text.split()).lower()
        tokens = [t for piece in _PIECE.findall(text) for t in self.bpe(piece)]
        ids = [self.bos] + [self.ids.get(t, self.eos) for t in tokens][:length - 2] + [self.eos]
        out = np.full(length, self.pad, np.int32)
        out[:len(ids)] = ids
        return out, (np.arange(length) < len(ids)).astype(np.int32)

    def bpe(self, piece: str) -> list[str]:
        word = [self.byte_table[b] for b in piece.encode()]
        word[-1] += "</w>"
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:], strict=False)}
            best = min(pairs, key=lambda p: self.ranks.get(p, math.inf))
            if best not in self.ranks:
                break
            word = _merge(word, best)
        return word


def _merge(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def escape_prompt(text: str) -> str:
    """A prompt as a tok_test record holds it: Python's unicode_escape (\\t, \\xNN, \\uNNNN, \\\\; spaces stay)."""
    return text.encode("unicode_escape").decode("ascii")


# ---------------------------------------------------------------------------------------------
# Building


def build(out_dir: str | os.PathLike[str], geometry: Geometry | str = "tiny", *, variant: str = "host", seed: int = 0,
          target: str = "npu4", version: int = 2, progress: ProgressFn | None = None) -> Path:
    """Write a bundle for `geometry` into `out_dir` (created; it must not exist or be empty).

    Args:
        out_dir: the bundle directory.
        geometry: a `Geometry`, or the name of a preset ("tiny", "sam3").
        variant: "host" (host ViT), "device" (device-resident ViT, bf16 residual stream) or "device-f32" (its
            f32 residual stream, `vit_res_f32=1`, format 2 only).
        seed: seeds every weight and PDI; the same inputs write byte-identical bundles.
        target: "npu1", "npu4", "npu5" or "npu6": the instruction streams' device generation and the xclbins'
            partition.
        version: the manifest format, 2, or 1 for a host or bf16 device bundle.
        progress: called with a line of text as each stage starts.

    Returns the bundle directory.

    Raises:
        ValueError: an unknown preset, variant or target, a negative seed, a version the variant cannot have, a
            non-empty `out_dir`; `GeometryError` for a geometry that breaks a rule (checked before anything is
            written).
        OSError: `out_dir` cannot be written.
    """
    g = Geometry.named(geometry) if isinstance(geometry, str) else geometry
    _check_variant(variant)
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r} (expected one of {', '.join(TARGETS)})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if version not in (1, 2) or (version == 1 and variant == "device-f32"):
        raise ValueError(f"version {version!r}: a {variant} bundle is format 2"
                         + ("" if variant == "device-f32" else " or 1"))
    g = g.for_variant(variant)
    g.check(variant)
    root = Path(out_dir)
    with BundleWriter(root, version=version) as w:
        _Builder(w, g, variant, seed, target, progress or (lambda line: None)).write()
    return root


class _Weights:
    """Seeded float32 draws, one independent stream per tensor name."""

    def __init__(self, seed: int):
        self.seed = seed

    def normal(self, name: str, shape: tuple[int, ...], std: float = 1.0) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def matrix(self, name: str, out: int, inp: int) -> np.ndarray:
        """A linear layer's weight, torch layout [out, in], N(0, 1/in)."""
        return self.normal(name, (out, inp), 1.0 / math.sqrt(inp))

    def vector(self, name: str, n: int, center: float = 0.0) -> np.ndarray:
        """A bias (center 0) or a norm scale (center 1), perturbed."""
        return np.float32(center) + self.normal(name, (n,), _STD_PERTURB)


def rope_angles(g: Geometry, perm: np.ndarray, windowed: bool) -> np.ndarray:
    """RoPE angles [T, half] in window order: axial, the first ceil(half/2) columns rotate by the token's column,
    the rest by its row, at frequencies 10000^(-i/n) per axis. A windowed layer counts positions within the
    window, a global one on the whole grid. (The builder's choice: the pipeline only reads the tables.)"""
    y, x = np.divmod(perm.astype(np.float32), np.float32(g.grid))
    if windowed:
        y, x = y % g.window, x % g.window
    nx = g.rope_half - g.rope_half // 2
    fx = np.float32(10000.0) ** (-np.arange(nx, dtype=np.float32) / np.float32(nx))
    fy = np.float32(10000.0) ** (-np.arange(g.rope_half - nx, dtype=np.float32) / np.float32(max(g.rope_half - nx, 1)))
    return np.concatenate([x[:, None] * fx, y[:, None] * fy], axis=1).astype(np.float32)


def write_kernels(w: BundleWriter, g: Geometry, variant: str, seed: int = 0, target: str = "npu4") -> None:
    """Writes the placeholder kernel files and the xclbin, gemm, mha and op records of geometry `g` into `w`: what
    the exporter writes for a checkpoint when no compiled kernels are given (docs/sam3-build.md 2).

    Raises:
        ValueError: an unknown target or variant.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    _Builder(w, g, variant, seed, target, lambda line: None).kernels()


class _Builder:
    """Writes one bundle: manifest records, kernel files, tensors, vocabulary and reference image."""

    def __init__(self, w: BundleWriter, g: Geometry, variant: str, seed: int, target: str, progress: ProgressFn):
        self.w, self.g, self.variant, self.seed, self.target = w, g, variant, seed, target
        self.say = progress
        self.rand = _Weights(seed)
        self.device = variant != "host"
        self.vocab = _Vocabulary()

    def write(self) -> None:
        self.header()
        self.kernels()
        self.test_records()
        for stage in (self.vit, self.neck, self.detr_encoder, self.detr_decoder, self.scoring, self.mask_decoder,
                      self.text, self.test_tensors):
            stage()

    # -- manifest

    def header(self) -> None:
        g, w = self.g, self.w
        w.comment(f"SAM3 bundle written by sam3.build {BUILDER_VERSION}: geometry {g.name}, variant {self.variant}, "
                  f"seed {self.seed}, target {self.target}.")
        w.comment("Synthetic: seeded random weights and placeholder kernels, for the emulator only.")
        for name, value in g.params().items():
            w.param(name, value)
        w.param("bos", self.vocab.bos)
        w.param("eos", self.vocab.eos)
        w.param("pad", self.vocab.pad)
        if self.device:
            w.param("vit_device", True)
        if self.variant == "device-f32":
            w.param("vit_res_f32", True)

    def test_records(self) -> None:
        w = self.w
        w.record("ref_image", "cases/ref.png")
        w.record("ref_prompt", REF_PROMPT)
        for j, prompt in enumerate(TOK_TESTS):
            w.record("tok_test", j, escape_prompt(prompt))
        # A tag the runtime does not know, which it must ignore (docs/sam3-bundle.md 4).
        w.record("builder", "sam3.build", version=BUILDER_VERSION, geometry=self.g.name, variant=self.variant,
                 seed=self.seed, target=self.target)

    # -- kernels

    def kernels(self) -> None:
        """xclbins, instruction streams and the gemm, mha and op records."""
        self.say("kernels")
        g, w = self.g, self.w
        dev_gen = TXN_DEV_GEN[self.target]
        cores = _PARTITIONS[self.target][0] * _CORE_ROWS
        contexts = gemm_contexts(g)
        for ctx in sorted(set(contexts.values())):
            w.xclbin(ctx, self.placeholder_xclbin(ctx), KERNEL_NAME)
        streams: dict[str, tuple[bytes, object]] = {}
        for key in GEMM_KEYS:
            s, mode = g.gemms[key], gemm_mode(key)
            streams[key] = (kernels.gemm_stream(dev_gen, s, mode, cores, key=key), (s, mode))
        extents = kernel_extents(g, self.variant)
        for key in MHA_KEYS:
            m = g.mhas[key]
            streams[key] = (kernels.mha_stream(dev_gen, m.elems, extents.get(key), key=key), (key, m))
        for key in OP_KEYS if self.device else ():
            streams[key] = (kernels.op_stream(dev_gen, extents[key], key=key), (key, extents[key]))
        _check_streams_distinct(streams)
        for key, (data, _) in streams.items():
            w.file(f"kernels/{key}.insts.bin", data)
        for key in GEMM_KEYS:
            s = g.gemms[key]
            w.record("gemm", key, ctx=contexts[key], insts=f"kernels/{key}.insts.bin", M=s.m, K=s.k, N=s.n, lda=s.lda,
                     tile_k=s.tile_k, tile_n=s.tile_n, ct_k=s.ct_k, bias=int(s.bias), b_bytes=pack.packed_size(
                         s.k, s.n, s.ct_k, s.bias))
        for key in MHA_KEYS:
            m = g.mhas[key]
            w.record("mha", key, xclbin=self.placeholder_xclbin(key), insts=f"kernels/{key}.insts.bin",
                     name=KERNEL_NAME, heads=m.heads, seq=m.seq, d=m.d, token_major=int(m.token_major), elems=m.elems)
        for key in OP_KEYS if self.device else ():
            w.record("op", key, xclbin=self.placeholder_xclbin(key), insts=f"kernels/{key}.insts.bin", name=KERNEL_NAME)

    def placeholder_xclbin(self, key: str) -> str:
        """kernels/<key>.xclbin: the MLIR_AIE kernel's xclbin around a seeded PDI, partition as `_PARTITIONS`."""
        rng = np.random.default_rng([self.seed, zlib.crc32(b"pdi:" + key.encode())])
        width, starts = _PARTITIONS[self.target]
        image = xclbin.build_mlir_aie(rng.integers(0, 256, _PDI_BYTES, dtype=np.uint8).tobytes(),
                                      column_width=width, start_columns=starts, kernel=KERNEL_NAME)
        rel = f"kernels/{key}.xclbin"
        self.w.file(rel, xclbin.write(image))
        return rel

    # -- tensor helpers

    def f32(self, name: str, array: np.ndarray) -> np.ndarray:
        self.w.tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return array

    def linear(self, name: str, out: int, inp: int) -> tuple[np.ndarray, np.ndarray]:
        """`name.w` [out, in] and `name.b` [out], written in f32."""
        weight, bias = self.rand.matrix(name + ".w", out, inp), self.rand.vector(name + ".b", out)
        return self.f32(name + ".w", weight), self.f32(name + ".b", bias)

    def norm(self, name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        """A LayerNorm's (or GroupNorm's) affine `name.w`, `name.b`, written in f32."""
        scale, shift = self.rand.vector(name + ".w", n, 1.0), self.rand.vector(name + ".b", n)
        return self.f32(name + ".w", scale), self.f32(name + ".b", shift)

    def packed(self, name: str, key: str, b: np.ndarray, bias: np.ndarray | None = None) -> None:
        """`name`: B [K, N] packed for GEMM `key` as raw bytes, with `bias` [N] in it when `key` has bias=1 (zeros
        when None); a GEMM with bias=0 takes none (its bias, if any, is added on the host)."""
        s = self.g.gemms[key]
        if bias is not None and not s.bias:
            raise ValueError(f"{name}: gemm {key} has bias=0, a bias cannot go into its B")
        if s.bias and bias is None:
            bias = np.zeros(s.n, np.float32)
        data = pack.pack_b(np.ascontiguousarray(b, dtype=np.float32), bias, s.tile_k, s.tile_n, s.ct_k)
        if data.size != s.b_bytes:  # pack_b's own contract; a mismatch would load as a silently short buffer
            raise RuntimeError(f"{name}: pack_b wrote {data.size} bytes, gemm {key} has b_bytes {s.b_bytes}")
        self.w.raw_tensor(name, data)

    # -- stages (tensor names, shapes and the structure of each weight: docs/sam3-build.md 4)

    def vit(self) -> None:
        g, T, D, F = self.g, self.g.tokens, self.g.vit_dim, self.g.vit_ffn_pad  # noqa: N806
        self.say("ViT")
        perm = pack.window_perm(g.grid, g.window)  # window-order row j is raster patch perm[j]
        self.w.tensor("v.perm", perm)
        self.f32("v.pos", self.rand.normal("v.pos", (T, D), 0.1))  # window order, like every ViT row
        self.norm("v.ln_pre", D)
        taps = 3 * g.patch * g.patch
        embed = np.zeros((g.gemms["v_embed"].k, D), np.float32)  # rows past the patch's taps meet zero A columns
        embed[:taps] = self.rand.matrix("v.embed.w", D, taps).T
        self.packed("v.embed", "v_embed", embed)
        for kind, windowed in (("win", True), ("glob", False)):
            angles = rope_angles(g, perm, windowed)
            cos, sin = self.f32(f"v.rope.{kind}.cos", np.cos(angles)), self.f32(f"v.rope.{kind}.sin", np.sin(angles))
            if self.device:
                self.w.raw_tensor(f"v.rope_tab.{kind}", np.frombuffer(kernels.rope_table(cos, sin), np.uint8))
        for i in range(g.vit_layers):
            self.say(f"ViT layer {i + 1}/{g.vit_layers}")
            self.vit_layer(f"v.{i}", D, F)

    def vit_layer(self, p: str, D: int, F: int) -> None:  # noqa: N803
        ln1, ln2 = self.norm(f"{p}.ln1", D), self.norm(f"{p}.ln2", D)
        qkv = self.rand.matrix(f"{p}.qkv.w", 3 * D, D).T, self.rand.vector(f"{p}.qkv.b", 3 * D)
        fc1 = self.rand.matrix(f"{p}.fc1.w", F, D).T, self.rand.vector(f"{p}.fc1.b", F)
        if self.device:  # addln's LayerNorm has no affine: each goes into the GEMM after it (docs/sam3-pipeline.md 2.3)
            qkv, fc1 = _fold_affine(*qkv, *ln1), _fold_affine(*fc1, *ln2)
        self.packed(f"{p}.qkv", "v_qkv", *qkv)
        self.packed(f"{p}.o", "v_o", self.rand.matrix(f"{p}.o.w", D, D).T, self.rand.vector(f"{p}.o.b", D))
        self.packed(f"{p}.fc1", "v_fc1", *fc1)
        fc2_b = self.f32(f"{p}.fc2.b", self.rand.vector(f"{p}.fc2.b", D))  # the host path adds it
        # A device ViT has no host work between its GEMMs: the fc2 bias rides in v_fc2's B (Geometry.for_variant).
        self.packed(f"{p}.fc2", "v_fc2", self.rand.matrix(f"{p}.fc2.w", D, F).T, fc2_b if self.device else None)

    def neck(self) -> None:
        g, D, d = self.g, self.g.vit_dim, self.g.d_model  # noqa: N806
        self.say("neck")
        n_in = g.gemms["n_in"].n
        self.packed("n.in", "n_in", self.rand.matrix("n.in.w", n_in, D).T, self.rand.vector("n.in.b", n_in))
        up = g.gemms["n_up"]
        b, bias = np.zeros((up.k, up.n), np.float32), np.zeros(up.n, np.float32)  # columns past 4 d_model unread
        b[:, :4 * d], bias[:4 * d] = self.rand.matrix("n.up.w", 4 * d, up.k).T, self.rand.vector("n.up.b", 4 * d)
        self.packed("n.up", "n_up", b, bias)
        for name in ("n.conv0", "n.conv1", "n.conv2"):
            self.conv(name)

    def conv(self, name: str) -> None:
        """A 3x3 conv as the conv GEMM's banded B (the host adds `name.b` after readback)."""
        d = self.g.d_model
        weight = self.rand.normal(name + ".w", (d, d, 3, 3), 1.0 / math.sqrt(9 * d))
        self.packed(name, "conv", pack.conv_weights(weight, self.g.conv_p))
        self.f32(name + ".b", self.rand.vector(name + ".b", d))

    def detr_encoder(self) -> None:
        g, T, d = self.g, self.g.tokens, self.g.d_model  # noqa: N806
        self.say("DETR encoder")
        self.f32("d.pos", self.rand.normal("d.pos", (T, d), 0.5))
        hd, dp = d // g.d_heads, g.mhas["mha_d"].d
        cols = (np.arange(g.d_heads)[:, None] * dp + np.arange(hd)).ravel()  # head h's dims in its padded slot
        # mha_d scales by 1/sqrt(dp); q pre-scaled by sqrt(dp / hd) makes it the head's 1/sqrt(hd).
        q_scale = np.float32(math.sqrt(dp / hd))
        for i in range(g.d_layers):
            p = f"d.{i}"
            for ln in ("ln1", "ln2", "ln3"):
                self.norm(f"{p}.{ln}", d)
            b, bias = np.zeros((2 * d, 3 * g.pd), np.float32), np.zeros(3 * g.pd, np.float32)
            for j, (part, rows) in enumerate((("q", slice(0, d)), ("k", slice(0, d)), ("v", slice(d, 2 * d)))):
                scale = q_scale if part == "q" else np.float32(1)
                # A = [LN1(x) + pos | LN1(x)]: q and k read the first half, v the second.
                b[rows, j * g.pd + cols] = self.rand.matrix(f"{p}.sa.{part}.w", d, d).T * scale
                bias[j * g.pd + cols] = self.rand.vector(f"{p}.sa.{part}.b", d) * scale
            self.packed(f"{p}.qkv", "d_qkv", b, bias)
            o = np.zeros((g.pd, d), np.float32)
            o[cols] = self.rand.matrix(f"{p}.sa.o.w", d, d).T
            self.packed(f"{p}.o", "d_o", o, self.rand.vector(f"{p}.sa.o.b", d))
            hidden = g.gemms["d_fc1"].n
            self.packed(f"{p}.fc1", "d_fc1", self.rand.matrix(f"{p}.fc1.w", hidden, d).T,
                        self.rand.vector(f"{p}.fc1.b", hidden))
            self.packed(f"{p}.fc2", "d_fc2", self.rand.matrix(f"{p}.fc2.w", d, hidden).T)
            self.f32(f"{p}.fc2.b", self.rand.vector(f"{p}.fc2.b", d))
            for part in "qkvo":
                self.linear(f"{p}.ca.{part}", d, d)

    def detr_decoder(self) -> None:
        g, d, Q = self.g, self.g.d_model, self.g.queries  # noqa: N806
        self.say("DETR decoder")
        kv = g.gemms["dec_kv"]
        b, bias = np.zeros((kv.k, kv.n), np.float32), np.zeros(kv.n, np.float32)
        for layer in range(g.dec_layers):  # A = [enc + pos | enc]: layer l's K at l 2d.., its V at l 2d + d..
            c = layer * 2 * d
            b[:d, c:c + d] = self.rand.matrix(f"dec.{layer}.vca.k.w", d, d).T
            b[d:, c + d:c + 2 * d] = self.rand.matrix(f"dec.{layer}.vca.v.w", d, d).T
            bias[c:c + d] = self.rand.vector(f"dec.{layer}.vca.k.b", d)
            bias[c + d:c + 2 * d] = self.rand.vector(f"dec.{layer}.vca.v.b", d)
        self.packed("dec.kv", "dec_kv", b, bias)
        self.f32("dec.reference_points", self.rand.normal("dec.reference_points", (Q, 4)))
        self.f32("dec.presence_token", self.rand.normal("dec.presence_token", (d,)))
        self.f32("dec.query_embed", self.rand.normal("dec.query_embed", (Q, d)))
        self.mlp("dec.ref_point_head", (2 * d, d, d))
        self.mlp("dec.rpb_y", (2, d, g.d_heads))
        self.mlp("dec.rpb_x", (2, d, g.d_heads))
        for layer in range(g.dec_layers):
            p = f"dec.{layer}"
            for part in ("sa.q", "sa.k", "sa.v", "sa.o", "tca.q", "tca.k", "tca.v", "tca.o", "vca.q", "vca.o"):
                self.linear(f"{p}.{part}", d, d)
            for ln in ("sa_ln", "tca_ln", "vca_ln", "mlp_ln"):
                self.norm(f"{p}.{ln}", d)
            self.linear(f"{p}.fc1", g.d_ffn, d)
            self.linear(f"{p}.fc2", d, g.d_ffn)
        self.norm("dec.out_ln", d)
        self.mlp("dec.box_head", (d, d, d, 4))
        self.norm("dec.presence_ln", d)
        self.mlp("dec.presence_head", (d, d, d, 1))

    def mlp(self, name: str, widths: Sequence[int], first: int = 1) -> None:
        """`name.<j>` linear layers from widths[0] through widths[-1], j counted from `first`."""
        for j, (inp, out) in enumerate(zip(widths, widths[1:], strict=False)):
            self.linear(f"{name}.{j + first}", out, inp)

    def scoring(self) -> None:
        g, d = self.g, self.g.d_model
        self.say("scoring")
        self.mlp("score.text_mlp", (d, g.d_ffn, d))
        self.norm("score.text_ln", d)
        self.linear("score.text_proj", d, d)
        self.linear("score.query_proj", d, d)

    def mask_decoder(self) -> None:
        d = self.g.d_model
        self.say("mask decoder")
        for part in "qkvo":
            self.linear(f"m.ca.{part}", d, d)
        self.norm("m.ca_ln", d)
        for i in range(2):
            self.conv(f"m.conv{i}")
            self.norm(f"m.gn{i}", d)
        self.mlp("m.embed", (d, d, d, d), first=0)
        self.linear("m.inst", d, d)
        self.f32("m.sem.w", self.rand.normal("m.sem.w", (d,), 1.0 / math.sqrt(d)))
        self.f32("m.sem.b", self.rand.vector("m.sem.b", 1))

    def text(self) -> None:
        g, td = self.g, self.g.text_dim
        self.say("text encoder")
        self.bf16("t.tok_emb", self.rand.normal("t.tok_emb", (len(self.vocab.ids), td), 0.1))
        self.f32("t.pos_emb", self.rand.normal("t.pos_emb", (g.text_len, td), 0.1))
        for i in range(g.text_layers):
            if g.text_layers > 4:
                self.say(f"text layer {i + 1}/{g.text_layers}")
            p = f"t.{i}"
            self.norm(f"{p}.ln1", td)
            self.norm(f"{p}.ln2", td)
            for part, out, inp in (("qkv", 3 * td, td), ("o", td, td), ("fc1", g.text_ffn, td),
                                   ("fc2", td, g.text_ffn)):
                self.bf16(f"{p}.{part}.w", self.rand.matrix(f"{p}.{part}.w", out, inp))
                self.f32(f"{p}.{part}.b", self.rand.vector(f"{p}.{part}.b", out))
        self.norm("t.final_ln", td)
        self.linear("t.proj", g.d_model, td)

    def bf16(self, name: str, array: np.ndarray) -> None:
        self.w.tensor(name, array.astype(ml_dtypes.bfloat16))

    def test_tensors(self) -> None:
        """pack_test.*, tok.<j>.*, the reference image and prompt (docs/sam3-build.md 4.3)."""
        g = self.g
        self.say("test tensors")
        s = g.gemms["d_s"]
        b = self.rand.normal("pack_test.B", (s.k, s.n), 1.0 / math.sqrt(s.k))
        b[:8, :3] = _PACK_EDGE_BLOCKS.T  # blocks down k in the first columns: ties, a saturation, tiny negatives
        bias = self.f32("pack_test.bias", self.rand.vector("pack_test.bias", s.n))
        self.f32("pack_test.B", b)
        self.w.raw_tensor("pack_test.packed", pack.pack_b(b, bias, s.tile_k, s.tile_n, s.ct_k))
        for j, prompt in enumerate(TOK_TESTS):
            ids, mask = self.vocab.encode(prompt, g.text_len)
            self.w.tensor(f"tok.{j}.ids", ids)
            self.w.tensor(f"tok.{j}.mask", mask)
        ids, mask = self.vocab.encode(REF_PROMPT, g.text_len)
        self.w.tensor("ref.input_ids", ids)
        self.w.tensor("ref.attention_mask", mask)
        self.reference_image()
        self.w.file("vocab.json", self.vocab.vocab_json())
        self.w.file("merges.txt", self.vocab.merges_txt())

    def reference_image(self) -> None:
        """cases/ref.png (smooth seeded colours, about 4:3, not a multiple of the model's size) and ref.rgb, its
        decoded pixels. (ref.pixel_values is the preprocessing's output: a reference the pipeline computes.)"""
        side = self.g.image_size
        h, w = side * 5 // 4 + 1, side * 5 // 3 + 1
        yy, xx = np.meshgrid(np.linspace(0, 1, h, dtype=np.float32), np.linspace(0, 1, w, dtype=np.float32),
                             indexing="ij")
        phase = self.rand.normal("ref.rgb", (3, 3), 3.0)
        waves = np.sin(phase[:, 0, None, None] * yy + phase[:, 1, None, None] * xx + phase[:, 2, None, None])
        rgb = np.clip(np.rint(127.5 + 110 * waves), 0, 255).astype(np.uint8).transpose(1, 2, 0)
        self.w.tensor("ref.rgb", np.ascontiguousarray(rgb))
        self.w.file("cases/ref.png", _png(rgb))


# The unit block of docs/sam3-packing.md, [64, 14.9375, 106.5, 94.5, 0, -1.5, -2.5, 3] (ties to even), a block
# whose largest value rounds up to 128 and saturates, and one where values 2^-40 below the largest shift out: -0.0
# and a tiny negative become -1 (docs/sam3-packing.md 2.4).
_PACK_EDGE_BLOCKS = np.array([[64, 14.9375, 106.5, 94.5, 0, -1.5, -2.5, 3],
                              [127.75, 1, -1, 0.5, -0.5, 2, -2, 64],
                              [1.0, -0.0, -1e-13, 1e-13, 0.25, -0.25, 0.125, -0.125]], np.float32)


def _fold_affine(b: np.ndarray, bias: np.ndarray, scale: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray,
                                                                                                 np.ndarray]:
    """B and bias of `(LN0(x) * scale + shift) @ B + bias` as one GEMM on LN0(x): (diag(scale) B, shift B + bias)."""
    return (b * scale[:, None]).astype(np.float32), (shift @ b + bias).astype(np.float32)


def _png(rgb: np.ndarray) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(out, format="PNG")
    return out.getvalue()


def gemm_contexts(g: Geometry) -> dict[str, str]:
    """GEMM key -> ctx (xclbin key). GEMMs share a compiled design, so a hardware context, when they agree on what
    the design fixes: M, the tiling and the bias flag; K and N are the instruction stream's."""
    return {key: "gemm_m{}_k{}_n{}_ct{}{}".format(*s.tiles[:4], "_bias" if s.bias else "")
            for key, s in g.gemms.items()}


def gemm_mode(key: str) -> int:
    """The epilogue mode GEMM `key`'s stream carries: tanh GELU for v_fc1, ReLU for d_fc1 (the DETR encoder's
    ReLU MLP, fc2 reading fc1's output in place), none for the rest (docs/sam3-kernels.md 3.2)."""
    return {"v_fc1": kernels.EPILOGUE_GELU_TANH, "d_fc1": kernels.EPILOGUE_RELU}.get(key, kernels.EPILOGUE_NONE)


def kernel_extents(g: Geometry, variant: str) -> dict[str, list[int]]:
    """Bytes of each buffer argument of the kernels a device ViT launches over buffers the runtime already holds
    (docs/sam3-pipeline.md 2.3, docs/sam3-kernels.md 4.3 and 5; none for a host ViT, whose MHAs read `elems` each).

    rope: [v_qkv C (rows x 3D bf16), the table, q|k out (T x 2D bf16)]; addln: [residual in, a GEMM's C (rows x D
    bf16), residual out, LN out (the next GEMM's A, rows x D bf16)], residuals T x D in f32 or bf16; mha_win and
    mha_glob: [q|k out, q|k out, v_qkv C, v_o A (rows x D bf16)]. rows is T rounded up to the layer GEMMs' M.
    """
    if variant == "host":
        return {}
    T, D = g.tokens, g.vit_dim  # noqa: N806
    rows = pack.round_up(T, g.gemms["v_qkv"].m)
    table = 2 * T * g.rope_half * 4  # kernels.rope_table: f32 cos, then sin, [T, half] each
    res = T * D * (4 if variant == "device-f32" else 2)
    rope_out, qkv_c, d_c = T * 2 * D * 2, rows * 3 * D * 2, rows * D * 2
    mha = [rope_out, rope_out, qkv_c, d_c]
    return {"rope": [qkv_c, table, rope_out], "addln": [res, d_c, res, d_c], "mha_win": mha, "mha_glob": mha}


def _check_streams_distinct(streams: Mapping[str, tuple[bytes, object]]) -> None:
    """The emulator knows a kernel by its stream's bytes: two keys may share them only to compute the same thing."""
    first: dict[bytes, str] = {}
    for key, (data, what) in streams.items():
        other = first.setdefault(data, key)
        if other != key and streams[other][1] != what:
            raise RuntimeError(f"sam3.kernels wrote the same instruction stream for {other} ({streams[other][1]}) "
                               f"and {key} ({what}), which compute different things")


# ---------------------------------------------------------------------------------------------
# Cache and command line

KEY_FILE = "build.key"


def build_key(geometry: Geometry, variant: str, seed: int, target: str, version: int = 2) -> str:
    """sha256 of everything a build's bytes depend on: the inputs, BUILDER_VERSION and the source of the modules
    that write them (this one, sam3.pack, sam3.kernels, sam3.bundle, amdxdna_direct.xclbin).

    Raises:
        RuntimeError: one of those modules was loaded without a source file (nothing to hash).
    """
    modules = (sys.modules[__name__], pack, kernels, sys.modules[BundleWriter.__module__], xclbin)
    inputs = json.dumps({"geometry": geometry.to_json(), "variant": variant, "seed": seed, "target": target,
                         "version": version, "builder": BUILDER_VERSION}, sort_keys=True).encode()
    h = hashlib.sha256(inputs)
    for module in modules:
        if module.__file__ is None:
            raise RuntimeError(f"build key: module {module.__name__} has no source file, so its code cannot be hashed")
        h.update(hashlib.sha256(Path(module.__file__).read_bytes()).digest())
    return h.hexdigest()


def build_cached(cache_dir: str | os.PathLike[str], geometry_name: str = "tiny", variant: str = "host",
                 seed: int = 0, *, target: str = "npu4", version: int = 2, progress: ProgressFn | None = None) -> Path:
    """The bundle for these inputs under `cache_dir`, reused when its key file matches `build_key`, else (re)built.

    A build goes to a temporary directory beside the final one and is renamed into place once complete, with its
    key file written last; a stale bundle is moved aside first. So a half-written or stale cache entry is never
    reused, and concurrent callers each end with a complete bundle.

    Raises:
        ValueError, GeometryError: as `build`.
        OSError: the cache cannot be created or written.
    """
    g = Geometry.named(geometry_name)
    key = build_key(g, variant, seed, target, version)
    final = Path(cache_dir) / f"{geometry_name}-{variant}-{target}-v{version}-seed{seed}"
    if _key_matches(final, key):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(staging / "bundle", g, variant=variant, seed=seed, target=target, version=version, progress=progress)
        (staging / "bundle" / KEY_FILE).write_text(key + "\n")
        if _key_matches(final, key):  # a concurrent caller finished first: keep its bundle
            return final
        if final.exists():  # stale (another key) or incomplete: out of the way, removed below
            os.replace(final, staging / "stale")
        try:
            os.replace(staging / "bundle", final)
        except OSError:
            if not _key_matches(final, key):  # not a concurrent builder that won the rename with the same bundle
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _key_matches(root: Path, key: str) -> bool:
    try:
        return (root / KEY_FILE).read_text().strip() == key
    except OSError:
        return False


def main(argv: Sequence[str] | None = None, prog: str = "build_bundle") -> int:
    """`build_bundle OUT [--preset tiny|sam3] [--variant host|device|device-f32] [--seed N] [--target npu1|npu4|
    npu5|npu6] [--format 1|2]`: write a bundle, print its directory. Progress lines go to stderr.

    Returns 0 on success (and for --help), 1 when the build fails (the message on stderr), 2 on bad usage (argparse's
    message on stderr).
    """
    p = argparse.ArgumentParser(prog=prog, description="Write a synthetic SAM3 bundle (seeded weights, placeholder "
                                "kernels for the emulator).")
    p.add_argument("out", help="bundle directory to create (must not exist or be empty)")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--variant", choices=VARIANTS, default="host")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", choices=TARGETS, default="npu4")
    p.add_argument("--format", type=int, choices=(1, 2), default=2, dest="version", help="manifest version")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # usage error (2) or --help (0): a status to return, as for a failed build
        return e.code if isinstance(e.code, int) else 2
    start = time.monotonic()

    def progress(line: str) -> None:
        print(f"{prog}: [{time.monotonic() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    try:
        root = build(args.out, args.preset, variant=args.variant, seed=args.seed, target=args.target,
                     version=args.version, progress=progress)
    except (ValueError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    progress("done")
    print(root)
    return 0
