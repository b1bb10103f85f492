"""Property tests: drawn valid calls give the float64 numpy reference.

Shape legend: `B` batch, `T` query length, `S` key length, `L` cache length,
`H` query heads, `G` key/value heads, `K` key head size, `O` output width.

Every example draws a configuration (heads, key/value heads, sizes, scorer,
fused or not), inputs with `T != S` as often as not, masks of every form
(fully masked rows included), the causal flag and the cache, and compares the
layer with `numpy_reference` in float64. Dropout stays off: the reference is
deterministic.
"""

import keras
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from keras import ops

import harness
import numpy_reference as ref
import strategies as s
from keras_attention import kv_cache
from keras_attention import masking
from keras_attention import ops as ka_ops
from keras_attention.layers import MultiHeadAttention
from keras_attention.layers import SelfAttention
from keras_attention.layers import SoftAttention
from keras_attention.models import GPT

TOLERANCE = dict(rtol=2e-4, atol=2e-4)


def _mha(heads, kv_heads, key_dim, value_dim, score, fused, output_shape):
    """A `MultiHeadAttention` of this configuration, built on width-8 inputs
    with a width-8 key, made once and reused."""
    config = (heads, kv_heads, key_dim, value_dim, score, fused, output_shape)
    x = np.zeros((1, 2, s.WIDTH), "float32")
    return s.cached_layer(
        ("mha",) + config,
        lambda: MultiHeadAttention(
            num_heads=heads, key_dim=key_dim, value_dim=value_dim, score=score,
            fused=fused, output_shape=output_shape, num_key_value_heads=kv_heads,
            kernel_initializer="zeros",
        ),
        x, x, x,
    )


@st.composite
def mha_configs(draw, cached=False):
    """The arguments of `_mha` (the layer is made in the test, not while
    drawing: Keras seeds from `random`)."""
    heads, kv_heads = draw(s.head_counts())
    key_dim = draw(st.sampled_from([2, 4]))
    value_dim = None if cached else draw(st.sampled_from([None, 3]))
    score = draw(st.sampled_from(["scaled_dot", "dot", "additive"]))
    fused = draw(st.booleans())
    output_shape = draw(st.sampled_from([None, 5]))
    return heads, kv_heads, key_dim, value_dim, score, fused, output_shape


@s.examples(8)
@given(config=mha_configs(), data=st.data())
def test_multi_head_attention_matches_reference(config, data):
    layer = _mha(*config)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    batch = 2
    query_length = data.draw(st.sampled_from([1, 3]), label="T")
    self_attention = data.draw(st.booleans(), label="self")
    key_length = query_length if self_attention else data.draw(st.sampled_from([2, 4]), label="S")
    query = s.normal(rng, (batch, query_length, s.WIDTH))
    value = query if self_attention else s.normal(rng, (batch, key_length, s.WIDTH))
    key = None if self_attention or data.draw(st.booleans(), label="key=value") else (
        s.normal(rng, (batch, key_length, s.WIDTH))
    )
    kwargs, mask = data.draw(
        s.attention_masks(batch, layer.num_heads, query_length, key_length, rng),
        label="masks",
    )
    use_causal_mask = data.draw(st.booleans(), label="causal")
    if use_causal_mask:
        mask = mask & s.causal(query_length, key_length)
    scores = data.draw(st.booleans(), label="return_attention_scores")

    got = layer(
        query, value, key=key, use_causal_mask=use_causal_mask,
        return_attention_scores=scores, **kwargs,
    )
    expected, weights = ref.multi_head_attention(layer, query, value, key, mask)
    if scores:
        got, got_weights = got
        np.testing.assert_allclose(harness.to_numpy(got_weights), weights, **TOLERANCE)
    np.testing.assert_allclose(harness.to_numpy(got), expected, **TOLERANCE)


