"""Input pipeline: grain over a random-access source -> fixed-shape numpy batches for jit: packed, shuffled training
batches of this process's shard (``make_datasets``), padded evaluation batches, and the run's tokenizer
(``load_or_train_tokenizer``). The batch contract: docs/data.md."""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from lconv.constants import EOS_ID, PAD_ID
from lconv.data import eval_caps, sources, stream, tokenizer_files
from lconv.data import tokenizer as tokenizer_lib
from lconv.data.data_config import DataConfig
from lconv.errors import UserError, first_line

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EvalSet:
    """Tokenised evaluation examples of this process; iterate for padded batches (a fresh pass each time)."""

    examples: list[dict[str, str]]  # this process's examples: {"inputs": text, "targets": text} (raw text)
    tokens: list[dict[str, np.ndarray]]  # the same examples as ids (with EOS, truncated to the eval lengths)
    batch_size: int  # rows per batch of this process
    num_batches: int  # the same on every process, so multi-host eval steps stay in lockstep
    lengths: dict[str, int]  # feature -> padded length
    stats: collections.Counter

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for b in range(self.num_batches):
            indices = range(b * self.batch_size, min((b + 1) * self.batch_size, len(self.tokens)))
            yield pad_batch([self.tokens[i] for i in indices], list(indices), self.batch_size, self.lengths)

    def __len__(self) -> int:
        return self.num_batches

    def packed(self) -> PackedBatches:
        """The same examples packed several to a row (``PackedBatches``), for a loss pass with far less padding."""
        if self._packed is None:
            self._packed = PackedBatches(self)
        return self._packed

    _packed: PackedBatches | None = dataclasses.field(default=None, repr=False, compare=False)


class PackedBatches:
    """An ``EvalSet``'s examples packed as training packs, in the set's batch shape; empty rows weigh zero."""

    def __init__(self, eval_set: EvalSet) -> None:
        self.lengths, self.batch_size = eval_set.lengths, eval_set.batch_size
        order = sorted(range(len(eval_set.tokens)), key=lambda i: max(len(v) for v in eval_set.tokens[i].values()))
        self.rows: list[list[dict[str, np.ndarray]]] = []
        used = dict.fromkeys(self.lengths, math.inf)
        for i in order:
            example = eval_set.tokens[i]
            if any(used[k] + len(example[k]) > length for k, length in self.lengths.items()):
                self.rows.append([])
                used = dict.fromkeys(self.lengths, 0)
            self.rows[-1].append(example)
            used = {k: used[k] + len(example[k]) for k in self.lengths}
        self.num_batches = _max_over_processes(math.ceil(len(self.rows) / self.batch_size))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for b in range(self.num_batches):
            rows = self.rows[b * self.batch_size:(b + 1) * self.batch_size]
            rows += [[]] * (self.batch_size - len(rows))
            batch = {}
            for key, length in self.lengths.items():
                packed = [pack_row([example[key] for example in row], length) for row in rows]
                for part, name in enumerate((key, f"{key}_segmentation", f"{key}_position")):
                    batch[name] = np.stack([p[part] for p in packed])  # [rows, length]
            batch["example_weight"] = np.asarray([float(bool(row)) for row in rows], np.float32)  # [rows]
            yield batch


