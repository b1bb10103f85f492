"""What `MultiHeadAttention` keeps of `keras.layers.MultiHeadAttention`'s
interface beyond its arguments: the private names Keras's tools and tests
read, quantization of the projections, the flash-attention checks and
`_compute_attention`, Keras's override point (`KerasInterface`, a mixin of
the layer).

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `K` key head size, `V` value head size.
"""

import inspect

import keras
from keras import ops

from keras_attention import _keras_objects
from keras_attention import masking
from keras_attention import scoring
from keras_attention.layers import _keras_interop

# The arguments that are Keras objects, serialized by their module.
_WEIGHT_ARGUMENTS = (
    _keras_objects.INITIALIZERS + _keras_objects.REGULARIZERS + _keras_objects.CONSTRAINTS
)
# The arguments stored as given.
_PLAIN_ARGUMENTS = (
    "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "output_shape",
    "num_key_value_heads", "fused", "seed", "attention_axes", "use_gate",
    "sliding_window", "flash_attention",
)


class KerasInterface:
    """Keras's private names and override point for `MultiHeadAttention`
    (a mixin: it reads the layer's projections, `dropout`, `score`,
    `key_dim`, `value_dim`, `flash_attention` and calls its `_attend`)."""

    # Keras's private names for the projections, the window and the flash
    # switch, which Keras's own tests and tools (LoRA, quantization) read.
    # Saving walks private names after public ones, so weights stay saved
    # under the public names.
    _query_dense = property(lambda self: self.query_dense)
    _key_dense = property(lambda self: self.key_dense)
    _value_dense = property(lambda self: self.value_dense)
    _output_dense = property(lambda self: self.output_dense)
    _gate_dense = property(lambda self: self.gate_dense)
    _sliding_window = property(lambda self: self.sliding_window)
    _flash_attention = property(lambda self: bool(self.flash_attention))

    def _check_flash_attention(self):
        """`flash_attention=True` promises the fused kernel: refuse what
        would take it away (as Keras does, with its messages)."""
        received = f"Received: dropout={self.dropout}, flash_attention=True"
        if self.dropout > 0:
            raise ValueError(
                "Dropout is not supported when flash attention is enabled. "
                f"Please set dropout to 0.0 to use flash attention. {received}"
            )
        if self.score.dot_product_scale(self.key_dim) is None:
            raise ValueError(
                "`flash_attention=True` needs a (scaled) dot-product scorer. "
                f"Received: score={scoring.serialize(self.score)!r}"
            )
        if self._value_dim != self.key_dim:
            raise ValueError(
                "`flash_attention=True` needs value heads of the key heads' "
                f"size. Received: key_dim={self.key_dim}, value_dim={self.value_dim}"
            )

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the projections (`EinsumDense.quantize`: `"int8"`,
        `"int4"`, `"float8"`, ...), as `keras.Model.quantize` does for a
        model. The attention core is unchanged: quantized kernels leave the
        fused Q/K/V projection and the decoding fast paths (which read plain
        kernels) for the projections' own calls, and the fused attention
        kernels run as before."""
        for dense in self._projections():
            dense.quantize(mode, type_check=type_check, config=config)
        for layer in self._flatten_layers():
            # The torch backend tracks the new variables (as
            # `keras.Model.quantize` does after quantizing).
            track = getattr(layer, "_track_variables", None)
            if track is not None:
                track()

    def _projections(self):
        denses = (
            self.query_dense, self.key_dense, self.gate_dense, self.value_dense,
            self.output_dense,
        )
        return tuple(d for d in denses if d is not None)

    def _call_compute_attention(self, q, k, v, mask, training, return_attention_scores):
        """A subclass's `_compute_attention`, with the arguments of Keras's
        `MultiHeadAttention` or, where its signature has no
        `return_attention_scores`, of Keras's `GroupedQueryAttention` (which
        reads the flag from `self._return_attention_scores`)."""
        method = type(self)._compute_attention
        if "return_attention_scores" in inspect.signature(method).parameters:
            return self._compute_attention(q, k, v, mask, training, return_attention_scores)
        self._return_attention_scores = return_attention_scores
        return self._compute_attention(q, k, v, mask, training)

    def _check_scores_allowed(self, return_attention_scores):
        """Keras's error: a forced fused kernel never forms the scores."""
        if self.flash_attention and return_attention_scores:
            raise ValueError(
                "Returning attention scores is not supported when flash "
                "attention is enabled. Please disable flash attention to access "
                "attention scores. Received: flash_attention=True, "
                "return_attention_scores=True"
            )

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
        """Attention of projected heads, Keras's override point.

        The same arguments as `keras.layers.MultiHeadAttention`'s: `query`
        `(B, T, H, K)`, `key` `(B, S, G, K)`, `value` `(B, S, G, V)`, a
        boolean `attention_mask` `(B, T, S)` (or `(T, S)`, `(B, H, T, S)`)
        and `use_causal_mask` (bottom-right aligned). Returns `(output,
        scores)`: `(B, T, H, V)` and `(B, H, T, S)` (None from a fused
        kernel). A subclass that overrides it is called by `call` with the
        causal mask folded into `attention_mask`, as Keras does.
        """
        dtype = self.compute_dtype
        query, key, value = (ops.convert_to_tensor(x, dtype) for x in (query, key, value))
        mask = masking.standardize_mask(attention_mask, "attention_mask")
        self._check_scores_allowed(return_attention_scores)
        return self._attend(
            query, key, value, mask, bool(use_causal_mask), False,
            return_attention_scores, training,
        )

    def _store_fused(self, fused, flash_attention):
        """`fused`, and `flash_attention`, Keras's name for the fused
        switch: None leaves `fused` to decide."""
        if flash_attention not in (None, True, False):
            raise ValueError(
                "`flash_attention` must be None, True or False. Received: "
                f"flash_attention={flash_attention!r}"
            )
        if flash_attention is True and fused is False:
            raise ValueError(
                "`flash_attention=True` forces the fused kernel, which "
                "`fused=False` forbids. Received: flash_attention=True, fused=False"
            )
        self.flash_attention = flash_attention
        # `flash_attention` is Keras's name for the fused switch; None leaves
        # `fused` to decide.
        self.fused = bool(fused) if flash_attention is None else flash_attention

    def _store_keras_objects(
        self, kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, kernel_constraint, bias_constraint,
    ):
        values = (
            kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer, kernel_constraint, bias_constraint,
        )
        _keras_objects.store(self, **dict(zip(_WEIGHT_ARGUMENTS, values)))

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _PLAIN_ARGUMENTS})
        config.update(
            {
                "score": scoring.serialize(self.score),
                "rotary_embedding": None
                if self.rotary_embedding is None
                else keras.saving.serialize_keras_object(self.rotary_embedding),
                "activity_regularizer": keras.regularizers.serialize(
                    self.activity_regularizer
                ),
            }
        )
        config.update(_keras_objects.serialize(self, _WEIGHT_ARGUMENTS))
        return config

    @classmethod
    def from_keras(cls, layer):
        """Builds a layer equal to a built `keras.layers.MultiHeadAttention`.

        Same configuration, copies of the weights, the same outputs on
        `(batch, length, dim)` inputs. `layer` must be built, with the default
        attention axes, no gate and no sliding window (else a `ValueError`).

        Example:

        >>> import keras, numpy as np
        >>> from keras_attention.layers import MultiHeadAttention
        >>> peer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        >>> x = np.random.rand(1, 3, 8).astype("float32")
        >>> _ = peer(x, x)
        >>> ours = MultiHeadAttention.from_keras(peer)
        >>> to_numpy = keras.ops.convert_to_numpy
        >>> bool(np.allclose(to_numpy(ours(x, x)), to_numpy(peer(x, x)), atol=1e-5))
        True
        """
        return _keras_interop.from_keras_multi_head_attention(cls, layer)
