"""Tests of `SelfAttention`: `softmax(s(X W_q, X W_k)) X W_v`."""

import re

import keras
import numpy as np
import pytest

import harness
import numpy_reference as ref
from keras_attention.layers import SelfAttention

SCORERS = ["dot", "scaled_dot", "additive", "bilinear"]
# Scorers checked against float32 under mixed precision.
MIXED_SCORERS = ["scaled_dot", "additive"]


def _sequence(batch=2, length=5, dim=6, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, length, dim)).astype(
        "float32"
    )


def _tokens():
    # Example 0 has 3 real tokens, example 1 has 2; 0 is padding.
    return np.array([[3, 1, 4, 0, 0], [2, 7, 0, 0, 0]], "int32")


def _project(dense, x):
    kernel = harness.to_numpy(dense.kernel).astype("float64")
    output = x.astype("float64") @ kernel
    if dense.use_bias:
        output = output + harness.to_numpy(dense.bias)
    return output


def numpy_self_attention(layer, x, mask=None):
    """`(output, weights)` computed in numpy from the layer's own weights."""
    query = _project(layer.query_dense, x)  # (B, T, U)
    key = _project(layer.key_dense, x)  # (B, T, U)
    value = _project(layer.value_dense, x)  # (B, T, U)
    return ref.attention(layer.attention.score, query, key, value, mask)


def _call(layer, x, **kwargs):
    output, weights = layer(x, return_attention_scores=True, **kwargs)
    return harness.to_numpy(output), harness.to_numpy(weights)


# Layer harness.


@pytest.mark.parametrize(
    "init_kwargs, call_kwargs, expected_output_shapes",
    [
        (
            {"units": 8, "score": "dot"},
            {"return_attention_scores": True},
            [(2, 5, 8), (2, 5, 5)],
        ),
        (
            {"units": 4, "score": "scaled_dot", "dropout": 0.25, "seed": 1},
            {"use_causal_mask": True},
            [(2, 5, 4)],
        ),
        (
            {"units": 8, "score": "additive", "use_bias": False},
            {},
            [(2, 5, 8)],
        ),
        (
            {"units": 3, "score": "bilinear", "kernel_regularizer": "l2"},
            {"return_attention_scores": True, "use_causal_mask": True},
            [(2, 5, 3), (2, 5, 5)],
        ),
    ],
    ids=SCORERS,
)
def test_layer_harness(init_kwargs, call_kwargs, expected_output_shapes):
    harness.run_layer_test(
        SelfAttention,
        init_kwargs,
        inputs={"inputs": _sequence()},
        call_kwargs=call_kwargs,
        expected_output_shapes=expected_output_shapes,
        # test_mixed_precision_matches_float32 covers these scorers, closer.
        run_mixed_precision_check=init_kwargs["score"] not in MIXED_SCORERS,
    )


def test_config_keeps_every_argument():
    layer = SelfAttention(
        units=3,
        score="additive",
        dropout=0.5,
        use_bias=False,
        kernel_initializer="ones",
        bias_initializer="ones",
        kernel_regularizer="l2",
        bias_regularizer="l1",
        seed=7,
    )
    restored = SelfAttention.from_config(layer.get_config())
    assert restored.units == 3
    assert type(restored.score).__name__ == "Additive"
    assert restored.dropout == 0.5 and restored.seed == 7
    assert restored.use_bias is False
    assert isinstance(restored.kernel_initializer, keras.initializers.Ones)
    assert isinstance(restored.bias_regularizer, keras.regularizers.L1)
    assert restored.get_config() == layer.get_config()


def test_restored_layer_keeps_weight_paths():
    layer = SelfAttention(units=3, score="bilinear", name="encoder")
    layer(_sequence())
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer)
    )
    paths = [w.path for w in layer.weights]
    assert [w.path for w in restored.weights] == paths
    scorer_path = layer.score.kernel.path
    assert scorer_path.startswith("encoder/attention/"), scorer_path


