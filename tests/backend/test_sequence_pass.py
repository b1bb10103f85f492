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
from keras_attention.layers import TransformerDecoderStack
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerEncoderStack
from keras_attention.models import BertMaskedLM
from keras_attention.models import GPT
from keras_attention.models import Seq2SeqTransformer

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
    stack = TransformerDecoderStack(2, 16, 2, **kwargs)
    stack.build((None, None, D))
    _randomize(stack)
    return stack


def _through_layers(fn):
    with kernels.recording():
        return fn()


def _check_same(stack_call, variables, inputs):
    """`stack_call(*inputs)` and its gradients (weights and inputs) against
    the same call through the layers."""
    cotangent = _normal((B, T, D), 7)

    def loss(call):
        weights = keras.ops.convert_to_tensor(cotangent)
        tensors = [keras.ops.convert_to_tensor(x) for x in inputs]
        return lambda: keras.ops.sum(call(*tensors) * weights)

    got = harness.to_numpy(stack_call(*inputs))
    want = harness.to_numpy(_through_layers(lambda: stack_call(*inputs)))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    got_grads = harness.variable_gradients(loss(stack_call), variables)
    want_grads = _through_layers(lambda: harness.variable_gradients(loss(stack_call), variables))
    for variable, g, w in zip(variables, got_grads, want_grads):
        assert np.abs(w).max() > 0, variable.path  # every weight takes part
        np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE, err_msg=variable.path)
    got_inputs = harness.input_gradients(stack_call, inputs, cotangent)
    want_inputs = _through_layers(lambda: harness.input_gradients(stack_call, inputs, cotangent))
    for g, w in zip(got_inputs, want_inputs):
        assert np.abs(w).max() > 0  # every input takes part
        np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE)
    return got


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

    _check_same(call, stack.trainable_variables, [x])


S = 6  # encoder length
# Padding: the second target row pads its first and last positions (a
# padded query sees no key, and no query sees a padded key: position 0 is
# one every later query would see), the first source row its last two;
# `empty_source` pads the whole second source row (cross-attention sees
# nothing there).
TARGET_MASK = np.array([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], bool)
SOURCE_MASK = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)


def _runs_with_masks(blocks, x, causal, **masks):
    masks = {k: keras.ops.convert_to_tensor(v) for k, v in masks.items()}
    ran = backend.stack_forward(blocks, keras.ops.convert_to_tensor(x), causal, True, **masks)
    return ran is not None


@pytest.mark.parametrize(
    "kwargs",
    [dict(use_bias=True), dict(normalize_first=True, num_key_value_heads=1)],
    ids=["post_norm", "pre_norm_multi_query"],
)
def test_encoder_pass_with_padding_equals_the_layers(kwargs):
    stack = TransformerEncoderStack(2, 16, 2, **kwargs)
    stack.build((None, None, D))
    _randomize(stack)
    x = _normal((B, T, D), 1)
    assert _runs_with_masks(stack.blocks, x, False, padding_mask=TARGET_MASK) == (
        BACKEND == "torch"
    )

    def call(inputs):
        return stack(inputs, padding_mask=TARGET_MASK, training=True)

    got = _check_same(call, stack.trainable_variables, [x])
    # The mask acted: without it the real positions read the padded ones.
    unmasked = harness.to_numpy(stack(x))
    assert not np.allclose(got[1, 1:4], unmasked[1, 1:4], atol=1e-3)


@pytest.mark.parametrize(
    "kwargs, source_mask",
    [
        (dict(use_bias=True), SOURCE_MASK),
        (dict(normalize_first=True, num_key_value_heads=1), SOURCE_MASK),
        (dict(use_bias=True), np.array([[1, 1, 1, 1, 0, 0], [0] * S], bool)),
    ],
    ids=["post_norm", "pre_norm_multi_query", "empty_source"],
)
def test_decoder_pass_with_cross_attention_and_padding_equals_the_layers(
    kwargs, source_mask
):
    stack = TransformerDecoderStack(2, 16, 2, **kwargs)
    stack.build((None, None, D), (None, None, D))
    _randomize(stack)
    x, memory = _normal((B, T, D), 1), _normal((B, S, D), 2)
    masks = dict(
        padding_mask=TARGET_MASK, memory=memory, memory_mask=source_mask
    )
    assert _runs_with_masks(stack.blocks, x, True, **masks) == (BACKEND == "torch")

    def call(inputs, encoded):
        return stack(
            inputs, encoded, decoder_padding_mask=TARGET_MASK,
            encoder_padding_mask=source_mask, training=True,
        )

    got = _check_same(call, stack.trainable_variables, [x, memory])
    # The masks acted: the outputs differ from the unmasked stack's.
    unmasked = harness.to_numpy(stack(x, memory))
    assert not np.allclose(got[0], unmasked[0], atol=1e-3)  # source padding
    assert not np.allclose(got[1, 1:4], unmasked[1, 1:4], atol=1e-3)  # target padding


