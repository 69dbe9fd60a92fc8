"""Document streams and the kNN memory threaded through training.

The stream is checked against an independent reconstruction of every row's documents; the train step that
carries the memory is checked against a per-row loop (batch of one, a fresh memory per document, the params of
each step) at the model level; resume restores the memory and the stream exactly."""
import collections

import helpers
import jax
import numpy as np
import pytest
import tiny_config

import lconv
from lconv.data import EOS_ID, PAD_ID, pipeline, sources, stream
from lconv.errors import UserError
from lconv.run import loss_pass, metrics, model_setup, schema
from lconv.train import loop, setup, update


class WordTokenizer:
    """"w17 w3" -> [17, 3]: every document's ids are known to the test."""

    def encode(self, text):
        return np.asarray([int(w[1:]) for w in text.split()], np.int32)


def make_documents(n, seed=0, max_words=30, vocab=64):
    """n documents of 1..max_words words with ids in [4, vocab)."""
    rng = np.random.default_rng(seed)
    return [{"text": " ".join(f"w{t}" for t in rng.integers(4, vocab, rng.integers(1, max_words + 1)))}
            for _ in range(n)]


def expected_tokens(doc):
    return tuple(WordTokenizer().encode(doc["text"]).tolist()) + (EOS_ID,)


def read_back(batches, window):
    """Rebuilds every row's documents from its windows, checking the layout: returns {row: [doc tokens, ...]}."""
    rows = collections.defaultdict(list)
    for batch in batches:
        assert batch["targets"].shape[1] == window
        for r in range(batch["targets"].shape[0]):
            ids, seg, pos = batch["targets"][r], batch["targets_segmentation"][r], batch["targets_position"][r]
            n = int(seg.sum())
            assert set(np.unique(seg)) <= {0, 1} and (seg[:n] == 1).all() and (ids[n:] == PAD_ID).all()
            assert (pos[:n] == np.arange(n)).all() and (pos[n:] == 0).all()  # positions restart per window
            if batch["document_start"][r]:
                assert n > 0
                rows[r].append([])
            elif n:  # a continuation: the row's document so far has not ended
                assert rows[r] and rows[r][-1][-1] != EOS_ID
            if n:
                rows[r][-1].extend(ids[:n].tolist())
            if n < window and n:
                assert ids[n - 1] == EOS_ID  # only a document's last window is padded
    return rows


def test_one_epoch_streams_every_document_whole_once_and_in_order():
    docs = make_documents(40)
    docs[5]["text"] = ""  # no tokens but EOS: skipped and counted
    it = stream.DocumentStream(docs, "text", WordTokenizer(), window=8, rows=3, num_epochs=1, shuffle=False)
    rows = read_back(list(it), window=8)
    streamed = [tuple(d) for r in sorted(rows) for d in rows[r]]
    expected = [expected_tokens(d) for i, d in enumerate(docs) if i != 5]
    assert sorted(streamed) == sorted(expected)  # every document once, whole, untruncated
    for r in rows:  # each row reads its documents in the source order
        order = [expected.index(tuple(d)) for d in rows[r]]
        assert order == sorted(order)
    assert it.stats["stream_documents"] == 39 and it.stats["stream_empty_documents"] == 1


def test_state_restores_the_exact_following_batches_across_epochs():
    docs = make_documents(9, seed=1)
    make = lambda: stream.DocumentStream(docs, "text", WordTokenizer(), window=4, rows=2, seed=3)  # noqa: E731
    it = make()
    for _ in range(23):  # well past the first epoch (~9 * 16 / 4 / 2 steps)
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(20)]
    resumed = make()
    resumed.set_state(state)
    for want, got in zip(expected, (next(resumed) for _ in range(20))):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])
    assert state["epoch"] >= 1
    with pytest.raises(ValueError, match=r"\b2\b.*\b3\b"):
        stream.DocumentStream(docs, "text", WordTokenizer(), window=4, rows=3).set_state(state)


