"""Writing a SAM3 kernel bundle for a model geometry (spec/sam3-bundle.md 1).

Real kernels come from an AIE compiler this machine does not have, so a built bundle carries
what the runtime path needs, made with the project's own writers: one xclbin per hardware context
(`xclbin.build_mlir_aie` around a seeded-random PDI), one TXN stream per kernel key
(`insts.dma_stream`: a shim BD and a DDR_PATCH per buffer argument, sized exactly as the kernel
reads and writes, plus RTP words naming the computation so that each stream is unique to it), the
packed weights (seeded random or the user's, from `.npz`) and the manifest. On an emulated device
the NPU layer binds each stream to the model of its manifest entry; on a real NPU such a bundle's
PDIs are not executable designs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from amdxdna_direct import insts, xclbin
from amdxdna_direct.device import TXN_DEV_GEN
from sam3.bundle import ELEMENTWISE_FNS, FORMAT, GENERATIONS, MANIFEST
from sam3.pack import BF16_BYTES, pack_b, pack_conv3x3, parse_layout, round_up

KERNEL_NAME = "MLIR_AIE"
PDI_BYTES = 1024
# Partition columns per generation (spec/xrt-npu-sequence.md 4): NPU1 contexts start at column
# 1..4 (column 0 has no shim DMA), NPU4-class contexts start at multiples of their width in 0..7.
_COLUMNS = {"aie2": (1, 5), "aie2p": (0, 8)}

# RTP word 0: what kind of computation the stream belongs to; the rest are its parameters.
RTP_GEMM, RTP_MHA, RTP_OP = 0x53410001, 0x53410002, 0x53410003
_LAYOUT_CODES = {"kn": 1, "nk": 2, "tiled": 3, "conv3x3": 4}


@dataclass(frozen=True)
class ConvShape:
    """One neck 3x3 convolution: an `h x w` map of `channels` in, `cout` out, P pixels per GEMM row."""

    key: str
    h: int
    w: int
    channels: int
    cout: int
    p: int
    m: int


@dataclass(frozen=True)
class Geometry:
    """The shapes a bundle is built for: one ViT block (windowed and global attention) and the neck convs."""

    name: str
    grid: tuple[int, int]
    width: int
    heads: int
    mlp: int
    window: int
    m: int
    fc1_tiles: tuple[int, int]
    convs: tuple[ConvShape, ...]
    column_width: int = 1

    @property
    def tokens(self) -> int:
        """Tokens of the image grid."""
        return self.grid[0] * self.grid[1]

    @property
    def head_dim(self) -> int:
        """Width per attention head."""
        return self.width // self.heads

    @property
    def windows(self) -> int:
        """Attention windows per image."""
        return (self.grid[0] // self.window) * (self.grid[1] // self.window)

    @property
    def rows(self) -> int:
        """GEMM rows of a block stage: the tokens padded to the kernel's m."""
        return round_up(self.tokens, self.m)


PRESETS = {
    # A few hundred tokens, width 64: the whole path in well under a second on the emulator.
    "tiny": Geometry(name="tiny", grid=(16, 16), width=64, heads=4, mlp=160, window=8, m=32, fc1_tiles=(16, 32),
                     convs=(ConvShape("neck.conv16", 16, 16, 32, 32, 4, 16),
                            ConvShape("neck.conv32", 32, 32, 32, 32, 4, 16))),
    # SAM3's image encoder: 72x72 = 5184 tokens of width 1024, 16 heads, MLP 4736, 24x24 windows
    # (576 tokens) and global blocks; the neck's 3x3 convs with 256 channels at 72x72 and 144x144.
    "sam3": Geometry(name="sam3", grid=(72, 72), width=1024, heads=16, mlp=4736, window=24, m=64,
                     fc1_tiles=(64, 128),
                     convs=(ConvShape("neck.conv72", 72, 72, 256, 256, 8, 32),
                            ConvShape("neck.conv144", 144, 144, 256, 256, 8, 32))),
}


def block_gemm_shapes(g: Geometry) -> dict[str, tuple[str, int, int, str]]:
    """key -> (context, k, n, b_layout) of the block's GEMMs; layouts vary to exercise each packing."""
    kt, nt = g.fc1_tiles
    return {
        "blk0.qkv": ("attn_gemm", g.width, 3 * g.width, "kn"),
        "blk0.proj": ("attn_gemm", g.width, g.width, "nk"),
        "blk0.fc1": ("mlp_gemm", g.width, g.mlp, f"tiled:{kt},{nt}"),
        "blk0.fc2": ("mlp_gemm", g.mlp, g.width, "kn"),
    }


# ---------------------------------------------------------------------------------------------


