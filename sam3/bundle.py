"""Loading and validating a SAM3 kernel bundle (spec/sam3-bundle.md 1-6).

A bundle is a directory holding `manifest.json`, one xclbin per hardware context, one TXN
instruction stream per kernel key and optional packed weights. Everything is checked on load;
every error is a `BundleError` naming the manifest key and field it concerns.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from amdxdna_direct.device import TXN_DEV_GEN
from amdxdna_direct.xclbin import Xclbin, XclbinError
from sam3.pack import BF16_BYTES, ConvGeometry, Layout, parse_layout

MANIFEST = "manifest.json"
FORMAT = 1

# NPU generation of each target name (spec/xrt-npu-sequence.md 4): npu1 is AIE2 (Phoenix/Hawk
# Point); npu4/5/6 are one AIE2P family whose xclbins and TXN streams are interchangeable.
GENERATIONS = {"npu1": "aie2", "npu4": "aie2p", "npu5": "aie2p", "npu6": "aie2p"}

ELEMENTWISE_FNS = ("gelu", "silu", "add", "copy", "layernorm")

_TOP_REQUIRED = {"format", "target", "xclbins"}
_TOP_OPTIONAL = {"gemms", "mhas", "ops"}
_XCLBIN_FIELDS = {"path", "kernel"}
_GEMM_FIELDS = {"key", "ctx", "m", "k", "n", "lda", "insts", "b_bytes", "b_layout"}
_MHA_FIELDS = {"key", "heads", "seq", "d", "elems", "xclbin", "insts", "name"}
_OP_FIELDS = {"key", "xclbin", "insts", "name", "fn", "elems"}
_OP_OPTIONAL = {"n"}  # layernorm's normalised length (spec 6: "over the last n elements")
# A kernel moves each buffer through a shim DMA buffer descriptor whose length is a 32-bit count of
# 32-bit words (spec/xrt-npu-sequence.md 2.3, BD word 0): every buffer a manifest entry implies is a
# whole number of words, at most this many bytes.
MAX_BUFFER_BYTES = 4 * 0xFFFF_FFFF
# TXN header (spec/xrt-npu-sequence.md 2.3): word 0 carries the device generation in bits 23:16,
# word 3 the stream's size in bytes.
_TXN_HEADER = struct.Struct("<4I")


class BundleError(ValueError):
    """A bundle that cannot be used; `key` and `field` name where (either may be None)."""

    def __init__(self, message: str, key: str | None = None, field: str | None = None):
        super().__init__(message)
        self.key = key
        self.field = field


@dataclass(frozen=True)
class XclbinEntry:
    """One hardware context's xclbin: manifest name, resolved path, kernel name."""

    name: str
    path: Path
    kernel: str


@dataclass(frozen=True)
class GemmSpec:
    """`C[m x n] = A[m x k] @ B[k x n]`, rows of A `lda` elements apart (spec 2)."""

    key: str
    ctx: str
    m: int
    k: int
    n: int
    lda: int
    insts: Path
    b_bytes: int
    b_layout: str

    @property
    def layout(self) -> Layout:
        """The parsed `b_layout`."""
        return parse_layout(self.b_layout)

    @property
    def conv(self) -> ConvGeometry | None:
        """D, P and Cout of a `conv3x3:P` GEMM; None for a plain GEMM."""
        return ConvGeometry.of(self.k, self.lda, self.n) if self.layout.kind == "conv3x3" else None


@dataclass(frozen=True)
class MhaSpec:
    """Multi-head attention over `[heads][seq][d]` q, k, v, o (spec 5)."""

    key: str
    heads: int
    seq: int
    d: int
    elems: int
    xclbin: Path
    insts: Path
    name: str


@dataclass(frozen=True)
class OpSpec:
    """An element-wise kernel `fn` over buffers of `elems` elements (spec 6); `n` for layernorm."""

    key: str
    xclbin: Path
    insts: Path
    name: str
    fn: str
    elems: int
    n: int | None = None


@dataclass(frozen=True)
class Kernel:
    """Where a key's kernel comes from: its context id (the xclbin path), xclbin, stream, kernel name."""

    key: str
    ctx: str
    xclbin: Path
    insts: Path
    name: str


