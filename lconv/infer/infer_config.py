"""What decoding and scoring read of a run's config, as one typed, frozen object (``RunConfig.infer`` makes it):
``lconv.infer`` sits below the schema's layer, so it takes this view."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class InferConfig:
    task: str  # translation | summarization | lm
    mesh_rules: tuple  # config.mesh.rules: logical axis -> mesh axis
    batch_size: int  # config.decode.batch_size: rows per decoding batch; 0 = auto (compiled.decode_rows)
    eval_batch_size: int  # config.data.eval_batch_size
    max_input_length: int  # config.data.eval_max_input_length: a source's tokens, EOS included
    max_target_length: int  # config.data.eval_max_target_length: an output's or a scored text's tokens
    max_positions: int  # config.model.max_len: an LM's prompt + continuation
    split: str = "test"  # config.decode.split: what eval.py and the final evaluation decode
    compound_split: bool = False  # config.decode.compound_split: BLEU of split compounds
    num_print: int = 5  # config.decode.num_print: sample outputs logged
