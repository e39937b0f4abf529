"""The README opens with its two commands, and its Python example runs as written from the repository alone."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_opens_with_install_and_test_commands():
    first_block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["pip install '.[sam3]' && sam3 demo", "pip install -e '.[test]' && python -m pytest -q"]
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_readme_example_returns_the_input(monkeypatch, tmp_path):
    (example,) = _python_blocks()
    monkeypatch.chdir(tmp_path)  # it needs no file
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
    printed = np.array(out.getvalue().strip().strip("[]").split(), dtype=np.int64)
    np.testing.assert_array_equal(printed, np.arange(16))
