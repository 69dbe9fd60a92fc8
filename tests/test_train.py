"""The training loop end to end on the bundled corpus with a tiny model (tests/tiny_config.py): it learns,
checkpoints (the last K and the best by validation), resumes exactly, gives the same losses on 1 and 8 devices,
skips half-written or corrupt checkpoints, stops on a non-finite loss without checkpointing it, and its step
matches the unsplit batch under gradient accumulation and the float32 loss under bfloat16 compute."""
import json
import os

import helpers
import jax
import numpy as np
import pytest
import sacrebleu
import tiny_config

from lconv.data import pipeline, sources
from lconv.infer import compiled
from lconv.run import checkpoints, loss_pass, model_setup, restore, schema
from lconv.train import loop, setup, update

_config = tiny_config.training_config
_ONE_DEVICE = jax.devices("cpu")[:1]  # the shared run's (tests/conftest.py:tiny_run)


def _rows(workdir, split):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def _train_losses(workdir):
    return {r["step"]: r["loss"] for r in _rows(workdir, "train")}




def test_training_runs_and_writes_its_outputs(tiny_run):
    workdir, result = tiny_run.workdir, tiny_run.result
    assert result["step"] == 6
    for name in ("config.json", "spm.model", "metrics.jsonl", "tensorboard", "checkpoints", "best"):
        assert (workdir / name).exists(), name
    losses = _train_losses(workdir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    # It learns something even in six tiny steps: the validation loss (the same examples, no dropout) falls from
    # step 3 to step 6. Training losses are of different batches under dropout: step 6's beat step 1's by 0.04
    # with one draw of the masks and lost by 0.03 with another, while the validation losses moved alike.
    validation = {r["step"]: r["loss"] for r in _rows(workdir, "validation")}
    assert sorted(validation) == [3, 6] and validation[6] < validation[3]
    assert result["validation"]["tokens"] > 1000  # every validation example was scored
    assert sorted(int(d) for d in os.listdir(workdir / "checkpoints")) == [2, 3, 4, 5, 6]  # keep_checkpoints=5
    # Each update's logged rate is the schedule's times the cooldown the tiny config keeps from configs/default.py:
    # with no budget, by the share of num_steps done before the update (update 6: 5/6, so 1/6 / 0.2 of the rate).
    optim = _config(tiny_run.data_dir).optim
    rate = update.step_rate(optim, 6)
    assert optim.cooldown_fraction == 0.2
    for step, row in {r["step"]: r for r in _rows(workdir, "train")}.items():
        cooldown = min(1.0, (1 - (step - 1) / 6) / optim.cooldown_fraction)
        assert row["lr"] == pytest.approx(float(rate(step - 1)) * cooldown, rel=1e-6), step


def test_the_best_checkpoint_is_the_lowest_validation_loss(tiny_run):
    workdir = tiny_run.workdir
    validation = {r["step"]: r["loss"] for r in _rows(workdir, "validation")}
    assert sorted(validation) == [3, 6]  # eval_every=3, and once at the end
    best_step = min(validation, key=validation.get)
    best = checkpoints.Checkpointer(workdir, subdir="best")
    assert best.all_steps() == [best_step]
    assert best.read_data(best_step) == {"step": best_step, "validation_loss": pytest.approx(validation[best_step])}
    best.close()


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_resume_continues_exactly(tiny_run, tiny_data, tmp_path):
    resumed = helpers.new_workdir(tiny_data, tmp_path / "resumed")
    loop.train_and_evaluate(_config(tiny_run.data_dir, 3), str(resumed), devices=_ONE_DEVICE)
    loop.train_and_evaluate(_config(tiny_run.data_dir, 6), str(resumed), devices=_ONE_DEVICE)
    full, again = _train_losses(tiny_run.workdir), _train_losses(resumed)
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert again[step] == pytest.approx(full[step], rel=1e-6), step


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_eight_devices_give_the_losses_of_one(tiny_run, tiny_data, tmp_path):
    eight_devices = helpers.new_workdir(tiny_data, tmp_path / "eight")
    loop.train_and_evaluate(_config(tiny_run.data_dir), str(eight_devices), devices=jax.devices("cpu"))
    eight, one = _train_losses(eight_devices), _train_losses(tiny_run.workdir)
    assert len(jax.devices("cpu")) == 8
    for step in range(1, 7):
        assert one[step] == pytest.approx(eight[step], rel=2e-5), step


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_half_written_and_corrupt_checkpoints_are_skipped(tiny_run, tmp_path, lconv_log):
    damaged = helpers.copy_run(tiny_run, tmp_path / "damaged")
    half = damaged / "checkpoints" / "9.orbax-checkpoint-tmp-1700000000"  # a save killed before its rename
    (half / "state").mkdir(parents=True)
    (half / "state" / "partial").write_bytes(b"\0" * 100)
    for path in (damaged / "checkpoints" / "6").rglob("*"):  # the newest complete one: every file garbage
        if path.is_file():
            path.write_bytes(b"garbage")
    loop.train_and_evaluate(_config(tiny_run.data_dir, 7), str(damaged), devices=_ONE_DEVICE)
    assert any("[6] unreadable" in m and "resuming from step 5" in m for m in lconv_log()), lconv_log()
    assert len(os.listdir(damaged / "checkpoints_unreadable")) == 1  # set aside, not deleted
    rows = [r for r in _rows(damaged, "train") if r["step"] == 6]
    assert rows[-1]["loss"] == pytest.approx(_train_losses(tiny_run.workdir)[6], rel=1e-6)  # redone from step 5
    assert 7 in checkpoints.Checkpointer(damaged).all_steps()


def test_a_checkpoint_that_does_not_fit_the_config_is_a_clear_error(tiny_run, tmp_path):
    other = helpers.copy_run(tiny_run, tmp_path / "other")
    config = _config(tiny_run.data_dir, 7)
    config.model.d_model = 32
    with pytest.raises(ValueError) as changed:
        loop.train_and_evaluate(config, str(other), devices=_ONE_DEVICE)
    helpers.one_line_error(changed, "config.model.d_model: 16 -> 32")
    with pytest.raises(ValueError) as misfit:
        loop.train_and_evaluate(config, str(other), devices=_ONE_DEVICE, accept_config_changes=True)
    assert "(16,)" in helpers.one_line_error(misfit, "params/") and "(32,)" in str(misfit.value)
    assert not (other / "checkpoints_unreadable").exists()  # a config mismatch sets nothing aside
    assert json.loads((other / "config.json").read_text())["model"]["d_model"] == 16  # still the checkpoints' own


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(tiny_run, tiny_data, tmp_path,
                                                                              monkeypatch):
    diverging = helpers.new_workdir(tiny_data, tmp_path / "diverging")
    make_step = update.make_train_step

    def poisoned(config, lr_schedule):  # from the 4th update on, the params and the loss become NaN
        step_fn = make_step(config, lr_schedule)

        def train_step(state, batch, lr_factor):
            new_state, sums = step_fn(state, batch, lr_factor)
            bad = state.step >= 3
            params = jax.tree.map(lambda p: jax.numpy.where(bad, jax.numpy.nan, p), new_state.params)
            sums["loss"] = jax.numpy.where(bad, jax.numpy.nan, sums["loss"])
            return new_state.replace(params=params), sums

        return train_step

    monkeypatch.setattr(update, "make_train_step", poisoned)
    with pytest.raises(FloatingPointError, match="step 4.*step 3"):  # where it stopped, the checkpoint it kept
        loop.train_and_evaluate(_config(tiny_run.data_dir), str(diverging), devices=_ONE_DEVICE)
    ckpt = checkpoints.Checkpointer(diverging)
    assert ckpt.latest_step() == 3
    ckpt.close()


# ----------------------------------------------------------------------------------------------------------------
# The step itself: gradient accumulation and bfloat16 compute
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def step_setup():
    config = tiny_config.get_config()
    config.model.dropout = config.model.weight_dropout = 0.0  # micro-batches would draw other dropout masks
    config.optim.warmup_init_lr = config.optim.learning_rate  # a first update of a visible size
    config.optim.optimizer = "nag"  # updates linear in the gradient (Adam's first step is ~sign(g): noise-prone)
    config = schema.validate_config(config)
    model = model_setup.build_model(config, 512)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    mesh = model_setup.make_mesh(config.mesh)
    state, _ = setup.create_state(config, model, mesh, tx)
    rng = np.random.default_rng(0)
    batch = model_setup.dummy_batch(config, config.data.batch_size)
    for key in ("inputs", "targets"):
        lengths = rng.integers(3, 17, size=8)
        batch[key] = np.where(np.arange(16) < lengths[:, None], rng.integers(4, 512, (8, 16)), 0).astype(np.int32)
        batch[f"{key}_segmentation"] = (batch[key] > 0).astype(np.int32)
    return config, model, tx, lr, mesh, state, batch


def _one_step(config, lr, mesh, state, batch):
    with jax.set_mesh(mesh):
        return jax.jit(update.make_train_step(config, lr))(state, batch)


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_gradient_accumulation_equals_the_unsplit_batch(step_setup):
    config, model, tx, lr, mesh, state, batch = step_setup
    whole, whole_sums = _one_step(config, lr, mesh, state, batch)
    config = config.replace(optim={"grad_accum_steps": 4})
    split, split_sums = _one_step(config, lr, mesh, state, batch)
    assert float(split_sums["tokens"]) == float(whole_sums["tokens"]) == float((batch["targets"] > 0).sum())
    assert float(split_sums["loss"]) == pytest.approx(float(whole_sums["loss"]), rel=1e-5)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), whole.params, state.params))
    assert max(moved) > 1e-4  # the update is not trivially zero
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_bfloat16_compute_keeps_float32_params_and_loss(step_setup):
    config, model, tx, lr, mesh, state, batch = step_setup
    _, f32_sums = _one_step(config, lr, mesh, state, batch)
    config = config.replace(model={"dtype": "bfloat16"})
    bf16_state = state.replace(apply_fn=model_setup.build_model(config, 512).apply)
    new_state, bf16_sums = _one_step(config, lr, mesh, bf16_state, batch)
    assert bf16_sums["loss"].dtype == np.float32
    assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {np.dtype(np.float32)}
    assert float(bf16_sums["loss"]) == pytest.approx(float(f32_sums["loss"]), rel=2e-2)
    assert float(bf16_sums["loss"]) != float(f32_sums["loss"])  # it really computed in bfloat16


