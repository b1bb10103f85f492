"""Rotary position embedding (RoPE): positions as rotations of query and key.

Shape legend: `B` batch, `T` sequence length, `H` heads, `D` head size (even),
`D/2` rotated pairs.
"""

import keras
import numpy as np
from keras import ops

from keras_attention import _validation
from keras_attention.layers.sinusoidal_position_encoding import (
    check_positive_number,
    check_start_index_and_positions,
    standardize_positions,
)


@keras.saving.register_keras_serializable(package="keras_attention")
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding (RoFormer), applied to queries or keys.

    Each head vector `x` at position `pos` is split into `D/2` pairs, and pair
    `i` is rotated in its plane by the angle

        theta_i(pos) = pos * max_wavelength ** (-2i / D) / scaling_factor

    Pairs follow the "rotate half" layout of GPT-NeoX, LLaMA and KerasHub:
    dimensions `i` and `i + D/2` form pair `i` (the paper pairs `2i` and
    `2i + 1`; the two layouts differ by a fixed permutation of the weights):

        y[i]       = x[i] cos(theta_i) - x[i + D/2] sin(theta_i)
        y[i + D/2] = x[i + D/2] cos(theta_i) + x[i] sin(theta_i)

    A rotation keeps norms, and rotating `q` at position `m` and `k` at
    position `n` gives `q' . k' = q^T R(n - m) k`: attention scores depend on
    positions only through the offset `n - m`. `scaling_factor > 1` is linear
    position interpolation (positions divided by the factor), for sequences
    longer than those seen in training.

    The rotation is computed in float32; the output has the inputs' dtype
    (the compute dtype, after Keras autocasting). The layer has no weights.

    Args:
        max_wavelength: positive number, the base of the wavelengths (the
            paper's 10000). Defaults to 10000.
        scaling_factor: positive number dividing the positions. Defaults to
            1.0.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(B, T, H, D)` queries or keys, `D` even.
        start_index: int or scalar int tensor, the position of the first
            element (for cached decoding, also inside `ops.while_loop`).
            Defaults to 0.
        positions: optional integer tensor `(T,)` or `(B, T)`, the position of
            each element. Overrides `start_index`.

    Returns:
        The rotated inputs, `(B, T, H, D)`.

    Example:

    >>> import numpy as np
    >>> query = np.random.rand(2, 5, 4, 8).astype("float32")  # (B, T, H, D)
    >>> rotated = RotaryEmbedding()(query)
    >>> tuple(rotated.shape)
    (2, 5, 4, 8)
    >>> bool(np.allclose(np.linalg.norm(np.asarray(rotated), axis=-1),
    ...                  np.linalg.norm(query, axis=-1), atol=1e-5))
    True

    References:
        - [Su et al., 2021 (RoFormer)](https://arxiv.org/abs/2104.09864)
        - [Chen et al., 2023 (position interpolation)](https://arxiv.org/abs/2306.15595)
    """

    def __init__(self, max_wavelength=10000, scaling_factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.max_wavelength = check_positive_number("max_wavelength", max_wavelength)
        self.scaling_factor = check_positive_number("scaling_factor", scaling_factor)
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0, positions=None):
        _check_inputs(inputs.shape, start_index, positions)
        head_dim = inputs.shape[-1]
        positions = standardize_positions(inputs, start_index, positions)
        if len(positions.shape) == 1:
            positions = ops.expand_dims(positions, 0)  # (1, T)
        exponents = np.arange(0, head_dim, 2) / head_dim  # 2i / D
        inverse_frequency = (
            np.power(float(self.max_wavelength), -exponents)
            / float(self.scaling_factor)
        ).astype("float32")
        # On the backend's device: torch will not multiply a GPU tensor by a
        # numpy array.
        inverse_frequency = ops.convert_to_tensor(inverse_frequency)  # (D/2,)
        angles = ops.expand_dims(positions, -1) * inverse_frequency  # (B|1, T, D/2)
        angles = ops.expand_dims(angles, 2)  # (B|1, T, 1, D/2)
        cos, sin = ops.cos(angles), ops.sin(angles)

        x = ops.cast(inputs, "float32")
        x1, x2 = ops.split(x, 2, axis=-1)  # (B, T, H, D/2) each
        rotated = ops.concatenate(
            [x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1
        )  # (B, T, H, D)
        return ops.cast(rotated, inputs.dtype)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def compute_output_spec(self, inputs, start_index=0, positions=None):
        _check_inputs(inputs.shape, start_index, positions)
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor,
            }
        )
        return config


def _check_inputs(inputs_shape, start_index, positions):
    _validation.check_rank("inputs", inputs_shape, 4)
    head_dim = inputs_shape[-1]
    if head_dim is None or head_dim % 2:
        raise ValueError(
            "The last dimension of `inputs` (the head size) must be known and "
            f"even, to split into rotated pairs. Received: inputs with shape "
            f"{tuple(inputs_shape)} (head size {head_dim})"
        )
    check_start_index_and_positions(inputs_shape, start_index, positions)
