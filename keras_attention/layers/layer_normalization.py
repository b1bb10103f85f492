"""Layer normalization: Keras's layer, computed in the form XLA runs fastest."""

import keras

from keras_attention import backend
from keras_attention._typing import Tensor
from keras_attention.layers._direct_calls import DirectCalls


@keras.saving.register_keras_serializable(package="keras_attention")
class LayerNormalization(DirectCalls, keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization`, the same arguments, weights and
    outputs (to float rounding), computed over the last axis by
    `backend.layer_norm`: as `(x - mean) / sqrt(variance + epsilon) * gamma +
    beta` on TensorFlow and JAX, and on torch by the kernel Keras's layer
    calls, `F.layer_norm`, without `keras.ops`' per-call conversions.

    Keras folds `gamma` into the inverse deviation and the mean into a
    shift, two tensors of the input's shape that XLA's CPU code writes out
    in the forward and the backward pass; this form keeps them per row.
    The package's blocks and models use this layer; weights move between it
    and Keras's layer as they are (`set_weights`, checkpoints).

    Other axes and the deprecated `rms_scaling` run Keras's computation.
    """

    def call(self, inputs: Tensor):
        last = [len(inputs.shape) - 1]
        axis = [a % len(inputs.shape) for a in self.axis]
        if not self.rms_scaling and axis == last:
            output = backend.layer_norm(inputs, self.gamma, self.beta, self.epsilon)
            return backend.cast(output, self.compute_dtype)
        return super().call(inputs)
