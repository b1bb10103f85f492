"""A user's code runs on every path: a block subclass that overrides `call`
and an attention layer that overrides `_compute_attention` change the
stacks' training and inference calls and `generate` exactly as calling the
layers one by one does; and `generate`'s scores are the model's own.

Shape legend: `B` batch, `T` length, `S` source length, `D` width, `V`
vocabulary size.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention.layers import MultiHeadAttention
from keras_attention.layers import TransformerDecoderStack
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerEncoderStack
from keras_attention.layers import TransformerEncoderBlock
from keras_attention.models import GPT
from keras_attention.models import Seq2SeqTransformer

B, T, D, V = 2, 6, 16, 13


def _halved(outputs):
    """A block's output halved, its caches (and weights) as they are."""
    if isinstance(outputs, tuple):
        return (outputs[0] * 0.5,) + tuple(outputs[1:])
    return outputs * 0.5


class HalvedDecoderBlock(TransformerDecoderBlock):
    def call(
        self, decoder_sequence, encoder_sequence=None, decoder_padding_mask=None,
        decoder_attention_mask=None, encoder_padding_mask=None,
        encoder_attention_mask=None, self_attention_cache=None,
        self_attention_cache_update_index=None, cross_attention_cache=None,
        cross_attention_cache_update_index=None, use_causal_mask=True, training=None,
        return_attention_scores=False,
    ):
        return _halved(
            super().call(
                decoder_sequence, encoder_sequence, decoder_padding_mask,
                decoder_attention_mask, encoder_padding_mask, encoder_attention_mask,
                self_attention_cache, self_attention_cache_update_index,
                cross_attention_cache, cross_attention_cache_update_index,
                use_causal_mask, training, return_attention_scores,
            )
        )


class HalvedEncoderBlock(TransformerEncoderBlock):
    def call(
        self, inputs, padding_mask=None, attention_mask=None, training=None,
        return_attention_scores=False, output_positions=None,
    ):
        return _halved(
            super().call(
                inputs, padding_mask, attention_mask, training, return_attention_scores,
                output_positions,
            )
        )


class DoubledAttention(MultiHeadAttention):
    """Keras's override point: the attention output doubled."""

    def _compute_attention(
        self, query, key, value, attention_mask=None, training=None,
        return_attention_scores=False,
    ):
        output, scores = super()._compute_attention(
            query, key, value, attention_mask, training, return_attention_scores
        )
        return output * 2.0, scores


class DoubledAttentionDecoderBlock(TransformerDecoderBlock):
    def _attention(self, hidden_dim, name, rotary, seed_offset):
        layer = super()._attention(hidden_dim, name, rotary, seed_offset)
        return DoubledAttention.from_config(layer.get_config())


class HalvedDecoder(TransformerDecoderStack):
    block_class = HalvedDecoderBlock


class HalvedEncoder(TransformerEncoderStack):
    block_class = HalvedEncoderBlock


class DoubledAttentionDecoder(TransformerDecoderStack):
    block_class = DoubledAttentionDecoderBlock


