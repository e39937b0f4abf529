"""Where the shared fixtures live (`../shared` beside the repo) and a helper that skips without them."""

from __future__ import annotations

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
