"""One `Sam3` used from several threads (docs/sam3-segment.md 10): every call gives exactly what the same call gives
alone, on a generated bundle on the emulator; the oracle is the same calls made one after another on another
object. And the image cache (10.2): an image with another image's file name, mtime and size, or another array's
shape and crc32, is served its own result."""

from __future__ import annotations

import os
import threading
import zlib

import numpy as np
import pytest
from PIL import Image

from sam3.build import build
from sam3.npu import NpuError
from sam3.pipeline import Sam3

THREADS = 8
CALLS = 10
PROMPTS = ("a cat", "dog", "a red car", "tree")


@pytest.fixture(scope="module", params=["device-f32", "host"])
def root(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("b") / request.param, "tiny", variant=request.param)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Five images of different sizes: three arrays and two files."""
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 256, (19 + 3 * i, 25 + 2 * i, 3), dtype=np.uint8) for i in range(5)]
    where = tmp_path_factory.mktemp("img")
    out: list[object] = []
    for i, rgb in enumerate(arrays):
        if i % 2:
            path = where / f"scene{i}.png"
            Image.fromarray(rgb).save(path)
            out.append(path)
        else:
            out.append(rgb)
    return out


def plan(images):
    """Per thread, its calls: (image index, prompt) pairs that switch images often, so the cache is contended."""
    rng = np.random.default_rng(11)
    return [[(int(rng.integers(len(images))), PROMPTS[int(rng.integers(len(PROMPTS)))]) for _ in range(CALLS)]
            for _ in range(THREADS)]


def same(a, b):
    """Exactly the same instances: queries, scores, boxes, masks, and the decoder's raw outputs."""
    return (np.array_equal(a.instances.queries, b.instances.queries)
            and np.array_equal(a.scores, b.scores) and np.array_equal(a.boxes, b.boxes)
            and np.array_equal(a.masks, b.masks)
            and np.array_equal(a.decoded.logits, b.decoded.logits)
            and np.array_equal(a.mask_logits.masks, b.mask_logits.masks))


def run_threads(target, count):
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def body(t):
        try:
            barrier.wait()
            target(t)
        except BaseException as e:  # reported by the test below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_threads_give_the_serial_results(root, images):
    calls = plan(images)
    with Sam3(root, "emu:npu4") as sam:
        want = {(i, p): sam.segment(images[i], p, threshold=0.0) for i in range(len(images)) for p in PROMPTS}
    got: list[list[object]] = [[None] * CALLS for _ in range(THREADS)]
    with Sam3(root, "emu:npu4") as sam:
        def work(t):
            for k, (i, p) in enumerate(calls[t]):
                # Odd threads pass an encoded prompt, even ones the text (encoded on the side thread or inline).
                prompt = sam.encode_prompt(p) if t % 2 else p
                got[t][k] = sam.segment(images[i], prompt, threshold=0.0)

        run_threads(work, THREADS)
    wrong = [(t, k, calls[t][k]) for t in range(THREADS) for k in range(CALLS)
             if not same(got[t][k], want[calls[t][k]])]
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} concurrent results differ from the serial ones: {wrong[:5]}"


def test_segment_many_from_threads(root, images):
    with Sam3(root, "emu:npu4") as sam:
        want = {(i, p): sam.segment(images[i], p) for i in range(len(images)) for p in PROMPTS}
    orders = [list(np.random.default_rng(t).permutation(len(images))) for t in range(4)]
    got: list[list[object]] = [[] for _ in orders]
    with Sam3(root, "emu:npu4") as sam:
        def work(t):
            got[t] = list(sam.segment_many([images[i] for i in orders[t]], list(PROMPTS)))

        run_threads(work, len(orders))
    for t, order in enumerate(orders):
        assert [item.index for item in got[t]] == list(range(len(order)))
        for item, i in zip(got[t], order, strict=True):
            assert item.ok
            assert [r.prompt for r in item.results] == list(PROMPTS)
            assert all(same(r, want[(int(i), r.prompt)]) for r in item.results)


