"""Decoding programs jitted once per model and reused: a call compiles only for a shape bucket it has not seen.

Inputs are padded to a bucket of rows (``row_bucket``: powers of two up to the batch size) and a width
(``width_bucket``: ``WIDTHS``), so sentences of different lengths share a program. ``Translator`` runs beam search or
samples (``search.translate_hypotheses``); ``Generator`` continues LM prompts of different lengths in one program
(``generate``).
Both take the params as an argument (not a constant folded into the program), which is also what
``lconv.export`` serialises.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lconv.constants import BATCH_MESH_AXES, EOS_ID, IMPOSSIBLE_LOGP, PAD_ID
from lconv.decode_settings import DecodeSettings
from lconv.infer import guards as guards_lib
from lconv.infer import lm_search, search
from lconv.infer.infer_config import InferConfig
from lconv.nn import common as nn_common

if TYPE_CHECKING:
    import flax.linen as nn

WIDTHS = (32, 64, 128, 256, 512, 1024)  # source (or prompt) widths inputs are padded to


def width_bucket(length: int, limit: int) -> int:
    """The smallest of ``WIDTHS`` that holds ``length`` tokens, or ``limit`` (the padded width) when smaller."""
    return min([w for w in WIDTHS if w >= length] + [limit])


def row_bucket(count: int, rows: int) -> int:
    """Rows for ``count`` examples in batches of ``rows``: the next power of two, at most ``rows``."""
    return min(rows, 1 << max(count - 1, 0).bit_length())


# ``decode.batch_size = 0`` (auto) on a GPU/TPU: widen the eval batch by powers of two while rows x beam stay within
# this many hypotheses. A search step over a few hundred hypotheses of a base-sized model is a few dozen small
# kernels whose launches, not arithmetic, set its time there, so wider batches decode a split in fewer steps. On
# CPU a step's time grows with its rows, so the eval batch stays. Memory is the limit: see ``decode_batches``.
ACCELERATOR_HYPOTHESES = 2048


def decode_rows(config: InferConfig, platform: str, eval_rows: int, beam_size: int) -> int:
    """Rows (sources or prompts) per decoding batch: ``config.decode.batch_size``, or for 0 (auto) ``eval_rows``
    (``data.eval_batch_size``) on CPU and, on other platforms, ``eval_rows`` doubled while ``rows * beam_size``
    stays within ``ACCELERATOR_HYPOTHESES`` (a multiple of the eval batch, so it splits over the mesh alike)."""
    chosen = config.batch_size
    if chosen:
        return chosen
    rows = eval_rows
    if platform != "cpu":
        while rows * 2 * max(beam_size, 1) <= ACCELERATOR_HYPOTHESES:
            rows *= 2
    return rows


def platform_of(params: Any) -> str:
    """The platform ``params`` live on as JAX names devices (``cpu``, ``gpu``, ``tpu``); the default backend's for
    host arrays. Only "cpu or not" is read from it (``decode_rows``)."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices())).platform
    return jax.default_backend()


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a JAX runtime error is the device running out of memory (XLA's RESOURCE_EXHAUSTED)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def max_output_len(config: InferConfig, settings: DecodeSettings, width: int) -> int:
    """The decoded length for sources ``width`` wide: ``settings.max_len_a * width + settings.max_len_b``, at most
    the eval limit (``config.data.eval_max_target_length``)."""
    return int(min(settings.max_len_a * width + settings.max_len_b, config.max_target_length))


def mesh_of(params: Any) -> jax.sharding.Mesh | None:
    """The mesh ``params`` are laid out on, or None for plain arrays (decoded where they are)."""
    for leaf in jax.tree.leaves(params):
        if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding):
            return leaf.sharding.mesh
    return None


def row_sharding(mesh: jax.sharding.Mesh | None, rows: int) -> NamedSharding | None:
    """Rows split over the mesh's batch axes (replicated when ``rows`` does not divide); None without a mesh."""
    if mesh is None:
        return None
    axes = tuple(a for a in BATCH_MESH_AXES if a in mesh.axis_names)
    shards = math.prod(mesh.shape[a] for a in axes)
    return NamedSharding(mesh, PartitionSpec(axes) if shards > 1 and rows % shards == 0 else PartitionSpec())


def place(array: np.ndarray, sharding: NamedSharding | None) -> Any:
    """The same numpy array on every process -> one global array laid out by ``sharding`` (None: as it is)."""
    if sharding is None:
        return array
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


