"""Tests of `Seq2SeqTransformer`: the forward pass, cached greedy decoding,
beam search (against brute force), KerasHub's BART weights, saving, errors.

Shape legend: `B` batch, `S` source length, `T` target length, `V` target
vocabulary size, `E` beams.
"""

import itertools
import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import harness
from keras_attention.models import Seq2SeqTransformer

BACKEND = keras.backend.backend()
SOURCE_V, TARGET_V, MAX_S, MAX_T = 13, 11, 12, 10
START, END, PAD = 1, 2, 0


def _model(seed=0, **kwargs):
    config = dict(
        num_encoder_layers=1, num_decoder_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, dropout=0.0,
    )
    config.update(kwargs)
    model = Seq2SeqTransformer(SOURCE_V, TARGET_V, MAX_S, MAX_T, **config)
    model.build()
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        if "float" in keras.backend.standardize_dtype(variable.dtype):
            variable.assign(rng.normal(scale=0.6, size=variable.shape).astype("float32"))
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


def _sources():
    """Two sources: 6 real tokens, and 3 then padding."""
    return np.array([[4, 5, 6, 7, 8, 9], [10, 3, 12, PAD, PAD, PAD]], "int32")


def _logits(model, source, target, **kwargs):
    inputs = {"encoder_token_ids": source, "decoder_token_ids": target, **kwargs}
    return harness.to_numpy(model(inputs)).astype("float64")


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _sequence_log_prob(model, source, sequence, given=1):
    """`sum log p(token)` of `sequence[given:]` given the source and the
    first `given` tokens, by a full pass (every target position real, even
    one holding the pad id)."""
    target = np.asarray(sequence, "int32")[None, :-1]
    logits = _logits(
        model, source[None], target, decoder_padding_mask=np.ones(target.shape, bool)
    )[0]
    log_p = _log_softmax(logits)
    return sum(log_p[t, sequence[t + 1]] for t in range(given - 1, len(sequence) - 1))


def _greedy_by_recomputing(model, source, steps, end=None):
    sequence = [START]
    for _ in range(steps):
        if end is not None and sequence[-1] == end and len(sequence) > 1:
            sequence.append(PAD)
            continue
        if sequence[-1] == PAD:
            sequence.append(PAD)
            continue
        logits = _logits(model, source[None], np.asarray(sequence, "int32")[None])
        sequence.append(int(np.argmax(logits[0, -1])))
    return sequence


# The forward pass.


def test_logits_shape_and_dtype(model):
    logits = _logits(model, _sources(), np.array([[START, 4, 5], [START, 6, PAD]]))
    assert logits.shape == (2, 3, TARGET_V)
    assert np.all(np.isfinite(logits))


def test_decoder_is_causal(model):
    source = _sources()
    target = np.array([[START, 4, 5, 6, 7], [START, 8, 9, 3, 4]], "int32")
    before = _logits(model, source, target)
    changed = target.copy()
    changed[:, 3:] = [[9, 9], [5, 5]]
    after = _logits(model, source, changed)
    np.testing.assert_allclose(after[:, :3], before[:, :3], rtol=1e-5, atol=1e-5)
    assert not np.allclose(after[:, 3:], before[:, 3:], atol=1e-3)


def test_source_padding_changes_nothing(model):
    source = _sources()
    target = np.array([[START, 4, 5], [START, 6, 7]], "int32")
    padded = np.concatenate([source, np.zeros((2, 3), "int32")], axis=1)
    np.testing.assert_allclose(
        _logits(model, padded, target), _logits(model, source, target), rtol=1e-5, atol=1e-5
    )
    # The explicit mask overrides the one derived from the pad id.
    mask = padded != PAD
    np.testing.assert_allclose(
        _logits(model, padded, target, encoder_padding_mask=mask),
        _logits(model, source, target), rtol=1e-5, atol=1e-5,
    )


# Decoding.


def test_cached_greedy_equals_recomputing_every_step(model):
    sources = _sources()
    got = model.generate(sources, max_new_tokens=6, start_token_id=START)
    assert got.shape == (2, 7) and got.dtype == np.int32
    for row, source in zip(got, sources):
        assert row.tolist() == _greedy_by_recomputing(model, source, 6)


