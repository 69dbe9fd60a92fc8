"""Evaluation: decode a split (or any text file), detokenise, score with sacreBLEU / ROUGE, write the outputs."""
from __future__ import annotations

import functools
import json
import os
import time

import jax
import numpy as np

from lconv import metrics


def decode_batches(config, model, params, eval_set):
    """``(batch, best-beam ids [B, L])`` over every example of ``eval_set`` (padding rows included; the caller
    drops rows with ``example_index < 0``).

    Examples are decoded in order of source length, each batch cut to the shortest width in ``_WIDTHS`` that holds
    it: a batch of short sentences neither encodes nor attends over 256 padding positions, and its beam search
    stops early together. That is a handful of compiled shapes, each compiled once.
    """
    from lconv import decode
    from lconv.data import pipeline

    @functools.partial(jax.jit, static_argnums=3)
    def translate(params, inputs, segmentation, max_len):
        return decode.translate(
            model, {"params": params}, inputs, inputs_segmentation=segmentation, beam_size=config.decode.beam_size,
            max_len=max_len, lenpen=config.decode.lenpen, max_len_a=config.decode.max_len_a,
            max_len_b=config.decode.max_len_b)

    order = sorted(range(len(eval_set.tokens)), key=lambda i: len(eval_set.tokens[i]["inputs"]))
    rows = eval_set.batch_size
    for b in range(eval_set.num_batches):  # the same count on every process
        chosen = order[b * rows:(b + 1) * rows]
        batch = pipeline.pad_batch([eval_set.tokens[i] for i in chosen], chosen, rows, eval_set.lengths)
        longest = max([len(eval_set.tokens[i]["inputs"]) for i in chosen] + [1])
        width = min([w for w in _WIDTHS if w >= longest] + [batch["inputs"].shape[1]])
        inputs = batch["inputs"][:, :width]
        segmentation = (inputs != 0).astype(np.int32)
        yield batch, np.asarray(translate(params, inputs, segmentation, _max_len(config, width)))


_WIDTHS = (32, 64, 128, 256, 512, 1024)  # source widths decoding batches are cut to


def _max_len(config, source_len):
    return int(min(config.decode.max_len_a * source_len + config.decode.max_len_b,
                   config.data.eval_max_target_length))


def score_split(config, model, params, tokenizer, eval_sets, workdir, *, split=None, log=print):
    """Decodes ``split`` of the eval sets, writes ``<workdir>/<split>.hyp.txt`` and ``<split>.scores.json``."""
    split = split or config.decode.split
    if split not in eval_sets:
        raise ValueError(f"split {split!r} is not prepared; available: {sorted(eval_sets)}")
    eval_set = eval_sets[split]
    start = time.time()
    hypotheses = {}
    for batch, tokens in decode_batches(config, model, params, eval_set):
        for row, index in enumerate(batch["example_index"]):
            if index >= 0:
                hypotheses[int(index)] = tokenizer.decode(tokens[row])
    seconds = time.time() - start
    order = sorted(hypotheses)
    hyps = [hypotheses[i] for i in order]
    refs = [eval_set.examples[i]["targets"] for i in order]
    sources = [eval_set.examples[i]["inputs"] for i in order]
    scores = score_texts(config.task, hyps, refs)
    scores.update(split=split, examples=len(hyps), decode_seconds=seconds,
                  sentences_per_s=len(hyps) / max(seconds, 1e-9), beam_size=config.decode.beam_size)
    write_outputs(workdir, split, hyps, scores)
    log(format_report(scores, sources, refs, hyps, config.decode.num_print))
    return scores


def score_texts(task, hypotheses, references):
    if task == "summarization":
        return metrics.rouge(hypotheses, references)
    return metrics.bleu(hypotheses, references)


def write_outputs(workdir, name, hypotheses, scores):
    if jax.process_index() != 0:
        return
    if hypotheses is not None:
        with open(os.path.join(workdir, f"{name}.hyp.txt"), "w") as f:
            f.writelines(h.replace("\n", " ") + "\n" for h in hypotheses)
    with open(os.path.join(workdir, f"{name}.scores.json"), "w") as f:
        json.dump(scores, f, indent=2)


def format_report(scores, sources, references, hypotheses, num_print):
    lines = []
    for i in range(min(num_print, len(hypotheses))):
        lines += [f"  source:     {sources[i][:300]}", f"  reference:  {references[i][:300]}",
                  f"  hypothesis: {hypotheses[i][:300]}", ""]
    if "bleu" in scores:
        head = f"{scores['split']}: sacreBLEU {scores['bleu']:.2f}  ({scores['bleu_signature']})"
    else:
        head = f"{scores['split']}: " + "  ".join(f"{k} {scores[k]:.2f}" for k in ("rouge1", "rouge2", "rougeL"))
    head += f"  on {scores['examples']} examples, {scores['sentences_per_s']:.1f} sentences/s"
    return "\n".join(["sample outputs:"] + lines + [head])


