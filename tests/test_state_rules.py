"""The mixer contract's state rules, enforced where a run starts (issue 56): before any data, the model's stateful
mixers are traced on the run's own dummy batch, and a collection init does not make, a leaf that changes shape
from one window to the next (it recompiled every window) or a ``reset_state`` that fails is one line naming the
mixer and the rule, not a 47-119-line traceback or a 469 s evaluation."""
from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import pytest
import tiny_config
import toy_mixers

from lconv.errors import UserError
from lconv.nn import mixers
from lconv.run import model_setup, schema


class _Stateful(toy_mixers.PrefixMean):
    """An identity mixer keeping one ``'carried'`` leaf of ``[B, width]``; ``grows`` widens it each window."""

    state: ClassVar[tuple[str, ...]] = ("carried",)
    grows: ClassVar[bool] = False
    makes: ClassVar[bool] = True

    @nn.compact
    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        if self.makes and (self.has_variable("carried", "h") or self.is_mutable_collection("carried")):
            h = self.variable("carried", "h", jnp.zeros, (x_BTC.shape[0], 2), jnp.float32)
            if self.grows and self.is_mutable_collection("carried") and not self.is_initializing():
                h.value = jnp.concatenate([h.value, h.value[:, :1]], axis=1)
        return x_BTC


class Growing(_Stateful):
    grows = True


class NeverMade(_Stateful):
    makes = False


class BrokenReset(_Stateful):
    reset_state = staticmethod(lambda tree, reset_B: tree["no_such_leaf"])


class Kept(_Stateful):
    """Keeps its shapes: passes."""


def _initial_state(name, monkeypatch):
    monkeypatch.setitem(mixers._MIXERS, name.lower(), {"Growing": Growing, "NeverMade": NeverMade,
                                                       "BrokenReset": BrokenReset, "Kept": Kept}[name])
    config = tiny_config.training_config("unused")
    config.task, config.data.dataset, config.data.stream = "lm", "ddtp/lm_en", True
    config.model.encoder_layers, config.model.decoder_mixer = 0, name.lower()
    config = schema.validate_config(config)
    model = model_setup.build_model(config, config.data.vocab_size)
    return model_setup.init_mixer_state(config, model, 3)


@pytest.mark.parametrize("name, rule, named", [("Growing", "rule state", "[3, 2] to float32[3, 3]"),
                                               ("NeverMade", "rule state", "init made no"),
                                               ("BrokenReset", "rule reset", "KeyError")])
def test_a_state_rule_broken_is_one_line_naming_the_mixer_before_any_data(name, rule, named, monkeypatch):
    with pytest.raises(UserError) as error:
        _initial_state(name, monkeypatch)
    helpers.one_line_error(error, f"mixer {name.lower()!r}", "'carried'", rule, named)


def test_a_mixer_that_keeps_the_rules_starts_its_stream(monkeypatch):
    state = _initial_state("Kept", monkeypatch)
    assert list(state.collections) == ["carried"]
    assert [leaf.shape for leaf in jax.tree.leaves(state.collections)] == [(3, 2)]


def test_train_py_checks_the_state_rules_before_any_data_is_prepared(monkeypatch, tmp_path):
    """The rules ran only once the data was prepared (minutes on a real corpus): now in ``check_config``, on the
    dummy batch, before the tokenizer or any dataset is touched."""
    from lconv.data import pipeline
    from lconv.train import setup

    monkeypatch.setitem(mixers._MIXERS, "growing", Growing)
    monkeypatch.setattr(pipeline, "load_or_train_tokenizer", lambda *a, **k: pytest.fail("data prepared first"))
    monkeypatch.setattr(pipeline, "make_datasets", lambda *a, **k: pytest.fail("data prepared first"))
    config = tiny_config.training_config(str(tmp_path / "no_data"))
    config.task, config.data.dataset, config.data.stream = "lm", "ddtp/lm_en", True
    config.model.encoder_layers, config.model.decoder_mixer = 0, "growing"
    with pytest.raises(UserError) as error:
        setup.build_run(config, str(tmp_path / "run"), jax.devices("cpu")[:1])
    helpers.one_line_error(error, "mixer 'growing'", "'carried'", "rule state")
    assert not (tmp_path / "run").exists()
