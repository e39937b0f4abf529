"""The tokenizer's framing as taconite-sam3 frames it (docs/sam3-host.md 4.3): an empty or all-whitespace prompt is
[bos, eos, pad...] with mask [1, 1, 0...]; a long prompt keeps bos, its first text_len - 2 tokens and eos; the
special ids may lie outside the vocabulary. A `tok_test` with an empty prompt passes `sam3 check`; `sam3 segment`
refuses an empty prompt on the command line while the Python API encodes it.

Oracles: the generated vocabulary of tests/test_sam3_tokenizer.py, whose ids are worked out by hand below (256
byte symbols by byte value, 256 `</w>` symbols at 256 + byte, the 7 merges at 512..518, then <|startoftext|> 519
and <|endoftext|> 520), and tok.<i> tensors written by hand from the manifest's bos, eos and pad.
"""

from __future__ import annotations

import io
import logging
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_sam3_tokenizer import MERGES, _vocab

from sam3 import build, text
from sam3.check import run_check
from sam3.cli import main
from sam3.pipeline import Sam3
from sam3.tokenizer import ClipTokenizer, TokenizerError

BOS, EOS = 519, 520
PAD = 33  # "!" (byte 0x21)
A, B, C, D = 256 + 97, 256 + 98, 256 + 99, 256 + 100  # "a</w>" .. "d</w>"


def _tok(length: int, bos: int = BOS, eos: int = EOS, pad: int = PAD, vocab: dict[str, int] | None = None):
    return ClipTokenizer(_vocab() if vocab is None else vocab, MERGES, length=length, bos=bos, eos=eos, pad=pad)


def test_the_hand_ids_are_the_vocabulary_s():
    v = _vocab()
    assert (v["<|startoftext|>"], v["<|endoftext|>"], v["!"]) == (BOS, EOS, PAD)
    assert (v["a</w>"], v["d</w>"], v["l"], v["ow"], v["cat</w>"]) == (A, D, 108, 512, 518)


@pytest.mark.parametrize("prompt", ["", " ", "   ", "\t\n ", "\u3000\u00a0\u2028"])
def test_an_empty_prompt_is_bos_eos_and_padding(prompt):
    tok = _tok(8)
    assert tok.tokens(prompt) == []
    ids, mask = tok.encode(prompt)
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    assert ids.tolist() == [BOS, EOS, PAD, PAD, PAD, PAD, PAD, PAD]
    assert mask.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]


def test_the_shortest_length_holds_an_empty_prompt_exactly():
    ids, mask = _tok(2).encode("")
    assert ids.tolist() == [BOS, EOS] and mask.tolist() == [1, 1]


@pytest.mark.parametrize("length, prompt, kept", [
    (6, "a b c d e f", [A, B, C, D]),           # six one-token words: the first four kept
    (4, "lowx", [108, 512]),                     # l ow x</w>: cut inside a word
    (3, "cat cat", [518]),
])
def test_a_long_prompt_keeps_bos_its_first_tokens_and_eos(length, prompt, kept, caplog):
    with caplog.at_level(logging.WARNING, logger="sam3.tokenizer"):
        ids, mask = _tok(length).encode(prompt)
    assert ids.tolist() == [BOS, *kept, EOS]
    assert mask.tolist() == [1] * length
    assert len(caplog.records) == 1 and f"truncated to the first {length - 2}" in caplog.records[0].getMessage()


def test_special_ids_outside_the_vocabulary_frame_and_stand_in():
    vocab = _vocab()
    del vocab["z</w>"]  # ids stay as they were: z</w> (256 + 122) is now unknown
    tok = _tok(8, bos=70000, eos=70001, pad=70002, vocab=vocab)
    ids, mask = tok.encode("cat z")
    assert ids.tolist() == [70000, 518, 70001, 70001, 70002, 70002, 70002, 70002]  # the unknown z is eos
    assert mask.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert tok.encode("")[0].tolist() == [70000, 70001, *[70002] * 6]
    # With no vocabulary token for eos, "<|endoftext|>" is ordinary text, as the reference splits it:
    # pieces "<|", "endoftext", "|>"; no merge applies to any of them.
    want = [ord("<"), 256 + ord("|"), *map(ord, "endofte"), ord("x"), 256 + ord("t"), ord("|"), 256 + ord(">")]
    assert tok.tokens("<|endoftext|>") == want
    # The special ids of the vocabulary still stand for their text.
    assert _tok(8).tokens("<|endoftext|>") == [EOS]


