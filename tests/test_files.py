"""amdxdna_direct.files: regular files only, a size limit per kind, bounded reads, paths shown safely
(docs/files.md). Every input is made by the test in a temporary directory."""

from __future__ import annotations

import os
import pickle
import socket
import stat
import tracemalloc

import pytest

from amdxdna_direct import files, insts, xclbin
from amdxdna_direct.errors import Error
from amdxdna_direct.files import FileRefused

GiB = 1 << 30


@pytest.fixture
def tree(tmp_path):
    """a (6 bytes), link -> a, sub/b, linkdir -> sub, fifo, sparse (8 GiB, no data), dir."""
    (tmp_path / "a").write_bytes(b"hello\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"b" * 10)
    (tmp_path / "link").symlink_to("a")
    (tmp_path / "linkdir").symlink_to("sub")
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(8 * GiB)
    (tmp_path / "dir").mkdir()
    return tmp_path


# --------------------------------------------------------------------------------------------- reading


def test_regular_files_read_whole_by_str_bytes_and_pathlib(tree):
    assert files.read_file(tree / "a", "text") == b"hello\n"
    assert files.read_file(str(tree / "a"), "xclbin") == b"hello\n"
    assert files.read_file(os.fsencode(tree / "a"), "insts") == b"hello\n"
    assert files.read_text(tree / "a") == "hello\n"
    with files.open_file(tree / "a", "text") as f:
        assert f.read() == b"hello\n"
    fd = files.open_fd(tree / "a", "text")
    try:
        assert stat.S_ISREG(os.fstat(fd).st_mode) and files.read_fd(fd, "a", "text") == b"hello\n"
    finally:
        os.close(fd)


@pytest.mark.parametrize(("name", "what"), [("fifo", "a FIFO"), ("dir", "a directory")])
def test_fifo_and_directory_are_refused_by_name_and_kind(tree, name, what):
    # a FIFO with no writer would block a plain open(); it is refused by its stat without being opened
    with pytest.raises(FileRefused, match=f"^{tree / name}: is not a regular file \\({what}\\)$") as e:
        files.read_file(tree / name, "insts")
    assert (e.value.path, e.value.reason, e.value.code) == (tree / name, f"is not a regular file ({what})", "type")


def test_devices_and_sockets_are_refused(tree):
    with pytest.raises(FileRefused, match=r"^/dev/zero: is not a regular file \(a character device\)$"):
        files.read_file("/dev/zero", "xclbin")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tree / "sock"))
        with pytest.raises(FileRefused, match=r"sock: is not a regular file \(a socket\)$"):
            files.read_file(tree / "sock", "npy")


def test_a_name_swapped_for_a_fifo_after_the_stat_is_refused_by_fstat(tree):
    # the check open_fd applies to the opened descriptor; O_NONBLOCK keeps the FIFO's open from waiting
    fd = os.open(tree / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(FileRefused, match=r"is not a regular file \(a FIFO\)"):
            files.check_regular(tree / "fifo", os.fstat(fd), "text")
    finally:
        os.close(fd)


def test_a_sparse_8_gib_file_is_refused_by_its_size_before_reading(tree):
    tracemalloc.start()
    try:
        with pytest.raises(FileRefused) as e:
            files.read_file(tree / "sparse", "xclbin")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value) == f"{tree / 'sparse'}: 8589934592 bytes, over the 256 MiB limit for xclbin files"
    assert (e.value.code, e.value.size, e.value.limit) == ("size", 8 * GiB, 256 << 20)
    assert peak < 1 << 20


def test_each_kind_has_its_limit_and_a_limit_may_be_given(tree):
    assert {k: files.limit_of(k) for k in ("xclbin", "insts", "text", "npy", "sysfs")} == {
        "xclbin": 256 << 20, "insts": 64 << 20, "text": 64 << 20, "npy": 4 * GiB, "sysfs": 1 << 20}
    assert files.read_file(tree / "sub" / "b", "text", limit=10) == b"b" * 10
    with pytest.raises(FileRefused, match=r"b: 10 bytes, over the 9-byte limit for text files$"):
        files.read_file(tree / "sub" / "b", "text", limit=9)
    with pytest.raises(ValueError, match=r"unknown file kind 'elf' \(kinds: image, insts, manifest, npy"):
        files.read_file(tree / "a", "elf")
    with pytest.raises(ValueError, match="limit -1 is negative"):
        files.read_file(tree / "a", "text", limit=-1)


