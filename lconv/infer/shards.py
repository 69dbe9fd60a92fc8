"""An eval split gathered from its process shards into source order, so every process decodes and scores all of it
(collectives: every process calls them at the same point)."""
from __future__ import annotations

import collections
import json
import math
from typing import Any

import jax
import numpy as np

from lconv.data import pipeline


def whole_split(eval_set: pipeline.EvalSet, rows: int) -> pipeline.EvalSet:
    """The whole split on every process, in source order, ``rows`` rows per batch, from this process's shard (or as it
    is when already whole)."""
    count = jax.process_count()
    if count == 1 or eval_set.batch_size == rows:
        return eval_set
    if eval_set.batch_size * count != rows:
        raise ValueError(f"an eval set of {eval_set.batch_size} rows per batch is neither the whole split "
                         f"({rows} rows) nor one of {count} process shards of it ({rows // count} rows)")
    local = {"examples": eval_set.examples, "stats": dict(eval_set.stats),
             "tokens": [{key: ids.tolist() for key, ids in example.items()} for example in eval_set.tokens]}
    gathered = allgather_json(local)
    total = sum(len(shard["examples"]) for shard in gathered)
    if [len(shard["examples"]) for shard in gathered] != [len(range(p, total, count)) for p in range(count)]:
        raise ValueError(f"eval shards of {[len(s['examples']) for s in gathered]} examples are not the "
                         f"p::{count} shards of {total} examples that pipeline.make_eval_set builds")
    examples = [gathered[i % count]["examples"][i // count] for i in range(total)]
    tokens = [{key: np.asarray(ids, np.int32) for key, ids in gathered[i % count]["tokens"][i // count].items()}
              for i in range(total)]
    stats = sum((collections.Counter(shard["stats"]) for shard in gathered), collections.Counter())
    return pipeline.EvalSet(examples, tokens, rows, math.ceil(total / rows), dict(eval_set.lengths), stats)


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-able ``value``, in process order; the same list on every process."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(encoded)], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)  # process_allgather needs one shape on every process
    padded[:len(encoded)] = encoded
    gathered = np.asarray(multihost_utils.process_allgather(padded))  # [P, longest]
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths)]
