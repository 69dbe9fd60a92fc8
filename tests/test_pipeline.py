"""Input pipeline: packing invariants against an independent reference, eval batches, checkpoints, sharding."""
import collections
import pathlib
import shutil

import numpy as np
import pytest

from lconv.data import EOS_ID, PAD_ID, pipeline, tokenizer_files


class WordTokenizer:
    """A fake tokenizer: "w17 w3" -> [17, 3]; makes every example's ids known to the test."""

    def encode(self, text):
        return np.asarray([int(w[1:]) for w in text.split()], np.int32)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


def make_source(n, seed=0, max_words=13):
    """n translation examples with distinct first tokens (ids >= 10), random lengths 1..max_words."""
    rng = np.random.default_rng(seed)
    source = []
    for i in range(n):
        src = [10 + i] + list(rng.integers(10, 500, rng.integers(0, max_words)))
        tgt = [10 + i] + list(rng.integers(10, 500, rng.integers(0, max_words)))
        source.append({"src": " ".join(f"w{t}" for t in src).encode(), "tgt": " ".join(f"w{t}" for t in tgt)})
    return source


def expected_examples(source, keys=("src", "tgt")):
    """Reference tokenisation: ids + EOS per example, keyed by the example's first token."""
    tok = WordTokenizer()
    out = {}
    for ex in source:
        ids = [tuple(tok.encode(ex[k].decode() if isinstance(ex[k], bytes) else ex[k]).tolist() + [EOS_ID])
               for k in keys]
        out[ids[-1][0]] = tuple(ids)
    return out


def unpack(batches, features=("inputs", "targets")):
    """Independent reference unpacker: every (row, segment) -> its tokens per feature; checks the layout."""
    found = []
    for batch in batches:
        for row in range(batch["targets"].shape[0]):
            segments_per_feature = []
            for f in features:
                ids, seg, pos = batch[f][row], batch[f"{f}_segmentation"][row], batch[f"{f}_position"][row]
                n = int((seg > 0).sum())
                assert (seg[n:] == 0).all() and (ids[n:] == PAD_ID).all() and (pos[n:] == 0).all()  # pad at end
                segments = {}
                for s in np.unique(seg[:n]):
                    where = np.flatnonzero(seg == s)
                    assert (np.diff(where) == 1).all()  # contiguous
                    assert (pos[where] == np.arange(len(where))).all()  # positions restart per example
                    assert ids[where][-1] == EOS_ID and (ids[where][:-1] != EOS_ID).all()
                    segments[int(s)] = tuple(ids[where].tolist())
                if n:
                    assert sorted(segments) == list(range(1, len(segments) + 1))  # 1, 2, 3 ...
                segments_per_feature.append(segments)
            assert all(set(s) == set(segments_per_feature[0]) for s in segments_per_feature)  # same examples
            for s in segments_per_feature[0]:
                found.append(tuple(seg[s] for seg in segments_per_feature))
    return found


def train_iter(source, rows=4, lengths=None, **kwargs):
    lengths = lengths or {"inputs": 16, "targets": 16}
    kwargs.setdefault("seed", 3)
    return pipeline.make_train_iter(source, "src", "tgt", WordTokenizer(), lengths, rows=rows, read_threads=1,
                                    **kwargs)


def test_packing_keeps_every_token_of_every_example_exactly_once():
    source = make_source(57)
    iterator, stats = train_iter(source, num_epochs=1)
    batches = list(iterator)
    for b in batches:
        assert set(b) == {"inputs", "targets", "inputs_segmentation", "inputs_position", "targets_segmentation",
                          "targets_position"}
        assert all(v.shape == (4, 16) and v.dtype == np.int32 for v in b.values())
    found = unpack(batches)
    assert sorted(found) == sorted(expected_examples(source).values())
    assert stats["train_examples"] == 57 and max(b["targets_segmentation"].max() for b in batches) > 1  # packed


