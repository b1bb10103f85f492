"""Tests of `compiled_steps._attend`, the single-query attention of the
decoding steps in `keras.ops` (per-head einsums for a short cache,
block-diagonal matmuls for a long one), against numpy in float64.

Shape legend: `B` batch, `n` cached positions, `H` query heads, `G`
key/value heads, `K` head size.

The steps themselves are tested against the layers in `test_fast_paths.py`.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention.backend import compiled_steps

B, H, K = 2, 4, 8
SCALE = 0.35
WAYS = {
    "per_head": compiled_steps._attend_per_head,
    "block_diagonal": compiled_steps._attend_block_diagonal,
}


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


def _inputs(length, groups, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, 1, H, K))
    keys = rng.normal(size=(B, length, groups, K))
    values = rng.normal(size=(B, length, groups, K))
    # Rounded to `dtype` first, so that the reference reads the same values.
    return [
        harness.to_numpy(keras.ops.cast(x, dtype)).astype("float64") for x in (q, keys, values)
    ]


def _attend(attend, inputs, dtype, mask):
    q, keys, values = (keras.ops.cast(x, dtype) for x in inputs)
    if mask is not None:
        mask = keras.ops.convert_to_tensor(mask)
    output = attend(q, keys, values, mask, SCALE)
    assert keras.backend.standardize_dtype(output.dtype) == dtype
    assert tuple(output.shape) == (B, 1, H, K)
    return harness.to_numpy(keras.ops.cast(output, "float32")).astype("float64")


def _mask(kind, length):
    if kind == "none":
        return None
    if kind == "per_row":  # the first positions seen, as a decoding step's cache
        return np.arange(length)[None] < np.array([[3], [length]])
    return (np.arange(length) % 3 != 1)[None]  # "shared": (1, n)


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("mask", ["none", "per_row", "shared"])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attend_equals_numpy(way, groups, mask):
    inputs = _inputs(7, groups, "float32")
    mask = _mask(mask, 7)
    got = _attend(WAYS[way], inputs, "float32", mask)
    np.testing.assert_allclose(got, _reference(*inputs, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize(
    "dtype, tolerance", [("bfloat16", 3e-2), ("float16", 3e-3)], ids=["bfloat16", "float16"]
)
def test_attend_in_half_precision(way, dtype, tolerance):
    """Half-precision caches: the softmax in float32; the rest as precise as
    the dtype's rounding of the scaled query, the scores, the weights and
    the output allows."""
    inputs = _inputs(7, 2, dtype, seed=1)
    mask = _mask("per_row", 7)
    got = _attend(WAYS[way], inputs, dtype, mask)
    np.testing.assert_allclose(got, _reference(*inputs, mask), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("groups", [4, 1], ids=["mha", "mqa"])
def test_attend_takes_the_matmuls_for_a_long_cache(groups):
    """The einsums up to `BLOCK_DIAGONAL_SLOTS_PER_GROUP` slots per key/value
    head, the matmuls past it; both equal numpy."""
    boundary = compiled_steps.BLOCK_DIAGONAL_SLOTS_PER_GROUP * groups
    for length, way in [(boundary, "per_head"), (boundary + 1, "block_diagonal")]:
        inputs = _inputs(length, groups, "float32", seed=length)
        mask = _mask("per_row", length)
        got = _attend(compiled_steps._attend, inputs, "float32", mask)
        np.testing.assert_array_equal(got, _attend(WAYS[way], inputs, "float32", mask))
        np.testing.assert_allclose(got, _reference(*inputs, mask), rtol=1e-5, atol=1e-5)
