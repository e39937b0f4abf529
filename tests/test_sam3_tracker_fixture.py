"""The repository's copy of the sam3-tiny-tracker fixture against the shared original (skipped without it)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import tracker_fixture as tf
from fixture_files import SHARED
from safetensors.numpy import load_file

ORIGINAL = SHARED / "fixtures" / tf.NAME
COPY = tf.HERE / tf.NAME


def _need_both() -> None:
    if not (ORIGINAL / "hf" / "model.safetensors").is_file():
        pytest.skip(f"the shared original {ORIGINAL} is absent")
    if not COPY.is_dir():
        pytest.skip(f"the repository copy {COPY} is absent")


@pytest.mark.parametrize("rel", ["cases.json", "reference.npz", "hf/config.json", "cases/field.png",
                                 "cases/stack.jpg"])
def test_copied_files_are_the_originals(rel):
    _need_both()
    assert (COPY / rel).read_bytes() == (ORIGINAL / rel).read_bytes()


def test_the_tracker_tensors_are_the_originals_and_the_rest_is_sam3_tiny():
    _need_both()
    whole = load_file(ORIGINAL / "hf" / "model.safetensors")
    mine = load_file(COPY / "hf" / "tracker.safetensors")
    assert len(mine) == 169 and all(k.startswith(("tracker_model.", "tracker_neck.")) for k in mine)
    for k, v in mine.items():
        assert v.dtype == whole[k].dtype and np.array_equal(v, whole[k]), k
    detector = {k: v for k, v in whole.items() if k not in mine}
    tiny = tf.tensors(tf.detector_dir())
    assert detector.keys() == tiny.keys()
    assert all(np.array_equal(tiny[k], detector[k]) for k in tiny)


def test_provenance_names_the_originals_hashes():
    _need_both()
    text = (COPY / "PROVENANCE.md").read_text()
    for rel in ("cases.json", "reference.npz", "hf/config.json", "hf/model.safetensors", "cases/field.png",
                "cases/stack.jpg"):
        assert hashlib.sha256((ORIGINAL / rel).read_bytes()).hexdigest() in text, rel


def test_config_has_the_tracker_config():
    cfg = tf.config()
    assert cfg["tracker_config"]["model_type"] == "sam3_tracker"
    assert json.loads((tf.tracker_dir() / "cases.json").read_text())["cases"] == tf.cases()