def test_epochs_are_reshuffled_and_processes_read_disjoint_shards():
    docs = make_documents(30, seed=2)
    it = stream.DocumentStream(docs, "text", WordTokenizer(), window=64, rows=1, seed=0)
    first_docs = [tuple(next(it)["targets"][0][:3]) for _ in range(60)]  # one document per window
    assert first_docs[:30] != first_docs[30:] and sorted(first_docs[:30]) == sorted(first_docs[30:])
    seen = []
    for p in range(3):
        shard = stream.DocumentStream(docs, "text", WordTokenizer(), window=8, rows=2, num_epochs=1,
                                      process_index=p, process_count=3)
        seen += [tuple(d) for ds in read_back(list(shard), 8).values() for d in ds]
    assert sorted(seen) == sorted(expected_tokens(d) for d in docs if d["text"])


class CountingTokenizer(WordTokenizer):
    calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def test_eval_set_counts_every_token_once_pads_for_lockstep_and_repeats():
    docs = make_documents(25, seed=3)
    tokenizer = CountingTokenizer()
    eval_set = stream.StreamEvalSet(docs, "text", tokenizer, window=8, rows=4)
    first, second = list(eval_set), list(eval_set)
    assert tokenizer.calls == len(docs)  # tokenised once, by the counting pass; the passes reuse the ids
    assert len(first) == eval_set.num_batches == len(eval_set)
    tokens = sum(int((b["targets_segmentation"] * b["example_weight"][:, None]).sum()) for b in first)
    assert tokens == sum(len(expected_tokens(d)) for d in docs if d["text"])
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["targets"], b["targets"])
    eval_set.num_batches += 2  # another process has more windows: this one pads
    padded = list(eval_set)
    assert len(padded) == len(first) + 2 and not padded[-1]["targets_segmentation"].any()
    assert not padded[-1]["example_weight"].any()


def test_stream_needs_a_language_model():
    config = dict(dataset="ddtp/en_de", stream=True, batch_size=8, eval_batch_size=8)
    with pytest.raises(ValueError, match=r"stream=True.*language model"):
        pipeline.make_datasets(config, WordTokenizer(), process_index=0, process_count=1)
    translation = _knn_config()
    translation.task = "translation"
    with pytest.raises(ValueError, match="config.data.stream=True .* needs task=lm"):
        setup.validate_config(translation)


# ----------------------------------------------------------------------------------------------------------
# The memory through the train step.

VOCAB = 64


def _knn_config(grad_accum_steps=1):
    c = tiny_config.get_config()
    c.task, c.data.stream = "lm", True
    c.data.batch_size, c.data.max_target_length = 4, 8
    c.model.encoder_layers, c.model.decoder_layers = 0, 2
    c.model.decoder_mixer = "knn_memory"
    c.model.mixer_kwargs = {"knn_memory": {"memory_size": 12, "num_neighbors": 4}}  # FIFO evicts
    c.model.dropout = c.model.attention_dropout = c.model.relu_dropout = c.model.weight_dropout = 0.0
    c.optim.learning_rate, c.optim.label_smoothing = 1e-2, 0.0
    c.optim.grad_accum_steps = grad_accum_steps
    c.model.matmul_precision = "highest"  # float32 on every backend: the reference's rows run alone, in other shapes
    return c


