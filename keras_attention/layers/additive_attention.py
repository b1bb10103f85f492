"""Bahdanau attention called as `keras.layers.AdditiveAttention` is.

Shape legend: `B` batch, `...` further batch axes, `T` query length, `S`
key/value length, `D` feature size.
"""

from typing import Any

import keras

from keras_attention import scoring
from keras_attention.layers.attention import Attention


@keras.saving.register_keras_serializable(package="keras_attention")
class AdditiveAttention(Attention):
    """Additive (Bahdanau) attention with the arguments and call of
    `keras.layers.AdditiveAttention`.

    Scores `e_ts = sum_d v_d tanh(q_td + k_sd)`, with `v` a learned vector
    (weight `scale`) when `use_scale=True` (the default), else all ones
    (`keras_attention.scoring.UnprojectedAdditive`); then a softmax over the
    keys and the weighted sum of the values. Query and key are not projected,
    so they must have the same size; for Bahdanau et al.'s learned
    projections use `SoftAttention(score="additive")`.

    Called as `Attention` is (a list of inputs, a list of masks, inputs of
    any rank `>= 3`), with the package's rules: boolean masks, a query that
    may attend to nothing gives weights and output exactly 0, softmax in
    float32 under mixed precision.

    Args:
        use_scale: bool, the learned vector `v`. Defaults to True.
        dropout, seed: the dropout on the weights, as `Attention`'s.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        inputs, mask, training, return_attention_scores, use_causal_mask:
            as `Attention`'s: `[query, value]` or `[query, value, key]` of
            rank 3 or more, and a list of their boolean masks.

    Returns:
        The attended values, of the query's shape but for the value's
        width, and the weights `(B, ..., T, S)` after them when
        `return_attention_scores=True`.

    Example:

    >>> import numpy as np
    >>> layer = AdditiveAttention()
    >>> query = np.random.rand(2, 3, 4).astype("float32")
    >>> value = np.random.rand(2, 5, 4).astype("float32")
    >>> tuple(layer([query, value]).shape)
    (2, 3, 4)

    References:
        - [Bahdanau et al., 2015](https://arxiv.org/abs/1409.0473)
    """

    def __init__(
        self,
        use_scale: bool = True,
        dropout: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("score_mode", None)  # Keras's layer takes and ignores it
        super().__init__(use_scale=use_scale, dropout=dropout, seed=seed, **kwargs)

    def _scorer(self, dtype):
        return scoring.UnprojectedAdditive(use_scale=self.use_scale, dtype=dtype)

    def get_config(self):
        config = super().get_config()
        del config["score_mode"]
        return config
