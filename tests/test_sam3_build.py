"""sam3.build: every variant of the tiny geometry writes a bundle that opens, keeps the format's consistency rules
(checked here from the written manifest and tensors, not through Geometry.check), and holds the seeded weights."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from amdxdna_direct import insts
from amdxdna_direct.xclbin import Xclbin
from sam3 import kernels, pack
from sam3.build import KEY_FILE, TOK_TESTS, Geometry, GeometryError, build, build_cached, main
from sam3.bundle import Bundle, BundleError

REPO = Path(__file__).resolve().parents[1]
SEED = 5
VARIANTS = ("host", "device", "device-f32")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    return {v: build(root / v, "tiny", variant=v, seed=SEED) for v in VARIANTS}


@pytest.fixture(params=VARIANTS)
def opened(request, bundles):
    with Bundle.open(bundles[request.param]) as b:
        yield request.param, b


def _draw(name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """The builder's documented seeding: one numpy stream per tensor name, default_rng([seed, crc32(name)])."""
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _linear(name: str, out: int, inp: int) -> tuple[np.ndarray, np.ndarray]:
    """(B = W.T [in, out], bias [out]) of a linear layer: W ~ N(0, 1/in), bias ~ N(0, 0.1^2)."""
    return _draw(name + ".w", (out, inp), inp ** -0.5).T, _draw(name + ".b", (out,), 0.1)


def _unpack(b: Bundle, tensor: str, key: str) -> tuple[np.ndarray, np.ndarray | None]:
    s = b.gemms[key]
    return pack.unpack_b(b.tensors.raw(tensor), s.k, s.n, s.tile_k, s.tile_n, s.ct_k, s.bias)


