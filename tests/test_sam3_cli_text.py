"""The `sam3` command line under hostile text (issue 26 item 10; docs/sam3-cli.md "Hostile text"): a prompt that
is not UTF-8, Ctrl-C during the first second of imports, control characters in every name, path and value
printed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sam3.build import build
from sam3.cli import main

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 120
ESCAPES = "\x1b[31m\x1b]0;title\x07\x9b2J\u202e"  # colour, window title + BEL, C1 CSI, a bidi override


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build(tmp_path_factory.mktemp("b") / "dev", "tiny", variant="device-f32")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "scene.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (21, 27, 3), dtype=np.uint8)).save(path)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMDXDNA_", "SAM3_", "LC_", "LANG"))}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _clean(text: str) -> None:
    """No control character but the line breaks, no forged line."""
    assert not any(c in text for c in "\x1b\x07\x9b\u202e\r"), repr(text)
    assert not any(line.startswith("forged") for line in text.splitlines()), text


# --------------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("form", ["one", "many"])
def test_a_prompt_that_is_not_utf8_is_one_line_and_exit_1(root, image, form):
    prompt = b"a\xffb"
    tail = [prompt] if form == "one" else [b"--prompt", prompt]
    argv = [sys.executable.encode(), b"-m", b"sam3", b"segment", os.fsencode(root), os.fsencode(image), *tail,
            b"--device", b"emu:npu4"]
    done = subprocess.run(argv, env=_env(LC_ALL="C"), capture_output=True, timeout=TIMEOUT)
    assert done.returncode == 1, done.stderr
    assert done.stderr == b"sam3 segment: prompt 'a\\xffb' is not UTF-8 text (byte 0xff at character 1)\n"
    assert done.stdout == b""  # refused before the bundle was loaded


# --------------------------------------------------------------------------------------------- Ctrl-C


def _interrupt(marker: str, delay: float, bundle: Path) -> tuple[int | None, str, list[str]]:
    """`python -X importtime -m sam3 bundle B`, SIGINT ``delay`` s after the import-time line of ``marker`` (that
    module imported: the interpreter's own start-up, before any code of the package, is over)."""
    child = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "sam3", "bundle", str(bundle)], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in child.stderr:
            if line.rstrip().endswith(f"| {marker}"):
                break
        time.sleep(delay)
        finished = child.poll() is not None
        if not finished:
            child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    return (None if finished else child.returncode), out, lines


# Delays after the package `sam3` itself is imported (runpy then starts `sam3.__main__`), and after `sam3.cli`.
@pytest.mark.parametrize("marker, delay", [("sam3", 0.01), ("sam3", 0.05), ("sam3", 0.15), ("sam3", 0.3),
                                           ("sam3", 0.6), ("sam3.cli", 0.0)])
def test_ctrl_c_during_the_imports_is_one_line_and_130(root, marker, delay):
    code, out, lines = _interrupt(marker, delay, root)
    if code is None:  # the command had finished before the signal could be sent
        return
    assert "Traceback" not in "\n".join(lines)
    if code == 0:  # it finished as the signal was sent, before it arrived
        assert lines == [] and "problems" in out
        return
    if code == 130:
        assert lines == ["sam3 bundle: interrupted"]
    else:
        # ended by the signal itself (docs/sam3-cli.md "Hostile text"): after the line, or once the work was done
        assert code == -signal.SIGINT, lines
        assert lines == ["sam3 bundle: interrupted"] or (lines == [] and "problems" in out)


# --------------------------------------------------------------------------------------------- escaping


def test_a_newline_in_a_bundle_or_overlay_path_forges_no_line(root, image, tmp_path, capsys):
    odd = tmp_path / f"b\nforged line{ESCAPES}"
    os.symlink(root, odd)
    overlay = tmp_path / f"o\nforged{ESCAPES}.png"
    assert main(["segment", str(odd), str(image), "a cat", "--device", "emu:npu4", "-o", str(overlay)]) == 0
    out, err = capsys.readouterr()
    _clean(out + err)
    assert out.splitlines()[0].startswith(f"loaded {str(odd)!r} (")
    assert out.splitlines()[-1] == f"wrote {str(overlay)!r}"
    assert overlay.is_file()


def test_many_images_lines_and_errors_are_escaped(root, image, tmp_path, capsys):
    bad = tmp_path / f"x\nforged{ESCAPES}.png"
    bad.write_bytes(b"not an image")
    assert main(["segment", str(root), str(image), str(bad), "--prompt", "a cat", "--device", "emu:npu4"]) == 1
    out, err = capsys.readouterr()
    _clean(out + err)
    assert sum("FAILED" in line for line in out.splitlines()) == 1


def test_terminal_escapes_in_a_manifest_value_are_escaped_by_sam3_bundle(root, tmp_path, capsys):
    copy = Path(shutil.copytree(root, tmp_path / "copy"))
    with (copy / "manifest.txt").open("a", encoding="utf-8") as f:
        f.write(f"param note red{ESCAPES}\n")
    main(["bundle", str(copy)])
    out, err = capsys.readouterr()
    _clean(out + err)
    note = next(line for line in out.splitlines() if " note " in line)
    assert note.split()[-1] == "red\\x1b[31m\\x1b]0;title\\x07\\x9b2J\\u202e"
    main(["bundle", str(copy), "--json"])
    assert "\\u001b[31m" in capsys.readouterr().out  # JSON keeps the value, escaped its own way


def test_a_usage_error_quoting_an_argument_stays_one_line(root, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bundle", str(root), f"--x\nforged{ESCAPES}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    _clean(err)
    assert err.count("\n") == 1 and "unrecognized arguments: --x\\nforged\\x1b[31m" in err


def test_an_error_naming_a_hostile_image_path_is_one_line(root, tmp_path, capsys):
    missing = tmp_path / f"m\nforged{ESCAPES}.png"
    assert main(["segment", str(root), str(missing), "a cat", "--device", "emu:npu4"]) == 1
    out, err = capsys.readouterr()
    _clean(out + err)
    assert err.count("\n") == 1 and err.endswith(": no such file\n")