def pack_row(sequences: list[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Id sequences -> one zero-padded row ``(ids, segmentation 1.., position 0..)``, each ``[length]``."""
    ids, segments, positions = (np.zeros(length, np.int32) for _ in range(3))
    start = 0
    for segment, sequence in enumerate(sequences, 1):
        end = start + len(sequence)
        ids[start:end], segments[start:end], positions[start:end] = sequence, segment, np.arange(len(sequence))
        start = end
    return ids, segments, positions


def loss_batches(eval_set: Any) -> Any:
    """What a loss pass over ``eval_set`` iterates: an ``EvalSet``'s packed batches, anything else as it is."""
    return eval_set.packed() if isinstance(eval_set, EvalSet) else eval_set


@dataclasses.dataclass
class Datasets:
    train_iter: Any  # grain DatasetIterator of batches; get_state() / set_state(state)
    eval_sets: dict[str, EvalSet]
    input_key: str | None
    target_key: str
    stats: collections.Counter  # training-side counts (truncated / dropped examples) of this process
    # What preparing the dataset skipped or altered (``sources.source_report``); {} for ``tfds build``'s datasets.
    source_report: dict = dataclasses.field(default_factory=dict)


def _process(process_index, process_count):
    if process_index is None or process_count is None:
        import jax

        return jax.process_index(), jax.process_count()
    return process_index, process_count


def import_readers() -> None:
    """Imports TFDS and grain in this thread now: call it before starting a thread beside data preparation."""
    import grain  # noqa: F401
    import tensorflow_datasets  # noqa: F401
    from tensorflow_datasets.core import dataset_metadata  # noqa: F401  (one such module the package leaves out)


def tokenizer_texts(config: DataConfig) -> Iterator[str]:
    """Training-split text of the dataset (inputs and targets interleaved), for the joint tokenizer."""
    cfg = DataConfig.from_config(config)
    source, input_key, target_key = sources.config_source(cfg, "train")
    for example in _in_order(source):
        for key in (input_key, target_key):
            if key is not None:
                yield _text(example[key])


def _in_order(source: Any, block: int = 1024) -> Iterator[Any]:
    """Every example of a random-access ``source`` in order, a block of records per read where the source can."""
    read_block = getattr(source, "__getitems__", None)
    for start in range(0, len(source), block):
        indices = range(start, min(start + block, len(source)))
        yield from (read_block(list(indices)) if read_block else (source[i] for i in indices))


def load_or_train_tokenizer(config: DataConfig, workdir: str, *, save: bool = True, process_index: int | None = None,
                            process_count: int | None = None) -> tokenizer_lib.Tokenizer:
    """``<workdir>/spm.model``, else a kept copy (``tokenizer_files``), else one trained on the training split and kept;
    process 0 makes it and sends it to the others (``save=False``: no copy read or written)."""
    cfg = DataConfig.from_config(config)

    def load_or_train() -> tokenizer_lib.Tokenizer:
        from etils import epath

        from lconv.data import paths

        paths.check_url(workdir, "workdir")  # a URL whose file system is not installed: one line, before any read
        in_workdir = epath.Path(tokenizer_lib.tokenizer_path(workdir)).exists()
        kept = tokenizer_files.kept_folder(cfg) if save and not in_workdir else None  # None: no cache to use
        kept_exists = kept is not None and epath.Path(tokenizer_lib.tokenizer_path(kept)).exists()
        kept_copy = tokenizer_files.usable_kept(kept, cfg.vocab_size) if kept_exists else None  # checked first
        kept_exists = kept_copy is not None
        shipped = tokenizer_files.shipped_path(cfg) if save and not (in_workdir or kept_exists) else None
        if kept_copy is not None:  # the workdir gets the kept copy; load_or_train then checks its size
            kept_copy.save(workdir)
            logger.info(f"tokenizer: {tokenizer_lib.tokenizer_path(kept)} reused (trained by an earlier run on the "
                        "same data and settings)")
        elif shipped is not None:
            tokenizer_lib.read_tokenizer(epath.Path(shipped)).save(workdir)
            logger.info(f"tokenizer: {shipped} (shipped with lconv: what training on the bundled corpus with these "
                        "settings gives)")
        training = not (in_workdir or kept_exists or shipped)
        if training:  # seconds to minutes, reading the training split first: say so before, and how it went after
            start = time.perf_counter()
            logger.info(f"tokenizer: training a {cfg.vocab_size:,}-piece SentencePiece model on up to "
                        f"{cfg.tokenizer_max_sentences:,} training texts of {sources.display_name(cfg)} ...")
        tokenizer = tokenizer_lib.load_or_train(workdir, tokenizer_texts(cfg), cfg.vocab_size,
                                                max_sentences=cfg.tokenizer_max_sentences, save=save)
        if training:
            logger.info(f"tokenizer: trained in {time.perf_counter() - start:.1f} s: {tokenizer.vocab_size:,} pieces")
        if kept is not None and not (kept_exists or in_workdir or shipped):  # trained just now: kept for later runs
            try:
                tokenizer_files.keep(tokenizer, kept)
            except (OSError, UserError) as err:  # a read-only data_dir: the next run trains it again
                logger.info(f"tokenizer: not kept for later runs in {kept} ({getattr(err, 'strerror', None) or err})")
        return tokenizer

    process_index, process_count = _process(process_index, process_count)
    if process_count == 1:
        return load_or_train()
    status, payload = _OK, b""
    if process_index == 0:
        try:
            payload = load_or_train().model_proto
        except UserError as e:
            status, payload, error = _USER_ERROR, str(e).encode(), e
        except Exception as e:
            status, payload, error = _FAILED, f"{type(e).__name__}: {e}".encode(), e
    status, payload = _broadcast_from_process_0(status, payload)
    if process_index == 0 and status != _OK:
        raise error
    if status == _USER_ERROR:
        raise UserError(payload.decode())
    if status == _FAILED:
        raise RuntimeError(f"process 0 failed to load or train the tokenizer: {payload.decode()}")
    return tokenizer_lib.Tokenizer(payload)


_OK, _USER_ERROR, _FAILED = 0, 1, 2
# How long the other processes wait for process 0 to prepare the data (a device collective would time out).
PREPARE_TIMEOUT_S = 4 * 3600
_broadcasts = 0  # numbers each broadcast's key in the coordinator's key-value store


def _broadcast_from_process_0(status: int, payload: bytes) -> tuple[int, bytes]:
    """(status, bytes) of process 0 on every process, through the ``jax.distributed`` key-value store."""
    global _broadcasts
    from jax._src import distributed  # the coordinator client (orbax reads it the same way)

    _broadcasts += 1
    client = distributed.global_state.client
    if client is None:
        return _collective_broadcast(status, payload)
    key = f"lconv/process_0_broadcast/{_broadcasts}"
    if distributed.global_state.process_id == 0:
        client.key_value_set_bytes(key, bytes([status]) + payload)
        return status, payload
    message = client.blocking_key_value_get_bytes(key, PREPARE_TIMEOUT_S * 1000)
    return message[0], bytes(message[1:])


def _collective_broadcast(status: int, payload: bytes) -> tuple[int, bytes]:
    from jax.experimental import multihost_utils

    header = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([status, len(payload)], np.int32)))
    if not header[1]:
        return int(header[0]), b""
    buffer = np.zeros(int(header[1]), np.uint8)
    if payload:
        buffer[:] = np.frombuffer(payload, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return int(header[0]), data.astype(np.uint8).tobytes()


def make_datasets(config: DataConfig, tokenizer: tokenizer_lib.Tokenizer, *, process_index: int | None = None,
                  process_count: int | None = None) -> Datasets:
    """Train iterator and eval sets for ``config.dataset`` (the batch contract: docs/data.md)."""
    process_index, process_count = _process(process_index, process_count)
    cfg = DataConfig.from_config(config)  # each field's own range is checked there, before any data is read
    for field in ("batch_size", "eval_batch_size"):
        if getattr(cfg, field) % process_count:
            raise UserError(f"{field}={getattr(cfg, field)} is not divisible by process_count={process_count}; "
                            f"change it")
    if cfg.stream and sources.config_spec(cfg).input_key is not None:
        raise UserError(f"stream=True streams documents to a language model; dataset={cfg.dataset!r} "
                         "has inputs (use a language-modelling dataset, e.g. ddtp/lm_en)")
    _report_vocabulary(cfg, tokenizer)
    source, input_key, target_key = sources.config_source(cfg, "train")
    report = sources.config_report(cfg)
    if cfg.stream:
        data = make_stream_datasets(cfg, source, input_key, target_key, tokenizer, process_index, process_count)
        return dataclasses.replace(data, source_report=report)
    lengths = {"targets": cfg.max_target_length}
    if input_key is not None:
        lengths["inputs"] = cfg.max_input_length
    train_iter, stats = make_train_iter(
        source, input_key, target_key, tokenizer, lengths, rows=cfg.batch_size // process_count,
        seed=cfg.seed, num_epochs=cfg.num_epochs, pack=cfg.pack, drop_long=cfg.train_long == "drop",
        process_index=process_index, process_count=process_count, read_threads=cfg.read_threads)
    eval_sets = {}
    for split in cfg.eval_splits:
        eval_source, _, _ = sources.config_source(cfg, split)
        eval_source = eval_caps.capped(eval_source, split, cfg)  # config.data.max_*_examples
        eval_lengths = {"targets": cfg.eval_max_target_length}
        if input_key is not None:
            eval_lengths["inputs"] = cfg.eval_max_input_length
        eval_sets[split] = make_eval_set(eval_source, input_key, target_key, tokenizer, eval_lengths,
                                         cfg.eval_batch_size // process_count, process_index, process_count)
    return Datasets(train_iter, eval_sets, input_key, target_key, stats, report)


def _report_vocabulary(cfg: DataConfig, tokenizer: Any) -> None:
    """One warning line when the tokenizer's vocabulary is not the ``vocab_size`` asked for."""
    used = getattr(tokenizer, "vocab_size", None)
    if used is not None and used != cfg.vocab_size:
        why = " (the training text is too small for more)" if used < cfg.vocab_size else ""
        logger.warning(f"vocabulary: {used:,} pieces, not the {cfg.vocab_size:,} config.data.vocab_size asks for"
                       f"{why}; the model is built for {used:,}")


def make_stream_datasets(config: DataConfig, source: sources.Source, input_key: str | None, target_key: str,
                         tokenizer: tokenizer_lib.Tokenizer, process_index: int, process_count: int) -> Datasets:
    """``make_datasets`` for ``stream=True``: document streams for training and every eval split."""
    cfg = DataConfig.from_config(config)
    del input_key  # None: make_datasets checked the dataset is a language-modelling one
    window = cfg.max_target_length
    train_iter = stream.DocumentStream(source, target_key, tokenizer, window=window,
                                       rows=cfg.batch_size // process_count, seed=cfg.seed,
                                       num_epochs=cfg.num_epochs, process_index=process_index,
                                       process_count=process_count)
    eval_sets = {}
    for split in cfg.eval_splits:
        eval_source, _, _ = sources.config_source(cfg, split)
        eval_source = eval_caps.capped(eval_source, split, cfg)  # the first documents
        eval_set = stream.StreamEvalSet(eval_source, target_key, tokenizer, window=window,
                                        rows=cfg.eval_batch_size // process_count,
                                        process_index=process_index, process_count=process_count)
        eval_set.num_batches = _max_over_processes(eval_set.num_batches)  # lockstep eval steps
        eval_sets[split] = eval_set
    return Datasets(train_iter, eval_sets, None, target_key, train_iter.stats)


def _max_over_processes(value: int) -> int:
    import jax

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int32))))


