"""Tests of the query-chunked kernel's two passes: its output and its written
out gradients against a float64 numpy reference and against the plain path,
for every mask form it takes, and through `MultiHeadAttention` training.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `K` head size.
"""

import dataclasses
import functools

import keras
import numpy as np
import pytest
from keras import ops

import harness
import numpy_reference as ref
from keras_attention import backend
from keras_attention import kernels
from keras_attention.kernels import choice
from keras_attention.kernels import chunked
from keras_attention.kernels import fused
from keras_attention.kernels import tiles as tiles_lib
from keras_attention.layers import MultiHeadAttention

B, H, K = 2, 4, 3


def _normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _reference(q, k, v, allowed, scale, d_output):
    """Output and `(dq, dk, dv)` of `softmax(q k^T scale) v` in float64, the
    gradients of `sum(output * d_output)` worked by hand; rows that see no
    key give 0 and no gradient."""
    ratio = q.shape[2] // k.shape[2]
    q, d_output = q.astype("float64"), d_output.astype("float64")
    k = np.repeat(k.astype("float64"), ratio, axis=2)  # (B, S, H, K)
    v = np.repeat(v.astype("float64"), ratio, axis=2)
    allowed = np.broadcast_to(allowed, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    scores = np.where(allowed, np.einsum("bthk,bshk->bhts", q, k) * scale, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.where(total > 0, weights / np.where(total > 0, total, 1.0), 0.0)
    output = np.einsum("bhts,bshv->bthv", weights, v)
    d_weights = np.einsum("bthv,bshv->bhts", d_output, v)
    d_scores = weights * (d_weights - np.sum(d_weights * weights, -1, keepdims=True))
    d_q = np.einsum("bhts,bshk->bthk", d_scores, k) * scale
    d_k = np.einsum("bhts,bthk->bshk", d_scores, q) * scale
    d_v = np.einsum("bhts,bthv->bshv", weights, d_output)

    def per_group(x):  # (B, S, H, D) -> (B, S, G, D): a group sums its heads
        return x.reshape(x.shape[0], x.shape[1], -1, ratio, x.shape[-1]).sum(3)

    return output, (d_q, per_group(d_k), per_group(d_v))


def _gradients(fn, inputs, d_output):
    return harness.input_gradients(fn, inputs, d_output, jit=True)


def test_bands_cover_the_chunks_and_see_every_key_their_queries_may():
    # 13 queries against 17 keys in chunks of 2: 7 chunks in 3 bands.
    t, s, c = 13, 17, 2
    got = chunked.bands(7, c, t, s, True, max_bands=3)
    assert [band[:2] for band in got] == [(0, 2), (2, 5), (5, 7)]
    for first, stop, keys in got:
        last_query = min(stop * c, t) - 1
        assert keys == min(s, s - t + stop * c) >= s - t + last_query + 1
    assert got[-1][2] == s
    assert chunked.bands(7, c, t, s, False) == [(0, 7, s)]  # every key
    assert chunked.bands(7, c, t, 5, True) == [(0, 7, 5)]  # T > S: one band
    assert len(chunked.bands(40, c, 80, 80, True)) == chunked.MAX_BANDS


# Every mask form the kernel takes: none, one row for every query
# `(B, 1, 1, S)`, shared `(1, 1, T, S)`, per batch `(B, 1, T, S)` and per head
# `(B, H, T, S)`, each with and without the causal flag, grouped heads,
# offsets (`T < S`) and a last chunk that is short.
CASES = {
    "causal_gqa": dict(t=13, s=13, groups=2, mask=None, causal=True),
    "causal_offset_mqa": dict(t=7, s=11, groups=1, mask=None, causal=True),
    "no_mask": dict(t=9, s=6, groups=4, mask=None, causal=False),
    "padding_row": dict(t=9, s=10, groups=2, mask=(B, 1, 1, 10), causal=False),
    "padding_row_causal": dict(t=10, s=10, groups=2, mask=(B, 1, 1, 10), causal=True),
    "shared": dict(t=11, s=8, groups=4, mask=(1, 1, 11, 8), causal=False),
    "per_batch_causal": dict(t=11, s=14, groups=2, mask=(B, 1, 11, 14), causal=True),
    "per_head": dict(t=8, s=9, groups=2, mask=(B, H, 8, 9), causal=False),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("chunk", [2, 3])
def test_chunked_output_and_gradients_match_numpy(case, chunk):
    t, s, groups, mask_shape, causal = (
        CASES[case][name] for name in ("t", "s", "groups", "mask", "causal")
    )
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, groups, K), 2), _normal((B, s, groups, K), 3)
    d_output = _normal((B, t, H, K), 4)
    allowed = np.ones((1, 1, t, s), bool)
    mask = None
    if mask_shape is not None:
        mask = np.random.default_rng(5).random(mask_shape) > 0.4
        mask[..., 0] = True  # every row sees a key (the kernel's contract)
        allowed = allowed & mask
    if causal:
        allowed = allowed & ref.causal_mask(t, s)
    expected, expected_grads = _reference(q, k, v, allowed, 0.6, d_output)

    def attend(q, k, v):
        given = None if mask is None else ops.convert_to_tensor(mask)
        return chunked.chunked_attention(q, k, v, given, 0.6, causal, chunk, max_bands=3)

    np.testing.assert_allclose(
        harness.to_numpy(attend(q, k, v)), expected, rtol=1e-5, atol=1e-5
    )
    for name, got, want in zip("qkv", _gradients(attend, [q, k, v], d_output), expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


# Causal cases for the tiles: `T = S`, offsets, a short last tile, every mask
# layout (rows and a shared row; per batch and per head; grouped heads).
TILE_CASES = {
    "causal_gqa": dict(t=13, s=13, groups=2, mask=None),
    "offset_mqa": dict(t=7, s=11, groups=1, mask=None),
    "padding_row": dict(t=10, s=10, groups=2, mask=(B, 1, 1, 10)),
    "per_batch_offset": dict(t=11, s=14, groups=2, mask=(B, 1, 11, 14)),
    "per_head": dict(t=9, s=9, groups=4, mask=(B, H, 9, 9)),
}


@pytest.mark.parametrize("case", list(TILE_CASES), ids=list(TILE_CASES))
@pytest.mark.parametrize("tile", [2, 4])
def test_causal_tiles_output_and_gradients_match_numpy(case, tile):
    t, s, groups, mask_shape = (TILE_CASES[case][n] for n in ("t", "s", "groups", "mask"))
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, groups, K), 2), _normal((B, s, groups, K), 3)
    d_output = _normal((B, t, H, K), 4)
    allowed = ref.causal_mask(t, s)[None, None]
    mask = None
    if mask_shape is not None:
        mask = np.random.default_rng(5).random(mask_shape) > 0.4
        mask[..., 0] = True
        allowed = allowed & mask
    expected, expected_grads = _reference(q, k, v, allowed, 0.6, d_output)
    ran = []
    forward = tiles_lib.Tiles.forward

    def counted(self, *args):
        ran.append(self.chunk)
        return forward(self, *args)

    def attend(q, k, v):
        given = None if mask is None else ops.convert_to_tensor(mask)
        return chunked.chunked_attention(q, k, v, given, 0.6, True, 3, tile=tile)

    with pytest.MonkeyPatch.context() as patch:
        preferences = dataclasses.replace(backend.preferences(), causal_tiles=True)
        patch.setattr(backend, "preferences", lambda: preferences)
        patch.setattr(tiles_lib.Tiles, "forward", counted)
        output = harness.to_numpy(attend(q, k, v))
        grads = _gradients(attend, [q, k, v], d_output)
    assert ran and set(ran) == {tile}  # the tiles ran, not the bands
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_causal_tiles_plan_covers_what_each_chunk_may_see():
    q, k = np.zeros((1, 10, 2, 3), "float32"), np.zeros((1, 13, 2, 3), "float32")
    tiles = tiles_lib.Tiles(q, k, k, None, 1.0, 4)
    rows, columns, firsts = tiles.plan
    # Offset 3: chunk i's last query sees keys up to 3 + 4 i + 3, in blocks of
    # 4 (0-3, 4-7, 8-11, 12); the third chunk's real queries stop at key 12.
    assert rows.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert columns.tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3]
    assert firsts.tolist() == [1, 0, 1, 0, 0, 1, 0, 0, 0]
    assert chunked.tile_size(1, 8) == 256  # 2 MiB of float32 scores
    assert chunked.tile_size(None, 8) == 256 and chunked.tile_size(4, 8) == 128


