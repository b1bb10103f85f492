"""Self-attention: queries, keys and values are linear maps of one sequence.

Shape legend: `B` batch, `T` sequence length, `D` input features, `U` units.
"""

import keras

from keras_attention import _keras_objects
from keras_attention import _signatures
from keras_attention import _validation
from keras_attention import scoring
from keras_attention import masking
from keras_attention._typing import Scorer
from keras_attention._typing import Tensor
from keras_attention.layers.soft_attention import SoftAttention


def _arguments(units: int, score: Scorer = "scaled_dot", dropout: float = 0.0):
    """`SelfAttention`'s own constructor arguments, before those of every
    layer of dense sublayers (`_keras_objects.dense_layer_arguments`)."""


@keras.saving.register_keras_serializable(package="keras_attention")
class SelfAttention(keras.layers.Layer):
    """Single-head self-attention: `softmax(s(X W_q, X W_k)) X W_v`.

    The self-attention model: one input sequence `X` `(B, T, D)` is mapped
    to queries `Q = X W_q`, keys `K = X W_k` and values `V = X W_v`, each
    `(B, T, units)`, and every position attends over all positions (or, with
    `use_causal_mask=True`, over itself and the positions before it). There is
    no output projection; stack `MultiHeadAttention` for the multi-head form.

    Args:
        units: positive int, the size of queries, keys and values.
        score: the scoring function (see `SoftAttention`). Defaults to
            `"scaled_dot"`.
        dropout: float in [0, 1), dropout rate on the attention weights.
        use_bias: bool, whether the projections have biases. Defaults to True.
        kernel_initializer: initializer of the projection kernels.
        bias_initializer: initializer of the projection biases.
        kernel_regularizer: optional regularizer of the projection kernels.
        bias_regularizer: optional regularizer of the projection biases.
        seed: optional int, the seed of the dropout.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: `(B, T, D)`.
        mask: optional `(B, T)` padding mask; filled from the Keras implicit
            mask of `inputs` when not given. Padded positions are neither
            attended to nor attend (their output is 0).
        attention_mask: optional `(B, T, T)` or `(T, T)` mask.
        use_causal_mask: bool, position `t` attends only to `0 .. t`.
        return_attention_scores: bool, also return the weights `(B, T, T)`.
        training: bool, whether dropout is active.

    Returns:
        `(B, T, units)`, or `(output, weights)`.

    Example:

    >>> import numpy as np
    >>> layer = SelfAttention(units=16)
    >>> tuple(layer(np.random.rand(2, 5, 8).astype("float32")).shape)
    (2, 5, 16)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
        - [Cheng et al., 2016](https://arxiv.org/abs/1601.06733)
    """

    @_signatures.takes_arguments_of(
        _keras_objects.dense_layer_arguments, adding=_arguments, before="use_bias"
    )
    def __init__(
        self, units, score, dropout, use_bias, kernel_initializer, bias_initializer,
        kernel_regularizer, bias_regularizer, seed, **kwargs,
    ):
        super().__init__(**kwargs)
        self.units = _validation.check_positive_int("units", units)
        _keras_objects.store_dense_arguments(
            self, use_bias, kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer,
        )
        projection_args = dict(
            units=self.units,
            use_bias=self.use_bias,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            dtype=self.dtype_policy,
        )
        self.query_dense = keras.layers.Dense(name="query_dense", **projection_args)
        self.key_dense = keras.layers.Dense(name="key_dense", **projection_args)
        self.value_dense = keras.layers.Dense(name="value_dense", **projection_args)
        self.attention = SoftAttention(
            score=score,
            dropout=dropout,
            seed=seed,
            dtype=self.dtype_policy,
            name="attention",
        )
        self.supports_masking = True

    @property
    def score(self):
        return self.attention.score

    @property
    def dropout(self):
        return self.attention.dropout

    @property
    def seed(self):
        return self.attention.seed

    def build(self, inputs_shape):
        _validation.check_rank("inputs", inputs_shape, 3)
        for dense in (self.query_dense, self.key_dense, self.value_dense):
            dense.build(inputs_shape)
        projected_shape = tuple(inputs_shape[:-1]) + (self.units,)
        self.attention.build(projected_shape, projected_shape, projected_shape)
        self.built = True

    def call(
        self, inputs: Tensor, mask: Tensor | None = None, attention_mask: Tensor | None = None,
        use_causal_mask: bool = False, return_attention_scores: bool = False,
        training: bool | None = None,
    ):
        _validation.check_rank("inputs", inputs.shape, 3)
        # Checked here so that errors name `mask`, not the `query_mask` and
        # `value_mask` it becomes below.
        mask = _check_mask(mask, inputs.shape)
        query = self.query_dense(inputs)  # (B, T, U)
        key = self.key_dense(inputs)  # (B, T, U)
        value = self.value_dense(inputs)  # (B, T, U)
        # `key_mask` explicit, or Keras would fill it from the mask the key
        # projection carries, and an explicit `mask` could not replace it.
        return self.attention(
            query, value, key=key, query_mask=mask, value_mask=mask, key_mask=mask,
            attention_mask=attention_mask, use_causal_mask=use_causal_mask,
            return_attention_scores=return_attention_scores, training=training,
        )

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape[:-1]) + (self.units,)

    def compute_output_spec(self, inputs, return_attention_scores=False, **kwargs):
        _validation.check_rank("inputs", inputs.shape, 3)
        output = keras.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return output
        length = inputs.shape[1]
        weights = keras.KerasTensor(
            (inputs.shape[0], length, length), dtype=self.compute_dtype
        )
        return output, weights

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "score": scoring.serialize(self.score),
                "dropout": self.dropout,
                **_keras_objects.dense_layer_config(self),
            }
        )
        return config


def _check_mask(mask, inputs_shape):
    """A `(B, T)` boolean or integer padding mask of `inputs`, as boolean."""
    mask = masking.standardize_mask(mask, "mask", ranks=(2,))
    if mask is not None:
        for axis, what in ((0, "batch size"), (1, "length")):
            _validation.check_same_dim(
                "mask", mask.shape[axis], "inputs", inputs_shape[axis], what
            )
    return mask
