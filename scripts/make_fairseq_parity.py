"""Writes tests/fixtures/fairseq_parity/: for each case of ``fairseq_parity_cases.CASES``, a tiny randomly
initialised fairseq 0.12.2 model saved as a real fairseq checkpoint, with fairseq's own outputs beside it.

Everything this script writes comes from fairseq and PyTorch: it does not import lconv. It runs in a fairseq
0.12.2 environment, kept outside the repository (docs/fairseq.md, "The parity matrix"; ../shared/fairseq/README.md
lists the patches fairseq 0.12.2 needs on Python 3.11 / torch 2.13)::

    python3.11 -m venv /work/fairseq-venv && . /work/fairseq-venv/bin/activate
    pip install "pip<24.1" && pip install torch==2.13.0 numpy==1.26.4 "cython<3" hydra-core==1.0.7 \\
        omegaconf==2.0.6 bitarray regex sacrebleu==2.6.0 cffi scipy tqdm
    pip download --no-deps --no-build-isolation --no-binary :all: fairseq==0.12.2   # then patch and
    pip install --no-deps --no-build-isolation ./fairseq-0.12.2                        # install the sdist
    OMP_NUM_THREADS=1 python scripts/make_fairseq_parity.py [--cases lc_base,tf_gelu]

Per case (``tests/fixtures/fairseq_parity/<case>/``):
- ``checkpoint.pt``: the container fairseq-train writes (``cfg`` a dict whose ``cfg["model"]`` is fairseq's
  ``argparse.Namespace``, ``model`` the state dict, no optimizer state; ``num_updates`` 0), built by fairseq's own
  task and ``build_model`` from the case's flags, so every argument and arch default is fairseq's. Every
  parameter is then redrawn from a seeded normal (``reinitialise``: biases, LayerNorm scales and offsets
  included, so that a dropped bias or norm shows; BetterTransformer's unused copies stay zero), and the model is
  trained for ``TRAIN_STEPS`` Adam steps on a synthetic task (``synthetic_batch``): a purely random tiny model
  repeats one token until the length limit, which would leave EOS handling and the decoder's incremental state
  untested; after these steps its searches stop at varied lengths (some at the limit) on varied tokens.
- ``dict.txt`` (joined) or ``dict.src.txt`` / ``dict.tgt.txt``: fairseq dictionaries (padded to a multiple of 8
  with ``madeupword`` entries, as fairseq-preprocess does); symbols are plain pieces (``p07``), no SentencePiece.
- ``outputs.npz``: fairseq's outputs of the checkpoint as re-loaded by ``checkpoint_utils`` (fairseq ids: ``<s>`` 0,
  ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3; log-probabilities in natural log; eval mode, float32, CPU, 1 thread):
  translation: ``src_tokens`` [B,S] (left-padded, EOS last), ``src_lengths`` [B], ``prev_output_tokens`` [B,T]
  (EOS first, right-padded), ``target`` [B,T] (EOS last, right-padded), ``lprobs`` [B,T,V]
  (``get_normalized_probs(log_probs=True)``); for beam k in 1, 4 (each source decoded alone by fairseq's
  SequenceGenerator): ``beam{k}_tokens`` [B,k,L] (hypotheses best first, EOS included, padded with 1),
  ``beam{k}_lengths`` [B,k], ``beam{k}_scores`` [B,k] (fairseq's normalised score, natural log),
  ``beam{k}_positional_scores`` [B,k,L] (0 after the length).
  language models: ``src_tokens`` [B,T] (EOS first, right-padded), ``target`` [B,T] (EOS last), ``lprobs``
  [B,T,V]; ``eval_lm_tokens`` / ``eval_lm_lengths``: the stream fairseq-eval-lm scored (one sentence per row,
  EOS last) and ``eval_lm_positional_scores``; ``prompt_tokens`` / ``prompt_lengths`` and ``greedy_tokens`` [P,L],
  ``greedy_lengths``, ``greedy_positional_scores``: fairseq's greedy continuation (prompt, continuation, EOS).
- ``case.json``: the flags, fairseq's resolved model arguments, the decoding settings, the texts, eval-lm's
  loss (base 2) and perplexity.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile

import fairseq_parity_cases as matrix
import numpy as np
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.data import Dictionary, data_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import OmegaConf

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "fairseq_parity"
SEED = 29
INIT_STD = 0.2
LINEAR_GAIN = 1.0
EMBED_STD = 0.3
TRAIN_STEPS, TRAIN_LR = 300, 1e-2  # synthetic_batch: so that searches end at varied lengths
SYMBOLS = {"joined": ("p", 45), "src": ("s", 45), "tgt": ("t", 33)}  # 45 + 4 -> 56 ids, 33 + 4 -> 40 ids
TRANSLATE = {"max_len_a": 0.8, "max_len_b": 1, "lenpen": 1.0, "beams": [1, 4]}  # fairseq-generate's flags
SOURCE_LENGTHS, TARGET_LENGTHS = (7, 3, 9, 5), (6, 8, 2, 5)  # pieces, before EOS
LM_LENGTHS, EVAL_LM_LENGTHS, PROMPT_LENGTHS = (6, 9, 3, 7), (5, 11, 1, 8, 4, 6), (3, 5)
LM_GENERATE = {"max_len_a": 0.0, "max_len_b": 12, "beam": 1}


def write_dictionary(path: pathlib.Path, prefix: str, count: int) -> Dictionary:
    """A fairseq dictionary of ``count`` pieces (counts descending), padded to a multiple of 8 as
    fairseq-preprocess pads it; saved in fairseq's ``dict.txt`` format."""
    dictionary = Dictionary()
    for i in range(count):
        dictionary.add_symbol(f"{prefix}{i:02d}", n=1000 - 10 * i)
    dictionary.finalize(threshold=-1, nwords=-1, padding_factor=8)
    dictionary.save(str(path))
    return Dictionary.load(str(path))


