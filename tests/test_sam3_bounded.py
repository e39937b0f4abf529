"""Bounded reads in the SAM3 layer (issue 26 item 6; docs/files.md 7, docs/sam3-segment.md 11.2).

A decompression bomb (a tiny PNG or JPEG declaring 100000 x 100000 pixels) is refused from its header, in one line
naming its pixels and the limit (`max_pixels`, `--max-pixels`); a FIFO or a device named as an image or as one of
the files `sam3 export` reads is refused without blocking; every JSON and text file export reads has a size
limit, checked before a byte is read (a 1 GiB sparse file costs nothing).

FIFO cases that would block if the file were opened run under an alarm (in process) or a subprocess timeout.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from amdxdna_direct import files
from sam3 import export, preprocess, tracker_config, userfiles
from sam3.build import build
from sam3.cli import main
from sam3.export_text import ExportError
from sam3.pipeline import Sam3

REPO = Path(__file__).resolve().parents[1]
HF = REPO / "tests" / "fixtures" / "sam3-tiny" / "hf"
TIMEOUT = 120
SPARSE = 1 << 30  # a 1 GiB hole: nothing is written, nothing may be read


@pytest.fixture(autouse=True)
def alarm():
    """Turn a read that blocks (a FIFO opened for reading waits for a writer) into a failure, not a hang."""
    def expired(signum, frame):
        raise TimeoutError("blocked: a FIFO was opened or read")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int, height: int) -> bytes:
    """A PNG header declaring width x height RGB8 pixels, with a few bytes of data (docs/sam3-segment.md 11.2)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(bytes(64)))
            + _chunk(b"IEND", b""))


def bomb_jpeg(width: int, height: int) -> bytes:
    """A baseline JPEG header (SOI, SOF0 of three components, SOS) declaring width x height pixels."""
    def segment(marker: int, body: bytes) -> bytes:
        return b"\xff" + bytes([marker]) + struct.pack(">H", len(body) + 2) + body

    sof = segment(0xC0, struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00")
    sos = segment(0xDA, b"\x03\x01\x00\x02\x00\x03\x00\x00\x3f\x00")
    return b"\xff\xd8" + sof + sos + bytes(16) + b"\xff\xd9"


# --------------------------------------------------------------------------------------------- decompression bombs


@pytest.mark.parametrize("make, name, width, height", [(bomb_png, "bomb.png", 100000, 100000),
                                                      (bomb_jpeg, "bomb.jpg", 65535, 60000)])  # JPEG: 16-bit sizes
def test_a_bomb_is_refused_from_its_header_naming_its_pixels_and_the_limit(tmp_path, make, name, width, height):
    path = tmp_path / name
    path.write_bytes(make(width, height))
    assert path.stat().st_size < 1000
    with pytest.raises(preprocess.ImageError) as e:
        preprocess.load_rgb(path)
    assert str(e.value) == (f"image {path}: {width} x {height} = {width * height} pixels, over the limit of 67108864 "
                            f"pixels (max_pixels; --max-pixels on the command line)")


def test_the_default_limit_is_8192_squared():
    assert preprocess.MAX_PIXELS == 8192 * 8192
    for doc in ("docs/sam3-segment.md", "docs/sam3-cli.md"):
        assert "67108864" in (REPO / doc).read_text() and "8192 x 8192" in (REPO / doc).read_text()


def test_max_pixels_is_the_limit_and_pillows_own_check_does_not_apply(tmp_path, monkeypatch):
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    # Pillow's Image.open would refuse this image above 2 * MAX_IMAGE_PIXELS (and warn above it): only ours applies
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    np.testing.assert_array_equal(preprocess.load_rgb(tmp_path / "a.png", max_pixels=48 * 64), rgb)
    with pytest.raises(preprocess.ImageError, match=r"48 = 3072 pixels, over the limit of 3071 pixels"):
        preprocess.load_rgb(tmp_path / "a.png", max_pixels=48 * 64 - 1)
    with pytest.raises(preprocess.ImageError, match=r"over the limit of 3071"):
        preprocess.preprocess_file(tmp_path / "a.png", 8, max_pixels=3071)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "100"])
