"""The fairseq parity matrix (issue 29): every case of tests/fixtures/fairseq_parity, a tiny fairseq 0.12.2 model
for one flag or pair of flags, imported as a user imports it (``python -m lconv.import_fairseq``, then
``lconv.load``), gives fairseq's teacher-forced log-probabilities (1e-5, relative below -1), its greedy and
beam-4 n-best lists token for token (scores 1e-4) and, for language models, fairseq-eval-lm's perplexity (0.1%)
and its greedy continuation. The references are fairseq's own outputs (scripts/make_fairseq_parity.py;
docs/fairseq.md shows the matrix); fairseq is not needed here.

A case lconv cannot import yet fails with the importer's one-line refusal: that is the matrix's point.
"""
from __future__ import annotations

import fairseq_parity as parity
import pytest

CASES = parity.manifest()["cases"]
TRANSLATION = [name for name, c in CASES.items() if c["task"] == "translation"]
LANGUAGE_MODELS = [name for name, c in CASES.items() if c["task"] == "language_modeling"]


def by_case(names: list[str]) -> list:
    """One xdist group per case: its tests run on one worker, so each case is imported and compiled once."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(f"fairseq_parity_{name}")) for name in names]


@pytest.fixture(scope="session")
def imported(tmp_path_factory):
    """Each case imported once (on first use) and loaded; an import that fails is kept and re-raised."""
    root = tmp_path_factory.mktemp("fairseq_parity")
    models: dict[str, object] = {}

    def get(name: str):
        if name not in models:
            try:
                models[name] = parity.import_case(name, str(root / name))
            except Exception as err:  # noqa: BLE001 - re-raised by every test of the case
                models[name] = err
        if isinstance(models[name], Exception):
            raise models[name]
        return models[name]

    return get


def test_the_manifest_lists_every_case_folder():
    folders = sorted(p.name for p in parity.FIXTURES.iterdir() if p.is_dir())
    assert folders == sorted(CASES)
    for name, entry in CASES.items():
        assert sorted(p.name for p in (parity.FIXTURES / name).iterdir()) == entry["files"], name


@pytest.mark.slow  # imports and compiles each of 50 models: ~16 min for the file on one core; CI runs it
@pytest.mark.parametrize("name", by_case(list(CASES)))
def test_log_probabilities_are_fairseqs(imported, name):
    difference = parity.lprobs_difference(imported(name), name)
    assert parity.within_float32(difference), \
        f"{name}: max |lconv - fairseq| / max(1, |fairseq|) log-prob = {difference:.3g}"


@pytest.mark.slow  # compiles a beam search per case and beam size (~6 s each)
@pytest.mark.parametrize("beams", [1, 4])
@pytest.mark.parametrize("name", by_case(TRANSLATION))
def test_greedy_and_beam_search_are_fairseqs(imported, name, beams):
    found = parity.search_differences(imported(name), name, beams)
    assert not found["differing"], f"{name}, beam {beams}: {found['differing'][:2]}"
    assert found["score"] <= 1e-4 and found["token_score"] <= 1e-4, (name, beams, found)


@pytest.mark.slow  # compiles each LM
@pytest.mark.parametrize("name", by_case(LANGUAGE_MODELS))
def test_perplexity_is_fairseq_eval_lms(imported, name):
    found = parity.perplexity_difference(imported(name), name)
    assert found["lconv_tokens"] == found["fairseq_tokens"], found
    assert found["relative"] <= 1e-3, found


@pytest.mark.slow  # compiles each LM's generator
@pytest.mark.parametrize("name", by_case(LANGUAGE_MODELS))
def test_greedy_continuation_is_fairseqs(imported, name):
    ours, theirs = parity.greedy_continuations(imported(name), name)
    assert ours == theirs


TRAINED = parity.FIXTURES.parent / "fairseq_parity_trained" / "side_ffn"
SHARED = parity.FIXTURES.parent / "fairseq"  # the same DDTP split, SentencePiece model and dictionary


@pytest.mark.slow  # imports a trained model and beam-searches 200 sentences
def test_a_trained_per_side_checkpoint_translates_as_fairseq_generate(tmp_path):
    """A lightconv model trained by fairseq-train whose decoder FFN is twice the encoder's (meta.json) gives
    fairseq-generate's translations of the 200 test sentences (>= 90% identical lines) and its sacreBLEU (0.3)."""
    import json

    import sacrebleu

    import lconv
    from lconv.interop import fairseq_workdir

    def lines(path):
        return path.read_text(encoding="utf-8").splitlines()

    meta = json.loads((TRAINED / "meta.json").read_text())
    workdir = str(tmp_path / "side_ffn")
    fairseq_workdir.import_checkpoint(str(TRAINED / "checkpoint_last.pt"), str(SHARED / "dict.txt"),
                                      str(SHARED / "spm.model"), workdir,
                                      decode={"beam_size": 4, "lenpen": 1.0, "max_len_a": 1.2, "max_len_b": 10})
    ours = lconv.load(workdir).translate(lines(SHARED / "test.src"))
    theirs = lines(TRAINED / "generate.txt")
    identical = sum(a == b for a, b in zip(ours, theirs))
    assert identical >= 180, [(a, b) for a, b in zip(ours, theirs) if a != b][:3]
    bleu = sacrebleu.corpus_bleu(ours, [lines(SHARED / "test.ref")]).score
    assert abs(bleu - meta["sacrebleu"]) <= 0.3, (bleu, meta["sacrebleu"])
