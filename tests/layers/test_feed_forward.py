"""Tests of `FeedForward`: `W2 act(x W1 + b1) + b2` and its gated forms."""

import math

import keras
import numpy as np
import pytest

import harness
from keras_attention import activations
from keras_attention.layers import FeedForward
from keras_attention.activations import gelu_approximate

BATCH, LENGTH, DIM, HIDDEN = 2, 5, 8, 16


def _inputs(length=LENGTH, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, length, DIM)).astype("float32")


def _save_and_load(model, tmp_path):
    path = str(tmp_path / "model.keras")
    model.save(path)
    return keras.saving.load_model(path, safe_mode=True)


# numpy references.

_erf = np.vectorize(math.erf)

ACTIVATIONS = {
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0))),
    "gelu_approximate": lambda x: 0.5
    * x
    * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


def feed_forward_reference(layer, x):
    """Vaswani et al. eq. 2, or Shazeer (2020) when gated, from the weights."""
    act = ACTIVATIONS[layer.get_config()["activation"]]

    def dense(sublayer, h):
        out = h @ harness.to_numpy(sublayer.kernel)
        if sublayer.use_bias:
            out = out + harness.to_numpy(sublayer.bias)
        return out

    hidden = dense(layer.intermediate_dense, x.astype("float64"))
    if layer.gated:
        hidden = act(dense(layer.gate_dense, x)) * hidden
    else:
        hidden = act(hidden)
    return dense(layer.output_dense, hidden)


def _built(**kwargs):
    """A built layer with random weights, biases included."""
    layer = FeedForward(HIDDEN, **kwargs)
    layer.build((None, None, DIM))
    rng = np.random.default_rng(7)
    for variable in layer.weights:
        variable.assign(rng.normal(size=variable.shape).astype("float32") * 0.5)
    return layer


# Layer harness.


@pytest.mark.parametrize(
    "init_kwargs, expected_width",
    [
        ({"intermediate_dim": HIDDEN}, DIM),
        (
            {
                "intermediate_dim": HIDDEN,
                "activation": "silu",
                "gated": True,
                "use_bias": False,
                "output_dim": 6,
                "dropout": 0.25,
                "seed": 3,
            },
            6,
        ),
        (
            {
                "intermediate_dim": HIDDEN,
                "activation": "gelu_approximate",
                "kernel_regularizer": "l2",
                "bias_initializer": "ones",
            },
            DIM,
        ),
    ],
    ids=["relu", "swiglu", "gelu_approximate"],
)
def test_layer_harness(init_kwargs, expected_width):
    harness.run_layer_test(
        FeedForward,
        init_kwargs,
        inputs={"inputs": _inputs()},
        expected_output_shapes=[(BATCH, LENGTH, expected_width)],
        # The activation does not change what a training step checks; one
        # step fewer saves a JAX compilation.
        run_training_check=init_kwargs.get("activation") != "gelu_approximate",
    )


# Small cases worked by hand and in numpy.


def test_hand_worked_case():
    # x = [1, -2]: W1 = I, b1 = [0, 1] -> relu([1, -1]) = [1, 0];
    # W2 = [[2], [3]], b2 = [0.5] -> 2 * 1 + 3 * 0 + 0.5 = 2.5.
    layer = FeedForward(2, output_dim=1)
    layer.build((None, 2))
    layer.intermediate_dense.kernel.assign(np.eye(2, dtype="float32"))
    layer.intermediate_dense.bias.assign(np.array([0.0, 1.0], "float32"))
    layer.output_dense.kernel.assign(np.array([[2.0], [3.0]], "float32"))
    layer.output_dense.bias.assign(np.array([0.5], "float32"))
    output = layer(np.array([[1.0, -2.0]], "float32"))
    np.testing.assert_allclose(harness.to_numpy(output), [[2.5]])


