"""Export a trained run for serving: ``jax.export`` programs of its search, serialised, with a JSON sidecar.

    python -m lconv.export --workdir=runs/default --out=exported/default --platforms=cpu,cuda,tpu
    python -m lconv.export --workdir=runs/lm --out=exported/lm --max_len=64 --temperature=0.8 --top_p=0.9

Writes into ``--out`` (local or ``gs://``):

- one program per shape bucket, ``translate_r{rows}_w{width}.jax`` (encoder + beam search: source ids
  ``[rows, width]`` (EOS-terminated, PAD after) and a float32 length penalty -> best beams ``[rows, L]``) or, for an
  LM run, ``generate_r{rows}_w{width}.jax`` (prompt ids ``[rows, width]`` right-padded, their lengths ``[rows]``
  and a uint32 seed -> ``[rows, width + max_len]`` tokens, the prompt first; ``lconv.infer.compiled.generate``);
  each lowered for every platform in ``--platforms`` (one artifact runs on any of them);
- ``params.npz`` (the params, the programs' first argument: kept out of the programs so they stay small),
  ``spm.model`` (the tokenizer; ``pieces.json`` for an imported BPE model) and ``lconv_export.json``: the
  config, the buckets and each program's signature, the platforms and the conv implementation each platform runs.

``conv_impl="auto"`` is decided per platform of the lowered program (``lconv.ops.conv``'s ``choose_impl``: the
shift conv on CPU, the band conv elsewhere), not by the exporting host. ``load(out)`` gives a callable that
takes texts (or token ids) and runs the serialised programs, with no model code involved.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import traverse_util
from flax.linen import meta as nn_meta

from lconv import console, outputs, shared_folders
from lconv.constants import EOS_ID, EXPORT_SIDECAR, PAD_ID
from lconv.data import paths
from lconv.data import tokenizer as tokenizer_lib
from lconv.decode_settings import SAMPLING_DEFAULTS, DecodeSettings
from lconv.errors import UserError, first_line
from lconv.export import files
from lconv.export.files import FORMAT_VERSION
from lconv.infer import compiled, source_lengths
from lconv.ops import conv as ops_conv
from lconv.run import backend, compilation_cache, restore, schema

SIDECAR = EXPORT_SIDECAR
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # jax.export's platform names
MAX_EXPORT_ROWS = 4096


def export(trained: restore.Trained, out: str, *, platforms: Sequence[str] = ("cpu",), rows: Sequence[int] = (1, 8),
           widths: Sequence[int] | None = None, beam_size: int | None = None, max_len: int | None = None,
           temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
           spell: Callable[[str], str] = str, no_repeat_ngram_size: int | None = None,
           min_len: int | None = None) -> dict[str, Any]:
    """Writes ``trained``'s programs (one per ``rows`` x ``widths`` bucket), params, tokenizer and sidecar into
    ``out``; returns the sidecar. ``widths`` default to ``default_widths``: inputs as long as ``lconv.load`` takes
    are decoded whole, so an exported model translates what the loaded one does. The sampling settings are an LM's
    (None = ``lconv.decode_settings.SAMPLING_DEFAULTS``), ``beam_size`` a translation's (None = the stored
    config's); the other task's are refused. ``no_repeat_ngram_size`` / ``min_len``: the generation guards, either
    task's (None = the stored config.decode's). The search is one ``DecodeSettings``, built here. Errors name the
    arguments as ``spell`` writes them: as this function's (``max_len``), or ``python -m lconv.export``'s flags."""
    config = trained.config
    lm = config.task == "lm"
    given = dict(max_len=max_len, temperature=temperature, top_k=top_k, top_p=top_p)
    check_task_settings(config.task, beam_size, [name for name, value in given.items() if value is not None], spell)
    widths = default_widths(config) if widths is None else widths
    check_buckets(config, platforms, rows, widths, spell)
    guards = dict(no_repeat_ngram_size=no_repeat_ngram_size, min_len=min_len)
    settings, widths = _search(trained, beam_size, given, guards, widths, spell)
    names = [f"{'generate' if lm else 'translate'}_r{r}_w{w}.jax" for r in rows for w in widths]
    # Every file this export writes is checked first: a refusal at its write left the files before it written.
    outputs.check_directory(out, "export", spell("out"))
    outputs.check_targets(out, [outputs.MARKER, SIDECAR, *names, "params.npz", trained.tokenizer.filename],
                          spell("out"))
    outputs.claim_directory(out, "export", spell("out"))  # new, empty or an earlier export: never another's files
    # Plain host arrays (no logical-axis boxes, which do not serialise): the programs are single-device.
    params = jax.tree.map(np.asarray, nn_meta.unbox(trained.params))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    program = (compiled.Generator if lm else compiled.Translator)(config.infer, trained.model, params)
    function = functools.partial(program.function, settings=settings.program_key())
    directory = epath.Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    # The sidecar goes first and comes back last: an export stopped half-way (SIGTERM, a full disk), even over an
    # earlier one, never looks complete, and load() names the missing sidecar instead of mixing two exports.
    (directory / SIDECAR).unlink(missing_ok=True)
    programs, written = [], {}
    for r in rows:
        for w in widths:
            if lm:  # after the prompt ids: their lengths and a seed
                length, fn, more = w + settings.max_len, function, (_spec((r,), jnp.int32), _spec((), jnp.uint32))
            else:  # after the source ids: a length penalty
                length = compiled.max_output_len(config.infer, settings, w)
                fn, more = functools.partial(function, output_len=length), (_spec((), jnp.float32),)
            exported = jax.export.export(jax.jit(fn), platforms=tuple(platforms))(abstract, _spec((r, w), jnp.int32),
                                                                                  *more)
            programs.append(dict(file=names[len(programs)], rows=r, width=w, output_len=length))
            written[programs[-1]["file"]] = bytes(exported.serialize())
    buffer = io.BytesIO()
    np.savez(buffer, **traverse_util.flatten_dict(params, sep="/"))
    written.update({"params.npz": buffer.getvalue(), trained.tokenizer.filename: trained.tokenizer.to_bytes()})
    for name, data in written.items():
        outputs.write_atomically(directory / name, data)
    impl = config.model.conv_impl
    sidecar = {
        "format": FORMAT_VERSION, "task": config.task, "workdir": trained.workdir, "steps": trained.steps,
        "platforms": list(platforms),
        "conv_impl": {p: ops_conv.choose_impl(p) if impl == "auto" else impl for p in platforms},
        "tokenizer": trained.tokenizer.filename, "params": "params.npz", "programs": programs,
        "search": {name: getattr(settings, name) for name in ("max_len", "temperature", "top_k", "top_p")} if lm
        else {"beam_size": settings.beam_size, "lenpen": settings.lenpen},
        "guards": {"no_repeat_ngram_size": settings.no_repeat_ngram_size, "min_len": settings.min_len},
        "ids": {"pad": PAD_ID, "eos": EOS_ID},
        "jax_version": jax.__version__, "config": config.as_config(),
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in written.items()},
    }
    outputs.write_atomically(directory / SIDECAR, json.dumps(sidecar, indent=2))
    return sidecar


def _search(trained: restore.Trained, beam_size: int | None, given: dict[str, Any], guards: dict[str, Any],
            widths: Sequence[int], spell: Callable[[str], str]) -> tuple[DecodeSettings, Sequence[int]]:
    """The export's search, checked by the rules eval.py and the API apply, before anything is written; an LM's
    widths cut to the prompt its ``max_len`` leaves."""
    config = trained.config
    schema.check_search(spell=spell, **guards)
    if config.task != "lm":
        schema.check_search(beam_size=beam_size, spell=spell,
                            vocab_size=None if beam_size is None else trained.tokenizer.vocab_size)
        return DecodeSettings.build(config.decode, beam_size=beam_size, **guards), widths
    schema.check_sampling(given, spell=spell, vocab_size=trained.tokenizer.vocab_size)
    settings = DecodeSettings.build(config.decode, **given, **guards)
    limit = settings.prompt_limit(config.model.max_len, spell("max_len"))
    return settings, sorted({max(min(w, limit), 1) for w in widths})  # a 0-token prompt (BOS alone) is width 1


def default_widths(config: schema.RunConfig) -> list[int]:
    """The width buckets up to the longest input ``lconv.load`` takes: a source's
    ``config.data.eval_max_input_length``, an LM prompt's ``config.model.max_len`` (export cuts a prompt's widths
    to what its ``max_len`` leaves)."""
    limit = int(config.model.max_len if config.task == "lm" else config.data.eval_max_input_length)
    return sorted({min(w, limit) for w in compiled.WIDTHS if w < limit * 2})


def check_task_settings(task: str, beam_size: int | None, sampling_given: Sequence[str],
                        spell: Callable[[str], str] = str) -> None:
    """A translation export beam-searches and an LM export samples: the other task's settings would be ignored."""
    if task == "lm" and beam_size is not None:
        sampling = ", ".join(map(spell, ("temperature", "top_k", "top_p", "max_len")))
        raise UserError(f"{spell('beam_size')}={beam_size}: an lm export samples ({sampling}); it would ignore a "
                        "beam size")
    if task != "lm" and sampling_given:
        flags = ", ".join(map(spell, sampling_given))
        raise UserError(f"{flags}: for lm exports; a {task} export beam-searches ({spell('beam_size')}) and would "
                        f"ignore {'it' if len(sampling_given) == 1 else 'them'}")


