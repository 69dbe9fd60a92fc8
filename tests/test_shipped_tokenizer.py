"""The tokenizer shipped beside the bundled snapshot: what training gives, used by new workdirs, named by its inputs."""
import os
import re

import pytest

from lconv.data import ddtp, pipeline, tfds_ddtp, tokenizer_files
from lconv.data import tokenizer as tokenizer_lib


def default_data(data_dir, name: str = "default"):
    """The data settings of ``name`` (a config, with its variant after a colon) reading ``data_dir``."""
    import importlib

    module, _, variant = name.partition(":")
    config = importlib.import_module(f"lconv.configs.{module}").get_config(variant or None).data
    config.data_dir = str(data_dir)
    return config


SHIPPED_FOR = ["default", "lm1b:ddtp"]  # the README's default and its bundled LM


def test_every_shipped_tokenizer_is_named_by_the_snapshot_and_training_of_today():
    """A file left behind by an older snapshot or tokenizer training would be dead weight that no config reaches."""
    shipped = [f for f in os.listdir(ddtp.SNAPSHOT_DIR) if f.startswith("tokenizer-")]
    assert shipped, "configs/default.py's tokenizer is shipped (scripts/ship_tokenizer.py)"
    for name in shipped:
        dataset, key, rest = re.fullmatch(r"tokenizer-(ddtp_\w+?)-([0-9a-f]{16})-(.*)\.model", name).groups()
        assert key == tfds_ddtp.bundled_source_key(dataset.replace("_", "/", 1)), name
        assert rest.endswith(f"-t{tokenizer_lib.TRAINING_VERSION}"), name


@pytest.mark.parametrize("name", SHIPPED_FOR)
def test_a_new_workdir_gets_the_shipped_tokenizer_untrained(name, tiny_data, tmp_path, monkeypatch, lconv_log):
    config = default_data(tiny_data.data_dir, name)
    shipped = tokenizer_files.shipped_path(config)
    assert shipped is not None and os.path.dirname(shipped) == ddtp.SNAPSHOT_DIR
    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", lambda *a, **k: pytest.fail("trained a tokenizer"))
    tokenizer = pipeline.load_or_train_tokenizer(config, str(tmp_path / "workdir"))
    with open(shipped, "rb") as f:
        assert tokenizer.to_bytes() == f.read() == (tmp_path / "workdir" / "spm.model").read_bytes()
    assert tokenizer.vocab_size == config.vocab_size
    assert lconv_log() == [f"tokenizer: {shipped} (shipped with lconv: what training on the bundled corpus with "
                           "these settings gives)"]
    assert not os.path.exists(tokenizer_files.kept_dir(config))  # the shipped file is the copy kept


@pytest.mark.parametrize("change", [dict(vocab_size=3000), dict(tokenizer_max_sentences=10_000),
                                    dict(dataset="ddtp/en_fr"), dict(dataset="iwslt14/de_en"),
                                    dict(raw_dir="/elsewhere")])
def test_other_data_or_settings_have_no_shipped_tokenizer(change):
    config = default_data("/unused")
    config.update(change)
    assert tokenizer_files.shipped_path(config) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED_FOR)
def test_the_shipped_tokenizer_is_what_training_gives(name, tiny_data, tmp_path, monkeypatch):
    """Trained again from the prepared corpus as a run would train it (the LM's corpus prepared first), byte for
    byte."""
    config = default_data(tiny_data.data_dir, name)
    trainings, train = [], tokenizer_lib.train_tokenizer
    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", lambda *a, **k: trainings.append(1) or train(*a, **k))
    trained = pipeline.load_or_train_tokenizer(config, str(tmp_path), save=False)
    assert trainings == [1]  # trained, not the shipped file read back
    import sentencepiece
    import tensorflow_datasets as tfds

    with open(tokenizer_files.shipped_path(config), "rb") as f:
        assert trained.to_bytes() == f.read(), (
            f"training here (sentencepiece {sentencepiece.__version__}, tensorflow-datasets {tfds.__version__}; it "
            "was made with 0.2.3 and 4.9.10) gives another model than the shipped one: if the code or the snapshot "
            "changed, run scripts/ship_tokenizer.py; if a package did, decide which model the default should have")
