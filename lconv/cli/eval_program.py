"""``eval.py``: a trained workdir, scored on a split of its dataset, run over a text file (sources to translate or
summarise, or an LM's prompts to continue), or over stdin a line at a time (``--interactive``).

Every input a user can get wrong is checked before anything is loaded or compiled, in one line naming the flag
or file: the flags' ranges, the stored task, the input files (UTF-8, matching line counts) and whether the
outputs can be written. A decoding pass is never lost to a mistake that could have been seen up front.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import jax

from lconv import console, outputs, shared_folders
from lconv.cli import eval_ensemble
from lconv.data import paths, pipeline, sources
from lconv.data import tokenizer as tokenizer_lib
from lconv.data.data_config import DataConfig
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled, per_line, reports, scoring, split_scoring
from lconv.run import loss_pass, restore, schema

logger = logging.getLogger(__name__)

SAMPLING_DEFAULTS = schema.SAMPLING_DEFAULTS


def run(workdir: str, *, split: str = "test", average_last: int = 1, checkpoint: str = "latest",
        beam_size: int | None = None, lenpen: float | None = None, source_file: str | None = None,
        reference_file: str | None = None, output_file: str | None = None, interactive: bool = False,
        nbest: int | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None,
        no_repeat_ngram_size: int | None = None, min_len: int | None = None,
        ensemble: str | Sequence[str] | None = None, data_dir: str | None = None, **sampling: Any) -> dict[str, Any]:
    """Scores ``split`` of the run's dataset (BLEU / ROUGE, or an LM's perplexity), or decodes ``source_file`` line
    by line: translations (scored against ``reference_file``; by beam search or sampled; with ``nbest``, k per
    line) or an LM's continuations of prompts (``sampling``). ``interactive`` reads ``stdin`` and writes each
    output as it is decoded. ``ensemble``: more workdirs decoding with ``workdir``'s (``eval_ensemble``; outputs
    named for it). ``data_dir``: where a split's data is read (and prepared if need be) instead of the run's own
    ``config.data.data_dir`` (``_split_data_dir``). Only params are restored."""
    if output_file in console.STDOUT_NAMES and (stdout or sys.stdout) is None:  # started with stdout closed
        raise UserError(f"--output_file={output_file}: stdout is closed; name a file to write the outputs to")
    if interactive and ((stdin or sys.stdin) is None or (stdout or sys.stdout) is None):  # checked before loading
        raise UserError("--interactive reads lines from stdin and prints to stdout, and this process was started "
                        "with one of them closed; pass --source_file instead")
    sampling = {name: value for name, value in sampling.items() if value is not None}
    guards = {name: value for name, value in (("no_repeat_ngram_size", no_repeat_ngram_size),
                                              ("min_len", min_len)) if value is not None}
    others = eval_ensemble.parse(ensemble)
    stem = f"{split}.{eval_ensemble.NAME}" if others else split  # a split's outputs: <workdir>/<stem>.hyp.txt
    stored = _check_run_flags(workdir, split=split, average_last=average_last, checkpoint=checkpoint,
                            beam_size=beam_size, lenpen=lenpen, source_file=source_file,
                            reference_file=reference_file, output_file=output_file, interactive=interactive,
                            sampling=sampling, nbest=nbest, guards=guards, stem=stem)
    members = eval_ensemble.check(workdir, stored, others) if others else None
    if members is not None and stored.config.data.stream and source_file is None and not interactive:
        raise UserError("--ensemble: a document-stream LM's split is scored with one model's mixer state carried "
                        "across windows; score the runs one at a time")
    task = stored.config.task
    chosen = {**_decode_choices(task, sampling, nbest), **guards}
    load = lambda: _load(stored, workdir, average_last, checkpoint, beam_size, lenpen, chosen, members)  # noqa: E731
    if interactive:
        if data_dir is not None:
            raise UserError("--data_dir goes with scoring a split (eval.py --split=...); --interactive reads stdin")
        trained, settings = load()
        return _interactive(trained, stdin or sys.stdin, stdout or sys.stdout, settings, nbest)
    if source_file is None:
        split_data_dir = _split_data_dir(stored, workdir, data_dir)  # before the checkpoint is read
        trained, settings = load()
        return _score_split(trained, settings, workdir, split, stem, members, split_data_dir)
    if data_dir is not None:
        raise UserError("--data_dir goes with scoring a split (eval.py --split=...); --source_file is read as given")
    printed = output_file in console.STDOUT_NAMES
    source_file, reference_file, output_file = (None if f is None else paths.expand(f)  # ~ as the user's home
                                                for f in (source_file, reference_file, output_file))
    sources = read_lines(source_file, "--source_file")
    references = read_lines(reference_file, "--reference_file") if reference_file else None
    if references is not None and len(references) != len(sources):
        raise UserError(f"--reference_file has {len(references)} lines for {len(sources)} source lines "
                        f"({reference_file} vs {source_file}); they must pair line by line")
    if printed:
        output_file = stdout or sys.stdout
    elif output_file is None:
        output_file = os.path.join(workdir, f"output.{eval_ensemble.NAME}.txt" if others else "output.txt")
        _check_writable(output_file, f"the default --output_file={output_file} (pass --output_file elsewhere)")
    else:  # never over an input, another command's output or committed docs (lconv.outputs), then writable
        outputs.check_output_file(output_file, "--output_file",
                                  inputs=[("--source_file", source_file), ("--reference_file", reference_file)])
        _check_writable(output_file, f"--output_file={output_file}")
    trained, settings = load()
    if task == "lm":
        return _generate_file(trained, sources, source_file, output_file, settings)
    return _translate_file(trained, sources, references, source_file, output_file, settings, nbest)


def _check_run_flags(workdir: str, *, split: str, average_last: int, checkpoint: str, beam_size: int | None,
                     lenpen: float | None, source_file: str | None, reference_file: str | None,
                     output_file: str | None, interactive: bool, sampling: dict[str, Any], nbest: int | None,
                     guards: dict[str, int], stem: str) -> restore.StoredConfig:
    """Every flag combination ``run`` refuses, checked before anything is loaded; returns the run's stored config."""
    check_flags(average_last=average_last, checkpoint=checkpoint, beam_size=beam_size, lenpen=lenpen)
    schema.check_search(spell=lambda name: f"--{name}", **guards)
    schema.check_sampling(sampling, spell=lambda name: f"--{name}", idle=False)  # ranges; the rest per task below
    if interactive:
        for flag, value in (("--source_file", source_file), ("--reference_file", reference_file),
                            ("--output_file", output_file)):
            if value is not None:
                raise UserError(f"{flag} does not go with --interactive, which reads lines from stdin and prints "
                                f"each output to stdout")
        if jax.process_count() > 1:
            raise UserError("--interactive reads this process's stdin: run it as a single process")
    stored = restore.read_stored(workdir)
    config, task = stored.config, stored.config.task
    if task == "lm":
        if nbest is not None:
            raise UserError(f"--nbest={nbest}: for translation and summarization runs (hypotheses of a beam search "
                            "or samples); an lm run continues prompts")
        _check_lm_flags(config, workdir, beam_size=beam_size, lenpen=lenpen, source_file=source_file,
                        reference_file=reference_file, interactive=interactive, sampling=sampling, guards=guards)
    else:
        _check_translation_flags(config, workdir, beam_size=beam_size, source_file=source_file,
                                 interactive=interactive, sampling=sampling, nbest=nbest)
    if source_file is None and not interactive:
        for flag, value in (("--reference_file", reference_file), ("--output_file", output_file)):
            if value is not None:
                raise UserError(f"{flag} goes with --source_file; a split is scored against its own references "
                                f"and written to <workdir>/{split}.hyp.txt")
        outputs = [f"{stem}.scores.json"] + ([] if task == "lm" else [f"{stem}.hyp.txt"])
        for name in outputs:
            path = os.path.join(workdir, name)
            _check_writable(path, f"{path} (eval writes a split's outputs into --workdir)")
    return stored