def _spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def check_buckets(config: schema.RunConfig, platforms: Sequence[str], rows: Sequence[int], widths: Sequence[int],
                  spell: Callable[[str], str] = str) -> None:
    """The platforms, and the rows and widths of the buckets: known, ascending, within what a program holds."""
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown or not platforms:
        raise UserError(f"{spell('platforms')}={','.join(platforms)}: choose from {', '.join(PLATFORMS)}")
    for flag, values in ((spell("rows"), rows), (spell("widths"), widths)):
        if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
            raise UserError(f"{flag}={','.join(map(str, values))}: positive integers, ascending, no repeats")
    if rows[-1] > MAX_EXPORT_ROWS:
        raise UserError(f"{spell('rows')}={','.join(map(str, rows))}: at most {MAX_EXPORT_ROWS} (a program holds its "
                        "rows' search in memory at once; the exported model splits a larger batch over its largest "
                        "bucket)")
    if config.task != "lm" and widths[-1] > config.data.eval_max_input_length:
        raise UserError(f"{spell('widths')}={','.join(map(str, widths))}: at most config.data.eval_max_input_length="
                        f"{config.data.eval_max_input_length} (the longest source the model decodes)")


class Served:
    """An exported run: ``served(texts) -> texts`` or ``served(ids [B, S]) -> ids``, through the serialised
    programs (the smallest bucket that holds the batch; a batch larger than every bucket is split)."""

    def __init__(self, path: str):
        backend.check_backend()  # JAX_PLATFORMS naming a backend that is not there: one line, as on the CLIs
        compilation_cache.use_user_folder()  # the programs compile at the first call: never into another user's cache
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise UserError(f"lconv.export.load: path must be an export's folder (a non-empty string); got "
                            f"{path!r:.60}")
        path = os.fspath(path)
        label = f"lconv.export.load({str(path)!r})"
        paths.check_url(path, "path", label=label)
        directory = epath.Path(paths.normalize(path))
        if not (directory / SIDECAR).exists():
            shown = console.printable(str(directory))  # a control character in the name shows as its escape
            if not directory.exists():
                raise UserError(f"{label}: no such directory ({shown})")
            hint = "a run's workdir: load it with lconv.load" if (directory / "config.json").exists() else \
                "export a run there with python -m lconv.export"
            raise UserError(f"{label}: no {SIDECAR} in {shown} ({hint})")
        shared_folders.check(path, label)  # as given: a '..' after a link is refused, not resolved away
        # Each file is read and checked here, so a damaged or incomplete export is one line naming the file and
        # what is wrong with it, never a traceback (or wrong outputs) at the first call.
        self.directory = directory
        self.sidecar = files.read_part(directory, SIDECAR, files.parse_sidecar, "the export's JSON sidecar")
        self.task = self.sidecar["task"]
        name, digests = self.sidecar["tokenizer"], self.sidecar.get("sha256", {})
        data = paths.read_bytes(directory / name, f"missing from the export (listed in its {EXPORT_SIDECAR})",
                                within=directory, limit=tokenizer_lib.TOKENIZER_LIMIT)
        files.check_digest(directory / name, data, digests.get(name))  # the bytes parsed next: no second read
        self.tokenizer = tokenizer_lib.read_tokenizer(directory / name, data=data)
        for part in [self.sidecar["params"]] + [p["file"] for p in self.sidecar["programs"]]:
            paths.check_file(directory / part, within=directory)  # each a plain file inside, before any is read
        self.programs = {(p["rows"], p["width"]): (p, files.read_part(directory, p["file"], files.parse_program,
                                                                      "a serialised jax.export program",
                                                                      sha256=digests.get(p["file"])))
                         for p in self.sidecar["programs"]}
        # The programs say what params they take: a params.npz declaring more is refused before it decompresses.
        leaves, size = files.params_limit(next(iter(self.programs.values()))[1])
        self.params = files.read_part(directory, self.sidecar["params"],
                                      functools.partial(files.parse_params, leaves=leaves, size=size),
                                      "a .npz of the params", limit=size + files.NPY_HEADER_BYTES * (leaves + 1),
                                      sha256=digests.get(self.sidecar["params"]))
        files.check_finite_params(self.params, directory / self.sidecar["params"])
        for entry, exported in self.programs.values():
            files.check_params_fit(self.params, exported, directory / self.sidecar["params"], entry["file"])
            files.check_entry_fits(entry, exported, self.sidecar, directory / SIDECAR)

    def __call__(self, inputs: str | Sequence[str] | np.ndarray, *,
                 seed: int | None = None) -> str | list[str] | np.ndarray:
        """A string for a string (as ``lconv.load(...).translate`` / ``generate``), a list for a list, and an id
        array ``[B, S]`` (PAD after) for one."""
        if isinstance(inputs, str):
            return self([inputs], seed=seed)[0]
        if isinstance(inputs, np.ndarray):
            if inputs.ndim != 2:
                raise UserError(f"an id array must be [B, S] (rows of ids, PAD after); got shape {inputs.shape}")
            return self.run_ids([row[row != PAD_ID] for row in inputs], seed=seed)
        texts = tokenizer_lib.check_texts(inputs, "inputs")
        if self.task == "lm":
            return [self.tokenizer.detokenize(row) for row in self.run_ids(self.tokenizer.encode_batch(texts),
                                                                           seed=seed)]
        # A blank source is not decoded and gets "", as lconv.load's translate gives it (from EOS alone a model
        # hallucinates)
        kept = [i for i, text in enumerate(texts) if text.strip()]
        encoded = [np.append(ids, EOS_ID) for ids in self.tokenizer.encode_batch([texts[i] for i in kept])]
        results = [""] * len(texts)
        for i, row in zip(kept, self.run_ids(encoded, seed=seed)):
            results[i] = self.tokenizer.detokenize(row)
        return results

    def run_ids(self, sequences: Sequence[np.ndarray], *, seed: int | None = None) -> np.ndarray:
        """Source ids (with EOS) or LM prompts, one array each -> outputs ``[len(sequences), L]``, PAD after EOS.
        Ids outside the vocabulary are refused; an input wider than every exported bucket is cut to the widest,
        with the warning ``lconv.load`` and eval.py give (a source keeps its first tokens and EOS, a prompt its
        last tokens)."""
        # A uint32 argument of an LM's programs, which only a sampling export reads.
        schema.check_sampling({"seed": seed, "temperature": self.sidecar["search"].get("temperature")})
        seed = SAMPLING_DEFAULTS["seed"] if seed is None else seed
        sequences = self._cut([self._checked_ids(x, i) for i, x in enumerate(sequences)])
        max_rows = max(r for r, _ in self.programs)
        outputs = []
        for start in range(0, len(sequences), max_rows):
            chunk = list(sequences[start:start + max_rows])
            outputs.append(self._run_bucket(chunk, seed))
        length = max([o.shape[1] for o in outputs], default=0)
        return np.concatenate([np.pad(o, ((0, 0), (0, length - o.shape[1]))) for o in outputs]) if outputs else \
            np.zeros((0, 0), np.int32)

    def _cut(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        widest = max(w for _, w in self.programs)
        lengths = [len(x) for x in sequences]
        cut = [i for i, n in enumerate(lengths) if n > widest]
        source_lengths.SourceLengths(cut, max(lengths, default=0), widest, [lengths[i] for i in cut]).log(
            "inputs[{}]".format, "the widest exported bucket; export larger widths (--widths) to keep more",
            keeps="cut to the last" if self.task == "lm" else "cut to")
        if self.task == "lm":  # the tokens nearest the continuation, as generate_lines keeps them
            return [np.asarray(x[-widest:]) if len(x) > widest else np.asarray(x) for x in sequences]
        return [np.append(x[:widest - 1], EOS_ID) if len(x) > widest else np.asarray(x) for x in sequences]

    def _checked_ids(self, ids: Any, index: int) -> np.ndarray:
        """Integer ids within the vocabulary: the programs would read an embedding row that is not there (XLA
        clamps the gather) and return plausible-looking garbage."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise UserError(f"input {index}: token ids must be a 1-D integer array; got {ids.dtype} {ids.shape}")
        vocab = self.tokenizer.vocab_size
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            raise UserError(f"input {index}, position {bad[0]}: token id {ids[bad[0]]} is out of range; the exported "
                            f"model's vocabulary has {vocab} ids (0..{vocab - 1})")
        return ids.astype(np.int32)

    def _run_bucket(self, chunk: list[np.ndarray], seed: int) -> np.ndarray:
        longest = max(len(x) for x in chunk)
        fits = sorted((r, w) for r, w in self.programs if r >= len(chunk) and w >= longest)
        entry, exported = self.programs[fits[0]]  # there is one: run_ids cut every input to the widest
        batch = compiled.pad_rows(chunk, entry["rows"], entry["width"])
        try:
            if self.task == "lm":
                lengths = np.asarray([len(x) for x in chunk] + [0] * (entry["rows"] - len(chunk)), np.int32)
                tokens = exported.call(self.params, batch, lengths, np.uint32(seed))
                out = compiled.continuations(np.asarray(tokens), lengths, self.sidecar["search"]["max_len"])
            else:
                out = np.asarray(exported.call(self.params, batch, np.float32(self.sidecar["search"]["lenpen"])))
        except jax.errors.JaxRuntimeError as err:  # a program that deserialises can still fail to compile or run
            raise UserError(f"{self.directory / entry['file']}: the exported program cannot run "
                            f"({first_line(err)}); if the file was altered, export the run again") from None
        return out[:len(chunk)]


def load(path: str) -> Served:
    """The run exported into ``path`` by ``python -m lconv.export``, ready to call."""
    return Served(path)
