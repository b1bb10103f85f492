"""Tests of `keras_attention.ops`: `masked_softmax` and `attention`.

Shape legend: `B` batch, `H` heads, `T` query length, `S` key length,
`Dq`/`Dk`/`Dv` query, key and value feature sizes.
"""

import keras
import numpy as np
import pytest
from harness import input_gradients as gradients
from harness import to_numpy
from keras import ops

from keras_attention import ops as attention_ops
from keras_attention import scoring

B, H, T, S = 2, 3, 4, 5
DQ, DK, DV = 3, 4, 6


def _rng(seed=0):
    return np.random.default_rng(seed)


def _normal(shape, seed=0, scale=1.0):
    return (scale * _rng(seed).normal(size=shape)).astype("float32")


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


def _mask_with_empty_rows(shape, seed=0):
    """A random mask `(..., T, S)` with row 0 fully masked, row 1 fully open."""
    mask = _rng(seed).random(shape) < 0.6
    mask[..., 0, :] = False
    mask[..., 1, :] = True
    return mask


def softmax_reference(scores, mask=None, axis=-1):
    """Masked softmax in float64: masked weights 0, empty rows all 0."""
    scores = np.asarray(scores, "float64")
    if mask is None:
        mask = np.ones(scores.shape, bool)
    mask = np.broadcast_to(mask, scores.shape)
    safe = np.where(mask, scores, -np.inf)
    top = np.max(safe, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    exp = np.exp(np.where(mask, scores - top, -np.inf))
    total = np.sum(exp, axis=axis, keepdims=True)
    return np.where(total > 0, exp / np.where(total > 0, total, 1.0), 0.0)


# masked_softmax ---------------------------------------------------------


def test_masked_softmax_by_hand():
    scores = np.array([[0.0, np.log(3.0), 5.0], [1.0, 2.0, 3.0]], "float32")
    mask = np.array([[True, True, False], [False, False, False]])
    weights = to_numpy(attention_ops.masked_softmax(scores, mask))
    np.testing.assert_allclose(weights, [[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]], atol=1e-7)
    assert weights[0, 2] == 0.0
    assert np.all(weights[1] == 0.0)


def test_masked_softmax_without_mask_is_softmax():
    scores = _normal((B, T, S), scale=3.0)
    weights = attention_ops.masked_softmax(scores)
    assert _dtype(weights) == "float32"
    np.testing.assert_allclose(to_numpy(weights), softmax_reference(scores), atol=1e-6)


@pytest.mark.parametrize(
    "scores_shape, mask_shape",
    [
        ((B, T, S), (B, T, S)),
        ((B, T, S), (B, 1, S)),
        ((B, T, S), (T, S)),
        ((B, H, T, S), (B, H, T, S)),
        ((B, H, T, S), (B, 1, 1, S)),
        ((B, H, T, S), (T, S)),
    ],
)
def test_masked_softmax_matches_numpy(scores_shape, mask_shape):
    # The mask broadcasts to the scores as numpy broadcasts.
    scores = _normal(scores_shape, seed=1, scale=3.0)
    if mask_shape[-2] == T:
        mask = _mask_with_empty_rows(mask_shape, seed=2)
    else:
        mask = _rng(2).random(mask_shape) < 0.6
    weights = to_numpy(attention_ops.masked_softmax(scores, mask))
    expected = softmax_reference(scores, mask)
    assert weights.shape == scores.shape
    np.testing.assert_allclose(weights, expected, atol=1e-6)
    full_mask = np.broadcast_to(mask, scores.shape)
    # Masked positions are exactly 0; rows with anything open sum to 1.
    assert np.all(weights[~full_mask] == 0.0)
    open_rows = full_mask.any(-1)
    np.testing.assert_allclose(weights.sum(-1)[open_rows], 1.0, atol=1e-6)
    assert np.all(weights[~open_rows] == 0.0)


def test_masked_softmax_fully_masked_rows_are_zero():
    scores = _normal((B, T, S), seed=3, scale=5.0)
    mask = np.ones((B, T, S), bool)
    mask[0, 2] = False
    mask[1] = False
    weights = to_numpy(attention_ops.masked_softmax(scores, mask))
    assert np.all(weights[0, 2] == 0.0)
    assert np.all(weights[1] == 0.0)
    np.testing.assert_allclose(weights[0, [0, 1, 3]].sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("offset", [-1e5, 1e6, -1e30])
def test_masked_softmax_large_offsets(offset):
    # Softmax ignores a common offset; the fill value must stay below any
    # real score, or masked positions would take the weight of open ones.
    scores = (_normal((B, T, S), seed=15, scale=3.0) + np.float32(offset)).astype(
        "float32"
    )
    mask = _mask_with_empty_rows((B, T, S), seed=16)
    weights = to_numpy(attention_ops.masked_softmax(scores, mask))
    np.testing.assert_allclose(weights, softmax_reference(scores, mask), atol=1e-6)
    np.testing.assert_allclose(weights.sum(-1)[mask.any(-1)], 1.0, atol=1e-6)


def test_masked_softmax_other_axis():
    scores = _normal((B, T, S), seed=4, scale=2.0)
    mask = _rng(5).random((B, T, S)) < 0.6
    weights = to_numpy(attention_ops.masked_softmax(scores, mask, axis=-2))
    expected = softmax_reference(scores, mask, axis=-2)
    np.testing.assert_allclose(weights, expected, atol=1e-6)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf, 1e30, -3e38])
