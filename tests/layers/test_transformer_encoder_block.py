"""Tests of `TransformerEncoderBlock`: post/pre-norm, masks, invariances.

Shape legend: `B` batch, `T` length, `D` model width, `H` heads, `G`
key/value heads, `K` head size, `F` feed-forward width.

The numpy reference of a block (`numpy_encoder_block` and the pieces it is
built of) reads the block's own weights, so it checks the equations of the
docstring independently of Keras; the decoder and stack tests import it.
"""

import re

import keras
import numpy as np
import pytest

import harness
import numpy_reference as ref
from keras_attention import masking
from keras_attention import scoring
from keras_attention.layers import TransformerEncoderStack
from keras_attention.layers import TransformerEncoderBlock
from keras_attention.activations import gelu_approximate

B, T, D, H, F = 2, 5, 16, 4, 32
TOLERANCE = 1e-4  # float32 through two residual sub-layers vs float64


def normal(shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).normal(size=shape)).astype("float32")


def randomize(layer, seed=0, scale=0.3):
    """Gives every weight of a built layer random values, biases included.

    Blocks are made with zero kernels (random initializers compile anew for
    every weight shape on JAX); random values here make the references check
    every weight, norms' scales and offsets included.
    """
    rng = np.random.default_rng(seed + 100)
    layer.set_weights(
        [
            (scale * rng.normal(size=w.shape)).astype("float32")
            for w in layer.get_weights()
        ]
    )
    return layer


def _block(**kwargs):
    return TransformerEncoderBlock(
        **{
            "intermediate_dim": F,
            "num_heads": H,
            "kernel_initializer": "zeros",
            **kwargs,
        }
    )


def _built(seed=0, **kwargs):
    block = _block(**kwargs)
    block.build((None, None, D))
    return randomize(block, seed)


def _padding_mask():
    # Example 0 has 3 real tokens, example 1 has 4.
    mask = np.ones((B, T), bool)
    mask[0, 3:] = False
    mask[1, 4:] = False
    return mask


# The numpy reference, in float64, from a layer's own weights.


ACTIVATIONS = {
    "relu": lambda x: np.maximum(x, 0.0),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "gelu_approximate": lambda x: 0.5
    * x
    * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))),
}


def numpy_dense(dense, x):
    """A `Dense` or `EinsumDense` layer."""
    kernel = harness.to_numpy(dense.kernel).astype("float64")
    x = np.asarray(x, "float64")
    if isinstance(dense, keras.layers.EinsumDense):
        y = np.einsum(dense.equation, x, kernel)
    else:
        y = x @ kernel
    if dense.bias is not None:
        y = y + harness.to_numpy(dense.bias)
    return y