def test_a_max_pixels_that_is_not_a_positive_integer_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match=r"max_pixels must be a positive whole number of pixels, got "):
        preprocess.load_rgb(tmp_path / "absent.png", max_pixels=bad)
    with pytest.raises(ValueError, match=r"max_pixels must be a positive whole number"):
        Sam3(tmp_path / "no-bundle", "emu:npu4", max_pixels=bad)  # before the bundle is looked at


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build(tmp_path_factory.mktemp("b") / "dev", "tiny", variant="device-f32")


def test_sam3_max_pixels_and_the_command_line_option(root, tmp_path, capsys):
    rgb = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    (tmp_path / "bomb.png").write_bytes(bomb_png(100000, 100000))
    with Sam3(root, "emu:npu4", max_pixels=600) as sam:
        assert sam.segment(tmp_path / "a.png", "a cat").masks.shape[1:] == (20, 30)
    with Sam3(root, "emu:npu4", max_pixels=599) as sam, pytest.raises(preprocess.ImageError, match="over the limit"):
        sam.segment(tmp_path / "a.png", "a cat")
    capsys.readouterr()
    assert main(["segment", str(root), str(tmp_path / "bomb.png"), "a cat", "--device", "emu:npu4"]) == 1
    err = capsys.readouterr().err
    assert err == (f"sam3 segment: image {tmp_path / 'bomb.png'}: 100000 x 100000 = 10000000000 pixels, over the "
                   f"limit of 67108864 pixels (max_pixels; --max-pixels on the command line)\n")
    assert main(["segment", str(root), str(tmp_path / "a.png"), "a cat", "--device", "emu:npu4",
                 "--max-pixels", "599"]) == 1
    assert "30 x 20 = 600 pixels, over the limit of 599 pixels" in capsys.readouterr().err
    assert main(["segment", str(root), str(tmp_path / "a.png"), "a cat", "--device", "emu:npu4",
                 "--max-pixels", "600"]) == 0
    many = main(["segment", str(root), str(tmp_path / "a.png"), str(tmp_path / "bomb.png"), "--prompt", "a cat",
                 "--device", "emu:npu4", "--max-pixels", "600"])
    out, err = capsys.readouterr()
    assert many == 1 and "bomb.png: FAILED: image" in out and "10000000000 pixels" in out
    for bad in ("0", "-5", "1e6", "x"):
        with pytest.raises(SystemExit) as e:
            main(["segment", str(root), str(tmp_path / "a.png"), "a cat", "--max-pixels", bad])
        assert e.value.code == 2
        assert f"argument --max-pixels: expected a positive whole number of pixels, got '{bad}'" in \
            capsys.readouterr().err


# --------------------------------------------------------------------------------------------- non-regular images


def test_a_fifo_or_a_device_named_as_an_image_is_refused_unopened(tmp_path):
    os.mkfifo(tmp_path / "fifo.png")
    with pytest.raises(preprocess.ImageError, match=r"fifo\.png: is not a regular file \(a FIFO\)$"):
        preprocess.load_rgb(tmp_path / "fifo.png")
    with pytest.raises(preprocess.ImageError, match=r"zero: is not a regular file \(a character device\)$"):
        preprocess.load_rgb("/dev/zero")
    with pytest.raises(preprocess.ImageError, match=r"is not a regular file \(a directory\)$"):
        preprocess.load_rgb(tmp_path)


def test_an_image_over_the_file_limit_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.png"
    with big.open("wb") as f:
        f.write(bomb_png(8, 8))
        f.truncate(SPARSE)
    with pytest.raises(preprocess.ImageError, match=r"1073741824 bytes, over the 256 MiB limit for image files"):
        preprocess.load_rgb(big)


def _sam3(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "sam3", *argv], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def test_sam3_segment_with_a_fifo_image_does_not_hang(root, tmp_path):
    os.mkfifo(tmp_path / "in.png")
    done = _sam3("segment", str(root), str(tmp_path / "in.png"), "a cat", "--device", "emu:npu4")
    assert done.returncode == 1
    assert done.stderr == f"sam3 segment: image {tmp_path / 'in.png'}: is not a regular file (a FIFO)\n"


def test_sam3_export_with_a_fifo_config_json_does_not_hang(tmp_path):
    (tmp_path / "hf").mkdir()
    os.mkfifo(tmp_path / "hf" / "config.json")
    done = _sam3("export", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "out"))
    assert done.returncode == 1
    assert done.stderr == (f"sam3 export: {tmp_path / 'hf' / 'config.json'}: cannot read: is not a regular file "
                           f"(a FIFO)\n")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- export's reads


