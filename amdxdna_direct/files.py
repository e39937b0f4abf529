"""Opening the files the project is handed: regular files only, a size limit per kind, paths shown safely.

Every file a user gives the project (an xclbin, an instruction stream, a bundle's manifest or tensors, a
``.npy`` input, a ``doctor --root`` sysfs file) is opened here (docs/files.md):

- only a regular file is read; a directory, FIFO, character or block device or socket is refused by its
  ``stat`` before it is opened, and again by ``fstat`` after (opened ``O_NONBLOCK | O_NOCTTY``, so a
  file swapped for a FIFO cannot block and a terminal cannot become the controlling one);
- each kind has a size limit (:data:`LIMITS`): a larger file is refused by its ``st_size`` before any
  byte is read, and a file that grows while being read is refused once the limit is passed;
- a path in a message goes through :func:`shown`, which quotes names holding newlines, control
  characters or terminal escape codes.

A refusal is a :class:`FileRefused` (a ``ValueError``); an ``OSError`` from ``open`` itself (a missing
file, no permission) propagates unchanged, except that a symbolic link met under
``follow_symlinks=False`` is a refusal.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import BinaryIO

from .errors import Error

__all__ = ["FileRefused", "LIMITS", "check_regular", "limit_of", "open_fd", "open_file", "read_fd", "read_file",
           "limit_text", "read_text", "shown"]

# Size limits per kind of file, in bytes (docs/files.md 2). The largest real inputs are far below them.
LIMITS: dict[str, int] = {
    "xclbin": 256 << 20,
    "insts": 64 << 20,
    "text": 64 << 20,
    "manifest": 64 << 20,
    "image": 256 << 20,
    "npy": 4 << 30,
    "sysfs": 1 << 20,
    "tensors": 1 << 40,
}

# One read call asks for at most this much beyond what st_size announced (docs/files.md 3).
_CHUNK = 1 << 20
# Linux returns at most this many bytes from one read(2).
_READ_MAX = 0x7FFFF000

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class FileRefused(Error, ValueError):
    """A file the project will not read: not a regular file, over its kind's size limit, a link where links
    are not followed, or text that does not decode.

    ``str()`` is ``"<shown path>: <reason>"``. Attributes: ``path`` (as given), ``reason`` (the text alone),
    ``code`` (what was refused: ``"type"``, ``"size"``, ``"grew"``, ``"link"``, ``"dir-link"``, ``"text"``,
    ``"name"``),
    ``size`` (the bytes found, for ``"size"``/``"grew"``) and ``limit`` (the limit applied, or None).
    """

    def __init__(self, path: str | bytes | os.PathLike[str] | os.PathLike[bytes], reason: str, code: str = "type",
                 size: int | None = None, limit: int | None = None) -> None:
        super().__init__(f"{shown(path)}: {reason}")
        self.path = path
        self.reason = reason
        self.code = code
        self.size = size
        self.limit = limit

    def __reduce__(self) -> tuple[type[FileRefused], tuple[object, ...]]:
        # pickling (multiprocessing, pytest-xdist) with this __init__
        return (type(self), (self.path, self.reason, self.code, self.size, self.limit))


# --------------------------------------------------------------------------------------------- showing

# repr() writes a byte the file system encoding could not decode as a lone surrogate; show it as \xNN.
_SURROGATE = re.compile(r"\\udc([89a-f][0-9a-f])")


def shown(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], *, ascii_only: bool = False) -> str:
    """``path`` as a message shows it: as is when it is plain printable text, else quoted with escapes.

    A name holding a newline, a control character, a terminal escape code, a non-printable or bidi
    character, a byte that is not valid in the file system encoding (shown ``\\xNN``), a quote, a backslash
    or leading/trailing spaces (or an empty name) is shown as a Python string literal, so it can neither
    forge a line nor move the cursor. ``ascii_only=True`` also escapes non-ASCII characters (for a stream
    that can only write ASCII).
    """
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    plain = (text != "" and text.isprintable() and text == text.strip(" ")
             and not any(c in text for c in "'\"\\") and (text.isascii() or not ascii_only))
    if plain:
        return text
    return _SURROGATE.sub(r"\\x\1", ascii(text) if ascii_only else repr(text))


# --------------------------------------------------------------------------------------------- opening


def limit_of(kind: str, limit: int | None = None) -> int:
    """The size limit for a file of ``kind``: ``limit`` when given, else ``LIMITS[kind]``.

    Raises:
        ValueError: ``kind`` is not a key of :data:`LIMITS` (and no limit is given), or ``limit`` < 0.
    """
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit {limit} is negative")
        return limit
    try:
        return LIMITS[kind]
    except KeyError:
        raise ValueError(f"unknown file kind {kind!r} (kinds: {', '.join(sorted(LIMITS))})") from None


def _mode_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((name for test, name in kinds if test(mode)), f"a file of mode {mode:o}")


def limit_text(n: int) -> str:
    """``"64 MiB"`` for a whole number of MiB, else ``"1000-byte"``: a limit as messages show it."""
    return f"{n >> 20} MiB" if n and n % (1 << 20) == 0 else f"{n}-byte"


def check_regular(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], st: os.stat_result, kind: str,
                  limit: int | None = None) -> None:
    """Refuse a file whose ``stat`` result ``st`` is not a regular file within the size limit of ``kind``.

    Raises:
        FileRefused: "is not a regular file (a FIFO)", "... bytes, over the 256 MiB limit for an xclbin file".
        ValueError: ``kind`` is unknown (see :func:`limit_of`).
    """
    most = limit_of(kind, limit)
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(path, f"is not a regular file ({_mode_kind(st.st_mode)})")
    if st.st_size > most:
        raise FileRefused(path, f"{st.st_size} bytes, over the {limit_text(most)} limit for {kind} files", "size",
                          st.st_size, most)


def _walk(path: str, dir_fd: int | None) -> tuple[int | None, str, int | None]:
    """Open every directory of ``path`` without following links: (descriptor of the last directory or
    ``dir_fd``, the last component, the descriptor to close or None)."""
    head, _, name = path.rpartition("/")
    if not head and path.startswith("/"):
        head = "/"
    parts = [p for p in head.split("/") if p] if head else []
    if not parts and head != "/":
        return dir_fd, name, None
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags) if path.startswith("/") else os.dup(dir_fd) if dir_fd is not None else os.open(".", flags)
    try:
        for part in parts:
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise FileRefused(path, "a directory of the path is a symbolic link or not a directory "
                              "(links are not followed here)", "dir-link") from e
        raise
    return fd, name, fd


def open_fd(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], kind: str, *, limit: int | None = None,
            dir_fd: int | None = None, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of the regular file ``path`` (relative to ``dir_fd`` when given), checked
    against the size limit of ``kind``. The caller closes it.

    With ``follow_symlinks=False`` no component of the path may be a symbolic link (each directory is
    opened ``O_NOFOLLOW`` in turn, the file too).

    Raises:
        FileRefused: not a regular file, over the limit, a link under ``follow_symlinks=False``, or a path
            holding a NUL character.
        OSError: ``open`` failed otherwise (``FileNotFoundError``, ``PermissionError``, ...).
        ValueError: ``kind`` is unknown.
    """
    limit_of(kind, limit)
    text = os.fsdecode(path)
    if "\0" in text:
        raise FileRefused(path, "the path contains a NUL character", "name")
    where, name, owned = _walk(text, dir_fd) if not follow_symlinks else (dir_fd, text, None)
    try:
        return _open_last(path, name, where, kind, limit, follow_symlinks)
    finally:
        if owned is not None:
            os.close(owned)


