"""Concat scoring without projections: `s(q, k) = c sum_d tanh(a (q_d + k_d))`."""

import keras
from keras import ops

from keras_attention import _validation
from keras_attention.scoring.scorer import Scorer


@keras.saving.register_keras_serializable(package="keras_attention")
class Concat(Scorer):
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
        query: `(..., T, D)`.
        key: `(..., S, D)`.

    Returns:
        Scores `(..., T, S)`.

    Example:

    >>> import numpy as np
    >>> scorer = Concat()
    >>> tuple(scorer(np.ones((2, 3, 4)), np.ones((2, 5, 4))).shape)
    (2, 3, 5)

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
        self.concat_score_weight = self.add_weight(
            name="concat_score_weight", shape=(), initializer="ones"
        )

    def check_shapes(self, query_shape, key_shape):
        super().check_shapes(query_shape, key_shape)
        _validation.check_same_dim(
            "query", query_shape[-1], "key", key_shape[-1], "feature size"
        )

    def call(self, query, key):
        pairs = self.pairwise_sum(query, key)  # (..., T, S, D)
        if self.use_scale:
            pairs = pairs * ops.cast(self.scale, pairs.dtype)
        scores = ops.sum(ops.tanh(pairs), axis=-1)  # (..., T, S)
        return scores * ops.cast(self.concat_score_weight, scores.dtype)

    def get_config(self):
        config = super().get_config()
        config["use_scale"] = self.use_scale
        return config
