"""Tests of `SoftAttention`: `softmax(s(Q, K)) V` with every scorer."""

import keras
import numpy as np
import pytest

import harness
import numpy_reference as ref
from keras_attention import backend
from keras_attention import kernels
from keras_attention import scoring
from keras_attention.kernels import choice
from keras_attention.layers import SoftAttention

SCORERS = ["dot", "scaled_dot", "additive", "bilinear"]
# Scorers with weights accept query and key of different feature sizes.
FREE_DIM_SCORERS = ["additive", "bilinear"]
ADDITIVE_WEIGHTS = ["query_kernel", "key_kernel", "bias", "score_vector"]


def _inputs(score, batch=2, t=3, s=5, dv=4, seed=0):
    """Query `(B, T, Dq)`, key `(B, S, Dk)` and value `(B, S, Dv)`."""
    dq, dk = (6, 7) if score in FREE_DIM_SCORERS else (6, 6)
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, t, dq)).astype("float32")
    key = rng.normal(size=(batch, s, dk)).astype("float32")
    value = rng.normal(size=(batch, s, dv)).astype("float32")
    return query, key, value


def _call(layer, query, value, **kwargs):
    """Eager call returning numpy `(output, weights)`."""
    output, weights = layer(query, value, return_attention_scores=True, **kwargs)
    return harness.to_numpy(output), harness.to_numpy(weights)


def _tokens():
    # Example 0 has 3 real tokens, example 1 has 2; 0 is padding.
    return np.array([[3, 1, 4, 0, 0], [2, 7, 0, 0, 0]], "int32")


# Layer harness.


@pytest.mark.parametrize(
    "init_kwargs, mode, call_kwargs, expected_output_shapes",
    [
        ({"score": "dot"}, "normal", {}, [(2, 3, 6)]),
        (
            {"score": "scaled_dot", "dropout": 0.25, "seed": 3},
            "key_value",
            {"use_causal_mask": True, "return_attention_scores": True},
            [(2, 3, 4), (2, 3, 5)],
        ),
        (
            {"score": "additive"},
            "key_value",
            {"return_attention_scores": True},
            [(2, 3, 4), (2, 3, 5)],
        ),
        ({"score": "bilinear"}, "normal", {"use_causal_mask": True}, [(2, 3, 7)]),
    ],
    ids=SCORERS,
)
def test_layer_harness(init_kwargs, mode, call_kwargs, expected_output_shapes):
    query, key, value = _inputs(init_kwargs["score"])
    inputs = {"query": query, "value": value, "key": key}
    if mode == "normal":
        inputs = {"query": query, "value": key}
    harness.run_layer_test(
        SoftAttention,
        init_kwargs,
        inputs=inputs,
        call_kwargs=call_kwargs,
        expected_output_shapes=expected_output_shapes,
        # Dot products have no weights to train.
        run_training_check=init_kwargs["score"] in FREE_DIM_SCORERS,
    )


@pytest.mark.parametrize("score", SCORERS)
def test_return_attention_scores_shapes(score):
    query, key, value = _inputs(score, t=3, s=5, dv=4)
    layer = SoftAttention(score=score)
    output, weights = layer(query, value, key=key, return_attention_scores=True)
    assert tuple(output.shape) == (2, 3, 4)
    assert tuple(weights.shape) == (2, 3, 5)
    assert tuple(layer(query, value, key=key).shape) == (2, 3, 4)
    # Symbolic: cross-attention weights are (B, T, S), not (B, T, T).
    q = keras.Input((3, query.shape[-1]))
    k = keras.Input((5, key.shape[-1]))
    v = keras.Input((5, 4))
    output, weights = SoftAttention(score=score)(
        q, v, key=k, return_attention_scores=True
    )
    assert tuple(output.shape) == (None, 3, 4)
    assert tuple(weights.shape) == (None, 3, 5)
    q = keras.Input((None, query.shape[-1]))
    k = keras.Input((None, key.shape[-1]))
    v = keras.Input((None, 4))
    output, weights = SoftAttention(score=score)(
        q, v, key=k, return_attention_scores=True
    )
    assert tuple(output.shape) == (None, None, 4)
    assert tuple(weights.shape) == (None, None, None)