def test_return_attention_scores_shapes():
    layer = SelfAttention(units=4)
    output, weights = layer(_sequence(), return_attention_scores=True)
    assert tuple(output.shape) == (2, 5, 4)
    assert tuple(weights.shape) == (2, 5, 5)
    output, weights = SelfAttention(units=4)(
        keras.Input((5, 6)), return_attention_scores=True
    )
    assert tuple(output.shape) == (None, 5, 4)
    assert tuple(weights.shape) == (None, 5, 5)
    output, weights = SelfAttention(units=4)(
        keras.Input((None, 6)), return_attention_scores=True
    )
    assert tuple(output.shape) == (None, None, 4)
    assert tuple(weights.shape) == (None, None, None)


# Small cases worked by hand and in numpy.


def test_hand_worked_case():
    # Identity projections and the dot score: softmax(X X^T) X.
    x = np.array([[[1.0, 0.0], [0.0, 1.0]]], "float32")
    layer = SelfAttention(
        units=2, score="dot", use_bias=False, kernel_initializer="identity"
    )
    output, weights = _call(layer, x)
    e = np.e
    expected = np.array([[[e, 1.0], [1.0, e]]]) / (1 + e)
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-6)


@pytest.mark.parametrize("score", SCORERS)
def test_matches_numpy(score):
    x = _sequence()
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool)
    layer = SelfAttention(units=4, score=score)
    output, weights = _call(layer, x)
    expected, expected_weights = numpy_self_attention(layer, x)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)

    output, weights = _call(layer, x, mask=mask, use_causal_mask=True)
    full_mask = mask[:, :, None] & mask[:, None, :] & ref.causal_mask(5, 5)
    expected, expected_weights = numpy_self_attention(layer, x, full_mask)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    assert np.all(output[~mask] == 0)


def test_attention_mask_matches_numpy():
    x = _sequence()
    attention_mask = np.random.default_rng(2).random((2, 5, 5)) > 0.4
    layer = SelfAttention(units=4)
    output, weights = _call(layer, x, attention_mask=attention_mask)
    expected, expected_weights = numpy_self_attention(layer, x, attention_mask)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    # A (T, T) mask applies to every example.
    output = harness.to_numpy(layer(x, attention_mask=attention_mask[0]))
    expected, _ = numpy_self_attention(layer, x, attention_mask[0])
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)


# Implicit mask == explicit mask.


@pytest.mark.parametrize("score", ["scaled_dot", "additive"])
def test_implicit_mask_equals_explicit_mask(score):
    tokens = _tokens()
    mask = tokens != 0
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    layer = SelfAttention(units=4, score=score)
    ids = keras.Input((None,), dtype="int32")
    output = layer(embedding(ids))
    # The padding mask propagates to the output.
    assert output._keras_mask is not None
    pooled = keras.layers.GlobalAveragePooling1D()(output)
    model = keras.Model(ids, [output, pooled])
    implicit, pooled = harness.to_numpy(model(tokens))

    x = harness.to_numpy(embedding(tokens))  # numpy: no Keras mask attached
    explicit = harness.to_numpy(layer(x, mask=mask))
    np.testing.assert_allclose(implicit, explicit, rtol=1e-6, atol=1e-6)
    expected, _ = numpy_self_attention(
        layer, x, mask[:, :, None] & mask[:, None, :]
    )
    np.testing.assert_allclose(implicit, expected, rtol=1e-5, atol=1e-5)
    assert np.all(implicit[~mask] == 0)
    assert not np.allclose(harness.to_numpy(layer(x))[mask], implicit[mask])
    # Masked pooling averages over the real tokens only.
    lengths = mask.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(pooled, implicit.sum(axis=1) / lengths, rtol=1e-5)


def test_explicit_mask_replaces_the_implicit_mask():
    tokens = _tokens()
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    embedded = embedding(tokens)
    x = harness.to_numpy(embedded)
    mask = np.array([[1, 1, 1, 1, 1], [1, 0, 1, 1, 0]], bool)
    layer = SelfAttention(units=4)
    output = harness.to_numpy(layer(embedded, mask=mask))
    expected, _ = numpy_self_attention(layer, x, mask[:, :, None] & mask[:, None, :])
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)


