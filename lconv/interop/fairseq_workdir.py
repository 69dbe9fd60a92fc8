"""``python -m lconv.import_fairseq``: a fairseq checkpoint written as an lconv workdir that ``eval.py``,
``lconv.load`` and the study read like a trained run.

The workdir holds ``config.json`` (a translation config whose ``model`` follows fairseq's arguments and
conventions, and whose ``decode`` is fairseq-generate's: beam 5, lenpen 1, fairseq's stopping rule),
``spm.model`` (fairseq's SentencePiece model re-numbered to its dictionary, ``fairseq_vocab``), one params
checkpoint at the checkpoint's update count, and ``imported.json`` (where it came from: path, SHA-256, fairseq's
model arguments, anything the import counted). The params are checked against the model's own tree, shape by
shape, before anything is written.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax.linen import meta as nn_meta

from lconv.errors import UserError
from lconv.interop import fairseq, fairseq_vocab

IMPORT_RECORD = "imported.json"


# fairseq-generate's defaults, written as config.decode unless the import is told the settings a model is used with
GENERATE_DEFAULTS = {"beam_size": 5, "lenpen": 1.0, "max_len_a": 0.0, "max_len_b": 200}


def import_checkpoint(checkpoint: str, dictionary: str, spm: str, workdir: str, *, dataset: str = "",
                      decode: dict[str, Any] | None = None, trust: bool = False,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """Writes ``workdir`` from a fairseq translation checkpoint; returns the import record. ``decode``: fields of
    ``config.decode`` over fairseq-generate's defaults (``GENERATE_DEFAULTS``)."""
    from lconv.train import checkpoints, setup
    from lconv.train import workdir as workdir_lib

    if checkpoints.has_checkpoint(workdir):
        raise UserError(f"{workdir} already holds checkpoints; import into a new --workdir")
    weights, args, updates = fairseq.read_checkpoint(checkpoint, trust=trust)
    vocab = fairseq_vocab.build_vocabulary(dictionary, spm)
    rows = weights.get("encoder.embed_tokens.weight", np.zeros((0, 0))).shape[0]
    if rows != vocab.size:
        raise UserError(f"{dictionary} gives {vocab.size} ids (4 special + {vocab.size - 4} lines) but the "
                        f"checkpoint's embeddings have {rows} rows: is it the dictionary the model was trained with?")
    fields = fairseq.model_fields(args, vocab.size)
    config = translation_config(fields, dataset, decode)
    params = fairseq.lconv_params(weights, fields)
    model = setup.build_model(config, vocab.size)
    boxed = _as_model_tree(model, config, params)
    workdir = workdir_lib.make_workdir(workdir)
    workdir_lib.write_config(config, workdir, {}, has_checkpoint=False, log=log)
    vocab.tokenizer.save(workdir)
    step = max(updates, 1)
    saver = checkpoints.Checkpointer(workdir)
    saver.save(step, {"params": boxed}, {"imported_from": str(checkpoint)}, force=True)
    saver.close()
    record = {"checkpoint": str(checkpoint), "sha256": _sha256(checkpoint), "dictionary": str(dictionary),
              "spm": str(spm), "updates": updates, "step": step, "arch": args.get("arch"),
              "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
              "spm_pieces_not_in_dictionary": vocab.pieces_not_in_dictionary,
              "imported_at": datetime.datetime.now().isoformat(timespec="seconds"),
              "fairseq_model_args": {k: v for k, v in args.items() if _jsonable(v)}}
    workdir_lib.write_atomically(epath.Path(workdir) / IMPORT_RECORD, json.dumps(record, indent=2, sort_keys=True))
    log(f"imported {args.get('arch')} ({record['parameters']:,} parameters, {updates} updates) into {workdir}")
    if vocab.pieces_not_in_dictionary:
        log(f"note: {vocab.pieces_not_in_dictionary} SentencePiece pieces are not in {dictionary}; fairseq maps "
            "them to <unk>, lconv's tokenizer segments around them")
    return record


def translation_config(fields: dict[str, Any], dataset: str = "",
                       decode: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
    """lconv's base config with the imported ``model`` (dots at "highest": float32 as fairseq's PyTorch computes
    it, on every backend) and fairseq-generate's decoding rule and defaults."""
    from lconv.configs import common

    config = common.base_config()
    config.task = "translation"
    config.data.vocab_size = fields["vocab_size"]
    if dataset:
        config.data.dataset = dataset
    # fairseq caps positions at max_*_positions; lconv cuts longer inputs and counts them
    config.data.eval_max_input_length = config.data.eval_max_target_length = int(fields["max_len"])
    model = {k: v for k, v in fields.items() if k != "vocab_size"}
    config.model.update({k: list(v) if isinstance(v, tuple) else v for k, v in model.items()})
    config.model.matmul_precision = "highest"
    unknown = sorted(set(decode or {}) - set(GENERATE_DEFAULTS))
    if unknown:
        raise UserError(f"decode settings {unknown} are not importable; choose from {sorted(GENERATE_DEFAULTS)}")
    config.decode.update({**GENERATE_DEFAULTS, **(decode or {}), "stop": "fairseq"})
    return config


def _as_model_tree(model: Any, config: ml_collections.ConfigDict, params: dict[str, Any]) -> Any:
    """``params`` in the model's own (boxed, logically partitioned) tree; a tree or shape mismatch is an error."""
    from lconv.train import setup

    args, kwargs = setup.model_inputs(setup.dummy_batch(config))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs)["params"])
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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with epath.Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def main(argv: list[str] | None = None) -> None:
    from absl import app, flags, logging

    from lconv.cli import runtime

    flags.DEFINE_string("checkpoint", None, "fairseq checkpoint (.pt) of a lightconv* or transformer* model.")
    flags.DEFINE_string("dict", None, "The dictionary it was trained with (dict.txt; source and target joined).")
    flags.DEFINE_string("spm", None, "The SentencePiece model whose pieces the dictionary lists.")
    flags.DEFINE_string("workdir", None, "The lconv workdir to write (new, or without checkpoints).")
    flags.DEFINE_string("dataset", "", "config.data.dataset of the workdir (what eval.py scores without "
                        "--source_file), e.g. wmt14/en_de.")
    flags.DEFINE_integer("beam_size", GENERATE_DEFAULTS["beam_size"], "config.decode.beam_size (fairseq --beam).")
    flags.DEFINE_float("lenpen", GENERATE_DEFAULTS["lenpen"], "config.decode.lenpen (fairseq --lenpen).")
    flags.DEFINE_float("max_len_a", GENERATE_DEFAULTS["max_len_a"], "config.decode.max_len_a (--max-len-a).")
    flags.DEFINE_integer("max_len_b", GENERATE_DEFAULTS["max_len_b"], "config.decode.max_len_b (--max-len-b).")
    flags.DEFINE_bool("trust_checkpoint", False, "Unpickle any object the file holds (only for files you trust); "
                      "without it only tensors, containers and argparse.Namespace are read.")
    flags.mark_flags_as_required(["checkpoint", "dict", "spm", "workdir"])
    F = flags.FLAGS

    def run(args: list[str]) -> None:
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments: {args[1:]}")
        with runtime.user_errors():
            decode = {name: F[name].value for name in GENERATE_DEFAULTS}
            import_checkpoint(F.checkpoint, F.dict, F.spm, F.workdir, dataset=F.dataset, decode=decode,
                              trust=F.trust_checkpoint)

    logging.set_verbosity(logging.WARNING)  # orbax's info lines
    app.run(run, argv=argv, flags_parser=runtime.parse_flags)