@pytest.mark.parametrize(
    "activation, gated",
    [
        ("relu", False),
        ("gelu", False),
        ("gelu_approximate", False),
        ("silu", True),  # SwiGLU
        ("gelu", True),  # GEGLU
        ("sigmoid", True),  # GLU
    ],
)
def test_equals_numpy(activation, gated):
    layer = _built(activation=activation, gated=gated)
    x = _inputs()
    np.testing.assert_allclose(
        harness.to_numpy(layer(x)), feed_forward_reference(layer, x), atol=1e-4
    )


def test_gelu_approximate_is_the_tanh_form_and_differs_from_exact_gelu():
    x = np.linspace(-4, 4, 41).astype("float32")
    approximate = harness.to_numpy(gelu_approximate(x))
    np.testing.assert_allclose(
        approximate, ACTIVATIONS["gelu_approximate"](x), atol=1e-6
    )
    assert np.max(np.abs(approximate - ACTIVATIONS["gelu"](x))) > 1e-4


def test_gated_layout():
    """gate_dense is the activated branch, intermediate_dense the linear one."""
    layer = _built(activation="relu", gated=True, use_bias=False)
    assert [w.path.split("/", 1)[1] for w in layer.weights] == [
        "intermediate_dense/kernel",
        "gate_dense/kernel",
        "output_dense/kernel",
    ]
    # A negative gate pre-activation zeroes the hidden unit under relu,
    # whatever the linear branch holds.
    layer.gate_dense.kernel.assign(-np.ones((DIM, HIDDEN), "float32"))
    x = np.ones((1, 1, DIM), "float32")
    np.testing.assert_array_equal(harness.to_numpy(layer(x)), 0.0)
    assert not hasattr(_built(), "gate_dense")


def test_output_dim_and_compute_output_shape():
    layer = FeedForward(HIDDEN, output_dim=3)
    assert layer.compute_output_shape((None, None, DIM)) == (None, None, 3)
    assert FeedForward(HIDDEN).compute_output_shape((4, 7, DIM)) == (4, 7, DIM)
    assert tuple(layer(_inputs()).shape) == (BATCH, LENGTH, 3)
    assert tuple(layer.output_dense.kernel.shape) == (HIDDEN, 3)


# Masking and dropout.


def test_mask_passes_through():
    ids = np.array([[3, 1, 4, 0, 0], [2, 7, 0, 0, 0]], "int32")
    embedded = keras.layers.Embedding(10, DIM, mask_zero=True)(ids)
    output = FeedForward(HIDDEN)(embedded)
    np.testing.assert_array_equal(harness.to_numpy(output._keras_mask), ids != 0)
    # The input's own mask is untouched.
    np.testing.assert_array_equal(harness.to_numpy(embedded._keras_mask), ids != 0)
    # A downstream layer reads it: the mean over real positions only.
    inputs = keras.Input((None,), dtype="int32")
    embedding = keras.layers.Embedding(10, DIM, mask_zero=True)
    layer = FeedForward(HIDDEN)
    hidden = layer(embedding(inputs))
    model = keras.Model(
        inputs, [hidden, keras.layers.GlobalAveragePooling1D()(hidden)]
    )
    hidden, pooled = model.predict(ids, verbose=0)
    expected = [hidden[b][ids[b] != 0].mean(axis=0) for b in range(BATCH)]
    np.testing.assert_allclose(pooled, expected, atol=1e-5)


def test_dropout_only_in_training():
    layer = _built(dropout=0.5, seed=1)
    x = _inputs()
    expected = feed_forward_reference(layer, x)
    for training in (None, False):
        output = harness.to_numpy(layer(x, training=training))
        np.testing.assert_allclose(output, expected, atol=1e-4)
    trained = harness.to_numpy(layer(x, training=True))
    assert not np.allclose(trained, expected, atol=1e-3)
    # Two training calls draw different masks.
    assert not np.allclose(harness.to_numpy(layer(x, training=True)), trained)
    # A rate of 0 changes nothing, even in training.
    no_dropout = _built(dropout=0.0)
    np.testing.assert_allclose(
        harness.to_numpy(no_dropout(x, training=True)), expected, atol=1e-4
    )


# Functional models, saving, configs, mixed precision.


