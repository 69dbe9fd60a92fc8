"""lconv's import of a case of the fairseq parity matrix (tests/fixtures/fairseq_parity, made by
scripts/make_fairseq_parity.py) against the outputs fairseq recorded beside it. Used by
tests/test_fairseq_parity.py and scripts/fairseq_parity_table.py; nothing here needs fairseq.

The import is the user's path: ``fairseq_workdir.import_checkpoint`` (``python -m lconv.import_fairseq``) into a
workdir with the case's dictionaries and no SentencePiece model (text is the dictionary's pieces, ``p07 p31``),
then ``lconv.load``. fairseq's ids become lconv's by ``FAIRSEQ_TO_LCONV`` (only the four special ids differ).
Every comparison returns its worst difference, so that the table can report it.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import jax
import numpy as np

from lconv.constants import PAD_ID
from lconv.interop import fairseq_vocab

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "fairseq_parity"
FAIRSEQ_PAD = 1
LCONV_TO_FAIRSEQ = {v: k for k, v in fairseq_vocab.FAIRSEQ_TO_LCONV.items()}


def manifest() -> dict[str, Any]:
    return json.loads((FIXTURES / "manifest.json").read_text(encoding="utf-8"))


def case(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "case.json").read_text(encoding="utf-8"))


def outputs(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "outputs.npz") as z:
        return {k: z[k] for k in z.files}


def to_lconv(ids: np.ndarray) -> np.ndarray:
    out = np.array(ids, np.int32)
    for fairseq_id, lconv_id in fairseq_vocab.FAIRSEQ_TO_LCONV.items():
        out[np.asarray(ids) == fairseq_id] = lconv_id
    return out


def to_fairseq(ids) -> list[int]:
    return [LCONV_TO_FAIRSEQ.get(int(i), int(i)) for i in ids]


def import_case(name: str, workdir: str):
    """The case's checkpoint imported into ``workdir`` as a user imports it, loaded by ``lconv.load``."""
    import lconv

    import_workdir(name, workdir)
    return lconv.load(workdir)


def import_workdir(name: str, workdir: str) -> None:
    """``python -m lconv.import_fairseq`` of the case: its dictionaries, no SentencePiece model, and for
    translation the decoding settings fairseq's searches used (``case.json``)."""
    from lconv.interop import fairseq_workdir

    record = case(name)
    folder = FIXTURES / name
    decode = {}
    if record["task"] == "translation":
        g = record["generate"]
        decode = {"beam_size": 4, "lenpen": g["lenpen"], "max_len_a": g["max_len_a"], "max_len_b": g["max_len_b"]}
    target = record["files"].get("target_dict")
    fairseq_workdir.import_checkpoint(str(folder / "checkpoint.pt"), str(folder / record["files"]["dict"]), None,
                                      workdir, decode=decode, continuation="",
                                      target_dictionary=str(folder / target) if target else "")


def _source_to_lconv(name: str, ids: np.ndarray) -> np.ndarray:
    """fairseq source ids as lconv's: with separate dictionaries the import's vocabulary is the target's symbols,
    then the source's others (``fairseq_vocab.joined_symbols``), so a source id moves; otherwise ``to_lconv``."""
    files = case(name)["files"]
    if not files.get("target_dict"):
        return to_lconv(ids)
    source = fairseq_vocab.read_dictionary(str(FIXTURES / name / files["dict"]))
    target = fairseq_vocab.read_dictionary(str(FIXTURES / name / files["target_dict"]))
    return fairseq_vocab.lconv_ids(fairseq_vocab.joined_symbols(source, target), source)[np.asarray(ids)]


def _columns(vocab_size: int) -> np.ndarray:
    """lconv's column of each fairseq id."""
    return np.array([fairseq_vocab.FAIRSEQ_TO_LCONV.get(i, i) for i in range(vocab_size)])


