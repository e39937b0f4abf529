"""CLIP byte-level BPE tokenizer over a bundle's ``vocab.json`` and ``merges.txt`` (docs/sam3-host.md 4).

The normaliser, pre-tokeniser and BPE run in the ``tokenizers`` library, built here from the two files with
the CLIP rules spelled out (NFC, whitespace runs collapsed, lowercase; contractions, letter runs, single
digits, other-symbol runs; GPT-2's byte-to-unicode map; ``</w>`` on each word's last symbol). This module
adds the model's framing: [bos] + tokens + [eos], padded with ``pad`` to ``length``, and the mask; an empty
prompt is [bos, eos] and padding (docs/sam3-host.md 4.3). The bos and eos tokens' own text inside a prompt
(``<|endoftext|>``) encodes as those ids when the vocabulary has them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

from amdxdna_direct.errors import Error

log = logging.getLogger(__name__)

# docs/sam3-host.md 4.2: at each position, in this order: a contraction, a run of letters, ONE numeric
# character, a run of other non-space characters. Whitespace between pieces is dropped.
PIECE_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"
END_OF_WORD = "</w>"
# The BPE's unknown token: no vocabulary symbol, since byte-level symbols never hold NUL. Its id is mapped to
# eos after encoding, so eos need not be a vocabulary id (docs/sam3-host.md 4.2).
_UNKNOWN = "\0unknown"
# Token ids are int32 arrays, as a bundle's tok.<i>.ids tensors are (docs/sam3-host.md 4.3).
_ID_MAX = (1 << 31) - 1


class TokenizerError(Error, ValueError):
    """A vocabulary or merges file that cannot be used, bad special ids, or a prompt that cannot be encoded."""


def read_vocab(path: str | Path) -> dict[str, int]:
    """Read ``vocab.json``: a flat JSON object from token string to id.

    Raises:
        TokenizerError: the file is missing, not JSON, or not an object of string -> non-negative integer.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read the vocabulary: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object of token -> id, got {type(data).__name__}")
    bad = [(k, v) for k, v in data.items() if type(v) is not int or v < 0]
    if bad:
        raise TokenizerError(f"{path}: token {bad[0][0]!r} has id {bad[0][1]!r} (expected a non-negative integer)")
    return data


def read_merges(path: str | Path) -> list[tuple[str, str]]:
    """Read ``merges.txt``: one ``left right`` pair per line, rank = order; empty and ``#version`` lines skipped.

    Raises:
        TokenizerError: the file is missing or not UTF-8, or a line does not hold exactly two symbols.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read the merges: {exc}") from exc
    merges = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#version"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{path}:{number}: expected two symbols, got {len(parts)}, in: {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


class ClipTokenizer:
    """CLIP BPE with SAM3's framing: ``encode(prompt)`` -> (ids, mask), int32 arrays of ``length``.

    Args:
        vocab: token string -> id (``vocab.json``).
        merges: the merge pairs in rank order (``merges.txt``).
        length: the model's token count L (``text_len``), at least 2.
        bos, eos, pad: the special ids, any in 0..2^31-1, vocabulary ids or not (eos also stands for a symbol
            the vocabulary lacks).

    Raises:
        TokenizerError: ``length`` < 2, a special id outside 0..2^31-1, or merges the vocabulary cannot satisfy
            (a pair or its result missing from it).
    """

    def __init__(self, vocab: Mapping[str, int], merges: Sequence[tuple[str, str]], *, length: int, bos: int,
                 eos: int, pad: int) -> None:
        if length < 2:
            raise TokenizerError(f"text length {length}: expected at least 2 (bos and eos)")
        for name, value in (("bos", bos), ("eos", eos), ("pad", pad)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _ID_MAX:
                raise TokenizerError(f"{name} id {value!r} is not a token id (an integer in 0..{_ID_MAX})")
        self.length = length
        self.bos, self.eos, self.pad = bos, eos, pad
        by_id = {i: tok for tok, i in vocab.items()}
        unknown = _UNKNOWN
        while unknown in vocab:  # only a hand-made vocabulary could hold it
            unknown += "?"
        self._unknown = max(by_id, default=-1) + 1
        # A merge that is not a pair is refused by the BPE constructor, which _build reports as a TokenizerError.
        pairs = cast(list[tuple[str, str]], [tuple(m) for m in merges])
        self._tok = _build({**vocab, unknown: self._unknown}, pairs, unknown=unknown)
        # The special tokens' own text in a prompt stands for them, as in the model's tokenizer.
        specials = [AddedToken(by_id[i], normalized=False, special=True) for i in (bos, eos) if i in by_id]
        self._tok.add_special_tokens(specials)

    @classmethod
    def from_files(cls, vocab_path: str | Path, merges_path: str | Path, *, length: int, bos: int, eos: int,
                   pad: int) -> ClipTokenizer:
        """Build from ``vocab.json`` and ``merges.txt``.

        Raises:
            TokenizerError: as ``read_vocab``, ``read_merges`` and the constructor.
        """
        return cls(read_vocab(vocab_path), read_merges(merges_path), length=length, bos=bos, eos=eos, pad=pad)

    @classmethod
    def from_bundle(cls, bundle: Any) -> ClipTokenizer:
        """Build from an open bundle: its ``vocab``, ``merges`` and the params ``text_len``, ``bos``, ``eos``, ``pad``.

        Raises:
            TokenizerError: as the constructor.
        """
        p = bundle.params
        return cls(bundle.vocab, bundle.merges, length=p.text_len, bos=p.bos, eos=p.eos, pad=p.pad)

    def tokens(self, prompt: str) -> list[int]:
        """The BPE token ids of ``prompt``, without bos/eos; a token missing from the vocabulary is eos.

        Raises:
            TypeError: ``prompt`` is not a str.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        ids = np.array(self._tok.encode(prompt, add_special_tokens=False).ids, dtype=np.int64)
        ids[ids == self._unknown] = self.eos
        out: list[int] = ids.tolist()
        return out

    def encode(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """[bos] + tokens + [eos], padded with ``pad`` to ``length``; mask 1 over bos..eos, 0 after.

        An empty or all-whitespace prompt has no tokens: [bos, eos, pad, ...], mask [1, 1, 0, ...], as the
        reference frames it (docs/sam3-host.md 4.3). A prompt of more than ``length - 2`` tokens keeps its first
        ``length - 2`` and logs a warning.

        Raises:
            TypeError: ``prompt`` is not a str.
        """
        ids = self.tokens(prompt)
        room = self.length - 2
        if len(ids) > room:
            log.warning("prompt %r has %d tokens; truncated to the first %d (text_len %d holds bos + %d + eos)",
                        prompt, len(ids), room, self.length, room)
            ids = ids[:room]
        out = np.full(self.length, self.pad, dtype=np.int32)
        out[0] = self.bos
        out[1:len(ids) + 1] = ids
        out[len(ids) + 1] = self.eos
        mask = np.zeros(self.length, dtype=np.int32)
        mask[:len(ids) + 2] = 1
        return out, mask


def _build(vocab: dict[str, int], merges: list[tuple[str, str]], unknown: str) -> Tokenizer:
    """The ``tokenizers`` pipeline of docs/sam3-host.md 4.2, with ``unknown`` for symbols missing from ``vocab``."""
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unknown, end_of_word_suffix=END_OF_WORD,
                         fuse_unk=False)
    except Exception as exc:  # tokenizers raises its own exception type, not a ValueError
        raise TokenizerError(f"vocabulary ({len(vocab)} tokens) and merges ({len(merges)}) disagree: {exc}") from exc
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([
        normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip(), normalizers.Lowercase(),
    ])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return tok
