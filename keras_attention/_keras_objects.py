"""Keras objects given as constructor arguments (initializers, regularizers,
constraints): resolved, serialized and copied in one place.

An argument's name says its kind, as in Keras: `kernel_initializer` is an
initializer, `bias_regularizer` a regularizer, `kernel_constraint` a
constraint.
"""

import keras

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
