"""Rotary position embedding (RoPE): positions as rotations of query and key.

Shape legend: `B` batch, `T` sequence length, `H` heads, `D` head size (even),
`D/2` rotated pairs; `...` further axes (heads).
"""

import math
import numbers
from typing import Any

import keras
from keras import ops

from keras_attention import _docs
from keras_attention import backend
from keras_attention import _validation
from keras_attention._typing import IntOrTensor
from keras_attention._typing import Tensor
from keras_attention.layers import _direct_calls
from keras_attention.layers._direct_calls import DirectCalls
from keras_attention.layers.sinusoidal_position_encoding import (
    PositionOutputs,
    check_positive_number,
    check_start_index_and_positions,
    standardize_positions,
)


ROPE_TYPES = ("linear", "dynamic", "yarn")


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class RotaryEmbedding(DirectCalls, PositionOutputs, keras.layers.Layer):
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
    positions only through the offset `n - m`.

    Longer contexts than those seen in training (`rope_type`, with
    `scaling_factor = s > 1`), as in KerasHub:

    - `"linear"` (default): position interpolation, every frequency divided
      by `s` (Chen et al., 2023);
    - `"dynamic"`: frequencies divided by `s ** (D / (D - 2))` (NTK-aware);
    - `"yarn"`: YaRN (Peng et al., 2023), the high frequencies kept, the low
      ones interpolated, a linear ramp between the dimensions that turn
      `beta_fast` and `beta_slow` times over `original_max_position_embeddings`
      positions; `cos` and `sin` scaled by `0.1 ln(s) + 1`.

    The frequencies are computed in float64 with numpy, the rotation in
    float32; the output has the layer's compute dtype (the dtype policy's,
    so `mixed_float16` gives float16). The layer has no weights.

    Args:
        max_wavelength: positive number, the base of the wavelengths (the
            paper's 10000). Defaults to 10000.
        scaling_factor: positive number, the context extension factor `s`.
            Defaults to 1.0.
        rope_type: `"linear"` (default), `"dynamic"` or `"yarn"`.
        beta_fast: positive number, YaRN's fast boundary. Defaults to 32.
        beta_slow: positive number, YaRN's slow boundary. Defaults to 1.
        original_max_position_embeddings: positive int, YaRN's training
            context length. Defaults to 4096.
        truncate: bool, whether YaRN rounds its ramp's ends to whole
            dimensions. Defaults to True.
        sequence_axis: int, the axis of the positions. Defaults to 1.
        feature_axis: int, the axis rotated (its size `D` even). Defaults
            to -1.
        denominator_dim: optional positive int used instead of `D` in the
            exponent `2i / D` (for models that rotate part of each head).
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: queries or keys of rank 3 or more, batch on axis 0:
            `(B, T, H, D)` or `(B, T, D)` with the default axes.
        {position_call_arguments}

    Returns:
        The rotated inputs, of the inputs' shape.

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
        - [Peng et al., 2023 (YaRN)](https://arxiv.org/abs/2309.00071)
    """

    def __init__(
        self,
        max_wavelength: int = 10000,
        scaling_factor: float = 1.0,
        rope_type: str = "linear",
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        original_max_position_embeddings: int = 4096,
        truncate: bool = True,
        sequence_axis: int = 1,
        feature_axis: int = -1,
        denominator_dim: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.max_wavelength = check_positive_number("max_wavelength", max_wavelength)
        self.scaling_factor = check_positive_number("scaling_factor", scaling_factor)
        self.rope_type = _check_rope_type(rope_type)
        self.beta_fast = check_positive_number("beta_fast", beta_fast)
        self.beta_slow = check_positive_number("beta_slow", beta_slow)
        self.original_max_position_embeddings = _validation.check_positive_int(
            "original_max_position_embeddings", original_max_position_embeddings
        )
        self.truncate = _validation.check_bool("truncate", truncate)
        for name, axis in (("sequence_axis", sequence_axis), ("feature_axis", feature_axis)):
            setattr(self, name, _check_axis(name, axis))
        self.denominator_dim = _validation.check_positive_int(
            "denominator_dim", denominator_dim, allow_none=True
        )
        self.supports_masking = True
        self.built = True

    def call(self, inputs: Tensor, start_index: IntOrTensor = 0, positions: Tensor | None = None):
        sequence_axis, feature_axis = self._check_inputs(
            inputs.shape, start_index, positions
        )
        rank = len(inputs.shape)
        moved = (sequence_axis, feature_axis) != (1, rank - 1)
        x = inputs
        if moved:
            x = ops.moveaxis(x, (sequence_axis, feature_axis), (1, -1))  # (B, T, ..., D)
        # Tensor indexing and operators rather than `keras.ops` calls where
        # they do the same: eagerly (torch's decoding loop) each `keras.ops`
        # call costs more than this rotation's arithmetic. Full-width `cos`
        # (`[cos, cos]`) and `sin` (`[-sin, sin]`) rotate every pair in one
        # product with the halves of `x` swapped.
        cos, sin = self._cos_sin(x, start_index, positions)  # (B|1, T, 1, .., D) each
        x = backend.cast(x, "float32")
        half = x.shape[-1] // 2
        swapped = ops.concatenate([x[..., half:], x[..., :half]], axis=-1)  # (B, T, ..., D)
        rotated = x * cos + swapped * sin  # (B, T, ..., D)
        if moved:
            rotated = ops.moveaxis(rotated, (1, -1), (sequence_axis, feature_axis))
        return backend.cast(rotated, self.compute_dtype)

    def _cos_sin(self, x, start_index, positions):
        """`[cos, cos]` and `[-sin, sin]` of the angles of the positions of
        `x` `(B, T, ..., D)`: `(B|1, T, 1, .., D)` each.

        Inside a decoding loop (`_direct_calls.inference()`), a known start
        slices them from those of positions `0 .. n`, computed once for the
        loop (its steps ask for one more position each) and shared by the
        loop's rotary embeddings of one configuration (every block's).
        """
        memo = _direct_calls.memo(self._memo_key())
        if memo is None or positions is not None or type(start_index) is not int:
            return self._angles(standardize_positions(x, start_index, positions), x)
        end = start_index + x.shape[1]
        key = (x.shape[-1], len(x.shape))
        known, table = memo.get(key, (0, None))
        if known < end:
            known = max(end, 2 * known)
            table = self._angles(ops.arange(known, dtype="float32"), x)
            memo[key] = known, table
        return tuple(t[:, start_index:end] for t in table)

    def _memo_key(self):
        """What the angles depend on: the configuration, or for a subclass,
        which may compute them from more, the layer itself."""
        if type(self) is not RotaryEmbedding:
            return id(self)
        return (
            RotaryEmbedding, self.max_wavelength, self.scaling_factor, self.rope_type,
            self.beta_fast, self.beta_slow, self.original_max_position_embeddings,
            self.truncate, self.denominator_dim,
        )

    def _angles(self, positions, x):
        """`[cos, cos]` and `[-sin, sin]` of the angles of float32
        `positions` `(T,)` or `(B, T)`, broadcastable to `x` `(B, T, ..., D)`:
        `(B|1, T, 1, .., D)` each."""
        if len(positions.shape) == 1:
            positions = positions[None]  # (1, T)
        # On the inputs' device: torch will not multiply a GPU tensor by a
        # host array.
        inverse_frequency = backend.constant(
            tuple(self._inverse_frequency(x.shape[-1])), "float32", x
        )  # (D/2,)
        angles = positions[..., None] * inverse_frequency  # (B|1, T, D/2)
        cos, sin = ops.cos(angles), ops.sin(angles)
        if self.rope_type == "yarn":
            factor = 0.1 * math.log(self.scaling_factor) + 1.0
            cos, sin = cos * factor, sin * factor
        cos = ops.concatenate([cos, cos], axis=-1)  # (B|1, T, D)
        sin = ops.concatenate([-sin, sin], axis=-1)
        expand = (slice(None), slice(None)) + (None,) * (len(x.shape) - 3)
        return cos[expand], sin[expand]  # (B|1, T, 1, .., D)

    def _inverse_frequency(self, head_dim):
        """The `D/2` angular frequencies, Python floats (float64; not numpy,
        `backend.constant`)."""
        denominator = self.denominator_dim or head_dim
        base = float(self.max_wavelength)
        inverse = [base ** -(column / denominator) for column in range(0, head_dim, 2)]
        scale = float(self.scaling_factor)
        if self.rope_type == "linear":
            return [frequency / scale for frequency in inverse]
        if self.rope_type == "dynamic":
            scale = scale ** (head_dim / max(1, head_dim - 2))
            return [frequency / scale for frequency in inverse]
        return self._yarn_inverse_frequency(head_dim)

    def _yarn_inverse_frequency(self, head_dim):
        """YaRN's frequencies (Peng et al., 2023, section 3.2)."""
        base = float(self.max_wavelength)

        def dimension(rotations):
            # The dimension whose wavelength fits `rotations` turns into the
            # training context.
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(base))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0.0), min(high, head_dim - 1.0)
        scale = float(self.scaling_factor)
        frequencies = []
        for index in range(head_dim // 2):
            extrapolated = base ** -(2 * index / head_dim)
            interpolated = extrapolated / scale
            ramp = min(max((index - low) / max(high - low, 0.001), 0.0), 1.0)
            frequencies.append(interpolated * ramp + extrapolated * (1.0 - ramp))
        return frequencies

    def _check_inputs(self, inputs_shape, start_index, positions):
        """Checks the inputs; returns the sequence and feature axes, >= 0."""
        rank = len(inputs_shape)
        _validation.check_rank("inputs", inputs_shape, max(rank, 3))
        axes = []
        for name in ("sequence_axis", "feature_axis"):
            axis = getattr(self, name)
            if not -rank < axis < rank or axis % rank == 0:
                raise ValueError(
                    f"`{name}` must name an axis of the inputs other than the "
                    f"batch axis 0. Received: {name}={axis} for inputs of rank {rank}"
                )
            axes.append(axis % rank)
        if axes[0] == axes[1]:
            raise ValueError(
                "`sequence_axis` and `feature_axis` must differ. Received: "
                f"sequence_axis={self.sequence_axis}, feature_axis={self.feature_axis}"
            )
        moved = [d for i, d in enumerate(inputs_shape) if i not in axes]
        moved = moved[:1] + [inputs_shape[axes[0]]] + moved[1:] + [inputs_shape[axes[1]]]
        _check_inputs(moved, start_index, positions)
        return tuple(axes)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor,
                "rope_type": self.rope_type,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "original_max_position_embeddings": (
                    self.original_max_position_embeddings
                ),
                "truncate": self.truncate,
                "sequence_axis": self.sequence_axis,
                "feature_axis": self.feature_axis,
                "denominator_dim": self.denominator_dim,
            }
        )
        return config


def _check_rope_type(rope_type):
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"`rope_type` must be one of {ROPE_TYPES}. Received: rope_type={rope_type!r}"
        )
    return rope_type


def _check_axis(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an integer. Received: {name}={value!r}")
    return int(value)


def _check_inputs(inputs_shape, start_index, positions):
    """Checks inputs `(B, T, ..., D)` (their axes moved so)."""
    head_dim = inputs_shape[-1]
    if head_dim is None or head_dim % 2:
        raise ValueError(
            "The last dimension of `inputs` (the head size) must be known and "
            f"even, to split into rotated pairs. Received: inputs with shape "
            f"{tuple(inputs_shape)} (head size {head_dim})"
        )
    check_start_index_and_positions(inputs_shape, start_index, positions)
