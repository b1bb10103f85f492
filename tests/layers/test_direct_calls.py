"""Tests of the direct calls (`layers/_direct_calls.py`): inside
`inference()`, a built layer of the package runs its own `call` without
Keras's per-call wrapper, with the wrapper's outputs; anywhere the wrapper
would do something (an unbuilt layer, a mixed policy, a symbolic or numpy
input, outside `inference()`), the wrapper runs. Every sublayer a decoding
step calls is such a layer, in both block configurations (GPT-2's and
LLaMA's), so that no configuration decodes through the wrapper.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention.layers import FeedForward
from keras_attention.layers import LayerNormalization
from keras_attention.layers import RMSNormalization
from keras_attention.layers import RotaryEmbedding
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import _direct_calls

B, T, D = 2, 5, 8


@pytest.fixture
def wrapped(monkeypatch):
    """The classes whose calls went through Keras's wrapper, in order."""
    calls = []
    keras_call = keras.layers.Layer.__call__

    def counting(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return keras_call(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", counting)
    return calls


def _x(seed=0, shape=(B, T, D)):
    return keras.ops.convert_to_tensor(
        np.random.default_rng(seed).normal(size=shape).astype("float32")
    )


LAYERS = {
    "layer_norm": lambda: LayerNormalization(),
    "rms_norm": lambda: RMSNormalization(epsilon=1e-6),
    "feedforward": lambda: FeedForward(16, activation="silu", gated=True),
    "rotary": lambda: RotaryEmbedding(),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_built_layer_skips_the_wrapper_only_inside_inference(name, wrapped):
    layer = LAYERS[name]()
    x = _x(shape=(B, T, 2, D)) if name == "rotary" else _x()
    expected = harness.to_numpy(layer(x))  # builds: through the wrapper
    assert wrapped == [type(layer).__name__]
    with _direct_calls.inference():
        got = harness.to_numpy(layer(x))
    assert wrapped == [type(layer).__name__]  # no further wrapped call
    np.testing.assert_array_equal(got, expected)
    layer(x)  # outside: the wrapper again
    assert len(wrapped) == 2


def test_the_wrapper_runs_where_it_would_do_something(wrapped):
    with _direct_calls.inference():
        layer = RMSNormalization()
        layer(_x())  # not built yet
        layer(np.ones((B, T, D), "float32"))  # a numpy array to convert
        layer(keras.Input((T, D)))  # symbolic
        mixed = RMSNormalization(dtype="mixed_float16")
        mixed.build((B, T, D))
        mixed(_x())  # inputs to cast
    assert wrapped == ["RMSNormalization"] * 4


def test_rms_normalization_is_keras_layer_with_a_mask():
    ours, keras_layer = RMSNormalization(epsilon=1e-6), keras.layers.RMSNormalization(epsilon=1e-6)
    for layer in (ours, keras_layer):
        layer.build((B, T, D))
    scale = np.random.default_rng(1).normal(size=(D,)).astype("float32")
    ours.set_weights([scale])
    keras_layer.set_weights([scale])
    x = harness.to_numpy(_x(2))
    reference = x / np.sqrt((x.astype("float64") ** 2).mean(-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(harness.to_numpy(ours(x)), reference, atol=1e-5)
    np.testing.assert_array_equal(harness.to_numpy(ours(x)), harness.to_numpy(keras_layer(x)))
    mask = np.array([[True] * T, [True] * 3 + [False] * 2])
    np.testing.assert_array_equal(harness.to_numpy(ours.compute_mask(x, mask)), mask)
    assert ours.supports_masking
    restored = RMSNormalization.from_config(ours.get_config())
    assert type(restored) is RMSNormalization and restored.epsilon == 1e-6


@pytest.mark.parametrize("normalization", ["layer_norm", "rms_norm"])
def test_a_decoder_block_runs_without_the_wrapper_inside_inference(normalization, wrapped):
    block = TransformerDecoderBlock(
        16, 2, normalization=normalization, use_rotary_embedding=True, gated_feedforward=True,
    )
    x = _x()
    expected = harness.to_numpy(block(x))
    assert len(wrapped) >= 6  # the block and its sublayers, built through the wrapper
    del wrapped[:]
    with _direct_calls.inference():
        got = harness.to_numpy(block(x))
    assert wrapped == []
    np.testing.assert_array_equal(got, expected)


def _decoding_step(config):
    """A small model of `config` and a function running one cached decoding
    step of it (its own step, as `generate` runs it): logits `(B, 1, V)`."""
    from keras_attention.models import GPT
    from keras_attention.models import Seq2SeqTransformer

    ids = np.random.default_rng(3).integers(1, 20, (B, T)).astype("int32")
    first = keras.ops.convert_to_tensor(ids[:, :1])  # a tensor, as in the decoding loop
    if config == "seq2seq":
        model = Seq2SeqTransformer(20, 20, 16, 16, num_encoder_layers=1, num_decoder_layers=1,
                                   num_heads=2, hidden_dim=D, intermediate_dim=16, dropout=0.0)
        model({"encoder_token_ids": ids, "decoder_token_ids": ids})
        caches = model._decoding_caches(B, 8, ids, np.ones((B, T), bool))
        return lambda: model._decoding_step(first, caches, 0)[0]
    llama = dict(normalization="rms_norm", positions="rotary", gated_feedforward=True,
                 use_bias=False, tie_weights=False, activation="silu")
    model = GPT(20, num_layers=1, num_heads=2, hidden_dim=D, intermediate_dim=16,
                dropout=0.0, max_sequence_length=16, **(llama if config == "llama" else {}))
    model(ids)
    caches = model._empty_layer_caches(B, 8)
    return lambda: model._call_with_layer_caches(first, caches, 0)[0]


@pytest.mark.parametrize("config", ["gpt2", "llama", "seq2seq"])
def test_a_model_decoding_step_runs_without_the_wrapper_inside_inference(config, wrapped):
    """Every layer a model's decoding step calls, its token table and output
    projection included, is called directly inside `inference()`."""
    step = _decoding_step(config)
    expected = harness.to_numpy(step())
    del wrapped[:]
    with _direct_calls.inference():
        got = harness.to_numpy(step())
    assert wrapped == []
    np.testing.assert_array_equal(got, expected)
