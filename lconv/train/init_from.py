"""Starting a run from another run's params (``train.init_from``): fine-tuning on new data or with another config, as
t5x's ``initial checkpoint`` does. The new run has its own optimizer state, step 0, schedule and data; it takes the
source's params and tokenizer, so its model must be the source's. The rules: docs/training.md, "Starting from another
run (fine-tuning)"."""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
from etils import epath

from lconv.data import paths
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.fields import schema_fields
from lconv.nn.model_config import ModelConfig
from lconv.run import checkpoints, model_setup, restore
from lconv.run import workdir as workdir_lib
from lconv.run.schema import RunConfig
from lconv.train import setup

logger = logging.getLogger(__name__)

FIELD = "config.train.init_from"


class Source:
    """The run ``config.train.init_from`` names: its resolved workdir and stored config, checked against ``config``."""

    def __init__(self, config: RunConfig) -> None:
        self.given = config.train.init_from
        self.workdir = restore.find_run(self.given, FIELD)
        self.config = restore.read_config(self.workdir, FIELD)
        self.label = f"{FIELD}={self.given}"

    def check(self, config: RunConfig) -> None:
        """The task, ``data.vocab_size`` and the model's fields against the source's: one line naming what differs."""
        theirs, ours = self.config, config
        if theirs.task != ours.task:
            raise UserError(f"{self.label}: config.task is {ours.task!r} here and {theirs.task!r} there; a run "
                            "starts only from a run of its own task")
        if theirs.data.vocab_size != ours.data.vocab_size:
            raise UserError(f"{self.label}: config.data.vocab_size is {ours.data.vocab_size} here and "
                            f"{theirs.data.vocab_size} there; the run takes the source's tokenizer, so set "
                            f"--config.data.vocab_size={theirs.data.vocab_size}")
        differing = [f.name for f in schema_fields(ModelConfig)
                     if getattr(ours.model, f.name) != getattr(theirs.model, f.name)]
        if differing and _param_shapes(ours) != _param_shapes(theirs):
            changes = ", ".join(f"config.model.{name} is {getattr(ours.model, name)!r} here and "
                                f"{getattr(theirs.model, name)!r} there" for name in differing)
            raise UserError(f"{self.label}: its params do not fit this model: {changes}")

    def copy_tokenizer(self, workdir: str) -> None:
        """The source's tokenizer into ``workdir`` (process 0) unless the same file is there. Both are read as every
        reader of a run's tokenizer reads it: a regular file of a tokenizer's size inside its run (a link out of the
        source was copied in, and a pipe there hung train.py)."""
        if jax.process_index() != 0:
            return
        for name in (tokenizer_lib.Tokenizer.filename, tokenizer_lib.PiecesTokenizer.filename):
            theirs, ours = epath.Path(self.workdir) / name, epath.Path(workdir) / name
            if not _present(theirs):
                continue
            data = paths.read_bytes(theirs, "missing", within=self.workdir, limit=tokenizer_lib.TOKENIZER_LIMIT)
            if not _present(ours):
                workdir_lib.write_atomically(ours, data)
            elif paths.read_bytes(ours, "missing", within=workdir, limit=tokenizer_lib.TOKENIZER_LIMIT) != data:
                raise UserError(f"{self.label}: {ours} is another tokenizer than the source's {theirs}; a run "
                                "started from another run uses that run's (remove this one)")
            return
        raise UserError(f"{self.label}: no tokenizer in {self.workdir}")

    def _checkpointer(self, config: RunConfig) -> tuple[checkpoints.Checkpointer, int]:
        """A reader of the source's chosen checkpoints (``train.init_checkpoint``) and the step it starts from."""
        which = config.train.init_checkpoint
        ckpt = checkpoints.Checkpointer(self.workdir, subdir="checkpoints" if which == "latest" else "best",
                                        read_only=True)
        step = ckpt.latest_step()
        if step is None:
            ckpt.close()
            raise UserError(f"{self.label}: no checkpoint in {ckpt.directory}")
        return ckpt, step

    def check_checkpoint(self, config: RunConfig) -> None:
        """The step the run will start from, its folder and metadata files checked as its restore will (no file is
        hashed): a damaged one is one line before the new workdir is made."""
        ckpt, step = self._checkpointer(config)
        try:
            ckpt.check_step(step)
        finally:
            ckpt.close()

    def restore_params(self, run: setup.Run) -> None:
        """The source checkpoint's params into ``run.state`` (laid out as its own), with a fresh optimizer at step 0."""
        which = run.config.train.init_checkpoint
        ckpt, step = self._checkpointer(run.config)
        params = ckpt.restore_params(checkpoints.abstract_like(run.state.params), step,
                                     also_held=checkpoints.abstract_like(run.state.mixer_state))
        ckpt.close()
        run.state = run.state.replace(params=params)
        logger.info(f"starting from the params of {self.workdir} ({which} checkpoint, step {step}); a new "
                    "optimizer state, step 0")


def prepare(config: RunConfig, workdir: str) -> Source | None:
    """The checked source run of a new run with ``train.init_from`` (call before anything is written); None without one,
    or when ``workdir`` has a checkpoint."""
    if not config.train.init_from or checkpoints.has_checkpoint(workdir):
        return None
    source = Source(config)
    source.check(config)
    source.check_checkpoint(config)
    return source


def _param_shapes(config: RunConfig) -> Any:
    """The shapes and dtypes of ``config``'s model params (no array is made)."""
    model = model_setup.build_model(config)
    args, kwargs = model_setup.model_inputs(model_setup.dummy_batch(config))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs)["params"])
    return jax.tree.map(lambda x: (x.shape, str(x.dtype)), abstract)


def _present(path: epath.Path) -> bool:
    """A file there, or a link (a dangling one is named by the read, not taken for no file)."""
    return path.exists() or os.path.islink(os.fspath(path))
