"""The SAM3 kernel bundle IRON's exporter writes: reader, writer and summary (docs/sam3-bundle.md).

A bundle is a directory: `manifest.txt` (one record a line), `tensors.txt` + `tensors.bin` (an index and
one blob holding every tensor), `kernels/` (xclbins and instruction streams), `vocab.json`, `merges.txt`
and test images. `Bundle.open` parses and checks all of it (docs/sam3-bundle.md 7) and maps `tensors.bin`
read-only, so a tensor is a zero-copy numpy view; `BundleWriter` writes the same format; `summarize` turns
an open bundle into a JSON-ready description plus a list of problems found.

Every file is opened relative to the bundle directory's file descriptor without following symbolic links
(docs/sam3-bundle.md 8), and every error is a `BundleError` naming the file, line and record.
"""

from __future__ import annotations

import builtins
import errno
import json
import math
import mmap
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, cast

import ml_dtypes
import numpy as np

from amdxdna_direct import files
from amdxdna_direct.errors import Error

MANIFEST = "manifest.txt"
INDEX = "tensors.txt"
BLOB = "tensors.bin"
VOCAB = "vocab.json"
MERGES = "merges.txt"

# The format this runtime writes, and the ones it reads, tried in this order (docs/sam3-bundle.md 2.2).
VERSION = 2
VERSIONS = (2, 1)

# Text files are read whole; past this size a file is refused rather than read (docs/sam3-bundle.md 8).
TEXT_LIMIT = 64 << 20
# Instruction streams and xclbins are read whole too (docs/sam3-bundle.md 8).
FILE_LIMIT = 256 << 20

# The writer aligns every tensor to 64 bytes; the reader enforces 8 (docs/sam3-bundle.md 6).
WRITE_ALIGN = 64
READ_ALIGN = 8

DEFAULT_KERNEL_NAME = "MLIR_AIE"

_USIZE_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
# numpy's limit on the number of dimensions of an array (docs/sam3-bundle.md 6).
_MAX_DIMS = 32

# Unicode White_Space, the set the manifest splits on (docs/sam3-bundle.md 2.1). Python's str.split() also
# splits on U+001C..U+001F, which the format treats as ordinary characters.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WS_RUN = re.compile(f"[{_WS}]+")
_WS_ONE = re.compile(f"[{_WS}]")
_NOT_WS = re.compile(f"[^{_WS}]")
_ASCII_NOT_WS = frozenset("\x1c\x1d\x1e\x1f")
# An unsigned integer as the format parses it: an optional '+', ASCII digits (docs/sam3-bundle.md 2.3).
_UINT = re.compile(r"\+?[0-9]+")
# A float as the format parses it: decimal with optional exponent, or inf / infinity / nan in any case.
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)
# The hex digits of an escape: an optional '+' then at least one hex digit (docs/sam3-bundle.md 4).
_HEX = re.compile(r"\+?[0-9a-fA-F]+")


class BundleError(Error, ValueError):
    """A bundle (or a bundle being written) that cannot be used; the message names file, line and record."""


# -------------------------------------------------------------------------------------------------------
# Scalars
# -------------------------------------------------------------------------------------------------------


def parse_uint(text: str, limit: int = _USIZE_MAX) -> int | None:
    """`text` as an unsigned integer no larger than `limit` (docs/sam3-bundle.md 2.3), or None if it is not one."""
    if not (text.isascii() and text.isdigit()) and _UINT.fullmatch(text) is None:
        return None
    digits = text.lstrip("+").lstrip("0") or "0"
    # A length check first: int() of a huge digit string is slow, or refused by Python's digit limit.
    if len(digits) > len(str(limit)):
        return None
    value = int(digits)
    return value if value <= limit else None


def parse_f32(text: str) -> float | None:
    """`text` as a float rounded to float32 (docs/sam3-bundle.md 2.3), or None if it is not one."""
    if _FLOAT.fullmatch(text) is None:
        return None
    with np.errstate(over="ignore"):
        return float(np.float32(float(text)))