def test_in_a_functional_model_at_several_lengths():
    layer = _built(activation="gelu", gated=True)
    inputs = keras.Input((None, DIM))
    model = keras.Model(inputs, layer(inputs))
    assert tuple(model.output.shape) == (None, None, DIM)
    for length in (3, LENGTH):
        x = _inputs(length)
        np.testing.assert_allclose(
            model.predict(x, verbose=0), feed_forward_reference(layer, x), atol=1e-4
        )


def test_saves_and_loads(tmp_path):
    inputs = keras.Input((None, DIM))
    layer = FeedForward(
        HIDDEN,
        activation="gelu_approximate",
        gated=True,
        dropout=0.1,
        output_dim=4,
        seed=2,
        name="ffn",
    )
    model = keras.Model(inputs, layer(inputs))
    x = _inputs()
    restored = _save_and_load(model, tmp_path)
    np.testing.assert_array_equal(
        harness.to_numpy(restored(x)), harness.to_numpy(model(x))
    )
    restored_layer = restored.get_layer("ffn")
    assert restored_layer.get_config() == layer.get_config()
    assert restored_layer.activation is gelu_approximate
    assert [w.path for w in restored.weights] == [w.path for w in model.weights]


def test_config_round_trip():
    layer = FeedForward(
        HIDDEN,
        activation=keras.activations.gelu,
        dropout=0.3,
        gated=True,
        output_dim=5,
        use_bias=False,
        kernel_initializer="he_normal",
        bias_initializer="ones",
        kernel_regularizer=keras.regularizers.L2(0.01),
        bias_regularizer="l1",
        seed=9,
    )
    harness.check_config_round_trip(layer)
    config = layer.get_config()
    assert config["intermediate_dim"] == HIDDEN
    assert config["activation"] == "gelu"
    assert config["dropout"] == 0.3 and config["gated"] is True
    assert config["output_dim"] == 5 and config["use_bias"] is False
    assert config["kernel_initializer"]["class_name"] == "HeNormal"
    assert config["bias_initializer"]["class_name"] == "Ones"
    assert config["kernel_regularizer"]["config"]["l2"] == pytest.approx(0.01)
    assert config["bias_regularizer"]["class_name"] == "L1"
    assert config["seed"] == 9
    clone = FeedForward.from_config(config)
    # Keras's exact GELU, as the package computes it (`activations.gelu`).
    assert clone.activation is activations.gelu
    assert layer.activation is activations.gelu
    assert FeedForward(HIDDEN, "gelu_approximate").get_config()["activation"] == (
        "gelu_approximate"
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_close_to_float32(policy):
    layer = _built(activation="silu", gated=True)
    mixed = FeedForward(HIDDEN, activation="silu", gated=True, dtype=policy)
    mixed.build((None, None, DIM))
    for source, target in zip(layer.weights, mixed.weights):
        target.assign(source)
    x = _inputs()
    output = mixed(x)
    assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
    expected = harness.to_numpy(layer(x))
    tolerance = 0.05 * np.max(np.abs(expected))
    np.testing.assert_allclose(
        harness.to_numpy(output).astype("float32"), expected, atol=tolerance
    )


# Errors.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"intermediate_dim": 0}, r"`intermediate_dim`.*intermediate_dim=0"),
        ({"intermediate_dim": 2.5}, r"intermediate_dim=2.5"),
        ({"intermediate_dim": True}, r"intermediate_dim=True"),
        ({"intermediate_dim": 4, "dropout": 1.0}, r"`dropout`.*dropout=1.0"),
        ({"intermediate_dim": 4, "dropout": -0.1}, r"dropout=-0.1"),
        ({"intermediate_dim": 4, "output_dim": 0}, r"`output_dim`.*output_dim=0"),
        ({"intermediate_dim": 4, "activation": "nope"}, r"`activation`.*'nope'"),
        ({"intermediate_dim": 4, "seed": "x"}, r"`seed`.*seed='x'"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FeedForward(**kwargs)


def test_rejects_inputs_without_a_known_width():
    with pytest.raises(ValueError, match=r"known last dimension.*\(None, 3, None\)"):
        FeedForward(4)(keras.Input((3, None)))