@s.examples(6)
@given(config=mha_configs(cached=True), data=st.data())
def test_cached_decoding_matches_reference(config, data):
    """A prefill then one-token steps, the index as an int, numpy integer or
    tensor, equal the reference of one causal pass over the sequence."""
    layer = _mha(*config)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    batch = data.draw(st.sampled_from([1, 2]), label="B")
    cache_length = data.draw(st.integers(2, 5), label="L")
    prefill = data.draw(st.integers(1, cache_length - 1), label="prefill")
    steps = data.draw(st.integers(1, cache_length - prefill), label="steps")
    total = prefill + steps
    x = s.normal(rng, (batch, total, s.WIDTH))
    cache = kv_cache.empty(
        batch, cache_length, layer.num_key_value_heads or layer.num_heads, layer.key_dim,
        "float32",
    )
    outputs = []
    output, cache = layer(x[:, :prefill], x[:, :prefill], cache=cache, cache_update_index=0)
    outputs.append(harness.to_numpy(output))
    for index in range(prefill, total):
        token = x[:, index : index + 1]
        output, cache = layer(
            token, token, cache=cache,
            cache_update_index=data.draw(s.integer_like(index), label="index"),
        )
        outputs.append(harness.to_numpy(output))
    expected, _ = ref.multi_head_attention(layer, x, x, mask=s.causal(total, total))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, **TOLERANCE)


