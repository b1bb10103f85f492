"""Tests of `HardAttention`: argmax and sampled selection, three estimators."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import harness
import numpy_reference as ref
from keras_attention import losses
from keras_attention import scoring
from keras_attention.layers import HardAttention
from keras_attention.layers import SoftAttention

BACKEND = keras.backend.backend()
SCORERS = ["dot", "scaled_dot", "additive", "bilinear"]
# Scorers with weights accept query and key of different feature sizes.
FREE_DIM_SCORERS = ["additive", "bilinear"]
# Every way the layer draws a position in training: all must sample from pi.
DRAWS = 2000
SAMPLERS = [
    {"estimator": "reinforce"},
    {"estimator": "straight_through"},
    {"estimator": "gumbel"},
    {"estimator": "gumbel", "hard": True},
]


def _inputs(score, batch=2, t=3, s=5, dv=4, seed=0):
    """Query `(B, T, Dq)`, key `(B, S, Dk)` and value `(B, S, Dv)`."""
    dq, dk = (6, 7) if score in FREE_DIM_SCORERS else (6, 6)
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, t, dq)).astype("float32")
    key = rng.normal(size=(batch, s, dk)).astype("float32")
    value = rng.normal(size=(batch, s, dv)).astype("float32")
    return query, key, value


def _draws(scale=0.8, seed=3):
    """One example repeated `DRAWS` times: query `(B, 4, 6)`, key `(B, 6, 6)`
    and identity values `(B, 6, 6)`, so the output is the selection itself.

    Every test that draws many samples uses these shapes (one compilation
    of each op on JAX).
    """
    rng = np.random.default_rng(seed)
    query = np.repeat(scale * rng.normal(size=(1, 4, 6)), DRAWS, axis=0)
    key = np.repeat(rng.normal(size=(1, 6, 6)), DRAWS, axis=0)
    value = np.repeat(np.eye(6)[None], DRAWS, axis=0)
    return query.astype("float32"), key.astype("float32"), value.astype("float32")


def _call(layer, query, value, **kwargs):
    """Eager call returning numpy `(output, probabilities, selection)`."""
    outputs = layer(query, value, return_attention_scores=True, **kwargs)
    return harness.to_numpy(outputs)


def _check_is_argmax(index, scores):
    """`index` is numpy's argmax of the float64 `scores`, up to float32 rounding.

    Where the two highest scores are within 1e-4 (random weights can make
    such near-ties), the layer may pick either; elsewhere it must agree.
    """
    top2 = np.sort(scores, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-4
    assert clear.mean() > 0.5
    np.testing.assert_array_equal(index[clear], np.argmax(scores, axis=-1)[clear])
    chosen = np.take_along_axis(scores, index[..., None], axis=-1)[..., 0]
    assert np.all(chosen >= top2[..., 1] - 1e-4)


# Layer harness.


# The training check fits the output alone, so it covers the relaxations;
# REINFORCE trains its scorer through `log_prob` (see tests/test_losses.py).
@pytest.mark.parametrize(
    "init_kwargs, mode, call_kwargs, expected_output_shapes",
    [
        (
            {"score": "additive", "estimator": "gumbel", "temperature": 0.5,
             "seed": 2},
            "key_value",
            {"return_attention_scores": True},
            [(2, 3, 4), (2, 3, 5), (2, 3, 5)],
        ),
        (
            {"score": "bilinear", "estimator": "straight_through", "seed": 3,
             "inference_selection": "sample"},
            "normal",
            {"use_causal_mask": True},
            [(2, 3, 7)],
        ),
    ],
    ids=["additive-gumbel", "bilinear-straight_through"],
)
def test_layer_harness(init_kwargs, mode, call_kwargs, expected_output_shapes):
    query, key, value = _inputs(init_kwargs["score"])
    inputs = {"query": query, "value": value, "key": key}
    if mode == "normal":
        inputs = {"query": query, "value": key}
    harness.run_layer_test(
        HardAttention,
        init_kwargs,
        inputs=inputs,
        call_kwargs=call_kwargs,
        expected_output_shapes=expected_output_shapes,
    )


def test_config_round_trip_with_every_argument():
    schedule = keras.optimizers.schedules.PolynomialDecay(
        1.0, 100, end_learning_rate=0.25
    )
    layer = HardAttention(
        score=scoring.Additive(units=3),
        selection="sample",
        estimator="gumbel",
        temperature=schedule,
        hard=True,
        inference_selection="sample",
        seed=7,
        name="hard",
    )
    harness.check_config_round_trip(layer)
    config = layer.get_config()
    clone = HardAttention.from_config(config)
    for name in ("selection", "estimator", "hard", "inference_selection", "seed"):
        assert getattr(clone, name) == getattr(layer, name)
    assert clone.score.units == 3
    assert clone.temperature.get_config() == schedule.get_config()
    assert HardAttention(temperature=1).get_config()["temperature"] == 1.0


@pytest.mark.parametrize("score", SCORERS)
def test_return_shapes_and_dtypes(score):
    query, key, value = _inputs(score, t=3, s=5, dv=4)
    layer = HardAttention(score=score, seed=0)
    outputs = layer(
        query, value, key=key, return_attention_scores=True, return_log_prob=True
    )
    shapes = [tuple(o.shape) for o in outputs]
    assert shapes == [(2, 3, 4), (2, 3, 5), (2, 3, 5), (2,), (2,)]
    output, log_prob, entropy = layer(query, value, key=key, return_log_prob=True)
    assert tuple(output.shape) == (2, 3, 4) and tuple(log_prob.shape) == (2,)
    assert tuple(layer(query, value, key=key).shape) == (2, 3, 4)
    # Symbolic, at unknown lengths: the selection is (B, T, S), not (B, T, T).
    q = keras.Input((None, query.shape[-1]))
    k = keras.Input((None, key.shape[-1]))
    v = keras.Input((None, 4))
    outputs = HardAttention(score=score)(
        q, v, key=k, return_attention_scores=True, return_log_prob=True
    )
    assert [tuple(o.shape) for o in outputs] == [
        (None, None, 4), (None, None, None), (None, None, None), (None,), (None,)
    ]
    assert [o.dtype for o in outputs[3:]] == ["float32", "float32"]


# Argmax selection: exactly the value row of the highest score.


@pytest.mark.parametrize("score", SCORERS)
def test_argmax_returns_exactly_the_value_of_the_highest_score(score):
    query, key, value = _inputs(score)
    layer = HardAttention(score=score)
    output, probabilities, selection = _call(layer, query, value, key=key)
    scores = ref.scores(layer.score, query, key)  # (B, T, S)
    index = selection.argmax(-1)  # (B, T)
    np.testing.assert_array_equal(selection, np.eye(5)[index])
    _check_is_argmax(index, scores)
    expected = np.take_along_axis(value, index[..., None], axis=1)  # (B, T, Dv)
    np.testing.assert_array_equal(output, expected)
    np.testing.assert_allclose(
        probabilities, ref.masked_softmax(scores), rtol=1e-5, atol=1e-6
    )
    # In training, `selection="argmax"` selects the same rows.
    for estimator in ("reinforce", "straight_through"):
        trained = HardAttention(score=layer.score, selection="argmax",
                                estimator=estimator)
        output, _, selection = _call(trained, query, value, key=key, training=True)
        np.testing.assert_array_equal(output, expected)
        np.testing.assert_array_equal(selection, np.eye(5)[index])


def test_argmax_ties_select_the_first():
    # Keys 1 and 3 are equal and score highest; keys 0 and 4 tie lower.
    query = np.array([[[1.0, 2.0]]], "float32")
    key = np.array(
        [[[0.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]], "float32"
    )
    value = np.arange(10, dtype="float32").reshape(1, 5, 2)
    layer = HardAttention(score="dot")
    output, _, selection = _call(layer, query, value, key=key)
    np.testing.assert_array_equal(selection, [[[0, 1, 0, 0, 0]]])
    np.testing.assert_array_equal(output, value[:, 1:2])
    # With key 1 masked, the first of the remaining maxima is key 3.
    value_mask = np.array([[1, 0, 1, 1, 1]], bool)
    output, _, selection = _call(layer, query, value, key=key, value_mask=value_mask)
    np.testing.assert_array_equal(selection, [[[0, 0, 0, 1, 0]]])
    np.testing.assert_array_equal(output, value[:, 3:4])


def test_inference_is_deterministic_argmax_unless_asked_to_sample():
    query, key, value = _draws(scale=0.3)  # flat: samples differ from the argmax
    expected = _call(HardAttention(score="dot"), query, value, key=key)
    assert np.all(expected[2] == expected[2][:1])  # the same argmax for each copy
    for layer in (HardAttention(score="dot", seed=0),
                  HardAttention(score="dot", estimator="gumbel", seed=0)):
        for training in (None, False):
            for result, want in zip(
                _call(layer, query, value, key=key, training=training), expected
            ):
                np.testing.assert_array_equal(result, want)
    sampling = HardAttention(score="dot", inference_selection="sample", seed=0)
    _, _, sampled = _call(sampling, query, value, key=key)
    assert not np.array_equal(sampled, expected[2])
    assert np.all(sampled.sum(-1) == 1)


# Sampling: the empirical frequencies are the attention distribution.


@pytest.mark.parametrize(
    "init_kwargs", SAMPLERS, ids=lambda kw: "-".join(map(str, kw.values()))
)
def test_sample_frequencies_match_the_distribution(init_kwargs):
    query, key, value = _draws()  # each query row drawn DRAWS times
    value_mask = np.ones((DRAWS, 6), bool)
    value_mask[:, 2] = False
    query_mask = np.ones((DRAWS, 4), bool)
    query_mask[:, 3] = False  # query 3 attends to nothing
    layer = HardAttention(score="dot", seed=11, **init_kwargs)
    output, probabilities, selection = _call(
        layer, query, value, key=key, value_mask=value_mask, query_mask=query_mask,
        training=True,
    )
    mask = value_mask[:, None, :] & query_mask[:, :, None]
    expected = ref.masked_softmax(ref.scores(layer.score, query, key), mask)[0]
    np.testing.assert_allclose(probabilities[0], expected, rtol=1e-5, atol=1e-6)
    # One-hot rows; masked positions are never drawn; query 3 draws nothing.
    assert set(np.unique(selection)) == {0.0, 1.0}
    np.testing.assert_array_equal(selection[:, :3].sum(-1), 1.0)
    assert np.all(selection[:, :, 2] == 0)
    assert np.all(selection[:, 3] == 0) and np.all(output[:, 3] == 0)
    frequencies = selection.mean(axis=0)  # (T, S)
    for row in range(3):
        allowed = expected[row] > 0
        counts = selection[:, row, allowed].sum(0)
        want = DRAWS * expected[row, allowed]
        chi_square = np.sum((counts - want) ** 2 / want)
        # 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
        assert chi_square < 18.47, (row, counts, want)
        # About 4 standard deviations of a frequency near 0.3.
        np.testing.assert_allclose(frequencies[row], expected[row], atol=0.04)
    if init_kwargs["estimator"] != "gumbel" or init_kwargs.get("hard"):
        np.testing.assert_array_equal(output, selection)


def test_sampling_is_reproducible_with_a_seed():
    query, key, value = _draws(scale=0.3)

    def draw(layer):
        return _call(layer, query, value, key=key, training=True)[2]

    first = HardAttention(score="dot", seed=5)
    again = HardAttention(score="dot", seed=5)
    selections = [draw(first), draw(first)]
    np.testing.assert_array_equal(draw(again), selections[0])
    np.testing.assert_array_equal(draw(again), selections[1])
    # Each call draws anew.
    assert not np.array_equal(selections[0], selections[1])
    assert not np.array_equal(draw(HardAttention(score="dot", seed=6)), selections[0])


# Straight-through: hard forward, the soft distribution's gradient backward.


@pytest.mark.parametrize(
    "score, selection", [("additive", "sample"), ("bilinear", "argmax")]
)
def test_straight_through_forward_is_hard_and_gradient_is_soft(score, selection):
    query, key, value = _inputs(score, t=3, s=5, dv=4)
    cotangent = np.random.default_rng(4).normal(size=(2, 3, 4)).astype("float32")
    hard = HardAttention(score=score, estimator="straight_through",
                         selection=selection, seed=1)
    soft = SoftAttention(score=score)
    hard(query, value, key=key)
    soft(query, value, key=key)
    soft.set_weights(hard.get_weights())

    output, _, picked = _call(hard, query, value, key=key, training=True)
    np.testing.assert_array_equal(output, np.einsum("bts,bsd->btd", picked, value))

    def loss(layer, **kwargs):
        return lambda: keras.ops.sum(
            keras.ops.multiply(layer(query, value, key=key, **kwargs), cotangent)
        )

    hard_grads = harness.variable_gradients(
        loss(hard, training=True), hard.score.trainable_weights
    )
    soft_grads = harness.variable_gradients(loss(soft), soft.score.trainable_weights)
    for h, s in zip(hard_grads, soft_grads):
        assert np.any(np.abs(h) > 1e-4)
        np.testing.assert_allclose(h, s, rtol=1e-5, atol=1e-6)


def test_straight_through_temperature_scales_the_soft_gradient():
    # The backward pass is that of softmax(q.k / temperature): soft attention
    # with a scaled dot product of scale 1 / temperature.
    query, key, value = _inputs("dot")
    cotangent = np.random.default_rng(5).normal(size=(2, 3, 4)).astype("float32")
    query_variable = keras.Variable(query)
    hard = HardAttention(score="dot", estimator="straight_through",
                         temperature=2.0, seed=0)
    soft = SoftAttention(score=scoring.ScaledDotProduct(scale=0.5))

    def loss(layer, **kwargs):
        return lambda: keras.ops.sum(
            keras.ops.multiply(
                layer(query_variable.value, value, key=key, **kwargs), cotangent
            )
        )

    (hard_grad,) = harness.variable_gradients(
        loss(hard, training=True), [query_variable]
    )
    (soft_grad,) = harness.variable_gradients(loss(soft), [query_variable])
    assert np.any(np.abs(hard_grad) > 1e-4)
    np.testing.assert_allclose(hard_grad, soft_grad, rtol=1e-5, atol=1e-6)


# Gumbel-softmax: the relaxation sharpens as the temperature falls.


def test_gumbel_soft_sample_approaches_one_hot_at_low_temperature():
    query, key, value = _draws()
    sharpness = {}
    for temperature in (1.0, 0.1, 0.01):
        layer = HardAttention(score="dot", estimator="gumbel",
                              temperature=temperature, seed=3)
        relaxed, _, selection = _call(layer, query, value, key=key, training=True)
        # Values are the identity: the output is the relaxed sample y itself.
        np.testing.assert_allclose(relaxed.sum(-1), 1.0, rtol=1e-5)
        # The same seed draws the same Gumbel noise, so the same selection.
        np.testing.assert_array_equal(relaxed.argmax(-1), selection.argmax(-1))
        sharpness[temperature] = np.mean(relaxed.max(-1) > 0.99)
    assert sharpness[1.0] < 0.5
    assert sharpness[1.0] < sharpness[0.1] < sharpness[0.01]
    assert sharpness[0.01] > 0.95


def test_hard_gumbel_is_exactly_one_hot_with_a_soft_gradient():
    query, key, value = _inputs("bilinear")
    layer = HardAttention(score="bilinear", estimator="gumbel", hard=True,
                          temperature=0.5, seed=3)
    output, _, selection = _call(layer, query, value, key=key, training=True)
    assert set(np.unique(selection)) == {0.0, 1.0}
    np.testing.assert_array_equal(selection.sum(-1), 1.0)
    np.testing.assert_array_equal(output, np.einsum("bts,bsd->btd", selection, value))
    cotangent = np.random.default_rng(6).normal(size=output.shape).astype("float32")
    (grad,) = harness.variable_gradients(
        lambda: keras.ops.sum(
            keras.ops.multiply(layer(query, value, key=key, training=True), cotangent)
        ),
        [layer.score.kernel],
    )
    assert np.all(np.isfinite(grad)) and np.any(np.abs(grad) > 1e-4)


def test_temperature_schedule_anneals_with_training_calls(tmp_path):
    schedule = keras.optimizers.schedules.PolynomialDecay(
        1.0, 4, end_learning_rate=0.5
    )
    layer = HardAttention(score="dot", estimator="gumbel", temperature=schedule,
                          seed=0, name="hard")
    query, key, value = _inputs("dot")
    layer(query, value, key=key)  # inference: no step
    assert int(harness.to_numpy(layer.iterations)) == 0
    temperatures = []
    for _ in range(6):
        temperatures.append(float(harness.to_numpy(layer.current_temperature())))
        layer(query, value, key=key, training=True)
    np.testing.assert_allclose(
        temperatures, [1.0, 0.875, 0.75, 0.625, 0.5, 0.5], rtol=1e-6
    )
    assert int(harness.to_numpy(layer.iterations)) == 6
    # The step is saved with the model.
    inputs = [keras.Input((3, 6)), keras.Input((5, 6)), keras.Input((5, 4))]
    model = keras.Model(inputs, layer(inputs[0], inputs[2], key=inputs[1]))
    path = str(tmp_path / "annealed.keras")
    model.save(path)
    restored = keras.saving.load_model(path).get_layer("hard")
    assert int(harness.to_numpy(restored.iterations)) == 6
    assert float(harness.to_numpy(restored.current_temperature())) == 0.5


# Log-probability and entropy of what was selected.


@pytest.mark.parametrize("score", ["dot", "bilinear"])
def test_log_prob_and_entropy_match_numpy(score):
    query, key, value = _inputs(score)
    value_mask = np.array([[1, 1, 1, 0, 1], [0, 0, 0, 0, 0]], bool)
    query_mask = np.array([[1, 1, 0], [1, 1, 1]], bool)
    layer = HardAttention(score=score, seed=2)
    _, probabilities, selection, log_prob, entropy = harness.to_numpy(
        layer(query, value, key=key, value_mask=value_mask, query_mask=query_mask,
              return_attention_scores=True, return_log_prob=True, training=True)
    )
    mask = query_mask[:, :, None] & value_mask[:, None, :]
    pi = ref.masked_softmax(ref.scores(layer.score, query, key), mask)
    with np.errstate(divide="ignore"):
        log_pi = np.where(pi > 0, np.log(pi), 0.0)
    np.testing.assert_allclose(
        log_prob, np.sum(selection * log_pi, axis=(1, 2)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        entropy, -np.sum(pi * log_pi, axis=(1, 2)), rtol=1e-5, atol=1e-5
    )
    # Example 1 attends to nothing; example 0's query 2 neither.
    assert log_prob[1] == 0 and entropy[1] == 0
    assert np.all(selection[1] == 0) and np.all(selection[0, 2] == 0)
    assert log_prob[0] < 0 and entropy[0] > 0
    np.testing.assert_array_equal(selection[0, :2].sum(-1), 1.0)


def test_log_prob_gradient_is_onehot_minus_probabilities():
    # d log pi(z) / d scores = onehot(z) - pi: checked through the query of a
    # dot product, d scores / d q = K.
    query, key, value = _inputs("dot", t=3, s=5)
    query_variable = keras.Variable(query)
    # Argmax, so that every call selects the same positions.
    layer = HardAttention(score="dot", selection="argmax")
    weights = np.array([1.0, -2.0], "float32")

    def loss():
        _, log_prob, _ = layer(
            query_variable.value, value, key=key, training=True,
            return_log_prob=True,
        )
        return keras.ops.sum(keras.ops.multiply(log_prob, weights))

    (grad,) = harness.variable_gradients(loss, [query_variable])
    _, probabilities, selection = _call(layer, query, value, key=key, training=True)
    expected = np.einsum(
        "bts,bsd->btd", (selection - probabilities) * weights[:, None, None], key
    )
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)


# Masks.


@pytest.mark.parametrize("score", ["additive"])
def test_implicit_mask_equals_explicit_mask(score):
    tokens = np.array([[3, 1, 4, 0, 0], [2, 7, 0, 0, 0]], "int32")
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    layer = HardAttention(score=score)
    ids = keras.Input((None,), dtype="int32")
    embedded = embedding(ids)
    output = layer(embedded, embedded)
    assert embedded._keras_mask is not None
    model = keras.Model(ids, output)
    implicit = harness.to_numpy(model(tokens))

    x = harness.to_numpy(embedding(tokens))
    mask = tokens != 0
    explicit = harness.to_numpy(layer(x, x, query_mask=mask, value_mask=mask))
    np.testing.assert_array_equal(implicit, explicit)
    scores = ref.scores(layer.score, x, x)
    pair = mask[:, :, None] & mask[:, None, :]
    index = np.argmax(np.where(pair, scores, -np.inf), axis=-1)
    expected = np.where(mask[..., None], np.take_along_axis(x, index[..., None], 1), 0)
    np.testing.assert_allclose(implicit, expected, rtol=1e-6, atol=1e-7)
    # The query's mask propagates to the output.
    assert output._keras_mask is not None


def test_causal_samples_never_look_ahead():
    # T = 4 queries at the end of S = 6 keys: bottom-right aligned.
    query, key, value = _draws(scale=0.3)
    layer = HardAttention(score="dot", seed=9)
    output, probabilities, selection = _call(
        layer, query, value, key=key, use_causal_mask=True, training=True
    )
    causal = ref.causal_mask(4, 6)
    assert np.all(selection[:, ~causal] == 0)
    assert np.all(probabilities[:, ~causal] == 0)
    np.testing.assert_array_equal(selection.sum(-1), 1.0)
    np.testing.assert_array_equal(output, selection)
    # Every allowed position is drawn somewhere in the batch.
    assert np.all(selection.sum(0)[causal] > 0)


@pytest.mark.parametrize(
    "init_kwargs",
    [{"estimator": "reinforce"}, {"estimator": "straight_through"},
     {"estimator": "gumbel"}, {"estimator": "gumbel", "hard": True}],
    ids=["reinforce", "straight_through", "gumbel", "hard-gumbel"],
)
def test_fully_masked_rows_are_zero_with_finite_gradients(init_kwargs):
    query, key, value = _inputs("bilinear")
    value_mask = np.array([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], bool)
    query_mask = np.array([[1, 0, 1], [1, 1, 1]], bool)
    layer = HardAttention(score="bilinear", seed=0, **init_kwargs)
    for training in (True, False):
        outputs = layer(query, value, key=key, value_mask=value_mask,
                        query_mask=query_mask, training=training,
                        return_attention_scores=True, return_log_prob=True)
        output, probabilities, selection, log_prob, entropy = harness.to_numpy(outputs)
        for empty in (output[1], probabilities[1], selection[1], output[0, 1],
                      probabilities[0, 1], selection[0, 1]):
            assert np.all(empty == 0)
        assert log_prob[1] == 0 and entropy[1] == 0
        np.testing.assert_array_equal(selection[0, [0, 2]].sum(-1), 1.0)

    def loss():
        output, log_prob, entropy = layer(
            query, value, key=key, value_mask=value_mask, query_mask=query_mask,
            training=True, return_log_prob=True,
        )
        return keras.ops.sum(output) + keras.ops.sum(log_prob + entropy)

    (grad,) = harness.variable_gradients(loss, [layer.score.kernel])
    assert np.all(np.isfinite(grad)) and np.any(grad != 0)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("score", ["dot", "additive"])
def test_nan_and_inf_in_masked_positions_do_not_leak(score, training):
    query, key, value = _inputs(score, batch=2, t=3, s=5)
    value_mask = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], bool)
    poisoned_key, poisoned_value = key.copy(), value.copy()
    poisoned_key[0, 3] = np.nan
    poisoned_key[1, 1] = np.inf
    poisoned_value[0, 3:] = np.inf
    poisoned_value[0, 4, 0] = np.nan
    poisoned_value[1, 1] = -np.inf
    layer = HardAttention(score=score, estimator="straight_through", seed=1)
    twin = HardAttention(score=score, estimator="straight_through", seed=1)
    clean = _call(layer, query, value, key=key, value_mask=value_mask,
                  training=training)
    twin(query, value, key=key)
    twin.set_weights(layer.get_weights())
    poisoned = _call(twin, query, poisoned_value, key=poisoned_key,
                     value_mask=value_mask, training=training)
    for p, c in zip(poisoned, clean):
        assert np.all(np.isfinite(p))
        np.testing.assert_allclose(p, c, rtol=1e-6, atol=1e-7)


# Low precision.


@pytest.mark.parametrize(
    "policy, estimator",
    [("mixed_float16", "straight_through"), ("mixed_bfloat16", "gumbel")],
)
def test_mixed_precision(policy, estimator):
    query, key, value = _inputs("bilinear", batch=4)
    reference = HardAttention(score="bilinear", estimator=estimator, seed=0)
    expected = _call(reference, query, value, key=key)
    mixed = HardAttention(score="bilinear", estimator=estimator, seed=0, dtype=policy)
    mixed(query, value, key=key)  # build
    mixed.set_weights(reference.get_weights())
    compute_dtype = policy.split("_")[1]
    # Inference: the argmax of float32 (where no near-tie could flip it in
    # low precision), each output exactly the selected value.
    output, probabilities, selection = _call(mixed, query, value, key=key)
    assert keras.backend.standardize_dtype(output.dtype) == compute_dtype
    assert keras.backend.standardize_dtype(selection.dtype) == compute_dtype
    top2 = np.sort(ref.scores(reference.score, query, key), axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 0.1
    assert clear.mean() > 0.5
    np.testing.assert_array_equal(
        selection[clear].astype("float32"), expected[2][clear]
    )
    selected_values = value.astype(compute_dtype)[
        np.arange(4)[:, None], selection.astype("float32").argmax(-1)
    ]
    np.testing.assert_array_equal(output, selected_values)
    # Training, with a fully masked example: finite, exact zeros, float32 terms.
    value_mask = np.array([[1, 1, 0, 1, 1]] * 3 + [[0, 0, 0, 0, 0]], bool)
    outputs = mixed(query, value, key=key, value_mask=value_mask, training=True,
                    return_attention_scores=True, return_log_prob=True)
    output, probabilities, selection, log_prob, entropy = harness.to_numpy(outputs)
    assert [keras.backend.standardize_dtype(o.dtype) for o in outputs[3:]] == [
        "float32", "float32"
    ]
    for x in (output, probabilities, selection):
        x = x.astype("float32")
        assert np.all(np.isfinite(x)) and np.all(x[3] == 0)
    assert np.all(selection[:, :, 2] == 0)
    np.testing.assert_array_equal(selection[:3].astype("float32").sum(-1), 1.0)
    assert log_prob[3] == 0 and entropy[3] == 0 and np.all(np.isfinite(log_prob))
    for weight in mixed.weights:
        assert keras.backend.standardize_dtype(weight.dtype) == "float32"


# Saving and loading.


def _build_model():
    """A functional model with hard attention, for save and load checks."""
    query = keras.Input((None, 6), name="query")
    key = keras.Input((None, 7), name="key")
    value = keras.Input((None, 4), name="value")
    output, probabilities, selection, log_prob, entropy = HardAttention(
        score=scoring.Additive(units=5, name="scorer"), seed=3, name="hard"
    )(query, value, key=key, return_attention_scores=True, return_log_prob=True)
    return keras.Model(
        [query, key, value], [output, probabilities, selection, log_prob, entropy]
    )


def test_saved_model_loads_with_the_same_outputs(tmp_path):
    query, key, value = _inputs("additive")
    model = _build_model()
    expected = harness.to_numpy(model([query, key, value]))
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.saving.load_model(path)  # safe_mode=True by default
    for got, want in zip(harness.to_numpy(restored([query, key, value])), expected):
        np.testing.assert_array_equal(got, want)
    layer = restored.get_layer("hard")
    assert layer.score.units == 5 and layer.seed == 3
    paths = [f"hard/scorer/{name}" for name in
             ["query_kernel", "key_kernel", "bias", "score_vector"]]
    assert [w.path for w in restored.weights] == paths


_CROSS_BACKEND_WORKER = """
import sys
import keras, numpy as np
import keras_attention  # noqa: F401  (registers the classes)
workdir = sys.argv[1]
inputs = [np.load(f"{workdir}/{name}.npy") for name in ("query", "key", "value")]
outputs = keras.saving.load_model(f"{workdir}/model.keras")(inputs)
reinforce = keras.saving.load_model(f"{workdir}/reinforce.keras")
outputs = list(outputs) + [
    reinforce(inputs), reinforce.baseline, reinforce.baseline_updates
]
outputs = [keras.ops.convert_to_numpy(o) for o in outputs]
np.savez(f"{workdir}/outputs-{keras.backend.backend()}.npz", *outputs)
"""


def test_saved_model_loads_under_another_backend(tmp_path):
    # A model with hard attention, and one wrapped for REINFORCE whose
    # baseline must travel too.
    query, key, value = _inputs("additive")
    model = _build_model()
    output, _, _, log_prob, entropy = model.outputs
    reinforce = losses.ReinforceModel(
        keras.Model(model.inputs, (output, log_prob, entropy)),
        entropy_weight=0.03, baseline_decay=0.7,
    )
    reinforce.compile(optimizer="sgd", loss="mse")
    reinforce.baseline.assign(-0.625)
    reinforce.baseline_updates.assign(5)
    expected = harness.to_numpy(model([query, key, value])) + [
        harness.to_numpy(reinforce([query, key, value])), -0.625, 5
    ]
    model.save(str(tmp_path / "model.keras"))
    reinforce.save(str(tmp_path / "reinforce.keras"))
    for name, array in (("query", query), ("key", key), ("value", value)):
        np.save(tmp_path / f"{name}.npy", array)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    # One other backend per run, in a cycle (tensorflow -> jax -> torch ->
    # tensorflow): over the three runs every backend saves and every backend
    # loads, at the cost of one subprocess per run.
    backends = ("tensorflow", "jax", "torch")
    other = backends[(backends.index(BACKEND) + 1) % 3]
    env = dict(os.environ, KERAS_BACKEND=other, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, env.get("PYTHONPATH")) if p
    )
    result = subprocess.run(
        [sys.executable, "-c", _CROSS_BACKEND_WORKER, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = np.load(tmp_path / f"outputs-{other}.npz")
    assert len(outputs.files) == len(expected)
    for i, want in enumerate(expected):
        np.testing.assert_allclose(
            outputs[f"arr_{i}"], want, rtol=1e-5, atol=1e-6, err_msg=f"{other} #{i}"
        )


# Error messages.


@pytest.mark.parametrize(
    "argument, value",
    [("selection", "top_k"), ("selection", None), ("estimator", "vimco"),
     ("estimator", 1), ("inference_selection", "random")],
)
def test_rejects_unknown_choices(argument, value):
    with pytest.raises(
        ValueError, match=rf"`{argument}` must be one of .*Received: {argument}="
    ):
        HardAttention(**{argument: value})


@pytest.mark.parametrize("temperature", [0, 0.0, -1.0, float("nan"), float("inf"),
                                         "1.0", True, None])
def test_rejects_bad_temperature(temperature):
    with pytest.raises(
        ValueError, match=r"`temperature` must be a positive float.*Received: "
        r"temperature="
    ):
        HardAttention(estimator="gumbel", temperature=temperature)


def test_rejects_a_temperature_for_reinforce():
    with pytest.raises(
        ValueError, match=r"temperature=0\.5 with estimator='reinforce'"
    ):
        HardAttention(estimator="reinforce", temperature=0.5)


def test_rejects_gumbel_with_argmax_selection():
    with pytest.raises(
        ValueError, match=r"`selection` must be 'sample'.*selection='argmax'"
    ):
        HardAttention(estimator="gumbel", selection="argmax")


def test_rejects_bad_hard_and_seed():
    with pytest.raises(ValueError, match=r"`hard` must be True or False.*hard='yes'"):
        HardAttention(estimator="gumbel", hard="yes")
    with pytest.raises(ValueError, match=r"`seed` must be None or an integer.*'a'"):
        HardAttention(seed="a")


def test_rejects_unknown_scorer():
    with pytest.raises(ValueError, match=r"score='cosine'"):
        HardAttention(score="cosine")


def test_rejects_bad_shapes_and_masks():
    query, key, value = _inputs("dot", s=5)
    with pytest.raises(ValueError, match=r"key length=4, value length=5"):
        HardAttention()(query, value, key=key[:, :4])
    with pytest.raises(ValueError, match=r"`query` must have rank 3.*\(rank 2\)"):
        HardAttention()(query[:, 0], value)
    with pytest.raises(TypeError, match=r"`value_mask` must be a boolean or integer"):
        HardAttention()(query, value, key=key, value_mask=np.ones((2, 5), "float32"))
    with pytest.raises(ValueError, match=r"`attention_mask` must have rank 2 or 3"):
        HardAttention()(
            query, value, key=key, attention_mask=np.ones((2, 1, 3, 5), bool)
        )
