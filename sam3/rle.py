"""COCO's compressed run-length encoding of a mask: `{"size": [h, w], "counts": "<string>"}` (docs/sam3-segment.md 5).

The runs are those of `post.rle_encode` (column-major, alternating off / on, starting with off). The string
form writes each run, from the fourth on as its difference from the run two before, in 5-bit groups, least
significant first, one character per group: `chr(48 + group)`, with 0x20 added when another group follows;
the last group's bit 0x10 is the sign. `compress` / `decompress` convert between the two forms over whole
arrays (one pass per group position, never per run); `encode` / `decode` go from and to a mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from sam3 import post

_BASE = 48  # '0': the character of group value 0 (docs/sam3-segment.md 5)
_BITS = 5  # value bits per character
_MORE = 0x20  # another character follows
_SIGN = 0x10  # in the last character: the value is negative
# Groups per value this module reads and writes: 60 bits, far above any run of a mask that fits in memory.
_MAX_GROUPS = 12


class RleError(post.PostError):
    """A run-length encoding that cannot be read: names the field, what was expected and what was found."""


def deltas(counts: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The values the string stores: the first three runs as they are, each later run minus the run two before."""
    c = np.asarray(counts, dtype=np.int64)
    d = c.copy()
    d[3:] -= c[1:-2]
    return d


def undelta(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The runs back from `deltas`: from the third run on, every second run is a running sum of its values."""
    c = values.copy()
    c[1::2] = np.cumsum(values[1::2])
    c[2::2] = np.cumsum(values[2::2])
    return c


def counts_to_string(counts: npt.ArrayLike) -> str:
    """The COCO string of run lengths `counts` (non-negative integers; an empty list gives '').

    Raises:
        RleError: `counts` is not a 1-D sequence of non-negative integers below 2^59.
    """
    c = np.asarray(counts)
    if c.ndim != 1 or (c.size and (c.dtype.kind not in "iu" or c.min() < 0 or c.max() >= 1 << 59)):
        raise RleError(f"counts must be non-negative integers below 2^59, got {np.asarray(counts)!r:.80}")
    x = deltas(c)
    if x.size == 0:
        return ""
    shifts = np.arange(_MAX_GROUPS, dtype=np.int64) * _BITS
    groups = (x[:, None] >> shifts) & 0x1F  # arithmetic shift: a negative value's high groups are all ones
    # A value needs k groups when it fits k * 5 bits in two's complement: -16 * 32^(k-1) <= x < 16 * 32^(k-1).
    limit = np.int64(16) << (shifts[:-1])
    need = 1 + ((x[:, None] >= limit) | (x[:, None] < -limit)).sum(axis=1)
    used = np.arange(_MAX_GROUPS)[None, :] < need[:, None]
    more = np.arange(_MAX_GROUPS)[None, :] < (need - 1)[:, None]
    chars = (groups | np.where(more, _MORE, 0)) + _BASE
    text: str = chars[used].astype(np.uint8).tobytes().decode("ascii")
    return text


def string_to_counts(text: str | bytes) -> npt.NDArray[np.int64]:
    """The run lengths of a COCO string.

    Raises:
        RleError: a character outside '0'..'o', a string ending inside a value, a value longer than 12 characters,
            or a run that decodes negative.
    """
    raw = text.encode("ascii", "replace") if isinstance(text, str) else bytes(text)
    c = np.frombuffer(raw, dtype=np.uint8).astype(np.int64) - _BASE
    if c.size == 0:
        return np.zeros(0, dtype=np.int64)
    bad = (c < 0) | (c > 0x3F)
    if bad.any():
        at = int(np.argmax(bad))
        raise RleError(f"counts: character {raw[at:at + 1]!r} at {at} is not one of '0'..'o'")
    last = (c & _MORE) == 0
    if not last[-1]:
        raise RleError(f"counts: the string ends inside a value (its last character {raw[-1:]!r} says more follows)")
    ends = np.flatnonzero(last)
    starts = np.concatenate([[0], ends[:-1] + 1])
    value_of = np.repeat(np.arange(ends.size), ends - starts + 1)
    position = np.arange(c.size) - starts[value_of]
    if int(position.max()) >= _MAX_GROUPS:
        raise RleError(f"counts: a value longer than {_MAX_GROUPS} characters ({_MAX_GROUPS * _BITS} bits) is refused")
    x = np.add.reduceat((c & 0x1F) << (position * _BITS), starts)
    width = (ends - starts + 1) * _BITS
    negative = (c[ends] & _SIGN) != 0
    x = np.where(negative, x - (np.int64(1) << width), x)
    counts = undelta(x)
    if (counts < 0).any():
        at = int(np.argmax(counts < 0))
        raise RleError(f"counts: run {at} decodes to {int(counts[at])}, a run length cannot be negative")
    return counts


def compress(rle: dict[str, Any]) -> dict[str, Any]:
    """An uncompressed RLE (`counts` a list of integers) as COCO's compressed one (`counts` a string)."""
    return {"size": [int(v) for v in rle["size"]], "counts": counts_to_string(rle["counts"])}


def decompress(rle: dict[str, Any]) -> dict[str, Any]:
    """A compressed RLE as the uncompressed form (`counts` a list of integers); an uncompressed one is returned as
    a copy.

    Raises:
        RleError: not a dict with `size` and `counts`, or a string `string_to_counts` refuses.
    """
    if not isinstance(rle, dict) or "size" not in rle or "counts" not in rle:
        raise RleError(f"rle: expected a dict with 'size' and 'counts', got {type(rle).__name__}")
    counts = rle["counts"]
    if isinstance(counts, (str, bytes)):
        counts = string_to_counts(counts).tolist()
    return {"size": rle["size"], "counts": list(counts)}


def encode(mask: np.ndarray) -> dict[str, Any]:
    """A mask `[h, w]` as COCO's compressed RLE `{"size": [h, w], "counts": str}`.

    Raises:
        PostError: `mask` is not a 2-D array with no zero axis.
    """
    return compress(post.rle_encode(mask))


def decode(rle: dict[str, Any]) -> npt.NDArray[np.bool_]:
    """The bool mask `[h, w]` of a COCO RLE, compressed (`counts` a string) or not (a list).

    Raises:
        RleError / PostError: a malformed string, a size that is not two positive integers, or counts that do not
            sum to h * w.
    """
    mask: npt.NDArray[np.bool_] = post.rle_decode(decompress(rle))
    return mask


def area(rle: dict[str, Any]) -> int:
    """Pixels on in a COCO RLE (the sum of its odd runs), without decoding the mask."""
    counts = np.asarray(decompress(rle)["counts"], dtype=np.int64)
    return int(counts[1::2].sum())
