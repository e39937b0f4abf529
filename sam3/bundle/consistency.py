"""The consistency rules a run relies on (docs/sam3-bundle.md 12): params that agree with each other, kernel
records of the shapes the params imply, and host tensors of the dtype and size each stage reads.

`problems(bundle)` lists every broken rule, one line each naming the param, record or tensor; `summarize` lists
them and `Sam3` refuses a bundle with any (`check`, raising the first as a BundleError). Bundle.open itself stays
as lenient as the reference reader (docs/sam3-bundle.md 13), so `sam3 bundle` can still describe such a bundle.
Every size is a Python int: nothing is allocated from a param before it is checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Protocol

from .manifest import GEMM_KEYS, MANIFEST, MHA_KEYS, OP_KEYS, BundleError, GemmSpec, MhaSpec, OpSpec, Params
from .tensors import DTYPE_NAMES, TensorStore, packed_tensors, upload_tensors

# Sizes that may be 0: token ids (docs/sam3-bundle.md 5).
_MAY_BE_ZERO = ("bos", "eos", "pad")
_SIZES = ("grid", "window", "vit_dim", "vit_heads", "vit_layers", "vit_ffn_pad", "patch", "image_size", "d_model",
          "d_heads", "d_layers", "d_ffn", "text_len", "text_dim", "text_heads", "text_layers", "text_ffn", "queries",
          "dec_layers", "mask_size")


class BundleView(Protocol):
    """What the rules read of an open bundle (a `Bundle`)."""

    params: Params
    gemms: dict[str, GemmSpec]
    mhas: dict[str, MhaSpec]
    ops: dict[str, OpSpec]
    tensors: TensorStore


def problems(bundle: BundleView, *, runtime: bool = False) -> list[str]:
    """Every broken consistency rule of `bundle`, one line each (docs/sam3-bundle.md 12).

    With `runtime`, also what the summary reports in its own words: missing runtime kernels, b_bytes against
    the packing formula, packed tensor lengths, missing host tensors. Kernel and tensor rules are skipped while
    a param rule is broken (they divide by the params).
    """
    out = list(_param_problems(bundle.params))
    if out:
        return out
    out += _kernel_problems(bundle, runtime)
    out += _tensor_problems(bundle, runtime)
    return out


def check(bundle: BundleView) -> None:
    """Refuse a bundle that breaks a rule a run relies on.

    Raises:
        BundleError: the first problem of `problems(bundle, runtime=True)`, naming the param, record or tensor.
    """
    first = next(iter(problems(bundle, runtime=True)), None)
    if first is not None:
        raise BundleError(f"inconsistent bundle: {first}")


# -------------------------------------------------------------------------------------------------------
# Params


def _param_problems(p: Params) -> Iterator[str]:
    def at(name: str, msg: str) -> str:
        return f"{p.where(name)}: param {name}: {msg}"

    bad = [n for n in _SIZES if getattr(p, n) == 0]
    if bad:
        yield from (at(n, "is 0, expected a positive integer") for n in bad)
        return
    for name in ("vit_eps", "text_eps"):
        eps = getattr(p, name)
        if not (math.isfinite(eps) and 0 < eps < 1):
            yield at(name, f"{eps!r} is not a small positive number")
    rules = [
        ("image_size", p.image_size == p.grid * p.patch, f"{p.image_size} != grid {p.grid} * patch {p.patch}"),
        ("window", p.grid % p.window == 0, f"grid {p.grid} is not a multiple of window {p.window}"),
        ("grid", p.grid * p.grid % 8 == 0, f"T = grid^2 = {p.grid * p.grid} is not a multiple of 8"),
        ("mask_size", p.mask_size == 4 * p.grid, f"{p.mask_size} != 4 * grid {p.grid}"),
        ("vit_heads", p.vit_dim % p.vit_heads == 0 and (p.vit_dim // p.vit_heads) % 2 == 0,
         f"vit_dim {p.vit_dim} / {p.vit_heads} heads is not an even head dim"),
        ("d_heads", p.d_model % p.d_heads == 0 and (p.d_model // p.d_heads) % 8 == 0,
         f"d_model {p.d_model} / {p.d_heads} heads is not a head dim that is a multiple of 8"),
        ("text_heads", p.text_dim % p.text_heads == 0, f"text_dim {p.text_dim} is not a multiple of {p.text_heads}"),
        ("text_len", p.text_len >= 2, f"{p.text_len} cannot hold bos and eos"),
        ("vit_global", bool(p.vit_global) and len(set(p.vit_global)) == len(p.vit_global)
         and all(i < p.vit_layers for i in p.vit_global),
         f"{p.raw.get('vit_global')} is not a list of distinct layers below vit_layers {p.vit_layers}"),
    ]
    yield from (at(name, msg) for name, ok, msg in rules if not ok)
    splits = p.neck_splits
    if len(splits) != 3:
        yield at("neck_splits", f"{p.raw.get('neck_splits')} has {len(splits)} widths, expected 3")
    elif splits[1] != 4 * p.d_model or splits[2] != p.d_model or splits[0] % 4 or not splits[0]:
        yield at("neck_splits", f"{p.raw.get('neck_splits')}: expected s0 a positive multiple of 4, s1 = 4 * d_model "
                 f"= {4 * p.d_model}, s2 = d_model = {p.d_model}")


# -------------------------------------------------------------------------------------------------------
# Kernel records


def _gemm_rules(b: BundleView) -> list[tuple[str, str, int, str, str]]:
    """(gemm, field, wanted, "eq" | "ge", what the wanted value is) of docs/sam3-bundle.md 12."""
    p, g = b.params, b.gemms
    d, dim = p.d_model, p.vit_dim
    s0 = p.neck_splits[0]
    pd = b.mhas["mha_d"].d * p.d_heads if "mha_d" in b.mhas else None
    rules = [("v_embed", "K", 3 * p.patch ** 2, "ge", "3 * patch^2"), ("v_embed", "N", dim, "eq", "vit_dim"),
             ("v_qkv", "K", dim, "eq", "vit_dim"), ("v_qkv", "N", 3 * dim, "eq", "3 * vit_dim"),
             ("v_o", "K", dim, "eq", "vit_dim"), ("v_o", "N", dim, "eq", "vit_dim"),
             ("v_fc1", "K", dim, "eq", "vit_dim"), ("v_fc2", "N", dim, "eq", "vit_dim"),
             ("n_in", "K", dim, "eq", "vit_dim"), ("n_in", "N", sum(p.neck_splits), "eq", "s0 + s1 + s2"),
             ("n_up", "K", s0 // 4, "eq", "s0 / 4"), ("n_up", "N", 4 * d, "ge", "4 * d_model"),
             ("d_s", "K", d, "eq", "d_model"), ("d_s", "N", p.d_heads * p.text_len, "eq", "d_heads * text_len"),
             ("d_c", "K", p.d_heads * p.text_len, "eq", "d_heads * text_len"), ("d_c", "N", d, "eq", "d_model"),
             ("d_o", "N", d, "eq", "d_model"), ("d_fc1", "K", d, "eq", "d_model"), ("d_fc2", "N", d, "eq", "d_model"),
             ("dec_kv", "K", 2 * d, "eq", "2 * d_model"),
             ("dec_kv", "N", p.dec_layers * 2 * d, "ge", "dec_layers * 2 * d_model"),
             ("m_head", "K", d, "eq", "d_model"), ("m_head", "N", p.queries + 1, "ge", "queries + 1")]
    if "v_fc1" in g:
        rules.append(("v_fc2", "K", g["v_fc1"].n, "eq", "v_fc1 N"))
    if "d_fc1" in g:
        rules.append(("d_fc2", "K", g["d_fc1"].n, "eq", "d_fc1 N"))
    if pd is not None:
        rules += [("d_qkv", "K", 2 * d, "eq", "2 * d_model"), ("d_qkv", "N", 3 * pd, "eq", "3 * mha_d.d * d_heads"),
                  ("d_o", "K", pd, "eq", "mha_d.d * d_heads")]
    return rules


def _kernel_problems(b: BundleView, runtime: bool) -> Iterator[str]:
    p = b.params
    if runtime:
        yield from (f"{MANIFEST}: kernel {k} missing from the manifest" for k in GEMM_KEYS if k not in b.gemms)
        yield from (f"{MANIFEST}: kernel {k} missing from the manifest" for k in MHA_KEYS if k not in b.mhas)
        if p.vit_device:
            yield from (f"{MANIFEST}: kernel {k} missing from the manifest (vit_device=1)"
                        for k in OP_KEYS if k not in b.ops)
    for g in b.gemms.values():
        zero = [f for f in ("m", "k", "n", "lda", "tile_k", "tile_n", "ct_k", "b_bytes") if getattr(g, f) == 0]
        if zero:
            yield f"{MANIFEST}:{g.line}: gemm {g.key}: {zero[0]}=0, expected a positive integer"
        elif runtime and g.b_bytes != g.packed_bytes:
            yield f"{MANIFEST}:{g.line}: gemm {g.key}: b_bytes={g.b_bytes}, but 9*N*(K+ct_k*bias)/8 = {g.packed_bytes}"
    for key, fld, want, how, what in _gemm_rules(b):
        spec = b.gemms.get(key)
        if spec is None:
            continue
        have = getattr(spec, fld.lower())
        if (have != want) if how == "eq" else (have < want):
            need = f"{what} = {want}" if how == "eq" else f"at least {what} = {want}"
            yield f"{MANIFEST}:{spec.line}: gemm {key}: {fld}={have}, the params need {need}"
    if "conv" in b.gemms:
        yield from _conv_problems(b.gemms["conv"], p.d_model)
    yield from _mha_problems(b)


def _conv_problems(c: GemmSpec, d: int) -> Iterator[str]:
    dd = (c.k - c.lda) // 2 if c.k > c.lda else 0
    if not dd or (c.k - c.lda) % 2 or dd % 3 or c.lda % dd or dd // 3 != d or c.n != (c.lda // dd) * d:
        yield (f"{MANIFEST}:{c.line}: gemm conv: K={c.k} lda={c.lda} N={c.n} is not a 3x3 convolution of d_model {d} "
               "channels (D = (K - lda) / 2 = 3 * d_model, lda a multiple of D, N = lda / D * d_model)")


def _mha_problems(b: BundleView) -> Iterator[str]:
    p = b.params
    tokens, hd = p.grid * p.grid, p.vit_dim // p.vit_heads
    windows = (p.grid // p.window) ** 2
    want = {"mha_win": (windows * p.vit_heads, p.window ** 2, hd, False, tokens * p.vit_dim),
            "mha_glob": (p.vit_heads, tokens, hd, True, tokens * p.vit_dim)}
    for key, h in b.mhas.items():
        where = f"{MANIFEST}:{h.line}: mha {key}"
        if key in want:
            heads, seq, d, major, least = want[key]
            if (h.heads, h.seq, h.d, h.token_major) != (heads, seq, d, major):
                yield (f"{where}: heads={h.heads} seq={h.seq} d={h.d} token_major={int(h.token_major)}, the params "
                       f"need heads={heads} seq={seq} d={d} token_major={int(major)}")
                continue
        elif key == "mha_d":
            if (h.heads, h.seq, h.token_major) != (p.d_heads, tokens, True) or h.d < p.d_model // p.d_heads:
                yield (f"{where}: heads={h.heads} seq={h.seq} d={h.d} token_major={int(h.token_major)}, the params "
                       f"need heads={p.d_heads} seq={tokens} d>={p.d_model // p.d_heads} token_major=1")
                continue
            least = tokens * h.d * p.d_heads
        else:
            continue
        least = max(least, h.heads * h.seq * h.d)
        if h.elems < least:
            yield f"{where}: elems={h.elems}, the params need at least {least}"


# -------------------------------------------------------------------------------------------------------
# Host tensors


def text_tensors(p: Params) -> Iterator[tuple[str, str, int, str]]:
    """(name, dtype, element count, "eq" | "rows") of every text-encoder tensor (docs/sam3-host.md 5.1); "rows":
    a whole, non-zero number of text_dim rows (the vocabulary, and a position table that may be longer)."""
    dim, ffn = p.text_dim, p.text_ffn
    yield from (("t.tok_emb", "bf16", dim, "rows"), ("t.pos_emb", "f32", dim, "rows"))
    for i in range(p.text_layers):
        for ln in ("ln1", "ln2"):
            yield from ((f"t.{i}.{ln}.w", "f32", dim, "eq"), (f"t.{i}.{ln}.b", "f32", dim, "eq"))
        for name, out, inp in (("qkv", 3 * dim, dim), ("o", dim, dim), ("fc1", ffn, dim), ("fc2", dim, ffn)):
            yield from ((f"t.{i}.{name}.w", "bf16", out * inp, "eq"), (f"t.{i}.{name}.b", "f32", out, "eq"))
    yield from (("t.final_ln.w", "f32", dim, "eq"), ("t.final_ln.b", "f32", dim, "eq"))
    yield from (("t.proj.w", "f32", p.d_model * dim, "eq"), ("t.proj.b", "f32", p.d_model, "eq"))


def _host_tensors(p: Params) -> Iterator[tuple[str, str, int, str]]:
    """The host tensors whose sizes the params fix (docs/sam3-bundle.md 5), then the text encoder's."""
    tokens, d = p.grid * p.grid, p.d_model
    yield from (("v.perm", "i32", tokens, "eq"), ("v.pos", "f32", tokens * p.vit_dim, "eq"),
                ("v.ln_pre.w", "f32", p.vit_dim, "eq"), ("v.ln_pre.b", "f32", p.vit_dim, "eq"),
                ("d.pos", "f32", tokens * d, "eq"), ("dec.reference_points", "f32", p.queries * 4, "eq"),
                ("dec.presence_token", "f32", d, "eq"), ("dec.query_embed", "f32", p.queries * d, "eq"))
    yield from text_tensors(p)


