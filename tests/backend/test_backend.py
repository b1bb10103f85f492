"""Tests of the backend seam: its primitives against numpy, the compiled
decoding loop, and the backends' preferences.

Shape legend: `B` batch, `D` width.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend

BACKEND = keras.backend.backend()
D = 8


def _normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _argmax_cases():
    x = _normal((7, 37), 4)
    x[1, [3, 20]] = 9.0  # a tie: the first
    x[2, [5, 30]] = np.nan  # NaN counts as the largest: the first NaN
    x[2, 1] = 50.0
    x[3, :] = -np.inf  # nothing but -inf: the first
    x[4, 36] = np.inf  # the last position
    x[5, 0] = np.nan  # NaN first
    x[6, :] = 2.5  # all equal
    return x


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_argmax_is_the_first_largest_with_nan_as_largest(compiled):
    x = _argmax_cases()
    argmax = backend.argmax
    if compiled:
        argmax = backend.compiled_loop(argmax)
    got = keras.ops.convert_to_numpy(argmax(keras.ops.convert_to_tensor(x)))
    # numpy's argmax: the first largest, NaN the largest.
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    # Keras's on the rows without NaN (TensorFlow's skips NaN).
    finite = ~np.isnan(x).any(axis=-1)
    expected = keras.ops.convert_to_numpy(keras.ops.argmax(x[finite], axis=-1))
    np.testing.assert_array_equal(got[finite], expected)


@pytest.mark.parametrize("rows", [3, 300], ids=["small", "large"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_linear_equals_numpy_with_gradients(rows, with_bias):
    """`backend.linear` against numpy, forward and every gradient."""
    x, kernel, bias = _normal((2, rows, 64), 1), _normal((64, 256), 2), _normal((256,), 3)
    inputs = [x, kernel] + ([bias] if with_bias else [])

    def fn(x, kernel, bias=None):
        x, kernel = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(kernel)
        bias = None if bias is None else keras.ops.convert_to_tensor(bias)
        return backend.linear(x, kernel, bias)

    want = x @ kernel + (bias if with_bias else 0)
    np.testing.assert_allclose(harness.to_numpy(fn(*inputs)), want, rtol=1e-4, atol=1e-4)
    cotangent = _normal(want.shape, 4)
    got = harness.input_gradients(fn, inputs, cotangent)
    np.testing.assert_allclose(got[0], cotangent @ kernel.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        got[1], np.einsum("btk,btn->kn", x, cotangent), rtol=1e-4, atol=1e-3
    )
    if with_bias:
        np.testing.assert_allclose(got[2], cotangent.sum((0, 1)), rtol=1e-4, atol=1e-4)


def test_one_row_linear_without_bias_in_a_compiled_loop():
    """A bias-free product of one row in a compiled loop (a decoding step)
    equals numpy's, non-finite kernel entries included. On TensorFlow XLA
    runs it fused with the zero bias the backend adds (an output fusion
    instead of a library product, which made LLaMA's decoding 1.3 to 1.5
    times as slow: benchmarks/gpt_speed.py --sections llama)."""
    x, kernel = _normal((1, 1, D)), _normal((D, 2 * D), 1)
    kernel[0, 1], kernel[0, 2], kernel[3, 4] = np.inf, np.nan, -np.inf

    def loop(x, kernel):
        def step(i, y):
            row = x * keras.ops.cast(i + 1, x.dtype)  # (1, 1, D), a new row each step
            return y + backend.linear(row, kernel, None)

        return backend.fori_loop(0, 3, step, keras.ops.zeros((1, 1, 2 * D)))

    compiled = backend.compiled_loop(loop)
    x, kernel = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(kernel)
    got = harness.to_numpy(compiled(x, kernel))
    want = 6 * (harness.to_numpy(x) @ harness.to_numpy(kernel))  # (1 + 2 + 3) x @ kernel
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    if BACKEND == "tensorflow":
        hlo = compiled.experimental_get_compiler_ir(x, kernel)(stage="optimized_hlo")
        assert "kind=kOutput" in hlo
        # The zero bias adds nothing to the gradients (a training step of one row).
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def gradients(x, kernel):
            with tf.GradientTape() as tape:
                tape.watch([x, kernel])
                y = backend.linear(x, kernel, None)
            return tape.gradient(y, [x, kernel])

        x, kernel = _normal((1, 1, D), 2), _normal((D, 2 * D), 3)
        d_x, d_kernel = (harness.to_numpy(g) for g in gradients(x, kernel))
        ones = np.ones((1, 1, 2 * D), "float32")
        np.testing.assert_allclose(d_x, ones @ kernel.T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(d_kernel, x[0].T @ ones[0], rtol=1e-5, atol=1e-5)


def test_compiled_decoding_computes_the_loop():
    """`compile_decoding` computes the loop as written, on the first call
    (trace and compile) and on those after it (what was kept; on
    TensorFlow its concrete function)."""
    x, w = _normal((4, 64)), _normal((64, 48), 1)

    def loop(x, w):
        product = keras.ops.matmul(x, w)
        return keras.ops.tanh(product), keras.ops.sum(product, axis=1)

    compiled = backend.compile_decoding(loop, [])
    for _ in range(2):
        got, sums = (keras.ops.convert_to_numpy(y) for y in compiled(x, w))
        np.testing.assert_allclose(got, np.tanh(x @ w), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sums, (x @ w).sum(axis=1), rtol=1e-4, atol=1e-4)


def test_run_once_reads_the_variables_and_keeps_what_it_assigns():
    """`run_once` computes the function with the variables' current values
    and leaves each variable it assigns holding the assigned value, the
    others untouched, as an eager call would (on JAX: one compiled call)."""
    x = _normal((4, 8))
    kernel = keras.Variable(_normal((8, 3), 1))
    counter = keras.Variable(np.float32(2.0))
    untouched = keras.Variable(_normal((3,), 2))

    def function():
        counter.assign(counter * 3.0)
        return keras.ops.matmul(x, kernel) + untouched, counter + 1.0

    product, count = backend.run_once(function, [kernel, counter, untouched])
    expected = x @ harness.to_numpy(kernel) + harness.to_numpy(untouched)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(product), expected, rtol=1e-5, atol=1e-5)
    assert float(keras.ops.convert_to_numpy(count)) == 7.0  # read after the assignment
    assert float(keras.ops.convert_to_numpy(counter)) == 6.0
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(untouched), _normal((3,), 2))
    # The next call reads the value the first one left.
    backend.run_once(function, [kernel, counter, untouched])
    assert float(keras.ops.convert_to_numpy(counter)) == 18.0


def test_preferences_are_declared_per_backend():
    preferences = backend.preferences()
    assert isinstance(preferences, backend.Preferences)
    assert preferences.blocked in ("always", "never")
    expected = {"tensorflow": "always", "jax": "always", "torch": "never"}
    assert preferences.blocked == expected[BACKEND]
    assert preferences.linear_projections
    assert not preferences.fuse_projections  # an option; no backend's default


def _translation_model(seed, **kwargs):
    """A small built `Seq2SeqTransformer` (two decoder blocks) with weights
    drawn from `seed`."""
    from keras_attention.models import Seq2SeqTransformer

    model = Seq2SeqTransformer(
        13, 11, 8, 8, num_encoder_layers=1, num_decoder_layers=2, num_heads=2,
        hidden_dim=D, intermediate_dim=16, dropout=0.0, **kwargs,
    )
    model.build()
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        variable.assign(0.5 * rng.normal(size=variable.shape).astype("float32"))
    return model


def test_decoding_reads_weights_that_change_after_the_loop_compiled():
    """A loop compiled at the first call decodes with whatever weights a
    later call finds: assigned ones, then the first ones again, each equal to
    greedy decoding by recomputation; the configuration's loop is reused."""
    model = _translation_model(3)
    first = [keras.ops.convert_to_numpy(v) for v in model.weights]
    source = np.array([[3, 4, 5, 6, 7]], "int32")
    before = model.generate(source, 5, start_token_id=1)
    np.testing.assert_array_equal(before, _greedy_by_recomputation(model, source, 5, 1))
    (loop,) = _loops(model)
    np.testing.assert_array_equal(model.generate(source, 5, start_token_id=1), before)

    rng = np.random.default_rng(11)
    for variable in model.weights:
        variable.assign(0.5 * rng.normal(size=variable.shape).astype("float32"))
    after = model.generate(source, 5, start_token_id=1)
    np.testing.assert_array_equal(after, _greedy_by_recomputation(model, source, 5, 1))
    assert not np.array_equal(after, before)
    assert _loops(model) == [loop]  # the same configuration's loop

    for variable, value in zip(model.weights, first):
        variable.assign(value)
    np.testing.assert_array_equal(model.generate(source, 5, start_token_id=1), before)


