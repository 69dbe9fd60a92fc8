"""Evaluation: decode a split (or any text file), detokenise, score with sacreBLEU / ROUGE, write the outputs."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from lconv import metrics


def decode_batches(config, model, params, batches):
    """Best-beam token ids for each batch of ``inputs`` (padding rows included; the caller drops them)."""
    from lconv import decode

    translate = jax.jit(
        lambda params, inputs, segmentation: decode.translate(
            model, {"params": params}, inputs, inputs_segmentation=segmentation, beam_size=config.decode.beam_size,
            max_len=_max_len(config, inputs.shape[1]), lenpen=config.decode.lenpen,
            max_len_a=config.decode.max_len_a, max_len_b=config.decode.max_len_b))
    for batch in batches:
        segmentation = (batch["inputs"] != 0).astype(np.int32)
        yield batch, np.asarray(translate(params, batch["inputs"], segmentation))


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
