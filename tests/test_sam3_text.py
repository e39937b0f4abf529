"""sam3.text (the CLIP text encoder), sam3.export_text (its checkpoint mapping) and sam3.hostmath.

Oracles: a token-by-token, head-by-head loop written from docs/sam3-host.md 5 on tiny random weights;
Python's ``math.erf``; checkpoints generated here with safetensors; and the sam3-tiny fixture's float32
text features (transformers' own output), compared at the check line's bar (cosine > 0.9999 over the
valid rows) with the bundle's bf16 weights, and far tighter with the checkpoint's float32 weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from fixture_files import REPO_FIXTURES
from safetensors import safe_open
from safetensors.numpy import save_file

from sam3 import text as text_mod
from sam3.export_text import ExportError, text_params, text_plan, text_tensors
from sam3.hostmath import cosine, erfc, f32, from_bf16, gelu_erf, layer_norm, linear, round_bf16, softmax, to_bf16
from sam3.text import TextError, encode_text

TINY = REPO_FIXTURES / "sam3-tiny"
BAR = 0.9999


def _tiny(rel: str) -> Path:
    path = TINY / rel
    if not path.exists():
        pytest.skip(f"fixture {path} absent (tests/fixtures incomplete in this checkout)")
    return path


# --- hostmath -------------------------------------------------------------------------------------------

def test_gelu_and_erfc_against_math_erf():
    x = np.linspace(-6, 6, 2001).astype(np.float32)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float)])
    np.testing.assert_allclose(gelu_erf(x), want, rtol=2e-6, atol=1e-7)
    z = np.linspace(-3, 3, 601).astype(np.float32)
    np.testing.assert_allclose(erfc(z), [math.erfc(v) for v in z.astype(float)], rtol=1e-6)
    assert gelu_erf(x).dtype == np.float32


def test_layer_norm_two_pass_by_hand():
    x = np.array([[1e4 + 1, 1e4 + 2, 1e4 + 3, 1e4 + 6]], dtype=np.float32)  # a large mean: one-pass would lose it
    out = layer_norm(x, np.array([1, 2, 1, 1], np.float32), np.array([0, 0, 1, 0], np.float32), 1e-5)
    d = np.array([-2.0, -1.0, 0.0, 3.0])
    want = d / math.sqrt((d * d).mean() + 1e-5) * [1, 2, 1, 1] + [0, 0, 1, 0]
    np.testing.assert_allclose(out[0], want, rtol=1e-5)


def test_softmax_masks_and_empty_rows():
    s = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, -np.inf], [0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[True, True, False], [True, True, True], [False, False, False]])
    out = softmax(s, mask)
    e = math.exp(1.0)
    np.testing.assert_allclose(out[0], [1 / (1 + e), e / (1 + e), 0.0], rtol=1e-6)
    np.testing.assert_allclose(out[1], [1 / (1 + e), e / (1 + e), 0.0], rtol=1e-6)
    assert out[2].tolist() == [0.0, 0.0, 0.0]
    assert softmax(np.full((1, 2), -np.inf, np.float32)).tolist() == [[0.0, 0.0]]


def test_bf16_round_trips():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 3.4e38, np.inf, np.nan], np.float32)
    bits = to_bf16(x)
    assert bits[:6].tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80, 0x7F80]  # ties to even; overflow -> inf
    assert np.isnan(from_bf16(bits)[6])
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(f32(bits.view(ml_dtypes.bfloat16)), from_bf16(bits))
    np.testing.assert_array_equal(round_bf16(x[:6]), from_bf16(bits[:6]))
    every = np.arange(1 << 16, dtype=np.uint32)
    np.testing.assert_array_equal(from_bf16(every.astype(np.uint16)).view(np.uint32), every << 16)  # NaNs too
    with pytest.raises(TypeError, match=r"got dtype <U1"):
        f32(np.array(["a"]))


def test_linear_torch_layout():
    w = np.array([[1, 2], [3, 4], [5, 6]], np.float32)  # [out 3, in 2]
    np.testing.assert_array_equal(linear(np.array([[1, 1]], np.float32), w, np.array([0, 0, 1], np.float32)),
                                  [[3, 7, 12]])


# --- a tiny random text encoder and its loop oracle ------------------------------------------------------

def _params(**kw) -> SimpleNamespace:
    base = dict(text_len=6, text_dim=8, text_heads=2, text_layers=2, text_ffn=16, text_eps=1e-5, d_model=4)
    return SimpleNamespace(**{**base, **kw})


def _weights(p: SimpleNamespace, vocab: int = 20, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f = p.text_dim, p.text_ffn

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"t.tok_emb": r(vocab, d), "t.pos_emb": r(p.text_len, d, scale=0.1),
         "t.final_ln.w": 1 + r(d, scale=0.1), "t.final_ln.b": r(d, scale=0.1),
         "t.proj.w": r(p.d_model, d, scale=d**-0.5), "t.proj.b": r(p.d_model, scale=0.1)}
    for i in range(p.text_layers):
        for ln in ("ln1", "ln2"):
            w[f"t.{i}.{ln}.w"], w[f"t.{i}.{ln}.b"] = 1 + r(d, scale=0.1), r(d, scale=0.1)
        for name, (n_out, n_in) in {"qkv": (3 * d, d), "o": (d, d), "fc1": (f, d), "fc2": (d, f)}.items():
            w[f"t.{i}.{name}.w"], w[f"t.{i}.{name}.b"] = r(n_out, n_in, scale=n_in**-0.5), r(n_out, scale=0.1)
    return w


def _loop_oracle(ids, n, w, p) -> np.ndarray:
    """docs/sam3-host.md 5 one token and one head at a time, in float64, with math.erf."""
    d, h = p.text_dim, p.text_heads
    hd = d // h
    W = {k: np.asarray(f32(v), np.float64) for k, v in w.items()}

    def ln(v, key):
        mu = sum(v) / d
        var = sum((a - mu) ** 2 for a in v) / d
        return np.array([(a - mu) / math.sqrt(var + p.text_eps) for a in v]) * W[key + ".w"] + W[key + ".b"]

    def lin(v, key):
        return W[key + ".w"].reshape(-1, len(v)) @ v + W[key + ".b"]

    x = [W["t.tok_emb"].reshape(-1, d)[ids[t]] + W["t.pos_emb"].reshape(-1, d)[t] for t in range(n)]
    for i in range(p.text_layers):
        qkv = [lin(ln(x[t], f"t.{i}.ln1"), f"t.{i}.qkv") for t in range(n)]
        att = []
        for t in range(n):
            row = []
            for head in range(h):
                q = qkv[t][head * hd:(head + 1) * hd]
                sc = [q @ qkv[s][d + head * hd:d + (head + 1) * hd] / math.sqrt(hd) for s in range(t + 1)]
                e = [math.exp(c - max(sc)) for c in sc]
                row.extend(sum(e[s] / sum(e) * qkv[s][2 * d + head * hd:2 * d + (head + 1) * hd]
                               for s in range(t + 1)))
            att.append(np.array(row))
        x = [x[t] + lin(att[t], f"t.{i}.o") for t in range(n)]
        for t in range(n):
            hid = lin(ln(x[t], f"t.{i}.ln2"), f"t.{i}.fc1")
            hid = np.array([0.5 * a * (1 + math.erf(a / math.sqrt(2))) for a in hid])
            x[t] = x[t] + lin(hid, f"t.{i}.fc2")
    out = np.zeros((p.text_len, p.d_model))
    for t in range(n):
        out[t] = lin(ln(x[t], "t.final_ln"), "t.proj")
    return out


def _prompt(p, n: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full(p.text_len, 19, np.int32)
    ids[:n] = [18, *range(3, 3 + n - 2), 19][:n]
    mask = (np.arange(p.text_len) < n).astype(np.int32)
    return ids, mask


@pytest.mark.parametrize("n", [1, 4, 6])
def test_encoder_matches_the_loop_oracle(n):
    p = _params()
    w = _weights(p)
    ids, mask = _prompt(p, n)
    got = encode_text(ids, mask, w, p)
    assert got.shape == (p.text_len, p.d_model) and got.dtype == np.float32
    np.testing.assert_allclose(got, _loop_oracle(ids, n, w, p), rtol=1e-4, atol=1e-5)
    assert not got[n:].any()


def test_encoder_with_three_heads_and_one_layer():
    p = _params(text_dim=12, text_heads=3, text_layers=1, text_ffn=20, d_model=5, text_len=5)
    w = _weights(p, seed=4)
    ids, mask = _prompt(p, 4)
    np.testing.assert_allclose(encode_text(ids, mask, w, p), _loop_oracle(ids, 4, w, p), rtol=1e-4, atol=1e-5)


def test_bf16_weights_in_either_storage_give_the_same_result():
    p = _params()
    w = _weights(p)
    as_ml = {k: (v.astype(ml_dtypes.bfloat16) if k.endswith((".w", "tok_emb")) and v.ndim == 2 else v)
             for k, v in w.items()}
    as_bits = {k: (v.view(np.uint16) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in as_ml.items()}
    flat = {k: v.ravel() for k, v in as_ml.items()}
    ids, mask = _prompt(p, 5)
    a = encode_text(ids, mask, as_ml, p)
    np.testing.assert_array_equal(a, encode_text(ids, mask, as_bits, p))
    np.testing.assert_array_equal(a, encode_text(ids, mask, flat, p))
    rounded = {k: (from_bf16(v.view(np.uint16)) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in as_ml.items()}
    np.testing.assert_allclose(a, _loop_oracle(ids, 5, rounded, p), rtol=1e-4, atol=1e-5)


def test_weights_from_a_tensor_store():
    """A store with ``in`` and ``get`` only (the bundle's TensorStore protocol) works like a dict."""
    p = _params()
    w = _weights(p)

    class Store:
        def __contains__(self, name):
            return name in w

        def get(self, name):
            return w[name].ravel()  # a store keeps its own shapes: flat here

    ids, mask = _prompt(p, 4)
    np.testing.assert_array_equal(encode_text(ids, mask, Store(), p), encode_text(ids, mask, w, p))


def test_attention_is_causal_and_padding_is_ignored():
    p = _params()
    w = _weights(p)
    ids, mask = _prompt(p, 5)
    base = encode_text(ids, mask, w, p)
    later = ids.copy()
    later[4] = 7  # a later token changes only its own and later rows
    changed = encode_text(later, mask, w, p)
    np.testing.assert_array_equal(changed[:4], base[:4])
    assert not np.allclose(changed[4], base[4])
    padded = ids.copy()
    padded[5:] = 0
    np.testing.assert_array_equal(encode_text(padded, mask, w, p), base)


def test_input_errors():
    p = _params()
    w = _weights(p)
    ids, mask = _prompt(p, 3)
    with pytest.raises(TextError, match=r"token ids: shape \[5\], expected \[6\] \(text_len\)"):
        encode_text(ids[:5], mask, w, p)
    with pytest.raises(TextError, match=r"attention mask must be a non-empty prefix of ones, got \[0, 1, 1, 0, 0, 0\]"):
        encode_text(ids, np.array([0, 1, 1, 0, 0, 0]), w, p)
    with pytest.raises(TextError, match=r"non-empty prefix"):
        encode_text(ids, np.zeros(6, np.int32), w, p)
    bad = ids.copy()
    bad[1] = 20
    with pytest.raises(TextError, match=r"token id 20 outside the vocabulary of 20 tokens"):
        encode_text(bad, mask, w, p)
    with pytest.raises(TextError, match=r"text_dim 8 is not divisible by text_heads 3"):
        encode_text(ids, mask, w, _params(text_heads=3))


def test_weight_errors_name_the_tensor():
    p = _params()
    ids, mask = _prompt(p, 3)
    w = _weights(p)
    del w["t.1.fc2.b"]
    with pytest.raises(TextError, match=r"text encoder: tensor t.1.fc2.b missing from the weights"):
        encode_text(ids, mask, w, p)
    w = _weights(p)
    w["t.0.fc1.w"] = w["t.0.fc1.w"][:, :4]
    with pytest.raises(TextError, match=r"tensor t.0.fc1.w has shape \[16, 4\] \(64 values\), expected \[16, 8\] "
                                        r"\(128 values\)"):
        encode_text(ids, mask, w, p)
    w = _weights(p)
    w["t.tok_emb"] = w["t.tok_emb"].ravel()[:-3]
    with pytest.raises(TextError, match=r"t.tok_emb has 157 values, not a multiple of text_dim 8"):
        encode_text(ids, mask, w, p)


# --- generated checkpoints for the exporter -------------------------------------------------------------

def _hf_state(p: SimpleNamespace, vocab: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f = p.text_dim, p.text_ffn

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.3

    c, state = "text_encoder.text_model.", {}
    state[c + "embeddings.token_embedding.weight"] = r(vocab, d)
    state[c + "embeddings.position_embedding.weight"] = r(p.text_len, d)
    for i in range(p.text_layers):
        pre = f"{c}encoder.layers.{i}."
        for name, shape in {"layer_norm1": (d,), "layer_norm2": (d,)}.items():
            state[pre + name + ".weight"], state[pre + name + ".bias"] = 1 + r(*shape), r(*shape)
        for name, (n_out, n_in) in {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, d), "self_attn.v_proj": (d, d),
                                    "self_attn.out_proj": (d, d), "mlp.fc1": (f, d), "mlp.fc2": (d, f)}.items():
            state[pre + name + ".weight"], state[pre + name + ".bias"] = r(n_out, n_in), r(n_out)
    state[c + "final_layer_norm.weight"], state[c + "final_layer_norm.bias"] = 1 + r(d), r(d)
    state["text_encoder.text_projection.weight"] = r(d, d)  # CLIP's pooled projection: not SAM3's t.proj
    state["text_projection.weight"], state["text_projection.bias"] = r(p.d_model, d), r(p.d_model)
    state["vision_encoder.other.weight"] = r(3)
    return state


def _checkpoint(root: Path, p: SimpleNamespace, *, state=None, cfg_edit=None, vocab_size: int = 10) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tokens = [f"t{i}" for i in range(vocab_size - 2)] + ["<|startoftext|>", "<|endoftext|>"]
    (root / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    cfg = {"model_type": "sam3", "detr_encoder_config": {"hidden_size": p.d_model},
           "text_config": {"hidden_act": "gelu", "hidden_size": p.text_dim, "intermediate_size": p.text_ffn,
                           "layer_norm_eps": p.text_eps, "max_position_embeddings": p.text_len,
                           "num_attention_heads": p.text_heads, "num_hidden_layers": p.text_layers,
                           "vocab_size": vocab_size, "bos_token_id": vocab_size - 2, "eos_token_id": vocab_size - 1,
                           "pad_token_id": 1}}
    if cfg_edit:
        cfg_edit(cfg)
    (root / "config.json").write_text(json.dumps(cfg))
    save_file(_hf_state(p, vocab_size) if state is None else state, str(root / "model.safetensors"))
    return root


def test_params_from_a_generated_checkpoint(tmp_path):
    p = _params()
    got = text_params(_checkpoint(tmp_path / "ck", p))
    assert got == {"text_len": 6, "text_dim": 8, "text_heads": 2, "text_layers": 2, "text_ffn": 16,
                   "text_eps": 1e-5, "bos": 8, "eos": 9, "pad": 9}


def test_tensors_names_layouts_and_values(tmp_path):
    p = _params()
    state = _hf_state(p, 10)
    out = dict(text_tensors(_checkpoint(tmp_path / "ck", p, state=state)))
    want_names = {"t.tok_emb", "t.pos_emb", "t.final_ln.w", "t.final_ln.b", "t.proj.w", "t.proj.b"}
    for i in range(p.text_layers):
        want_names |= {f"t.{i}.{x}.{y}" for x in ("ln1", "ln2", "qkv", "o", "fc1", "fc2") for y in "wb"}
    assert set(out) == want_names
    bf16 = {k for k, v in out.items() if v.dtype == ml_dtypes.bfloat16}
    assert bf16 == {"t.tok_emb"} | {f"t.{i}.{x}.w" for i in range(2) for x in ("qkv", "o", "fc1", "fc2")}
    assert all(out[k].dtype == np.float32 for k in want_names - bf16)
    c = "text_encoder.text_model."
    pre = c + "encoder.layers.1.self_attn."
    qkv = f32(out["t.1.qkv.w"])
    assert qkv.shape == (24, 8)
    for j, x in enumerate("qkv"):  # q | k | v along out, each the checkpoint's [out, in] rounded to bf16
        np.testing.assert_array_equal(qkv[8 * j:8 * (j + 1)], round_bf16(state[f"{pre}{x}_proj.weight"]))
        np.testing.assert_array_equal(out["t.1.qkv.b"][8 * j:8 * (j + 1)], state[f"{pre}{x}_proj.bias"])
    np.testing.assert_array_equal(f32(out["t.0.fc2.w"]), round_bf16(state[c + "encoder.layers.0.mlp.fc2.weight"]))
    np.testing.assert_array_equal(out["t.proj.w"], state["text_projection.weight"])
    np.testing.assert_array_equal(out["t.0.ln2.b"], state[c + "encoder.layers.0.layer_norm2.bias"])


def test_export_then_encode_matches_the_loop_oracle(tmp_path):
    p = _params()
    weights = dict(text_tensors(_checkpoint(tmp_path / "ck", p)))
    ids, mask = _prompt(p, 4)
    ids = np.where(ids >= 10, 9, ids)
    np.testing.assert_allclose(encode_text(ids, mask, weights, p), _loop_oracle(ids, 4, weights, p),
                               rtol=1e-4, atol=1e-5)


def test_export_refusals(tmp_path):
    p = _params()

    def ck(name, **kw):
        return _checkpoint(tmp_path / name, p, **kw)

    with pytest.raises(ExportError, match=r"config.json: model_type 'clip' is not 'sam3': not a SAM3 checkpoint"):
        text_params(ck("a", cfg_edit=lambda c: c.update(model_type="clip")))
    state = _hf_state(p, 10)
    del state["text_encoder.text_model.encoder.layers.1.mlp.fc1.bias"]
    with pytest.raises(ExportError, match=r"model.safetensors: tensor text_encoder.text_model.encoder.layers.1.mlp."
                                          r"fc1.bias missing"):
        next(text_tensors(ck("b", state=state)))  # checked before the first tensor is yielded
    state = _hf_state(p, 10)
    state["text_projection.weight"] = state["text_projection.weight"].T.copy()
    with pytest.raises(ExportError, match=r"tensor text_projection.weight has shape \[8, 4\], expected \[4, 8\]"):
        next(text_tensors(ck("c", state=state)))
    with pytest.raises(ExportError, match=r"text_config.hidden_act 'quick_gelu': the text encoder implements"):
        text_params(ck("d", cfg_edit=lambda c: c["text_config"].update(hidden_act="quick_gelu")))
    with pytest.raises(ExportError, match=r"config.json: key text_config.num_hidden_layers missing"):
        text_params(ck("e", cfg_edit=lambda c: c["text_config"].pop("num_hidden_layers")))
    with pytest.raises(ExportError, match=r"text_config.bos_token_id 3 disagrees with the tokenizer's bos id 8"):
        text_params(ck("f", cfg_edit=lambda c: c["text_config"].update(bos_token_id=3)))
    with pytest.raises(ExportError, match=r"hidden_size 8 is not divisible by num_attention_heads 3"):
        text_params(ck("g", cfg_edit=lambda c: c["text_config"].update(num_attention_heads=3)))
    with pytest.raises(ExportError, match=r"text_config.intermediate_size = 0, expected a positive integer"):
        text_params(ck("h", cfg_edit=lambda c: c["text_config"].update(intermediate_size=0)))
    bad_vocab = ck("i")
    (bad_vocab / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    with pytest.raises(ExportError, match=r"bos_token '<s>' is not in .*vocab.json"):
        text_params(bad_vocab)
    no_weights = ck("j")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ExportError, match=r"model.safetensors: no such file"):
        next(text_tensors(no_weights))
    with pytest.raises(ExportError, match=r"config.json: cannot read"):
        text_params(tmp_path / "nowhere")


# --- the sam3-tiny fixture ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    hf = _tiny("hf")
    cfg = json.loads((hf / "config.json").read_text())
    params = SimpleNamespace(**text_params(hf), d_model=cfg["detr_encoder_config"]["hidden_size"])
    ref = np.load(_tiny("reference.npz"))
    cases = [(ref[f"case.{c['index']}.input_ids"], ref[f"case.{c['index']}.attention_mask"],
              ref[f"case.{c['index']}.text"]) for c in json.loads(_tiny("cases.json").read_text())["cases"]]
    return SimpleNamespace(hf=hf, params=params, weights=dict(text_tensors(hf)), cases=cases)


def _min_cosine(tiny, weights) -> float:
    cos = []
    for ids, mask, want in tiny.cases:
        n = int((mask != 0).sum())
        cos.append(cosine(encode_text(ids, mask, weights, tiny.params)[:n], want[:n]))
    return min(cos)


def test_fixture_text_names_and_params(tiny):
    """Every text tensor of the real checkpoint is used except CLIP's pooled projection, and nothing else is."""
    with safe_open(str(tiny.hf / "model.safetensors"), framework="numpy") as st:
        names = {k for k in st.keys() if k.startswith(("text_encoder.", "text_projection."))}
    used = {source for entry in text_plan(tiny.hf) for source in entry.sources}
    assert names - used == {"text_encoder.text_projection.weight"}
    assert used <= names
    assert len(tiny.weights) == 2 + 12 * tiny.params.text_layers + 4
    assert tiny.weights["t.tok_emb"].shape == (49408, tiny.params.text_dim)
    assert (tiny.params.text_len, tiny.params.bos, tiny.params.eos, tiny.params.pad) == (32, 49406, 49407, 49407)


def test_fixture_text_check_line_with_bf16_weights(tiny):
    """The check line: cosine > 0.9999 over the valid rows, every case, with the bundle's bf16 weights."""
    for ids, mask, want in tiny.cases:
        got = encode_text(ids, mask, tiny.weights, tiny.params)
        n = int((mask != 0).sum())
        assert cosine(got[:n], want[:n]) > BAR
        assert not got[n:].any()


def test_fixture_text_with_float32_weights_is_near_exact(tiny):
    """The checkpoint's own float32 weights, mapped here by hand: the encoder itself adds almost no error."""
    c, names = "text_encoder.text_model.", {}
    names["t.tok_emb"], names["t.pos_emb"] = c + "embeddings.token_embedding", c + "embeddings.position_embedding"
    names["t.final_ln"], names["t.proj"] = c + "final_layer_norm", "text_projection"
    for i in range(tiny.params.text_layers):
        pre = f"{c}encoder.layers.{i}."
        for ours, theirs in (("ln1", "layer_norm1"), ("ln2", "layer_norm2"), ("o", "self_attn.out_proj"),
                             ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"), ("q", "self_attn.q_proj"),
                             ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj")):
            names[f"t.{i}.{ours}"] = pre + theirs
    w = {}
    with safe_open(str(tiny.hf / "model.safetensors"), framework="numpy") as st:
        for ours, theirs in names.items():
            if ours in ("t.tok_emb", "t.pos_emb"):
                w[ours] = st.get_tensor(theirs + ".weight")
                continue
            w[ours + ".w"], w[ours + ".b"] = st.get_tensor(theirs + ".weight"), st.get_tensor(theirs + ".bias")
    for i in range(tiny.params.text_layers):
        for y in "wb":
            w[f"t.{i}.qkv.{y}"] = np.concatenate([w.pop(f"t.{i}.{x}.{y}") for x in "qkv"])
    for ids, mask, want in tiny.cases:
        n = int((mask != 0).sum())
        got = encode_text(ids, mask, w, tiny.params)
        np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=1e-5)


def _heads_swapped(a: np.ndarray, heads: int) -> np.ndarray:
    a = f32(a).reshape(3, heads, -1).copy()  # [q|k|v, head, rows of that head (x in)]
    a[:, [0, 1]] = a[:, [1, 0]]
    return a.reshape(-1)


def _k_q_v(a: np.ndarray) -> np.ndarray:
    q, k, v = np.split(f32(a), 3)
    return np.concatenate([k, q, v])


LAYOUT_ERRORS = {
    "two heads of qkv swapped": lambda w, p: {
        "t.0.qkv.w": _heads_swapped(w["t.0.qkv.w"], p.text_heads),
        "t.0.qkv.b": _heads_swapped(w["t.0.qkv.b"], p.text_heads)},
    "q and k swapped": lambda w, p: {"t.1.qkv.w": _k_q_v(w["t.1.qkv.w"])},
    "qkv bias dropped": lambda w, p: {"t.0.qkv.b": np.zeros_like(w["t.0.qkv.b"])},
    "fc1 bias dropped": lambda w, p: {"t.1.fc1.b": np.zeros_like(w["t.1.fc1.b"])},
    "o weight transposed": lambda w, p: {"t.0.o.w": f32(w["t.0.o.w"]).T.copy()},
    "LN1 affine lost": lambda w, p: {"t.0.ln1.w": np.ones_like(w["t.0.ln1.w"]),
                                     "t.0.ln1.b": np.zeros_like(w["t.0.ln1.b"])},
    "LN2 weight and bias swapped": lambda w, p: {"t.1.ln2.w": w["t.1.ln2.b"], "t.1.ln2.b": w["t.1.ln2.w"]},
    "positions dropped": lambda w, p: {"t.pos_emb": np.zeros_like(w["t.pos_emb"])},
}


@pytest.mark.parametrize("error", sorted(LAYOUT_ERRORS))
def test_fixture_catches_a_wrong_layout(tiny, error):
    broken = {**tiny.weights, **LAYOUT_ERRORS[error](tiny.weights, tiny.params)}
    assert _min_cosine(tiny, broken) < BAR


@pytest.mark.parametrize("skipped", [0, 3, 4])
def test_fixture_catches_a_skipped_layer_norm(tiny, monkeypatch, skipped):
    """A pipeline that skips one LayerNorm (layer 0's LN1, layer 1's LN2, the final one) fails the check."""
    calls = {"n": 0}
    real = text_mod.layer_norm
    per_run = 2 * tiny.params.text_layers + 1

    def maybe_skip(x, w, b, eps):
        calls["n"] += 1
        return x if (calls["n"] - 1) % per_run == skipped else real(x, w, b, eps)

    monkeypatch.setattr(text_mod, "layer_norm", maybe_skip)
    assert _min_cosine(tiny, tiny.weights) < BAR
