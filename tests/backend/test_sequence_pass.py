"""Tests of the sequence pass outside the layers (`backend.stack_forward`,
`backend.decoder_forward`): plain torch on torch, None elsewhere.

Every check compares the model or stack with the same call made through the
layers (`kernels.recording()` sends every call there), values and
gradients, and checks on torch that the pass did run (a pass that quietly
fell back would make the comparison say nothing).

Shape legend: `B` batch, `T` length, `D` width, `V` vocabulary size.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend
from keras_attention import kernels
from keras_attention.layers import TransformerDecoder
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.models import GPT

BACKEND = keras.backend.backend()
B, T, D, V = 2, 5, 8, 13
TOLERANCE = 1e-5


def _normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _randomize(layer, seed=3):
    # Norm scales and offsets away from 1 and 0 too: every weight shows.
    rng = np.random.default_rng(seed)
    layer.set_weights(
        [0.5 * rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()]
    )


def _stack(**kwargs):
    stack = TransformerDecoder(2, 16, 2, **kwargs)
    stack.build((None, None, D))
    _randomize(stack)
    return stack


def _through_layers(fn):
    with kernels.recording():
        return fn()


def _check_same(stack_call, variables, inputs):
    """`stack_call(x)` and its gradients (weights and input) against the
    same call through the layers."""
    cotangent = _normal((B, T, D), 7)

    def loss(call):
        weights = keras.ops.convert_to_tensor(cotangent)
        return lambda: keras.ops.sum(call(keras.ops.convert_to_tensor(inputs)) * weights)

    got = harness.to_numpy(stack_call(inputs))
    want = harness.to_numpy(_through_layers(lambda: stack_call(inputs)))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    got_grads = harness.variable_gradients(loss(stack_call), variables)
    want_grads = _through_layers(lambda: harness.variable_gradients(loss(stack_call), variables))
    for variable, g, w in zip(variables, got_grads, want_grads):
        assert np.abs(w).max() > 0, variable.path  # every weight takes part
        np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE, err_msg=variable.path)
    got_input = harness.input_gradients(stack_call, [inputs], cotangent)[0]
    want_input = _through_layers(
        lambda: harness.input_gradients(stack_call, [inputs], cotangent)[0]
    )
    np.testing.assert_allclose(got_input, want_input, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize(
    "kwargs, causal",
    [
        (dict(normalize_first=True, activation="gelu", use_bias=False), True),  # GPT
        (dict(use_bias=True), False),  # the paper's post-norm block, bidirectional
        (dict(normalize_first=True, num_key_value_heads=1), True),  # multi-query
    ],
    ids=["gpt", "post_norm_full", "multi_query"],
)
def test_stack_pass_equals_the_layers(kwargs, causal):
    stack = _stack(**kwargs)
    x = _normal((B, T, D), 1)
    ran = backend.stack_forward(
        stack.blocks, keras.ops.convert_to_tensor(x), causal, True
    )
    assert (ran is not None) == (BACKEND == "torch")

    def call(inputs):
        return stack(inputs, use_causal_mask=causal, training=True)

    _check_same(call, stack.trainable_variables, x)


def test_gpt_pass_equals_the_layers():
    model = GPT(
        vocabulary_size=V, max_sequence_length=8, num_layers=2, num_heads=2,
        hidden_dim=D, intermediate_dim=16, use_bias=True,
    )
    model.build((None, None))
    _randomize(model)
    ids = np.random.default_rng(2).integers(0, V, size=(B, T)).astype("int32")
    blocks = model.decoder.blocks
    ran = backend.decoder_forward(
        model.embedding, blocks, model.decoder.output_layer_norm, ids, True
    )
    assert (ran is not None) == (BACKEND == "torch")
    got = harness.to_numpy(model(ids, training=True))
    want = harness.to_numpy(_through_layers(lambda: model(ids, training=True)))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    cotangent = keras.ops.convert_to_tensor(_normal((B, T, V), 4))

    def loss():
        return keras.ops.sum(model(ids, training=True) * cotangent)

    variables = model.trainable_variables
    got_grads = harness.variable_gradients(loss, variables)
    want_grads = _through_layers(lambda: harness.variable_gradients(loss, variables))
    for variable, g, w in zip(variables, got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE, err_msg=variable.path)


def test_gpt_pass_in_mixed_precision_equals_the_layers():
    model = GPT(
        vocabulary_size=V, max_sequence_length=8, num_layers=1, num_heads=2,
        hidden_dim=D, intermediate_dim=16, dtype="mixed_bfloat16",
    )
    model.build((None, None))
    _randomize(model)
    ids = np.random.default_rng(2).integers(0, V, size=(B, T)).astype("int32")
    got = model(ids)
    want = _through_layers(lambda: model(ids))
    assert keras.backend.standardize_dtype(got.dtype) == "bfloat16"
    np.testing.assert_allclose(
        harness.to_numpy(keras.ops.cast(got, "float32")),
        harness.to_numpy(keras.ops.cast(want, "float32")),
        rtol=2e-2, atol=2e-2,
    )


def _runs_outside(stack, training=True):
    x = keras.ops.convert_to_tensor(_normal((B, T, D), 1))
    return backend.stack_forward(stack.blocks, x, True, training) is not None


def _gpt_pair(**kwargs):
    """Two GPTs with the same weights and seeds: what one draws through the
    pass, the other draws through the layers."""
    models = []
    for _ in range(2):
        model = GPT(
            vocabulary_size=V, max_sequence_length=8, num_layers=2, num_heads=2,
            hidden_dim=D, intermediate_dim=16, seed=5, **kwargs,
        )
        model.build((None, None))
        _randomize(model)
        models.append(model)
    return models


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dropout=0.3),  # embedding, residual and attention dropout
        dict(dropout=0.2, num_key_value_heads=1),
    ],
    ids=["dropout", "dropout_multi_query"],
)
def test_dropout_in_training_draws_what_the_layers_draw(kwargs):
    fast, layers = _gpt_pair(**kwargs)
    ids = np.random.default_rng(2).integers(0, V, size=(B, T)).astype("int32")
    ran = backend.decoder_forward(
        fast.embedding, fast.decoder.blocks, fast.decoder.output_layer_norm, ids, True,
        embedding_dropout=fast.embedding_dropout,
    )
    assert (ran is not None) == (BACKEND == "torch")
    # `ran` drew from the fast model's generators: both draw once more here.
    if ran is not None:
        _through_layers(lambda: layers(ids, training=True))
    cotangent = keras.ops.convert_to_tensor(_normal((B, T, V), 4))
    got = harness.to_numpy(fast(ids, training=True))
    want = harness.to_numpy(_through_layers(lambda: layers(ids, training=True)))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    # Dropout did act: training differs from inference.
    assert not np.allclose(got, harness.to_numpy(fast(ids)), atol=1e-3)
    got_grads = harness.variable_gradients(
        lambda: keras.ops.sum(fast(ids, training=True) * cotangent), fast.trainable_variables
    )
    want_grads = _through_layers(
        lambda: harness.variable_gradients(
            lambda: keras.ops.sum(layers(ids, training=True) * cotangent),
            layers.trainable_variables,
        )
    )
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE)


def test_dropout_in_the_stack_draws_what_the_layers_draw():
    stacks = []
    for _ in range(2):
        stack = TransformerDecoder(
            2, 16, 2, dropout=0.2, attention_dropout=0.3, feedforward_dropout=0.4, seed=3
        )
        stack.build((None, None, D))
        _randomize(stack)
        stacks.append(stack)
    fast, layers = stacks
    x = _normal((B, T, D), 1)
    assert _runs_outside(fast, training=True) == (BACKEND == "torch")
    if BACKEND == "torch":
        _through_layers(lambda: layers(x, training=True))  # the same draws
    got = harness.to_numpy(fast(x, training=True))
    want = harness.to_numpy(_through_layers(lambda: layers(x, training=True)))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert not np.allclose(got, harness.to_numpy(fast(x)), atol=1e-3)


def test_options_the_pass_does_not_compute_go_to_the_layers():
    assert _runs_outside(_stack()) == (BACKEND == "torch")
    cross = TransformerDecoderBlock(16, 2)
    cross.build((None, None, D), (None, None, D))  # with cross-attention
    x = keras.ops.convert_to_tensor(_normal((B, T, D), 1))
    assert backend.stack_forward([cross], x, True, False) is None
    for kwargs in (dict(use_rotary_embedding=True), dict(normalization="rms_norm")):
        assert not _runs_outside(_stack(**kwargs)), kwargs
    stack = _stack()
    stack.blocks[1].feedforward.output_dense.enable_lora(2)  # not a plain weight
    assert not _runs_outside(stack)
    # Activity regularization, also when switched on after a first call: a
    # loss the layers' call records.
    stack = _stack()
    x = _normal((B, T, D), 1)
    stack(x, training=True)
    stack.blocks[0].self_attention.activity_regularizer = keras.regularizers.L2(0.1)
    assert not _runs_outside(stack)
    stack(x, training=True)
    assert len(stack.losses) == 1
    assert float(harness.to_numpy(stack.losses[0])) > 0
    with keras.RematScope(mode="full"):
        rematerialized = _stack()
    assert not _runs_outside(rematerialized)
    # The explicit kernel asked for, also after a first call.
    stack = _stack()
    stack(x, training=True)
    stack.blocks[1].self_attention.fused = False
    assert not _runs_outside(stack)


def test_a_non_finite_input_keeps_the_layers_rules():
    # NaN at position 2 reaches the causal outputs at 2 and after, not before;
    # the pass gives None and the layers answer.
    stack = _stack(normalize_first=True)
    x = _normal((B, T, D), 1)
    poisoned = x.copy()
    poisoned[0, 2, 0] = np.nan
    assert backend.stack_forward(
        stack.blocks, keras.ops.convert_to_tensor(poisoned), True, False
    ) is None
    clean = harness.to_numpy(stack(x))
    dirty = harness.to_numpy(stack(poisoned))
    np.testing.assert_allclose(dirty[0, :2], clean[0, :2], rtol=TOLERANCE, atol=TOLERANCE)
    assert np.isnan(dirty[0, 2:]).all()
    np.testing.assert_allclose(dirty[1], clean[1], rtol=TOLERANCE, atol=TOLERANCE)