def _plain_and_chunked(mask, causal_flag, chunk=3, guard_with_cond=True):
    def attend(chosen):
        given = None if mask is None else ops.convert_to_tensor(mask)
        return lambda q, k, v: fused.attend(chosen, q, k, v, given, 0.5, causal_flag)

    return (
        attend(choice.Choice(choice.FUSED, 7, guard_with_cond=guard_with_cond)),
        attend(
            choice.Choice(
                choice.CHUNKED, 5, chunk_size=chunk, guard_with_cond=guard_with_cond
            )
        ),
    )


@pytest.mark.parametrize("causal_flag", [False, True])
def test_chunked_gradients_equal_the_plain_paths(causal_flag):
    t = s = 10
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, 2, K), 2), _normal((B, s, 2, K), 3)
    d_output = _normal((B, t, H, K), 4)
    mask = None
    if not causal_flag:
        mask = np.random.default_rng(6).random((B, 1, t, s)) > 0.3
        mask[..., 2] = True
    plain, chunks = _plain_and_chunked(mask, causal_flag)
    np.testing.assert_allclose(
        harness.to_numpy(chunks(q, k, v)), harness.to_numpy(plain(q, k, v)),
        rtol=1e-5, atol=1e-5,
    )
    for got, want in zip(
        _gradients(chunks, [q, k, v], d_output), _gradients(plain, [q, k, v], d_output)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("guard_with_cond", [False, True], ids=["always", "cond"])
@pytest.mark.parametrize("nan_in", [None, "key", "value"])
def test_fully_masked_rows_and_masked_nan_keep_gradients_finite_and_exact(
    nan_in, guard_with_cond
):
    # Through the guards of `fused.attend`: a query that sees nothing gets 0
    # and no gradient; a masked key or value holding NaN reaches nothing,
    # gradients included, under either guard. (The `cond` guard once
    # decided from the plain kernel's output and so differentiated it even
    # when it recomputed: `0 * NaN`.)
    t, s = 7, 8
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, H, K), 2), _normal((B, s, H, K), 3)
    if nan_in is not None:
        (k if nan_in == "key" else v)[:, -1] = np.nan
    d_output = _normal((B, t, H, K), 4)
    mask = np.random.default_rng(7).random((B, 1, t, s)) > 0.3
    mask[..., -1] = False  # nobody sees the NaN
    mask[..., 0] = True
    mask[0, 0, 2] = False  # a query that sees nothing
    mask[1, 0, 5] = False
    plain, chunks = _plain_and_chunked(mask, False, guard_with_cond=guard_with_cond)
    out = harness.to_numpy(chunks(q, k, v))
    assert np.all(out[0, 2] == 0) and np.all(out[1, 5] == 0)
    np.testing.assert_allclose(out, harness.to_numpy(plain(q, k, v)), rtol=1e-5, atol=1e-5)
    allowed = mask & np.ones((B, H, t, s), bool)
    clean_k, clean_v = (np.where(np.isnan(x), 0.0, x) for x in (k, v))
    expected_output, expected = _reference(q, clean_k, clean_v, allowed, 0.5, d_output)
    np.testing.assert_allclose(out, expected_output, rtol=1e-5, atol=1e-5)
    mine = _gradients(chunks, [q, k, v], d_output)
    theirs = _gradients(plain, [q, k, v], d_output)
    for name, got, plain_grad, want in zip("qkv", mine, theirs, expected):
        # The NaN position itself takes no gradient (it is masked): 0.
        assert np.all(np.isfinite(got)), f"d{name}"
        assert np.all(np.isfinite(plain_grad)), f"plain d{name}"
        np.testing.assert_allclose(got, plain_grad, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("nan_in", ["key", "value"])
def test_causal_flag_masked_nan_keeps_gradients_finite_under_the_cond_guard(nan_in):
    # The causal flag hides the later keys: NaN in the last key or value
    # reaches only the last query, whose output is NaN; every other query's
    # output and every gradient it sends elsewhere stay exact.
    t = s = 9
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, H, K), 2), _normal((B, s, H, K), 3)
    (k if nan_in == "key" else v)[:, -1] = np.nan
    d_output = _normal((B, t, H, K), 4)
    d_output[:, -1] = 0.0  # the poisoned query sends no gradient
    plain, chunks = _plain_and_chunked(None, True, guard_with_cond=True)
    clean_k, clean_v = (np.where(np.isnan(x), 0.0, x) for x in (k, v))
    allowed = np.broadcast_to(ref.causal_mask(t, s), (B, H, t, s))
    expected_output, expected = _reference(q, clean_k, clean_v, allowed, 0.5, d_output)
    for attend in (plain, chunks):
        out = harness.to_numpy(attend(q, k, v))
        assert np.all(np.isnan(out[:, -1])) and np.all(np.isfinite(out[:, :-1]))
        np.testing.assert_allclose(out[:, :-1], expected_output[:, :-1], rtol=1e-5, atol=1e-5)
        # The poisoned output is `where(sees_bad, NaN, ...)`: no gradient
        # flows back through the NaN, so the last query's own gradients
        # are those of the clean inputs with a zero output gradient.
        grads = _gradients(attend, [q, k, v], d_output)
        for name, got, want in zip("qkv", grads, expected):
            assert np.all(np.isfinite(got)), f"d{name}"
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_the_backward_pass_is_the_written_one(monkeypatch):
    # Not autodiff through the forward pass, which keeps every chunk's scores.
    calls = []
    original = chunked._Chunks.backward

    def counted(self, residuals, d_output):
        calls.append(len(residuals))
        return original(self, residuals, d_output)

    monkeypatch.setattr(chunked._Chunks, "backward", counted)
    q, k, v = _normal((B, 6, H, K), 1), _normal((B, 6, H, K), 2), _normal((B, 6, H, K), 3)

    def attend(q, k, v):
        return chunked.chunked_attention(q, k, v, None, 0.5, True, 2)

    _gradients(attend, [q, k, v], _normal((B, 6, H, K), 4))
    assert calls == [5]  # q chunks, keys, values, output, log-sum-exp: O(T)