def test_masked_softmax_poison_at_masked_positions(poison):
    scores = _normal((B, T, S), seed=6, scale=3.0)
    mask = _mask_with_empty_rows((B, T, S), seed=7)
    poisoned = np.where(mask, scores, np.float32(poison)).astype("float32")
    clean = to_numpy(attention_ops.masked_softmax(scores, mask))
    dirty = to_numpy(attention_ops.masked_softmax(poisoned, mask))
    assert np.all(np.isfinite(dirty))
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("poison", [None, np.nan, np.inf])
def test_masked_softmax_gradients(poison):
    scores = _normal((B, T, S), seed=8, scale=2.0)
    mask = _mask_with_empty_rows((B, T, S), seed=9)
    if poison is not None:
        scores = np.where(mask, scores, np.float32(poison)).astype("float32")
    cotangent = _normal((B, T, S), seed=10)

    (grad,) = gradients(
        lambda s: attention_ops.masked_softmax(s, mask), [scores], cotangent
    )
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~mask] == 0.0)
    assert np.all(grad[:, 0] == 0.0)  # the fully masked rows
    # Softmax Jacobian-vector product, d/ds sum(w * c) = w * (c - sum(w * c)).
    w = softmax_reference(scores, mask)
    expected = w * (cotangent - np.sum(w * cotangent, axis=-1, keepdims=True))
    np.testing.assert_allclose(grad, expected, atol=1e-5)


@pytest.mark.parametrize("dtype", ["int32", "int8", "uint8", "int64"])
def test_masked_softmax_integer_mask(dtype):
    scores = _normal((B, T, S), seed=11)
    bool_mask = _mask_with_empty_rows((B, T, S), seed=12)
    int_mask = bool_mask.astype(dtype) * 3  # nonzero = may attend
    from_int = to_numpy(
        attention_ops.masked_softmax(scores, ops.convert_to_tensor(int_mask))
    )
    from_bool = to_numpy(attention_ops.masked_softmax(scores, bool_mask))
    np.testing.assert_array_equal(from_int, from_bool)
    np.testing.assert_allclose(
        from_int, softmax_reference(scores, bool_mask), atol=1e-6
    )


def test_masked_softmax_float_mask_is_type_error():
    with pytest.raises(TypeError, match=r"`mask`.*bias"):
        attention_ops.masked_softmax(
            np.zeros((2, 3), "float32"), np.ones((2, 3), "float32")
        )


