"""Dot-product scoring: `s(q, k) = q . k` (Luong et al., 2015, "dot")."""

import keras
from keras import ops

from keras_attention import _validation
from keras_attention.scoring.scorer import Scorer


@keras.saving.register_keras_serializable(package="keras_attention")
class DotProduct(Scorer):
    """Dot-product score `s(q, k) = q . k`.

    The "dot" score of Luong et al. (2015). It has no weights, and needs the
    query and key feature sizes to be equal.

    Call arguments:
        query: `(..., T, D)`.
        key: `(..., S, D)`.

    Returns:
        Scores `(..., T, S)`.

    Example:

    >>> import numpy as np
    >>> q = np.ones((1, 2, 3), "float32")
    >>> k = np.ones((1, 4, 3), "float32")
    >>> tuple(DotProduct()(q, k).shape)
    (1, 2, 4)

    References:
        - [Luong et al., 2015](https://arxiv.org/abs/1508.04025)
    """

    def check_shapes(self, query_shape, key_shape):
        super().check_shapes(query_shape, key_shape)
        _validation.check_same_dim(
            "query", query_shape[-1], "key", key_shape[-1], "feature size"
        )

    def call(self, query, key):
        return ops.matmul(query, ops.swapaxes(key, -1, -2))  # (..., T, S)

    def dot_product_scale(self, key_dim):
        return 1.0