def data_dir(case: matrix.Case, root: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """fairseq's data folder for the task (dictionaries only) and the dictionary files the case ships."""
    folder = root / "data"
    folder.mkdir(parents=True, exist_ok=True)
    if case.task == "language_modeling":
        write_dictionary(folder / "dict.txt", *SYMBOLS["joined"])
        return folder, {"dict": "dict.txt"}
    if case.joined:
        for lang in ("src", "tgt"):
            write_dictionary(folder / f"dict.{lang}.txt", *SYMBOLS["joined"])
        return folder, {"dict": "dict.txt"}
    for lang in ("src", "tgt"):
        write_dictionary(folder / f"dict.{lang}.txt", *SYMBOLS[lang])
    return folder, {"dict": "dict.src.txt", "target_dict": "dict.tgt.txt"}


def build_model(name: str, folder: pathlib.Path):
    """fairseq's task and model from the case's flags, exactly as fairseq-train builds them."""
    case = matrix.CASES[name]
    argv = [str(folder), "--task", case.task, *matrix.flags(name), "--seed", str(SEED), "--cpu"]
    if case.task == "translation":
        argv += ["--source-lang", "src", "--target-lang", "tgt"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    reinitialise(model)
    return cfg, model, task


BETTER_TRANSFORMER = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "fc1_weight",
                      "fc1_bias", "fc2_weight", "fc2_bias")  # fairseq 0.12's unused zero copies


def reinitialise(model: torch.nn.Module) -> None:
    """Every parameter from a seeded normal: linear weights N(0, LINEAR_GAIN² / fan_in), LayerNorm scales
    1 + N(0, INIT_STD²), everything else (embeddings, biases, LayerNorm offsets, LightConv kernels) N(0, INIT_STD²)."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) and m.weight is not None}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in BETTER_TRANSFORMER:
                continue
            noise = torch.randn(p.shape, generator=generator)
            if id(p) in linears and p.dim() == 2:
                p.copy_(noise * LINEAR_GAIN / math.sqrt(p.shape[1]))
            elif id(p) in embeddings:
                p.copy_(noise * EMBED_STD)
            else:
                p.copy_(noise * INIT_STD + (1.0 if id(p) in norms else 0.0))


def synthetic_batch(rng: np.random.Generator, task, rows: int = 16):
    """A task a tiny model learns in a few hundred steps, so that its searches end in EOS at varied lengths
    and its outputs depend on the input: translation shifts each source piece; a language
    model continues ``p(i) -> p(3i + 1 mod n)`` runs of random length."""
    source, target = task.source_dictionary, task.target_dictionary
    n_src, n_tgt = (sum(not d[i].startswith("madeupword") for i in range(d.nspecial, len(d))) for d in (source, target))
    pad, eos, first = source.pad(), source.eos(), source.nspecial
    if target is None or task.__class__.__name__.startswith("LanguageModeling"):
        rows_ = []
        for _ in range(rows):
            start, n = int(rng.integers(n_src)), int(rng.integers(3, 12))
            run = [start]
            for _ in range(n - 1):
                run.append((3 * run[-1] + 1) % n_src)
            rows_.append(torch.tensor([first + i for i in run] + [eos]))
        prev = data_utils.collate_tokens(rows_, pad, eos, move_eos_to_beginning=True)
        return {"src_tokens": prev}, data_utils.collate_tokens(rows_, pad, eos)
    pieces = [rng.integers(n_src, size=int(rng.integers(2, 10))) for _ in range(rows)]
    src = [torch.tensor([first + int(i) for i in p] + [eos]) for p in pieces]
    tgt = [torch.tensor([first + (int(i) + 5) % n_tgt for i in p] + [eos]) for p in pieces]
    net_input = {"src_tokens": data_utils.collate_tokens(src, pad, eos, left_pad=True),
                 "src_lengths": torch.tensor([len(s) for s in src]),
                 "prev_output_tokens": data_utils.collate_tokens(tgt, pad, eos, move_eos_to_beginning=True)}
    return net_input, data_utils.collate_tokens(tgt, pad, eos)


def train_briefly(model: torch.nn.Module, task) -> list[float]:
    """``TRAIN_STEPS`` of Adam on ``synthetic_batch`` (dropout on, as in training); the losses every 50 steps."""
    rng = np.random.default_rng(SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=TRAIN_LR)
    pad = task.source_dictionary.pad()
    model.train()
    losses = []
    for step in range(TRAIN_STEPS):
        net_input, target = synthetic_batch(rng, task)
        net_output = model(**net_input)
        adaptive = getattr(model.decoder, "adaptive_softmax", None)
        if adaptive is not None:  # fairseq's AdaptiveLoss (get_log_prob is not differentiable)
            logits, targets = adaptive(net_output[0], target.view(-1))
            loss = sum(torch.nn.functional.cross_entropy(x, y, ignore_index=pad, reduction="sum")
                       for x, y in zip(logits, targets) if x is not None) / (target != pad).sum()
        else:
            lprobs = model.get_normalized_probs(net_output, log_probs=True)
            loss = -lprobs.gather(-1, target[..., None])[..., 0][target != pad].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == TRAIN_STEPS - 1:
            losses.append(round(loss.item(), 4))
    model.eval()
    return losses


def save_checkpoint(cfg, model: torch.nn.Module, path: pathlib.Path) -> None:
    """The container fairseq-train's ``Trainer.state_dict`` writes, without optimizer state."""
    state = {
        "args": None,
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "model": model.state_dict(),
        "criterion": None,
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "none",
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "task_state": {},
        "extra_state": {"parity_fixture": "randomly initialised by scripts/make_fairseq_parity.py; never trained"},
    }
    checkpoint_utils.torch_persistent_save(state, str(path))
    torch.serialization.add_safe_globals([argparse.Namespace])
    torch.load(str(path), map_location="cpu", weights_only=True)  # readable without fairseq (lconv's loader)


def reload(path: pathlib.Path, folder: pathlib.Path):
    """The checkpoint as fairseq's own loader gives it back (what fairseq-generate / eval-lm would run)."""
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)],
                                                                      arg_overrides={"data": str(folder)})
    model = models[0].eval()
    return model, cfg, task


