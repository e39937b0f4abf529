"""The text of a bundle: manifest.txt's grammar, records and params, and the scalars, paths and lines they share
(docs/sam3-bundle.md 2-5)."""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType

import numpy as np

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
KERNEL_TAGS = ("gemm", "mha", "op")
_RUNTIME_KIND = {**dict.fromkeys(GEMM_KEYS, "gemm"), **dict.fromkeys(MHA_KEYS, "mha"), **dict.fromkeys(OP_KEYS, "op")}


def kernel_kind(key: str, *tables: Mapping[str, object]) -> str | None:
    """Which record kind kernel `key` is run as, given the gemm, mha and op tables in that order, or None.

    A key defined by two kinds is the kind the runtime launches it as (docs/sam3-bundle.md 4.1): `conv` a gemm,
    `mha_d` an mha, `rope` an op; any other key the first of gemm, mha, op that defines it.
    """
    return _run_as(key, [tag for tag, table in zip(KERNEL_TAGS, tables, strict=True) if key in table])


def _run_as(key: str, kinds: list[str]) -> str | None:
    preferred = _RUNTIME_KIND.get(key)
    return preferred if preferred in kinds else next(iter(kinds), None)


def kernel_warnings(records: Iterable[Record]) -> list[str]:
    """The kernel records a run overrides (docs/sam3-bundle.md 4.1), one warning each: a gemm, mha or op key
    defined again by the same kind (the later record wins), and a key defined by two kinds."""
    out: list[str] = []
    last: dict[tuple[str, str], Record] = {}
    kinds: dict[str, dict[str, Record]] = {}
    for r in records:
        if r.tag not in KERNEL_TAGS or not r.fields:
            continue
        key = r.fields[0]
        earlier = last.get((r.tag, key))
        if earlier is not None:
            out.append(f"{MANIFEST}:{r.line}: {r.tag} {key} defined twice (first at line {earlier.line}): "
                       "the later record wins")
        last[(r.tag, key)] = r
        kinds.setdefault(key, {})[r.tag] = r
    for key, by_tag in kinds.items():
        if len(by_tag) > 1:
            tags = [t for t in KERNEL_TAGS if t in by_tag]
            run = _run_as(key, tags)
            where = ", ".join(f"{t} at line {by_tag[t].line}" for t in tags)
            out.append(f"{MANIFEST}: kernel key {key} is defined by {len(by_tag)} kinds ({where}): "
                       f"it runs as the {run}")
    return out

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

    def where(self, name: str) -> str:
        """`manifest.txt:<line>` of `param <name>` (`manifest.txt` alone when it has no record)."""
        rec = self._records.get(name)
        return f"{MANIFEST}:{rec.line}" if rec is not None else MANIFEST

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
