"""Planning the study (``lconv.study.plan``) and judging its comparison (``lconv.study.verdicts``), without training:
parameter counts matched within the tolerance in every mode, study fields refused in one line, and the comparison
with the paper written from the numbers. tests/test_study.py runs the quick study itself."""
import helpers
import ml_collections
import pytest

from lconv.configs import study as study_config
from lconv.errors import UserError
from lconv.study import plan, verdicts


@pytest.mark.slow  # a sweep of every mixer's models: CI runs it, the quick command skips it
def test_param_matching_lands_within_the_tolerance():
    """Every mixer's FFN width found by the search gives a count within 5% of the Transformer's (at the quick
    sizes CoLT5's routers and light heads cost FFN width, LightConv's ~3 d^2 per layer instead of 4 d^2 buys some)."""
    study = plan.normalize(study_config.get_config("quick"))
    study.tasks = ("translation",)
    runs = plan.plan(study, {"translation": 512})
    by_mixer = {r.key.mixer: r for r in runs}
    reference = by_mixer["transformer"].params
    for mixer, run in by_mixer.items():
        assert run.error is None, (mixer, run.error)
        assert abs(run.params / reference - 1) <= 0.05, mixer
        assert run.params == plan.count_params(run.config, 512, length=None)  # at the training lengths too
    assert by_mixer["colt5"].config.model.ffn_dim < by_mixer["transformer"].config.model.ffn_dim
    assert by_mixer["lightconv"].config.model.ffn_dim > by_mixer["transformer"].config.model.ffn_dim


@pytest.mark.slow  # traces about 60 deep models (the gpu mode's alone ~20 s): CI runs it, the quick command skips it
@pytest.mark.parametrize("mode", ["full", "gpu"])
def test_every_mixer_fits_every_task_of_the_long_modes(mode):
    """The modes nobody runs in the suite still plan: each mixer's count is matched on each task at that mode's
    sizes (Fixed and Hadamard's [max_len, max_len] tables can outweigh every FFN width if max_len is too long)."""
    study = plan.normalize(study_config.get_config(mode))
    study.seeds = (0,)
    vocab = {task: plan.training_config(study, plan.RunKey(task, "transformer", 0)).data.vocab_size
             for task in plan.TASKS}
    for run in plan.plan(study, vocab):
        assert run.error is None, (run.key.name, run.error)
        if run.not_applicable is None:
            assert abs(run.params / run.reference_params - 1) <= study.param_tolerance, run.key.name


def test_bad_study_fields_are_one_line_errors():
    study = plan.normalize(study_config.get_config("quick"))
    study.mixers = ("transformer", "mamba")
    with pytest.raises(UserError, match=r"config.mixers.*'mamba'"):
        plan.check_study(study)
    fields = study_config.get_config("quick").to_dict()
    fields["seeds"] = "0,x"
    with pytest.raises(UserError, match="config.seeds="):
        plan.normalize(ml_collections.ConfigDict(fields))
    with pytest.raises(UserError, match="choose one study mode"):
        study_config.get_config("quick,gpu")


def test_a_mixer_named_twice_is_refused_and_a_module_class_word_parses():
    """One mixer twice (by a word and its registered name) would report n=2 from one seed; docs/models.md's
    ``--config.mixers=transformer,my_mixers:GatedMean`` reaches ml_collections as a tuple it can parse."""
    study = plan.normalize(study_config.get_config("quick"))
    for twice in (("transformer", "dynamic", "dynamicconv"), ("toy_mixers:PrefixMean",) * 2):
        study.mixers = twice
        with pytest.raises(UserError) as error:
            plan.check_study(study)
        helpers.one_line_error(error, "config.mixers", "twice")
    quoted = plan.quote_word_lists(["study", "--config.mixers=transformer,toy_mixers:PrefixMean", "--config.seeds=0"])
    assert quoted == ["study", "--config.mixers=('transformer', 'toy_mixers:PrefixMean')", "--config.seeds=0"]


def test_an_lm_generation_longer_than_the_lms_positions_is_refused_before_any_run():
    study = plan.normalize(study_config.get_config("quick"))
    study.tasks, study.mixers = ("lm",), ("fixed",)
    limit = plan.training_config(study, plan.RunKey("lm", "fixed", 0)).model.max_len
    study.lm_generate_tokens = limit  # fits: BOS and the first limit - 1 tokens are fed
    assert [run.error for run in plan.plan(study, {"lm": 512})] == [None]
    study.lm_generate_tokens = limit + 1
    with pytest.raises(UserError, match=rf"config.lm_generate_tokens={limit + 1}: .* at most {limit}$"):
        plan.plan(study, {"lm": 512})



def _translation_row(mixer, bleus):
    row = {"task": "translation", "mixer": mixer, "label": plan.label(mixer), "ok": len(bleus)}
    row["bleu"], row["bleu_sd"], _ = verdicts.mean_sd(bleus)
    return row


