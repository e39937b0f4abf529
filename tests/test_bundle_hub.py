"""Bundles in the Hugging Face hub cache (docs/sam3-bundle.md 8, 13; docs/sam3-cli.md `sam3 download`).

A generated tiny bundle is laid out as huggingface_hub lays out a download: `models--owner--name/blobs/<sha256>`
holding each file's bytes, `snapshots/<commit>/...` the bundle's tree of real directories whose files are relative
links into `blobs/`, `refs/<branch>` the commit a branch names. The oracles: the same bundle read from its plain
directory, huggingface_hub's own functions (its cache directory, repository-id rules, `snapshot_download` offline),
and messages spelled out from the docs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sam3 import validate_hook
from sam3.build import build
from sam3.bundle import Bundle, BundleError, hub, summarize
from sam3.cli import main

REPO = Path(__file__).resolve().parents[1]
MAIN = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "fedcba9876543210fedcba9876543210fedcba98"
EXTRA_LINE = ("sam3 download: downloading needs huggingface_hub, which is not installed: "
              "pip install 'amdxdna-direct[hub]'")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("src") / "tiny", "tiny", variant="host")


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "scene.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (21, 27, 3), dtype=np.uint8)).save(path)
    return path


def snapshot(cache: Path, source: Path, commit: str, repo: str = "owner/name", edit=None) -> Path:
    """`source` laid out as a hub download of `repo` at `commit`: every file a relative link into blobs/.
    `edit(relative_path, data)` may change a file's bytes on the way."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = f.relative_to(source)
        data = f.read_bytes() if edit is None else edit(rel.as_posix(), f.read_bytes())
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snap


def ref(cache: Path, name: str, commit: str, repo: str = "owner/name", text: str | None = None) -> None:
    path = cache / ("models--" + repo.replace("/", "--")) / "refs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit if text is None else text)


@pytest.fixture
def cache(tmp_path, source, monkeypatch) -> Path:
    """A hub cache holding owner/name at MAIN (branch main) and TAGGED (tag v1, one comment line added to its
    manifest), with HF_HUB_CACHE pointing at it and the network off."""
    where = tmp_path / "hub"
    snapshot(where, source, MAIN)
    ref(where, "main", MAIN)
    snapshot(where, source, TAGGED, edit=lambda rel, data: data + b"# tagged\n" if rel == "manifest.txt" else data)
    ref(where, "v1", TAGGED)
    monkeypatch.setenv("HF_HUB_CACHE", str(where))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no directory named owner/name here
    return where


def snap_dir(cache: Path, commit: str, repo: str = "owner/name") -> Path:
    return (cache / ("models--" + repo.replace("/", "--")) / "snapshots" / commit).resolve()


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def without_root(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "root"}


# ---------------------------------------------------------------------------------------------
# a snapshot directory opens and runs as the plain directory does


def test_the_layout_is_the_hubs(cache, source):
    snap = snap_dir(cache, MAIN)
    files = [p for p in snap.rglob("*") if not p.is_dir()]
    assert {p.relative_to(snap).parts[0] for p in files} >= {"kernels", "cases", "manifest.txt", "tensors.bin"}
    for p in files:
        target = os.readlink(p)
        assert p.is_symlink() and not os.path.isabs(target)
        assert Path(os.path.normpath(p.parent / target)).parent == snap.parents[1] / "blobs"


def test_a_snapshot_directory_opens_as_its_source(cache, source):
    with Bundle.open(source) as plain, Bundle.open(snap_dir(cache, MAIN)) as linked:
        assert without_root(summarize(linked)) == without_root(summarize(plain))
        assert summarize(linked)["problems"] == []
        for key in plain.kernel_keys():
            k = plain.kernel(key)
            assert linked.insts_bytes(key) == plain.insts_bytes(key)
            assert linked.file_bytes(plain.relative(k.xclbin)) == plain.file_bytes(k.xclbin)
        image = plain.relative(plain.ref_image)
        assert image.startswith("cases/") and linked.file_bytes(image) == plain.file_bytes(image)
        assert linked.tensors.names() == plain.tensors.names()
        for name in plain.tensors.names():
            assert np.array_equal(linked.tensors.raw(name), plain.tensors.raw(name))


