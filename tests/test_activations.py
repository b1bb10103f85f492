"""Tests of `keras_attention.activations`: the exact GELU the package computes
for `"gelu"` (the erf form on JAX, Keras's `ops.gelu` elsewhere) against
numpy's `math.erf` in float64, its derivative against the hand-worked one,
Keras's function, the names configs use, and which backends take the form.
"""

import math

import keras
import numpy as np
import pytest

import harness
from keras_attention import activations
from keras_attention import backend
from keras_attention.layers import FeedForward

BACKEND = keras.backend.backend()

_erf = np.vectorize(math.erf)


def _gelu(x):
    x = np.asarray(x, "float64")
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_derivative(x):
    # d/dx x Phi(x) = Phi(x) + x phi(x).
    x = np.asarray(x, "float64")
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x**2) / math.sqrt(
        2.0 * math.pi
    )


X = np.linspace(-9.0, 9.0, 3601).astype("float32")


def test_gelu_equals_numpy_and_keras():
    got = harness.to_numpy(activations.gelu(keras.ops.convert_to_tensor(X)))
    np.testing.assert_allclose(got, _gelu(X), rtol=0, atol=2e-6)
    keras_gelu = harness.to_numpy(keras.activations.gelu(keras.ops.convert_to_tensor(X)))
    np.testing.assert_allclose(got, keras_gelu, rtol=0, atol=2e-6)
    # Relative accuracy down to x = -1 (below it `1 + erf` cancels, as in
    # torch's kernel: the absolute error stays under 2e-6 above).
    kept = (X > -1.0) & (np.abs(X) > 0.1)
    np.testing.assert_allclose(got[kept], _gelu(X)[kept], rtol=2e-6, atol=0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "compiled"])
def test_gelu_derivative_equals_hand_worked(jit):
    cotangent = np.ones_like(X)
    got = harness.input_gradients(activations.gelu, [X], cotangent, jit=jit)[0]
    np.testing.assert_allclose(got, _gelu_derivative(X), rtol=0, atol=5e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gelu_keeps_half_precision(dtype):
    x = keras.ops.cast(keras.ops.convert_to_tensor(X[::40] / 2), dtype)
    got = activations.gelu(x)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    tolerance = 2e-2 if dtype == "bfloat16" else 3e-3
    np.testing.assert_allclose(
        harness.to_numpy(keras.ops.cast(got, "float32")),
        _gelu(harness.to_numpy(keras.ops.cast(x, "float32"))),
        rtol=tolerance, atol=tolerance,
    )


@pytest.mark.parametrize("dtype, low", [("float16", -4.0), ("bfloat16", -6.0)])
def test_gelu_negative_tail_in_half_precision(dtype, low):
    """Below x = -2, `1 + erf` in half precision cancels to 0 (and in
    float32 below x = -5, which bfloat16 still holds): the tail must be no
    worse than Keras's own `ops.gelu` at that dtype. `low` keeps float16's
    values above its subnormals."""
    x = keras.ops.cast(keras.ops.convert_to_tensor(np.linspace(low, -2.0, 201)), dtype)
    exact = _gelu(harness.to_numpy(keras.ops.cast(x, "float32")))

    def worst(y):
        y = harness.to_numpy(keras.ops.cast(y, "float32")).astype("float64")
        return np.max(np.abs(y - exact) / np.abs(exact))

    ours, keras_own = worst(activations.gelu(x)), worst(keras.ops.gelu(x, approximate=False))
    rounding = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    assert ours <= max(2 * rounding, keras_own), (ours, keras_own)


def test_gelu_is_the_name_in_configs():
    assert activations.get("gelu") is activations.gelu
    assert activations.get(keras.activations.serialize(keras.activations.gelu)) is activations.gelu
    assert activations.serialize(activations.gelu) == "gelu"
    layer = FeedForward(16, activation="gelu")
    assert layer.get_config()["activation"] == "gelu"
    restored = FeedForward.from_config(layer.get_config())
    assert restored.activation is activations.gelu
    # Keras's function, passed as it is, gets the package's; Keras's own
    # lookup is untouched.
    assert activations.get(keras.activations.gelu) is activations.gelu
    assert keras.activations.get("gelu") is keras.activations.gelu


def test_erf_form_runs_where_declared():
    """JAX computes `x (1 + erf(x / sqrt 2)) / 2` in float32 (its
    `jax.nn.gelu` takes erfc); TensorFlow and torch, and other dtypes, hand
    the call to Keras's `ops.gelu`."""
    x = keras.ops.convert_to_tensor(X[::100])
    direct = backend.gelu(x)
    assert (direct is None) == (BACKEND != "jax")
    for dtype in ("float16", "bfloat16"):
        assert backend.gelu(keras.ops.cast(x, dtype)) is None
    if BACKEND == "jax":
        import jax

        np.testing.assert_allclose(harness.to_numpy(direct), _gelu(X[::100]), atol=2e-6)
        primitives = {
            equation.primitive.name for equation in jax.make_jaxpr(activations.gelu)(x).eqns
        }
        assert "erf" in primitives and "erfc" not in primitives
