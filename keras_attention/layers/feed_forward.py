"""Position-wise feed-forward network, plain or gated (GLU family).

Shape legend: `B` batch, `T` sequence length, `D` input width, `F`
intermediate width (`intermediate_dim`), `O` output width.
"""

import keras

from keras_attention import _keras_objects
from keras_attention import _signatures
from keras_attention import _validation
from keras_attention import activations
from keras_attention._typing import Activation
from keras_attention._typing import Tensor
from keras_attention.layers import _projection
from keras_attention.layers._direct_calls import DirectCalls
from keras_attention.layers._dropout import Dropout


def _arguments(
    intermediate_dim: int,
    activation: Activation = "relu",
    dropout: float = 0.0,
    gated: bool = False,
    output_dim: int | None = None,
):
    """`FeedForward`'s own constructor arguments, before those of every layer
    of dense sublayers (`_keras_objects.dense_layer_arguments`)."""


@keras.saving.register_keras_serializable(package="keras_attention")
class FeedForward(DirectCalls, keras.layers.Layer):
    """The position-wise feed-forward network of a Transformer block.

    Plain (`gated=False`), equation 2 of "Attention Is All You Need" with a
    chosen activation:

        FFN(x) = act(x W_1 + b_1) W_2 + b_2

    Gated (`gated=True`), the GLU family of Shazeer (2020): the activated
    branch gates a linear one elementwise,

        FFN(x) = (act(x W_gate + b_gate) * (x W_1 + b_1)) W_2 + b_2

    with `activation="sigmoid"` GLU, `"gelu"` GEGLU, `"silu"` SwiGLU (LLaMA)
    and `"relu"` ReGLU. As in LLaMA and KerasHub, `gate_dense` (`W_gate`) is
    the activated branch and `intermediate_dense` (`W_1`) the linear one; in
    the plain network `intermediate_dense` carries the activation. The paper's
    GLU variants have no biases: pass `use_bias=False` for them.

    Dropout acts on the hidden layer `(B, T, F)`, after the activation (after
    the gating product when gated), in training only. The network acts on each
    position alone, so a Keras mask on the inputs passes through unchanged.

    Sublayers (named as their attributes): `intermediate_dense` (`D -> F`),
    `gate_dense` (`D -> F`, only when gated), `output_dense` (`F -> O`) and
    `dropout_layer`.

    Args:
        intermediate_dim: positive int, the hidden width `F`.
        activation: activation name or callable. Defaults to `"relu"` (the
            paper). `"gelu"` is the exact GELU; `"gelu_approximate"` is its
            tanh approximation (GPT-2).
        dropout: float in [0, 1), dropout rate on the hidden layer.
        gated: bool, whether to use the gated (GLU) form.
        output_dim: optional positive int, the output width `O`. Defaults to
            the input width `D`.
        use_bias: bool, whether the dense layers have biases.
        kernel_initializer: as in `keras.layers.Dense`, for every dense layer.
        bias_initializer: as in `keras.layers.Dense`, for every dense layer.
        kernel_regularizer: as in `keras.layers.Dense`, for every dense layer.
        bias_regularizer: as in `keras.layers.Dense`, for every dense layer.
        seed: optional int, the seed of the dropout.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(B, T, D)` (any rank >= 2: the last axis is transformed).
        training: bool, whether dropout is active.

    Returns:
        `(B, T, O)`.

    Example:

    >>> import numpy as np
    >>> x = np.random.rand(2, 5, 16).astype("float32")
    >>> tuple(FeedForward(64)(x).shape)
    (2, 5, 16)
    >>> swiglu = FeedForward(64, activation="silu", gated=True, use_bias=False)
    >>> tuple(swiglu(x).shape)
    (2, 5, 16)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), section 3.3.
        - [Shazeer, 2020](https://arxiv.org/abs/2002.05202)
        - [Hendrycks and Gimpel, 2016 (GELU)](https://arxiv.org/abs/1606.08415)
    """

    @_signatures.takes_arguments_of(
        _keras_objects.dense_layer_arguments, adding=_arguments, before="use_bias"
    )
    def __init__(
        self, intermediate_dim, activation, dropout, gated, output_dim, use_bias,
        kernel_initializer, bias_initializer, kernel_regularizer, bias_regularizer, seed,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.intermediate_dim = _validation.check_positive_int(
            "intermediate_dim", intermediate_dim
        )
        self.activation = activations.get(activation)
        self.dropout = _validation.check_rate("dropout", dropout)
        self.gated = bool(gated)
        self.output_dim = _validation.check_positive_int(
            "output_dim", output_dim, allow_none=True
        )
        _keras_objects.store_dense_arguments(
            self, use_bias, kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer,
        )
        self.seed = _validation.check_seed("seed", seed)
        self.supports_masking = True

    def _dense(self, units, name):
        dense = keras.layers.Dense(
            units,
            use_bias=self.use_bias,
            # Fresh initializer instances, so that no two kernels start equal.
            kernel_initializer=_keras_objects.copy_initializer(self.kernel_initializer),
            bias_initializer=_keras_objects.copy_initializer(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            dtype=self.dtype_policy,
            name=name,
        )
        return dense

    def build(self, inputs_shape):
        if len(inputs_shape) < 2 or inputs_shape[-1] is None:
            raise ValueError(
                "`inputs` must have rank >= 2 and a known last dimension. "
                f"Received: inputs with shape {tuple(inputs_shape)}"
            )
        hidden_shape = tuple(inputs_shape[:-1]) + (self.intermediate_dim,)
        output_dim = self.output_dim or inputs_shape[-1]
        self.intermediate_dense = self._dense(
            self.intermediate_dim, "intermediate_dense"
        )
        self.intermediate_dense.build(inputs_shape)
        if self.gated:
            self.gate_dense = self._dense(self.intermediate_dim, "gate_dense")
            self.gate_dense.build(inputs_shape)
        self.output_dense = self._dense(output_dim, "output_dense")
        self.output_dense.build(hidden_shape)
        self.dropout_layer = Dropout(
            self.dropout,
            seed=self.seed,
            dtype=self.dtype_policy,
            name="dropout_layer",
        )
        self.built = True

    def call(self, inputs: Tensor, training: bool | None = None):
        hidden = _projection.dense_call(self.intermediate_dense, inputs)  # (B, T, F)
        if self.gated:
            gate = self.activation(_projection.dense_call(self.gate_dense, inputs))  # (B, T, F)
            hidden = gate * hidden  # (B, T, F)
        else:
            hidden = self.activation(hidden)  # (B, T, F)
        if self.dropout > 0:  # rate 0 is the identity: no layer call (eager cost)
            hidden = self.dropout_layer(hidden, training=training)
        return _projection.dense_call(self.output_dense, hidden)  # (B, T, O)

    def compute_output_shape(self, inputs_shape):
        output_dim = self.output_dim or inputs_shape[-1]
        return tuple(inputs_shape[:-1]) + (output_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "intermediate_dim": self.intermediate_dim,
                "activation": activations.serialize(self.activation),
                "dropout": self.dropout,
                "gated": self.gated,
                "output_dim": self.output_dim,
                **_keras_objects.dense_layer_config(self),
            }
        )
        return config
