"""Tests of `Attention` and `AdditiveAttention`, the drop-ins for Keras's.

Shape legend: `B` batch, `T` query length, `S` key length, `D` feature size.

Keras's own test files run against these layers in `test_keras_suite.py`;
here: the scores against numpy, the layers against Keras's with copied
weights (`from_keras`), the package's rules where they differ from Keras's
(a masked query's weights, float masks), inputs of rank 4, saving.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import scoring
from keras_attention.layers import AdditiveAttention
from keras_attention.layers import Attention
from keras_attention.layers import SoftAttention

B, T, S, D = 2, 3, 4, 5
TOLERANCE = 1e-5


def normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numpy_scores(layer, q, k):
    """The docstrings' scores in float64, from the layer's own weights."""
    q, k = q.astype("float64"), k.astype("float64")
    score = layer.score
    pairs = q[..., :, None, :] + k[..., None, :, :]  # (..., T, S, D)
    if isinstance(score, scoring.DotProduct):
        scale = float(harness.to_numpy(score.scale)) if score.use_scale else 1.0
        return scale * q @ np.swapaxes(k, -1, -2)
    if isinstance(score, scoring.Concat):
        scale = float(harness.to_numpy(score.scale)) if score.use_scale else 1.0
        weight = float(harness.to_numpy(score.concat_score_weight))
        return weight * np.tanh(scale * pairs).sum(-1)
    vector = harness.to_numpy(score.scale) if score.use_scale else 1.0
    return (vector * np.tanh(pairs)).sum(-1)


LAYERS = [
    (Attention, {}),
    (Attention, {"use_scale": True}),
    (Attention, {"score_mode": "concat"}),
    (Attention, {"score_mode": "concat", "use_scale": True}),
    (AdditiveAttention, {}),
    (AdditiveAttention, {"use_scale": False}),
]
IDS = ["dot", "dot-scale", "concat", "concat-scale", "additive", "additive-unscaled"]


def _randomized(cls, kwargs, q, v, k):
    layer = cls(**kwargs)
    layer([q, v, k])
    for i, weight in enumerate(layer.weights):
        weight.assign(normal(tuple(weight.shape), seed=10 + i) + 1.0)
    return layer


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=IDS)
def test_matches_numpy_reference(cls, kwargs):
    q, v, k = normal((B, T, D)), normal((B, S, D + 2), 1), normal((B, S, D), 2)
    layer = _randomized(cls, kwargs, q, v, k)
    output, weights = layer([q, v, k], return_attention_scores=True)
    expected_weights = softmax(numpy_scores(layer, q, k))
    np.testing.assert_allclose(harness.to_numpy(weights), expected_weights, atol=TOLERANCE)
    np.testing.assert_allclose(
        harness.to_numpy(output), expected_weights @ v, atol=TOLERANCE
    )


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=IDS)
def test_from_keras_equals_keras(cls, kwargs):
    q, v, k = normal((B, T, D)), normal((B, S, D), 1), normal((B, S, D), 2)
    peer = getattr(keras.layers, cls.__name__)(**kwargs, name="peer")
    peer([q, v, k])
    for i, weight in enumerate(peer.weights):
        weight.assign(normal(tuple(weight.shape), seed=20 + i) + 1.0)
    ours = cls.from_keras(peer)
    assert type(ours) is cls and ours.name == "peer"
    for name in ("use_scale", "dropout", "seed"):
        assert getattr(ours, name) == peer.get_config()[name]
    # Padding of the values, a causal mask: no query is fully masked.
    value_mask = np.array([[True, True, False, True], [True, True, True, False]])
    for call in (
        dict(),
        dict(mask=[None, value_mask]),
        dict(use_causal_mask=True),
    ):
        inputs = [q, v, k] if "use_causal_mask" not in call else [v, v, k]
        theirs = peer(inputs, return_attention_scores=True, **call)
        mine = ours(inputs, return_attention_scores=True, **call)
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(
                harness.to_numpy(a), harness.to_numpy(b), atol=TOLERANCE
            )


def test_from_keras_refuses_other_layers():
    peer = keras.layers.AdditiveAttention()
    peer([normal((1, 2, 3)), normal((1, 2, 3))])
    with pytest.raises(ValueError, match=r"AdditiveAttention.from_keras.*layer="):
        Attention.from_keras(peer)
    with pytest.raises(ValueError, match=r"must be a keras.layers.AdditiveAttention"):
        AdditiveAttention.from_keras(keras.layers.Attention())
    with pytest.raises(ValueError, match=r"must be built.*unbuilt layer 'fresh'"):
        Attention.from_keras(keras.layers.Attention(name="fresh"))


@pytest.mark.parametrize("cls, kwargs", LAYERS[1::2], ids=IDS[1::2])
def test_rank_4_inputs_equal_keras_and_the_rank_3_calls(cls, kwargs):
    q, v = normal((B, 3, T, D)), normal((B, 3, S, D), 1)
    query_mask = np.random.default_rng(3).random((B, 3, T)) > 0.3
    value_mask = np.ones((B, 3, S), bool)
    value_mask[:, :, 1] = False
    peer = getattr(keras.layers, cls.__name__)(**kwargs)
    peer([q, v])
    ours = cls.from_keras(peer)
    output, weights = ours([q, v], mask=[query_mask, value_mask], return_attention_scores=True)
    assert tuple(output.shape) == (B, 3, T, D)
    assert tuple(weights.shape) == (B, 3, T, S)
    # Keras's layer takes rank-4 inputs, but not rank-4 masks.
    np.testing.assert_allclose(
        harness.to_numpy(ours([q, v])), harness.to_numpy(peer([q, v])), atol=TOLERANCE
    )
    # Each slice of the extra axis is a rank-3 call, masks included.
    for i in range(3):
        sliced = ours([q[:, i], v[:, i]], mask=[query_mask[:, i], value_mask[:, i]])
        np.testing.assert_allclose(
            harness.to_numpy(sliced), harness.to_numpy(output)[:, i], atol=TOLERANCE
        )


def test_symbolic_rank_4_and_several_lengths():
    query = keras.Input((2, None, D))
    value = keras.Input((2, None, D))
    output, weights = AdditiveAttention()([query, value], return_attention_scores=True)
    assert tuple(output.shape) == (None, 2, None, D)
    assert tuple(weights.shape) == (None, 2, None, None)
    model = keras.Model([query, value], output)
    for t, s in ((3, 4), (5, 2)):
        got = model([normal((1, 2, t, D)), normal((1, 2, s, D))])
        assert tuple(got.shape) == (1, 2, t, D)


@pytest.mark.parametrize("cls", [Attention, AdditiveAttention])
def test_masked_query_gives_zero_weights_and_output(cls):
    # Keras gives the masked query the softmax over the values as its
    # weights; here it attends to nothing (README, "Coming from Keras").
    q, v = normal((1, 2, D)), normal((1, S, D), 1)
    output, weights = cls()(
        [q, v], mask=[np.array([[True, False]]), None], return_attention_scores=True
    )
    assert np.all(harness.to_numpy(weights)[0, 1] == 0)
    assert np.all(harness.to_numpy(output)[0, 1] == 0)
    np.testing.assert_allclose(harness.to_numpy(weights)[0, 0].sum(), 1.0, atol=1e-6)
    # All values masked: every query attends to nothing.
    output = cls()([q, v], mask=[None, np.zeros((1, S), bool)])
    assert np.all(harness.to_numpy(output) == 0)


@pytest.mark.parametrize("cls", [Attention, AdditiveAttention])
def test_masked_nan_values_do_not_leak(cls):
    q, v = normal((1, T, D)), normal((1, S, D), 1)
    value_mask = np.array([[True, True, False, True]])
    layer = cls()
    clean = layer([q, v], mask=[None, value_mask])
    v[0, 2] = np.nan
    poisoned = layer([q, v], mask=[None, value_mask])
    np.testing.assert_array_equal(harness.to_numpy(poisoned), harness.to_numpy(clean))


def test_keras_masks_propagate_and_are_read():
    ids = np.array([[3, 4, 0], [5, 0, 0]])
    embedding = keras.layers.Embedding(8, D, mask_zero=True)
    x = embedding(ids)
    layer = Attention()
    output = layer([x, x])
    explicit = Attention()([x, x], mask=[ids != 0, ids != 0])
    np.testing.assert_array_equal(harness.to_numpy(output), harness.to_numpy(explicit))
    np.testing.assert_array_equal(
        harness.to_numpy(layer.compute_mask([x, x], [ids != 0, ids != 0])), ids != 0
    )
    assert np.all(harness.to_numpy(output)[1, 1:] == 0)


def test_float_masks_are_refused():
    q = normal((1, T, D))
    with pytest.raises(TypeError, match=r"`value_mask` must be a boolean.*float32"):
        Attention()([q, q], mask=[None, np.ones((1, T), "float32")])
    with pytest.raises(TypeError, match=r"`query_mask` must be a boolean.*float64"):
        Attention().compute_mask([q, q], [np.ones(T), None])


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"score_mode.*score_mode='general'"):
        Attention(score_mode="general")
    with pytest.raises(ValueError, match=r"`use_scale` must be True or False.*use_scale=1"):
        Attention(use_scale=1)
    with pytest.raises(ValueError, match=r"`dropout` must be a float in \[0, 1\).*dropout=1.0"):
        AdditiveAttention(dropout=1.0)
    q = normal((1, T, D))
    with pytest.raises(ValueError, match=r"must be called on a list.*shape \(1, 3, 5\)"):
        Attention()(q)
    with pytest.raises(ValueError, match=r"`query` must have rank 3.*\(3, 5\)"):
        Attention()([q[0], q[0]])
    with pytest.raises(ValueError, match=r"`value` must have rank 3"):
        Attention()([q, q[None]])
    with pytest.raises(ValueError, match=r"`query_mask` must have rank 2.*\(3,\)"):
        Attention()([q, q], mask=[np.ones(T, bool), None])
    with pytest.raises(ValueError, match=r"feature size.*query.*5.*key.*4"):
        AdditiveAttention()([q, q, normal((1, T, 4))])


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=IDS)
def test_config_round_trip_and_keras_names(cls, kwargs):
    layer = cls(**kwargs, dropout=0.25, seed=7)
    harness.check_config_round_trip(layer)
    config = layer.get_config()
    assert "score" not in config
    assert config["use_scale"] == kwargs.get("use_scale", cls is AdditiveAttention)
    assert ("score_mode" in config) == (cls is Attention)
    assert isinstance(layer, SoftAttention)


@pytest.mark.parametrize("cls, kwargs", LAYERS[1::2], ids=IDS[1::2])
def test_saves_and_loads_with_safe_mode(cls, kwargs, tmp_path):
    query, value = keras.Input((None, D)), keras.Input((None, D))
    layer = cls(**kwargs, name="attention")
    model = keras.Model([query, value], layer([query, value]))
    for i, weight in enumerate(model.weights):
        weight.assign(normal(tuple(weight.shape), seed=30 + i))
    q, v = normal((2, T, D)), normal((2, S, D), 1)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.get_layer("attention")) is cls
    np.testing.assert_allclose(
        harness.to_numpy(loaded([q, v])), harness.to_numpy(model([q, v])), atol=1e-6
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("cls, kwargs", LAYERS[1::2], ids=IDS[1::2])
def test_mixed_precision(cls, kwargs, policy):
    q = normal((B, T, D), 5) * 30  # large scores: softmax must run in float32
    layer = cls(**kwargs, dtype=policy)
    output, weights = layer([q, q], return_attention_scores=True)
    compute = policy.split("_")[1]
    assert keras.backend.standardize_dtype(output.dtype) == compute
    assert keras.backend.standardize_dtype(weights.dtype) == compute
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in layer.weights)
    assert np.all(np.isfinite(harness.to_numpy(output).astype("float32")))
    np.testing.assert_allclose(
        harness.to_numpy(weights).astype("float32").sum(-1), 1.0, atol=2e-2
    )


def test_dropout_trains_and_is_off_at_inference():
    q = normal((B, T, D))
    layer = Attention(dropout=0.5, seed=3)
    inference = harness.to_numpy(layer([q, q]))
    np.testing.assert_array_equal(inference, harness.to_numpy(Attention()([q, q])))
    training = harness.to_numpy(layer([q, q], training=True))
    assert not np.allclose(training, inference)


def test_scores_train():
    # The learned scales get gradients through the whole layer.
    query, value = keras.Input((T, D)), keras.Input((S, D))
    layer = Attention(use_scale=True, score_mode="concat")
    model = keras.Model([query, value], layer([query, value]))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    assert len(layer.trainable_weights) == 2
    with harness.trains_every_weight(layer):
        model.train_on_batch([normal((B, T, D)), normal((B, S, D), 1)], normal((B, T, D), 2))