def lprobs_difference(model, name: str) -> float:
    """Max |lconv - fairseq| / max(1, |fairseq|) of the teacher-forced log-probabilities, over every vocabulary
    entry at every non-pad target position of fairseq's batch (lconv's inputs right-padded; fairseq's sources
    left-padded). Relative beyond 1 because float32 rounding is: these tiny models give log-probs down to -45,
    where one ulp is 4e-6 and fairseq's own output is 1.1e-5 from its float64 forward pass (lclm_adaptive_tied)."""
    out = outputs(name)
    target = out["target"]
    targets = np.where(target == FAIRSEQ_PAD, PAD_ID, to_lconv(target)).astype(np.int32)
    params = {"params": model.params}
    apply = jax.jit(model.module.apply)  # one compilation: faster than running the ops one by one
    if case(name)["task"] == "translation":
        rows = [_source_to_lconv(name, r[r != FAIRSEQ_PAD]) for r in out["src_tokens"]]
        inputs = np.zeros((len(rows), max(map(len, rows))), np.int32)
        for i, r in enumerate(rows):
            inputs[i, :len(r)] = r
        logits = apply(params, inputs, targets, inputs_segmentation=(inputs != PAD_ID).astype(np.int32),
                       targets_segmentation=(targets != PAD_ID).astype(np.int32))
    else:  # fairseq's rows start from EOS; an imported LM starts its targets from EOS too
        logits = apply(params, targets, targets_segmentation=(targets != PAD_ID).astype(np.int32))
    lprobs = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1))
    theirs = out["lprobs"]
    ours = lprobs[..., _columns(theirs.shape[-1])]
    real = target != FAIRSEQ_PAD
    return float(np.max(np.abs(ours[real] - theirs[real]) / np.maximum(1.0, np.abs(theirs[real]))))


def search_differences(model, name: str, beams: int) -> dict[str, Any]:
    """lconv's n-best lists (``translate(nbest=beams, beam_size=beams)``, all sources in one call) against
    fairseq's SequenceGenerator (each source alone): the hypotheses that differ in a token, and the worst score
    and per-token score differences over the rest."""
    out, record = outputs(name), case(name)
    found = model.translate(record["texts"]["sources"], beam_size=beams, nbest=beams)
    differing, score, token = [], 0.0, 0.0
    for b, nbest in enumerate(found):
        lengths = out[f"beam{beams}_lengths"][b]
        for k in range(beams):
            theirs = out[f"beam{beams}_tokens"][b, k, :lengths[k]].tolist()
            ours = to_fairseq(nbest[k]["tokens"]) if k < len(nbest) else None
            if ours != theirs:
                differing.append({"source": b, "rank": k, "lconv": ours, "fairseq": theirs})
                continue
            score = max(score, abs(nbest[k]["score"] - float(out[f"beam{beams}_scores"][b, k])))
            positional = out[f"beam{beams}_positional_scores"][b, k, :lengths[k]]
            token = max(token, float(np.max(np.abs(np.asarray(nbest[k]["token_scores"]) - positional))))
    return {"differing": differing, "score": score, "token_score": token}


def perplexity_difference(model, name: str) -> dict[str, float]:
    """``Model.perplexity`` of eval-lm's stream (one sentence per line, each scored from EOS as
    ``--sample-break-mode eos`` does) against fairseq-eval-lm's: relative difference and token counts."""
    record = case(name)
    theirs = record["eval_lm"]
    ours = model.perplexity(record["texts"]["eval_lm"])
    return {"relative": abs(ours["ppl"] / theirs["perplexity"] - 1.0), "lconv_ppl": ours["ppl"],
            "fairseq_ppl": theirs["perplexity"], "lconv_tokens": ours["tokens"], "fairseq_tokens": theirs["tokens"],
            "nll": abs(ours["nll"] - theirs["nll_sum"] / theirs["tokens"])}


def greedy_continuations(model, name: str) -> tuple[list[str], list[str]]:
    """(lconv's, fairseq's) greedy continuations of the prompts: fairseq's hypothesis is the prompt, then the
    continuation, then EOS, at most ``max_len_b`` tokens before EOS; lconv's ``generate`` gets the room left."""
    out, record = outputs(name), case(name)
    symbols = fairseq_vocab.read_dictionary(str(FIXTURES / name / record["files"]["dict"]))
    theirs, ours = [], []
    for p, prompt in enumerate(record["texts"]["prompts"]):
        n = int(out["prompt_lengths"][p])
        tokens = out["greedy_tokens"][p, :out["greedy_lengths"][p]].tolist()
        theirs.append(" ".join(symbols[i - 4] for i in tokens[n:] if i != 2))
        room = int(record["generate"]["max_len_b"]) - n
        ours.append(model.generate([prompt], max_len=room)[0])
    return ours, theirs


def within_float32(difference: float) -> bool:
    return math.isfinite(difference) and difference <= 1e-5
