"""One study run, in a process of its own: train (resuming), score the averaged last checkpoints, measure.

``python -m lconv.study.run <spec>`` (output in ``<workdir>/study.log``): a process per run keeps one run's failure or
memory from the others. The outcome is ``study_result.json`` (finished, skipped later) or ``study_failure.json``
(``{"error", "stage"}``; a later study resumes the run from its checkpoints).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

from lconv import console, json_text, outputs, shared_folders
from lconv.data import paths
from lconv.errors import UserError, first_line
from lconv.run import host_memory
from lconv.study import figures

logger = logging.getLogger(__name__)

RESULT, FAILURE, SPEC, LOG = "study_result.json", "study_failure.json", "study_spec.json", "study.log"
RECORD_LIMIT = 64 << 20  # bytes read of a study JSON file: a run's spec or record is tens of kB


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``; None for a missing, unreadable or malformed one, or one that is no object."""
    return load_json(path)[0]


def load_json(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(object, None)``; ``(None, None)`` for a missing file; else ``(None, what is wrong with it)``. Read as a
    bounded regular file: a pipe or ``/dev/zero`` put in a run's folder is neither a wait nor a flood."""
    try:
        with paths.open_checked(path, limit=RECORD_LIMIT) as f:
            found = json_text.loads(f.read(RECORD_LIMIT + 1))
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, UserError) as err:
        return None, first_line(err, 300)
    return (found, None) if isinstance(found, dict) else (None, "not a JSON object")


def read_record(workdir: str, record: dict[str, Any], waiting: str | None = None) -> dict[str, Any]:
    """A run's record as its workdir holds it: the result, a failure, or "not run" (``waiting``: why)."""
    found, damaged = load_json(os.path.join(workdir, RESULT))
    failed = read_json(os.path.join(workdir, FAILURE))
    if damaged:  # a run with a result lconv cannot read is no run to train again unseen
        return failure_record({"error": f"{RESULT} is damaged ({damaged})", "stage": "result"}, record)
    if found or failed:  # what the run is and where it lives are the plan's, never the file's
        return checked_result({**found, **record}, record, workdir) if found else failure_record(failed, record)
    return {**record, **({"error": waiting} if waiting else {}), "status": "not run"}