def make_train_iter(source: sources.Source, input_key: str | None, target_key: str, tokenizer: tokenizer_lib.Tokenizer,
                    lengths: Mapping[str, int], *,
                    rows: int, seed: int, num_epochs: int | None = None, pack: bool = True,
                    drop_long: bool = False, process_index: int = 0, process_count: int = 1,
                    read_threads: int = 2) -> tuple[Iterator[dict[str, np.ndarray]], collections.Counter]:
    """(grain iterator of train batches [rows, L], stats Counter): shuffled, tokenised, cut and packed."""
    import grain

    stats = collections.Counter()

    def tokenize(example):
        return tokenize_example(example, input_key, target_key, tokenizer, lengths, stats, drop=drop_long)

    ds = grain.MapDataset.source(source)[process_index::process_count]  # disjoint, covering shards
    ds = ds.shuffle(seed=seed).repeat(num_epochs).map(tokenize)  # shuffle then repeat: a new order every epoch
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * rows))
    ds = ds.filter(lambda example: example is not None)  # over-long examples when drop_long
    if pack:
        ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct=dict(lengths), num_packing_bins=rows,
                                                        shuffle_bins=False)
        ds = ds.map(rename_packed)
    else:
        ds = ds.map(lambda example: pad_example(example, lengths))
    ds = ds.batch(rows, drop_remainder=num_epochs is None)
    if num_epochs is not None:
        ds = ds.map(lambda batch: pad_rows(batch, rows))
    return iter(ds), stats


