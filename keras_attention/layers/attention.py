"""Luong attention called as `keras.layers.Attention` is: on a list of inputs.

Shape legend: `B` batch, `...` further batch axes, `T` query length, `S`
key/value length, `D` feature size.
"""

import math
from typing import Any

import keras
from keras import ops

from keras_attention import _validation
from keras_attention import masking
from keras_attention import scoring
from keras_attention._typing import Tensor
from keras_attention.layers import _keras_interop
from keras_attention.layers.soft_attention import SoftAttention

SCORE_MODES = ("dot", "concat")


@keras.saving.register_keras_serializable(package="keras_attention")
class Attention(SoftAttention):
    """Dot-product (Luong) attention with the arguments and call of
    `keras.layers.Attention`.

    Scores each query against each key, normalizes the scores with a softmax
    over the keys and returns the weighted sum of the values:

    - `score_mode="dot"`: `e_ts = q_t . k_s`, times a learned scalar `a`
      (weight `scale`, initialized to 1) when `use_scale=True`
      (`keras_attention.scoring.DotProduct`);
    - `score_mode="concat"`: `e_ts = c * sum_d tanh(a (q_td + k_sd))`, `c` a
      learned scalar (weight `concat_score_weight`), `a` as above
      (`keras_attention.scoring.Concat`).

    Neither projects its inputs: query and key must have the same size.
    The layer is `SoftAttention` with that scorer, so the package's rules
    hold: masks are boolean (`True` = may attend; a float mask is a
    `TypeError`), a query that may attend to nothing gets weights and output
    exactly 0, masked NaN or inf values cannot leak, and softmax runs in
    float32 under mixed precision. Where Keras's layer differs (a masked
    query's weights, the causal mask when `T != S`) the README's "Coming
    from Keras or KerasHub" says how.

    Inputs of any rank `>= 3` attend over their second-to-last axis; the
    axes before it are batch axes, as in Keras.

    Args:
        use_scale: bool, a learned scalar scale of the scores. Defaults to
            False.
        score_mode: `"dot"` (default) or `"concat"`.
        dropout: float in [0, 1), dropout on the attention weights during
            training. Defaults to 0.
        seed: optional int, the seed of the dropout.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: a list `[query, value]` or `[query, value, key]`: query
            `(B, ..., T, D)`, value `(B, ..., S, Dv)`, key `(B, ..., S, D)`
            (defaults to `value`).
        mask: optional list `[query_mask, value_mask]` (or with a third,
            `key_mask`, combined with `value_mask`): boolean `(B, ..., T)`
            and `(B, ..., S)`. Defaults to the Keras masks of the inputs.
            Masked queries give output 0 (and weights 0).
        training: bool, whether dropout is active.
        return_attention_scores: bool, also return the attention weights.
        use_causal_mask: bool, query `t` attends only to keys
            `0 .. S - T + t` (bottom-right aligned when `T != S`).

    Returns:
        `output` `(B, ..., T, Dv)`, or `(output, weights)` with weights
        `(B, ..., T, S)` when `return_attention_scores=True`. The output's
        Keras mask is the query mask.

    Example:

    >>> import numpy as np
    >>> layer = Attention(use_scale=True)
    >>> query = np.random.rand(2, 3, 4).astype("float32")
    >>> value = np.random.rand(2, 5, 4).astype("float32")
    >>> output, weights = layer([query, value], return_attention_scores=True)
    >>> tuple(output.shape), tuple(weights.shape)
    ((2, 3, 4), (2, 3, 5))

    References:
        - [Luong et al., 2015](https://arxiv.org/abs/1508.04025)
    """

    def __init__(
        self,
        use_scale: bool = False,
        score_mode: str = "dot",
        dropout: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        if score_mode not in SCORE_MODES:
            raise ValueError(
                "Invalid value for argument score_mode. Expected one of "
                f"{{'dot', 'concat'}}. Received: score_mode={score_mode!r}"
            )
        self.use_scale = _validation.check_bool("use_scale", use_scale)
        self.score_mode = score_mode
        super().__init__(score=self._scorer(kwargs.get("dtype")), dropout=dropout, seed=seed, **kwargs)

    def _scorer(self, dtype):
        if self.score_mode == "concat":
            return scoring.Concat(use_scale=self.use_scale, dtype=dtype)
        return scoring.DotProduct(use_scale=self.use_scale, dtype=dtype)

    @property
    def scale(self):
        """The learned scale (a variable), or None without `use_scale`."""
        return getattr(self.score, "scale", None)

    def build(self, input_shape):
        check_inputs(self, input_shape, what="shapes")
        query_shape, value_shape, key_shape = _three(input_shape)
        super().build(
            _as_rank3(query_shape), _as_rank3(value_shape), _as_rank3(key_shape)
        )

    def call(
        self,
        inputs: Tensor,
        mask: Tensor | None = None,
        training: bool | None = None,
        return_attention_scores: bool = False,
        use_causal_mask: bool = False,
    ):
        check_inputs(self, inputs, mask)
        query, value, key = _three(inputs)
        query_mask, value_mask, key_mask = _three(mask or [None, None])
        if key_mask is value_mask:
            key_mask = None
        _check_ranks(query, value, key)
        batch_axes = ops.shape(query)[:-2]  # (B, ...)
        result = super().call(
            _flat(query),  # (B', T, D)
            _flat(value),  # (B', S, Dv)
            key=_flat(key),  # (B', S, D)
            query_mask=_flat_mask(query_mask, "query_mask", query),  # (B', T)
            value_mask=_flat_mask(value_mask, "value_mask", query),  # (B', S)
            key_mask=_flat_mask(key_mask, "key_mask", query),  # (B', S)
            use_causal_mask=use_causal_mask,
            return_attention_scores=return_attention_scores,
            training=training,
        )
        if len(query.shape) == 3:
            return result
        if return_attention_scores:
            output, weights = result
            return _unflat(output, batch_axes), _unflat(weights, batch_axes)
        return _unflat(result, batch_axes)

    def compute_mask(self, inputs, mask=None):
        check_inputs(self, inputs, mask)
        if mask is None or mask[0] is None:
            return None
        return masking.standardize_mask(mask[0], "query_mask", ranks=None)

    def compute_output_shape(self, input_shape):
        query_shape, value_shape, _ = _three(input_shape)
        return tuple(query_shape[:-1]) + (value_shape[-1],)

    def compute_output_spec(
        self, inputs, mask=None, return_attention_scores=False, **kwargs
    ):
        check_inputs(self, inputs, mask)
        query, value, key = _three(inputs)
        _check_ranks(query, value, key)
        output = keras.KerasTensor(
            self.compute_output_shape([query.shape, value.shape, key.shape]),
            dtype=self.compute_dtype,
        )
        if not return_attention_scores:
            return output
        weights = keras.KerasTensor(
            tuple(query.shape[:-1]) + (key.shape[-2],), dtype=self.compute_dtype
        )
        return output, weights

    def get_config(self):
        config = super().get_config()
        del config["score"]  # made from `use_scale` and `score_mode`
        config.update({"use_scale": self.use_scale, "score_mode": self.score_mode})
        return config

    @classmethod
    def from_keras(cls, layer):
        """A built layer equal to a built `keras.layers.Attention`.

        Its arguments, dtype policy and name, copies of its weights; the
        same outputs (see the README for where the layers differ).

        Example:

        >>> import keras, numpy as np
        >>> peer = keras.layers.Attention(use_scale=True, score_mode="concat")
        >>> q = np.random.rand(1, 3, 4).astype("float32")
        >>> _ = peer([q, q])
        >>> ours = Attention.from_keras(peer)
        >>> to_numpy = keras.ops.convert_to_numpy
        >>> bool(np.allclose(to_numpy(ours([q, q])), to_numpy(peer([q, q])), atol=1e-5))
        True
        """
        return _keras_interop.from_keras_attention(cls, layer)


def check_inputs(layer, inputs, mask=None, what="tensors"):
    """Keras's rules for the list arguments: `inputs` a list of 2 or 3
    tensors (or shapes, `what="shapes"`), `mask` None or a list of 2 or 3."""
    name = type(layer).__name__
    if what == "shapes":
        is_list = isinstance(inputs, (list, tuple)) and all(
            isinstance(shape, (list, tuple)) for shape in inputs
        )
    else:
        is_list = isinstance(inputs, (list, tuple))
    if not is_list:
        # Keras builds with the shape of a single tensor: say so.
        received = (
            f"a tensor of shape {tuple(inputs)}" if what == "shapes" else _describe(inputs)
        )
        raise ValueError(
            f"The {name} layer must be called on a list of inputs, [query, "
            f"value] or [query, value, key]. Received: inputs={received}"
        )
    _check_length(name, "inputs", inputs, "[query, value] or [query, value, key]")
    if mask is None:
        return
    if not isinstance(mask, (list, tuple)):
        raise ValueError(
            f"The {name} layer mask must be a list, [query_mask, value_mask]. "
            f"Received: mask={_describe(mask)}"
        )
    _check_length(
        name, "mask", mask, "[query_mask, value_mask] or [query_mask, value_mask, key_mask]"
    )


def _check_length(layer_name, name, items, expected):
    if not 2 <= len(items) <= 3:
        raise ValueError(
            f"The {layer_name} layer takes a list `{name}` of length 2 or 3, "
            f"{expected}. Received: a list of length {len(items)}"
        )


def _describe(x):
    shape = getattr(x, "shape", None)
    return f"a tensor of shape {tuple(shape)}" if shape is not None else repr(x)


def _three(items):
    """`[a, b]` -> `(a, b, b)`; `[a, b, c]` -> `(a, b, c)`."""
    return items[0], items[1], items[2] if len(items) > 2 else items[1]


def _check_ranks(query, value, key):
    _validation.check_rank("query", query.shape, max(len(query.shape), 3))
    _validation.check_rank("value", value.shape, len(query.shape))
    _validation.check_rank("key", key.shape, len(query.shape))


def _as_rank3(shape):
    """`(B, ..., T, D)` -> `(B * ..., T, D)` (None where unknown)."""
    shape = tuple(shape)
    if len(shape) <= 3:
        return shape
    leading = shape[:-2]
    batch = None if None in leading else math.prod(leading)
    return (batch,) + shape[-2:]


def _flat(x):
    """`(B, ..., T, D)` -> `(B', T, D)`; rank 3 as is (its Keras mask kept)."""
    if len(x.shape) <= 3:
        return x
    return ops.reshape(x, (-1,) + tuple(ops.shape(x)[-2:]))


def _flat_mask(mask, name, query):
    """`(B, ..., T)` -> `(B', T)`, boolean; one rank below the query's."""
    mask = masking.standardize_mask(mask, name, ranks=(len(query.shape) - 1,))
    if mask is None or len(mask.shape) <= 2:
        return mask
    return ops.reshape(mask, (-1, ops.shape(mask)[-1]))


def _unflat(x, batch_axes):
    """`(B', T, X)` -> `(B, ..., T, X)`."""
    return ops.reshape(x, tuple(batch_axes) + tuple(ops.shape(x)[1:]))