def test_segment_and_check_run_on_a_hub_name(cache, source, image, capsys):
    code, out, _ = run(capsys, "segment", source, image, "a cat", "--threshold", "0", "--device", "emu", "--json")
    assert code == 0
    want = json.loads(out)["prompts"]
    code, out, _ = run(capsys, "segment", "owner/name", image, "a cat", "--threshold", "0", "--device", "emu",
                       "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["bundle"] == "owner/name" and doc["prompts"][0]["instances"] == want[0]["instances"]
    assert len(want[0]["instances"]) > 0
    code, out, _ = run(capsys, "check", "owner/name@v1", "--device", "emu")
    assert code == 0 and out.startswith("loaded owner/name@v1 (") and "ALL CHECKS PASSED" in out
    code, out, _ = run(capsys, "demo", "--bundle", "owner/name", "--device", "emu", "--json", "-o", "")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["bundles"] == ["owner/name"] and doc["weights"] == "from the bundle"


# ---------------------------------------------------------------------------------------------
# owner/name[@revision] in the cache (docs/sam3-bundle.md 14)


def test_names_and_revisions_resolve_to_their_snapshots(cache, capsys):
    for name, commit in [("owner/name", MAIN), ("owner/name@main", MAIN), ("owner/name@v1", TAGGED),
                         (f"owner/name@{TAGGED}", TAGGED), (f"owner/name@{MAIN}", MAIN)]:
        code, out, _ = run(capsys, "bundle", name, "--json")
        assert code == 0, name
        assert json.loads(out)["root"] == str(snap_dir(cache, commit)), name
    with Bundle.open("owner/name@v1") as b, Bundle.open(Path("owner/name@v1")) as p:  # demo --bundle passes a Path
        assert b.root == p.root == snap_dir(cache, TAGGED)
        assert b.file_bytes("manifest.txt").endswith(b"# tagged\n")
    with Bundle.open(snap_dir(cache, MAIN)) as b:  # amdxdna validate --bundle reads through the same hook
        assert [k.insts for k in validate_hook.bundle_kernels("owner/name")] == \
            [b.kernel(key).insts for key in b.kernel_keys()]
    ref(cache, "nl", TAGGED, text=TAGGED + "\n")  # a ref written with a line break still names its commit
    with Bundle.open("owner/name@nl") as b:
        assert b.root == snap_dir(cache, TAGGED)


def test_a_ref_wins_over_a_snapshot_of_the_same_name(cache, source):
    snapshot(cache, source, "v2")  # a folder named like the ref: the ref's commit is the one opened
    ref(cache, "v2", MAIN)
    with Bundle.open("owner/name@v2") as b:
        assert b.root == snap_dir(cache, MAIN)


def test_an_existing_directory_wins_over_the_cache(cache, source, tmp_path):
    shutil.copytree(source, tmp_path / "owner" / "name")
    with Bundle.open("owner/name") as b:
        assert b.root == (tmp_path / "owner" / "name").resolve()


@pytest.mark.parametrize("variables, where", [
    ({"HF_HUB_CACHE": "{tmp}/a"}, "{tmp}/a"),
    ({"HUGGINGFACE_HUB_CACHE": "{tmp}/legacy", "HF_HOME": "{tmp}/home"}, "{tmp}/legacy"),
    ({"HF_HOME": "{tmp}/home"}, "{tmp}/home/hub"),
    ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/huggingface/hub"),
    ({"HOME": "{tmp}/user"}, "{tmp}/user/.cache/huggingface/hub"),
    ({"HOME": "{tmp}/user", "HF_HOME": "~/hf"}, "{tmp}/user/hf/hub"),
    ({"HF_HUB_CACHE": "{tmp}/b", "HF_HOME": "{tmp}/home"}, "{tmp}/b"),
])
def test_the_cache_directory_is_huggingface_hubs(tmp_path, monkeypatch, variables, where):
    """The oracle: huggingface_hub's own constant, read in a fresh interpreter with the same environment."""
    pytest.importorskip("huggingface_hub")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    env.update({k: v.format(tmp=tmp_path) for k, v in variables.items()})
    theirs = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"],
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert theirs == where.format(tmp=tmp_path)
    assert str(hub.cache_dir()) == theirs


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False),
                                             ("", False), ("off", False), (None, False)])
