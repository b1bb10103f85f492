"""Dropout whose mask comes from the backend seam (`backend.dropout`).

Shape legend: any shape; the mask has the shape of the input.
"""

import keras

from keras_attention import backend
from keras_attention.layers._direct_calls import DirectCalls


@keras.saving.register_keras_serializable(package="keras_attention")
class Dropout(DirectCalls, keras.layers.Dropout):
    """`keras.layers.Dropout`, drawing its mask through `backend.dropout`.

    The same layer, arguments and distribution: `inputs / (1 - rate)` kept
    with probability `1 - rate`, else 0, in training only. On TensorFlow and
    JAX it computes what `keras.layers.Dropout` computes; on torch the mask
    is drawn in fewer and cheaper operations (`backend/torch.py`), always
    from the layer's own `SeedGenerator`, which advances once per call as
    Keras's seeded dropout does. A `noise_shape` keeps Keras's own draw.

    Args:
        rate: float in [0, 1], the fraction of the inputs to drop.
        noise_shape: optional shape of the mask, broadcast to the inputs.
        seed: optional int, the seed of the mask.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: a tensor of any shape.
        training: bool, whether dropout is active.

    Returns:
        A tensor of the shape and dtype of `inputs`.

    Example:

    >>> import numpy as np
    >>> layer = Dropout(0.5, seed=1)
    >>> x = np.ones((2, 4), "float32")
    >>> bool(np.all(np.asarray(layer(x)) == 1))
    True
    >>> np.unique(keras.ops.convert_to_numpy(layer(x, training=True))).tolist()
    [0.0, 2.0]

    References:
        - [Srivastava et al., 2014](https://jmlr.org/papers/v15/srivastava14a.html)
    """

    def call(self, inputs, training=False):
        if training and self.rate > 0 and self.noise_shape is None:
            return backend.dropout(inputs, self.rate, self.seed_generator)
        return super().call(inputs, training=training)