def _check_lm_flags(config: schema.RunConfig, workdir: str, *, beam_size: int | None, lenpen: float | None,
                    source_file: str | None, reference_file: str | None, interactive: bool,
                    sampling: dict[str, Any], guards: dict[str, int]) -> None:
    """What an LM run refuses: beam settings, references, sampling or generation guards without prompts (a
    split's perplexity decodes nothing), and sampling settings its model cannot take (``--max_len`` beyond its
    positions, ``--top_k`` beyond its vocabulary)."""
    given = [f"--{n}" for n in SAMPLING_DEFAULTS if sampling.get(n) is not None]
    beam = [f for f, v in (("--beam_size", beam_size), ("--lenpen", lenpen)) if v is not None]
    if beam:
        raise UserError(f"{', '.join(beam)}: an lm run samples rather than beam-searches; use --temperature, "
                        f"--top_k, --top_p, --seed (temperature 0 = greedy)")
    if reference_file is not None:
        raise UserError("--reference_file: an lm run continues the prompts of --source_file and scores nothing; "
                        "its perplexity is scored on a split (eval.py --split=...)")
    if source_file is None and not interactive:
        given += [f"--{n}" for n in guards]
        if given:
            raise UserError(f"{', '.join(given)} go with prompts: --source_file (one per line) or --interactive; "
                            "without them eval.py scores the split's perplexity")
        return
    DecodeSettings.build(config.decode, **sampling).prompt_limit(config.model.max_len, "--max_len")
    vocab_size = _vocab_size(config, workdir) if sampling.get("top_k") else None
    schema.check_sampling(sampling, spell=lambda name: f"--{name}", vocab_size=vocab_size)