class Bundle:
    """A loaded, validated bundle. Build with `Bundle.load(directory)`."""

    def __init__(self, root: Path, target: str, xclbins: dict[str, XclbinEntry], gemms: dict[str, GemmSpec],
                 mhas: dict[str, MhaSpec], ops: dict[str, OpSpec]):
        self.root = root
        self.target = target
        self.xclbins = xclbins
        self.gemms = gemms
        self.mhas = mhas
        self.ops = ops
        self._parsed: dict[Path, Xclbin] = {}

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Bundle:
        """Reads and checks `directory/manifest.json` and every file it names.

        Raises:
            BundleError: unreadable or malformed manifest, a missing or escaping file, a bad field.
        """
        try:
            root = Path(directory).resolve()
        except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, an embedded NUL
            raise BundleError(f"bundle {directory!r}: cannot resolve the directory: {e}", field=MANIFEST) from e
        doc = _read_manifest(root)
        _check_fields(doc, _TOP_REQUIRED, _TOP_OPTIONAL, None, "manifest")
        if type(doc["format"]) is not int or doc["format"] != FORMAT:
            raise BundleError(f"manifest format: {doc['format']!r} is not supported (expected {FORMAT})",
                              field="format")
        target = doc["target"]
        if not isinstance(target, str) or target not in GENERATIONS:
            raise BundleError(f"manifest target: unknown NPU {target!r} (expected one of {sorted(GENERATIONS)})",
                              field="target")
        xclbins = _load_xclbins(root, _mapping(doc, "xclbins"))
        seen: set[str] = set()
        gemms = {g.key: g for g in (_load_gemm(root, e, xclbins, seen) for e in _entries(doc, "gemms"))}
        mhas = {h.key: h for h in (_load_mha(root, e, seen) for e in _entries(doc, "mhas"))}
        ops = {o.key: o for o in (_load_op(root, e, seen) for e in _entries(doc, "ops"))}
        bundle = cls(root, target, xclbins, gemms, mhas, ops)
        bundle._check_xclbins()
        bundle._check_streams()
        bundle._check_weights()
        return bundle

    # -- queries ------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every kernel key, sorted (the order the NPU layer loads them in, spec 7)."""
        return sorted([*self.gemms, *self.mhas, *self.ops])

    def kernel(self, key: str) -> Kernel:
        """Where `key`'s kernel comes from; kernels naming the same xclbin share a context (spec 1).

        Raises:
            KeyError: no kernel `key` in the bundle.
        """
        if key in self.gemms:
            g = self.gemms[key]
            x = self.xclbins[g.ctx]
            return Kernel(key, self._ctx_id(x.path), x.path, g.insts, x.kernel)
        spec = self.mhas.get(key) or self.ops.get(key)
        if spec is None:
            raise KeyError(f"bundle {self.root}: no kernel {key!r}")
        return Kernel(key, self._ctx_id(spec.xclbin), spec.xclbin, spec.insts, spec.name)

    def weights(self, key: str) -> Path | None:
        """The packed B of GEMM `key` shipped in `weights/<key>.bin`, or None."""
        path = self.root / "weights" / f"{key}.bin"
        try:
            return path if path.is_file() else None
        except OSError:  # ENAMETOOLONG: a key no file can be named after ships no weights
            return None

    def check_target(self, device: str) -> None:
        """Checks that this bundle's xclbins run on a device of generation `device` ("npu1", "npu4", ...).

        Raises:
            BundleError: the device belongs to another NPU generation (naming both).
        """
        have = GENERATIONS.get(device)
        want = GENERATIONS[self.target]
        if have != want:
            raise BundleError(f"bundle {self.root} targets {self.target} ({want.upper()}) but the device is "
                              f"{device} ({(have or 'unknown generation').upper()})", field="target")

    def xclbin(self, key: str) -> Xclbin:
        """The parsed xclbin of kernel `key` (parsed once per file at load).

        Raises:
            KeyError: no kernel `key` in the bundle.
        """
        return self._parsed[self.kernel(key).xclbin]

    def _ctx_id(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    # -- cross-file checks ----------------------------------------------------------------------

    def _check_xclbins(self) -> None:
        """Each kernel's xclbin parses and carries a PDI for the kernel name it is opened with."""
        for key in self.keys():
            k = self.kernel(key)
            field = "ctx" if key in self.gemms else "xclbin"
            try:
                if k.xclbin not in self._parsed:
                    self._parsed[k.xclbin] = Xclbin.load(k.xclbin)
                self._parsed[k.xclbin].pdi_for(k.name)
                _check_mlir_aie_args(self._parsed[k.xclbin].kernel(k.name), self._buffers(key))
            except (XclbinError, OSError) as e:
                raise BundleError(f"{key}.{field}: {k.ctx} is not a usable xclbin for kernel {k.name!r}: {e}",
                                  key, field) from e

    def _buffers(self, key: str) -> int:
        """Buffer arguments kernel `key` is run with: A, B, C (spec 2); q, k, v, o (spec 5); an op at least one."""
        return 3 if key in self.gemms else 4 if key in self.mhas else 1

    def _check_streams(self) -> None:
        """Each instruction stream is a TXN stream for the bundle's target (spec/xrt-npu-sequence.md 2.3)."""
        want = TXN_DEV_GEN[self.target]
        for key in self.keys():
            path = self.kernel(key).insts
            try:
                with path.open("rb") as f:
                    head = f.read(_TXN_HEADER.size)
                    length = os.fstat(f.fileno()).st_size
            except OSError as e:
                raise BundleError(f"{key}.insts: {path.name} cannot be read: {e}", key, "insts") from e
            if len(head) < _TXN_HEADER.size or length % 4:
                raise BundleError(f"{key}.insts: {path.name} is not a TXN stream (size {length})", key, "insts")
            word0, _, _, size = _TXN_HEADER.unpack(head)
            gen = (word0 >> 16) & 0xFF
            if gen != want:
                raise BundleError(f"{key}.insts: TXN device generation {gen} does not match target "
                                  f"{self.target} (generation {want})", key, "insts")
            if size != length:
                raise BundleError(f"{key}.insts: TXN header says {size} bytes, file has {length}", key, "insts")

    def _check_weights(self) -> None:
        """Shipped weights must be exactly `b_bytes` long and belong to a GEMM."""
        folder = self.root / "weights"
        if not folder.exists():
            return
        if not folder.is_dir():
            raise BundleError(f"bundle {self.root}: weights is not a directory", field="weights")
        for path in sorted(folder.iterdir()):
            key = path.name.removesuffix(".bin")
            _inside(self.root, f"weights/{path.name}", key, "weights")
            if key not in self.gemms:
                raise BundleError(f"weights/{path.name}: no GEMM {key!r} in the manifest", key, "weights")
            size, b_bytes = path.stat().st_size, self.gemms[key].b_bytes
            if size != b_bytes:
                raise BundleError(f"{key}.b_bytes: weights/{path.name} has {size} bytes, b_bytes is {b_bytes}",
                                  key, "b_bytes")


def _check_mlir_aie_args(kernel: Any, buffers: int) -> None:
    """The NPU layer runs every kernel in the mlir-aie convention (spec/xrt-npu-sequence.md 2.2): scalar opcode,
    instruction buffer, scalar word count, then `buffers` buffer arguments; a kernel declaring other arguments
    (a DPU kernel's scalar argv, a PL kernel) cannot take that command.

    Raises:
        XclbinError: the kernel's arguments are not in that convention.
    """
    args = sorted(kernel.args, key=lambda a: a.index)
    want = ["scalar", "global", "scalar"] + ["global"] * buffers
    have = [a.kind for a in args[: len(want)]]
    if have != want:
        declared = ", ".join(f"{a.name}: {a.kind}" for a in args)
        raise XclbinError(f"kernel {kernel.name!r} declares ({declared}); the mlir-aie convention needs a scalar "
                          f"opcode, an instruction buffer, a scalar word count and {buffers} buffer(s)")


# ---------------------------------------------------------------------------------------------
# Field-level checks


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"bundle {root}: {MANIFEST} not found", field=MANIFEST)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_names)
    except OSError as e:
        raise BundleError(f"bundle {root}: {MANIFEST} cannot be read: {e}", field=MANIFEST) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"bundle {root}: {MANIFEST} is not valid JSON: {e}", field=MANIFEST) from e
    except RecursionError as e:  # json's C decoder recurses once per nesting level
        raise BundleError(f"bundle {root}: {MANIFEST} nests too deeply to be a manifest", field=MANIFEST) from e
    if not isinstance(doc, dict):
        raise BundleError(f"bundle {root}: {MANIFEST} must hold an object, not {type(doc).__name__}",
                          field=MANIFEST)
    return doc


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a name given twice is an error (json keeps the last silently: a hand edit that adds a
    field instead of changing it would be ignored, or would replace a whole xclbins entry)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise BundleError(f"{MANIFEST}: {name!r} appears twice in one object", field=name)
        out[name] = value
    return out


