"""Tests of `keras_attention.layers.LayerNormalization`: Keras's layer with the
same weights, computed as `(x - mean) / sqrt(variance + epsilon) * gamma +
beta` where the backend runs that form (TensorFlow, JAX), against numpy in
float64 and against `keras.layers.LayerNormalization`, forward and gradients.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend
from keras_attention.layers import LayerNormalization
from keras_attention.layers import RMSNormalization

BACKEND = keras.backend.backend()


def _normal(shape, seed, scale=1.0, shift=0.0):
    return (shift + scale * np.random.default_rng(seed).normal(size=shape)).astype("float32")


def _pair(shape, seed=0, **kwargs):
    """Ours and Keras's layer, built for `shape`, holding the same random
    `gamma` and `beta`."""
    ours = LayerNormalization(**kwargs)
    keras_layer = keras.layers.LayerNormalization(**kwargs)
    for layer in (ours, keras_layer):
        layer.build(shape)
    weights = [_normal(w.shape, seed + 1 + n) for n, w in enumerate(ours.weights)]
    ours.set_weights(weights)
    keras_layer.set_weights(weights)
    return ours, keras_layer


def _reference(x, gamma, beta, epsilon):
    x = x.astype("float64")
    centered = x - x.mean(-1, keepdims=True)
    output = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + epsilon)
    if gamma is not None:
        output = output * gamma
    if beta is not None:
        output = output + beta
    return output


@pytest.mark.parametrize("shape", [(4, 16), (2, 5, 32)], ids=["rank2", "rank3"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"epsilon": 1e-5}, {"center": False}, {"scale": False}],
    ids=["default", "epsilon", "no_beta", "no_gamma"],
)
def test_equals_numpy_and_keras(shape, kwargs):
    # A mean far from zero: the centered form must not lose the variance.
    x = _normal(shape, 7, scale=2.0, shift=30.0)
    ours, keras_layer = _pair(shape, **kwargs)
    got = harness.to_numpy(ours(x))
    gamma = harness.to_numpy(ours.gamma) if ours.gamma is not None else None
    beta = harness.to_numpy(ours.beta) if ours.beta is not None else None
    want = _reference(x, gamma, beta, ours.epsilon)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, harness.to_numpy(keras_layer(x)), rtol=1e-4, atol=1e-4)


def test_gradients_equal_keras():
    shape = (3, 6, 16)
    x = _normal(shape, 11, shift=2.0)
    cotangent = _normal(shape, 12)
    ours, keras_layer = _pair(shape)
    got = harness.input_gradients(lambda t: ours(t), [x], cotangent)[0]
    want = harness.input_gradients(lambda t: keras_layer(t), [x], cotangent)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    weights = keras.ops.convert_to_tensor(cotangent)
    for mine, theirs in zip(
        harness.variable_gradients(
            lambda: keras.ops.sum(ours(x) * weights), ours.trainable_variables
        ),
        harness.variable_gradients(
            lambda: keras.ops.sum(keras_layer(x) * weights), keras_layer.trainable_variables
        ),
    ):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", [False, True])
def test_backend_primitive_against_numpy(weights):
    """Every backend's `layer_norm` (TensorFlow and JAX the centered form,
    torch `F.layer_norm`), with and without `gamma` and `beta`."""
    x = keras.ops.convert_to_tensor(_normal((2, 8), 3))
    gamma = _normal((8,), 4) if weights else None
    beta = _normal((8,), 5) if weights else None
    direct = backend.layer_norm(x, gamma, beta, 1e-3)
    np.testing.assert_allclose(
        harness.to_numpy(direct), _reference(harness.to_numpy(x), gamma, beta, 1e-3),
        rtol=1e-5, atol=1e-5,
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_returns_the_compute_dtype(policy):
    shape = (2, 4, 16)
    x = _normal(shape, 5, shift=3.0)
    ours, keras_layer = _pair(shape, dtype=policy)
    half = keras.ops.cast(x, ours.compute_dtype)
    got = ours(half)
    assert keras.backend.standardize_dtype(got.dtype) == ours.compute_dtype
    tolerance = 2e-2 if policy == "mixed_bfloat16" else 3e-3
    np.testing.assert_allclose(
        harness.to_numpy(keras.ops.cast(got, "float32")),
        harness.to_numpy(keras.ops.cast(keras_layer(half), "float32")),
        rtol=tolerance, atol=tolerance,
    )


def test_other_axes_run_keras_computation():
    """Normalization over the last two axes: Keras's computation, as Keras's
    layer gives it, and numpy's."""
    shape = (2, 6, 8)
    x = _normal(shape, 9, shift=1.0)
    ours, keras_layer = _pair(shape, axis=[1, 2])
    got = harness.to_numpy(ours(x))
    np.testing.assert_allclose(got, harness.to_numpy(keras_layer(x)), rtol=1e-5, atol=1e-5)
    flat = _reference(x.reshape(2, 48), None, None, ours.epsilon).reshape(shape)
    gamma, beta = (harness.to_numpy(w) for w in (ours.gamma, ours.beta))
    np.testing.assert_allclose(got, flat * gamma + beta, rtol=1e-4, atol=1e-4)


def test_config_round_trip_and_keras_weights():
    ours, keras_layer = _pair((2, 8), epsilon=1e-6)
    harness.check_config_round_trip(ours)
    # Weights move between the two layers as they are.
    assert [w.shape for w in ours.weights] == [w.shape for w in keras_layer.weights]
    assert isinstance(ours, keras.layers.LayerNormalization)


def _rms_reference(x, scale, epsilon):
    x = x.astype("float64")
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + epsilon) * scale


def test_rms_primitive_against_numpy():
    """Torch computes RMS normalization in `F.rms_norm` directly; the other
    backends leave it to Keras's computation (None)."""
    x = keras.ops.convert_to_tensor(_normal((2, 3, 8), 6))
    scale = _normal((8,), 7)
    direct = backend.rms_norm(x, scale, 1e-6)
    if BACKEND != "torch":
        assert direct is None
        return
    np.testing.assert_allclose(
        harness.to_numpy(direct), _rms_reference(harness.to_numpy(x), scale, 1e-6),
        rtol=1e-5, atol=1e-5,
    )


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_rms_normalization_equals_keras_layer(policy):
    shape = (2, 4, 16)
    ours = RMSNormalization(epsilon=1e-6, dtype=policy)
    theirs = keras.layers.RMSNormalization(epsilon=1e-6, dtype=policy)
    for layer in (ours, theirs):
        layer.build(shape)
    scale = _normal((16,), 8)
    ours.set_weights([scale])
    theirs.set_weights([scale])
    x = keras.ops.cast(_normal(shape, 9, shift=2.0), ours.compute_dtype)
    got = ours(x)
    assert keras.backend.standardize_dtype(got.dtype) == ours.compute_dtype
    tolerance = {"float32": 1e-5, "mixed_float16": 3e-3, "mixed_bfloat16": 2e-2}[policy]
    np.testing.assert_allclose(
        harness.to_numpy(keras.ops.cast(got, "float32")),
        harness.to_numpy(keras.ops.cast(theirs(x), "float32")),
        rtol=tolerance, atol=tolerance,
    )
    if policy == "float32":
        np.testing.assert_allclose(
            harness.to_numpy(got), _rms_reference(harness.to_numpy(x), scale, 1e-6),
            rtol=1e-5, atol=1e-5,
        )
