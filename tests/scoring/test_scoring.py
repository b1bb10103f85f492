"""Tests of the scoring functions `s(q, k)` and of `scoring.get`."""

import re

import keras
import numpy as np
import pytest

import harness
import numpy_reference
from keras_attention import scoring

SCORERS = ["dot", "scaled_dot", "additive", "bilinear"]
# Scorers with weights accept query and key of different feature sizes.
FREE_DIM_SCORERS = ["additive", "bilinear"]


def _rng(seed=0):
    return np.random.default_rng(seed)


def _inputs(name, leading=(2,), t=3, s=5, seed=0):
    """Query `(*leading, T, Dq)` and key `(*leading, S, Dk)`."""
    dq, dk = (6, 7) if name in FREE_DIM_SCORERS else (6, 6)
    rng = _rng(seed)
    query = rng.normal(size=(*leading, t, dq)).astype("float32")
    key = rng.normal(size=(*leading, s, dk)).astype("float32")
    return query, key


# Layer harness.


# The attention layers run the harness with every scorer inside; here the
# scorers with weights run it alone.
@pytest.mark.parametrize("name", FREE_DIM_SCORERS)
def test_scorer_layer_harness(name):
    query, key = _inputs(name)
    harness.run_layer_test(
        type(scoring.get(name)),
        {},
        inputs={"query": query, "key": key},
        expected_output_shapes=[(2, 3, 5)],
    )


@pytest.mark.parametrize(
    "scorer",
    [
        scoring.DotProduct(name="dot"),
        scoring.ScaledDotProduct(scale=0.25),
        scoring.Additive(units=3, kernel_initializer="ones", bias_initializer="ones"),
        scoring.Bilinear(kernel_initializer="orthogonal", kernel_regularizer="l2"),
    ],
    ids=lambda s: type(s).__name__,
)
def test_config_round_trip_keeps_arguments(scorer):
    harness.check_config_round_trip(scorer)
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(scorer)
    )
    for argument in ("scale", "units"):
        assert getattr(restored, argument, None) == getattr(scorer, argument, None)
    if isinstance(scorer, scoring.Bilinear):
        assert isinstance(restored.kernel_regularizer, keras.regularizers.L2)


# Small cases worked by hand and in numpy.


def test_hand_worked_dot_and_scaled_dot():
    query = np.array([[[1.0, 2.0]]], "float32")  # (1, 1, 2)
    key = np.array([[[3.0, 4.0], [1.0, 0.0], [-2.0, 1.0]]], "float32")  # (1, 3, 2)
    expected = np.array([[[11.0, 1.0, 0.0]]])
    np.testing.assert_allclose(
        harness.to_numpy(scoring.DotProduct()(query, key)), expected
    )
    np.testing.assert_allclose(
        harness.to_numpy(scoring.ScaledDotProduct()(query, key)),
        expected / np.sqrt(2.0),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        harness.to_numpy(scoring.ScaledDotProduct(scale=3)(query, key)),
        3 * expected,
    )


def test_hand_worked_additive():
    # units=1: s(q, k) = v * tanh(q . w_q + k . w_k + b).
    scorer = scoring.Additive(units=1)
    query = np.array([[[1.0, 0.0]]], "float32")
    key = np.array([[[0.0, 1.0], [0.5, 0.5]]], "float32")
    scorer(query, key)
    scorer.query_kernel.assign(np.array([[1.0], [2.0]], "float32"))
    scorer.key_kernel.assign(np.array([[-1.0], [0.5]], "float32"))
    scorer.bias.assign(np.array([0.25], "float32"))
    scorer.score_vector.assign(np.array([2.0], "float32"))
    expected = 2.0 * np.tanh(np.array([1.0 + 0.5 + 0.25, 1.0 - 0.25 + 0.25]))
    np.testing.assert_allclose(
        harness.to_numpy(scorer(query, key))[0, 0], expected, rtol=1e-6
    )


