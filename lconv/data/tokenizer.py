"""SentencePiece tokenizer: one joint model, trained from training-split text, saved in the run's workdir.

Trained with ``lconv.constants``' special ids; ``<workdir>/spm.model`` is reused by a resumed or evaluation run.
Normalisation is ``identity`` with ``byte_fallback``, so BLEU and ROUGE see the text, not an NFKC variant.
"""
from __future__ import annotations

import io
import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from lconv.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from lconv.data.pieces_tokenizer import PiecesTokenizer, content_ids
from lconv.errors import UserError

MODEL_FILENAME = "spm.model"
DEFAULT_MAX_TRAIN_SENTENCES = 200_000  # sentences sampled for training: bounded, so training takes seconds
TOKENIZER_LIMIT = 256 << 20  # bytes: a SentencePiece model or pieces.json of any real vocabulary is far smaller
_MAX_SENTENCE_CHARS = 4096  # longer training lines are cut (SentencePiece would skip them)
# Names how ``train_tokenizer`` makes a model: a kept tokenizer is reused only under the same version.
TRAINING_VERSION = 2  # 2: the seeded, uniform sample (1: every k-th text)
_BYTE_PIECES = 256  # byte_fallback: one piece per byte value, so any text encodes without UNK
# The smallest vocabulary SentencePiece can train: the special, byte and word-boundary pieces and one character.
MIN_VOCAB_SIZE = len({PAD_ID, EOS_ID, UNK_ID, BOS_ID}) + _BYTE_PIECES + 2


class Tokenizer:
    """A loaded SentencePiece model. ``encode`` returns int32 ids without EOS; ``detokenize`` stops at EOS."""

    filename = MODEL_FILENAME

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self.model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if (self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id(), self._sp.bos_id()) != (
                PAD_ID, EOS_ID, UNK_ID, BOS_ID):
            raise UserError("tokenizer model has other special ids than PAD=0 EOS=1 UNK=2 BOS=3; retrain it "
                             "with lconv.data.tokenizer.train_tokenizer")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def requested_vocab_size(self) -> int:
        """The vocab_size it was trained for: ``vocab_size`` or, from a corpus too small for it, more."""
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(self.model_proto)
        return int(model.trainer_spec.vocab_size) or self.vocab_size

    def encode(self, text: str) -> np.ndarray:
        """text -> ids [n] int32, no EOS."""
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(list(texts))]

    def detokenize(self, ids: np.ndarray | Sequence[int]) -> str:
        """ids [n] -> text; stops at the first EOS, ignores PAD and BOS (ready for BLEU/ROUGE)."""
        return self._sp.decode(content_ids(ids))

    decode = detokenize  # the name before "decode" came to mean the search alone; kept for code written then

    def to_bytes(self) -> bytes:
        return self.model_proto

    def save(self, directory: str) -> str:
        return save_tokenizer(self, directory)


def check_texts(texts: Any, argument: str) -> list[str]:
    """``texts`` as a list of str that encode as UTF-8, or a one-line ``UserError`` naming the index."""
    if isinstance(texts, (str, bytes, bytearray)) or not isinstance(texts, Sequence):
        raise UserError(f"{argument}: must be a list of strings; got {type(texts).__name__}")
    for i, text in enumerate(texts):
        check_text(text, f"{argument}[{i}]")
    return list(texts)


def check_text(text: Any, name: str) -> str:
    """``text`` if it is a str that UTF-8 can hold, else a one-line ``UserError`` naming ``name``."""
    if not isinstance(text, str):
        hint = " (decode bytes to str first)" if isinstance(text, (bytes, bytearray)) else ""
        raise UserError(f"{name}: must be a string; got {type(text).__name__}{hint}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"{name}: character {err.start} ({text[err.start]!r}) is a lone surrogate, not text that "
                        "UTF-8 can hold (a file read with errors='surrogateescape'?); decode the input as UTF-8") \
            from None
    return text


def save_tokenizer(tokenizer: Tokenizer | PiecesTokenizer, directory: str) -> str:
    """Writes ``<directory>/<tokenizer.filename>`` atomically (``lconv.outputs.write_atomically``)."""
    from etils import epath

    from lconv import outputs

    epath.Path(directory).mkdir(parents=True, exist_ok=True)
    outputs.write_atomically(epath.Path(directory) / tokenizer.filename, tokenizer.to_bytes())
    return str(epath.Path(directory) / tokenizer.filename)


def tokenizer_from_bytes(filename: str, data: bytes) -> Tokenizer | PiecesTokenizer:
    """The tokenizer a saved file holds, by its name: ``spm.model`` or ``pieces.json``."""
    return PiecesTokenizer.from_bytes(data, filename) if filename.endswith(PiecesTokenizer.filename) \
        else Tokenizer(data)


def tokenizer_path(directory: str) -> str:
    return f"{str(directory).rstrip('/')}/{MODEL_FILENAME}"