def test_bfloat16_gradients_follow_float32():
    t = s = 9
    q, k, v = _normal((B, t, H, K), 1), _normal((B, s, 2, K), 2), _normal((B, s, 2, K), 3)
    d_output = _normal((B, t, H, K), 4)

    def attend(dtype):
        def fn(q, k, v):
            q, k, v = (ops.cast(x, dtype) for x in (q, k, v))
            return chunked.chunked_attention(q, k, v, None, 0.5, True, 2)

        return fn

    for got, want in zip(
        _gradients(attend("bfloat16"), [q, k, v], d_output),
        _gradients(attend("float32"), [q, k, v], d_output),
    ):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=0.1, atol=0.1)


# Through the layer: one training step.


def _forced_chunks(monkeypatch):
    """Every dot-product call of the core takes query chunks of a few queries."""
    preferences = dataclasses.replace(backend.preferences(), chunk_long_queries=True)
    monkeypatch.setattr(
        kernels,
        "choose_kernel",
        functools.partial(
            choice.choose_kernel, preferences=preferences,
            chunk_above_bytes=0, chunk_bytes=H * 12 * 4 * 5,
        ),
    )


def _model(inputs):
    query = keras.Input(inputs[0].shape[1:], name="query")
    attention_mask = keras.Input(inputs[1].shape[1:], dtype="bool", name="attention_mask")
    layer = MultiHeadAttention(H, 4, num_key_value_heads=2)
    output = layer(query, query, attention_mask=attention_mask, use_causal_mask=True)
    model = keras.Model([query, attention_mask], output)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss="mse")
    return model


