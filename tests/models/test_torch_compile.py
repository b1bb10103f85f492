"""`torch.compile` of the layers and models, on torch (the other backends'
compilers, XLA through `jit_compile`, run in every compiled test elsewhere).

Dynamo traces the attention layer and the models whole (`fullgraph=True`
raises at the first graph break), and the compiled calls and gradients equal
the eager ones, non-finite values in masked positions included. A model compiled by
Keras with `jit_compile=True` trains as the eager one does.

Shape legend: `B` batch, `T` length, `D` width, `V` vocabulary size.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention.layers import MultiHeadAttention
from keras_attention.models import BertMaskedLM
from keras_attention.models import GPT
from keras_attention.models import Seq2SeqTransformer

if keras.backend.backend() != "torch":
    pytest.skip("torch.compile is torch's compiler", allow_module_level=True)

import torch  # noqa: E402

B, T, D, V = 2, 8, 16, 23
CONFIG = dict(
    vocabulary_size=V,
    max_sequence_length=T,
    num_layers=1,
    num_heads=2,
    hidden_dim=D,
    intermediate_dim=32,
)


def _normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _ids(seed=0):
    return np.random.default_rng(seed).integers(1, V, (B, T)).astype("int32")


def _value_and_gradients(function, weights, *inputs):
    """`function(*inputs)` and the gradients of its sum over `weights`."""
    for weight in weights:
        weight.value.grad = None
    output = function(*inputs)
    output.sum().backward()
    gradients = [w.value.grad for w in weights]  # None: a weight the output does not read
    return harness.to_numpy(output), [g if g is None else harness.to_numpy(g) for g in gradients]


def _assert_compiled_equals_eager(function, weights, *inputs):
    eager, eager_gradients = _value_and_gradients(function, weights, *inputs)
    compiled = torch.compile(function, fullgraph=True)
    got, gradients = _value_and_gradients(compiled, weights, *inputs)
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-5)
    # Inductor sums in another order: gradients that are 0 but for rounding
    # (a bias before a norm) move by 1e-5 of the largest.
    assert [g is None for g in gradients] == [g is None for g in eager_gradients]
    scale = max(np.abs(g).max() for g in eager_gradients if g is not None)
    for gradient, expected in zip(gradients, eager_gradients):
        if expected is None:
            continue
        np.testing.assert_allclose(gradient, expected, rtol=1e-4, atol=1e-5 * scale)
    return got


def test_attention_with_masks_and_nonfinite_keys_traces_whole():
    """Causal self-attention over padded rows, with NaN and inf in the
    padding: the compiled call takes the guarded computation (no `cond`
    for Dynamo to break at) and gives the eager output, finite, and the
    eager gradients."""
    layer = MultiHeadAttention(num_heads=2, key_dim=4)
    x = _normal((B, T, D))
    padding = np.ones((B, T), bool)
    padding[0, 5:] = False
    padding[1, 7] = False
    layer(x, x, value_mask=padding, use_causal_mask=True)
    x[0, 6] = np.nan
    x[1, 7, 1] = np.inf
    inputs = torch.tensor(x), torch.tensor(padding)

    def call(x, padding):
        output = layer(x, x, value_mask=padding, use_causal_mask=True)
        return torch.where(padding[..., None], output, 0.0)  # the rows that may see a key

    got = _assert_compiled_equals_eager(call, layer.trainable_weights, *inputs)
    assert np.all(np.isfinite(got))
    # The clean rows agree with the call on clean inputs: nothing leaked.
    clean = harness.to_numpy(call(torch.tensor(np.nan_to_num(x, posinf=0.0)), inputs[1]))
    np.testing.assert_allclose(got[0, :5], clean[0, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1, :7], clean[1, :7], rtol=1e-5, atol=1e-5)


def _gpt():
    return GPT(**CONFIG), _ids()


def _llama():
    model = GPT(
        **CONFIG, activation="silu", num_key_value_heads=1, use_bias=False,
        normalization="rms_norm", positions="rotary", gated_feedforward=True,
        tie_weights=False,
    )
    return model, _ids()


def _bert():
    model = BertMaskedLM(V, num_layers=1, num_heads=2, hidden_dim=D, intermediate_dim=32,
                         dropout=0.0, max_sequence_length=T)
    padding = np.ones((B, T), bool)
    padding[1, 6:] = False
    inputs = {
        "token_ids": _ids(),
        "segment_ids": np.repeat([[0] * 4 + [1] * 4], B, axis=0).astype("int32"),
        "padding_mask": padding,
        "mask_positions": np.array([[1, 3, 6], [0, 2, 5]], "int32"),
    }
    return model, inputs


def _seq2seq():
    model = Seq2SeqTransformer(V, V, T, T, num_encoder_layers=1, num_decoder_layers=1,
                               num_heads=2, hidden_dim=D, intermediate_dim=32, dropout=0.0)
    source = _ids(1)
    source[1, 5:] = 0  # padding
    return model, {"encoder_token_ids": source, "decoder_token_ids": _ids(2)[:, :5]}


@pytest.mark.parametrize(
    "build, training",
    [(_gpt, False), (_gpt, True), (_llama, True), (_bert, True), (_seq2seq, True)],
    ids=["gpt-inference", "gpt", "llama", "bert", "seq2seq"],
)
def test_models_trace_whole(build, training):
    """Each model's call, input checks included (skipped while traced, as
    under `jax.jit`), its position tables (learned, rotary, sinusoidal),
    norms, grouped heads and masks, is one graph and equals the eager call."""
    model, inputs = build()
    model(inputs)
    harness.randomize_weights(model)
    inputs = keras.tree.map_structure(torch.tensor, inputs)
    _assert_compiled_equals_eager(
        lambda x: model(x, training=training), model.trainable_weights, inputs
    )


def test_jit_compiled_fit_trains_as_eager():
    """`compile(jit_compile=True)` (Keras wraps the step in `torch.compile`)
    takes the same steps as the eager model from the same weights."""
    losses = {}
    for jit_compile in (False, True):
        keras.utils.set_random_seed(3)
        model = GPT(**CONFIG)
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        losses[jit_compile] = [
            float(model.train_on_batch(_ids(0), _ids(1))) for _ in range(3)
        ]
    assert losses[True][2] < losses[True][0]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


def _compiled_twin(model, inputs):
    """A model of `model`'s config and weights (built on `inputs`), compiled
    with `jit_compile=True`."""
    twin = model.__class__.from_config(model.get_config())
    twin(inputs)
    twin.set_weights(model.get_weights())
    twin.compile(jit_compile=True)
    return twin


@pytest.mark.parametrize(
    "build, options",
    [
        (_gpt, dict(sampling="greedy")),
        (_gpt, dict(sampling="top_k", top_k=5, seed=4)),
        (_llama, dict(sampling="beam", num_beams=3)),
        (_seq2seq, dict(sampling="greedy")),
    ],
    ids=["gpt-greedy", "gpt-top-k", "llama-beam", "seq2seq-greedy"],
)
def test_jit_compiled_models_generate_as_eager(build, options):
    """`compile(jit_compile=True)`: torch decodes one token at a time through
    the compiled step, the whole step one graph (no graph break), and
    returns the eager model's tokens and scores."""
    model, inputs = build()
    model(inputs)
    harness.randomize_weights(model)
    twin = _compiled_twin(model, inputs)
    if isinstance(model, GPT):
        padding = np.ones((B, 5), bool)
        padding[1, 3:] = False  # ragged prompts
        prompt = (_ids()[:, :5],)
        arguments = dict(max_new_tokens=T - 5, prompt_padding_mask=padding, **options)
    else:
        prompt = (inputs["encoder_token_ids"], T - 1)
        arguments = dict(start_token_id=1, **options)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    expected, expected_scores = model.generate(*prompt, return_scores=True, **arguments)
    assert not counters["stats"]  # eagerly, nothing compiled
    got, scores = twin.generate(*prompt, return_scores=True, **arguments)
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)
