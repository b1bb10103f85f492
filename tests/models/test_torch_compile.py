"""`torch.compile` of the layers and models, on torch (the other backends'
compilers, XLA through `jit_compile`, run in every compiled test elsewhere).

Dynamo traces the attention layer and `GPT` whole (`fullgraph=True` raises at
the first graph break), and the compiled calls and gradients equal the eager
ones, non-finite values in masked positions included. A model compiled by
Keras with `jit_compile=True` trains as the eager one does.

Shape legend: `B` batch, `T` length, `D` width, `V` vocabulary size.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention.layers import MultiHeadAttention
from keras_attention.models import GPT

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
    return harness.to_numpy(output), [harness.to_numpy(w.value.grad) for w in weights]


def _assert_compiled_equals_eager(function, weights, *inputs):
    eager, eager_gradients = _value_and_gradients(function, weights, *inputs)
    compiled = torch.compile(function, fullgraph=True)
    got, gradients = _value_and_gradients(compiled, weights, *inputs)
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-5)
    # Inductor sums in another order: gradients that are 0 but for rounding
    # (a bias before a norm) move by 1e-5 of the largest.
    scale = max(np.abs(g).max() for g in eager_gradients)
    for gradient, expected in zip(gradients, eager_gradients):
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


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_gpt_traces_whole(training):
    """The model's call, token-id checks included (skipped while traced, as
    under `jax.jit`), is one graph, and equals the eager call."""
    model = GPT(**CONFIG)
    ids = _ids()
    model(ids)
    harness.randomize_weights(model)
    _assert_compiled_equals_eager(
        lambda x: model(x, training=training), model.trainable_weights, torch.tensor(ids)
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