def _gradients_of_one_step(model, inputs, target):
    """The weights before minus after one `train_on_batch` with SGD at rate 1:
    the gradients, through the backend's (compiled) trainer; and the kernels
    that ran."""
    before = [harness.to_numpy(w) for w in model.trainable_weights]
    with kernels.tracing() as taken:
        model.train_on_batch(inputs, target)
    after = [harness.to_numpy(w) for w in model.trainable_weights]
    return [b - a for b, a in zip(before, after)], {chosen.kernel for _, chosen in taken}


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "causal_and_mask"])
def test_layer_training_gradients_equal_the_plain_paths(monkeypatch, padded):
    t, width = 12, 16
    x = _normal((B, t, width), 1)
    target = _normal((B, t, width), 2)
    mask = np.ones((B, t, t), bool)
    if padded:
        mask[:, :, -3:] = False  # padding at the end of every sequence
        mask[1, 4] = False  # a query row that sees nothing
    plain_model, chunked_model = _model((x, mask)), _model((x, mask))
    chunked_model.set_weights(plain_model.get_weights())
    plain, plain_kernels = _gradients_of_one_step(plain_model, (x, mask), target)
    _forced_chunks(monkeypatch)
    chunks, chunked_kernels = _gradients_of_one_step(chunked_model, (x, mask), target)
    assert choice.CHUNKED not in plain_kernels and chunked_kernels == {choice.CHUNKED}
    assert len(plain) == len(chunks) == 8
    for got, want in zip(chunks, plain):
        assert np.all(np.isfinite(got)) and np.any(got != 0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_layer_training_through_the_causal_tiles_equals_the_plain_path(monkeypatch):
    # The causal flag alone (no mask): square tiles of 4, inside the
    # trainer's compiled step (on TensorFlow, an XLA loop inside its graph).
    t, width = 12, 16
    x, target = _normal((B, t, width), 1), _normal((B, t, width), 2)

    def model():
        query = keras.Input((t, width))
        layer = MultiHeadAttention(H, 4, num_key_value_heads=2)
        built = keras.Model(query, layer(query, query, use_causal_mask=True))
        built.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss="mse")
        return built

    plain_model, tiled_model = model(), model()
    tiled_model.set_weights(plain_model.get_weights())
    plain, _ = _gradients_of_one_step(plain_model, x, target)
    _forced_chunks(monkeypatch)
    preferences = dataclasses.replace(backend.preferences(), causal_tiles=True)
    monkeypatch.setattr(backend, "preferences", lambda: preferences)
    monkeypatch.setattr(chunked, "tile_size", lambda *args, **kwargs: 4)
    ran = []
    forward = tiles_lib.Tiles.forward
    monkeypatch.setattr(
        tiles_lib.Tiles, "forward", lambda self, *a: ran.append(self.chunk) or forward(self, *a)
    )
    tiled, kernels_taken = _gradients_of_one_step(tiled_model, x, target)
    assert kernels_taken == {choice.CHUNKED} and ran and set(ran) == {4}
    for got, want in zip(tiled, plain):
        assert np.all(np.isfinite(got)) and np.any(got != 0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