def numpy_norm(block, norm, x):
    """Layer norm (Ba et al.) or RMS norm (Zhang and Sennrich) over the last
    axis: the kind and epsilon the block was given, the weights of `norm`."""
    x = np.asarray(x, "float64")
    epsilon = block.layer_norm_epsilon
    if block.normalization == "rms_norm":
        rms = np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + epsilon)
        return x / rms * harness.to_numpy(norm.scale)
    mean = x.mean(axis=-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    normalized = (x - mean) / np.sqrt(variance + epsilon)
    return normalized * harness.to_numpy(norm.gamma) + harness.to_numpy(norm.beta)


def numpy_rotary(x, max_wavelength, start=0):
    """RoPE, "rotate half" layout, on `(B, T, heads, K)` at positions `start + t`."""
    head_dim = x.shape[-1]
    inverse_frequency = float(max_wavelength) ** (
        -np.arange(0, head_dim, 2) / head_dim
    )  # (K/2,)
    angles = (start + np.arange(x.shape[1]))[:, None] * inverse_frequency  # (T, K/2)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # (T, 1, K/2)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def numpy_mha(layer, query, value, mask=None):
    """`(output, weights)` of a `MultiHeadAttention`; mask `(B, T, S)`."""
    q = numpy_dense(layer.query_dense, query)  # (B, T, H, K)
    k = numpy_dense(layer.key_dense, value)  # (B, S, G, K)
    v = numpy_dense(layer.value_dense, value)  # (B, S, G, K)
    if layer.rotary_embedding is not None:
        q = numpy_rotary(q, layer.rotary_embedding.max_wavelength)
        k = numpy_rotary(k, layer.rotary_embedding.max_wavelength)
    heads, kv_heads = q.shape[2], k.shape[2]
    serving = np.arange(heads) // (heads // kv_heads)  # kv head of each head
    q, k, v = (
        np.transpose(t, (0, 2, 1, 3)) for t in (q, k[:, :, serving], v[:, :, serving])
    )  # (B, H, T|S, K)
    scores = ref.scores(layer.score, q, k)  # (B, H, T, S)
    weights = ref.masked_softmax(scores, None if mask is None else mask[:, None])
    attended = np.transpose(weights @ v, (0, 2, 1, 3))  # (B, T, H, K)
    return numpy_dense(layer.output_dense, attended), weights


def numpy_feedforward(block, x):
    """The block's FFN, from its weights and the block's own arguments."""
    act = ACTIVATIONS[block.get_config()["activation"]]
    layer = block.feedforward
    hidden = numpy_dense(layer.intermediate_dense, x)  # (B, T, F)
    if block.gated_feedforward:
        hidden = act(numpy_dense(layer.gate_dense, x)) * hidden
    else:
        hidden = act(hidden)
    return numpy_dense(layer.output_dense, hidden)


def numpy_sublayer(block, x, norm, fn):
    """Post-norm `norm(x + f(x))` or pre-norm `x + f(norm(x))`."""
    if block.normalize_first:
        return x + fn(numpy_norm(block, norm, x))
    return numpy_norm(block, norm, x + fn(x))


def check_attention_arguments(block, layer, rotary):
    """The attention sublayer is made of the block's arguments (the numpy
    reference reads its weights, so it would follow a sublayer built wrong)."""
    assert layer.num_heads == block.num_heads
    assert (layer.num_key_value_heads or layer.num_heads) == (
        block.num_key_value_heads or block.num_heads
    )
    hidden_dim = layer.query_dense.kernel.shape[0]
    assert layer.key_dim == (block.key_dim or hidden_dim // block.num_heads)
    assert type(layer.score) is type(scoring.get(block.score))
    assert layer.use_bias == block.use_bias and layer.dropout == block.attention_dropout
    if rotary and block.use_rotary_embedding:
        assert layer.rotary_embedding.max_wavelength == block.rotary_max_wavelength
    else:
        assert layer.rotary_embedding is None


def self_attention_mask(padding_mask=None, attention_mask=None, causal=False, t=T):
    """The AND of a `(B, T)` padding mask (queries and keys), an attention
    mask and the causal mask, `(B, T, T)`."""
    mask = np.ones((B, t, t), bool)
    if padding_mask is not None:
        mask &= padding_mask[:, :, None] & padding_mask[:, None, :]
    if attention_mask is not None:
        mask &= attention_mask
    if causal:
        mask &= ref.causal_mask(t, t)
    return mask


def numpy_encoder_block(block, x, padding_mask=None, attention_mask=None):
    """`(output, weights)` of an encoder block: attention, then FFN."""
    mask = self_attention_mask(padding_mask, attention_mask, t=x.shape[1])
    captured = []

    check_attention_arguments(block, block.self_attention, rotary=True)

    def attend(h):
        output, weights = numpy_mha(block.self_attention, h, h, mask)
        captured.append(weights)
        return output

    x = np.asarray(x, "float64")
    x = numpy_sublayer(block, x, block.self_attention_layer_norm, attend)
    x = numpy_sublayer(
        block,
        x,
        block.feedforward_layer_norm,
        lambda h: numpy_feedforward(block, h),
    )
    return x, captured[0]


# Layer harness.


def test_layer_harness():
    # The paper's block. The variants (pre-norm, RMS norm, gated FFN, GQA,
    # RoPE) meet numpy references below, mixed precision here too, and
    # train and save in the model of every layer of test_transformer_stacks.py.
    harness.run_layer_test(
        TransformerEncoderBlock,
        {"intermediate_dim": F, "num_heads": H},
        inputs={"inputs": normal((B, T, D)), "padding_mask": _padding_mask()},
        call_kwargs={"return_attention_scores": True},
        expected_output_shapes=[(B, T, D), (B, H, T, T)],
    )


def test_config_keeps_every_argument():
    arguments = dict(
        intermediate_dim=12,
        num_heads=4,
        dropout=0.2,
        activation="gelu_approximate",
        layer_norm_epsilon=1e-6,
        kernel_initializer="ones",
        bias_initializer=keras.initializers.Constant(0.5),
        normalize_first=True,
        key_dim=6,
        num_key_value_heads=2,
        score="bilinear",
        attention_dropout=0.05,
        feedforward_dropout=0.1,
        gated_feedforward=True,
        normalization="rms_norm",
        use_rotary_embedding=True,
        rotary_max_wavelength=500,
        use_bias=False,
        seed=7,
    )
    block = TransformerEncoderBlock(**arguments, name="encoder_block")
    config = block.get_config()
    restored = TransformerEncoderBlock.from_config(config)
    assert restored.get_config() == config
    assert restored.activation is gelu_approximate
    for name, value in arguments.items():
        if name not in ("activation", "kernel_initializer", "bias_initializer"):
            assert getattr(restored, name) == value, name
    assert type(restored.kernel_initializer).__name__ == "Ones"
    assert restored.bias_initializer.value == 0.5
    # The sublayers are made of these arguments.
    restored.build((None, None, D))
    attention = restored.self_attention
    assert (attention.key_dim, attention.num_key_value_heads) == (6, 2)
    assert type(attention.score).__name__ == "Bilinear"
    assert attention.dropout == 0.05 and not attention.use_bias
    assert attention.rotary_embedding.max_wavelength == 500
    assert isinstance(restored.self_attention_layer_norm, keras.layers.RMSNormalization)
    assert restored.self_attention_layer_norm.epsilon == 1e-6
    assert restored.feedforward.gated and restored.feedforward.dropout == 0.1
    assert restored.feedforward.activation is gelu_approximate
    # `attention_dropout` left out follows `dropout`, and stays left out.
    default = TransformerEncoderBlock(8, 2, dropout=0.3)
    assert default.attention_dropout == 0.3
    assert default.get_config()["attention_dropout"] is None


# The block equals its numpy reference.


NUMPY_CASES = {
    # Post-norm (the paper) and pre-norm (GPT-2), each with both norms; the
    # other variants ride along.
    "post_norm_layer_norm": dict(),
    "pre_norm_layer_norm_gqa_no_bias": dict(
        normalize_first=True, num_key_value_heads=2, use_bias=False
    ),
    "post_norm_rms_norm_swiglu_bilinear_key_dim": dict(
        normalization="rms_norm",
        gated_feedforward=True,
        activation="silu",
        score="bilinear",
        key_dim=6,
    ),
    "pre_norm_rms_norm_geglu_rotary": dict(
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        activation="gelu_approximate",
        use_rotary_embedding=True,
    ),
}


# Post-norm and pre-norm configurations of the numpy tests, reused so that
# JAX compiles fewer new operations.
POST_NORM, PRE_NORM = "post_norm_layer_norm", "pre_norm_layer_norm_gqa_no_bias"


@pytest.mark.parametrize("case", list(NUMPY_CASES))
def test_matches_numpy(case):
    block = _built(**NUMPY_CASES[case])
    x = normal((B, T, D))
    padding_mask = _padding_mask()
    attention_mask = np.random.default_rng(2).random((B, T, T)) < 0.7
    attention_mask[:, :, 0] = True  # no real query is left without a key
    kwargs = dict(padding_mask=padding_mask, attention_mask=attention_mask)
    expected, expected_weights = numpy_encoder_block(block, x, **kwargs)
    output, weights = harness.to_numpy(block(x, return_attention_scores=True, **kwargs))
    np.testing.assert_allclose(output, expected, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
    # The fused kernel (no scores returned) computes the same function.
    fused = harness.to_numpy(block(x, **kwargs))
    np.testing.assert_allclose(fused, expected, rtol=TOLERANCE, atol=TOLERANCE)
    # Without masks too.
    expected, _ = numpy_encoder_block(block, x)
    np.testing.assert_allclose(
        harness.to_numpy(block(x)), expected, rtol=TOLERANCE, atol=TOLERANCE
    )


def test_pre_norm_output_is_not_normalized_and_post_norm_output_is():
    x = normal((B, T, D), scale=3.0)
    post = _built(bias_initializer="zeros")
    post.self_attention_layer_norm.set_weights([np.ones(D), np.zeros(D)])
    post.feedforward_layer_norm.set_weights([np.ones(D), np.zeros(D)])
    pre = _built(**NUMPY_CASES[PRE_NORM])
    out = harness.to_numpy(post(x))
    # Post-norm ends with a unit-scale layer norm: zero mean, unit variance.
    np.testing.assert_allclose(out.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(out.var(-1), 1.0, rtol=1e-3)
    # Pre-norm keeps the residual stream: its variance follows the inputs'.
    out = harness.to_numpy(pre(x))
    assert np.all(out.var(-1) > 2.0)


# Invariances.


@pytest.mark.parametrize("case", [POST_NORM, PRE_NORM])
@pytest.mark.parametrize("padding", ["random", "nan"])
def test_padding_invariance_with_an_explicit_padding_mask(case, padding):
    # f([a b c PAD PAD])[:3] == f([a b c]): padding never reaches real tokens,
    # even when it holds NaN.
    block = _built(**NUMPY_CASES[case])
    x = normal((B, T, D))
    real = x[:, :3]
    if padding == "nan":
        x[:, 3:] = np.nan
    padding_mask = np.zeros((B, T), bool)
    padding_mask[:, :3] = True
    padded, weights = harness.to_numpy(
        block(x, padding_mask=padding_mask, return_attention_scores=True)
    )
    alone, alone_weights = harness.to_numpy(block(real, return_attention_scores=True))
    np.testing.assert_allclose(padded[:, :3], alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        weights[:, :, :3, :3], alone_weights, rtol=1e-5, atol=1e-6
    )
    assert np.all(weights[:, :, :, 3:] == 0) and np.all(weights[:, :, 3:] == 0)
    fused = harness.to_numpy(block(x, padding_mask=padding_mask))
    np.testing.assert_allclose(fused[:, :3], alone, rtol=1e-5, atol=1e-5)


def _embedded_block_model(block):
    """token ids -> `Embedding(mask_zero=True)` -> `block`, as a functional model."""
    ids = keras.Input((None,), dtype="int32")
    embedding = keras.layers.Embedding(10, D, mask_zero=True)
    outputs = block(embedding(ids), return_attention_scores=True)
    model = keras.Model(ids, outputs)
    embedding.set_weights([normal((10, D), seed=4)])
    return model, embedding


@pytest.mark.parametrize("case", [POST_NORM, PRE_NORM])
def test_padding_invariance_with_a_keras_implicit_mask(case):
    block = _built(**NUMPY_CASES[case])
    model, embedding = _embedded_block_model(block)
    ids = np.array([[3, 1, 4, 0, 0], [2, 7, 5, 0, 0]], "int32")
    padded, weights = harness.to_numpy(model(ids))
    alone, alone_weights = harness.to_numpy(model(ids[:, :3]))
    np.testing.assert_allclose(padded[:, :3], alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        weights[:, :, :3, :3], alone_weights, rtol=1e-5, atol=1e-6
    )
    assert np.all(weights[:, :, :, 3:] == 0)
    # The implicit mask is the explicit one.
    vectors = harness.to_numpy(embedding(ids))
    explicit, explicit_weights = harness.to_numpy(
        block(vectors, padding_mask=ids != 0, return_attention_scores=True)
    )
    np.testing.assert_allclose(padded, explicit, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(weights, explicit_weights)
    # And the query mask propagates to the output.
    mask = block.compute_mask(vectors, ids != 0)
    np.testing.assert_array_equal(harness.to_numpy(mask), ids != 0)


@pytest.mark.parametrize("case, masked", [(POST_NORM, False), (PRE_NORM, True)])
def test_permutation_equivariance_without_positions(case, masked):
    # Without position information, self-attention and the position-wise
    # FFN commute with any reordering of the tokens.
    block = _built(**NUMPY_CASES[case])
    x = normal((B, T, D))
    permutation = np.array([3, 0, 4, 1, 2])
    kwargs = {"padding_mask": _padding_mask()} if masked else {}
    permuted_kwargs = (
        {"padding_mask": _padding_mask()[:, permutation]} if masked else {}
    )
    output, weights = harness.to_numpy(block(x, return_attention_scores=True, **kwargs))
    permuted, permuted_weights = harness.to_numpy(
        block(x[:, permutation], return_attention_scores=True, **permuted_kwargs)
    )
    np.testing.assert_allclose(permuted, output[:, permutation], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        permuted_weights,
        weights[:, :, permutation][:, :, :, permutation],
        rtol=1e-5,
        atol=1e-6,
    )


def test_rotary_embedding_makes_the_block_position_aware():
    # The counterpart of the test above: with RoPE, the order matters.
    block = _built(**NUMPY_CASES["pre_norm_rms_norm_geglu_rotary"])
    x = normal((B, T, D))
    permutation = np.array([3, 0, 4, 1, 2])
    output = harness.to_numpy(block(x))
    permuted = harness.to_numpy(block(x[:, permutation]))
    assert not np.allclose(permuted, output[:, permutation], atol=1e-3)


# Output at some positions only.


POSITIONS = np.array([[4, 0, 2], [1, 1, 3]])  # (B, M): repeats and any order


def _rows(x, positions=POSITIONS, axis=1):
    return np.take_along_axis(
        x, positions.reshape((B,) + (1,) * (axis - 1) + (-1,) + (1,) * (x.ndim - axis - 1)),
        axis=axis,
    )


@pytest.mark.parametrize("case", [POST_NORM, PRE_NORM])
@pytest.mark.parametrize("mask_rank", [None, 2, 3, 4])
def test_output_positions_are_the_full_outputs_rows(case, mask_rank):
    # Queries at M positions over keys and values at all T: the rows of the
    # full output, weights included, under every mask form.
    block = _built(**NUMPY_CASES[case])
    x = normal((B, T, D))
    rng = np.random.default_rng(3)
    kwargs = {"padding_mask": _padding_mask()}
    if mask_rank is not None:
        shape = {2: (T, T), 3: (B, T, T), 4: (B, 1, T, T)}[mask_rank]
        attention_mask = rng.random(shape) < 0.7
        attention_mask[..., 0] = True
        kwargs["attention_mask"] = attention_mask
    full, full_weights = harness.to_numpy(block(x, return_attention_scores=True, **kwargs))
    rows, weights = harness.to_numpy(
        block(x, return_attention_scores=True, output_positions=POSITIONS, **kwargs)
    )
    assert rows.shape == (B, 3, D) and weights.shape == (B, H, 3, T)
    np.testing.assert_allclose(rows, _rows(full), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weights, _rows(full_weights, axis=2), rtol=1e-5, atol=1e-6)
    fused = harness.to_numpy(block(x, output_positions=POSITIONS, **kwargs))
    np.testing.assert_allclose(fused, _rows(full), rtol=1e-5, atol=1e-5)


def test_output_positions_gradients_equal_the_full_outputs_rows():
    # What training sees: the same gradients, for every weight, as the full
    # output gathered at the positions.
    block = _built(**NUMPY_CASES[PRE_NORM])
    x = normal((B, T, D))
    cotangent = keras.ops.convert_to_tensor(normal((B, 3, D), seed=5))
    padding_mask = _padding_mask()

    def loss(rows):
        return keras.ops.sum(keras.ops.multiply(rows, cotangent))

    full = harness.variable_gradients(
        lambda: loss(
            keras.ops.take_along_axis(
                block(x, padding_mask=padding_mask), POSITIONS[:, :, None], axis=1
            )
        ),
        block.trainable_variables,
    )
    rows = harness.variable_gradients(
        lambda: loss(block(x, padding_mask=padding_mask, output_positions=POSITIONS)),
        block.trainable_variables,
    )
    for got, want in zip(rows, full):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_output_positions_keep_the_keras_mask_rows():
    block = _built()
    model, embedding = _embedded_block_model(block)
    ids = np.array([[3, 1, 4, 0, 0], [2, 7, 5, 9, 0]], "int32")
    vectors = embedding(ids)
    out = block(vectors, output_positions=POSITIONS)
    mask = harness.to_numpy(masking.implicit_mask(out))
    np.testing.assert_array_equal(mask, _rows(ids != 0))


def test_output_positions_symbolic_shape():
    out, weights = _block()(
        keras.KerasTensor((B, T, D)),
        output_positions=keras.KerasTensor((B, 3), dtype="int32"),
        return_attention_scores=True,
    )
    assert tuple(out.shape) == (B, 3, D) and tuple(weights.shape) == (B, H, 3, T)


def test_rejects_bad_output_positions():
    # Through the layer's call, as a user calls it: numpy positions are
    # checked before Keras makes them a tensor (a gather would clamp them on
    # JAX); the stack checks them as its last block does.
    block = _built()
    x = normal((B, T, D))
    stack = TransformerEncoderStack(num_layers=2, intermediate_dim=F, num_heads=H)
    for layer in (block, stack):
        with pytest.raises(
            ValueError,
            match=r"`output_positions` must hold positions in \[0, 5\), the length of "
            r"`inputs`\. Received: a position 5",
        ):
            layer(x, output_positions=np.array([[0, 5], [1, 2]]))
        with pytest.raises(ValueError, match=r"Received: a position -1"):
            layer(x, output_positions=np.array([[0, 1], [-1, 2]]))
    with pytest.raises(ValueError, match=r"`output_positions` must have rank 2"):
        block(x, output_positions=np.array([0, 1]))
    with pytest.raises(
        ValueError, match=r"output_positions batch size=3, inputs batch size=2"
    ):
        block(x, output_positions=np.zeros((3, 2), "int32"))
    with pytest.raises(ValueError, match=r"`output_positions` must hold ints"):
        block(x, output_positions=np.zeros((2, 2), "float32"))


# Dropout and mixed precision.


def test_dropout_is_active_only_in_training():
    x = normal((B, T, D))
    block = _built(dropout=0.5, seed=1)
    plain = _block()
    plain.build((None, None, D))
    plain.set_weights(block.get_weights())
    expected = harness.to_numpy(plain(x))
    np.testing.assert_allclose(
        harness.to_numpy(block(x, training=False)), expected, rtol=1e-6, atol=1e-6
    )
    first = harness.to_numpy(block(x, training=True))
    second = harness.to_numpy(block(x, training=True))
    assert not np.allclose(first, expected, atol=1e-3)
    assert not np.allclose(first, second, atol=1e-3)  # a new mask every call


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 1e-2), ("mixed_bfloat16", 6e-2)]
)
@pytest.mark.parametrize("case", [POST_NORM, "pre_norm_rms_norm_geglu_rotary"])
def test_mixed_precision_close_to_float32(policy, tolerance, case):
    kwargs = NUMPY_CASES[case]
    reference = _built(**kwargs)
    mixed = _block(**kwargs, dtype=policy)
    mixed.build((None, None, D))
    mixed.set_weights(reference.get_weights())
    for w in mixed.weights:
        assert keras.backend.standardize_dtype(w.dtype) == "float32"
    x = normal((B, T, D))
    padding_mask = _padding_mask()
    expected, expected_weights = harness.to_numpy(
        reference(x, padding_mask=padding_mask, return_attention_scores=True)
    )
    compute_dtype = policy.split("_")[1]
    fused = mixed(x, padding_mask=padding_mask)
    output, weights = mixed(x, padding_mask=padding_mask, return_attention_scores=True)
    for t in (fused, output, weights):
        assert keras.backend.standardize_dtype(t.dtype) == compute_dtype
    fused, output, weights = (
        harness.to_numpy(t).astype("float32") for t in (fused, output, weights)
    )
    for got in (fused, output):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(weights, expected_weights, atol=tolerance)
    assert np.all(weights[~np.broadcast_to(expected_weights > 0, weights.shape)] == 0)


# Shapes.


def test_symbolic_shapes_and_compute_output_shape():
    block = _block()
    output, weights = block(keras.Input((None, D)), return_attention_scores=True)
    assert tuple(output.shape) == (None, None, D)
    assert tuple(weights.shape) == (None, H, None, None)
    assert block.compute_output_shape((B, T, D)) == (B, T, D)


# Error messages.


def test_rejects_hidden_dim_not_divisible_by_num_heads():
    with pytest.raises(
        ValueError,
        match=r"`hidden_dim` .* must be divisible by `num_heads`.*"
        r"Received: hidden_dim=16, num_heads=3",
    ):
        _block(num_heads=3)(normal((B, T, D)))
    # A given `key_dim` lifts the requirement.
    block = _block(num_heads=3, key_dim=4)
    block.build((None, None, D))
    assert tuple(block.self_attention.query_dense.kernel.shape) == (D, 3, 4)


@pytest.mark.parametrize("shape", [(B, D), (B, T, 2, D)])
def test_rejects_inputs_of_rank_other_than_3(shape):
    with pytest.raises(
        ValueError,
        match=rf"`inputs` must have rank 3\. .*\(rank {len(shape)}\)",
    ):
        _block()(np.zeros(shape, "float32"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"dropout": 1.0},
            r"`dropout` must be a float in \[0, 1\)\. Received: dropout=1\.0",
        ),
        ({"dropout": -0.1}, r"Received: dropout=-0\.1"),
        ({"attention_dropout": 1.5}, r"`attention_dropout` .* attention_dropout=1\.5"),
        ({"feedforward_dropout": "0.1"}, r"`feedforward_dropout` .*'0\.1'"),
        (
            {"normalization": "batch_norm"},
            r"`normalization` must be one of \('layer_norm', 'rms_norm'\)\. "
            r"Received: normalization='batch_norm'",
        ),
        ({"num_heads": 0}, r"`num_heads` must be a positive integer\. .*num_heads=0"),
        ({"intermediate_dim": 2.5}, r"`intermediate_dim` .*intermediate_dim=2\.5"),
        (
            {"num_heads": 4, "num_key_value_heads": 3},
            r"`num_heads` must be divisible by `num_key_value_heads`",
        ),
        ({"layer_norm_epsilon": 0}, r"`layer_norm_epsilon` .*layer_norm_epsilon=0"),
        ({"score": "cosine"}, r"score='cosine'"),
        ({"activation": "no_such_activation"}, r"`activation` .*no_such_activation"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerEncoderBlock(**{"intermediate_dim": F, "num_heads": H, **kwargs})


def test_rejects_float_and_misshaped_masks():
    x = normal((B, T, D))
    with pytest.raises(TypeError, match=r"`padding_mask` must be a boolean or integer"):
        _block()(x, padding_mask=np.ones((B, T), "float32"))
    with pytest.raises(ValueError, match=re.escape("`padding_mask` must have rank 2")):
        _block()(x, padding_mask=np.ones((B, T, T), bool))
    with pytest.raises(
        ValueError,
        match=r"`padding_mask` and `inputs` must have the same length\. "
        r"Received: padding_mask length=6, inputs length=5",
    ):
        _block()(x, padding_mask=np.ones((B, T + 1), bool))
    with pytest.raises(
        ValueError, match=r"padding_mask batch size=3, inputs batch size=2"
    ):
        _block()(x, padding_mask=np.ones((3, T), bool))
