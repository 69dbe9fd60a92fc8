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

import functools
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import meta as nn_meta

from lconv.constants import BOS_ID, EOS_ID, PAD_ID
from lconv.data import tokenizer as tokenizer_lib
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled, lm_blocks, lm_scoring, per_line, probing, scoring, source_lengths
from lconv.nn import ensemble as model_ensemble
from lconv.run import backend, ensembles, load_options, loss_pass, metrics, model_setup, restore, schema
from lconv.run import compilation_cache as user_cache

logger = logging.getLogger(__name__)


def load(workdir: str | Sequence[str], *, checkpoint: str = "latest", average_last: int = 1, dtype: str | None = None,
         decode_batch_size: int | None = None, max_input_length: int | None = None,
         devices: Sequence[jax.Device] | None = None, trust_plugins: bool = False) -> Model:
    """The run in ``workdir`` (written by train.py), a local folder or any ``etils.epath`` URL (``gs://...``):
    ``checkpoint`` is ``"latest"`` or ``"best"``; with ``average_last=N`` the params are the mean of the last N
    checkpoints (eval.py's ``--average_last``). Reads only: the workdir may be read-only. A list of workdirs
    loads each alike and gives their ``ensemble``.

    The stored config, changed for this load only: ``dtype`` the compute dtype (``"bfloat16"`` on an
    accelerator; the params stay float32, as in training: ``config.model.dtype``), ``decode_batch_size`` the rows
    per decoding batch (``config.decode.batch_size``; 0 = auto), ``max_input_length`` the longest source in
    tokens (``config.data.eval_max_input_length``; longer ones are cut). ``devices``: the mesh the params are laid
    out on (``config.mesh``, default every device), whose batch axes split each decoding batch's rows.

    A run from elsewhere is data: a plugin mixer its config names as ``"module:Class"`` is imported (its code run)
    only with ``trust_plugins=True``, or when this process has it already (registered, or its module imported).

    Compiled programs are kept in this user's cache folder, as train.py and eval.py keep them
    (``lconv.run.compilation_cache``; never the workdir's), unless this process turned JAX's cache off or chose
    another folder."""
    backend.check_backend()  # JAX_PLATFORMS naming a backend that is not there: one line, as on the CLIs
    if not isinstance(trust_plugins, bool):  # "false" is a non-empty string: truthy, and an opt-in it is not
        raise UserError(f"trust_plugins: must be True or False; got {trust_plugins!r:.60}")
    user_cache.use_user_folder()
    if isinstance(workdir, (bytes, bytearray, memoryview)):  # a Sequence too: read as a list of its byte values
        raise UserError(f"workdir: a workdir path (str or os.PathLike) is expected, not {type(workdir).__name__} "
                        f"({bytes(workdir)[:60]!r}); decode it first")
    if not isinstance(workdir, (str, os.PathLike)) and isinstance(workdir, Sequence) and workdir:
        options = dict(checkpoint=checkpoint, average_last=average_last, dtype=dtype,
                       decode_batch_size=decode_batch_size, max_input_length=max_input_length, devices=devices,
                       trust_plugins=trust_plugins)
        return ensemble([load(path, **options) for path in workdir])
    if not isinstance(workdir, (str, os.PathLike)) or not str(workdir):
        raise UserError(f"workdir: must be a path or URL of a run (a non-empty string), or a list of them; got "
                        f"{workdir!r:.60}")
    overrides = load_options.overrides(dtype=dtype, decode_batch_size=decode_batch_size,
                                       max_input_length=max_input_length)
    return Model(restore.load_trained(os.fspath(workdir), average_last=average_last, checkpoint=checkpoint,
                                      caller="lconv.load", spell=str, overrides=overrides,
                                      devices=load_options.checked_devices(devices),
                                      trust_plugins=trust_plugins))


