"""`sam3-npu demo`: one SAM3 ViT block and the neck's 3x3 convolutions on the NPU, checked against numpy.

The block: LayerNorm (host), QKV GEMM, windowed multi-head attention, output projection, residual
(host), LayerNorm (host), MLP fc1, GELU on the device in place over fc1's C, fc2 reading that C
in place (chained: no host copy), residual (host). Then the global-attention kernel over the same
q/k/v and every neck convolution of the bundle. Each device stage is compared with a numpy float32
reference computed from the same bf16 inputs the device read; the whole block is also compared
end to end with a float32 block.

Usage: `sam3-npu demo [--preset tiny|sam3] [--device emu|/dev/accel/N] [--bundle DIR] [--json]`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from amdxdna_direct import errors
from amdxdna_direct.device import Device, open_device
from sam3 import pack, reference
from sam3.build import PRESETS, Geometry, block_gemm_shapes, build_cached
from sam3.build import main as build_main
from sam3.bundle import Bundle, BundleError
from sam3.npu import EVICTION_POLICIES, Npu, NpuError, Stage, device_generation

# Tolerances on max|device - reference| / max|reference|. bf16 keeps 8 significant bits: one
# rounding costs at most 2^-9 (0.2%) of a value. A device stage reads exactly the bf16 values
# its reference reads and rounds its fp32 result once, so 1% leaves room for accumulation order
# and, for the convolution, the three rounded partial rows summed on the host. The end-to-end
# block compounds roundings of every intermediate (LayerNorm outputs, q/k/v, attention, hidden).
STAGE_TOLERANCE = 1e-2
BLOCK_TOLERANCE = 3e-2


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.abs(want).max())
    return float(np.abs(got - want).max()) / (scale if scale > 0 else 1.0)


def _progress(enabled: bool) -> Callable[[str], None]:
    def say(message: str) -> None:
        if enabled:
            print(f"[sam3-npu] {message}", file=sys.stderr, flush=True)
    return say


# ---------------------------------------------------------------------------------------------
# weights as the reference sees them (the bf16 values the device reads)


def _gemm_weight(bundle: Bundle, key: str) -> tuple[np.ndarray, Any]:
    g = bundle.gemms[key]
    path = bundle.weights(key)
    if path is None:
        raise BundleError(f"{key}: the demo needs weights/{key}.bin in the bundle", key, "weights")
    return np.fromfile(path, dtype=np.uint16), g


def _check_geometry(bundle: Bundle, g: Geometry) -> None:
    """The bundle must hold the preset's kernels with the preset's shapes."""
    want = {key: (k, n) for key, (_, k, n, _) in block_gemm_shapes(g).items()}
    want.update({c.key: ((c.p + 2) * c.channels, 3 * c.p * c.cout) for c in g.convs})
    for key, (k, n) in want.items():
        have = bundle.gemms.get(key)
        if have is None or (have.k, have.n) != (k, n):
            got = "missing" if have is None else f"k={have.k} n={have.n}"
            raise BundleError(f"{key}: the {g.name} preset needs a GEMM with k={k} n={n}, bundle has {got}", key)
    for key, seq in (("blk0.attn", g.window * g.window), ("glb.attn", g.tokens)):
        h = bundle.mhas.get(key)
        if h is None or (h.heads, h.seq, h.d) != (g.heads, seq, g.head_dim):
            raise BundleError(f"{key}: the {g.name} preset needs MHA heads={g.heads} seq={seq} d={g.head_dim}", key)
    op = bundle.ops.get("blk0.gelu")
    if op is None or op.fn != "gelu" or op.elems != g.rows * g.mlp:
        raise BundleError(f"blk0.gelu: the {g.name} preset needs a gelu op over {g.rows * g.mlp} elements",
                          "blk0.gelu")


# ---------------------------------------------------------------------------------------------


class Demo:
    """Runs the demo's stages on an open `Npu` and records them (see module docstring).

    Uploads the block's weights from the bundle; `matrix` holds them as the `[k][n]` float32 matrices
    the references use (exactly the bf16 values the device reads).

    Raises:
        BundleError: the bundle ships no weights for a block GEMM.
    """

    def __init__(self, npu: Npu, g: Geometry, seed: int = 0, say: Callable[[str], None] = lambda m: None):
        self.npu, self.g, self.say = npu, g, say
        self.rng = np.random.default_rng(seed)
        self.ok = True
        self.w: dict[str, Any] = {}
        self.matrix: dict[str, np.ndarray] = {}
        for key in block_gemm_shapes(g):
            packed, spec = _gemm_weight(npu.bundle, key)
            self.w[key] = npu.upload(packed)
            self.matrix[key] = pack.b_matrix(packed, spec.b_layout, spec.k, spec.n)

    def _check(self, stage: Stage, got: np.ndarray, want: np.ndarray, tolerance: float | None = None) -> None:
        tolerance = STAGE_TOLERANCE if tolerance is None else tolerance
        stage.max_rel_err = _rel_err(got, want)
        self.ok &= bool(stage.max_rel_err <= tolerance)

    @property
    def stages(self) -> list[Stage]:
        """Every stage measured so far (the NPU layer's records, with `max_rel_err` filled in)."""
        return self.npu.stages

    def _finish(self, stage: Stage) -> None:
        self.say(f"{stage.name}: {stage.seconds:.3f} s, {stage.chunks} chunk(s), {stage.exec_cmds} EXEC_CMD(s), "
                 f"max rel err {stage.max_rel_err:.2e}")

    def gemm(self, name: str, key: str, a: np.ndarray | None, rows: int,
              src: Any = None) -> tuple[Any, np.ndarray, Stage]:
        """One GEMM stage: push A (unless chained on `src`), run every chunk, pull C.

        Returns (io, C as float32 `[rows][n]`, the stage record).

        Raises:
            NpuError: the kernel failed to load or run.
        """
        npu = self.npu
        io = npu.io_chained(key, src) if src is not None else npu.io(key, rows)
        npu.prepare(io, self.w[key])
        with npu.stage(name, "gemm", rows, len(io.chunks)) as st:
            if a is not None:
                io.set_a(a)
            npu.run_synced(io, self.w[key])
            out = pack.from_bf16(io.get_c(rows))
        return io, out, st

    def block(self) -> None:
        """The ViT block, stage by stage, the end-to-end check, then the global attention kernel.

        Raises:
            NpuError: a kernel failed to load or run.
        """
        g, npu = self.g, self.npu
        t = g.tokens
        x = self.rng.standard_normal((t, g.width), dtype=np.float32)
        ln1 = pack.round_bf16(reference.layernorm(x))

        _, qkv, st = self.gemm("qkv", "blk0.qkv", ln1, t)
        self._check(st, qkv, ln1 @ self.matrix["blk0.qkv"])
        self._finish(st)

        attn, q, k, v = self.window_attention(qkv)
        _, proj, st = self.gemm("proj", "blk0.proj", attn, t)
        self._check(st, proj, attn @ self.matrix["blk0.proj"])
        self._finish(st)
        h = x + proj
        ln2 = pack.round_bf16(reference.layernorm(h))

        fc1, hidden, st = self.gemm("fc1", "blk0.fc1", ln2, t)
        self._check(st, hidden, ln2 @ self.matrix["blk0.fc1"])
        self._finish(st)

        npu.prepare_args("blk0.gelu", [fc1.c])
        with npu.stage("gelu", "op", fc1.rows, 1) as st:
            npu.run_args("blk0.gelu", [fc1.c])
            act = pack.from_bf16(fc1.get_c(t))
        self._check(st, act, reference.gelu(hidden))
        self._finish(st)

        _, mlp, st = self.gemm("fc2", "blk0.fc2", None, t, src=fc1)
        self._check(st, mlp, act @ self.matrix["blk0.fc2"])
        self._finish(st)

        self._block_check(x, h + mlp)
        self._global_attention(q, k, v)

    def window_attention(self, qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Windowed MHA over the QKV output (`[tokens][3*width]`): windows and heads split on the host, all
        windows in one chain. Returns (attention output `[tokens][width]`, q, k, v).

        Raises:
            NpuError: the kernel failed to load or run.
        """
        g, npu = self.g, self.npu
        hh, ww = g.grid
        q, k, v = (qkv[:, i * g.width : (i + 1) * g.width] for i in range(3))

        def heads(x: np.ndarray) -> np.ndarray:  # [windows][heads][win*win][d]
            return pack.split_heads(pack.window_partition(x.reshape(hh, ww, g.width), g.window), g.heads)

        mio = npu.mha_io("blk0.attn", batch=g.windows)
        npu.prepare_mha(mio)
        qh, kh, vh = heads(q), heads(k), heads(v)
        with npu.stage("attn", "mha", g.tokens, g.windows) as st:
            mio.set_qkv(qh, kh, vh)
            npu.run_mha(mio)
            o = pack.from_bf16(mio.get_o())
        self._check(st, o, reference.attention(qh, kh, vh))
        self._finish(st)
        merged = pack.window_merge(pack.merge_heads(o), g.window, hh, ww).reshape(g.tokens, g.width)
        return merged, q, k, v

    def _block_check(self, x: np.ndarray, out: np.ndarray) -> None:
        g = self.g
        with self.npu.stage("block", "host", g.tokens, 0) as st:
            weights = {key.removeprefix("blk0."): m for key, m in self.matrix.items()}
            want = reference.vit_block(x, weights, g.heads, g.window, g.grid)
        self._check(st, out, want, BLOCK_TOLERANCE)
        self._finish(st)

    def _global_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """The global block's attention kernel (seq = every token) over the same q/k/v."""
        g, npu = self.g, self.npu
        qh, kh, vh = (pack.split_heads(t, g.heads) for t in (q, k, v))
        mio = npu.mha_io("glb.attn")
        npu.prepare_mha(mio)
        with npu.stage("glb.attn", "mha", g.tokens, 1) as st:
            mio.set_qkv(qh, kh, vh)
            npu.run_mha(mio)
            o = pack.from_bf16(mio.get_o())[0]
        # Head by head: the full score tensor of the sam3 preset would need 1.7 GB.
        want = np.stack([reference.attention(qh[i], kh[i], vh[i]) for i in range(g.heads)])
        self._check(st, o, want)
        self._finish(st)

    def convs(self, only: Sequence[str] | None = None) -> None:
        """Every neck convolution (or those in `only`): Y built on the host, the overlapping-row GEMM on the
        device, the three kernel rows summed on the host.

        Raises:
            BundleError: the bundle ships no weights for a conv.
            NpuError: the kernel failed to load or run.
        """
        npu = self.npu
        for c in self.g.convs:
            if only is not None and c.key not in only:
                continue
            packed, _ = _gemm_weight(npu.bundle, c.key)
            weight = pack.unpack_conv3x3(packed, c.channels, c.p, c.cout)
            wbo = npu.upload(packed)
            x = pack.round_bf16(self.rng.standard_normal((c.h, c.w, c.channels), dtype=np.float32))
            io = npu.conv_io(c.key, c.h, c.w)
            geom = npu.conv_geometry(c.key)
            npu.prepare(io, wbo)
            with npu.stage(c.key, "conv", io.rows, len(io.chunks)) as st:
                io.set_a(pack.conv_input(x, geom, io.rows))
                npu.run_synced(io, wbo)
                out = pack.conv_output(io.get_c(io.rows), geom, c.h, c.w)
            self._check(st, out, reference.conv3x3(x, weight))
            self._finish(st)


# ---------------------------------------------------------------------------------------------


def _default_device() -> Device:
    """AMDXDNA_DEVICE when set; else a real NPU if one is present, else the emulator (the JSON and the
    table name the device used).

    Raises:
        XdnaError: the device named by AMDXDNA_DEVICE cannot be opened, or a present NPU refused.
    """
    try:
        return open_device(None)
    except errors.NoDeviceError:
        if os.environ.get("AMDXDNA_DEVICE"):
            raise
        return open_device("emu")


def _cache_dir() -> Path:
    base = os.environ.get("SAM3_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sam3-npu")
    return Path(base) / "bundles"


def run_demo(preset: str = "tiny", device: Any = None, bundle: str | os.PathLike | None = None,
             max_contexts: int | None = None, evict: str = "lru", progress: bool = False,
             seed: int = 0) -> dict[str, Any]:
    """Runs the demo and returns its JSON document (see `main`).

    Raises:
        BundleError: the bundle is invalid, for another NPU generation, or not of the preset's shapes.
        NpuError: a kernel failed to load or run.
        XdnaError: the device could not be opened.
    """
    g = PRESETS[preset]
    say = _progress(progress)
    dev = _default_device() if device is None else open_device(device)
    try:
        if bundle is None and dev.emulator is None:
            raise NpuError(f"{dev.name} is a real NPU: pass --bundle DIR with compiled kernels (a built bundle "
                           f"carries placeholder PDIs that only the emulator runs)")
        if bundle is None:
            target = device_generation(dev)
            say(f"the {preset} bundle for {target} (built on first use, then cached)")
            root = build_cached(_cache_dir(), preset, target, seed)
            say(f"bundle: {root}")
        else:
            root = Path(bundle)
        loaded = Bundle.load(root)
        _check_geometry(loaded, g)
        with Npu(loaded, dev, max_contexts=max_contexts, evict=evict) as npu:
            say(f"{npu.loads} context(s) loaded on {dev.name}")
            demo = Demo(npu, g, seed, say)
            demo.block()
            demo.convs()
            return {"device": dev.name, "preset": preset, "stages": [s.row() for s in demo.stages],
                    "loads": npu.loads, "evictions": npu.evictions, "ok": demo.ok}
    finally:
        dev.close()


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _error(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"  # None: unchecked, or a NaN/infinite result


def format_table(doc: dict[str, Any]) -> str:
    """The human-readable report of a demo document."""
    head = f"{'stage':<13}{'kind':<6}{'rows':>7}{'chunks':>7}{'EXEC':>6}{'waits':>6}{'in':>11}{'out':>11}" \
           f"{'seconds':>9}{'max rel err':>13}"
    lines = [f"sam3-npu demo: preset {doc['preset']} on {doc['device']}", head, "-" * len(head)]
    for s in doc["stages"]:
        lines.append(f"{s['name']:<13}{s['kind']:<6}{s['rows']:>7}{s['chunks']:>7}{s['exec_cmds']:>6}"
                     f"{s['waits']:>6}{_size(s['bytes_in']):>11}{_size(s['bytes_out']):>11}"
                     f"{s['seconds']:>9.3f}{_error(s['max_rel_err']):>13}")
    lines.append(f"tolerance: max|npu - numpy float32| / max|numpy| <= {STAGE_TOLERANCE:g} per stage "
                 f"(bf16: 8 significant bits), {BLOCK_TOLERANCE:g} for the whole block")
    lines.append(f"contexts: {doc['loads']} loaded, {doc['evictions']} evicted")
    lines.append("result: " + ("OK" if doc["ok"] else "FAILED"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The `sam3-npu` console script: `demo` (exit status 0 only when every stage is within tolerance) and
    `build` (`sam3.build.main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["build"]:
        return build_main(argv[1:], prog="sam3-npu build")
    p = argparse.ArgumentParser(prog="sam3-npu", description="SAM3's heavy layers on an AMD XDNA NPU.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run one ViT block and the neck convolutions, checked against numpy")
    d.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    d.add_argument("--device", help="emu, emu:<profile> or /dev/accel/N (default: a real NPU if present, else emu)")
    d.add_argument("--bundle", help="use this bundle directory instead of building one")
    d.add_argument("--max-contexts", type=int, help="resident context limit (default: env SAM3_MAX_CONTEXTS)")
    d.add_argument("--evict", choices=EVICTION_POLICIES, default="lru")
    d.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    sub.add_parser("build", help="write a kernel bundle (options: sam3-npu build --help)", add_help=False)
    args = p.parse_args(argv)
    # Progress lines (stderr) only for the long presets: the tiny demo finishes in about a second.
    long_run = args.preset != "tiny"
    start = time.perf_counter()
    try:
        doc = run_demo(args.preset, args.device, args.bundle, args.max_contexts, args.evict, progress=long_run)
    except (BundleError, NpuError, ValueError, OSError) as e:  # OSError: XdnaError, or an unwritable cache
        print(f"sam3-npu demo: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, allow_nan=False) if args.json else format_table(doc))
    _progress(long_run)(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
