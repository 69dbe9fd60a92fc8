"""A trained run as a Python object, for notebooks and scripts::

    import lconv
    model = lconv.load("runs/default")
    model.translate(["Tool to convert images between formats."])      # -> ["Werkzeug zum ..."]
    model.translate("Tool to convert images.", nbest=2)               # -> [{"text", "score", "token_scores", ...}]
    model.score(["Tool to convert images."], ["Werkzeug zum Konvertieren von Bildern."])  # -> [{"score", ...}]

``load`` restores the params only (the latest checkpoint, the mean of the last ``average_last``, or the best by
validation loss), the tokenizer and the config stored in the workdir. Decoding programs are compiled once per
shape bucket (rows: a power of two up to the decoding batch, ``config.decode.batch_size``; width: 32, 64, 128, ...
tokens) and kept by the ``Model``, so calling it again on other sentences of similar length compiles nothing.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import meta as nn_meta

from lconv.configs import schema
from lconv.constants import BOS_ID, EOS_ID, PAD_ID
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.infer import compiled, decode_and_score, lm_blocks
from lconv.train import backend, metrics, setup


def load(workdir: str, *, checkpoint: str = "latest", average_last: int = 1) -> Model:
    """The run in ``workdir`` (written by train.py), a local folder or any ``etils.epath`` URL (``gs://...``):
    ``checkpoint`` is ``"latest"`` or ``"best"``; with ``average_last=N`` the params are the mean of the last N
    checkpoints (eval.py's ``--average_last``). Reads only: the workdir may be read-only."""
    backend.check_backend()  # JAX_PLATFORMS naming a backend that is not there: one line, as on the CLIs
    if not isinstance(workdir, (str, os.PathLike)) or not str(workdir):
        raise UserError(f"workdir: must be a path or URL of a run (a non-empty string); got {workdir!r:.60}")
    return Model(setup.load_trained(os.fspath(workdir), average_last=average_last, checkpoint=checkpoint,
                                    caller="lconv.load"))


class Model:
    """A trained run: ``translate`` / ``score`` / ``bleu`` (translation, summarisation), ``generate`` /
    ``perplexity`` (language models), ``kernels`` (the normalised conv kernels, for plots). Fields: ``config``
    (the stored config), ``tokenizer``, ``module`` (the flax model), ``params``, ``steps`` (the checkpoints they
    come from)."""

    def __init__(self, trained: setup.Trained):
        self.config, self.tokenizer, self.module = trained.config, trained.tokenizer, trained.model
        self.params = nn_meta.unbox(trained.params)  # plain arrays (their shardings kept): what kernels() reads
        self.steps, self.workdir = trained.steps, trained.workdir
        self.task = self.config.task
        self._translator: compiled.Translator | None = None
        self._generator: compiled.Generator | None = None
        self._jitted: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"lconv.Model({self.workdir!r}, task={self.task!r}, steps={self.steps})"

    # --- translation and summarisation ---------------------------------------------------------------------
    def translate(self, sources: str | Sequence[str], *, beam_size: int | None = None, lenpen: float | None = None,
                  nbest: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0) -> str | list[str] | list[dict[str, Any]] | list[list[dict[str, Any]]]:
        """One output per source (``""`` for a blank one), a string for a string and a list for a list: by beam
        search (``beam_size`` / ``lenpen`` default to the stored ``config.decode``'s), or with ``temperature > 0``
        a sample (after ``top_k`` and nucleus ``top_p`` filtering), drawn from ``seed`` and the source alone: the
        same source and seed give the same sample alone or in any batch.

        With ``nbest=k`` each output is instead a list of up to k dicts, best first (a blank source's is empty):
        ``"text"``; ``"score"``, the search's ``sum(token_scores) / len(token_scores)**lenpen`` (fairseq's);
        ``"token_scores"``, each output token's log-probability under the model (EOS included; before temperature
        and filters, so ``score`` gives the same numbers); ``"tokens"``, the token ids (what ``score`` takes to
        rescore exactly this hypothesis). Beam search gives the best k of its beams (k <= the beam size);
        sampling draws k samples. Sources longer than ``config.data.eval_max_input_length`` tokens are cut to it."""
        self._need("translate", ("translation", "summarization"))
        lines = _lines(sources, "sources", one_allowed=True)
        schema.check_search(beam_size=beam_size, lenpen=lenpen, spell=str,  # the arguments' own names
                            vocab_size=self.tokenizer.vocab_size)
        limit = int(self.config.data.eval_max_target_length)
        schema.check_sampling(dict(max_len=limit, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                              vocab_size=self.tokenizer.vocab_size)
        search = {"beam_size": self._hypotheses_per_source(nbest, beam_size, temperature)}
        if lenpen is not None:
            search["lenpen"] = lenpen
        if temperature:
            search.update(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if self._translator is None:
            self._translator = compiled.Translator(self.config, self.module, self.params)
        found = decode_and_score.translate_lines(self.config, self.module, self.params, self.tokenizer, lines,
                                                 translator=self._translator, nbest=nbest or 0, **search)
        outputs = found.hypotheses if nbest is None else found.nbest
        return outputs[0] if isinstance(sources, str) else outputs

    def _hypotheses_per_source(self, nbest: int | None, beam_size: int | None, temperature: float) -> int:
        """The beams (or samples, when sampling) a search keeps per source, with ``nbest`` checked against it."""
        return schema.hypotheses_per_source(nbest=nbest, beam_size=beam_size, temperature=temperature,
                                            stored_beam_size=self.config.decode.beam_size,
                                            vocab_size=self.tokenizer.vocab_size)

    def score(self, sources: str | Sequence[str],
              targets: str | Sequence[int] | Sequence[str | Sequence[int]]) -> dict[str, Any] | list[dict[str, Any]]:
        """The log-probability of each target given its source, teacher-forced (fairseq hub's ``score``): per
        pair ``{"score": sum of token_scores, "token_scores": [log p of each target token, EOS included]}``; a
        dict for a string source, a list for a list. A target is a string, or token ids (an n-best entry's
        ``"tokens"``, to rescore exactly that hypothesis: a decoded text may re-tokenise otherwise). Cut as
        ``translate`` cuts: sources to ``config.data.eval_max_input_length`` tokens and targets to
        ``config.data.eval_max_target_length`` (EOS included in both), so a translation scores whole."""
        self._need("score", ("translation", "summarization"))
        one = isinstance(sources, str)
        source_lines = _lines(sources, "sources", one_allowed=True)
        target_ids = _target_ids(self.tokenizer, [targets] if one else targets, one)
        if len(source_lines) != len(target_ids):
            raise UserError(f"{len(source_lines)} sources for {len(target_ids)} targets; they pair one to one")
        data = self.config.data
        inputs = [np.append(ids[:data.eval_max_input_length - 1], EOS_ID)
                  for ids in self.tokenizer.encode_batch(source_lines)]
        targets_ = [np.append(ids[:data.eval_max_target_length - 1], EOS_ID) for ids in target_ids]
        rows = compiled.row_bucket(len(inputs), data.eval_batch_size)
        log_probs = self._function("token_log_probs", self._token_log_probs)
        out = []
        for start in range(0, len(inputs), rows):
            chunk = slice(start, start + rows)
            inputs_BS = _pad_rows(inputs[chunk], rows, compiled.width_bucket(max(map(len, inputs[chunk])),
                                                                              data.eval_max_input_length))
            targets_BT = _pad_rows(targets_[chunk], rows, compiled.width_bucket(max(map(len, targets_[chunk])),
                                                                                 data.eval_max_target_length))
            logp_BT = np.asarray(log_probs(self.params, inputs_BS, targets_BT))
            for row, target in enumerate(targets_[chunk]):
                token_scores = logp_BT[row, :len(target)]
                out.append({"score": float(np.sum(token_scores, dtype=np.float64)),
                            "token_scores": token_scores.tolist()})
        return out[0] if one else out

    def _token_log_probs(self, params: Any, inputs_BS: jax.Array, targets_BT: jax.Array) -> jax.Array:
        """``[B, T]``: log p(target token t | source, targets before t), as the search scores a token."""
        logits_BTV = self.module.apply({"params": params}, inputs_BS, targets_BT,
                                       inputs_segmentation=(inputs_BS != PAD_ID).astype(jnp.int32),
                                       targets_segmentation=(targets_BT != PAD_ID).astype(jnp.int32))
        logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)  # [B, T, V]
        return jnp.take_along_axis(logp_BTV, targets_BT[:, :, None], axis=-1)[:, :, 0]  # [B, T]

    def bleu(self, sources: Sequence[str], references: Sequence[str], *, beam_size: int | None = None,
             lenpen: float | None = None) -> dict[str, Any]:
        """Translates ``sources`` and scores them against ``references``: sacreBLEU (``bleu``, ``bleu_signature``)
        and tokenized BLEU for translation, ROUGE-1/2/L and ROUGE-Lsum for summarisation."""
        sources, references = _lines(sources, "sources"), _lines(references, "references")
        if len(sources) != len(references):
            raise UserError(f"{len(sources)} sources for {len(references)} references; they pair one to one")
        hypotheses = self.translate(sources, beam_size=beam_size, lenpen=lenpen)
        return decode_and_score.score_texts(self.task, hypotheses, references)

    # --- language models -----------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str], *, max_len: int = 50, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> list[str]:
        """Continues each prompt by up to ``max_len`` tokens: greedy at ``temperature=0``, else sampled (after
        ``top_k`` and nucleus ``top_p`` filtering) from ``seed``; a prompt's sample depends on it, the seed and
        the settings alone, not on the other prompts or its place among them. A prompt too long for
        ``config.model.max_len`` keeps its last tokens."""
        self._need("generate", ("lm",))
        lines = _lines(prompts, "prompts", one_allowed=True)
        schema.check_sampling(dict(max_len=max_len, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                              vocab_size=self.tokenizer.vocab_size)
        if self._generator is None:
            self._generator = compiled.Generator(self.config, self.module, self.params)
        outputs = decode_and_score.generate_lines(self.config, self.tokenizer, lines, self._generator,
                                                  max_len=max_len, temperature=temperature, top_k=top_k, top_p=top_p,
                                                  seed=seed).hypotheses
        return outputs[0] if isinstance(prompts, str) else outputs

    def perplexity(self, texts: Sequence[str], *, sample_break_mode: str = "eos", tokens_per_sample: int | None = None,
                   context_window: int = 0) -> dict[str, float]:
        """Token-level ``ppl``, ``nll`` per token and ``tokens`` (EOS counted) of ``texts`` under an LM.

        By default each text is scored alone, cut to ``config.data.eval_max_target_length`` tokens. The keyword
        arguments are ``fairseq-eval-lm``'s (``lconv.infer.lm_blocks``): ``sample_break_mode="none"`` scores the
        texts as one stream in blocks of ``tokens_per_sample`` tokens (default ``eval_max_target_length``),
        ``"complete"`` packs whole texts into such blocks, and ``context_window`` gives each block that many
        tokens before it as unscored context. fairseq prints its loss in base 2 and ``2**loss`` as its perplexity:
        ``nll / ln 2`` and ``ppl`` here."""
        self._need("perplexity", ("lm",))
        if self.config.data.stream:
            raise UserError("a document-stream run carries its kNN memory across windows: score it with "
                            "eval.py --split=... instead")
        limit = int(self.config.data.eval_max_target_length)
        if (sample_break_mode, tokens_per_sample, context_window) != ("eos", None, 0):
            return self._fairseq_perplexity(texts, sample_break_mode, tokens_per_sample or limit, context_window)
        ids = self.tokenizer.encode_batch(_lines(texts, "texts", one_allowed=True))
        lengths = [len(x) + 1 for x in ids]  # the one rule for long inputs: cut, and a warning names each
        cut = [i for i, n in enumerate(lengths) if n > limit]
        decode_and_score.SourceLengths(cut, max(lengths, default=0), limit, [lengths[i] for i in cut]).log(
            "texts[{}]".format, "config.data.eval_max_target_length, EOS included; sample_break_mode='none' scores "
            "long texts whole")
        encoded = [np.append(x[:limit - 1], EOS_ID) for x in ids]
        rows = compiled.row_bucket(len(encoded), self.config.data.eval_batch_size)
        loss = self._function("nll", self._nll_sums)
        total = {"nll": 0.0, "tokens": 0.0}
        for start in range(0, len(encoded), rows):
            chunk = encoded[start:start + rows]
            targets_BT = _pad_rows(chunk, rows, compiled.width_bucket(max(map(len, chunk)), limit))
            sums = loss(self.params, targets_BT)
            total = {k: total[k] + float(sums[k]) for k in total}
        nll = total["nll"] / max(total["tokens"], 1.0)
        return {"ppl": math.exp(min(nll, 50.0)), "nll": nll, "tokens": total["tokens"]}

    def _fairseq_perplexity(self, texts: Sequence[str], mode: str, tokens_per_sample: int,
                            context_window: int) -> dict[str, float]:
        """``perplexity`` on fairseq-eval-lm's rows: whole texts (no cut), each row's scored tokens counted."""
        lm_blocks.check_settings(mode, tokens_per_sample, context_window, int(self.config.model.max_len))
        rows = lm_blocks.fairseq_rows(self.tokenizer.encode_batch(_lines(texts, "texts", one_allowed=True)),
                                      sample_break_mode=mode,
                                      tokens_per_sample=tokens_per_sample, context_window=context_window,
                                      start_id=self.module.config.decoder_start_id, eos_id=EOS_ID)
        batch = compiled.row_bucket(len(rows), self.config.data.eval_batch_size)
        loss = self._function("row_nll", self._row_nll_sums)
        total = {"nll": 0.0, "tokens": 0.0}
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            width = compiled.width_bucket(max(len(r.inputs) for r in chunk), tokens_per_sample)
            inputs_BT = _pad_rows([r.inputs for r in chunk], batch, width)
            targets_BT = _pad_rows([r.targets for r in chunk], batch, width)
            scored_BT = _pad_rows([np.arange(len(r.inputs)) >= r.first_scored for r in chunk], batch, width)
            sums = loss(self.params, inputs_BT, targets_BT, scored_BT)
            total = {k: total[k] + float(sums[k]) for k in total}
        nll = total["nll"] / max(total["tokens"], 1.0)
        return {"ppl": math.exp(min(nll, 50.0)), "nll": nll, "tokens": total["tokens"]}

    def _row_nll_sums(self, params: Any, inputs_BT: jax.Array, targets_BT: jax.Array,
                      scored_BT: jax.Array) -> dict[str, jax.Array]:
        logits_BTV = self.module.apply({"params": params}, inputs_BT, shift=False,
                                       targets_segmentation=(inputs_BT != PAD_ID).astype(jnp.int32))
        return metrics.label_smoothed_loss(logits_BTV, targets_BT, scored_BT, 0.0)

    def _nll_sums(self, params: Any, targets_BT: jax.Array) -> dict[str, jax.Array]:
        logits_BTV = self.module.apply({"params": params}, targets_BT,
                                       targets_segmentation=(targets_BT != PAD_ID).astype(jnp.int32))
        return metrics.label_smoothed_loss(logits_BTV, targets_BT, targets_BT != PAD_ID, 0.0)

    # --- kernels -------------------------------------------------------------------------------------------
    def kernels(self, sentence: str) -> dict[str, Any]:
        """The normalised (softmax over K) conv kernels ``sentence`` meets, per layer of each side.

        Returns ``{"encoder": [...], "decoder": [...], "source_tokens": [...], "target_tokens": [...]}``: a
        LightConv layer's entry is its ``[H, K]`` kernel (the same at every position), a DynamicConv layer's its
        ``[T, H, K]`` kernels (one per token), any other mixer's ``None``. For translation the encoder reads the
        sentence (+ EOS) and the decoder its translation, teacher-forced: decoder position t reads
        ``target_tokens[t]`` (BOS, then the translation). An LM has ``"decoder"`` and ``"target_tokens"`` only
        (BOS, then the sentence). Tap ``k`` of position t weighs input ``t + k - P`` (``P = K // 2`` in the
        encoder, ``K - 1`` in the decoder)."""
        tokenizer_lib.check_text(sentence, "sentence")
        if self.task == "lm":
            targets = np.append(self.tokenizer.encode(sentence), EOS_ID)[:self.config.data.eval_max_target_length]
            inputs = None
        else:
            inputs = np.append(self.tokenizer.encode(sentence), EOS_ID)[:self.config.data.eval_max_input_length]
            translation = self.translate([sentence])[0]
            limit = self.config.data.eval_max_target_length
            targets = np.append(self.tokenizer.encode(translation), EOS_ID)[:limit]
        kernel_logits = self._function("kernel_logits", self._kernel_logits)
        sides = {"decoder": len(targets)} if inputs is None else {"encoder": len(inputs), "decoder": len(targets)}
        data = self.config.data
        ids = [_pad_rows([x], 1, compiled.width_bucket(len(x), limit)) for x, limit in
               ([] if inputs is None else [(inputs, data.eval_max_input_length)])
               + [(targets, data.eval_max_target_length)]]
        out = {}
        for side, layers in kernel_logits(self.params, *ids).items():
            out[side] = [_normalised(logits, sides[side]) for logits in layers]
        if inputs is not None:
            out["source_tokens"] = [self._piece(i) for i in inputs.tolist()]
        start = self.module.config.decoder_start_id  # BOS, or EOS for a model imported from fairseq
        out["target_tokens"] = [self._piece(i) for i in [start] + targets[:-1].tolist()]
        return out

    def _kernel_logits(self, params: Any, *ids: jax.Array) -> dict[str, list[Any]]:
        """Per side, per layer: the LightConv kernel's logits ``[H, K]``, the DynamicConv kernel predictor's
        output as ``[T, H, K]`` (captured as the model runs on row 0 of ``ids``), or None for another mixer."""
        is_predictor = lambda module, method: method == "__call__" and module.name == "weight_linear"  # noqa: E731
        segmentation = [(x != PAD_ID).astype(jnp.int32) for x in ids]
        if self.task == "lm":
            kwargs = dict(targets_segmentation=segmentation[0])
        else:
            kwargs = dict(inputs_segmentation=segmentation[0], targets_segmentation=segmentation[1])
        _, state = self.module.apply({"params": params}, *ids, **kwargs, capture_intermediates=is_predictor,
                                     mutable=["intermediates"])
        out = {}
        for side in ("decoder",) if self.task == "lm" else ("encoder", "decoder"):
            out[side] = []
            for i in range(sum(k.startswith("layer_") for k in params[side])):
                conv = params[side][f"layer_{i}"].get("mixer", {}).get("conv", {})
                if "weight" in conv:  # LightConv: [H, K]
                    out[side].append(conv["weight"])
                elif "weight_linear" in conv:  # DynamicConv: [1, T, H*K] head-major -> [T, H, K]
                    captured = state["intermediates"][side][f"layer_{i}"]["mixer"]["conv"]["weight_linear"]
                    K = self.module.config.kernel_size(side, i)
                    out[side].append(captured["__call__"][0][0].reshape(ids[0].shape[1] if side == "encoder"
                                                                        else ids[-1].shape[1], -1, K))
                else:
                    out[side].append(None)
        return out

    # --- helpers -------------------------------------------------------------------------------------------
    def _function(self, name: str, fn: Any) -> Any:
        """``fn`` jitted once per model (one compilation per shape bucket)."""
        if name not in self._jitted:
            self._jitted[name] = jax.jit(fn)
        return self._jitted[name]

    def _need(self, method: str, tasks: tuple[str, ...]) -> None:
        if self.task not in tasks:
            other = "translate / score / bleu" if self.task != "lm" else "generate / perplexity"
            raise UserError(f"{method}() is for {' and '.join(tasks)} runs; {self.workdir} is a {self.task} run "
                            f"(use {other})")

    def _piece(self, token: int) -> str:
        return {BOS_ID: "<s>", EOS_ID: "</s>", PAD_ID: "<pad>"}.get(token) or self.tokenizer.decode([token]) or "▁"


def _normalised(logits: Any, length: int) -> np.ndarray | None:
    """Softmax over K in float32, as the conv modules normalise their kernels; ``[T, H, K]`` cut to ``length``."""
    if logits is None:
        return None
    kernels = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    return kernels[:length] if kernels.ndim == 3 else kernels


def _lines(texts: Any, argument: str, one_allowed: bool = False) -> list[str]:
    """``texts`` as a list of str, checked like the CLIs check their input: a one-line ``UserError`` naming the
    argument (and the index) for anything else; ``None``, bytes or numbers are not turned into ``"None"``."""
    if isinstance(texts, str):
        if one_allowed:
            return tokenizer_lib.check_texts([texts], argument)
        raise UserError(f"{argument}: pass a list of strings (one per example), not one string")
    return tokenizer_lib.check_texts(texts, argument)


def _target_ids(tokenizer: Any, targets: Any, one: bool) -> list[np.ndarray]:
    """``score``'s targets as id arrays without EOS: a string is encoded, ids are taken as they are (an n-best
    entry's ``"tokens"``, whose last, EOS, is dropped: ``score`` appends it). One-line errors name the target."""
    if isinstance(targets, str) or not isinstance(targets, Sequence):
        raise UserError(f"targets: pass {'one string (or token ids) for one source' if one else 'a list'}; "
                        f"got {type(targets).__name__}")
    out = []
    for i, target in enumerate(targets):
        name = "targets" if one else f"targets[{i}]"
        if isinstance(target, str):
            out.append(np.asarray(tokenizer.encode(tokenizer_lib.check_text(target, name)), np.int32))
            continue
        ids = np.asarray(target) if isinstance(target, (Sequence, np.ndarray)) and len(target) else None
        if ids is None or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any() \
                or (ids >= tokenizer.vocab_size).any() or (ids[:-1] == EOS_ID).any():
            raise UserError(f"{name}: must be a string or a non-empty list of token ids in [0, "
                            f"{tokenizer.vocab_size}) with EOS ({EOS_ID}) last if anywhere; got {target!r:.60}")
        out.append(ids[:-1] if ids[-1] == EOS_ID else ids)
    return out


def _pad_rows(ids: Sequence[np.ndarray], rows: int, width: int) -> np.ndarray:
    """Id arrays -> ``[rows, width]`` int32, PAD after each and in the missing rows."""
    out = np.full((rows, width), PAD_ID, np.int32)
    for row, x in enumerate(ids):
        out[row, :len(x)] = x
    return out