def failure_record(failed: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """A failed run's record: the plan's, with the failure file's error and stage as text (nothing else of it)."""
    return {**record, "status": "failed", "error": str(failed.get("error", ""))[:500],
            "stage": str(failed.get("stage", "unknown"))[:40]}


def checked_result(found: dict[str, Any], record: dict[str, Any], workdir: str) -> dict[str, Any]:
    """A finished run's record as read back: its figures numbers (``figures.check_figures``), or a failed record
    saying which one is not, so one bad file fails its run instead of the report."""
    if found.get("status") != "ok":
        return failure_record(found, record)
    try:
        figures.check_figures(found, record, os.path.join(workdir, RESULT))
    except UserError as err:
        return {**record, "status": "failed", "error": str(err), "stage": "result"}
    return found


def write_json(path: str, value: Any) -> None:
    """Written whole or not at all (a temporary file renamed), so a killed run never leaves half a result."""
    outputs.write_atomically(path, json.dumps(value, indent=1, sort_keys=True, default=str))


# The study's side: launch a run's process, wait, read its outcome
def launch(spec: dict[str, Any], workdir: str, tokenizer_file: str, timeout_minutes: float) -> dict[str, Any]:
    """Runs one planned run unless its result exists; returns its record (``status`` ok / failed)."""
    done = read_json(os.path.join(workdir, RESULT))
    if done is not None:
        return checked_result({**done, **spec["record"], "skipped": True}, spec["record"], workdir)
    outputs.claim_directory(workdir, "workdir", "a study run's folder")  # a run's workdir, the study's files beside
    if not os.path.exists(os.path.join(workdir, "spm.model")):  # every run of a task shares one tokenizer
        shutil.copy(tokenizer_file, os.path.join(workdir, "spm.model"))
    write_json(os.path.join(workdir, SPEC), spec)
    failure_path = os.path.join(workdir, FAILURE)
    if os.path.exists(failure_path):
        os.remove(failure_path)
    start = time.time()
    code, timed_out = _run_process(workdir, timeout_minutes)
    result = read_json(os.path.join(workdir, RESULT))
    if result is not None:
        return checked_result({**result, **spec["record"]}, spec["record"], workdir)
    failure = read_json(failure_path) or {"error": _last_line(os.path.join(workdir, LOG)) or f"exit code {code}",
                                          "stage": "unknown"}
    if timed_out:
        failure = {"error": f"timed out after {timeout_minutes:g} minutes (config.run_timeout_minutes); stopped "
                            "with a checkpoint, a re-run resumes it", "stage": failure.get("stage", "unknown")}
    failure.update(status="failed", wall_seconds=time.time() - start, exit_code=code)
    write_json(failure_path, failure)
    return {**spec["record"], **failure}


def _run_process(workdir: str, timeout_minutes: float) -> tuple[int, bool]:
    """``python -m lconv.study.run <spec>`` with its output in ``study.log``; SIGTERM on timeout, SIGKILL a minute later
    (a SIGTERM to the study is passed on). Returns ``(exit code, timed out)``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = shared_folders.child_environment(root)
    with open(os.path.join(workdir, LOG), "a") as out, _sigterm_raises():
        out.write(f"\n=== study run started {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        out.flush()
        # -P: lconv from PYTHONPATH above, never from the working folder (another user's planted lconv/ in /tmp)
        process = subprocess.Popen([sys.executable, "-P", "-m", "lconv.study.run", os.path.join(workdir, SPEC)],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            return process.wait(timeout=timeout_minutes * 60), False
        except subprocess.TimeoutExpired:
            return _stop(process), True
        except _Terminated:
            _stop(process)
            raise UserError(f"stopped by SIGTERM while running {workdir}; the same command resumes the study "
                            "from that run's last checkpoint") from None
        except KeyboardInterrupt:  # the run got the Ctrl-C too: let it checkpoint, then stop the study
            process.wait()
            raise


class _Terminated(Exception):
    """The study process got SIGTERM."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``_Terminated`` once; a second one while the run is being stopped is ignored."""
    raised = []

    def handler(signum: int, frame: Any) -> None:
        del signum, frame
        if not raised:
            raised.append(True)
            raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(process: subprocess.Popen) -> int:
    """SIGTERM (the run checkpoints and exits), SIGKILL if it has not exited a minute later; its exit code."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""


# The run's side (this module as a program)
def _train(spec: dict[str, Any], config: Any) -> dict[str, Any]:
    """Trains (or resumes) the run to its last step; a run stopped early (a signal, its time) fails, to resume later."""
    from lconv.train import loop

    spec["stage"] = "train"
    trained = loop.train_and_evaluate(config, spec["workdir"])
    if trained.get("stopped_by"):
        raise UserError(f"training stopped by {trained['stopped_by']} at step {trained['step']}; a re-run resumes it")
    return trained


def _check_plans_run(workdir: str) -> None:
    """The tuning run to decode is the plan's: its ``config.json`` is its spec's config, which the study checked
    against the plan. A run planted in the folder named its own data and mixer, which decoding it would read."""
    import ml_collections

    from lconv.study import plan

    spec, stored = read_json(os.path.join(workdir, SPEC)), read_json(os.path.join(workdir, "config.json"))
    changes = plan.stored_config_changes(stored, ml_collections.ConfigDict(spec["config"])) \
        if spec is not None and isinstance(spec.get("config"), dict) and stored is not None else {"config.json": ()}
    if changes:
        raise UserError(f"{workdir}: its config.json is not the planned tuning run's (first: {next(iter(changes))}); "
                        "remove the folder and the study trains it again")


def _train_restored(workdir: str) -> None:
    """A tuning run restored from the archive keeps no checkpoint (a study resumed on another machine): it trains
    again from its stored config and seed, so the length-penalty sweep has a checkpoint to decode."""
    import ml_collections

    spec = read_json(os.path.join(workdir, SPEC))
    archived = (read_json(os.path.join(workdir, RESULT)) or {}).get("validation_nll")
    if spec is None:
        raise UserError(f"{workdir}: no {SPEC}; the chosen tuning run cannot be trained again to decode it")
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(workdir, "metrics.jsonl"))  # the archive's rows (it keeps them): training writes its own
    trained = _train(dict(spec, workdir=workdir), ml_collections.ConfigDict(spec["config"]))
    found = (trained.get("validation") or {}).get("nll")
    logger.info(f"{workdir}: restored without a checkpoint, trained again to decode it: validation NLL "
                f"{found if found is None else round(found, 4)} (archived {archived})")


def execute_tuning(spec: dict[str, Any]) -> dict[str, Any]:
    """A tuning sweep's process (lconv.study.tuning): ``tune`` trains a short run and records its validation loss;
    ``lenpen`` decodes the validation split at each length penalty."""
    import ml_collections

    from lconv.cli import eval_program
    from lconv.study import measure

    config, record = ml_collections.ConfigDict(spec["config"]), dict(spec["record"])
    if spec["kind"] == "tune":
        trained = _train(spec, config)
        validation = trained.get("validation") or {}
        if "nll" not in validation:
            raise UserError(f"the run ended without a validation pass (got {sorted(validation)})")
        record.update(status="ok", step=trained["step"], validation_nll=validation["nll"],
                      validation_loss=validation.get("loss"), **measure.training_speed(measure.read_metrics(
                          spec["workdir"])), machine=measure.machine())
        return record
    scores, metric = {}, record["metric"]
    source = os.path.join(os.path.dirname(spec["workdir"]), f"tune_lr{record['learning_rate']:g}")
    if not os.path.exists(os.path.join(source, "config.json")):
        _train_restored(source)
    _check_plans_run(source)
    spec["stage"] = "decode"
    for lenpen in spec["record"]["lenpens"]:
        found = eval_program.run(source, split="validation", lenpen=lenpen)
        scores[f"{lenpen:g}"] = found[metric]
        logger.info(f"validation {metric} at length penalty {lenpen:g}: {found[metric]:.2f}")
    record.update(status="ok", scores=scores, machine=measure.machine())
    return record


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """Trains the run, scores the test split on the last checkpoints' mean, measures; returns the record."""
    import ml_collections

    from lconv.cli import eval_program
    from lconv.data import tokenizer as tokenizer_lib
    from lconv.run import restore
    from lconv.study import measure

    config, workdir = ml_collections.ConfigDict(spec["config"]), spec["workdir"]
    record, times, start = dict(spec["record"]), {}, time.time()
    trained = _train(spec, config)
    times["train_seconds"] = time.time() - start
    spec["stage"], start = "evaluate", time.time()
    split = config.decode.split
    scores = eval_program.run(workdir, split=split, average_last=spec["average_last"])
    times["evaluate_seconds"] = time.time() - start
    tokenizer = tokenizer_lib.load_tokenizer(workdir)
    spec["stage"], start = "measure", time.time()
    if config.task == "lm":
        words = measure.word_count(config, split)
        quality = {"ppl": scores["ppl"], "ppl_word": measure.per_word_perplexity(scores, words),
                   "nll": scores["nll"], "test_tokens": scores["tokens"], "test_words": words}
        restored = restore.load_trained(workdir, average_last=spec["average_last"])
        decode = measure.lm_generation_speed(restored, spec["lm_generate_rows"], spec["lm_generate_tokens"])
        decode["decode_kind"] = (f"greedy LM generation, {spec['lm_generate_rows']} rows x "
                                 f"{spec['lm_generate_tokens']} tokens, median of {decode['decode_repeats']} calls "
                                 "after a compiling one")
    else:
        keys = ("bleu", "bleu_signature") if config.task == "translation" else ("rouge1", "rouge2", "rougeL")
        quality = {k: scores[k] for k in keys}
        quality["test_examples"] = scores["examples"]
        hyp_tokens = measure.hypothesis_tokens(workdir, split, tokenizer)
        decode = {"decode_sentences_per_s": scores["sentences_per_s"], "decode_seconds": scores["decode_seconds"],
                  "decode_tokens_per_s": hyp_tokens / max(scores["decode_seconds"], 1e-9),
                  "decode_tokens": hyp_tokens,
                  "decode_kind": f"beam {config.decode.beam_size} over the {split} split, compilation included"}
    memory = measure.train_step_memory(config, tokenizer.vocab_size)
    times["measure_seconds"] = time.time() - start
    rows = measure.read_metrics(workdir)
    steps_saved = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    record.update(status="ok", step=trained["step"], averaged_steps=steps_saved[-spec["average_last"]:],
                  validation=trained.get("validation", {}), **quality, **decode, **memory,
                  **measure.training_speed(rows), **times, peak_rss_bytes=measure.peak_rss_bytes(),
                  machine=measure.machine())
    return record


def _cache_compilations(directory: str) -> None:
    """JAX's persistent compilation cache, private to the run (no run's timings profit from another's)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv: list[str]) -> int:
    """``python -m lconv.study.run <spec.json>``: 0 with ``study_result.json``, else 1 with ``study_failure.json``."""
    spec = read_json(argv[1])
    if spec is None:
        print(f"error: cannot read the run spec {argv[1]}", file=sys.stderr)
        return 2
    workdir, start = spec["workdir"], time.time()
    host_memory.reuse_freed_memory()  # the driver checked the variable: it raised there, not here
    console.show_log("stdout")  # into study.log, with the run's other output
    _cache_compilations(os.path.join(workdir, "xla_cache"))
    try:
        record = execute_tuning(spec) if spec.get("kind") in ("tune", "lenpen") else execute(spec)
    except (UserError, Exception) as err:  # noqa: BLE001 (every failure is recorded; the study goes on)
        if not isinstance(err, UserError):
            traceback.print_exc()
        lines = str(err).strip().splitlines() or [""]
        error = lines[0] if isinstance(err, UserError) else f"{type(err).__name__}: {lines[0]}"
        write_json(os.path.join(workdir, FAILURE), {"error": error[:500], "stage": spec.get("stage", "start")})
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        write_json(os.path.join(workdir, FAILURE), {"error": "interrupted (Ctrl-C); a re-run resumes it",
                                                    "stage": spec.get("stage", "start")})
        return 130
    record["wall_seconds"] = time.time() - start
    write_json(os.path.join(workdir, RESULT), record)
    if spec.get("prune_checkpoints"):  # the result is safe: the checkpoints (most of the disk) can go
        for name in ("checkpoints", "best", "xla_cache"):
            shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    return 0


if __name__ == "__main__":
    import logging

    logging.getLogger("absl").setLevel(logging.WARNING)
    sys.exit(main(sys.argv))
