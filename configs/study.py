"""The reproduction study: every mixer on the three bundled DDTP tasks, same data, budget and seeds.

    python -m lconv.study --config=configs/study.py --output_dir=runs/study              # full
    python -m lconv.study --config=configs/study.py:quick --output_dir=runs/study_quick --docs_dir=runs/study_quick
    python -m lconv.study --config=configs/study.py:gpu --output_dir=runs/study_gpu      # one accelerator

A re-run skips finished runs and resumes interrupted ones; ``--resume_from=docs`` copies the runs archived in
``<docs_dir>/results/runs/`` instead of training them again (lconv/study/archive.py). Modes: ``full``, the README
default's model and recipe, 600 updates per run (equal updates, not equal minutes), each mixer at the rate and
length penalty its own sweep chose;
``quick``, a smoke test whose numbers mean nothing; ``gpu``, the paper's sizes on one accelerator. How runs are
matched and measured: lconv/study/plan.py and measure.py; how long each mode takes: docs/results.md.
"""
import ml_collections

from lconv.configs import common, default
from lconv.errors import UserError
from lconv.nn import mixers

REFERENCE_MIXER = "transformer"
TASKS = ("translation", "lm", "summarization")
MODES = ("full", "quick", "gpu")


def _task(family, words, overrides, max_seeds=0):
    """One task of the study: a family config (``lconv.configs.<family>``), its variant words besides the mixer,
    fields that every run of the task overrides (a nested dict: section -> field -> value), and how many of the
    study's seeds it runs (0: all)."""
    return ml_collections.ConfigDict({"family": family, "words": words, "overrides": overrides,
                                      "max_seeds": max_seeds})


def _default_scale():
    """The README default's model and recipe (configs/default.py) as study overrides: its size, optimiser,
    schedule, batches and vocabulary, so the study measures the models a new user trains."""
    d = default.get_config()
    pick = {"model": ("d_model", "ffn_dim", "num_heads", "encoder_layers", "decoder_layers", "encoder_kernel_sizes",
                      "decoder_kernel_sizes", "dropout", "weight_dropout", "normalize_before", "max_len"),
            "optim": ("optimizer", "learning_rate", "schedule", "warmup_steps", "cooldown_fraction", "clip_norm"),
            "data": ("batch_size", "max_input_length", "max_target_length", "vocab_size", "tokenizer_max_sentences"),
            "decode": ("beam_size", "lenpen")}
    return {section: {name: d[section][name] for name in names} for section, names in pick.items()}


def _shared(d_model, ffn_dim, heads, layers, kernels, steps, warmup, rows, length, checkpoint_every):
    """The overrides every task shares in a mode: the model size, optimisation and the step budget."""
    return {
        "model": {"d_model": d_model, "ffn_dim": ffn_dim, "num_heads": heads, "encoder_layers": layers,
                  "decoder_layers": layers, "encoder_kernel_sizes": kernels[:layers],
                  "decoder_kernel_sizes": kernels[:layers], "dropout": 0.1, "weight_dropout": 0.0,
                  "normalize_before": True},
        "optim": {"optimizer": "adam", "learning_rate": 3e-3, "schedule": "inverse_sqrt", "warmup_steps": warmup,
                  "clip_norm": 0.0},
        "data": {"batch_size": rows, "max_input_length": length, "max_target_length": length},
        "train": {"num_steps": steps, "checkpoint_every": checkpoint_every},
    }


def _merge(base, extra):
    out = {k: dict(v) for k, v in base.items()}
    for section, fields in extra.items():
        out.setdefault(section, {}).update(fields)
    return out


