"""Scaled dot-product scoring: `s(q, k) = q . k / sqrt(d_k)` (Vaswani et al.)."""

import math
import numbers
from typing import Any

import keras
from keras import ops

from keras_attention import _docs
from keras_attention import _validation
from keras_attention._typing import Tensor
from keras_attention.scoring.scorer import Scorer


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class ScaledDotProduct(Scorer):
    """Scaled dot-product score `s(q, k) = scale * q . k`.

    With the default `scale=None` the scale is `1 / sqrt(Dk)`, as in
    "Attention Is All You Need": it keeps the variance of the scores near 1
    when `q` and `k` have unit-variance entries, so the softmax does not
    saturate as the head size grows.

    Args:
        scale: optional positive float. Defaults to `1 / sqrt(Dk)`.

    {scorer_call}

    Example:

    >>> import numpy as np
    >>> q = np.ones((1, 2, 4), "float32")
    >>> float(np.asarray(ScaledDotProduct()(q, q))[0, 0, 0])
    2.0

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
    """

    def __init__(self, scale: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, numbers.Real)
            or not scale > 0
        ):
            raise ValueError(
                "`scale` must be None or a positive float. "
                f"Received: scale={scale!r}"
            )
        self.scale = None if scale is None else float(scale)

    def check_shapes(self, query_shape, key_shape):
        super().check_shapes(query_shape, key_shape)
        _validation.check_same_dim(
            "query", query_shape[-1], "key", key_shape[-1], "feature size"
        )

    def call(self, query: Tensor, key: Tensor):
        scale = self.dot_product_scale(key.shape[-1])
        # Scaling the query costs T * D multiplications instead of T * S.
        query = query * ops.cast(scale, query.dtype)
        return ops.matmul(query, ops.swapaxes(key, -1, -2))  # (..., T, S)

    def dot_product_scale(self, key_dim):
        if self.scale is not None:
            return self.scale
        return 1.0 / math.sqrt(int(key_dim))

    def get_config(self):
        config = super().get_config()
        config.update({"scale": self.scale})
        return config
