"""eval.py's ``--ensemble`` (lconv/cli/eval_ensemble.py): runs decoding together, as fairseq-generate's
``--path a.pt:b.pt``. A run with itself is that run; two runs score each token by the log of their mean
probability, checked against each member's own ``score()``; outputs are named for the ensemble, never over a run's
own; members that cannot decode together are one line each, before anything loads."""
from __future__ import annotations

import json
import math
import shutil

import helpers
import numpy as np
import pytest
import tiny_config
import tiny_runs

import lconv
from lconv.api import Model
from lconv.cli import eval_program
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.run import restore

SOURCES = ["Fast tool.", "", "A library for the window system and fonts."]
REFERENCES = ["Schnelles Werkzeug.", "", "Eine Bibliothek für das Fenstersystem."]


def _workdirs(tmp_path, monkeypatch, runs: dict[str, restore.Trained]) -> dict[str, str]:
    """A workdir per name holding its run's config.json and tokenizer, whose ``load_trained`` gives that run
    (untrained in-memory runs: eval's logic is under test, not the models)."""
    paths = {}
    for name, trained in runs.items():
        workdir = tmp_path / name
        workdir.mkdir()
        (workdir / "config.json").write_text(helpers.config_json(trained.config))
        (workdir / "spm.model").write_bytes(trained.tokenizer.model_proto)
        paths[name] = str(workdir)
    by_path = {paths[name]: trained for name, trained in runs.items()}
    monkeypatch.setattr(restore, "load_trained", lambda workdir, **kwargs: by_path[str(workdir)])
    (tmp_path / "in.txt").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(REFERENCES) + "\n")
    return paths


def _nbest(path) -> dict[int, list[tuple[float, str, list[float]]]]:
    """fairseq-generate's H/P lines -> {source index: [(score, text, token scores), ...]}."""
    blocks, lines = {}, path.read_text().split("\n")[:-1]
    for h, p in zip(lines[::2], lines[1::2]):
        tag, score, text = h.split("\t")
        blocks.setdefault(int(tag[2:]), []).append((float(score), text, [float(x) for x in p.split("\t")[1].split()]))
    return blocks


@pytest.mark.slow  # four decodes, the single model's and the ensemble's programs: ~10 s of CPU
def test_an_ensemble_of_a_run_with_itself_is_that_run_and_keeps_its_outputs(tmp_path, monkeypatch):
    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    run = _workdirs(tmp_path, monkeypatch, {"a": trained})["a"]
    common = dict(source_file=str(tmp_path / "in.txt"), reference_file=str(tmp_path / "ref.txt"), beam_size=3)
    alone = eval_program.run(run, **common)
    twice = eval_program.run(run, ensemble=run, **common)  # no --output_file: <workdir>/output.ensemble.txt
    single, ensemble = tmp_path / "a" / "output.txt", tmp_path / "a" / "output.ensemble.txt"
    assert ensemble.read_text() == single.read_text() and len(single.read_text().splitlines()) == 3
    assert twice["bleu"] == alone["bleu"]
    eval_program.run(run, ensemble=[run], nbest=2, output_file=str(tmp_path / "twice.txt"), **common)
    eval_program.run(run, nbest=2, output_file=str(tmp_path / "alone.txt"), **common)
    pairs = zip(_nbest(tmp_path / "twice.txt").items(), _nbest(tmp_path / "alone.txt").items(), strict=True)
    for (i, entries), (j, expected) in pairs:
        assert i == j and [t for _, t, _ in entries] == [t for _, t, _ in expected]
        np.testing.assert_allclose([s for s, _, _ in entries], [s for s, _, _ in expected], rtol=1e-5)
        for (_, _, got), (_, _, want) in zip(entries, expected):
            np.testing.assert_allclose(got, want, atol=2e-4)  # printed to 4 decimals