def test_offline_reads_hf_hub_offline_as_huggingface_hub(monkeypatch, value, expected):
    pytest.importorskip("huggingface_hub")
    from huggingface_hub.constants import _is_true

    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if value is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub.offline() is expected is _is_true(value)


@pytest.mark.parametrize("repo", ["owner/name", "brishen/iron-sam3-npu2", "a/b", "A_1/x.y-z", "_o/n_", "o/" + "n" * 96,
                                  "o/n--m", "o/n..m", "o/n.git", "o/-n", "o/n.", "/n", "o/", "o/n/x", "name", "o/n m",
                                  "o/é", "o/" + "n" * 97, ".o/n", "o\\n/x"])
def test_repository_ids_follow_huggingface_hubs_rules(repo):
    """The oracle: huggingface_hub's validate_repo_id, restricted to the owner/name form."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
        theirs = "/" in repo
    except HFValidationError:
        theirs = False
    ours = hub.parse_name(repo)
    assert (ours is not None) is theirs, repo
    if ours is not None:
        assert ours.repo_id == repo and ours.revision == "main"
        assert ours.folder == "models--" + repo.replace("/", "--")


def test_revisions_parse_and_cannot_climb():
    assert hub.parse_name("o/n@refs/pr/1") == hub.HubName("o/n", "refs/pr/1")
    assert hub.parse_name(f"o/n@{MAIN}") == hub.HubName("o/n", MAIN)
    for bad in ("o/n@", "o/n@..", "o/n@../x", "o/n@a//b", "o/n@./a", "o/n@a/", "o/n@a\0b"):
        assert hub.parse_name(bad) is None, bad


# ---------------------------------------------------------------------------------------------
# a name that is not there


def test_a_name_not_in_the_cache_is_one_line_naming_what_was_looked_for(cache, capsys):
    folder = cache / "models--owner--absent"
    code, out, err = run(capsys, "bundle", "owner/absent")
    assert code == 1 and out == ""
    assert err == (f"sam3 bundle: bundle: owner/absent: not a bundle directory, and revision main of owner/absent is "
                   f"not in the Hugging Face cache (looked for {folder}/refs/main and {folder}/snapshots/main); fetch "
                   f"it with `sam3 download owner/absent`\n")
    folder = cache / "models--owner--name"
    with pytest.raises(BundleError) as e:
        Bundle.open("owner/name@v9")
    assert str(e.value) == (f"owner/name@v9: not a bundle directory, and revision v9 of owner/name is not in the "
                            f"Hugging Face cache (looked for {folder}/refs/v9 and {folder}/snapshots/v9); fetch it "
                            f"with `sam3 download owner/name --revision v9`")
    ref(cache, "gone", "aaaa")  # a ref to a commit whose snapshot is not there
    with pytest.raises(BundleError) as e:
        Bundle.open("owner/name@gone")
    assert str(e.value).startswith("owner/name@gone: not a bundle directory, and revision gone of owner/name is not in")
    assert f"(looked for {folder}/refs/gone (commit aaaa) and {folder}/snapshots/aaaa);" in str(e.value)
    ref(cache, "huge", "a" * 5000)  # no ref is that long: refused by its size, not read
    with pytest.raises(BundleError) as e:
        Bundle.open("owner/name@huge")
    assert str(e.value).startswith(f"{folder}/refs/huge: cannot read the ref ({folder}/refs/huge: 5000 bytes, over ")
    code, out, err = run(capsys, "segment", "owner/absent", "x.png", "a cat", "--device", "emu")
    assert code == 1 and err.count("\n") == 1 and "fetch it with `sam3 download owner/absent`" in err
    code, out, err = run(capsys, "check", "owner/absent", "--device", "emu")
    assert code == 1 and err.count("\n") == 1 and "fetch it with `sam3 download owner/absent`" in err


def test_a_path_that_is_no_name_keeps_the_directory_error(cache, tmp_path):
    for path in (str(tmp_path / "nowhere"), "a/b/c", "nowhere"):
        with pytest.raises(BundleError, match=f"^{path}: cannot open the bundle directory"):
            Bundle.open(path)


# ---------------------------------------------------------------------------------------------
# what stays refused inside a snapshot (docs/sam3-bundle.md 8)


def _line(snap: Path, text: str) -> int:
    return (snap / "manifest.txt").read_text().splitlines().index(text) + 1


@pytest.mark.parametrize("line, what, path, reason", [
    ("op extra xclbin=/etc/passwd insts=kernels/x.bin", "xclbin", "/etc/passwd", "is absolute"),
    ("op extra xclbin=kernels/x.xclbin insts=../../blobs/{blob}", "insts", "../../blobs/{blob}",
     "escapes the bundle directory"),
    ("ref_image cases/../../x.png", "ref_image", "cases/../../x.png", "escapes the bundle directory"),
])
def test_manifest_paths_out_of_the_snapshot_stay_refused(tmp_path, source, monkeypatch, line, what, path, reason):
    """The blobs are one `..` away from a snapshot, and the links reach them; a manifest path may not."""
    cache = tmp_path / "hub"
    blob = hashlib.sha256((source / "vocab.json").read_bytes()).hexdigest()
    line, path = line.format(blob=blob), path.format(blob=blob)
    snap = snapshot(cache, source, MAIN, edit=lambda rel, d: d + line.encode() + b"\n" if rel == "manifest.txt" else d)
    ref(cache, "main", MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(BundleError) as e:
        Bundle.open("owner/name")
    assert str(e.value) == f"manifest.txt:{_line(snap, line)}: {what} path {path!r} {reason}, in: {line}"


def test_links_to_what_is_not_a_regular_file_stay_refused(cache, capsys):
    snap = snap_dir(cache, MAIN)
    kernel = sorted((snap / "kernels").iterdir())[0]
    rel = f"kernels/{kernel.name}"
    blobs = snap.parents[1] / "blobs"
    os.mkfifo(blobs / "fifo")
    cases = [("dir", os.path.relpath(blobs, kernel.parent), "is not a regular file (a directory)"),
             ("fifo", os.path.relpath(blobs / "fifo", kernel.parent), "is not a regular file (a FIFO)"),
             ("missing", "../../../blobs/0000", "does not exist")]
    for label, target, reason in cases:
        kernel.unlink()
        os.symlink(target, kernel)
        with Bundle.open(snap) as b:  # a FIFO is refused without being opened: no hang
            with pytest.raises(BundleError) as e:
                b.file_bytes(rel)
            assert str(e.value) == f"{rel}: is a symbolic link to {target}, which {reason}", label
            problems = summarize(b)["problems"]
            assert any(f"{rel}: is a symbolic link to {target}, which {reason}" in p for p in problems), label
    code, out, _ = run(capsys, "bundle", "owner/name")
    assert code == 1 and f"{rel}: is a symbolic link to ../../../blobs/0000, which does not exist" in out
    kernel.unlink()
    os.symlink(kernel.name, kernel)  # a link to itself
    with Bundle.open(snap) as b, pytest.raises(BundleError) as e:
        b.file_bytes(rel)
    assert str(e.value) == f"{rel}: is a symbolic link in a loop of links"
    (snap / "vocab.json").unlink()
    os.symlink("/dev/null", snap / "vocab.json")
    with pytest.raises(BundleError) as e:
        Bundle.open(snap)
    assert str(e.value) == ("vocab.json: is a symbolic link to /dev/null, which is not a regular file "
                            "(a character device)")


def test_a_file_swapped_after_open_is_refused(cache):
    snap = snap_dir(cache, MAIN)
    with Bundle.open(snap) as b:
        key = b.kernel_keys()[0]
        insts = b.relative(b.kernel(key).insts)
        other = next(k for k in b.kernel_keys() if b.relative(b.kernel(k).insts) != insts)
        link = snap / insts
        target = os.readlink(snap / b.relative(b.kernel(other).insts))
        link.unlink()
        os.symlink(target, link)  # another blob now: a regular file, but not the one found at open
        swapped = f"{insts}: was replaced after the bundle was opened (another file is there now)"
        with pytest.raises(BundleError) as e:
            b.insts_bytes(key)
        assert str(e.value) == swapped
        assert b.file_problem(insts) == swapped
        # A directory swapped for a link out of the bundle after open is not followed either.
        os.rename(snap / "cases", snap.parent / "cases")
        os.symlink(snap.parent / "cases", snap / "cases")
        with pytest.raises(BundleError) as e:
            b.file_bytes(b.relative(b.ref_image))
        assert str(e.value) == (f"{b.relative(b.ref_image)}: the path passes through a symbolic link to a directory "
                                f"outside the bundle ({snap.parent / 'cases'})")
    (snap / "cases").unlink()
    os.rename(snap.parent / "cases", snap / "cases")
    with Bundle.open(snap) as b:  # opened afresh, the new file is the bundle's
        assert b.insts_bytes(key) == (link.parent / target).read_bytes()


# ---------------------------------------------------------------------------------------------
# sam3 download (docs/sam3-cli.md)


def test_download_without_huggingface_hub_names_the_extra(cache, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    code, out, err = run(capsys, "download", "owner/name")
    assert (code, out, err) == (1, "", EXTRA_LINE + "\n")
    code, out, err = run(capsys, "download", "owner/name", "--json")
    assert code == 1 and json.loads(out) == {"schema": 1, "command": "download", "ok": False,
                                             "error": EXTRA_LINE.removeprefix("sam3 download: ")}
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["hub"] == ["huggingface_hub"]


def test_download_offline_returns_the_cached_snapshot(cache, capsys):
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import snapshot_download

    theirs = snapshot_download("owner/name", cache_dir=cache, local_files_only=True)
    code, out, err = run(capsys, "download", "owner/name")
    assert (code, err) == (0, "") and out == f"{theirs}\n" and Path(theirs) == snap_dir(cache, MAIN)
    code, out, _ = run(capsys, "download", "owner/name", "--revision", "v1", "--json")
    assert code == 0 and json.loads(out) == {"schema": 1, "command": "download", "ok": True, "repo": "owner/name",
                                             "revision": "v1", "commit": TAGGED,
                                             "path": str(snap_dir(cache, TAGGED))}
    code, out, _ = run(capsys, "download", "owner/name@v1")
    assert code == 0 and out == f"{snap_dir(cache, TAGGED)}\n"


def test_download_errors_are_one_line(cache, capsys):
    pytest.importorskip("huggingface_hub")
    code, out, err = run(capsys, "download", "owner/absent")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("sam3 download: owner/absent: download failed: LocalEntryNotFoundError: Cannot find")
    code, _, err = run(capsys, "download", "owner/name@v1", "--revision", "main")
    assert (code, err) == (1, "sam3 download: owner/name@v1: the revision is given twice (@ and --revision)\n")
    code, _, err = run(capsys, "download", "not a name")
    assert (code, err) == (1, "sam3 download: not a name: not a Hugging Face repository name (owner/name[@revision])\n")
    code, _, err = run(capsys, "download", "owner/name", "--revision", "../x")
    assert (code, err) == (1, "sam3 download: ../x: not a revision (an empty, '.' or '..' component)\n")
    with pytest.raises(SystemExit) as e:
        main(["download"])
    assert e.value.code == 2
