"""Tests of `compiled_steps._attend`, the single-query attention of the
decoding steps in `keras.ops` (per-head einsums for a short cache,
block-diagonal matmuls for a long one), and of the grouped layout of a
translation's step (`_attend_grouped`, `grouped_visible`), against numpy in
float64.

Shape legend: `B` batch, `n` cached positions, `H` query heads, `G`
key/value heads, `K` head size.

The steps themselves are tested against the layers in `test_fast_paths.py`.
"""

import itertools

import keras
import numpy as np
import pytest

import harness
from keras_attention import kv_cache
from keras_attention.backend import compiled_steps
from keras_attention.layers import MultiHeadAttention

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


# The grouped layout of a translation's step: the `E` hypotheses of a source
# share its cache rows; keys `(B G, K, n)`, values `(B G, n, K)`.


def _grouped(keys, values):
    """`(B, n, G, K)` keys and values in the grouped layout."""
    cache = kv_cache.pack(keras.ops.convert_to_tensor(keys), keras.ops.convert_to_tensor(values))
    return compiled_steps.grouped_cache(cache)


def test_grouped_cache_lays_out_each_head_per_source():
    rng = np.random.default_rng(2)
    keys, values = rng.normal(size=(2, 2, 5, 3, 4)).astype("float32")  # (B, n, G, K) each
    grouped_keys, grouped_values = (harness.to_numpy(x) for x in _grouped(keys, values))
    assert grouped_keys.shape == (6, 4, 5) and grouped_values.shape == (6, 5, 4)
    for b, g in itertools.product(range(2), range(3)):
        np.testing.assert_array_equal(grouped_keys[b * 3 + g], keys[b, :, g].T)
        np.testing.assert_array_equal(grouped_values[b * 3 + g], values[b, :, g])


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("visible", ["none", "per_hypothesis"])
def test_attend_grouped_equals_numpy(beams, groups, visible):
    """Each hypothesis attends to its source's keys and values, over the
    slots it sees: the reference of `_attend` per hypothesis."""
    rng = np.random.default_rng(beams * 10 + groups)
    length = 6
    q = rng.normal(size=(B * beams, 1, H, K)).astype("float32")
    keys = rng.normal(size=(B, length, groups, K)).astype("float32")
    values = rng.normal(size=(B, length, groups, K)).astype("float32")
    seen = None
    if visible == "per_hypothesis":
        seen = rng.random((B, beams, length)) < 0.6
        seen[..., 0] = True  # every hypothesis sees a slot
    grouped_keys, grouped_values = _grouped(keys, values)
    got = compiled_steps._attend_grouped(
        keras.ops.convert_to_tensor(q), grouped_keys, grouped_values,
        None if seen is None else keras.ops.convert_to_tensor(seen), SCALE, groups,
    )
    assert tuple(got.shape) == (B * beams, 1, H, K)
    got = harness.to_numpy(got)
    for b, k in itertools.product(range(B), range(beams)):
        row = b * beams + k
        mask = None if seen is None else seen[b, k][None]
        want = _reference(q[row : row + 1], keys[b : b + 1], values[b : b + 1], mask)
        np.testing.assert_allclose(got[row : row + 1], want, rtol=1e-5, atol=1e-5)


def test_grouped_visible_follows_the_ancestry():
    """Slot `s E + j` is visible to hypothesis `k` at position `i` exactly
    when `s <= i` and row `j` holds position `s` of `k` (brute force)."""
    rng = np.random.default_rng(4)
    batch, beams, length, index = 2, 3, 5, 3
    ancestry = rng.integers(0, beams, (batch, beams, length)).astype("int32")
    got = harness.to_numpy(
        compiled_steps.grouped_visible(index, length, keras.ops.convert_to_tensor(ancestry))
    )
    assert got.shape == (batch, beams, length * beams)
    for b, k, s, j in itertools.product(range(batch), range(beams), range(length), range(beams)):
        assert got[b, k, s * beams + j] == (s <= index and ancestry[b, k, s] == j)
    alone = harness.to_numpy(compiled_steps.grouped_visible(index, length))
    np.testing.assert_array_equal(alone, (np.arange(length) <= index)[None, None])


@pytest.mark.parametrize(
    "dtype, tolerance", [("bfloat16", 3e-2), ("float16", 3e-3)], ids=["bfloat16", "float16"]
)
def test_attend_grouped_in_half_precision(dtype, tolerance):
    """Half-precision caches: computed in float32, the output in the dtype."""
    beams, groups, length = 2, 2, 7
    rng = np.random.default_rng(6)
    q, keys, values = (
        harness.to_numpy(keras.ops.cast(rng.normal(size=shape), dtype)).astype("float32")
        for shape in ((B * beams, 1, H, K), (B, length, groups, K), (B, length, groups, K))
    )
    seen = np.arange(length)[None, None] < np.array([[[3], [7]], [[5], [1]]])  # (B, E, n)
    grouped = [keras.ops.cast(x, dtype) for x in _grouped(keys, values)]
    got = compiled_steps._attend_grouped(
        keras.ops.cast(q, dtype), *grouped, keras.ops.convert_to_tensor(seen), SCALE, groups
    )
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    got = harness.to_numpy(keras.ops.cast(got, "float32"))
    for b, k in itertools.product(range(B), range(beams)):
        row = b * beams + k
        want = _reference(q[row : row + 1], keys[b : b + 1], values[b : b + 1], seen[b, k][None])
        np.testing.assert_allclose(got[row : row + 1], want, rtol=tolerance, atol=tolerance)


