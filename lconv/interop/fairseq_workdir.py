"""A fairseq checkpoint written as an lconv workdir (``python -m lconv.import_fairseq``) that ``eval.py``,
``lconv.load`` and the study read like a trained run: ``config.json`` (decoding as fairseq-generate's), ``spm.model``
(``fairseq_vocab``), one params checkpoint checked shape by shape against the model's tree, and ``imported.json`` (where
it came from). The layout: docs/fairseq.md, "What the import writes"."""
from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax.linen import meta as nn_meta

from lconv import outputs
from lconv.data import paths, sources
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.interop import fairseq, fairseq_lm, fairseq_vocab
from lconv.run import schema

logger = logging.getLogger(__name__)

IMPORT_RECORD = "imported.json"


# fairseq-generate's defaults, written as config.decode unless the import is told the settings a model is used with
GENERATE_DEFAULTS = {"beam_size": 5, "lenpen": 1.0, "max_len_a": 0.0, "max_len_b": 200}
# and the scoring: tokenized BLEU with compound splitting (the paper's WMT En-De number) or without
SCORING_DEFAULTS = {"compound_split": False}


def import_checkpoint(checkpoint: str, dictionary: str, spm: str | None, workdir: str, *, dataset: str = "",
                      decode: dict[str, Any] | None = None, continuation: str = "@@", target_dictionary: str = "",
                      trust: bool = False) -> dict[str, Any]:
    """Writes ``workdir`` from a fairseq translation or LM checkpoint; returns the import record. ``decode``: over
    ``GENERATE_DEFAULTS``; ``spm=None``: text split into the dictionary's pieces; ``target_dictionary``: for separate
    dictionaries."""
    from lconv.run import checkpoints, model_setup
    from lconv.run import workdir as workdir_lib

    outputs.check_directory(workdir, "workdir", "--workdir")  # before the checkpoint is read; nothing written
    schema.check_decode(decode or {}, spell=lambda name: f"--{name}")  # --lenpen=nan: one line, not a NaN config
    if checkpoints.has_checkpoint(workdir):
        raise UserError(f"{workdir} already holds checkpoints; import into a new --workdir")
    weights, args, updates = fairseq.read_checkpoint(checkpoint, trust=trust)
    if fairseq.is_language_model(args):
        vocab = fairseq_vocab.build_vocabulary(dictionary, spm, continuation)
        _check_language_model_vocabulary(weights, vocab.size, dictionary)
        fields = fairseq_lm.model_fields(args, vocab.size)
        config = language_model_config(fields, dataset)
        params = fairseq_lm.lconv_params(weights, fields)
    else:
        vocab, orders = _vocabulary(weights, dictionary, target_dictionary, spm, continuation)
        fields = fairseq.model_fields(args, vocab.size)
        if orders is not None and fields["share_embeddings"]:
            raise UserError(f"{target_dictionary} differs from {dictionary}, but the checkpoint shares all "
                            "embeddings (fairseq's --share-all-embeddings needs one joined dictionary): is it the "
                            "one it was trained with?")
        if orders is not None:  # the target's ids come first; the decoder predicts only them
            fields["output_vocab_size"] = 4 + len(fairseq_vocab.read_dictionary(target_dictionary))
        config = translation_config(fields, dataset, decode)
        params = fairseq.lconv_params(weights, fields, orders)
    typed = schema.validate_config(config)
    sources.config_spec(typed.data)  # --dataset names one, as train.py checks it: not stored for eval.py to find
    model = model_setup.build_model(typed, vocab.size)
    boxed = _as_model_tree(model, typed, params)
    workdir = workdir_lib.make_workdir(workdir)
    workdir_lib.write_config(workdir_lib.as_record(config), workdir, {}, has_checkpoint=False)
    tokenizer_lib.save_tokenizer(vocab.tokenizer, workdir)
    step = max(updates, 1)
    saver = checkpoints.Checkpointer(workdir)
    saver.save(step, {"params": boxed}, {"imported_from": str(checkpoint)}, force=True)
    saver.close()
    record = {"checkpoint": str(checkpoint), "sha256": paths.sha256(checkpoint), "dictionary": str(dictionary),
              "spm": None if spm is None else str(spm), "tokenizer": vocab.tokenizer.filename,
              "updates": updates, "step": step, "arch": args.get("arch"),
              "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
              "spm_pieces_not_in_dictionary": vocab.pieces_not_in_dictionary,
              "imported_at": datetime.datetime.now().isoformat(timespec="seconds"),
              "fairseq_model_args": {k: v for k, v in args.items() if _jsonable(v)}}
    workdir_lib.write_atomically(epath.Path(workdir) / IMPORT_RECORD, json.dumps(record, indent=2, sort_keys=True))
    logger.info(f"imported {args.get('arch')} ({record['parameters']:,} parameters, {updates} updates) into {workdir}")
    if vocab.pieces_not_in_dictionary:
        logger.info(f"note: {vocab.pieces_not_in_dictionary} SentencePiece pieces are not in {dictionary}; "
                    "fairseq maps them to <unk>, lconv's tokenizer segments around them")
    return record


