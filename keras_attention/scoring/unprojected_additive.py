"""Additive scoring without projections: `s(q, k) = sum_d v_d tanh(q_d + k_d)`."""

import keras
from keras import ops

from keras_attention import _validation
from keras_attention.scoring.scorer import Scorer


@keras.saving.register_keras_serializable(package="keras_attention")
class UnprojectedAdditive(Scorer):
    """Additive score without projections: `s(q, k) = sum_d v_d tanh(q_d + k_d)`.

    The score of `keras.layers.AdditiveAttention`: Bahdanau et al.'s
    `v . tanh(W_q q + W_k k)` with the projections left out, so query and
    key must have the same size `D` (project them beforehand if they should
    be learned). `v` is a learned vector of size `D` (weight `scale`,
    initialized Glorot-uniform) when `use_scale=True`, else all ones.
    `keras_attention.scoring.Additive` is the form with projections.

    Memory: the sums are `(..., T, S, D)`; meant for short sequences.

    Args:
        use_scale: bool, the learned vector `v`. Defaults to True.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        query: `(..., T, D)`.
        key: `(..., S, D)`.

    Returns:
        Scores `(..., T, S)`.

    Example:

    >>> import numpy as np
    >>> scorer = UnprojectedAdditive()
    >>> tuple(scorer(np.ones((2, 3, 4)), np.ones((2, 5, 4))).shape)
    (2, 3, 5)

    References:
        - [Bahdanau et al., 2015](https://arxiv.org/abs/1409.0473)
    """

    def __init__(self, use_scale=True, **kwargs):
        super().__init__(**kwargs)
        self.use_scale = _validation.check_bool("use_scale", use_scale)

    def build(self, query_shape, key_shape):
        self.check_shapes(query_shape, key_shape)
        self.scale = None
        if self.use_scale:
            self.scale = self.add_weight(
                name="scale", shape=(query_shape[-1],), initializer="glorot_uniform"
            )

    def check_shapes(self, query_shape, key_shape):
        super().check_shapes(query_shape, key_shape)
        _validation.check_same_dim(
            "query", query_shape[-1], "key", key_shape[-1], "feature size"
        )

    def call(self, query, key):
        hidden = ops.tanh(self.pairwise_sum(query, key))  # (..., T, S, D)
        if self.use_scale:
            hidden = hidden * ops.cast(self.scale, hidden.dtype)
        return ops.sum(hidden, axis=-1)  # (..., T, S)

    def get_config(self):
        config = super().get_config()
        config["use_scale"] = self.use_scale
        return config