def _vocab_size(config: schema.RunConfig, workdir: str) -> int:
    """The upper bound of ``--top_k``, ``--beam_size`` and ``--nbest``: the tokenizer's vocabulary (the model's), or
    where there is no tokenizer to read the config's (loading the run then says what is missing)."""
    try:
        return tokenizer_lib.load_tokenizer(workdir).vocab_size
    except UserError:
        return int(config.data.vocab_size)


def _check_translation_flags(config: schema.RunConfig, workdir: str, *, beam_size: int | None, source_file: str | None,
                             interactive: bool, sampling: dict[str, Any], nbest: int | None) -> None:
    """What a translation or summarization run refuses: ``--max_len`` (its lengths are config.decode.max_len_a and
    _b), sampling or ``--nbest`` without sources to decode, ``--nbest`` beyond the beam (the API's rule,
    ``schema.hypotheses_per_source``) and ``--top_k`` beyond the vocabulary."""
    if sampling.get("max_len") is not None:
        raise UserError(f"--max_len: for lm runs; a {config.task} run's output length is config.decode.max_len_a * "
                        "source length + max_len_b")
    given = [f"--{n}" for n in SAMPLING_DEFAULTS if sampling.get(n) is not None] + (["--nbest"] if nbest else [])
    if given and source_file is None and not interactive:
        raise UserError(f"{', '.join(given)} go with sources: --source_file (one per line) or --interactive; a "
                        "split is scored on its beam search's best hypotheses")
    # top_k's, the beam's and the samples' upper bound is the vocabulary's size (the tokenizer's)
    vocab_size = _vocab_size(config, workdir) if sampling.get("top_k") or beam_size or nbest else None
    schema.hypotheses_per_source(nbest=nbest, beam_size=beam_size, temperature=sampling.get("temperature"),
                                 stored_beam_size=config.decode.beam_size, spell=lambda name: f"--{name}",
                                 vocab_size=vocab_size)
    schema.check_search(beam_size=beam_size, spell=lambda name: f"--{name}", vocab_size=vocab_size)
    schema.check_sampling(sampling, spell=lambda name: f"--{name}", vocab_size=vocab_size)


def _decode_choices(task: str, sampling: dict[str, Any], nbest: int | None) -> dict[str, Any]:
    """The decoding settings the flags choose (checked), for ``DecodeSettings.build`` over the loaded config's
    ``decode`` section, with ``--beam_size`` / ``--lenpen`` (``_load``): an LM's sampling flags; a
    translation's only with ``--temperature > 0``, and then the samples per source (``--nbest``, else one)."""
    if task == "lm":
        return dict(sampling)
    if not sampling.get("temperature"):
        return {}
    return {**sampling, "beam_size": nbest or 1}