def _check_fields(entry: Any, required: set[str], optional: set[str], key: str | None, where: str) -> None:
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: expected an object, got {type(entry).__name__}", key)
    unknown = sorted(set(entry) - required - optional)
    if unknown:
        raise BundleError(f"{where}.{unknown[0]}: unknown field", key, unknown[0])
    missing = sorted(required - set(entry))
    if missing:
        raise BundleError(f"{where}.{missing[0]}: missing field", key, missing[0])


def _mapping(doc: dict[str, Any], field: str) -> dict[str, Any]:
    value = doc[field]
    if not isinstance(value, dict):
        raise BundleError(f"manifest {field}: expected an object, got {type(value).__name__}", field=field)
    return value


def _entries(doc: dict[str, Any], field: str) -> list[Any]:
    value = doc.get(field, [])
    if not isinstance(value, list):
        raise BundleError(f"manifest {field}: expected a list, got {type(value).__name__}", field=field)
    return value


def _positive(entry: dict[str, Any], field: str, key: str) -> int:
    value = entry[field]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BundleError(f"{key}.{field}: expected a positive integer, got {value!r}", key, field)
    return value


def _string(entry: dict[str, Any], field: str, key: str | None) -> str:
    value = entry[field]
    if not isinstance(value, str) or not value:
        raise BundleError(f"{key}.{field}: expected a non-empty string, got {value!r}", key, field)
    return value