def _tensor_problems(b: BundleView, runtime: bool) -> Iterator[str]:
    t, p = b.tensors, b.params
    # The list stops at the first missing tensor (a huge layer count costs nothing); the summary reports none.
    for name, dtype, count, how in _host_tensors(p):
        if name not in t:
            if runtime:
                yield f"tensor {name} missing from the bundle"
            break
        info = t.info(name)
        if info.dtype != dtype:
            yield f"tensors.txt:{info.line}: tensor {name} is {DTYPE_NAMES[info.dtype]}, wanted {DTYPE_NAMES[dtype]}"
        elif (info.count != count) if how == "eq" else (info.count == 0 or info.count % count):
            need = f"{count}" if how == "eq" else f"a non-zero multiple of {count} (text_dim)"
            yield f"tensors.txt:{info.line}: tensor {name} holds {info.count} elements, the params need {need}"
    if runtime:
        missing = next((n for n in upload_tensors(p) if n not in t), None)
        if missing is not None:
            yield f"tensor {missing} missing from the bundle"
        for name, key in packed_tensors(p).items():
            if name in t and key in b.gemms and t.info(name).nbytes != b.gemms[key].b_bytes:
                yield f"tensor {name} is {t.info(name).nbytes} bytes, gemm {key} b_bytes={b.gemms[key].b_bytes}"