def check_flags(*, average_last: int, checkpoint: str, beam_size: int | None, lenpen: float | None) -> None:
    """eval.py's flags against their ranges, before the workdir is read."""
    restore.check_checkpoint_choice(average_last, checkpoint)
    schema.check_search(beam_size=beam_size, lenpen=lenpen, spell=lambda name: f"--{name}")


TEXT_FILE_LIMIT = 1 << 30  # bytes of --source_file / --reference_file: every line is held in memory
LINE_OVERHEAD_BYTES = 64  # a Python string's own size and its place in the list
TEXT_LINE_LIMIT = 1 << 20  # lines of one --source_file: far past any test set


def read_lines(path: str, flag: str) -> list[str]:
    """The lines of a UTF-8 text file, each without its "\\n" (or "\\r\\n"). A byte sequence that is not UTF-8
    is an error naming the line (1-based) and the byte offset in it (0-based), never replaced: a silently
    changed input would be decoded and scored as if it were the user's."""
    lines, total = [], 0
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) and not f.isatty():  # /dev/zero: read to the bound
                raise UserError(f"{flag}={path}: a device, not a text file; name a file, a pipe or a terminal")
            number = 0
            while raw := f.readline(TEXT_FILE_LIMIT - total + 1):  # bounded: /dev/zero is one endless line
                # what holding it takes: its text, and each line's own string (short lines cost far more than bytes)
                total, number = total + len(raw) + LINE_OVERHEAD_BYTES, number + 1
                if number > TEXT_LINE_LIMIT:  # each is tokenized and held before the first batch
                    raise UserError(f"{flag}={path}: more than {TEXT_LINE_LIMIT:,} lines; split it into smaller "
                                    "files")
                if total > TEXT_FILE_LIMIT:
                    raise UserError(f"{flag}={path}: more than {TEXT_FILE_LIMIT:,} bytes to hold (its text and "
                                    f"{LINE_OVERHEAD_BYTES} a line); split it into smaller files")
                raw = raw.removesuffix(b"\n").removesuffix(b"\r")
                try:
                    lines.append(raw.decode("utf-8"))
                except UnicodeDecodeError as err:
                    raise UserError(
                        f"{flag}={path}: line {number}, byte offset {err.start}: {raw[err.start]:#04x} is not UTF-8 "
                        f"({err.reason}); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    except OSError as err:
        raise UserError(f"{flag}={path}: cannot read it ({err.strerror or err})") from None
    return lines


def _check_writable(path: str, what: str) -> None:
    """Raises when ``path`` cannot be written: tried now (a temporary file beside it), not after decoding."""
    if paths.is_url(path):  # a remote filesystem (gs://...): no local check
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.islink(path):
        problem = "it is a symbolic link (lconv writes no output through a link)"
    elif os.path.isdir(path):
        problem = "it is a directory"
    elif outputs.special_kind(path, follow_links=True) not in (None, "character device"):  # /dev/null: written into
        problem = (f"it is a {outputs.special_kind(path, follow_links=True)}, not a regular file (name a regular "
                   "file, or a device to write to)")
    elif not os.path.isdir(directory):
        problem = f"the directory {directory} does not exist"
    else:
        # as given: its folder swapped for a link, or a '..' after one, would move the output elsewhere
        shared_folders.check_way(os.path.dirname(path) or os.curdir, what)
        try:
            if outputs.special_kind(path, follow_links=True) == "character device":  # written into, never renamed
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                return
            # the writer would refuse it after decoding: say so before
            shared_folders.check_owner(path, "lconv replaces no other user's file with its output")
            if os.path.exists(path):  # open for writing without truncating, never through a link swapped in
                os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC))
            # the writer's temporary file beside it, renamed over it: the folder must take one too
            handle, probe = tempfile.mkstemp(dir=directory, prefix=".lconv-write-check-")
            os.close(handle)
            os.remove(probe)
            return
        except OSError as err:
            problem = err.strerror or str(err)
    raise UserError(f"cannot write {what}: {problem}")