def test_long_examples_are_truncated_or_dropped_and_counted():
    source = make_source(30, max_words=40)
    lengths = {"inputs": 12, "targets": 12}
    long = sum(any(len(ex[k].split()) + 1 > 12 for k in ("src", "tgt")) for ex in source)
    assert long > 0
    _, stats = train_iter(source, lengths=lengths, num_epochs=1)
    batches = list(_)
    assert sum(b["targets_segmentation"].max(axis=1).sum() for b in batches) == 30
    assert stats["train_inputs_truncated"] + stats["train_targets_truncated"] >= long
    iterator, stats = train_iter(source, lengths=lengths, num_epochs=1, drop_long=True)
    assert len(unpack(list(iterator))) == 30 - long and stats["train_dropped_too_long"] == long


def test_language_modelling_batches_have_targets_only():
    source = [{"text": f"w{10 + i} w5 w6".encode()} for i in range(9)]
    iterator, _ = pipeline.make_train_iter(source, None, "text", WordTokenizer(), {"targets": 8}, rows=2, seed=0,
                                           num_epochs=1, read_threads=1)
    batches = list(iterator)
    assert set(batches[0]) == {"targets", "targets_segmentation", "targets_position"}
    assert sorted(unpack(batches, ("targets",))) == sorted(expected_examples(source, ("text",)).values())


def test_unpacked_training_rows_hold_one_example_each():
    source = make_source(11)
    batches = list(train_iter(source, num_epochs=1, pack=False)[0])
    assert all(b["targets_segmentation"].max() <= 1 for b in batches)
    assert sorted(unpack(batches)) == sorted(expected_examples(source).values())


def test_iterator_state_restores_the_exact_following_batches():
    source = make_source(40)
    iterator, _ = train_iter(source)  # repeats forever, reshuffled every epoch
    for _ in range(7):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(12)]  # crosses epoch boundaries
    restored, _ = train_iter(source)
    restored.set_state(state)
    for want in expected:
        got = next(restored)
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_seed_changes_the_order_and_epochs_are_reshuffled():
    source = make_source(40)
    first = [next(train_iter(source, seed=s)[0])["targets"] for s in (1, 2)]
    assert not np.array_equal(*first)
    one_epoch = [e[1][0] for e in unpack(list(train_iter(source, num_epochs=1)[0]))]
    two_epochs = [e[1][0] for e in unpack(list(train_iter(source, num_epochs=2)[0]))]
    assert sorted(two_epochs[40:]) == sorted(one_epoch) and two_epochs[40:] != two_epochs[:40]


def test_process_shards_are_disjoint_and_cover_the_data():
    source = make_source(50)
    shards = []
    for index in range(3):
        iterator, _ = train_iter(source, num_epochs=1, process_index=index, process_count=3)
        shards.append({e[1][0] for e in unpack(list(iterator))})
    assert not (shards[0] & shards[1]) and not (shards[0] & shards[2]) and not (shards[1] & shards[2])
    assert set().union(*shards) == {10 + i for i in range(50)}


@pytest.mark.parametrize("process_count", [1, 3])
def test_eval_batches_keep_every_example_including_the_last_partial_batch(process_count):
    source = make_source(23, max_words=30)
    lengths = {"inputs": 20, "targets": 20}
    eval_sets = [pipeline.make_eval_set(source, "src", "tgt", WordTokenizer(), lengths, rows=5, process_index=p,
                                        process_count=process_count) for p in range(process_count)]
    assert len({len(e) for e in eval_sets}) == 1  # every process runs the same number of eval steps
    seen = collections.Counter()
    truncated = 0
    for eval_set in eval_sets:
        truncated += eval_set.stats["eval_inputs_truncated"] + eval_set.stats["eval_targets_truncated"]
        for batch in eval_set:
            assert batch["inputs"].shape == (5, 20) and batch["example_weight"].shape == (5,)
            real = batch["example_index"] >= 0
            assert (batch["example_weight"] == real).all()
            assert (batch["targets_segmentation"][~real] == 0).all() and (batch["targets"][~real] == 0).all()
            for row in np.flatnonzero(real):
                example = eval_set.examples[batch["example_index"][row]]
                first = WordTokenizer().encode(example["targets"])[0]
                assert batch["targets"][row][0] == first and batch["targets_segmentation"][row][0] == 1
                seen[first] += 1
    assert seen == collections.Counter(10 + i for i in range(23))
    assert truncated == sum(len(ex[k].split()) + 1 > 20 for ex in source for k in ("src", "tgt"))