def test_functional_model_at_several_lengths():
    q = keras.Input((None, 6))
    v = keras.Input((None, 6))
    layer = SoftAttention(score="bilinear")
    model = keras.Model([q, v], layer(q, v, use_causal_mask=True))
    model.compile(loss="mse")
    for t, s in [(2, 3), (5, 7)]:
        query, value, _ = _inputs("dot", t=t, s=s)  # (B, S, 6) values
        predicted = model.predict([query, value], verbose=0)
        expected, _ = ref.attention(
            layer.score, query, value, value, ref.causal_mask(t, s)
        )
        np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-5)


def test_saved_model_loads_with_the_same_outputs(tmp_path):
    query, key, value = _inputs("additive")
    inputs = [keras.Input(x.shape[1:]) for x in (query, key, value)]
    outputs = SoftAttention(
        score=scoring.Additive(units=5, name="scorer"), name="attention"
    )(inputs[0], inputs[2], key=inputs[1])
    model = keras.Model(inputs, outputs)
    expected = harness.to_numpy(model([query, key, value]))
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(
        harness.to_numpy(restored([query, key, value])), expected, rtol=1e-6
    )
    assert restored.layers[-1].score.units == 5
    # The scorer's variables keep their path under the attention layer.
    paths = [f"attention/scorer/{name}" for name in ADDITIVE_WEIGHTS]
    assert [w.path for w in model.weights] == paths
    assert [w.path for w in restored.weights] == paths


# Small cases worked by hand and in numpy.


def test_hand_worked_case():
    # Scores q . k = [1, 0, 1]: weights [e, 1, e] / (2e + 1).
    query = np.array([[[1.0, 0.0]]], "float32")
    key = np.array([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]], "float32")
    value = np.array([[[2.0], [5.0], [-1.0]]], "float32")
    output, weights = _call(SoftAttention(score="dot"), query, value, key=key)
    e = np.e
    expected_weights = np.array([[[e, 1, e]]]) / (2 * e + 1)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-6)
    np.testing.assert_allclose(
        output, [[[(2 * e + 5 - e) / (2 * e + 1)]]], rtol=1e-6
    )


@pytest.mark.parametrize("score", SCORERS)
def test_key_value_mode_matches_numpy(score):
    query, key, value = _inputs(score)
    layer = SoftAttention(score=score)
    output, weights = _call(layer, query, value, key=key)
    expected, expected_weights = ref.attention(layer.score, query, key, value)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("score", SCORERS)