def _load(stored: restore.StoredConfig, workdir: str, average_last: int, checkpoint: str, beam_size: int | None,
          lenpen: float | None, chosen: dict[str, Any], members: eval_ensemble.Members | None = None
          ) -> tuple[restore.Trained, DecodeSettings]:
    """The trained run (or the ensemble of ``members``), and the search eval.py runs: the (first) run's stored
    ``config.decode`` with the flags in place."""
    if members is not None:
        trained = eval_ensemble.load(members, average_last=average_last, checkpoint=checkpoint)
    else:
        trained = restore.load_trained(workdir, average_last=average_last, checkpoint=checkpoint, stored=stored)
        logger.info(f"checkpoint(s) {trained.steps}")
    return trained, DecodeSettings.build(trained.config.decode, **{"beam_size": beam_size, "lenpen": lenpen, **chosen})


def _split_data_dir(stored: restore.StoredConfig, workdir: str, data_dir: str | None) -> str:
    """The folder a split's data is read from: ``--data_dir`` (prepared there if need be), else the run's own
    ``config.data.data_dir`` if its copy is complete there. The stored folder is whoever made the run's choice: a
    run from elsewhere naming ``/etc`` had eval.py prepare a dataset into it, a write where the user never said."""
    if data_dir is not None:
        if not str(data_dir).strip():
            raise UserError("--data_dir is empty: name the folder to read (or prepare) the split's data in")
        return data_dir
    data = DataConfig.from_config(stored.config.data)
    if not sources.config_is_prepared(data):
        raise UserError(f"config.data.data_dir={data.data_dir} ({os.path.join(workdir, 'config.json')}) holds no "
                        f"prepared copy of {sources.display_name(data)}; eval.py writes data only where you say: "
                        "pass --data_dir=DIR to read or prepare it there")
    return data.data_dir


def _score_split(trained: restore.Trained, settings: DecodeSettings, workdir: str, split: str, stem: str,
                 members: eval_ensemble.Members | None, data_dir: str | None = None) -> dict[str, Any]:
    """``split`` of the run's dataset (read from ``data_dir``, default the run's own) decoded and scored (an LM: its
    perplexity), written as ``<workdir>/<stem>.*``; an ensemble's scores name its members."""
    data_dir = trained.config.data.data_dir if data_dir is None else data_dir
    # The split alone: a view for this pass (training's rule that eval_splits holds validation does not apply)
    config = dataclasses.replace(trained.config, data=dataclasses.replace(trained.config.data, eval_splits=(split,),
                                                                          data_dir=data_dir))
    data = pipeline.make_datasets(config.data, trained.tokenizer)
    extra = eval_ensemble.report(members) if members is not None else {}
    extra.update(_split_as_recorded(config.data, workdir, split))
    if config.task == "lm":
        return loss_pass.score_perplexity(config, trained.model, trained.params, data.eval_sets[split], workdir,
                                          split, output_name=stem, extra=extra)
    return split_scoring.score_split(config.infer, trained.model, trained.params, trained.tokenizer, data.eval_sets,
                                     workdir, settings, split=split, output_name=stem, extra=extra)


def _split_as_recorded(data: DataConfig, workdir: str, split: str) -> dict[str, Any]:
    """``{}`` when ``split`` holds as many examples as the run's ``data_report.json`` recorded (or it recorded
    none); else a warning, and the two counts for the scores: another copy or version of the dataset (a data_dir
    someone else prepared) would be scored without a word."""
    try:
        with paths.open_checked(paths.join(workdir, "data_report.json"), within=workdir, limit=1 << 20) as f:
            recorded = json.loads(f.read()).get("examples", {}).get(split)
    except (UserError, OSError, ValueError, AttributeError):
        return {}  # none recorded (a catalog dataset, a run from before the report): nothing to compare
    found = len(sources.config_source(data, split)[0])
    if not isinstance(recorded, int) or recorded == found:
        return {}
    logger.warning(f"the {split} split in {data.data_dir} holds {found:,} examples, where this run's "
                   f"data_report.json recorded {recorded:,}: the scores are of this copy of "
                   f"{sources.display_name(data)}, not of the one the run was made with")
    return {"examples_in_split": found, "examples_recorded_by_run": recorded}


