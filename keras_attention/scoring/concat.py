"""Concat scoring without projections: `s(q, k) = c sum_d tanh(a (q_d + k_d))`."""

import keras
from keras import ops

from keras_attention._typing import Tensor
from keras_attention.scoring.scorer import FeatureWiseScorer


@keras.saving.register_keras_serializable(package="keras_attention")
class Concat(FeatureWiseScorer):
    """Keras's `"concat"` score: `s(q, k) = c * sum_d tanh(a * (q_d + k_d))`.

    The score of `keras.layers.Attention(score_mode="concat")`: query and key
    are added feature by feature (no projections, so their sizes must be
    equal), passed through `tanh` and summed. `c` is a learned scalar (weight
    `concat_score_weight`, initialized to 1); `a` is a learned scalar too
    (weight `scale`, initialized to 1) when `use_scale=True`, else 1. Luong et
    al. (2015) name "concat" the score `v . tanh(W [q; k])`, which is
    `keras_attention.scoring.Additive`; this one is its form without weights
    on the features.

    Memory: the sums are `(..., T, S, D)`; meant for short sequences.

    Args:
        use_scale: bool, a learned scale `a` inside the `tanh`. Defaults to
            False.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        query: `(..., T, D)`, each query added to every key.
        key: `(..., S, D)`, of the query's size.

    Returns:
        The summed `tanh`s, `(..., T, S)`.

    Example:

    >>> import keras, numpy as np
    >>> query = np.zeros((1, 1, 2), "float32")
    >>> key = np.ones((1, 3, 2), "float32")
    >>> scores = Concat()(query, key)  # (1, 1, 3)
    >>> round(float(keras.ops.convert_to_numpy(scores)[0, 0, 2]), 4)  # 2 tanh(1)
    1.5232

    References:
        - [Luong et al., 2015](https://arxiv.org/abs/1508.04025)
    """

    def build(self, query_shape, key_shape):
        super().build(query_shape, key_shape)
        self.concat_score_weight = self.add_weight(
            name="concat_score_weight", shape=(), initializer="ones"
        )

    def call(self, query: Tensor, key: Tensor):
        hidden = ops.tanh(self.scaled(self.pairwise_sum(query, key)))  # (..., T, S, D)
        scores = ops.sum(hidden, axis=-1)  # (..., T, S)
        return scores * ops.cast(self.concat_score_weight, scores.dtype)