def _inside(root: Path, rel: Any, key: str | None, field: str) -> Path:
    """The file `rel` names inside the bundle; refuses absolute paths, `..` and symlinks out."""
    where = f"{key}.{field}" if key else field
    if not isinstance(rel, str) or not rel:
        raise BundleError(f"{where}: expected a relative path, got {rel!r}", key, field)
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("\\") or ".." in pure.parts or (len(rel) > 1 and rel[1] == ":"):
        raise BundleError(f"{where}: path {rel!r} escapes the bundle", key, field)
    if "\0" in rel:
        raise BundleError(f"{where}: path {rel!r} holds a NUL byte", key, field)
    path = root / pure
    try:
        resolved = path.resolve()
        if not resolved.is_relative_to(root):
            raise BundleError(f"{where}: path {rel!r} escapes the bundle (symlink to {resolved})", key, field)
        if not path.is_file():
            raise BundleError(f"{where}: file {rel!r} not found in bundle {root}", key, field)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (pathlib.resolve, Python < 3.13)
        raise BundleError(f"{where}: path {rel!r} cannot be resolved: {e}", key, field) from e
    return path


def _new_key(entry: dict[str, Any], seen: set[str], where: str) -> str:
    if "key" not in entry:
        raise BundleError(f"{where}.key: missing field", None, "key")
    key = _string(entry, "key", None)
    if key in seen:
        raise BundleError(f"{key}.key: duplicate key (keys are unique across gemms, mhas and ops)", key, "key")
    if "/" in key or "\\" in key or key in (".", ".."):
        raise BundleError(f"{key}.key: a key may not contain path separators", key, "key")
    seen.add(key)
    return key


def _load_xclbins(root: Path, table: dict[str, Any]) -> dict[str, XclbinEntry]:
    out = {}
    for name, entry in table.items():
        _check_fields(entry, _XCLBIN_FIELDS, set(), name, f"xclbins.{name}")
        path = _inside(root, entry["path"], name, "path")
        out[name] = XclbinEntry(name, path, _string(entry, "kernel", name))
    return out


def _load_gemm(root: Path, entry: Any, xclbins: dict[str, XclbinEntry], seen: set[str]) -> GemmSpec:
    if not isinstance(entry, dict):
        raise BundleError(f"gemms: expected objects, got {type(entry).__name__}", field="gemms")
    key = _new_key(entry, seen, "gemms[]")
    _check_fields(entry, _GEMM_FIELDS, set(), key, key)
    m, k, n, lda, b_bytes = (_positive(entry, f, key) for f in ("m", "k", "n", "lda", "b_bytes"))
    ctx = _string(entry, "ctx", key)
    if ctx not in xclbins:
        raise BundleError(f"{key}.ctx: unknown context {ctx!r} (xclbins has {sorted(xclbins)})", key, "ctx")
    spec = GemmSpec(key, ctx, m, k, n, lda, _inside(root, entry["insts"], key, "insts"), b_bytes,
                    _string(entry, "b_layout", key))
    _check_gemm_layout(spec)
    return spec