@pytest.mark.parametrize("field, value", [
    ("optim.schedule", "linear"),
    ("optim.schedule", "budget"),  # without train.max_minutes it has no end to decay to
    ("optim.warmup_fraction", 1.0),
    ("optim.decay_fraction", 0.0),
    ("optim.cooldown_fraction", 1.5),
    ("optim.grad_accum_steps", 0),
    ("optim.label_smoothing", 1.0),
    ("task", "tagging"),
    ("model.num_heads", 3),
    ("decode.stop", "greedy"),
    ("decode.batch_size", -1),
    ("model.attention_impl", "flash"),
])
def test_bad_config_values_fail_fast_naming_the_field(field, value, tmp_path):
    config = tiny_config.get_config()
    section, _, name = field.rpartition(".")
    (config[section] if section else config)[name] = value
    with pytest.raises(ValueError) as error:
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    helpers.one_line_error(error, f"config.{field}={value!r}")
    assert not (tmp_path / "run").exists()  # failed before writing anything


def test_batch_must_divide_into_devices_times_micro_batches(tmp_path):
    config = tiny_config.get_config()
    config.optim.grad_accum_steps = 3
    with pytest.raises(ValueError) as error:
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    helpers.one_line_error(error, "batch_size=8", "8 ", "grad_accum_steps=3")