def test_masks_of_all_true_are_no_masks():
    stack = TransformerDecoderStack(1, 16, 2)
    stack.build((None, None, D), (None, None, D))
    _randomize(stack)
    x, memory = _normal((B, T, D), 1), _normal((B, S, D), 2)
    masked = stack(
        x, memory, decoder_padding_mask=np.ones((B, T), bool),
        encoder_padding_mask=np.ones((B, S), bool),
    )
    want = _through_layers(lambda: stack(x, memory))
    np.testing.assert_allclose(
        harness.to_numpy(masked), harness.to_numpy(want), rtol=TOLERANCE, atol=TOLERANCE
    )


def _seq2seq_pair(**kwargs):
    """Two translation models with the same weights and seeds: what one
    draws through the pass, the other draws through the layers."""
    models = []
    for _ in range(2):
        model = Seq2SeqTransformer(
            V, V + 2, 8, 8, num_encoder_layers=2, num_decoder_layers=2, num_heads=2,
            hidden_dim=D, intermediate_dim=16, positions="learned", seed=5, **kwargs,
        )
        model.build({"encoder_token_ids": (None, None), "decoder_token_ids": (None, None)})
        _randomize(model)
        models.append(model)
    return models


def _translation_inputs():
    rng = np.random.default_rng(2)
    source = rng.integers(1, V, size=(B, S)).astype("int32")
    target = rng.integers(1, V + 2, size=(B, T)).astype("int32")
    return {
        "encoder_token_ids": np.where(SOURCE_MASK, source, 0),
        "decoder_token_ids": np.where(TARGET_MASK, target, 0),
    }


def _check_model_pair(fast, layers, inputs, tolerance, dropout):
    """A training call of `fast` against the same call of `layers` (same
    weights and seeds) through the layers: outputs and weight gradients.
    Returns the output."""
    got = harness.to_numpy(fast(inputs, training=True))
    want = harness.to_numpy(_through_layers(lambda: layers(inputs, training=True)))
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    if dropout:  # dropout did act: training differs from inference
        assert not np.allclose(got, harness.to_numpy(fast(inputs)), atol=1e-3)
    cotangent = keras.ops.convert_to_tensor(_normal(got.shape, 4).astype(fast.compute_dtype))

    def loss(model):
        return lambda: keras.ops.sum(model(inputs, training=True) * cotangent)

    got_grads = harness.variable_gradients(loss(fast), fast.trainable_variables)
    want_grads = _through_layers(
        lambda: harness.variable_gradients(loss(layers), layers.trainable_variables)
    )
    for variable, g, w in zip(fast.trainable_variables, got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance, err_msg=variable.path)


