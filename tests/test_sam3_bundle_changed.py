"""A bundle file changed on disk under an open `Sam3` (docs/sam3-bundle.md 8.1): replaced, rewritten in place with
its size and mtime kept, truncated or removed, each is refused with one line before the forward runs (no kernel
submitted), and a change during a forward refuses its result; a truncation during a forward is SIGBUS, as
documented. The oracle for "before the forward": the device's EXEC_CMD count does not move."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sam3.build import build
from sam3.bundle import Bundle, BundleError
from sam3.pipeline import Sam3

REPO = Path(__file__).resolve().parents[1]
# One file of each kind the bundle reads: the mapped weights, the text files read at open, a stream, an xclbin.
FILES = ("tensors.bin", "tensors.txt", "manifest.txt", "vocab.json", "kernels/d_s.insts.bin",
         "kernels/mha_d.xclbin")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(tmp_path_factory.mktemp("b") / "dev", "tiny", variant="device-f32")


@pytest.fixture
def root(built, tmp_path):
    """A copy of the bundle this test may change."""
    return Path(shutil.copytree(built, tmp_path / "bundle"))


@pytest.fixture(scope="module")
def rgb():
    return np.random.default_rng(0).integers(0, 256, (21, 27, 3), dtype=np.uint8)


def replace(path: Path) -> None:
    """Another file renamed over it (what a re-copy through a temporary file, `rsync` or a hub update does): the
    same bytes but the last one, so only the file's identity tells."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def rewrite(path: Path) -> None:
    """The same file written in place, same size, its times set back (`cp -p` over it, `rsync -t --inplace`)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def truncate(path: Path) -> None:
    os.truncate(path, os.stat(path).st_size // 2)


def remove(path: Path) -> None:
    path.unlink()


CHANGES = {"replaced": replace, "rewritten": rewrite, "truncated": truncate, "removed": remove}


def refused(root: Path, name: str) -> str:
    return f"^{root / name} changed on disk since the bundle was opened: reopen it$"


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("change", [c for c in CHANGES if c != "truncated"])
def test_a_changed_file_is_refused_before_the_forward(root, rgb, name, change):
    with Sam3(root, "emu:npu4") as sam:
        sam.segment(rgb, "a cat")
        CHANGES[change](root / name)
        execs = sam.npu.device.stats["EXEC_CMD"]
        for call in (lambda: sam.segment(rgb, "a cat"), lambda: sam.segment(rgb[:20], "dog"),
                     lambda: sam.encode_prompt("dog"), lambda: sam.encode_image(rgb),
                     lambda: list(sam.segment_many([rgb], ["dog"]))):
            with pytest.raises(BundleError, match=refused(root, name)):
                call()
        assert sam.npu.device.stats["EXEC_CMD"] == execs  # nothing reached the device


@pytest.mark.parametrize("name", [n for n in FILES if n != "tensors.bin"])
def test_a_truncated_file_is_refused(root, rgb, name):
    with Sam3(root, "emu:npu4") as sam:
        sam.segment(rgb, "a cat")
        truncate(root / name)
        with pytest.raises(BundleError, match=refused(root, name)):
            sam.segment(rgb, "dog")


def run(script: str, *argv: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, argv)], capture_output=True,
                          text=True, timeout=180, env=env)


def test_a_truncated_tensors_bin_is_refused_not_a_sigbus(root):
    """Before the check, the next forward read the mapping past the new end of the file: SIGBUS. In a child, so a
    regression cannot take the test run down."""
    done = run("""
        import os, sys
        import numpy as np
        from sam3.bundle import BundleError
        from sam3.pipeline import Sam3
        root = sys.argv[1]
        rgb = np.random.default_rng(0).integers(0, 256, (21, 27, 3), dtype=np.uint8)
        with Sam3(root, "emu:npu4") as sam:
            sam.segment(rgb, "a cat")
            os.truncate(os.path.join(root, "tensors.bin"), 0)
            try:
                sam.segment(rgb, "dog")
            except BundleError as e:
                print(e)
    """, root)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout == f"{root / 'tensors.bin'} changed on disk since the bundle was opened: reopen it\n"


def test_a_truncation_during_a_forward_is_sigbus(root):
    """What docs/sam3-bundle.md 8.1 says a truncation in the middle of a forward does: the next read of the mapping
    past the new end raises SIGBUS, which ends the process (here: while the decoder runs, before it reads its
    host weights)."""
    done = run("""
        import os, sys
        import numpy as np
        from sam3.pipeline import Sam3
        root = sys.argv[1]
        rgb = np.random.default_rng(0).integers(0, 256, (21, 27, 3), dtype=np.uint8)
        with Sam3(root, "emu:npu4") as sam:
            forward = sam.decoder.forward
            def truncating(*args):
                os.truncate(os.path.join(root, "tensors.bin"), 0)
                return forward(*args)
            sam.decoder.forward = truncating
            sam.segment(rgb, "a cat")
        print("survived")
    """, root)
    assert done.returncode == -signal.SIGBUS and "survived" not in done.stdout, (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("change", ["replaced", "rewritten"])
def test_a_change_during_a_forward_refuses_its_result(root, rgb, change):
    """The check after the forward: weights may have come from both files, so the result is not returned."""
    with Sam3(root, "emu:npu4") as sam:
        forward = sam.decoder.forward

        def changing(*args):
            CHANGES[change](root / "tensors.bin")
            return forward(*args)

        sam.decoder.forward = changing
        with pytest.raises(BundleError, match=refused(root, "tensors.bin")):
            sam.segment(rgb, "a cat")


def test_reopened_it_runs_the_new_files(root, rgb):
    """The way out the message names: a Sam3 opened after the change reads the new bundle and gives its results."""
    with Sam3(root, "emu:npu4") as sam:
        sam.segment(rgb, "a cat")
        replace(root / "tensors.bin")
        with pytest.raises(BundleError, match="reopen it"):
            sam.segment(rgb, "a cat")
    with Sam3(root, "emu:npu4") as sam:
        again = sam.segment(rgb, "a cat", threshold=0.0)
    assert len(again) > 0


def test_an_unchanged_bundle_passes_and_every_file_is_watched(root):
    with Bundle.open(root) as b:
        b.check_unchanged()
        watched = {"/".join(p) for p in b._dir._stamps}
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert watched == on_disk  # every file the manifest names is recorded at open, and nothing else is there