def test_same_masked_tensor_is_masked_for_every_reader():
    tokens = _tokens()
    mask = tokens != 0
    pair_mask = mask[:, :, None] & mask[:, None, :]
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    first = SelfAttention(units=4)
    second = SelfAttention(units=4, score="bilinear")
    ids = keras.Input((None,), dtype="int32")
    embedded = embedding(ids)
    outputs = [first(embedded), second(embedded)]
    assert embedded._keras_mask is not None
    model = keras.Model(ids, outputs)
    x = harness.to_numpy(embedding(tokens))
    for layer, output in zip((first, second), harness.to_numpy(model(tokens))):
        expected, _ = numpy_self_attention(layer, x, pair_mask)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)


# Invariants.


@pytest.mark.parametrize("score", ["scaled_dot", "additive"])
def test_causal_outputs_ignore_the_future(score):
    x = _sequence()
    changed = x.copy()
    changed[:, 3:] = 10.0 * _sequence(seed=1)[:, 3:]
    layer = SelfAttention(units=4, score=score)
    before = harness.to_numpy(layer(x, use_causal_mask=True))
    after = harness.to_numpy(layer(changed, use_causal_mask=True))
    np.testing.assert_allclose(after[:, :3], before[:, :3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(after[:, 3:], before[:, 3:])
    # Without the causal mask every position sees the change.
    unmasked = harness.to_numpy(layer(changed))
    assert not np.allclose(unmasked[:, :3], before[:, :3])


@pytest.mark.parametrize("score", ["dot", "bilinear"])
def test_padding_invariance(score):
    # Padding appended to a sequence changes no output of its real tokens.
    x = _sequence(length=3)
    layer = SelfAttention(units=4, score=score)
    short = harness.to_numpy(layer(x))
    padded = np.concatenate([x, 100.0 * np.ones_like(x[:, :2])], axis=1)
    mask = np.arange(5)[None, :].repeat(2, axis=0) < 3
    long = harness.to_numpy(layer(padded, mask=mask))
    np.testing.assert_allclose(long[:, :3], short, rtol=1e-5, atol=1e-6)
    assert np.all(long[:, 3:] == 0)


# SoftAttention's tests train through fully masked rows with every scorer.
@pytest.mark.parametrize("score", ["additive"])
def test_training_step_through_fully_padded_examples(score):
    keras.utils.set_random_seed(0)
    tokens = _tokens()
    tokens[1] = 0  # example 1 is padding only
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(10, 6, mask_zero=True)(ids)
    x = SelfAttention(units=4, score=score)(x)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    # A target far from the outputs, so that the query kernel's gradient
    # (it reaches it through tanh) is never lost to float32 rounding.
    with harness.trains_every_weight(model):
        loss = model.train_on_batch(tokens, np.full((2, 5, 1), 100.0, "float32"))
    assert np.isfinite(loss)
    predicted = harness.to_numpy(model(tokens))
    # The padded example attends to nothing: the head returns its bias.
    bias = harness.to_numpy(model.layers[-1].bias)
    np.testing.assert_allclose(predicted[1], np.broadcast_to(bias, (5, 1)), rtol=1e-6)


@pytest.mark.parametrize("score", ["scaled_dot"])
def test_fits_on_tf_data_and_predicts_as_on_numpy(score):
    import tensorflow as tf  # tf.data feeds models on every backend

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, size=(16, 6)).astype("int32")
    lengths = rng.integers(1, 7, size=16)
    tokens[np.arange(6)[None, :] >= lengths[:, None]] = 0
    labels = rng.normal(size=(16, 1)).astype("float32")

    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(ids)
    x = SelfAttention(units=8, score=score)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

    dataset = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(8)
    with harness.trains_every_weight(model):
        history = model.fit(dataset, epochs=3, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]

    from_dataset = model.predict(
        tf.data.Dataset.from_tensor_slices(tokens).batch(8), verbose=0
    )
    from_numpy = model.predict(tokens, batch_size=8, verbose=0)
    assert np.all(np.isfinite(from_dataset))
    np.testing.assert_allclose(from_dataset, from_numpy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 2e-3), ("mixed_bfloat16", 2e-2)]
)
@pytest.mark.parametrize("score", MIXED_SCORERS)
def test_mixed_precision_matches_float32(score, policy, tolerance):
    x = _sequence()
    reference = SelfAttention(units=4, score=score)
    expected = harness.to_numpy(reference(x))
    mixed = SelfAttention(units=4, score=score, dtype=policy)
    mixed(x)  # build
    mixed.set_weights(reference.get_weights())
    output = mixed(x)
    assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
    for weight in mixed.weights:
        assert keras.backend.standardize_dtype(weight.dtype) == "float32"
    output = harness.to_numpy(output).astype("float32")
    np.testing.assert_allclose(output, expected, atol=tolerance, rtol=tolerance)
    # An example that is all padding: zeros, never NaN.
    mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
    output = harness.to_numpy(mixed(x, mask=mask)).astype("float32")
    assert np.all(np.isfinite(output))
    assert np.all(output[1] == 0) and np.all(output[0, 3:] == 0)