@pytest.mark.slow  # two members' programs and each member's scoring: CI runs it, the quick command skips it
def test_two_runs_score_each_token_by_the_log_of_their_mean_probability(tmp_path, monkeypatch):
    config = tiny_runs.translation_config()
    a, b = tiny_runs.in_memory(config), tiny_runs.in_memory(config, seed=1)
    paths = _workdirs(tmp_path, monkeypatch, {"a": a, "b": b})
    eval_program.run(paths["a"], ensemble=paths["b"], source_file=str(tmp_path / "in.txt"),
                     output_file=str(tmp_path / "out.txt"), beam_size=2, nbest=2)
    blocks = _nbest(tmp_path / "out.txt")
    found = lconv.ensemble([Model(a), Model(b)]).translate(SOURCES, beam_size=2, nbest=2)  # for the tokens
    assert sorted(blocks) == [0, 2]
    for index, entries in blocks.items():
        assert [text for _, text, _ in entries] == [e["text"] for e in found[index]]
        for (_, _, token_scores), entry in zip(entries, found[index], strict=True):
            own = [Model(m).score(SOURCES[index], entry["tokens"])["token_scores"] for m in (a, b)]
            assert np.abs(np.subtract(*own)).max() > 0.01  # two members that differ: the mixture is not either one
            expected = np.logaddexp(own[0], own[1]) - math.log(2)  # log((p_a + p_b) / 2), per token
            np.testing.assert_allclose(token_scores, expected, atol=2e-4)  # printed to 4 decimals


@pytest.mark.slow  # decodes a capped test split twice with the shared tiny run
def test_a_splits_ensemble_outputs_are_named_for_it_and_name_its_members(tiny_run, tmp_path):
    workdir = helpers.copy_run(tiny_run, tmp_path / "run")
    stored = json.loads((workdir / "config.json").read_text())
    stored["data"]["max_test_examples"] = 8
    (workdir / "config.json").write_text(json.dumps(stored))
    alone = eval_program.run(str(workdir), split="test")
    hypotheses = (workdir / "test.hyp.txt").read_text()
    twice = eval_program.run(str(workdir), split="test", ensemble=str(workdir))
    assert (workdir / "test.hyp.txt").read_text() == hypotheses  # the run's own outputs stay
    assert (workdir / "test.ensemble.hyp.txt").read_text() == hypotheses and len(hypotheses.splitlines()) == 8
    written = json.loads((workdir / "test.ensemble.scores.json").read_text())
    assert written["ensemble"] == [str(workdir)] * 2 and len(written["ensemble_checkpoints"]) == 2
    assert twice["bleu"] == alone["bleu"] == written["bleu"]


def test_members_that_cannot_decode_together_are_one_line_each_before_anything_loads(tmp_path, monkeypatch,
                                                                                     capsys):
    mt = tiny_runs.in_memory(tiny_runs.translation_config())
    other_tokenizer = tokenizer_lib.train_tokenizer(tiny_runs.sentences(seed=3), 300, num_threads=1)
    runs = {"mt": mt, "lm": tiny_runs.in_memory(tiny_runs.lm_config()),
            "vocab": restore.Trained(tiny_config.get_config(), "x", other_tokenizer, None, None, [0])}
    paths = _workdirs(tmp_path, monkeypatch, runs)
    shutil.rmtree(tmp_path / "empty", ignore_errors=True)
    (tmp_path / "empty").mkdir()

    def never(*args, **kwargs):
        raise AssertionError("a run was loaded before the members were checked")

    monkeypatch.setattr(restore, "load_trained", never)
    for ensemble, named in [(paths["lm"], ["--ensemble[1]", "lm", "translation", "one task"]),
                            (paths["vocab"], ["--ensemble[1]", "another tokenizer"]),
                            (f"{paths['mt']},{tmp_path / 'empty'}", ["--ensemble[2]"]),
                            (f"{paths['mt']},", ["--ensemble", "comma-separated"])]:
        with pytest.raises(UserError) as error:
            eval_program.run(paths["mt"], ensemble=ensemble, source_file=str(tmp_path / "in.txt"),
                             output_file=str(tmp_path / "out.txt"))
        helpers.one_line_error(error, *named)
    code, _, err = helpers.run_cli(capsys, "eval.py", f"--workdir={paths['mt']}", f"--ensemble={paths['lm']}",
                                   "--compilation_cache=none")  # the flag, as eval.py passes it
    assert code == 2 and "--ensemble[1]" in err and "one task" in err


def test_an_lm_with_itself_lowers_no_limit_it_did_not_have(lconv_log):
    """An LM's input limit past its positions is cut to them alone too: an ensemble of it with itself warned that
    its members' minimum lowered it."""
    from lconv.run import ensembles

    lm = tiny_runs.in_memory(tiny_runs.lm_config())
    assert lm.config.data.eval_max_input_length > lm.config.model.max_len
    pair = ensembles.combine([lm, lm], ["--workdir", "--ensemble[1]"])
    assert pair.config.data.eval_max_input_length == lm.config.model.max_len
    assert not [line for line in lconv_log() if "ensemble" in line]