def test_a_file_that_grows_while_read_is_refused_at_the_limit(tree):
    path = tree / "grow"
    path.write_bytes(b"x" * 10)
    fd = files.open_fd(path, "text", limit=20)  # 10 bytes: within the limit when opened
    try:
        with open(path, "ab") as f:
            f.write(b"y" * 100)
        with pytest.raises(FileRefused, match=r"grow: grew past the 20-byte limit for text files while being read$"):
            files.read_fd(fd, path, "text", limit=20)
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux procfs")
def test_a_pseudo_file_whose_st_size_is_zero_is_read_up_to_the_limit():
    assert os.stat("/proc/self/status").st_size == 0
    assert files.read_text("/proc/self/status", "sysfs").startswith("Name:")
    with pytest.raises(FileRefused, match=r"^/proc/self/status: grew past the 16-byte limit for sysfs files"):
        files.read_file("/proc/self/status", "sysfs", limit=16)


def test_text_must_be_utf8(tree):
    (tree / "bad").write_bytes(b"ok\xff")
    with pytest.raises(FileRefused, match=r"bad: not UTF-8 text \(byte 2: invalid start byte\)$"):
        files.read_text(tree / "bad")


def test_a_path_with_a_nul_is_refused(tree):
    # found by test_fuzz_parsers.py (a bundle path): os.stat raises a bare ValueError for it
    with pytest.raises(FileRefused, match=r"^'a\\x00b': the path contains a NUL character$") as e:
        files.read_file("a\0b", "text")
    assert e.value.code == "name"


def test_open_errors_stay_oserror(tree):
    with pytest.raises(FileNotFoundError):
        files.read_file(tree / "missing", "text")


# --------------------------------------------------------------------------------------------- links, dir_fd


def test_links_are_followed_by_default_and_refused_when_asked(tree):
    assert files.read_file(tree / "link", "text") == b"hello\n"
    assert files.read_file(tree / "linkdir" / "b", "text") == b"b" * 10
    with pytest.raises(FileRefused, match=r"link: is a symbolic link \(links are not followed here\)$") as e:
        files.read_file(tree / "link", "text", follow_symlinks=False)
    assert e.value.code == "link"
    with pytest.raises(FileRefused, match="a directory of the path is a symbolic link or not a directory") as e:
        files.read_file(tree / "linkdir" / "b", "text", follow_symlinks=False)
    assert e.value.code == "dir-link"
    assert files.read_file(tree / "sub" / "b", "text", follow_symlinks=False) == b"b" * 10