class Translator:
    """Beam search (or sampling) over one model's params: ``translator(inputs_BS, settings) -> best beams [B, L]``,
    ``translator.hypotheses(inputs_BS, settings) -> search.Hypotheses`` (numpy, every row on every process).
    One program per (rows, width, ``settings.program_key()``); ``lenpen`` and the seed are arguments, so changing
    them compiles nothing, and the best beam and the n-best lists come from the same program."""

    def __init__(self, config: InferConfig, model: nn.Module, params: Any):
        self.config, self.params, self.mesh = config, params, mesh_of(params)

        def hypotheses(params, inputs_BS, lenpen, seed, prefix=None, *, settings, output_len):
            segmentation_BS = (inputs_BS != PAD_ID).astype(jnp.int32)  # [B, S]
            return search.translate_hypotheses(
                model, {"params": params}, inputs_BS, inputs_segmentation=segmentation_BS,
                beam_size=settings.beam_size, max_len=output_len, lenpen=lenpen, max_len_a=settings.max_len_a,
                max_len_b=settings.max_len_b, stop=settings.stop, rng=jax.random.key(seed) if settings.sampling else
                None, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                prefix=prefix, guards=guards_lib.Guards.of(settings))  # [B, N, L], [B, N], [B, N, L]

        def best(params, inputs_BS, lenpen, *, settings, output_len):
            return hypotheses(params, inputs_BS, lenpen, jnp.uint32(0), settings=settings,
                              output_len=output_len).tokens[:, 0]  # [B, L]

        self.function = nn_common.under_axis_rules(best, config.mesh_rules)  # what lconv.export lowers
        replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        self.jitted = jax.jit(nn_common.under_axis_rules(hypotheses, config.mesh_rules), out_shardings=replicated,
                              static_argnames=("settings", "output_len"))
        # (rows, width, settings.program_key()) -> a Future of the program ``prepare`` compiles; shared with the
        # translators ``with_params`` makes, so a program prepared before training ends serves its final params
        self._prepared: dict[tuple[int, int, Any], concurrent.futures.Future] = {}

    def prepare(self, rows: int, width: int, settings: DecodeSettings) -> concurrent.futures.Future:
        """Compiles, in a background thread, the program for ``[rows, width]`` sources (no prefixes), so a later
        call of that shape does not wait for it: XLA compiles on one core while decoding or training beside it
        keeps the others busy. Returns the compilation's future."""
        key = (rows, width, settings.program_key())
        if key not in self._prepared:
            # The params' shapes and layouts, taken now: a training step may donate the arrays before the thread runs
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=getattr(x, "sharding", None)), self.params)
            self._prepared[key] = future = _background().submit(self._compile, params, rows, width, settings)
            _in_flight.add(future)
            future.add_done_callback(_in_flight.discard)
        return self._prepared[key]

    def _compile(self, params: Any, rows: int, width: int, settings: DecodeSettings) -> Any:
        sources = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=row_sharding(self.mesh, rows))
        with _mesh_context(self.mesh):
            return self.jitted.lower(params, sources, jnp.float32(settings.lenpen), jnp.uint32(settings.seed), None,
                                     settings=settings.program_key(),
                                     output_len=max_output_len(self.config, settings, width)).compile()

    def with_params(self, params: Any) -> Translator:
        """The same programs over other params of the same shapes (a training run's final ones): nothing compiles
        again."""
        other = copy.copy(self)
        other.params = params
        return other

    def __call__(self, inputs_BS: np.ndarray, settings: DecodeSettings) -> np.ndarray:
        """``inputs_BS``: source ids ending in EOS, PAD after, already cut to a bucket."""
        return self.hypotheses(inputs_BS, settings).tokens[:, 0]  # [B, L]

    def hypotheses(self, inputs_BS: np.ndarray, settings: DecodeSettings,
                   prefixes: Sequence[np.ndarray] | None = None) -> search.Hypotheses:
        """``settings.beam_size`` hypotheses per source, best first (``search.translate_hypotheses``): beams, or
        with ``settings.temperature > 0`` samples drawn from ``settings.seed``. ``prefixes``: per row the ids its
        outputs start with (``search.Prefix``; at most ``max_output_len - 1`` each), padded here to the output
        length, so a prefix adds one program per bucket, not one per prefix length."""
        inputs_BS = np.asarray(inputs_BS, np.int32)
        output_len = max_output_len(self.config, settings, inputs_BS.shape[1])
        rows = row_sharding(self.mesh, inputs_BS.shape[0])
        prefix = None if prefixes is None else search.Prefix(
            *(place(x, rows) for x in padded_prefixes(prefixes, inputs_BS.shape[0], output_len)))
        prepared = self._prepared.get((*inputs_BS.shape, settings.program_key())) if prefix is None else None
        with _mesh_context(self.mesh):
            args = (self.params, place(inputs_BS, rows), jnp.float32(settings.lenpen), jnp.uint32(settings.seed),
                    prefix)
            found = prepared.result()(*args) if prepared is not None else self.jitted(
                *args, settings=settings.program_key(), output_len=output_len)
            return search.Hypotheses(*map(np.asarray, found))  # replicated: every process reads all of it


