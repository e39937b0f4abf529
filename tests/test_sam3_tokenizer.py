"""sam3.tokenizer: CLIP BPE and SAM3's framing of the tokens.

Oracles: a tiny generated vocabulary whose merges are worked out by hand, GPT-2's byte-to-unicode table
built here from its definition, the sam3-tiny fixture's processor tokens, and the reference
``tokenizer.json`` run by the ``tokenizers`` library.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from fixture_files import REPO_FIXTURES

from sam3.tokenizer import ClipTokenizer, TokenizerError, read_merges, read_vocab

TINY = REPO_FIXTURES / "sam3-tiny"


def _tiny(rel: str):
    path = TINY / rel
    if not path.exists():
        pytest.skip(f"fixture {path} absent (tests/fixtures incomplete in this checkout)")
    return path


def _byte_chars() -> list[str]:
    """GPT-2's byte -> unicode map: printable Latin-1 bytes map to themselves, the rest to 256, 257, ... in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTES = _byte_chars()
MERGES = [("o", "w"), ("l", "o"), ("lo", "w"), ("e", "r</w>"), ("ow", "er</w>"), ("c", "a"), ("ca", "t</w>")]
SPECIALS = ("<|startoftext|>", "<|endoftext|>")


def _vocab(drop: tuple[str, ...] = ()) -> dict[str, int]:
    tokens = [*BYTES, *(c + "</w>" for c in BYTES)]
    for a, b in MERGES:
        tokens.append(a + b)
    tokens += SPECIALS
    return {t: i for i, t in enumerate(t for t in tokens if t not in drop)}


def _tok(length: int = 8, vocab: dict[str, int] | None = None) -> ClipTokenizer:
    vocab = _vocab() if vocab is None else vocab
    return ClipTokenizer(vocab, MERGES, length=length, bos=vocab[SPECIALS[0]], eos=vocab[SPECIALS[1]],
                         pad=vocab[SPECIALS[1]])


def _ids(*tokens: str) -> list[int]:
    v = _vocab()
    return [v[t] for t in tokens]


# --- BPE on the generated vocabulary ---------------------------------------------------------------------

def test_byte_table_is_a_bijection_onto_512_symbols():
    assert len(set(BYTES)) == 256
    assert BYTES[ord("a")] == "a" and BYTES[ord(" ")] == "\u0120" and BYTES[0] == "\u0100"


def test_merges_apply_by_rank_not_position():
    # "lowx": l o w x</w>; (o, w) has rank 0 and wins over (l, o) at rank 1, so "lo" never forms.
    assert _tok().tokens("lowx") == _ids("l", "ow", "x</w>")
    # "low": l o w</w>; (o, w</w>) is no merge, so (l, o) then nothing: lo + w</w>.
    assert _tok().tokens("low") == _ids("lo", "w</w>")
    # "ower": o w e r</w> -> ow e r</w> -> ow er</w> -> ower</w>
    assert _tok().tokens("ower") == _ids("ower</w>")
    assert _tok().tokens("cat") == _ids("cat</w>")


def test_pieces_contractions_single_digits_symbol_runs_and_lowercase():
    got = _tok(length=40).tokens("It'S 12 ab!?  CAT")
    want = _ids("i", "t</w>", "'", "s</w>", "1</w>", "2</w>", "a", "b</w>", "!", "?</w>", "cat</w>")
    assert got == want


def test_non_ascii_goes_through_the_byte_table():
    # é is U+00E9, UTF-8 c3 a9: two byte symbols, the last with </w>
    assert _tok().tokens("é") == _ids(BYTES[0xC3], BYTES[0xA9] + "</w>")


def test_missing_token_becomes_eos():
    vocab = _vocab(drop=("z</w>",))
    tok = _tok(vocab=vocab)
    assert tok.tokens("az") == [vocab["a"], vocab["<|endoftext|>"]]


# --- framing ---------------------------------------------------------------------------------------------

def test_encode_frames_pads_and_masks():
    v = _vocab()
    ids, mask = _tok(length=8).encode("cat lowx")
    bos, eos = v["<|startoftext|>"], v["<|endoftext|>"]
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    assert ids.tolist() == [bos, *_ids("cat</w>", "l", "ow", "x</w>"), eos, eos, eos]
    assert mask.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


def test_a_distinct_pad_id_fills_only_the_tail():
    v = _vocab()
    tok = ClipTokenizer(v, MERGES, length=6, bos=v["<|startoftext|>"], eos=v["<|endoftext|>"], pad=v["!"])
    ids, _ = tok.encode("cat")
    assert ids.tolist() == [v["<|startoftext|>"], v["cat</w>"], v["<|endoftext|>"], v["!"], v["!"], v["!"]]


def test_exactly_full_prompt_is_not_truncated(caplog):
    with caplog.at_level(logging.WARNING, logger="sam3.tokenizer"):
        ids, mask = _tok(length=5).encode("a b c")
    assert caplog.records == []
    assert mask.tolist() == [1] * 5 and ids[-1] == _vocab()["<|endoftext|>"]


def test_long_prompt_is_truncated_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="sam3.tokenizer"):
        ids, mask = _tok(length=5).encode("a b c d e")
    assert ids.tolist() == [_vocab()["<|startoftext|>"], *_ids("a</w>", "b</w>", "c</w>"), _vocab()["<|endoftext|>"]]
    assert mask.tolist() == [1] * 5
    (record,) = caplog.records
    assert "has 5 tokens; truncated to the first 3 (text_len 5" in record.getMessage()


