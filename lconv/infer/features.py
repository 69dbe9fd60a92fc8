"""Each layer's hidden states as a model computes them, for probing (fairseq hub's ``extract_features``, Hugging Face's
``output_hidden_states``): per side ``L + 1`` states (the embeddings, each layer's output, the last after the final
norm), captured from one teacher-forced pass with ``capture_intermediates``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from lconv.constants import PAD_ID

if TYPE_CHECKING:
    import flax.linen as nn

# The modules whose outputs the sides' first layers read, per model kind (lconv.nn.models)
STACK_INPUTS = {"encoder": "source_positions", "decoder": "target_positions", "lm": "scale_and_position"}


def layer_states(model: nn.Module, params: Any, *ids: jax.Array, lm: bool) -> dict[str, list[jax.Array]]:
    """Per side, the ``L + 1`` states ``[B, T, C]`` of the teacher-forced pass on ``ids`` (PAD after each row)."""
    inputs = {"decoder": STACK_INPUTS["lm"]} if lm else {side: STACK_INPUTS[side] for side in ("encoder", "decoder")}
    wanted = set(inputs) | set(inputs.values())

    def captured(module: nn.Module, method: str) -> bool:
        return method == "__call__" and (module.name in wanted or (module.name or "").startswith("layer_"))

    segmentation = [(x != PAD_ID).astype(jnp.int32) for x in ids]
    if lm:
        kwargs = dict(targets_segmentation=segmentation[0])
    else:
        kwargs = dict(inputs_segmentation=segmentation[0], targets_segmentation=segmentation[1])
    _, state = model.apply({"params": params}, *ids, **kwargs, capture_intermediates=captured,
                           mutable=["intermediates"])
    found = state["intermediates"]
    out = {}
    for side, first in inputs.items():
        layers = sum(name.startswith("layer_") for name in params[side])
        out[side] = ([found[first]["__call__"][0]] + [found[side][f"layer_{i}"]["__call__"][0]
                                                      for i in range(layers - 1)] + [found[side]["__call__"][0]])
    return out