def _greedy_by_recomputation(model, source, new_tokens, start):
    """Greedy decoding by the full forward pass over the whole target at
    every step (no cache, no compiled loop)."""
    tokens = np.full((source.shape[0], 1), start, "int32")
    for _ in range(new_tokens):
        logits = model({"encoder_token_ids": source, "decoder_token_ids": tokens})
        best = np.argmax(keras.ops.convert_to_numpy(logits)[:, -1], axis=-1)
        tokens = np.concatenate([tokens, best[:, None].astype("int32")], axis=1)
    return tokens


def _loops(model):
    """The model's compiled decoding loops, in the order they were made."""
    return list(model._get_generator()._functions.values())


def test_cast_returns_a_tensor_already_in_the_dtype_and_casts_otherwise():
    x = keras.ops.convert_to_tensor(np.array([1.5, -2.25], "float32"))
    assert backend.cast(x, "float32") is x
    half = backend.cast(x, "float16")
    assert keras.backend.standardize_dtype(half.dtype) == "float16"
    np.testing.assert_array_equal(harness.to_numpy(half), np.array([1.5, -2.25], "float16"))


def test_constant_holds_the_numbers_in_the_dtype_beside_the_tensor_given():
    like = keras.ops.convert_to_tensor(np.zeros(3, "float32"))
    values = (1.0 / 3.0, 2.0**-20, 1e10)
    got = backend.constant(values, "float32", like)
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    # Rounded once, from the float64 numbers, as numpy rounds them.
    np.testing.assert_array_equal(harness.to_numpy(got), np.asarray(values, "float32"))
    flags = backend.constant((True, False), "bool", like)
    np.testing.assert_array_equal(harness.to_numpy(flags), [True, False])
    if BACKEND == "torch":
        assert got.device == like.device
    assert backend.compiling() is False  # eagerly; tests/models/test_torch_compile.py traces
