"""sam3.rle: COCO's compressed run-length strings against masks whose runs and strings were worked out by hand
(docs/sam3-segment.md 5), round trips, and every refused input."""

from __future__ import annotations

import numpy as np
import pytest

from sam3 import post, rle


def column_major(h: int, w: int, on: list[tuple[int, int]]) -> np.ndarray:
    """An h x w mask whose pixels at column-major positions [a, b) are on, for each (a, b)."""
    flat = np.zeros(h * w, dtype=bool)
    for a, b in on:
        flat[a:b] = True
    return flat.reshape((h, w), order="F")


# 4 rows x 3 columns. Read down the columns: 0 1 0 0 | 1 1 1 0 | 0 0 1 1, so the runs are
# off 1, on 1, off 2, on 3, off 3, on 2. Stored: 1, 1, 2, then 3-1 = 2, 3-2 = 1, 2-3 = -1. Each fits one character:
# chr(48 + v) for 0 <= v < 16, and -1 is the 5-bit group 31 with the sign bit set: chr(48 + 31) = 'O'.
HAND_4X3 = np.array([[0, 1, 0],
                     [1, 1, 0],
                     [0, 1, 1],
                     [0, 0, 1]], dtype=bool)


def test_a_hand_made_4x3_mask():
    assert post.rle_encode(HAND_4X3)["counts"] == [1, 1, 2, 3, 3, 2]
    assert rle.encode(HAND_4X3) == {"size": [4, 3], "counts": "11221O"}
    assert np.array_equal(rle.decode({"size": [4, 3], "counts": "11221O"}), HAND_4X3)
    assert rle.area({"size": [4, 3], "counts": "11221O"}) == 6 == int(HAND_4X3.sum())


def test_values_of_two_characters_and_negative_ones():
    # runs 5, 50, 5, 10, 30 of a 10 x 10 mask. Stored 5, 50, 5, 10-50 = -40, 30-5 = 25.
    # 50 = 18 + 1*32: group 18 (bit 0x10 set, so a second group is needed even though 50 >> 5 = 1 is positive),
    #   chr(48 + 18 + 32) = 'b', then chr(48 + 1) = '1'.
    # -40 = 24 + (-2)*32: group 24 (bit 0x10 set, rest -2 != -1: more), chr(48 + 24 + 32) = 'h'; then -2 = 30 + (-1)*32:
    #   group 30 (sign bit set, rest -1: last), chr(48 + 30) = 'N'.
    # 25: group 25 has bit 0x10 set but the value is positive: more, chr(48 + 25 + 32) = 'i', then '0'.
    mask = column_major(10, 10, [(5, 55), (60, 70)])
    assert post.rle_encode(mask)["counts"] == [5, 50, 5, 10, 30]
    assert rle.encode(mask) == {"size": [10, 10], "counts": "5b15hNi0"}
    assert np.array_equal(rle.decode(rle.encode(mask)), mask)
    # a first pixel on: the runs start with an off run of 0. 40 = 8 + 1*32 -> 'X' '1'; 60 = 28 + 1*32 -> 'l' '1'.
    first_on = column_major(10, 10, [(0, 40)])
    assert rle.encode(first_on)["counts"] == "0X1l1"
    assert rle.string_to_counts("0X1l1").tolist() == [0, 40, 60]


def test_empty_and_full_masks():
    # one off run of 21: group 21 has bit 0x10 set while the value is positive, so a second group follows:
    # chr(48 + 21 + 32) = 'e', then '0'. All on: an off run of 0, then 4.
    assert rle.encode(np.zeros((3, 7), dtype=bool)) == {"size": [3, 7], "counts": "e0"}
    assert rle.encode(np.ones((2, 2), dtype=bool)) == {"size": [2, 2], "counts": "04"}


def test_random_masks_round_trip_and_match_the_uncompressed_runs():
    rng = np.random.default_rng(7)
    for h, w, p in ((1, 1, 0.5), (1, 300, 0.5), (257, 3, 0.02), (64, 80, 0.5), (120, 90, 0.995)):
        mask = rng.random((h, w)) < p
        blob = np.zeros((h, w), dtype=bool)
        blob[h // 3:, w // 4:] = True  # long runs: several characters per value
        for m in (mask, blob, mask ^ blob):
            enc = rle.encode(m)
            assert enc["size"] == [h, w] and isinstance(enc["counts"], str)
            assert rle.string_to_counts(enc["counts"]).tolist() == post.rle_encode(m)["counts"]
            assert np.array_equal(rle.decode(enc), m)
            assert rle.area(enc) == int(m.sum())


def test_decode_takes_the_uncompressed_form_too():
    assert np.array_equal(rle.decode({"size": [4, 3], "counts": [1, 1, 2, 3, 3, 2]}), HAND_4X3)
    assert rle.decompress({"size": [4, 3], "counts": "11221O"}) == {"size": [4, 3], "counts": [1, 1, 2, 3, 3, 2]}


def test_large_values_take_as_many_characters_as_they_need():
    counts = np.array([0, 1 << 20, 3, (1 << 20) - 7, 1 << 30, 12])
    text = rle.counts_to_string(counts)
    assert rle.string_to_counts(text).tolist() == counts.tolist()
    # 1 << 20 = group 0 four times, then 1: five characters '0' + 32 ('P') x 4, then '1'.
    assert text.startswith("0PPPP1")


@pytest.mark.parametrize(("counts", "message"), [
    ("11221O!", r"character b'!' at 6 is not one of '0'..'o'"),
    ("11p", r"character b'p' at 2"),
    ("11b", "ends inside a value"),
    ("1O", "run 1 decodes to -1"),
    ("P" * 12 + "0", "longer than 12 characters"),
])
def test_bad_strings_are_refused(counts, message):
    with pytest.raises(rle.RleError, match=message):
        rle.string_to_counts(counts)


def test_bad_masks_and_sizes_are_refused():
    with pytest.raises(post.PostError, match=r"counts sum to 12, size 4x4 has 16 pixels"):
        rle.decode({"size": [4, 4], "counts": "11221O"})
    with pytest.raises(rle.RleError, match="expected a dict with 'size' and 'counts'"):
        rle.decode("11221O")  # type: ignore[arg-type]
    with pytest.raises(post.PostError, match=r"mask must be \[H, W\]"):
        rle.encode(np.zeros((2, 2, 2), dtype=bool))
    with pytest.raises(rle.RleError, match="non-negative integers"):
        rle.counts_to_string([3, -1])
    with pytest.raises(rle.RleError, match="non-negative integers"):
        rle.counts_to_string([1.5])
