"""``Model.extract_features`` against a manual layer-by-layer pass (the model's own submodules applied one by one
to the unpadded sentence), and ``lconv.load``'s options against a load without them."""
from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import tiny_runs

import lconv
from lconv.api import Model
from lconv.constants import EOS_ID
from lconv.errors import UserError
from lconv.infer import compiled
from lconv.nn import models

SENTENCE = "The small package for images and fonts."


@pytest.fixture(scope="module")
def mt2():
    """A two-layer tiny translation model (pre-norm, so each side ends in a final norm): a state between layers."""
    config = tiny_runs.translation_config()
    config.model.encoder_layers = config.model.decoder_layers = 2
    config.model.encoder_kernel_sizes = config.model.decoder_kernel_sizes = (3, 5)
    return Model(tiny_runs.in_memory(config))


def _by_hand(model: Model, side: str, x_1TC, segments_1T, **cross) -> list[np.ndarray]:
    """``side``'s states from ``x`` (what its first layer reads): each ``models.Layer`` applied to the last, with
    its params, then the final norm when the side has one."""
    cfg, params = model.module.config, model.params[side]
    states = [x_1TC]
    for i, mixer in enumerate(cfg.layer_mixers(side)):
        layer = models.Layer(cfg, mixer, layer=i, side=side, causal=side == "decoder",
                             cross_attention=bool(cross))
        states.append(layer.apply({"params": params[f"layer_{i}"]}, states[-1], segments_1T, None, True, False,
                                  *cross.values()))
    if "final_norm" in params:
        states[-1] = models._layer_norm(cfg, "final_norm").apply({"params": params["final_norm"]}, states[-1])
    return [np.asarray(x[0]) for x in states]


@pytest.mark.slow  # a translation's search and an eager reference pass: CI runs it, the quick command skips it
def test_features_equal_a_manual_layer_by_layer_pass(mt2):
    target = "Ein kleines Paket."
    got = mt2.extract_features(SENTENCE, target=target)
    source_1S = jnp.asarray([list(mt2.tokenizer.encode(SENTENCE)) + [EOS_ID]], jnp.int32)
    target_ids = list(mt2.tokenizer.encode(target)) + [EOS_ID]
    decoder_input_1T = jnp.asarray([[mt2.module.config.decoder_start_id] + target_ids[:-1]], jnp.int32)
    bound = mt2.module.bind({"params": mt2.params})
    encoder = _by_hand(mt2, "encoder", bound.source_positions(bound.source_embed(source_1S), None, deterministic=True),
                       jnp.ones_like(source_1S))
    embedded_1TC = models._project(bound.project_in, bound.target_embed(decoder_input_1T))
    decoder = _by_hand(mt2, "decoder", bound.target_positions(embedded_1TC, None, deterministic=True),
                       jnp.ones_like(decoder_input_1T), encoded=encoder[-1][None],
                       encoded_segments=jnp.ones_like(source_1S))
    for side, expected in (("encoder", encoder), ("decoder", decoder)):
        assert len(got[side]) == 3 and all(x.dtype == np.float32 for x in got[side])
        for state, by_hand in zip(got[side], expected):
            np.testing.assert_allclose(state, by_hand, rtol=1e-5, atol=1e-5)
    encoded = bound.encode(source_1S)[0]  # the encoder's output as the model returns it: the last state
    np.testing.assert_allclose(got["encoder"][-1], encoded, rtol=1e-5, atol=1e-5)
    assert got["target_tokens"][0] == "<s>" and got["source_tokens"][-1] == "</s>"
    assert len(got["target_tokens"]) == len(target_ids) == got["decoder"][0].shape[0]
    middle = mt2.extract_features(SENTENCE, target=target, layer=1)
    np.testing.assert_array_equal(middle["encoder"], got["encoder"][1])
    np.testing.assert_array_equal(mt2.extract_features(SENTENCE, target=target, layer=-1)["decoder"], got["decoder"][2])
    own = mt2.extract_features(SENTENCE)  # the decoder reads the model's own translation
    assert own["target_tokens"][1:] == [mt2._piece(i) for i in mt2.tokenizer.encode(mt2.translate(SENTENCE))]
    for kwargs, named in [(dict(layer=3), ["layer=3", "-3..2"]), (dict(layer="last"), ["layer='last'"]),
                          (dict(target=b"x"), ["target"])]:
        with pytest.raises(UserError) as error:
            mt2.extract_features(SENTENCE, **kwargs)
        helpers.one_line_error(error, *named)


