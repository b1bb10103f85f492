"""Soft attention: a softmax-weighted average of values.

Shape legend: `B` batch, `T` query length, `S` key/value length, `Dq`, `Dk`,
`Dv` feature sizes of query, key and value.
"""

from typing import Any

import keras

from keras_attention import _docs
from keras_attention import _signatures
from keras_attention import _validation
from keras_attention import scoring
from keras_attention._typing import Scorer
from keras_attention.layers._single_head import SingleHeadAttention
from keras_attention.layers._single_head import call_arguments


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class SoftAttention(SingleHeadAttention):
    """Soft attention: `output = softmax(s(Q, K)) V` with any scorer.

    For each query `q_t` the layer scores every key, `e_ts = s(q_t, k_s)`,
    turns the scores into weights `alpha_ts = softmax_s(e_ts)` and returns the
    weighted sum of the values `o_t = sum_s alpha_ts v_s`.

    Two modes:

    - normal mode (`key=None`): the same sequence `X` serves as keys and
      values, `o_t = sum_s alpha_ts x_s`;
    - key-value mode: keys (what is matched) and values (what is returned)
      are different sequences of the same length.

    Masks are boolean, `True` = may attend (see `keras_attention.masking`).
    Padding masks, an attention mask, a causal mask and Keras implicit masks
    (from `mask_zero=True` embeddings) combine with AND. A query that may
    attend to nothing gets weights and output exactly 0. The query's Keras mask
    propagates to the output; the masks of the input tensors are never changed.

    Args:
        score: the scoring function: `"scaled_dot"` (default), `"dot"`,
            `"additive"`, `"bilinear"`, a `keras_attention.scoring.Scorer`
            instance or a scorer config.
        dropout: float in [0, 1), dropout rate on the attention weights during
            training. Defaults to 0.
        seed: optional int, the seed of the dropout.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        {single_head_call_inputs}
        use_causal_mask: bool, query `t` attends only to keys
            `0 .. S - T + t` (bottom-right aligned when `T != S`).
        return_attention_scores: bool, also return the weights.
        training: bool, whether dropout is active.

    Returns:
        `output` of shape `(B, T, Dv)`, or `(output, weights)` with weights
        `(B, T, S)` when `return_attention_scores=True`.

    Example:

    >>> import numpy as np
    >>> layer = SoftAttention(score="additive")
    >>> query = np.random.rand(2, 3, 8).astype("float32")
    >>> value = np.random.rand(2, 5, 8).astype("float32")
    >>> output, weights = layer(query, value, return_attention_scores=True)
    >>> tuple(output.shape), tuple(weights.shape)
    ((2, 3, 8), (2, 3, 5))

    References:
        - [Bahdanau et al., 2015](https://arxiv.org/abs/1409.0473)
        - [Luong et al., 2015](https://arxiv.org/abs/1508.04025)
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
    """

    def __init__(
        self,
        score: Scorer = "scaled_dot",
        dropout: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.dropout = _validation.check_rate("dropout", dropout)
        self.seed = _validation.check_seed("seed", seed)
        self.score = scoring.get(score, dtype=self.dtype_policy)
        self.seed_generator = (
            keras.random.SeedGenerator(self.seed) if self.dropout > 0 else None
        )
        self.supports_masking = True

    @_signatures.takes_arguments_of(call_arguments)
    def call(self, return_attention_scores, training, **inputs):
        output, weights = self._attend(
            **inputs,
            dropout=self.dropout,
            training=training,
            seed=self.seed_generator,
            return_weights=return_attention_scores,
        )
        if return_attention_scores:
            return output, weights
        return output

    def compute_output_spec(self, *args, **kwargs):
        arguments = self._call_arguments(args, kwargs)
        output, weights = self._output_spec(
            arguments["query"], arguments["value"], arguments["key"],
            1 if arguments["return_attention_scores"] else 0,
        )
        return (output, *weights) if weights else output

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "score": scoring.serialize(self.score),
                "dropout": self.dropout,
                "seed": self.seed,
            }
        )
        return config