def test_paths_relative_to_a_directory_descriptor(tree):
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert files.read_file("sub/b", "text", dir_fd=fd, follow_symlinks=False) == b"b" * 10
        assert files.read_file("a", "text", dir_fd=fd) == b"hello\n"
        with pytest.raises(FileRefused, match="^link: is a symbolic link"):
            files.read_file("link", "text", dir_fd=fd, follow_symlinks=False)
        with pytest.raises(FileRefused, match="^linkdir/b: a directory of the path is a symbolic link"):
            files.read_file("linkdir/b", "text", dir_fd=fd, follow_symlinks=False)
        with pytest.raises(FileRefused, match=r"^fifo: is not a regular file \(a FIFO\)$"):
            files.read_file("fifo", "text", dir_fd=fd, follow_symlinks=False)
        with pytest.raises(FileNotFoundError):
            files.read_file("sub/none", "text", dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- shown, errors


@pytest.mark.parametrize(("path", "want", "want_ascii"), [
    ("kernels/a.xclbin", "kernels/a.xclbin", "kernels/a.xclbin"),
    ("with space.bin", "with space.bin", "with space.bin"),
    ("naïve.bin", "naïve.bin", "'na\\xefve.bin'"),
    ("a\nb", "'a\\nb'", "'a\\nb'"),
    ("\x1b[31mred", "'\\x1b[31mred'", "'\\x1b[31mred'"),
    ("bidi\u202etxt", "'bidi\\u202etxt'", "'bidi\\u202etxt'"),
    (b"raw\xff.bin", "'raw\\xff.bin'", "'raw\\xff.bin'"),
    ("it's", '"it\'s"', '"it\'s"'),
    (" lead", "' lead'", "' lead'"),
    ("", "''", "''"),
])
def test_shown_quotes_names_that_could_forge_output(path, want, want_ascii):
    assert files.shown(path) == want
    assert files.shown(path, ascii_only=True) == want_ascii
    assert "\n" not in files.shown(path) and "\x1b" not in files.shown(path)


def test_messages_show_paths_quoted(tree):
    name = tree / "evil\n\x1b[2Jname"
    os.mkfifo(name)
    with pytest.raises(FileRefused) as e:
        files.read_file(name, "xclbin")
    assert str(e.value) == f"{files.shown(name)}: is not a regular file (a FIFO)"
    assert "\n" not in str(e.value) and "\\n\\x1b[2J" in str(e.value)


def test_file_refused_is_a_value_error_and_a_package_error_and_pickles():
    e = FileRefused("x\ny", "is not a regular file (a FIFO)")
    assert isinstance(e, ValueError) and isinstance(e, Error)
    again = pickle.loads(pickle.dumps(FileRefused("p", "r", "size", 10, 9)))
    assert (str(again), again.code, again.size, again.limit) == ("p: r", "size", 10, 9)


# --------------------------------------------------------------------------------------------- users


def test_the_parsers_open_their_files_through_the_rules(tree):
    for load in (xclbin.parse, xclbin.Xclbin.load, insts.load):
        with pytest.raises(FileRefused, match=r"fifo: is not a regular file \(a FIFO\)$"):
            load(tree / "fifo")
        with pytest.raises(FileRefused, match=r"^/dev/zero: is not a regular file \(a character device\)$"):
            load("/dev/zero")
    with pytest.raises(FileRefused, match=r"sparse: 8589934592 bytes, over the 256 MiB limit for xclbin files$"):
        xclbin.parse(tree / "sparse")
    with pytest.raises(FileRefused, match=r"sparse: 8589934592 bytes, over the 64 MiB limit for insts files$"):
        insts.load(tree / "sparse")
    with pytest.raises(FileRefused, match=r"over the 64 MiB limit for insts files$"):
        insts.read_input(tree / "sparse", "load")
    assert insts.read_input(tree / "a", "load", kind="text") == b"hello\n"


def test_the_bundle_reader_opens_through_the_rules_and_quotes_names(tmp_path):
    from test_sam3_bundle import write_hand_bundle

    from sam3.bundle import Bundle, BundleError, summarize

    root = write_hand_bundle(tmp_path / "b", "case 1 cases/\x1b[31mx.png p\n")
    os.mkfifo(root / "kernels" / "fifo.bin")
    (root / "kernels" / "link.bin").symlink_to("gemm.xclbin")
    with Bundle.open(root) as b:
        assert "case 1 image (line 30): 'cases/\\x1b[31mx.png': no such file" in summarize(b)["problems"]
        with pytest.raises(BundleError, match=r"^'cases/\\x1b\[31mx.png': no such file$"):
            b.file_bytes("cases/\x1b[31mx.png")
        with pytest.raises(BundleError, match=r"^kernels/fifo.bin: is not a regular file \(a FIFO\)$") as e:
            b.file_bytes("kernels/fifo.bin")
        assert isinstance(e.value.__cause__, FileRefused)
        # a link inside the bundle is resolved to its in-bundle target first, then opened without following links
        assert b.file_bytes("kernels/link.bin") == b"xclbin bytes"
        with pytest.raises(BundleError, match=r"^kernels/gemm.xclbin: 12 bytes, over the 11-byte limit$"):
            b.file_bytes("kernels/gemm.xclbin", limit=11)
        assert b.file_bytes("kernels/gemm.xclbin") == b"xclbin bytes"
    with pytest.raises(BundleError, match=r"^'/nowhere\\n': cannot open the bundle directory"):
        Bundle.open("/nowhere\n")
