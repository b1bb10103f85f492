"""Tests of `MultiHeadAttention`: heads, scorers, GQA, masks, fused path, KV cache.

Shape legend: `B` batch, `T` query length, `S` key/value length, `L` cache
length, `H` query heads, `G` key/value heads, `K` key head size, `V` value
head size, `O` output width.
"""

import json
import re

import keras
import numpy as np
import pytest
from keras import ops

import harness
import numpy_reference as ref
from keras_attention.layers import MultiHeadAttention
from keras_attention import backend
from keras_attention import kernels
from keras_attention.kernels import choice
from keras_attention.layers import _projection

BACKEND = keras.backend.backend()
SCORERS = ["dot", "scaled_dot", "additive", "bilinear"]
B, T, S = 2, 5, 7
DQ, DK, DV = 8, 6, 5  # query, key and value widths of cross-attention
H, K = 4, 3


def _normal(shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).normal(size=shape)).astype("float32")


def _cross_inputs(seed=0):
    """Query `(B, T, DQ)`, value `(B, S, DV)` and key `(B, S, DK)`."""
    return (
        _normal((B, T, DQ), seed),
        _normal((B, S, DV), seed + 1),
        _normal((B, S, DK), seed + 2),
    )


def _mha(**kwargs):
    """`MultiHeadAttention`, `H` heads of size `K` unless told otherwise.

    Zero kernels, because the tests give the weights random values anyway
    (`_randomize`): random initializers compile anew for every weight shape
    on JAX, which would dominate the time of this file.
    """
    return MultiHeadAttention(
        **{"num_heads": H, "key_dim": K, "kernel_initializer": "zeros", **kwargs}
    )


def _randomize(layer, seed=0, scale=0.5):
    """Gives every weight of a built layer random values, biases included.

    Random biases (not the default zeros) make the references check them too.
    """
    rng = np.random.default_rng(seed + 100)
    layer.set_weights(
        [
            (scale * rng.normal(size=w.shape)).astype("float32")
            for w in layer.get_weights()
        ]
    )
    return layer


def _built(layer, query, value, key=None, seed=0, scale=0.5):
    """Builds `layer` on these inputs, with random weights."""
    if not layer.built:
        layer(query, value, key=key)
    return _randomize(layer, seed, scale)


def _call(layer, query, value, **kwargs):
    return harness.to_numpy(layer(query, value, **kwargs))


def _twin(layer, query, value, key=None, **kwargs):
    """A layer with the configuration of `layer` changed by `kwargs`, same weights."""
    config = {**layer.get_config(), **kwargs}
    config.pop("name")
    twin = MultiHeadAttention.from_config(config)
    twin(query, value, key=key)
    twin.set_weights(layer.get_weights())
    return twin


# The numpy reference, from the layer's own weights.


_project = ref.project
_projected_heads = ref.projected_heads
_output_projection = ref.output_projection
_head_mask = ref.head_mask
numpy_mha = ref.multi_head_attention


def _masks(s=S, seed=3):
    """Partial padding and attention masks; query 1 of example 1 is padding."""
    query_mask = np.ones((B, T), bool)
    query_mask[1, 1] = False
    value_mask = np.ones((B, s), bool)
    value_mask[0, -2:] = False
    value_mask[1, 0] = False
    attention_mask = np.random.default_rng(seed).random((B, T, s)) < 0.7
    attention_mask[:, :, 1] = True  # no row is empty by accident
    return query_mask, value_mask, attention_mask


def _combined(query_mask=None, value_mask=None, attention_mask=None, s=S):
    """The AND of the masks given, `(B, T, S)`."""
    mask = np.ones((B, T, s), bool)
    if query_mask is not None:
        mask &= query_mask[:, :, None]
    if value_mask is not None:
        mask &= value_mask[:, None, :]
    if attention_mask is not None:
        mask &= attention_mask
    return mask


def _tokens():
    # (B, T): example 0 has 3 real tokens, example 1 has 2; 0 is padding.
    return np.array([[3, 1, 4, 0, 0], [2, 7, 0, 0, 0]], "int32")


def _empty_cache(layer, max_length, fill=0.0):
    """A KV cache `(B, 2, L, G, K)` whose every slot holds `fill`."""
    kv_heads = layer.num_key_value_heads or layer.num_heads
    return np.full((B, 2, max_length, kv_heads, layer.key_dim), fill, "float32")