# ----------------------------------------------------------------------------------------------------------------
# eval.py's library side: splits, averaging, the best checkpoint, arbitrary text
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_eval_averages_the_last_checkpoints_and_scores_a_split(tiny_run, tmp_path, lconv_log):
    from lconv.cli import eval_program

    workdir = helpers.copy_run(tiny_run, tmp_path / "run")  # eval.py writes its outputs into the workdir
    config = schema.validate_config(_config(tiny_run.data_dir))
    model = model_setup.build_model(config, 512)
    trained = restore.load_trained(str(workdir), average_last=3)
    averaged, chosen = trained.params, trained.steps
    assert chosen == [4, 5, 6]
    ckpt = checkpoints.Checkpointer(workdir)
    template = checkpoints.abstract_like(setup.create_state(
        config, model, model_setup.make_mesh(config.mesh), update.build_optimizer(config.optim, 6)[0])[0])
    each = [jax.tree.leaves(ckpt.restore(template, step)[0].params) for step in chosen]
    ckpt.close()
    for got, *separate in zip(jax.tree.leaves(averaged), *each):
        np.testing.assert_allclose(np.asarray(got), np.mean([np.asarray(x, np.float64) for x in separate], 0),
                                   rtol=1e-6, atol=1e-7)

    scores = eval_program.run(str(workdir), split="validation", average_last=3, beam_size=2)
    assert lconv_log()[0] == "checkpoint(s) [4, 5, 6]"
    size = len(sources.get_source(config.data.dataset, "validation", config.data.data_dir, None)[0])
    assert scores["examples"] == size > 1000 and scores["bleu_signature"].startswith("nrefs:1")
    with open(workdir / "validation.hyp.txt") as f:
        assert len(f.readlines()) == size  # one line per example, in the split's order
    with open(workdir / "validation.scores.json") as f:
        assert json.load(f)["bleu"] == pytest.approx(scores["bleu"])


