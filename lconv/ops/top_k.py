"""``jax.lax.top_k`` that keeps a sharded batch sharded: used by the kNN memory's retrieval and by beam search."""
from __future__ import annotations

import math

import jax

from lconv.constants import BATCH_MESH_AXES


def rowwise_top_k(scores_B___: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last axis, shard by shard when a mesh splits the rows (XLA would all-gather them)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in BATCH_MESH_AXES if a in mesh.axis_names)
    shards = math.prod(mesh.shape[a] for a in axes)
    if shards <= 1 or scores_B___.shape[0] % shards:
        return jax.lax.top_k(scores_B___, k)
    spec = jax.sharding.PartitionSpec(axes)
    return jax.shard_map(lambda s: tuple(jax.lax.top_k(s, k)), in_specs=spec, out_specs=(spec, spec))(scores_B___)