def _assert_bfp16(got: np.ndarray, want: np.ndarray) -> None:
    """got is want rounded through bfp16ebs8: to the nearest multiple of its 8-value block's step 2^(E-133) (E the
    block's largest biased exponent), within half a step, except a value that rounds up to 128 steps and saturates
    at 127."""
    k, n = want.shape
    top = np.abs(want).reshape(k // 8, 8, n).max(axis=1)
    step = np.ldexp(np.float32(1), np.frexp(top)[1] - 7)[:, None, :]  # top = f 2^e, f in [0.5, 1): 2^(E-127) = 2^(e-1)
    g, w = got.reshape(k // 8, 8, n), want.reshape(k // 8, 8, n)
    err = np.abs(g - w)
    saturated = (g == 127 * step) & (w > 127 * step)
    assert ((err <= step / 2) | saturated).all(), float((err / step).max())
    assert err.max() > 0  # the values were rounded, so these are not the f32 weights themselves


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# The written bundle


def test_variants_open_with_their_params(opened):
    variant, b = opened
    p = b.params
    assert b.version == 2
    assert (p.vit_device, p.vit_res_f32) == {"host": (False, False), "device": (True, False),
                                             "device-f32": (True, True)}[variant]
    assert sorted(b.gemms) == sorted("v_embed v_qkv v_o v_fc1 v_fc2 n_in n_up conv d_qkv d_o d_s d_c d_fc1 d_fc2 "
                                     "dec_kv m_head".split())
    assert sorted(b.mhas) == ["mha_d", "mha_glob", "mha_win"]
    assert sorted(b.ops) == ([] if variant == "host" else ["addln", "rope"])
    assert (p.grid, p.window, p.vit_dim, p.d_model, p.text_len, p.neck_splits) == (8, 4, 64, 32, 8, [64, 128, 32])
    # A handful of contexts shared by the GEMMs; each MHA and op its own xclbin.
    assert 1 < len(b.xclbins) < len(b.gemms)
    assert {g.ctx for g in b.gemms.values()} == set(b.xclbins)
    assert len({m.xclbin for m in [*b.mhas.values(), *b.ops.values()]}) == len(b.mhas) + len(b.ops)
    assert ("v.rope_tab.win" in b.tensors) == (variant != "host")


def test_manifest_extras(bundles):
    text = (bundles["host"] / "manifest.txt").read_text()
    assert text.startswith("version 2\n# ")
    assert "\nbuilder sam3.build version=1 geometry=tiny variant=host seed=5 target=npu4\n" in text  # unknown tag
    assert "\ntok_test 1   Cats\\tand DOGS  \n" in text  # escaped, spacing kept
    assert "\ntok_test 3 \\u20ac\\\\zz\n" in text
    with Bundle.open(bundles["host"]) as b:
        assert [t.prompt for t in b.tok_tests] == list(TOK_TESTS)
        assert b.ref_prompt == "cat" and b.ref_image.name == "ref.png"


def _spec8_broken(b: Bundle) -> list[str]:
    """Every consistency rule of docs/sam3-build.md 3 that the manifest breaks."""
    p, g, h = b.params, b.gemms, b.mhas
    T, d = p.grid ** 2, p.d_model  # noqa: N806
    s0, s1, s2 = p.neck_splits
    c = g["conv"]
    dd = (c.k - c.lda) // 2
    pd = h["mha_d"].d * p.d_heads
    rules = {
        "image_size = grid patch": p.image_size == p.grid * p.patch, "grid % window": p.grid % p.window == 0,
        "T % 8": T % 8 == 0, "mask_size = 4 grid": p.mask_size == 4 * p.grid,
        "v_embed K >= 3 patch^2": g["v_embed"].k >= 3 * p.patch ** 2, "v_qkv N": g["v_qkv"].n == 3 * p.vit_dim,
        "v_o K = N = vit_dim": g["v_o"].k == g["v_o"].n == p.vit_dim, "v_fc2 K": g["v_fc2"].k == g["v_fc1"].n,
        "vit heads": p.vit_dim % p.vit_heads == 0 and (p.vit_dim // p.vit_heads) % 2 == 0,
        "n_in": g["n_in"].k == p.vit_dim and g["n_in"].n == s0 + s1 + s2 and s1 == 4 * d and s2 == d,
        "n_up": g["n_up"].k == s0 // 4 and s0 % 4 == 0 and g["n_up"].n >= 4 * d,
        "conv": (c.k - c.lda) % 2 == 0 and dd % 3 == 0 and c.lda % dd == 0 and dd // 3 == d
        and c.n == c.lda // dd * d and b.tensors.info("n.conv0.b").count == d,
        "d_qkv": g["d_qkv"].k == 2 * d and g["d_qkv"].n == 3 * pd, "d_o": g["d_o"].k == pd and g["d_o"].n == d,
        "d_s": g["d_s"].k == d and g["d_s"].n == p.d_heads * p.text_len,
        "d_c": g["d_c"].k == p.d_heads * p.text_len and g["d_c"].n == d, "d_fc2": g["d_fc2"].k == g["d_fc1"].n,
        "dec_kv": g["dec_kv"].k == 2 * d and g["dec_kv"].n >= p.dec_layers * 2 * d,
        "m_head": g["m_head"].k == d and g["m_head"].n >= p.queries + 1,
        "d heads": d % p.d_heads == 0 and (d // p.d_heads) % 8 == 0 and d % 8 == 0,
        "text heads": p.text_dim % p.text_heads == 0,
        "mha elems": min(h["mha_win"].elems, h["mha_glob"].elems) >= T * p.vit_dim and h["mha_d"].elems >= T * pd,
    }
    for key, s in g.items():
        rules[f"{key} tiles"] = (s.k % s.tile_k == 0 and s.n % s.tile_n == 0 and s.tile_k % s.ct_k == 0
                                 and s.ct_k % 8 == 0 and s.tile_n % 8 == 0)
        rules[f"{key} lda"] = s.lda == s.k or key == "conv"
    return [rule for rule, ok in rules.items() if not ok]


def test_consistency_rules_hold_on_the_written_manifest(opened):
    _, b = opened
    assert _spec8_broken(b) == []


def _packed_tensors(p) -> dict[str, str]:
    names = {"v.embed": "v_embed", "n.in": "n_in", "n.up": "n_up", "dec.kv": "dec_kv", "pack_test.packed": "d_s"}
    names |= {f"v.{i}.{w}": f"v_{w}" for i in range(p.vit_layers) for w in ("qkv", "o", "fc1", "fc2")}
    names |= {f"d.{i}.{w}": f"d_{w}" for i in range(p.d_layers) for w in ("qkv", "o", "fc1", "fc2")}
    return names | {n: "conv" for n in ("n.conv0", "n.conv1", "n.conv2", "m.conv0", "m.conv1")}


def test_each_packed_tensor_is_its_gemms_b_bytes(opened):
    _, b = opened
    for name, key in _packed_tensors(b.params).items():
        s, info = b.gemms[key], b.tensors.info(name)
        assert info.dtype == "u8"
        assert info.nbytes == s.b_bytes == 9 * s.n * (s.k + s.ct_k * s.bias) // 8, name


def test_gemm_streams_carry_the_epilogue_and_the_extents(opened):
    _, b = opened
    for key, s in b.gemms.items():
        stream = b.insts_bytes(key)
        want = {"v_fc1": 5, "d_fc1": kernels.EPILOGUE_RELU}.get(key, 0)  # 5 = tanh GELU
        assert kernels.epilogue_mode(stream) == want, key
        assert kernels.stream_extents(stream) == {0: ((s.m - 1) * s.lda + s.k) * 2, 1: s.b_bytes, 2: s.m * s.n * 2}
        assert insts.decode(stream).dev_gen == 4
    streams = [b.insts_bytes(k) for k in b.kernel_keys()]
    assert len(set(streams)) == len(streams)  # no two kernels share a stream
    assert len({b.kernel(k).insts for k in b.kernel_keys()}) == len(streams)


def test_device_kernel_extents(bundles):
    with Bundle.open(bundles["device-f32"]) as b:
        T, D, rows = 64, 64, 64  # noqa: N806 (T rounded up to the layer GEMMs' M = 16 is T)
        assert kernels.stream_extents(b.insts_bytes("addln")) == {0: T * D * 4, 1: rows * D * 2, 2: T * D * 4,
                                                                  3: rows * D * 2}
        assert kernels.stream_extents(b.insts_bytes("rope")) == {0: rows * 3 * D * 2, 1: b.tensors.info(
            "v.rope_tab.win").nbytes, 2: T * 2 * D * 2}
        assert kernels.stream_extents(b.insts_bytes("mha_win")) == {0: T * 2 * D * 2, 1: T * 2 * D * 2,
                                                                    2: rows * 3 * D * 2, 3: rows * D * 2}
        assert kernels.stream_extents(b.insts_bytes("mha_d")) == dict.fromkeys(range(4), b.mhas["mha_d"].elems * 2)
    with Bundle.open(bundles["device"]) as b:
        assert kernels.stream_extents(b.insts_bytes("addln"))[0] == T * D * 2  # bf16 residual stream


def test_placeholder_xclbins(opened):
    _, b = opened
    paths = [x.path for x in b.xclbins.values()] + [m.xclbin for m in [*b.mhas.values(), *b.ops.values()]]
    pdis = set()
    for path in paths:
        x = Xclbin.load(path)
        assert x.kernel("MLIR_AIE").name == "MLIR_AIE"
        assert (x.partition.column_width, x.partition.start_columns) == (8, (0,))  # the whole NPU4 array
        pdis.add(x.pdi_for("MLIR_AIE").image)
    assert len(pdis) == len(paths)


# ---------------------------------------------------------------------------------------------------------------
# Weights


def test_unpacked_weights_are_the_rounded_seeded_ones(bundles):
    with Bundle.open(bundles["host"]) as b:
        D = b.params.vit_dim  # noqa: N806
        for name in ("v.1.o", "v.0.qkv"):
            key = "v_" + name.split(".")[2]
            out = b.gemms[key].n
            w, bias = _linear(name, out, D)
            got_w, got_b = _unpack(b, name, key)
            _assert_bfp16(got_w, w)
            assert np.array_equal(got_b, _bf16(bias))
        got_w, got_b = _unpack(b, "v.0.fc2", "v_fc2")  # the host ViT adds the fc2 bias itself
        _assert_bfp16(got_w, _linear("v.0.fc2", D, b.params.vit_ffn_pad)[0])
        assert got_b is None
        assert np.array_equal(b.tensors.get("v.0.fc2.b", "f32"), _linear("v.0.fc2", D, 96)[1])
        assert np.array_equal(b.tensors.get("v.0.ln1.w", "f32"), 1 + _draw("v.0.ln1.w", (D,), 0.1))


def test_device_vit_folds_the_layer_norm_affines(bundles):
    with Bundle.open(bundles["device"]) as b:
        D, F = 64, 96  # noqa: N806
        for name, key, ln, out in (("v.0.qkv", "v_qkv", "v.0.ln1", 3 * D), ("v.1.fc1", "v_fc1", "v.1.ln2", F)):
            w, bias = _linear(name, out, D)
            scale, shift = b.tensors.get(ln + ".w", "f32"), b.tensors.get(ln + ".b", "f32")
            got_w, got_b = _unpack(b, name, key)
            # LN(x) scale + shift, then B: the same as LN(x) @ (diag(scale) B) + (shift @ B + bias).
            _assert_bfp16(got_w, w * scale[:, None])
            ref = shift.astype(np.float64) @ w + bias
            assert np.all(np.abs(got_b - ref) <= np.abs(ref) * 2.0 ** -8 + 1e-6)
        got_w, got_b = _unpack(b, "v.1.fc2", "v_fc2")
        assert b.gemms["v_fc2"].bias
        assert np.array_equal(got_b, _bf16(b.tensors.get("v.1.fc2.b", "f32")))


def test_detr_qkv_pads_heads_and_splits_its_input(bundles):
    with Bundle.open(bundles["host"]) as b:
        d, pd, hd = 32, 64, 16
        got, bias = _unpack(b, "d.0.qkv", "d_qkv")
        live = (np.arange(pd) % 32) < hd  # each head's 16 dims at the start of its 32-wide slot
        cols = np.concatenate([live, live, live])
        assert not got[:, ~cols].any() and not bias[~cols].any()
        assert not got[d:, :2 * pd].any() and not got[:d, 2 * pd:].any()  # q, k read LN(x) + pos; v reads LN(x)
        wq, bq = _linear("d.0.sa.q", d, d)
        _assert_bfp16(got[:d, :pd][:, live], wq * np.float32(np.sqrt(2)))  # 1/sqrt(32) of mha_d -> 1/sqrt(16)
        kv, _ = _unpack(b, "dec.kv", "dec_kv")
        assert not kv[d:, :d].any() and not kv[:d, d:].any()


def test_pack_test_is_the_d_s_packing(opened):
    _, b = opened
    s = b.gemms["d_s"]
    packed = b.tensors.raw("pack_test.packed")
    bias = b.tensors.get("pack_test.bias", "f32")
    matrix = b.tensors.get("pack_test.B", "f32").reshape(s.k, s.n)
    assert np.array_equal(pack.pack_b(matrix, bias, s.tile_k, s.tile_n, s.ct_k), packed)
    # Column 0's first block, decoded by hand: after the bias chunk (ct_k tile_n / 8 blocks of 9 bytes) comes
    # E = 133, then the mantissas of [64, 14.9375, 106.5, 94.5, 0, -1.5, -2.5, 3].
    chunk = s.ct_k * s.tile_n // 8 * 9
    assert list(packed[chunk:chunk + 9]) == [133, 64, 15, 106, 94, 0, 254, 254, 3]
    assert list(packed[:4]) == list(bias[:2].astype(ml_dtypes.bfloat16).view(np.uint8))


def test_perm_rope_and_reference_image(opened):
    variant, b = opened
    p = b.params
    T, half = p.grid ** 2, p.vit_dim // p.vit_heads // 2  # noqa: N806
    perm = b.tensors.get("v.perm", "i32")
    assert sorted(perm.tolist()) == list(range(T))
    y, x = np.divmod(perm, p.grid)
    window = np.arange(T) // p.window ** 2  # window-order row j lies in window j / window^2 (raster of windows)
    assert np.array_equal((y // p.window) * (p.grid // p.window) + x // p.window, window)
    for kind in ("win", "glob"):
        cos, sin = b.tensors.get(f"v.rope.{kind}.cos", "f32"), b.tensors.get(f"v.rope.{kind}.sin", "f32")
        assert cos.shape == sin.shape == (T, half)
        np.testing.assert_allclose(cos ** 2 + sin ** 2, 1, atol=1e-6)
        if variant != "host":  # the kernels' table layout: f32 cos, then f32 sin
            assert bytes(b.tensors.raw(f"v.rope_tab.{kind}")) == cos.tobytes() + sin.tobytes()
    assert np.array_equal(np.asarray(Image.open(b.ref_image).convert("RGB")), b.tensors.get("ref.rgb", "u8"))


def test_text_encoder_and_tokenizer_tensors(bundles):
    with Bundle.open(bundles["host"]) as b:
        assert b.tensors.info("t.tok_emb").dtype == "bf16" and b.tensors.info("t.0.qkv.w").dtype == "bf16"
        assert b.tensors.info("t.0.qkv.b").dtype == "f32" and b.tensors.info("t.proj.w").shape == (32, 32)
        assert b.tensors.info("t.tok_emb").shape == (len(b.vocab), 32)
        v = b.vocab
        bos, eos = v["<|startoftext|>"], v["<|endoftext|>"]
        assert (b.params.bos, b.params.eos, b.params.pad) == (bos, eos, eos)
        # Each prompt's BPE worked by hand over merges.txt (text_len 8: bos, at most 6 tokens, eos, then pad).
        tokens = [["a</w>", "cat</w>"],
                  ["cats</w>", "a", "n", "d</w>", "do", "g"],             # "cats and dogs", cut at 6 tokens
                  ["ca", "f", "\xc3", "\xa9</w>", "5</w>"],               # "café 5": é is bytes c3 a9
                  ["\xe2", "\u0124", "\xac", "\\</w>", "z", "z</w>"],    # euro = e2 82 ac (82 -> U+0124)
                  ["cat</w>", "'s</w>", "car</w>"],
                  ["person</w>", "4</w>", "2</w>", "!</w>"]]
        for j, toks in enumerate(tokens):
            ids = [bos] + [v[t] for t in toks] + [eos]
            want = np.array(ids + [eos] * (8 - len(ids)), np.int32)
            assert np.array_equal(b.tensors.get(f"tok.{j}.ids", "i32"), want), j
            assert np.array_equal(b.tensors.get(f"tok.{j}.mask", "i32"), np.arange(8) < len(ids)), j
        assert b.tensors.get("ref.input_ids", "i32").tolist()[:3] == [bos, v["cat</w>"], eos]
        assert b.merges[0] == ("c", "a") and len(v) == 512 + len(b.merges) + 2


# ---------------------------------------------------------------------------------------------------------------
# Geometry


def test_presets_pass_their_rules():
    big = Geometry.sam3()
    for variant in VARIANTS:
        big.for_variant(variant).check(variant)
    assert big.gemms["d_s"].b_bytes == 82944
    assert big.params()["neck_splits"] == [2048, 1024, 256] and big.mhas["mha_win"].heads == 9 * 16
    assert big.gemms["v_embed"].k == 768


_BROKEN = [
    (lambda g: dataclasses.replace(g, image_size=18), "image_size = grid * patch"),
    (lambda g: dataclasses.replace(g, window=3), "grid % window = 0"),
    (lambda g: dataclasses.replace(g, grid=6, image_size=12, window=3, mask_size=24), "T = grid^2 is a multiple of 8"),
    (lambda g: dataclasses.replace(g, mask_size=30), "mask_size = 4 * grid"),
    (lambda g: g.with_gemm("v_embed", k=8, lda=8, tile_k=8), "v_embed K >= 3 * patch^2"),
    (lambda g: g.with_gemm("v_qkv", n=128), "v_qkv N = 3 * vit_dim"),
    (lambda g: g.with_gemm("v_fc2", k=80, lda=80), "v_fc2 K = v_fc1 N"),
    (lambda g: dataclasses.replace(g, vit_heads=3), "vit_dim % vit_heads = 0"),
    (lambda g: dataclasses.replace(g, neck_splits=(64, 128)), "neck_splits has 3 widths"),
    (lambda g: dataclasses.replace(g, neck_splits=(64, 96, 32)), "neck_splits s1 = 4 * d_model"),
    (lambda g: dataclasses.replace(g, vit_heads=0), "vit_heads is a positive integer"),
    (lambda g: g.with_gemm("n_up", n=64), "n_up N >= 4 * d_model"),
    (lambda g: g.with_gemm("conv", lda=191), "conv (K - lda) is even"),
    (lambda g: g.with_gemm("conv", k=192, lda=96), "conv C = D / 3 = d_model"),
    (lambda g: g.with_gemm("conv", n=32), "conv N = P * d_model"),
    (lambda g: g.with_gemm("d_qkv", n=96), "d_qkv N = 3 * pd"),
    (lambda g: g.with_gemm("d_s", n=32), "d_s N = d_heads * text_len"),
    (lambda g: g.with_gemm("d_fc2", k=32, lda=32), "d_fc2 K = d_fc1 N"),
    (lambda g: g.with_gemm("dec_kv", n=32), "dec_kv N >= dec_layers * 2 * d_model"),
    (lambda g: g.with_gemm("m_head", n=4, tile_n=4), "m_head N >= queries + 1"),
    (lambda g: dataclasses.replace(g, d_heads=8), "d_model % d_heads = 0 with a head dim that is a multiple of 8"),
    (lambda g: dataclasses.replace(g, text_heads=3), "text_dim % text_heads = 0"),
    (lambda g: g.with_mha("mha_glob", elems=1024), "mha_glob elems >= T * vit_dim"),
    (lambda g: g.with_gemm("v_fc1", tile_n=64), "v_fc1: K % tile_k = 0 and N % tile_n = 0"),
    (lambda g: g.with_gemm("v_o", ct_k=12), "v_o: tile_k % ct_k = 0, ct_k % 8 = 0"),
    (lambda g: g.with_gemm("d_o", lda=32), "d_o: lda = K"),
    (lambda g: dataclasses.replace(g, vit_global=(2,)), "vit_global lists distinct layers"),
    (lambda g: dataclasses.replace(g, vit_global=()), "vit_global lists distinct layers"),
    (lambda g: dataclasses.replace(g, vit_eps=0.0), "vit_eps is a small positive float"),
    (lambda g: g.with_mha("mha_win", seq=4), "mha_win is [windows * vit_heads, window^2, head dim]"),
]


@pytest.mark.parametrize("broken, rule", _BROKEN, ids=[r for _, r in _BROKEN])
def test_check_names_the_broken_rule(broken, rule, tmp_path):
    g = broken(Geometry.tiny())
    with pytest.raises(GeometryError, match="^geometry tiny: " + _re(rule)) as e:
        g.check()
    assert e.value.rule.startswith(rule)
    with pytest.raises(GeometryError):
        build(tmp_path / "b", g)
    assert not (tmp_path / "b").exists()  # refused before anything is written


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_derive_refuses_unknown_overrides():
    base = dataclasses.asdict(Geometry.tiny())
    params = {k: v for k, v in base.items() if k not in ("name", "gemms", "mhas")}
    tiles = {"m": 16, "tile_k": 16, "tile_n": 16, "ct_k": 8, "mha_d_head": 32}
    assert Geometry.derive("t", **tiles, **params).gemms["d_s"].ct_k == 8
    with pytest.raises(GeometryError, match=r"overrides name GEMM keys: unknown \['v_mlp'\]"):
        Geometry.derive("t", **tiles, overrides={"v_mlp": {"m": 8}}, **params)
    with pytest.raises(GeometryError, match=r"overrides of v_o name GemmShape fields: unknown \['rows'\]"):
        Geometry.derive("t", **tiles, overrides={"v_o": {"rows": 8}}, **params)


def test_equal_streams_must_mean_equal_kernels():
    from sam3.build import _check_streams_distinct

    _check_streams_distinct({"d_s": (b"same", ("shape", 0)), "d_c": (b"same", ("shape", 0))})
    with pytest.raises(RuntimeError, match="same instruction stream for mha_win .* and mha_glob"):
        _check_streams_distinct({"mha_win": (b"same", "windowed"), "mha_glob": (b"same", "global")})


def test_variant_rules():
    g = Geometry.tiny()
    with pytest.raises(GeometryError, match="v_fc2 bias = 1 in a device bundle"):
        g.check("device")
    with pytest.raises(GeometryError, match="the device ViT's layer GEMMs share M"):
        g.for_variant("device").with_gemm("v_o", m=32).check("device")
    g.with_gemm("v_o", m=32).check("host")
    with pytest.raises(ValueError, match="unknown variant 'gpu'"):
        g.check("gpu")


# ---------------------------------------------------------------------------------------------------------------
# Reproducibility, formats, cache, command line


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_seeds_reproduce_bundles(bundles, tmp_path):
    again = _files(build(tmp_path / "again", "tiny", variant="device", seed=SEED))
    assert again == _files(bundles["device"])
    other = _files(build(tmp_path / "other", "tiny", variant="device", seed=SEED + 1))
    assert other.keys() == again.keys()
    differ = {name for name in again if again[name] != other[name]}
    assert "tensors.bin" in differ and "kernels/v_qkv.insts.bin" not in differ  # streams do not depend on the seed
    assert {n for n in differ if n.endswith(".xclbin")} == {n for n in again if n.endswith(".xclbin")}  # seeded PDIs


def test_format_1_and_targets(tmp_path):
    root = build(tmp_path / "v1", "tiny", variant="device", version=1, target="npu1")
    with Bundle.open(root) as b:
        assert b.version == 1
        assert all(insts.decode(b.insts_bytes(k)).dev_gen == 3 for k in b.kernel_keys())
        x = Xclbin.load(b.xclbins[b.gemms["v_qkv"].ctx].path)
        assert (x.partition.column_width, x.partition.start_columns) == (4, (1,))
    with pytest.raises(ValueError, match="version 1: a device-f32 bundle is format 2"):
        build(tmp_path / "f", "tiny", variant="device-f32", version=1)
    for kwargs, message in (({"variant": "gpu"}, "unknown variant 'gpu'"), ({"target": "npu3"}, "unknown target"),
                            ({"seed": -1}, "seed must be a non-negative integer")):
        with pytest.raises(ValueError, match=message):
            build(tmp_path / "x", "tiny", **kwargs)
    with pytest.raises(ValueError, match="unknown geometry 'huge'"):
        build(tmp_path / "x", "huge")
    with pytest.raises(BundleError, match="must not exist or be empty"):
        build(root, "tiny")


def test_build_cached_reuses_and_rebuilds(tmp_path):
    first = build_cached(tmp_path, "tiny", "device", 3)
    stamp = (first / "tensors.bin").stat().st_mtime_ns
    assert build_cached(tmp_path, "tiny", "device", 3) == first
    assert (first / "tensors.bin").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind
    (first / KEY_FILE).write_text("0" * 64 + "\n")  # built by other inputs or another builder
    assert build_cached(tmp_path, "tiny", "device", 3) == first
    assert (first / KEY_FILE).read_text() != "0" * 64 + "\n"
    os.remove(first / KEY_FILE)  # a half-written entry has no key file
    (first / "manifest.txt").write_text("garbage")
    rebuilt = build_cached(tmp_path, "tiny", "device", 3)
    with Bundle.open(rebuilt) as b:
        assert b.params.vit_device
    other = build_cached(tmp_path, "tiny", "host", 3)
    assert other != first and sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_build_cached_concurrent_callers(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        roots = list(pool.map(lambda _: build_cached(tmp_path, "tiny", "host", 4), range(3)))
    assert len(set(roots)) == 1 and [p.name for p in tmp_path.iterdir()] == [roots[0].name]
    with Bundle.open(roots[0]) as b:
        assert len(b.gemms) == 16


def test_main_and_tool_script(tmp_path, capsys):
    assert main([str(tmp_path / "m"), "--variant", "device-f32", "--seed", "2", "--target", "npu6"]) == 0
    out = capsys.readouterr()
    assert out.out == f"{tmp_path / 'm'}\n" and "ViT layer 2/2" in out.err and "done" in out.err
    with Bundle.open(tmp_path / "m") as b:
        assert b.params.vit_res_f32
    assert main([str(tmp_path / "m")]) == 1  # not empty
    assert "must not exist or be empty" in capsys.readouterr().err
    assert main([str(tmp_path / "n"), "--variant", "gpu"]) == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err and not (tmp_path / "n").exists()
    assert main(["--help"]) == 0 and "--variant" in capsys.readouterr().out
    run = subprocess.run([sys.executable, str(REPO / "tools" / "build_bundle.py"), str(tmp_path / "t"), "--preset",
                          "tiny", "--target", "npu5"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "t") and "kernels" in run.stderr