def _hostile(path: Path, how: str) -> None:
    """Make ``path`` a FIFO, a link to /dev/zero, a 1 GiB sparse file, or JSON nested 100000 deep."""
    path.unlink(missing_ok=True)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "zero":
        path.symlink_to("/dev/zero")
    elif how == "sparse":
        with path.open("wb") as f:
            f.truncate(SPARSE)
    else:
        path.write_text("[" * 100000)


REASONS = {
    "fifo": r"is not a regular file \(a FIFO\)",
    "zero": r"is not a regular file \(a character device\)",
    "sparse": r"1073741824 bytes, over the 16 MiB limit for text files",
    "nested": r"not JSON this reader takes: nested too deeply",
}


@pytest.fixture
def memory_cap():
    """Address space capped at 2 GiB above what the process has mapped while the test runs: a reader that would
    read /dev/zero until it runs out (what the export did, issue 26 item 6) meets MemoryError instead of taking the
    machine's memory."""
    mapped = next(int(line.split()[1]) << 10 for line in Path("/proc/self/status").read_text().splitlines()
                  if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + (2 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("how", sorted(REASONS))
def test_a_hostile_config_json_is_refused_by_export_and_the_tracker(tmp_path, how, memory_cap):
    _hostile(tmp_path / "config.json", how)
    with pytest.raises(ExportError, match=rf"config\.json: cannot read: {REASONS[how]}$"):
        export.read_model(tmp_path)
    with pytest.raises(tracker_config.TrackerError, match=rf"config\.json: cannot read the checkpoint's config "
                                                          rf"\({REASONS[how]}\)$"):
        tracker_config.read_config(tmp_path)


def _checkpoint_copy(tmp_path: Path) -> Path:
    if not HF.is_dir():
        pytest.skip(f"the sam3-tiny checkpoint fixture is not in {HF.parent}")
    root = tmp_path / "hf"
    root.mkdir()
    for f in HF.iterdir():
        (root / f.name).symlink_to(f)
    return root


@pytest.mark.parametrize("name", ["processor_config.json", "tokenizer_config.json", "vocab.json"])
@pytest.mark.parametrize("how", ["fifo", "sparse"])
def test_every_json_file_export_reads_is_bounded(tmp_path, name, how):
    root = _checkpoint_copy(tmp_path)
    export.read_model(root)  # the copy is a good checkpoint
    _hostile(root / name, how)
    with pytest.raises(ExportError, match=rf"{name.replace('.', '[.]')}: cannot read: {REASONS[how]}$"):
        export.read_model(root)


def test_the_reference_archive_and_its_cases_are_bounded(tmp_path):
    os.mkfifo(tmp_path / "reference.npz")
    with pytest.raises(ExportError, match=r"reference\.npz: cannot read the reference: is not a regular file "
                                          r"\(a FIFO\)$"):
        export._Reference.load(tmp_path / "reference.npz", None)
    (tmp_path / "reference.npz").unlink()
    np.savez(tmp_path / "reference.npz", x=np.zeros(2))
    for how in ("fifo", "sparse"):
        _hostile(tmp_path / "cases.json", how)
        with pytest.raises(ExportError, match=rf"cases\.json: cannot read the cases beside the reference: "
                                              rf"{REASONS[how]}$"):
            export._Reference.load(tmp_path / "reference.npz", None)


def test_the_files_export_copies_whole_are_bounded(tmp_path):
    os.mkfifo(tmp_path / "merges.txt")
    with pytest.raises(files.FileRefused, match=r"merges\.txt: is not a regular file \(a FIFO\)$"):
        userfiles.read_bytes(tmp_path / "merges.txt", "text")
    _hostile(tmp_path / "vocab.json", "sparse")
    with pytest.raises(files.FileRefused, match=r"over the 64 MiB limit for text files"):
        userfiles.read_bytes(tmp_path / "vocab.json", "text")
    (tmp_path / "ok.json").write_text(json.dumps({"a": [1, 2]}))
    assert userfiles.read_json(tmp_path / "ok.json") == {"a": [1, 2]}
    assert userfiles.read_bytes(tmp_path / "ok.json", "text") == b'{"a": [1, 2]}'
    with pytest.raises(FileNotFoundError):
        userfiles.read_json(tmp_path / "absent.json")
