"""`summarize` and `format_summary`: an open bundle described, with the problems a run would trip on and the
warnings about what the reader accepted as the reference does (docs/sam3-bundle.md 11)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import consistency
from .manifest import (
    BLOB,
    FLAG_PARAMS,
    GEMM_KEYS,
    MHA_KEYS,
    OP_KEYS,
    WRITE_ALIGN,
    GemmSpec,
    MhaSpec,
    OpSpec,
    kernel_warnings,
)
from .reader import Bundle
from .tensors import packed_tensors


def summarize(bundle: Bundle) -> dict[str, Any]:
    """A JSON-ready description of `bundle`: version, params, xclbins, kernels, tensors, problems and warnings.

    Problems are what the load-time checks let through but a run would trip on; warnings are what the reader
    accepted because the reference does, though a bundle should not hold it (docs/sam3-bundle.md 11).
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
            "warnings": self._warnings(),
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
                        "kernels": sorted(set(users))})
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
        self.problems += consistency.problems(b)
        for c in [*b.cases, *b.pcases]:
            self._file(c.image, f"case {c.index} image (line {c.line})")
        if b.ref_image is not None:
            self._file(b.ref_image, "ref_image")
        return self.problems

    def _warnings(self) -> list[str]:
        shapes = [t.shape_warning() for t in self.b.tensors]
        return kernel_warnings(self.b.records) + [w for w in shapes if w is not None]

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
    # Warnings come after the problems, which alone make `sam3 bundle` exit 1 (docs/sam3-bundle.md 11).
    rows += [["warning", w] for w in summary.get("warnings", [])]
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
