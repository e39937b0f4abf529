"""Bundles that open but break a rule a run relies on (docs/sam3-bundle.md 12): `Sam3` refuses them at open with
one BundleError naming the param, record or tensor, and `sam3 bundle` lists the problem (issue 26 items 2, 9).

Each case is a built tiny bundle (consistent: the oracle that the rules accept it) with one line changed; before
the rules, these ran into ZeroDivisionError, KeyError, IndexError or ValueError from the stages, or (a text
tensor relabelled f32 -> i32) to another answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sam3 import build, cli
from sam3.bundle import Bundle, BundleError, consistency, summarize
from sam3.pipeline import Sam3


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build.build(tmp_path_factory.mktemp("c") / "b", "tiny", variant="host")


def _edit(base: Path, tmp: Path, name: str, old: str, new: str) -> Path:
    root = tmp / "m"
    shutil.copytree(base, root)
    text = (root / name).read_text()
    lines = text.split("\n")
    hits = [i for i, ln in enumerate(lines) if ln.startswith(old)]
    assert len(hits) == 1, old
    lines[hits[0]] = new if new.startswith(old.split(" ")[0]) or not new else lines[hits[0]].replace(old, new, 1)
    (root / name).write_text("\n".join(ln for ln in lines if ln))
    return root


def _line(root: Path, name: str, start: str) -> int:
    return next(n for n, ln in enumerate((root / name).read_text().split("\n"), 1) if ln.startswith(start))


def _refused(root: Path) -> str:
    with pytest.raises(BundleError) as e:
        Sam3(root, "emu")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("inconsistent bundle: ")
    return msg


def test_the_built_bundle_keeps_every_rule(base):
    with Bundle.open(base) as b:
        assert consistency.problems(b, runtime=True) == []
        assert summarize(b)["problems"] == []


CASES = [
    ("manifest.txt", "param window ", "param window 0", "param window: is 0, expected a positive integer"),
    ("manifest.txt", "param window ", "param window 3", "param window: grid 8 is not a multiple of window 3"),
    ("manifest.txt", "param vit_heads ", "param vit_heads 0", "param vit_heads: is 0"),
    ("manifest.txt", "param dec_layers ", "param dec_layers 0", "param dec_layers: is 0"),
    ("manifest.txt", "param text_dim ", "param text_dim 0", "param text_dim: is 0"),
    ("manifest.txt", "param image_size ", "param image_size 1000000", "param image_size: 1000000 != grid 8 * patch 2"),
    ("manifest.txt", "param patch ", "param patch 3", "param image_size: 16 != grid 8 * patch 3"),
    ("manifest.txt", "param vit_global ", "param vit_global 5", "param vit_global: 5 is not a list of distinct"),
    ("manifest.txt", "param queries ", "param queries 3", "tensor dec.reference_points holds 16 elements, the "
     "params need 12"),
    ("manifest.txt", "param vit_dim ", "param vit_dim 32", "gemm v_embed: N=64, the params need vit_dim = 32"),
    ("manifest.txt", "mha mha_glob ", "", "kernel mha_glob missing from the manifest"),
    ("manifest.txt", "gemm n_up ", "", "kernel n_up missing from the manifest"),
    ("manifest.txt", "gemm v_embed ", "", "kernel v_embed missing from the manifest"),
]


@pytest.mark.parametrize(("name", "old", "new", "message"), CASES, ids=[c[2] or f"del {c[1]}" for c in CASES])
def test_sam3_refuses_an_inconsistent_bundle_and_sam3_bundle_lists_it(base, tmp_path, capsys, name, old, new,
                                                                       message):
    root = _edit(base, tmp_path, name, old, new)
    msg = _refused(root)
    assert message in msg
    if new and message.startswith("param " + new.split()[1] + ":"):
        assert f"manifest.txt:{_line(root, name, new)}: {message}" in msg  # the param's own line
    code = cli.main(["bundle", str(root), "--json"])
    doc = json.loads(capsys.readouterr().out)
    if "missing from the manifest" not in message:  # the summary's own words for a missing kernel
        assert code == 1 and any(message in p for p in doc["problems"])
    else:
        assert code == 1 and any(p.startswith(message.replace("manifest.txt: ", "")) for p in doc["problems"])


def _text_tensors(base: Path) -> list[str]:
    return [ln for ln in (base / "tensors.txt").read_text().splitlines() if ln.startswith("t.")]


def test_every_text_tensor_is_checked(base):
    with Bundle.open(base) as b:
        want = {name for name, *_ in consistency.text_tensors(b.params)}
    assert want == {ln.split()[0] for ln in _text_tensors(base)}


def test_every_text_tensor_relabelled_i32_is_refused(base, tmp_path):
    """Issue 26 item 2: any text tensor relabelled f32 -> i32 (bf16 -> i32: half the count) is refused at open;
    each of the bundle's text tensors in turn, however many its params give."""
    lines = _text_tensors(base)
    assert lines
    for index, line in enumerate(lines):
        name, dtype, shape, off, nbytes = line.split()
        new = " ".join([name, "i32", str(int(nbytes) // 4), off, nbytes])
        root = _edit(base, tmp_path / str(index), "tensors.txt", line, new)
        msg = _refused(root)
        assert f"tensors.txt:{_line(root, 'tensors.txt', name + ' ')}: tensor {name} is I32, wanted " in msg, name
        assert msg.endswith("F32" if dtype == "f32" else "Bf16"), (name, msg)


def test_a_text_tensor_of_the_wrong_size_is_refused(base, tmp_path):
    line = next(ln for ln in _text_tensors(base) if ln.startswith("t.0.fc1.b "))
    name, dtype, _, off, nbytes = line.split()
    root = _edit(base, tmp_path, "tensors.txt", line, f"{name} {dtype} 8 {off} 32")
    assert "tensor t.0.fc1.b holds 8 elements, the params need 64" in _refused(root)


def test_the_unchanged_bundle_still_segments(base):
    with Sam3(base, "emu") as sam:
        assert len(sam.segment(np.zeros((12, 9, 3), np.uint8), "a cat", threshold=0.0)) == 4  # queries


def test_the_text_encoder_refuses_integer_weights_given_directly(base):
    """The stage itself, called without Sam3 (a dict or the store): an i32 weight is refused, not reinterpreted."""
    from sam3 import text
    from sam3.text import TextError

    with Bundle.open(base) as b:
        weights = {n: np.asarray(b.tensors.get(n)) for n in b.tensors.names() if n.startswith("t.")}
        ids, mask = np.zeros(b.params.text_len, np.int32), np.zeros(b.params.text_len, np.int32)
        ids[:2], mask[:2] = (b.params.bos, b.params.eos), 1
        assert text.encode_text(ids, mask, weights, b.params).shape == (b.params.text_len, b.params.d_model)
        weights["t.0.ln1.w"] = weights["t.0.ln1.w"].view(np.int32)
        with pytest.raises(TextError, match=r"tensor t.0.ln1.w is int32, expected float32 or bfloat16"):
            text.encode_text(ids, mask, weights, b.params)
