"""The fairseq importer (``python -m lconv.import_fairseq``) against fairseq's own outputs.

The references are fairseq's, never lconv's: two models trained by fairseq 0.12.2 (a DynamicConv ``lightconv``
model and a Transformer), their teacher-forced log-probabilities, fairseq-generate's beam-search translations and
scores of 200 test sentences, and their sacreBLEU (tests/fixtures/fairseq/README.md). The ids are checked against
fairseq's rule applied by hand: SentencePiece pieces looked up in ``dict.txt``.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import fairseq_reference
import helpers
import jax
import numpy as np
import pytest
import sacrebleu
import sentencepiece as spm
import tiny_runs
from reference import tolerance

from lconv.errors import UserError
from lconv.interop import fairseq, fairseq_vocab, fairseq_workdir

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "fairseq"
MODELS = ("dynamic", "transformer")
# fairseq-generate's settings for generate.txt
GENERATE = {"beam_size": 4, "lenpen": 1.0, "max_len_a": 1.2, "max_len_b": 10}


def _lines(path: pathlib.Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="session")
def workdirs(tmp_path_factory):
    """Each model imported once, through the function (the command line: test_the_command_line_imports_alike)."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name in MODELS:
        out[name] = str(root / name)
        args = _import_args(name, out[name])
        fairseq_workdir.import_checkpoint(args["checkpoint"], args["dict"], args["spm"], args["workdir"],
                                          decode=GENERATE)
    return out


def _import_args(name, workdir):
    return dict(checkpoint=str(FIXTURES / name / "checkpoint_last.pt"), dict=str(FIXTURES / "dict.txt"),
                spm=str(FIXTURES / "spm.model"), workdir=workdir)


