"""Learned position embedding: one trained vector per position.

Shape legend: `B` batch, `T` sequence length, `L` table length
(`sequence_length`), `D` model width.
"""

import numbers
from typing import Any

import keras
from keras import ops

from keras_attention import _docs
from keras_attention import _validation
from keras_attention import backend
from keras_attention._typing import Initializer
from keras_attention._typing import IntOrTensor
from keras_attention._typing import Tensor
from keras_attention.layers._direct_calls import DirectCalls
from keras_attention.layers.sinusoidal_position_encoding import PositionOutputs
from keras_attention.layers.sinusoidal_position_encoding import broadcast_rows
from keras_attention.layers.sinusoidal_position_encoding import check_table_inputs


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class PositionEmbedding(DirectCalls, PositionOutputs, keras.layers.Layer):
    """A learned position table `(sequence_length, D)`, as in GPT and BERT.

    The layer holds a trainable table `embeddings` of shape
    `(sequence_length, D)` (`D` is the inputs' last dimension, known at build
    time; `position_embeddings` is the same variable, under KerasHub's
    name) and returns its rows `start_index .. start_index + T - 1` (or the
    rows at `positions`) broadcast to the inputs' shape, in the layer's compute
    dtype; the caller adds them to the embeddings. Rows that are not read get
    no gradient.

    A sequence longer than the table is a `ValueError` when it can be told
    statically (a static length `T > sequence_length`, or a Python
    `start_index` with `start_index + T > sequence_length`; given `positions`
    are not checked). A dynamic length
    beyond the table cannot be checked on every backend: TensorFlow raises at
    run time, JAX clamps the slice (`jax.lax.dynamic_slice`).

    A Keras mask on the inputs passes through to the output. Inputs of rank
    above 3 (`(B, ..., T, D)`, as KerasHub takes them) have their positions
    on the axis before the features.

    Args:
        sequence_length: positive int, the number of positions `L` in the
            table (the longest sequence the layer accepts).
        initializer: initializer of the table. Defaults to
            `"glorot_uniform"`.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        {position_table_call_arguments}

    Returns:
        The position embedding, of the inputs' shape.

    Example:

    >>> layer = PositionEmbedding(sequence_length=16)
    {position_table_example}
    >>> tuple(layer.embeddings.shape)
    (16, 8)

    References:
        - [Radford et al., 2018 (GPT)](https://cdn.openai.com/research-covers/language-unsupervised/language_understanding_paper.pdf)
        - [Devlin et al., 2019 (BERT)](https://arxiv.org/abs/1810.04805)
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), section 3.5
          (learned and sinusoidal positions compared).
    """

    def __init__(
        self,
        sequence_length: int,
        initializer: Initializer = "glorot_uniform",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sequence_length = _validation.check_positive_int(
            "sequence_length", sequence_length
        )
        self.initializer = keras.initializers.get(initializer)
        self.supports_masking = True

    def build(self, inputs_shape):
        self._check_inputs(inputs_shape, 0, None)
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, inputs_shape[-1]),  # (L, D)
            initializer=self.initializer,
            trainable=True,
        )
        self.built = True

    def call(self, inputs: Tensor, start_index: IntOrTensor = 0, positions: Tensor | None = None):
        self._check_inputs(inputs.shape, start_index, positions)
        table = ops.cast(self.embeddings, self.compute_dtype)  # (L, D)
        if positions is not None:
            positions = ops.cast(positions, "int32")
            rows = ops.take(table, positions, axis=0)  # (T, D) or (B, T, D)
        else:
            if isinstance(start_index, numbers.Integral):
                start_index = int(start_index)
            else:
                # One index dtype for tf.slice's packed start vector.
                start_index = ops.cast(start_index, "int32")
            length = ops.shape(inputs)[-2]
            if not isinstance(start_index, int) and backend.compiling():
                # Keras's torch `slice` reads a tensor start back, which
                # `torch.compile` cannot trace: the same rows by index,
                # the start clamped as `jax.lax.dynamic_slice` clamps it.
                start_index = ops.clip(start_index, 0, table.shape[0] - length)
                rows = ops.take(table, start_index + ops.arange(length), axis=0)  # (T, D)
            else:
                rows = ops.slice(
                    table, (start_index, 0), (length, table.shape[-1])
                )  # (T, D)
        return broadcast_rows(rows, inputs)  # (B, ..., T, D)

    @property
    def position_embeddings(self):
        """The table `embeddings`, under the name KerasHub gives it."""
        return self.embeddings

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "sequence_length": self.sequence_length,
                "initializer": keras.initializers.serialize(self.initializer),
            }
        )
        return config

    def _check_inputs(self, inputs_shape, start_index, positions):
        start = check_table_inputs(inputs_shape, start_index, positions)
        if positions is None:
            check_length(inputs_shape[-2], start, self.sequence_length)


def check_length(length, start_index, sequence_length):
    """Raises if `start_index + length` exceeds `sequence_length`, where both
    are known (`start_index` a checked int, or None when traced: then the
    slice of the table is clamped by the backend, inside the table)."""
    if length is None:
        return
    start = 0 if start_index is None else int(start_index)
    if start + length > sequence_length:
        where = f"`start_index` + length: start_index={start_index} + " if start else ""
        raise ValueError(
            f"The sequence is longer than the position table: {where}"
            f"length={length} > sequence_length={sequence_length}. Pass "
            "shorter sequences or build the layer with a larger "
            "`sequence_length`."
        )