def random_rows(rng: np.random.Generator, dictionary: Dictionary, lengths) -> list[torch.Tensor]:
    """Rows of real pieces (no specials, no madeupwords), EOS last."""
    real = [i for i in range(dictionary.nspecial, len(dictionary)) if not dictionary[i].startswith("madeupword")]
    return [torch.tensor([*rng.choice(real, n).tolist(), dictionary.eos()]) for n in lengths]


def as_text(dictionary: Dictionary, row: torch.Tensor) -> str:
    return " ".join(dictionary[int(i)] for i in row.tolist() if int(i) != dictionary.eos())


def pad_hypotheses(hypotheses: list[list[dict]], beams: int, pad: int) -> dict[str, np.ndarray]:
    """fairseq's n-best lists [B][k] as padded arrays (see the module docstring)."""
    width = max(len(h["tokens"]) for nbest in hypotheses for h in nbest)
    tokens = np.full((len(hypotheses), beams, width), pad, np.int64)
    positional = np.zeros((len(hypotheses), beams, width), np.float32)
    lengths = np.zeros((len(hypotheses), beams), np.int64)
    scores = np.full((len(hypotheses), beams), np.nan, np.float32)
    for b, nbest in enumerate(hypotheses):
        for k, hypo in enumerate(nbest[:beams]):
            n = len(hypo["tokens"])
            tokens[b, k, :n] = hypo["tokens"].numpy()
            positional[b, k, :n] = hypo["positional_scores"].float().numpy()
            lengths[b, k], scores[b, k] = n, float(hypo["score"])
    return {"tokens": tokens, "lengths": lengths, "scores": scores, "positional_scores": positional}


