"""The text-encoder and tokenizer part of the bundle exporter (docs/sam3-host.md 6).

Reads a transformers SAM3 checkpoint directory (``config.json``, ``model.safetensors``,
``tokenizer_config.json``, ``vocab.json``) without torch: tensors stream one at a time through
``safetensors.safe_open(..., framework="numpy")``. ``text_tensors`` yields the bundle's text tensors
under their bundle names and layouts; ``text_params`` gives the matching params.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from amdxdna_direct.errors import Error
from sam3 import userfiles
from sam3.hostmath import f32, to_bf16

# docs/sam3-host.md 6.1: where the CLIP text encoder lives in the checkpoint. The top-level
# ``text_projection`` (hidden -> DETR width, applied to every token) is t.proj; the CLIP model's own
# ``text_encoder.text_projection`` (for pooled CLIP embeddings) is not used by SAM3.
_CLIP = "text_encoder.text_model."
_LAYER = _CLIP + "encoder.layers.{i}."
_PROJ = "text_projection."
WEIGHTS_FILE = "model.safetensors"


class ExportError(Error, ValueError):
    """A checkpoint that is not SAM3, or a missing or mis-shaped tensor or config key (named in the message)."""


def _json(path: Path) -> dict[str, Any]:
    try:
        data = userfiles.read_json(path)
    except (OSError, ValueError) as exc:  # userfiles.ReadError: not a regular file, too large, not JSON
        raise ExportError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _key(cfg: dict[str, Any], path: Path, *keys: str) -> Any:
    node: Any = cfg
    for depth, key in enumerate(keys):
        if not isinstance(node, dict) or key not in node:
            raise ExportError(f"{path}: key {'.'.join(keys[:depth + 1])} missing")
        node = node[key]
    return node


def _int(cfg: dict[str, Any], path: Path, *keys: str) -> int:
    value = _key(cfg, path, *keys)
    if type(value) is not int or value <= 0:
        raise ExportError(f"{path}: {'.'.join(keys)} = {value!r}, expected a positive integer")
    return value


def _eps(cfg: dict[str, Any], path: Path, *keys: str) -> float:
    value = _key(cfg, path, *keys)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ExportError(f"{path}: {'.'.join(keys)} = {value!r}, expected a small positive number")
    return float(value)


def sam3_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a SAM3 checkpoint.

    Raises:
        ExportError: the file is missing or unreadable, or its ``model_type`` is not ``sam3``.
    """
    path = Path(checkpoint_dir) / "config.json"
    cfg = _json(path)
    if cfg.get("model_type") != "sam3":
        raise ExportError(f"{path}: model_type {cfg.get('model_type')!r} is not 'sam3': not a SAM3 checkpoint")
    return cfg


def text_params(checkpoint_dir: str | Path) -> dict[str, int | float]:
    """The text params of the bundle: text_len, text_dim, text_heads, text_layers, text_ffn, text_eps, bos, eos, pad.

    Sizes come from ``config.json`` ``text_config``; the special ids from ``tokenizer_config.json``'s token
    strings looked up in ``vocab.json`` (docs/sam3-host.md 6.2).

    Raises:
        ExportError: not a SAM3 checkpoint, a missing or bad key, an activation other than the exact GELU,
            text_dim not divisible by text_heads, a special token missing from the vocabulary, or config ids
            that disagree with the tokenizer's.
    """
    root = Path(checkpoint_dir)
    cfg_path = root / "config.json"
    cfg = sam3_config(root)
    tc = ("text_config",)
    act = _key(cfg, cfg_path, *tc, "hidden_act")
    if act != "gelu":
        raise ExportError(f"{cfg_path}: text_config.hidden_act {act!r}: the text encoder implements 'gelu' (erf) only")
    params: dict[str, int | float] = {
        "text_len": _int(cfg, cfg_path, *tc, "max_position_embeddings"),
        "text_dim": _int(cfg, cfg_path, *tc, "hidden_size"),
        "text_heads": _int(cfg, cfg_path, *tc, "num_attention_heads"),
        "text_layers": _int(cfg, cfg_path, *tc, "num_hidden_layers"),
        "text_ffn": _int(cfg, cfg_path, *tc, "intermediate_size"),
        "text_eps": _eps(cfg, cfg_path, *tc, "layer_norm_eps"),
    }
    if params["text_dim"] % params["text_heads"]:
        raise ExportError(f"{cfg_path}: text_config.hidden_size {params['text_dim']} is not divisible by "
                          f"num_attention_heads {params['text_heads']}")
    params.update(_special_ids(root, cfg, cfg_path))
    return params


