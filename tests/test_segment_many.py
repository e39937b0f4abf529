"""`sam3 segment BUNDLE IMAGES... --prompt P` and `Sam3.segment_many`: a folder of the fixture's images plus a
corrupt one on a generated tiny bundle on the emulator. Oracles: single-image `sam3 segment --json -o` runs of the
same images (instances, masks, overlays), `rle` (tested against hand-computed strings in test_rle.py), counts of
forwards, and what a terminal and a pipe receive."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fixture_files import SAM3_TINY
from PIL import Image

from sam3 import many, post, preprocess, rle, vit
from sam3.build import build
from sam3.cli import main
from sam3.pipeline import Sam3

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a cat", "dog"]
THRESHOLD = "0.25"
GOOD = ("scene.jpg", "shapes.png")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build(tmp_path_factory.mktemp("b") / "dev", "tiny", variant="device-f32")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cases = SAM3_TINY / "cases"
    if not all((cases / n).is_file() for n in GOOD):
        pytest.skip(f"fixture images {cases} absent (tests/fixtures incomplete in this checkout)")
    out = tmp_path_factory.mktemp("images")
    for name in GOOD:
        shutil.copy(cases / name, out / name)
    (out / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n but not really")
    (out / "notes.txt").write_text("not an image: a directory gives only its .jpg/.jpeg/.png files\n")
    return out


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def many_argv(root, *images, prompts=PROMPTS):
    return ["segment", root, *images, *(x for p in prompts for x in ("--prompt", p)), "--threshold", THRESHOLD,
            "--device", "emu"]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def quiet_main(*argv):
    """`main` with its stdout and stderr captured (for module-scope fixtures, where capsys is not)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def single(root, folder, tmp_path_factory):
    """Each good image through the one-image form: its --json document and its -o overlay."""
    out = tmp_path_factory.mktemp("single")
    docs = {}
    for name in GOOD:
        overlay = out / f"{name}.png"
        code, stdout, _ = quiet_main("segment", root, folder / name, *PROMPTS, "--threshold", THRESHOLD, "-o", overlay,
                                     "--device", "emu", "--json")
        assert code == 0
        docs[name] = (json.loads(stdout), np.asarray(Image.open(overlay).convert("RGB")))
    return docs


@pytest.fixture(scope="module")
def batch(root, folder, tmp_path_factory):
    """The folder through the many-image form once, with every output."""
    out = tmp_path_factory.mktemp("many")
    code, stdout, stderr = quiet_main(*many_argv(root, folder), "--jsonl", out / "r.jsonl", "--coco", out / "r.json",
                                      "--out", out / "ov")
    return code, stdout, stderr, out


def test_every_good_image_equals_its_single_image_run(batch, single, folder):
    code, _, _, out = batch
    assert code == 1  # the corrupt image
    records = read_jsonl(out / "r.jsonl")
    ok = [r for r in records if r["ok"]]
    assert [(Path(r["image"]).name, r["prompt"]) for r in ok] == [(n, p) for n in GOOD for p in PROMPTS]
    assert sum(len(r["instances"]) for r in ok) > 2  # the threshold lets some through: the comparison means something
    for r in ok:
        doc, _ = single[Path(r["image"]).name]
        (want,) = [p for p in doc["prompts"] if p["prompt"] == r["prompt"]]
        got = r["instances"]
        assert [i["query"] for i in got] == [i["query"] for i in want["instances"]]
        assert [i["score"] for i in got] == [i["score"] for i in want["instances"]]
        assert [i["box"] for i in got] == [i["box"] for i in want["instances"]]
        assert [i["pixels"] for i in got] == [i["pixels"] for i in want["instances"]]
        for g, w in zip(got, want["instances"], strict=True):
            assert isinstance(g["mask"]["counts"], str)
            assert np.array_equal(rle.decode(g["mask"]), post.rle_decode(w["mask"]))
        assert r["category_id"] == PROMPTS.index(r["prompt"]) + 1
        with Image.open(r["image"]) as img:
            assert [r["width"], r["height"]] == list(img.size)


def test_the_overlays_equal_the_single_image_overlays(batch, single):
    _, _, _, out = batch
    assert sorted(p.name for p in (out / "ov").iterdir()) == ["scene.png", "shapes.png"]  # none for bad.png
    for name in GOOD:
        written = np.asarray(Image.open(out / "ov" / f"{Path(name).stem}.png").convert("RGB"))
        assert np.array_equal(written, single[name][1])


