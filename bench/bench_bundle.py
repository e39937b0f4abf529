"""Opening a full-size SAM3 bundle: time and memory of `Bundle.open`, against reading tensors.bin into memory.

Run (from the repository root, the package importable): ``python bench/bench_bundle.py [--size-gb 1.5]
[--rounds 2] [--dir /tmp]``

Writes (with `BundleWriter`, into a temporary directory that is removed afterwards) a bundle with the tensor
names and sizes of a full-size SAM3 bundle: image 1008, grid 72 (5184 tokens), a 1024-wide ViT of 32 layers
with a 4736-wide MLP, a 1024-wide text encoder of 24 layers, d_model 256, 6 DETR encoder and decoder layers,
200 queries, packed NPU weights (9 bytes per 8 values), bf16 text weights, f32 host weights and the
reference tensors; about 1.5 GB. The bytes are zeros: only sizes matter here. With ``--size-gb`` every
tensor's size is scaled to reach that total (shapes then become one-dimensional).

Measured side by side in one run:
1. `Bundle.open` (manifest, index, vocab, merges parsed; tensors.bin mapped), then a view of every tensor;
2. the same bundle's tensors.bin read into one heap buffer (what a reader without mmap would pay).

Goals: `Bundle.open` well under a second, and no heap for tensors: the RSS growth and the traced heap peak
of step 1 stay far below the bundle's size (views share the mapping; pages are read only when touched).
Counts printed are deterministic: tensors and bytes by dtype, manifest records, vocabulary size.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

# Runnable from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sam3.bundle import Bundle, BundleWriter  # noqa: E402

# Full-size SAM3 (docs/sam3-bundle.md 5): the sizes the tensor names are shaped by.
SIZES = dict(grid=72, window=24, patch=14, image_size=1008, vit_dim=1024, vit_heads=16, vit_layers=32, vit_ffn=4736,
             d_model=256, d_heads=8, d_layers=6, d_ffn=2048, text_len=32, text_dim=1024, text_heads=16,
             text_layers=24, text_ffn=4096, vocab=49408, queries=200, dec_layers=6, mask_size=288)


def packed(k: int, n: int, bias: bool, ct_k: int = 8) -> int:
    """Bytes of a packed B operand: 9 * N * (K + ct_k * bias) / 8 (docs/sam3-bundle.md 3)."""
    return 9 * n * (k + ct_k * int(bias)) // 8


def gemm_shapes(s: dict[str, int]) -> dict[str, tuple[int, int, bool]]:
    """(K, N, bias) of each of the 16 GEMMs for these sizes (an illustrative choice: docs/sam3-bundle.md 4)."""
    dim, dm, pd = s["vit_dim"], s["d_model"], 64 * s["d_heads"]
    conv_p, conv_d = 2, 3 * dm  # P = 2 output pixels a row, D = 3 * C (docs/sam3-bundle.md 12)
    return {
        "v_embed": (3 * s["patch"] ** 2 + 4, dim, True), "v_qkv": (dim, 3 * dim, True), "v_o": (dim, dim, True),
        "v_fc1": (dim, s["vit_ffn"], True), "v_fc2": (s["vit_ffn"], dim, False),
        "n_in": (dim, 2048 + 4 * dm + dm, True), "n_up": (512, 4 * dm, True),
        "conv": ((conv_p + 2) * conv_d, conv_p * dm, False),
        "d_qkv": (2 * dm, 3 * pd, True), "d_o": (pd, dm, True), "d_s": (dm, s["d_heads"] * s["text_len"], False),
        "d_c": (s["d_heads"] * s["text_len"], dm, False), "d_fc1": (dm, s["d_ffn"], True),
        "d_fc2": (s["d_ffn"], dm, True), "dec_kv": (2 * dm, s["dec_layers"] * 2 * dm, True),
        "m_head": (dm, 256, True),
    }


def tensor_list(s: dict[str, int]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of a full-size bundle; packed operands are u8 [bytes]."""
    g = gemm_shapes(s)
    t, dim, dm, q = s["grid"] ** 2, s["vit_dim"], s["d_model"], s["queries"]
    out: list[tuple[str, str, tuple[int, ...]]] = []

    def pk(name: str, key: str) -> None:
        out.append((name, "u8", (packed(*g[key]),)))

    def f32(name: str, *shape: int) -> None:
        out.append((name, "f32", shape))

    def lin(name: str, n_out: int, n_in: int, dtype: str = "f32") -> None:
        out.append((f"{name}.w", dtype, (n_out, n_in)))
        f32(f"{name}.b", n_out)

    pk("v.embed", "v_embed")
    out.append(("v.perm", "i32", (t,)))
    f32("v.pos", t * dim)
    f32("v.ln_pre.w", dim), f32("v.ln_pre.b", dim)
    for i in range(s["vit_layers"]):
        for w, key in (("qkv", "v_qkv"), ("o", "v_o"), ("fc1", "v_fc1"), ("fc2", "v_fc2")):
            pk(f"v.{i}.{w}", key)
        for w in ("ln1.w", "ln1.b", "ln2.w", "ln2.b", "fc2.b"):
            f32(f"v.{i}.{w}", dim)
    half = dim // s["vit_heads"] // 2
    for kind in ("win", "glob"):
        f32(f"v.rope.{kind}.cos", t * half), f32(f"v.rope.{kind}.sin", t * half)
        out.append((f"v.rope_tab.{kind}", "u8", (t * half * 2 * 2,)))
    pk("n.in", "n_in"), pk("n.up", "n_up")
    for i in range(3):
        pk(f"n.conv{i}", "conv"), f32(f"n.conv{i}.b", dm)
    f32("d.pos", t * dm)
    for i in range(s["d_layers"]):
        for w, key in (("qkv", "d_qkv"), ("o", "d_o"), ("fc1", "d_fc1"), ("fc2", "d_fc2")):
            pk(f"d.{i}.{w}", key)
        for w in ("ln1", "ln2", "ln3"):
            f32(f"d.{i}.{w}.w", dm), f32(f"d.{i}.{w}.b", dm)
        f32(f"d.{i}.fc2.b", dm)
        for w in "qkvo":
            lin(f"d.{i}.ca.{w}", dm, dm)
    pk("dec.kv", "dec_kv")
    f32("dec.reference_points", q * 4), f32("dec.presence_token", dm), f32("dec.query_embed", q * dm)
    for name in ("dec.ref_point_head.1", "dec.ref_point_head.2", "dec.rpb_y.1", "dec.rpb_y.2", "dec.rpb_x.1",
                 "dec.rpb_x.2", "dec.box_head.1", "dec.box_head.2", "dec.box_head.3", "dec.presence_head.1",
                 "dec.presence_head.2", "dec.presence_head.3"):
        lin(name, dm, dm)
    for i in range(s["dec_layers"]):
        for w in [f"sa.{x}" for x in "qkvo"] + [f"tca.{x}" for x in "qkvo"] + ["vca.q", "vca.o"]:
            lin(f"dec.{i}.{w}", dm, dm)
        lin(f"dec.{i}.fc1", s["d_ffn"], dm), lin(f"dec.{i}.fc2", dm, s["d_ffn"])
        for w in ("sa_ln", "tca_ln", "vca_ln", "mlp_ln"):
            f32(f"dec.{i}.{w}.w", dm), f32(f"dec.{i}.{w}.b", dm)
    for w in ("dec.out_ln", "dec.presence_ln", "score.text_ln", "m.ca_ln"):
        f32(f"{w}.w", dm), f32(f"{w}.b", dm)
    for w in ("score.text_mlp.1", "score.text_mlp.2", "score.text_proj", "score.query_proj"):
        lin(w, dm, dm)
    for i in range(2):
        pk(f"m.conv{i}", "conv"), f32(f"m.conv{i}.b", dm), f32(f"m.gn{i}.w", dm), f32(f"m.gn{i}.b", dm)
    for w in "qkvo":
        lin(f"m.ca.{w}", dm, dm)
    for i in range(3):
        lin(f"m.embed.{i}", dm, dm)
    lin("m.inst", dm, dm), f32("m.sem.w", dm), f32("m.sem.b", 1)
    td, tf = s["text_dim"], s["text_ffn"]
    out.append(("t.tok_emb", "bf16", (s["vocab"], td)))
    f32("t.pos_emb", s["text_len"] * td)
    for i in range(s["text_layers"]):
        for w in ("ln1", "ln2"):
            f32(f"t.{i}.{w}.w", td), f32(f"t.{i}.{w}.b", td)
        lin(f"t.{i}.qkv", 3 * td, td, "bf16"), lin(f"t.{i}.o", td, td, "bf16")
        lin(f"t.{i}.fc1", tf, td, "bf16"), lin(f"t.{i}.fc2", td, tf, "bf16")
    f32("t.final_ln.w", td), f32("t.final_ln.b", td), lin("t.proj", dm, td)
    side, ms = s["image_size"], s["mask_size"]
    kn = g["d_s"]
    f32("pack_test.B", kn[0] * kn[1]), f32("pack_test.bias", kn[1]), pk("pack_test.packed", "d_s")
    out += [("ref.rgb", "u8", (480, 640, 3)), ("ref.input_ids", "i32", (s["text_len"],)),
            ("ref.attention_mask", "i32", (s["text_len"],))]
    f32("ref.pixel_values", 3 * side * side), f32("ref.text", s["text_len"] * dm), f32("ref.vit_out", t * dim)
    for i, f in enumerate((4, 2, 1)):
        f32(f"ref.fpn{i}", (s["grid"] * f) ** 2 * dm)
    f32("ref.enc_out", t * dm), f32("ref.dec_hidden", s["dec_layers"] * q * dm)
    f32("ref.pred_logits", q), f32("ref.pred_boxes", q * 4), f32("ref.presence", 1)
    f32("ref.pred_masks", q * ms * ms), f32("ref.semantic", ms * ms)
    for j in range(4):
        out += [(f"tok.{j}.ids", "i32", (s["text_len"],)), (f"tok.{j}.mask", "i32", (s["text_len"],))]
        f32(f"case.{j}.scores", 3)
        out.append((f"case.{j}.masks", "u8", (3, 480, 640)))
    return out


