"""Tests of dropout through the backend seam: `backend.dropout` (torch's
own draw, Keras's elsewhere), `backend.all_finite` and the layers' `Dropout`.

Shape legend: `N` rows, `M` columns.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend
from keras_attention.layers._dropout import Dropout

BACKEND = keras.backend.backend()
N, M = 64, 1000


def _draw(rate, seed, shape=(N, M), dtype="float32"):
    return harness.to_numpy(backend.dropout(np.ones(shape, dtype), rate, seed))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_drops_the_rate_and_keeps_the_mean(rate):
    got = _draw(rate, keras.random.SeedGenerator(1))
    kept = got[got != 0]
    # Kept values are scaled by 1 / (1 - rate), as Keras's dropout.
    np.testing.assert_allclose(kept, 1 / (1 - rate), rtol=1e-6)
    assert np.all(kept == kept[0])
    sigma = np.sqrt(rate * (1 - rate) / got.size)
    assert abs(np.mean(got == 0) - rate) < 5 * sigma
    # Every position draws the same law: even and odd columns each drop
    # the rate.
    for half in (got[:, 0::2], got[:, 1::2]):
        assert abs(np.mean(half == 0) - rate) < 5 * sigma * np.sqrt(2)
    assert abs(np.mean(got) - 1) < 5 * np.sqrt(rate / (1 - rate) / got.size)


def test_dropout_is_reproducible_from_the_seed_generator_state():
    first, second = keras.random.SeedGenerator(3), keras.random.SeedGenerator(3)
    a = _draw(0.3, first)
    np.testing.assert_array_equal(a, _draw(0.3, second))  # same seed, same mask
    state = harness.to_numpy(first.state.value)
    b = _draw(0.3, first)
    assert not np.array_equal(a, b)  # the generator advanced
    # A generator restored to a saved state (a resumed run) draws what the
    # uninterrupted one drew next.
    resumed = keras.random.SeedGenerator(99)
    resumed.state.assign(state)
    np.testing.assert_array_equal(_draw(0.3, resumed), b)


def test_dropout_with_an_int_seed_repeats_and_keeps_the_dtype():
    np.testing.assert_array_equal(_draw(0.2, 5, shape=(8, 9)), _draw(0.2, 5, shape=(8, 9)))
    out = backend.dropout(np.ones((8, 9), "float16"), 0.2, keras.random.SeedGenerator(0))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert np.all(np.isin(harness.to_numpy(out), [0, np.float16(1 / 0.8)]))


def test_odd_and_empty_sizes():
    got = _draw(0.5, keras.random.SeedGenerator(2), shape=(3, 5, 7))
    assert got.shape == (3, 5, 7) and set(np.unique(got)) <= {0.0, 2.0}
    assert _draw(0.5, keras.random.SeedGenerator(2), shape=(0, 4)).shape == (0, 4)


def test_all_finite_answers_eagerly_on_torch_only():
    clean = np.ones((2, 3), "float32")
    for poison in (np.nan, np.inf, -np.inf):
        dirty = clean.copy()
        dirty[1, 2] = poison
        tensors = [keras.ops.convert_to_tensor(x) for x in (clean, dirty)]
        got = backend.all_finite(*tensors)
        assert got is (False if BACKEND == "torch" else None)
    got = backend.all_finite(keras.ops.convert_to_tensor(clean), keras.ops.convert_to_tensor(clean))
    assert got is (True if BACKEND == "torch" else None)


def test_dropout_layer_is_keras_dropout_where_the_backend_keeps_keras_draw():
    x = np.random.default_rng(0).normal(size=(4, 6, 8)).astype("float32")
    ours, theirs = Dropout(0.25, seed=7), keras.layers.Dropout(0.25, seed=7)
    np.testing.assert_array_equal(harness.to_numpy(ours(x)), x)  # inference
    got = harness.to_numpy(ours(x, training=True))
    if BACKEND != "torch":
        np.testing.assert_array_equal(got, harness.to_numpy(theirs(x, training=True)))
    kept = got != 0
    np.testing.assert_allclose(got[kept], x[kept] / 0.75, rtol=1e-3)
    # Seeded layers repeat: another layer of the same seed draws the same.
    np.testing.assert_array_equal(
        harness.to_numpy(Dropout(0.25, seed=7)(x, training=True)), got
    )


def test_dropout_layer_with_a_noise_shape_keeps_keras_draw():
    x = np.ones((4, 6, 8), "float32")
    got = harness.to_numpy(Dropout(0.5, noise_shape=(4, 1, 8), seed=1)(x, training=True))
    assert np.all(got == got[:, :1])  # one mask for every row of the axis
