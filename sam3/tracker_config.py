"""The tracker's sizes and weights as a transformers SAM3 checkpoint holds them (docs/sam3-tracker.md 1).

Sizes come from config.json's `tracker_config` (present both in a `sam3` config with the tracker added and in a
`sam3_video` one, as facebook/sam3 ships), weights by their checkpoint names (`tracker_model.*`,
`tracker_neck.*`) from a dict of arrays read out of the checkpoint's safetensors files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file

from amdxdna_direct.errors import Error
from sam3 import userfiles

F32Array = npt.NDArray[np.float32]
MODEL = "tracker_model."
NECK = "tracker_neck."


class TrackerError(Error, ValueError):
    """A tracker checkpoint, config or prompt that cannot be used: says which name or value, and what was expected."""


@dataclass(frozen=True)
class TrackerConfig:
    """The sizes the tracker stages read (names as in transformers' `Sam3TrackerConfig`)."""

    width: int                      # prompt encoder and mask decoder width
    image_size: int                 # the square model frame the prompts are given in
    patch: int
    heads: int
    layers: int                     # two-way transformer blocks
    downsample: int                 # cross-attention width = width // downsample
    multimask_outputs: int          # candidates 1..multimask_outputs; token 0 is the single-mask one
    stability_delta: float
    stability_thresh: float
    dynamic_stability: bool
    scale_factors: tuple[float, ...]    # the tracker neck's levels
    levels: int                     # neck levels the mask decoder reads (len(backbone_feature_sizes))
    backbone_width: int
    fpn_width: int
    layer_norm_eps: float           # the upscaling LayerNorm's (the two-way transformer's are 1e-5)

    @property
    def grid(self) -> int:
        """Side of the image embedding (tokens per row)."""
        return self.image_size // self.patch

    @property
    def mask_side(self) -> int:
        """Side of the low-resolution masks: two 2x transposed convolutions above the grid."""
        return 4 * self.grid

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrackerConfig:
        """From a parsed config.json: its `tracker_config`, or the config itself when it is a `sam3_tracker` one.

        Raises:
            TrackerError: there is no tracker config, or a size is missing or not of the expected type.
        """
        tc = config.get("tracker_config") if config.get("model_type") != "sam3_tracker" else config
        if not isinstance(tc, Mapping):
            raise TrackerError("config.json has no tracker_config: the checkpoint has no tracker")
        pe, md, vis = (_section(tc, k) for k in ("prompt_encoder_config", "mask_decoder_config", "vision_config"))
        backbone = _section(vis, "backbone_config")
        if _int(pe, "hidden_size") != _int(md, "hidden_size"):
            raise TrackerError(f"tracker_config: prompt encoder width {pe['hidden_size']} differs from the mask "
                               f"decoder's {md['hidden_size']}")
        return cls(
            width=_int(md, "hidden_size"), image_size=_int(pe, "image_size"), patch=_int(pe, "patch_size"),
            heads=_int(md, "num_attention_heads"), layers=_int(md, "num_hidden_layers"),
            downsample=_int(md, "attention_downsample_rate"), multimask_outputs=_int(md, "num_multimask_outputs"),
            stability_delta=_num(md, "dynamic_multimask_stability_delta"),
            stability_thresh=_num(md, "dynamic_multimask_stability_thresh"),
            dynamic_stability=bool(md.get("dynamic_multimask_via_stability", True)),
            scale_factors=tuple(float(s) for s in _list(vis, "scale_factors")),
            levels=len(_list(vis, "backbone_feature_sizes")),
            backbone_width=_int(backbone, "hidden_size"), fpn_width=_int(vis, "fpn_hidden_size"),
            layer_norm_eps=_num(pe, "layer_norm_eps"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> TrackerConfig:
        """From `model_dir/config.json`.

        Raises:
            TrackerError: as `from_config`, or config.json is unreadable.
        """
        return cls.from_config(read_config(model_dir))


def _section(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = d.get(key)
    if not isinstance(v, Mapping):
        raise TrackerError(f"tracker_config: {key} missing or not an object")
    return v


def _int(d: Mapping[str, Any], key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise TrackerError(f"tracker_config: {key} must be a positive integer, got {v!r}")
    return v


def _num(d: Mapping[str, Any], key: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TrackerError(f"tracker_config: {key} must be a number, got {v!r}")
    return float(v)


def _list(d: Mapping[str, Any], key: str) -> list[Any]:
    v = d.get(key)
    if not isinstance(v, list) or not v:
        raise TrackerError(f"tracker_config: {key} must be a non-empty list, got {v!r}")
    return v


def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`model_dir/config.json`, parsed.

    Raises:
        TrackerError: the file is missing or not a JSON object.
    """
    path = Path(model_dir) / "config.json"
    try:
        data = userfiles.read_json(path)
    except (OSError, ValueError) as e:
        raise TrackerError(f"{path}: cannot read the checkpoint's config ({e})") from e
    if not isinstance(data, dict):
        raise TrackerError(f"{path}: not a JSON object")
    return data


def read_weights(*model_dirs: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of every `*.safetensors` file in the directories, in order (a later file's name wins).

    A sharded checkpoint's files are all read; several directories let one checkpoint be split in two.

    Raises:
        TrackerError: a directory holds no safetensors file.
    """
    out: dict[str, np.ndarray] = {}
    for d in model_dirs:
        files = sorted(Path(d).glob("*.safetensors"))
        if not files:
            raise TrackerError(f"{d}: no *.safetensors file")
        for f in files:
            out.update(load_file(f))
    return out


def tensor(weights: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...] | None = None) -> F32Array:
    """`weights[name]` as float32, its shape checked when `shape` is given (-1: any length on that axis).

    Raises:
        TrackerError: the tensor is missing, or its shape differs.
    """
    if name not in weights:
        raise TrackerError(f"checkpoint tensor {name} missing (a tracker checkpoint names it so)")
    arr = np.asarray(weights[name], dtype=np.float32)
    if shape is not None and (arr.ndim != len(shape) or any(s not in (-1, a) for a, s in zip(arr.shape, shape,
                                                                                              strict=True))):
        raise TrackerError(f"checkpoint tensor {name}: shape {list(arr.shape)}, expected {list(shape)}")
    return arr


def has_tracker(weights: Mapping[str, np.ndarray]) -> bool:
    """Whether the checkpoint's tensors include the tracker's."""
    return any(k.startswith(MODEL) for k in weights) and any(k.startswith(NECK) for k in weights)
