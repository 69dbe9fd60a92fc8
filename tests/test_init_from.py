"""``train.init_from``: a new run (fresh optimizer, step 0) that starts from another run's params and takes its
tokenizer; a model or vocabulary that does not fit is one line naming the differing fields, before anything is
written."""
import json

import helpers
import jax
import numpy as np
import pytest
import tiny_config

from lconv.errors import UserError
from lconv.run import checkpoints, model_setup, restore, schema
from lconv.train import init_from, loop, setup, update

_ONE_DEVICE = jax.devices("cpu")[:1]


def _from(tiny_run, num_steps=1, **train):
    return tiny_config.training_config(tiny_run.data_dir, num_steps, init_from=str(tiny_run.workdir), **train)


@pytest.mark.slow  # trains in-process
def test_a_run_started_from_another_starts_at_its_params_with_a_new_optimizer(tiny_run, tmp_path):
    config = _from(tiny_run, eval_every=1000)
    config.optim.warmup_init_lr = 0.0  # the first update's learning rate is 0: its params are the starting ones
    workdir = tmp_path / "finetune"
    result = loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
    assert result["step"] == 1 and checkpoints.Checkpointer(workdir).all_steps() == [1]  # a new run: step 0 first
    assert (workdir / "spm.model").read_bytes() == (tiny_run.workdir / "spm.model").read_bytes()
    source, started = restore.load_trained(str(tiny_run.workdir)), restore.load_trained(str(workdir))
    assert source.steps == [6]
    for ours, theirs in zip(jax.tree.leaves(started.params), jax.tree.leaves(source.params), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    first = [json.loads(line) for line in (tiny_run.workdir / "metrics.jsonl").read_text().splitlines()]
    loss = lambda rows, step: next(r["loss"] for r in rows if r["split"] == "train" and r["step"] == step)  # noqa
    assert loss(rows, 1) < loss(first, 1)  # it starts trained, not from a random init
    state, _ = checkpoints.Checkpointer(workdir).restore(checkpoints.abstract_like(_fresh_state(config, workdir)))
    assert int(state.step) == 1 and int(jax.tree.leaves(state.opt_state)[0]) == 1  # Adam's count: one update


def _fresh_state(config, workdir):
    from lconv.data import tokenizer

    config = schema.validate_config(config)
    model = model_setup.build_model(config, tokenizer.load_tokenizer(str(workdir)).vocab_size)
    optimizer, _ = update.build_optimizer(config.optim, config.train.num_steps)
    return setup.create_state(config, model, model_setup.make_mesh(config.mesh, _ONE_DEVICE), optimizer)[0]


def test_a_model_that_does_not_fit_is_one_line_naming_the_fields_before_anything_is_written(tiny_run, tmp_path):
    config = _from(tiny_run)
    config.model.d_model, config.model.ffn_dim = 32, 64
    workdir = tmp_path / "misfit"
    with pytest.raises(UserError) as misfit:
        loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
    message = helpers.one_line_error(misfit, "config.train.init_from=", "config.model.d_model", "config.model.ffn_dim")
    assert "32" in message and "16" in message
    assert not workdir.exists()


def test_fields_that_leave_the_params_alone_may_differ(tiny_run, tmp_path):
    config = _from(tiny_run)
    config.model.dropout, config.model.conv_impl = 0.3, "unfold"
    source = init_from.prepare(schema.validate_config(config), str(tmp_path / "new"))
    assert source.workdir == str(tiny_run.workdir)


@pytest.mark.parametrize("change, named", [
    (lambda c: c.data.update(vocab_size=600), ["config.data.vocab_size", "512"]),
    (lambda c: c.update(task="summarization"), ["config.task", "'translation'"]),
])
def test_another_vocabulary_or_task_is_one_line(tiny_run, tmp_path, change, named):
    config = _from(tiny_run)
    change(config)
    with pytest.raises(UserError) as error:
        init_from.prepare(schema.validate_config(config), str(tmp_path / "new"))
    helpers.one_line_error(error, "config.train.init_from=", *named)


def test_a_source_that_is_not_a_run_is_one_line(tmp_path):
    config = tiny_config.training_config(tmp_path, 1, init_from=str(tmp_path / "nowhere"))
    with pytest.raises(UserError) as error:
        init_from.prepare(schema.validate_config(config), str(tmp_path / "new"))
    helpers.one_line_error(error, f"config.train.init_from={tmp_path / 'nowhere'}")


def test_a_resumed_run_restores_its_own_checkpoint_not_the_source(tiny_run):
    config = _from(tiny_run)
    # the workdir has checkpoints of its own
    assert init_from.prepare(schema.validate_config(config), str(tiny_run.workdir)) is None


def test_a_source_whose_step_metadata_is_nested_too_deep_is_one_line_before_anything_is_written(tiny_run, tmp_path):
    """A source run whose latest step's _CHECKPOINT_METADATA is nested 100,000 deep: orbax's RecursionError was an
    80-line traceback after the new workdir got its config, tokenizer, data report and lock (round-9 campaign)."""
    from lconv.run import integrity

    source = helpers.copy_run(tiny_run, tmp_path / "source")
    step = max((source / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    (step / integrity.MANIFEST_FILENAME).unlink()
    (step / integrity.STEP_METADATA_FILENAME).write_text("[" * 100_000 + "]" * 100_000)
    config = tiny_config.training_config(tiny_run.data_dir, 1, init_from=str(source))
    workdir = tmp_path / "new"
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
    helpers.one_line_error(error, str(step), integrity.STEP_METADATA_FILENAME, "nested deeper")
    assert not workdir.exists()


@pytest.mark.parametrize("plant", ["link_out", "pipe"])
def test_the_sources_tokenizer_is_read_only_as_a_regular_file_inside_it(tiny_run, tmp_path, plant):
    """The source's ``spm.model`` was copied with no check: a link out of the source run was read and copied into
    the new workdir, and a pipe hung train.py without a line (round-11 campaign S2)."""
    import os

    source = helpers.copy_run(tiny_run, tmp_path / "source")
    (source / "spm.model").unlink()
    outside = tmp_path / "outside.txt"
    outside.write_text("a file outside the source run")
    if plant == "link_out":
        (source / "spm.model").symlink_to(outside)
    else:
        os.mkfifo(source / "spm.model")
    config = tiny_config.training_config(tiny_run.data_dir, 1, init_from=str(source))
    new = tmp_path / "new"
    new.mkdir()
    with pytest.raises(UserError) as error:
        init_from.prepare(schema.validate_config(config), str(new)).copy_tokenizer(str(new))
    helpers.one_line_error(error, str(source / "spm.model"), "leads out of" if plant == "link_out" else "not a regular")
    assert not (new / "spm.model").exists()