@pytest.mark.slow  # compiles the loss pass at two widths for many seconds: CI runs it, the quick command skips it
def test_a_packed_loss_pass_scores_what_one_example_per_row_scores(tiny_run):
    """The validation pass packs examples several to a row; no mixer may let one example see another."""
    trained = restore.load_trained(str(tiny_run.workdir))
    # rows with room for several examples
    config = trained.config.replace(data={"eval_max_input_length": 256, "eval_max_target_length": 256})
    validation = pipeline.make_datasets(config.data, trained.tokenizer, process_index=0,
                                        process_count=1).eval_sets["validation"]
    mesh = compiled.mesh_of(trained.params)  # the mesh load_trained put the params on
    eval_step = loss_pass.jit_eval_step(config, mesh)
    packed = loss_pass.evaluate_loss(eval_step, trained.params, trained.model.apply, validation, mesh)
    padded = loss_pass.evaluate_loss(eval_step, trained.params, trained.model.apply, list(validation), mesh)
    assert len(validation.packed()) < len(validation) / 2
    assert packed["tokens"] == padded["tokens"] > 10_000
    for key in ("loss", "nll", "accuracy"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5), key


def test_eval_translates_a_text_file_and_scores_it(tiny_run, tmp_path, lconv_log):
    from lconv.cli import eval_program

    workdir = tiny_run.workdir  # every output goes to tmp_path
    sources = ["This package contains the documentation.", "", "A library for parsing XML files in C."]
    (tmp_path / "in.en").write_text("\n".join(sources) + "\n")
    out = tmp_path / "out.de"
    scores = eval_program.run(str(workdir), checkpoint="best", source_file=str(tmp_path / "in.en"),
                              output_file=str(out), beam_size=2)
    best_step = checkpoints.Checkpointer(workdir, subdir="best").all_steps()
    assert lconv_log()[0] == f"checkpoint(s) {best_step}"
    hypotheses = out.read_text().split("\n")[:-1]
    assert len(hypotheses) == 3 and hypotheses[1] == ""  # a blank line stays blank, in place
    assert scores["examples"] == 3 and scores["blank_sources"] == 1 and scores["truncated_sources"] == 0
    # With references, the scores are sacreBLEU's own on the hypotheses and references, row by row.
    references = ["Dieses Paket enthält die Dokumentation.", "", "Eine Bibliothek zum Parsen von XML-Dateien."]
    (tmp_path / "ref.de").write_text("\n".join(references) + "\n")
    scores = eval_program.run(str(workdir), checkpoint="best", source_file=str(tmp_path / "in.en"),
                          reference_file=str(tmp_path / "ref.de"), output_file=str(tmp_path / "again.de"),
                          beam_size=2)
    assert (tmp_path / "again.de").read_text() == out.read_text()  # decoding is deterministic
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    (tmp_path / "short.de").write_text("one line\n")
    with pytest.raises(ValueError) as error:
        eval_program.run(str(workdir), source_file=str(tmp_path / "in.en"), reference_file=str(tmp_path / "short.de"))
    helpers.one_line_error(error, "--reference_file", "1 lines", "3 source lines")
    with pytest.raises(ValueError) as error:
        eval_program.run(str(workdir), checkpoint="best", average_last=2)
    helpers.one_line_error(error, "--checkpoint=best", "--average_last")


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_eval_scores_a_language_model_by_perplexity(tiny_data, tmp_path):
    from lconv.cli import eval_program

    config = _config(tiny_data.data_dir, num_steps=2, eval_every=1000)
    config.task, config.data.dataset = "lm", "ddtp/lm_en"
    config.model.encoder_layers = 0
    workdir = helpers.new_workdir(tiny_data, tmp_path / "lm")  # the shared joint tokenizer reads English too
    result = loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
    scores = eval_program.run(str(workdir), split="validation")
    # The same params on the same split: eval.py's perplexity is the one train.py logged at the end.
    assert scores["tokens"] == result["validation"]["tokens"] > 1000
    assert scores["ppl"] == pytest.approx(result["validation"]["ppl"], rel=1e-5)
    with open(workdir / "validation.scores.json") as f:
        assert json.load(f)["ppl"] == pytest.approx(scores["ppl"])
    assert "word_ppl" not in scores  # validation texts are cut to 32 tokens here: their NLL is not the texts'
    with pytest.raises(ValueError) as error:
        eval_program.run(str(workdir), source_file=str(workdir / "config.json"), reference_file=str(workdir / "x"))
    helpers.one_line_error(error, "--reference_file", "lm run")