def get_config(arg=None):
    words = common.parse_args(arg, MODES)
    if len(words) > 1:
        raise UserError(f"choose one study mode; got {sorted(words)}")
    mode = next(iter(words), "full")
    c = ml_collections.ConfigDict()
    c.mode = mode
    # Every registered mixer (plugins too), by its variant word, the reference first; a package.module:Class word
    # adds a mixer from a file of your own: --config.mixers=transformer,dynamic,my_mixers:MyMixer
    c.mixers = tuple(dict.fromkeys([REFERENCE_MIXER, *mixers.variant_words()]))
    c.tasks = TASKS
    c.seeds = (0, 1, 2)  # each seed sets config.seed (init, dropout) and data.seed (shuffling) for every mixer
    c.data_dir = "~/tensorflow_datasets"  # where the bundled DDTP tasks are prepared
    c.param_tolerance = 0.05  # every mixer's parameter count within this fraction of the reference mixer's
    c.reference_mixer = REFERENCE_MIXER  # whose parameter count (at the task's sizes) the others match
    c.ffn_multiple = 8  # the matched FFN width is a multiple of this
    c.average_last = 3  # the test split is scored with the mean of the last checkpoints (the paper's practice)
    c.run_timeout_minutes = 30.0  # a run that takes longer is stopped and reported as failed
    c.prune_checkpoints = True  # delete a finished run's checkpoints (its result, logs and outputs stay)
    c.lm_generate_rows, c.lm_generate_tokens = 16, 64  # LM decoding speed: greedy generation of this shape
    # Per-mixer overrides (variant word -> section -> field -> value), applied after the task's; e.g.
    # {"knn": {"model": {"mixer_kwargs": {"knn_memory": {"memory_size": 1024, "num_neighbors": 32}}}}}.
    c.mixer_overrides = {}
    # The fair recipe: per (task, mixer), short runs of seed `seed` at each peak rate, the lowest validation NLL
    # wins; then that run's checkpoint decodes the validation split at each length penalty, the best BLEU / ROUGE-L
    # wins. Every seed then trains at the chosen pair (lconv/study/tuning.py). steps = 0 turns it off.
    c.tuning = ml_collections.ConfigDict({"learning_rates": (1.5e-3, 3e-3, 6e-3), "lenpens": (1.0, 1.5, 2.0),
                                          "steps": 0, "seed": 0})

    if mode == "full":
        shared = _merge(_default_scale(), {"train": {"num_steps": 600, "checkpoint_every": 100, "log_every": 50}})
        c.average_last = 1  # the default's recipe: the final parameters, after its cooldown
        # Positions up to 128, not the default's 256: Fixed and Hadamard hold a [max_len, max_len] table per head
        # and layer, which at 256 would take half their FFN to match the Transformer's parameters. Test sources
        # and outputs past 128 tokens are cut there (and counted in each run's log).
        seq2seq = {"model": {"max_len": 128}, "data": {"eval_max_input_length": 128, "eval_max_target_length": 128}}
        c.translation = _task("default", "", _merge(shared, seq2seq))
        c.lm = _task("lm1b", "ddtp,stream", _merge(shared, {
            "model": {"encoder_layers": 0, "decoder_layers": 3, "decoder_kernel_sizes": (3, 7, 15), "max_len": 64},
            "data": {"max_target_length": 64}}))
        c.summarization = _task("cnn_dailymail", "ddtp", _merge(shared, {
            "model": {"max_len": 128}, "data": {**seq2seq["data"], "max_input_length": 128, "max_target_length": 32,
                                                "pack": True}}), max_seeds=2)
        c.tuning.steps = 300
    elif mode == "quick":
        c.seeds = (0,)
        c.average_last = 2
        c.run_timeout_minutes = 10.0
        c.lm_generate_rows, c.lm_generate_tokens = 4, 8
        shared = _shared(32, 64, 2, 1, (3,), steps=12, warmup=2, rows=8, length=16, checkpoint_every=4)
        tiny = {"data": {"vocab_size": 512, "tokenizer_max_sentences": 2_000, "eval_batch_size": 64,
                         "eval_max_input_length": 32, "eval_max_target_length": 32, "read_threads": 1},
                "model": {"max_len": 32}, "decode": {"beam_size": 1, "num_print": 0},
                "train": {"log_every": 2, "spike_factor": 0.0}}
        c.translation = _task("default", "", _merge(shared, tiny))
        c.lm = _task("lm1b", "ddtp,stream", _merge(_merge(shared, tiny), {
            "data": {"max_target_length": 16}, "model": {"encoder_layers": 0, "max_len": 16}}))
        c.summarization = _task("cnn_dailymail", "ddtp", _merge(shared, tiny))
        c.tuning.update({"learning_rates": (3e-3, 6e-3), "lenpens": (1.0, 1.5), "steps": 6})
    else:  # gpu
        c.average_last = 5
        c.run_timeout_minutes = 120.0
        c.lm_generate_rows, c.lm_generate_tokens = 64, 256
        kernels = (3, 7, 15, 31, 31, 31)
        shared = _shared(512, 2048, 8, 6, kernels, steps=6000, warmup=1000, rows=64, length=128,
                         checkpoint_every=500)
        shared = _merge(shared, {"optim": {"learning_rate": 1e-3}, "data": {"vocab_size": 8000},
                                 "train": {"log_every": 100}})
        c.translation = _task("default", "", _merge(shared, {"decode": {"beam_size": 5}}))
        c.lm = _task("lm1b", "ddtp,stream", _merge(shared, {
            "data": {"max_target_length": 256}, "model": {"encoder_layers": 0, "max_len": 256},
            "train": {"num_steps": 4000}}))
        c.summarization = _task("cnn_dailymail", "ddtp", _merge(shared, {
            "data": {"max_input_length": 256, "max_target_length": 32, "pack": True, "eval_max_input_length": 256},
            "model": {"max_len": 256}}))
        c.tuning.update({"learning_rates": (5e-4, 1e-3, 2e-3), "steps": 2000})
    return c