def _translate_file(trained: restore.Trained, sources: Sequence[str], references: Sequence[str] | None,
                    source_file: str, output_file: str | TextIO, settings: DecodeSettings, nbest: int | None
                    ) -> dict[str, Any]:
    """Decodes the lines, writes one output per input line (with ``nbest``: ``write_nbest``'s lines), reports what
    was not decoded as given, and scores the best hypotheses against ``references`` (blank sources stay in, as
    empty hypotheses)."""
    config = trained.config
    translations = per_line.translate_lines(config.infer, trained.model, trained.params, trained.tokenizer, sources,
                                            settings, name=_line_name, nbest=nbest or 0,
                                            progress=f"decoding {os.path.basename(source_file)}")
    if nbest:
        _write_text(output_file, "".join(nbest_lines(i, entries) for i, entries in enumerate(translations.nbest)))
    else:
        _write_lines(output_file, translations.hypotheses)
    scores = {"examples": len(sources), "blank_sources": len(translations.blank), **translations.lengths.counts()}
    if not sources:
        written = output_file if isinstance(output_file, str) else "the output"
        logger.info(f"--source_file={source_file} has no lines: {written} is empty, nothing to score")
    if translations.blank:
        scored = "; scored as empty hypotheses" if references is not None else ""
        count = len(translations.blank)
        logger.info(f"{count} blank source line{'s' if count != 1 else ''} ({_line_numbers(translations.blank)}): "
                    f"empty output{'s' if count != 1 else ''} in place{scored}")
    if references is not None and sources:
        scores.update(scoring.score_texts(config.task, translations.hypotheses, references,
                                           split_compounds=config.decode.compound_split))
    logger.info(json.dumps({k: v for k, v in scores.items() if k != "bleu_text"}))
    return scores


def _generate_file(trained: restore.Trained, prompts: Sequence[str], source_file: str, output_file: str | TextIO,
                   settings: DecodeSettings) -> dict[str, Any]:
    """An LM's continuation of each prompt line, one output line per prompt (a blank prompt starts from BOS)."""
    generator = compiled.Generator(trained.config.infer, trained.model, trained.params)
    outputs = per_line.generate_lines(trained.config.infer, trained.tokenizer, prompts, generator, settings,
                                      name=_line_name, progress=f"continuing {os.path.basename(source_file)}")
    _write_lines(output_file, outputs.hypotheses)
    report = {"examples": len(prompts), "truncated_prompts": len(outputs.lengths.truncated),
              "longest_prompt_tokens": outputs.lengths.longest, "prompt_token_limit": outputs.lengths.limit,
              **{name: getattr(settings, name) for name in SAMPLING_DEFAULTS}}
    logger.info(json.dumps(report))
    return report


def _interactive(trained: restore.Trained, stdin: TextIO, stdout: TextIO, settings: DecodeSettings,
                 nbest: int | None) -> dict[str, Any]:
    """Decodes each line of ``stdin`` as it arrives and prints its output (one line; with ``nbest``,
    ``nbest_lines``' block) to ``stdout``. The programs are built once: a line compiles only when its length falls
    in a width bucket not seen before."""
    config = trained.config
    current = {"line": 0}  # the stdin line being decoded, for the warning when it is cut
    name = lambda _: f"stdin line {current['line']}"  # noqa: E731
    if config.task == "lm":
        generator = compiled.Generator(config.infer, trained.model, trained.params)
        output_of = lambda line: per_line.generate_lines(config.infer, trained.tokenizer, [line],  # noqa: E731
                                                                 generator, settings, name=name).hypotheses[0]
    else:
        translator = compiled.Translator(config.infer, trained.model, trained.params)

        def output_of(line: str) -> str:
            found = per_line.translate_lines(config.infer, trained.model, trained.params, trained.tokenizer, [line],
                                                     settings, translator=translator, name=name, nbest=nbest or 0)
            return nbest_lines(current["line"] - 1, found.nbest[0]).rstrip("\n") if nbest else found.hypotheses[0]
    logger.info(f"reading {'prompts' if config.task == 'lm' else 'sources'} from stdin, one per line (end with Ctrl-D)")
    # On a terminal a run's pieces could hold escape sequences (set the title, clear the screen): shown escaped.
    shown = console.printable if console.is_terminal(stdout) else (lambda text: text)
    count, not_utf8 = 0, []
    for number, line in _stdin_lines(stdin):
        if line is None:  # reported; an empty output line keeps outputs paired with inputs
            not_utf8.append(number - 1)
            print("", file=stdout, flush=True)
            continue
        current["line"] = number
        output = output_of(line)
        print(shown(output if nbest else output.replace("\n", " ")), file=stdout, flush=True)
        count += 1
    if not_utf8:
        logger.warning(f"{len(not_utf8)} stdin line(s) not UTF-8, each skipped with an empty output "
                       f"({_line_numbers(not_utf8)})")
    return {"examples": count, "not_utf8_lines": len(not_utf8)}


