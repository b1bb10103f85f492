"""Bilinear scoring: `s(q, k) = q W k^T` (Luong et al., "general")."""

from typing import Any

import keras
from keras import ops

from keras_attention import _docs
from keras_attention import _keras_objects
from keras_attention._typing import Initializer
from keras_attention._typing import Regularizer
from keras_attention._typing import Tensor
from keras_attention.scoring.scorer import Scorer


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class Bilinear(Scorer):
    """Bilinear score `s(q, k) = q W k^T`, Luong's "general" score.

    A learned matrix `W` of shape `(Dq, Dk)` relates query and key features,
    so their sizes may differ. With `W = I` it is the dot product.

    Args:
        kernel_initializer: initializer of `kernel`. Defaults to
            `"glorot_uniform"`.
        kernel_regularizer: optional regularizer of `kernel`.

    Weights:
        kernel `(Dq, Dk)`.

    {scorer_call}

    Example:

    >>> scorer = Bilinear()
    {scorer_example}

    References:
        - [Luong et al., 2015](https://arxiv.org/abs/1508.04025)
    """

    def __init__(
        self,
        kernel_initializer: Initializer = "glorot_uniform",
        kernel_regularizer: Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _keras_objects.store(
            self,
            kernel_initializer=kernel_initializer,
            kernel_regularizer=kernel_regularizer,
        )

    def build(self, query_shape, key_shape):
        self.check_shapes(query_shape, key_shape)
        self.kernel = self.add_weight(
            name="kernel",
            shape=(query_shape[-1], key_shape[-1]),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
        )

    def call(self, query: Tensor, key: Tensor):
        projected = ops.matmul(query, self.kernel)  # (..., T, Dk)
        return ops.matmul(projected, ops.swapaxes(key, -1, -2))  # (..., T, S)

    def get_config(self):
        config = super().get_config()
        config.update(
            _keras_objects.serialize(self, ("kernel_initializer", "kernel_regularizer"))
        )
        return config
