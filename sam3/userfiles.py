"""The files `sam3 export` is handed besides the weights, read through the runtime's one file-opening path.

A checkpoint's JSON documents (``config.json``, ``processor_config.json``, ``tokenizer_config.json``,
``vocab.json``), its ``merges.txt``, a reference's ``cases.json``, its ``.npz`` archive and case images are opened
by ``amdxdna_direct.files`` (docs/files.md 1-3): only a regular file is read (a FIFO or a device is refused by
its ``stat``, before it is opened, so nothing blocks), each within a size limit checked before any byte is read
and again while reading (docs/files.md 7).

A refusal of a file parsed or opened here is a :class:`ReadError` whose text is the reason alone (the caller's
message names the file, as it does for the file's other errors); one of a file copied whole is the runtime's
``FileRefused``, which names the file.
"""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO

from amdxdna_direct import files

__all__ = ["JSON_LIMIT", "ReadError", "read_json", "read_bytes", "open_binary"]

# The largest JSON document parsed (docs/files.md 7): a SAM3 checkpoint's are a few KB (vocab.json 1-2 MB).
JSON_LIMIT = 16 << 20


class ReadError(ValueError):
    """A file refused or not parsed; ``str()`` is the reason without the path (the caller names the file)."""


def read_json(path: str | os.PathLike[str], limit: int = JSON_LIMIT) -> Any:
    """The JSON document in the regular file ``path`` of at most ``limit`` bytes, UTF-8.

    Raises:
        ReadError: not a regular file, over the limit, not UTF-8, not JSON, or nested too deeply to parse.
        OSError: the file cannot be opened or read (``FileNotFoundError``, ...), unchanged.
    """
    try:
        text = files.read_text(path, "text", limit=limit)
    except files.FileRefused as exc:
        raise ReadError(exc.reason) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReadError(f"not JSON: {exc}") from exc
    except RecursionError as exc:  # a document of thousands of nested arrays: Python's parser recurses
        raise ReadError("not JSON this reader takes: nested too deeply") from exc


def read_bytes(path: str | os.PathLike[str], kind: str) -> bytes:
    """The whole regular file ``path`` within the limit of ``kind`` (``"text"``, ``"image"``: docs/files.md 3), for a
    file copied whole into a bundle: a refusal names the file itself, as the copy has no message of its own.

    Raises:
        FileRefused: ``"<path>: is not a regular file (a FIFO)"``, ``"<path>: ... over the 64 MiB limit ..."``.
        OSError: the file cannot be opened or read, unchanged.
    """
    return files.read_file(path, kind)


def open_binary(path: str | os.PathLike[str], kind: str) -> BinaryIO:
    """The regular file ``path`` opened for reading (a file object the caller closes), checked against the limit
    of ``kind`` by its size; for a reader that seeks (a ``.npz`` archive is a zip file).

    Raises:
        ReadError: not a regular file, or over the limit.
        OSError: the file cannot be opened, unchanged.
    """
    try:
        return files.open_file(path, kind)
    except files.FileRefused as exc:
        raise ReadError(exc.reason) from exc