def test_bilinear_with_identity_kernel_is_dot_product():
    query, key = _inputs("dot")
    scorer = scoring.Bilinear(kernel_initializer="identity")
    np.testing.assert_allclose(
        harness.to_numpy(scorer(query, key)),
        harness.to_numpy(scoring.DotProduct()(query, key)),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("leading", [(2,), (2, 3)], ids=["batch", "batch_heads"])
@pytest.mark.parametrize("name", SCORERS)
def test_scores_match_numpy(name, leading):
    query, key = _inputs(name, leading=leading)
    scorer = scoring.get(name)
    scores = harness.to_numpy(scorer(query, key))
    assert scores.shape == (*leading, 3, 5)
    np.testing.assert_allclose(
        scores, numpy_reference.scores(scorer, query, key), rtol=1e-5, atol=1e-5
    )


def test_scaled_dot_product_default_and_explicit_scale():
    query, key = _inputs("scaled_dot", leading=(2, 3))
    dot = harness.to_numpy(scoring.DotProduct()(query, key))
    default = harness.to_numpy(scoring.ScaledDotProduct()(query, key))
    np.testing.assert_allclose(default, dot / np.sqrt(6.0), rtol=1e-5, atol=1e-6)
    explicit = harness.to_numpy(scoring.ScaledDotProduct(scale=0.1)(query, key))
    np.testing.assert_allclose(explicit, 0.1 * dot, rtol=1e-5, atol=1e-6)
    assert scoring.ScaledDotProduct().dot_product_scale(16) == 0.25
    assert scoring.ScaledDotProduct(scale=2).dot_product_scale(16) == 2.0
    assert scoring.DotProduct().dot_product_scale(16) == 1.0
    assert scoring.Additive().dot_product_scale(16) is None
    assert scoring.Bilinear().dot_product_scale(16) is None


def test_weight_names_and_shapes():
    query, key = _inputs("additive")  # Dq = 6, Dk = 7
    additive = scoring.Additive(units=4)
    additive(query, key)
    shapes = {w.name: tuple(w.shape) for w in additive.weights}
    assert shapes == {
        "query_kernel": (6, 4),
        "key_kernel": (7, 4),
        "bias": (4,),
        "score_vector": (4,),
    }
    # The default hidden size is the key feature size.
    default = scoring.Additive()
    default(query, key)
    assert tuple(default.query_kernel.shape) == (6, 7)
    bilinear = scoring.Bilinear()
    bilinear(query, key)
    assert {w.name: tuple(w.shape) for w in bilinear.weights} == {"kernel": (6, 7)}
    assert scoring.DotProduct().weights == []


@pytest.mark.parametrize("name", SCORERS)
def test_symbolic_shape(name):
    query, key = _inputs(name)
    scorer = scoring.get(name)
    q = keras.Input((None, query.shape[-1]))
    k = keras.Input((9, key.shape[-1]))
    assert tuple(scorer(q, k).shape) == (None, None, 9)
    assert scorer.compute_output_shape((2, 3, 5), (2, 9, 7)) == (2, 3, 9)


@pytest.mark.parametrize("name", FREE_DIM_SCORERS)
def test_restored_scorer_gives_same_scores(name):
    query, key = _inputs(name)
    scorer = scoring.get(name)
    expected = harness.to_numpy(scorer(query, key))
    restored = scoring.get(keras.saving.serialize_keras_object(scorer))
    # No build config: the attention layer that owns a scorer builds it.
    assert not restored.built
    restored.build(query.shape, key.shape)
    restored.set_weights(scorer.get_weights())
    np.testing.assert_allclose(harness.to_numpy(restored(query, key)), expected)


def test_serialize_leaves_the_build_to_the_owner():
    query, key = _inputs("bilinear")
    scorer = scoring.Bilinear(kernel_initializer="orthogonal")
    scorer(query, key)
    config = scoring.serialize(scorer)
    assert "build_config" not in config
    unbuilt = scoring.Bilinear(kernel_initializer="orthogonal", name=scorer.name)
    assert config == keras.saving.serialize_keras_object(unbuilt)
    restored = scoring.get(config)
    assert type(restored) is scoring.Bilinear and not restored.built
    assert restored.get_config() == scorer.get_config()


# scoring.get.


@pytest.mark.parametrize(
    "name, cls",
    [
        ("dot", scoring.DotProduct),
        ("scaled_dot", scoring.ScaledDotProduct),
        ("additive", scoring.Additive),
        ("bilinear", scoring.Bilinear),
    ],
)
def test_get_by_name(name, cls):
    scorer = scoring.get(name)
    assert type(scorer) is cls
    # Each call makes a new scorer, so two layers never share weights.
    assert scoring.get(name) is not scorer
    assert scoring.get(name, dtype="mixed_float16").compute_dtype == "float16"


def test_get_returns_the_same_instance():
    scorer = scoring.Additive(units=3)
    assert scoring.get(scorer) is scorer


@pytest.mark.parametrize(
    "scorer",
    [scoring.ScaledDotProduct(scale=0.5), scoring.Additive(units=3)],
    ids=lambda s: type(s).__name__,
)
def test_get_from_config(scorer):
    config = keras.saving.serialize_keras_object(scorer)
    restored = scoring.get(config)
    assert type(restored) is type(scorer)
    assert restored is not scorer
    assert restored.get_config() == scorer.get_config()


@pytest.mark.parametrize("identifier", ["softmax", "Dot", "", "scaled-dot"])
def test_get_unknown_name(identifier):
    with pytest.raises(ValueError, match=rf"Unknown scorer `score='{identifier}'`"):
        scoring.get(identifier)


@pytest.mark.parametrize(
    "identifier",
    [
        None,
        3,
        keras.layers.Dense(2),
        keras.saving.serialize_keras_object(keras.layers.Dense(2)),
    ],
    ids=["none", "int", "layer", "layer_config"],
)
def test_get_rejects_non_scorers(identifier):
    with pytest.raises(ValueError, match=r"Received: score="):
        scoring.get(identifier)


# Error messages.


@pytest.mark.parametrize("units", [0, -1, 2.5, "8", True])
def test_additive_rejects_bad_units(units):
    message = r"`units` must be a positive integer\. Received: units="
    with pytest.raises(ValueError, match=message + re.escape(repr(units))):
        scoring.Additive(units=units)


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), "2", True])
def test_scaled_dot_product_rejects_bad_scale(scale):
    with pytest.raises(ValueError, match=r"`scale` must be None or a positive"):
        scoring.ScaledDotProduct(scale=scale)