def _row_reference(config, model, params_per_step, batches, carry=True):
    """Per step, the summed loss of every row run alone: batch of one, its own memory, a fresh one at each new
    document (or at every window when ``carry`` is False); also each row's final memory."""
    @jax.jit
    def apply(params, memory, row):  # the model's own call, no train_lib helper in between
        logits, updated = model.apply({"params": params, "memory": memory}, row["targets"],
                                      targets_segmentation=row["targets_segmentation"],
                                      targets_position=row["targets_position"], mutable=["memory"])
        return logits, updated["memory"]

    losses, memories = [], {}
    for params, batch in zip(params_per_step, batches):
        total = 0.0
        for r in range(batch["targets"].shape[0]):
            row = {k: v[r:r + 1] for k, v in batch.items()}
            if batch["document_start"][r] or not carry or r not in memories:
                memories[r] = model_setup.init_mixer_state(config, model, 1).collections["memory"]  # init's, one row
            logits, memories[r] = apply(params, memories[r], row)
            total += float(metrics.label_smoothed_loss(logits, row["targets"], row["targets_segmentation"] > 0,
                                                       0.0)["loss"])
        losses.append(total)
    stacked = jax.tree.map(lambda *rows: np.concatenate(rows), *[memories[r] for r in sorted(memories)])
    return np.array(losses), stacked


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_train_step_threads_the_memory_as_a_per_row_loop_does(grad_accum_steps):
    config = schema.validate_config(_knn_config(grad_accum_steps))
    model = model_setup.build_model(config, VOCAB)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    mesh = model_setup.make_mesh(config.mesh, devices=helpers.cpu_devices(2))
    state, shardings = setup.create_state(config, model, mesh, tx)
    assert jax.tree.leaves(state.mixer_state) and all(s.spec[0] == ("data", "fsdp") for s in
                                                      jax.tree.leaves(shardings.mixer_state))
    it = stream.DocumentStream(make_documents(12, seed=4), "text", WordTokenizer(), window=8, rows=4, seed=0)
    train_step = jax.jit(update.make_train_step(config, lr))
    params_per_step, batches, losses = [], [], []
    with jax.set_mesh(mesh):
        for _ in range(10):
            batch = next(it)
            params_per_step.append(jax.device_get(state.params))
            batches.append(batch)
            state, sums = train_step(state, model_setup.global_batch(batch, model_setup.batch_sharding(mesh)))
            losses.append(float(sums["loss"]))
    assert sum(b["document_start"].sum() for b in batches[1:]) >= 4  # documents end and start mid-run
    reference, memory = _row_reference(config, model, params_per_step, batches)
    np.testing.assert_allclose(losses, reference, rtol=2e-5)
    carried = jax.device_get(state.mixer_state.collections["memory"])
    for got, want in zip(jax.tree.leaves(carried), jax.tree.leaves(memory)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-5)
    # The memory matters: forgetting it at every window gives other losses.
    forgetful, _ = _row_reference(config, model, params_per_step, batches, carry=False)
    assert np.abs(forgetful - reference).max() > 1e-3


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_memory_rows_stay_on_their_devices():
    """Compiled on 8 devices, the train and eval steps of a kNN stream model move no memory or scores between
    devices (no all-gather; top-k runs shard by shard): only the all-reduce of loss sums and gradients remains;
    and an eval pass compiles once."""
    import re

    config = _knn_config()
    config.data.batch_size = 8
    config = schema.validate_config(config)
    model = model_setup.build_model(config, VOCAB)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    mesh = model_setup.make_mesh(config.mesh, helpers.cpu_devices(8))
    state, _ = setup.create_state(config, model, mesh, tx)
    sharding = model_setup.batch_sharding(mesh)
    batch = next(stream.DocumentStream(make_documents(16), "text", WordTokenizer(), window=8, rows=8,
                                       with_weights=True))
    eval_step = loss_pass.jit_eval_step(config, mesh)
    memory = model_setup.init_mixer_state(config, model, 8, sharding)
    # A whole stream pass compiles the eval step once: the memory it returns keeps the batch's sharding.
    eval_set = stream.StreamEvalSet(make_documents(16), "text", WordTokenizer(), window=8, rows=8)
    scores = loss_pass.evaluate_loss(eval_step, state.params, state.apply_fn, eval_set, mesh, memory)
    assert len(eval_set) > 2 and scores["tokens"] > 0
    assert eval_step._cache_size() == 1
    with jax.set_mesh(mesh):
        batch = model_setup.global_batch(batch, sharding)
        train_hlo = jax.jit(update.make_train_step(config, lr)).lower(state, batch).compile().as_text()
        eval_hlo = eval_step.lower(state.params, state.apply_fn, batch, memory).compile().as_text()
    collectives = lambda hlo: sorted(set(re.findall(r"(all-gather|all-to-all|all-reduce)[-a-z]*\(", hlo)))  # noqa: E731
    assert collectives(train_hlo) == collectives(eval_hlo) == ["all-reduce"]  # the loss sums (and gradients)