def test_packed_eval_batches_hold_every_example_once_in_fewer_batches_of_the_same_shape():
    source = make_source(41, max_words=9)
    lengths = {"inputs": 24, "targets": 24}
    eval_set = pipeline.make_eval_set(source, "src", "tgt", WordTokenizer(), lengths, rows=4)
    packed = list(eval_set.packed())
    assert len(packed) == len(eval_set.packed()) < len(eval_set) / 2  # ~3 examples a row here, against one
    assert all(b[k].shape == (4, 24) for b in packed for k in ("inputs", "targets", "targets_position"))
    assert sorted(unpack(packed)) == sorted(expected_examples(source).values())  # each example, whole, once
    for batch in packed:  # rows without an example weigh nothing; the others weigh one
        assert (batch["example_weight"] == (batch["targets_segmentation"] > 0).any(1)).all()


@pytest.fixture(scope="module")
def ddtp_data(tmp_path_factory):
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    root = tmp_path_factory.mktemp("ddtp")
    config = dict(dataset="ddtp/en_zh", data_dir=str(root / "tfds"), vocab_size=2000, batch_size=6,
                  eval_batch_size=8, max_input_length=32, max_target_length=24, tokenizer_max_sentences=2000)
    tokenizer = pipeline.load_or_train_tokenizer(config, str(root / "workdir"))
    return config, tokenizer, pipeline.make_datasets(config, tokenizer, process_index=0, process_count=1)


def test_make_datasets_on_the_bundled_snapshot(ddtp_data):
    config, tokenizer, data = ddtp_data
    batch = next(data.train_iter)
    assert batch["inputs"].shape == (6, 32) and batch["targets"].shape == (6, 24)
    assert (data.input_key, data.target_key) == ("en", "zh")
    test = data.eval_sets["test"]
    assert len(test.examples) == 106  # the documented en_zh test count
    batches = list(test)
    assert len(batches) == 14 and batches[-1]["example_weight"].sum() == 106 - 13 * 8
    row = int(np.flatnonzero(batches[0]["example_index"] == 0)[0])
    assert tokenizer.detokenize(batches[0]["targets"][row]) == test.examples[0]["targets"]


def test_a_new_workdir_reuses_the_tokenizer_trained_for_the_same_data_and_settings(ddtp_data, tmp_path, monkeypatch,
                                                                                    lconv_log):
    """The fixture's run trained en_zh's tokenizer and kept it under data_dir: a second workdir copies it (the same
    bytes, nothing trained), and other settings are another tokenizer, trained."""
    from lconv.data import tokenizer as tokenizer_lib

    config, tokenizer, _ = ddtp_data
    kept = tokenizer_files.kept_dir(config)
    assert tokenizer_lib.load_tokenizer(kept).to_bytes() == tokenizer.to_bytes()
    trained = []
    real_train = tokenizer_lib.train_tokenizer
    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", lambda *a, **k: trained.append(1) or real_train(*a, **k))
    again = pipeline.load_or_train_tokenizer(config, str(tmp_path / "second"))
    assert again.to_bytes() == tokenizer.to_bytes() and not trained
    assert (tmp_path / "second" / "spm.model").read_bytes() == tokenizer.to_bytes()
    assert lconv_log() == [f"tokenizer: {kept}/spm.model reused (trained by an earlier run on the same data and "
                           "settings)"]
    other = {**config, "tokenizer_max_sentences": 1000}
    assert tokenizer_files.kept_dir(other) != kept
    pipeline.load_or_train_tokenizer(other, str(tmp_path / "third"))
    assert trained == [1]