@pytest.mark.parametrize("name", ["dot", "scaled_dot"])
def test_dot_products_reject_different_feature_sizes(name):
    query, key = _inputs("additive")  # Dq = 6, Dk = 7
    with pytest.raises(
        ValueError,
        match=r"`query` and `key` must have the same feature size.*"
        r"query feature size=6, key feature size=7",
    ):
        scoring.get(name)(query, key)


@pytest.mark.parametrize("name", SCORERS)
def test_query_and_key_of_different_ranks(name):
    query, key = _inputs(name, leading=(2, 3))
    with pytest.raises(ValueError, match=r"`query` must have rank 3"):
        scoring.get(name)(query, key[0])


# Keras's projection-free scores (`keras.layers.Attention`, `AdditiveAttention`).

KERAS_SCORERS = [
    scoring.DotProduct(use_scale=True),
    scoring.Concat(),
    scoring.Concat(use_scale=True),
    scoring.UnprojectedAdditive(),
    scoring.UnprojectedAdditive(use_scale=False),
]
KERAS_IDS = ["dot-scale", "concat", "concat-scale", "additive", "additive-unscaled"]


def test_hand_worked_concat_and_unprojected_additive():
    # q = (1, 0), k = (0, 1) and (1, 0): sums (1, 1) and (2, 0).
    q = np.array([[[1.0, 0.0]]], "float32")
    k = np.array([[[0.0, 1.0], [1.0, 0.0]]], "float32")
    t1, t2 = np.tanh(1.0), np.tanh(2.0)
    np.testing.assert_allclose(
        harness.to_numpy(scoring.Concat()(q, k)), [[[2 * t1, t2]]], atol=1e-6
    )
    additive = scoring.UnprojectedAdditive()
    additive.build(q.shape, k.shape)
    additive.scale.assign(np.array([2.0, -1.0], "float32"))
    np.testing.assert_allclose(
        harness.to_numpy(additive(q, k)), [[[2 * t1 - t1, 2 * t2]]], atol=1e-6
    )
    dot = scoring.DotProduct(use_scale=True)
    dot.build(q.shape, k.shape)
    dot.scale.assign(3.0)
    np.testing.assert_allclose(harness.to_numpy(dot(q, k)), [[[0.0, 3.0]]], atol=1e-6)


@pytest.mark.parametrize("scorer", KERAS_SCORERS, ids=KERAS_IDS)
def test_keras_scorers_round_trip_and_weights(scorer):
    config = keras.saving.serialize_keras_object(scorer)
    restored = scoring.get(config)
    assert type(restored) is type(scorer)
    assert restored.get_config() == scorer.get_config()
    query, key = _inputs("dot")
    restored(query, key)
    names = sorted(w.name for w in restored.weights)
    expected = {
        "DotProduct": ["scale"],
        "Concat": ["concat_score_weight"] + (["scale"] if scorer.use_scale else []),
        "UnprojectedAdditive": ["scale"] if scorer.use_scale else [],
    }[type(scorer).__name__]
    assert names == sorted(expected)
    # A learned scale is a tensor: the fused kernels (float scales) are not taken.
    assert restored.dot_product_scale(6) is None


@pytest.mark.parametrize("cls", [scoring.Concat, scoring.UnprojectedAdditive])
def test_keras_scorers_reject_bad_arguments(cls):
    with pytest.raises(ValueError, match=r"`use_scale` must be True or False.*use_scale='yes'"):
        cls(use_scale="yes")
    query, key = _inputs("dot")
    with pytest.raises(ValueError, match=r"feature size"):
        cls()(query, key[..., :4])
