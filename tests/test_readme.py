"""The README's Python example runs as written (on the emulator, with the npu1_1col fixture)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "xdna" / "mlir-aie-npu1_1col"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_opens_with_install_and_test_commands():
    first_block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["pip install '.[sam3]' && sam3 demo", "pip install -e '.[test]' && python -m pytest -q"]
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.skipif(not FIXTURE.is_dir(), reason=f"fixture directory {FIXTURE} is absent")
def test_readme_example_returns_the_input(monkeypatch):
    (example,) = _python_blocks()
    monkeypatch.chdir(FIXTURE)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
    printed = np.array(out.getvalue().strip().strip("[]").split(), dtype=np.int64)
    np.testing.assert_array_equal(printed, np.arange(16))
