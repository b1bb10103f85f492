"""Tests of `compiled_steps._attend`, the single-query attention of the
decoding steps in `keras.ops`, against numpy in float64.

Shape legend: `B` batch, `n` cached positions, `H` query heads, `G`
key/value heads, `K` head size.

The steps themselves are tested against the layers in `test_fast_paths.py`.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention.backend import compiled_steps

B, N, H, K = 2, 7, 4, 8
SCALE = 0.35


def _reference(q, keys, values, mask):
    """`softmax(scale q.k) v` per head over the seen positions, in float64;
    query head `h` reads key/value head `h // (H / G)`."""
    q, keys, values = (np.asarray(x, "float64") for x in (q, keys, values))
    groups = keys.shape[2]
    seen = np.broadcast_to(mask if mask is not None else True, keys.shape[:2])  # (B, n)
    repeat = H // groups
    keys = np.repeat(keys, repeat, axis=2)  # (B, n, H, K)
    values = np.repeat(values, repeat, axis=2)
    scores = SCALE * np.einsum("bhk,bnhk->bhn", q[:, 0], keys)  # (B, H, n)
    scores = np.where(seen[:, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhn,bnhk->bhk", weights, values)[:, None]  # (B, 1, H, K)


def _inputs(groups, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, 1, H, K))
    keys = rng.normal(size=(B, N, groups, K))
    values = rng.normal(size=(B, N, groups, K))
    # Rounded to `dtype` first, so that the reference reads the same values.
    return [
        harness.to_numpy(keras.ops.cast(x, dtype)).astype("float64") for x in (q, keys, values)
    ]


def _attend(inputs, dtype, mask):
    q, keys, values = (keras.ops.cast(x, dtype) for x in inputs)
    if mask is not None:
        mask = keras.ops.convert_to_tensor(mask)
    output = compiled_steps._attend(q, keys, values, mask, SCALE)
    assert keras.backend.standardize_dtype(output.dtype) == dtype
    assert tuple(output.shape) == (B, 1, H, K)
    return harness.to_numpy(keras.ops.cast(output, "float32")).astype("float64")


MASKS = {
    "none": None,
    # Per row: the first positions seen, as a decoding step's cache.
    "per_row": np.arange(N)[None] < np.array([[3], [7]]),
    "shared": (np.arange(N) % 3 != 1)[None],  # (1, n)
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attend_equals_numpy(groups, mask):
    inputs = _inputs(groups, "float32")
    mask = MASKS[mask]
    expected = _reference(*inputs, mask)
    got = _attend(inputs, "float32", mask)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, tolerance", [("bfloat16", 3e-2), ("float16", 3e-3)], ids=["bfloat16", "float16"]
)
def test_attend_in_half_precision(dtype, tolerance):
    """Half-precision caches: the softmax in float32, the sums as precise as
    the dtype's rounding of the scaled query, the scores, the weights and
    the output allow."""
    inputs = _inputs(2, dtype, seed=1)
    mask = MASKS["per_row"]
    expected = _reference(*inputs, mask)
    got = _attend(inputs, dtype, mask)
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
