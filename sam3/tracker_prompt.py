"""The tracker's prompt encoder on the host: points and a box to sparse tokens, the no-mask dense embedding, and
the image-wide positional encoding (docs/sam3-tracker.md 3).

Coordinates are pixels of the square model frame (`image_size`), pixel centres at +0.5. Every position is encoded
with the random-Fourier features of a `[2, width/2]` Gaussian matrix: `[sin(2*pi*(2u-1) @ G), cos(...)]` for `u`
the position divided by the frame size.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sam3.tracker_config import MODEL, F32Array, TrackerConfig, TrackerError, tensor

_F32 = np.float32
PE = MODEL + "prompt_encoder."
LABEL_NOT_A_POINT = -1      # a token with no position: the not-a-point embedding
LABEL_PAD = -10             # a padding token: all zeros
BOX_CORNERS = (2, 3)        # the point-embedding rows added to a box's top-left and bottom-right corners


def fourier(unit: np.ndarray, gauss: np.ndarray) -> F32Array:
    """Random-Fourier features of positions `unit` `[..., 2]` in [0, 1]: `[..., 2 * gauss.shape[1]]`."""
    proj = (_F32(2) * np.asarray(unit, dtype=_F32) - _F32(1)) @ gauss
    proj = proj * _F32(2 * np.pi)
    out: F32Array = np.concatenate([np.sin(proj), np.cos(proj)], axis=-1)
    return out


def _gauss(weights: Mapping[str, np.ndarray], cfg: TrackerConfig, name: str) -> F32Array:
    return tensor(weights, name, (2, cfg.width // 2))


def image_pe(weights: Mapping[str, np.ndarray], cfg: TrackerConfig) -> F32Array:
    """The image-wide positional encoding `[grid^2, width]` in raster order: each cell's centre, (x, y) over the
    grid side, through the model's own Fourier matrix (`shared_image_embedding`)."""
    g = cfg.grid
    centre = (np.arange(g, dtype=_F32) + _F32(0.5)) / _F32(g)
    xy = np.stack(np.broadcast_arrays(centre[None, :], centre[:, None]), axis=-1).reshape(g * g, 2)
    return fourier(xy, _gauss(weights, cfg, MODEL + "shared_image_embedding.positional_embedding"))


def model_frame(xy: np.ndarray, width: int, height: int, image_size: int) -> F32Array:
    """Image pixel coordinates `[..., 2]` (x, y) scaled to the square model frame, unrounded."""
    scale = np.array([image_size / width, image_size / height], dtype=_F32)
    out: F32Array = np.asarray(xy, dtype=_F32) * scale
    return out


def _frame_pe(weights: Mapping[str, np.ndarray], cfg: TrackerConfig, xy: np.ndarray) -> F32Array:
    unit = (np.asarray(xy, dtype=_F32) + _F32(0.5)) / _F32(cfg.image_size)
    return fourier(unit, _gauss(weights, cfg, PE + "shared_embedding.positional_embedding"))


def embed_points(weights: Mapping[str, np.ndarray], cfg: TrackerConfig, points: np.ndarray, labels: np.ndarray,
                 pad: bool) -> F32Array:
    """Point tokens `[n (+1), width]`: each point's Fourier features plus the embedding row of its label (0, 1;
    2 and 3 are the box corners'); label -1 is the not-a-point embedding alone, -10 all zeros. `pad` appends one
    not-a-point token, as a prompt without a box has."""
    pts = np.asarray(points, dtype=_F32).reshape(-1, 2)
    lab = np.asarray(labels, dtype=np.int64).reshape(-1)
    if pad:
        pts = np.concatenate([pts, np.zeros((1, 2), _F32)])
        lab = np.concatenate([lab, [LABEL_NOT_A_POINT]])
    table = tensor(weights, PE + "point_embed.weight", (-1, cfg.width))
    not_a_point = tensor(weights, PE + "not_a_point_embed.weight", (1, cfg.width))
    if np.any((lab >= len(table)) | ((lab < 0) & (lab != LABEL_NOT_A_POINT) & (lab != LABEL_PAD))):
        raise TrackerError(f"point labels must be 0..{len(table) - 1}, {LABEL_NOT_A_POINT} or {LABEL_PAD}, "
                           f"got {lab.tolist()}")
    emb = np.where((lab == LABEL_NOT_A_POINT)[:, None], not_a_point, _frame_pe(weights, cfg, pts))
    emb = np.where((lab == LABEL_PAD)[:, None], _F32(0), emb)
    out: F32Array = emb + table[np.maximum(lab, 0)] * (lab >= 0)[:, None].astype(_F32)
    return out


def embed_box(weights: Mapping[str, np.ndarray], cfg: TrackerConfig, box: np.ndarray) -> F32Array:
    """Box tokens `[3, width]`: the two corners' Fourier features plus the corner embeddings, then a not-a-point."""
    corners = _frame_pe(weights, cfg, np.asarray(box, dtype=_F32).reshape(2, 2))
    table = tensor(weights, PE + "point_embed.weight", (-1, cfg.width))
    corners = corners + table[list(BOX_CORNERS)]
    not_a_point = tensor(weights, PE + "not_a_point_embed.weight", (1, cfg.width))
    out: F32Array = np.concatenate([corners, not_a_point])
    return out


def sparse(weights: Mapping[str, np.ndarray], cfg: TrackerConfig, points: np.ndarray | None,
           labels: np.ndarray | None, box: np.ndarray | None) -> F32Array:
    """The prompt tokens `[N, width]`: the points (plus one not-a-point when there is no box), then the box's three.

    Points and box are in model-frame pixels. A prompt with neither is one not-a-point point, padded (2 tokens).

    Raises:
        TrackerError: points without labels (or of another count), or a label out of range.
    """
    parts = []
    if points is not None and len(np.asarray(points).reshape(-1, 2)):
        if labels is None or np.asarray(labels).size != np.asarray(points).size // 2:
            raise TrackerError("every point needs one label")
        parts.append(embed_points(weights, cfg, points, labels, pad=box is None))
    elif box is None:
        parts.append(embed_points(weights, cfg, np.zeros((1, 2), _F32), np.array([LABEL_NOT_A_POINT]), pad=True))
    if box is not None:
        parts.append(embed_box(weights, cfg, box))
    out: F32Array = np.concatenate(parts)
    return out


def dense(weights: Mapping[str, np.ndarray], cfg: TrackerConfig) -> F32Array:
    """The dense prompt without a mask input: the no-mask embedding at every cell, `[grid^2, width]` raster."""
    row = tensor(weights, PE + "no_mask_embed.weight", (1, cfg.width))
    out: F32Array = np.broadcast_to(row, (cfg.grid * cfg.grid, cfg.width)).copy()
    return out