def make_eval_set(source: sources.Source, input_key: str | None, target_key: str, tokenizer: tokenizer_lib.Tokenizer,
                  lengths: Mapping[str, int], rows: int, process_index: int = 0,
                  process_count: int = 1) -> EvalSet:
    """Every example of this process's shard of ``source`` (in source order), tokenised for padded batches."""
    stats = collections.Counter()
    indices = range(process_index, len(source), process_count)
    examples = []
    from google.protobuf.message import DecodeError

    def damaged(i: int, why: str) -> UserError:
        where = getattr(getattr(source, "dataset_info", None), "data_dir", None) or "the prepared copy"
        return UserError(f"example {i} cannot be read from {where} ({why}); the prepared copy is damaged: remove it "
                         "to prepare it again")

    for i in indices:
        try:
            raw = source[i]
        except (RuntimeError, DecodeError) as err:  # a damaged shard: array_record's hash, or records not examples
            raise damaged(i, first_line(err)) from None
        example = {}
        for name, key in (("targets", target_key), ("inputs", input_key)):
            if key is not None:
                if not isinstance(raw.get(key), (bytes, str)):  # an empty record parses with every feature None
                    raise damaged(i, f"no text under {key!r}")
                example[name] = _text(raw[key])
        examples.append(example)
    keys = [k for k in ("inputs", "targets") if k in lengths]
    encoded = {k: tokenizer.encode_batch([e[k] for e in examples]) for k in keys}
    tokens = [{k: _with_eos(encoded[k][j], lengths[k], stats, f"eval_{k}_truncated") for k in keys}
              for j in range(len(examples))]
    stats["eval_examples"] = len(examples)
    per_process = math.ceil(len(source) / process_count)
    return EvalSet(examples, tokens, rows, math.ceil(per_process / rows), dict(lengths), stats)


