"""Tests of the attention core: the kernel table and every kernel, called
with explicit sizes, against numpy and against each other.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `K` head size.
"""

import keras
import numpy as np
import pytest
from keras import ops

import harness
import numpy_reference as ref
from keras_attention import backend
from keras_attention import kernels
from keras_attention import scoring
from keras_attention.kernels import blocked
from keras_attention.kernels import choice
from keras_attention.kernels import chunked
from keras_attention.kernels import fused

BACKEND = keras.backend.backend()
B, H, K = 2, 4, 3


def _normal(shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).normal(size=shape)).astype("float32")


def _numpy_kernel(q, k, v, allowed, scale):
    """softmax(q k^T scale) v per head in float64, `(B, T, H, K)` layout;
    a row that sees no key is NaN (a bare kernel's contract excludes it)."""
    serving = np.arange(q.shape[2]) // (q.shape[2] // k.shape[2])
    k, v = k[:, :, serving].astype("float64"), v[:, :, serving].astype("float64")
    scores = np.einsum("bthk,bshk->bhts", q.astype("float64"), k) * scale
    scores = np.where(allowed, scores, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bshk->bthk", weights, v)


def _gradients(fn, inputs):
    return harness.input_gradients(
        fn, inputs, lambda shape: _normal(shape, seed=9), jit=True
    )


# The table.

PREFERENCES = {
    "tensorflow": backend.Preferences(
        blocked="always",
        blocked_min_queries=32,
        causal_blocks=2,
        chunk_long_queries=True,
        linear_projections=True,
        fuse_cached_projections=True,
        repeat_single_key_value_head=True,
        cache_windows=True,
        causal_tiles=True,
    ),
    "jax": backend.Preferences(
        blocked="always", normalize_last=True, chunk_long_queries=True, guard_with_cond=False,
        linear_projections=True, cache_windows=True, causal_tiles=True,
    ),
    "torch": backend.Preferences(linear_projections=True, dropout_kernel=True, direct_calls=True),
}


def _choose(t=8, s=8, v=K, preferences=None, **kwargs):
    return kernels.choose_kernel(
        (B, t, H, K), (B, s, H, K), (B, s, H, v), "float32",
        dot_product=kwargs.pop("dot_product", True),
        preferences=preferences, **kwargs,
    )


@pytest.mark.parametrize(
    "kwargs, row",
    [
        (dict(fused=False), 1),
        (dict(dot_product=False), 2),
        (dict(weights_needed=True), 3),
        (dict(dropout_active=True), 3),
        (dict(v=K + 1), 4),
    ],
    ids=["fused_off", "other_scorer", "weights", "dropout", "value_size"],
)
def test_explicit_rows_come_first_on_every_backend(kwargs, row):
    for preferences in PREFERENCES.values():
        got = _choose(preferences=preferences, **kwargs)
        # Dropout alone goes to a backend's fused kernel with dropout (torch).
        own = preferences.dropout_kernel and list(kwargs) == ["dropout_active"]
        assert (got.kernel, got.row) == (choice.DROPOUT if own else choice.EXPLICIT, row)


def test_dropout_kernel_row_needs_every_condition():
    torch = PREFERENCES["torch"]
    # A fused kernel: it carries the fused rows' dtype and guards.
    assert _choose(preferences=torch, dropout_active=True) == choice.Choice(
        choice.DROPOUT, 3, "float32"
    )
    assert _choose(preferences=torch, dropout_active=True, cached=True) == choice.Choice(
        choice.DROPOUT, 3, "float32", guard_on_inputs=False
    )
    for kwargs in (
        dict(fused=False),
        dict(dot_product=False),
        dict(weights_needed=True),
        dict(v=K + 1),
    ):
        got = _choose(preferences=torch, dropout_active=True, **kwargs)
        assert got.kernel == choice.EXPLICIT, kwargs


def test_table_rows_per_backend_preferences():
    tf, jax, torch = (PREFERENCES[name] for name in ("tensorflow", "jax", "torch"))
    long = dict(chunk_above_bytes=0, chunk_bytes=B * H * 8 * 4 * 3)  # 3 queries
    # The chunks' NaN guard runs always, never as a `cond`.
    assert _choose(preferences=tf, **long) == choice.Choice(
        choice.CHUNKED, 5, "float32", chunk_size=3, guard_with_cond=False
    )
    assert _choose(preferences=jax, **long).kernel == choice.CHUNKED
    assert _choose(preferences=torch, **long).kernel == choice.FUSED  # flash: no chunks
    assert (_choose(preferences=tf, t=32).kernel, _choose(preferences=tf, t=32).row) == (
        choice.BLOCKED, 6
    )
    # Fewer queries: Keras's kernel, unless they read a cache.
    assert (_choose(preferences=tf, t=31).kernel, _choose(preferences=tf, t=31).row) == (
        choice.FUSED, 7
    )
    assert _choose(preferences=tf, t=1, cached=True).row == 6
    lower = kernels.choose_kernel(
        (B, 8, H, K), (B, 8, H, K), (B, 8, H, K), "float16", dot_product=True,
        preferences=tf,
    )
    assert lower.row == 6  # the threshold was measured in float32 only
    assert _choose(preferences=tf, t=None).kernel == choice.FUSED  # dynamic length
    for kwargs in (dict(t=1, s=1), dict(t=512, s=512), dict(t=512, s=512, causal=True)):
        assert _choose(preferences=jax, **kwargs).row == 6, kwargs  # any static length
    assert _choose(preferences=jax, t=None).kernel == choice.FUSED
    assert _choose(preferences=torch).row == 7
    # The NaN guard: a `cond`, except JAX outside a cache.
    assert _choose(preferences=tf).guard_with_cond
    assert not _choose(preferences=jax).guard_with_cond
    assert _choose(preferences=jax, cached=True).guard_with_cond


def test_the_running_backend_declares_its_row():
    assert backend.preferences() == PREFERENCES[BACKEND]
    got = _choose(t=32, s=32)
    expected = {"tensorflow": choice.BLOCKED, "jax": choice.BLOCKED}
    assert got.kernel == expected.get(BACKEND, choice.FUSED)


def test_chunk_size():
    per_query = B * H * 5 * 4  # bytes of float32 scores of one query
    assert chunked.chunk_size(B, 7, H, 5) is None  # short: one block
    # Under the threshold the scores stay one block, whatever the chunk size.
    assert chunked.chunk_size(B, 7, H, 5, chunk_bytes=3 * per_query) is None
    above = 7 * per_query - 1
    assert chunked.chunk_size(B, 7, H, 5, above, 3 * per_query) == 3
    assert chunked.chunk_size(B, 7, H, 5, above, 7 * per_query) is None  # one chunk
    assert chunked.chunk_size(B, 7, H, 5, above, 1) == 1
    assert chunked.chunk_size(None, 7, H, 5, above // B, 3 * per_query // B) == 3
    assert chunked.chunk_size(B, None, H, 5, 0, 1) is None


def test_causal_blocks_cover_the_queries_once():
    blocks = blocked.causal_blocks(19, 19, block_size=4)
    assert len(blocks) == 4 and blocks[0][0] == 0 and blocks[-1][1] == 19
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(blocks, blocks[1:]))
    assert len(blocked.causal_blocks(19, 19, block_size=4, max_blocks=3)) == 3
    assert blocked.causal_blocks(7, 19, block_size=4) == [(0, 7)]  # under two blocks
    assert blocked.causal_blocks(19, 7, block_size=4) == [(0, 19)]  # T > S


# The kernels against numpy.


@pytest.mark.parametrize(
    "t, s, groups, masked",
    [(19, 19, 4, False), (13, 21, 2, True), (9, 9, 1, True), (1, 9, 2, True)],
    ids=["self", "offset_gqa_mask", "mqa_mask", "one_query"],
)
@pytest.mark.parametrize("normalize_last", [False, True], ids=["softmax", "normalize_last"])
def test_blocked_kernel_matches_numpy(t, s, groups, masked, normalize_last):
    # Causal blocks of at least 3 queries, bottom-right aligned, with a
    # per-head mask or one broadcast over the queries.
    rng = np.random.default_rng(11)
    q = _normal((B, t, H, K), seed=1)
    k, v = _normal((B, s, groups, K), seed=2), _normal((B, s, groups, K), seed=3)
    for causal in (True, False):
        allowed = np.ones((B, H, t, s), bool)
        mask = None
        if masked:
            mask = rng.random((B, H, 1 if t == 1 else t, s)) > 0.4
            mask[..., -1] = True  # every row sees a key
            allowed &= mask
        if causal:
            allowed &= ref.causal_mask(t, s)
        got = blocked.blocked_attention(
            q, k, v, mask, 0.7, causal, block_size=3, normalize_last=normalize_last
        )
        np.testing.assert_allclose(
            harness.to_numpy(got), _numpy_kernel(q, k, v, allowed, 0.7),
            rtol=1e-5, atol=1e-5,
        )


@pytest.mark.parametrize("chunk", [2, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_query_chunks_equal_one_block_with_gradients(chunk, masked):
    # T = 5 queries in chunks of 2 (2 + 2 + 1) or 3 (3 + 2), causal,
    # bottom-right aligned against S = 7 keys.
    t, s = 5, 7
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, 2, K), 2), _normal((B, s, 2, K), 3)
    mask = None
    allowed = ref.causal_mask(t, s)[None, None] & np.ones((B, H, t, s), bool)
    if masked:
        mask = np.random.default_rng(4).random((B, 1, t, s)) > 0.3
        mask[..., 0] = True
        allowed = allowed & mask
    whole = choice.Choice(choice.FUSED, 7)
    parts = choice.Choice(choice.CHUNKED, 5, chunk_size=chunk)

    def attend(chosen):
        return lambda q, k, v: fused.attend(
            chosen, q, k, v, masking_or_none(mask, t, s), 0.6, False
        )

    def masking_or_none(mask, t, s):
        causal = ref.causal_mask(t, s)[None, None]
        return ops.convert_to_tensor(causal if mask is None else causal & mask)

    got = harness.to_numpy(attend(parts)(q, k, v))
    np.testing.assert_allclose(got, _numpy_kernel(q, k, v, allowed, 0.6), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, harness.to_numpy(attend(whole)(q, k, v)), rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(
        _gradients(attend(parts), [q, k, v]), _gradients(attend(whole), [q, k, v])
    ):
        assert np.all(np.isfinite(mine))
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)


def test_chunks_with_the_causal_flag_build_their_own_rows():
    t = s = 6
    q, k, v = _normal((B, t, H, K), 5), _normal((B, s, H, K), 6), _normal((B, s, H, K), 7)
    got = chunked.chunked_attention(q, k, v, None, 0.5, True, 4)
    allowed = ref.causal_mask(t, s)[None, None] & np.ones((B, H, t, s), bool)
    np.testing.assert_allclose(
        harness.to_numpy(got), _numpy_kernel(q, k, v, allowed, 0.5), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kernel", [choice.FUSED, choice.BLOCKED, choice.CHUNKED])
def test_fused_kernels_zero_fully_masked_rows_and_stop_nan(kernel):
    t, s = 4, 6
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, H, K), 2), _normal((B, s, H, K), 3)
    mask = np.ones((B, 1, t, s), bool)
    mask[0, 0, 1] = False  # a query that sees nothing
    mask[:, :, :, -1] = False  # a key nobody sees, holding NaN
    mask[1, 0, 2, -1] = True  # ... but for one query, which must get NaN
    k[:, -1] = np.nan
    chosen = choice.Choice(kernel, 0, chunk_size=3 if kernel == choice.CHUNKED else None)
    got = harness.to_numpy(fused.attend(chosen, q, k, v, ops.convert_to_tensor(mask), 0.5, False))
    assert np.all(got[0, 1] == 0)
    assert np.all(np.isnan(got[1, 2]))
    clean = np.ones_like(got, bool)
    clean[0, 1] = clean[1, 2] = False
    k[:, -1] = 0.0
    allowed = np.broadcast_to(mask, (B, H, t, s))
    np.testing.assert_allclose(
        got[clean], _numpy_kernel(q, k, v, allowed, 0.5)[clean], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kernel", [choice.FUSED, choice.BLOCKED, choice.CHUNKED])
@pytest.mark.parametrize("t", [1, 3], ids=["one_query", "three_queries"])
def test_one_row_mask_zeroes_hidden_keys_and_values_without_a_check(kernel, t):
    # A mask of one row (a decoding step's written slots, a padding mask
    # alone): NaN and inf in the keys and values hidden from every query
    # reach neither the outputs nor the gradients, and a batch row that sees
    # no key gets 0.
    s, groups = 6, 2
    q = _normal((B, t, H, K), 1)
    k, v = _normal((B, s, groups, K), 2), _normal((B, s, groups, K), 3)
    mask = np.ones((B, 1, 1, s), bool)
    mask[0, ..., 4:] = False  # batch row 0: the last two slots unwritten
    mask[1] = False  # batch row 1 sees nothing
    k[0, 4], v[0, 5], k[1, 0], v[1, 2] = np.nan, np.inf, np.inf, np.nan
    chosen = choice.Choice(kernel, 0, chunk_size=2 if kernel == choice.CHUNKED else None)

    def attend(q, k, v):
        return fused.attend(chosen, q, k, v, ops.convert_to_tensor(mask), 0.5, False)

    got = harness.to_numpy(attend(q, k, v))
    assert np.all(got[1] == 0)
    allowed = np.broadcast_to(mask[:1], (1, H, t, s))
    clean_k, clean_v = np.nan_to_num(k, posinf=0.0), np.nan_to_num(v, posinf=0.0)
    np.testing.assert_allclose(
        got[:1], _numpy_kernel(q[:1], clean_k[:1], clean_v[:1], allowed, 0.5),
        rtol=1e-5, atol=1e-5,
    )
    d_q, d_k, d_v = _gradients(attend, [q, k, v])
    for grad in (d_q, d_k, d_v):
        assert np.all(np.isfinite(grad))
    assert np.all(d_k[0, 4:] == 0) and np.all(d_v[0, 4:] == 0) and np.all(d_k[1] == 0)
    # The same outputs with the hidden slots finite: nothing hidden was read.
    np.testing.assert_allclose(got, harness.to_numpy(attend(q, clean_k, clean_v)), atol=1e-6)


# The entry point.


def test_attention_entry_point_agrees_across_kernels_and_with_numpy():
    t, s = 5, 5
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, 2, K), 2), _normal((B, s, 2, K), 3)
    scorer = scoring.ScaledDotProduct()
    allowed = ref.causal_mask(t, s)[None, None] & np.ones((B, H, t, s), bool)
    expected = _numpy_kernel(q, k, v, allowed, K**-0.5)
    with kernels.tracing() as taken:
        fast, none = kernels.attention(q, k, v, scorer, causal=True, owner="fast")
        slow, weights = kernels.attention(
            q, k, v, scorer, causal=True, fused=False, owner="slow"
        )
    assert none is None and tuple(weights.shape) == (B, H, t, s)
    assert [owner for owner, _ in taken] == ["fast", "slow"]
    assert taken[0][1].kernel != choice.EXPLICIT and taken[1][1].kernel == choice.EXPLICIT
    for got in (fast, slow):
        np.testing.assert_allclose(harness.to_numpy(got), expected, rtol=1e-5, atol=1e-5)