def ensemble(models: Sequence[Model]) -> Model:
    """``models`` decoding together, as fairseq-generate's ``--path a.pt:b.pt``: their next-token distributions are
    averaged at each step (``lconv.nn.ensemble``). The result is a ``Model`` with the first model's config and
    tokenizer, which every member must share; a member that is an ensemble adds its members, so each weighs the same."""
    if isinstance(models, (str, Model)) or not isinstance(models, Sequence) or not models:
        raise UserError("models: pass a non-empty list of lconv.Model (lconv.load(...) of each run)")
    for i, model in enumerate(models):
        if not isinstance(model, Model):
            raise UserError(f"models[{i}]: must be an lconv.Model; got {type(model).__name__}")
    members = [restore.Trained(m.config, m.workdir, m.tokenizer, m.module, m.params, m.steps) for m in models]
    return Model(ensembles.combine(members, [f"models[{i}]" for i in range(len(models))]))


class Model(probing.Probing):
    """A trained run: ``translate`` / ``score`` / ``bleu`` (translation, summarisation), ``generate`` /
    ``perplexity`` (language models), ``kernels`` (the normalised conv kernels, for plots). Fields: ``config``
    (the stored config), ``tokenizer``, ``module`` (the flax model), ``params``, ``steps`` (the checkpoints they
    come from; an ensemble's: every member's, in order)."""

    def __init__(self, trained: restore.Trained):
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
                  nbest: int | None = None, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None,
                  prefix: str | Sequence[int] | Sequence[str | Sequence[int]] | None = None,
                  no_repeat_ngram_size: int | None = None, min_len: int | None = None
                  ) -> str | list[str] | list[dict[str, Any]] | list[list[dict[str, Any]]]:
        """One output per source (``""`` for a blank one), a string for a string and a list for a list: by beam
        search (``beam_size`` / ``lenpen`` default to the stored ``config.decode``'s), or with ``temperature > 0``
        a sample (after ``top_k`` and nucleus ``top_p`` filtering), drawn from ``seed`` and the source alone: the
        same source and seed give the same sample alone or in any batch. A sampling setting left as None is
        ``lconv.decode_settings.SamplingSettings``' default (temperature 0: beam search; no filter; seed 0).

        With ``nbest=k`` each output is instead a list of up to k dicts, best first (a blank source's is empty):
        ``"text"``; ``"score"``, the search's ``sum(token_scores) / len(token_scores)**lenpen`` (fairseq's);
        ``"token_scores"``, each output token's log-probability under the model (EOS included; before temperature
        and filters, so ``score`` gives the same numbers); ``"tokens"``, the token ids (what ``score`` takes to
        rescore exactly this hypothesis). Beam search gives the best k of its beams (k <= the beam size);
        sampling draws k samples. Sources longer than ``config.data.eval_max_input_length`` tokens are cut to it.

        ``prefix`` forces the start of each output (fairseq's ``prefix_tokens``): a string or token ids for a
        string source, a list of them (one per source) for a list. The outputs hold the prefix, and its tokens are
        scored under the model as the rest are (so ``score`` of an output gives its scores).

        Generation guards (fairseq's; None = the stored ``config.decode``'s, 0 = off): ``no_repeat_ngram_size=n``
        lets no n-gram appear twice in an output (its prefix included), ``min_len=m`` forbids EOS before m output
        tokens (the length limit still wins)."""
        self._need("translate", ("translation", "summarization"))
        lines = _lines(sources, "sources", one_allowed=True)
        schema.check_search(beam_size=beam_size, lenpen=lenpen, spell=str,  # the arguments' own names
                            vocab_size=self.tokenizer.vocab_size, no_repeat_ngram_size=no_repeat_ngram_size,
                            min_len=min_len)
        limit = int(self.config.data.eval_max_target_length)
        schema.check_sampling(dict(max_len=limit, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                              vocab_size=self.tokenizer.vocab_size)
        settings = DecodeSettings.build(self.config.decode, lenpen=lenpen, temperature=temperature, top_k=top_k,
                                        top_p=top_p, seed=seed, no_repeat_ngram_size=no_repeat_ngram_size,
                                        min_len=min_len,
                                        beam_size=self._hypotheses_per_source(nbest, beam_size, temperature))
        prefixes = None if prefix is None else self._prefix_ids(prefix, lines, isinstance(sources, str), settings)
        if self._translator is None:
            self._translator = compiled.Translator(self.config.infer, self.module, self.params)
        found = per_line.translate_lines(self.config.infer, self.module, self.params, self.tokenizer, lines,
                                                 settings, translator=self._translator, nbest=nbest or 0,
                                                 prefixes=prefixes)
        outputs = found.hypotheses if nbest is None else found.nbest
        return outputs[0] if isinstance(sources, str) else outputs

    def _prefix_ids(self, prefix: Any, lines: list[str], one: bool, settings: DecodeSettings) -> list[np.ndarray]:
        """``translate``'s ``prefix`` as id arrays, one per line, each checked to leave room for EOS in the output
        limit of the line's own bucket (a batch's programs are at least as long)."""
        ids = _target_ids(self.tokenizer, [prefix] if one else prefix, one, name="prefix", eos_allowed=False,
                          empty_allowed=True)
        if len(ids) != len(lines):
            raise UserError(f"{len(lines)} sources for {len(ids)} prefixes; they pair one to one")
        data = self.config.data
        for i, (line, forced) in enumerate(zip(lines, ids)):
            source_len = min(len(self.tokenizer.encode(line)) + 1, data.eval_max_input_length)
            width = compiled.width_bucket(source_len, data.eval_max_input_length)
            limit = compiled.max_output_len(self.config.infer, settings, width)
            if len(forced) >= limit:
                raise UserError(f"{'prefix' if one else f'prefix[{i}]'}: {len(forced)} tokens; the output of this "
                                f"source holds at most {limit} (config.decode.max_len_a/b, "
                                f"config.data.eval_max_target_length), EOS included")
        return ids

    def _hypotheses_per_source(self, nbest: int | None, beam_size: int | None, temperature: float | None) -> int:
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
        ``config.data.eval_max_target_length`` (EOS included in both), so a translation scores whole.

        For an LM the sources are prompts and the targets their continuations: log p of each continuation token
        and EOS given BOS and the prompt (what ``generate``'s n-best entries hold), a pair longer than
        ``config.model.max_len`` keeping the prompt's last tokens."""
        self._need("score", ("translation", "summarization", "lm"))
        one = isinstance(sources, str)
        source_lines = _lines(sources, "sources", one_allowed=True)
        target_ids = _target_ids(self.tokenizer, [targets] if one else targets, one)
        if len(source_lines) != len(target_ids):
            raise UserError(f"{len(source_lines)} sources for {len(target_ids)} targets; they pair one to one")
        if self.task == "lm":
            prompts = self.tokenizer.encode_batch(source_lines)
            _warn_of_cut([len(p) + len(t) + 1 for p, t in zip(prompts, target_ids)], int(self.config.model.max_len),
                         "sources[{}]", "config.model.max_len, prompt + continuation + EOS; the prompt keeps its "
                         "last tokens")
            log_probs = self._function("lm_token_log_probs", functools.partial(lm_scoring.token_log_probs,
                                                                               self.module))
            out = lm_scoring.continuation_scores(self.config.infer, log_probs, self.params, prompts, target_ids)
            return out[0] if one else out
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
             lenpen: float | None = None, no_repeat_ngram_size: int | None = None,
             min_len: int | None = None) -> dict[str, Any]:
        """Translates ``sources`` and scores them against ``references``: sacreBLEU (``bleu``, ``bleu_signature``)
        and tokenized BLEU for translation, ROUGE-1/2/L and ROUGE-Lsum for summarisation."""
        sources, references = _lines(sources, "sources"), _lines(references, "references")
        if len(sources) != len(references):
            raise UserError(f"{len(sources)} sources for {len(references)} references; they pair one to one")
        if not sources:
            raise UserError("sources: an empty corpus has no BLEU; give at least one source and reference")
        hypotheses = self.translate(sources, beam_size=beam_size, lenpen=lenpen,
                                    no_repeat_ngram_size=no_repeat_ngram_size, min_len=min_len)
        return scoring.score_texts(self.task, hypotheses, references)

    # --- language models -----------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str], *, max_len: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 beam_size: int | None = None, lenpen: float | None = None, nbest: int | None = None,
                 no_repeat_ngram_size: int | None = None, min_len: int | None = None
                 ) -> str | list[str] | list[dict[str, Any]] | list[list[dict[str, Any]]]:
        """Continues each prompt by up to ``max_len`` tokens: greedy at ``temperature=0``, else sampled (after
        ``top_k`` and nucleus ``top_p`` filtering) from ``seed``; a prompt's sample depends on it, the seed and
        the settings alone, not on the other prompts or its place among them. A sampling setting left as None is
        ``lconv.decode_settings.SamplingSettings``' default (50 tokens, greedy, no filter, seed 0). A prompt too
        long for ``config.model.max_len`` keeps its last tokens.

        With ``beam_size`` or ``nbest``, a beam search instead (``beam_size`` / ``lenpen`` default to the stored
        ``config.decode``'s), or with ``temperature > 0`` ``nbest`` samples; with ``nbest=k`` each output is a
        list of up to k dicts, best first, as ``translate`` gives them: ``"text"`` and ``"tokens"`` (the
        continuation, EOS last: forced at ``max_len``), ``"token_scores"`` (each one's log-prob given BOS, the
        prompt and the tokens before it: ``score(prompt, tokens)`` gives them again) and ``"score"``
        (``sum(token_scores) / len**lenpen`` over the continuation, which the beam ranks by).

        ``no_repeat_ngram_size`` / ``min_len``: the generation guards, as ``translate`` takes them; the prompt's
        n-grams count, and ``min_len`` counts continuation tokens."""
        self._need("generate", ("lm",))
        lines = _lines(prompts, "prompts", one_allowed=True)
        schema.check_sampling(dict(max_len=max_len, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                              vocab_size=self.tokenizer.vocab_size)
        schema.check_search(no_repeat_ngram_size=no_repeat_ngram_size, min_len=min_len, spell=str)
        scored = beam_size is not None or nbest is not None
        if lenpen is not None and not scored:
            raise UserError(f"lenpen={lenpen}: ranks a beam search's or n samples' hypotheses; pass beam_size or "
                            "nbest with it")
        if scored:
            schema.check_search(beam_size=beam_size, lenpen=lenpen, spell=str, vocab_size=self.tokenizer.vocab_size)
            beam_size = self._hypotheses_per_source(nbest, beam_size, temperature)
        settings = DecodeSettings.build(self.config.decode, max_len=max_len, temperature=temperature, top_k=top_k,
                                        top_p=top_p, seed=seed, beam_size=beam_size, lenpen=lenpen,
                                        no_repeat_ngram_size=no_repeat_ngram_size, min_len=min_len)
        if self._generator is None:
            self._generator = compiled.Generator(self.config.infer, self.module, self.params)
        found = per_line.generate_lines(self.config.infer, self.tokenizer, lines, self._generator, settings,
                                                nbest=(nbest or 1) if scored else 0)
        outputs = found.hypotheses if nbest is None else found.nbest
        return outputs[0] if isinstance(prompts, str) else outputs

    def perplexity(self, texts: str | Sequence[str], *, sample_break_mode: str = "eos",
                   tokens_per_sample: int | None = None, context_window: int = 0,
                   per_text: bool = False) -> dict[str, float] | list[dict[str, float]]:
        """Token-level ``ppl``, ``nll`` per token and ``tokens`` (EOS counted) of ``texts`` under an LM: of the
        corpus for a list, or with ``per_text=True`` a list of them, one per text; one text's for a string.

        By default each text is scored alone, cut to ``config.data.eval_max_target_length`` tokens. The keyword
        arguments are ``fairseq-eval-lm``'s (``lconv.infer.lm_blocks``): ``sample_break_mode="none"`` scores the
        texts as one stream in blocks of ``tokens_per_sample`` tokens (default ``eval_max_target_length``),
        ``"complete"`` packs whole texts into such blocks, and ``context_window`` gives each block that many
        tokens before it as unscored context. fairseq prints its loss in base 2 and ``2**loss`` as its perplexity:
        ``nll / ln 2`` and ``ppl`` here.

        A document-stream run (``data.stream``) scores the texts as documents, as eval.py scores a split:
        streamed in its windows, its mixers' state carried across them (``per_text``: each text streamed alone)."""
        self._need("perplexity", ("lm",))
        if self.config.data.stream:
            return self._stream_perplexity(texts, per_text, (sample_break_mode, tokens_per_sample, context_window))
        limit = int(self.config.data.eval_max_target_length)
        blocks = dict(sample_break_mode=sample_break_mode, tokens_per_sample=tokens_per_sample,
                      context_window=context_window)
        if isinstance(texts, str) and not per_text:  # one text: a corpus of one, the same program and numbers
            return self.perplexity([texts], **blocks)
        if per_text:
            return self._text_perplexities(texts, (sample_break_mode, tokens_per_sample, context_window))
        if isinstance(texts, Sequence) and not isinstance(texts, (bytes, bytearray)) and len(texts) == 0:
            raise UserError("texts: an empty list has no perplexity (0 tokens); give at least one text")
        if (sample_break_mode, tokens_per_sample, context_window) != ("eos", None, 0):
            return self._fairseq_perplexity(texts, sample_break_mode, tokens_per_sample or limit, context_window)
        ids = self.tokenizer.encode_batch(_lines(texts, "texts", one_allowed=True))
        _warn_of_cut_texts(ids, limit)
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

    def _stream_perplexity(self, texts: str | Sequence[str], per_text: bool, blocks: tuple[Any, ...]) -> Any:
        """``perplexity`` of a document-stream run: the texts are documents, streamed as eval.py streams a split
        (``loss_pass.stream_perplexity``: its windows, its state carried across them)."""
        if blocks != ("eos", None, 0):
            raise UserError(f"sample_break_mode={blocks[0]!r}, tokens_per_sample={blocks[1]}, context_window="
                            f"{blocks[2]}: a document-stream run scores texts in its own windows "
                            f"(data.max_target_length={self.config.data.max_target_length}); leave them unset")
        if hasattr(self.module, "members"):  # the stream's state is each member's: no mixture carries it
            raise UserError("perplexity: an ensemble of document-stream LMs has none here (each member carries its "
                            "own state across windows); score each run alone")
        documents = _lines(texts, "texts", one_allowed=True)
        if not documents:
            raise UserError("texts: an empty list has no perplexity (0 tokens); give at least one text")
        if "stream_eval_step" not in self._jitted:
            self._jitted["stream_eval_step"] = loss_pass.jit_eval_step(
                self.config, model_setup.make_mesh(self.config.mesh))
        score = functools.partial(loss_pass.stream_perplexity, self.config, self.module, self.params,
                                  self.tokenizer, eval_step=self._jitted["stream_eval_step"])
        if per_text:
            out = []
            for index, document in enumerate(documents):
                try:
                    out.append(score([document]))
                except UserError as err:  # an empty text: say which
                    where = "texts" if isinstance(texts, str) else f"texts[{index}]"
                    raise UserError(f"{where}: {str(err).removeprefix('texts: ')}") from None
            return out[0] if isinstance(texts, str) else out
        return score(documents)

    def _text_perplexities(self, texts: str | Sequence[str], blocks: tuple[Any, ...]) -> Any:
        """``perplexity`` of each text alone (fairseq-eval-lm's ``--sample-break-mode eos``, per text)."""
        if blocks != ("eos", None, 0):
            raise UserError(f"sample_break_mode={blocks[0]!r}, tokens_per_sample={blocks[1]}, context_window="
                            f"{blocks[2]}: blocks span texts; per-text results score each text alone (the defaults)")
        encoded = self.tokenizer.encode_batch(_lines(texts, "texts", one_allowed=True))
        _warn_of_cut_texts(encoded, int(self.config.data.eval_max_target_length))
        log_probs = self._function("lm_token_log_probs", functools.partial(lm_scoring.token_log_probs, self.module))
        out = lm_scoring.text_perplexities(self.config.infer, log_probs, self.params, encoded)
        return out[0] if isinstance(texts, str) else out

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

    # --- helpers -------------------------------------------------------------------------------------------
    def _function(self, name: str, fn: Any) -> Any:
        """``fn`` jitted once per model (one compilation per shape bucket)."""
        if name not in self._jitted:
            self._jitted[name] = jax.jit(fn)
        return self._jitted[name]

    def _one_model(self, method: str) -> None:
        if isinstance(self.module, model_ensemble.Ensemble):
            raise UserError(f"{method}() reads one model's layers; {self.workdir} is an ensemble: call it on one of "
                            "its models")

    def _need(self, method: str, tasks: tuple[str, ...]) -> None:
        if self.task not in tasks:
            other = "translate / score / bleu" if self.task != "lm" else "generate / perplexity"
            raise UserError(f"{method}() is for {' and '.join(tasks)} runs; {self.workdir} is a {self.task} run "
                            f"(use {other})")

    def _piece(self, token: int) -> str:
        return {BOS_ID: "<s>", EOS_ID: "</s>", PAD_ID: "<pad>"}.get(token) or self.tokenizer.detokenize([token]) or "▁"



def _warn_of_cut_texts(ids: Sequence[Sequence[int]], limit: int) -> None:
    """The one rule for long inputs, for ``perplexity``'s texts: each is cut to ``limit`` tokens (EOS included),
    and one warning names those that were."""
    _warn_of_cut([len(x) + 1 for x in ids], limit, "texts[{}]", "config.data.eval_max_target_length, EOS included; "
                 "sample_break_mode='none' scores long texts whole")


def _warn_of_cut(lengths: Sequence[int], limit: int, name: str, where: str) -> None:
    """One warning naming the inputs (``name.format(index)``) whose ``lengths`` (tokens) pass ``limit``: the rule
    every surface that cuts long inputs follows (``source_lengths.SourceLengths``)."""
    cut = [i for i, n in enumerate(lengths) if n > limit]
    source_lengths.SourceLengths(cut, max(lengths, default=0), limit, [lengths[i] for i in cut]).log(
        name.format, where)

def _lines(texts: Any, argument: str, one_allowed: bool = False) -> list[str]:
    """``texts`` as a list of str, checked like the CLIs check their input: a one-line ``UserError`` naming the
    argument (and the index) for anything else; ``None``, bytes or numbers are not turned into ``"None"``."""
    if isinstance(texts, str):
        if one_allowed:
            return tokenizer_lib.check_texts([texts], argument)
        raise UserError(f"{argument}: pass a list of strings (one per example), not one string")
    return tokenizer_lib.check_texts(texts, argument)


def _target_ids(tokenizer: Any, targets: Any, one: bool, *, name: str = "targets", eos_allowed: bool = True,
                empty_allowed: bool = False) -> list[np.ndarray]:
    """``score``'s targets (or ``translate``'s prefixes: ``name``) as id arrays without EOS: a string is encoded,
    ids are taken as they are (an n-best entry's ``"tokens"``, whose last, EOS, is dropped: ``score`` appends it;
    a prefix holds no EOS, and may be empty). One-line errors name the target."""
    if isinstance(targets, str) or not isinstance(targets, Sequence):
        raise UserError(f"{name}: pass {'one string (or token ids) for one source' if one else 'a list'}; "
                        f"got {type(targets).__name__}")
    out = []
    for i, target in enumerate(targets):
        named = name if one else f"{name}[{i}]"
        if isinstance(target, (bytes, bytearray)):
            raise UserError(f"{named}: must be a string or a list of token ids; got bytes (decode them first: "
                            f"{target!r:.40}.decode('utf-8'))")
        if isinstance(target, str):
            out.append(np.asarray(tokenizer.encode(tokenizer_lib.check_text(target, name)), np.int32))
            continue
        ids = np.asarray(target) if isinstance(target, (Sequence, np.ndarray)) else None
        ids = ids if ids is not None and (len(ids) or empty_allowed) else None
        if ids is not None and len(ids) == 0:
            out.append(np.zeros((0,), np.int32))
            continue
        lowest = PAD_ID + 1  # PAD is no token: a score counted a log-probability for it, a prefix forced it
        if ids is None or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids < lowest).any() \
                or (ids >= tokenizer.vocab_size).any() or (ids[:-1] == EOS_ID).any() \
                or (ids[-1] == EOS_ID and not eos_allowed):
            rule = f"with EOS ({EOS_ID}) last if anywhere" if eos_allowed else f"without EOS ({EOS_ID})"
            raise UserError(f"{named}: must be a string or a {'' if empty_allowed else 'non-empty '}list of token "
                            f"ids in [{lowest}, {tokenizer.vocab_size}) {rule}; got {target!r:.60}")
        out.append(ids[:-1].astype(np.int32) if ids[-1] == EOS_ID else ids.astype(np.int32))
    return out


_pad_rows = compiled.pad_rows  # Id arrays -> [rows, width] int32, PAD after each and in the missing rows