@pytest.mark.parametrize("changed", ["value_kernel", "embeddings"])
def test_generation_follows_a_change_of_one_weight(changed):
    """A weight assigned between two calls is read by the second, through
    the compiled loop made at the first: also a weight the fast step
    derives arrays from (the fused Q/K/V kernel, the logits' transposed
    table). The scores tell even where the tokens stay the same."""
    model = _model(seed=3)
    sources = _sources()
    _, before = model.generate(sources, 5, start_token_id=START, return_scores=True)
    if changed == "value_kernel":
        variable = model.decoder.blocks[-1].self_attention.value_dense.kernel
    else:
        variable = model.token_embedding.embeddings
    rng = np.random.default_rng(7)
    variable.assign(rng.normal(scale=0.6, size=variable.shape).astype("float32"))
    sequences, after = model.generate(sources, 5, start_token_id=START, return_scores=True)
    assert np.all(np.abs(after - before) > 1e-3)
    for sequence, score, source in zip(sequences, after, sources):
        assert sequence.tolist() == _greedy_by_recomputing(model, source, 5)
        np.testing.assert_allclose(
            score, _sequence_log_prob(model, source, sequence) / 5, rtol=1e-4
        )


def test_cross_attention_decodes_as_the_full_pass():
    """Greedy decoding through the cross-attention caches gives the tokens
    of recomputing the full pass, and beam search the model's own
    log-probabilities, a source of padding included."""
    model = _model(seed=4)
    sources = np.concatenate([_sources(), np.full((1, 6), PAD, "int32")])
    got = model.generate(sources, max_new_tokens=4, start_token_id=START)
    for row, source in zip(got, sources):
        assert row.tolist() == _greedy_by_recomputing(model, source, 4)
    sequences, scores = model.generate(
        sources, max_new_tokens=4, start_token_id=START, sampling="beam", num_beams=3,
        length_penalty=0.0, return_scores=True,
    )
    for sequence, score, source in zip(sequences, scores, sources):
        np.testing.assert_allclose(
            score, _sequence_log_prob(model, source, sequence), rtol=1e-4, atol=1e-4
        )


def test_end_token_stops_a_row_and_pads_after_it(model):
    source = _sources()
    free = model.generate(source, max_new_tokens=6, start_token_id=START)
    end = int(free[0, 2])  # a token row 0 generates becomes the end
    first = free[0, 1:].tolist().index(end) + 1  # where row 0 first makes it
    got = model.generate(source, max_new_tokens=6, start_token_id=START, end_token_id=end)
    assert got[0, : first + 1].tolist() == free[0, : first + 1].tolist()
    assert np.all(got[0, first + 1 :] == PAD)
    for row, source_row in zip(got, source):
        assert row.tolist() == _greedy_by_recomputing(model, source_row, 6, end=end)


def test_one_beam_is_greedy(model):
    sources = _sources()
    greedy = model.generate(sources, max_new_tokens=5, start_token_id=START)
    beam = model.generate(
        sources, max_new_tokens=5, start_token_id=START, sampling="beam", num_beams=1
    )
    np.testing.assert_array_equal(beam, greedy)