def scaled(tensors: list[tuple[str, str, tuple[int, ...]]], factor: float) -> list[tuple[str, str, tuple[int, ...]]]:
    """Every tensor with its element count scaled by `factor` (at least 1), as a one-dimensional shape."""
    return [(name, dtype, (max(1, round(int(np.prod(shape)) * factor)),)) for name, dtype, shape in tensors]


def write_bundle(root: Path, tensors: list[tuple[str, str, tuple[int, ...]]], s: dict[str, int]) -> float:
    """Write the bundle with BundleWriter from one zero buffer; returns the seconds taken."""
    t0 = time.perf_counter()
    dtypes = {"f32": np.float32, "bf16": np.uint16, "u8": np.uint8, "i32": np.int32}
    biggest = max(int(np.prod(sh)) * np.dtype(dtypes[d]).itemsize for _, d, sh in tensors)
    zeros = np.zeros(biggest, np.uint8)
    g = gemm_shapes(s)
    with BundleWriter(root) as w:
        params = {k: v for k, v in s.items() if k not in ("vit_ffn", "vocab")}
        params |= dict(vit_ffn_pad=s["vit_ffn"], vit_global="7,15,23,31", neck_splits=f"2048,{4 * s['d_model']},"
                       f"{s['d_model']}", text_eps=1e-5, vit_eps=1e-6, bos=49406, eos=49407, pad=49407, vit_device=1)
        for name, value in params.items():
            w.param(name, value)
        for ctx in ("gemm_a", "gemm_b", "gemm_c", "gemm_d", "gemm_e", "gemm_f", "gemm_g", "gemm_h", "gemm_i",
                    "gemm_j"):
            w.xclbin(ctx, f"kernels/{ctx}.xclbin", "MLIR_AIE")
        for i, (key, (k, n, bias)) in enumerate(g.items()):
            lda = k // 2 if key == "conv" else k  # K = (P+2)·D at row stride P·D, P = 2
            w.record("gemm", key, ctx=f"gemm_{'abcdefghij'[i % 10]}", insts=f"kernels/{key}.insts.bin", M=256, K=k,
                     N=n, lda=lda, tile_k=k, tile_n=8, ct_k=8, bias=bias, b_bytes=packed(k, n, bias))
        t = s["grid"] ** 2
        for key, seq, d in (("mha_win", 576, 64), ("mha_glob", t, 64), ("mha_d", t, 64)):
            w.record("mha", key, xclbin=f"kernels/{key}.xclbin", insts=f"kernels/{key}.insts.bin", heads=16, seq=seq,
                     d=d, token_major=1, elems=t * s["vit_dim"])
        for key in ("rope", "addln"):
            w.record("op", key, xclbin=f"kernels/{key}.xclbin", insts=f"kernels/{key}.insts.bin")
        for name, dtype, shape in tensors:
            n = int(np.prod(shape)) * np.dtype(dtypes[dtype]).itemsize
            view = zeros[:n].view(dtypes[dtype]).reshape(shape)
            w.tensor(name, view, dtype="bf16" if dtype == "bf16" else None)
        vocab = {f"t{i}</w>": i for i in range(s["vocab"])}
        w.file("vocab.json", json.dumps(vocab).encode())
        w.file("merges.txt", ("#version: 0.2\n" + "".join(f"t{i} t{i + 1}</w>\n" for i in range(48894))).encode())
    return time.perf_counter() - t0