def _special_ids(root: Path, cfg: dict[str, Any], cfg_path: Path) -> dict[str, int]:
    tok_path, vocab_path = root / "tokenizer_config.json", root / "vocab.json"
    tok_cfg, vocab = _json(tok_path), _json(vocab_path)
    ids = {}
    for name in ("bos", "eos", "pad"):
        token = _key(tok_cfg, tok_path, f"{name}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token not in vocab:
            raise ExportError(f"{tok_path}: {name}_token {token!r} is not in {vocab_path}")
        ids[name] = vocab[token]
    for name in ("bos", "eos"):  # the model config's pad_token_id is not the tokenizer's pad: not compared
        configured = cfg["text_config"].get(f"{name}_token_id")
        if configured is not None and configured != ids[name]:
            raise ExportError(f"{cfg_path}: text_config.{name}_token_id {configured} disagrees with the "
                              f"tokenizer's {name} id {ids[name]} ({tok_path})")
    return ids


def text_tensors(checkpoint_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (bundle name, array) for every text-encoder tensor of docs/sam3-host.md 5.1, one at a time.

    Matrices are ``[out, in]``; ``t.tok_emb`` and the four linear weights per layer are ml_dtypes bfloat16
    (rounded to nearest even), everything else float32. ``t.<i>.qkv`` stacks q, k, v along ``out``. Every
    checkpoint tensor's presence and shape is checked before the first one is read.

    Raises:
        ExportError: (at the first ``next``: this is a generator) not a SAM3 checkpoint, bad config (as
            ``text_params``), the weights file missing, or a tensor missing or of the wrong shape (its name,
            the shape found and the shape wanted).
    """
    root = Path(checkpoint_dir)
    plan = text_plan(root)
    path = root / WEIGHTS_FILE
    if not path.is_file():
        raise ExportError(f"{path}: no such file (the checkpoint's weights)")
    try:
        handle = safe_open(str(path), framework="numpy")
    except SafetensorError as e:
        raise ExportError(f"{path}: not a safetensors file: {e}") from e
    with handle as st:
        names = set(st.keys())
        for entry in plan:
            for source in entry.sources:
                if source not in names:
                    raise ExportError(f"{path}: tensor {source} missing")
                found = tuple(st.get_slice(source).get_shape())
                if found != entry.shape:
                    raise ExportError(f"{path}: tensor {source} has shape {list(found)}, expected {list(entry.shape)}")
        for entry in plan:
            parts = [np.ascontiguousarray(f32(st.get_tensor(source))) for source in entry.sources]
            value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            yield entry.name, (_bf16(value) if entry.bf16 else value)


@dataclass(frozen=True)
class PlanEntry:
    """One bundle tensor: its checkpoint sources (stacked along axis 0), each source's shape, and its dtype."""

    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    bf16: bool


def text_plan(checkpoint_dir: str | Path) -> list[PlanEntry]:
    """The mapping of docs/sam3-host.md 6.1 for this checkpoint's sizes, in bundle order (nothing read but JSON).

    Raises:
        ExportError: as ``text_params``, or ``text_config.vocab_size`` / ``detr_encoder_config.hidden_size``
            missing or not a positive integer.
    """
    root = Path(checkpoint_dir)
    p = text_params(root)
    cfg = sam3_config(root)
    dim, ffn = int(p["text_dim"]), int(p["text_ffn"])
    vocab = _int(cfg, root / "config.json", "text_config", "vocab_size")
    d_model = _int(cfg, root / "config.json", "detr_encoder_config", "hidden_size")

    def one(name: str, source: str, shape: tuple[int, ...], bf16: bool = False) -> PlanEntry:
        return PlanEntry(name, (source,), shape, bf16)

    def norm(name: str, source: str) -> list[PlanEntry]:
        return [one(f"{name}.w", source + "weight", (dim,)), one(f"{name}.b", source + "bias", (dim,))]

    plan = [one("t.tok_emb", _CLIP + "embeddings.token_embedding.weight", (vocab, dim), bf16=True),
            one("t.pos_emb", _CLIP + "embeddings.position_embedding.weight", (int(p["text_len"]), dim))]
    for i in range(int(p["text_layers"])):
        pre, key = _LAYER.format(i=i), f"t.{i}"
        attn = pre + "self_attn."
        plan += norm(f"{key}.ln1", pre + "layer_norm1.") + norm(f"{key}.ln2", pre + "layer_norm2.")
        plan.append(PlanEntry(f"{key}.qkv.w", tuple(f"{attn}{x}_proj.weight" for x in "qkv"), (dim, dim), True))
        plan.append(PlanEntry(f"{key}.qkv.b", tuple(f"{attn}{x}_proj.bias" for x in "qkv"), (dim,), False))
        for name, source, shape in (("o", attn + "out_proj.", (dim, dim)), ("fc1", pre + "mlp.fc1.", (ffn, dim)),
                                    ("fc2", pre + "mlp.fc2.", (dim, ffn))):
            plan += [one(f"{key}.{name}.w", source + "weight", shape, bf16=True),
                     one(f"{key}.{name}.b", source + "bias", shape[:1])]
    plan += norm("t.final_ln", _CLIP + "final_layer_norm.")
    plan += [one("t.proj.w", _PROJ + "weight", (d_model, dim)), one("t.proj.b", _PROJ + "bias", (d_model,))]
    return plan


def _bf16(x: np.ndarray) -> np.ndarray:
    return to_bf16(x).view(ml_dtypes.bfloat16)
