"""Tests of `TransformerDecoderBlock`: causality, cross-attention, KV caches.

Shape legend: `B` batch, `T` decoder length, `S` encoder length, `L` cache
length, `D` model width, `H` heads, `G` key/value heads, `K` head size.
"""

import keras
import numpy as np
import pytest
from keras import ops

import harness
from keras_attention.layers import TransformerDecoderBlock
from test_transformer_encoder_block import B
from test_transformer_encoder_block import D
from test_transformer_encoder_block import F
from test_transformer_encoder_block import H
from test_transformer_encoder_block import T
from test_transformer_encoder_block import TOLERANCE
from test_transformer_encoder_block import check_attention_arguments
from test_transformer_encoder_block import normal
from test_transformer_encoder_block import numpy_feedforward
from test_transformer_encoder_block import numpy_mha
from test_transformer_encoder_block import numpy_sublayer
from test_transformer_encoder_block import randomize
from test_transformer_encoder_block import self_attention_mask

BACKEND = keras.backend.backend()
S = 7


def _block(**kwargs):
    return TransformerDecoderBlock(
        **{
            "intermediate_dim": F,
            "num_heads": H,
            "kernel_initializer": "zeros",
            **kwargs,
        }
    )


def _built(cross=True, seed=0, **kwargs):
    block = _block(**kwargs)
    block.build((None, None, D), (None, None, D) if cross else None)
    return randomize(block, seed)


def _inputs(seed=0):
    """Decoder `(B, T, D)` and encoder `(B, S, D)` sequences."""
    return normal((B, T, D), seed), normal((B, S, D), seed + 1)


def _masks():
    """Decoder padding `(B, T)`, encoder padding `(B, S)`, cross mask `(B, T, S)`."""
    decoder_padding_mask = np.ones((B, T), bool)
    decoder_padding_mask[1, 4:] = False
    encoder_padding_mask = np.ones((B, S), bool)
    encoder_padding_mask[0, 5:] = False
    encoder_padding_mask[1, 3:] = False
    encoder_attention_mask = np.random.default_rng(5).random((B, T, S)) < 0.7
    encoder_attention_mask[:, :, 0] = True  # every query sees a key
    return decoder_padding_mask, encoder_padding_mask, encoder_attention_mask


def _heads(mask, weights):
    """A `(B, T|1, S)` mask broadcast to weights `(B, H, T, S)`."""
    return np.broadcast_to(mask[:, None], weights.shape)


def numpy_decoder_block(
    block,
    x,
    encoder=None,
    decoder_padding_mask=None,
    encoder_padding_mask=None,
    encoder_attention_mask=None,
    causal=True,
):
    """`(output, self weights[, cross weights])` of a decoder block, in numpy.

    Self-attention masks padded queries and keys and the future; the
    cross-attention masks padded encoder positions.
    """
    t = x.shape[1]
    captured = []

    def attend(layer, mask, source=None):
        def fn(h):
            output, weights = numpy_mha(layer, h, h if source is None else source, mask)
            captured.append(weights)
            return output

        return fn

    check_attention_arguments(block, block.self_attention, rotary=True)
    if encoder is not None:
        check_attention_arguments(block, block.cross_attention, rotary=False)
    x = np.asarray(x, "float64")
    mask = self_attention_mask(decoder_padding_mask, causal=causal, t=t)
    x = numpy_sublayer(
        block, x, block.self_attention_layer_norm, attend(block.self_attention, mask)
    )
    if encoder is not None:
        mask = np.ones((x.shape[0], t, encoder.shape[1]), bool)
        if encoder_padding_mask is not None:
            mask &= encoder_padding_mask[:, None, :]
        if encoder_attention_mask is not None:
            mask &= encoder_attention_mask
        x = numpy_sublayer(
            block,
            x,
            block.cross_attention_layer_norm,
            attend(block.cross_attention, mask, np.asarray(encoder, "float64")),
        )
    x = numpy_sublayer(
        block,
        x,
        block.feedforward_layer_norm,
        lambda h: numpy_feedforward(block, h),
    )
    return (x, *captured)


