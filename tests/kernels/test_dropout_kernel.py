"""Tests of attention with dropout on the weights: the backend's dropout
kernel (torch, `backend.dropout_attention`, row 3 of `choice.py`'s table)
and the explicit kernel it stands in for, against numpy and each other.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `K` head size.
"""

import keras
import numpy as np
import pytest

import harness
import numpy_reference as ref
from keras_attention import backend
from keras_attention import kernels
from keras_attention import scoring
from keras_attention.kernels import choice
from keras_attention.layers import MultiHeadAttention

BACKEND = keras.backend.backend()
B, T, S, H, K = 2, 5, 7, 4, 3
RATE = 0.3
# The kernel dot-product attention with dropout takes on this backend.
KERNEL = choice.DROPOUT if backend.preferences().dropout_kernel else choice.EXPLICIT


def _normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _inputs(groups=H):
    return _normal((B, T, H, K), 1), _normal((B, S, groups, K), 2), _normal((B, S, groups, K), 3)


def _mask():
    mask = np.random.default_rng(4).random((B, T, S)) > 0.3
    mask[0, 1] = False  # a query that sees nothing
    return mask


def _attend(q, k, v, mask=None, seed=7, fused=True, causal=False, owner="call"):
    output, _ = kernels.attention(
        q, k, v, scoring.ScaledDotProduct(), mask=mask, causal=causal,
        dropout=RATE, training=True, seed=keras.random.SeedGenerator(seed),
        fused=fused, owner=owner,
    )
    return output


def _numpy_dropout_attention(q, k, v, allowed, seed=7):
    """float64 softmax weights times the noise the first draw of
    `SeedGenerator(seed)` makes for `(B, H, T, S)` weights, then `@ v`."""
    noise = harness.to_numpy(
        backend.dropout(np.ones(allowed.shape, "float32"), RATE, keras.random.SeedGenerator(seed))
    ).astype("float64")
    serving = np.arange(H) // (H // k.shape[2])
    k, v = k[:, :, serving].astype("float64"), v[:, :, serving].astype("float64")
    scores = np.einsum("bthk,bshk->bhts", q.astype("float64"), k) * K**-0.5
    weights = ref.masked_softmax(scores, allowed)
    return np.einsum("bhts,bshk->bthk", weights * noise, v)


@pytest.mark.parametrize("groups", [H, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("masked", ["none", "mask", "causal"])
def test_dropout_attention_against_numpy(groups, masked):
    q, k, v = _inputs(groups)
    mask = _mask() if masked == "mask" else None
    with kernels.tracing() as taken:
        got = harness.to_numpy(_attend(q, k, v, mask, causal=masked == "causal"))
    assert [chosen.kernel for _, chosen in taken] == [KERNEL]
    allowed = np.ones((B, H, T, S), bool)
    if masked == "mask":
        allowed &= mask[:, None]
    if masked == "causal":
        allowed &= ref.causal_mask(T, S)[None, None]
    expected = _numpy_dropout_attention(q, k, v, allowed)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    if masked == "mask":
        assert np.all(got[0, 1] == 0)  # fully masked row: exactly 0


def test_dropout_kernel_equals_explicit_kernel_with_gradients():
    q, k, v = _inputs(2)
    mask = _mask()
    with kernels.tracing() as taken:
        fast = _attend(q, k, v, mask, owner="fast")
        slow = _attend(q, k, v, mask, fused=False, owner="slow")
    assert [chosen.kernel for _, chosen in taken] == [KERNEL, choice.EXPLICIT]
    np.testing.assert_allclose(harness.to_numpy(fast), harness.to_numpy(slow), rtol=1e-6, atol=1e-6)
    if BACKEND == "jax":
        return  # a SeedGenerator advances by assignment, which a JAX trace refuses

    def gradients(fused):
        return harness.input_gradients(
            lambda q, k, v: _attend(q, k, v, mask, fused=fused), [q, k, v],
            lambda shape: _normal(shape, 9),
        )

    for mine, theirs in zip(gradients(True), gradients(False), strict=True):
        assert np.all(np.isfinite(mine))
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_poison_in_masked_positions_does_not_leak(poison):
    q, k, v = _inputs(2)
    mask = np.ones((B, T, S), bool)
    mask[:, :, -1] = False  # a key nobody sees, poisoned
    mask[1, 2, -1] = True  # ... but for one query, which must get NaN
    mask[0, 1] = False  # and a query that sees nothing
    dirty_k, dirty_v = k.copy(), v.copy()
    dirty_k[:, -1] = poison
    dirty_v[:, -1, 0] = poison
    clean = harness.to_numpy(_attend(q, k, v, mask))
    got = harness.to_numpy(_attend(q, dirty_k, dirty_v, mask))
    assert np.all(np.isnan(got[1, 2]))
    others = np.ones(got.shape, bool)
    others[1, 2] = False
    np.testing.assert_array_equal(got[others], clean[others])
    assert np.all(got[0, 1] == 0)
    if BACKEND == "jax":
        return
    # Nor does the poison reach a gradient (the query that sees it aside).
    mask[1, 2, -1] = False

    def gradients(k, v):
        return harness.input_gradients(
            lambda q, k, v: _attend(q, k, v, mask), [q, k, v], lambda shape: _normal(shape, 9)
        )

    for dirty, plain in zip(gradients(dirty_k, dirty_v), gradients(k, v), strict=True):
        assert np.all(np.isfinite(dirty))
        np.testing.assert_allclose(dirty, plain, atol=1e-6)


@pytest.mark.parametrize("dtype, tolerance", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_half_precision_matches_float32(dtype, tolerance):
    q, k, v = _inputs(2)
    mask = _mask()
    want = harness.to_numpy(_attend(q, k, v, mask))
    cast = [keras.ops.cast(x, dtype) for x in (q, k, v)]
    got = _attend(*cast, mask)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    np.testing.assert_allclose(harness.to_numpy(keras.ops.cast(got, "float32")), want,
                               rtol=tolerance, atol=tolerance)


def test_multi_head_attention_in_training_takes_the_dropout_kernel():
    x = _normal((B, T, 8), 5)
    mask = _mask()[:, :, :T]
    layers = [
        MultiHeadAttention(2, 4, dropout=RATE, seed=3, fused=fused) for fused in (True, False)
    ]
    for layer in layers:
        layer(x, x)
    layers[1].set_weights(layers[0].get_weights())
    with kernels.tracing() as taken:
        fast, slow = (harness.to_numpy(layer(x, x, attention_mask=mask, training=True))
                      for layer in layers)
        harness.to_numpy(layers[0](x, x, attention_mask=mask))  # inference: fused
    assert [chosen.kernel for _, chosen in taken][:2] == [KERNEL, choice.EXPLICIT]
    assert taken[2][1].kernel not in (choice.EXPLICIT, choice.DROPOUT)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-5)  # same seed, same mask
