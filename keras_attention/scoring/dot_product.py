"""Dot-product scoring: `s(q, k) = q . k` (Luong et al., 2015, "dot")."""

import keras
from keras import ops

from keras_attention import _docs
from keras_attention._typing import Tensor
from keras_attention.scoring.scorer import FeatureWiseScorer


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class DotProduct(FeatureWiseScorer):
    """Dot-product score `s(q, k) = q . k`, or `a q . k` with a learned `a`.

    The "dot" score of Luong et al. (2015). It needs the query and key
    feature sizes to be equal. Without `use_scale` it has no weights; with
    it, one learned scalar `a` (weight `scale`, initialized to 1) multiplies
    the scores, as `keras.layers.Attention(use_scale=True)` does.

    Args:
        use_scale: bool, a learned scalar scale of the scores. Defaults to
            False.
        **kwargs: base `keras.layers.Layer` arguments.

    {scorer_call}

    Example:

    >>> import numpy as np
    >>> q = np.ones((1, 2, 3), "float32")
    >>> k = np.ones((1, 4, 3), "float32")
    >>> tuple(DotProduct()(q, k).shape)
    (1, 2, 4)

    References:
        - [Luong et al., 2015](https://arxiv.org/abs/1508.04025)
    """

    def call(self, query: Tensor, key: Tensor):
        return self.scaled(ops.matmul(query, ops.swapaxes(key, -1, -2)))  # (..., T, S)

    def dot_product_scale(self, key_dim):
        # A learned scale is a tensor, which the fused kernels do not take.
        return None if self.use_scale else 1.0