# Pure functions.


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _with_eos(ids: np.ndarray, length: int, stats: collections.Counter, key: str) -> np.ndarray:
    """ids [n] -> ids [min(n + 1, length)] int32 ending with EOS; truncation counted under ``key``."""
    if len(ids) + 1 > length:
        stats[key] += 1
        ids = ids[: length - 1]
    return np.concatenate([ids, [EOS_ID]]).astype(np.int32)


def tokenize_example(example: Mapping, input_key: str | None, target_key: str, tokenizer: tokenizer_lib.Tokenizer,
                     lengths: Mapping[str, int], stats: collections.Counter, *,
                     drop: bool = False) -> dict[str, np.ndarray] | None:
    """Source example -> {"inputs": [<=Ls], "targets": [<=Lt]} int32 ids with EOS; None if dropped for length."""
    texts = {"targets": _text(example[target_key])}
    if input_key is not None:
        texts["inputs"] = _text(example[input_key])
    ids = {key: tokenizer.encode(text) for key, text in texts.items()}
    if drop and any(len(v) + 1 > lengths[k] for k, v in ids.items()):
        stats["train_dropped_too_long"] += 1
        return None
    stats["train_examples"] += 1
    return {key: _with_eos(v, lengths[key], stats, f"train_{key}_truncated") for key, v in ids.items()}


def rename_packed(packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """grain's ``x_segment_ids`` / ``x_positions`` -> the batch contract's ``x_segmentation`` / ``x_position``."""
    out = {}
    for key, value in packed.items():
        key = key.replace("_segment_ids", "_segmentation").replace("_positions", "_position")
        out[key] = np.asarray(value, dtype=np.int32)
    return out


def pad_example(example: Mapping[str, np.ndarray], lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """One example -> one row: ids padded with PAD to ``lengths``, segmentation 1/0, position 0.. / 0."""
    out = {}
    for key, length in lengths.items():
        ids = example[key]
        n = len(ids)
        out[key] = np.pad(ids, (0, length - n), constant_values=PAD_ID).astype(np.int32)  # [L]
        out[f"{key}_segmentation"] = (np.arange(length) < n).astype(np.int32)  # [L]
        out[f"{key}_position"] = np.where(np.arange(length) < n, np.arange(length), 0).astype(np.int32)  # [L]
    return out


def pad_rows(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """A batch with fewer than ``rows`` rows -> ``rows`` rows; the extra rows are all zeros (padding)."""
    return {key: np.pad(v, [(0, rows - len(v))] + [(0, 0)] * (v.ndim - 1)) for key, v in batch.items()}


def pad_batch(examples: list[Mapping[str, np.ndarray]], indices: list[int], rows: int,
              lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Examples -> a [rows, L] batch, one example per row; missing rows are padding with example_weight 0."""
    empty = {key: np.zeros([0], np.int32) for key in lengths}
    padded = [pad_example(e, lengths) for e in examples] + [pad_example(empty, lengths)] * (rows - len(examples))
    batch = {key: np.stack([p[key] for p in padded]) for key in padded[0]}
    batch["example_index"] = np.asarray(list(indices) + [-1] * (rows - len(examples)), np.int32)  # [rows]
    batch["example_weight"] = (batch["example_index"] >= 0).astype(np.float32)  # [rows]
    return batch
