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
    example = _python_blocks()[0]
    monkeypatch.chdir(tmp_path)  # it needs no file
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
    printed = np.array(out.getvalue().strip().strip("[]").split(), dtype=np.int64)
    np.testing.assert_array_equal(printed, np.arange(16))


def test_readme_sam3_example_runs_on_a_generated_bundle(monkeypatch, tmp_path):
    """The SAM3 snippet, with its bundle and image names pointed at a generated bundle and its reference image."""
    from sam3.build import build
    from sam3.bundle import Bundle

    (snippet,) = [b for b in _python_blocks() if "Sam3(" in b]
    root = build(tmp_path / "bundle", "tiny", variant="device-f32")
    with Bundle.open(root) as b:
        image = b.ref_image
    code = snippet.replace('"bundle/"', repr(str(root))).replace('"cats.jpg"', repr(str(image)))
    assert code != snippet
    scope = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), scope)
    found = scope["found"]
    assert found.scores.shape[0] == found.boxes.shape[0] == found.masks.shape[0]