def test_normal_mode_is_key_value_mode_with_key_equal_to_value(score):
    query, value, _ = _inputs(score)  # value is (B, S, Dk)
    layer = SoftAttention(score=score)
    normal = _call(layer, query, value)
    key_value = _call(layer, query, value, key=value)
    np.testing.assert_allclose(normal[0], key_value[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(normal[1], key_value[1], rtol=1e-6, atol=1e-6)
    expected, _ = ref.attention(layer.score, query, value, value)
    np.testing.assert_allclose(normal[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score", SCORERS)
def test_masks_match_numpy(score):
    query, key, value = _inputs(score)
    value_mask = np.array([[1, 1, 1, 0, 1], [1, 1, 0, 0, 0]], bool)
    query_mask = np.array([[1, 1, 1], [1, 0, 1]], bool)
    attention_mask = np.random.default_rng(1).random((2, 3, 5)) > 0.3
    layer = SoftAttention(score=score)
    output, weights = _call(
        layer,
        query,
        value,
        key=key,
        query_mask=query_mask,
        value_mask=value_mask,
        attention_mask=attention_mask,
    )
    mask = query_mask[:, :, None] & value_mask[:, None, :] & attention_mask
    expected, expected_weights = ref.attention(layer.score, query, key, value, mask)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    assert np.all(weights[~mask] == 0)


@pytest.mark.parametrize("t, s", [(5, 5), (3, 5)])
@pytest.mark.parametrize("score", SCORERS)
def test_causal_mask_matches_numpy(score, t, s):
    query, key, value = _inputs(score, t=t, s=s)
    layer = SoftAttention(score=score)
    output, weights = _call(layer, query, value, key=key, use_causal_mask=True)
    causal = ref.causal_mask(t, s)
    expected, expected_weights = ref.attention(layer.score, query, key, value, causal)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    # Bottom-right aligned: the last query sees every key, query i sees
    # keys 0 .. S - T + i.
    assert np.all(weights[:, -1, :] > 0)
    for i in range(t):
        assert np.all(weights[:, i, s - t + i + 1 :] == 0)
        assert np.all(weights[:, i, : s - t + i + 1] > 0)


def test_causal_mask_combines_with_padding():
    query, key, value = _inputs("scaled_dot", t=5, s=5)
    value_mask = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 0, 1]], bool)
    layer = SoftAttention()
    output, weights = _call(
        layer, query, value, key=key, value_mask=value_mask, use_causal_mask=True
    )
    mask = ref.causal_mask(5, 5)[None] & value_mask[:, None, :]
    expected, expected_weights = ref.attention(layer.score, query, key, value, mask)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    # Example 0, query 0 may only see key 0, which is padding.
    assert np.all(output[0, 0] == 0)


# Implicit mask == explicit mask.


@pytest.mark.parametrize("score", ["scaled_dot", "additive"])
def test_implicit_mask_equals_explicit_mask(score):
    tokens = _tokens()
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    layer = SoftAttention(score=score)
    ids = keras.Input((None,), dtype="int32")
    embedded = embedding(ids)
    model = keras.Model(ids, layer(embedded, embedded))
    implicit = harness.to_numpy(model(tokens))

    x = harness.to_numpy(embedding(tokens))  # numpy: no Keras mask attached
    mask = tokens != 0
    explicit = harness.to_numpy(layer(x, x, query_mask=mask, value_mask=mask))
    np.testing.assert_allclose(implicit, explicit, rtol=1e-6, atol=1e-6)
    expected, _ = ref.attention(
        layer.score, x, x, x, mask[:, :, None] & mask[:, None, :]
    )
    np.testing.assert_allclose(implicit, expected, rtol=1e-5, atol=1e-5)
    # Padded queries attend to nothing.
    assert np.all(implicit[~mask] == 0)
    unmasked = harness.to_numpy(layer(x, x))
    assert not np.allclose(implicit[mask], unmasked[mask])


def test_query_mask_propagates_to_the_output():
    tokens = _tokens()
    ids = keras.Input((None,), dtype="int32")
    memory = keras.Input((4, 6))
    query = keras.layers.Embedding(10, 6, mask_zero=True)(ids)
    output = SoftAttention()(query, memory)
    assert output._keras_mask is not None
    # Masked average pooling divides by the number of real query positions.
    pooled = keras.layers.GlobalAveragePooling1D()(output)
    model = keras.Model([ids, memory], [output, pooled])
    value = np.random.default_rng(0).normal(size=(2, 4, 6)).astype("float32")
    output, pooled = harness.to_numpy(model([tokens, value]))
    lengths = (tokens != 0).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(pooled, output.sum(axis=1) / lengths, rtol=1e-5)

    # Eagerly too: the pooling layer reads the mask of the eager output.
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    output = SoftAttention()(embedding(tokens), value)
    pooled = keras.layers.GlobalAveragePooling1D()(output)
    output = harness.to_numpy(output)
    np.testing.assert_allclose(
        harness.to_numpy(pooled), output.sum(axis=1) / lengths, rtol=1e-5
    )


def test_same_masked_tensor_is_masked_for_every_reader():
    tokens = _tokens()
    mask = tokens != 0
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    first, second = SoftAttention(score="dot"), SoftAttention(score="bilinear")
    ids = keras.Input((None,), dtype="int32")
    embedded = embedding(ids)
    outputs = [first(embedded, embedded), second(embedded, embedded)]
    # The layers leave the mask of their input in place.
    assert embedded._keras_mask is not None
    model = keras.Model(ids, outputs)
    x = harness.to_numpy(embedding(tokens))
    pair_mask = mask[:, :, None] & mask[:, None, :]
    for layer, output in zip((first, second), harness.to_numpy(model(tokens))):
        expected, _ = ref.attention(layer.score, x, x, x, pair_mask)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)

    # Eagerly: the same embedded tensor read twice is masked both times.
    embedded = embedding(tokens)
    for layer in (first, second, first):
        expected, _ = ref.attention(layer.score, x, x, x, pair_mask)
        np.testing.assert_allclose(
            harness.to_numpy(layer(embedded, embedded)),
            expected,
            rtol=1e-5,
            atol=1e-5,
        )


