"""What `SoftAttention` and `HardAttention` share: one head of attention
over `(B, T, D)` inputs, from the masks to the core and back.

Shape legend: `B` batch, `T` query length, `S` key/value length, `Dq`, `Dk`,
`Dv` feature sizes of query, key and value.
"""

import inspect

import keras

from keras_attention import _signatures
from keras_attention import _validation
from keras_attention import kernels
from keras_attention import masking
from keras_attention.layers.multi_head_attention import MultiHeadAttention


# The arguments of `SoftAttention.call`, which `HardAttention.call` takes too
# (and `return_log_prob`): `MultiHeadAttention.call`'s, the Keras convention,
# but the cache, with the causal flag before the returned scores. Both layers'
# docstrings say what each means; their `call`s take them with
# `_signatures.takes_arguments_of`.
call_arguments = _signatures.selection(
    MultiHeadAttention.call,
    (
        "self", "query", "value", "key", "query_mask", "value_mask", "key_mask",
        "attention_mask", "use_causal_mask", "return_attention_scores", "training",
    ),
)


class SingleHeadAttention(keras.layers.Layer):
    """Base of `SoftAttention` and `HardAttention`, which differ only in the
    normalize step they give the core. Not public: use one of the two.

    A subclass sets `self.score` (a `Scorer`) in `__init__`, and its `call`
    takes `call_arguments` and hands the inputs, masks and causal flag to
    `_attend`.
    """

    def build(self, query_shape, value_shape, key_shape=None):
        _validation.check_attention_shapes(query_shape, value_shape, key_shape)
        key_shape = value_shape if key_shape is None else key_shape
        self.score.build_or_check(query_shape, key_shape)
        self.built = True

    def _attend(
        self,
        query,
        value,
        key,
        query_mask,
        value_mask,
        key_mask,
        attention_mask,
        use_causal_mask,
        **options,
    ):
        """The masks combined and one head of the core's `(B, T, H, D)`
        layout attended; `options` go to `kernels.attention` (dropout, a
        normalize step, returned weights).

        Returns:
            `(output, weights)`: `(B, T, Dv)` and `(B, T, S)` or None.
        """
        _validation.check_attention_shapes(
            query.shape, value.shape, None if key is None else key.shape
        )
        key = value if key is None else key
        # One head: a (B, H, T, S) mask would broadcast its heads against the
        # batch of the (B, T, S) scores, so it is refused here.
        attention_mask = masking.standardize_mask(
            attention_mask, "attention_mask", ranks=(2, 3)
        )
        mask = masking.compute_attention_mask(
            query,
            value,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
        )
        # A dot-product scorer and the default normalization take the fast
        # kernels, anything else the explicit one.
        output, weights = kernels.attention(
            query[:, :, None],  # (B, T, 1, Dq)
            key[:, :, None],  # (B, S, 1, Dk)
            value[:, :, None],  # (B, S, 1, Dv)
            self.score,
            mask=mask,
            causal=use_causal_mask,
            owner=self,
            **options,
        )
        weights = None if weights is None else weights[:, 0]  # (B, T, S)
        return output[:, :, 0], weights  # (B, T, Dv)

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return tuple(query_shape[:-1]) + (value_shape[-1],)

    def _call_arguments(self, args, kwargs):
        """A symbolic call's arguments by name, as `call` binds them (masks
        may come by position)."""
        bound = inspect.signature(self.call).bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def _output_spec(self, query, value, key, num_weights):
        """The output's `KerasTensor` and a tuple of `num_weights` more of
        the weights' shape `(B, T, S)`."""
        _validation.check_attention_shapes(
            query.shape, value.shape, None if key is None else key.shape
        )
        output = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape),
            dtype=self.compute_dtype,
        )
        weights_shape = (query.shape[0], query.shape[1], value.shape[1])
        weights = tuple(
            keras.KerasTensor(weights_shape, dtype=self.compute_dtype)
            for _ in range(num_weights)
        )
        return output, weights