def rss() -> int:
    """This process's resident set size in bytes (VmRSS of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_round(root: Path, traced: bool) -> tuple[float, int, tuple[int, int], dict[str, object]]:
    """Bundle.open plus a view of every tensor: (seconds, RSS growth, (heap peak, heap of the views), counts).

    tracemalloc slows allocation several times over and its own records take memory, so a traced round
    gives only the heap peak; time and RSS come from untraced rounds.
    """
    gc.collect()
    before = rss()
    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    b = Bundle.open(root)
    opened = tracemalloc.get_traced_memory()[0]
    views = [b.tensors.get(name) for name in b.tensors.names()]
    seconds = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    grown = rss() - before
    by_dtype: dict[str, list[int]] = {}
    for info in b.tensors:
        by_dtype.setdefault(info.dtype, [0, 0])
        by_dtype[info.dtype][0] += 1
        by_dtype[info.dtype][1] += info.nbytes
    counts = {"tensors": len(views), "by_dtype": by_dtype, "records": len(b.records), "params": len(b.params.raw),
              "vocab": len(b.vocab), "merges": len(b.merges)}
    del views
    b.close()
    return seconds, grown, (peak, current - opened), counts


def read_round(root: Path) -> tuple[float, int]:
    """tensors.bin read into one heap buffer: (seconds, RSS growth)."""
    gc.collect()
    before = rss()
    t0 = time.perf_counter()
    data = np.fromfile(root / "tensors.bin", dtype=np.uint8)
    seconds = time.perf_counter() - t0
    grown = rss() - before
    del data
    return seconds, grown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=None, help="scale every tensor to reach this total size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to create the temporary bundle (default: the system temp)")
    args = ap.parse_args(argv)
    tensors = tensor_list(SIZES)
    itemsize = {"f32": 4, "bf16": 2, "u8": 1, "i32": 4}
    full = sum(int(np.prod(sh)) * itemsize[d] for _, d, sh in tensors)
    if args.size_gb is not None:
        tensors = scaled(tensors, args.size_gb * 1e9 / full)
    tmp = Path(tempfile.mkdtemp(prefix="bench_bundle.", dir=args.dir))
    try:
        root = tmp / "bundle"
        wrote = write_bundle(root, tensors, SIZES)
        size = (root / "tensors.bin").stat().st_size
        print(f"bundle: {len(tensors)} tensors, tensors.bin {size / 1e9:.3f} GB "
              f"(full-size SAM3 {full / 1e9:.3f} GB), written in {wrote:.2f} s ({size / wrote / 1e9:.2f} GB/s)")
        # Every open round before the first read: freeing a bundle-sized heap buffer (and the page-cache
        # churn it causes) slows whatever runs next, and would be charged to the open.
        opens = [open_round(root, traced=False) for _ in range(args.rounds)]
        peak, views_heap = open_round(root, traced=True)[2]
        reads = [read_round(root) for _ in range(args.rounds)]
        counts = opens[0][3]
        print(f"counts: {counts['tensors']} tensors, {counts['records']} records, {counts['params']} params, "
              f"vocab {counts['vocab']}, merges {counts['merges']}")
        for dtype, (n, nbytes) in sorted(counts["by_dtype"].items()):  # type: ignore[union-attr]
            print(f"  {dtype:>4}: {n:5d} tensors {nbytes:>14,d} bytes")
        t_open = statistics.median(o[0] for o in opens)
        t_read = statistics.median(r[0] for r in reads)
        rss_open = max(o[1] for o in opens)
        rss_read = statistics.median(r[1] for r in reads)
        print(f"Bundle.open + every view: {t_open * 1e3:8.1f} ms median  (goal: well under a second)")
        print(f"read tensors.bin to heap: {t_read * 1e3:8.1f} ms median  (ratio read/open {t_read / t_open:.1f}x)")
        print(f"RSS growth, open: {rss_open / 2**20:8.1f} MiB (the vocabulary and merges live on the heap); traced "
              f"heap peak {peak / 2**20:.1f} MiB (goal: no heap for tensors: {peak / size * 100:.2f}% of tensors.bin)")
        print(f"heap of the {counts['tensors']} views: {views_heap / 2**10:.0f} KiB "
              f"({views_heap / counts['tensors']:.0f} bytes a view, none for the data)")
        print(f"RSS growth, read: {rss_read / 2**20:8.1f} MiB ({rss_read / max(rss_open, 1):.0f}x the open's)")
    finally:
        shutil.rmtree(tmp, ignore_errors=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