def compiled(fn):
    """`fn` compiled as the backend compiles a decoding loop."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def empty_cache(block, length, fill=0.0, batch=B):
    """A KV cache `(B, 2, L, G, K)` whose every slot holds `fill`."""
    kv_heads = block.num_key_value_heads or block.num_heads
    key_dim = block.key_dim or D // block.num_heads
    return np.full((batch, 2, length, kv_heads, key_dim), fill, "float32")


# Layer harness.


def test_layer_harness():
    decoder_padding_mask, encoder_padding_mask, _ = _masks()
    x, encoder = _inputs()
    harness.run_layer_test(
        TransformerDecoderBlock,
        {"intermediate_dim": F, "num_heads": H},
        inputs={
            "decoder_sequence": x,
            "encoder_sequence": encoder,
            "decoder_padding_mask": decoder_padding_mask,
            "encoder_padding_mask": encoder_padding_mask,
        },
        call_kwargs={"return_attention_scores": True},
        expected_output_shapes=[(B, T, D), (B, H, T, T), (B, H, T, S)],
    )


def test_config_round_trip():
    block = TransformerDecoderBlock(
        intermediate_dim=12,
        num_heads=4,
        dropout=0.1,
        activation="silu",
        normalize_first=True,
        num_key_value_heads=1,
        gated_feedforward=True,
        normalization="rms_norm",
        use_rotary_embedding=True,
        rotary_max_wavelength=100,
        use_bias=False,
        seed=5,
        kernel_initializer="zeros",
        name="decoder_block",
    )
    harness.check_config_round_trip(block)
    restored = TransformerDecoderBlock.from_config(block.get_config())
    restored.build((None, None, D), (None, None, 8))
    # Rotary embeddings reach the self-attention only.
    assert restored.self_attention.rotary_embedding.max_wavelength == 100
    assert restored.cross_attention.rotary_embedding is None
    assert restored.cross_attention.num_key_value_heads == 1
    # The cross-attention reads encoder outputs of their own width.
    assert tuple(restored.cross_attention.key_dense.kernel.shape) == (8, 1, 4)


# The block equals its numpy reference; returned weights.


NUMPY_CASES = {
    "post_norm": dict(),
    "pre_norm_gqa_rotary": dict(
        normalize_first=True, num_key_value_heads=2, use_rotary_embedding=True
    ),
    "rms_norm_swiglu_mqa": dict(
        normalization="rms_norm",
        gated_feedforward=True,
        activation="silu",
        num_key_value_heads=1,
    ),
}
# The decoder-only (GPT-like) configuration.
DECODER_ONLY = dict(
    normalize_first=True,
    normalization="rms_norm",
    num_key_value_heads=1,
    use_rotary_embedding=True,
)


@pytest.mark.parametrize("case", list(NUMPY_CASES))
def test_matches_numpy_and_returns_both_attention_weights(case):
    block = _built(**NUMPY_CASES[case])
    x, encoder = _inputs()
    decoder_padding_mask, encoder_padding_mask, encoder_attention_mask = _masks()
    kwargs = dict(
        decoder_padding_mask=decoder_padding_mask,
        encoder_padding_mask=encoder_padding_mask,
        encoder_attention_mask=encoder_attention_mask,
    )
    expected, expected_self, expected_cross = numpy_decoder_block(
        block, x, encoder, **kwargs
    )
    output, self_weights, cross_weights = harness.to_numpy(
        block(x, encoder, return_attention_scores=True, **kwargs)
    )
    assert self_weights.shape == (B, H, T, T)
    assert cross_weights.shape == (B, H, T, S)
    # Padded decoder positions attend to nothing in the self-attention;
    # what they read in the cross-attention is left open: only the real
    # positions' outputs and cross-attention rows are compared.
    real = decoder_padding_mask
    np.testing.assert_allclose(
        output[real], expected[real], rtol=TOLERANCE, atol=TOLERANCE
    )
    np.testing.assert_allclose(self_weights, expected_self, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        cross_weights.transpose(0, 2, 1, 3)[real],
        expected_cross.transpose(0, 2, 1, 3)[real],
        rtol=1e-5,
        atol=1e-6,
    )
    # Rows are distributions over what they may see, and 0 elsewhere.
    self_sums = self_weights.sum(-1)  # (B, H, T)
    np.testing.assert_allclose(self_sums.transpose(0, 2, 1)[real], 1.0, rtol=1e-5)
    assert np.all(self_sums.transpose(0, 2, 1)[~real] == 0)
    cross_sums = cross_weights.sum(-1)  # (B, H, T)
    np.testing.assert_allclose(cross_sums.transpose(0, 2, 1)[real], 1.0, rtol=1e-5)
    future = ~np.tril(np.ones((T, T), bool))
    assert np.all(self_weights[:, :, future] == 0)
    cross_mask = encoder_padding_mask[:, None, :] & encoder_attention_mask
    assert np.all(cross_weights[_heads(~cross_mask, cross_weights)] == 0)
    # The fused kernel gives the same output.
    fused = harness.to_numpy(block(x, encoder, **kwargs))
    np.testing.assert_allclose(
        fused[real], expected[real], rtol=TOLERANCE, atol=TOLERANCE
    )


def test_use_causal_mask_false_attends_to_the_future():
    block = _built()
    x, encoder = _inputs()
    expected, expected_self, _ = numpy_decoder_block(block, x, encoder, causal=False)
    output, self_weights, _ = harness.to_numpy(
        block(x, encoder, use_causal_mask=False, return_attention_scores=True)
    )
    np.testing.assert_allclose(output, expected, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(self_weights, expected_self, rtol=1e-5, atol=1e-6)
    assert np.all(self_weights > 0)


def test_symbolic_weights_have_the_encoder_length():
    block = _block()
    output, self_weights, cross_weights = block(
        keras.Input((T, D)), keras.Input((S, 8)), return_attention_scores=True
    )
    assert tuple(output.shape) == (None, T, D)
    assert tuple(self_weights.shape) == (None, H, T, T)
    assert tuple(cross_weights.shape) == (None, H, T, S)
    # With caches: self weights over the cache length, caches as given.
    output, self_weights, cross_weights, self_cache, cross_cache = _block()(
        keras.Input((1, D)),
        self_attention_cache=keras.Input((2, 9, H, D // H)),
        self_attention_cache_update_index=3,
        cross_attention_cache=keras.Input((2, S, H, D // H)),
        return_attention_scores=True,
    )
    assert tuple(self_weights.shape) == (None, H, 1, 9)
    assert tuple(cross_weights.shape) == (None, H, 1, S)
    assert tuple(self_cache.shape) == (None, 2, 9, H, D // H)
    assert tuple(cross_cache.shape) == (None, 2, S, H, D // H)


# Invariances: causality, encoder padding.


@pytest.mark.parametrize("case", list(NUMPY_CASES))
def test_later_tokens_never_change_earlier_outputs(case):
    block = _built(**NUMPY_CASES[case])
    x, encoder = _inputs()
    changed = x.copy()
    changed[:, 3:] = normal((B, T - 3, D), seed=9, scale=3.0)
    for scores in (False, True):  # fused and explicit paths
        outputs = [
            harness.to_numpy(
                block(v, encoder, return_attention_scores=scores)
            )
            for v in (x, changed)
        ]
        first, second = (o[0] if scores else o for o in outputs)
        np.testing.assert_allclose(first[:, :3], second[:, :3], rtol=1e-5, atol=1e-5)
        assert not np.allclose(first[:, 3:], second[:, 3:], atol=1e-3)


def test_nan_in_later_tokens_never_reaches_earlier_outputs():
    # Causality at its limit (DESIGN.md: NaN or inf in a masked key/value
    # leaves every other output unchanged). Fails as of this writing: the
    # MultiHeadAttention zeroes only the keys and values that no query may
    # see, and the causal mask hides a later key from the earlier queries
    # only, so `0 * NaN` reaches them, on the fused and the explicit path.
    block = _built()
    x, encoder = _inputs()
    poisoned = x.copy()
    poisoned[:, 3:] = np.nan
    for scores in (False, True):
        clean, got = (
            harness.to_numpy(block(v, encoder, return_attention_scores=scores))
            for v in (x, poisoned)
        )
        clean, got = (o[0] if scores else o for o in (clean, got))
        np.testing.assert_allclose(got[:, :3], clean[:, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["post_norm", "pre_norm_gqa_rotary"])
def test_cross_attention_ignores_padded_encoder_positions(case):
    block = _built(**NUMPY_CASES[case])
    x, encoder = _inputs()
    encoder_padding_mask = np.zeros((B, S), bool)
    encoder_padding_mask[:, :4] = True
    # The same as an encoder sequence without the padding ...
    expected, _, expected_cross = harness.to_numpy(
        block(x, encoder[:, :4], return_attention_scores=True)
    )
    # ... whatever the padded positions hold, NaN included.
    poisoned = encoder.copy()
    poisoned[:, 4:] = np.nan
    for source in (encoder, poisoned):
        output, _, cross_weights = harness.to_numpy(
            block(
                x,
                source,
                encoder_padding_mask=encoder_padding_mask,
                return_attention_scores=True,
            )
        )
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            cross_weights[..., :4], expected_cross, rtol=1e-5, atol=1e-6
        )
        assert np.all(cross_weights[..., 4:] == 0)
        fused = harness.to_numpy(
            block(x, source, encoder_padding_mask=encoder_padding_mask)
        )
        np.testing.assert_allclose(fused, expected, rtol=1e-5, atol=1e-5)


def test_keras_implicit_masks_equal_explicit_masks():
    # Decoder and encoder token ids through `mask_zero=True` embeddings.
    block = _built()
    decoder_ids = keras.Input((None,), dtype="int32")
    encoder_ids = keras.Input((None,), dtype="int32")
    embedding = keras.layers.Embedding(10, D, mask_zero=True)
    outputs = block(
        embedding(decoder_ids), embedding(encoder_ids), return_attention_scores=True
    )
    model = keras.Model([decoder_ids, encoder_ids], outputs)
    embedding.set_weights([normal((10, D), seed=4)])
    decoder_tokens = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 0]], "int32")
    encoder_tokens = np.array([[2, 7, 1, 8, 2, 0, 0], [8, 1, 8, 0, 0, 0, 0]], "int32")
    output, self_weights, cross_weights = harness.to_numpy(
        model([decoder_tokens, encoder_tokens])
    )
    decoder, encoder = (
        harness.to_numpy(embedding(t)) for t in (decoder_tokens, encoder_tokens)
    )
    expected = harness.to_numpy(
        block(
            decoder,
            encoder,
            decoder_padding_mask=decoder_tokens != 0,
            encoder_padding_mask=encoder_tokens != 0,
            return_attention_scores=True,
        )
    )
    for got, want in zip((output, self_weights, cross_weights), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    padded = (encoder_tokens == 0)[:, None, :]  # (B, 1, S)
    assert np.all(cross_weights[_heads(padded, cross_weights)] == 0)


# Cached decoding == full pass.


def decode(block, x, encoder, prefill, self_cache, cross_cache=None, **kwargs):
    """Prefills `prefill` tokens at index 0 (filling the cross cache from
    `encoder`), then decodes one token at a time in `ops.while_loop`,
    reading the filled cross cache; all of it compiled (jit on JAX,
    `tf.function` on TensorFlow). Returns the outputs `(B, T, D)` and the
    final caches."""
    batch, length, width = x.shape
    cross = cross_cache is not None

    def run(x, encoder, self_cache, cross_cache):
        prefilled = block(
            x[:, :prefill],
            encoder,
            self_attention_cache=self_cache,
            self_attention_cache_update_index=0,
            cross_attention_cache=cross_cache,
            cross_attention_cache_update_index=0 if cross else None,
            **kwargs,
        )
        output, self_cache = prefilled[:2]
        cross_cache = prefilled[2] if cross else ops.zeros((1,))
        outputs = ops.concatenate(
            [output, ops.zeros((batch, length - prefill, width))], axis=1
        )  # (B, T, D)

        def step(i, self_cache, cross_cache, outputs):
            token = ops.slice(x, (0, i, 0), (batch, 1, width))  # (B, 1, D)
            stepped = block(
                token,
                self_attention_cache=self_cache,
                self_attention_cache_update_index=i,
                cross_attention_cache=cross_cache if cross else None,
                **kwargs,
            )
            outputs = ops.slice_update(outputs, (0, i, 0), stepped[0])
            return i + 1, stepped[1], stepped[2] if cross else cross_cache, outputs

        _, self_cache, cross_cache, outputs = ops.while_loop(
            lambda i, *_: i < length,
            step,
            (prefill, self_cache, cross_cache, outputs),
        )
        return outputs, self_cache, cross_cache

    outputs, self_cache, cross_cache = compiled(run)(
        ops.convert_to_tensor(x),
        None if encoder is None else ops.convert_to_tensor(encoder),
        ops.convert_to_tensor(self_cache),
        None if cross_cache is None else ops.convert_to_tensor(cross_cache),
    )
    return tuple(harness.to_numpy(t) for t in (outputs, self_cache, cross_cache))


@pytest.mark.parametrize(
    "case, kwargs",
    [
        ("post_norm", NUMPY_CASES["post_norm"]),
        ("pre_norm_gqa_rotary", NUMPY_CASES["pre_norm_gqa_rotary"]),
        ("decoder_only_rms_mqa_rotary", DECODER_ONLY),
    ],
)
def test_cached_decoding_equals_full_pass(case, kwargs):
    cross = not case.startswith("decoder_only")
    block = _built(cross=cross, **kwargs)
    x, encoder = _inputs()
    prefill, max_length = 2, T + 2
    encoder_kwargs = {}
    if cross:
        # Padded encoder positions hold NaN: they reach the cross cache, and
        # must never be read from it.
        encoder_padding_mask = np.ones((B, S), bool)
        encoder_padding_mask[1, 4:] = False
        encoder = encoder.copy()
        encoder[1, 4:] = np.nan
        encoder_kwargs = dict(encoder_padding_mask=encoder_padding_mask)
        full = block(x, encoder, **encoder_kwargs)
        cross_cache = empty_cache(block, S)
    else:
        full = block(x)
        encoder = cross_cache = None
    full = harness.to_numpy(full)
    assert np.all(np.isfinite(full))
    # Unwritten slots of the self cache hold NaN: they must never be read.
    self_cache = empty_cache(block, max_length, fill=np.nan)
    decoded, self_cache, cross_cache = decode(
        block, x, encoder, prefill, self_cache, cross_cache, **encoder_kwargs
    )
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    # The self cache holds a key and value for every position, and leaves
    # the slots past them as they were.
    assert np.all(np.isfinite(self_cache[:, :, :T]))
    assert np.all(np.isnan(self_cache[:, :, T:]))
    if cross:
        expected_cache = block.cross_attention.compute_cache(encoder)
        np.testing.assert_allclose(
            cross_cache, harness.to_numpy(expected_cache), rtol=1e-6, atol=1e-6
        )


def test_cached_steps_on_a_keras_masked_sequence():
    """A cached step whose input carries a Keras mask (a `mask_zero`
    embedding's) masks its queries, as the explicit padding mask does, and
    none of the caches' slots: Keras's wrapper must not read the `(B, T)`
    mask of the new positions as one over a cache's `L` slots."""
    block = _built()
    _, encoder = _inputs()
    embedding = keras.layers.Embedding(10, D, mask_zero=True)
    embedding.build((None, None))
    embedding.set_weights([normal((10, D), seed=5)])
    tokens = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 0]], "int32")
    x = embedding(tokens)
    assert x._keras_mask is not None  # the step's input carries the mask
    plain = harness.to_numpy(embedding(tokens))
    max_length = T + 2

    def steps(x, **kwargs):
        _, self_cache, cross_cache = block(
            x[:, :3], encoder,
            self_attention_cache=ops.zeros((B, 2, max_length, H, D // H)),
            self_attention_cache_update_index=0,
            cross_attention_cache=ops.zeros((B, 2, S, H, D // H)),
            cross_attention_cache_update_index=0,
            **{k: v[:, :3] for k, v in kwargs.items()},
        )
        tail = x[:, 3:]
        if hasattr(x, "_keras_mask"):
            tail._keras_mask = x._keras_mask[:, 3:]
        output, _, _ = block(
            tail,
            self_attention_cache=self_cache, self_attention_cache_update_index=3,
            cross_attention_cache=cross_cache,
            **{k: v[:, 3:] for k, v in kwargs.items()},
        )
        return harness.to_numpy(output)

    expected = steps(ops.convert_to_tensor(plain), decoder_padding_mask=tokens != 0)
    np.testing.assert_allclose(steps(x), expected, rtol=1e-6, atol=1e-6)
    full = harness.to_numpy(block(plain, encoder, decoder_padding_mask=tokens != 0))
    np.testing.assert_allclose(expected, full[:, 3:], rtol=1e-5, atol=1e-5)


def test_cached_step_returns_weights_over_the_cache():
    block = _built()
    x, encoder = _inputs()
    expected, expected_self, expected_cross = harness.to_numpy(
        block(x, encoder, return_attention_scores=True)
    )
    max_length = T + 2

    def run(x, encoder):
        _, self_cache, cross_cache = block(
            x[:, :3],
            encoder,
            self_attention_cache=ops.zeros((B, 2, max_length, H, D // H)),
            self_attention_cache_update_index=0,
            cross_attention_cache=ops.zeros((B, 2, S, H, D // H)),
            cross_attention_cache_update_index=0,
        )
        return block(
            x[:, 3:],
            self_attention_cache=self_cache,
            self_attention_cache_update_index=3,
            cross_attention_cache=cross_cache,
            return_attention_scores=True,
        )

    output, self_weights, cross_weights, _, _ = harness.to_numpy(
        compiled(run)(ops.convert_to_tensor(x), ops.convert_to_tensor(encoder))
    )
    np.testing.assert_allclose(output, expected[:, 3:], rtol=1e-5, atol=1e-5)
    assert self_weights.shape == (B, H, T - 3, max_length)
    np.testing.assert_allclose(
        self_weights[..., :T], expected_self[:, :, 3:], rtol=1e-5, atol=1e-6
    )
    assert np.all(self_weights[..., T:] == 0)
    np.testing.assert_allclose(
        cross_weights, expected_cross[:, :, 3:], rtol=1e-5, atol=1e-6
    )


# Decoder-only blocks.


def test_decoder_only_block_matches_numpy_and_refuses_an_encoder():
    block = _built(cross=False, **DECODER_ONLY)
    assert block.cross_attention is None
    x, encoder = _inputs()
    decoder_padding_mask = _masks()[0]
    expected, expected_self = numpy_decoder_block(
        block, x, decoder_padding_mask=decoder_padding_mask
    )
    output, self_weights = harness.to_numpy(
        block(
            x, decoder_padding_mask=decoder_padding_mask, return_attention_scores=True
        )
    )
    np.testing.assert_allclose(output, expected, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(self_weights, expected_self, rtol=1e-5, atol=1e-6)
    message = r"built without an encoder sequence.*decoder-only"
    with pytest.raises(ValueError, match=message):
        block(x, encoder)
    with pytest.raises(ValueError, match=message):
        block(
            x[:, :1],
            self_attention_cache=empty_cache(block, T),
            self_attention_cache_update_index=0,
            cross_attention_cache=empty_cache(block, S),
        )
    # And a block built with cross-attention needs an encoder sequence.
    with pytest.raises(
        ValueError, match=r"needs `encoder_sequence`.*Received: encoder_sequence=None"
    ):
        _built()(x)


# Mixed precision.


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 1e-2), ("mixed_bfloat16", 6e-2)]
)
def test_mixed_precision_close_to_float32(policy, tolerance):
    reference = _built()
    mixed = _block(dtype=policy)
    mixed.build((None, None, D), (None, None, D))
    mixed.set_weights(reference.get_weights())
    x, encoder = _inputs()
    decoder_padding_mask, encoder_padding_mask, _ = _masks()
    kwargs = dict(
        decoder_padding_mask=decoder_padding_mask,
        encoder_padding_mask=encoder_padding_mask,
    )
    expected = harness.to_numpy(
        reference(x, encoder, return_attention_scores=True, **kwargs)
    )
    compute_dtype = policy.split("_")[1]
    fused = mixed(x, encoder, **kwargs)
    outputs = mixed(x, encoder, return_attention_scores=True, **kwargs)
    for t in (fused, *outputs):
        assert keras.backend.standardize_dtype(t.dtype) == compute_dtype
    fused = harness.to_numpy(fused).astype("float32")
    outputs = [harness.to_numpy(t).astype("float32") for t in outputs]
    for got, want in zip([fused, *outputs], [expected[0], *expected]):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    # Masked weights stay exactly 0.
    padded = ~encoder_padding_mask[:, None, :]  # (B, 1, S)
    assert np.all(outputs[2][_heads(padded, outputs[2])] == 0)


# Error messages.


def test_rejects_hidden_dim_not_divisible_by_num_heads():
    x, encoder = _inputs()
    with pytest.raises(
        ValueError,
        match=r"`hidden_dim` .* divisible by `num_heads`.*hidden_dim=16, num_heads=3",
    ):
        _block(num_heads=3)(x, encoder)


@pytest.mark.parametrize("argument", ["decoder_sequence", "encoder_sequence"])
def test_rejects_inputs_of_rank_other_than_3(argument):
    x, encoder = _inputs()
    inputs = {"decoder_sequence": x, "encoder_sequence": encoder}
    inputs[argument] = inputs[argument][:, 0]
    with pytest.raises(ValueError, match=rf"`{argument}` must have rank 3.*\(rank 2\)"):
        _block()(**inputs)


def test_rejects_decoder_and_encoder_of_different_batch_sizes():
    x, encoder = _inputs()
    message = (
        r"`decoder_sequence` and `encoder_sequence` must have the same batch "
        r"size\. Received: decoder_sequence batch size=2, encoder_sequence "
        r"batch size=3"
    )
    third = np.concatenate([encoder, encoder[:1]])
    with pytest.raises(ValueError, match=message):
        _block()(x, third)  # unbuilt: the check runs at build time
    with pytest.raises(ValueError, match=message):
        _built()(x, third)  # built: the check runs in `call`
    with pytest.raises(ValueError, match=message):
        _block()(keras.Input((T, D), batch_size=2), keras.Input((S, D), batch_size=3))


def test_rejects_cache_indices_without_caches():
    block = _built()
    x, encoder = _inputs()
    with pytest.raises(
        ValueError,
        match=r"`self_attention_cache_update_index` needs a `self_attention_cache`\. "
        r"Received: self_attention_cache=None, self_attention_cache_update_index=2",
    ):
        block(x, encoder, self_attention_cache_update_index=2)
    with pytest.raises(
        ValueError,
        match=r"`cross_attention_cache_update_index` needs a "
        r"`cross_attention_cache`\. Received: cross_attention_cache=None, "
        r"cross_attention_cache_update_index=0",
    ):
        block(x, encoder, cross_attention_cache_update_index=0)
    with pytest.raises(
        ValueError,
        match=r"Filling the cross-attention cache \(cross_attention_cache_update_"
        r"index=0\) needs `encoder_sequence`",
    ):
        block(
            x,
            cross_attention_cache=empty_cache(block, S),
            cross_attention_cache_update_index=0,
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"dropout": 1.0},
            r"`dropout` must be a float in \[0, 1\)\. Received: dropout=1\.0",
        ),
        (
            {"normalization": "layernorm"},
            r"`normalization` must be one of .*'layernorm'",
        ),
        ({"num_heads": -2}, r"`num_heads` must be a positive integer.*num_heads=-2"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerDecoderBlock(**{"intermediate_dim": F, "num_heads": H, **kwargs})


def test_rejects_misshaped_padding_masks():
    x, encoder = _inputs()
    with pytest.raises(
        ValueError,
        match=r"`encoder_padding_mask` and `encoder_sequence` must have the same "
        r"length\. Received: encoder_padding_mask length=5, encoder_sequence length=7",
    ):
        _block()(x, encoder, encoder_padding_mask=np.ones((B, 5), bool))
    with pytest.raises(
        ValueError,
        match=r"`decoder_padding_mask` and `decoder_sequence` must have the same "
        r"length",
    ):
        _block()(x, encoder, decoder_padding_mask=np.ones((B, S), bool))
