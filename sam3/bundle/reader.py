"""`Bundle.open`: a bundle directory (or a hub snapshot) held open, every file opened relative to it
(docs/sam3-bundle.md 7-9, 13)."""

from __future__ import annotations

import errno
import json
import mmap
import os
from pathlib import Path, PurePosixPath
from typing import cast

from amdxdna_direct import files

from . import hub
from .manifest import (
    _U32_MAX,
    BLOB,
    DEFAULT_KERNEL_NAME,
    FILE_LIMIT,
    INDEX,
    MANIFEST,
    MERGES,
    TEXT_LIMIT,
    VERSIONS,
    VOCAB,
    BundleError,
    Case,
    GemmSpec,
    KernelSource,
    MhaSpec,
    OpSpec,
    Params,
    Record,
    TokTest,
    XclbinRecord,
    _lines,
    _rel_parts,
    _utf8,
    kernel_kind,
    unescape,
)
from .tensors import TensorStore, parse_index, upload_tensors

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_LINK = "a component of the path is not a directory (or is a symbolic link)"


class _Dir:
    """The bundle directory, held open: every file is opened relative to its descriptor, and must stay the file
    first found there (docs/sam3-bundle.md 8)."""

    def __init__(self, directory: str | os.PathLike[str]):
        try:
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise BundleError(f"{files.shown(directory)}: cannot open the bundle directory "
                              f"({os.strerror(e.errno or 0)})") from e
        self.root = Path(os.path.realpath(directory))
        # (st_dev, st_ino) of each file when first opened: a later open finding another file refuses it.
        self._seen: dict[tuple[str, ...], tuple[int, int]] = {}
        # What each file was when first opened, for the check before each forward (docs/sam3-bundle.md 8.1).
        self._stamps: dict[tuple[str, ...], tuple[int, ...]] = {}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def inside(self, text: str) -> tuple[str, ...] | str:
        """The in-bundle components of a bundle-relative path: its directories resolved (they must stay inside the
        bundle), its last component as written (a link there is followed when the file is opened); or the reason
        the path is refused."""
        if not text:
            return "is empty"
        if "\0" in text:
            return "contains a NUL character"
        if PurePosixPath(text).is_absolute():
            return "is absolute"
        parts = _rel_parts(text)
        if parts is None:
            return "escapes the bundle directory"
        if not parts:
            return ()
        real = os.path.realpath(os.path.join(self.root, *parts[:-1]))
        rel = os.path.relpath(real, self.root)
        if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
            return f"passes through a symbolic link to a directory outside the bundle ({real})"
        return (*(() if rel == "." else rel.split("/")), parts[-1])

    def resolve(self, text: str) -> tuple[str, ...]:
        """The real in-bundle components of `text`.

        Raises:
            BundleError: "<text>: the path is absolute" (escapes, passes through a directory link out of the bundle,
                is empty).
        """
        where = self.inside(text)
        if isinstance(where, str):
            raise BundleError(f"{text}: the path {where}")
        return where

    def open_file(self, parts: tuple[str, ...], what: str, limit: int | None = None) -> int:
        """A descriptor of the regular file at `parts`: its directories opened one by one without following a
        link, the file itself (a link followed wherever it points) by `amdxdna_direct.files` (docs/files.md 2);
        it must be the file first found at `parts` (docs/sam3-bundle.md 8).

        Raises:
            BundleError: "<what>: no such file", "... is not a regular file", "... was replaced after ...", ...
        """
        if self.fd < 0:
            raise BundleError(f"{files.shown(what)}: the bundle is closed")
        if not parts:
            raise BundleError(f"{files.shown(what)}: is the bundle directory, not a file")
        where = self._walk(parts[:-1], what)
        try:
            fd = files.open_fd(parts[-1], "tensors", limit=limit, dir_fd=where)
        except files.FileRefused as e:
            reason = _linked(where, parts[-1], _refusal(e), e.code == "type")
            raise BundleError(f"{files.shown(what)}: {reason}") from e
        except OSError as e:
            reason = _linked(where, parts[-1], _open_reason(e), e.errno == errno.ENOENT)
            raise BundleError(f"{files.shown(what)}: {reason}") from e
        finally:
            if where != self.fd:
                os.close(where)
        return self._same(fd, parts, what)

    def _walk(self, dirs: tuple[str, ...], what: str) -> int:
        """A descriptor of the directory `dirs` (the bundle's own for none), each component opened `O_NOFOLLOW`, so
        a directory swapped for a link after it was resolved is refused. The caller closes it unless it is `fd`."""
        fd = self.fd
        try:
            for part in dirs:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                if fd != self.fd:
                    os.close(fd)
                fd = nxt
        except OSError as e:
            if fd != self.fd:
                os.close(fd)
            reason = _DIR_LINK if e.errno in (errno.ELOOP, errno.ENOTDIR) else _open_reason(e)
            raise BundleError(f"{files.shown(what)}: {reason}") from e
        return fd

    def _same(self, fd: int, parts: tuple[str, ...], what: str) -> int:
        """`fd` when its file is the one first opened at `parts` (recording it the first time); else refused."""
        st = os.fstat(fd)
        self._stamps.setdefault(parts, _stamp(st))
        if self._seen.setdefault(parts, (st.st_dev, st.st_ino)) != (st.st_dev, st.st_ino):
            os.close(fd)
            raise BundleError(f"{files.shown(what)}: was replaced after the bundle was opened (another file is there "
                              "now)")
        return fd

    def changed(self) -> tuple[str, ...] | None:
        """The first file opened so far that is no longer what it was when first opened (another file there, the
        same one resized, written or its status changed, or none at all), or None (docs/sam3-bundle.md 8.1).

        Raises:
            BundleError: the bundle is closed.
        """
        if self.fd < 0:
            raise BundleError("the bundle is closed")
        # A list first: another thread's first read of a file may add to the table meanwhile.
        for parts, stamp in list(self._stamps.items()):
            try:
                st = os.stat("/".join(parts), dir_fd=self.fd)
            except OSError:
                return parts
            if _stamp(st) != stamp:
                return parts
        return None

    def pin(self, parts: tuple[str, ...]) -> None:
        """Record the file at `parts` now, if it can be opened, so a file swapped for it later is refused; a file
        that cannot be opened is reported when it is read."""
        if parts and parts not in self._seen:
            try:
                os.close(self.open_file(parts, "/".join(parts)))
            except BundleError:
                pass

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


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    """What a change of a file shows in its status: identity, size, modification and status-change times. The
    status-change time cannot be set back (utime itself moves it), so a rewrite that keeps size and mtime shows."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _linked(where: int, name: str, reason: str, about_target: bool) -> str:
    """`reason`, saying so when `name` is a symbolic link and the reason is about its target (missing or not a
    regular file): "is a symbolic link to T, which is not a regular file (a FIFO)"."""
    try:
        target = os.readlink(name, dir_fd=where) if about_target else None
    except OSError:
        target = None
    if target is None:
        return reason
    which = "does not exist" if reason == "no such file" else reason
    return f"is a symbolic link to {files.shown(target)}, which {which}"


def _refusal(e: files.FileRefused) -> str:
    """The bundle's wording of a refusal by amdxdna_direct.files (docs/sam3-bundle.md 8)."""
    limit = files.limit_text(e.limit) if e.limit is not None else ""
    reasons = {
        "size": f"{e.size} bytes, over the {limit} limit",
        "grew": f"grew past the {limit} limit while being read",
    }
    return reasons.get(e.code, e.reason)