def unescape(text: str) -> str:
    """Undo Python's `unicode_escape` of a prompt, by the rules of docs/sam3-bundle.md 4.

    `\\t \\n \\r \\\\` and `\\xNN \\uNNNN \\UNNNNNNNN` are decoded; any other `\\c` stays as written, as does a
    lone trailing backslash; an escape whose hex digits are bad or name no character is dropped.
    """
    out: list[str] = []
    i, n = 0, len(text)
    simple = {"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}
    widths = {"x": 2, "u": 4, "U": 8}
    while i < n:
        start = text.find("\\", i)
        if start < 0:
            out.append(text[i:])
            break
        out.append(text[i:start])
        if start + 1 == n:
            out.append("\\")
            break
        c = text[start + 1]
        if c in simple:
            out.append(simple[c])
            i = start + 2
        elif c in widths:
            digits = text[start + 2 : start + 2 + widths[c]]
            out.append(_char_of_hex(digits))
            i = start + 2 + len(digits)
        else:
            out.append("\\" + c)
            i = start + 2
    return "".join(out)


def _char_of_hex(digits: str) -> str:
    """The character a hex escape names, or "" when the digits are bad or name no character."""
    if _HEX.fullmatch(digits) is None:
        return ""
    value = int(digits.lstrip("+"), 16)
    if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
        return ""
    return chr(value)


def escape(text: str) -> str:
    """Python's `unicode_escape` of `text` as ASCII, the form `tok_test` prompts are written in."""
    return text.encode("unicode_escape").decode("ascii")


def split_fields(text: str) -> list[str]:
    """`text` split on runs of Unicode whitespace, empty pieces dropped (docs/sam3-bundle.md 2.1)."""
    if text.isascii() and _ASCII_NOT_WS.isdisjoint(text):
        return text.split()  # the same split, faster: ASCII text without the separators str.split adds
    return [t for t in _WS_RUN.split(text) if t]


# -------------------------------------------------------------------------------------------------------
# Records
# -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One manifest line: a tag and its fields, with its line number and text for errors (docs/sam3-bundle.md 2.1)."""

    line: int
    tag: str
    fields: tuple[str, ...]
    text: str
    kv: Mapping[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def parse(cls, line: int, text: str) -> Record | None:
        """The record of one line (CR already stripped), or None for a blank or comment line."""
        tokens = split_fields(text)
        if not tokens or tokens[0].startswith("#"):
            return None
        fields = tuple(tokens[1:])
        kv = dict(f.split("=", 1) for f in fields if "=" in f)
        return cls(line, tokens[0], fields, text, MappingProxyType(kv))

    def error(self, msg: str) -> BundleError:
        """A BundleError pointing at this line: `manifest.txt:<line>: <msg>, in: <text>`."""
        return BundleError(f"{MANIFEST}:{self.line}: {msg}, in: {self.text}")

    def field(self, i: int) -> str:
        """Field `i` (0 is the first after the tag).

        Raises:
            BundleError: "expected at least (i+1) fields".
        """
        if i >= len(self.fields):
            raise self.error(f"expected at least {i + 1} fields")
        return self.fields[i]

    def uint_field(self, i: int, limit: int = _USIZE_MAX) -> int:
        """Field `i` as an unsigned integer.

        Raises:
            BundleError: the field is missing, or "field (i+1) (text) is malformed".
        """
        text = self.field(i)
        value = parse_uint(text, limit)
        if value is None:
            raise self.error(f"field {i + 1} ({text}) is malformed")
        return value

    def has(self, key: str) -> bool:
        """Whether a `key=` field is present."""
        return key in self.kv

    def str(self, key: str) -> str:
        """The value of the `key=` field (the last one when repeated).

        Raises:
            BundleError: "`key=` missing".
        """
        if key not in self.kv:
            raise self.error(f"`{key}=` missing")
        return self.kv[key]

    # `str` names the method above from here to the end of the class body, hence `builtins.str`.
    def uint(self, key: builtins.str) -> int:
        """The `key=` field as an unsigned integer.

        Raises:
            BundleError: the field is missing, or "`key=v` is malformed".
        """
        text = self.str(key)
        value = parse_uint(text)
        if value is None:
            raise self.error(f"`{key}={text}` is malformed")
        return value

    def flag(self, key: builtins.str) -> bool:
        """The `key=` field, which must be exactly 0 or 1.

        Raises:
            BundleError: the field is missing, or "`key=v` is not 0 or 1".
        """
        text = self.str(key)
        if text not in ("0", "1"):
            raise self.error(f"`{key}={text}` is not 0 or 1")
        return text == "1"

    def rest(self, n: int) -> builtins.str:
        """The raw text after the tag and `n` fields, inner spacing kept (docs/sam3-bundle.md 2.1).

        Skips n+1 tokens, each after its leading whitespace, then drops exactly one leading ASCII space.
        """
        s = self.text
        for _ in range(n + 1):
            m = _NOT_WS.search(s)
            s = "" if m is None else s[m.start() :]
            m = _WS_ONE.search(s)
            s = "" if m is None else s[m.start() :]
        return s[1:] if s.startswith(" ") else s


# -------------------------------------------------------------------------------------------------------
# Kernels and test records
# -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XclbinRecord:
    """`xclbin <key> <file> <kernel-name>`: a hardware context that gemm records name by key."""

    key: str
    path: Path
    kernel: str
    line: int = 0


@dataclass(frozen=True)
class GemmSpec:
    """One compiled GEMM `C[m, n] = A[m, k] B[k, n] (+ bias)`; A rows `lda` apart; B packed, `b_bytes` long."""

    key: str
    ctx: str
    insts: Path
    m: int
    k: int
    n: int
    lda: int
    tile_k: int
    tile_n: int
    ct_k: int
    bias: bool
    b_bytes: int
    line: int = 0

    @property
    def packed_bytes(self) -> int:
        """The packed B length the shape implies: 9 * n * (k + ct_k * bias) / 8 (docs/sam3-bundle.md 3)."""
        return 9 * self.n * (self.k + self.ct_k * int(self.bias)) // 8


@dataclass(frozen=True)
class MhaSpec:
    """One compiled non-causal MHA: q, k, v and o are `elems` bf16 each, [heads, seq, d] or token-major."""

    key: str
    xclbin: Path
    insts: Path
    name: str
    heads: int
    seq: int
    d: int
    token_major: bool
    elems: int
    line: int = 0


@dataclass(frozen=True)
class OpSpec:
    """Any other compiled kernel (the device ViT's `rope` and `addln`)."""

    key: str
    xclbin: Path
    insts: Path
    name: str
    line: int = 0


@dataclass(frozen=True)
class KernelSource:
    """What loading one kernel needs: its context id, xclbin, stream, kernel name and ops per run."""

    key: str
    ctx: str
    xclbin: Path
    insts: Path
    name: str
    ops: int


@dataclass(frozen=True)
class TokTest:
    """`tok_test <index> <prompt>`: a tokenizer test; the prompt is unescaped (docs/sam3-bundle.md 4)."""

    index: int
    prompt: str
    line: int


@dataclass(frozen=True)
class Case:
    """`case` (text prompt) or `pcase` (points/box prompt, kept as written): an image and its references."""

    index: int
    image: Path
    prompt: str
    line: int


# The kernel keys the SAM3 runtime launches (docs/sam3-bundle.md 4).
GEMM_KEYS = (
    "v_embed v_qkv v_o v_fc1 v_fc2 n_in n_up conv d_qkv d_o d_s d_c d_fc1 d_fc2 dec_kv m_head".split()
)
MHA_KEYS = ("mha_win", "mha_glob", "mha_d")
OP_KEYS = ("rope", "addln")

# -------------------------------------------------------------------------------------------------------
# Params
# -------------------------------------------------------------------------------------------------------

USIZE_PARAMS = (
    "grid window vit_dim vit_heads vit_layers vit_ffn_pad patch image_size d_model d_heads d_layers d_ffn "
    "text_len text_dim text_heads text_layers text_ffn queries dec_layers mask_size bos eos pad"
).split()
LIST_PARAMS = ("vit_global", "neck_splits")
F32_PARAMS = ("text_eps", "vit_eps")
FLAG_PARAMS = ("vit_device", "vit_res_f32", "tracker")
TRACKER_USIZE_PARAMS = ("trk_heads", "trk_layers", "trk_mask_tokens")
TRACKER_LIST_PARAMS = ("trk_out_ch",)
TRACKER_F32_PARAMS = ("trk_stability_delta", "trk_stability_thresh")


class Params:
    """The typed `param` values of docs/sam3-bundle.md 5; `raw` holds every param as written.

    Tracker params are None unless `tracker` is on. Reading the typed attributes never fails: every
    required param is parsed, and its errors raised, by the constructor.
    """

    grid: int
    window: int
    vit_dim: int
    vit_heads: int
    vit_layers: int
    vit_ffn_pad: int
    patch: int
    image_size: int
    d_model: int
    d_heads: int
    d_layers: int
    d_ffn: int
    text_len: int
    text_dim: int
    text_heads: int
    text_layers: int
    text_ffn: int
    queries: int
    dec_layers: int
    mask_size: int
    bos: int
    eos: int
    pad: int
    vit_global: list[int]
    neck_splits: list[int]
    text_eps: float
    vit_eps: float
    vit_device: bool
    vit_res_f32: bool
    tracker: bool
    trk_heads: int | None
    trk_layers: int | None
    trk_mask_tokens: int | None
    trk_out_ch: list[int] | None
    trk_stability_delta: float | None
    trk_stability_thresh: float | None

    def __init__(self, raw: Mapping[str, str], records: Mapping[str, Record] | None = None):
        """Parse every required param (and the tracker's when `tracker` is 1).

        Raises:
            BundleError: a param is missing ("param X missing from the manifest"), malformed
                ("param X (v) is malformed", "param X: bad list item s") or a tracker list has not 3 items.
        """
        self.raw = dict(raw)
        self._records = dict(records or {})
        for name in USIZE_PARAMS:
            setattr(self, name, self.usize(name))
        for name in LIST_PARAMS:
            setattr(self, name, self.usize_list(name))
        for name in F32_PARAMS:
            setattr(self, name, self.f32(name))
        for name in FLAG_PARAMS:
            setattr(self, name, self.flag(name))
        for name in TRACKER_USIZE_PARAMS + TRACKER_LIST_PARAMS + TRACKER_F32_PARAMS:
            setattr(self, name, None)
        if self.tracker:
            self._tracker_params()

    def _tracker_params(self) -> None:
        for name in TRACKER_USIZE_PARAMS:
            setattr(self, name, self.usize(name))
        for name in TRACKER_F32_PARAMS:
            setattr(self, name, self.f32(name))
        out_ch = self.usize_list("trk_out_ch")
        if len(out_ch) != 3:
            raise self._error("trk_out_ch", f"param trk_out_ch ({self.raw['trk_out_ch']}) has {len(out_ch)} items, "
                              "wanted 3")
        self.trk_out_ch = out_ch
        # Lazily: a huge trk_layers fails at its first missing depth instead of building a huge list.
        for name in self._tracker_mlps():
            self.depth(name)

    def _tracker_mlps(self) -> Iterator[str]:
        if self.tracker:
            yield from (f"trk.{i}.mlp" for i in range(self.trk_layers or 0))
            yield from (f"trk.hyper{i}" for i in range(self.trk_mask_tokens or 0))
            yield from ("trk.iou_head", "trk.obj_head")

    def tracker_mlps(self) -> list[str]:
        """The tracker MLPs that carry a `<name>.depth` param (docs/sam3-bundle.md 5); [] without the tracker."""
        return list(self._tracker_mlps())

    def _error(self, name: str, msg: str) -> BundleError:
        rec = self._records.get(name)
        return rec.error(msg) if rec is not None else BundleError(f"{MANIFEST}: {msg}")

    def has(self, name: str) -> bool:
        """Whether the manifest has `param <name>`."""
        return name in self.raw

    def text(self, name: str) -> str:
        """The param as written.

        Raises:
            BundleError: "param X missing from the manifest".
        """
        if name not in self.raw:
            raise BundleError(f"{MANIFEST}: param {name} missing from the manifest")
        return self.raw[name]

    def usize(self, name: str) -> int:
        """The param as an unsigned integer.

        Raises:
            BundleError: missing, or "param X (v) is malformed".
        """
        text = self.text(name)
        value = parse_uint(text)
        if value is None:
            raise self._error(name, f"param {name} ({text}) is malformed")
        return value

    def f32(self, name: str) -> float:
        """The param as a float32 value.

        Raises:
            BundleError: missing, or "param X (v) is malformed".
        """
        text = self.text(name)
        value = parse_f32(text)
        if value is None:
            raise self._error(name, f"param {name} ({text}) is malformed")
        return value

    def usize_list(self, name: str) -> list[int]:
        """The param split on ',' with empty items dropped, each an unsigned integer (docs/sam3-bundle.md 2.2).

        Raises:
            BundleError: missing, or "param X: bad list item s".
        """
        out = []
        for item in self.text(name).split(","):
            if not item:
                continue
            value = parse_uint(item)
            if value is None:
                raise self._error(name, f"param {name}: bad list item {item}")
            out.append(value)
        return out

    def flag(self, name: str) -> bool:
        """An optional flag: on exactly when the param is `1` (docs/sam3-bundle.md 5)."""
        return self.raw.get(name) == "1"

    def depth(self, mlp: str) -> int:
        """The `<mlp>.depth` param of a tracker MLP.

        Raises:
            BundleError: missing or malformed.
        """
        return self.usize(f"{mlp}.depth")


# -------------------------------------------------------------------------------------------------------
# Files, opened relative to the bundle directory without following links
# -------------------------------------------------------------------------------------------------------


def _rel_parts(text: str) -> tuple[str, ...] | None:
    """The components of a relative path, `.` and `..` folded; None if it is absolute or climbs out."""
    path = PurePosixPath(text)
    if path.is_absolute():
        return None
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part != ".":
            parts.append(part)
    return tuple(parts)


class _Dir:
    """The bundle directory, held open: every file is opened relative to its descriptor (docs/sam3-bundle.md 8)."""

    def __init__(self, directory: str | os.PathLike[str]):
        try:
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise BundleError(f"{files.shown(directory)}: cannot open the bundle directory "
                              f"({os.strerror(e.errno or 0)})") from e
        self.root = Path(os.path.realpath(directory))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def inside(self, text: str) -> tuple[str, ...] | str:
        """The real in-bundle components of a bundle-relative path, or the reason it is refused."""
        if not text:
            return "is empty"
        if "\0" in text:
            return "contains a NUL character"
        if PurePosixPath(text).is_absolute():
            return "is absolute"
        parts = _rel_parts(text)
        if parts is None:
            return "escapes the bundle directory"
        real = os.path.realpath(os.path.join(self.root, *parts))
        rel = os.path.relpath(real, self.root)
        if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
            return f"is a symbolic link pointing out of the bundle (to {real})"
        return () if rel == "." else tuple(rel.split("/"))

    def resolve(self, text: str) -> tuple[str, ...]:
        """The real in-bundle components of `text`.

        Raises:
            BundleError: "<text>: the path is absolute" (escapes, links out of the bundle, is empty).
        """
        where = self.inside(text)
        if isinstance(where, str):
            raise BundleError(f"{text}: the path {where}")
        return where

    def open_file(self, parts: tuple[str, ...], what: str, limit: int | None = None) -> int:
        """A descriptor of the regular file at `parts`, opened without following any link, by
        `amdxdna_direct.files` relative to the directory's descriptor (docs/files.md 2).

        Raises:
            BundleError: "<what>: no such file", "... is a symbolic link", "... is not a regular file", ...
        """
        if self.fd < 0:
            raise BundleError(f"{files.shown(what)}: the bundle is closed")
        if not parts:
            raise BundleError(f"{files.shown(what)}: is the bundle directory, not a file")
        try:
            return files.open_fd("/".join(parts), "tensors", limit=limit, dir_fd=self.fd, follow_symlinks=False)
        except files.FileRefused as e:
            raise BundleError(f"{files.shown(what)}: {_refusal(e)}") from e
        except OSError as e:
            raise BundleError(f"{files.shown(what)}: {_open_reason(e)}") from e

    def read(self, parts: tuple[str, ...], what: str, limit: int) -> bytes:
        """The whole regular file at `parts`, at most `limit` bytes (docs/files.md 3).

        Raises:
            BundleError: the file cannot be opened (see open_file) or is larger than `limit`.
        """
        fd = self.open_file(parts, what, limit)
        try:
            return files.read_fd(fd, what, "tensors", limit)
        except files.FileRefused as e:
            raise BundleError(f"{files.shown(what)}: {_refusal(e)}") from e
        except OSError as e:
            raise BundleError(f"{files.shown(what)}: cannot read ({errno.errorcode.get(e.errno or 0, '?')}: "
                              f"{os.strerror(e.errno or 0)})") from e
        finally:
            os.close(fd)


def _refusal(e: files.FileRefused) -> str:
    """The bundle's wording of a refusal by amdxdna_direct.files (docs/sam3-bundle.md 8)."""
    limit = files.limit_text(e.limit) if e.limit is not None else ""
    reasons = {
        "size": f"{e.size} bytes, over the {limit} limit",
        "grew": f"grew past the {limit} limit while being read",
        "link": "is a symbolic link (bundle files are opened without following links)",
        "dir-link": "a component of the path is not a directory (or is a symbolic link)",
    }
    return reasons.get(e.code, e.reason)


def _open_reason(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symbolic link (bundle files are opened without following links)"
    if e.errno == errno.ENOTDIR:
        return "a component of the path is not a directory (or is a symbolic link)"
    if e.errno == errno.ENOENT:
        return "no such file"
    return f"cannot open ({errno.errorcode.get(e.errno or 0, '?')}: {os.strerror(e.errno or 0)})"


def _utf8(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError(f"{name}: not UTF-8 text (byte {e.start}: {e.reason})") from e


def _lines(text: str) -> list[str]:
    """Lines split on LF with one trailing CR stripped each; a final LF ends the last line (docs/sam3-bundle.md 2.1)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if "\r" not in text:
        return lines
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


# -------------------------------------------------------------------------------------------------------
# tensors.txt + tensors.bin
# -------------------------------------------------------------------------------------------------------

DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "u8": np.dtype("u1"),
    "i32": np.dtype("<i4"),
}
# The names errors use for dtypes (docs/sam3-bundle.md 6).
DTYPE_NAMES = {"f32": "F32", "bf16": "Bf16", "u8": "U8", "i32": "I32"}


@dataclass(frozen=True)
class TensorInfo:
    """One `tensors.txt` line: name, dtype, shape, byte offset and length in tensors.bin, line number."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    line: int

    @property
    def count(self) -> int:
        """The number of elements."""
        return self.nbytes // DTYPES[self.dtype].itemsize


def parse_index(text: str, blob_size: int) -> dict[str, TensorInfo]:
    """The tensors of a `tensors.txt` text for a blob of `blob_size` bytes (docs/sam3-bundle.md 6).

    Raises:
        BundleError: `tensors.txt:<line>: <msg>, in: <line>` for a malformed line, a duplicate, a shape whose
            element count is not the byte count's, or a tensor past the end of tensors.bin.
    """
    out: dict[str, TensorInfo] = {}
    for number, line in enumerate(_lines(text), 1):
        info = _index_line(number, line)
        if info.name in out:
            raise _index_error(number, line, "tensor defined twice")
        if info.offset + info.nbytes > blob_size:
            raise _index_error(number, line, f"tensor {info.name} runs past the end of {BLOB} "
                               f"({info.offset} + {info.nbytes} > {blob_size} bytes)")
        out[info.name] = info
    return out


def _index_error(number: int, line: str, msg: str) -> BundleError:
    return BundleError(f"{INDEX}:{number}: {msg}, in: {line}")


def _index_line(number: int, line: str) -> TensorInfo:
    f = split_fields(line)
    if len(f) != 5:
        raise _index_error(number, line, "expected <name> <dtype> <shape> <offset> <bytes>")
    name, dtype, shape_text, off_text, len_text = f
    if dtype not in DTYPES:
        raise _index_error(number, line, "unknown dtype")
    dims = [parse_uint(s) for s in shape_text.split(",")]
    if any(d is None for d in dims):
        raise _index_error(number, line, "bad shape")
    if len(dims) > _MAX_DIMS:
        raise _index_error(number, line, f"bad shape (more than {_MAX_DIMS} dimensions)")
    offset, nbytes = parse_uint(off_text), parse_uint(len_text)
    if offset is None:
        raise _index_error(number, line, "bad offset")
    if nbytes is None:
        raise _index_error(number, line, "bad byte count")
    if offset % READ_ALIGN:
        raise _index_error(number, line, "offset is not 8-byte aligned")
    size = DTYPES[dtype].itemsize
    if nbytes % size:
        raise _index_error(number, line, "byte count is not a whole number of elements")
    shape = tuple(d for d in dims if d is not None)
    if math.prod(shape) != nbytes // size:
        raise _index_error(number, line, f"tensor {name}: shape {shape_text} of {dtype} is {math.prod(shape)} "
                           f"elements, but {nbytes} bytes hold {nbytes // size}")
    return TensorInfo(name, dtype, shape, offset, nbytes, number)


class TensorStore:
    """Every tensor of a bundle over `tensors.bin` mapped read-only: views are zero-copy (docs/sam3-bundle.md 6)."""

    def __init__(self, index: Mapping[str, TensorInfo], data: mmap.mmap | bytes):
        self._index = dict(index)
        self._data: mmap.mmap | bytes | None = data

    @property
    def buffer(self) -> mmap.mmap | bytes:
        """The mapping of tensors.bin (bytes when the file is empty).

        Raises:
            BundleError: the bundle is closed.
        """
        if self._data is None:
            raise BundleError(f"{BLOB}: the bundle is closed")
        return self._data

    def names(self) -> list[str]:
        """Every tensor name, in index order."""
        return list(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self._index.values())

    def has(self, name: str) -> bool:
        """Whether the bundle has tensor `name`."""
        return name in self._index

    def info(self, name: str) -> TensorInfo:
        """The index entry of `name`.

        Raises:
            BundleError: "tensor N missing from the bundle".
        """
        info = self._index.get(name)
        if info is None:
            raise BundleError(f"tensor {name} missing from the bundle")
        return info

    def get(self, name: str, dtype: str | None = None) -> np.ndarray:
        """A read-only view of `name` with its dtype and shape, into the mapping (no copy).

        Raises:
            BundleError: missing, or "tensor N is <Dtype>, wanted <Dtype>" when `dtype` is given and differs.
        """
        info = self.info(name)
        if dtype is not None and info.dtype != dtype:
            raise BundleError(f"tensor {name} is {DTYPE_NAMES[info.dtype]}, wanted {_dtype_name(dtype)}")
        view = np.frombuffer(self.buffer, DTYPES[info.dtype], info.count, info.offset)
        return view.reshape(info.shape)

    def raw(self, name: str) -> np.ndarray:
        """The bytes of `name`, of any dtype, as a read-only uint8 view.

        Raises:
            BundleError: missing.
        """
        info = self.info(name)
        return np.frombuffer(self.buffer, np.uint8, info.nbytes, info.offset)

    def expect(self, name: str, dtype: str, count: int) -> np.ndarray:
        """The view of `name`, checked to hold `count` elements of `dtype`.

        Raises:
            BundleError: missing, or "tensor N is <elems> x <Dtype>, wanted <n> x <Dtype>".
        """
        info = self.info(name)
        if info.dtype != dtype or info.count != count:
            raise BundleError(f"tensor {name} is {info.count} x {DTYPE_NAMES[info.dtype]}, "
                              f"wanted {count} x {_dtype_name(dtype)}")
        return self.get(name)

    def close(self) -> None:
        """Drop the mapping; it is unmapped once no view of it is left."""
        self._data = None


def _dtype_name(dtype: str) -> str:
    if dtype not in DTYPE_NAMES:
        raise BundleError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return DTYPE_NAMES[dtype]


def upload_tensors(params: Params) -> Iterator[str]:
    """The tensors uploaded at load as NPU B operands, which must all be present (docs/sam3-bundle.md 5).

    A generator: a huge layer count stops at its first missing tensor instead of building a huge list.
    """
    yield from ("v.embed", "n.in", "n.up", "dec.kv")
    yield from (f"v.{i}.{w}" for i in range(params.vit_layers) for w in ("qkv", "o", "fc1", "fc2"))
    yield from (f"d.{i}.{w}" for i in range(params.d_layers) for w in ("qkv", "o", "fc1", "fc2"))
    yield from ("n.conv0", "n.conv1", "n.conv2", "m.conv0", "m.conv1")
    if params.vit_device:
        yield from ("v.rope_tab.win", "v.rope_tab.glob")
    if params.tracker:
        yield from ("tn.in", "tn.up", "tn.conv0", "tn.conv1", "tn.conv2")


def packed_tensors(params: Params) -> dict[str, str]:
    """Each packed B tensor and the GEMM whose packing it holds (docs/sam3-bundle.md 5), for the summary."""
    out = {"v.embed": "v_embed", "n.in": "n_in", "n.up": "n_up", "dec.kv": "dec_kv", "pack_test.packed": "d_s"}
    for i in range(params.vit_layers):
        out |= {f"v.{i}.qkv": "v_qkv", f"v.{i}.o": "v_o", f"v.{i}.fc1": "v_fc1", f"v.{i}.fc2": "v_fc2"}
    for i in range(params.d_layers):
        out |= {f"d.{i}.qkv": "d_qkv", f"d.{i}.o": "d_o", f"d.{i}.fc1": "d_fc1", f"d.{i}.fc2": "d_fc2"}
    out |= {name: "conv" for name in ("n.conv0", "n.conv1", "n.conv2", "m.conv0", "m.conv1")}
    if params.tracker:
        out |= {"tn.in": "n_in", "tn.up": "n_up"} | {f"tn.conv{i}": "conv" for i in range(3)}
    return out


# -------------------------------------------------------------------------------------------------------
# The bundle
# -------------------------------------------------------------------------------------------------------


class Bundle:
    """An open bundle: manifest, params, kernels, tensors and tokenizer files, all checked at open.

    Use `Bundle.open(directory)`; close it (or use it as a context manager) to release the directory
    descriptor and the mapping of tensors.bin (which stays mapped while views of it are alive).
    """

    version: int
    params: Params
    xclbins: dict[str, XclbinRecord]
    gemms: dict[str, GemmSpec]
    mhas: dict[str, MhaSpec]
    ops: dict[str, OpSpec]
    records: list[Record]
    tensors: TensorStore
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    tok_tests: list[TokTest]
    cases: list[Case]
    pcases: list[Case]
    ref_image: Path | None
    ref_prompt: str | None
    _dir: _Dir
    _insts: dict[str, bytes]

    def __init__(self) -> None:
        raise TypeError("use Bundle.open(directory)")

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Bundle:
        """Open and check the bundle in `directory` (docs/sam3-bundle.md 7).

        Raises:
            BundleError: any grammar, version, param, kernel, path, tensor, vocab.json or merges.txt error;
                the message names the file, line and record.
        """
        self = cls.__new__(cls)
        self._dir = _Dir(directory)
        self._insts = {}
        self.tensors = TensorStore({}, b"")
        try:
            self._load()
        except BaseException:
            self.close()
            raise
        return self

    @property
    def root(self) -> Path:
        """The bundle directory (resolved)."""
        return self._dir.root

    def _load(self) -> None:
        d = self._dir
        text = _utf8(d.read(d.resolve(MANIFEST), MANIFEST, TEXT_LIMIT), MANIFEST)
        records = [r for n, ln in enumerate(_lines(text), 1) if (r := Record.parse(n, ln)) is not None]
        self._shared(records)
        self._model(self.records)
        self.params = Params(self._param_values, self._param_records)
        self.tensors = self._store()
        missing = next((n for n in upload_tensors(self.params) if n not in self.tensors), None)
        if missing is not None:
            raise BundleError(f"tensor {missing} missing from the bundle")
        self.vocab = parse_vocab(d.read(d.resolve(VOCAB), VOCAB, TEXT_LIMIT))
        self.merges = parse_merges(d.read(d.resolve(MERGES), MERGES, TEXT_LIMIT))

    def _shared(self, records: list[Record]) -> None:
        """The version, param and xclbin records (docs/sam3-bundle.md 2.2); every other record is kept."""
        version: int | None = None
        self._param_values: dict[str, str] = {}
        self._param_records: dict[str, Record] = {}
        self.xclbins = {}
        self.records = []
        for r in records:
            if r.tag == "version":
                if version is not None:
                    raise r.error("second version record")
                version = r.uint_field(0, _U32_MAX)
            elif r.tag == "param":
                name = r.field(0)
                r.field(1)
                if name in self._param_values:
                    raise r.error(f"param {name} defined twice")
                self._param_values[name] = r.rest(1)
                self._param_records[name] = r
            elif r.tag == "xclbin":
                key, path, kernel = r.field(0), r.field(1), r.field(2)
                if key in self.xclbins:
                    raise r.error(f"xclbin {key} defined twice")
                self.xclbins[key] = XclbinRecord(key, self._path(r, path, "xclbin"), kernel, r.line)
            else:
                self.records.append(r)
        # Versions are tried newest first; when none matches, the newest attempt's error is the one reported.
        if version not in VERSIONS:
            found = "no version record" if version is None else f"version {version}"
            raise BundleError(f"{self.root / MANIFEST}: {found}, this runtime reads version {VERSIONS[0]}; "
                              "re-export the bundle")
        self.version = version

    def _path(self, r: Record, text: str, what: str) -> Path:
        """A manifest path, refused when absolute, escaping the bundle or a link out of it (docs/sam3-bundle.md 8)."""
        where = self._dir.inside(text)
        if isinstance(where, str):
            raise r.error(f"{what} path {text!r} {where}")
        parts = _rel_parts(text) or ()
        return self.root.joinpath(*parts)

    def _model(self, records: list[Record]) -> None:
        """The SAM3 records of docs/sam3-bundle.md 4; unknown tags are ignored."""
        self.gemms, self.mhas, self.ops = {}, {}, {}
        self.tok_tests, self.cases, self.pcases = [], [], []
        self.ref_image, self.ref_prompt = None, None
        owners: dict[str, tuple[str, int]] = {}
        for r in records:
            if r.tag == "gemm":
                g = self._gemm(r)
                self.gemms[_claim(owners, r, g.key)] = g
            elif r.tag == "mha":
                h = self._mha(r)
                self.mhas[_claim(owners, r, h.key)] = h
            elif r.tag == "op":
                o = self._op(r)
                self.ops[_claim(owners, r, o.key)] = o
            elif r.tag == "ref_image":
                self.ref_image = self._path(r, r.rest(0), "ref_image")
            elif r.tag == "ref_prompt":
                self.ref_prompt = r.rest(0)
            elif r.tag == "tok_test":
                self.tok_tests.append(TokTest(r.uint_field(0), unescape(r.rest(1)), r.line))
            elif r.tag == "case":
                r.field(2)
                self.cases.append(Case(r.uint_field(0), self._path(r, r.field(1), "case image"), r.rest(2), r.line))
            elif r.tag == "pcase":
                self.pcases.append(Case(r.uint_field(0), self._path(r, r.field(1), "pcase image"), r.rest(2), r.line))

    def _gemm(self, r: Record) -> GemmSpec:
        key, ctx = r.field(0), r.str("ctx")
        insts = self._path(r, r.str("insts"), "insts")
        m, k, n, lda, tile_k, tile_n, ct_k = (r.uint(f) for f in ("M", "K", "N", "lda", "tile_k", "tile_n", "ct_k"))
        g = GemmSpec(key, ctx, insts, m, k, n, lda, tile_k, tile_n, ct_k, r.flag("bias"), r.uint("b_bytes"), r.line)
        if ctx not in self.xclbins:
            raise r.error(f"gemm {key} runs on unknown xclbin {ctx}")
        return g

    def _mha(self, r: Record) -> MhaSpec:
        key = r.field(0)
        xclbin = self._path(r, r.str("xclbin"), "xclbin")
        insts = self._path(r, r.str("insts"), "insts")
        name = r.kv.get("name", DEFAULT_KERNEL_NAME)
        heads, seq, d = r.uint("heads"), r.uint("seq"), r.uint("d")
        return MhaSpec(key, xclbin, insts, name, heads, seq, d, r.flag("token_major"), r.uint("elems"), r.line)

    def _op(self, r: Record) -> OpSpec:
        key = r.field(0)
        xclbin = self._path(r, r.str("xclbin"), "xclbin")
        insts = self._path(r, r.str("insts"), "insts")
        return OpSpec(key, xclbin, insts, r.kv.get("name", DEFAULT_KERNEL_NAME), r.line)

    def _store(self) -> TensorStore:
        d = self._dir
        index_text = _utf8(d.read(d.resolve(INDEX), INDEX, TEXT_LIMIT), INDEX)
        fd = d.open_file(d.resolve(BLOB), BLOB)
        try:
            size = os.fstat(fd).st_size
            index = parse_index(index_text, size)
            # A zero-length file cannot be mapped; an empty bundle then has only empty tensors.
            data: mmap.mmap | bytes = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise BundleError(f"{BLOB}: cannot map ({os.strerror(e.errno or 0)})") from e
        finally:
            os.close(fd)
        return TensorStore(index, data)

    # --- kernels -----------------------------------------------------------------------------------

    def kernel_keys(self) -> list[str]:
        """Every gemm, mha and op key, sorted by name (the load order, docs/sam3-bundle.md 9)."""
        return sorted([*self.gemms, *self.mhas, *self.ops])

    def xclbin(self, key: str) -> XclbinRecord:
        """The xclbin record `key`.

        Raises:
            BundleError: "xclbin K missing from the manifest".
        """
        if key not in self.xclbins:
            raise BundleError(f"xclbin {key} missing from the manifest")
        return self.xclbins[key]

    def gemm(self, key: str) -> GemmSpec:
        """The gemm `key`.

        Raises:
            BundleError: "kernel K missing from the manifest".
        """
        if key not in self.gemms:
            raise BundleError(f"kernel {key} missing from the manifest")
        return self.gemms[key]

    def mha(self, key: str) -> MhaSpec:
        """The mha `key`.

        Raises:
            BundleError: "no MHA K".
        """
        if key not in self.mhas:
            raise BundleError(f"no MHA {key}")
        return self.mhas[key]

    def kernel(self, key: str) -> KernelSource:
        """What loading kernel `key` needs; GEMMs share the context of their `ctx` xclbin (docs/sam3-bundle.md 9).

        Raises:
            BundleError: "no kernel K".
        """
        if key in self.gemms:
            g = self.gemms[key]
            x = self.xclbins[g.ctx]
            return KernelSource(key, g.ctx, x.path, g.insts, x.kernel, 2 * g.m * g.k * g.n)
        if key in self.mhas:
            h = self.mhas[key]
            return KernelSource(key, key, h.xclbin, h.insts, h.name, 4 * h.heads * h.seq * h.seq * h.d)
        if key in self.ops:
            o = self.ops[key]
            return KernelSource(key, key, o.xclbin, o.insts, o.name, 0)
        raise BundleError(f"no kernel {key}")

    def relative(self, path: Path) -> str:
        """`path` (a path this bundle resolved) relative to the bundle directory.

        Raises:
            BundleError: `path` is not inside the bundle directory.
        """
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError as e:
            raise BundleError(f"{path}: not a path inside the bundle {self.root}") from e

    def _text(self, path: Path | str) -> str:
        return self.relative(path) if isinstance(path, Path) and path.is_absolute() else str(path)

    def file_bytes(self, path: Path | str, limit: int = FILE_LIMIT) -> bytes:
        """The bytes of a bundle file (an xclbin, a stream, an image), read without following links.

        `path` is one of this bundle's resolved paths or a bundle-relative one.

        Raises:
            BundleError: the path is refused, the file is missing, not regular, a link, or over `limit`.
        """
        text = self._text(path)
        return self._dir.read(self._dir.resolve(text), text, limit)

    def file_problem(self, path: Path | str) -> str | None:
        """Why the bundle file at `path` could not be read (refused, missing, not regular), or None if it can."""
        try:
            text = self._text(path)
            os.close(self._dir.open_file(self._dir.resolve(text), text))
        except BundleError as e:
            return str(e)
        return None

    def insts_bytes(self, key: str) -> bytes:
        """The instruction stream of kernel `key`, read once and cached.

        Raises:
            BundleError: no such kernel, or the stream file cannot be read (see file_bytes).
        """
        if key not in self._insts:
            self._insts[key] = self.file_bytes(self.kernel(key).insts)
        return self._insts[key]

    def close(self) -> None:
        """Release the directory descriptor and the mapping (idempotent)."""
        self.tensors.close()
        self._dir.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _claim(owners: dict[str, tuple[str, int]], r: Record, key: str) -> str:
    """Record `r` as the owner of kernel `key`, which one key names across gemm, mha and op; returns `key`."""
    if key in owners:
        tag, line = owners[key]
        raise r.error(f"{r.tag} {key} defined twice" if tag == r.tag else
                      f"{r.tag} {key}: the key is already the {tag} of {MANIFEST}:{line}")
    owners[key] = (r.tag, r.line)
    return key


def parse_vocab(data: bytes) -> dict[str, int]:
    """`vocab.json`: a flat JSON object of string to integer (docs/sam3-bundle.md 7).

    Raises:
        BundleError: "vocab.json: not a flat {string: int} object (...)".
    """
    bad = f"{VOCAB}: not a flat {{string: int}} object"
    try:
        value = json.loads(_utf8(data, VOCAB))
    except (ValueError, RecursionError) as e:
        raise BundleError(f"{bad} ({e})") from e
    if not isinstance(value, dict):
        raise BundleError(f"{bad} (a JSON {type(value).__name__})")
    if not all(type(v) is int for v in value.values()):
        wrong = next(k for k, v in value.items() if type(v) is not int)
        raise BundleError(f"{bad} ({wrong!r} maps to {json.dumps(value[wrong])[:40]})")
    return value


def parse_merges(data: bytes) -> list[tuple[str, str]]:
    """`merges.txt`: one `a b` pair a line, rank = order; empty and `#version` lines skipped (docs/sam3-bundle.md 7).

    Raises:
        BundleError: "merges.txt: <line>" for a line without a space.
    """
    lines = _lines(_utf8(data, MERGES))
    # ln[0] != "#" first: the cheap test settles almost every line.
    pairs = [tuple(ln.split(" ", 1)) for ln in lines if ln and (ln[0] != "#" or not ln.startswith("#version"))]
    if min(map(len, pairs), default=2) < 2:
        number, line = next((n, ln) for n, ln in enumerate(lines, 1)
                            if ln and not ln.startswith("#version") and " " not in ln)
        raise BundleError(f"{MERGES}:{number}: {line}")
    return cast(list[tuple[str, str]], pairs)  # every pair has two parts: checked above


# -------------------------------------------------------------------------------------------------------
# The writer
# -------------------------------------------------------------------------------------------------------

_SHARED_TAGS = ("version", "param", "xclbin")
_RESERVED = (MANIFEST, INDEX, BLOB)


def _token(value: object, what: str) -> str:
    """`value` as one manifest token: non-empty, without whitespace."""
    text = _scalar(value, what)
    if not text or _WS_ONE.search(text):
        raise BundleError(f"{what} {text!r}: a manifest token must be non-empty and have no whitespace")
    return text


def _scalar(value: object, what: str) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        return repr(float(value))
    if isinstance(value, str | os.PathLike):
        return os.fspath(value) if isinstance(value, os.PathLike) else value
    raise TypeError(f"{what}: {type(value).__name__} is not a manifest value (int, float, str, bool)")


def _one_line(text: str, what: str) -> str:
    if "\n" in text or "\r" in text:
        raise BundleError(f"{what} {text!r}: a manifest line cannot hold a line break")
    return text


class BundleWriter:
    """Writes a bundle: tensors stream into tensors.bin as they come, 64-byte aligned (docs/sam3-bundle.md 10).

    manifest.txt is written last, at close(), so a write that fails leaves a directory that does not open.
    Use as a context manager: on an exception, close() is skipped and no manifest is written.
    """

    def __init__(self, directory: str | os.PathLike[str], version: int = VERSION):
        """Start a bundle in `directory`, which must not exist or be empty.

        Raises:
            BundleError: the directory is not empty, not a directory, or `version` is not one this reader reads.
        """
        if version not in VERSIONS:
            raise BundleError(f"version {version}: this runtime reads versions {', '.join(map(str, VERSIONS))}")
        self.root = Path(directory)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise BundleError(f"{self.root}: the bundle directory must not exist or be empty")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lines = [f"version {version}"]
        self._index: list[str] = []
        self._tensors: set[str] = set()
        self._params: set[str] = set()
        self._xclbins: set[str] = set()
        self._files: set[tuple[str, ...]] = set()
        self._offset = 0
        self._blob = open(self.root / BLOB, "xb")
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise BundleError(f"{self.root}: the writer is closed")

    def param(self, name: str, value: object) -> None:
        """`param <name> <value>`: int, float, str, bool (1/0) or a list/tuple (comma-joined).

        Raises:
            BundleError: duplicate name, a name with whitespace, a value with a line break.
            TypeError: a value of another type.
        """
        self._check_open()
        name = _token(name, "param name")
        if name in self._params:
            raise BundleError(f"param {name} defined twice")
        if isinstance(value, list | tuple | np.ndarray):
            text = ",".join(_token(v, f"param {name} item") for v in value)
        else:
            text = _one_line(_scalar(value, f"param {name}"), f"param {name}")
        self._params.add(name)
        self._lines.append(f"param {name} {text}")

    def xclbin(self, key: str, rel_path: str, kernel_name: str) -> None:
        """`xclbin <key> <rel_path> <kernel_name>`.

        Raises:
            BundleError: duplicate key, or a field that is not one token.
        """
        self._check_open()
        fields = (_token(key, "xclbin key"), _token(rel_path, "xclbin path"), _token(kernel_name, "kernel name"))
        line = "xclbin " + " ".join(fields)
        if key in self._xclbins:
            raise BundleError(f"xclbin {key} defined twice")
        self._xclbins.add(key)
        self._lines.append(line)

    def record(self, tag: str, *positional: object, **fields: object) -> None:
        """`<tag> <positional...> <k=v...>`; without k=v fields the last positional may hold spaces (a prompt).

        Raises:
            BundleError: a shared tag (use param/xclbin; the version is the constructor's), a bad token.
            TypeError: a value that is not int, float, str or bool.
        """
        self._check_open()
        tag = _token(tag, "record tag")
        if tag in _SHARED_TAGS or tag.startswith("#"):
            raise BundleError(f"record tag {tag!r}: write it with the writer's own method")
        parts = [tag]
        free = positional[-1] if positional and not fields else None
        fixed = positional[:-1] if free is not None else positional
        parts += [_token(v, f"{tag} field") for v in fixed]
        parts += [f"{_token(k, f'{tag} key')}={_token(v, f'{tag} {k}=')}" for k, v in fields.items()]
        if free is not None:
            parts.append(_one_line(_scalar(free, f"{tag} text"), f"{tag} text"))
        self._lines.append(" ".join(parts))

    def comment(self, text: str) -> None:
        """A `# text` line.

        Raises:
            BundleError: text with a line break.
        """
        self._check_open()
        self._lines.append("# " + _one_line(text, "comment"))

    def tensor(self, name: str, array: np.ndarray, dtype: str | None = None) -> TensorInfo:
        """Append `array` to tensors.bin; dtype f32, bf16 (ml_dtypes.bfloat16, or uint16 bits with dtype="bf16"),
        u8 or i32, inferred from the array when not given.

        Raises:
            BundleError: duplicate name, a bad name, a 0-d array, an array of another dtype.
        """
        self._check_open()
        arr = np.asarray(array)
        code = _dtype_code(arr, dtype, name)
        if arr.ndim == 0:
            raise BundleError(f"tensor {name}: a 0-d array has no shape tensors.txt can hold (use shape [1])")
        # uint16 bf16 bits are written as they are; other dtypes in little-endian order (docs/sam3-bundle.md 6).
        want = np.dtype("<u2") if code == "bf16_bits" else DTYPES[code]
        data = np.ascontiguousarray(arr.astype(want, copy=False)).reshape(-1).view(np.uint8)
        return self._append(name, code.removesuffix("_bits"), arr.shape, data.data)

    def raw_tensor(self, name: str, data: bytes | bytearray | memoryview | np.ndarray) -> TensorInfo:
        """Append raw bytes as a u8 tensor of shape [nbytes] (a packed B operand, a RoPE table).

        Raises:
            BundleError: duplicate or bad name, an array that is not uint8.
        """
        self._check_open()
        if isinstance(data, np.ndarray):
            if data.dtype != np.uint8:
                raise BundleError(f"tensor {name}: raw bytes must be uint8, not {data.dtype}")
            view = np.ascontiguousarray(data).reshape(-1).data
        else:
            view = memoryview(data).cast("B")
        return self._append(name, "u8", (view.nbytes,), view)

    def _append(self, name: str, code: str, shape: tuple[int, ...], view: memoryview) -> TensorInfo:
        name = _token(name, "tensor name")
        if name in self._tensors:
            raise BundleError(f"tensor {name} written twice")
        pad = -self._offset % WRITE_ALIGN
        if pad:
            self._blob.write(bytes(pad))
        offset = self._offset + pad
        self._blob.write(view)
        self._offset = offset + view.nbytes
        self._tensors.add(name)
        dims = ",".join(str(d) for d in shape)
        self._index.append(f"{name} {code} {dims} {offset} {view.nbytes}")
        return TensorInfo(name, code, tuple(shape), offset, view.nbytes, len(self._index))

    def file(self, rel_path: str, data: bytes) -> Path:
        """Write a bundle file (kernels/*, vocab.json, merges.txt, case images) at `rel_path`.

        Raises:
            BundleError: an absolute or escaping path, a reserved name, a file written twice.
        """
        self._check_open()
        parts = _rel_parts(rel_path) if not PurePosixPath(rel_path).is_absolute() else None
        if not parts:
            raise BundleError(f"file {rel_path!r}: not a path inside the bundle")
        if parts in self._files or (len(parts) == 1 and parts[0] in _RESERVED + (MANIFEST + ".tmp",)):
            raise BundleError(f"file {rel_path!r}: written twice, or a name the writer owns")
        target = self.root.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as f:
            f.write(data)
        self._files.add(parts)
        return target

    def close(self) -> Path:
        """Finish tensors.bin, write tensors.txt, then manifest.txt (last, via rename); idempotent.

        Raises:
            OSError: the files cannot be written.
        """
        if self._closed:
            return self.root
        self._blob.flush()
        os.fsync(self._blob.fileno())
        self._blob.close()
        self._write_text(INDEX, self._index)
        self._write_text(MANIFEST, self._lines)
        self._closed = True
        return self.root

    def abort(self) -> None:
        """Stop writing without a manifest: what was written stays, and does not open as a bundle."""
        if not self._closed:
            self._blob.close()
            self._closed = True

    def _write_text(self, name: str, lines: list[str]) -> None:
        tmp = self.root / (name + ".tmp")
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _dtype_code(arr: np.ndarray, dtype: str | None, name: str) -> str:
    found = next((code for code, dt in DTYPES.items() if arr.dtype == dt or
                  (code != "bf16" and arr.dtype.newbyteorder("<") == dt)), None)
    if dtype is None:
        if found is None:
            raise BundleError(f"tensor {name}: unknown dtype {arr.dtype} (write f32, bf16, u8 or i32)")
        return found
    if dtype not in DTYPES:
        raise BundleError(f"tensor {name}: unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    if dtype == "bf16" and arr.dtype == np.uint16:
        return "bf16_bits"
    if found != dtype:
        raise BundleError(f"tensor {name}: array is {arr.dtype}, wanted {dtype} (convert it first)")
    return dtype


# -------------------------------------------------------------------------------------------------------
# Summary
# -------------------------------------------------------------------------------------------------------


def summarize(bundle: Bundle) -> dict[str, Any]:
    """A JSON-ready description of `bundle`: version, params, xclbins, kernels, tensors and problems found.

    Problems are what the load-time checks let through but a run would trip on (docs/sam3-bundle.md 11).
    """
    return _Summary(bundle).build()


class _Summary:
    """Builds the dict of summarize(), collecting problems on the way."""

    def __init__(self, bundle: Bundle):
        self.b = bundle
        self.problems: list[str] = []

    def build(self) -> dict[str, Any]:
        b = self.b
        return {
            "root": str(b.root),
            "version": b.version,
            "params": dict(b.params.raw),
            "xclbins": self._xclbins(),
            "contexts": self._contexts(),
            "gemms": [self._gemm(g) for g in b.gemms.values()],
            "mhas": [self._mha(h) for h in b.mhas.values()],
            "ops": [self._op(o) for o in b.ops.values()],
            "tensors": self._tensors(),
            "problems": self._problems(),
        }

    def _rel(self, path: Path) -> str:
        return self.b.relative(path)

    def _file(self, path: Path, what: str) -> None:
        problem = self.b.file_problem(path)
        if problem is not None:
            self.problems.append(f"{what}: {problem}")

    def _xclbins(self) -> list[dict[str, Any]]:
        out = []
        for x in self.b.xclbins.values():
            users = [g.key for g in self.b.gemms.values() if g.ctx == x.key]
            named: list[MhaSpec | OpSpec] = [*self.b.mhas.values(), *self.b.ops.values()]
            users += [k.key for k in named if (k.xclbin, k.name) == (x.path, x.kernel)]
            out.append({"key": x.key, "path": self._rel(x.path), "kernel": x.kernel, "line": x.line,
                        "kernels": sorted(users)})
            self._file(x.path, f"xclbin {x.key}")
            if not users:
                self.problems.append(f"xclbin {x.key} ({self._rel(x.path)}) is used by no kernel")
        return out

    def _contexts(self) -> list[dict[str, Any]]:
        groups: dict[tuple[str, str], list[str]] = {}
        for key in self.b.kernel_keys():
            k = self.b.kernel(key)
            groups.setdefault((self._rel(k.xclbin), k.name), []).append(key)
        return [{"xclbin": p, "kernel": n, "kernels": keys} for (p, n), keys in groups.items()]

    def _gemm(self, g: GemmSpec) -> dict[str, Any]:
        self._file(g.insts, f"gemm {g.key} insts")
        if g.b_bytes != g.packed_bytes:
            self.problems.append(f"gemm {g.key}: b_bytes={g.b_bytes}, but 9*N*(K+ct_k*bias)/8 = {g.packed_bytes}")
        return {"key": g.key, "ctx": g.ctx, "insts": self._rel(g.insts), "M": g.m, "K": g.k, "N": g.n,
                "lda": g.lda, "tile_k": g.tile_k, "tile_n": g.tile_n, "ct_k": g.ct_k, "bias": g.bias,
                "b_bytes": g.b_bytes, "line": g.line}

    def _mha(self, h: MhaSpec) -> dict[str, Any]:
        self._file(h.xclbin, f"mha {h.key} xclbin")
        self._file(h.insts, f"mha {h.key} insts")
        return {"key": h.key, "xclbin": self._rel(h.xclbin), "insts": self._rel(h.insts), "name": h.name,
                "heads": h.heads, "seq": h.seq, "d": h.d, "token_major": h.token_major, "elems": h.elems,
                "line": h.line}

    def _op(self, o: OpSpec) -> dict[str, Any]:
        self._file(o.xclbin, f"op {o.key} xclbin")
        self._file(o.insts, f"op {o.key} insts")
        return {"key": o.key, "xclbin": self._rel(o.xclbin), "insts": self._rel(o.insts), "name": o.name,
                "line": o.line}

    def _tensors(self) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        by_dtype: dict[str, dict[str, int]] = {}
        for t in self.b.tensors:
            items.append({"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                          "offset": t.offset})
            total = by_dtype.setdefault(t.dtype, {"count": 0, "bytes": 0})
            total["count"] += 1
            total["bytes"] += t.nbytes
        return {"count": len(items), "bytes": sum(t["bytes"] for t in items), "by_dtype": by_dtype, "items": items}

    def _problems(self) -> list[str]:
        b = self.b
        for keys, tags in ((GEMM_KEYS, b.gemms), (MHA_KEYS, b.mhas)):
            self.problems += [f"kernel {k} missing from the manifest" for k in keys if k not in tags]
        if b.params.vit_device:
            self.problems += [f"kernel {k} missing from the manifest (vit_device=1)" for k in OP_KEYS if k not in b.ops]
        for name in FLAG_PARAMS:
            if b.params.has(name) and b.params.raw[name] not in ("0", "1"):
                self.problems.append(f"param {name} ({b.params.raw[name]}) is not 0 or 1: read as off")
        for name, key in packed_tensors(b.params).items():
            if name in b.tensors and key in b.gemms and b.tensors.info(name).nbytes != b.gemms[key].b_bytes:
                self.problems.append(f"tensor {name} is {b.tensors.info(name).nbytes} bytes, "
                                     f"gemm {key} b_bytes={b.gemms[key].b_bytes}")
        for t in b.tensors:
            if t.offset % WRITE_ALIGN:
                self.problems.append(f"tensor {t.name}: offset {t.offset} is not 64-byte aligned")
        self._overlaps()
        for c in [*b.cases, *b.pcases]:
            self._file(c.image, f"case {c.index} image (line {c.line})")
        if b.ref_image is not None:
            self._file(b.ref_image, "ref_image")
        return self.problems

    def _overlaps(self) -> None:
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.b.tensors if t.nbytes)
        for (_, end, name), (start, _, nxt) in zip(spans, spans[1:], strict=False):
            if start < end:
                self.problems.append(f"tensor {nxt} overlaps tensor {name} in {BLOB}")


def format_summary(summary: Mapping[str, Any]) -> str:
    """The human text form of a summarize() dict: one line per item, columns aligned."""
    rows: list[list[str]] = [["bundle", summary["root"], f"version {summary['version']}"]]
    rows += [["param", k, v] for k, v in summary["params"].items()]
    rows += [["xclbin", x["key"], x["path"], x["kernel"], " ".join(x["kernels"]) or "(unused)"]
             for x in summary["xclbins"]]
    rows += [["context", c["xclbin"], c["kernel"], " ".join(c["kernels"])] for c in summary["contexts"]]
    for g in summary["gemms"]:
        dims = f"M={g['M']} K={g['K']} N={g['N']} lda={g['lda']}"
        tiles = f"tile_k={g['tile_k']} tile_n={g['tile_n']} ct_k={g['ct_k']} bias={int(g['bias'])}"
        rows.append(["gemm", g["key"], f"ctx={g['ctx']}", dims, tiles, f"b_bytes={g['b_bytes']}", g["insts"]])
    for h in summary["mhas"]:
        shape = f"heads={h['heads']} seq={h['seq']} d={h['d']} token_major={int(h['token_major'])}"
        rows.append(["mha", h["key"], h["name"], shape, f"elems={h['elems']}", h["xclbin"], h["insts"]])
    rows += [["op", o["key"], o["name"], o["xclbin"], o["insts"]] for o in summary["ops"]]
    t = summary["tensors"]
    rows += [["tensor", i["name"], i["dtype"], "x".join(map(str, i["shape"])), f"{i['bytes']} bytes"]
             for i in t["items"]]
    rows += [["tensors", dt, f"{v['count']} tensors", f"{v['bytes']} bytes"] for dt, v in t["by_dtype"].items()]
    rows.append(["tensors", "all", f"{t['count']} tensors", f"{t['bytes']} bytes"])
    rows += [["problem", p] for p in summary["problems"]] or [["problems", "none"]]
    # Columns are aligned within each run of rows of one kind (params, gemms, tensors, ...).
    kind = max(len(r[0]) for r in rows)
    runs: list[list[list[str]]] = []
    for row in ([r[0].ljust(kind), *r[1:]] for r in rows):
        if runs and runs[-1][0][0] == row[0]:
            runs[-1].append(row)
        else:
            runs.append([row])
    return "".join(_align(run) for run in runs)


def _align(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as text, each column as wide as its widest cell (the last cell of a row unpadded)."""
    ncols = max(len(r) for r in rows)
    widths = [max((len(r[i]) for r in rows if i < len(r) - 1), default=0) for i in range(ncols)]
    return "\n".join("  ".join(c.ljust(widths[i]) if i < len(r) - 1 else c for i, c in enumerate(r))
                     for r in rows) + "\n"
