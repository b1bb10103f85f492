"""Tests of the direct calls (`layers/_direct_calls.py`): inside
`inference()`, a built layer of the package runs its own `call` without
Keras's per-call wrapper, with the wrapper's outputs; anywhere the wrapper
would do something (an unbuilt layer, a mixed policy, a symbolic or numpy
input, outside `inference()`), the wrapper runs. Every sublayer a decoding
step calls is such a layer, in both block configurations (GPT-2's and
LLaMA's), so that no configuration decodes through the wrapper. Where the
backend prefers direct calls (torch; forced here on every backend), the
sublayers of a stack or block called with `training=True` or `False` run
directly too, with the wrapper's outputs, dropout draws and training steps.
"""

import dataclasses

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend
from keras_attention.layers import FeedForward
from keras_attention.layers import LayerNormalization
from keras_attention.layers import RMSNormalization
from keras_attention.layers import RotaryEmbedding
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerDecoderStack
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


@pytest.fixture
def prefer(monkeypatch):
    """`prefer(flag)`: the backend's preferences with `direct_calls=flag`."""
    preferences = backend.preferences()

    def set_flag(flag):
        replaced = dataclasses.replace(preferences, direct_calls=flag)
        monkeypatch.setattr(backend, "preferences", lambda: replaced)

    return set_flag


def _stack():
    return TransformerDecoderStack(
        2, 16, 2, dropout=0.3, seed=7, normalization="rms_norm",
        use_rotary_embedding=True, gated_feedforward=True,
    )


@pytest.mark.parametrize("training", [True, False])
def test_a_stack_called_with_a_flag_runs_its_sublayers_directly(training, prefer, wrapped):
    """Training and inference calls of a built stack: only the stack goes
    through the wrapper where direct calls are preferred, every block and
    sublayer beneath it runs its own `call`, and the outputs (dropout's
    draws included) are the wrapper's."""
    x = _x()
    outputs = {}
    for flag in (False, True):
        prefer(flag)
        keras.utils.set_random_seed(2)
        stack = _stack()
        stack(x)  # builds
        del wrapped[:]
        outputs[flag] = [harness.to_numpy(stack(x, training=training)) for _ in range(2)]
        if flag:
            assert wrapped == ["TransformerDecoderStack"] * 2
        else:
            assert {"TransformerDecoderBlock", "MultiHeadAttention", "Dropout"} <= set(wrapped)
    for got, expected in zip(outputs[True], outputs[False]):
        np.testing.assert_array_equal(got, expected)
    if training:  # the draws differ between calls, as they do through the wrapper
        assert not np.array_equal(outputs[True][0], outputs[True][1])


def test_without_a_flag_the_wrapper_resolves_it(prefer, wrapped):
    """A stack called with no `training` leaves the flag to Keras (an outer
    layer's, else the default): its sublayers go through the wrapper."""
    prefer(True)
    stack = _stack()
    stack(_x())
    del wrapped[:]
    stack(_x())
    assert {"TransformerDecoderBlock", "MultiHeadAttention", "FeedForward"} <= set(wrapped)


def test_a_sublayer_given_another_flag_takes_the_wrapper(prefer, wrapped):
    """Inside a training call, a layer called with `training=None` or
    `False` goes through the wrapper (which resolves the flag), one called
    with `True` does not; the layers beneath a wrapped call run directly
    where the flag passed down is the one in force (True), else through the
    wrapper. The outputs (dropout's draws included) are the wrapper's."""
    outputs = {}
    for flag in (False, True):
        prefer(flag)
        keras.utils.set_random_seed(4)
        outer = _stack()
        outer(_x())
        inner = FeedForward(16, dropout=0.5, seed=1)
        inner(_x(), training=True)  # builds its dropout layer too

        class Probe(type(outer)):
            def call(self, inputs, training=None):
                return [inner(inputs, training=flag) for flag in (None, False, True)]

        probe = Probe.from_config(outer.get_config())
        probe.build(_x().shape)
        del wrapped[:]
        outputs[flag] = harness.to_numpy(probe(_x(), training=True))
    assert wrapped == ["Probe", "FeedForward", "Dropout", "FeedForward", "Dropout"]
    for got, expected in zip(outputs[True], outputs[False]):
        np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(outputs[True][2], outputs[True][1])  # True drops, False does not


def test_training_steps_with_direct_calls_are_the_wrappers(prefer):
    """A GPT with dropout trained two steps, then evaluated: the losses and
    the weights with direct calls equal those through the wrapper."""
    from keras_attention.models import GPT

    ids = np.random.default_rng(5).integers(1, 20, (4, 9)).astype("int32")
    results = {}
    for flag in (False, True):
        prefer(flag)
        keras.utils.set_random_seed(3)
        model = GPT(20, num_layers=2, num_heads=2, hidden_dim=D, intermediate_dim=16,
                    dropout=0.2, max_sequence_length=16, seed=11)
        model.compile(  # eagerly, as torch trains, but on JAX (op by op it is slower)
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=keras.backend.backend() != "jax",
        )
        losses = [float(model.train_on_batch(ids[:, :-1], ids[:, 1:])) for _ in range(2)]
        losses.append(float(model.test_on_batch(ids[:, :-1], ids[:, 1:])))
        results[flag] = losses, [np.array(w) for w in model.get_weights()]
    np.testing.assert_array_equal(results[True][0], results[False][0])
    assert results[True][0][0] != results[True][0][1]  # the step changed the model
    for got, expected in zip(results[True][1], results[False][1]):
        np.testing.assert_array_equal(got, expected)