def _vocabulary(weights: Mapping[str, np.ndarray], dictionary: str, target_dictionary: str, spm: str | None,
                continuation: str) -> tuple[fairseq_vocab.Vocabulary, dict[str, np.ndarray] | None]:
    """lconv's one vocabulary, and for separate source and target dictionaries each side's row order: the target's
    symbols, then the source's others, a missing symbol reading that side's <unk> row as fairseq maps it."""
    source = fairseq_vocab.read_dictionary(dictionary)
    target = fairseq_vocab.read_dictionary(target_dictionary) if target_dictionary else source
    rows = {side: weights.get(f"{side}.embed_tokens.weight", np.zeros((0, 0))).shape[0]
            for side in ("encoder", "decoder")}
    if target == source and rows["encoder"] != rows["decoder"]:
        raise UserError(f"the checkpoint's source and target dictionaries differ ({rows['encoder']} and "
                        f"{rows['decoder']} embedding rows: fairseq-preprocess without --joined-dictionary); give "
                        "the target side's dict.txt too (--target_dict)")
    paths = {"encoder": (dictionary, source), "decoder": (target_dictionary or dictionary, target)}
    for side, (path, symbols) in paths.items():
        if rows[side] != 4 + len(symbols):
            raise UserError(f"{path} gives {4 + len(symbols)} ids (4 special + {len(symbols)} lines) but the "
                            f"checkpoint's {side} embeddings have {rows[side]} rows: the dictionary it was trained "
                            "with is needed")
    if target == source:
        return fairseq_vocab.build_vocabulary(dictionary, spm, continuation), None
    symbols = fairseq_vocab.joined_symbols(source, target)
    vocab = fairseq_vocab.build_vocabulary(dictionary, spm, continuation, symbols=symbols)
    return vocab, {"encoder": fairseq_vocab.side_order(symbols, source),
                   "decoder": fairseq_vocab.side_order(symbols, target)}


def _check_language_model_vocabulary(weights: Mapping[str, np.ndarray], size: int, dictionary: str) -> None:
    """The dictionary must number the embedding's rows (all bands' rows with adaptive input)."""
    bands = [weights[k].shape[0] for k in weights  # keys first: only the bands' tensors are read
             if k.startswith("decoder.embed_tokens.embeddings.") and k.endswith(".0.weight")]
    rows = sum(bands) if bands else weights.get("decoder.embed_tokens.weight", np.zeros((0, 0))).shape[0]
    if rows != size:
        raise UserError(f"{dictionary} gives {size} ids (4 special + {size - 4} lines) but the checkpoint's "
                        f"embeddings have {rows} rows: the dictionary it was trained with is needed")


def language_model_config(fields: dict[str, Any], dataset: str = "") -> ml_collections.ConfigDict:
    """lconv's base config as a language model with the imported ``model`` (dots at "highest")."""
    config = _imported_config("lm", fields)
    config.data.dataset = dataset or "lm1b"
    config.data.max_target_length = config.data.eval_max_target_length = int(fields["max_len"])
    return config


def translation_config(fields: dict[str, Any], dataset: str = "",
                       decode: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
    """lconv's base config with the imported ``model`` (dots at "highest") and fairseq-generate's decoding."""
    config = _imported_config("translation", fields)
    if dataset:
        config.data.dataset = dataset
    # fairseq caps positions at max_*_positions; lconv cuts longer inputs and counts them
    config.data.eval_max_input_length = config.data.eval_max_target_length = int(fields["max_len"])
    if fields.get("output_vocab_size"):  # smoothing would put probability on the ids the decoder cannot predict
        config.optim.label_smoothing = 0.0
    allowed = {**GENERATE_DEFAULTS, **SCORING_DEFAULTS}
    unknown = sorted(set(decode or {}) - set(allowed))
    if unknown:
        raise UserError(f"decode settings {unknown} are not importable; choose from {sorted(allowed)}")
    config.decode.update({**allowed, **(decode or {}), "stop": "fairseq"})
    return config


def _imported_config(task: str, fields: dict[str, Any]) -> ml_collections.ConfigDict:
    """lconv's base config for ``task`` with the imported ``model`` fields, its dots at "highest"."""
    from lconv.configs import common

    config = common.base_config()
    config.task = task
    config.data.vocab_size = fields["vocab_size"]
    config.model.update({k: list(v) if isinstance(v, tuple) else v for k, v in fields.items() if k != "vocab_size"})
    config.model.matmul_precision = "highest"
    return config


def _as_model_tree(model: Any, config: schema.RunConfig, params: dict[str, Any]) -> Any:
    """``params`` in the model's own (boxed, logically partitioned) tree; a tree or shape mismatch is an error."""
    from lconv.run import model_setup

    abstract = model_setup.abstract_params(config, model, model_setup.make_mesh(config.mesh))
    expected = nn_meta.unbox(abstract)
    paths = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(expected)[0]}
    given = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    if paths != given:
        missing, extra = sorted(set(paths) - set(given)), sorted(set(given) - set(paths))
        shapes = [f"{k}: {given[k]} vs {paths[k]}" for k in sorted(set(paths) & set(given)) if paths[k] != given[k]]
        raise UserError(f"the imported params do not fit lconv's model: missing {missing[:3]}, extra {extra[:3]}, "
                        f"shapes {shapes[:3]}")
    leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False

