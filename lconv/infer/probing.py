"""Reading a trained model's insides, for plots and probing: ``lconv.api.Model``'s ``kernels`` and ``extract_features``,
for one model's layers (an ensemble has none of its own)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lconv.constants import EOS_ID, PAD_ID
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.fields import is_integer
from lconv.infer import compiled, features, source_lengths


class Probing:
    """``lconv.api.Model``'s probing methods, reading the model's config, tokenizer, module, params and helpers."""

    def kernels(self, sentence: str) -> dict[str, Any]:
        """The normalised conv kernels ``sentence`` meets per layer of each side (LightConv ``[H, K]``, DynamicConv
        ``[T, H, K]``, others ``None``), with the tokens each side reads; the decoder is teacher-forced on the
        translation."""
        self._one_model("kernels")
        inputs, targets, ids = self._teacher_forced_ids(sentence, None)
        kernel_logits = self._function("kernel_logits", self._kernel_logits)
        sides = {"decoder": len(targets)} if inputs is None else {"encoder": len(inputs), "decoder": len(targets)}
        out = {}
        for side, layers in kernel_logits(self.params, *ids).items():
            out[side] = [_normalised(logits, sides[side]) for logits in layers]
        return {**out, **self._tokens_read(inputs, targets)}

    def extract_features(self, sentence: str, *, layer: int | None = None,
                         target: str | None = None) -> dict[str, Any]:
        """Each layer's hidden states on ``sentence``, keyed as ``kernels``: per side L + 1 float32 ``[T, C]`` states
        (``layer=i``: one); the decoder reads ``target``, else the translation."""
        self._one_model("extract_features")
        if layer is not None and not is_integer(layer):  # before any work; True would be taken as layer 1
            raise UserError(f"layer={layer!r}: must be an integer index of a side's states (or None for all)")
        if target is not None and self.task == "lm":
            raise UserError("target: an LM reads the sentence itself; pass target= to a translation run only")
        inputs, targets, ids = self._teacher_forced_ids(sentence, target)
        states = self._function("layer_states", functools.partial(features.layer_states, self.module,
                                                                   lm=self.task == "lm"))(self.params, *ids)
        lengths = {"decoder": len(targets)} if inputs is None else {"encoder": len(inputs), "decoder": len(targets)}
        out = {}
        for side, side_states in states.items():
            cut = [np.asarray(x[0, :lengths[side]], np.float32) for x in side_states]
            if layer is not None and not (is_integer(layer) and -len(cut) <= layer < len(cut)):  # True is no layer
                raise UserError(f"layer={layer!r}: the {side} has {len(cut)} states (0 = its embeddings, "
                                f"{len(cut) - 1} = its output); pass one of -{len(cut)}..{len(cut) - 1}")
            out[side] = cut if layer is None else cut[layer]
        return {**out, **self._tokens_read(inputs, targets)}

    def _teacher_forced_ids(self, sentence: str, target: str | None) -> tuple[Any, np.ndarray, list[np.ndarray]]:
        """``(source ids or None, target ids, the padded [1, width] rows the model reads)``, cut to the eval limits."""
        tokenizer_lib.check_text(sentence, "sentence")
        if target is not None:
            tokenizer_lib.check_text(target, "target")
        data = self.config.data
        if self.task == "lm":
            inputs, targets = None, _cut(self.tokenizer.encode(sentence), data.eval_max_target_length, "sentence",
                                         "config.data.eval_max_target_length")
        else:
            inputs = _cut(self.tokenizer.encode(sentence), data.eval_max_input_length, "sentence",
                          "config.data.eval_max_input_length")
            translation = self.translate([sentence])[0] if target is None else target
            targets = _cut(self.tokenizer.encode(translation), data.eval_max_target_length,
                           "target" if target is not None else "its translation", "config.data.eval_max_target_length")
        ids = [compiled.pad_rows([x], 1, compiled.width_bucket(len(x), limit)) for x, limit in
               ([] if inputs is None else [(inputs, data.eval_max_input_length)])
               + [(targets, data.eval_max_target_length)]]
        return inputs, targets, ids

    def _tokens_read(self, inputs: np.ndarray | None, targets: np.ndarray) -> dict[str, list[str]]:
        """The pieces each side reads: the source, and the decoder's inputs (its start token, then the targets)."""
        out = {} if inputs is None else {"source_tokens": [self._piece(i) for i in inputs.tolist()]}
        start = self.module.config.decoder_start_id  # BOS, or EOS for a model imported from fairseq
        out["target_tokens"] = [self._piece(i) for i in [start] + targets[:-1].tolist()]
        return out

    def _kernel_logits(self, params: Any, *ids: jax.Array) -> dict[str, list[Any]]:
        """Per side and layer: the LightConv logits ``[H, K]``, the DynamicConv predictor's ``[T, H, K]``, or None."""
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


def _normalised(logits: Any, length: int) -> np.ndarray | None:
    """Softmax over K in float32, as the conv modules normalise their kernels; ``[T, H, K]`` cut to ``length``."""
    if logits is None:
        return None
    kernels = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    return kernels[:length] if kernels.ndim == 3 else kernels


def _cut(ids: Any, limit: int, name: str, where: str) -> np.ndarray:
    """``ids`` and EOS, cut to ``limit`` tokens, with the warning every surface gives a cut input."""
    ids = np.append(ids, EOS_ID)
    cut = [0] if len(ids) > limit else []
    source_lengths.SourceLengths(cut, len(ids), limit, [len(ids)] * len(cut)).log(
        lambda _: name, f"{where}, EOS included")
    return ids[:limit]
