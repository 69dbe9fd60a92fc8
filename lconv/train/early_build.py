"""The train state and the train step, built in background threads (the step compiling beside the state's
initialisers) while the corpus and tokenizer are prepared.

Neither needs the data (the shapes follow from the config, vocabulary size and batch shape), so the first update comes
sooner. What ``build_run`` finds is checked before use, so the early build can only save time, never change a result. It
runs on one process, where the workdir has no tokenizer yet; a small corpus of your own trains its tokenizer first
(``tokenizer_first``). Measurements: docs/default-run.md.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath

from lconv.data import own_files, pipeline, sources
from lconv.data.data_config import DataConfig
from lconv.errors import UserError
from lconv.run import model_setup
from lconv.run.schema import RunConfig
from lconv.train import update

logger = logging.getLogger(__name__)
PyTree = Any
THREAD_NAME = "lconv-early-build"  # the CLIs' exit does not wait for it (``lconv.cli.runtime.EARLY_BUILD_THREAD``)
# Below this many bytes of training text per piece asked, SentencePiece may give fewer pieces (docs/data.md).
BYTES_PER_PIECE = 100


@dataclasses.dataclass
class StateParts:
    """What ``build_run`` builds after the tokenizer: the model, optimizer, fresh state and its shardings."""

    model: nn.Module
    lr_schedule: optax.Schedule
    state: Any
    state_shardings: PyTree


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """``StateParts`` before the state is made: its ``layout`` (shapes, dtypes, shardings) is what the train step
    compiles for, so the step can compile while ``initialise`` compiles and runs (``lconv.train.setup.plan_state``)."""

    model: nn.Module
    lr_schedule: optax.Schedule
    initialise: Callable[[], Any]
    layout: PyTree
    state_shardings: PyTree

    def build(self) -> StateParts:
        return StateParts(self.model, self.lr_schedule, self.initialise(), self.state_shardings)


class PreparedStep:
    """``jitted`` with one program compiled ahead for one ``(state, batch, lr_factor)`` signature; any other call goes
    to ``jitted``."""

    def __init__(self, jitted: Callable, compiled: Any, state_signature: PyTree, batch_signature: PyTree) -> None:
        self.jitted, self.compiled = jitted, compiled
        self._state_signature, self._batch_signature = state_signature, batch_signature
        self._state_checked = False

    def __call__(self, state: Any, batch: Any, lr_factor: Any) -> Any:
        if self.compiled is not None and not self._state_checked:
            self._state_checked = True
            if signature(state) != self._state_signature:
                self._give_up("the state")
        if self.compiled is not None and signature(batch) != self._batch_signature:
            self._give_up("the batches")
        return (self.compiled or self.jitted)(state, batch, lr_factor)

    def _give_up(self, what: str) -> None:
        logger.info(f"the train step compiled during the data's preparation does not fit {what}: compiling it again")
        self.compiled = None


def signature(tree: PyTree) -> tuple:
    """The tree's structure and each leaf's shape, dtype and sharding: what a compiled program accepts."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x),
                           getattr(x, "sharding", None)) for x in leaves)


class EarlyBuild:
    """Starts the build of the state and the train step for ``vocab_size`` in a background thread, at once."""

    def __init__(self, config: RunConfig, mesh: jax.sharding.Mesh, vocab_size: int,
                 build_state: Callable[[int], StatePlan]) -> None:
        self.vocab_size = vocab_size
        self._config, self._mesh = config, mesh
        self._cancelled = threading.Event()
        pipeline.import_readers()  # before the thread: their imports would hand its imports stand-ins
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._future = executor.submit(self._build, build_state)
        executor.shutdown(wait=False)

    def cancel(self) -> None:
        """The caller failed: the thread stops at its next stage rather than compile on."""
        self._cancelled.set()

    def _build(self, build_state: Callable[[int], StatePlan]) -> tuple[StateParts, PreparedStep] | None:
        plan = build_state(self.vocab_size)
        if self._cancelled.is_set():
            return None
        # The state's initialisers compile and run in a second thread while this one compiles the step: two
        # programs that need nothing of each other, on two cores where there are two.
        helper = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        made = helper.submit(plan.build)
        helper.shutdown(wait=False)
        config, mesh = self._config, self._mesh
        jitted = update.jit_train_step(config, plan.lr_schedule, plan.state_shardings, mesh)
        sharding = model_setup.batch_sharding(mesh)
        rows = model_setup.dummy_batch(config, config.data.batch_size)
        if config.data.stream:  # a document stream's batches also say which rows start a document (lconv.data.stream)
            rows["document_start"] = np.zeros((config.data.batch_size,), np.int32)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in rows.items()}
        with jax.set_mesh(mesh):
            lowered = jitted.lower(plan.layout, batch, jax.ShapeDtypeStruct((), jnp.float32))
            compiled = None if self._cancelled.is_set() else lowered.compile()
        parts = made.result()
        if compiled is None:
            return None
        return parts, PreparedStep(jitted, compiled, signature(plan.layout), signature(batch))

    def result_for(self, vocab_size: int) -> tuple[StateParts, PreparedStep] | None:
        """The state and step if built for ``vocab_size`` (waits for them); else None. A ``UserError`` is raised as the
        usual order would; other failures are logged and left to it."""
        if vocab_size != self.vocab_size:
            logger.info(f"the state built during the data's preparation assumed a vocabulary of {self.vocab_size}; "
                        f"the tokenizer has {vocab_size}: building it again")
            return None
        try:
            return self._future.result()
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 (built again in order, where a real error surfaces)
            line = (str(err).strip().splitlines() or [""])[0]
            logger.info(f"the state built during the data's preparation failed ({type(err).__name__}: {line}): "
                        "building it again")
            return None


def tokenizer_first(data_config: DataConfig) -> bool:
    """Whether the tokenizer is trained before the early build: your own files under ``BYTES_PER_PIECE``."""
    if data_config.dataset != sources.FILES:
        return False
    try:
        train = own_files.find_files(sources.files_layout(data_config))["train"]
        size = sum(int(epath.Path(path).stat().length) for path in train.values())
    except (UserError, OSError, KeyError, ValueError):
        return False
    return size < BYTES_PER_PIECE * int(data_config.vocab_size)
