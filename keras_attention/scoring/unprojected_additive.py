"""Additive scoring without projections: `s(q, k) = sum_d v_d tanh(q_d + k_d)`."""

from typing import Any

import keras
from keras import ops

from keras_attention._typing import Tensor
from keras_attention.scoring.scorer import FeatureWiseScorer


@keras.saving.register_keras_serializable(package="keras_attention")
class UnprojectedAdditive(FeatureWiseScorer):
    """Additive score without projections: `s(q, k) = sum_d v_d tanh(q_d + k_d)`.

    The score of `keras.layers.AdditiveAttention`: Bahdanau et al.'s
    `v . tanh(W_q q + W_k k)` with the projections left out, so query and
    key must have the same size `D` (project them beforehand if they should
    be learned). `v` is a learned vector of size `D` (weight `scale`,
    initialized Glorot-uniform) when `use_scale=True`, else all ones.
    `keras_attention.scoring.Additive` is the form with projections.

    Memory: the hidden activations are `(..., T, S, D)`; meant for short
    sequences.

    Args:
        use_scale: bool, the learned vector `v`. Defaults to True, as in
            Keras.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        query: queries `(..., T, D)`.
        key: keys `(..., S, D)`, of the queries' size.

    Returns:
        Additive scores `(..., T, S)`.

    Example:

    >>> import numpy as np
    >>> queries, keys = np.ones((2, 3, 4)), np.ones((2, 5, 4))
    >>> scores = UnprojectedAdditive(use_scale=False)(queries, keys)
    >>> tuple(scores.shape), round(float(scores[0, 0, 0]), 4)  # 4 tanh(2)
    ((2, 3, 5), 3.8561)

    References:
        - [Bahdanau et al., 2015](https://arxiv.org/abs/1409.0473)
    """

    scale_initializer = "glorot_uniform"

    def __init__(self, use_scale: bool = True, **kwargs: Any) -> None:
        super().__init__(use_scale=use_scale, **kwargs)

    def scale_shape(self, dim):
        return (dim,)

    def call(self, query: Tensor, key: Tensor):
        hidden = ops.tanh(self.pairwise_sum(query, key))  # (..., T, S, D)
        return ops.sum(self.scaled(hidden), axis=-1)  # (..., T, S)
