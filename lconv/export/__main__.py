"""``python -m lconv.export``: the flags, then ``lconv.export.export``. The program is the one part of the export
that stands on the CLIs' runtime (one-line errors, the flags' parser); the library beside it does not."""
from __future__ import annotations

from collections.abc import Sequence

from lconv import export as export_lib
from lconv import outputs
from lconv.cli import programs, runtime
from lconv.decode_settings import SAMPLING_DEFAULTS
from lconv.errors import UserError
from lconv.run import compilation_cache, restore, schema


def _flag(name: str) -> str:
    return f"--{name}"


def main(argv: list[str] | None = None) -> None:
    """``python -m lconv.export``: the flags, then ``export``."""
    from absl import app, flags, logging

    from lconv import console

    flags.DEFINE_string("workdir", None, "A directory written by train.py.")
    flags.DEFINE_string("out", None, "Where to write the programs, params, tokenizer and sidecar.")
    flags.DEFINE_list("platforms", ["cpu"], f"Platforms to lower for, from {', '.join(export_lib.PLATFORMS)}.")
    flags.DEFINE_list("rows", ["1", "8"], "Batch rows of the exported buckets.")
    flags.DEFINE_list("widths", [], "Input widths (tokens) of the exported buckets (default: 32, 64, ... up to the "
                      "longest input lconv.load takes: config.data.eval_max_input_length, an LM's model.max_len).")
    flags.DEFINE_integer("average_last", 1, "Average the parameters of the last N >= 1 checkpoints.")
    flags.DEFINE_enum("checkpoint", "latest", ["latest", "best"], "The latest checkpoint(s), or the best.")
    flags.DEFINE_integer("beam_size", None, "Translation: beam size (default: the stored config's).")
    sampling = SAMPLING_DEFAULTS  # eval.py's and the API's defaults
    flags.DEFINE_integer("max_len", None, f"LM: new tokens per prompt (default {sampling['max_len']}).")
    flags.DEFINE_float("temperature", None, f"LM: sampling temperature (default {sampling['temperature']}: greedy).")
    flags.DEFINE_integer("top_k", None, f"LM: top-k filter (default {sampling['top_k']}: off).")
    flags.DEFINE_float("top_p", None, f"LM: nucleus filter (default {sampling['top_p']}: off).")
    programs.define_trust_plugins()
    flags.DEFINE_integer("no_repeat_ngram_size", None, "No n-gram of this size twice in an output (fairseq's; 0 = "
                         "off; default: the stored config's).")
    flags.DEFINE_integer("min_len", None, "No EOS before this many output tokens (fairseq's --min-len; 0 = off; "
                         "default: the stored config's).")
    flags.mark_flags_as_required(["workdir", "out"])
    F = flags.FLAGS

    def run(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        console.show_log("stdout")
        with runtime.user_errors():
            runtime.check_backend()  # JAX_PLATFORMS naming a backend that is not there: one line, first
            compilation_cache.use_user_folder()  # an entry is code: never from a folder another user could fill
            rows, widths = (_integers(F[name].value, f"--{name}") for name in ("rows", "widths"))
            restore.check_checkpoint_choice(F.average_last, F.checkpoint)
            schema.check_search(beam_size=F.beam_size, spell=_flag, no_repeat_ngram_size=F.no_repeat_ngram_size,
                                min_len=F.min_len)  # the rules eval.py and the API apply
            sampling = {name: F[name].value for name in ("max_len", "temperature", "top_k", "top_p")}
            schema.check_sampling(sampling, spell=_flag)
            stored = restore.read_stored(F.workdir, trust_plugins=F.trust_plugins)
            config = stored.config
            given = [name for name, value in sampling.items() if value is not None]
            export_lib.check_task_settings(config.task, F.beam_size, given, _flag)
            widths = widths or export_lib.default_widths(config)
            export_lib.check_buckets(config, F.platforms, rows, widths, _flag)
            outputs.check_directory(F.out, "export", "--out")  # before the checkpoint is read
            trained = restore.load_trained(F.workdir, average_last=F.average_last, checkpoint=F.checkpoint,
                                           stored=stored)
            sidecar = export_lib.export(trained, F.out, platforms=F.platforms, rows=rows, widths=widths,
                                        beam_size=F.beam_size, max_len=F.max_len, temperature=F.temperature,
                                        top_k=F.top_k, top_p=F.top_p, spell=_flag,
                                        no_repeat_ngram_size=F.no_repeat_ngram_size, min_len=F.min_len)
            print(f"exported {len(sidecar['programs'])} programs for {','.join(sidecar['platforms'])} to {F.out}")

    logging.set_verbosity(logging.WARNING)  # orbax's and JAX's info lines: stderr holds errors alone
    app.run(run, argv=argv, flags_parser=runtime.parse_flags)


def _integers(values: Sequence[str], flag: str) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError:
        raise UserError(f"{flag}={','.join(values)}: comma-separated integers") from None


if __name__ == "__main__":
    main()