def translation_outputs(model, task, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict]:
    """Teacher-forced log-probabilities of a left-padded batch, and fairseq's greedy and beam-4 hypotheses of
    each source decoded alone."""
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    sources = random_rows(rng, src_dict, SOURCE_LENGTHS)
    targets = random_rows(rng, tgt_dict, TARGET_LENGTHS)
    pad, eos = src_dict.pad(), src_dict.eos()
    # what LanguagePairDataset's collater builds (left_pad_source=True, left_pad_target=False), in file order
    src_tokens = data_utils.collate_tokens(sources, pad, eos, left_pad=True)
    prev_output_tokens = data_utils.collate_tokens(targets, pad, eos, left_pad=False, move_eos_to_beginning=True)
    target = data_utils.collate_tokens(targets, pad, eos, left_pad=False)
    src_lengths = torch.tensor([len(s) for s in sources])
    with torch.no_grad():
        net_output = model(src_tokens, src_lengths, prev_output_tokens)
        lprobs = model.get_normalized_probs(net_output, log_probs=True).float()
    out = {"src_tokens": src_tokens.numpy(), "src_lengths": src_lengths.numpy(),
           "prev_output_tokens": prev_output_tokens.numpy(), "target": target.numpy(), "lprobs": lprobs.numpy()}
    for beams in TRANSLATE["beams"]:
        settings = argparse.Namespace(beam=beams, max_len_a=TRANSLATE["max_len_a"], max_len_b=TRANSLATE["max_len_b"],
                                      lenpen=TRANSLATE["lenpen"])
        generator = task.build_generator([model], settings)
        found = []
        for source in sources:  # alone: fairseq-generate --batch-size 1
            sample = {"net_input": {"src_tokens": source[None], "src_lengths": torch.tensor([len(source)])}}
            found.append(task.inference_step(generator, [model], sample)[0])
        for key, value in pad_hypotheses(found, beams, pad).items():
            out[f"beam{beams}_{key}"] = value
    texts = {"sources": [as_text(src_dict, s) for s in sources], "targets": [as_text(tgt_dict, t) for t in targets],
             "beam4_best": [as_text(tgt_dict, torch.from_numpy(r[0][r[0] != pad])) for r in out["beam4_tokens"]]}
    return out, texts