def load_tokenizer(directory: str) -> Tokenizer | PiecesTokenizer:
    """The workdir's SentencePiece model, or an imported model's pieces vocabulary (``lconv.data.pieces_tokenizer``)."""
    from etils import epath

    for name in (Tokenizer.filename, PiecesTokenizer.filename):
        path = epath.Path(directory) / name
        if path.exists() or os.path.islink(os.fspath(path)):  # a dangling link is named, not skipped
            return read_tokenizer(path, within=directory)
    raise UserError(f"no tokenizer at {tokenizer_path(directory)}; train one with "
                    "lconv.data.tokenizer.load_or_train")


def read_tokenizer(path: Any, within: Any = None, data: bytes | None = None) -> Tokenizer | PiecesTokenizer:
    """The tokenizer the file ``path`` holds (``data``: its bytes, already read and checked); a missing, bad or
    out-of-``within`` file is one line naming it."""
    from lconv.data import paths

    if data is None:
        data = paths.read_bytes(path, "missing; restore it from a copy", within=within, limit=TOKENIZER_LIMIT)
    if not data:
        raise UserError(f"{path}: empty (a write cut short?); restore it from a copy")
    try:
        return tokenizer_from_bytes(str(path), data)
    except UserError as err:  # the special ids, or a pieces.json that names itself
        raise UserError(str(err) if str(path) in str(err) else f"{path}: {err}") from None
    except (RuntimeError, ValueError):  # SentencePiece's parser; a piece that is not UTF-8 (UnicodeDecodeError)
        raise UserError(f"{path}: not a SentencePiece model ({len(data):,} bytes; truncated or damaged); restore "
                        "it from a copy: the model it belongs to fits no other tokenizer") from None


def load_or_train(directory: str, texts: Iterable[str], vocab_size: int, *,
                  max_sentences: int = DEFAULT_MAX_TRAIN_SENTENCES, save: bool = True) -> Tokenizer:
    """Loads ``<directory>/spm.model`` if it exists (its vocab size must match), else trains and saves it."""
    from etils import epath

    from lconv.data import paths

    paths.check_url(directory, "workdir")
    if epath.Path(tokenizer_path(directory)).exists():
        tokenizer = load_tokenizer(directory)
        if tokenizer.requested_vocab_size != vocab_size:
            raise UserError(f"vocab_size={vocab_size} but {tokenizer_path(directory)} was trained for "
                            f"{tokenizer.requested_vocab_size}; use the same vocab_size or a fresh workdir")
        return tokenizer
    tokenizer = train_tokenizer(texts, vocab_size, max_sentences=max_sentences)
    if save:
        tokenizer.save(directory)
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, max_sentences: int = DEFAULT_MAX_TRAIN_SENTENCES,
                    model_type: str = "unigram", character_coverage: float = 0.9995,
                    num_threads: int = 2) -> Tokenizer:
    """Trains a joint SentencePiece model in memory on a bounded, deterministic sample of ``texts``."""
    import sentencepiece as spm

    if vocab_size < MIN_VOCAB_SIZE:
        raise UserError(f"vocab_size={vocab_size} is below {MIN_VOCAB_SIZE}, the smallest the tokenizer can have "
                        f"({_BYTE_PIECES} byte pieces, 4 special ids, the word boundary and a character)")
    sample = sample_sentences(texts, max_sentences)
    if not sample:
        raise UserError("texts is empty; the tokenizer needs training-split text")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            character_coverage=character_coverage, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=BOS_ID,
            pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", bos_piece="<s>",
            normalization_rule_name="identity", byte_fallback=True, hard_vocab_limit=False,
            max_sentence_length=_MAX_SENTENCE_CHARS * 4, num_threads=num_threads, minloglevel=2,
            train_extremely_large_corpus=False, shuffle_input_sentence=False)
    except RuntimeError as e:
        if "required_chars" in str(e):
            raise UserError(f"vocab_size={vocab_size} is smaller than the characters the text needs "
                             f"({str(e).split('. ')[-2]}); raise vocab_size or lower character_coverage") from e
        raise
    return Tokenizer(_record_requested_size(model.getvalue(), vocab_size))


def _record_requested_size(model_proto: bytes, vocab_size: int) -> bytes:
    """The model with ``vocab_size`` recorded as asked, so a resumed run asking the same size reuses it."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    if model.trainer_spec.vocab_size == vocab_size:
        return model_proto
    model.trainer_spec.vocab_size = vocab_size
    return model.SerializeToString()


def sample_sentences(texts: Iterable[str], max_sentences: int) -> list[str]:
    """A seeded, uniform sample of at most max_sentences non-empty texts, in order, each cut short."""
    if max_sentences < 1:
        raise UserError(f"max_sentences={max_sentences} must be >= 1 (tokenizer_max_sentences: the sentences the "
                        "tokenizer is trained on)")
    pool = [t[:_MAX_SENTENCE_CHARS] for t in itertools.islice(texts, max_sentences * 4) if t and t.strip()]
    if len(pool) <= max_sentences:
        return pool
    keep = np.sort(np.random.default_rng(0).choice(len(pool), max_sentences, replace=False))
    return [pool[i] for i in keep]
