"""Tests of attention with dropout on the weights in training: on torch its
fused kernel with `dropout_p` (`backend.dropout_attention`, row 3 of
`choice.py`'s table), elsewhere the explicit kernel (Keras's fused kernels
take no dropout), against numpy.

The reference applies the noise the kernel drew: the explicit kernel draws
`backend.dropout`'s, torch's SDPA its own, recovered from a call with the
same seed whose values are the one-hot vectors of the keys (so the output is
the dropped weights themselves; hence `K == S`).

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
B, T, S, H, K = 2, 5, 7, 4, 7
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


def _attend(q, k, v, mask=None, seed=7, fused=True, causal=False, owner="call", rate=RATE):
    """Attention in training; `seed` an int for a stateless draw, or a
    `SeedGenerator` (whose first draw the other backends' reference reads)."""
    output, _ = kernels.attention(
        q, k, v, scoring.ScaledDotProduct(), mask=mask, causal=causal,
        dropout=rate, training=True, seed=seed, fused=fused, owner=owner,
    )
    return output


def _allowed(mask=None, causal=False):
    allowed = np.ones((B, H, T, S), bool)
    if mask is not None:
        allowed &= mask[:, None]
    if causal:
        allowed &= ref.causal_mask(T, S)[None, None]
    return allowed


def _noise(q, k, seed, mask=None, causal=False):
    """The noise `(B, H, T, S)` (0 or `1 / (1 - RATE)`) the kernel applied
    to the weights of these queries and keys; `seed()` gives the seed that
    call took afresh (an int, or a new `SeedGenerator` of the same seed)."""
    if KERNEL == choice.EXPLICIT:
        ones = np.ones((B, H, T, S), "float32")
        return harness.to_numpy(backend.dropout(ones, RATE, seed())).astype("float64")
    groups = k.shape[2]
    one_hot = np.broadcast_to(np.eye(S, dtype="float32")[None, :, None], (B, S, groups, S))
    dropped = harness.to_numpy(_attend(q, k, one_hot.copy(), mask, seed(), causal=causal))
    return (dropped.transpose(0, 2, 1, 3) != 0) / (1 - RATE)  # (B, H, T, S)


def _reference(q, k, v, allowed, noise, cotangent=None):
    """float64 dropout attention and, given a cotangent `(B, T, H, K)`, the
    gradients of `sum(output * cotangent)` w.r.t. q, k and v."""
    serving = np.arange(H) // (H // k.shape[2])  # the key/value head of each query head
    q, k, v = (x.astype("float64") for x in (q, k, v))
    scale = K**-0.5
    scores = np.einsum("bthk,bshk->bhts", q, k[:, :, serving]) * scale  # (B, H, T, S)
    weights = ref.masked_softmax(scores, allowed)  # (B, H, T, S)
    dropped = weights * noise
    output = np.einsum("bhts,bshk->bthk", dropped, v[:, :, serving])  # (B, T, H, K)
    if cotangent is None:
        return output
    d_dropped = np.einsum("bthk,bshk->bhts", cotangent, v[:, :, serving])
    d_weights = d_dropped * noise
    d_scores = weights * (d_weights - np.sum(d_weights * weights, axis=-1, keepdims=True))
    d_q = np.einsum("bhts,bshk->bthk", d_scores, k[:, :, serving]) * scale
    d_k_heads = np.einsum("bhts,bthk->bshk", d_scores, q) * scale  # (B, S, H, K)
    d_v_heads = np.einsum("bhts,bthk->bshk", dropped, cotangent)
    d_k, d_v = np.zeros_like(k), np.zeros_like(v)
    np.add.at(d_k, (slice(None), slice(None), serving), d_k_heads)  # sum over each group
    np.add.at(d_v, (slice(None), slice(None), serving), d_v_heads)
    return output, (d_q, d_k, d_v)


@pytest.mark.parametrize("groups", [H, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("masked", ["none", "mask", "causal"])
def test_dropout_attention_against_numpy(groups, masked):
    q, k, v = _inputs(groups)
    mask = _mask() if masked == "mask" else None
    causal = masked == "causal"
    with kernels.tracing() as taken:
        got = harness.to_numpy(_attend(q, k, v, mask, keras.random.SeedGenerator(7), causal=causal))
    assert [(chosen.kernel, chosen.row) for _, chosen in taken] == [(KERNEL, 3)]
    noise = _noise(q, k, lambda: keras.random.SeedGenerator(7), mask, causal)
    allowed = _allowed(mask, causal)
    # About RATE of the weights a query may see are dropped.
    assert abs(np.mean(noise[allowed] == 0) - RATE) < 0.15
    np.testing.assert_allclose(got, _reference(q, k, v, allowed, noise), rtol=1e-5, atol=1e-5)
    if masked == "mask":
        assert np.all(got[0, 1] == 0)  # fully masked row: exactly 0


@pytest.mark.parametrize("groups", [H, 2], ids=["mha", "gqa"])
def test_dropout_attention_gradients_against_numpy(groups):
    q, k, v = _inputs(groups)
    mask = _mask()
    cotangent = _normal((B, T, H, K), 9)
    got = harness.input_gradients(lambda q, k, v: _attend(q, k, v, mask, 11), [q, k, v], cotangent)
    noise = _noise(q, k, lambda: 11, mask)
    _, want = _reference(q, k, v, _allowed(mask), noise, cotangent)
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


def test_rate_zero_is_attention_without_dropout():
    q, k, v = _inputs(2)
    mask = _mask()
    want = _reference(q, k, v, _allowed(mask), np.ones((B, H, T, S)))
    got = harness.to_numpy(_attend(q, k, v, mask, keras.random.SeedGenerator(7), rate=0.0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if KERNEL == choice.DROPOUT:
        # The backend's kernel itself at rate 0 (the core sends rate 0 to the
        # fused row), fully masked row aside (the guards' work).
        kernel = harness.to_numpy(backend.dropout_attention(
            q, k, v, np.ones((B, 1, T, S), bool), K**-0.5, False, 0.0, 7
        ))
        np.testing.assert_allclose(kernel, _reference(q, k, v, _allowed(), 1.0),
                                   rtol=1e-5, atol=1e-5)


def test_mean_over_many_draws_is_attention_without_dropout():
    # N copies of the batch in one call draw N independent noises. Each
    # output is a sum of `w_s v_s z_s / (1 - p)`, z Bernoulli(1 - p): mean
    # `sum w_s v_s`, variance `p / (1 - p) sum (w_s v_s)^2`; the mean of N
    # draws lies within 6 standard errors (of 280 outputs, every one with
    # probability 1 - 6e-7 under the normal approximation).
    draws = 2000
    q, k, v = _inputs(2)
    mask = _mask()
    tiled = [np.tile(x, (draws, 1, 1, 1)) for x in (q, k, v)]
    outputs = harness.to_numpy(
        _attend(*tiled, np.tile(mask, (draws, 1, 1)), keras.random.SeedGenerator(5))
    ).reshape(draws, B, T, H, K).astype("float64")
    allowed = _allowed(mask)
    want = _reference(q, k, v, allowed, np.ones((B, H, T, S)))
    serving = np.arange(H) // 2
    weights = ref.masked_softmax(
        np.einsum("bthk,bshk->bhts", q, k[:, :, serving]) * K**-0.5, allowed
    )
    terms = np.einsum("bhts,bshk->bthsk", weights, v[:, :, serving].astype("float64"))
    variance = RATE / (1 - RATE) * np.sum(terms**2, axis=3)  # (B, T, H, K)
    error = np.abs(outputs.mean(axis=0) - want)
    assert np.all(error <= 6 * np.sqrt(variance / draws) + 1e-6)
    # And the noise has the rate's variance (within 10%, where 2,000 draws
    # of 280 outputs estimate it to about 1%).
    assert np.sum(outputs.var(axis=0)) == pytest.approx(np.sum(variance), rel=0.1)


def test_same_seed_same_output_other_seed_differs():
    q, k, v = _inputs(2)
    mask = _mask()

    def output(seed):
        return harness.to_numpy(_attend(q, k, v, mask, keras.random.SeedGenerator(seed)))

    first, again, other = output(1), output(1), output(2)
    np.testing.assert_array_equal(first, again)
    assert np.max(np.abs(first - other)) > 0.1
    # A SeedGenerator advances: its second call draws other noise.
    generator = keras.random.SeedGenerator(1)
    one, two = (harness.to_numpy(_attend(q, k, v, mask, generator)) for _ in range(2))
    np.testing.assert_array_equal(one, first)
    assert np.max(np.abs(one - two)) > 0.1


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
    # The same seed draws the same noise whichever branch of the guard runs.
    clean = harness.to_numpy(_attend(q, k, v, mask, 7))
    got = harness.to_numpy(_attend(q, dirty_k, dirty_v, mask, 7))
    assert np.all(np.isnan(got[1, 2]))
    others = np.ones(got.shape, bool)
    others[1, 2] = False
    np.testing.assert_array_equal(got[others], clean[others])
    assert np.all(got[0, 1] == 0)
    # Nor does the poison reach a gradient (the query that sees it aside).
    mask[1, 2, -1] = False

    def gradients(k, v):
        return harness.input_gradients(
            lambda q, k, v: _attend(q, k, v, mask, 7), [q, k, v], lambda shape: _normal(shape, 9)
        )

    for dirty, plain in zip(gradients(dirty_k, dirty_v), gradients(k, v), strict=True):
        assert np.all(np.isfinite(dirty))
        np.testing.assert_allclose(dirty, plain, atol=1e-6)


@pytest.mark.parametrize("dtype, tolerance", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_half_precision_matches_float32(dtype, tolerance):
    q, k, v = _inputs(2)
    mask = _mask()
    want = harness.to_numpy(_attend(q, k, v, mask, 7))
    cast = [keras.ops.cast(x, dtype) for x in (q, k, v)]
    got = _attend(*cast, mask, 7)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    np.testing.assert_allclose(harness.to_numpy(keras.ops.cast(got, "float32")), want,
                               rtol=tolerance, atol=tolerance)


def test_fit_multi_head_attention_with_dropout_takes_the_dropout_row():
    x = _normal((16, T, 8), 5)
    y = np.tanh(x[:, ::-1])  # a target the layer must move keys across queries for
    inputs = keras.Input((T, 8))
    layer = MultiHeadAttention(2, 4, dropout=0.1, seed=3)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    before = [harness.to_numpy(w) for w in model.get_weights()]
    with kernels.tracing() as taken:
        history = model.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False)
    chosen = [(c.kernel, c.row) for owner, c in taken if owner is layer]
    # Every training step's call (torch's eager steps, or the trace of a
    # compiled one) took row 3; Keras's trainer may first call the model
    # once in inference (to build its metrics on torch): a fused row.
    assert chosen.count((KERNEL, 3)) >= 1
    assert {kernel for kernel, _ in chosen} <= {KERNEL, choice.FUSED, choice.BLOCKED}
    if BACKEND == "torch":
        assert chosen.count((KERNEL, 3)) == 8  # 4 epochs of 2 batches, eagerly
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    after = model.get_weights()
    assert all(np.any(a != b) for a, b in zip(after, before, strict=True))
    with kernels.tracing() as taken:
        model.predict(x, verbose=0)  # inference: no dropout, a fused kernel
    assert {c.kernel for owner, c in taken if owner is layer} <= {choice.FUSED, choice.BLOCKED}
