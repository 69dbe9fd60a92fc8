"""The training loop end to end on the bundled corpus with a tiny model: it learns, checkpoints, and a resumed
run continues with exactly the losses of an uninterrupted one (model, optimizer and data-iterator state)."""
import json
import os
import shutil

import pytest

from configs import default
from lconv import train_lib


def _tiny_config(data_dir, num_steps):
    c = default.get_config()
    c.data.data_dir = str(data_dir)
    c.data.vocab_size = 512
    c.data.tokenizer_max_sentences = 20_000
    c.data.batch_size, c.data.eval_batch_size = 8, 64  # divisible by the 8 test devices
    c.data.max_input_length = c.data.max_target_length = 16
    c.data.eval_max_input_length = c.data.eval_max_target_length = 32
    c.data.read_threads = 1
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 16, 32, 2
    c.model.encoder_layers = c.model.decoder_layers = 1
    c.model.encoder_kernel_sizes = c.model.decoder_kernel_sizes = (3,)
    c.optim.warmup_steps = 2
    c.train.num_steps, c.train.max_minutes = num_steps, 0.0
    c.train.log_every = c.train.checkpoint_every = 1
    c.train.eval_every = 1000
    c.train.eval_after_training = False
    return c


def _train_losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    workdir = root / "full"
    result = train_lib.train_and_evaluate(_tiny_config(root / "tfds", 6), str(workdir), log=lambda *a: None)
    return root, workdir, result


def test_training_runs_and_writes_its_outputs(uninterrupted):
    root, workdir, result = uninterrupted
    assert result["step"] == 6
    for name in ("config.json", "spm.model", "metrics.jsonl", "tensorboard", "checkpoints"):
        assert (workdir / name).exists(), name
    losses = _train_losses(workdir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1]  # it learns something even in six tiny steps
    assert result["validation"]["tokens"] > 1000  # every validation example was scored


def test_resume_continues_exactly(uninterrupted):
    root, workdir, _ = uninterrupted
    resumed = root / "resumed"
    resumed.mkdir()
    shutil.copy(workdir / "spm.model", resumed / "spm.model")  # same vocabulary, no retraining
    train_lib.train_and_evaluate(_tiny_config(root / "tfds", 3), str(resumed), log=lambda *a: None)
    train_lib.train_and_evaluate(_tiny_config(root / "tfds", 6), str(resumed), log=lambda *a: None)
    full, again = _train_losses(workdir), _train_losses(resumed)
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert again[step] == pytest.approx(full[step], rel=1e-6), step


def test_a_checkpoint_that_does_not_fit_the_config_is_a_clear_error(uninterrupted):
    root, workdir, _ = uninterrupted
    other = root / "other"
    shutil.copytree(workdir, other)
    config = _tiny_config(root / "tfds", 7)
    config.model.d_model = 32
    with pytest.raises(ValueError, match="does not fit"):
        train_lib.train_and_evaluate(config, str(other), log=lambda *a: None)