def test_lm_features_start_from_the_embeddings_and_end_in_the_output(tmp_path):
    lm = Model(tiny_runs.in_memory(tiny_runs.lm_config()))
    got = lm.extract_features(SENTENCE)
    ids = list(lm.tokenizer.encode(SENTENCE)) + [EOS_ID]
    inputs_1T = jnp.asarray([[lm.module.config.decoder_start_id] + ids[:-1]], jnp.int32)
    bound = lm.module.bind({"params": lm.params})
    first = bound.scale_and_position(models._project(bound.project_in, bound.embed(inputs_1T)), None,
                                     deterministic=True)
    expected = _by_hand(lm, "decoder", first, jnp.ones_like(inputs_1T))
    assert set(got) == {"decoder", "target_tokens"} and len(got["decoder"]) == len(expected) == 3
    for state, by_hand in zip(got["decoder"], expected):
        np.testing.assert_allclose(state, by_hand, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# lconv.load's options
# ----------------------------------------------------------------------------------------------------------------
LONG = " ".join(["Library for the X window system, with fonts and files."] * 3)  # > 16 tokens


@pytest.mark.slow  # compiles bfloat16 and ensemble programs: CI runs it, the quick command skips it
def test_load_options_change_the_stored_config_for_this_load_only(tiny_run, lconv_log):
    stored = lconv.load(str(tiny_run.workdir))
    model = lconv.load(str(tiny_run.workdir), dtype="bfloat16", decode_batch_size=2, max_input_length=16)
    assert (model.config.model.dtype, model.config.decode.batch_size, model.config.data.eval_max_input_length) == \
        ("bfloat16", 2, 16) and model.module.config.dtype == jnp.bfloat16
    assert compiled.decode_rows(model.config.infer, "cpu", model.config.data.eval_batch_size, 4) == 2
    assert stored.config.model.dtype == "float32" and stored.config.data.eval_max_input_length == 32
    # bfloat16 compute on float32 params: the float32 model's scores to bfloat16's rounding, but not exactly.
    target = "Ein kleines Werkzeug."
    bf16, f32 = (m.score(SENTENCE, target)["token_scores"] for m in (model, stored))
    np.testing.assert_allclose(bf16, f32, **reference.tolerance("bfloat16", "highest"))
    assert bf16 != f32 and jax.tree.leaves(model.params)[0].dtype == jnp.float32
    model.translate([LONG])
    assert any("cut to 16 tokens" in m and "sources[0] had" in m for m in lconv_log())
    twice = lconv.load([str(tiny_run.workdir)] * 2)  # an ensemble of a run with itself: the run's distributions
    assert len(twice.module.members) == 2 and twice.steps == stored.steps * 2
    np.testing.assert_allclose(twice.score(SENTENCE, target)["token_scores"], f32, rtol=1e-5, atol=1e-6)
    for kwargs, named in [(dict(dtype="float64"), "dtype='float64'"), (dict(decode_batch_size=-1), "decode_batch_size"),
                          (dict(max_input_length=0), "max_input_length=0"),
                          (dict(max_input_length=1), "max_input_length=1"),
                          (dict(max_input_length=10 ** 6), "config.model.max_len"),
                          (dict(devices="cpu"), "devices")]:
        with pytest.raises(UserError) as error:
            lconv.load(str(tiny_run.workdir), **kwargs)
        helpers.one_line_error(error, named)


@pytest.mark.slow  # compiles the search for an 8-device mesh
def test_a_run_loaded_onto_eight_devices_translates_as_on_one(tiny_run):
    one = lconv.load(str(tiny_run.workdir), devices=helpers.cpu_devices(1))
    eight = lconv.load(str(tiny_run.workdir), devices=helpers.cpu_devices(8))
    assert compiled.mesh_of(eight.params).size == 8
    sources = [SENTENCE, LONG, "Fast text editor.", "Fonts.", "A tool.", "Data files.", "Images.", "Python module."]
    assert eight.translate(sources, beam_size=2) == one.translate(sources, beam_size=2)