def pad_rows(ids: Sequence[np.ndarray], rows: int, width: int) -> np.ndarray:
    """Id arrays -> ``[rows, width]`` int32, PAD after each and in the missing rows."""
    out = np.full((rows, width), PAD_ID, np.int32)
    for row, x in enumerate(ids):
        out[row, :len(x)] = x
    return out


def padded_prefixes(prefixes: Sequence[np.ndarray], rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row prefix ids -> ``(tokens [rows, width] PAD after each, lengths [rows])``; missing rows have none."""
    if any(len(ids) >= width for ids in prefixes):
        raise ValueError(f"a prefix of {max(map(len, prefixes))} tokens leaves no room for EOS in {width}")
    return pad_rows(prefixes, rows, width), np.asarray([len(ids) for ids in prefixes] + [0] * (rows - len(prefixes)),
                                                       np.int32)


def generate(model: nn.Module, variables: Any, prompt_BP: jax.Array, prompt_len_B: jax.Array, *, max_len: int,
             rng: jax.Array | None, temperature: float, top_k: int, top_p: float,
             guards: guards_lib.Guards | None = None) -> jax.Array:
    """Continues right-padded prompts of different lengths ``[B, P]`` (``prompt_len_B`` real tokens each) with a
    ``DecoderOnlyLM``; returns ``[B, P + max_len]`` tokens whose first ``prompt_len_B[b]`` are row b's prompt.

    The prompt is fed a token per step (``search.sample`` feeds one chunk, one length for all rows): while step
    ``i < prompt_len[b]`` row b's logits are a one-hot on its prompt token, which every filter then picks. So a
    batch of ragged prompts is one program, at the price of feeding prompts step by step. ``guards`` act after each
    row's prompt, which they read as part of the hypothesis.
    """
    B, P = prompt_BP.shape
    total = P + max_len
    # Positions fed: BOS, the prompt and every new token but the last (``search.sample`` never feeds the last).
    apply, cache = search.lm_decoder(model, variables, B, total)

    def tokens_to_logits(tokens_BT, state):
        cache, i = state
        logits_BTV, cache = apply(tokens_BT, cache)
        V = logits_BTV.shape[-1]
        forced_B = jax.lax.dynamic_index_in_dim(prompt_BP, jnp.minimum(i, P - 1), axis=1, keepdims=False)  # [B]
        one_hot_BV = jnp.where(jnp.arange(V) == forced_B[:, None], 0.0, IMPOSSIBLE_LOGP)  # [B, V]
        forcing_B1 = (i < prompt_len_B)[:, None]  # [B, 1]
        logits_BV = jnp.where(forcing_B1, one_hot_BV, logits_BTV[:, -1].astype(jnp.float32))  # [B, V]
        return logits_BV[:, None], (cache, i + 1)  # [B, 1, V]

    return search.sample(tokens_to_logits, (cache, jnp.int32(0)), B, total, rng, temperature=temperature,
                         top_k=top_k, top_p=top_p, bos_id=model.config.decoder_start_id, guards=guards,
                         output_start_B=prompt_len_B)  # [B, P + max_len]


class Generator:
    """LM sampling over one model's params: ``generator(prompt_BP, prompt_len_B, settings)`` -> continuations
    ``[B, settings.max_len]`` (numpy, PAD after EOS), ``generator.hypotheses(...)`` the scored beams or samples.
    One program per (rows, width, ``settings.program_key()``); ``lenpen`` and the seed are arguments."""

    def __init__(self, config: InferConfig, model: nn.Module, params: Any):
        self.config, self.params, self.mesh = config, params, mesh_of(params)

        def run(params, prompt_BP, prompt_len_B, seed, *, settings):
            # One key per prompt, from its ids: a prompt samples alike alone or anywhere in any batch.
            rng = search.row_keys(jax.random.key(seed), prompt_BP) if settings.sampling else None
            return generate(model, {"params": params}, prompt_BP, prompt_len_B, max_len=settings.max_len, rng=rng,
                            temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                            guards=guards_lib.Guards.of(settings))

        def hypotheses(params, prompt_BP, prompt_len_B, lenpen, seed, *, settings):
            return lm_search.lm_hypotheses(model, {"params": params}, prompt_BP, prompt_len_B,
                                           max_len=settings.max_len, beam_size=settings.beam_size, lenpen=lenpen,
                                           stop=settings.stop, rng=jax.random.key(seed) if settings.sampling else None,
                                           temperature=settings.temperature, top_k=settings.top_k,
                                           top_p=settings.top_p, guards=guards_lib.Guards.of(settings))

        self.function = nn_common.under_axis_rules(run, config.mesh_rules)  # what lconv.export lowers
        replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        self.jitted = jax.jit(self.function, static_argnames=("settings",), out_shardings=replicated)
        self.jitted_hypotheses = jax.jit(nn_common.under_axis_rules(hypotheses, config.mesh_rules),
                                         static_argnames=("settings",), out_shardings=replicated)

    def hypotheses(self, prompt_BP: np.ndarray, prompt_len_B: np.ndarray,
                   settings: DecodeSettings) -> search.Hypotheses:
        """``settings.beam_size`` scored continuations per prompt, best first (``lm_search.lm_hypotheses``):
        beams, or with ``settings.temperature > 0`` samples; ``[B, N, settings.max_len]`` numpy."""
        prompt_BP, prompt_len_B = np.asarray(prompt_BP, np.int32), np.asarray(prompt_len_B, np.int32)
        sharding = row_sharding(self.mesh, prompt_BP.shape[0])
        with _mesh_context(self.mesh):
            found = self.jitted_hypotheses(self.params, place(prompt_BP, sharding), place(prompt_len_B, sharding),
                                           jnp.float32(settings.lenpen), jnp.uint32(settings.seed),
                                           settings=settings.program_key())
            return search.Hypotheses(*map(np.asarray, found))

    def __call__(self, prompt_BP: np.ndarray, prompt_len_B: np.ndarray, settings: DecodeSettings) -> np.ndarray:
        prompt_BP, prompt_len_B = np.asarray(prompt_BP, np.int32), np.asarray(prompt_len_B, np.int32)
        sharding = row_sharding(self.mesh, prompt_BP.shape[0])
        with _mesh_context(self.mesh):
            tokens_BX = self.jitted(self.params, place(prompt_BP, sharding), place(prompt_len_B, sharding),
                                    jnp.uint32(settings.seed), settings=settings.program_key())
            return continuations(np.asarray(tokens_BX), prompt_len_B, settings.max_len)


def continuations(tokens_BX: np.ndarray, prompt_len_B: np.ndarray, max_len: int) -> np.ndarray:
    """``generate``'s output -> each row's ``max_len`` tokens after its prompt, PAD after the first EOS."""
    out_BL = np.full((tokens_BX.shape[0], max_len), PAD_ID, np.int32)
    for b, start in enumerate(prompt_len_B.tolist()):
        row = tokens_BX[b, start:start + max_len]
        ends = np.flatnonzero(row == EOS_ID)
        row = row[:ends[0] + 1] if len(ends) else row
        out_BL[b, :len(row)] = row
    return out_BL


THREAD_NAME = "lconv-compile"
_in_flight: set[concurrent.futures.Future] = set()  # compilations queued or running on that thread


def compiling() -> bool:
    """Whether a compilation is queued or running in the background (the CLIs' exit does not wait for it,
    ``lconv.cli.runtime``); the thread itself stays alive, idle, between them."""
    return any(not future.done() for future in list(_in_flight))


@functools.cache
def _background() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread ``Translator.prepare`` compiles in (one at a time: two would share a core with the work
    they are meant to stay beside)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)


def _mesh_context(mesh: jax.sharding.Mesh | None) -> Any:
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
