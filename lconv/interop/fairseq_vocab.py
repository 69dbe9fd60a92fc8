"""fairseq's dictionary and SentencePiece model as one lconv tokenizer, and the id map between the two: pieces
re-ordered into ``dict.txt``'s order, the four specials at lconv's ids (``FAIRSEQ_TO_LCONV``), so text segments as in
fairseq. Details: docs/fairseq.md, "The vocabulary"."""
from __future__ import annotations

import dataclasses

import numpy as np

from lconv.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from lconv.data.pieces_tokenizer import PiecesTokenizer
from lconv.data.tokenizer import TOKENIZER_LIMIT, Tokenizer
from lconv.errors import UserError

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq ids 0..3
FAIRSEQ_TO_LCONV = {0: BOS_ID, 1: PAD_ID, 2: EOS_ID, 3: UNK_ID}  # every other id is the same in both


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    tokenizer: Tokenizer | PiecesTokenizer
    size: int  # rows of the embedding tables: 4 special ids + the dictionary's lines
    pieces_not_in_dictionary: int  # SentencePiece pieces fairseq would map to <unk> (docs/fairseq.md)


def read_dictionary(path: str) -> list[str]:
    """The symbols of a fairseq ``dict.txt``, in id order from id 4."""
    from etils import epath

    from lconv.data import paths

    paths.check_file(path)  # a pipe or a device: one line, not a hang
    try:
        lines = epath.Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read the fairseq dictionary {path}: {err}") from None
    symbols = []
    for number, line in enumerate(lines, 1):
        fields = line.rstrip("\n").split(" ")
        if len(fields) < 2 or not fields[1].lstrip("-").isdigit():
            raise UserError(f"{path}:{number}: not a fairseq dictionary line ('<symbol> <count>'): {line[:60]!r}")
        symbols.append(fields[0])
    if len(set(symbols)) != len(symbols):
        raise UserError(f"{path} lists a symbol twice; is it a fairseq dict.txt?")
    return symbols


def lconv_rows(table_VC: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """A table indexed by fairseq ids -> the same rows at lconv's ids; ``order``: the fairseq id of each lconv id
    (default: the four specials re-numbered)."""
    if order is None:
        order = np.arange(table_VC.shape[0])
        for fairseq_id, lconv_id in FAIRSEQ_TO_LCONV.items():
            order[lconv_id] = fairseq_id
    return table_VC[order]


def joined_symbols(source: list[str], target: list[str]) -> list[str]:
    """One vocabulary for separate dictionaries: the target's symbols first, then the source's others."""
    known = set(target)
    return target + [symbol for symbol in source if symbol not in known]


def lconv_ids(symbols: list[str], dictionary: list[str]) -> np.ndarray:
    """``[4 + len(dictionary)]``: the lconv id of each fairseq id of one side's ``dictionary``."""
    ids = {symbol: i + len(FAIRSEQ_SPECIALS) for i, symbol in enumerate(symbols)}
    return np.array([FAIRSEQ_TO_LCONV[i] for i in range(len(FAIRSEQ_SPECIALS))] + [ids[s] for s in dictionary])


def side_order(symbols: list[str], dictionary: list[str]) -> np.ndarray:
    """For each lconv id of ``symbols``, the fairseq id of its symbol in ``dictionary``, or its ``<unk>`` (3)."""
    ids = {symbol: i + len(FAIRSEQ_SPECIALS) for i, symbol in enumerate(dictionary)}
    order = np.array([FAIRSEQ_SPECIALS.index("<unk>")] * (len(FAIRSEQ_SPECIALS) + len(symbols)))
    for fairseq_id, lconv_id in FAIRSEQ_TO_LCONV.items():
        order[lconv_id] = fairseq_id
    for i, symbol in enumerate(symbols):
        order[len(FAIRSEQ_SPECIALS) + i] = ids.get(symbol, FAIRSEQ_SPECIALS.index("<unk>"))
    return order


def build_vocabulary(dictionary_path: str, spm_path: str | None, continuation: str = "@@",
                     symbols: list[str] | None = None) -> Vocabulary:
    """The lconv tokenizer equal to fairseq's SentencePiece model + ``dict.txt``, or the dictionary alone for pre-split
    text (``continuation``: BPE's marker); ``symbols``: pieces in id order, if not the file's."""
    symbols = read_dictionary(dictionary_path) if symbols is None else symbols
    clash = sorted(set(symbols) & set(FAIRSEQ_SPECIALS))
    if clash:
        raise UserError(f"{dictionary_path} lists fairseq's special symbols {clash}; they are implicit (ids 0-3)")
    if spm_path is None:
        return Vocabulary(PiecesTokenizer(symbols, continuation), 4 + len(symbols), 0)
    return _sentencepiece_vocabulary(symbols, spm_path, dictionary_path)


def _sentencepiece_vocabulary(symbols: list[str], spm_path: str, dictionary_path: str) -> Vocabulary:
    from etils import epath
    from sentencepiece import sentencepiece_model_pb2

    from lconv.data import paths

    # a pipe hung the import and /dev/zero was read until memory ran out: a regular file of a tokenizer's size
    data = paths.read_bytes(epath.Path(spm_path), "no such file; pass the spm.model the dictionary was made with",
                            limit=TOKENIZER_LIMIT)
    source = sentencepiece_model_pb2.ModelProto()
    try:
        source.ParseFromString(data)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, or another of its errors
        raise UserError(f"{spm_path} is not a SentencePiece model ({type(err).__name__}: {err})") from None
    Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
    by_text = {p.piece: p for p in source.pieces if p.type in (Piece.NORMAL, Piece.USER_DEFINED, Piece.BYTE)}
    model = sentencepiece_model_pb2.ModelProto()
    model.CopyFrom(source)
    del model.pieces[:]
    specials = {PAD_ID: ("<pad>", Piece.CONTROL), EOS_ID: ("</s>", Piece.CONTROL), UNK_ID: ("<unk>", Piece.UNKNOWN),
                BOS_ID: ("<s>", Piece.CONTROL)}
    for i in range(len(specials)):
        model.pieces.add(piece=specials[i][0], score=0.0, type=specials[i][1])
    for symbol in symbols:
        known = by_text.get(symbol)
        model.pieces.add(piece=symbol, score=known.score if known else 0.0, type=known.type if known else Piece.UNUSED)
    missing = [p for text, p in by_text.items() if text not in set(symbols)]
    for piece in missing:
        model.pieces.add(piece=piece.piece, score=piece.score, type=Piece.UNUSED)
    spec = model.trainer_spec
    spec.pad_id, spec.eos_id, spec.unk_id, spec.bos_id = PAD_ID, EOS_ID, UNK_ID, BOS_ID
    spec.pad_piece, spec.eos_piece, spec.unk_piece, spec.bos_piece = "<pad>", "</s>", "<unk>", "<s>"
    spec.vocab_size = len(model.pieces)
    try:
        tokenizer = Tokenizer(model.SerializeToString())
    except Exception as err:  # noqa: BLE001 - SentencePiece's own check of the rebuilt model, e.g. its byte pieces
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{spm_path} does not fit {dictionary_path}: SentencePiece refuses the model rebuilt in the "
                        f"dictionary's order ({reason}); pass the spm.model the dictionary was made with") from None
    return Vocabulary(tokenizer, 4 + len(symbols), len(missing))