def test_the_coco_file_is_the_instances_in_the_results_format(batch, single):
    _, _, _, out = batch
    entries = json.loads((out / "r.json").read_text())
    # image ids: the sorted folder's positions from 1 (bad.png, scene.jpg, shapes.png); categories: the prompts'.
    ids = {"scene.jpg": 2, "shapes.png": 3}
    want = []
    for name in GOOD:
        doc, _ = single[name]
        for k, p in enumerate(doc["prompts"]):
            for i in p["instances"]:
                want.append((ids[name], k + 1, i))
    assert len(entries) == len(want) > 0
    for e, (image_id, category, inst) in zip(entries, want, strict=True):
        assert set(e) == {"image_id", "category_id", "segmentation", "bbox", "score"}
        assert (e["image_id"], e["category_id"], e["score"]) == (image_id, category, inst["score"])
        assert np.array_equal(rle.decode(e["segmentation"]), post.rle_decode(inst["mask"]))
        h, w = e["segmentation"]["size"]
        x0, y0, x1, y1 = inst["box"]
        x0, x1 = min(max(x0, 0), w), min(max(x1, 0), w)
        y0, y1 = min(max(y0, 0), h), min(max(y1, 0), h)
        assert e["bbox"] == pytest.approx([x0, y0, x1 - x0, y1 - y0], abs=1e-9)


def test_the_corrupt_image_is_reported_and_the_others_done(batch, folder):
    code, stdout, stderr, out = batch
    records = read_jsonl(out / "r.jsonl")
    (bad,) = [r for r in records if not r["ok"]]
    assert bad["image"] == str(folder / "bad.png") and bad["prompt"] is None and "bad.png" in bad["error"]
    assert not any("notes.txt" in r["image"] for r in records)
    stdout = stdout.splitlines()
    assert f"{folder / 'bad.png'}: FAILED: {bad['error']}" in stdout
    assert any(t.startswith("3 of 3 image(s) in ") and "2 segmented, 1 failed, 0 skipped" in t for t in stdout)
    assert f"failed: {folder / 'bad.png'}: {bad['error']}" in stdout
    assert stderr.splitlines() == ["sam3 segment: 1 of 3 image(s) failed"]
    assert code == 1


def count_forwards(monkeypatch):
    """Counts image-encoder forwards: the work an image costs."""
    seen = []
    real = vit.Vit.forward

    def counting(self, pixels):
        seen.append(1)
        return real(self, pixels)

    monkeypatch.setattr(vit.Vit, "forward", counting)
    return seen


def test_resume_does_no_work_the_second_time(root, folder, tmp_path, capsys, monkeypatch):
    forwards = count_forwards(monkeypatch)
    outputs = ["--jsonl", tmp_path / "r.jsonl", "--coco", tmp_path / "r.json"]
    code, _, _ = run(capsys, *many_argv(root, folder), *outputs)
    assert code == 1 and len(forwards) == 2
    first, first_coco = read_jsonl(tmp_path / "r.jsonl"), json.loads((tmp_path / "r.json").read_text())
    code, out, _ = run(capsys, *many_argv(root, folder), *outputs, "--resume")
    assert len(forwards) == 2  # none more: both good images were done; the corrupt one fails before any forward
    assert code == 1 and "0 segmented, 1 failed, 2 skipped as done" in out
    again = read_jsonl(tmp_path / "r.jsonl")
    assert [r for r in again if r["ok"]] == [r for r in first if r["ok"]]
    assert json.loads((tmp_path / "r.json").read_text()) == first_coco
    # an interrupted run's file: the last image's lines gone, a half-written line left: only that image runs again
    kept = [json.dumps(r) for r in first if r["ok"] and not r["image"].endswith("shapes.png")]
    (tmp_path / "r.jsonl").write_text("\n".join(kept) + '\n{"image": "cut sh')
    code, out, _ = run(capsys, *many_argv(root, folder), *outputs, "--resume")
    assert code == 1 and len(forwards) == 3 and "1 segmented, 1 failed, 1 skipped as done" in out

    def timeless(records):
        return sorted(json.dumps({k: v for k, v in r.items() if k != "ms"}) for r in records if r["ok"])

    assert timeless(read_jsonl(tmp_path / "r.jsonl")) == timeless(first)
    # other inputs against the same file: an image id the file gives another image is refused
    code, _, err = run(capsys, *many_argv(root, folder / "shapes.png", folder / "bad.png"), *outputs, "--resume")
    assert code == 1 and err.startswith(f"sam3 segment: --resume: image id 2 of {folder / 'bad.png'} is "
                                        f"{folder / 'scene.jpg'}'s in ") and "resume with the same inputs" in err