def _normal(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _randomized(model, seed):
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        if "float" in keras.backend.standardize_dtype(variable.dtype):
            variable.assign(0.4 * rng.normal(size=variable.shape).astype("float32"))
    return model


# The stacks.


def _by_blocks(stack, x, **kwargs):
    for block in stack.blocks:
        x = block(x, **kwargs)
    if stack.output_layer_norm is not None:
        x = stack.output_layer_norm(x)
    return harness.to_numpy(x)


@pytest.mark.parametrize(
    "stack_class, base_class",
    [
        (HalvedDecoder, TransformerDecoderStack),
        (DoubledAttentionDecoder, TransformerDecoderStack),
        (HalvedEncoder, TransformerEncoderStack),
    ],
    ids=["decoder_block_call", "compute_attention", "encoder_block_call"],
)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_stack_runs_the_overridden_code_as_its_blocks_do(stack_class, base_class, training):
    x = _normal((B, T, D), 1)
    padding = np.ones((B, T), bool)
    padding[1, 4:] = False
    kwargs = dict(num_heads=2, normalize_first=True, dropout=0.0)
    stack = stack_class(2, 32, **kwargs)
    base = base_class(2, 32, **kwargs)
    stack.build((None, None, D))
    base.build((None, None, D))
    _randomized(stack, 3)
    base.set_weights(stack.get_weights())
    mask_name = "decoder_padding_mask" if base_class is TransformerDecoderStack else "padding_mask"
    got = harness.to_numpy(stack(x, training=training, **{mask_name: padding}))
    want = _by_blocks(stack, x, training=training, **{mask_name: padding})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    plain = harness.to_numpy(base(x, training=training, **{mask_name: padding}))
    assert np.abs(got - plain).max() > 1e-2  # the override took effect


def test_training_follows_the_overridden_code():
    """The gradient of a model on the overriding stack is the gradient of
    the layers called one by one (checked through one SGD step)."""
    x = _normal((B, T, D), 2)
    y = _normal((B, T, D), 3)

    def model_of(stack_class, call_blocks):
        inputs = keras.Input((T, D))
        stack = stack_class(2, 32, num_heads=2, dropout=0.0, name="stack")
        if call_blocks:
            stack.build((None, T, D))
            h = inputs
            for block in stack.blocks:
                h = block(h)
            outputs = stack.output_layer_norm(h) if stack.output_layer_norm else h
        else:
            outputs = stack(inputs)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    together = model_of(HalvedDecoder, call_blocks=False)
    apart = model_of(HalvedDecoder, call_blocks=True)
    _randomized(together, 4)
    apart.set_weights(together.get_weights())
    np.testing.assert_allclose(together.train_on_batch(x, y), apart.train_on_batch(x, y), rtol=1e-5)
    for mine, theirs in zip(together.get_weights(), apart.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-6)


# Generation.


class HalvedGPT(GPT):
    decoder_class = HalvedDecoder


class DoubledAttentionGPT(GPT):
    decoder_class = DoubledAttentionDecoder


def _gpt(model_class, seed=5):
    model = model_class(
        vocabulary_size=V, max_sequence_length=16, num_layers=2, num_heads=2,
        hidden_dim=D, intermediate_dim=32,
    )
    model.build((None, None))
    return _randomized(model, seed)


def _gpt_logits_by_layers(model, ids):
    """The logits from the layers called one by one."""
    x = model.embedding(ids)
    for block in model.decoder.blocks:
        x = block(x)
    x = model.decoder.output_layer_norm(x)
    return harness.to_numpy(model.embedding(x, reverse=True))


def _gpt_greedy_by_layers(model, prompt, new_tokens):
    ids = prompt
    for _ in range(new_tokens):
        best = np.argmax(_gpt_logits_by_layers(model, ids)[:, -1], axis=-1)
        ids = np.concatenate([ids, best[:, None].astype("int32")], axis=1)
    return ids


@pytest.mark.parametrize("jit_compile", [False, True], ids=["default", "jit_compile"])
@pytest.mark.parametrize("model_class", [HalvedGPT, DoubledAttentionGPT])
def test_gpt_generates_through_the_overridden_code(model_class, jit_compile):
    """`jit_compile=True`: on torch each decoding step through
    `torch.compile`, which traces the overriding code too."""
    prompt = np.random.default_rng(6).integers(1, V, (B, 3)).astype("int32")
    model = _gpt(model_class)
    if jit_compile:
        model.compile(jit_compile=True)
    got = model.generate(prompt, max_new_tokens=8)
    np.testing.assert_array_equal(got, _gpt_greedy_by_layers(model, prompt, 8))
    np.testing.assert_allclose(
        harness.to_numpy(model(got)), _gpt_logits_by_layers(model, got), rtol=1e-5, atol=1e-5
    )
    base = _gpt(GPT)
    base.set_weights(model.get_weights())
    assert np.abs(harness.to_numpy(base(got)) - harness.to_numpy(model(got))).max() > 1e-2


class HalvedSeq2Seq(Seq2SeqTransformer):
    decoder_class = HalvedDecoder


def _translator(model_class, seed, vocabulary=V):
    model = model_class(
        vocabulary, vocabulary, 6, 8, num_encoder_layers=1, num_decoder_layers=2,
        num_heads=2, hidden_dim=D, intermediate_dim=32, dropout=0.0,
    )
    model.build()
    return _randomized(model, seed)


def _log_probs(model, source, target):
    """The full pass's log-probability of each next token `(B, T - 1)`."""
    logits = harness.to_numpy(
        model({"encoder_token_ids": source, "decoder_token_ids": target})
    ).astype("float64")
    logits -= logits.max(axis=-1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return np.take_along_axis(log_softmax[:, :-1], target[:, 1:, None], axis=-1)[..., 0]


def test_translation_generates_through_the_overridden_code():
    source = np.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12]], "int32")
    model = _translator(HalvedSeq2Seq, seed=7)
    got = model.generate(source, max_new_tokens=5, start_token_id=1)
    tokens = np.ones((B, 1), "int32")
    for _ in range(5):
        logits = harness.to_numpy(
            model({"encoder_token_ids": source, "decoder_token_ids": tokens})
        )
        best = np.argmax(logits[:, -1], axis=-1)
        tokens = np.concatenate([tokens, best[:, None].astype("int32")], axis=1)
    np.testing.assert_array_equal(got, tokens)


# The pad id: the decoder's full pass reads it as padding, so it is never
# generated, and every returned sequence scores as the full pass says.


# Weights under which, with the pad id allowed, greedy decoding (5, 11) and
# beam search (all three) generate it mid-sequence, and their scores then
# disagree with the full pass by 0.01 to 0.5.
@pytest.mark.parametrize("seed", [5, 7, 11])
def test_generated_sequences_score_as_the_full_pass_says(seed):
    """A 4-token vocabulary, where the pad id (0) is likely: greedy and beam
    search never generate it, and the scores they return are the sums of
    the full pass's log-probabilities of their tokens."""
    model = _translator(Seq2SeqTransformer, seed=seed, vocabulary=4)
    source = np.array([[1, 2, 3, 1, 2, 3], [3, 3, 2, 0, 0, 0]], "int32")
    ids, scores = model.generate(
        source, max_new_tokens=5, start_token_id=1, return_scores=True, length_penalty=0.0
    )
    assert not np.any(ids[:, 1:] == 0)
    np.testing.assert_allclose(scores, _log_probs(model, source, ids).sum(axis=1), rtol=1e-4, atol=1e-4)
    ids, scores = model.generate(
        source, max_new_tokens=5, start_token_id=1, sampling="beam", num_beams=6,
        num_return_sequences=6, return_scores=True, length_penalty=0.0,
    )
    assert not np.any(ids[:, :, 1:] == 0)
    for k in range(6):
        np.testing.assert_allclose(
            scores[:, k], _log_probs(model, source, ids[:, k]).sum(axis=1), rtol=1e-4, atol=1e-4
        )


def test_an_end_token_equal_to_the_pad_id_is_refused():
    model = _translator(Seq2SeqTransformer, seed=0)
    with pytest.raises(ValueError, match=r"end_token_id=0, pad_token_id=0"):
        model.generate(np.array([[1, 2]], "int32"), 3, start_token_id=1, end_token_id=0)
