"""The ViT backbone on the NPU: the host-driven path and the device-resident path (docs/sam3-pipeline.md 2).

Tokens run in window order throughout (row j is raster patch `v.perm[j]`), so every attention window's
tokens are contiguous; the output is un-permuted to raster order at the end. Every size comes from the
bundle's params and GEMM records.

Host path, per layer: LN1 (affine) -> v_qkv -> RoPE on the host -> mha_win / mha_glob -> v_o -> residual
-> LN2 -> v_fc1 (tanh-GELU epilogue) -> v_fc2 reading fc1's C in place -> residual + `v.<i>.fc2.b`.

Device path (`vit_device=1`): after a host prologue, 8 launches a layer with no host work between them:
v_qkv, rope, attention over [rope_out, rope_out, qkv C, o A], v_o, addln, v_fc1, v_fc2 (chained), addln,
over two residual buffers (f32 when `vit_res_f32=1`, else bf16) that never leave the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from amdxdna_direct.bo import BF16, Bo
from sam3 import hostmath, kernels
from sam3.bundle import Bundle
from sam3.npu import Io, MhaIo, Npu, NpuError, pull, push
from sam3.pack import BF16_BYTES, from_bf16, round_bf16, unpack_b

GEMMS = ("v_embed", "v_qkv", "v_o", "v_fc1", "v_fc2")


class Geometry:
    """The ViT's sizes, from the params and GEMM records of a bundle."""

    def __init__(self, bundle: Bundle):
        p = bundle.params
        self.params = p
        self.grid, self.window, self.patch = p.grid, p.window, p.patch
        self.tokens = p.grid * p.grid
        self.dim, self.heads, self.layers = p.vit_dim, p.vit_heads, p.vit_layers
        self.head_dim = p.vit_dim // p.vit_heads
        self.half = self.head_dim // 2
        self.win_tokens = p.window * p.window
        self.windows = self.tokens // self.win_tokens
        self.globals = frozenset(p.vit_global)
        self.eps = p.vit_eps
        self.embed_k = bundle.gemms["v_embed"].k
        self.device = p.vit_device
        self.res_f32 = p.vit_res_f32

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` attends globally (else within windows)."""
        return layer in self.globals


def patches(pixels: np.ndarray, g: Geometry, perm: np.ndarray) -> np.ndarray:
    """The patch rows in window order, `[T, K]` float32: row j is raster patch `perm[j]`, columns
    (channel, ky, kx), zero beyond 3 * patch^2 up to the embedding GEMM's K (docs/sam3-pipeline.md 2.1).

    Raises:
        ValueError: `pixels` is not `[3, S, S]` with S = grid * patch.
    """
    side = g.grid * g.patch
    if pixels.shape != (3, side, side):
        raise ValueError(f"pixels must be [3, {side}, {side}] (grid {g.grid} x patch {g.patch}), got "
                         f"{list(pixels.shape)}")
    x = np.asarray(pixels, np.float32).reshape(3, g.grid, g.patch, g.grid, g.patch)
    raster = x.transpose(1, 3, 0, 2, 4).reshape(g.tokens, 3 * g.patch * g.patch)
    out = np.zeros((g.tokens, g.embed_k), np.float32)
    out[:, :raster.shape[1]] = raster[perm]
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int) -> np.ndarray:
    """Rotates every head of `x` `[T, heads*hd]`: x1 = dim d, x2 = dim d + hd/2 of a head; out_d = x1 cos - x2 sin,
    out_{d+half} = x2 cos + x1 sin, with per-token tables `[T, half]` (docs/sam3-pipeline.md 2.2)."""
    t = x.shape[0]
    h = x.reshape(t, heads, 2, -1)
    x1, x2 = h[:, :, 0], h[:, :, 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(h)
    out[:, :, 0] = x1 * c - x2 * s
    out[:, :, 1] = x2 * c + x1 * s
    return out.reshape(t, -1)


def to_windows(x: np.ndarray, g: Geometry) -> np.ndarray:
    """Token-major `[T, heads*hd]` (window order) -> the windowed kernel's `[windows*heads, window^2, hd]`."""
    return x.reshape(g.windows, g.win_tokens, g.heads, g.head_dim).transpose(0, 2, 1, 3).reshape(
        g.windows * g.heads, g.win_tokens, g.head_dim)


def from_windows(x: np.ndarray, g: Geometry) -> np.ndarray:
    """The inverse of `to_windows`."""
    return x.reshape(g.windows, g.heads, g.win_tokens, g.head_dim).transpose(0, 2, 1, 3).reshape(g.tokens, g.dim)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, groups: int = 1) -> np.ndarray:
    """Non-causal attention of token-major `[T, heads*hd]` tensors within `groups` equal runs of tokens, f32."""
    t, width = q.shape
    hd = width // heads

    def split(a: np.ndarray) -> np.ndarray:
        return a.reshape(groups, t // groups, heads, hd).transpose(0, 2, 1, 3)

    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.float32(np.sqrt(hd))
    out: np.ndarray = hostmath.softmax(scores) @ split(v)
    return out.transpose(0, 2, 1, 3).reshape(t, width)


def host_rope_tables(bundle: Bundle, g: Geometry, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The host RoPE tables `v.rope.<kind>.{cos,sin}` as `[T, half]` float32."""
    cos, sin = (bundle.tensors.get(f"v.rope.{kind}.{part}", "f32").reshape(g.tokens, g.half) for part in ("cos", "sin"))
    return cos, sin


def _checked_mha(npu: Npu, key: str, g: Geometry, heads: int, seq: int) -> None:
    spec = npu.mhas[key]
    if spec.d != g.head_dim or spec.elems < g.tokens * g.dim:
        raise NpuError(f"{key}: MHA d={spec.d}, elems={spec.elems} cannot run the ViT's attention (head dim "
                       f"{g.head_dim}, {g.tokens} x {g.dim} elements)", key)
    if spec.seq != seq or spec.heads != heads:
        raise NpuError(f"{key}: MHA heads={spec.heads}, seq={spec.seq}; the ViT needs heads={heads}, seq={seq}",
                       key)


class Vit:
    """The ViT of a bundle on an `Npu`: operand buffers allocated once, reused by every forward.

    Raises:
        NpuError / BundleError: a kernel or tensor the ViT needs is missing or has the wrong shape.
        XdnaError: allocation failed.
    """

    def __init__(self, npu: Npu):
        self.npu = npu
        bundle = npu.bundle
        self.g = g = Geometry(bundle)
        for key in GEMMS:
            npu.spec(key)
        self.perm = bundle.tensors.get("v.perm", "i32").astype(np.int64)
        if self.perm.shape != (g.tokens,) or not np.array_equal(np.sort(self.perm), np.arange(g.tokens)):
            raise NpuError(f"v.perm must be a permutation of [0, {g.tokens})")
        self.pos = bundle.tensors.get("v.pos", "f32").reshape(g.tokens, g.dim)
        self.ln_pre = (bundle.tensors.get("v.ln_pre.w", "f32"), bundle.tensors.get("v.ln_pre.b", "f32"))
        self.embed = npu.io("v_embed", g.tokens)
        self.qkv = npu.io("v_qkv", g.tokens)
        self.o = npu.io("v_o", g.tokens)
        self.fc1 = npu.io("v_fc1", g.tokens)
        self.fc2 = npu.io_chained("v_fc2", self.fc1)
        if g.device:
            self._device_buffers()
        else:
            self._host_buffers()

    def _host_buffers(self) -> None:
        g, npu = self.g, self.npu
        _checked_mha(npu, "mha_win", g, g.windows * g.heads, g.win_tokens)
        _checked_mha(npu, "mha_glob", g, g.heads, g.tokens)
        self.mha: dict[str, MhaIo] = {"win": npu.mha_io("mha_win"), "glob": npu.mha_io("mha_glob")}
        self.tables = {kind: host_rope_tables(npu.bundle, g, kind) for kind in ("win", "glob")}

    def _device_buffers(self) -> None:
        g, npu = self.g, self.npu
        for key in ("rope", "addln"):
            if key not in npu.ops:
                raise NpuError(f"vit_device=1 needs the {key!r} op, which the manifest lacks", key)
        # The device form reads rope_out, qkv and o through its stream: of the mha records only elems is read, as
        # the reference reads it (docs/sam3-kernels.md 4.3); heads, seq and d may describe any layout.
        for key in ("mha_win", "mha_glob"):
            spec = npu.mhas[key]
            if spec.elems < g.tokens * g.dim:
                raise NpuError(f"{key}: MHA elems={spec.elems} is fewer than the ViT's {g.tokens} x {g.dim} "
                               f"elements", key)
        self.rope_out = npu.device.bo(g.tokens * 2 * g.dim * BF16_BYTES)
        width = 4 if g.res_f32 else BF16_BYTES
        self.xres = [npu.device.bo(g.tokens * g.dim * width) for _ in range(2)]
        self.rope_tab = {kind: npu.weights(f"v.rope_tab.{kind}") for kind in ("win", "glob")}

    def _w(self, name: str) -> Bo:
        return self.npu.weights(name)

    def _gemm(self, io: Io, a: np.ndarray | None, weights: str, rows: int) -> np.ndarray:
        """Runs GEMM `io` (A set from `a` unless chained) and returns the first `rows` rows of C as float32."""
        if a is not None:
            io.set_a(a)
        self.npu.run(io, self._w(weights))
        return io.get_c_f32(rows)

    def prologue(self, pixels: np.ndarray) -> np.ndarray:
        """Patch embedding + position + LN_pre: x0 `[T, D]` float32, window order."""
        g = self.g
        y = self._gemm(self.embed, patches(pixels, g, self.perm), "v.embed", g.tokens)
        return hostmath.layer_norm(y + self.pos, *self.ln_pre, g.eps)

    def forward(self, pixels: np.ndarray, on_layer: Callable[[int], None] | None = None) -> np.ndarray:
        """The backbone's last hidden state, raster order `[T, D]` float32.

        Raises:
            ValueError: `pixels` is not `[3, S, S]`.
            NpuError: a kernel failed.
        """
        x = self.prologue(pixels)
        x = self._device_layers(x, on_layer) if self.g.device else self._host_layers(x, on_layer)
        out = np.empty_like(x)
        out[self.perm] = x
        return out

    def _host_layers(self, x: np.ndarray, on_layer: Callable[[int], None] | None) -> np.ndarray:
        g, t = self.g, self.tensors
        for i in range(g.layers):
            h = hostmath.layer_norm(x, t(f"v.{i}.ln1.w"), t(f"v.{i}.ln1.b"), g.eps)
            qkv = self._gemm(self.qkv, h, f"v.{i}.qkv", g.tokens)
            kind = "glob" if g.is_global(i) else "win"
            cos, sin = self.tables[kind]
            q = rope(qkv[:, :g.dim], cos, sin, g.heads)
            k = rope(qkv[:, g.dim:2 * g.dim], cos, sin, g.heads)
            v = qkv[:, 2 * g.dim:]
            m = self.mha[kind]
            if kind == "win":
                m.set_qkv(to_windows(q, g), to_windows(k, g), to_windows(v, g))
            else:
                m.set_qkv(q, k, v)
            self.npu.run_mha(m)
            o = from_bf16(m.get_o(g.tokens * g.dim))
            o = from_windows(o, g) if kind == "win" else o.reshape(g.tokens, g.dim)
            x = x + self._gemm(self.o, o, f"v.{i}.o", g.tokens)
            h = hostmath.layer_norm(x, t(f"v.{i}.ln2.w"), t(f"v.{i}.ln2.b"), g.eps)
            self.fc1.set_a(h)
            self.npu.run(self.fc1, self._w(f"v.{i}.fc1"))
            x = x + self._gemm(self.fc2, None, f"v.{i}.fc2", g.tokens) + t(f"v.{i}.fc2.b")
            if on_layer is not None:
                on_layer(i)
        return x

    def tensors(self, name: str) -> np.ndarray:
        """A float32 host tensor of the bundle."""
        return self.npu.bundle.tensors.get(name, "f32")

    def _device_layers(self, x0: np.ndarray, on_layer: Callable[[int], None] | None) -> np.ndarray:
        g, npu = self.g, self.npu
        if not g.res_f32:
            x0 = round_bf16(x0)
        h = hostmath.layer_norm(x0, np.float32(1), np.float32(0), g.eps)
        # The last forward's layers wrote v_qkv's A and residual 0 on the device after the host last synced them.
        # A sync first makes the host's copy the device's, so the writes below are newer data even where they
        # rewrite the same bytes (the emulator tells a host write from none only by a changed byte: docs/emulator.md).
        self.qkv.a.sync()
        self.xres[0].sync()
        self.qkv.set_a(h)
        push(x0.astype(np.float32), self.xres[0], dtype=None if g.res_f32 else BF16)
        qkv, o, fc1, fc2 = self.qkv, self.o, self.fc1, self.fc2
        r0, r1 = self.xres
        for i in range(g.layers):
            kind = "glob" if g.is_global(i) else "win"
            npu.run(qkv, self._w(f"v.{i}.qkv"))
            npu.run_args("rope", [qkv.c, self.rope_tab[kind], self.rope_out])
            npu.run_args(f"mha_{kind}", [self.rope_out, self.rope_out, qkv.c, o.a])
            npu.run(o, self._w(f"v.{i}.o"))
            npu.run_args("addln", [r0, o.c, r1, fc1.a])
            npu.run(fc1, self._w(f"v.{i}.fc1"))
            npu.run(fc2, self._w(f"v.{i}.fc2"))
            npu.run_args("addln", [r1, fc2.c, r0, qkv.a])
            if on_layer is not None:
                on_layer(i)
        if g.res_f32:
            return pull(r0, g.tokens * g.dim, np.float32).reshape(g.tokens, g.dim)
        return pull(r0, g.tokens * g.dim, np.float32, stored=BF16).reshape(g.tokens, g.dim)


# ---------------------------------------------------------------------------------------------
# the float32 reference: the same stage in numpy, on the weights as the bundle holds them


def gemm_weights(bundle: Bundle, key: str, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """GEMM `key`'s B operand `name` decoded to float32 `[K, N]` (and its bias row, if packed with one)."""
    s = bundle.gemms[key]
    return unpack_b(bundle.tensors.raw(name), s.k, s.n, s.tile_k, s.tile_n, s.ct_k, s.bias)


def reference_gemm(bundle: Bundle, key: str, name: str, a: np.ndarray) -> np.ndarray:
    """`act(a @ B + bias)` in float32 for GEMM `key` with operand `name`, the activation read from its stream."""
    b, bias = gemm_weights(bundle, key, name)
    y = np.asarray(a, np.float32) @ b
    if bias is not None:
        y = y + bias
    return kernels.apply_epilogue(y, kernels.epilogue_mode(bundle.insts_bytes(key)))


def reference(bundle: Bundle, pixels: np.ndarray) -> np.ndarray:
    """The ViT in float32 numpy over the bundle's weights (device bundles: LayerNorms without affine, as their
    affines are folded into the next GEMM, and RoPE from the device table): raster `[T, D]`."""
    g = Geometry(bundle)
    t = bundle.tensors
    perm = t.get("v.perm", "i32").astype(np.int64)
    y = reference_gemm(bundle, "v_embed", "v.embed", patches(pixels, g, perm))
    x = hostmath.layer_norm(y + t.get("v.pos", "f32").reshape(g.tokens, g.dim), t.get("v.ln_pre.w", "f32"),
                            t.get("v.ln_pre.b", "f32"), g.eps)
    tables = {kind: _reference_tables(bundle, g, kind) for kind in ("win", "glob")}
    for i in range(g.layers):
        h = _reference_ln(bundle, g, x, i, 1)
        qkv = reference_gemm(bundle, "v_qkv", f"v.{i}.qkv", h)
        cos, sin = tables["glob" if g.is_global(i) else "win"]
        q = rope(qkv[:, :g.dim], cos, sin, g.heads)
        k = rope(qkv[:, g.dim:2 * g.dim], cos, sin, g.heads)
        groups = 1 if g.is_global(i) else g.windows
        x = x + reference_gemm(bundle, "v_o", f"v.{i}.o", attention(q, k, qkv[:, 2 * g.dim:], g.heads, groups))
        h = _reference_ln(bundle, g, x, i, 2)
        x = x + reference_gemm(bundle, "v_fc2", f"v.{i}.fc2", reference_gemm(bundle, "v_fc1", f"v.{i}.fc1", h))
        if not g.device:
            x = x + t.get(f"v.{i}.fc2.b", "f32")
    out = np.empty_like(x)
    out[perm] = x
    return out


def _reference_ln(bundle: Bundle, g: Geometry, x: np.ndarray, layer: int, which: int) -> np.ndarray:
    if g.device:
        return hostmath.layer_norm(x, np.float32(1), np.float32(0), g.eps)
    t = bundle.tensors
    return hostmath.layer_norm(x, t.get(f"v.{layer}.ln{which}.w", "f32"), t.get(f"v.{layer}.ln{which}.b", "f32"),
                               g.eps)


def _reference_tables(bundle: Bundle, g: Geometry, kind: str) -> tuple[np.ndarray, np.ndarray]:
    if g.device:
        cos, sin = kernels.split_rope_table(bundle.tensors.raw(f"v.rope_tab.{kind}"), g.tokens, g.half)
        return cos, sin
    return host_rope_tables(bundle, g, kind)