def lm_outputs(model, task, rng: np.random.Generator, folder: pathlib.Path, checkpoint: pathlib.Path):
    """Teacher-forced log-probabilities of a batch (each row from EOS, as fairseq-eval-lm's ``eos`` break mode
    gives it), fairseq-eval-lm on a tiny stream, and a greedy continuation of two prompts."""
    dictionary = task.source_dictionary
    pad, eos = dictionary.pad(), dictionary.eos()
    rows = random_rows(rng, dictionary, LM_LENGTHS)
    src_tokens = data_utils.collate_tokens(rows, pad, eos, left_pad=False, move_eos_to_beginning=True)
    target = data_utils.collate_tokens(rows, pad, eos, left_pad=False)
    with torch.no_grad():
        net_output = model(src_tokens)
        lprobs = model.get_normalized_probs(net_output, log_probs=True).float()
    out = {"src_tokens": src_tokens.numpy(), "target": target.numpy(), "lprobs": lprobs.numpy()}
    stream = random_rows(rng, dictionary, EVAL_LM_LENGTHS)
    evaluated = eval_lm(stream, dictionary, folder, checkpoint)
    out.update(eval_lm_tokens=data_utils.collate_tokens(stream, pad, eos).numpy(),
               eval_lm_lengths=np.array([len(s) for s in stream]),
               eval_lm_positional_scores=evaluated.pop("positional_scores"))
    prompts = random_rows(rng, dictionary, PROMPT_LENGTHS)
    generator = task.build_generator([model], argparse.Namespace(**LM_GENERATE))
    found = []
    for prompt in prompts:  # as the hub's sample(): the prompt's EOS moved to the front, the prompt a forced prefix
        tokens = torch.cat([prompt[-1:], prompt[:-1]])[None]
        sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([tokens.shape[1]])}}
        found.append(task.inference_step(generator, [model], sample)[0])
    greedy = pad_hypotheses(found, 1, pad)
    out.update(prompt_tokens=data_utils.collate_tokens([p[:-1] for p in prompts], pad, eos).numpy(),
               prompt_lengths=np.array([len(p) - 1 for p in prompts]),
               greedy_tokens=greedy["tokens"][:, 0], greedy_lengths=greedy["lengths"][:, 0],
               greedy_positional_scores=greedy["positional_scores"][:, 0])
    texts = {"batch": [as_text(dictionary, r) for r in rows], "eval_lm": [as_text(dictionary, s) for s in stream],
             "prompts": [as_text(dictionary, p) for p in prompts]}
    return out, texts, evaluated


def eval_lm(stream: list[torch.Tensor], dictionary: Dictionary, folder: pathlib.Path,
            checkpoint: pathlib.Path) -> dict:
    """fairseq-eval-lm itself (``fairseq_cli.eval_lm.main``, ``--sample-break-mode eos``: each sentence from EOS)
    on the stream binarized by fairseq-preprocess, and each sentence's positional scores from SequenceScorer."""
    import fairseq_cli.eval_lm
    from fairseq.sequence_scorer import SequenceScorer

    raw = folder / "stream"  # fairseq-preprocess reads <testpref> itself when no language is given
    raw.write_text("".join(as_text(dictionary, s) + "\n" for s in stream), encoding="utf-8")
    binarized = folder / "stream-bin"
    subprocess.run([sys.executable, "-P", "-m", "fairseq_cli.preprocess", "--only-source", "--srcdict",
                    str(folder / "dict.txt"), "--testpref", str(raw), "--destdir", str(binarized),
                    "--workers", "1"], check=True, capture_output=True)
    flags = [str(binarized), "--path", str(checkpoint), "--sample-break-mode", "eos", "--gen-subset", "test",
             "--cpu", "--num-workers", "0", "--max-tokens", "4000", "--tokens-per-sample", "64"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_eval_lm_parser(), flags))
    results = fairseq_cli.eval_lm.main(cfg)
    # the same batches again, for each sentence's scores
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                    arg_overrides={"data": str(binarized)})
    task.load_dataset("test")
    scores = np.zeros((len(stream), max(map(len, stream))), np.float32)
    scorer = SequenceScorer(task.target_dictionary)
    for sample in task.eval_lm_dataloader(task.dataset("test"), max_tokens=4000, num_workers=0):
        for i, hypos in zip(sample["id"].tolist(), scorer.generate([models[0].eval()], sample)):
            assert hypos[0]["tokens"].tolist() == stream[i].tolist(), "eval-lm read another stream"
            scores[i, :len(stream[i])] = hypos[0]["positional_scores"].numpy()
    total = float(scores.sum(dtype=np.float64))
    count = int(sum(map(len, stream)))
    assert math.isclose(-total / count / math.log(2), float(results["loss"]), rel_tol=1e-5)
    return {"loss_base2": float(results["loss"]), "perplexity": float(results["perplexity"]), "tokens": count,
            "nll_sum": -total, "sample_break_mode": "eos", "positional_scores": scores}


