"""RMS normalization: Keras's layer, called directly while a model decodes."""

import keras

from keras_attention import backend
from keras_attention._typing import Tensor
from keras_attention.layers._direct_calls import DirectCalls


@keras.saving.register_keras_serializable(package="keras_attention")
class RMSNormalization(DirectCalls, keras.layers.RMSNormalization):
    """`keras.layers.RMSNormalization`, the same arguments, weights and
    computation, called through its own `call` while a model decodes eagerly
    (`layers/_direct_calls.py`), as the package's other layers are: Keras's
    per-call wrapper costs more than a decoding step's norm on torch.
    Position-wise, so it carries a padding mask over (Keras's layer warns
    on every masked call that it "destroys the mask"). Over the last axis
    the backend's `rms_norm` runs it where it has one (torch: Keras's
    kernel without the per-call conversions around it).
    """

    def call(self, x: Tensor):
        if [a % len(x.shape) for a in self.axis] == [len(x.shape) - 1]:
            output = backend.rms_norm(x, self.scale, self.epsilon)
            if output is not None:
                return backend.cast(output, self.compute_dtype)
        return super().call(x)

    def compute_mask(self, inputs, mask=None):
        return mask
