"""Generation guards on the surfaces: the API's ``translate`` against a beam search by brute force on the model's full
teacher-forced passes (test_api_decoding's reference, with the guards' rule applied to each extension), eval.py's
flags (one-line errors; the outputs the API gives), and an LM's searches (greedy, beams, samples) keeping the
rule after their prompts."""
from __future__ import annotations

import helpers
import numpy as np
import pytest
import tiny_runs
from test_api_decoding import SOURCES, WIDTH, _step_log_probs
from test_guards import _allowed

from lconv.api import Model
from lconv.constants import EOS_ID, PAD_ID
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled


@pytest.fixture(scope="module")
def mt():
    return Model(tiny_runs.in_memory(tiny_runs.translation_config()))


def _guarded_reference_beam(model: Model, source: str, *, beam: int, lenpen: float, ngram: int, min_len: int,
                            prefix: list[int]) -> list[tuple[float, list[int]]]:
    """test_api_decoding's reference beam (no early stop; the best ``2 * beam`` extensions, EOS ones finish), each
    extension of a free step kept only where ``test_guards._allowed`` allows it."""
    decode = model.config.decode
    source_ids = list(model.tokenizer.encode(source)) + [EOS_ID]
    limit = min(int(decode.max_len_a * len(source_ids) + decode.max_len_b) + 1,
                compiled.max_output_len(model.config.infer, DecodeSettings.build(decode), WIDTH))
    limit = max(limit, len(prefix) + 1)
    alive, finished = [(0.0, [])], []
    for i in range(limit):
        logp_AV = _step_log_probs([model], source_ids, [tokens for _, tokens in alive], beam)
        logp_AV[:, PAD_ID] = -np.inf
        extensions = []
        for a, (score, tokens) in enumerate(alive):
            allowed = [prefix[i]] if i < len(prefix) else [EOS_ID] if i + 1 == limit else range(logp_AV.shape[1])
            extensions += [(score + logp_AV[a, v], tokens + [v]) for v in allowed if np.isfinite(logp_AV[a, v]) and (
                i < len(prefix) or _allowed(tokens + [v], i, ngram=ngram, min_len=min_len, start=0, limit=limit))]
        best = sorted(extensions, key=lambda e: -e[0])[:2 * beam]
        finished += [(score / len(tokens) ** lenpen, tokens) for score, tokens in best if tokens[-1] == EOS_ID]
        alive = [(score, tokens) for score, tokens in best if tokens[-1] != EOS_ID][:beam]
    return sorted(finished, key=lambda f: -f[0])[:beam]


@pytest.mark.slow  # a program of its own (the guards are static): CI runs it, the quick tier skips it
def test_the_apis_guarded_beam_equals_a_brute_force_beam_with_the_rule_applied(mt):
    prefix = [7, 7]  # forced, though it repeats: its bigram then bans 7 after a 7
    found = mt.translate(SOURCES, beam_size=3, lenpen=0.6, nbest=3, prefix=[prefix, []], no_repeat_ngram_size=2,
                         min_len=4)
    plain = mt.translate(SOURCES, beam_size=3, lenpen=0.6, nbest=3, prefix=[prefix, []])
    assert [[e["tokens"] for e in entries] for entries in found] != [[e["tokens"] for e in entries]
                                                                      for entries in plain]
    for source, ids, entries in zip(SOURCES, [prefix, []], found):
        reference = _guarded_reference_beam(mt, source, beam=3, lenpen=0.6, ngram=2, min_len=4, prefix=ids)
        assert [entry["tokens"] for entry in entries] == [tokens for _, tokens in reference]
        np.testing.assert_allclose([entry["score"] for entry in entries], [score for score, _ in reference],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # three LM programs
def test_an_lms_greedy_beam_and_sampled_continuations_keep_the_guards_after_their_prompts():
    lm = Model(tiny_runs.in_memory(tiny_runs.lm_config()))
    prompts = ["The small package", "", "Fonts and fonts and fonts"]
    ngram, min_len = 2, 5
    prompt_ids = [list(ids) for ids in lm.tokenizer.encode_batch(prompts)]

    def check(prompt, continuation):
        seq = prompt + continuation
        assert all(_allowed(seq, j, ngram=ngram, min_len=min_len, start=len(prompt), limit=len(prompt) + 12)
                   for j in range(len(prompt), len(seq)))

    for kwargs in (dict(beam_size=3, nbest=3), dict(temperature=1.0, nbest=3, seed=2)):
        for ids, entries in zip(prompt_ids, lm.generate(prompts, max_len=12, no_repeat_ngram_size=ngram,
                                                        min_len=min_len, **kwargs)):
            for entry in entries:
                check(ids, entry["tokens"])
    settings = DecodeSettings.build(lm.config.decode, max_len=12, no_repeat_ngram_size=ngram, min_len=min_len)
    rows = compiled.pad_rows([np.asarray(ids, np.int32) for ids in prompt_ids], 4, 32)
    lengths = np.asarray([len(ids) for ids in prompt_ids] + [0], np.int32)
    greedy = compiled.Generator(lm.config.infer, lm.module, lm.params)(rows, lengths, settings)  # [4, 12] PAD after EOS
    for ids, row in zip(prompt_ids, greedy.tolist()):
        check(ids, [t for t in row if t != PAD_ID])


def test_eval_py_takes_the_guard_flags(tmp_path, capsys):
    import helpers
    import tiny_config
    from test_cli import _config_only

    workdir = _config_only(tmp_path, tiny_config.get_config())
    code, _, err = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", "--no_repeat_ngram_size=65")
    assert helpers.one_line_error((code, "", err), "--no_repeat_ngram_size=65", "[0, 64]")


@pytest.mark.slow  # decodes with a program of its own
def test_eval_py_decodes_with_the_guards_as_the_api_does(tmp_path, monkeypatch):
    from lconv.cli import eval_program
    from lconv.run import restore

    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(helpers.config_json(trained.config))
    monkeypatch.setattr(restore, "load_trained", lambda *args, **kwargs: trained)
    (tmp_path / "in.txt").write_text("\n".join(SOURCES) + "\n")
    guards = dict(no_repeat_ngram_size=2, min_len=6)
    eval_program.run(str(workdir), source_file=str(tmp_path / "in.txt"), output_file=str(tmp_path / "out.txt"),
                     **guards)
    model = Model(trained)
    expected = [text.replace("\n", " ") for text in model.translate(SOURCES, **guards)]
    assert (tmp_path / "out.txt").read_text().split("\n")[:-1] == expected
    assert expected != [text.replace("\n", " ") for text in model.translate(SOURCES)]


@pytest.mark.slow  # lowers and serialises a program
def test_an_export_lowers_the_guards_and_serves_what_the_api_gives(tmp_path):
    from lconv import export

    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    guards = dict(no_repeat_ngram_size=2, min_len=6)
    sidecar = export.export(trained, str(tmp_path), rows=(2,), widths=(32,), beam_size=2, **guards)
    assert sidecar["guards"] == guards
    live = Model(trained).translate(SOURCES, beam_size=2, **guards)
    assert export.load(str(tmp_path))(SOURCES) == live != Model(trained).translate(SOURCES, beam_size=2)
    with pytest.raises(UserError, match=r"^min_len=-1: must be an integer in \[0, "):
        export.export(trained, str(tmp_path / "bad"), rows=(2,), widths=(32,), min_len=-1)
