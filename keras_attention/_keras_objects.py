"""Keras objects given as constructor arguments (initializers, regularizers,
constraints): resolved, serialized and copied in one place; and the
arguments of the layers made of dense sublayers, written once.

An argument's name says its kind, as in Keras: `kernel_initializer` is an
initializer, `bias_regularizer` a regularizer, `kernel_constraint` a
constraint.
"""

from typing import Any

import keras

from keras_attention._typing import Initializer
from keras_attention._typing import Regularizer

# The weight arguments of a Keras layer with kernels and biases, by kind.
INITIALIZERS = ("kernel_initializer", "bias_initializer")
REGULARIZERS = ("kernel_regularizer", "bias_regularizer")
CONSTRAINTS = ("kernel_constraint", "bias_constraint")

_MODULES = {
    "initializer": keras.initializers,
    "regularizer": keras.regularizers,
    "constraint": keras.constraints,
}


def _module(name):
    return _MODULES[name.rsplit("_", 1)[-1]]


def store(owner, **arguments):
    """Sets each argument, resolved by its kind's `get`, as the attribute of
    `owner` of the same name."""
    for name, value in arguments.items():
        setattr(owner, name, _module(name).get(value))


def serialize(owner, names):
    """`{name: the attribute serialized}` for each of `names` of `owner`."""
    return {name: _module(name).serialize(getattr(owner, name)) for name in names}


def copy_initializer(initializer):
    """A new initializer of the same class and config (a plain function,
    which holds no state, as it is): so that no two kernels start equal."""
    if isinstance(initializer, keras.initializers.Initializer):
        return initializer.__class__.from_config(initializer.get_config())
    return initializer


def add_scalar_state(owner, name, dtype):
    """A non-trainable scalar weight of `owner` named `name`, starting at 0:
    a step counter or a running value, saved and restored with the weights."""
    return owner.add_weight(
        name=name, shape=(), dtype=dtype, initializer="zeros", trainable=False
    )


def dense_layer_arguments(
    self,
    use_bias: bool = True,
    kernel_initializer: Initializer = "glorot_uniform",
    bias_initializer: Initializer = "zeros",
    kernel_regularizer: Regularizer | None = None,
    bias_regularizer: Regularizer | None = None,
    seed: int | None = None,
    **kwargs: Any,
) -> None:
    """The arguments that the constructor of a layer made of dense sublayers
    (`FeedForward`, `SelfAttention`) ends with: the sublayers' biases,
    initializers and regularizers, the seed of its dropout and the base
    layer's arguments. Such a constructor takes them with
    `_signatures.takes_arguments_of(dense_layer_arguments, adding=...)` and
    keeps them with `store_dense_arguments`."""


def store_dense_arguments(
    owner, use_bias, kernel_initializer, bias_initializer, kernel_regularizer, bias_regularizer
):
    """Sets `owner.use_bias` and the initializers and regularizers of
    `dense_layer_arguments`, resolved, as the attributes of their names."""
    owner.use_bias = bool(use_bias)
    values = (kernel_initializer, bias_initializer, kernel_regularizer, bias_regularizer)
    store(owner, **dict(zip(INITIALIZERS + REGULARIZERS, values)))


def dense_layer_config(owner):
    """The config of `owner`'s `dense_layer_arguments` (but the base
    layer's, which `keras.layers.Layer.get_config` gives)."""
    weights = serialize(owner, INITIALIZERS + REGULARIZERS)
    return {"use_bias": owner.use_bias, "seed": owner.seed, **weights}
