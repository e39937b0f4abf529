"""Where the test fixtures live, and a helper that skips a test whose fixture is absent.

The fixtures ship in the repository (``tests/fixtures/``: real xclbins and instruction streams, the sam3-tiny
checkpoint and its ``transformers`` outputs; provenance in ``tests/fixtures/README.md``), so a clone tests what
CI tests. Only the specification texts (``../shared/spec``: the ABI facts the layout proofs compare with, and the
driver's rule tables) stay outside; the tests that read them skip without ``../shared`` and say so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHARED = Path(__file__).resolve().parents[1].parent / "shared"
FIXTURES = REPO_FIXTURES / "xdna"
SAM3_TINY = REPO_FIXTURES / "sam3-tiny"


def fixture(rel: str) -> Path:
    """The fixture file ``FIXTURES / rel``; skips the calling test when it is absent."""
    path = FIXTURES / rel
    if not path.is_file():
        pytest.skip(f"fixture {path} absent (tests/fixtures incomplete in this checkout)")
    return path


def sam3_tiny_cases() -> list[int]:
    """The case indices of the sam3-tiny fixture (its cases.json)."""
    path = SAM3_TINY / "cases.json"
    return [c["index"] for c in json.loads(path.read_text())["cases"]] if path.is_file() else [0]