def test_each_result_counts_only_its_own_npu_work(root, images):
    """The per-call accounting (npu seconds by kernel, loads, evictions) is the call's, not its neighbours'."""
    with Sam3(root, "emu:npu4") as sam:
        got: list[object] = [None] * THREADS

        def work(t):
            got[t] = sam.segment(images[t % 2] if t < 4 else images[2 + t % 3], PROMPTS[t % len(PROMPTS)])

        run_threads(work, THREADS)
        total = sum(sum(r.timing.npu.values()) for r in got)
        assert total == pytest.approx(sum(sam.npu.kernel_seconds.values()), rel=1e-9)


def crc32_twin(data: bytes, like: bytes, at: int) -> bytes:
    """`data` with its 4 bytes at `at` set so that its crc32 is `like`'s. crc32 is affine over GF(2): flipping bit b
    changes the checksum by a fixed 32-bit vector, so the bits to flip are the solution of a 32 x 32 linear system
    (solved here by elimination over the 32 bit vectors)."""
    base = bytearray(data)
    base[at:at + 4] = bytes(4)
    start, want = zlib.crc32(base), zlib.crc32(like)
    basis: list[tuple[int, int, int]] = []  # (pivot bit, vector, the data bits it combines), earlier pivots cleared
    for bit in range(32):
        probe = bytearray(base)
        probe[at + bit // 8] ^= 1 << (bit % 8)
        vector, combo = zlib.crc32(probe) ^ start, 1 << bit
        for pivot, v, c in basis:
            if vector >> pivot & 1:
                vector, combo = vector ^ v, combo ^ c
        if vector:
            basis.append((vector.bit_length() - 1, vector, combo))
    target, flips = want ^ start, 0
    for pivot, v, c in basis:
        if target >> pivot & 1:
            target, flips = target ^ v, flips ^ c
    assert target == 0  # 32 independent vectors: every checksum is reachable
    base[at:at + 4] = flips.to_bytes(4, "little")
    return bytes(base)


def test_an_array_with_the_same_shape_and_crc32_is_another_image(root):
    rng = np.random.default_rng(3)
    first = rng.integers(0, 256, (19, 25, 3), dtype=np.uint8)
    other = rng.integers(0, 256, first.shape, dtype=np.uint8)
    twin = np.frombuffer(crc32_twin(other.tobytes(), first.tobytes(), 0), np.uint8).reshape(first.shape)
    # The old key, (shape, crc32), is the same for both; the pixels are not.
    assert zlib.crc32(twin.tobytes()) == zlib.crc32(first.tobytes()) and not np.array_equal(twin, first)
    with Sam3(root, "emu:npu4") as sam:
        want = sam.segment(twin, "a cat", threshold=0.0)
    with Sam3(root, "emu:npu4") as sam:
        before = sam.segment(first, "a cat", threshold=0.0)
        after = sam.segment(twin, "a cat", threshold=0.0)
        again = sam.segment(twin.copy(), "a cat", threshold=0.0)
    assert not same(before, want)  # else serving the first image's result would go unseen
    assert "vit" in after.timing.stages and same(after, want)
    assert "vit" not in again.timing.stages and same(again, want)  # equal pixels: reused


def test_a_file_rewritten_with_its_size_and_mtime_kept_is_another_image(root, tmp_path):
    rng = np.random.default_rng(5)
    first, second = (rng.integers(0, 256, (19, 25, 3), dtype=np.uint8) for _ in range(2))
    path = tmp_path / "scene.png"
    Image.fromarray(first).save(path, compress_level=0)  # stored deflate blocks: the size depends on the size only
    st = os.stat(path)
    with Sam3(root, "emu:npu4") as sam:
        want = sam.segment(second, "dog", threshold=0.0)
    with Sam3(root, "emu:npu4") as sam:
        before = sam.segment(path, "dog", threshold=0.0)
        Image.fromarray(second).save(path, compress_level=0)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` or `rsync -t` leave it
        now = os.stat(path)
        # The old key, (path, mtime, size), is the same; the file is not.
        assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
        after = sam.segment(path, "dog", threshold=0.0)
    assert not same(before, want)
    assert "vit" in after.timing.stages and same(after, want)


def test_a_call_after_close_is_refused(root, images):
    sam = Sam3(root, "emu:npu4")
    sam.close()
    for call in (lambda: sam.segment(images[0], "cat"), lambda: sam.encode_prompt("cat"),
                 lambda: sam.encode_image(images[0]), lambda: list(sam.segment_many([images[0]], "cat"))):
        with pytest.raises(NpuError, match="^Sam3: closed$"):
            call()
