"""`Sam3.segment` and `sam3 segment` on a generated bundle on the emulator: the instances against the float32
pipeline computed in numpy, image reuse across prompts, the overlay file, `--json` round trips, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from sam3 import decoder, detr, mask, neck, post, preprocess, text, vit
from sam3.build import build
from sam3.bundle import Bundle
from sam3.cli import main
from sam3.pipeline import Sam3
from sam3.tokenizer import ClipTokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build(tmp_path_factory.mktemp("b") / "dev", "tiny", variant="device-f32")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    rgb = np.random.default_rng(0).integers(0, 256, (21, 27, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("img") / "scene.png"
    Image.fromarray(rgb).save(path)
    return path, rgb


def reference_scores(bundle, rgb, prompt):
    """Every query's score by the float32 numpy pipeline over the bundle's weights."""
    p = bundle.params
    pixels = preprocess.preprocess(rgb, p.image_size)
    levels = neck.reference(bundle, vit.reference(bundle, pixels))
    ids, m = ClipTokenizer.from_bundle(bundle).encode(prompt)
    feats = text.encode_text(ids, m, bundle.tensors, p)
    valid = m != 0
    enc = detr.reference(bundle, levels[2], feats, valid)
    dec = decoder.reference(bundle, enc, feats, valid)
    masks = mask.reference(bundle, dec.hidden, levels, enc, feats, valid)
    return post.scores(dec.logits, dec.presence), dec, masks


def test_segment_agrees_with_the_float32_pipeline(root, image):
    path, rgb = image
    with Bundle.open(root) as bundle:
        want, dec, masks = reference_scores(bundle, rgb, "a cat")
    with Sam3(root, "emu:npu4") as sam:
        result = sam.segment(path, "a cat", threshold=0.0)
    found = result.instances
    assert np.array_equal(found.queries, np.arange(len(want)))  # threshold 0: every query, in query order
    assert np.abs(found.scores - want).max() < 0.03
    h, w = rgb.shape[:2]
    assert found.masks.shape == (len(want), h, w)
    assert np.abs(found.boxes - dec.boxes * [w, h, w, h]).max() < 0.5  # boxes in pixels, within half a pixel
    cos = float(np.dot(result.mask_logits.masks.ravel(), masks.masks.ravel())
                / (np.linalg.norm(result.mask_logits.masks) * np.linalg.norm(masks.masks)))
    assert cos > 0.995


def test_a_second_prompt_reuses_the_image(root, image):
    path, _ = image
    with Sam3(root, "emu:npu4") as sam:
        first = sam.segment(path, "a cat")
        second = sam.segment(path, "a dog")
    assert "vit" in first.timing.stages and "neck" in first.timing.stages
    assert "vit" not in second.timing.stages and "neck" not in second.timing.stages
    assert "v_qkv" in first.timing.npu and "v_qkv" not in second.timing.npu
    assert set(second.timing.stages) >= {"text", "detr_enc", "detr_dec", "mask_dec", "post"}


def test_arrays_are_images_too(root, image):
    path, rgb = image
    with Sam3(root, "emu:npu4") as sam:
        from_file = sam.segment(path, "cat", threshold=0.0)
        from_array = sam.segment(rgb, "cat", threshold=0.0)
        with pytest.raises(preprocess.ImageError, match=r"uint8 \[H, W, 3\]"):
            sam.segment(rgb[..., 0], "cat")
        with pytest.raises(post.PostError, match="threshold must be a number in"):
            sam.segment(rgb, "cat", threshold=1.5)
    assert np.array_equal(from_file.instances.scores, from_array.instances.scores)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_segment_writes_the_overlay_and_json_round_trips(root, image, tmp_path, capsys):
    path, rgb = image
    overlay = tmp_path / "ov.png"
    code, out, _ = run(capsys, "segment", root, path, "a cat", "--threshold", "0", "-o", overlay, "--device", "emu",
                       "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["schema"] == 1 and doc["overlay"] == str(overlay)
    instances = doc["prompts"][0]["instances"]
    with Sam3(root, "emu:npu4") as sam:
        found = sam.segment(path, "a cat", threshold=0.0).instances
    assert [i["query"] for i in instances] == found.queries.tolist()
    decoded = np.stack([post.rle_decode(i["mask"]) for i in instances])
    assert np.array_equal(decoded, found.masks)
    assert [i["pixels"] for i in instances] == found.areas().tolist()
    written = np.asarray(Image.open(overlay).convert("RGB"))
    assert written.shape == rgb.shape
    assert np.array_equal(written, post.overlay(rgb, found))
    assert (written != rgb).any(axis=2)[found.masks.any(axis=0)].all()  # every masked pixel changed


def test_segment_table(root, image, capsys):
    path, _ = image
    code, out, _ = run(capsys, "segment", root, path, "a cat", "--device", "emu", "--reps", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(f"loaded {root} (") and "mode npu on emulator" in lines[0]
    assert lines[1].startswith("forward 0: ") and "stages: preprocess" in lines[1] and "; npu " in lines[1]
    assert lines[2].startswith("forward 1: ") and "contexts loaded 0, evicted 0" in lines[2]
    assert lines[3].startswith('"a cat": ') and lines[3].endswith("instance(s)")


def test_bad_input_is_one_line_and_exit_1(root, image, tmp_path, capsys):
    path, _ = image
    corrupt = tmp_path / "bad.png"
    corrupt.write_bytes(b"\x89PNG not really")
    for argv, text_ in (((root, tmp_path / "none.png", "cat"), "none.png"),
                        ((root, corrupt, "cat"), "bad.png"),
                        ((root, path, "   "), "empty")):
        code, out, err = run(capsys, "segment", *argv, "--device", "emu")
        assert code == 1 and len(err.strip().splitlines()) == 1 and text_ in err, err
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    index = (broken / "tensors.txt").read_text().splitlines()
    (broken / "tensors.txt").write_text("\n".join(x for x in index if not x.startswith("dec.presence_token ")) + "\n")
    code, out, err = run(capsys, "segment", broken, path, "cat", "--device", "emu")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "dec.presence_token" in err, err


def test_a_long_prompt_is_truncated_with_a_warning(root, image):
    import os
    import subprocess
    import sys
    from pathlib import Path

    path, _ = image
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "sam3", "segment", str(root), str(path), " ".join(["cat"] * 40),
                           "--device", "emu"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("sam3: warning: prompt ") and "truncated" in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_the_python_api(root, image):
    import sam3

    path, rgb = image
    with sam3.Sam3(root, device="emu") as sam:
        found = sam.segment(path, "a cat", threshold=0.0)
    assert len(found) == found.scores.shape[0] == found.boxes.shape[0] == found.masks.shape[0] > 0
    assert found.masks.dtype == bool and found.masks.shape[1:] == rgb.shape[:2]
    assert found.boxes.shape[1] == 4 and found.scores.dtype == np.float32
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        sam3.Nope  # noqa: B018
