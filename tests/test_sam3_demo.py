"""`sam3 demo` and the `sam3` command line: the stages pass on the emulator (with and without evictions), the
JSON document, exit codes 0/1/2, the NPU-without-a-bundle message, `sam3 bundle`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from sam3 import demo
from sam3.cli import main

STAGE_FIELDS = {"name", "kind", "rows", "chunks", "exec_cmds", "waits", "bytes_in", "bytes_out", "seconds",
                "device_seconds", "host_seconds", "max_rel_err", "cosine", "tolerance", "bundle"}


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo writes overlay.png into the working directory
    monkeypatch.setenv("SAM3_CACHE", str(tmp_path_factory.getbasetemp() / "sam3-cache"))
    monkeypatch.delenv("SAM3_MAX_CONTEXTS", raising=False)
    monkeypatch.delenv("AMDXDNA_DEVICE", raising=False)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_json_lists_every_stage_within_tolerance(capsys):
    code, out, _ = run(capsys, "demo", "--device", "emu", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["schema"] == 1 and doc["emulated"]
    assert doc["weights"] == "random (generated)"
    assert [s["name"] for s in doc["stages"]] == ["vit (host)", "vit (device)", "neck", "detr_enc"]
    for s in doc["stages"]:
        assert STAGE_FIELDS <= set(s)
        assert s["exec_cmds"] >= 1 and s["waits"] >= 1 and s["bytes_in"] > 0 and s["bytes_out"] > 0
        assert 0 <= s["max_rel_err"] <= s["tolerance"]
    assert doc["loads"] > 0 and doc["evictions"] == 0
    seg = doc["segment"]
    assert seg["prompt"] and seg["overlay"] == "overlay.png" and seg["instances"] == len(seg["scores"])
    assert {"vit", "neck", "detr_enc", "detr_dec", "mask_dec", "post"} <= set(seg["timing"]["stages_ms"])
    from PIL import Image

    with Image.open("overlay.png") as written, Image.open(seg["image"]) as original:
        k = seg["scale"]
        assert written.size == (original.size[0] * k, original.size[1] * k) == tuple(seg["overlay_size"])
        assert max(written.size) >= 512 > max(original.size) * (k - 1)  # the smallest whole factor reaching 512


def test_the_overlay_is_enlarged_and_labels_each_instance_with_its_score(capsys):
    """Oracle: post.overlay over the reference picture enlarged by Pillow (bilinear) and the masks by whole
    blocks (np.kron), everywhere but inside the score labels, which are filled with their instance's colour."""
    from PIL import Image

    from sam3 import post
    from sam3.pipeline import Sam3

    code, out, _ = run(capsys, "demo", "--device", "emu", "--json")
    doc = json.loads(out)
    seg = doc["segment"]
    assert code == 0 and seg["instances"] == 0 and seg["shown"]["which"] == "the best 3 queries (none above 0.5)"
    with Sam3(doc["bundles"][-1], "emu") as sam:
        every = sam.segment(seg["image"], seg["prompt"], threshold=0.0).instances
    best = np.sort(np.argsort(-every.scores)[:3])
    assert seg["shown"]["queries"] == every.queries[best].tolist()
    assert seg["shown"]["scores"] == every.scores[best].tolist()
    assert sorted(seg["shown"]["scores"], reverse=True) == sorted(every.scores.tolist(), reverse=True)[:3]
    k = seg["scale"]
    with Image.open(seg["image"]) as original:
        rgb = np.asarray(original.convert("RGB"))
        big = np.asarray(original.convert("RGB").resize((rgb.shape[1] * k, rgb.shape[0] * k),
                                                        Image.Resampling.BILINEAR))
    masks = np.kron(every.masks[best], np.ones((k, k), dtype=bool)).astype(bool)
    want = post.overlay(big, post.Instances(every.queries[best], every.scores[best], every.boxes[best] * k, masks))
    written = np.asarray(Image.open("overlay.png").convert("RGB"))
    inside = np.zeros(written.shape[:2], dtype=bool)
    assert [lab["query"] for lab in seg["labels"]] == seg["shown"]["queries"]
    for n, lab in enumerate(seg["labels"]):
        x0, y0, x1, y1 = lab["rect"]
        assert 0 <= x0 < x1 < written.shape[1] and 0 <= y0 < y1 < written.shape[0]
        inside[y0:y1 + 1, x0:x1 + 1] = True
        patch = written[y0:y1 + 1, x0:x1 + 1].reshape(-1, 3)
        fill = (patch == post.COLORS[n % 6]).all(axis=1)
        assert 0.4 < fill.mean() < 1.0  # the label's colour, with its text drawn over it
    assert np.array_equal(written[~inside], want[~inside])