@pytest.mark.parametrize("name, value", [("bos", -1), ("eos", 1 << 31), ("pad", 2.0), ("pad", True)])
def test_a_special_id_must_fit_the_int32_ids(name, value):
    kw = {"bos": BOS, "eos": EOS, "pad": PAD, name: value}
    with pytest.raises(TokenizerError, match=rf"^{name} id {value!r} is not a token id \(an integer in "
                                             rf"0\.\.2147483647\)$"):
        ClipTokenizer(_vocab(), MERGES, length=8, **kw)


# -------------------------------------------------------------------------------------------------------
# `sam3 check`, `sam3 segment` and the Python API on a generated bundle
# -------------------------------------------------------------------------------------------------------

def _param(root: Path, name: str) -> int:
    line = next(ln for ln in (root / "manifest.txt").read_text().splitlines() if ln.startswith(f"param {name} "))
    return int(line.split()[2])


def _append_tensors(root: Path, tensors: dict[str, np.ndarray]) -> None:
    """Appends int32 tensors to tensors.bin, each at a 64-byte aligned offset, and their lines to tensors.txt."""
    index = (root / "tensors.txt").read_text()
    with open(root / "tensors.bin", "ab") as f:
        for name, arr in tensors.items():
            f.write(bytes(-f.tell() % 64))
            index += f"{name} i32 {arr.size} {f.tell()} {arr.size * 4}\n"
            f.write(struct.pack(f"<{arr.size}i", *arr.tolist()))
    (root / "tensors.txt").write_text(index)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    return build.build(tmp_path_factory.mktemp("framing") / "b", "tiny", variant="host")


def test_a_tok_test_with_an_empty_prompt_passes_sam3_check(generated, tmp_path):
    root = tmp_path / "b"
    shutil.copytree(generated, root)
    n, bos, eos, pad = (_param(root, k) for k in ("text_len", "bos", "eos", "pad"))
    before = sum(ln.startswith("tok_test ") for ln in (root / "manifest.txt").read_text().splitlines())
    with open(root / "manifest.txt", "a") as f:
        f.write("tok_test 90\ntok_test 91 \\u3000\\t \n")  # no prompt; U+3000, TAB and a space
    framed = np.array([bos, eos] + [pad] * (n - 2), np.int32)
    ones = np.array([1, 1] + [0] * (n - 2), np.int32)
    _append_tensors(root, {"tok.90.ids": framed, "tok.90.mask": ones, "tok.91.ids": framed, "tok.91.mask": ones})
    out = io.StringIO()
    report = run_check(root, "emu", out=out)
    line = next(ln for ln in report.lines if ln.name == "tokenizer")
    assert line.status == "ok", line.detail
    assert line.detail == f"{before + 2}/{before + 2} prompts identical"
    assert report.ok, out.getvalue()


def test_sam3_segment_refuses_an_empty_prompt_in_one_line(generated, tmp_path, capsys):
    image = tmp_path / "scene.png"
    Image.fromarray(np.zeros((9, 11, 3), np.uint8)).save(image)
    for prompt in ("", "\u3000 \t"):
        code = main(["segment", str(generated), str(image), "a cat", prompt, "--device", "emu"])
        out, err = capsys.readouterr()
        assert code == 1 and out == "", out
        assert err.strip().splitlines() == [f"sam3 segment: prompt {prompt!r} is empty: nothing to segment"]


def test_the_python_api_encodes_an_empty_prompt(generated, tmp_path):
    n, bos, eos, pad = (_param(generated, k) for k in ("text_len", "bos", "eos", "pad"))
    image = tmp_path / "scene.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (9, 11, 3), dtype=np.uint8)).save(image)
    with Sam3(generated, "emu") as sam:
        prompt = sam.encode_prompt("")
        assert prompt.ids.tolist() == [bos, eos] + [pad] * (n - 2)
        assert prompt.mask.tolist() == [1, 1] + [0] * (n - 2)
        want = text.encode_text(prompt.ids, prompt.mask, sam.bundle.tensors, sam.bundle.params)
        np.testing.assert_array_equal(prompt.feats, want)
        assert prompt.feats[:2].any() and not prompt.feats[2:].any()
        result = sam.segment(image, "   ", threshold=0.0)
    assert len(result.instances) == sam.bundle.params.queries
