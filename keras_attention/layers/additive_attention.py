"""Bahdanau attention called as `keras.layers.AdditiveAttention` is.

Shape legend: `B` batch, `...` further batch axes, `T` query length, `S`
key/value length, `D` feature size.
"""

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
        dropout: float in [0, 1), dropout on the attention weights during
            training. Defaults to 0.
        seed: optional int, the seed of the dropout.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: a list `[query, value]` or `[query, value, key]`: query
            `(B, ..., T, D)`, value `(B, ..., S, Dv)`, key `(B, ..., S, D)`
            (defaults to `value`).
        mask: optional list `[query_mask, value_mask]` (or with a third,
            `key_mask`): boolean `(B, ..., T)` and `(B, ..., S)`.
        training: bool, whether dropout is active.
        return_attention_scores: bool, also return the attention weights.
        use_causal_mask: bool, query `t` attends only to keys
            `0 .. S - T + t` (bottom-right aligned when `T != S`).

    Returns:
        `output` `(B, ..., T, Dv)`, or `(output, weights)` with weights
        `(B, ..., T, S)` when `return_attention_scores=True`.

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

    def __init__(self, use_scale=True, dropout=0.0, seed=None, **kwargs):
        kwargs.pop("score_mode", None)  # Keras's layer takes and ignores it
        super().__init__(use_scale=use_scale, dropout=dropout, seed=seed, **kwargs)

    def _scorer(self, dtype):
        return scoring.UnprojectedAdditive(use_scale=self.use_scale, dtype=dtype)

    def get_config(self):
        config = super().get_config()
        del config["score_mode"]
        return config