# Empty prompts are framed as [bos, eos, pad...]: tests/test_tokenizer_framing.py.


def test_bad_prompt_type():
    with pytest.raises(TypeError, match=r"prompt must be a str, got bytes"):
        _tok().encode(b"cat")


# --- construction errors and the files -------------------------------------------------------------------

def test_bad_special_ids_and_length():
    v = _vocab()
    # Special ids outside the vocabulary are accepted: tests/test_tokenizer_framing.py.
    with pytest.raises(TokenizerError, match=r"text length 1: expected at least 2"):
        ClipTokenizer(v, MERGES, length=1, bos=0, eos=1, pad=1)


def test_merges_the_vocabulary_cannot_satisfy():
    with pytest.raises(TokenizerError, match=r"vocabulary \(\d+ tokens\) and merges \(8\) disagree"):
        ClipTokenizer(_vocab(), [*MERGES, ("q", "q")], length=8, bos=0, eos=1, pad=1)


def test_read_files(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps(_vocab()))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in MERGES) + "\n\n")
    assert read_merges(tmp_path / "merges.txt") == MERGES
    assert read_vocab(tmp_path / "vocab.json") == _vocab()
    v = _vocab()
    tok = ClipTokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", length=4,
                                   bos=v["<|startoftext|>"], eos=v["<|endoftext|>"], pad=v["<|endoftext|>"])
    assert tok.tokens("ower") == _ids("ower</w>")


def test_file_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "merges.txt"
    bad.write_text("#version: 0.2\na b\nc d e\n")
    with pytest.raises(TokenizerError, match=rf"{bad}:3: expected two symbols, got 3, in: 'c d e'"):
        read_merges(bad)
    with pytest.raises(TokenizerError, match=r"none\.txt: cannot read the merges"):
        read_merges(tmp_path / "none.txt")
    vocab = tmp_path / "vocab.json"
    vocab.write_text("[1, 2]")
    with pytest.raises(TokenizerError, match=r"expected a JSON object of token -> id, got list"):
        read_vocab(vocab)
    vocab.write_text('{"a": 0, "b": "x"}')
    with pytest.raises(TokenizerError, match=r"token 'b' has id 'x' \(expected a non-negative integer\)"):
        read_vocab(vocab)
    vocab.write_text("{")
    with pytest.raises(TokenizerError, match=r"cannot read the vocabulary"):
        read_vocab(vocab)


def test_from_bundle_reads_vocab_merges_and_params():
    v = _vocab()

    class Params:
        text_len, bos, eos, pad = 6, v["<|startoftext|>"], v["<|endoftext|>"], v["<|endoftext|>"]

    class FakeBundle:
        vocab, merges, params = v, MERGES, Params()

    ids, mask = ClipTokenizer.from_bundle(FakeBundle()).encode("cat")
    assert ids.tolist() == [Params.bos, v["cat</w>"], Params.eos, Params.pad, Params.pad, Params.pad]
    assert mask.tolist() == [1, 1, 1, 0, 0, 0]


# --- the CLIP vocabulary of the sam3-tiny fixture --------------------------------------------------------

@pytest.fixture(scope="module")
def clip():
    hf = _tiny("hf")
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    vocab = read_vocab(hf / "vocab.json")
    length = json.loads((hf / "config.json").read_text())["text_config"]["max_position_embeddings"]
    tok = ClipTokenizer(vocab, read_merges(hf / "merges.txt"), length=length, bos=vocab[cfg["bos_token"]],
                        eos=vocab[cfg["eos_token"]], pad=vocab[cfg["pad_token"]])
    return tok


@pytest.fixture(scope="module")
def reference():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_tiny("hf/tokenizer.json")))


def test_fixture_case_prompts_identical(clip):
    """The check line: every case prompt's ids and mask identical to the processor's."""
    ref = np.load(_tiny("reference.npz"))
    cases = json.loads(_tiny("cases.json").read_text())["cases"]
    for case in cases:
        ids, mask = clip.encode(case["prompt"])
        np.testing.assert_array_equal(ids, ref[f"case.{case['index']}.input_ids"])
        np.testing.assert_array_equal(mask, ref[f"case.{case['index']}.attention_mask"])


HAND_PROMPTS = [
    "a cat",
    "Hello   World!!",
    "it's the CAT'S toy, isn't it? we'll see, they'd've",
    "12345 apples and 3.14 pies",
    "café naïve Zürich",
    "cafe\u0301 (decomposed)",
    "  tabs\tand\nnewlines\u00a0nbsp\u2003em  ",
    "日本語のテキスト",
    "emoji 🐱🐶 ok",
    "²³ ½ Ⅻ İstanbul ΣΑΣ ǅ",
    "a-b_c.d/e@f#g",
    "'''quoted''' 'S 'LL",
    "<|endoftext|> then text",
    "one two three four five six seven eight nine ten " * 4,
]


@pytest.mark.parametrize("prompt", HAND_PROMPTS)
def test_matches_the_reference_tokenizer(clip, reference, prompt):
    enc = reference.encode(prompt)  # its post-processor adds bos ... eos
    want = enc.ids[:clip.length - 1] + [clip.eos] if len(enc.ids) > clip.length else enc.ids
    ids, mask = clip.encode(prompt)
    n = len(want)
    assert ids[:n].tolist() == want
    assert (ids[n:] == clip.pad).all()
    assert mask.tolist() == [1] * n + [0] * (clip.length - n)