def _open_last(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], name: str, where: int | None, kind: str,
               limit: int | None, follow: bool) -> int:
    # stat first: a device or FIFO is refused without being opened (opening some devices acts).
    before = os.stat(name or ".", dir_fd=where, follow_symlinks=follow)
    if stat.S_ISLNK(before.st_mode):
        raise FileRefused(path, "is a symbolic link (links are not followed here)", "link")
    check_regular(path, before, kind, limit)
    flags = _OPEN_FLAGS | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=where)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise FileRefused(path, "is a symbolic link (links are not followed here)", "link") from e
        raise
    try:
        # fstat again: the name may have been swapped between stat and open.
        check_regular(path, os.fstat(fd), kind, limit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, path: str | bytes | os.PathLike[str] | os.PathLike[bytes], kind: str,
            limit: int | None = None) -> bytes:
    """The content of the open descriptor ``fd`` (from its current position), at most the limit of ``kind``.

    ``st_size`` sizes the first read; the read stops with a refusal once more than the limit arrives
    (a file growing while read, or a pseudo-file whose ``st_size`` says 0 or 4096). ``fd`` stays open.

    Raises:
        FileRefused: the content passed the limit.
        OSError: ``read`` failed.
        ValueError: ``kind`` is unknown.
    """
    most = limit_of(kind, limit)
    announced = max(os.fstat(fd).st_size, 0)
    chunks: list[bytes] = []
    total = 0
    want = min(most + 1, announced + 1) if announced else min(most + 1, _CHUNK)
    while total <= most:
        chunk = os.read(fd, min(want, _READ_MAX))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        want = min(most + 1 - total, _CHUNK)
    if total > most:
        raise FileRefused(path, f"grew past the {limit_text(most)} limit for {kind} files while being read", "grew",
                          total, most)
    return b"".join(chunks)


def read_file(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], kind: str, *, limit: int | None = None,
              dir_fd: int | None = None, follow_symlinks: bool = True) -> bytes:
    """The whole content of the regular file ``path``, refused past the size limit of ``kind``.

    Raises:
        FileRefused: not a regular file, over the limit (before or while reading), a link under
            ``follow_symlinks=False``, or a path holding a NUL character.
        OSError: the file cannot be opened or read (``FileNotFoundError``, ``PermissionError``, ...).
        ValueError: ``kind`` is unknown.
    """
    fd = open_fd(path, kind, limit=limit, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    try:
        return read_fd(fd, path, kind, limit)
    finally:
        os.close(fd)


def read_text(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], kind: str = "text", *,
              limit: int | None = None, dir_fd: int | None = None, follow_symlinks: bool = True) -> str:
    """The content of ``path`` decoded as UTF-8 (as :func:`read_file`, default kind ``"text"``).

    Raises:
        FileRefused: as :func:`read_file`, or "not UTF-8 text (byte N: reason)".
        OSError: as :func:`read_file`.
        ValueError: ``kind`` is unknown.
    """
    data = read_file(path, kind, limit=limit, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileRefused(path, f"not UTF-8 text (byte {e.start}: {e.reason})", "text") from None


def open_file(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], kind: str, *, limit: int | None = None,
              dir_fd: int | None = None, follow_symlinks: bool = True) -> BinaryIO:
    """The regular file ``path`` opened for binary reading (a file object the caller closes), checked as
    :func:`open_fd` checks it. Reads from it are not bounded: use :func:`read_fd` on ``.fileno()`` or
    :func:`read_file` to read a whole file within the limit.

    Raises:
        FileRefused: as :func:`open_fd`.
        OSError: as :func:`open_fd`.
        ValueError: ``kind`` is unknown.
    """
    fd = open_fd(path, kind, limit=limit, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
