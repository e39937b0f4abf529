"""Packing and unpacking GEMM B operands (bfp16ebs8, docs/sam3-packing.md 2 and 3), timed side by side.

Run: ``python bench/bench_pack.py [--rounds 5] [--slice 256x64]``

1. ``pack_b`` and ``unpack_b`` on the two largest ViT weights, the MLP's 1024 x 4736 (fc1) and 4736 x 1024
   (fc2), with bias, at tilings of the kind a bundle's gemm records give (the real tile sizes are the
   bundle's; any valid tiling costs about the same). The goal is well under a second per weight.
2. The vectorised packer against a naive one that encodes block by block in Python (the reference's
   loops), on a small slice; both run in alternate rounds and must give the same bytes. The ratio of the
   medians is what to quote.

Counts are deterministic: bytes in and out and blocks per weight.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Runnable from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sam3 import pack  # noqa: E402

# (K, N, tile_k, tile_n, ct_k): tilings that satisfy docs/sam3-packing.md 3.1 for the ViT MLP weights
WEIGHTS = [
    ("fc1 1024x4736", (1024, 4736, 256, 64, 64)),
    ("fc2 4736x1024", (4736, 1024, 128, 64, 64)),
]
GOAL_S = 1.0


def _median(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _naive_block(values: list[float]) -> bytes:
    """One block by the rule, one value at a time (docs/sam3-packing.md 2.4)."""
    fields = []
    for x in values:
        u = struct.unpack("<I", struct.pack("<f", x))[0]
        neg, e, m = u >> 31, (u >> 23) & 0xFF, u & 0x7FFFFF
        m |= (1 << 23) if e else 0
        fields.append((neg, e, -m if neg else m))
    top = max(f[1] for f in fields)
    out = [top]
    for neg, e, v in fields:
        if top - e >= 32:
            q = -1 if neg else 0
        else:
            total = 17 + top - e
            q = v >> total
            rem, half = v - (q << total), 1 << (total - 1)
            q += rem > half or (rem == half and q & 1)
        out.append(min(max(q, -128), 127) & 0xFF)
    return bytes(out)


def _naive_pack(b: np.ndarray, tile_k: int, tile_n: int, ct_k: int) -> bytes:
    """The packer as the reference writes it: five nested loops over the tile order, no bias."""
    k, n = b.shape
    vals = b.tolist()
    out = bytearray()
    for cb in range(n // tile_n):
        for kb in range(k // tile_k):
            for ks in range(tile_k // ct_k):
                for tb in range(tile_n // 8):
                    for i in range(ct_k // 8):
                        k0 = kb * tile_k + ks * ct_k + 8 * i
                        for t_in in range(8):
                            col = cb * tile_n + 8 * tb + t_in
                            out += _naive_block([vals[k0 + s][col] for s in range(8)])
    return bytes(out)


def bench_weights(rounds: int) -> None:
    rng = np.random.default_rng(0)
    print(f"pack_b / unpack_b, median of {rounds} (goal: well under {GOAL_S:.0f} s per weight)")
    for name, (k, n, tile_k, tile_n, ct_k) in WEIGHTS:
        b = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        packed = pack.pack_b(b, bias, tile_k, tile_n, ct_k)
        t_pack = _median(lambda b=b, bias=bias, t=(tile_k, tile_n, ct_k): pack.pack_b(b, bias, *t), rounds)
        t_unpack = _median(lambda p=packed, d=(k, n, tile_k, tile_n, ct_k): pack.unpack_b(p, *d, True), rounds)
        back, _ = pack.unpack_b(packed, k, n, tile_k, tile_n, ct_k, True)
        worst = float(np.max(np.abs(back - b)))
        print(f"  {name} tile_k={tile_k} tile_n={tile_n} ct_k={ct_k} bias=1: {b.nbytes} B f32 -> {packed.size} B "
              f"({k * n // 8} blocks), max |error| {worst:.2e}")
        for what, t in (("pack", t_pack), ("unpack", t_unpack)):
            verdict = "ok" if t < GOAL_S / 4 else "NOT well under the goal"
            print(f"    {what:6s} {t * 1e3:7.1f} ms  {packed.size / t / 1e6:7.1f} MB/s packed, "
                  f"{b.nbytes / t / 1e6:7.1f} MB/s f32  [{verdict}]")


def bench_naive(rounds: int, shape: tuple[int, int]) -> None:
    k, n = shape
    b = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    tiles = (k, 8, 8)
    same = pack.pack_b(b, None, *tiles).tobytes() == _naive_pack(b, *tiles)
    naive, fast = [], []
    for _ in range(rounds):
        for times, fn in ((naive, lambda: _naive_pack(b, *tiles)), (fast, lambda: pack.pack_b(b, None, *tiles))):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    t_naive, t_fast = statistics.median(naive), statistics.median(fast)
    print(f"vectorised vs naive per-block packer on {k}x{n} ({k * n // 8} blocks), median of {rounds}, "
          f"same bytes: {'yes' if same else 'NO'}")
    print(f"  naive {t_naive * 1e3:8.1f} ms ({t_naive / (k * n // 8) * 1e6:.2f} us/block)   "
          f"vectorised {t_fast * 1e3:6.2f} ms   ratio {t_naive / t_fast:.0f}x")
    full = WEIGHTS[0][1][0] * WEIGHTS[0][1][1] // 8
    print(f"  (at that rate the naive packer would need ~{t_naive / (k * n // 8) * full:.1f} s for {WEIGHTS[0][0]}, "
          "extrapolated, not measured)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slice", default="256x64", help="K x N of the naive comparison (multiples of 8)")
    args = ap.parse_args()
    k, n = (int(v) for v in args.slice.lower().split("x"))
    bench_weights(args.rounds)
    bench_naive(args.rounds, (k, n))


if __name__ == "__main__":
    main()
