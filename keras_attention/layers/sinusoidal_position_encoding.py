"""Sinusoidal position encoding, the fixed table of "Attention Is All You Need".

Shape legend: `B` batch, `T` sequence length, `D` model width.
"""

import functools
import numbers
from typing import Any

import keras
from keras import ops

from keras_attention import _docs
from keras_attention import _validation
from keras_attention import backend
from keras_attention._typing import IntOrTensor
from keras_attention._typing import Tensor
from keras_attention.layers._direct_calls import DirectCalls


class PositionOutputs:
    """The position layers' output: of the inputs' shape, in the layer's
    compute dtype, once the layer's `_check_inputs(inputs_shape,
    start_index, positions)` has passed."""

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def compute_output_spec(self, inputs, start_index=0, positions=None):
        self._check_inputs(inputs.shape, start_index, positions)
        return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class SinusoidalPositionEncoding(DirectCalls, PositionOutputs, keras.layers.Layer):
    """The fixed sinusoidal position table of Vaswani et al. (section 3.5).

    For position `pos` and feature pair `i` of a width-`D` model:

        PE[pos, 2i]     = sin(pos / max_wavelength ** (2i / D))
        PE[pos, 2i + 1] = cos(pos / max_wavelength ** (2i / D))

    Sines and cosines are interleaved, as in the paper and in KerasHub's
    `SinePositionEncoding` (the two layers agree to float32 rounding). The
    wavelengths form a geometric progression
    from `2 pi` to `max_wavelength * 2 pi`, so `PE[pos + k]` is a linear
    function of `PE[pos]` for any fixed offset `k`. An odd `D` is allowed:
    the last column is then a sine.

    The layer returns the table for positions `start_index .. start_index +
    T - 1` (or the given `positions`) broadcast to the inputs' shape, in the
    layer's compute dtype; the caller adds it to the embeddings. The table is
    computed in float32 and has no weights. A Keras mask on the inputs passes
    through to the output. Inputs of rank above 3 (`(B, ..., T, D)`, as
    KerasHub takes them) have their positions on the axis before the
    features.

    Args:
        max_wavelength: positive number, the longest wavelength over `2 pi`
            (the paper's 10000). Defaults to 10000.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        {position_table_call_arguments}

    Returns:
        The position encoding, of the inputs' shape.

    Example:

    >>> layer = SinusoidalPositionEncoding()
    {position_table_example}
    >>> float(positions[0, 0, 1])  # cos(0)
    1.0

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), section 3.5.
    """

    def __init__(self, max_wavelength: int = 10000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_wavelength = check_positive_number("max_wavelength", max_wavelength)
        self.supports_masking = True
        self.built = True

    def call(self, inputs: Tensor, start_index: IntOrTensor = 0, positions: Tensor | None = None):
        check_table_inputs(inputs.shape, start_index, positions)
        positions = standardize_positions(inputs, start_index, positions, -2)
        table = sinusoidal_table(
            positions, inputs.shape[-1], self.max_wavelength
        )  # (T, D) or (B, T, D)
        table = ops.cast(table, self.compute_dtype)
        return broadcast_rows(table, inputs)  # (B, ..., T, D)

    def _check_inputs(self, inputs_shape, start_index, positions):
        check_table_inputs(inputs_shape, start_index, positions)

    def get_config(self):
        config = super().get_config()
        config.update({"max_wavelength": self.max_wavelength})
        return config


def sinusoidal_table(positions, dim, max_wavelength):
    """The table `PE` of the paper at float32 `positions` `(..., T)`.

    Returns `(..., T, dim)` float32, sines in the even columns and cosines in
    the odd ones.
    """
    frequencies, is_sine = _columns(dim, float(max_wavelength))
    # Tensors on the positions' device: torch will not multiply a GPU tensor
    # by a host array.
    inverse_frequency = backend.constant(frequencies, "float32", positions)  # (D,)
    angles = ops.expand_dims(positions, -1) * inverse_frequency  # (..., T, D)
    is_sine = backend.constant(is_sine, "bool", positions)  # (D,)
    return ops.where(is_sine, ops.sin(angles), ops.cos(angles))  # (..., T, D)


@functools.lru_cache(maxsize=64)
def _columns(dim, max_wavelength):
    """Each column's frequency and whether it is a sine: columns 2i and
    2i + 1 share max_wavelength ** (-2i / D), computed in float64 so that
    only the product with the positions rounds. Python numbers, not numpy
    (`backend.constant`)."""
    frequencies = tuple(max_wavelength ** (-(2 * (column // 2)) / dim) for column in range(dim))
    return frequencies, tuple(column % 2 == 0 for column in range(dim))


def broadcast_rows(rows, inputs):
    """Position rows `(T, D)` or `(B, T, D)` broadcast to `inputs`
    `(B, ..., T, D)`."""
    if len(rows.shape) == 3:
        for _ in range(len(inputs.shape) - 3):
            rows = ops.expand_dims(rows, 1)  # (B, 1, ..., T, D)
    return ops.broadcast_to(rows, ops.shape(inputs))


def standardize_positions(inputs, start_index, positions, sequence_axis=1):
    """Float32 positions `(T,)` or `(B, T)` for inputs whose `sequence_axis`
    has length `T` (`(B, T, ...)` by default)."""
    if positions is not None:
        return ops.cast(positions, "float32")
    length = inputs.shape[sequence_axis]
    if isinstance(start_index, numbers.Integral) and length is not None:
        # A known start and length (eagerly, or a literal start): one call.
        return ops.arange(start_index, start_index + length, dtype="float32")  # (T,)
    positions = ops.arange(ops.shape(inputs)[sequence_axis], dtype="float32")  # (T,)
    return positions + ops.cast(start_index, "float32")


def check_start_index_and_positions(inputs_shape, start_index, positions, sequence_axis=1):
    """Checks `start_index` and the rank and length of `positions` (the
    length of the inputs' `sequence_axis`, their batch size on axis 0).

    `start_index` is a Python int, a numpy integer or a scalar integer
    tensor, at least 0 whenever its value is known (eagerly); returns that
    value, or None when it is not known (traced).
    """
    start = _validation.check_integer("start_index", start_index, minimum=0)
    if positions is None:
        return start
    shape = tuple(positions.shape)
    if len(shape) not in (1, 2):
        raise ValueError(
            "`positions` must have shape (length,) or (batch, length). "
            f"Received: positions with shape {shape}"
        )
    _validation.check_same_dim(
        "positions", shape[-1], "inputs", inputs_shape[sequence_axis], "length"
    )
    if len(shape) == 2:
        _validation.check_same_dim(
            "positions", shape[0], "inputs", inputs_shape[0], "batch size"
        )
    return start


def check_positive_number(name, value):
    """Returns `value` if it is a positive real number, else raises."""
    if not _validation.is_positive_number(value):
        raise ValueError(
            f"`{name}` must be a positive number. Received: {name}={value!r}"
        )
    # Python numbers, so that configs stay JSON (numpy ints are not).
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_table_inputs(inputs_shape, start_index, positions):
    """Checks the inputs of a position table: rank 3 or more (positions on
    the axis before the features), a known width; returns `start_index`'s
    value where known."""
    _validation.check_rank("inputs", inputs_shape, max(len(inputs_shape), 3))
    if inputs_shape[-1] is None:
        raise ValueError(
            "The last dimension of `inputs` must be known. Received: inputs "
            f"with shape {tuple(inputs_shape)}"
        )
    return check_start_index_and_positions(inputs_shape, start_index, positions, -2)