def test_the_comparison_with_the_paper_is_written_from_the_numbers():
    rows = [_translation_row("transformer", [10.0, 10.4, 10.2]), _translation_row("lightconv", [10.3, 10.7, 10.0]),
            _translation_row("dynamic", [12.0, 12.3, 12.1])]
    lines = {line.split(". Here")[0]: line for line in verdicts.compare_with_paper(rows)}
    assert "exceeds the seed spread: at this scale the data agree" in lines[
        "- IWSLT14 De-En: Transformer 34.4 < DynamicConv 35.2"]
    assert "within the seed spread: consistent with the paper, not evidence" in lines[
        "- IWSLT14 De-En: Transformer 34.4 < LightConv 34.8"]
    rows[2] = _translation_row("dynamic", [8.0, 8.2, 8.1])  # DynamicConv now clearly behind
    reversed_line = [line for line in verdicts.compare_with_paper(rows) if "WMT14" in line][0]
    assert "the opposite order" in reversed_line and "the paper's ordering does not hold" in reversed_line
    one_seed = verdicts.compare_with_paper([_translation_row("transformer", [10.0]),
                                            _translation_row("dynamic", [11.0])])
    assert "fewer than two seeds" in one_seed[1]
    expected = "LightConv (10.33) ≈ Transformer (10.20) > DynamicConv (8.10)"
    assert verdicts.ordering(rows, "translation").startswith(expected)
    level = verdicts.compare_with_paper([_translation_row("transformer", [10.0, 11.0, 12.0]),
                                         _translation_row("dynamic", [12.0, 10.0, 11.0])])
    assert level[-1].endswith("equal means: no order either way.")  # not "the opposite order (-0.00 ...)"


def _row(task, mixer, values):
    key = verdicts.METRICS[task][0][0]
    row = {"task": task, "mixer": mixer, "label": plan.label(mixer), "ok": len(values)}
    row[key], row[f"{key}_sd"], _ = verdicts.mean_sd(values)
    return row


def test_each_mixer_is_judged_against_the_reference_and_the_leader_beyond_its_neighbours():
    """The ordering's chain marks neighbours only, and its within-the-spread mark does not chain: A and B within
    the spread, B and C too, may leave A and C beyond it. Each mixer against the reference and the leader against
    every other one are judged pair by pair; with fewer than two seeds nothing is judged, and lower perplexity is
    ahead."""
    a, b, c = (_row("translation", m, v) for m, v in (("dynamic", [9.9, 10.2, 10.5]),
                                                      ("lightconv", [9.5, 9.8, 10.1]),
                                                      ("transformer", [9.1, 9.4, 9.7])))
    rows = [c, a, b]
    assert verdicts.ordering(rows, "translation") == "DynamicConv (10.20) ≈ LightConv (9.80) ≈ Transformer (9.40)"
    assert verdicts.resolved(c, a, "bleu")  # 0.8 apart, sds 0.3 each
    assert verdicts.versus_reference(rows, "translation", "transformer") == (
        "Against Transformer (9.40 ± 0.30, n 3): ahead beyond the spread: DynamicConv (+0.80); within the spread: "
        "LightConv (+0.40)")
    assert verdicts.leader(rows, "translation") == "DynamicConv is first, but within the spread of LightConv"
    b["bleu"] = 8.6  # now behind the reference, beyond the spread
    assert verdicts.versus_reference(rows, "translation", "transformer").endswith(
        "ahead beyond the spread: DynamicConv (+0.80); behind beyond the spread: LightConv (-0.80)")
    assert verdicts.leader(rows, "translation") == "DynamicConv is first, beyond the spread of every other mixer"

    lm = [_row("lm", "transformer", [120.0, 121.0, 122.0]), _row("lm", "dynamic", [100.0, 101.0, 102.0]),
          _row("lm", "fixed", [140.0])]
    assert verdicts.ordering(lm, "lm") == "DynamicConv (101.00) > Transformer (121.00) ? Fixed (Synthesizer-R) (140.00)"
    assert verdicts.versus_reference(lm, "lm", "transformer") == (
        "Against Transformer (121.00 ± 1.00, n 3): ahead beyond the spread: DynamicConv (-20.00); fewer than two "
        "seeds, no spread to judge by: Fixed (Synthesizer-R) (+19.00)")
    assert "its lead is not yet judged" in verdicts.leader(lm, "lm")
    lm[2] = _row("lm", "fixed", [100.5, 101.5, 102.5])  # a label holding " (": named whole
    assert verdicts.leader(lm, "lm") == "DynamicConv is first, but within the spread of Fixed (Synthesizer-R)"
    lm[0]["ok"] = 0  # the reference unfinished
    assert verdicts.versus_reference(lm, "lm", "transformer").endswith("has no finished run: nothing to set the "
                                                                        "others against")


def test_a_second_sigterm_while_the_study_stops_its_run_is_ignored():
    """The first SIGTERM stops the study (passed on to its run); a second one during that stop raised again
    inside the handler: two tracebacks instead of the study's one line (issue 41)."""
    import os
    import signal
    import time

    from lconv.study import run

    first = second = False
    with run._sigterm_raises():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at once; the sleep only bounds the wait
        except run._Terminated:
            first = True
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # while stopping
                time.sleep(0.2)
            except run._Terminated:
                second = True
    assert first and not second