@pytest.mark.parametrize("dtype, atol", [("float16", 2e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("scale", [3.0, 1e4])
def test_masked_softmax_half_precision(dtype, atol, scale):
    # Scores of 1e4 make exp overflow in float16 unless softmax runs wider.
    scores32 = _normal((B, T, S), seed=13, scale=scale)
    scores = ops.cast(scores32, dtype)
    mask = _mask_with_empty_rows((B, T, S), seed=14)
    weights = attention_ops.masked_softmax(scores, mask)
    assert _dtype(weights) == dtype
    weights = to_numpy(ops.cast(weights, "float32"))
    assert np.all(np.isfinite(weights))
    assert np.all(weights[~mask] == 0.0)
    assert np.all(weights[:, 0] == 0.0)
    # Against float32 softmax of the same (rounded) scores.
    rounded = to_numpy(ops.cast(scores, "float32"))
    reference = to_numpy(attention_ops.masked_softmax(rounded, mask))
    np.testing.assert_allclose(weights, reference, atol=atol)
    np.testing.assert_allclose(reference, softmax_reference(rounded, mask), atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_masked_softmax_half_precision_extremes(dtype):
    # Largest float16 scores, poison at masked positions and an empty row.
    big = 6.0e4 if dtype == "float16" else 3.0e38
    scores32 = np.array(
        [
            [big, big, -big, np.nan],
            [np.inf, -np.inf, np.nan, big],
            [1.0, 2.0, 3.0, 4.0],
        ],
        "float32",
    )
    mask = np.array(
        [
            [True, True, True, False],
            [False, False, False, False],
            [True, False, True, True],
        ]
    )
    weights = attention_ops.masked_softmax(ops.cast(scores32, dtype), mask)
    assert _dtype(weights) == dtype
    weights = to_numpy(ops.cast(weights, "float32"))
    assert np.all(np.isfinite(weights))
    np.testing.assert_allclose(weights[0], [0.5, 0.5, 0.0, 0.0], atol=1e-3)
    assert np.all(weights[1] == 0.0)
    expected = softmax_reference(scores32[2:], mask[2:])
    np.testing.assert_allclose(weights[2:], expected, atol=2e-2)
    (grad,) = gradients(
        lambda s: attention_ops.masked_softmax(ops.cast(s, dtype), mask),
        [scores32],
        _normal(scores32.shape, seed=15),
    )
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~mask] == 0.0)


def test_masked_softmax_integer_scores():
    weights = attention_ops.masked_softmax(
        np.array([[1, 2, 3]], "int32"), np.array([[1, 1, 0]])
    )
    assert _dtype(weights) == keras.config.floatx()
    np.testing.assert_allclose(
        to_numpy(weights), softmax_reference([[1, 2, 3]], [[1, 1, 0]]), atol=1e-6
    )


# attention --------------------------------------------------------------


def scores_reference(scorer, query, key):
    """The scorer's equation in numpy, from the layer's own weights."""
    if isinstance(scorer, scoring.ScaledDotProduct):
        return query @ np.swapaxes(key, -1, -2) / np.sqrt(key.shape[-1])
    if isinstance(scorer, scoring.DotProduct):
        return query @ np.swapaxes(key, -1, -2)
    if isinstance(scorer, scoring.Bilinear):
        return query @ to_numpy(scorer.kernel) @ np.swapaxes(key, -1, -2)
    if isinstance(scorer, scoring.Additive):
        q = query @ to_numpy(scorer.query_kernel)  # (..., T, U)
        k = key @ to_numpy(scorer.key_kernel)  # (..., S, U)
        hidden = np.tanh(
            q[..., :, None, :] + k[..., None, :, :] + to_numpy(scorer.bias)
        )
        return hidden @ to_numpy(scorer.score_vector)  # (..., T, S)
    raise TypeError(scorer)


def attention_reference(scorer, query, key, value, mask=None):
    query, key, value = (np.asarray(x, "float64") for x in (query, key, value))
    weights = softmax_reference(scores_reference(scorer, query, key), mask)
    return weights @ value, weights


SCORERS = {
    "dot": lambda: scoring.DotProduct(),
    "scaled_dot": lambda: scoring.ScaledDotProduct(),
    # Built with zeros, then given random weights from numpy (below): no
    # random initializer to compile, and weights far from the defaults.
    "additive": lambda: scoring.Additive(
        units=7, kernel_initializer="zeros", bias_initializer="zeros"
    ),
    "bilinear": lambda: scoring.Bilinear(kernel_initializer="zeros"),
}


def _inputs(name, leading=(B,), seed=20):
    """query, key, value; additive and bilinear get Dq != Dk."""
    dq = DK if name in ("dot", "scaled_dot") else DQ
    query = _normal(leading + (T, dq), seed=seed)
    key = _normal(leading + (S, DK), seed=seed + 1)
    value = _normal(leading + (S, DV), seed=seed + 2)
    return query, key, value


def _built_scorer(name, query, key):
    scorer = SCORERS[name]()
    scorer(query, key)  # builds the weights before any gradient tracing
    scorer.set_weights(
        [_normal(w.shape, seed=100 + i) for i, w in enumerate(scorer.weights)]
    )
    return scorer


@pytest.mark.parametrize("name", sorted(SCORERS))
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_numpy(name, masked):
    query, key, value = _inputs(name)
    scorer = _built_scorer(name, query, key)
    mask = _mask_with_empty_rows((B, T, S), seed=21) if masked else None
    output, weights = attention_ops.attention(query, key, value, scorer, mask=mask)
    assert tuple(output.shape) == (B, T, DV)
    assert tuple(weights.shape) == (B, T, S)
    assert _dtype(output) == "float32"
    expected_output, expected_weights = attention_reference(
        scorer, query, key, value, mask
    )
    np.testing.assert_allclose(to_numpy(weights), expected_weights, atol=1e-5)
    np.testing.assert_allclose(to_numpy(output), expected_output, atol=1e-5)
    if masked:
        assert np.all(to_numpy(weights)[~mask] == 0.0)
        assert np.all(to_numpy(output)[:, 0] == 0.0)


def test_attention_by_hand():
    # One query, equal scores on two open keys: the mean of their values.
    query = np.zeros((1, 1, 2), "float32")
    key = np.array([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]], "float32")
    value = np.array([[[2.0], [4.0], [100.0]]], "float32")
    mask = np.array([[[True, True, False]]])
    output, weights = attention_ops.attention(
        query, key, value, scoring.DotProduct(), mask=mask
    )
    np.testing.assert_allclose(to_numpy(weights), [[[0.5, 0.5, 0.0]]], atol=1e-7)
    np.testing.assert_allclose(to_numpy(output), [[[3.0]]], atol=1e-6)


@pytest.mark.parametrize("name", sorted(SCORERS))
@pytest.mark.parametrize(
    "mask_shape", [(B, H, T, S), (B, 1, T, S), (B, 1, 1, S), (T, S)]
)
def test_attention_with_head_axis(name, mask_shape):
    query, key, value = _inputs(name, leading=(B, H), seed=30)
    scorer = _built_scorer(name, query, key)
    mask = _rng(31).random(mask_shape) < 0.6
    output, weights = attention_ops.attention(query, key, value, scorer, mask=mask)
    assert tuple(output.shape) == (B, H, T, DV)
    assert tuple(weights.shape) == (B, H, T, S)
    expected_output, expected_weights = attention_reference(
        scorer, query, key, value, mask
    )
    np.testing.assert_allclose(to_numpy(weights), expected_weights, atol=1e-5)
    np.testing.assert_allclose(to_numpy(output), expected_output, atol=1e-5)


@pytest.mark.parametrize("name", sorted(SCORERS))
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_attention_masked_poison_does_not_leak(name, poison):
    query, key, value = _inputs(name, seed=40)
    scorer = _built_scorer(name, query, key)
    value_mask = np.ones((B, S), bool)
    value_mask[0, [1, 4]] = False
    value_mask[1, 0] = False
    query_mask = np.ones((B, T), bool)
    query_mask[1, 2] = False
    mask = value_mask[:, None, :] & query_mask[:, :, None]  # (B, T, S)
    dirty_key = np.where(value_mask[..., None], key, np.float32(poison)).astype(
        "float32"
    )
    dirty_value = np.where(value_mask[..., None], value, np.float32(poison)).astype(
        "float32"
    )

    clean_output, clean_weights = attention_ops.attention(
        query, key, value, scorer, mask=mask
    )
    output, weights = attention_ops.attention(
        query, dirty_key, dirty_value, scorer, mask=mask
    )
    output, weights = to_numpy(output), to_numpy(weights)
    assert np.all(np.isfinite(output)) and np.all(np.isfinite(weights))
    np.testing.assert_array_equal(output, to_numpy(clean_output))
    np.testing.assert_array_equal(weights, to_numpy(clean_weights))
    assert np.all(output[1, 2] == 0.0)

    # Nor does the poison reach a gradient.
    def fn(q, k, v):
        return attention_ops.attention(q, k, v, scorer, mask=mask)[0]

    cotangent = _normal((B, T, DV), seed=41)
    clean_grads = gradients(fn, [query, key, value], cotangent)
    grads = gradients(fn, [query, dirty_key, dirty_value], cotangent)
    for clean, dirty in zip(clean_grads, grads, strict=True):
        assert np.all(np.isfinite(dirty))
        np.testing.assert_allclose(dirty, clean, atol=1e-6)
    # Keys and values nobody attends to get no gradient.
    assert np.all(grads[1][~value_mask] == 0.0) and np.all(grads[2][~value_mask] == 0.0)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_attention_fully_masked_rows(name):
    query, key, value = _inputs(name, seed=50)
    scorer = _built_scorer(name, query, key)
    mask = np.ones((B, T, S), bool)
    mask[0, 1] = False  # one empty query row
    mask[1] = False  # a batch element that attends to nothing at all

    output, weights = attention_ops.attention(query, key, value, scorer, mask=mask)
    output, weights = to_numpy(output), to_numpy(weights)
    assert np.all(output[0, 1] == 0.0) and np.all(weights[0, 1] == 0.0)
    assert np.all(output[1] == 0.0) and np.all(weights[1] == 0.0)
    expected_output, _ = attention_reference(scorer, query, key, value, mask)
    np.testing.assert_allclose(output, expected_output, atol=1e-5)

    def fn(q, k, v):
        return attention_ops.attention(q, k, v, scorer, mask=mask)[0]

    grad_q, grad_k, grad_v = gradients(
        fn, [query, key, value], _normal((B, T, DV), seed=51)
    )
    for grad in (grad_q, grad_k, grad_v):
        assert np.all(np.isfinite(grad))
    # Nothing flows from, or into, what nobody attends to.
    assert np.all(grad_q[0, 1] == 0.0)
    assert (
        np.all(grad_q[1] == 0.0)
        and np.all(grad_k[1] == 0.0)
        and np.all(grad_v[1] == 0.0)
    )
    assert np.any(grad_q[0] != 0.0) and np.any(grad_v[0] != 0.0)


@pytest.mark.parametrize("dtype", ["int32", "uint8"])
def test_attention_integer_mask(dtype):
    query, key, value = _inputs("scaled_dot", seed=60)
    scorer = scoring.ScaledDotProduct()
    bool_mask = _mask_with_empty_rows((B, T, S), seed=61)
    from_bool = attention_ops.attention(query, key, value, scorer, mask=bool_mask)
    from_int = attention_ops.attention(
        query, key, value, scorer, mask=ops.convert_to_tensor(bool_mask.astype(dtype))
    )
    for a, b in zip(from_int, from_bool, strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_attention_output_in_value_dtype():
    query, key, value = (ops.cast(x, "float16") for x in _inputs("dot", seed=62))
    mask = _mask_with_empty_rows((B, T, S), seed=63)
    output, weights = attention_ops.attention(
        query, key, value, scoring.DotProduct(), mask=mask
    )
    assert _dtype(output) == "float16"
    expected, _ = attention_reference(
        scoring.DotProduct(),
        *(to_numpy(ops.cast(x, "float32")) for x in (query, key, value)),
        mask,
    )
    np.testing.assert_allclose(
        to_numpy(ops.cast(output, "float32")), expected, atol=1e-2
    )
    assert np.all(to_numpy(ops.cast(output, "float32"))[:, 0] == 0.0)


def test_attention_custom_normalize():
    # Hard attention passes its own normalize: here, one-hot of the argmax.
    query, key, value = _inputs("dot", seed=64)

    def one_hot_argmax(scores, mask):
        return ops.one_hot(ops.argmax(scores, axis=-1), S)

    output, weights = attention_ops.attention(
        query, key, value, scoring.DotProduct(), normalize=one_hot_argmax
    )
    chosen = np.argmax(query @ np.swapaxes(key, -1, -2), axis=-1)  # (B, T)
    np.testing.assert_allclose(
        to_numpy(output),
        np.take_along_axis(value, chosen[..., None], axis=1),
        atol=1e-6,
    )


def test_attention_dropout_inactive_without_training():
    query, key, value = _inputs("scaled_dot", seed=70)
    scorer = scoring.ScaledDotProduct()
    mask = _mask_with_empty_rows((B, T, S), seed=71)
    plain = attention_ops.attention(query, key, value, scorer, mask=mask)
    for training in (False, None):
        dropped = attention_ops.attention(
            query, key, value, scorer, mask=mask, dropout=0.5, training=training, seed=1
        )
        for a, b in zip(dropped, plain, strict=True):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


@pytest.mark.parametrize("rate", [0.3, 0.5])
def test_attention_dropout_in_training(rate):
    t, s = 16, 16
    query = _normal((B, t, DK), seed=72)
    key = _normal((B, s, DK), seed=73)
    value = _normal((B, s, DV), seed=74)
    scorer = scoring.ScaledDotProduct()
    mask = _mask_with_empty_rows((B, t, s), seed=75)
    _, plain = attention_ops.attention(query, key, value, scorer, mask=mask)
    output, weights = attention_ops.attention(
        query, key, value, scorer, mask=mask, dropout=rate, training=True, seed=3
    )
    plain, output, weights = to_numpy(plain), to_numpy(output), to_numpy(weights)

    kept = weights != 0.0
    open_positions = plain != 0.0
    assert not np.any(kept & ~open_positions)  # nothing masked comes back
    dropped_fraction = 1.0 - kept[open_positions].mean()
    assert 0.05 < dropped_fraction < 0.95  # some zeroed, some kept
    # Kept weights are rescaled by 1 / (1 - rate).
    np.testing.assert_allclose(weights[kept], plain[kept] / (1.0 - rate), rtol=1e-5)
    # The output is the weighted sum with the dropped weights.
    np.testing.assert_allclose(output, weights @ value, atol=1e-5)
    # Fully masked rows stay exactly 0.
    assert np.all(weights[:, 0] == 0.0) and np.all(output[:, 0] == 0.0)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, "0.1", True, None])
