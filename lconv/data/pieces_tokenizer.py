"""A tokenizer for text that is already split into pieces (words or BPE units, separated by spaces): a vocabulary and
nothing else, for fairseq's published checkpoints (Moses + subword-nmt BPE). ``detokenize`` joins ``continuation``
pieces (``@@``) as ``--remove-bpe`` does; saved as ``<dir>/pieces.json`` (docs/fairseq.md)."""
from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from lconv import json_text
from lconv.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from lconv.errors import UserError

FILENAME = "pieces.json"
SPECIALS = {PAD_ID: "<pad>", EOS_ID: "</s>", UNK_ID: "<unk>", BOS_ID: "<s>"}


def content_ids(ids: np.ndarray | Sequence[int]) -> list[int]:
    """The ids a text is decoded from: up to the first EOS, without PAD and BOS."""
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
        if i == EOS_ID:
            break
        if i not in (PAD_ID, BOS_ID):
            out.append(int(i))
    return out


class PiecesTokenizer:
    """``encode(text) -> ids`` (no EOS) by whitespace pieces; ``detokenize(ids) -> text`` stops at EOS."""

    filename = FILENAME

    def __init__(self, symbols: Sequence[str], continuation: str = ""):
        self.symbols = [SPECIALS[i] for i in range(len(SPECIALS))] + list(symbols)
        self.continuation = continuation
        self._ids = {s: i for i, s in enumerate(self.symbols)}
        if len(self._ids) != len(self.symbols):
            raise UserError("a pieces vocabulary lists a symbol twice (or one of <pad> </s> <unk> <s>)")

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([self._ids.get(p, UNK_ID) for p in text.split()], np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def detokenize(self, ids: np.ndarray | Sequence[int]) -> str:
        text = " ".join(self.symbols[i] if 0 <= i < len(self.symbols) else SPECIALS[UNK_ID]
                        for i in content_ids(ids))
        if self.continuation:
            text = (text + " ").replace(self.continuation + " ", "").rstrip()
        return text

    decode = detokenize  # the name before "decode" came to mean the search alone; kept for code written then

    def to_bytes(self) -> bytes:
        return json.dumps({"symbols": self.symbols[len(SPECIALS):], "continuation": self.continuation},
                          ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, where: str = FILENAME) -> PiecesTokenizer:
        try:
            spec = json_text.loads(data.decode("utf-8"))
            symbols, continuation = spec["symbols"], spec.get("continuation", "")
            if not isinstance(symbols, list) or not isinstance(continuation, str):
                raise TypeError("its symbols are a list of strings and its continuation a string")
            odd = next((i for i, s in enumerate(symbols) if not isinstance(s, str)), None)
            if odd is not None:  # a number among them loaded, then failed at the first decoding
                raise TypeError(f"symbols[{odd}] is {json.dumps(symbols[odd])[:40]}, where a string belongs")
            return cls(symbols, continuation)
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"{where} is not a pieces vocabulary ({type(err).__name__}: {err})") from None
