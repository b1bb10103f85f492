"""Dot-product scoring: `s(q, k) = q . k` (Luong et al., 2015, "dot")."""

import keras
from keras import ops

from keras_attention import _validation
from keras_attention.scoring.scorer import Scorer


@keras.saving.register_keras_serializable(package="keras_attention")
class DotProduct(Scorer):
    """Dot-product score `s(q, k) = q . k`, or `a q . k` with a learned `a`.

    The "dot" score of Luong et al. (2015). It needs the query and key
    feature sizes to be equal. Without `use_scale` it has no weights; with
    it, one learned scalar `a` (weight `scale`, initialized to 1) multiplies
    the scores, as `keras.layers.Attention(use_scale=True)` does.

    Args:
        use_scale: bool, a learned scalar scale of the scores. Defaults to
            False.
        **kwargs: base `keras.layers.Layer` arguments.

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

    def __init__(self, use_scale=False, **kwargs):
        super().__init__(**kwargs)
        self.use_scale = _validation.check_bool("use_scale", use_scale)

    def build(self, query_shape, key_shape):
        self.check_shapes(query_shape, key_shape)
        self.scale = None
        if self.use_scale:
            self.scale = self.add_weight(name="scale", shape=(), initializer="ones")

    def check_shapes(self, query_shape, key_shape):
        super().check_shapes(query_shape, key_shape)
        _validation.check_same_dim(
            "query", query_shape[-1], "key", key_shape[-1], "feature size"
        )

    def call(self, query, key):
        scores = ops.matmul(query, ops.swapaxes(key, -1, -2))  # (..., T, S)
        if self.use_scale:
            scores = scores * ops.cast(self.scale, scores.dtype)
        return scores

    def dot_product_scale(self, key_dim):
        # A learned scale is a tensor, which the fused kernels do not take.
        return None if self.use_scale else 1.0

    def get_config(self):
        config = super().get_config()
        config["use_scale"] = self.use_scale
        return config