def test_attention_bad_dropout(rate):
    query, key, value = _inputs("dot")
    with pytest.raises(ValueError, match=r"`dropout` must be a float in \[0, 1\)"):
        attention_ops.attention(
            query, key, value, scoring.DotProduct(), dropout=rate, training=True
        )


# helpers ----------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("float16", "float32"),
        ("bfloat16", "float32"),
        ("float32", "float32"),
        ("float64", "float64"),
    ],
)
def test_softmax_dtype(dtype, expected):
    assert attention_ops.softmax_dtype(dtype) == expected


@pytest.mark.parametrize(
    "dtype, largest",
    [
        ("float16", 65504.0),
        ("bfloat16", 3.38e38),
        ("float32", 3.40e38),
        ("float64", 1.79e308),
    ],
)
def test_mask_fill_value_is_finite_and_very_negative(dtype, largest):
    fill = attention_ops.mask_fill_value(dtype)
    assert np.isfinite(fill)
    # Far below any real score, yet `fill - fill` cannot meet `inf - inf`.
    assert -largest < fill < -0.4 * largest
    if dtype != "float64":  # JAX runs without float64 by default.
        cast = to_numpy(ops.cast(ops.cast(np.array(fill, "float32"), dtype), "float32"))
        assert np.isfinite(cast) and cast < 0