# Invariants.


@pytest.mark.parametrize("score", SCORERS)
def test_fully_masked_rows_are_zero(score):
    query, key, value = _inputs(score)
    value_mask = np.array([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], bool)
    query_mask = np.array([[1, 0, 1], [1, 1, 1]], bool)
    attention_mask = np.ones((2, 3, 5), bool)
    attention_mask[0, 2] = False
    output, weights = _call(
        SoftAttention(score=score),
        query,
        value,
        key=key,
        query_mask=query_mask,
        value_mask=value_mask,
        attention_mask=attention_mask,
    )
    assert np.all(weights[1] == 0) and np.all(output[1] == 0)
    assert np.all(weights[0, 1:] == 0) and np.all(output[0, 1:] == 0)
    assert np.all(output[0, 0] != 0)
    np.testing.assert_allclose(weights[0, 0].sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("score", SCORERS)
def test_training_through_fully_masked_rows_keeps_weights_finite(score):
    query, key, value = _inputs(score)
    value_mask = np.array([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0]], bool)
    # Every key of example 1 is masked.
    q_in = keras.Input(query.shape[1:])
    k_in = keras.Input(key.shape[1:])
    v_in = keras.Input(value.shape[1:])
    m_in = keras.Input((5,), dtype="bool")
    q = keras.layers.Dense(query.shape[-1])(q_in)
    layer = SoftAttention(score=score)
    output = keras.layers.Dense(2)(layer(q, v_in, key=k_in, value_mask=m_in))
    model = keras.Model([q_in, k_in, v_in, m_in], output)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    target = np.ones((2, 3, 2), "float32")
    with harness.trains_every_weight(model):
        loss = model.train_on_batch([query, key, value, value_mask], target)
    assert np.isfinite(loss)
    predicted = harness.to_numpy(model([query, key, value, value_mask]))
    assert np.all(np.isfinite(predicted))
    # Example 1 attends to nothing: the head sees zeros and returns its bias.
    bias = harness.to_numpy(model.layers[-1].bias)
    np.testing.assert_allclose(predicted[1], np.broadcast_to(bias, (3, 2)), rtol=1e-6)