@s.examples(5)
@given(config=mha_configs(), data=st.data())
def test_implicit_masks_equal_explicit(config, data):
    """Keras masks of `mask_zero=True` embeddings give the explicit padding
    masks' outputs; the query mask propagates to the output."""
    layer = _mha(*config)
    embedding = s.cached_layer(
        "embedding", lambda: keras.layers.Embedding(6, s.WIDTH, mask_zero=True), np.zeros((1, 1))
    )
    batch = data.draw(st.sampled_from([1, 2]), label="B")
    lengths = data.draw(st.tuples(st.integers(1, 4), st.integers(1, 4)), label="T, S")
    tokens = [
        np.asarray(
            data.draw(
                st.lists(st.integers(0, 5), min_size=batch * n, max_size=batch * n),
                label="tokens",
            ),
            "int32",
        ).reshape(batch, n)
        for n in lengths
    ]
    query, value = embedding(tokens[0]), embedding(tokens[1])
    got = layer(query, value)
    explicit = layer(
        harness.to_numpy(query), harness.to_numpy(value),
        query_mask=tokens[0] != 0, value_mask=tokens[1] != 0,
    )
    np.testing.assert_allclose(harness.to_numpy(got), harness.to_numpy(explicit), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(harness.to_numpy(masking.implicit_mask(got)), tokens[0] != 0)


@s.examples(8)
@given(data=st.data())
def test_soft_attention_matches_reference(data):
    score = data.draw(st.sampled_from(["scaled_dot", "dot", "additive", "bilinear"]), label="score")
    width = 4
    layer = s.cached_layer(
        ("soft", score), lambda: SoftAttention(score=score),
        np.zeros((1, 2, width), "float32"), np.zeros((1, 3, width), "float32"),
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    batch = data.draw(st.sampled_from([1, 2]), label="B")
    query_length, key_length = data.draw(st.tuples(st.integers(1, 4), st.integers(1, 5)), label="T, S")
    query = s.normal(rng, (batch, query_length, width))
    value = s.normal(rng, (batch, key_length, width))
    key = s.normal(rng, (batch, key_length, width)) if data.draw(st.booleans(), label="key") else None
    kwargs, mask = data.draw(
        s.attention_masks(batch, 1, query_length, key_length, rng), label="masks"
    )
    if np.ndim(kwargs.get("attention_mask")) == 4:  # one head: no head axis
        kwargs["attention_mask"] = kwargs["attention_mask"][:, 0]
    use_causal_mask = data.draw(st.booleans(), label="causal")
    if use_causal_mask:
        mask = mask & s.causal(query_length, key_length)
    output, weights = layer(
        query, value, key=key, use_causal_mask=use_causal_mask,
        return_attention_scores=True, **kwargs,
    )
    expected, expected_weights = ref.attention(
        layer.score, query, value if key is None else key, value, mask[:, 0]
    )
    np.testing.assert_allclose(harness.to_numpy(weights), expected_weights, **TOLERANCE)
    np.testing.assert_allclose(harness.to_numpy(output), expected, **TOLERANCE)


@s.examples(6)
@given(data=st.data())
def test_self_attention_matches_reference(data):
    width, units = 4, 3
    layer = s.cached_layer(
        "self", lambda: SelfAttention(units), np.zeros((1, 2, width), "float32")
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    batch = data.draw(st.sampled_from([1, 2]), label="B")
    length = data.draw(st.integers(1, 4), label="T")
    x = s.normal(rng, (batch, length, width))
    padding = rng.random((batch, length)) < 0.7
    use_causal_mask = data.draw(st.booleans(), label="causal")
    # The one padding mask masks the queries and the keys.
    mask = padding[:, None, :] & padding[:, :, None]
    if use_causal_mask:
        mask = mask & s.causal(length, length)
    output = layer(x, mask=padding, use_causal_mask=use_causal_mask)

    def project(dense):
        y = x.astype("float64") @ harness.to_numpy(dense.kernel)
        return y if dense.bias is None else y + harness.to_numpy(dense.bias)

    expected, _ = ref.attention(
        layer.score, project(layer.query_dense), project(layer.key_dense),
        project(layer.value_dense), mask,
    )
    np.testing.assert_allclose(harness.to_numpy(output), expected, **TOLERANCE)


@given(data=st.data())
def test_masked_softmax_matches_reference(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    shape = data.draw(
        st.tuples(st.sampled_from([1, 2]), st.integers(1, 4), st.integers(1, 5)), label="shape"
    )
    logits = 3 * s.normal(rng, shape)
    mask = rng.random(shape) < data.draw(st.sampled_from([0.0, 0.5, 1.0]), label="density")
    got = ka_ops.masked_softmax(logits, mask)
    np.testing.assert_allclose(harness.to_numpy(got), ref.masked_softmax(logits, mask), **TOLERANCE)


@given(
    query_length=st.integers(1, 6),
    extra=st.integers(0, 4),
    start=st.one_of(st.none(), st.integers(-2, 6)),
    data=st.data(),
)
def test_causal_mask_matches_reference(query_length, extra, start, data):
    key_length = query_length + extra
    args = [data.draw(s.integer_like(n), label="length") for n in (query_length, key_length)]
    got = masking.causal_mask(*args, query_start=start)
    first = key_length - query_length if start is None else start
    expected = (np.arange(query_length)[:, None] + first) >= np.arange(key_length)[None]
    np.testing.assert_array_equal(harness.to_numpy(got), expected)


def _gpt(num_key_value_heads):
    return s.cached_layer(
        ("gpt", num_key_value_heads),
        lambda: GPT(
            vocabulary_size=13, max_sequence_length=8, num_layers=2, num_heads=2,
            hidden_dim=8, intermediate_dim=16, num_key_value_heads=num_key_value_heads,
        ),
        np.zeros((1, 2), "int32"),
    )


@s.examples(3)
@given(data=st.data())
def test_gpt_cached_logits_equal_full_pass(data):
    """`call_with_cache` over a prefill and steps (the index as an int, numpy
    integer or tensor) gives the logits of one full pass."""
    model = _gpt(data.draw(st.sampled_from([None, 1]), label="num_key_value_heads"))
    batch = 1
    total = data.draw(st.sampled_from([3, 5]), label="length")
    prefill = data.draw(st.integers(1, total - 1), label="prefill")
    ids = np.asarray(
        data.draw(st.lists(st.integers(0, 12), min_size=batch * total, max_size=batch * total)),
        "int32",
    ).reshape(batch, total)
    full = harness.to_numpy(model(ids))
    cache = model.empty_cache(batch, 8)
    logits, cache = model.call_with_cache(ids[:, :prefill], cache, 0)
    pieces = [harness.to_numpy(logits)]
    for index in range(prefill, total):
        logits, cache = model.call_with_cache(
            ids[:, index : index + 1], cache, data.draw(s.integer_like(index), label="index")
        )
        pieces.append(harness.to_numpy(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-4, atol=1e-4)


def test_tensor_lengths_are_accepted():
    """A scalar int tensor is as good as an int for a mask length."""
    got = masking.causal_mask(ops.convert_to_tensor(2, "int32"), 3)
    np.testing.assert_array_equal(harness.to_numpy(got), s.causal(2, 3))