@pytest.mark.parametrize("spoil", ["damaged", "swapped", "another_corpus", "no_record"])
def test_a_kept_tokenizer_that_does_not_fit_is_ignored_said_once_and_kept_anew(ddtp_data, tmp_path, monkeypatch,
                                                                               lconv_log, spoil):
    """The kept tokenizer is a cache, checked before a workdir gets it: a damaged one blocked every run on its
    data_dir, a swapped one was copied into a fresh workdir (which then failed forever), one kept for another
    corpus trained an en_de run without a word. Each is now trained again (stubbed here) and kept with its record."""
    import json
    import os
    import shutil

    from lconv.data import tokenizer as tokenizer_lib

    config, tokenizer, _ = ddtp_data
    real = tokenizer_files.kept_dir(config)
    kept = tmp_path / "kept" / os.path.basename(real)  # a private copy: the fixture's stays as it is
    shutil.copytree(real, kept)
    monkeypatch.setattr(tokenizer_files, "kept_dir", lambda cfg: str(kept))
    record = kept / tokenizer_files.KEPT_RECORD
    if spoil == "damaged":
        (kept / "spm.model").write_bytes(tokenizer.to_bytes()[:100])
    elif spoil == "swapped":
        (kept / "spm.model").write_bytes(tokenizer_lib.train_tokenizer(["a b c d e f g"] * 50, 300).to_bytes())
    elif spoil == "another_corpus":
        record.write_text(json.dumps({**json.loads(record.read_text()), "for": "ddtp_lm_en-0123456789ab-v2000"}))
    else:
        record.unlink()
    trained = []
    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", lambda *a, **k: trained.append(1) or tokenizer)
    again = pipeline.load_or_train_tokenizer(config, str(tmp_path / "workdir"))
    assert trained == [1] and again.to_bytes() == tokenizer.to_bytes()
    (line,) = [m for m in lconv_log() if "not used" in m]
    assert str(kept) in line
    assert tokenizer_files.usable_kept(str(kept), config["vocab_size"]) is not None  # kept anew, with its record
    pipeline.load_or_train_tokenizer(config, str(tmp_path / "next"))
    assert trained == [1]  # the next workdir copies it


def test_too_small_vocabulary_is_a_one_line_error():
    from lconv.data import tokenizer as tokenizer_lib

    with pytest.raises(ValueError, match="vocab_size=300 is smaller"):
        tokenizer_lib.train_tokenizer([chr(0x4E00 + i) * 3 for i in range(400)], vocab_size=300)


def test_make_datasets_rejects_bad_fields(ddtp_data):
    config, tokenizer, _ = ddtp_data
    with pytest.raises(ValueError, match="batch_size=6 is not divisible"):
        pipeline.make_datasets(config, tokenizer, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="train_long"):
        pipeline.make_datasets({**config, "train_long": "skip"}, tokenizer, process_index=0, process_count=1)


def test_a_prepared_catalog_dataset_is_read_without_its_builder_code(ddtp_data, tmp_path):
    config, _, _ = ddtp_data  # the ddtp/en_zh files stand in for a `tfds build` output (copied: a link is refused)
    shutil.copytree(pathlib.Path(config["data_dir"]) / "ddtp" / "en_zh", tmp_path / "ddtp" / "en_zh")
    builder = pipeline.sources._prepared_builder("ddtp/en_zh", str(tmp_path))
    assert len(builder.as_data_source(split="test")) == 106


def _tree(folder):
    """Every file and folder under ``folder``: {relative path: its bytes, or None for a folder}."""
    import os

    found = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = None if os.path.isdir(path) else open(path, "rb").read()
    return found


