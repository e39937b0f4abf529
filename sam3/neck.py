"""The FPN neck: one NPU GEMM (`n_in`) for the three levels' first steps, `n_up` for level 0's second transposed
convolution, and the 3x3 convolutions as overlapping-row GEMMs; GELU and the pixel shuffles on the host
(docs/sam3-pipeline.md 3). Outputs are channels-last float32: `[(4g)^2, d]`, `[(2g)^2, d]`, `[g^2, d]`.
"""

from __future__ import annotations

import numpy as np

from sam3 import hostmath
from sam3.bundle import Bundle
from sam3.npu import Io, Npu, NpuError
from sam3.pack import ConvGeometry, conv_input, conv_output, from_bf16, round_bf16
from sam3.vit import gemm_weights, reference_gemm


def shuffle(y: np.ndarray, side: int, width: int) -> np.ndarray:
    """A 2x2 transposed convolution's output `[side^2, 4*width]` (tap-major, channel-minor columns) laid onto
    the doubled grid `[(2*side)^2, width]`: row (yy, xx) takes tap (yy % 2) * 2 + xx % 2 of cell (yy/2, xx/2)."""
    cells = y.reshape(side, side, 2, 2, width)
    return cells.transpose(0, 2, 1, 3, 4).reshape(4 * side * side, width)


class Splits:
    """The column split of `n_in`'s output (the `neck_splits` param) and the level widths."""

    def __init__(self, bundle: Bundle):
        p = bundle.params
        if len(p.neck_splits) != 3:
            raise NpuError(f"neck_splits must list 3 widths, got {p.neck_splits}")
        self.s0, self.s1, self.s2 = p.neck_splits
        self.d = p.d_model
        self.grid = p.grid
        self.mid = self.s0 // 4
        n_in, n_up = bundle.gemms["n_in"], bundle.gemms["n_up"]
        if n_in.n != self.s0 + self.s1 + self.s2 or self.s1 < 4 * self.d or self.s2 < self.d or self.s0 % 4:
            raise NpuError(f"n_in N={n_in.n} and neck_splits {p.neck_splits} do not fit d_model {self.d} "
                           "(N = s0+s1+s2, s1 >= 4d, s2 >= d, s0 % 4 == 0)", "n_in")
        if n_up.k != self.mid or n_up.n < 4 * self.d:
            raise NpuError(f"n_up K={n_up.k}, N={n_up.n}: needs K = s0/4 = {self.mid} and N >= 4d = {4 * self.d}",
                           "n_up")


def conv3x3(npu: Npu, convs: dict[int, Io], side: int, x: np.ndarray, weights: str, bias: str) -> np.ndarray:
    """3x3 convolution (zero padding 1) of a `[side^2, C]` map on the `conv` GEMM with bundle operand `weights`, plus
    the host bias tensor `bias`; `convs` keeps one operand set per map side, shared by the neck and the mask decoder.

    Raises:
        NpuError: the operand set kept for `side` is not a convolution's, or the kernel failed.
    """
    io = convs.get(side)
    if io is None:
        io = convs[side] = npu.conv_io("conv", side, side)
    geom = io.conv_geometry()
    io.set_a(conv_input(x.reshape(side, side, -1), geom, io.rows))
    npu.run(io, npu.weights(weights))
    b = npu.bundle.tensors.get(bias, "f32")
    out: np.ndarray = conv_output(io.get_c_f32(io.rows), geom, side, side).reshape(side * side, -1) + b
    return out


class Neck:
    """The neck on an `Npu`; its conv operand sets (one per map side) are shared with the mask decoder."""

    def __init__(self, npu: Npu, convs: dict[int, Io] | None = None):
        self.npu = npu
        self.s = Splits(npu.bundle)
        g = self.s.grid
        self.n_in = npu.io("n_in", g * g)
        self.n_up = npu.io("n_up", 4 * g * g)
        self.convs = convs if convs is not None else {}

    def conv(self, side: int, x: np.ndarray, weights: str, bias: str) -> np.ndarray:
        """3x3 convolution (zero padding 1) of a `[side^2, C]` map with bundle operand `weights` + host `bias`.

        Raises:
            NpuError: the operand set kept for `side` is not a convolution's, or the kernel failed.
        """
        return conv3x3(self.npu, self.convs, side, x, weights, bias)

    def forward(self, vit_out: np.ndarray) -> list[np.ndarray]:
        """The three levels from the ViT's raster output `[T, vit_dim]`."""
        s, g = self.s, self.s.grid
        self.n_in.set_a(vit_out)
        self.npu.run(self.n_in, self.npu.weights("n.in"))
        y = self.n_in.get_c_f32(g * g)
        lvl0 = round_bf16(hostmath.gelu_erf(round_bf16(shuffle(y[:, :s.s0], g, s.mid))))
        self.n_up.set_a(lvl0)
        self.npu.run(self.n_up, self.npu.weights("n.up"))
        up = self.n_up.get_c_f32(4 * g * g)[:, :4 * s.d]
        fpn0 = self.conv(4 * g, shuffle(up, 2 * g, s.d), "n.conv0", "n.conv0.b")
        fpn1 = self.conv(2 * g, shuffle(y[:, s.s0:s.s0 + 4 * s.d], g, s.d), "n.conv1", "n.conv1.b")
        fpn2 = self.conv(g, y[:, s.s0 + s.s1:s.s0 + s.s1 + s.d], "n.conv2", "n.conv2.b")
        return [fpn0, fpn1, fpn2]


def reference_conv(bundle: Bundle, x: np.ndarray, side: int, weights: str, bias: str) -> np.ndarray:
    """The 3x3 convolution in float32: the same overlapping-row GEMM over Y, computed by numpy."""
    spec = bundle.gemms["conv"]
    geom = ConvGeometry.of(spec.k, spec.lda, spec.n)
    rows = geom.rows(side, side, spec.m)
    y = from_bf16(conv_input(x.reshape(side, side, -1), geom, rows))
    b, packed_bias = gemm_weights(bundle, "conv", weights)
    # GEMM row r reads Y[r*lda : r*lda + K]: overlapping windows of one buffer, as the device's A views.
    a = np.lib.stride_tricks.as_strided(y, (rows, spec.k), (spec.lda * y.itemsize, y.itemsize), writeable=False)
    block = max(1, (1 << 22) // spec.k)  # rows per matmul: bounds the copy numpy makes of a strided operand
    c = np.concatenate([a[r:r + block] @ b for r in range(0, rows, block)])
    if packed_bias is not None:
        c = c + packed_bias
    out: np.ndarray = conv_output(c, geom, side, side).reshape(side * side, -1) + bundle.tensors.get(bias, "f32")
    return out


def reference(bundle: Bundle, vit_out: np.ndarray) -> list[np.ndarray]:
    """The neck in float32 numpy over the bundle's weights."""
    s = Splits(bundle)
    g = s.grid
    y = reference_gemm(bundle, "n_in", "n.in", vit_out)
    lvl0 = hostmath.gelu_erf(shuffle(y[:, :s.s0], g, s.mid))
    up = reference_gemm(bundle, "n_up", "n.up", lvl0)[:, :4 * s.d]
    return [reference_conv(bundle, shuffle(up, 2 * g, s.d), 4 * g, "n.conv0", "n.conv0.b"),
            reference_conv(bundle, shuffle(y[:, s.s0:s.s0 + 4 * s.d], g, s.d), 2 * g, "n.conv1", "n.conv1.b"),
            reference_conv(bundle, y[:, s.s0 + s.s1:s.s0 + s.s1 + s.d], g, "n.conv2", "n.conv2.b")]