def _compiled(fn):
    """`fn` compiled as the backend compiles a decoding loop."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def gradients(fn, inputs):
    """Gradients of `sum(fn(*inputs) * cotangent)` w.r.t. every input, for
    one fixed normal cotangent."""
    return harness.input_gradients(
        fn, inputs, lambda shape: _normal(shape, seed=9), jit=True
    )


# Layer harness.


@pytest.mark.parametrize(
    "init_kwargs, mode, call_kwargs, expected_output_shapes",
    [
        (
            {"num_heads": H, "key_dim": K, "num_key_value_heads": 2},
            "self",
            {"use_causal_mask": True},
            [(B, T, DQ)],
        ),
        (
            {
                "num_heads": H,
                "key_dim": K,
                "value_dim": 2,
                "output_shape": 6,
                "num_key_value_heads": 1,
                "score": "additive",
                "dropout": 0.1,
                "seed": 2,
            },
            "cross",
            {"return_attention_scores": True},
            [(B, T, 6), (B, H, T, S)],
        ),
    ],
    ids=["self_gqa_causal", "cross_mqa_additive_scores"],
)
def test_layer_harness(init_kwargs, mode, call_kwargs, expected_output_shapes):
    query, value, key = _cross_inputs()
    inputs = {"query": query, "value": value, "key": key}
    if mode == "self":
        inputs = {"query": query, "value": query}
    harness.run_layer_test(
        MultiHeadAttention,
        init_kwargs,
        inputs=inputs,
        call_kwargs=call_kwargs,
        expected_output_shapes=expected_output_shapes,
    )


def test_config_keeps_every_argument():
    layer = MultiHeadAttention(
        num_heads=4,
        key_dim=3,
        value_dim=5,
        dropout=0.25,
        use_bias=False,
        output_shape=(7,),
        num_key_value_heads=2,
        score="bilinear",
        fused=False,
        seed=11,
        kernel_initializer="he_normal",
        bias_initializer="ones",
        kernel_regularizer="l2",
        bias_regularizer="l1",
        activity_regularizer="l2",
        kernel_constraint="non_neg",
        bias_constraint="max_norm",
    )
    restored = MultiHeadAttention.from_config(layer.get_config())
    for name in ("num_heads", "key_dim", "value_dim", "dropout", "use_bias"):
        assert getattr(restored, name) == getattr(layer, name)
    assert restored.output_shape == (7,)
    assert restored.num_key_value_heads == 2
    assert restored.fused is False and restored.seed == 11
    assert type(restored.score).__name__ == "Bilinear"
    assert type(restored.kernel_initializer).__name__ == "HeNormal"
    assert type(restored.bias_constraint).__name__ == "MaxNorm"
    assert restored.activity_regularizer is not None
    assert restored.get_config() == layer.get_config()


# Small cases worked in numpy and against peers.


def test_hand_worked_case():
    # Two heads of size 1: head h reads, scores and writes feature h only, so
    # each head is one-dimensional dot-product attention on its feature.
    layer = MultiHeadAttention(num_heads=2, key_dim=1, use_bias=False, score="dot")
    x = np.array([[[1.0, 0.0], [0.0, 1.0]]], "float32")  # (1, T=2, D=2)
    layer(x, x)
    select = np.eye(2, dtype="float32")
    for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
        dense.set_weights([select[:, :, None]])  # (D, H, 1)
    layer.output_dense.set_weights([select[:, None, :]])  # (H, 1, O)
    # Head 0 at query 0: scores [1, 0], values [1, 0]: e / (e + 1).
    # Head 0 at query 1: scores [0, 0]: the mean 1 / 2. Head 1 mirrors it.
    e = np.e
    expected = [[[e / (e + 1), 0.5], [0.5, e / (e + 1)]]]
    output, weights = harness.to_numpy(layer(x, x, return_attention_scores=True))
    np.testing.assert_allclose(output, expected, rtol=1e-6)
    np.testing.assert_allclose(_call(layer, x, x), expected, rtol=1e-6)  # fused
    np.testing.assert_allclose(
        weights[0, 0], [[e / (e + 1), 1 / (e + 1)], [0.5, 0.5]], rtol=1e-6
    )
    # Causal: query 0 sees only key 0, so head 1 there reads value 0.
    causal = _call(layer, x, x, use_causal_mask=True)
    np.testing.assert_allclose(causal, [[[1.0, 0.0], [0.5, e / (e + 1)]]], rtol=1e-6)


@pytest.mark.parametrize(
    "case", ["self", "cross", "masks", "attention_mask_rank4", "causal", "no_bias"]
)
def test_matches_numpy(case):
    query, value, key = _cross_inputs()
    kwargs, mask = {}, None
    init = {}
    if case == "self":
        value, key = query, None  # key defaults to value
    if case == "cross":
        init.update(value_dim=2, output_shape=6)
    if case == "masks":
        query_mask, value_mask, attention_mask = _masks()
        kwargs = dict(
            query_mask=query_mask, value_mask=value_mask, attention_mask=attention_mask
        )
        mask = _combined(query_mask, value_mask, attention_mask)
    if case == "attention_mask_rank4":
        mask = np.random.default_rng(4).random((B, H, T, S)) < 0.6
        kwargs = dict(attention_mask=mask)
    if case == "causal":
        value, key = query, None
        kwargs = dict(use_causal_mask=True)
        mask = ref.causal_mask(T, T)
    if case == "no_bias":
        init.update(use_bias=False)
    layer = _built(_mha(**init), query, value, key)
    expected, expected_weights = numpy_mha(layer, query, value, key, mask)
    output, weights = harness.to_numpy(
        layer(query, value, key=key, return_attention_scores=True, **kwargs)
    )  # explicit path
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    assert weights.shape == (B, H, T, value.shape[1])
    fused = _call(layer, query, value, key=key, **kwargs)
    np.testing.assert_allclose(fused, expected, rtol=1e-5, atol=1e-5)
    if mask is not None:
        assert np.all(weights[~np.broadcast_to(_head_mask(mask), weights.shape)] == 0)


if BACKEND == "torch":
    # Defined on torch only: torch's own kernel is the independent reference.

    @pytest.mark.parametrize("num_key_value_heads", [None, 2])
    @pytest.mark.parametrize("masked", ["none", "causal", "masks"])
    def test_matches_torch_scaled_dot_product_attention(masked, num_key_value_heads):
        import torch

        query, value, key = _cross_inputs()
        kwargs, mask, is_causal = {}, None, False
        if masked == "causal":
            value = key = query
            kwargs, is_causal = dict(use_causal_mask=True), True
        if masked == "masks":
            query_mask, value_mask, attention_mask = _masks()
            kwargs = dict(
                query_mask=query_mask,
                value_mask=value_mask,
                attention_mask=attention_mask,
            )
            # Query 1 of example 1 is fully masked: torch gives it zeros too.
            mask = torch.as_tensor(_combined(query_mask, value_mask, attention_mask))
            mask = mask[:, None]  # (B, 1, T, S)
        layer = _mha(num_key_value_heads=num_key_value_heads)
        layer = _built(layer, query, value, key)
        q, k, v = (
            torch.as_tensor(x) for x in _projected_heads(layer, query, value, key)
        )
        heads = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal
        )  # (B, H, T, V)
        expected = _output_projection(layer, heads.numpy())
        for fused in (True, False):
            output = _call(
                _twin(layer, query, value, key, fused=fused),
                query,
                value,
                key=key,
                **kwargs,
            )
            np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)


def _keras_peer(query, value, key, **kwargs):
    peer = keras.layers.MultiHeadAttention(
        num_heads=H, key_dim=K, kernel_initializer="zeros", **kwargs
    )
    # Built through its explicit path: its fused path fails on JAX when
    # value_dim != key_dim (a Keras bug).
    peer(query, value, key=key, return_attention_scores=True)
    return _built(peer, query, value, key, seed=5)


@pytest.mark.parametrize(
    "case", ["self", "cross", "padding", "attention_mask", "causal", "scores"]
)
def test_from_keras_gives_the_outputs_of_keras(case):
    query, value, key = _cross_inputs()
    peer_kwargs, kwargs = {}, {}
    rows = np.ones((B, T), bool)  # query rows compared with keras
    if case in ("self", "causal"):
        value = key = query
    if case == "cross":
        peer_kwargs = dict(value_dim=2, output_shape=6)
    if case == "padding":
        query_mask, value_mask, _ = _masks()
        kwargs = dict(query_mask=query_mask, value_mask=value_mask)
        # Keras reads the query mask from the query tensor's Keras mask only,
        # and gives padded query rows the mean of the values; ours gives 0.
        rows = query_mask
    if case == "attention_mask":
        kwargs = dict(attention_mask=_masks()[2])
    if case == "causal":
        kwargs = dict(use_causal_mask=True)
    peer = _keras_peer(query, value, key, **peer_kwargs)
    ours = MultiHeadAttention.from_keras(peer)
    assert ours.built and ours.name == peer.name
    for theirs, mine in zip(peer.weights, ours.weights):
        assert mine is not theirs  # copies, not shared variables
    if case == "scores":
        expected, expected_scores = harness.to_numpy(
            peer(query, value, key=key, return_attention_scores=True)
        )
        output, scores = harness.to_numpy(
            ours(query, value, key=key, return_attention_scores=True)
        )
        assert scores.shape == (B, H, T, S)
        np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
        return
    if case == "cross":
        # Keras's own fused path fails on JAX when value_dim != key_dim; its
        # explicit path (taken for returned scores) gives the same function.
        expected = harness.to_numpy(
            peer(query, value, key=key, return_attention_scores=True)[0]
        )
    else:
        expected = _call(peer, query, value, key=key, **kwargs)
    output = _call(ours, query, value, key=key, **kwargs)
    np.testing.assert_allclose(output[rows], expected[rows], rtol=1e-5, atol=1e-5)
    bias = harness.to_numpy(ours.output_dense.bias)
    assert np.all(output[~rows] == bias)
    # Keras and ours were not equal by accident: the masks mattered.
    if kwargs:
        unmasked = _call(ours, query, value, key=key)
        assert not np.allclose(unmasked[rows], output[rows], atol=1e-3)


def test_from_keras_rejects_unbuilt_layers_and_other_objects():
    with pytest.raises(ValueError, match=r"`layer` must be built.*'unbuilt'"):
        MultiHeadAttention.from_keras(
            keras.layers.MultiHeadAttention(num_heads=2, key_dim=2, name="unbuilt")
        )
    with pytest.raises(
        ValueError, match=r"must be a keras.layers.MultiHeadAttention.*Dense"
    ):
        MultiHeadAttention.from_keras(keras.layers.Dense(3))
    with pytest.raises(ValueError, match=r"must be a keras.layers.MultiHeadAttention"):
        MultiHeadAttention.from_keras(MultiHeadAttention(num_heads=2, key_dim=2))


@pytest.mark.parametrize(
    "case", ["gate", "window", "causal_window", "axes", "output_shape"]
)
def test_from_keras_takes_over_gates_windows_and_axes(case):
    query = _normal((B, T, DQ))
    peer_kwargs, kwargs = {}, {}
    if case == "gate":
        peer_kwargs = dict(use_gate=True, value_dim=2)
    if case in ("window", "causal_window"):
        peer_kwargs = dict(sliding_window=2)
    if case == "causal_window":
        kwargs = dict(use_causal_mask=True)
    if case == "axes":
        query = _normal((B, 3, T, DQ))
        peer_kwargs = dict(attention_axes=2)
    if case == "output_shape":
        peer_kwargs = dict(output_shape=(2, 3))
    peer = _keras_peer(query, query, query, **peer_kwargs)
    ours = MultiHeadAttention.from_keras(peer)
    expected = harness.to_numpy(
        peer(query, query, return_attention_scores=True, **kwargs)[0]
    )
    np.testing.assert_allclose(
        _call(ours, query, query, **kwargs), expected, rtol=1e-5, atol=1e-5
    )
    # The option mattered: without it, other outputs.
    # (Not for the gate, whose Keras layer without it has fewer weights.)
    if case in ("window", "causal_window", "axes"):
        plain = keras.layers.MultiHeadAttention(num_heads=H, key_dim=K)
        plain(query, query)
        plain.set_weights(peer.get_weights())
        unchanged = harness.to_numpy(plain(query, query, **kwargs))
        assert not np.allclose(unchanged, expected, atol=1e-4)


@pytest.mark.parametrize("num_key_value_heads", [1, 2, 4])
def test_grouped_query_heads_match_numpy(num_key_value_heads):
    query, value, key = _cross_inputs()
    query_mask, value_mask, attention_mask = _masks()
    layer = _mha(num_key_value_heads=num_key_value_heads)
    layer = _built(layer, query, value, key)
    assert tuple(layer.query_dense.kernel.shape) == (DQ, H, K)
    assert tuple(layer.key_dense.kernel.shape) == (DK, num_key_value_heads, K)
    assert tuple(layer.value_dense.kernel.shape) == (DV, num_key_value_heads, K)
    kwargs = dict(value_mask=value_mask, attention_mask=attention_mask)
    mask = _combined(None, value_mask, attention_mask)
    expected, expected_weights = numpy_mha(layer, query, value, key, mask)
    output, weights = harness.to_numpy(
        layer(query, value, key=key, return_attention_scores=True, **kwargs)
    )
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    fused = _call(layer, query, value, key=key, **kwargs)
    np.testing.assert_allclose(fused, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_causal_mask_is_bottom_right_aligned(fused):
    # A query block at the end of a longer key sequence: query t sees keys
    # 0 .. S - T + t.
    t, s = T, S
    query, value, key = _cross_inputs()
    layer = _built(_mha(fused=fused), query, value, key)
    causal = ref.causal_mask(t, s)
    np.testing.assert_array_equal(
        causal, np.arange(s)[None] <= s - t + np.arange(t)[:, None]
    )
    expected, expected_weights = numpy_mha(layer, query, value, key, causal)
    output = _call(layer, query, value, key=key, use_causal_mask=True)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    _, weights = harness.to_numpy(
        layer(query, value, key=key, use_causal_mask=True, return_attention_scores=True)
    )
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    for i in range(t):
        assert np.all(weights[..., i, s - t + i + 1 :] == 0)
        assert np.all(weights[..., i, : s - t + i + 1] > 0)


# Implicit mask == explicit mask.


def _masked_embeddings():
    embedding = keras.layers.Embedding(
        10, DQ, mask_zero=True, embeddings_initializer="zeros"
    )
    embedding.build((None, None))
    embedding.set_weights([_normal((10, DQ), seed=7)])
    return embedding


@pytest.mark.parametrize("fused", [True, False])
def test_implicit_mask_equals_explicit_mask(fused, recwarn):
    tokens = _tokens()
    memory_tokens = np.array([[5, 6, 0, 0], [1, 2, 3, 4]], "int32")
    embedding = _masked_embeddings()
    ids = keras.Input((None,), dtype="int32")
    memory_ids = keras.Input((None,), dtype="int32")
    embedded, memory = embedding(ids), embedding(memory_ids)
    self_layer = _mha(fused=fused)
    cross_layer = _mha(fused=fused)
    model = keras.Model(
        [ids, memory_ids],
        [self_layer(embedded, embedded), cross_layer(embedded, memory)],
    )
    _randomize(self_layer)
    _randomize(cross_layer, seed=1)
    implicit = harness.to_numpy(model([tokens, memory_tokens]))

    x = harness.to_numpy(embedding(tokens))  # numpy: no Keras mask attached
    m = harness.to_numpy(embedding(memory_tokens))
    mask, memory_mask = tokens != 0, memory_tokens != 0
    explicit = (
        _call(self_layer, x, x, query_mask=mask, value_mask=mask),
        _call(cross_layer, x, m, query_mask=mask, value_mask=memory_mask),
    )
    for layer, value, value_mask, got, want in zip(
        (self_layer, cross_layer), (x, m), (mask, memory_mask), implicit, explicit
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        expected, _ = numpy_mha(
            layer, x, value, mask=_combined(mask, value_mask, s=value.shape[1])
        )
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        assert not np.allclose(got[mask], _call(layer, x, value)[mask], atol=1e-4)
    # No sublayer complains that it "destroys the mask".
    assert not [w for w in recwarn if "mask" in str(w.message)]


def test_query_mask_propagates_to_the_output():
    tokens = _tokens()
    ids = keras.Input((None,), dtype="int32")
    memory = keras.Input((4, DV))
    query = _masked_embeddings()(ids)
    layer = _mha()
    output = layer(query, memory)
    _randomize(layer)
    assert output._keras_mask is not None
    # Masked average pooling divides by the number of real query positions.
    pooled = keras.layers.GlobalAveragePooling1D()(output)
    model = keras.Model([ids, memory], [output, pooled])
    value = _normal((2, 4, DV))
    output, pooled = harness.to_numpy(model([tokens, value]))
    real = tokens != 0
    np.testing.assert_allclose(
        pooled,
        (output * real[..., None]).sum(1) / real.sum(1, keepdims=True),
        rtol=1e-5,
    )
    # Eagerly too.
    output = layer(_masked_embeddings()(tokens), value)
    np.testing.assert_array_equal(harness.to_numpy(output._keras_mask), real)


def test_same_masked_tensor_is_masked_for_every_reader():
    # keras.layers.MultiHeadAttention strips the mask of its inputs: ours must not.
    tokens = _tokens()
    mask = tokens != 0
    embedding = _masked_embeddings()
    first = _mha()
    second = _mha(score="bilinear")
    ids = keras.Input((None,), dtype="int32")
    embedded = embedding(ids)
    outputs = [first(embedded, embedded), second(embedded, embedded)]
    _randomize(first)
    _randomize(second, seed=1)
    assert embedded._keras_mask is not None
    model = keras.Model(ids, outputs)
    x = harness.to_numpy(embedding(tokens))
    pair_mask = _combined(mask, mask, s=T)
    for layer, output in zip((first, second), harness.to_numpy(model(tokens))):
        expected, _ = numpy_mha(layer, x, x, mask=pair_mask)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)

    # Eagerly: the same embedded tensor read three times is masked every time.
    embedded = embedding(tokens)
    for layer in (first, second, first):
        expected, _ = numpy_mha(layer, x, x, mask=pair_mask)
        np.testing.assert_allclose(
            _call(layer, embedded, embedded), expected, rtol=1e-5, atol=1e-5
        )
    np.testing.assert_array_equal(harness.to_numpy(embedded._keras_mask), mask)


# Invariants.


@pytest.mark.parametrize("fused", [True, False])
def test_causal_outputs_ignore_the_future(fused):
    x = _normal((B, T, DQ))
    layer = _built(_mha(fused=fused), x, x)
    assert layer.uses_fused_path() is fused
    before = _call(layer, x, x, use_causal_mask=True)
    for t in (0, 2, 3):
        changed = x.copy()
        changed[:, t + 1 :] = _normal(changed[:, t + 1 :].shape, seed=t + 20, scale=3.0)
        after = _call(layer, changed, changed, use_causal_mask=True)
        np.testing.assert_allclose(
            after[:, : t + 1], before[:, : t + 1], rtol=1e-6, atol=1e-6
        )
        assert not np.allclose(after[:, t + 1 :], before[:, t + 1 :], atol=1e-3)


def test_uses_fused_path_reports_the_path_taken():
    x = _normal((B, T, DQ))

    def check(layer, expected, training=False, return_attention_scores=False):
        kwargs = dict(
            training=training, return_attention_scores=return_attention_scores
        )
        assert layer.uses_fused_path(**kwargs) is expected
        with kernels.tracing() as taken:
            layer(x, x, **kwargs)
        fused = [(o, c.kernel != choice.EXPLICIT) for o, c in taken]
        assert fused == [(layer, expected)]

    dropout = _mha(dropout=0.5, seed=1)
    # With dropout in training: fused where the backend's kernel takes
    # dropout (torch's SDPA), else the explicit kernel.
    check(dropout, backend.preferences().dropout_kernel, training=True)
    check(dropout, True, training=False)
    check(dropout, False, return_attention_scores=True)
    plain = _mha()
    check(plain, True)
    check(plain, True, training=True)  # no dropout: training changes nothing
    check(plain, False, return_attention_scores=True)
    check(_mha(score="dot"), True)
    check(_mha(score="additive"), False)
    check(_mha(score="bilinear"), False)
    check(_mha(fused=False), False)
    check(_mha(value_dim=K + 1), False)  # the kernel needs V == K


@pytest.mark.parametrize(
    "masks",
    ["padding", "attention_2d", "attention_3d", "attention_4d", "causal_padding"],
)
def test_fused_path_equals_explicit_path_on_partial_masks(masks):
    query, value, key = _cross_inputs()
    query_mask, value_mask, attention_mask = _masks()
    kwargs = {
        "padding": dict(query_mask=query_mask, value_mask=value_mask),
        "attention_2d": dict(attention_mask=attention_mask[0]),
        "attention_3d": dict(attention_mask=attention_mask),
        "attention_4d": dict(
            attention_mask=np.random.default_rng(5).random((B, H, T, S)) < 0.6
        ),
        "causal_padding": dict(value_mask=value_mask, use_causal_mask=True),
    }[masks]
    fused = _built(_mha(), query, value, key)
    explicit = _twin(fused, query, value, key, fused=False)
    assert fused.uses_fused_path() and not explicit.uses_fused_path()
    got = _call(fused, query, value, key=key, **kwargs)
    want = _call(explicit, query, value, key=key, **kwargs)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, _call(fused, query, value, key=key), atol=1e-3)


def test_fully_masked_rows_are_zero_on_both_paths_with_finite_gradients():
    query, value, key = _cross_inputs()
    query_mask = np.ones((B, T), bool)
    query_mask[0, 2] = False
    value_mask = np.ones((B, S), bool)
    value_mask[1] = False  # every key of example 1
    attention_mask = np.ones((B, T, S), bool)
    attention_mask[0, 4] = False
    kwargs = dict(
        query_mask=query_mask, value_mask=value_mask, attention_mask=attention_mask
    )
    empty = _combined(query_mask, value_mask, attention_mask).sum(-1) == 0  # (B, T)
    assert empty.sum() == 2 + T
    fused = _built(_mha(), query, value, key)
    explicit = _twin(fused, query, value, key, fused=False)
    bias = harness.to_numpy(fused.output_dense.bias)
    results = {}
    for layer in (fused, explicit):
        output = _call(layer, query, value, key=key, **kwargs)
        # Attention output exactly 0: the layer output is the output bias.
        assert np.all(output[empty] == bias)
        assert np.all(output[~empty] != bias)
        grads = gradients(
            lambda q, v, k, layer=layer: layer(q, v, key=k, **kwargs),
            [query, value, key],
        )
        for g in grads:
            assert np.all(np.isfinite(g))
        assert np.all(grads[1][1] == 0) and np.all(grads[2][1] == 0)  # masked keys
        results[layer.fused] = (output, grads)
    np.testing.assert_allclose(
        results[True][0], results[False][0], rtol=1e-6, atol=1e-6
    )
    for g_fused, g_explicit in zip(results[True][1], results[False][1]):
        np.testing.assert_allclose(g_fused, g_explicit, rtol=1e-5, atol=1e-5)
    _, weights = harness.to_numpy(
        fused(query, value, key=key, return_attention_scores=True, **kwargs)
    )
    assert np.all(weights.transpose(0, 2, 1, 3)[empty] == 0)


@pytest.mark.parametrize("fused", [True, False])
def test_nan_and_inf_in_masked_positions_do_not_leak(fused):
    query, value, key = _cross_inputs()
    value_mask = np.ones((B, S), bool)
    value_mask[0, 3:5] = False
    value_mask[1, 0] = False
    attention_mask = np.ones((T, S), bool)
    attention_mask[:, 6] = False  # key 6 is masked for every query
    kwargs = dict(value_mask=value_mask, attention_mask=attention_mask)
    layer = _built(_mha(fused=fused), query, value, key)
    clean = _call(layer, query, value, key=key, **kwargs)
    poisoned_value, poisoned_key = value.copy(), key.copy()
    poisoned_value[0, 3] = np.nan
    poisoned_value[0, 4, 1] = np.inf
    poisoned_value[1, 0] = -np.inf
    poisoned_value[:, 6] = np.nan
    poisoned_key[0, 4] = np.nan
    poisoned_key[1, 0, 2] = np.inf
    poisoned_key[:, 6] = -np.inf
    poisoned = _call(layer, query, poisoned_value, key=poisoned_key, **kwargs)
    assert np.all(np.isfinite(poisoned))
    np.testing.assert_allclose(poisoned, clean, rtol=1e-6, atol=1e-6)
    # Self-attention (key = value) too.
    self_mask = np.ones((B, T), bool)
    self_mask[:, -1] = False
    x = _normal((B, T, DV))
    layer = _built(_mha(fused=fused), x, x)
    clean = _call(layer, x, x, value_mask=self_mask)
    x[:, -1] = np.nan
    poisoned = _call(layer, x, x, value_mask=self_mask)
    # The poisoned position is also a query: only its own output may change.
    assert np.all(np.isfinite(poisoned[:, :-1]))
    np.testing.assert_allclose(poisoned[:, :-1], clean[:, :-1], rtol=1e-6, atol=1e-6)
    # Masked as a query too, it attends to nothing: exactly the output bias.
    poisoned = _call(layer, x, x, query_mask=self_mask, value_mask=self_mask)
    np.testing.assert_allclose(poisoned[:, :-1], clean[:, :-1], rtol=1e-6, atol=1e-6)
    assert np.all(poisoned[:, -1] == harness.to_numpy(layer.output_dense.bias))


def test_long_sequences_take_query_chunks_where_the_backend_chunks():
    # The table's row 5 for the layer's own shapes (the kernel itself is
    # tested in tests/kernels): TensorFlow and JAX chunk, torch's kernel
    # is memory-efficient already.
    q_shape, k_shape = (B, 8192, H, K), (B, 8192, H, K)  # 2 GiB of scores
    chosen = kernels.choose_kernel(
        q_shape, k_shape, k_shape, "float32", dot_product=True
    )
    assert chosen.kernel == (
        choice.CHUNKED if BACKEND in ("tensorflow", "jax") else choice.FUSED
    )


@pytest.mark.parametrize("num_key_value_heads", [None, 2])
def test_causal_self_attention_on_the_blocked_kernel_equals_explicit_path(
    num_key_value_heads,
):
    t = 37  # TensorFlow's blocked kernel takes at least 32 queries
    x = _normal((B, t, DQ), seed=5)
    layer = _built(_mha(num_key_value_heads=num_key_value_heads), x, x)
    explicit = _twin(layer, x, x, fused=False)
    with kernels.tracing() as taken:
        got = _call(layer, x, x, use_causal_mask=True)
    blocked = BACKEND in ("tensorflow", "jax")  # torch keeps its own kernel
    assert taken[0][1].kernel == (choice.BLOCKED if blocked else choice.FUSED)
    expected, _ = numpy_mha(layer, x, x, mask=ref.causal_mask(t, t))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    grads = gradients(lambda x: layer(x, x, use_causal_mask=True), [x])
    want = gradients(lambda x: explicit(x, x, use_causal_mask=True), [x])
    np.testing.assert_allclose(grads[0], want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 2e-3), ("mixed_bfloat16", 2e-2)]
)
def test_mixed_precision_matches_float32(policy, tolerance):
    # The fused path without scores, the explicit path with them; the layer
    # harness checks other scorers for finite outputs in both policies.
    query, value, key = _cross_inputs()
    reference = _built(_mha(), query, value, key, scale=0.3)
    mixed = _twin(reference, query, value, key, dtype=policy)
    compute_dtype = policy.split("_")[1]
    for w in mixed.weights:
        assert keras.backend.standardize_dtype(w.dtype) == "float32"
    value_mask = np.ones((B, S), bool)
    value_mask[0, 2] = False
    for kwargs in ({}, {"use_causal_mask": True}, {"value_mask": value_mask}):
        expected = _call(reference, query, value, key=key, **kwargs)
        output = mixed(query, value, key=key, **kwargs)  # fused
        assert keras.backend.standardize_dtype(output.dtype) == compute_dtype
        output = harness.to_numpy(output).astype("float32")
        np.testing.assert_allclose(output, expected, atol=tolerance, rtol=tolerance)
        _, expected_weights = harness.to_numpy(
            reference(query, value, key=key, return_attention_scores=True, **kwargs)
        )
        output, weights = (
            harness.to_numpy(t).astype("float32")
            for t in mixed(
                query, value, key=key, return_attention_scores=True, **kwargs
            )
        )
        np.testing.assert_allclose(output, expected, atol=tolerance, rtol=tolerance)
        np.testing.assert_allclose(
            weights, expected_weights, atol=tolerance, rtol=tolerance
        )
    # All keys of example 1 masked: finite, and the attention output is 0,
    # on the fused path and on the explicit one.
    value_mask[1] = False
    bias = ops.cast(ops.cast(mixed.output_dense.bias, compute_dtype), "float32")
    bias = harness.to_numpy(bias)
    fused = mixed(query, value, key=key, value_mask=value_mask)
    output, weights = mixed(
        query, value, key=key, value_mask=value_mask, return_attention_scores=True
    )
    fused, output, weights = (
        harness.to_numpy(t).astype("float32") for t in (fused, output, weights)
    )
    for t in (fused, output, weights):
        assert np.all(np.isfinite(t))
    assert np.all(fused[1] == bias) and np.all(output[1] == bias)
    assert np.all(weights[1] == 0)
    np.testing.assert_allclose(weights[0].sum(-1), 1.0, atol=tolerance)


def test_dropout_is_active_only_in_training():
    x = _normal((B, T, DQ))
    rate = 0.5
    layer = _built(_mha(dropout=rate, seed=1), x, x)
    plain = _twin(layer, x, x, dropout=0.0)
    expected = _call(plain, x, x)
    _, expected_weights = harness.to_numpy(plain(x, x, return_attention_scores=True))
    for _ in range(2):
        np.testing.assert_allclose(
            _call(layer, x, x, training=False), expected, rtol=1e-6, atol=1e-6
        )
    output = _call(layer, x, x, training=True)
    assert not np.allclose(output, expected, atol=1e-3)
    # Inverted dropout on the weights: each is dropped or scaled by 1 / (1 - rate).
    output, weights = harness.to_numpy(
        layer(x, x, training=True, return_attention_scores=True)
    )
    dropped = weights == 0
    assert 0.2 < dropped.mean() < 0.8
    np.testing.assert_allclose(
        weights[~dropped], expected_weights[~dropped] / (1 - rate), rtol=1e-5
    )
    _, _, v = _projected_heads(layer, x, x)
    np.testing.assert_allclose(
        output, _output_projection(layer, weights @ v), rtol=1e-4, atol=1e-5
    )


def test_symbolic_cross_attention_scores_have_the_key_length():
    # keras.layers.MultiHeadAttention reports (B, H, T, T) here.
    for t, s in ((T, S), (None, None)):
        layer = _mha(num_key_value_heads=2)
        output, scores = layer(
            keras.Input((t, DQ)),
            keras.Input((s, DV)),
            key=keras.Input((s, DK)),
            return_attention_scores=True,
        )
        assert tuple(output.shape) == (None, t, DQ)
        assert tuple(scores.shape) == (None, H, t, s)
    cache = keras.Input((2, 9, 2, K))
    output, scores, new_cache = _mha(num_key_value_heads=2)(
        keras.Input((1, DQ)),
        keras.Input((1, DQ)),
        cache=cache,
        cache_update_index=3,
        return_attention_scores=True,
    )
    assert tuple(scores.shape) == (None, H, 1, 9)
    assert tuple(new_cache.shape) == (None, 2, 9, 2, K)


def test_saved_model_loads_with_the_same_outputs(tmp_path):
    query, value, key = _cross_inputs()
    inputs = [keras.Input(x.shape[1:]) for x in (query, value, key)]
    first = _mha(num_key_value_heads=2, value_dim=2)
    second = _mha(num_heads=2, score="additive", output_shape=3)
    hidden = first(inputs[0], inputs[1], key=inputs[2], use_causal_mask=True)
    model = keras.Model(inputs, second(hidden, inputs[1]))
    _built(first, query, value, key)
    _built(second, _normal((B, T, DQ)), value, seed=1)
    expected = harness.to_numpy(model([query, value, key]))
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.saving.load_model(path)  # safe_mode=True
    np.testing.assert_array_equal(
        harness.to_numpy(restored([query, value, key])), expected
    )
    layers = [
        layer for layer in restored.layers if isinstance(layer, MultiHeadAttention)
    ]
    # Through JSON, as in the file: tuples come back as lists.
    configs = json.loads(json.dumps([first.get_config(), second.get_config()]))
    assert json.loads(json.dumps([layer.get_config() for layer in layers])) == configs
    # Scorer weights included, every weight keeps its path.
    for layer, original in zip(layers, (first, second)):
        assert [w.path for w in layer.weights] == [w.path for w in original.weights]
    assert any(w.path.endswith("query_kernel") for w in layers[1].weights)


# Error messages.


@pytest.mark.parametrize(
    "argument, value",
    [
        ("num_heads", 0),
        ("num_heads", -1),
        ("num_heads", 2.5),
        ("key_dim", 0),
        ("key_dim", "4"),
        ("value_dim", -3),
        ("num_key_value_heads", 0),
    ],
)
def test_rejects_bad_sizes(argument, value):
    kwargs = {"num_heads": 2, "key_dim": 4, argument: value}
    with pytest.raises(
        ValueError,
        match=rf"`{argument}` must be a positive integer\. "
        rf"Received: {argument}={re.escape(repr(value))}$",
    ):
        MultiHeadAttention(**kwargs)


def test_rejects_heads_not_divisible_by_key_value_heads():
    with pytest.raises(
        ValueError,
        match=r"`num_heads` must be divisible by `num_key_value_heads`.*"
        r"num_heads=4, num_key_value_heads=3",
    ):
        MultiHeadAttention(num_heads=4, key_dim=2, num_key_value_heads=3)


@pytest.mark.parametrize("dropout", [1.0, -0.1, "0.1"])
def test_rejects_bad_dropout(dropout):
    with pytest.raises(
        ValueError,
        match=r"`dropout` must be a float in \[0, 1\)\. "
        rf"Received: dropout={re.escape(repr(dropout))}$",
    ):
        MultiHeadAttention(num_heads=2, key_dim=4, dropout=dropout)


@pytest.mark.parametrize("output_shape", [0, -2, (4, 0), (), "8", (2.0,), True])
def test_rejects_bad_output_shape(output_shape):
    with pytest.raises(
        ValueError,
        match=r"`output_shape` must be None, a positive int.*"
        rf"Received: output_shape={re.escape(repr(output_shape))}$",
    ):
        MultiHeadAttention(num_heads=2, key_dim=4, output_shape=output_shape)


def test_rejects_unknown_scorer():
    with pytest.raises(ValueError, match=r"score='cosine'"):
        MultiHeadAttention(num_heads=2, key_dim=4, score="cosine")


@pytest.mark.parametrize("argument", ["query", "value", "key"])
def test_rejects_rank_2_inputs(argument):
    query, value, key = _cross_inputs()
    inputs = {"query": query, "value": value, "key": key}
    inputs[argument] = inputs[argument][:, 0]
    with pytest.raises(ValueError, match=rf"`{argument}` must have rank 3.*\(rank 2\)"):
        _mha()(**inputs)
    symbolic = {name: keras.Input(x.shape[1:]) for name, x in inputs.items()}
    with pytest.raises(ValueError, match=rf"`{argument}` must have rank 3"):
        _mha()(**symbolic)


def test_rejects_key_and_value_of_different_lengths():
    query, value, key = _cross_inputs()
    with pytest.raises(
        ValueError,
        match=r"`key` and `value` must have the same length.*"
        r"key length=4, value length=7",
    ):
        _mha()(query, value, key=key[:, :4])


@pytest.mark.parametrize("argument", ["query_mask", "value_mask", "attention_mask"])
def test_rejects_float_mask(argument):
    query, value, _ = _cross_inputs()
    shapes = {"query_mask": (B, T), "value_mask": (B, S), "attention_mask": (B, T, S)}
    with pytest.raises(
        TypeError,
        match=rf"`{argument}` must be a boolean or integer mask.*additive bias",
    ):
        _mha()(query, value, **{argument: np.ones(shapes[argument], "float32")})


@pytest.mark.parametrize(
    "argument, shape, message",
    [
        ("value_mask", (B, S - 1), r"`value_mask` must have length 7 on axis 1"),
        ("query_mask", (B, T + 1), r"`query_mask` must have length 5 on axis 1"),
        ("attention_mask", (B, T, S + 1), r"`attention_mask` must have key length 7"),
        (
            "attention_mask",
            (B, H, T + 1, S),
            r"`attention_mask` must have query length 5",
        ),
    ],
)
def test_rejects_wrongly_shaped_mask(argument, shape, message):
    query, value, _ = _cross_inputs()
    with pytest.raises(ValueError, match=message):
        _mha()(query, value, **{argument: np.ones(shape, bool)})


@pytest.mark.parametrize("index, length", [(-1, 1), (8, 1), (6, 3), (0, 9)])
def test_rejects_out_of_range_cache_index(index, length):
    layer = _mha(num_key_value_heads=2)
    x = _normal((B, length, DQ))
    with pytest.raises(
        ValueError,
        match=r"`cache_update_index` out of range: writing "
        rf"{length} positions at cache_update_index={index} .*max_length=8",
    ):
        layer(x, x, cache=_empty_cache(layer, 8), cache_update_index=index)


@pytest.mark.parametrize(
    "shape",
    [
        (B, 2, 8, 4, K),
        (B, 2, 8, 2, K + 1),
        (B, 3, 8, 2, K),
        (B, 8, 2, K),
        (B, 1, 2, 8, 2, K),
    ],
)
def test_rejects_cache_of_wrong_shape(shape):
    layer = _mha(num_key_value_heads=2)
    x = _normal((B, 1, DQ))
    with pytest.raises(
        ValueError,
        match=rf"`cache` must have shape \(batch, 2, max_length, 2, {K}\)\. "
        rf"Received: cache with shape {re.escape(str(shape))}",
    ):
        layer(x, x, cache=np.zeros(shape, "float32"), cache_update_index=0)


def test_rejects_cache_misuse():
    x = _normal((B, 1, DQ))
    layer = _mha()
    with pytest.raises(ValueError, match=r"`cache_update_index` needs a `cache`.*=2"):
        layer(x, x, cache_update_index=2)
    layer = _mha(value_dim=K + 1)
    with pytest.raises(ValueError, match=r"needs `value_dim == key_dim`.*value_dim=4"):
        layer(x, x, cache=_empty_cache(layer, 4), cache_update_index=0)


# Every scorer, per head.


@pytest.mark.parametrize("score", SCORERS)
def test_every_scorer_per_head_matches_numpy(score):
    query, value, key = _cross_inputs()
    query_mask, value_mask, attention_mask = _masks()
    layer = _built(_mha(score=score), query, value, key)
    # Scorer weights are one set shared by every head.
    if score == "additive":
        assert tuple(layer.score.query_kernel.shape) == (K, K)
        assert tuple(layer.score.key_kernel.shape) == (K, K)
    if score == "bilinear":
        assert tuple(layer.score.kernel.shape) == (K, K)
    assert layer.uses_fused_path() is (score in ("dot", "scaled_dot"))
    kwargs = dict(
        query_mask=query_mask, value_mask=value_mask, attention_mask=attention_mask
    )
    output, weights = harness.to_numpy(
        layer(query, value, key=key, return_attention_scores=True, **kwargs)
    )
    mask = _combined(query_mask, value_mask, attention_mask)
    expected, expected_weights = numpy_mha(layer, query, value, key, mask)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        _call(layer, query, value, key=key, **kwargs), output, rtol=1e-6, atol=1e-6
    )
    # Heads differ (their projections do), and masked weights are exactly 0.
    assert not np.allclose(weights[:, 0], weights[:, 1])
    assert np.all(weights[~np.broadcast_to(mask[:, None], weights.shape)] == 0)


# Cached decoding == full pass.


def _decode(layer, x, prefill, cache, **kwargs):
    """Prefills `prefill` tokens at index 0, then decodes one token at a time.

    The decoding steps run in `ops.while_loop`, compiled (jit on JAX,
    `tf.function` on TensorFlow).
    """
    batch, length, width = x.shape
    output, cache = layer(
        x[:, :prefill], x[:, :prefill], cache=cache, cache_update_index=0, **kwargs
    )
    outputs = ops.concatenate(
        [output, ops.zeros((batch, length - prefill, output.shape[-1]))], axis=1
    )  # (B, T, O)

    def loop(x, cache, outputs):
        def step(i, cache, outputs):
            token = ops.slice(x, (0, i, 0), (batch, 1, width))  # (B, 1, D)
            output, cache = layer(
                token, token, cache=cache, cache_update_index=i, **kwargs
            )
            outputs = ops.slice_update(outputs, (0, i, 0), output)
            return i + 1, cache, outputs

        _, cache, outputs = ops.while_loop(
            lambda i, cache, outputs: i < length, step, (prefill, cache, outputs)
        )
        return cache, outputs

    cache, outputs = _compiled(loop)(ops.convert_to_tensor(x), cache, outputs)
    return harness.to_numpy(outputs), harness.to_numpy(cache)


@pytest.mark.parametrize(
    "num_key_value_heads, fused, fill",
    [(None, True, 0.0), (2, True, np.nan), (1, True, np.nan), (2, False, 1e30)],
)
def test_cached_decoding_equals_full_pass(num_key_value_heads, fused, fill):
    # Unwritten cache slots hold `fill`: they must never be attended.
    prefill, max_length = 2, T + 3
    x = _normal((B, T, DQ))
    layer = _built(_mha(num_key_value_heads=num_key_value_heads, fused=fused), x, x)
    full = _call(layer, x, x, use_causal_mask=True)
    expected, _ = numpy_mha(layer, x, x, mask=ref.causal_mask(T, T))
    np.testing.assert_allclose(full, expected, rtol=1e-5, atol=1e-5)
    decoded, cache = _decode(layer, x, prefill, _empty_cache(layer, max_length, fill))
    assert np.all(np.isfinite(decoded))
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    # The cache holds the projected keys and values of every position, and
    # leaves the slots past them as they were.
    k = _project(layer.key_dense, x)  # (B, T, G, K)
    v = _project(layer.value_dense, x)  # (B, T, G, K)
    np.testing.assert_allclose(cache[:, 0, :T], k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache[:, 1, :T], v, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache[:, :, T:], np.full_like(cache[:, :, T:], fill))


@pytest.mark.parametrize(
    "fill, fused", [(np.nan, True), (np.nan, False), (1e30, True), (-np.inf, False)]
)
def test_unwritten_cache_slots_are_never_attended(fill, fused):
    max_length = T + 3
    x = _normal((B, T, DQ))
    layer = _built(_mha(num_key_value_heads=2, fused=fused), x, x)
    full = _call(layer, x, x, use_causal_mask=True)
    # Eager steps of two, one and two tokens; unwritten slots hold `fill`.
    cache = _empty_cache(layer, max_length, fill)
    outputs = []
    for start, stop in ((0, 2), (2, 3), (3, 5)):
        chunk = x[:, start:stop]
        output, cache = layer(chunk, chunk, cache=cache, cache_update_index=start)
        outputs.append(harness.to_numpy(output))
    decoded = np.concatenate(outputs, axis=1)
    assert np.all(np.isfinite(decoded))
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    # Returned scores of a two-token step at index 1: weight exactly 0 past
    # the written slots.
    _, cache = layer(
        x[:, :1],
        x[:, :1],
        cache=_empty_cache(layer, max_length, fill),
        cache_update_index=0,
    )
    _, weights, _ = layer(
        x[:, 1:3],
        x[:, 1:3],
        cache=cache,
        cache_update_index=1,
        return_attention_scores=True,
    )
    weights = harness.to_numpy(weights)  # (B, H, 2, L)
    assert np.all(weights[:, :, 0, 2:] == 0) and np.all(weights[:, :, 1, 3:] == 0)
    assert np.all(weights[:, :, 1, :3] > 0)


@pytest.mark.parametrize("num_key_value_heads", [None, 2])
def test_filled_cross_attention_cache_equals_uncached(num_key_value_heads):
    query, value, key = _cross_inputs()
    _, value_mask, attention_mask = _masks()
    layer = _mha(num_key_value_heads=num_key_value_heads)
    layer = _built(layer, query, value, key)
    cache = ops.stack(
        [layer.key_dense(key), layer.value_dense(value)], axis=1
    )  # (B, 2, S, G, K)
    for kwargs in ({}, {"value_mask": value_mask, "attention_mask": attention_mask}):
        expected = _call(layer, query, value, key=key, **kwargs)
        output, new_cache = layer(query, value, key=key, cache=cache, **kwargs)
        np.testing.assert_allclose(
            harness.to_numpy(output), expected, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(
            harness.to_numpy(new_cache), harness.to_numpy(cache)
        )
        _, expected_weights = harness.to_numpy(
            layer(query, value, key=key, return_attention_scores=True, **kwargs)
        )
        output, weights, _ = layer(
            query, value, cache=cache, return_attention_scores=True, **kwargs
        )
        np.testing.assert_allclose(
            harness.to_numpy(output), expected, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            harness.to_numpy(weights), expected_weights, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(num_key_value_heads=2, use_bias=False), dict(value_dim=K + 2)],
    ids=["mha", "gqa_no_bias", "value_dim"],
)
def test_self_attention_projections_fused_into_one_matmul(monkeypatch, kwargs):
    x = _normal((B, T, DQ), seed=3)
    fused = _built(_mha(**kwargs), x, x)
    fused.fuse_projections = True  # an option, no backend's default
    split = _twin(fused, x, x)
    split.fuse_projections = False
    taken = []
    original = _projection.project_self

    def recording(query_dense, key_dense, value_dense, inputs):
        taken.append(query_dense.path.split("/")[0])
        return original(query_dense, key_dense, value_dense, inputs)

    monkeypatch.setattr(_projection, "project_self", recording)
    value_mask = np.ones((B, T), bool)
    value_mask[0, -2:] = False
    call = dict(value_mask=value_mask, use_causal_mask=True)
    got = _call(fused, x, x, **call)
    assert taken == [fused.name]
    want = _call(split, x, x, **call)
    assert taken == [fused.name]  # the split twin projects three times
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    mask = value_mask[:, None, :] & np.tril(np.ones((T, T), bool))
    expected, _ = numpy_mha(fused, x, x, mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Cross-attention (value is not query) never takes the fused projection.
    _call(fused, x, x.copy())
    assert taken == [fused.name]

    # Gradients reach the three kernels as they do through three matmuls.
    def kernel_grads(layer):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x, x, **call) ** 2)
            return [g.numpy() for g in tape.gradient(loss, layer.trainable_weights)]
        if BACKEND == "jax":
            import jax

            def loss(trainable):
                out, _ = layer.stateless_call(trainable, [], x, x, **call)
                return (out**2).sum()

            values = [v.value for v in layer.trainable_variables]
            return [np.asarray(g) for g in jax.grad(loss)(values)]
        layer.zero_grad()
        (layer(x, x, **call) ** 2).sum().backward()
        return [v.value.grad.numpy() for v in layer.trainable_variables]

    for got, want in zip(kernel_grads(fused), kernel_grads(split)):
        assert np.any(got != 0)
        # Sums of O(30) in another order: float32 rounding, not a bug.
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# Rotary position embeddings, cross caches and attention capture.


def _numpy_rotate(x, start=0, max_wavelength=10000.0):
    """RoPE on `(B, T, heads, D)` in numpy, pairing dims `i` and `i + D/2`."""
    x = np.asarray(x, "float64")
    half = x.shape[-1] // 2
    positions = start + np.arange(x.shape[1], dtype="float64")  # (T,)
    inverse = max_wavelength ** (-np.arange(half, dtype="float64") / half)  # (D/2,)
    angles = positions[:, None] * inverse[None, :]  # (T, D/2)
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def _rotary_mha(**kwargs):
    from keras_attention.layers import RotaryEmbedding

    return _mha(key_dim=4, rotary_embedding=RotaryEmbedding(), **kwargs)


@pytest.mark.parametrize("fused", [True, False])
def test_rotary_embedding_rotates_queries_and_keys(fused):
    x = _normal((B, T, DQ))
    layer = _built(_rotary_mha(fused=fused), x, x)
    got = _call(layer, x, x, use_causal_mask=True)
    q = _numpy_rotate(_project(layer.query_dense, x))  # (B, T, H, K)
    k = _numpy_rotate(_project(layer.key_dense, x))  # (B, T, H, K)
    v = _project(layer.value_dense, x)
    heads, _ = ref.attention(
        layer.score,
        *(np.transpose(a, (0, 2, 1, 3)) for a in (q, k, v)),
        ref.causal_mask(T, T),
    )  # (B, H, T, V)
    np.testing.assert_allclose(
        got, _output_projection(layer, heads), rtol=1e-5, atol=1e-5
    )
    # Positions matter now: without rotation the output differs.
    plain = _twin(layer, x, x, rotary_embedding=None)
    assert not np.allclose(_call(plain, x, x, use_causal_mask=True), got, atol=1e-3)
    # The rotary layer round-trips through the config.
    config = layer.get_config()
    assert config["rotary_embedding"]["class_name"] == "RotaryEmbedding"
    twin = _twin(layer, x, x)
    np.testing.assert_allclose(
        _call(twin, x, x, use_causal_mask=True), got, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("num_key_value_heads", [None, 2])
def test_rotary_cached_decoding_equals_full_pass(num_key_value_heads):
    x = _normal((B, T, DQ))
    layer = _built(_rotary_mha(num_key_value_heads=num_key_value_heads), x, x)
    full = _call(layer, x, x, use_causal_mask=True)
    decoded, cache = _decode(layer, x, 2, _empty_cache(layer, T + 2, np.nan))
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    # The cache holds the rotated keys, each at its own position.
    k = _numpy_rotate(_project(layer.key_dense, x))
    np.testing.assert_allclose(cache[:, 0, :T], k, rtol=1e-5, atol=1e-5)


def test_rejects_rotary_embedding_of_wrong_type():
    with pytest.raises(ValueError, match=r"rotary_embedding=.*'rope'"):
        _mha(rotary_embedding="rope")


@pytest.mark.parametrize("num_key_value_heads", [None, 2])
def test_compute_cache_fills_a_cross_attention_cache(num_key_value_heads):
    query, value, key = _cross_inputs()
    _, value_mask, _ = _masks()
    layer = _built(_mha(num_key_value_heads=num_key_value_heads), query, value, key)
    cache = harness.to_numpy(layer.compute_cache(value, key=key))
    kv_heads = num_key_value_heads or H
    assert cache.shape == (B, 2, S, kv_heads, K)
    np.testing.assert_allclose(
        cache[:, 0], _project(layer.key_dense, key), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        cache[:, 1], _project(layer.value_dense, value), rtol=1e-5, atol=1e-5
    )
    output, _ = layer(query, value, cache=cache, value_mask=value_mask)
    expected = _call(layer, query, value, key=key, value_mask=value_mask)
    np.testing.assert_allclose(harness.to_numpy(output), expected, rtol=1e-5, atol=1e-5)


def test_cache_update_needs_the_queries_own_positions():
    query, value, key = _cross_inputs()
    layer = _built(_mha(), query, value, key)
    with pytest.raises(ValueError, match=r"query length=5, value length=7"):
        layer(query, value, key=key, cache=_empty_cache(layer, S), cache_update_index=0)
    layer = _built(_mha(value_dim=K + 1), query, value, key)
    with pytest.raises(ValueError, match=r"key_dim=3, value_dim=4"):
        layer.compute_cache(value, key=key)


def test_capture_attention_records_the_weights_of_both_paths():
    from keras_attention.visualization import capture_attention

    query, value, key = _cross_inputs()
    query_mask, value_mask, attention_mask = _masks()
    layer = _built(_mha(), query, value, key)
    kwargs = dict(query_mask=query_mask, value_mask=value_mask, use_causal_mask=True)
    assert layer.uses_fused_path()
    _, expected = harness.to_numpy(
        layer(query, value, key=key, return_attention_scores=True, **kwargs)
    )
    [(name, weights)] = capture_attention(layer, query, value, key=key, **kwargs)
    assert name == layer.path
    np.testing.assert_allclose(weights, expected, rtol=1e-6, atol=1e-6)
    # The causal flag alone (no mask built) is recorded as the causal mask.
    layer = _built(_mha(), query, query)
    [(_, weights)] = capture_attention(layer, query, query, use_causal_mask=True)
    assert np.all(np.triu(np.ones((T, T), bool), 1)[None, None] <= (weights == 0))
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    # Recording stops after the capture, and the output is unchanged by it.
    assert not kernels.is_recording()


# Keras's options: gate, sliding window, attention axes, flash_attention,
# multi-dimensional output shapes; quantization, LoRA, dtype policy maps.


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _numpy_gated_window(layer, x, window, causal):
    """Self-attention of `x` `(B, T, D)` in float64 from the layer's weights:
    `sigmoid(x W_g) * softmax(q k / sqrt(K) + band) v`, projected."""
    w = {d.name: [np.asarray(harness.to_numpy(v), "float64") for v in d.weights]
         for d in (layer.query_dense, layer.key_dense, layer.value_dense,
                   layer.output_dense, layer.gate_dense)}
    x = x.astype("float64")
    q = np.einsum("btd,dhk->bthk", x, w["query"][0]) + w["query"][1]
    k = np.einsum("btd,dhk->bthk", x, w["key"][0]) + w["key"][1]
    v = np.einsum("btd,dhk->bthk", x, w["value"][0]) + w["value"][1]
    gate = _sigmoid(np.einsum("btd,dhk->bthk", x, w["gate"][0]) + w["gate"][1])
    scores = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    t = np.arange(x.shape[1])
    allowed = np.abs(t[:, None] - t[None, :]) < window
    if causal:
        allowed &= t[:, None] >= t[None, :]
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bhts,bshv->bthv", weights, v) * gate
    return np.einsum("bthv,hvo->bto", heads, w["attention_output"][0]) + w["attention_output"][1]


def test_keras_options_pass_the_harness():
    x = _normal((B, T, DQ))
    harness.run_layer_test(
        MultiHeadAttention,
        {"num_heads": 2, "key_dim": 4, "use_gate": True, "sliding_window": 2,
         "output_shape": (2, 3)},
        inputs={"query": x, "value": x},
        call_kwargs={"use_causal_mask": True},
        expected_output_shapes=[(B, T, 2, 3)],
    )


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_gate_and_sliding_window_match_numpy(fused, causal):
    x = _normal((B, 6, DQ))
    layer = _built(_mha(use_gate=True, sliding_window=3, fused=fused), x, x)
    expected = _numpy_gated_window(layer, x, 3, causal)
    output = _call(layer, x, x, use_causal_mask=causal)
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-4)
    _, scores = harness.to_numpy(
        layer(x, x, use_causal_mask=causal, return_attention_scores=True)
    )
    t = np.arange(6)
    outside = np.abs(t[:, None] - t[None, :]) >= 3
    assert np.all(scores[..., outside] == 0)


def test_sliding_window_aligns_bottom_right_and_caches():
    # Query t of a block ending a longer key sequence sits at S - T + t, as
    # with the causal mask; cached decoding equals the full pass.
    x = _normal((B, 6, DQ))
    layer = _built(_mha(sliding_window=2), x, x)
    full = _call(layer, x, x, use_causal_mask=True)
    _, scores = harness.to_numpy(
        layer(x[:, 4:], x, use_causal_mask=True, return_attention_scores=True)
    )
    np.testing.assert_array_equal(scores[0, 0] > 0, [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]])
    decoded = harness.to_numpy(_decode(layer, x, 2, _empty_cache(layer, 6))[0])
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masks", ["none", "value_mask", "attention_mask", "window"])
@pytest.mark.parametrize("start, length", [(0, 1), (0, 3), (4, 1), (3, 2)])
def test_eager_cached_call_reads_the_written_slots_as_the_masked_cache(masks, start, length):
    """With its index known (eagerly), a cached call reads only the slots
    written so far, causally; with the scores returned it reads the whole
    cache through a mask. Both give the full pass's rows, with the same
    masks, and unwritten slots (NaN here) never reach them."""
    max_length = 8
    x = _normal((B, max_length, DQ), seed=3)
    layer = _built(_mha(num_key_value_heads=2, sliding_window=3 if masks == "window" else None),
                   x, x)
    rng = np.random.default_rng(4)
    kwargs, full_kwargs = {}, {}
    if masks == "value_mask":
        value_mask = np.ones((B, max_length), bool)
        value_mask[0, 1] = value_mask[1, 0] = False
        kwargs = dict(value_mask=value_mask)
        full_kwargs = dict(value_mask=value_mask)
    if masks == "attention_mask":
        full_mask = rng.random((B, max_length, max_length)) < 0.6
        full_mask |= np.eye(max_length, dtype=bool)[None]
        kwargs = dict(attention_mask=full_mask[:, start:start + length])
        full_kwargs = dict(attention_mask=full_mask)
    full = _call(layer, x, x, use_causal_mask=True, **full_kwargs)
    cache = _empty_cache(layer, max_length, np.nan)
    if start:
        _, cache = layer(x[:, :start], x[:, :start], cache=cache, cache_update_index=0)
    chunk = x[:, start:start + length]
    output, written = layer(chunk, chunk, cache=cache, cache_update_index=start, **kwargs)
    masked, _, masked_cache = layer(
        chunk, chunk, cache=cache, cache_update_index=start, return_attention_scores=True,
        **kwargs,
    )
    output, masked = harness.to_numpy(output), harness.to_numpy(masked)
    assert np.all(np.isfinite(output))
    np.testing.assert_allclose(output, masked, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(output, full[:, start:start + length], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(harness.to_numpy(written), harness.to_numpy(masked_cache))
    # The masks are checked against the whole cache before any is cut.
    with pytest.raises(ValueError, match=r"value_mask"):
        layer(chunk, chunk, cache=cache, cache_update_index=start,
              value_mask=np.ones((B, max_length - 1), bool))


def test_attention_axes_attend_within_slices():
    # attention_axes=2 on (B, N, T, D): each n is an independent sequence;
    # attention_axes=(1, 2) is attention over the flattened N * T positions.
    x = _normal((B, 3, T, DQ))
    mask = np.tril(np.ones((T, T), bool))
    layer = _built(_mha(attention_axes=2), x, x)
    output, scores = harness.to_numpy(
        layer(x, x, attention_mask=mask, return_attention_scores=True)
    )
    assert scores.shape == (B, 3, H, T, T)
    flat = _mha(attention_axes=(1, 2))
    flat(x, x)
    flat.set_weights(layer.get_weights())
    sequence = _mha()
    sequence(x[:, 0], x[:, 0])
    sequence.set_weights(layer.get_weights())
    for n in range(3):
        expected = _call(sequence, x[:, n], x[:, n], use_causal_mask=True)
        np.testing.assert_allclose(output[:, n], expected, rtol=1e-5, atol=1e-5)
    expected = _call(sequence, x.reshape(B, 3 * T, DQ), x.reshape(B, 3 * T, DQ))
    np.testing.assert_allclose(
        _call(flat, x, x).reshape(B, 3 * T, -1), expected, rtol=1e-5, atol=1e-5
    )
    symbolic = layer(keras.Input(batch_shape=x.shape), keras.Input(batch_shape=x.shape),
                     return_attention_scores=True)
    assert tuple(symbolic[1].shape) == (B, 3, H, T, T)


def test_flash_attention_is_the_fused_switch():
    x = _normal((B, T, DQ))
    assert not _mha(flash_attention=False).fused
    layer = _mha(flash_attention=True)
    assert layer.fused and layer.uses_fused_path()
    with kernels.tracing() as chosen:
        layer(x, x)
    assert all(c.kernel != choice.EXPLICIT for _, c in chosen)
    with pytest.raises(ValueError, match=r"not supported when flash attention.*"
                       r"return_attention_scores=True"):
        layer(x, x, return_attention_scores=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_axes": "1"}, r"`attention_axes` must be None, an int.*='1'"),
        ({"attention_axes": ()}, r"`attention_axes` must be None.*=\(\)"),
        ({"attention_axes": (1, 1)}, r"distinct ints.*=\(1, 1\)"),
        ({"sliding_window": 0}, r"`sliding_window` must be a positive integer.*=0"),
        ({"sliding_window": 2.0}, r"`sliding_window`.*=2\.0"),
        ({"flash_attention": "yes"}, r"`flash_attention` must be None, True.*'yes'"),
        ({"flash_attention": True, "dropout": 0.1},
         r"Dropout is not supported when flash.*dropout=0\.1"),
        ({"flash_attention": True, "score": "additive"}, r"flash_attention=True.*score="),
        ({"flash_attention": True, "value_dim": 2}, r"flash_attention=True.*value_dim=2"),
        ({"flash_attention": True, "fused": False}, r"fused=False"),
        ({"num_heads": 1.5}, r"argument `num_heads`.*num_heads=1\.5"),
    ],
)
def test_rejects_bad_keras_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**{"num_heads": 2, "key_dim": 4, **kwargs})


def test_rejects_calls_the_attention_axes_cannot_run():
    x = _normal((B, 3, T, DQ))
    with pytest.raises(ValueError, match=r"`attention_axes` must name.*=\(3,\)"):
        _mha(attention_axes=3)(x, x)
    with pytest.raises(ValueError, match=r"use_causal_mask=True"):
        _mha(attention_axes=(1, 2))(x, x, use_causal_mask=True)
    with pytest.raises(ValueError, match=r"size on axis 1.*query.*=3, value.*=2"):
        _mha(attention_axes=2)(x, x[:, :2])
    with pytest.raises(ValueError, match=r"A `cache` needs"):
        layer = _mha(attention_axes=2)
        layer(x, x, cache=ops.zeros((B, 2, T, H, K)), cache_update_index=0)
    with pytest.raises(ValueError, match=r"must be equal.*key_shape=\(2, 3, 4, 6\)"):
        _mha().compute_output_shape((B, 3, T, DQ), (B, 3, T, DV), (B, 3, 4, DK))


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_quantized_layer_falls_back_from_the_fused_projection(mode):
    x = _normal((B, T, 16))
    layer = _built(MultiHeadAttention(num_heads=2, key_dim=8), x, x, scale=0.2)
    denses = (layer.query_dense, layer.key_dense, layer.value_dense)
    assert _projection.fusable(denses, 16)
    before = _call(layer, x, x)
    layer.quantize(mode)
    assert all(d.quantization_mode == mode for d in denses + (layer.output_dense,))
    assert not _projection.fusable(denses, 16)
    after = _call(layer, x, x)
    assert np.mean((after - before) ** 2) < 1e-2
    # The attention core is unchanged: still a fused kernel.
    with kernels.tracing() as chosen:
        layer(x, x)
    assert all(c.kernel != choice.EXPLICIT for _, c in chosen)


def test_lora_falls_back_and_trains_only_the_adapters():
    x = _normal((B, T, 16))
    layer = _built(MultiHeadAttention(num_heads=2, key_dim=8, use_gate=True), x, x)
    before = _call(layer, x, x)
    layer.query_dense.enable_lora(2)
    layer.gate_dense.enable_lora(2)
    denses = (layer.query_dense, layer.key_dense, layer.value_dense)
    assert not _projection.fusable(denses, 16)
    # LoRA starts as the identity update (its B factor is zeros).
    np.testing.assert_allclose(_call(layer, x, x), before, rtol=1e-5, atol=1e-5)
    trainable = {v.path for v in layer.trainable_variables}
    assert any("lora" in p for p in trainable)
    assert not any(p.endswith("query/kernel") for p in trainable)


def test_dtype_policy_map_quantizes_named_projections():
    # As Keras's layer: the map's entries name the projections by path.
    # (Saving a model with a map fails in Keras 3.15 for its own layer too,
    # "Invalid dtype: object"; the config and the weights round-trip.)
    x = _normal((B, T, 16))
    policy_map = keras.dtype_policies.DTypePolicyMap()
    for name in ("query", "key", "value"):
        policy_map[f"mha/{name}"] = keras.dtype_policies.QuantizedDTypePolicy(
            "int8", "float32"
        )
    layer = MultiHeadAttention(num_heads=2, key_dim=8, dtype=policy_map, name="mha")
    layer.build(x.shape, x.shape)
    assert keras.backend.standardize_dtype(layer.query_dense._kernel.dtype) == "int8"
    assert layer.output_dense.quantization_mode is None
    output = _call(layer, x, x)
    copy = MultiHeadAttention.from_config(layer.get_config())
    copy.build(x.shape, x.shape)
    assert copy.value_dense.quantization_mode == "int8"
    copy.set_weights(layer.get_weights())
    np.testing.assert_allclose(_call(copy, x, x), output, rtol=1e-6, atol=1e-6)


def test_a_subclass_compute_attention_gets_keras_arguments():
    seen = {}

    class Custom(MultiHeadAttention):
        def _compute_attention(self, query, key, value, attention_mask=None,
                               training=None, return_attention_scores=False):
            seen["mask"] = harness.to_numpy(attention_mask)
            return super()._compute_attention(
                query, key, value, attention_mask, training, return_attention_scores
            )

    x = _normal((B, T, DQ))
    layer = _built(Custom(num_heads=H, key_dim=K), x, x)
    output = _call(layer, x, x, use_causal_mask=True)
    np.testing.assert_array_equal(np.squeeze(seen["mask"]), np.tril(np.ones((T, T), bool)))
    plain = MultiHeadAttention(num_heads=H, key_dim=K)
    plain(x, x)
    plain.set_weights(layer.get_weights())
    np.testing.assert_allclose(output, _call(plain, x, x, use_causal_mask=True), atol=1e-5)