# Cross-attention absorbed into its projections (`absorbed_cross_cache`):
# per source, the query kernel against the keys and the values through the
# output kernel, so that a step attends with two products.


def _cross_attention(groups, use_bias, seed):
    """A built `MultiHeadAttention` (`H` heads of `K`, width 12) with
    random weights."""
    layer = MultiHeadAttention(
        num_heads=H, key_dim=K, num_key_value_heads=groups, use_bias=use_bias
    )
    layer(np.zeros((1, 2, 12), "float32"), np.zeros((1, 3, 12), "float32"))
    rng = np.random.default_rng(seed)
    for variable in layer.weights:
        variable.assign(rng.normal(scale=0.5, size=variable.shape).astype("float32"))
    return layer


def _cross_reference(layer, x, keys, values, mask):
    """The layer's attention of queries `x` `(B, E, D)` over cached keys and
    values `(B, S, G, K)` in float64: projections, softmax per head over
    the source tokens `mask` `(B, S)` marks, output projection; a source
    without a token attends to nothing (the output bias alone)."""
    query = layer.query_dense
    kernel = harness.to_numpy(query.kernel).astype("float64")  # (D, H, K)
    q = np.einsum("bed,dhk->behk", x, kernel)
    if query.bias is not None:
        q = q + harness.to_numpy(query.bias)
    repeat = H // keys.shape[2]
    keys, values = np.repeat(keys, repeat, axis=2), np.repeat(values, repeat, axis=2)
    scores = SCALE * np.einsum("behk,bshk->behs", q, keys)
    scores = np.where(mask[:, None, None, :], scores, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
    weights = np.where(mask.any(-1)[:, None, None, None], weights, 0.0)
    heads = np.einsum("behs,bshk->behk", weights, values)
    output = layer.output_dense
    out = np.einsum("behk,hkc->bec", heads, harness.to_numpy(output.kernel).astype("float64"))
    if output.bias is not None:
        out = out + harness.to_numpy(output.bias)
    return out


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
def test_absorbed_cross_attention_equals_numpy(beams, groups, use_bias):
    """Each hypothesis's cross-attention through the absorbed cache equals
    the layer's projections and attention in float64, over sources with
    padding and one without any token."""
    layer = _cross_attention(groups, use_bias, seed=beams + 10 * groups)
    rng = np.random.default_rng(groups)
    length = 5
    x = rng.normal(size=(B, beams, 12)).astype("float32")
    keys, values = rng.normal(size=(2, B, length, groups, K)).astype("float32")
    mask = np.array([[True, True, True, False, False], [False] * length])
    cache = kv_cache.hide(
        kv_cache.pack(*(keras.ops.convert_to_tensor(a) for a in (keys, values))),
        keras.ops.convert_to_tensor(mask),
    )
    absorbed = compiled_steps.absorbed_cross_cache(cache, layer, SCALE)
    got = compiled_steps._attend_absorbed(
        keras.ops.convert_to_tensor(x.reshape(B * beams, 1, 12)), absorbed,
        keras.ops.convert_to_tensor(mask), layer,
    )
    assert tuple(got.shape) == (B * beams, 1, 12)
    want = _cross_reference(layer, x.astype("float64"), keys, values, mask)
    np.testing.assert_allclose(
        harness.to_numpy(got).reshape(B, beams, 12), want, rtol=1e-4, atol=1e-4
    )


def test_cross_attention_is_absorbed_only_where_it_is_no_more_arithmetic():
    """`H S <= D + S` for `H K = D`: with 4 heads of 8 (`D` = 32), up to 10
    source tokens."""
    layer = MultiHeadAttention(num_heads=4, key_dim=8)
    layer(np.zeros((1, 1, 32), "float32"), np.zeros((1, 2, 32), "float32"))
    assert compiled_steps.absorbs_cross_attention(layer, 10)
    assert not compiled_steps.absorbs_cross_attention(layer, 11)
    assert not compiled_steps.absorbs_cross_attention(layer, None)


# What a compiled loop carries for a decoder-only model: each block's cache
# in the grouped layout (`group_caches`), back to the layers' cache after it.


@pytest.mark.parametrize("batch", [1, 3])
def test_grouped_caches_hold_the_keys_and_values_and_pack_back(batch):
    """Keys `(B G, K, L)` and values `(B G, L, K)` from the layers' `(B, 2,
    L, G, K)`; `ungroup_caches` gives the layers' caches back as they
    were."""
    rng = np.random.default_rng(batch)
    caches = tuple(rng.normal(size=(batch, 2, 5, 2, 3)).astype("float32") for _ in range(2))
    grouped = compiled_steps.group_caches(tuple(keras.ops.convert_to_tensor(c) for c in caches))
    for (keys, values), cache in zip(grouped, caches):
        assert tuple(keys.shape) == (batch * 2, 3, 5)
        assert tuple(values.shape) == (batch * 2, 5, 3)
        for b in range(batch):
            for g in range(2):
                np.testing.assert_array_equal(harness.to_numpy(keys)[b * 2 + g], cache[b, 0, :, g].T)
                np.testing.assert_array_equal(harness.to_numpy(values)[b * 2 + g], cache[b, 1, :, g])
    packed = compiled_steps.ungroup_caches(grouped, [2, 2])
    for got, cache in zip(packed, caches):
        np.testing.assert_array_equal(harness.to_numpy(got), cache)