def test_ctrl_c_keeps_what_is_done_and_exits_130(root, folder, tmp_path, capsys, monkeypatch):
    real = Sam3.segment

    def interrupted(self, image, prompt, *args):
        if str(image).endswith("shapes.png"):
            raise KeyboardInterrupt
        return real(self, image, prompt, *args)

    monkeypatch.setattr(Sam3, "segment", interrupted)
    outputs = ["--jsonl", tmp_path / "r.jsonl", "--coco", tmp_path / "r.json"]
    code, out, err = run(capsys, *many_argv(root, folder), *outputs)
    assert code == 130 and err.strip().splitlines()[-1] == "sam3 segment: interrupted"
    assert "; interrupted" in out and "1 segmented, 1 failed" in out
    records = read_jsonl(tmp_path / "r.jsonl")
    assert [(Path(r["image"]).name, r["prompt"]) for r in records] == [("bad.png", None),
                                                                       *(("scene.jpg", p) for p in PROMPTS)]
    entries = json.loads((tmp_path / "r.json").read_text())  # the array was closed
    assert len(entries) == sum(len(r["instances"]) for r in records if r["ok"])
    monkeypatch.setattr(Sam3, "segment", real)
    forwards = count_forwards(monkeypatch)
    code, out, _ = run(capsys, *many_argv(root, folder), *outputs, "--resume")
    assert code == 1 and len(forwards) == 1 and "1 segmented, 1 failed, 1 skipped as done" in out


def test_a_real_sigint_flushes_and_exits_130(root, folder, tmp_path):
    """SIGINT to a running `sam3 segment` (60 copies of an image: it is still running when the first line shows):
    every line written parses, the COCO array is closed, exit 130; --resume then does only the rest."""
    import signal
    import time

    many_dir = tmp_path / "copies"
    many_dir.mkdir()
    for n in range(60):
        shutil.copy(folder / "shapes.png", many_dir / f"s{n:03d}.png")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "sam3", *map(str, many_argv(root, many_dir, prompts=["cat"])), "--jsonl",
            str(tmp_path / "r.jsonl"), "--coco", str(tmp_path / "r.json"), "--quiet"]
    # SIGINT as a terminal's Ctrl-C delivers it, even when this test runs where it is ignored (a background job)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (tmp_path / "r.jsonl").exists() or not (tmp_path / "r.jsonl").stat().st_size:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert err.splitlines()[-1] == "sam3 segment: interrupted" and "; interrupted" in out
    records = read_jsonl(tmp_path / "r.jsonl")
    assert 1 <= len(records) < 60 and all(r["ok"] for r in records)
    assert len(json.loads((tmp_path / "r.json").read_text())) == sum(len(r["instances"]) for r in records)
    done = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert f"{60 - len(records)} segmented, 0 failed, {len(records)} skipped as done" in done.stdout
    assert sorted(r["image"] for r in read_jsonl(tmp_path / "r.jsonl")) == sorted(
        str(p) for p in many_dir.iterdir())


def _segment_process(root, folder, tmp_path, *extra, stderr_tty):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    argv = [sys.executable, "-m", "sam3", *map(str, many_argv(root, folder)), "--jsonl", str(tmp_path / "p.jsonl"),
            *extra]
    if not stderr_tty:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        return done.returncode, done.stdout, done.stderr
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, text=True, env=env)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
        stdout = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        os.close(leader)
    return proc.returncode, stdout, b"".join(chunks).decode()


def test_the_progress_bar_shows_on_a_terminal_and_not_in_a_pipe(root, folder, tmp_path):
    code, out, err = _segment_process(root, folder, tmp_path, stderr_tty=True)
    assert code == 1
    assert "\r3/3 [########################] " in err and " img/s ETA 0:00" in err and "(1 failed)" in err
    assert "\r1/3 [" in err and "\r2/3 [" in err and "ETA" not in out
    assert err.rstrip().splitlines()[-1] == "sam3 segment: 1 of 3 image(s) failed"
    code, out, err = _segment_process(root, folder, tmp_path, stderr_tty=False)
    assert code == 1 and "img/s ETA" not in err and "\r" not in err
    assert err.splitlines() == ["sam3 segment: 1 of 3 image(s) failed"]
    assert "2 segmented, 1 failed" in out
    code, out, err = _segment_process(root, folder, tmp_path, "--quiet", stderr_tty=True)
    assert code == 1 and "img/s ETA" not in err and "FAILED" not in out and "2 segmented, 1 failed" in out


