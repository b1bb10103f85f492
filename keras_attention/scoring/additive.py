"""Additive scoring: `s(q, k) = v . tanh(q W_q + k W_k + b)` (Bahdanau et al.)."""

from typing import Any

import keras
from keras import ops

from keras_attention import _docs
from keras_attention import _keras_objects
from keras_attention import _validation
from keras_attention._typing import Initializer
from keras_attention._typing import Regularizer
from keras_attention._typing import Tensor
from keras_attention.scoring.scorer import Scorer


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class Additive(Scorer):
    """Additive (Bahdanau) score `s(q, k) = v . tanh(q W_q + k W_k + b)`.

    A one-hidden-layer network scores each query-key pair: query and key are
    projected to `units` features, added, passed through `tanh`, and reduced
    by the learned vector `v`. Query and key sizes may differ.

    Memory: the hidden activations are `(..., T, S, units)`; this scorer is
    meant for the sequence lengths of classic encoder-decoder models.

    Args:
        units: optional positive int, the hidden size. Defaults to the key
            feature size `Dk`.
        kernel_initializer: initializer of `query_kernel`, `key_kernel` and
            `score_vector`. Defaults to `"glorot_uniform"`.
        bias_initializer: initializer of `bias`. Defaults to `"zeros"`.
        kernel_regularizer: optional regularizer of the kernels.

    Weights:
        query_kernel `(Dq, units)`, key_kernel `(Dk, units)`, bias `(units,)`,
        score_vector `(units,)`.

    {scorer_call}

    Example:

    >>> scorer = Additive(units=8)
    {scorer_example}

    References:
        - [Bahdanau et al., 2015](https://arxiv.org/abs/1409.0473)
    """

    def __init__(
        self,
        units: int | None = None,
        kernel_initializer: Initializer = "glorot_uniform",
        bias_initializer: Initializer = "zeros",
        kernel_regularizer: Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.units = _validation.check_positive_int("units", units, allow_none=True)
        _keras_objects.store(
            self,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
        )

    def build(self, query_shape, key_shape):
        self.check_shapes(query_shape, key_shape)
        units = self.units or key_shape[-1]
        if units is None:
            raise ValueError(
                "`Additive` needs a known key feature size, or `units`. "
                f"Received: key shape {tuple(key_shape)}, units=None"
            )
        kernel_args = dict(
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
        )
        self.query_kernel = self.add_weight(
            name="query_kernel", shape=(query_shape[-1], units), **kernel_args
        )
        self.key_kernel = self.add_weight(
            name="key_kernel", shape=(key_shape[-1], units), **kernel_args
        )
        self.bias = self.add_weight(
            name="bias", shape=(units,), initializer=self.bias_initializer
        )
        self.score_vector = self.add_weight(
            name="score_vector", shape=(units,), **kernel_args
        )

    def call(self, query: Tensor, key: Tensor):
        q = ops.matmul(query, self.query_kernel)  # (..., T, U)
        k = ops.matmul(key, self.key_kernel)  # (..., S, U)
        hidden = ops.tanh(q[..., :, None, :] + k[..., None, :, :] + self.bias)
        return ops.sum(hidden * self.score_vector, axis=-1)  # (..., T, S)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                **_keras_objects.serialize(
                    self, ("kernel_initializer", "bias_initializer", "kernel_regularizer")
                ),
            }
        )
        return config