def test_recording_gives_the_weights_of_every_kernel():
    t, s = 3, 4
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, H, K), 2), _normal((B, s, H, K), 3)
    mask = np.random.default_rng(0).random((B, t, s)) > 0.3
    scorer = scoring.ScaledDotProduct()
    assert not kernels.is_recording()
    with kernels.recording() as records:
        kernels.attention(q, k, v, scorer, mask=mask, owner="fused")
        _, weights = kernels.attention(q, k, v, scorer, mask=mask, fused=False, owner="explicit")
        kernels.attention(q, k, v, scorer, mask=mask)  # no owner: not recorded
        assert kernels.is_recording()
    assert not kernels.is_recording()
    assert [owner for owner, _ in records] == ["fused", "explicit"]
    for _, recorded in records:
        np.testing.assert_allclose(
            harness.to_numpy(recorded), harness.to_numpy(weights), rtol=1e-6, atol=1e-6
        )
    assert np.all(harness.to_numpy(weights)[np.broadcast_to(~mask[:, None], (B, H, t, s))] == 0)


@pytest.mark.parametrize("normalize_last", [False, True], ids=["softmax", "normalize_last"])
def test_blocked_kernel_gradients_through_several_blocks(normalize_last):
    # 19 causal queries in blocks of 5, 5, 5 and 4, against the backend's
    # kernel with the causal mask.
    t = 19
    q, k, v = _normal((B, t, H, K), 1), _normal((B, t, 2, K), 2), _normal((B, t, 2, K), 3)

    def blocked_fn(q, k, v):
        return blocked.blocked_attention(
            q, k, v, None, 0.5, True, block_size=4, normalize_last=normalize_last
        )

    def plain_fn(q, k, v):
        mask = ops.convert_to_tensor(ref.causal_mask(t, t)[None, None])
        return fused.run(choice.Choice(choice.FUSED, 7), q, k, v, mask, 0.5, False)

    np.testing.assert_allclose(
        harness.to_numpy(blocked_fn(q, k, v)), harness.to_numpy(plain_fn(q, k, v)),
        rtol=1e-5, atol=1e-5,
    )
    for mine, theirs in zip(_gradients(blocked_fn, [q, k, v]), _gradients(plain_fn, [q, k, v])):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)
