"""Exporting a full-size SAM3 checkpoint (docs/sam3-export.md): time and peak memory.

Run: ``python bench/bench_export.py [--vit device|host] [--residual f32|bf16] [--dir DIR] [--keep]``

Writes a random-weight checkpoint in transformers' format at facebook/sam3's sizes (1008 px, ViT 1024 x 32, text
1024 x 24, DETR 256 x 6 / 6, 200 queries; float32 safetensors of about 3.4 GB, streamed to disk tensor by tensor
with numpy, plus config.json and a CLIP-shaped vocabulary) into a temporary directory, exports it in a child
process, and prints the export's wall time and peak RSS (``resource.getrusage(RUSAGE_CHILDREN)``) next to the
checkpoint's size: the exporter streams, so its peak should stay a small fraction of the checkpoint. The counts
(tensors, bytes in and out) are deterministic. Everything written is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sam3 import export  # noqa: E402

SEED = 0
VOCAB = 49408
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def sam3_config() -> dict:
    """config.json of a SAM3 checkpoint at facebook/sam3's sizes (the keys the exporter reads)."""
    return {
        "model_type": "sam3",
        "vision_config": {
            "backbone_config": {
                "image_size": 1008, "patch_size": 14, "window_size": 24, "hidden_size": 1024, "num_attention_heads": 16,
                "num_hidden_layers": 32, "intermediate_size": 4736, "global_attn_indexes": [7, 15, 23, 31],
                "layer_norm_eps": 1e-6, "hidden_act": "gelu", "num_channels": 3, "pretrain_image_size": 336,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}},
            "fpn_hidden_size": 256, "scale_factors": [4.0, 2.0, 1.0, 0.5],
            "backbone_feature_sizes": [[288, 288], [144, 144], [72, 72]]},
        "text_config": {"hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 24,
                        "intermediate_size": 4096, "max_position_embeddings": 32, "vocab_size": VOCAB,
                        "layer_norm_eps": 1e-5, "hidden_act": "gelu", "bos_token_id": VOCAB - 2,
                        "eos_token_id": VOCAB - 1},
        "detr_encoder_config": {"hidden_size": 256, "num_layers": 6, "num_attention_heads": 8,
                                "intermediate_size": 2048, "hidden_act": "relu"},
        "detr_decoder_config": {"hidden_size": 256, "num_layers": 6, "num_queries": 200, "num_attention_heads": 8,
                                "intermediate_size": 2048, "hidden_act": "relu"},
        "mask_decoder_config": {"hidden_size": 256, "num_attention_heads": 8, "num_upsampling_stages": 3},
    }


def text_tensors(cfg: dict, d_model: int) -> dict[str, tuple[int, ...]]:
    """The CLIP text model's tensors (transformers' names) and the projection to the DETR width."""
    t = cfg["text_config"]
    dim, ffn = t["hidden_size"], t["intermediate_size"]
    pre = "text_encoder.text_model."
    out: dict[str, tuple[int, ...]] = {pre + "embeddings.token_embedding.weight": (t["vocab_size"], dim),
                                       pre + "embeddings.position_embedding.weight": (t["max_position_embeddings"],
                                                                                      dim)}
    for i in range(t["num_hidden_layers"]):
        lay = f"{pre}encoder.layers.{i}."
        for name, shape in (("layer_norm1", (dim,)), ("layer_norm2", (dim,))):
            out |= {lay + name + ".weight": shape, lay + name + ".bias": shape}
        for name, o, inp in (("self_attn.q_proj", dim, dim), ("self_attn.k_proj", dim, dim),
                             ("self_attn.v_proj", dim, dim), ("self_attn.out_proj", dim, dim),
                             ("mlp.fc1", ffn, dim), ("mlp.fc2", dim, ffn)):
            out |= {lay + name + ".weight": (o, inp), lay + name + ".bias": (o,)}
    out |= {pre + "final_layer_norm.weight": (dim,), pre + "final_layer_norm.bias": (dim,),
            "text_projection.weight": (d_model, dim), "text_projection.bias": (d_model,)}
    return out


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> int:
    """A float32 safetensors file of random tensors, streamed: the header (u64 length, JSON with each tensor's
    dtype, shape and data offsets), then the tensors in header order. Matrices N(0, 1/fan_in), vectors (biases,
    norm affines) N(0, 0.1^2) plus 1 for norm weights. Returns the file size."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in shapes.items():
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
            a = rng.standard_normal(shape, dtype=np.float32)
            if fan_in:
                a *= np.float32(fan_in ** -0.5)
            else:
                a *= np.float32(0.1)
                if name.endswith(".weight"):
                    a += np.float32(1)
            a.astype("<f4").tofile(f)
    return path.stat().st_size


def write_checkpoint(root: Path, seed: int = SEED) -> tuple[int, int]:
    """config.json, model.safetensors, vocab.json, merges.txt, tokenizer_config.json in `root`; returns (tensors,
    bytes of model.safetensors)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = sam3_config()
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    vocab = {f"t{i}</w>": i for i in range(VOCAB - 2)} | {BOS: VOCAB - 2, EOS: VOCAB - 1}
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\nt 0</w>\n")
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}))
    # the image-side names and shapes are the exporter's own list, from the config just written
    shapes = export.image_tensors(export.read_model(root))
    shapes |= text_tensors(cfg, cfg["detr_encoder_config"]["hidden_size"])
    return len(shapes), write_safetensors(root / "model.safetensors", shapes, seed)