@pytest.mark.slow  # launches python -m lconv.import_fairseq: the slow tier
def test_the_command_line_imports_alike(workdirs, tmp_path):
    """``python -m lconv.import_fairseq`` writes the workdir the function writes (config, tokenizer, checkpoint)."""
    workdir = tmp_path / "dynamic"
    flags = [f"--{k}={v}" for k, v in {**_import_args("dynamic", str(workdir)), **GENERATE}.items()]
    done = subprocess.run([sys.executable, "-m", "lconv.import_fairseq", *flags], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "imported lightconv (220,416 parameters, 1500 updates)" in done.stdout
    function = pathlib.Path(workdirs["dynamic"])
    assert json.loads((workdir / "config.json").read_text()) == json.loads((function / "config.json").read_text())
    assert (workdir / "spm.model").read_bytes() == (function / "spm.model").read_bytes()
    assert sorted(p.name for p in workdir.iterdir()) == sorted(p.name for p in function.iterdir())
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1500"]


def test_text_becomes_fairseqs_ids():
    """fairseq's rule by hand (SentencePiece pieces as strings, looked up in dict.txt, ids from 4; EOS 2 last),
    against the imported tokenizer on all 200 sources, and against fairseq's own batch of the first 8."""
    vocab = fairseq_vocab.build_vocabulary(str(FIXTURES / "dict.txt"), str(FIXTURES / "spm.model"))
    assert (vocab.size, vocab.pieces_not_in_dictionary) == (1008, 0)
    pieces = spm.SentencePieceProcessor(model_file=str(FIXTURES / "spm.model"))
    symbols = {s: i + 4 for i, s in enumerate(line.split(" ")[0] for line in _lines(FIXTURES / "dict.txt"))}
    sources = _lines(FIXTURES / "test.src")
    for source in sources:
        by_hand = [symbols.get(p, 3) for p in pieces.encode(source, out_type=str)]
        assert vocab.tokenizer.encode(source).tolist() == by_hand, source  # ids >= 4 are the same in both
        assert vocab.tokenizer.detokenize(vocab.tokenizer.encode(source)) == " ".join(source.split())
    golden = np.load(FIXTURES / "dynamic" / "golden_lprobs.npz")
    for row, source in zip(golden["src_tokens"], sources):
        assert row[row != 1].tolist() == vocab.tokenizer.encode(source).tolist() + [2]


def _to_lconv(ids: np.ndarray) -> np.ndarray:
    out = ids.copy()
    for fairseq_id, lconv_id in fairseq_vocab.FAIRSEQ_TO_LCONV.items():
        out[ids == fairseq_id] = lconv_id
    return out


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
@pytest.mark.parametrize("name", MODELS)
def test_imported_log_probabilities_equal_fairseqs(workdirs, name):
    """Teacher-forced log-probabilities of every vocabulary entry at every target position of fairseq's batch
    (left-padded sources, right-padded targets; lconv's inputs are right-padded) equal fairseq's in float32."""
    import lconv

    model = lconv.load(workdirs[name])
    assert model.module.config.matmul_precision == "highest"  # float32 as fairseq's PyTorch, on every backend
    golden = np.load(FIXTURES / name / "golden_lprobs.npz")
    rows = [_to_lconv(r[r != 1]) for r in golden["src_tokens"]]
    inputs = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        inputs[i, :len(r)] = r
    targets = np.where(golden["target"] == 1, 0, _to_lconv(golden["target"])).astype(np.int32)
    logits = model.module.apply({"params": model.params}, inputs, targets,
                                inputs_segmentation=(inputs != 0).astype(np.int32),
                                targets_segmentation=(targets != 0).astype(np.int32))
    lprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    columns = np.array([fairseq_vocab.FAIRSEQ_TO_LCONV.get(i, i) for i in range(lprobs.shape[-1])])
    real = golden["target"] != 1
    np.testing.assert_allclose(lprobs[..., columns][real], golden["lprobs"][real],
                               **tolerance(np.float32, "highest", rtol=1e-5, atol=2e-5))


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
@pytest.mark.parametrize("name", MODELS)
def test_beam_search_reproduces_fairseq_generate(workdirs, name):
    """eval.py on the imported workdir with fairseq's stopping rule, beam 4: every translation of the 200
    sentences is fairseq's (or, where one differs, the two hypotheses' scores tie), and sacreBLEU is fairseq's."""
    from lconv.cli import eval_program

    output = pathlib.Path(workdirs[name]) / "generate.txt"
    result = eval_program.run(workdirs[name], source_file=str(FIXTURES / "test.src"),
                          reference_file=str(FIXTURES / "test.ref"), output_file=str(output))
    ours, theirs = _lines(output), _lines(FIXTURES / name / "generate.txt")
    differing = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert len(ours) == len(theirs) == 200
    assert not differing, [(i, ours[i], theirs[i]) for i in differing[:3]]
    bleu = float(_lines(FIXTURES / name / "bleu.txt")[0].split(" = ")[1].split(" ")[0])
    assert abs(result["bleu"] - bleu) <= 0.1, (result["bleu"], bleu)
    assert sacrebleu.corpus_bleu(ours, [_lines(FIXTURES / "test.ref")]).score == pytest.approx(result["bleu"])


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_nbest_scores_are_fairseq_generates_and_score_gives_them_back(workdirs):
    """``translate(..., nbest=1)``'s score of each of the first 8 test sentences is the one fairseq-generate
    printed (base 2 there: ln-score / ln 2), and ``score`` of the same pair, teacher-forced, adds up to it."""
    import lconv

    model = lconv.load(workdirs["dynamic"])
    sources = _lines(FIXTURES / "test.src")[:8]
    theirs = [float(line) * math.log(2) for line in _lines(FIXTURES / "dynamic" / "generate_scores.txt")[:8]]
    best = [entries[0] for entries in model.translate(sources, nbest=1)]
    assert [entry["text"] for entry in best] == _lines(FIXTURES / "dynamic" / "generate.txt")[:8]
    np.testing.assert_allclose([entry["score"] for entry in best], theirs, rtol=1e-5)
    scored = model.score(sources, [entry["tokens"] for entry in best])
    np.testing.assert_allclose([s["score"] / len(e["tokens"]) for s, e in zip(scored, best)], theirs, rtol=1e-5)


@pytest.fixture(scope="module")
def dynamic_checkpoint():
    return fairseq.read_checkpoint(str(FIXTURES / "dynamic" / "checkpoint_last.pt"))


def test_settings_lconv_lacks_are_one_line_naming_each(dynamic_checkpoint):
    _, args, updates = dynamic_checkpoint
    assert updates == 1500 and args["arch"] == "lightconv"
    changed = {**args, "decoder_embed_dim": 128, "decoder_conv_type": "separable",
               "adaptive_softmax_cutoff": "1000,5000"}
    with pytest.raises(UserError) as err:
        fairseq.model_fields(changed, 1008)
    message = str(err.value)
    assert "\n" not in message
    for named in ("decoder_embed_dim=128", "decoder_conv_type='separable'", "adaptive_softmax_cutoff"):
        assert named in message
    transformer = {**args, "arch": "transformer", "activation_fn": "swish", "cross_self_attention": True,
                   "quant_noise_pq": 0.1}
    with pytest.raises(UserError) as err:
        fairseq.model_fields(transformer, 1008)
    for named in ("activation_fn='swish'", "cross_self_attention=True", "quant_noise_pq=0.1"):
        assert named in str(err.value) and "\n" not in str(err.value)
    # sinusoidal positions: different source and target limits only bound lengths (learned tables must agree)
    assert fairseq.model_fields({**args, "max_target_positions": 512}, 1008)["max_len"] == 1024
    with pytest.raises(UserError, match="max_source_positions=1024.*max_target_positions=512"):
        fairseq.model_fields({**args, "max_target_positions": 512, "encoder_learned_pos": True,
                              "decoder_learned_pos": True}, 1008)
    with pytest.raises(UserError, match="'fconv' is not importable"):
        fairseq.model_fields({**args, "arch": "fconv"}, 1008)
    # language models have their own importer (tests/test_fairseq_lm_import.py)
    with pytest.raises(UserError, match="'lightconv_lm' is a language model: import it with"):
        fairseq.model_fields({**args, "arch": "lightconv_lm"}, 1008)
    # an output projection (decoder_output_dim) needs an output table of its width: fairseq cannot run it shared
    with pytest.raises(UserError, match="decoder_output_dim=32 with shared output embeddings 64 wide"):
        fairseq.model_fields({**args, "decoder_output_dim": 32}, 1008)
    separate = {**args, "share_all_embeddings": False, "share_decoder_input_output_embed": False}
    assert fairseq.model_fields({**separate, "decoder_output_dim": 32}, 1008)["decoder_output_dim"] == 32
    # fairseq's transformer stores it as a string (its flag has no argparse type)
    assert fairseq.model_fields({**separate, "decoder_output_dim": "32"}, 1008)["decoder_output_dim"] == 32
    assert fairseq.model_fields({**separate, "decoder_output_dim": "64"}, 1008)["decoder_output_dim"] == 0


def test_a_state_dict_that_does_not_fit_its_arguments_is_refused(dynamic_checkpoint):
    weights, args, _ = dynamic_checkpoint
    fields = fairseq.model_fields(args, 1008)
    with pytest.raises(UserError, match=r"would not use: \['encoder.layers.2.fc1.weight'\]"):
        fairseq.lconv_params({**weights, "encoder.layers.2.fc1.weight": np.zeros((128, 64))}, fields)
    trimmed = {k: v for k, v in weights.items() if k != "decoder.layers.1.fc2.bias"}
    with pytest.raises(UserError, match="lacks 'decoder.layers.1.fc2.bias'"):
        fairseq.lconv_params(trimmed, fields)
    with pytest.raises(UserError, match="should be a copy of the shared embedding"):
        fairseq.lconv_params({**weights, "decoder.embed_tokens.weight": weights["decoder.embed_tokens.weight"] + 1},
                             fields)


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32"])
def test_an_unused_huge_tensor_of_any_dtype_is_refused_without_being_converted(tmp_path, dtype):
    import torch

    state = torch.load(FIXTURES / "dynamic" / "checkpoint_last.pt", map_location="cpu", weights_only=False)  # ours
    # A few bytes on disk (zero strides), 4 TB as float32: converted before the leftover check, it was a traceback
    state["model"]["encoder.extra.weight"] = torch.zeros(1, dtype=getattr(torch, dtype)).expand(10**6, 10**6)
    checkpoint = tmp_path / "huge.pt"
    torch.save(state, checkpoint)
    with pytest.raises(UserError, match=r"would not use: \['encoder.extra.weight'\]") as err:
        fairseq_workdir.import_checkpoint(str(checkpoint), str(FIXTURES / "dict.txt"), str(FIXTURES / "spm.model"),
                                          str(tmp_path / "run"))
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_bad_files_are_one_line_errors(tmp_path, monkeypatch, workdirs):
    checkpoint, dictionary, model = (str(FIXTURES / "dynamic" / "checkpoint_last.pt"), str(FIXTURES / "dict.txt"),
                                     str(FIXTURES / "spm.model"))
    not_a_checkpoint = tmp_path / "model.pt"
    not_a_checkpoint.write_bytes(b"not a zip")
    cases = [
        ((str(not_a_checkpoint), dictionary, model), "cannot read .* as a torch checkpoint"),
        ((str(tmp_path / "missing.pt"), dictionary, model), "no fairseq checkpoint at"),
        ((checkpoint, str(FIXTURES / "test.src"), model), r"test.src:1: not a fairseq dictionary line"),
        ((checkpoint, dictionary, str(FIXTURES / "dict.txt")), "is not a SentencePiece model"),
    ]
    short = tmp_path / "dict.txt"
    short.write_text("\n".join(_lines(FIXTURES / "dict.txt")[:-8]) + "\n", encoding="utf-8")
    cases.append(((checkpoint, str(short), model), "gives 1000 ids .* encoder embeddings have 1008 rows"))
    other_spm = tmp_path / "other_spm.model"  # another model's (byte pieces the dictionary lacks): was SentencePiece's
    other_spm.write_bytes(tiny_runs.tokenizer().to_bytes())
    cases.append(((checkpoint, dictionary, str(other_spm)), "other_spm.model does not fit .*dict.txt"))
    for (ckpt, dict_path, spm_path), pattern in cases:
        with pytest.raises(UserError, match=pattern):
            fairseq_workdir.import_checkpoint(ckpt, dict_path, spm_path, str(tmp_path / "run"))
        assert not (tmp_path / "run").exists()  # nothing is written before everything has been checked
    other = tmp_path / "dict.de.txt"
    other.write_text("\n".join(reversed(_lines(FIXTURES / "dict.txt"))) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="dict.de.txt"):
        fairseq_workdir.import_checkpoint(checkpoint, dictionary, model, str(tmp_path / "run"),
                                          target_dictionary=str(other))
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="evil:X"):  # stored, it was found only at eval.py's first read (r26-16)
        fairseq_workdir.import_checkpoint(checkpoint, dictionary, model, str(tmp_path / "run"), dataset="evil:X")
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="already holds checkpoints"):
        fairseq_workdir.import_checkpoint(checkpoint, dictionary, model, workdirs["dynamic"])
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(UserError, match=r'lconv\[fairseq\]'):
        fairseq.read_checkpoint(checkpoint)