@pytest.fixture
def first_validation_documents(monkeypatch):
    """The validation split cut to its first 100 documents (19k tokens of 610k; the longest is 20 windows of 32,
    so the memory is carried across windows): the runs below check the resume, not the split, and the whole
    split was three quarters of this test's time."""
    whole = sources.get_source

    def first_documents(name, split, *args, **kwargs):
        source, input_key, target_key = whole(name, split, *args, **kwargs)
        return ([source[i] for i in range(100)] if split == "validation" else source), input_key, target_key

    monkeypatch.setattr(sources, "get_source", first_documents)


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_resume_restores_the_memory_and_the_stream(tiny_data, tmp_path, first_validation_documents):
    config = _knn_config()
    config.data.dataset, config.data.data_dir = "ddtp/lm_en", str(tiny_data.data_dir)  # prepared once, shared
    config.data.batch_size, config.data.max_target_length, config.data.eval_batch_size = 8, 32, 16
    config.data.eval_splits = ("validation",)
    config.train.num_steps, config.train.eval_every, config.train.checkpoint_every = 6, 1000, 3
    full = helpers.new_workdir(tiny_data, tmp_path / "full")  # the shared joint tokenizer reads English too
    devices = helpers.cpu_devices(2)  # the memory sharded over two devices, without eight-way overhead on CI's cores
    result = loop.train_and_evaluate(config, str(full), devices=devices)
    assert result["validation"]["tokens"] > 1000
    losses = _read_losses(full)
    # The API scores the same documents as the run's own validation did, its memory carried window by window.
    source, _, text_key = sources.get_source(config.data.dataset, "validation", config.data.data_dir)
    documents = [source[i][text_key] for i in range(len(source))]
    documents = [d.decode() if isinstance(d, bytes) else d for d in documents]
    model = lconv.load(str(full))
    scored = model.perplexity(documents)
    assert scored["tokens"] == result["validation"]["tokens"]
    assert scored["ppl"] == pytest.approx(result["validation"]["ppl"], rel=1e-6)
    # Texts with no token (the stream skips them, as its pipeline does): one line, not an AttributeError
    for texts, per_text, named in (("", False, "texts: nothing to score"), ([" ", ""], False, "texts: nothing"),
                                   ([documents[0], ""], True, "texts[1]: nothing to score")):
        with pytest.raises(UserError) as error:
            model.perplexity(texts, per_text=per_text)
        helpers.one_line_error(error, named)
    with pytest.raises(UserError) as error:  # it was refused in internal words, "logits=False" (r27-37)
        lconv.ensemble([model, lconv.load(str(full))]).perplexity(documents[:2])
    helpers.one_line_error(error, "an ensemble of document-stream LMs", "score each run alone")

    half = helpers.new_workdir(tiny_data, tmp_path / "half")
    config.train.num_steps = 3
    loop.train_and_evaluate(config, str(half), devices=devices)
    config.train.num_steps = 6
    resumed = loop.train_and_evaluate(config, str(half), devices=devices)
    assert _read_losses(half) == losses  # steps 4..6 after the restore equal the uninterrupted run's
    assert resumed["validation"]["ppl"] == pytest.approx(result["validation"]["ppl"], rel=1e-6)


def _read_losses(workdir):
    import json

    with open(workdir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}
