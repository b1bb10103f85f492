"""Activations, in one place: the names the package knows beyond Keras's.

`get` resolves a name, a serialized activation or a callable (Keras's names,
plus `"gelu_approximate"`); `serialize` writes the package's own functions as
their names, so configs read well and load in safe mode.
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_attention")
def gelu_approximate(x):
    """GELU with the tanh approximation, as in GPT-2 and BERT's original code.

    `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`. Registered under the
    name `"gelu_approximate"`, so `FeedForward(activation="gelu_approximate")`
    serializes and loads in safe mode.
    """
    return ops.gelu(x, approximate=True)


# Names this module resolves itself, before `keras.activations.get`.
_ACTIVATIONS = {"gelu_approximate": gelu_approximate}


def serialize(activation):
    """An activation as it reads in a config: the package's names as names."""
    for name, function in _ACTIVATIONS.items():
        if activation is function:
            return name  # Reads better in a config than a registered function.
    return keras.activations.serialize(activation)


def get(activation):
    """The activation function for a name, config or callable."""
    if isinstance(activation, str) and activation in _ACTIVATIONS:
        return _ACTIVATIONS[activation]
    try:
        return keras.activations.get(activation)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`activation` must be an activation name (e.g. 'relu', 'gelu', "
            "'gelu_approximate', 'silu'), a serialized activation or a "
            f"callable. Received: activation={activation!r}"
        ) from error
