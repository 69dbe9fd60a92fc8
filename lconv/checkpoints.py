"""All orbax use in one place: the train state and the data-iterator state, saved together so resumes are exact.

A checkpoint is ``<workdir>/checkpoints/<step>/`` with two items: ``state`` (params, optimizer state, step; restored
straight into the target shardings) and ``data`` (the grain iterator's state as JSON). Orbax writes into a
temporary directory and renames it when complete, so a checkpoint left half-written by a crash is never listed
as a step and is ignored on restore.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, workdir, *, keep=5, save_every=1000, async_save=False):
        self.directory = os.path.join(os.path.abspath(os.path.expanduser(workdir)), "checkpoints")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=1, create=True, enable_async_checkpointing=async_save,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))
        self.save_every = save_every

    def latest_step(self):
        return self.manager.latest_step()

    def all_steps(self):
        return list(self.manager.all_steps())

    def save(self, step, state, data_state, *, force=False):
        """Saves at multiples of ``save_every`` (or when forced); returns whether it saved."""
        if not force and (step % self.save_every):
            return False
        if step in self.manager.all_steps():
            return False
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
        self.manager.wait_until_finished()
        return True

    def restore(self, abstract_state, step=None):
        """``(state, data_state)`` at ``step`` (default: latest), laid out as ``abstract_state``'s shardings.

        A checkpoint whose arrays do not fit the current config's shapes is a one-line ``ValueError``.
        """
        step = self.manager.latest_step() if step is None else step
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"checkpoint {self.directory}/{step} does not fit this config's model ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200]}); use the config stored with it or a new --workdir"
            ) from None
        return restored["state"], restored["data"]

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree):
    """Shape/dtype/sharding structs of a (possibly sharded) pytree, the target layout for a restore."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)