# ----------------------------------------------------------------------------------------------------------------
# eval.py: a trained workdir, its stored config, any split or text file
# ----------------------------------------------------------------------------------------------------------------
def restore_params(config, model, workdir, average_last=1, checkpoint="latest"):
    """Params of the latest checkpoint, the mean of the last ``average_last`` (the paper's practice), or, with
    ``checkpoint="best"``, of the one with the lowest validation loss."""
    from lconv import checkpoints, train_lib

    if checkpoint not in ("latest", "best"):
        raise ValueError(f"--checkpoint must be latest or best; got {checkpoint!r}")
    if checkpoint == "best" and average_last > 1:
        raise ValueError("--average_last averages the latest checkpoints; it does not combine with --checkpoint=best")
    ckpt = checkpoints.Checkpointer(workdir, subdir="checkpoints" if checkpoint == "latest" else "best")
    steps = sorted(ckpt.all_steps())
    if not steps:
        raise ValueError(f"no checkpoint in {ckpt.directory}; train first with train.py --workdir={workdir}")
    tx, _ = train_lib.build_optimizer(config.optim, config.train.num_steps)
    mesh = train_lib.make_mesh(config.mesh)
    state, _ = train_lib.create_state(config, model, mesh, tx)
    abstract = checkpoints.abstract_like(state)
    chosen = steps[-max(average_last, 1):]
    total = None
    for step in chosen:
        restored, _ = ckpt.restore(abstract, step=step)
        total = restored.params if total is None else jax.tree.map(lambda a, b: a + b, total, restored.params)
    ckpt.close()
    return jax.tree.map(lambda x: x / len(chosen), total), chosen


def run(workdir, *, split="test", average_last=1, checkpoint="latest", beam_size=None, lenpen=None,
        source_file=None, reference_file=None, output_file=None, log=print):
    """``eval.py``: scores a split of the run's dataset, or translates/summarises ``source_file`` line by line."""
    import ml_collections

    from lconv import train_lib
    from lconv.data import pipeline, tokenizer as tokenizer_lib

    config_path = os.path.join(workdir, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{config_path} not found: --workdir must be a directory written by train.py")
    with open(config_path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    if beam_size is not None:
        config.decode.beam_size = beam_size
    if lenpen is not None:
        config.decode.lenpen = lenpen
    if config.task == "lm" and source_file is not None:
        raise ValueError("--source_file is for translation/summarization runs; an lm run is scored by perplexity")
    tokenizer = tokenizer_lib.load_tokenizer(workdir)
    model = train_lib.build_model(config, tokenizer.vocab_size)
    params, steps = restore_params(config, model, workdir, average_last, checkpoint)
    log(f"checkpoint(s) {steps}")
    if config.task == "lm":
        config.data.eval_splits = (split,)
        data = pipeline.make_datasets(config.data, tokenizer)
        return score_perplexity(config, model, params, data.eval_sets[split], workdir, split, log)
    if source_file is None:
        config.data.eval_splits = (split,)
        data = pipeline.make_datasets(config.data, tokenizer)
        return score_split(config, model, params, tokenizer, data.eval_sets, workdir, split=split, log=log)
    with open(source_file, encoding="utf-8") as f:
        sources = [line.rstrip("\n") for line in f]
    references = None
    if reference_file:
        with open(reference_file, encoding="utf-8") as f:
            references = [line.rstrip("\n") for line in f]
        if len(references) != len(sources):
            raise ValueError(f"--reference_file has {len(references)} lines for {len(sources)} source lines")
    examples = [{"inputs": s, "targets": r} for s, r in zip(sources, references or [""] * len(sources))]
    lengths = {"inputs": config.data.eval_max_input_length, "targets": config.data.eval_max_target_length}
    eval_set = pipeline.make_eval_set(_ListSource(examples), "inputs", "targets", tokenizer, lengths,
                                      config.data.eval_batch_size)
    hyps = [""] * len(sources)
    for batch, tokens in decode_batches(config, model, params, eval_set):
        for row, index in enumerate(batch["example_index"]):
            if index >= 0:
                hyps[int(index)] = tokenizer.decode(tokens[row])
    with open(output_file or os.path.join(workdir, "output.txt"), "w", encoding="utf-8") as f:
        f.writelines(h.replace("\n", " ") + "\n" for h in hyps)
    scores = {"examples": len(hyps)}
    if references is not None:
        scores.update(score_texts(config.task, hyps, references))
        log(json.dumps({k: v for k, v in scores.items() if k != "bleu_text"}))
    return scores


def score_perplexity(config, model, params, eval_set, workdir, split, log=print):
    """An LM's token-level perplexity (and loss, accuracy) on ``split``; written to ``<split>.scores.json``."""
    import types

    from lconv import train_lib

    mesh = train_lib.make_mesh(config.mesh)
    eval_step = train_lib.jit_eval_step(config, mesh)
    state = types.SimpleNamespace(params=params, apply_fn=model.apply)
    memory = train_lib.init_memory(config, model, config.data.eval_batch_size, train_lib._batch_sharding(mesh))
    scores = dict(train_lib.evaluate_loss(eval_step, state, eval_set, mesh, memory), split=split)
    write_outputs(workdir, split, None, scores)
    log(f"{split}: perplexity {scores['ppl']:.2f} (nll {scores['nll']:.4f}/token over {scores['tokens']:.0f} tokens)")
    return scores


class _ListSource:
    """A random-access source over in-memory examples (what ``make_eval_set`` reads)."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]