def _check_gemm_layout(g: GemmSpec) -> None:
    try:
        lay = g.layout
    except ValueError as e:
        raise BundleError(f"{g.key}.b_layout: {e}", g.key, "b_layout") from e
    if lay.kind == "tiled" and (g.k % lay.kt or g.n % lay.nt):
        raise BundleError(f"{g.key}.b_layout: {lay} does not tile K={g.k} x N={g.n}", g.key, "b_layout")
    if lay.kind == "conv3x3":
        try:
            geom = ConvGeometry.of(g.k, g.lda, g.n)
        except ValueError as e:
            raise BundleError(f"{g.key}.lda: {e}", g.key, "lda") from e
        if geom.p != lay.p:
            raise BundleError(f"{g.key}.b_layout: {lay} but K={g.k}, lda={g.lda} give P={geom.p}", g.key, "b_layout")
    elif g.lda != g.k:
        raise BundleError(f"{g.key}.lda: {g.lda} != K={g.k} (only conv3x3 GEMMs overlap rows)", g.key, "lda")
    if g.b_bytes != g.k * g.n * BF16_BYTES:
        raise BundleError(f"{g.key}.b_bytes: {g.b_bytes} does not match {lay} for K={g.k} x N={g.n} "
                          f"({g.k * g.n * BF16_BYTES} bytes of bf16)", g.key, "b_bytes")
    _check_buffer(g.key, "m", f"A ((m-1)*lda + k = {(g.m - 1) * g.lda + g.k} bf16)",
                  ((g.m - 1) * g.lda + g.k) * BF16_BYTES)
    _check_buffer(g.key, "b_bytes", "B", g.b_bytes)
    _check_buffer(g.key, "m", f"C (m*n = {g.m * g.n} bf16)", g.m * g.n * BF16_BYTES)


def _check_buffer(key: str, field: str, what: str, nbytes: int) -> None:
    """`what`, `nbytes` long, must fit one shim buffer descriptor (MAX_BUFFER_BYTES)."""
    if nbytes % 4 or nbytes > MAX_BUFFER_BYTES:
        raise BundleError(f"{key}.{field}: {what} would be {nbytes} bytes; a kernel buffer is a whole number of "
                          f"32-bit words, at most {MAX_BUFFER_BYTES} bytes", key, field)


def _load_mha(root: Path, entry: Any, seen: set[str]) -> MhaSpec:
    if not isinstance(entry, dict):
        raise BundleError(f"mhas: expected objects, got {type(entry).__name__}", field="mhas")
    key = _new_key(entry, seen, "mhas[]")
    _check_fields(entry, _MHA_FIELDS, set(), key, key)
    heads, seq, d, elems = (_positive(entry, f, key) for f in ("heads", "seq", "d", "elems"))
    if elems != heads * seq * d:
        raise BundleError(f"{key}.elems: {elems} != heads*seq*d = {heads * seq * d}", key, "elems")
    _check_buffer(key, "elems", "each of q, k, v, o", elems * BF16_BYTES)
    return MhaSpec(key, heads, seq, d, elems, _inside(root, entry["xclbin"], key, "xclbin"),
                   _inside(root, entry["insts"], key, "insts"), _string(entry, "name", key))


def _load_op(root: Path, entry: Any, seen: set[str]) -> OpSpec:
    if not isinstance(entry, dict):
        raise BundleError(f"ops: expected objects, got {type(entry).__name__}", field="ops")
    key = _new_key(entry, seen, "ops[]")
    _check_fields(entry, _OP_FIELDS, _OP_OPTIONAL, key, key)
    fn = _string(entry, "fn", key)
    if fn not in ELEMENTWISE_FNS:
        raise BundleError(f"{key}.fn: unknown function {fn!r} (expected one of {list(ELEMENTWISE_FNS)})", key, "fn")
    elems = _positive(entry, "elems", key)
    _check_buffer(key, "elems", "each buffer", elems * BF16_BYTES)
    n = _op_length(entry, key, fn, elems)
    return OpSpec(key, _inside(root, entry["xclbin"], key, "xclbin"), _inside(root, entry["insts"], key, "insts"),
                  _string(entry, "name", key), fn, elems, n)


def _op_length(entry: dict[str, Any], key: str, fn: str, elems: int) -> int | None:
    if fn != "layernorm":
        if "n" in entry:
            raise BundleError(f"{key}.n: only layernorm takes a normalised length", key, "n")
        return None
    if "n" not in entry:
        raise BundleError(f"{key}.n: missing field (layernorm needs its normalised length)", key, "n")
    n = _positive(entry, "n", key)
    if elems % n:
        raise BundleError(f"{key}.n: elems {elems} is not a multiple of n={n}", key, "n")
    return n
