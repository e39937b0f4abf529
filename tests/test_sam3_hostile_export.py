"""sam3 export on hostile checkpoints (issue 26 items 7, 8): a malformed safetensors header, absurd config values,
tokenizer files the bundle cannot use and a reference naming images outside its directory each end in one line
naming the file, exit 1, and leave no bundle behind. Each case is the fixture checkpoint with one thing changed."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from fixture_files import REPO_FIXTURES

from sam3 import export

TINY = REPO_FIXTURES / "sam3-tiny"
HF = TINY / "hf"


def _need_fixture() -> None:
    if not (HF / "model.safetensors").is_file() or not (TINY / "reference.npz").is_file():
        pytest.skip(f"fixture {TINY} absent (tests/fixtures incomplete in this checkout)")


def _with_config(tmp_path: Path, value: object, *keys: str) -> Path:
    """The checkpoint with config.json's ``keys`` path set to ``value``."""
    _need_fixture()
    cfg = json.loads((HF / "config.json").read_text())
    node = cfg
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return _copy(tmp_path, "config.json", json.dumps(cfg).encode())


def _copy(tmp_path: Path, name: str | None = None, data: bytes | None = None) -> Path:
    _need_fixture()
    root = tmp_path / "hf"
    root.mkdir()
    for f in HF.iterdir():
        if f.name != name:
            (root / f.name).symlink_to(f)
    if name is not None and data is not None:
        (root / name).write_bytes(data)
    return root


def _fails(capsys, root: Path, out: Path, *extra: str) -> str:
    code = export.main(["--model", str(root), "--out", str(out), "--vit", "host", *extra])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "] " not in ln]  # progress lines carry a "[  0.1 s] " stamp
    assert code == 1 and len(lines) == 1, err
    assert not out.exists()  # nothing left behind
    return lines[0]


def _header(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


HEADERS = {
    "empty file": b"",
    "short length prefix": b"\x01\x02",
    "length beyond the file": struct.pack("<Q", 1 << 40) + b"{}",
    "not JSON": _header(b"{not json"),
    "JSON not an object": _header(b"[1, 2]"),
    "unknown dtype": _header(b'{"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
    "offsets out of range": _header(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 400]}}', b"\0" * 4),
    "shape and offsets disagree": _header(b'{"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}', b"\0" * 4),
    "negative dim": _header(b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', b"\0" * 4),
    "huge dims": _header(b'{"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}}',
                         b"\0" * 4),
    "overlapping offsets": _header(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                   b'"b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
    "duplicate keys": _header(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                              b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8),
    "offsets reversed": _header(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', b"\0" * 4),
    "a fractional dim": _header(b'{"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}', b"\0" * 4),
    "metadata not strings": _header(b'{"__metadata__": {"x": 1}}'),
    "a tensor that is not an object": _header(b'{"a": 7}'),
}


@pytest.mark.parametrize("kind", list(HEADERS))
def test_a_malformed_safetensors_header_is_one_line(tmp_path, capsys, kind):
    root = _copy(tmp_path, "model.safetensors", HEADERS[kind])
    line = _fails(capsys, root, tmp_path / "out")
    assert "model.safetensors" in line, line


def test_a_config_declaring_1e8_layers_is_refused_before_building_its_tensor_list(tmp_path, capsys):
    root = _with_config(tmp_path, 10 ** 8, "vision_config", "backbone_config", "num_hidden_layers")
    line = _fails(capsys, root, tmp_path / "out")
    assert "config.json: vision_config.backbone_config.num_hidden_layers = 100000000, more than the" in line


@pytest.mark.parametrize("value", [None, {"a": 1}, [1, 2, 3], -4, 0, 1.5, "8", True])
def test_config_values_that_are_not_sizes_name_the_field(tmp_path, capsys, value):
    root = _with_config(tmp_path, value, "detr_encoder_config", "num_layers")
    line = _fails(capsys, root, tmp_path / "out")
    assert "config.json: detr_encoder_config.num_layers = " in line and "expected a positive integer" in line


def test_a_vocab_id_of_1_5_does_not_give_exit_0(tmp_path, capsys):
    _need_fixture()
    vocab = json.loads((HF / "vocab.json").read_text())
    vocab[next(k for k in vocab if k not in ("<|startoftext|>", "<|endoftext|>"))] = 1.5
    root = _copy(tmp_path, "vocab.json", json.dumps(vocab).encode())
    line = _fails(capsys, root, tmp_path / "out")
    assert "the written bundle does not open: vocab.json: not a flat {string: int} object" in line


def test_a_bad_merges_txt_does_not_give_exit_0(tmp_path, capsys):
    _need_fixture()
    root = _copy(tmp_path, "merges.txt", b"#version: 0.2\nab\n")
    line = _fails(capsys, root, tmp_path / "out")
    assert "the written bundle does not open: merges.txt:2: ab" in line


def test_a_reference_image_outside_its_directory_is_refused(tmp_path, capsys):
    _need_fixture()
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "reference.npz").symlink_to(TINY / "reference.npz")
    shutil.copytree(TINY / "cases", ref / "cases")
    doc = json.loads((TINY / "cases.json").read_text())
    secret = tmp_path / "x"
    secret.write_bytes(b"not for the bundle")
    doc["cases"][0]["image"] = "../x"
    (ref / "cases.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    line = _fails(capsys, HF, out, "--reference", str(ref / "reference.npz"))
    assert "case 0: image '../x' is not a file inside the reference's directory" in line


@pytest.mark.parametrize("value", [None, "1e-5", [1e-5], 0, -1e-5, 2.0, True])
def test_a_text_eps_that_is_not_a_small_number_names_the_field(tmp_path, capsys, value):
    root = _with_config(tmp_path, value, "text_config", "layer_norm_eps")
    line = _fails(capsys, root, tmp_path / "out")
    assert "config.json: text_config.layer_norm_eps = " in line and "expected a small positive number" in line