def test_segment_many_from_python(root, folder):
    paths = [folder / "scene.jpg", folder / "bad.png", folder / "shapes.png"]
    with Image.open(paths[0]) as img:
        rgb = preprocess.to_rgb(img)
    with Sam3(root, "emu:npu4") as sam:
        items = list(sam.segment_many([*paths, rgb], PROMPTS, threshold=0.25))
        singles = [[sam.segment(p, q, 0.25) for q in PROMPTS] for p in paths[::2]]
        # The Python API encodes a blank prompt as the reference does ([bos, eos], docs/sam3-host.md 4.3); only the
        # command line refuses it.
        assert [r.ok for r in sam.segment_many(paths[:1], ["cat", "  "])] == [True]
        with pytest.raises(ValueError, match="no prompts"):
            sam.segment_many(paths, [])
        with pytest.raises(post.PostError, match="threshold must be a number in"):
            sam.segment_many(paths, "cat", threshold=2)
    assert [i.index for i in items] == [0, 1, 2, 3] and [i.ok for i in items] == [True, False, True, True]
    assert isinstance(items[1].error, preprocess.ImageError) and items[1].results == []
    for item, want in zip([items[0], items[2]], singles, strict=True):
        assert [r.prompt for r in item.results] == PROMPTS
        for got, ref in zip(item.results, want, strict=True):
            assert np.array_equal(got.scores, ref.scores) and np.array_equal(got.masks, ref.masks)
            assert np.array_equal(got.boxes, ref.boxes)
    for got, ref in zip(items[3].results, singles[0], strict=True):  # the array is the same picture
        assert np.array_equal(got.scores, ref.scores) and np.array_equal(got.masks, ref.masks)


def test_files_directories_and_patterns(folder, tmp_path):
    (tmp_path / "sub").mkdir()
    shutil.copy(folder / "scene.jpg", tmp_path / "sub" / "b.JPEG")
    shutil.copy(folder / "scene.jpg", tmp_path / "a.png")
    got = many.expand([str(folder), str(tmp_path / "**" / "*.JPEG"), str(folder / "scene.jpg"),
                       str(tmp_path / "missing.png")])
    assert got == [folder / "bad.png", folder / "scene.jpg", folder / "shapes.png", tmp_path / "sub" / "b.JPEG",
                   tmp_path / "missing.png"]  # scene.jpg once; a missing file fails on its own line later
    with pytest.raises(ValueError, match="no file matches"):
        many.expand([str(tmp_path / "*.gif")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"directory .*empty holds no \.jpg, \.jpeg, \.png file"):
        many.expand([str(tmp_path / "empty")])
    assert many.image_ids([Path("000000000139.jpg"), Path("x/42.png")]) == [139, 42]
    assert many.image_ids([Path("139.jpg"), Path("cat.png")]) == [1, 2]
    assert many.image_ids([Path("a/7.jpg"), Path("b/007.png")]) == [1, 2]  # the same number twice
    assert many.overlay_names([Path("a/x.jpg"), Path("b/x.png"), Path("y.png")], [1, 2, 3]) == ["x-1", "x-2", "y"]


def test_errors_and_usage_errors(root, folder, tmp_path, capsys):
    code, _, err = run(capsys, *many_argv(root, tmp_path / "nothing-*.png"))
    assert code == 1 and err.strip() == f"sam3 segment: images: no file matches {str(tmp_path / 'nothing-*.png')!r}"
    code, _, err = run(capsys, *many_argv(root, folder, prompts=["cat", " "]))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "empty" in err
    for argv, message in (
            (("segment", root, folder / "scene.jpg", "cat", "--jsonl", tmp_path / "x"), "--jsonl: only in the many"),
            (("segment", root, folder / "scene.jpg"), "give an image and its prompt(s)"),
            ((*many_argv(root, folder), "--resume"), "--resume needs --jsonl FILE"),
            ((*many_argv(root, folder), "-o", tmp_path / "o.png"), "with --prompt, write overlays with --out DIR"),
            ((*many_argv(root, folder), "--reps", "2"), "--reps is the one-image form's")):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("sam3 segment: ") and message in err and len(err.splitlines()) == 1


def test_json_summary(root, folder, capsys):
    code, out, _ = run(capsys, *many_argv(root, folder), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["images"] == 3 and doc["done"] == 2 and doc["skipped"] == 0
    assert [f["image"] for f in doc["failed"]] == [str(folder / "bad.png")] and doc["prompts"] == PROMPTS