@pytest.mark.parametrize("score", SCORERS)
def test_nan_and_inf_in_masked_positions_do_not_leak(score):
    query, key, value = _inputs(score)
    value_mask = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], bool)
    layer = SoftAttention(score=score)
    clean = _call(layer, query, value, key=key, value_mask=value_mask)
    poisoned_key, poisoned_value = key.copy(), value.copy()
    poisoned_key[0, 3] = np.nan
    poisoned_key[1, 1] = np.inf
    poisoned_value[0, 3:] = np.inf
    poisoned_value[0, 4, 0] = np.nan
    poisoned_value[1, 1] = -np.inf
    poisoned = _call(
        layer, query, poisoned_value, key=poisoned_key, value_mask=value_mask
    )
    for p, c in zip(poisoned, clean):
        assert np.all(np.isfinite(p))
        np.testing.assert_allclose(p, c, rtol=1e-6, atol=1e-7)
    # Normal mode (key = value) too.
    clean = _call(layer, query, key, value_mask=value_mask)
    poisoned = _call(layer, query, poisoned_key, value_mask=value_mask)
    for p, c in zip(poisoned, clean):
        assert np.all(np.isfinite(p))
        np.testing.assert_allclose(p, c, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("score", SCORERS)
def test_dot_product_scorers_take_a_fused_kernel_with_the_same_results(score):
    """Through the attention core a dot-product scorer takes a fused kernel
    (one head of `(B, T, 1, D)`), any other scorer the explicit one; returned
    weights and dropout in training take the explicit kernel too."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    mask = rng.random((2, 6)) > 0.3
    layer = SoftAttention(score=score)
    layer.build(x.shape, x.shape)
    with kernels.tracing() as taken:
        fast = harness.to_numpy(layer(x, x, value_mask=mask, use_causal_mask=True))
        slow, weights = layer(
            x, x, value_mask=mask, use_causal_mask=True, return_attention_scores=True
        )
    dot = score in ("dot", "scaled_dot")
    assert [c.kernel != choice.EXPLICIT for _, c in taken] == [dot, False]
    np.testing.assert_allclose(fast, harness.to_numpy(slow), rtol=1e-5, atol=1e-5)
    cotangent = rng.normal(size=(2, 6, 8)).astype("float32")
    kwargs = dict(value_mask=mask, use_causal_mask=True)
    fast_grads = harness.input_gradients(lambda q: layer(q, x, **kwargs), [x], cotangent)
    slow_grads = harness.input_gradients(
        lambda q: layer(q, x, return_attention_scores=True, **kwargs)[0], [x], cotangent
    )
    np.testing.assert_allclose(fast_grads[0], slow_grads[0], rtol=1e-4, atol=1e-5)
    dropout = SoftAttention(score=score, dropout=0.5, seed=1)
    with kernels.tracing() as taken:
        dropout(x, x, training=True)
        dropout(x, x, training=False)
    # Training: the explicit kernel, or the backend's fused kernel with
    # dropout (torch).
    trained = choice.DROPOUT if dot and backend.preferences().dropout_kernel else choice.EXPLICIT
    assert [c.kernel for _, c in taken][0] == trained
    assert (taken[1][1].kernel != choice.EXPLICIT) == dot


@pytest.mark.parametrize("score", SCORERS)
def test_padding_invariance(score):
    # Appending masked keys and values changes nothing.
    query, key, value = _inputs(score, s=3)
    layer = SoftAttention(score=score)
    short = _call(layer, query, value, key=key)
    padded_key = np.concatenate([key, 100 * np.ones_like(key[:, :2])], axis=1)
    padded_value = np.concatenate([value, -50 * np.ones_like(value[:, :2])], axis=1)
    value_mask = np.arange(5)[None, :].repeat(2, 0) < 3
    long = _call(layer, query, padded_value, key=padded_key, value_mask=value_mask)
    np.testing.assert_allclose(long[0], short[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(long[1][..., :3], short[1], rtol=1e-5, atol=1e-6)
    assert np.all(long[1][..., 3:] == 0)


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 2e-3), ("mixed_bfloat16", 2e-2)]
)
@pytest.mark.parametrize("score", SCORERS)
def test_mixed_precision_matches_float32(score, policy, tolerance):
    query, key, value = _inputs(score)
    reference = SoftAttention(score=score)
    expected = _call(reference, query, value, key=key)
    mixed = SoftAttention(score=score, dtype=policy)
    mixed(query, value, key=key)  # build
    mixed.set_weights(reference.get_weights())
    output, weights = _call(mixed, query, value, key=key)
    compute_dtype = policy.split("_")[1]
    assert keras.backend.standardize_dtype(output.dtype) == compute_dtype
    for weight in mixed.weights:
        assert keras.backend.standardize_dtype(weight.dtype) == "float32"
    output, weights = output.astype("float32"), weights.astype("float32")
    np.testing.assert_allclose(output, expected[0], atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(weights, expected[1], atol=tolerance, rtol=tolerance)
    # All keys of example 1 masked: exact zeros, never NaN.
    value_mask = np.array([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], bool)
    output, weights = _call(mixed, query, value, key=key, value_mask=value_mask)
    output, weights = output.astype("float32"), weights.astype("float32")
    assert np.all(np.isfinite(output)) and np.all(np.isfinite(weights))
    assert np.all(output[1] == 0) and np.all(weights[1] == 0)
    np.testing.assert_allclose(weights[0].sum(-1), 1.0, atol=tolerance)


def test_dropout_with_seed():
    query, key, value = _inputs("dot")
    rate = 0.5
    layer = SoftAttention(score="dot", dropout=rate, seed=1)
    plain = _call(SoftAttention(score="dot"), query, value, key=key)
    inference = [
        _call(layer, query, value, key=key, training=False) for _ in range(2)
    ]
    for result in inference:
        np.testing.assert_allclose(result[0], plain[0], rtol=1e-6)
        np.testing.assert_allclose(result[1], plain[1], rtol=1e-6)
    output, weights = _call(layer, query, value, key=key, training=True)
    assert not np.allclose(output, plain[0])
    # Inverted dropout on the weights: each is dropped or scaled by 1 / (1 - rate).
    dropped = weights == 0
    assert 0.2 < dropped.mean() < 0.8
    np.testing.assert_allclose(
        weights[~dropped], plain[1][~dropped] / (1 - rate), rtol=1e-5
    )
    np.testing.assert_allclose(
        output, np.einsum("bts,bsd->btd", weights, value), rtol=1e-4, atol=1e-5
    )
    # The seed makes the dropout reproducible.
    again = SoftAttention(score="dot", dropout=rate, seed=1)
    np.testing.assert_array_equal(
        _call(again, query, value, key=key, training=True)[1], weights
    )


# Error messages.


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5, "0.1", True])
def test_rejects_bad_dropout(dropout):
    with pytest.raises(ValueError, match=r"`dropout` must be a float in \[0, 1\)"):
        SoftAttention(dropout=dropout)


def test_rejects_bad_seed():
    with pytest.raises(ValueError, match=r"`seed` must be None or an integer.*'a'"):
        SoftAttention(seed="a")


def test_rejects_unknown_scorer():
    with pytest.raises(ValueError, match=r"score='cosine'"):
        SoftAttention(score="cosine")


def test_rejects_key_and_value_of_different_lengths():
    query, key, value = _inputs("dot", s=5)
    with pytest.raises(
        ValueError,
        match=r"`key` and `value` must have the same length.*"
        r"key length=4, value length=5",
    ):
        SoftAttention()(query, value, key=key[:, :4])
    with pytest.raises(ValueError, match=r"`key` and `value` must have the same"):
        SoftAttention()(
            keras.Input((3, 6)), keras.Input((5, 4)), key=keras.Input((4, 6))
        )


def test_rejects_batch_size_mismatch():
    query, key, value = _inputs("dot")
    message = r"`query` and `value` must have the same batch size"
    with pytest.raises(ValueError, match=message):
        SoftAttention()(query[:1], value)


@pytest.mark.parametrize(
    "argument, rank", [("query", 2), ("query", 4), ("value", 2), ("key", 4)]
)
def test_rejects_wrong_rank(argument, rank):
    query, key, value = _inputs("dot")
    inputs = {"query": query, "value": value, "key": key}
    inputs[argument] = np.zeros((2, 5, 6, 1)[:rank], "float32")
    with pytest.raises(
        ValueError, match=rf"`{argument}` must have rank 3.*\(rank {rank}\)"
    ):
        SoftAttention()(**inputs)


def test_dot_rejects_different_query_and_key_sizes():
    query, key, value = _inputs("additive")  # Dq = 6, Dk = 7
    with pytest.raises(ValueError, match=r"same feature size"):
        SoftAttention(score="dot")(query, value, key=key)


@pytest.mark.parametrize("argument", ["query_mask", "value_mask", "attention_mask"])
def test_rejects_float_mask(argument):
    query, value, _ = _inputs("dot", t=3, s=5)
    masks = {
        "query_mask": np.ones((2, 3), "float32"),
        "value_mask": np.ones((2, 5), "float32"),
        "attention_mask": np.ones((2, 3, 5), "float32"),
    }
    with pytest.raises(TypeError, match=rf"`{argument}` must be a boolean or integer"):
        SoftAttention()(query, value, **{argument: masks[argument]})


@pytest.mark.parametrize(
    "argument, shape, message",
    [
        ("value_mask", (2, 4), r"`value_mask` must have length 5 on axis 1"),
        ("value_mask", (3, 5), r"`value_mask` must have batch size 2 on axis 0"),
        ("value_mask", (2, 5, 1), r"`value_mask` must have rank 2"),
        ("key_mask", (2, 6), r"`key_mask` must have length 5 on axis 1"),
        ("query_mask", (2, 5), r"`query_mask` must have length 3 on axis 1"),
        ("query_mask", (2,), r"`query_mask` must have rank 2"),
        ("attention_mask", (2, 3, 4), r"`attention_mask` must have key length 5"),
        ("attention_mask", (2, 5, 5), r"`attention_mask` must have query length 3"),
        ("attention_mask", (5,), r"`attention_mask` must have rank 2 or 3\. "),
        # One head: a (B, H, T, S) mask is refused, not broadcast.
        ("attention_mask", (2, 1, 3, 5), r"`attention_mask` must have rank 2 or 3\. "),
    ],
)
def test_rejects_wrongly_shaped_mask(argument, shape, message):
    query, value, _ = _inputs("dot", t=3, s=5)
    with pytest.raises(ValueError, match=message):
        SoftAttention()(query, value, **{argument: np.ones(shape, bool)})


@pytest.mark.parametrize("name", ["SoftAttention", "HardAttention"])
def test_symbolic_call_binds_masks_given_by_position(name):
    """A functional model built with the masks passed by position (as `call`
    takes them) computes the eager call, and its output specs follow
    `return_attention_scores` given by name."""
    from keras_attention import layers

    layer = getattr(layers, name)()
    query, value = keras.Input((5, 8)), keras.Input((7, 8))
    query_mask = keras.Input((5,), dtype="bool")
    value_mask = keras.Input((7,), dtype="bool")
    output = layer(query, value, None, query_mask, value_mask)
    assert tuple(output.shape) == (None, 5, 8)
    model = keras.Model([query, value, query_mask, value_mask], output)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 5, 8)).astype("float32")
    v = rng.normal(size=(2, 7, 8)).astype("float32")
    q_mask = np.array([[1, 1, 1, 0, 0], [1] * 5], bool)
    v_mask = np.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
    np.testing.assert_allclose(
        harness.to_numpy(model([q, v, q_mask, v_mask])),
        harness.to_numpy(layer(q, v, None, q_mask, v_mask)),
        rtol=1e-6, atol=1e-6,
    )
    scored = layer(query, value, return_attention_scores=True)
    assert [tuple(x.shape) for x in scored][:2] == [(None, 5, 8), (None, 5, 7)]
