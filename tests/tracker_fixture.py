"""The sam3-tiny-tracker fixture: this repository's copy (tests/fixtures/) first, the shared one as fallback.

The repository's copy holds only the tracker's tensors (`hf/tracker.safetensors`); the detector's, byte for byte
sam3-tiny's, come from the sam3-tiny fixture (again the repository's copy first). Tests skip, saying why, when
neither copy is there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixture_files import SHARED
from safetensors.numpy import load_file, save_file

HERE = Path(__file__).resolve().parent / "fixtures"
NAME = "sam3-tiny-tracker"


def _first(*candidates: Path) -> Path | None:
    return next((c for c in candidates if c.is_dir()), None)


def tracker_dir() -> Path:
    """The fixture's directory; skips the calling test when there is none."""
    found = _first(HERE / NAME, SHARED / "fixtures" / NAME)
    if found is None:
        pytest.skip(f"fixture {NAME} absent (neither {HERE / NAME} nor {SHARED / 'fixtures' / NAME})")
    return found


def detector_dir() -> Path:
    """sam3-tiny's checkpoint directory (`hf/`), whose tensors are the tracker fixture's detector."""
    found = _first(HERE / "sam3-tiny" / "hf", SHARED / "fixtures" / "sam3-tiny" / "hf")
    if found is None:
        pytest.skip("fixture sam3-tiny absent: the tracker fixture's detector tensors come from it")
    return found


def tensors(root: Path) -> dict[str, np.ndarray]:
    """Every tensor of every `*.safetensors` file in `root`."""
    out: dict[str, np.ndarray] = {}
    for path in sorted(root.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def tracker_tensors() -> dict[str, np.ndarray]:
    """The tracker's tensors (`tracker_model.*`, `tracker_neck.*`) from whichever copy is found."""
    return {k: v for k, v in tensors(tracker_dir() / "hf").items() if k.startswith(("tracker_model.", "tracker_neck."))}


def config() -> dict[str, Any]:
    """The fixture's config.json."""
    out: dict[str, Any] = json.loads((tracker_dir() / "hf" / "config.json").read_text())
    return out


def cases() -> list[dict[str, Any]]:
    """cases.json's cases."""
    out: list[dict[str, Any]] = json.loads((tracker_dir() / "cases.json").read_text())["cases"]
    return out


def case_indices() -> list[int]:
    """The case indices, for parametrising (the 4 of the fixture, or [0] when it is absent and the tests skip)."""
    found = _first(HERE / NAME, SHARED / "fixtures" / NAME)
    if found is None:
        return [0]
    return [c["index"] for c in json.loads((found / "cases.json").read_text())["cases"]]


class Reference:
    """reference.npz, read by case and stage name: `ref(i, "tokens_out")`."""

    def __init__(self) -> None:
        self.npz = np.load(tracker_dir() / "reference.npz")

    def __call__(self, i: int, name: str) -> np.ndarray:
        return np.asarray(self.npz[f"pcase.{i}.{name}"])

    def has(self, i: int, name: str) -> bool:
        return f"pcase.{i}.{name}" in self.npz.files


def full_checkpoint(out: Path) -> Path:
    """One checkpoint directory holding detector and tracker (`model.safetensors` the union, the tracker's
    config.json, sam3-tiny's tokenizer and processor files), as the shared original has it."""
    out.mkdir(parents=True, exist_ok=True)
    det = detector_dir()
    for f in det.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text((tracker_dir() / "hf" / "config.json").read_text())
    save_file({**tensors(det), **tracker_tensors()}, out / "model.safetensors")
    return out