def test_demo_overlay_can_be_turned_off(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--device", "emu", "--json", "-o", "")
    assert code == 0 and json.loads(out)["segment"]["overlay"] is None and not (tmp_path / "overlay.png").exists()


def test_an_overlay_no_format_writes_is_refused_before_any_work(capsys):
    code, out, err = run(capsys, "demo", "--device", "emu", "-o", "overlay.xyz")
    assert code == 1 and out == ""
    assert err == "sam3 demo: overlay overlay.xyz: no image format writes extension '.xyz' (use .png, .jpg, ...)\n"


def test_two_contexts_still_pass_with_evictions(capsys, monkeypatch):
    monkeypatch.setenv("SAM3_MAX_CONTEXTS", "2")
    code, out, _ = run(capsys, "demo", "--device", "emu", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["evictions"] > 0


def test_chunk_by_chunk_dispatch_gives_the_same_errors(capsys):
    _, out, _ = run(capsys, "demo", "--device", "emu", "--json")
    chained = json.loads(out)
    code, out, _ = run(capsys, "demo", "--device", "emu", "--json", "--no-chains")
    single = json.loads(out)
    assert code == 0
    for a, b in zip(chained["stages"], single["stages"], strict=True):
        assert a["max_rel_err"] == b["max_rel_err"]
        assert b["exec_cmds"] >= a["exec_cmds"]
    assert sum(s["exec_cmds"] for s in single["stages"]) > sum(s["exec_cmds"] for s in chained["stages"])


def test_table_and_a_stage_out_of_tolerance(capsys, monkeypatch):
    code, out, _ = run(capsys, "demo", "--device", "emu")
    assert code == 0 and out.splitlines()[-1] == "result: OK" and "random (generated)" in out
    assert "random weights: the instances mean nothing" in out and "wrote overlay.png" in out
    monkeypatch.setitem(demo.TOLERANCE, "neck", 1e-9)
    code, out, _ = run(capsys, "demo", "--device", "emu")
    assert code == 1 and out.splitlines()[-1] == "result: FAILED"


def test_an_npu_without_a_bundle_runs_on_the_emulator_and_says_why(monkeypatch):
    class FakeNpu:
        name, emulator = "/dev/accel/accel0", None

        def close(self):
            pass

    opened = []

    def fake_open(spec):
        opened.append(spec)
        if spec is None:
            return FakeNpu()
        from amdxdna_direct.device import open_device
        return open_device(spec)

    monkeypatch.setattr(demo, "open_device", fake_open)
    said = []
    dev = demo.choose_device(None, None, said.append)
    try:
        assert dev.emulator is not None and opened == [None, "emu"]
        assert "brishen/iron-sam3-npu2" in said[0] and "--bundle" in said[0]
    finally:
        dev.close()


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--geometry", "huge"])
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_a_bad_bundle_is_one_line_and_exit_1(capsys, tmp_path):
    code, out, err = run(capsys, "bundle", str(tmp_path))
    assert code == 1 and out == "" and err.startswith("sam3 bundle: bundle: ") and len(err.splitlines()) == 1
    code, out, _ = run(capsys, "bundle", str(tmp_path), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["error"].startswith("bundle: ")


def test_bundle_summary_of_a_generated_bundle(capsys, tmp_path):
    from sam3.build import build

    root = build(tmp_path / "b", "tiny", variant="device-f32")
    code, out, _ = run(capsys, "bundle", str(root), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == 1
    assert doc["version"] == 2
    code, out, _ = run(capsys, "bundle", str(root))
    assert code == 0 and "v_qkv" in out


def test_python_dash_m_and_version():
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "sam3", "--version"], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0 and done.stdout.startswith("sam3 (amdxdna-direct) ")