@pytest.mark.parametrize("start", [(1,), (1, 2)], ids=["start_token", "decoder_prompt"])
def test_beam_search_finds_the_best_sequence_by_brute_force(start):
    # V = 4 with the pad id 0, which is never generated: 3 tokens, 3 new
    # tokens, 27 sequences; 9 = 3 ** 2 beams keep every prefix. The start is
    # one id or a decoder prompt of two (BART's).
    small = Seq2SeqTransformer(
        SOURCE_V, 4, MAX_S, 5, num_encoder_layers=1, num_decoder_layers=1,
        num_heads=2, hidden_dim=8, intermediate_dim=16, dropout=0.0,
    )
    small.build()
    rng = np.random.default_rng(5)
    for variable in small.weights:
        variable.assign(rng.normal(scale=1.0, size=variable.shape).astype("float32"))
    sources = _sources()
    sequences, scores = small.generate(
        sources, max_new_tokens=3, start_token_id=list(start), sampling="beam", num_beams=9,
        num_return_sequences=9, length_penalty=0.0, return_scores=True,
    )
    assert sequences.shape == (2, 9, len(start) + 3) and scores.shape == (2, 9)
    for b, source in enumerate(sources):
        everything = {
            start + tail: _sequence_log_prob(small, source, start + tail, given=len(start))
            for tail in itertools.product(range(1, 4), repeat=3)
        }
        ranked = sorted(everything.items(), key=lambda item: -item[1])
        assert tuple(sequences[b, 0]) == ranked[0][0]
        # n-best sorted, and each score the model's own log-probability.
        assert np.all(np.diff(scores[b]) <= 1e-6)
        for sequence, score in zip(sequences[b], scores[b]):
            np.testing.assert_allclose(score, everything[tuple(sequence)], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(scores[b], [s for _, s in ranked[:9]], rtol=1e-4, atol=1e-4)


def test_beam_scores_with_an_end_token_and_a_length_penalty(model):
    sources = _sources()
    sequences, scores = model.generate(
        sources, max_new_tokens=6, start_token_id=START, end_token_id=END,
        sampling="beam", num_beams=4, num_return_sequences=3, length_penalty=0.7,
        return_scores=True,
    )
    assert sequences.shape == (2, 3, 7)
    for b, source in enumerate(sources):
        assert np.all(np.diff(scores[b]) <= 1e-6)
        for sequence, score in zip(sequences[b], scores[b]):
            sequence = sequence.tolist()
            length = sequence.index(END) if END in sequence else len(sequence) - 1
            assert all(t == PAD for t in sequence[length + 1:])
            log_p = _sequence_log_prob(model, source, sequence[: length + 1])
            np.testing.assert_allclose(score, log_p / length**0.7, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampling", ["greedy", "beam"])
def test_a_batch_decodes_as_each_source_alone(model, sampling):
    sources = _sources()
    kwargs = dict(max_new_tokens=5, start_token_id=START, end_token_id=END, sampling=sampling)
    together = model.generate(sources, **kwargs)
    short = sources[1:, :3]  # the second source without its padding
    alone = [model.generate(sources[:1], **kwargs)[0], model.generate(short, **kwargs)[0]]
    np.testing.assert_array_equal(together, np.stack(alone))


def test_greedy_scores_are_the_model_log_probabilities(model):
    sources = _sources()
    ids, scores = model.generate(
        sources, max_new_tokens=4, start_token_id=START, return_scores=True,
        length_penalty=0.0,
    )
    for row, score, source in zip(ids, scores, sources):
        np.testing.assert_allclose(
            score, _sequence_log_prob(model, source, row.tolist()), rtol=1e-4, atol=1e-4
        )


def test_sampling_is_seeded(model):
    kwargs = dict(max_new_tokens=5, start_token_id=START, sampling="top_k", top_k=3)
    first = model.generate(_sources(), seed=3, **kwargs)
    np.testing.assert_array_equal(first, model.generate(_sources(), seed=3, **kwargs))


# Configurations.


def test_paper_defaults():
    model = Seq2SeqTransformer(100, 120, 32, 32)
    assert (model.num_encoder_layers, model.num_decoder_layers, model.num_heads) == (6, 6, 8)
    assert (model.hidden_dim, model.intermediate_dim, model.dropout) == (512, 2048, 0.1)
    assert not model.normalize_first and model.positions == "sinusoidal"
    assert model.scale_embeddings and model.decoder.final_layer_norm is None
    assert not model.decoder.normalize_first  # so no final layer norm


def test_shared_embeddings_and_learned_positions():
    model = Seq2SeqTransformer(
        20, 20, 8, 8, num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
        hidden_dim=8, intermediate_dim=16, share_embeddings=True, positions="learned",
        embedding_layer_norm=True, normalize_first=True,
    )
    model.build()
    assert model.source_token_embedding is model.token_embedding
    names = [w.path for w in model.weights]
    assert sum("embeddings" in n and "token" in n for n in names) == 1
    assert model.decoder.output_layer_norm is not None
    with pytest.raises(ValueError, match=r"`share_embeddings=True` needs one vocabulary"):
        Seq2SeqTransformer(20, 21, 8, 8, share_embeddings=True)


def test_from_keras_hub_bart_reproduces_its_logits():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=17, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=10, dropout=0.0,
    )
    rng = np.random.default_rng(2)
    for variable in backbone.weights:
        variable.assign(rng.normal(scale=0.5, size=variable.shape).astype("float32"))
    ours = Seq2SeqTransformer.from_keras_hub(backbone)
    source = np.array([[3, 4, 5, 6, 1, 1], [7, 8, 9, 10, 11, 12]], "int32")
    target = np.array([[2, 5, 6, 1], [2, 7, 8, 9]], "int32")
    inputs = {
        "encoder_token_ids": source, "encoder_padding_mask": source != 1,
        "decoder_token_ids": target, "decoder_padding_mask": target != 1,
    }
    hidden = backbone(inputs)["decoder_sequence_output"]
    expected = harness.to_numpy(backbone.token_embedding(hidden, reverse=True))
    got = harness.to_numpy(ours(inputs))
    # Real target positions; a padded one attends to nothing here (its
    # output is not used), while KerasHub lets it attend.
    real = target != 1
    np.testing.assert_allclose(got[real], expected[real], rtol=1e-4, atol=1e-4)


def test_keras_file_loads_in_a_fresh_process(model, tmp_path):
    path = tmp_path / "model.keras"
    model.save(path)
    source = _sources()
    target = np.array([[START, 4, 5], [START, 6, 7]], "int32")
    np.savez(tmp_path / "io.npz", source=source, target=target, logits=_logits(model, source, target))
    code = f"""
import numpy as np, keras, keras_attention
model = keras.saving.load_model({str(path)!r})
data = np.load({str(tmp_path / "io.npz")!r})
got = keras.ops.convert_to_numpy(model({{"encoder_token_ids": data["source"], "decoder_token_ids": data["target"]}}))
np.testing.assert_allclose(got, data["logits"], rtol=1e-5, atol=1e-5)
print("ok", type(model).__name__)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["ok", "Seq2SeqTransformer"]
    config = model.get_config()
    json.dumps(config)
    assert Seq2SeqTransformer.from_config(config).get_config() == config


def test_mixed_precision_is_finite():
    model = _model(dtype="mixed_bfloat16")
    logits = _logits(model, _sources(), np.array([[START, 4], [START, 5]]))
    assert np.all(np.isfinite(logits))
    out = model.generate(_sources(), max_new_tokens=3, start_token_id=START, sampling="beam", num_beams=2)
    assert out.shape == (2, 4)


# Errors.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=0, sampling="beam"), r"`num_beams` must be a positive integer"),
        (dict(num_beams=2, num_return_sequences=3, sampling="beam"), r"`num_return_sequences` must be at most `num_beams`"),
        (dict(start_token_id=TARGET_V), r"`start_token_id` must be an id in \[0, 11\)"),
        (dict(end_token_id=-1), r"`end_token_id` must be an id"),
        (dict(max_new_tokens=MAX_T), r"must fit in max_target_length=10\. Received: prompt length 1 \+ max_new_tokens=10"),
        (dict(sampling="nucleus"), r"`sampling` must be one of"),
    ],
    ids=["beams", "return_sequences", "start_id", "end_id", "too_long", "sampling"],
)
def test_generate_rejects_bad_arguments(model, kwargs, message):
    arguments = dict(max_new_tokens=3, start_token_id=START)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        model.generate(_sources(), **arguments)


def test_generate_rejects_bad_sources(model):
    with pytest.raises(ValueError, match=r"`encoder_token_ids` must hold ids in \[0, 13\)"):
        model.generate(np.array([[SOURCE_V]]), 3, start_token_id=START)
    with pytest.raises(ValueError, match=r"`encoder_token_ids` is longer than max_source_length=12"):
        model.generate(np.ones((1, MAX_S + 1), "int32"), 3, start_token_id=START)


@pytest.mark.parametrize("dtype", ["int32", "int64", "int8"])
def test_generate_rejects_negative_ids_of_every_width(model, dtype):
    # The range check reads signed ids as unsigned: a negative id must still
    # be caught (and named), whatever the width.
    source = np.array([[4, -1, 6]], dtype)
    with pytest.raises(ValueError, match=r"`encoder_token_ids` must hold ids in \[0, 13\)\. Received: an id -1"):
        model.generate(source, 2, start_token_id=START)


def test_generate_takes_unsigned_and_strided_sources(model):
    source = _sources()
    expected = model.generate(source, 3, start_token_id=START)
    np.testing.assert_array_equal(model.generate(source.astype("uint16"), 3, start_token_id=START), expected)
    wide = np.repeat(source, 2, axis=1)[:, ::2]  # a view with strides, the same ids
    np.testing.assert_array_equal(model.generate(wide, 3, start_token_id=START), expected)


def test_generate_checks_the_source_mask(model):
    source = _sources()
    mask = source != PAD
    expected = model.generate(source, 3, start_token_id=START, encoder_padding_mask=mask)
    for given in (mask.astype("int32"), keras.ops.convert_to_tensor(mask)):
        np.testing.assert_array_equal(
            model.generate(source, 3, start_token_id=START, encoder_padding_mask=given), expected
        )
    with pytest.raises(TypeError, match=r"`encoder_padding_mask` must be a boolean or integer mask.*float32"):
        model.generate(source, 3, start_token_id=START, encoder_padding_mask=mask.astype("float32"))
    with pytest.raises(ValueError, match=r"`encoder_padding_mask` must have shape \(2, 6\)\. Received: encoder_padding_mask with shape \(2, 5\)"):
        model.generate(source, 3, start_token_id=START, encoder_padding_mask=mask[:, :5])
    with pytest.raises(ValueError, match=r"`encoder_padding_mask` must have rank 2"):
        model.generate(source, 3, start_token_id=START, encoder_padding_mask=mask[0])


def test_generate_returns_writable_int32_numpy(model):
    for out in (
        model.generate(_sources(), 3, start_token_id=START),
        model.generate(_sources(), 3, start_token_id=START, sampling="beam", num_beams=2),
    ):
        assert isinstance(out, np.ndarray) and out.dtype == np.int32
        out[0, 0] = PAD  # the caller's to change
