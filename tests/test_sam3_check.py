"""sam3.check: the `sam3 check` sequence on generated tiny bundles (the host pieces they carry pass, every other
check is skipped with its reason; a corrupted packed byte or token id fails the right check, exit 1), the case
matching on masks built by hand, and the sam3-tiny fixture (tests/fixtures/sam3-tiny) exported with its
float32 reference for a host and a device ViT: every line passes, the cases with the instance counts cases.json
gives; corrupted references fail exactly their checks; the margin and min_iou tensors change the case verdicts."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixture_files import REPO_FIXTURES

from sam3 import build, check, export, post
from sam3.bundle import Bundle
from sam3.check import CaseMatch, iou_matrix, main, match_case, run_check

TINY = REPO_FIXTURES / "sam3-tiny"
HOST = ["bfp16 packing", "tokenizer", "resize + normalise", "image decoding", "text encoder"]
STAGES = ["ViT backbone", "neck level 0", "neck level 1", "neck level 2", "DETR encoder", "DETR decoder hidden",
          "DETR decoder boxes", "DETR decoder logits", "presence", "mask decoder masks", "mask decoder semantic"]
HEADERS = ["host pieces:", "stages, each on the float32 reference's inputs:",
           "end to end (image file + prompt -> instances) against the reference cases:"]


def _check(root: Path) -> tuple[check.CheckReport, list[str]]:
    out = io.StringIO()
    report = run_check(root, "emu", out=out)
    return report, out.getvalue().splitlines()


def _index(root: Path) -> dict[str, tuple[str, str, int, int]]:
    """tensors.txt read by hand: name -> (dtype, shape text, offset, bytes)."""
    rows = {}
    for line in (root / "tensors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, dtype, shape, offset, nbytes = line.split()
            rows[name] = (dtype, shape, int(offset), int(nbytes))
    return rows


def _patch(root: Path, name: str, fn) -> None:
    """Rewrites tensor `name` in place in tensors.bin: `fn` maps its current bytes (a uint8 copy) to new ones."""
    _, _, offset, nbytes = _index(root)[name]
    with open(root / "tensors.bin", "r+b") as f:
        f.seek(offset)
        old = np.frombuffer(f.read(nbytes), np.uint8).copy()
        new = np.ascontiguousarray(fn(old)).view(np.uint8)
        assert new.size == nbytes
        f.seek(offset)
        f.write(new.tobytes())


def _reshape_index(root: Path, name: str, shape: str, nbytes: int) -> None:
    """Gives `name` another shape and byte count in tensors.txt (same offset)."""
    lines = (root / "tensors.txt").read_text().splitlines()
    for k, line in enumerate(lines):
        f = line.split()
        if f and f[0] == name:
            lines[k] = " ".join([f[0], f[1], shape, f[3], str(nbytes)])
    (root / "tensors.txt").write_text("\n".join(lines) + "\n")


def _f32(fn):
    return lambda raw: fn(raw.view(np.float32).copy()).astype(np.float32)


def _i32(fn):
    return lambda raw: fn(raw.view(np.int32).copy()).astype(np.int32)


def _by_name(report: check.CheckReport) -> dict[str, check.Line]:
    return {line.name: line for line in report.lines}


# ---------------------------------------------------------------------------------------------
# generated tiny bundles: no float32 reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {v: build.build(root / v, "tiny", variant=v) for v in ("host", "device-f32")}


def _tok_tests(root: Path) -> int:
    return sum(1 for line in (root / "manifest.txt").read_text().splitlines() if line.startswith("tok_test "))


@pytest.mark.parametrize("variant", ["host", "device-f32"])
def test_tiny_bundle_host_pieces_pass_and_the_rest_is_skipped_with_reasons(tiny, variant):
    report, text = _check(tiny[variant])
    n = _tok_tests(tiny[variant])
    assert n > 0
    assert text[0].startswith(f"loaded {tiny[variant]} (") and text[0].endswith("s); mode npu on emulator (emu:npu4)")
    assert "carries no float32 reference" in text[1] and not report.reference
    assert [t for t in text if not t.startswith("  ")][2:5] == HEADERS
    lines = _by_name(report)
    assert [line.name for line in report.lines] == HOST + STAGES + ["cases"]
    packed = _index(tiny[variant])["pack_test.packed"][3]
    assert lines["bfp16 packing"].status == "ok" and lines["bfp16 packing"].detail.startswith(f"0 of {packed} bytes")
    assert lines["tokenizer"].status == "ok" and lines["tokenizer"].detail == f"{n}/{n} prompts identical"
    assert lines["image decoding"].status == "info" and " 0 of " in lines["image decoding"].detail
    assert lines["resize + normalise"].detail == "no ref.pixel_values in the bundle"
    assert lines["text encoder"].detail == "no ref.text in the bundle"
    assert lines["ViT backbone"].detail == "no ref.vit_out in the bundle"
    assert lines["cases"].detail == "no case records in the bundle"
    skipped = [name for name in HOST + STAGES + ["cases"] if name not in ("bfp16 packing", "tokenizer",
                                                                          "image decoding")]
    assert report.skipped == skipped
    assert all(lines[name].status == "skip" and "in the bundle" in lines[name].detail for name in skipped)
    assert "  [skip] ViT backbone: no ref.vit_out in the bundle" in text
    assert report.ok and report.failed == [] and text[-1] == "ALL CHECKS PASSED"
    assert text[-2] == f"{len(skipped)} check(s) skipped: the bundle lacks what they compare against"
    assert text[-3].startswith("contexts loaded ") and text[-3].endswith(", evicted 0")


def test_tiny_bundle_main_exit_0_and_json(tiny, capsys):
    assert main([str(tiny["host"]), "--device", "emu"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[-1] == "ALL CHECKS PASSED"
    assert main([str(tiny["host"]), "--device", "emu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "check" and doc["ok"] is True and doc["failed"] == [] and doc["reference"] is False
    assert [line["name"] for line in doc["lines"]] == HOST + STAGES + ["cases"]
    assert [f"  [{x['status']}] {x['name']}: {x['detail']}" for x in doc["lines"]][5:] == \
        [t for t in text if t.startswith("  [")][5:]  # the stage and case lines are untimed skips: identical


@pytest.fixture
def tiny_copy(tiny, tmp_path) -> Path:
    return Path(shutil.copytree(tiny["host"], tmp_path / "copy"))


def test_a_corrupted_packed_byte_fails_bfp16_packing(tiny_copy, capsys):
    _patch(tiny_copy, "pack_test.packed", lambda raw: np.where(np.arange(raw.size) == 100, raw ^ 0x40, raw))
    assert main([str(tiny_copy), "--device", "emu"]) == 1
    text = capsys.readouterr().out.splitlines()
    size = _index(tiny_copy)["pack_test.packed"][3]
    line = next(t for t in text if "bfp16 packing" in t)
    assert line.startswith(f"  [FAIL] bfp16 packing: 1 of {size} bytes differ, the first at byte 100 (0x")
    assert text[-1] == "FAILED: bfp16 packing"


def test_a_corrupted_token_id_fails_the_tokenizer(tiny_copy, capsys):
    _patch(tiny_copy, "tok.2.ids", _i32(lambda ids: np.where(np.arange(ids.size) == 1, ids + 1, ids)))
    assert main([str(tiny_copy), "--device", "emu"]) == 1
    text = capsys.readouterr().out.splitlines()
    n = _tok_tests(tiny_copy)
    line = next(t for t in text if "tokenizer" in t)
    assert line.startswith(f"  [FAIL] tokenizer: {n - 1}/{n} prompts identical; tok_test 2 ")
    assert "ids differ at token 1" in line
    assert text[-1] == "FAILED: tokenizer"


def test_a_corrupted_mask_fails_the_tokenizer_too(tiny_copy):
    _patch(tiny_copy, "tok.0.mask", _i32(lambda m: 1 - m))
    report, _ = _check(tiny_copy)
    n = _tok_tests(tiny_copy)
    assert report.failed == ["tokenizer"]
    assert _by_name(report)["tokenizer"].detail.startswith(f"{n - 1}/{n} prompts identical; tok_test 0 ")
    assert "mask differ at token 0 (got 1, want 0)" in _by_name(report)["tokenizer"].detail


def test_errors_and_usage(tmp_path, capsys):
    assert main([str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("sam3 check: bundle: ") and str(tmp_path / "none") in err[0]
    assert main([str(tmp_path / "none"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["error"].startswith("bundle: ")
    for argv in ([], ["a", "b"], ["a", "--bogus"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.startswith("sam3 check: ")


# ---------------------------------------------------------------------------------------------
# case matching on masks built by hand


def _found(masks: np.ndarray, scores, queries=None) -> post.Instances:
    n = len(scores)
    return post.Instances(np.arange(n) if queries is None else np.asarray(queries), np.asarray(scores, np.float32),
                          np.zeros((n, 4), np.float32), np.asarray(masks, bool))


def _rects(*spans, h=10, w=10) -> np.ndarray:
    """Masks [n, h, w], mask k on rows spans[k][0]..spans[k][1] (all columns)."""
    out = np.zeros((len(spans), h, w), bool)
    for k, (a, b) in enumerate(spans):
        out[k, a:b] = True
    return out


def test_iou_matrix_by_hand():
    ref = _rects((0, 4), (4, 10), (0, 0))
    got = _rects((0, 2), (0, 0))
    want = np.array([[0.5, 0.0], [0.0, 0.0], [0.0, 1.0]])  # rows 0-1 of rows 0-3; disjoint; empty vs empty = 1
    np.testing.assert_array_equal(iou_matrix(ref, got), want)
    with pytest.raises(ValueError, match=r"\[2, 10, 10\] and found masks \[1, 5, 10\]"):
        iou_matrix(_rects((0, 1), (1, 2)), _rects((0, 1), h=5))


def test_match_case_equal_sets_in_another_order():
    ref = _rects((0, 3), (3, 6), (6, 10))
    found = _found(ref[[2, 0, 1]], [0.7, 0.6, 0.65], queries=[9, 4, 5])
    m = match_case([0.61, 0.66, 0.71], ref, found, threshold=0.5)
    assert isinstance(m, CaseMatch) and m.ok
    np.testing.assert_array_equal(m.which, [1, 2, 0])
    np.testing.assert_array_equal(m.ious, [1.0, 1.0, 1.0])
    assert m.detail == "3 instance(s) at threshold 0.5, reference 3, min IoU 1.000 > 0.97, max |score diff| " \
                       "0.0100 < 0.03"


def test_match_case_iou_bar_and_score_tolerance():
    ref = _rects((0, 10))
    nine = _rects((0, 9))  # IoU 0.9
    assert not match_case([0.6], ref, _found(nine, [0.6]), 0.5).ok  # the default bar 0.97
    m = match_case([0.6], ref, _found(nine, [0.6]), 0.5, min_iou=0.85)
    assert m.ok and m.ious[0] == pytest.approx(0.9)
    bad = match_case([0.6], ref, _found(nine, [0.6], queries=[4]), 0.5, min_iou=0.95)
    assert bad.detail == "1 instance(s) at threshold 0.5, reference 1: reference instance 0 (score 0.6000): IoU " \
                         "0.900 <= 0.95 with query 4"
    near = match_case([0.6], ref, _found(nine, [0.6], queries=[4]), 0.5, margin=0.01, min_iou=0.95)
    assert not near.ok and "reference instance 0 (score 0.6000) unmatched (best IoU 0.900 <= 0.95)" in near.detail
    assert "query 4 (score 0.6000) matches no reference instance" in near.detail
    far = match_case([0.6], ref, _found(ref, [0.64]), 0.5)
    assert not far.ok and "|diff| 0.0400 >= 0.03" in far.detail
    assert match_case([0.6], ref, _found(ref, [0.625]), 0.5).ok


def test_match_case_counts_without_a_margin():
    ref = _rects((0, 3), (3, 6))
    fewer = match_case([0.6, 0.505], ref, _found(ref[:1], [0.6]), 0.5)
    assert not fewer.ok and fewer.detail.startswith("1 instance(s) at threshold 0.5, reference 2: ")
    assert "reference instance 1 (score 0.5050) unmatched (no found instance left)" in fewer.detail
    more = match_case([0.6], ref[:1], _found(ref, [0.6, 0.505], queries=[3, 7]), 0.5)
    assert not more.ok and "query 7 (score 0.5050) matches no reference instance" in more.detail
    none = match_case(np.zeros(0), np.zeros((0, 10, 10), bool), _found(np.zeros((0, 10, 10)), []), 0.5)
    assert none.ok and none.detail == "0 instance(s) at threshold 0.5, reference 0"


def test_match_case_margin_forgives_queries_near_the_threshold():
    ref = _rects((0, 3), (3, 6), (6, 10))
    # the reference's instance 1 (0.505) is absent, a found query 8 (0.507, matching nothing) is extra
    found = _found(np.concatenate([ref[[0, 2]], _rects((0, 10))]), [0.6, 0.7, 0.507], queries=[2, 6, 8])
    m = match_case([0.6, 0.505, 0.7], ref, found, threshold=0.5, margin=0.01)
    assert m.ok and m.absent == [1] and m.extra == [2]
    np.testing.assert_array_equal(m.which, [0, -1, 1])
    assert m.detail.endswith("within the margin 0.01 of the threshold: reference instance 1 (0.5050) absent, query 8 "
                             "(0.5070) extra")
    assert not match_case([0.6, 0.505, 0.7], ref, found, threshold=0.5, margin=0.004).ok
    # a query far from the threshold is not forgiven, absent or extra
    far = match_case([0.6, 0.52, 0.7], ref, found, threshold=0.5, margin=0.01)
    assert not far.ok and "reference instance 1 (score 0.5200) unmatched (best IoU 0.300 <= 0.97)" in far.detail
    assert "query 8" not in far.detail
    extra = _found(np.concatenate([ref, _rects((0, 10))]), [0.6, 0.505, 0.7, 0.53], queries=[2, 4, 6, 8])
    far = match_case([0.6, 0.505, 0.7], ref, extra, threshold=0.5, margin=0.01)
    assert not far.ok and "query 8 (score 0.5300) matches no reference instance" in far.detail


def test_match_case_margin_pairs_best_iou_first():
    """An absent reference instance near the threshold does not take the found instance of a later one that
    resembles it: with the margin, pairs go best IoU first (the reference-order greedy would pair 0 with it)."""
    full = np.ones((1, 10, 10), bool)
    found = full.copy()
    found[0, 9, 9] = False  # IoU 0.99 with the full mask
    first = np.zeros((1, 10, 10), bool)
    first.reshape(-1)[:93] = True  # IoU 93/99 with the found mask
    ref = np.concatenate([first, full])
    m = match_case([0.505, 0.6], ref, _found(found, [0.6], queries=[3]), threshold=0.5, margin=0.01, min_iou=0.9)
    assert m.ok and m.absent == [0] and m.extra == []
    np.testing.assert_array_equal(m.which, [-1, 0])
    assert m.ious[1] == pytest.approx(0.99)
    assert m.detail == "1 instance(s) at threshold 0.5, reference 2, min IoU 0.990 > 0.9, max |score diff| 0.0000 " \
                       "< 0.03, within the margin 0.01 of the threshold: reference instance 0 (0.5050) absent"
    plain = match_case([0.505, 0.6], ref, _found(found, [0.6], queries=[3]), threshold=0.5, min_iou=0.9)
    assert not plain.ok and "reference instance 1 (score 0.6000) unmatched (no found instance left)" in plain.detail


def test_match_case_nothing_found():
    m = match_case([0.6], _rects((0, 3)), _found(np.zeros((0, 10, 10)), []), 0.5)
    assert not m.ok and m.detail == "0 instance(s) at threshold 0.5, reference 1: reference instance 0 (score " \
                                    "0.6000) unmatched (no found instance left)"
    near = match_case([0.505], _rects((0, 3)), _found(np.zeros((0, 10, 10)), []), 0.5, margin=0.01)
    assert near.ok and near.absent == [0]


def test_match_case_shape_errors():
    with pytest.raises(ValueError, match=r"reference scores \[2\] and masks \[1, 10, 10\] disagree"):
        match_case([0.6, 0.7], _rects((0, 1)), _found(_rects((0, 1)), [0.6]), 0.5)


# ---------------------------------------------------------------------------------------------
# the sam3-tiny fixture exported with its float32 reference


@pytest.fixture(scope="module")
def fixture_bundles(tmp_path_factory) -> dict[str, Path]:
    if not (TINY / "hf" / "model.safetensors").is_file() or not (TINY / "reference.npz").is_file():
        pytest.skip(f"fixture {TINY} absent (tests/fixtures incomplete in this checkout)")
    root = tmp_path_factory.mktemp("sam3-tiny")
    return {vit: export.export(TINY / "hf", root / vit, vit=vit, reference=TINY / "reference.npz")
            for vit in ("host", "device")}


@pytest.fixture(scope="module")
def fixture_reports(fixture_bundles) -> dict[str, tuple[check.CheckReport, list[str]]]:
    return {vit: _check(root) for vit, root in fixture_bundles.items()}


def _cases() -> list[dict]:
    return json.loads((TINY / "cases.json").read_text())["cases"]


def _case_name(case: dict) -> str:
    return f"cases/{Path(case['image']).name} / {json.dumps(case['prompt'])}"


@pytest.mark.parametrize("vit", ["host", "device"])
def test_fixture_every_check_passes(fixture_bundles, fixture_reports, vit):
    report, text = fixture_reports[vit]
    cases = _cases()
    assert report.reference and report.skipped == []
    assert [line.name for line in report.lines] == HOST + STAGES + [_case_name(c) for c in cases]
    assert [line.status for line in report.lines] == ["ok"] * 3 + ["info"] + ["ok"] * (1 + len(STAGES) + len(cases))
    assert [t for t in text if not t.startswith("  ")][1:4] == HEADERS
    assert report.ok and text[-1] == "ALL CHECKS PASSED"
    with Bundle.open(fixture_bundles[vit]) as b:  # one Sam3: each context loaded once, none evicted
        contexts = len({b.kernel(k).ctx for k in b.kernel_keys()})
    assert (report.loads, report.evictions) == (contexts, 0)
    assert text[-2] == f"contexts loaded {contexts}, evicted 0"
    lines = _by_name(report)
    assert lines["tokenizer"].detail == f"{len(cases)}/{len(cases)} prompts identical"
    assert lines["image decoding"].detail.startswith(f"cases/{Path(cases[0]['image']).name}: 0 of ")
    for stage in ("ViT backbone", "neck level 0", "DETR encoder", "DETR decoder hidden", "mask decoder masks"):
        assert lines[stage].seconds is not None and f"  [ok] {stage}: cosine " in lines[stage].text()
    for case in cases:
        (thrx,) = [k for k in case["instances"] if k != "0.5"]
        n = case["instances"][thrx]
        detail = lines[_case_name(case)].detail
        assert detail.startswith(f"{n} instance(s) at threshold {float(thrx):.4g}, reference {n}, min IoU ")
        iou = float(detail.split("min IoU ")[1].split()[0])
        assert iou > case["thrx_min_iou"]


def test_fixture_corrupted_references_fail_their_checks(fixture_bundles, tmp_path):
    """Each corruption fails its own line only: boxes moved, the presence logit shifted, the semantic map of
    another size (an error, reported as the line's failure), a case's IoU bar raised, another case's threshold
    raised past a query without a margin; a third case's threshold raised past two queries within its margin
    still passes."""
    root = Path(shutil.copytree(fixture_bundles["device"], tmp_path / "copy"))
    _patch(root, "ref.pred_boxes", _f32(lambda b: b + 0.5))
    _patch(root, "ref.presence", _f32(lambda p: p + 1.0))
    _reshape_index(root, "ref.semantic", "24,48", _index(root)["ref.semantic"][3] // 2)
    _patch(root, "case.0.min_iou", _f32(lambda v: np.full_like(v, 0.995)))
    _patch(root, "case.1.threshold", _f32(lambda v: np.full_like(v, 0.357)))
    _patch(root, "case.2.threshold", _f32(lambda v: np.full_like(v, 0.144)))
    _patch(root, "case.2.margin", _f32(lambda v: np.zeros_like(v)))
    report, text = _check(root)
    cases = [_case_name(c) for c in _cases()]
    assert report.failed == ["DETR decoder boxes", "presence", "mask decoder semantic", cases[0], cases[2]]
    assert text[-1] == "FAILED: " + ", ".join(report.failed)
    lines = _by_name(report)
    assert ">= 0.01 over" in lines["DETR decoder boxes"].detail
    assert "|diff| 1 >= 0.05" in lines["presence"].detail
    assert lines["mask decoder semantic"].detail.startswith("ref.semantic holds 1152 values [24, 48]")
    assert lines["mask decoder masks"].status == "ok"
    assert "<= 0.995" in lines[cases[0]].detail
    assert "at threshold 0.144, reference 8: reference instance " in lines[cases[2]].detail
    assert lines[cases[1]].status == "ok" and "within the margin 0.01 of the threshold: " in lines[cases[1]].detail
    assert lines[cases[1]].detail.endswith(": reference instance 0 (0.3510) absent, reference instance 3 (0.3521) "
                                           "absent")