def make_case(name: str, scratch: pathlib.Path) -> dict:
    """One case folder: dictionaries, checkpoint, fairseq's outputs, case.json; returns its manifest entry."""
    case = matrix.CASES[name]
    folder, dictionaries = data_dir(case, scratch / name)
    cfg, model, build_task = build_model(name, folder)
    torch.manual_seed(SEED)
    losses = train_briefly(model, build_task)
    target = OUT / name
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.iterdir():
        stale.unlink()
    checkpoint = target / "checkpoint.pt"
    save_checkpoint(cfg, model, checkpoint)
    if case.joined or case.task != "translation":
        (target / "dict.txt").write_bytes((folder / ("dict.txt" if case.task != "translation" else
                                                     "dict.src.txt")).read_bytes())
    else:
        for lang in ("src", "tgt"):
            (target / f"dict.{lang}.txt").write_bytes((folder / f"dict.{lang}.txt").read_bytes())
    reloaded, _, task = reload(checkpoint, folder)
    rng = np.random.default_rng(SEED)
    torch.manual_seed(SEED)
    record = {"name": name, "task": case.task, "covers": case.covers, "flags": list(matrix.flags(name)),
              "share": case.share, "joined": case.joined, "cfg_model_type": type(cfg.model).__name__,
              "files": dictionaries, "seed": SEED,
              "init": {"std": INIT_STD, "linear_gain": LINEAR_GAIN, "embed_std": EMBED_STD},
              "fairseq": _version("fairseq"), "torch": torch.__version__,
              "model_args": {k: v for k, v in sorted(_model_args(cfg.model).items()) if _jsonable(v)},
              "parameters": sum(p.numel() for p in model.parameters()),
              "synthetic_training": {"steps": TRAIN_STEPS, "lr": TRAIN_LR, "losses": losses}}
    if case.task == "translation":
        out, texts = translation_outputs(reloaded, task, rng)
        record["generate"] = {k: v for k, v in TRANSLATE.items()}
    else:
        out, texts, record["eval_lm"] = lm_outputs(reloaded, task, rng, folder, checkpoint)
        record["generate"] = dict(LM_GENERATE)
    record["texts"] = texts
    np.savez_compressed(target / "outputs.npz", **out)
    (target / "case.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    size = sum(p.stat().st_size for p in target.iterdir())
    print(f"{name}: {record['parameters']:,} parameters, {size / 1024:.1f} KB", flush=True)
    return {"task": case.task, "covers": case.covers, "files": sorted(p.name for p in target.iterdir()),
            "bytes": size}


def _model_args(model_cfg) -> dict:
    """``cfg.model``: an ``argparse.Namespace`` for fairseq's legacy models (lightconv*, transformer), a config
    for its dataclass models (transformer_lm), which the checkpoint stores as a plain dict."""
    if isinstance(model_cfg, argparse.Namespace):
        return vars(model_cfg)
    return OmegaConf.to_container(model_cfg, resolve=True, enum_to_str=True)


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.cases.split(",") if args.cases else list(matrix.CASES)
    unknown = sorted(set(names) - set(matrix.CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; see scripts/fairseq_parity_cases.py")
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"cases": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            manifest["cases"][name] = make_case(name, pathlib.Path(scratch))
    manifest["cases"] = {n: manifest["cases"][n] for n in matrix.CASES if n in manifest["cases"]}
    manifest.update(fairseq=_version("fairseq"), torch=torch.__version__, made_by="scripts/make_fairseq_parity.py",
                    total_bytes=sum(c["bytes"] for c in manifest["cases"].values()))
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