@pytest.mark.parametrize("victim_holds", ["a_matching_kept_copy", "another_runs_tokenizer"])
@pytest.mark.parametrize("depth", ["tokenizer_folder", "tokenizers", "lconv_prepared"])
def test_a_link_on_the_kept_tokenizers_path_is_neither_read_nor_written_through(ddtp_data, tmp_path, monkeypatch,
                                                                                caplog, depth, victim_holds):
    """A link planted in a shared data_dir at ``lconv_prepared``, ``tokenizers`` or the kept tokenizer's folder had
    a run read a tokenizer from outside data_dir (a kept copy with its record) or replace the one it led to
    (another run's), and a fresh copy prepared through ``lconv_prepared``. The kept cache is now not used (one
    warning naming the link and where it leads; the run's tokenizer is the one it trains); a linked
    ``lconv_prepared``, which holds the data too, is one line. The folder the link leads to is untouched."""
    import hashlib
    import json
    import os
    import shutil

    import helpers

    from lconv.data import tokenizer as tokenizer_lib
    from lconv.errors import UserError

    config, tokenizer, _ = ddtp_data
    shutil.copytree(config["data_dir"], tmp_path / "shared", symlinks=True,  # the prepared copy, no kept tokenizer
                    ignore=shutil.ignore_patterns(tokenizer_files.KEPT_TOKENIZERS))
    config = {**config, "data_dir": str(tmp_path / "shared")}
    kept = tokenizer_files.kept_dir(config)
    link = {"tokenizer_folder": kept, "tokenizers": os.path.dirname(kept),
            "lconv_prepared": os.path.dirname(os.path.dirname(kept))}[depth]
    victim = tmp_path / "victim"
    if depth == "lconv_prepared" and victim_holds == "a_matching_kept_copy":  # another data_dir's, its copy too
        os.rename(link, victim)
    elif depth == "lconv_prepared":  # holds no copy: one was prepared into it
        shutil.rmtree(link)
    target = victim / os.path.relpath(kept, link)  # where the kept copy lands through the link
    target.mkdir(parents=True, exist_ok=True)
    (victim / "precious.txt").write_text("another user's file")
    if victim_holds == "a_matching_kept_copy":  # what an earlier run kept: reused through the link before
        tokenizer.save(str(target))
        (target / tokenizer_files.KEPT_RECORD).write_text(json.dumps({
            "for": os.path.basename(kept), "sha256": hashlib.sha256(tokenizer.to_bytes()).hexdigest(),
            "vocab_size": tokenizer.vocab_size}))
    else:  # another run's workdir: its spm.model was replaced, and a kept.json added
        (target / "spm.model").write_bytes(b"another run's tokenizer")
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(victim, link)
    before = _tree(victim)
    trained_here = tokenizer_lib.train_tokenizer(["a b c d e f g"] * 50, 300)  # not the victim's tokenizer
    trained = []
    monkeypatch.setattr(tokenizer_lib, "train_tokenizer", lambda *a, **k: trained.append(1) or trained_here)

    if depth == "lconv_prepared":
        with pytest.raises(UserError) as info:
            pipeline.load_or_train_tokenizer(config, str(tmp_path / "workdir"))
        helpers.one_line_error(info, link)
        assert not (tmp_path / "workdir" / "spm.model").exists()
    else:
        got = pipeline.load_or_train_tokenizer(config, str(tmp_path / "workdir"))
        assert trained == [1] and got.to_bytes() == trained_here.to_bytes()
        assert (tmp_path / "workdir" / "spm.model").read_bytes() == trained_here.to_bytes()
        said = [record.getMessage() for record in caplog.records if record.name.startswith("lconv")]
        (line,) = [m for m in said if link in m]  # the whole message: lconv_log shortens long paths
        assert f"{link} is a link (to {victim})" in line and "training one for this run" in line
        assert not [m for m in said if "reused" in m]
    assert _tree(victim) == before and os.path.islink(link)
