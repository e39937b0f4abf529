"""Convolutions the tracker's neck and decoder share, on channels-last float32 maps with torch-layout weights.

Each is a few whole-map matrix products (no loop over pixels): a 1x1 is one, a 3x3 nine shifted ones, a stride-2
2x2 transposed convolution one product whose four taps are then interleaved onto the doubled grid.
"""

from __future__ import annotations

import numpy as np

from sam3 import hostmath
from sam3.tracker_config import F32Array

_F32 = np.float32


def conv1x1(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> F32Array:
    """A 1x1 convolution of `[..., Cin]` with a torch weight `[Cout, Cin, 1, 1]`."""
    return hostmath.linear(x, weight.reshape(weight.shape[0], -1), bias)


def conv3x3(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> F32Array:
    """A 3x3 convolution, zero padding 1, of `[H, W, Cin]` with a torch weight `[Cout, Cin, 3, 3]`: `[H, W, Cout]`,
    as nine shifted matrix products over the whole map."""
    h, w, _ = x.shape
    padded = np.pad(np.asarray(x, dtype=_F32), ((1, 1), (1, 1), (0, 0)))
    out = np.broadcast_to(np.asarray(bias, dtype=_F32), (h, w, weight.shape[0])).copy()
    for dy in range(3):
        for dx in range(3):
            out += padded[dy:dy + h, dx:dx + w] @ weight[:, :, dy, dx].T
    return out


def conv_transpose2x2(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> F32Array:
    """A stride-2, 2x2 transposed convolution of a channels-last map `[H, W, Cin]` with a torch weight
    `[Cin, Cout, 2, 2]`: `[2H, 2W, Cout]`, output (2y + dy, 2x + dx) = in(y, x) @ weight[:, :, dy, dx] + bias."""
    h, wd, cin = x.shape
    cout = weight.shape[1]
    taps = np.asarray(x, dtype=_F32).reshape(h * wd, cin) @ weight.reshape(cin, cout * 4)
    cells = taps.reshape(h, wd, cout, 2, 2).transpose(0, 3, 1, 4, 2)
    out: F32Array = cells.reshape(2 * h, 2 * wd, cout) + bias
    return out
