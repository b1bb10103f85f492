"""Activations, in one place: the names the package knows beyond Keras's.

`get` resolves a name, a serialized activation or a callable (Keras's names,
plus `"gelu_approximate"`; `"gelu"` is the package's `gelu`, Keras's function
computed where the backend has a faster form); `serialize` writes the
package's own functions as their names, so configs read well and load in
safe mode.
"""

import keras
from keras import ops

from keras_attention import backend


@keras.saving.register_keras_serializable(package="keras_attention")
def gelu(x):
    """The exact GELU, `x Phi(x) = x (1 + erf(x / sqrt(2))) / 2`: Keras's
    `"gelu"` (`approximate=False`), as nanoGPT uses it.

    On JAX in float32 computed in the erf form above (`backend.gelu`), which
    XLA runs faster than `jax.nn.gelu`'s erfc form; otherwise Keras's
    `ops.gelu`. The two agree to about 1e-6. Named `"gelu"` in configs.

    Example:

    >>> import numpy as np
    >>> np.round(np.asarray(gelu(np.array([-1.0, 0.0, 2.0], "float32"))), 4)
    array([-0.1587,  0.    ,  1.9545], dtype=float32)

    References:
        Hendrycks and Gimpel, "Gaussian Error Linear Units (GELUs)", 2016.
    """
    output = backend.gelu(x)
    return ops.gelu(x, approximate=False) if output is None else output


@keras.saving.register_keras_serializable(package="keras_attention")
def gelu_approximate(x):
    """GELU with the tanh approximation, as in GPT-2 and BERT's original code.

    `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`. Registered under the
    name `"gelu_approximate"`, so `FeedForward(activation="gelu_approximate")`
    serializes and loads in safe mode.
    """
    return ops.gelu(x, approximate=True)


# Names this module resolves itself, before `keras.activations.get`.
_ACTIVATIONS = {"gelu": gelu, "gelu_approximate": gelu_approximate}


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
        resolved = keras.activations.get(activation)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`activation` must be an activation name (e.g. 'relu', 'gelu', "
            "'gelu_approximate', 'silu'), a serialized activation or a "
            f"callable. Received: activation={activation!r}"
        ) from error
    # Keras's exact GELU, however it was given (the function, its config):
    # the same function, computed as `gelu` computes it.
    return gelu if resolved is keras.activations.gelu else resolved