def _open_reason(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symbolic link in a loop of links"
    if e.errno == errno.ENOTDIR:
        return _DIR_LINK
    if e.errno == errno.ENOENT:
        return "no such file"
    return f"cannot open ({errno.errorcode.get(e.errno or 0, '?')}: {os.strerror(e.errno or 0)})"


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
        """Open and check the bundle in `directory` (docs/sam3-bundle.md 7): a directory, or `owner/name[@revision]`
        naming a snapshot in the local Hugging Face hub cache when no such directory exists (docs/sam3-bundle.md 14).

        Raises:
            BundleError: any grammar, version, param, kernel, path, tensor, vocab.json or merges.txt error;
                the message names the file, line and record. `hub.HubError` (a BundleError): a hub name that is
                not in the cache.
        """
        where = hub.locate(directory)
        self = cls.__new__(cls)
        self._dir = _Dir(where)
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
        """A manifest path, refused when absolute, escaping the bundle or through a directory link out of it; its
        file is recorded now, so one swapped later is refused (docs/sam3-bundle.md 8)."""
        where = self._dir.inside(text)
        if isinstance(where, str):
            raise r.error(f"{what} path {text!r} {where}")
        self._dir.pin(where)
        parts = _rel_parts(text) or ()
        return self.root.joinpath(*parts)

    def _model(self, records: list[Record]) -> None:
        """The SAM3 records of docs/sam3-bundle.md 4; unknown tags are ignored."""
        self.gemms, self.mhas, self.ops = {}, {}, {}
        self.tok_tests, self.cases, self.pcases = [], [], []
        self.ref_image, self.ref_prompt = None, None
        # A kernel key defined again replaces the earlier record; kinds keep separate tables (docs/sam3-bundle.md 4.1).
        for r in records:
            if r.tag == "gemm":
                g = self._gemm(r)
                self.gemms[g.key] = g
            elif r.tag == "mha":
                h = self._mha(r)
                self.mhas[h.key] = h
            elif r.tag == "op":
                o = self._op(r)
                self.ops[o.key] = o
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
        """Every gemm, mha and op key, once each, sorted by name (the load order, docs/sam3-bundle.md 9)."""
        return sorted({*self.gemms, *self.mhas, *self.ops})

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

        A key two kinds define is the kind the runtime launches it as (`manifest.kernel_kind`).

        Raises:
            BundleError: "no kernel K".
        """
        kind = kernel_kind(key, self.gemms, self.mhas, self.ops)
        if kind == "gemm":
            g = self.gemms[key]
            x = self.xclbins[g.ctx]
            return KernelSource(key, g.ctx, x.path, g.insts, x.kernel, 2 * g.m * g.k * g.n)
        if kind == "mha":
            h = self.mhas[key]
            return KernelSource(key, key, h.xclbin, h.insts, h.name, 4 * h.heads * h.seq * h.seq * h.d)
        if kind == "op":
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
        """The bytes of a bundle file (an xclbin, a stream, an image): a link in its last component is followed to
        a regular file, the file must be the one found when the bundle was opened (docs/sam3-bundle.md 8).

        `path` is one of this bundle's resolved paths or a bundle-relative one.

        Raises:
            BundleError: the path is refused, the file is missing, not regular, replaced, or over `limit`.
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

    def check_unchanged(self) -> None:
        """Refuses the bundle when a file it opened changed on disk since: replaced (renamed over, a link
        repointed), resized (truncated, grown), written in place, or removed (docs/sam3-bundle.md 8.1). A forward
        calls it first, so it never mixes weights uploaded from one file with host weights read from another.

        Raises:
            BundleError: "<file> changed on disk since the bundle was opened: reopen it"; the bundle is closed.
        """
        parts = self._dir.changed()
        if parts is not None:
            raise BundleError(f"{files.shown(str(self.root.joinpath(*parts)))} changed on disk since the bundle was "
                              "opened: reopen it")

    def close(self) -> None:
        """Release the directory descriptor and the mapping (idempotent)."""
        self.tensors.close()
        self._dir.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