STDIN_LINE_LIMIT = 1 << 20  # bytes of one --interactive line


def _stdin_lines(stdin: TextIO) -> Iterator[tuple[int, str | None]]:
    """(line number, the line without its newline), or None for a line that is not UTF-8 (logged, naming the byte).
    Lines are read as bytes: a text stream would end the session at the first bad byte (or, under the C locale's
    surrogateescape, pass the tokenizer lone surrogates it refuses)."""
    stream = getattr(stdin, "buffer", stdin)
    for number, raw in enumerate(iter(lambda: stream.readline(STDIN_LINE_LIMIT + 1), stream.read(0)), start=1):
        if len(raw) > STDIN_LINE_LIMIT:  # /dev/zero has no newline: held whole, it would take the host's memory
            raise UserError(f"stdin line {number}: more than {STDIN_LINE_LIMIT:,} bytes without a newline; "
                            "--interactive reads one source or prompt a line")
        if isinstance(raw, str):  # a text stream without bytes beneath (io.StringIO): its bad characters as bytes
            try:
                raw = raw.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raw = raw.encode("utf-8", "surrogatepass")
        raw = raw.removesuffix(b"\n").removesuffix(b"\r")
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            logger.warning(f"stdin line {number}, byte offset {err.start}: {raw[err.start]:#04x} is not UTF-8 "
                           f"({err.reason}); line skipped")
            yield number, None


def _write_lines(output: str | TextIO, outputs: Sequence[str]) -> None:
    """One output per line, to a local file, a URL (gs://) or stdout; process 0 writes (every process holds every
    output)."""
    _write_text(output, reports.lines_text(outputs))


def _write_text(output: str | TextIO, text: str) -> None:
    """Writes ``text`` to the file named ``output`` (atomically), or prints it (``--output_file=-``: control
    characters escaped on a terminal)."""
    if jax.process_index() != 0:
        return
    if isinstance(output, str):
        outputs.write_atomically(output, text)
        logger.info(f"outputs written to {output}")  # the default, <workdir>/output.txt, is not on the command line
    else:
        output.write(console.printable(text) if console.is_terminal(output) else text)
        output.flush()


def nbest_lines(index: int, entries: Sequence[dict[str, Any]]) -> str:
    """fairseq-generate's lines for source ``index`` (0-based, as fairseq numbers them), per hypothesis best first:
    ``H-<index>\t<score>\t<text>`` (the search's length-penalised score, a natural log: fairseq prints base 2)
    and ``P-<index>\t<each output token's log-probability, EOS included>``; nothing for a blank source."""
    lines = []
    for entry in entries:
        text = entry["text"].replace("\n", " ").replace("\t", " ")
        lines.append(f"H-{index}\t{entry['score']!r}\t{text}\n")
        lines.append(f"P-{index}\t" + " ".join(f"{score:.4f}" for score in entry["token_scores"]) + "\n")
    return "".join(lines)


def _line_name(index: int) -> str:
    return f"line {index + 1}"  # 1-based, as editors number lines


def _line_numbers(indices: Sequence[int], shown: int = 5) -> str:
    """0-based indices -> "line 3, 7, 9 and 2 more" (1-based, as editors number lines)."""
    numbers = ", ".join(str(i + 1) for i in indices[:shown])
    more = f" and {len(indices) - shown} more" if len(indices) > shown else ""
    return f"line{'s' if len(indices) > 1 else ''} {numbers}{more}"