@pytest.mark.parametrize(
    "dropout, dtype, tolerance",
    # With dropout, float32 rounding through four post-norm blocks reaches
    # 1e-4 in gradients of 10 (float64: 1e-15): compared in float64.
    [(0.0, "float32", TOLERANCE), (0.3, "float64", 1e-10)],
    ids=["no_dropout", "dropout"],
)
def test_translation_model_through_the_pass_equals_the_layers(dropout, dtype, tolerance):
    fast, layers = _seq2seq_pair(dropout=dropout, dtype=dtype)
    inputs = _translation_inputs()
    encoded, source_mask = fast.encode(inputs["encoder_token_ids"])
    x = keras.ops.convert_to_tensor(_normal((B, T, D), 1))
    assert (
        backend.stack_forward(fast.encoder.blocks, encoded, False, False, source_mask)
        is not None
    ) == (BACKEND == "torch")
    assert (
        backend.stack_forward(
            fast.decoder.blocks, x, True, False, keras.ops.convert_to_tensor(TARGET_MASK),
            encoded, source_mask,
        )
        is not None
    ) == (BACKEND == "torch")
    _check_model_pair(fast, layers, inputs, tolerance, dropout)


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_masked_lm_through_the_pass_equals_the_layers(dropout):
    # The blocks before the last through the pass; the last, which computes
    # the mask positions' rows only (`output_positions`), through its layer.
    models = []
    for _ in range(2):
        model = BertMaskedLM(
            V, 3, 2, D, 16, dropout=dropout, max_sequence_length=8, seed=5,
            dtype="float64" if dropout else "float32",
        )
        model.build({
            "token_ids": (None, None), "padding_mask": (None, None),
            "mask_positions": (None, None),
        })
        _randomize(model)
        models.append(model)
    fast, layers = models
    rng = np.random.default_rng(2)
    inputs = {
        "token_ids": np.where(TARGET_MASK, rng.integers(1, V, size=(B, T)), 0).astype("int32"),
        "padding_mask": TARGET_MASK,
        "mask_positions": np.array([[1, 3], [2, 3]], "int32"),
    }
    blocks = fast.encoder.encoder.blocks
    x = keras.ops.convert_to_tensor(_normal((B, T, D), 1).astype(fast.compute_dtype))
    ran = backend.stack_forward(blocks[:-1], x, False, False, TARGET_MASK)
    assert (ran is not None) == (BACKEND == "torch")
    _check_model_pair(fast, layers, inputs, 1e-10 if dropout else TOLERANCE, dropout)


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
        stack = TransformerDecoderStack(
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
    # A block with cross-attention called without an encoder output, or one
    # without called with it: the layers raise.
    cross = TransformerDecoderBlock(16, 2)
    cross.build((None, None, D), (None, None, D))
    x = keras.ops.convert_to_tensor(_normal((B, T, D), 1))
    memory = keras.ops.convert_to_tensor(_normal((B, S, D), 2))
    assert backend.stack_forward([cross], x, True, False) is None
    plain = _stack().blocks
    assert backend.stack_forward(plain, x, True, False, memory=memory) is None
    assert (backend.stack_forward([cross], x, True, False, memory=memory) is not None) == (
        BACKEND == "torch"
    )
    # The cross-attention's explicit kernel asked for.
    cross.cross_attention.fused = False
    assert backend.stack_forward([cross], x, True, False, memory=memory) is None
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


def test_a_non_finite_padded_memory_position_reaches_nothing():
    # The pass sees NaN in its output (0 times NaN in the kernel) and gives
    # None; the layers leave a padded position out entirely.
    stack = TransformerDecoderStack(2, 16, 2)
    stack.build((None, None, D), (None, None, D))
    _randomize(stack)
    x, memory = _normal((B, T, D), 1), _normal((B, S, D), 2)
    poisoned = memory.copy()
    poisoned[0, 5, 0] = np.nan  # padded in SOURCE_MASK
    masks = dict(padding_mask=TARGET_MASK, memory=poisoned, memory_mask=SOURCE_MASK)
    assert not _runs_with_masks(stack.blocks, x, True, **masks)

    def call(encoded):
        return harness.to_numpy(
            stack(x, encoded, decoder_padding_mask=TARGET_MASK, encoder_padding_mask=SOURCE_MASK)
        )

    np.testing.assert_allclose(call(poisoned), call(memory), rtol=TOLERANCE, atol=TOLERANCE)


def test_a_tracing_sees_every_attention_call():
    # The passes stand aside while a tracing is open: each attention layer
    # calls the core, which names its kernel.
    encoder = TransformerEncoderStack(2, 16, 2)
    encoder.build((None, None, D))
    decoder = TransformerDecoderStack(2, 16, 2)
    decoder.build((None, None, D), (None, None, D))
    x, memory = _normal((B, T, D), 1), _normal((B, S, D), 2)
    with kernels.tracing() as taken:
        encoder(x, padding_mask=TARGET_MASK)
        decoder(x, memory, encoder_padding_mask=SOURCE_MASK)
    owners = [owner for owner, _ in taken]
    want = [b.self_attention for b in encoder.blocks]
    for block in decoder.blocks:
        want += [block.self_attention, block.cross_attention]
    assert owners == want