def test_dropout_with_seed():
    x = _sequence()
    layer = SelfAttention(units=4, dropout=0.5, seed=3)
    plain = SelfAttention(units=4)
    plain(x)
    layer(x)
    plain.set_weights(layer.get_weights())
    expected = harness.to_numpy(plain(x))
    for _ in range(2):
        np.testing.assert_allclose(
            harness.to_numpy(layer(x, training=False)), expected, rtol=1e-6
        )
    trained = harness.to_numpy(layer(x, training=True))
    assert np.all(np.isfinite(trained))
    assert not np.allclose(trained, expected)


# Error messages.


@pytest.mark.parametrize("units", [0, -1, 2.5, "8", True, None])
def test_rejects_bad_units(units):
    message = r"`units` must be a positive integer\. Received: units="
    with pytest.raises(ValueError, match=message + re.escape(repr(units))):
        SelfAttention(units=units)


@pytest.mark.parametrize("dropout", [-0.5, 1.0, "0.1"])
def test_rejects_bad_dropout(dropout):
    with pytest.raises(ValueError, match=r"`dropout` must be a float in \[0, 1\)"):
        SelfAttention(units=4, dropout=dropout)


def test_rejects_unknown_scorer():
    with pytest.raises(ValueError, match=r"score='general'"):
        SelfAttention(units=4, score="general")


@pytest.mark.parametrize("shape", [(2, 6), (2, 5, 6, 1)])
def test_rejects_wrong_rank(shape):
    message = rf"`inputs` must have rank 3.*\(rank {len(shape)}\)"
    with pytest.raises(ValueError, match=message):
        SelfAttention(units=4)(np.ones(shape, "float32"))
    with pytest.raises(ValueError, match=r"`inputs` must have rank 3"):
        SelfAttention(units=4)(keras.Input(shape[1:]))


def test_rejects_float_mask():
    with pytest.raises(TypeError, match=r"`mask` must be a boolean or integer"):
        SelfAttention(units=4)(_sequence(), mask=np.ones((2, 5), "float32"))


@pytest.mark.parametrize(
    "argument, shape, message",
    [
        (
            "mask",
            (2, 4),
            r"`mask` and `inputs` must have the same length.*mask length=4",
        ),
        ("mask", (3, 5), r"`mask` and `inputs` must have the same batch size"),
        ("mask", (2, 5, 5), r"`mask` must have rank 2"),
        ("attention_mask", (2, 5, 4), r"`attention_mask` must have key length 5"),
    ],
)
def test_rejects_wrongly_shaped_mask(argument, shape, message):
    with pytest.raises(ValueError, match=message):
        SelfAttention(units=4)(_sequence(), **{argument: np.ones(shape, bool)})