POLL_S = 0.02


def _watch(child: subprocess.Popen) -> dict[str, int]:
    """Wait for `child`, sampling its anonymous and file-backed resident memory (/proc/<pid>/status); the maxima in
    bytes. (safetensors maps the checkpoint: pages it touched count in the resident set while the file is open.)"""
    peak = {"RssAnon": 0, "RssFile": 0}
    status = Path(f"/proc/{child.pid}/status")
    while child.poll() is None:
        try:
            for line in status.read_text().splitlines():
                key, _, value = line.partition(":")
                if key in peak:
                    peak[key] = max(peak[key], int(value.split()[0]) * 1024)
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(POLL_S)
    return peak


def _bundle_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vit", choices=export.VIT_MODES, default="device")
    p.add_argument("--residual", choices=export.RESIDUALS, default="f32")
    p.add_argument("--dir", help="work directory (default: a new temporary directory, deleted at the end)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and the bundle")
    args = p.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sam3-bench-export-"))
    try:
        t0 = time.perf_counter()
        count, size = write_checkpoint(work / "hf")
        gen = time.perf_counter() - t0
        print(f"checkpoint: {count} tensors, {size / 1e9:.2f} GB float32 ({gen:.1f} s to generate)")
        code = "import sys; from sam3.export import main; sys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, "--model", str(work / "hf"), "--out", str(work / "bundle"), "--vit",
               args.vit, "--residual", args.residual]
        t0 = time.perf_counter()
        with tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)
            parts = _watch(child)
            wall = time.perf_counter() - t0
            err.seek(0)
            log = err.read()
        if child.returncode:
            print(log, file=sys.stderr)
            print(f"export failed with exit code {child.returncode}", file=sys.stderr)
            return 1
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
        out = _bundle_bytes(work / "bundle")
        tensors = (work / "bundle" / "tensors.txt").read_text().count("\n")
        largest = VOCAB * sam3_config()["text_config"]["hidden_size"] * 4
        print(f"bundle ({args.vit} ViT, {args.residual} residual): {tensors} tensors, {out / 1e9:.2f} GB")
        print(f"export: {wall:.1f} s wall, {size / wall / 1e6:.0f} MB/s of checkpoint")
        print(f"peak RSS: {rss / 1e9:.2f} GB = {rss / size:.2f} x the checkpoint, {rss / largest:.1f} x its largest "
              f"tensor (the token embedding, {largest / 1e6:.0f} MB)")
        print(f"  sampled every {POLL_S * 1000:.0f} ms: anonymous at most {parts['RssAnon'] / 1e9:.2f} GB, mapped "
              f"checkpoint pages at most {parts['RssFile'] / 1e9:.2f} GB")
        print(log.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