def build(out: str | os.PathLike, preset: str | Geometry = "tiny", target: str = "npu4", seed: int = 0,
          weights: str | os.PathLike | None = None) -> Path:
    """Writes a bundle for `preset` into directory `out` (created; must not hold a manifest yet).

    Args:
        out: the bundle directory.
        preset: "tiny", "sam3" or a `Geometry`.
        target: "npu1", "npu4", "npu5" or "npu6".
        seed: seeds the PDIs and the random weights.
        weights: optional `.npz` of the user's own weights: key -> `[k][n]` float matrix for a block
            GEMM (C = A @ W), `[Cout][D][3][3]` for a conv; keys it lacks get seeded random weights.

    Returns the bundle directory.

    Raises:
        ValueError: unknown preset or target, a negative seed, an existing bundle at `out`, or a weights file that
            is not an `.npz` of numeric arrays named and shaped as the preset's kernels (checked before anything
            is written).
        OSError: `out` or `weights` cannot be written or read.
    """
    g = PRESETS.get(preset) if isinstance(preset, str) else preset
    if g is None:
        raise ValueError(f"unknown preset {preset!r} (expected one of {sorted(PRESETS)})")
    if target not in GENERATIONS:
        raise ValueError(f"unknown target {target!r} (expected one of {sorted(GENERATIONS)})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    root = Path(out)
    if (root / MANIFEST).exists():
        raise ValueError(f"{root} already holds a bundle ({MANIFEST})")
    user = _user_weights(weights, g) if weights is not None else {}
    manifest = _Writer(root, g, target, seed, user).write()
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return root


def _user_weights(path: str | os.PathLike, g: Geometry) -> dict[str, np.ndarray]:
    """The arrays of the `.npz` at `path` as float32, each named and shaped as one of `g`'s kernels."""
    shapes = {key: (k, n) for key, (_, k, n, _) in block_gemm_shapes(g).items()}
    shapes.update({c.key: (c.cout, c.channels, 3, 3) for c in g.convs})
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("a single array (.npy): expected an .npz archive of arrays named by kernel key")
        with data:
            arrays = {name: data[name] for name in data.files}
    except (ValueError, zipfile.BadZipFile, EOFError) as e:  # EOFError: an empty file
        raise ValueError(f"{path}: not a weights archive: {e}") from e
    unused = sorted(set(arrays) - set(shapes))
    if unused:
        raise ValueError(f"{path}: arrays {unused} match no kernel of the {g.name} preset")
    for key, w in arrays.items():
        if w.dtype.kind not in "biuf":
            raise ValueError(f"weights for {key}: dtype {w.dtype}, expected real numbers")
        if w.shape != shapes[key]:
            raise ValueError(f"weights for {key}: shape {w.shape}, the {g.name} preset needs {shapes[key]}")
    return {key: w.astype(np.float32) for key, w in arrays.items()}


def build_cached(cache: str | os.PathLike, preset: str = "tiny", target: str = "npu4", seed: int = 0) -> Path:
    """The bundle for (preset, target, seed) under `cache`, built on first use (atomically, by rename).

    Raises:
        ValueError: as `build`.
        OSError: the cache directory cannot be created or written.
    """
    final = Path(cache) / f"{preset}-{target}-seed{seed}-v{FORMAT}"
    if (final / MANIFEST).is_file():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    except OSError as e:
        raise OSError(e.errno, f"bundle cache {final.parent}: {e.strerror}", e.filename) from e
    try:
        build(staging, preset, target, seed)
        os.replace(staging, final)
    except OSError:
        if not (final / MANIFEST).is_file():  # a concurrent builder did not win the rename either
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


class _Writer:
    """Writes the files of one bundle and collects its manifest."""

    def __init__(self, root: Path, g: Geometry, target: str, seed: int, user: dict[str, np.ndarray]):
        self.root, self.g, self.target, self.seed, self.user = root, g, target, seed, user
        self.dev_gen = TXN_DEV_GEN[target]
        for sub in ("xclbin", "insts", "weights"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def write(self) -> dict:
        g = self.g
        contexts = ["attn_gemm", "mlp_gemm", "conv_gemm", "mha", "ew"]
        xclbins = {name: {"path": self.xclbin(name), "kernel": KERNEL_NAME} for name in contexts}
        gemms = [self.block_gemm(key, *shape) for key, shape in block_gemm_shapes(g).items()]
        gemms += [self.conv_gemm(c) for c in g.convs]
        mhas = [self.mha("blk0.attn", g.window * g.window), self.mha("glb.attn", g.tokens)]
        ops = [self.op("blk0.gelu", "gelu", g.rows * g.mlp, args=1)]
        return {"format": FORMAT, "target": self.target, "xclbins": xclbins, "gemms": gemms, "mhas": mhas,
                "ops": ops}

    def xclbin(self, ctx: str) -> str:
        rng = np.random.default_rng([self.seed, zlib.crc32(ctx.encode())])
        pdi = rng.integers(0, 256, PDI_BYTES, dtype=np.uint8).tobytes()
        first, end = _COLUMNS[GENERATIONS[self.target]]
        width = self.g.column_width
        starts = [c for c in range(first, end - width + 1) if GENERATIONS[self.target] == "aie2" or c % width == 0]
        image = xclbin.write(xclbin.build_mlir_aie(pdi, column_width=width, start_columns=starts,
                                                   kernel=KERNEL_NAME))
        rel = f"xclbin/{ctx}.xclbin"
        (self.root / rel).write_bytes(image)
        return rel

    def stream(self, key: str, buffers: Sequence[tuple[int, int, str]], rtp: Sequence[int]) -> str:
        rel = f"insts/{key}.bin"
        try:
            stream = insts.dma_stream(self.dev_gen, buffers, rtp=rtp)
        except ValueError as e:  # a geometry whose buffers are not whole words (the shim DMA moves words)
            raise ValueError(f"{self.g.name} preset, kernel {key}: {e}") from e
        (self.root / rel).write_bytes(insts.encode(stream))
        return rel

    def block_gemm(self, key: str, ctx: str, k: int, n: int, layout: str) -> dict:
        w = self._weight(key, (k, n), 1.0 / math.sqrt(k))
        return self._gemm(key, ctx, self.g.m, k, n, k, layout, pack_b(w, layout))

    def conv_gemm(self, c: ConvShape) -> dict:
        w = self._weight(c.key, (c.cout, c.channels, 3, 3), 1.0 / math.sqrt(9 * c.channels))
        k, lda, n = (c.p + 2) * c.channels, c.p * c.channels, 3 * c.p * c.cout  # spec 4
        return self._gemm(c.key, "conv_gemm", c.m, k, n, lda, f"conv3x3:{c.p}", pack_conv3x3(w, c.p))

    def _gemm(self, key: str, ctx: str, m: int, k: int, n: int, lda: int, layout: str, packed: np.ndarray) -> dict:
        lay = parse_layout(layout)
        a_bytes = ((m - 1) * lda + k) * BF16_BYTES
        b_bytes = k * n * BF16_BYTES
        rtp = [RTP_GEMM, m, k, n, lda, _LAYOUT_CODES[lay.kind], lay.kt or lay.p, lay.nt]
        rel = self.stream(key, [(0, a_bytes, "in"), (1, b_bytes, "in"), (2, m * n * BF16_BYTES, "out")], rtp)
        (self.root / "weights" / f"{key}.bin").write_bytes(packed.tobytes())
        return {"key": key, "ctx": ctx, "m": m, "k": k, "n": n, "lda": lda, "insts": rel, "b_bytes": b_bytes,
                "b_layout": layout}

    def mha(self, key: str, seq: int) -> dict:
        g = self.g
        elems = g.heads * seq * g.head_dim
        nbytes = elems * BF16_BYTES
        buffers = [(0, nbytes, "in"), (1, nbytes, "in"), (2, nbytes, "in"), (3, nbytes, "out")]
        rel = self.stream(key, buffers, [RTP_MHA, g.heads, seq, g.head_dim])
        return {"key": key, "heads": g.heads, "seq": seq, "d": g.head_dim, "elems": elems,
                "xclbin": "xclbin/mha.xclbin", "insts": rel, "name": KERNEL_NAME}

    def op(self, key: str, fn: str, elems: int, args: int) -> dict:
        # In place with one argument (spec 6: GELU over the MLP's hidden C before fc2 reads it).
        buffers = [(i, elems * BF16_BYTES, "in" if i < args - 1 else "out") for i in range(args)]
        rel = self.stream(key, buffers, [RTP_OP, ELEMENTWISE_FNS.index(fn) + 1, elems, 0, args])
        return {"key": key, "xclbin": "xclbin/ew.xclbin", "insts": rel, "name": KERNEL_NAME, "fn": fn,
                "elems": elems}

    def _weight(self, key: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
        if key in self.user:  # named and shaped as this kernel's (checked by _user_weights)
            return self.user[key]
        rng = np.random.default_rng([self.seed, zlib.crc32(key.encode())])
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, prog: str = "build_bundle") -> int:
    """`build_bundle.py OUT [--preset tiny|sam3] [--target npu1|npu4|npu5|npu6] [--seed N] [--weights W.npz]`;
    also `sam3-npu build`. Prints the bundle directory; exit status 1 (message on stderr) on failure."""
    p = argparse.ArgumentParser(prog=prog, description="Write a SAM3 kernel bundle.")
    p.add_argument("out", help="bundle directory to create")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--target", choices=sorted(GENERATIONS), default="npu4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", help=".npz of your own weights (key -> [k][n] or [Cout][D][3][3])")
    args = p.parse_args(argv)
    try:
        root = build(args.out, args.preset, args.target, args.seed, args.weights)
    except (ValueError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    print(root)
    return 0
