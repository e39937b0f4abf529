"""Where the shared fixtures live (`../shared` beside the repo) and a helper that skips without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
FIXTURES = SHARED / "fixtures" / "xdna"


def fixture(rel: str) -> Path:
    """The fixture file ``FIXTURES / rel``; skips the calling test when ../shared is not checked out."""
    path = FIXTURES / rel
    if not path.is_file():
        pytest.skip(f"fixture {path} absent (../shared not checked out next to the repo)")
    return path


SAM3_TINY = SHARED / "fixtures" / "sam3-tiny"


def sam3_tiny_cases() -> list[int]:
    """The case indices of the sam3-tiny fixture (its cases.json), or [0] without ../shared (its tests skip)."""
    path = SAM3_TINY / "cases.json"
    return [c["index"] for c in json.loads(path.read_text())["cases"]] if path.is_file() else [0]