def test_each_process_gets_its_own_data_position_back():
    item = checkpoints.gather_process_states({"position": 7})
    assert item == {"process_count": 1, "processes": [{"position": 7}]}
    assert checkpoints.this_process_state(item) == {"position": 7}
    with pytest.raises(ValueError, match="written by 2 processes, this run has 1"):
        checkpoints.this_process_state({"process_count": 2, "processes": [{}, {}]}, "ckpt/6")
    with pytest.raises(ValueError, match="no per-process data-iterator state"):
        checkpoints.this_process_state({"position": 7}, "ckpt/6")


def test_a_data_position_the_iterator_cannot_take_is_one_line_naming_the_checkpoint():
    """A checkpoint without a manifest whose ``data/metadata`` says ``"next_index": "16"``: grain's TypeError
    traceback becomes one line naming the checkpoint; a good state is set as it is."""
    import grain

    from lconv.errors import UserError

    iterator = iter(grain.MapDataset.range(40).to_iter_dataset())
    next(iterator)
    good = checkpoints.gather_process_states(iterator.get_state())
    next(iterator)
    checkpoints.restore_iterator(iterator, good, "ckpt/6")
    assert next(iterator) == 1
    bad = checkpoints.gather_process_states({**iterator.get_state(), "next_index": "16"})
    with pytest.raises(UserError, match=r"checkpoint ckpt/6: its data-iterator state is unreadable \(TypeError"):
        checkpoints.restore_iterator(iterator, bad, "ckpt/6")