@pytest.mark.parametrize("state, named", [
    ({"model": {}, "cfg": {"model": 5}}, "model arguments are int 5"),
    ({"model": [], "args": {"arch": "lightconv"}}, "no 'model' state dict"),
    ({"model": {}, "args": {"arch": "lightconv"}, "optimizer_history": [5]}, r"optimizer_history is \[5\]"),
    ({"model": {}, "args": {"arch": "lightconv"}, "optimizer_history": 5}, "optimizer_history is 5"),
    ({"model": {}, "args": {"arch": "lightconv"}, "optimizer_history": [{"num_updates": "x"}]}, "num_updates"),
])
def test_a_checkpoint_of_the_wrong_shape_is_one_line_naming_what_is_malformed(tmp_path, state, named):
    import torch

    path = tmp_path / "x.pt"
    torch.save(state, path)
    with pytest.raises(UserError, match=named) as err:
        fairseq.read_checkpoint(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("removed, changed, named", [
    (["encoder_kernel_size_list"], {}, "lack encoder_kernel_size_list"),
    (["encoder_layers", "decoder_kernel_size_list"], {}, "lack encoder_layers, decoder_kernel_size_list"),
    ([], {"encoder_layers": "two"}, "encoder_layers='two' is not a layer count"),
    ([], {"decoder_layers": None}, "decoder_layers=None is not a layer count"),
    ([], {"decoder_kernel_size_list": 3}, "decoder_kernel_size_list=3: fairseq records a list"),
])
def test_lightconv_arguments_missing_or_of_the_wrong_type_are_one_line_naming_them(removed, changed, named):
    args = {"arch": "lightconv", "encoder_layers": 2, "decoder_layers": 2, "encoder_embed_dim": 4,
            "decoder_embed_dim": 4, "encoder_kernel_size_list": [3, 3], "decoder_kernel_size_list": [3, 3],
            "encoder_conv_type": "lightweight", "decoder_conv_type": "lightweight"}
    assert fairseq.model_fields(args, 6)["encoder_kernel_sizes"] == (3, 3)
    hand_made = {**{k: v for k, v in args.items() if k not in removed}, **changed}
    with pytest.raises(UserError, match=named):
        fairseq.model_fields(hand_made, 6)


def test_an_spm_model_that_is_a_pipe_or_too_big_is_one_line_not_a_hang(tmp_path):
    from lconv.data.tokenizer import TOKENIZER_LIMIT

    pipe, huge = tmp_path / "spm.fifo", tmp_path / "huge.model"
    os.mkfifo(pipe)  # no writer: reading it waited for ever
    with open(huge, "wb") as f:  # sparse: stands for /dev/zero, read until memory ran out
        f.truncate(TOKENIZER_LIMIT + 1)
    for spm_path, named in ((pipe, "not a regular file"), (huge, "more than the")):
        with pytest.raises(UserError, match=named):
            fairseq_vocab.build_vocabulary(str(FIXTURES / "dict.txt"), str(spm_path))


def test_the_import_record_names_its_source_and_counts_fairseqs_parameters(workdirs):
    import json

    record = json.loads((pathlib.Path(workdirs["transformer"]) / "imported.json").read_text())
    # fairseq's 231,936 trained parameters (its file also holds 66,432 unused zeros, which are not imported)
    assert (record["arch"], record["parameters"], record["updates"]) == ("transformer", 231_936, 1500)
    assert len(record["sha256"]) == 64 and record["fairseq_model_args"]["share_all_embeddings"] is True
    assert math.isclose(record["fairseq_model_args"]["dropout"], 0.1)


def test_the_numpy_reference_is_fairseqs_forward_pass(dynamic_checkpoint):
    """The float64 reference the variant test below trusts reproduces fairseq's golden log-probabilities."""
    for name in MODELS:
        weights, args, _ = (dynamic_checkpoint if name == "dynamic" else
                            fairseq.read_checkpoint(str(FIXTURES / name / "checkpoint_last.pt")))
        golden = np.load(FIXTURES / name / "golden_lprobs.npz")
        target = golden["target"]
        previous = np.concatenate([np.full((len(target), 1), 2), target[:, :-1]], axis=1)  # EOS first
        logits = fairseq_reference.forward(weights, args, golden["src_tokens"], previous)
        lprobs = logits - logits.max(-1, keepdims=True)
        lprobs -= np.log(np.exp(lprobs).sum(-1, keepdims=True))
        real = target != 1
        np.testing.assert_allclose(lprobs[real], golden["lprobs"][real], rtol=1e-5, atol=2e-5)


# Architectures no fixture covers: (fairseq arguments over _BASE_ARGS). Together they take every importable
# option both ways: conv type, GLU, pre/post-norm, learned/sinusoidal positions, shared / decoder-tied / separate
# embeddings, conv width != model width, embedding scaling (lightconv ignores --no-scale-embedding), each per side,
# different encoder and decoder widths (transformer), GELU both ways, embedding layer norm, no positions, an output
# projection (decoder_output_dim), no final decoder norm.
VARIANTS = {
    "lightweight_noglu_prenorm_learned_tied_decoder": dict(
        arch="lightconv", encoder_conv_type="lightweight", decoder_conv_type="lightweight", encoder_glu=False,
        decoder_glu=False, encoder_normalize_before=True, decoder_normalize_before=True, encoder_learned_pos=True,
        decoder_learned_pos=True, share_all_embeddings=False, share_decoder_input_output_embed=True,
        encoder_conv_dim=24, decoder_conv_dim=24),
    "dynamic_glu_postnorm_separate_output": dict(
        arch="lightconv_wmt_en_de", encoder_conv_type="dynamic", decoder_conv_type="dynamic",
        share_all_embeddings=False, share_decoder_input_output_embed=False),
    "transformer_output_projection": dict(
        arch="transformer", share_all_embeddings=False, share_decoder_input_output_embed=False, decoder_output_dim=12,
        activation_fn="relu"),
    "transformer_prenorm_learned_unscaled": dict(
        arch="transformer", encoder_normalize_before=True, decoder_normalize_before=True, encoder_learned_pos=True,
        decoder_learned_pos=True, no_scale_embedding=True, activation_fn="relu"),
    "transformer_prenorm_no_decoder_final_norm": dict(
        arch="transformer", encoder_normalize_before=True, decoder_normalize_before=True, activation_fn="relu",
        no_decoder_final_norm=True),
    # Per-side settings: every block setting differs between encoder and decoder.
    "lightconv_sides_differ": dict(
        arch="lightconv", encoder_conv_type="lightweight", decoder_conv_type="dynamic", encoder_glu=True,
        decoder_glu=False, encoder_normalize_before=True, decoder_normalize_before=False, encoder_learned_pos=False,
        decoder_learned_pos=True, encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_embed_dim=32,
        decoder_ffn_embed_dim=20, encoder_conv_dim=24, decoder_conv_dim=16, no_scale_embedding=True),
    "transformer_widths_differ_gelu_layernorm_embedding": dict(
        arch="transformer", decoder_embed_dim=12, decoder_attention_heads=3, decoder_ffn_embed_dim=20,
        encoder_normalize_before=True, share_all_embeddings=False, share_decoder_input_output_embed=True,
        activation_fn="gelu", layernorm_embedding=True, decoder_learned_pos=True),
    "transformer_gelu_fast_no_positions": dict(
        arch="transformer", activation_fn="gelu_fast", no_token_positional_embeddings=True, decoder_learned_pos=True,
        share_all_embeddings=False, share_decoder_input_output_embed=False),
}
_BASE_ARGS = dict(encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32,
                  encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_kernel_size_list=[3, 5], decoder_kernel_size_list=[2, 4], encoder_glu=True,
                  decoder_glu=True, encoder_normalize_before=False, decoder_normalize_before=False,
                  encoder_learned_pos=False, decoder_learned_pos=False, share_all_embeddings=True,
                  max_source_positions=16, max_target_positions=16, weight_softmax=True, dropout=0.1)
_V = 24


def _fairseq_weights(args: dict, rng: np.random.Generator, vocab: int = _V,
                     target_vocab: int | None = None) -> dict[str, np.ndarray]:
    """A random state dict under fairseq's names and [out, in] layouts for ``args``, each side at its own widths
    (the decoder's encoder attention reads keys and values of the encoder's width, fairseq's kdim = vdim)."""
    w: dict[str, np.ndarray] = {}
    normal = lambda *shape: rng.normal(0.0, 0.3, shape).astype(np.float32)
    lightconv = args["arch"].startswith("lightconv")

    def linear(name, out, inp, bias=True):
        w[f"{name}.weight"] = normal(out, inp)
        if bias:
            w[f"{name}.bias"] = normal(out)

    def norm(name, C):
        w[f"{name}.weight"], w[f"{name}.bias"] = 1.0 + normal(C), normal(C)

    for side in ("encoder", "decoder"):
        C, F = args[f"{side}_embed_dim"], args[f"{side}_ffn_embed_dim"]
        H, conv = args[f"{side}_attention_heads"], args.get(f"{side}_conv_dim", C)
        w[f"{side}.embed_tokens.weight"] = normal(vocab if side == "encoder" else target_vocab or vocab, C)
        if args[f"{side}_learned_pos"] and not args.get("no_token_positional_embeddings"):
            w[f"{side}.embed_positions.weight"] = normal(args["max_source_positions"] + 2, C)
        if args.get("layernorm_embedding") and not lightconv:
            norm(f"{side}.layernorm_embedding", C)
        for i in range(args[f"{side}_layers"]):
            p = f"{side}.layers.{i}"
            if lightconv:
                K = args[f"{side}_kernel_size_list"][i]
                linear(f"{p}.linear1", 2 * conv if args[f"{side}_glu"] else conv, C)
                if args[f"{side}_conv_type"] == "dynamic":
                    linear(f"{p}.conv.weight_linear", H * K, conv, bias=False)
                else:
                    w[f"{p}.conv.weight"] = normal(H, 1, K)
                linear(f"{p}.linear2", C, conv)
                norm(f"{p}.layer_norms.0" if side == "encoder" else f"{p}.conv_layer_norm", C)
            else:
                for proj in ("q", "k", "v", "out"):
                    linear(f"{p}.self_attn.{proj}_proj", C, C)
                norm(f"{p}.self_attn_layer_norm", C)
            if side == "decoder":
                for proj in ("q", "k", "v", "out"):
                    linear(f"{p}.encoder_attn.{proj}_proj", C,
                           args["encoder_embed_dim"] if proj in ("k", "v") else C)
                norm(f"{p}.encoder_attn_layer_norm", C)
            linear(f"{p}.fc1", F, C)
            linear(f"{p}.fc2", C, F)
            norm(f"{p}.layer_norms.1" if side == "encoder" and lightconv else f"{p}.final_layer_norm", C)
        if args[f"{side}_normalize_before"] and not (side == "decoder" and args.get("no_decoder_final_norm")):
            norm(f"{side}.layer_norm", C)
    if args["share_all_embeddings"]:
        w["decoder.embed_tokens.weight"] = w["encoder.embed_tokens.weight"]
    elif not args["share_decoder_input_output_embed"]:
        d_out = args.get("decoder_output_dim", args["decoder_embed_dim"])
        w["decoder.embed_out"] = normal(target_vocab or vocab, d_out)
        if d_out != args["decoder_embed_dim"]:
            w["decoder.project_out_dim.weight"] = normal(d_out, args["decoder_embed_dim"])
    return w


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_importable_architecture_matches_the_reference(variant):
    """Random weights under fairseq's names, imported, give the float64 reference's logits."""
    from lconv.nn.models import EncoderDecoder, ModelConfig

    args = {**_BASE_ARGS, **VARIANTS[variant]}
    rng = np.random.default_rng(0)
    weights = _fairseq_weights(args, rng)
    fields = fairseq.model_fields(args, _V)
    model = EncoderDecoder(ModelConfig.from_config(fields, matmul_precision="highest"))
    _assert_logits_are_the_references(model, fairseq.lconv_params(weights, fields), weights, args, _V, rng)


def _assert_logits_are_the_references(model, params, weights, args, vocab, rng, target_vocab=None,
                                      source_ids=_to_lconv):
    """Teacher-forced logits of a batch of random sentences (fairseq's padding on fairseq's side, lconv's on
    lconv's) equal ``fairseq_reference.forward``'s in float32. ``source_ids``: fairseq's source ids -> lconv's;
    the target's ids are lconv's but for the four specials, and logits past the target's ids are -inf."""
    target_vocab = target_vocab or vocab
    lengths, target_lengths = [7, 4, 6], [5, 7, 3]
    source = np.ones((3, 7), np.int64)  # fairseq: left-padded, EOS last
    previous = np.ones((3, 7), np.int64)  # fairseq: EOS first, right-padded
    target = np.zeros((3, 7), np.int32)  # lconv: the targets (EOS last), right-padded; the model shifts them
    for b, (n, m) in enumerate(zip(lengths, target_lengths)):
        source[b, 7 - n:] = np.append(rng.integers(4, vocab, n - 1), 2)
        tokens = np.append(rng.integers(4, target_vocab, m - 1), 2)
        previous[b, :m] = np.append(2, tokens[:-1])
        target[b, :m] = _to_lconv(tokens)
    inputs = np.zeros((3, 7), np.int32)
    for b, n in enumerate(lengths):
        inputs[b, :n] = source_ids(source[b, 7 - n:])
    logits = model.apply({"params": params}, inputs, target, inputs_segmentation=(inputs != 0).astype(np.int32),
                         targets_segmentation=(target != 0).astype(np.int32))
    expected = fairseq_reference.forward(weights, args, source, previous)
    columns = [fairseq_vocab.FAIRSEQ_TO_LCONV.get(i, i) for i in range(target_vocab)]
    real = target != 0
    np.testing.assert_allclose(np.asarray(logits)[..., columns][real], expected[real],
                               **tolerance(np.float32, "highest", rtol=1e-5, atol=1e-5))
    assert np.all(np.asarray(logits)[..., target_vocab:] == -np.inf)


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_a_checkpoint_whose_sides_differ_imports_into_a_workdir_lconv_load_reads(tmp_path):
    """The whole path for per-side settings and the transformer's flags: a fairseq checkpoint file (written as
    fairseq writes one: cfg["model"] a Namespace) -> python -m lconv.import_fairseq's function -> config.json
    -> lconv.load, whose model gives the reference's logits."""
    import lconv

    args = {**_BASE_ARGS, **VARIANTS["transformer_widths_differ_gelu_layernorm_embedding"]}
    rng = np.random.default_rng(1)
    weights = _fairseq_weights(args, rng, vocab=1008)  # the fixtures' dictionary: 1008 ids
    _save_checkpoint(tmp_path / "checkpoint.pt", weights, args)
    workdir = str(tmp_path / "run")
    fairseq_workdir.import_checkpoint(str(tmp_path / "checkpoint.pt"), str(FIXTURES / "dict.txt"),
                                      str(FIXTURES / "spm.model"), workdir)
    stored = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (stored["d_model"], stored["decoder_d_model"], stored["decoder_num_heads"], stored["activation"],
            stored["layernorm_embedding"], stored["encoder_normalize_before"]) == (16, 12, 3, "gelu", True, None)
    model = lconv.load(workdir)
    _assert_logits_are_the_references(model.module, model.params, weights, args, 1008, rng)


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_without_sentencepiece_text_split_into_pieces_translates_as_fairseq(tmp_path):
    """The dictionary alone (the tokenizer of fairseq's published, BPE-split models): sources given as their
    pieces give fairseq-generate's hypotheses as pieces (generate_pieces.txt), for all 200 sentences."""
    import lconv

    workdir = str(tmp_path / "pieces")
    record = fairseq_workdir.import_checkpoint(str(FIXTURES / "dynamic" / "checkpoint_last.pt"),
                                               str(FIXTURES / "dict.txt"), None, workdir, decode=GENERATE,
                                               continuation="")
    assert record["tokenizer"] == "pieces.json" and record["spm"] is None
    pieces = spm.SentencePieceProcessor(model_file=str(FIXTURES / "spm.model"))
    sources = [" ".join(pieces.encode(s, out_type=str)) for s in _lines(FIXTURES / "test.src")]
    model = lconv.load(workdir)
    assert model.translate(sources) == _lines(FIXTURES / "dynamic" / "generate_pieces.txt")


def test_the_pieces_tokenizer_joins_bpe_units_as_remove_bpe_does(tmp_path):
    from lconv.data import tokenizer as tokenizer_lib
    from lconv.data.pieces_tokenizer import PiecesTokenizer

    tokenizer = PiecesTokenizer(["Werk@@", "zeug", "zum", "Um@@", "wand@@", "eln", "."], continuation="@@")
    ids = tokenizer.encode("Werk@@ zeug zum Um@@ wand@@ eln unbekannt .")
    assert ids.tolist() == [4, 5, 6, 7, 8, 9, 2, 10]  # an unknown piece is UNK (2)
    assert tokenizer.detokenize(np.append(ids, [1, 4])) == "Werkzeug zum Umwandeln <unk> ."  # stops at EOS (1)
    tokenizer_lib.save_tokenizer(tokenizer, str(tmp_path))
    loaded = tokenizer_lib.load_tokenizer(str(tmp_path))
    assert (loaded.symbols, loaded.continuation) == (tokenizer.symbols, "@@")
    # Not JSON; and numbers among the symbols (round 13: loaded, then a TypeError traceback at the first decoding).
    for text, named in (("{not json", "JSONDecodeError"), ('{"symbols": ["a", 100, 101]}', "symbols[1] is 100"),
                        ('{"symbols": "abc"}', "list of strings")):
        (tmp_path / "pieces.json").write_text(text)
        with pytest.raises(UserError) as error:
            tokenizer_lib.load_tokenizer(str(tmp_path))
        helpers.one_line_error(error, "is not a pieces vocabulary", named)


def _save_checkpoint(path: pathlib.Path, weights: dict[str, np.ndarray], args: dict) -> None:
    """A checkpoint file as fairseq 0.12 writes one: ``cfg["model"]`` an ``argparse.Namespace``."""
    import argparse
    import collections

    import torch

    torch.save({"args": None, "cfg": {"model": argparse.Namespace(**args, _name=args["arch"])},
                "model": collections.OrderedDict((k, torch.from_numpy(v)) for k, v in weights.items()),
                "optimizer_history": [{"num_updates": 7}]}, path)


def test_separate_dictionaries_without_the_target_one_are_refused_in_one_line(tmp_path):
    """fairseq-preprocess without --joined-dictionary, imported with the source dictionary alone."""
    args = {**_BASE_ARGS, "arch": "transformer", "share_all_embeddings": False}
    weights = {"encoder.embed_tokens.weight": np.zeros((1008, 16), np.float32),
               "decoder.embed_tokens.weight": np.zeros((1000, 16), np.float32)}
    _save_checkpoint(tmp_path / "checkpoint.pt", weights, args)
    with pytest.raises(UserError) as err:
        fairseq_workdir.import_checkpoint(str(tmp_path / "checkpoint.pt"), str(FIXTURES / "dict.txt"),
                                          str(FIXTURES / "spm.model"), str(tmp_path / "run"))
    assert str(err.value).startswith("the checkpoint's source and target dictionaries differ (1008 and 1000 "
                                     "embedding rows: fairseq-preprocess without --joined-dictionary); give the "
                                     "target side's dict.txt too (--target_dict)")
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_separate_dictionaries_import_as_one_vocabulary_the_decoder_predicts_only_the_targets_of(tmp_path):
    """fairseq-preprocess without --joined-dictionary: the source is the fixtures' dictionary, the target 300 of its
    lines in another order. lconv's vocabulary is the target's symbols, then the source's others; the encoder
    reads each source piece at its source row, the decoder predicts over the target's ids alone."""
    import lconv

    source = _lines(FIXTURES / "dict.txt")
    target = source[::-3][:300]
    (tmp_path / "dict.de.txt").write_text("\n".join(target) + "\n", encoding="utf-8")
    args = {**_BASE_ARGS, **VARIANTS["transformer_gelu_fast_no_positions"], "share_decoder_input_output_embed": True}
    rng = np.random.default_rng(2)
    weights = _fairseq_weights(args, rng, vocab=1008, target_vocab=304)
    _save_checkpoint(tmp_path / "checkpoint.pt", weights, args)
    workdir = str(tmp_path / "run")
    fairseq_workdir.import_checkpoint(str(tmp_path / "checkpoint.pt"), str(FIXTURES / "dict.txt"),
                                      str(FIXTURES / "spm.model"), workdir, target_dictionary=str(tmp_path /
                                                                                                  "dict.de.txt"))
    model = lconv.load(workdir)
    assert (model.config.model.output_vocab_size, model.config.optim.label_smoothing) == (304, 0.0)
    source_symbols, target_symbols = ([line.split(" ")[0] for line in lines] for lines in (source, target))
    symbols = target_symbols + [s for s in source_symbols if s not in set(target_symbols)]  # by hand
    lconv_id = {symbol: i + 4 for i, symbol in enumerate(symbols)}
    by_source_id = fairseq_vocab.lconv_ids(fairseq_vocab.joined_symbols(source_symbols, target_symbols),
                                           source_symbols)
    assert [by_source_id[i + 4] for i in range(len(source))] == [lconv_id[s] for s in source_symbols]
    assert fairseq_vocab.lconv_ids(symbols, target_symbols)[4:].tolist() == list(range(4, 304))  # target first
    sentence = _lines(FIXTURES / "test.src")[1]
    pieces = spm.SentencePieceProcessor(model_file=str(FIXTURES / "spm.model")).encode(sentence, out_type=str)
    assert model.tokenizer.encode(sentence).tolist() == [lconv_id[p] for p in pieces]
    _assert_logits_are_the_references(model.module, model.params, weights, args, 1008, rng, target_vocab=304,
                                      source_ids=lambda ids: by_source_id[ids])
