"""The Transformer decoder block: masked self-attention, cross-attention, FFN.

Shape legend: `B` batch, `T` decoder length, `S` encoder length, `L` cache
length, `D` model width (`hidden_dim`), `H` heads, `G` key/value heads, `K`
head size.
"""

import keras
from keras import ops

from keras_attention import _validation
from keras_attention import kv_cache
from keras_attention import masking
from keras_attention._typing import IntOrTensor
from keras_attention._typing import Tensor
from keras_attention.layers import _block_io
from keras_attention.layers._transformer_block import TransformerBlock
from keras_attention.layers._transformer_block import as_tuple


@keras.saving.register_keras_serializable(package="keras_attention")
class TransformerDecoderBlock(_block_io.DecoderOutputSpec, TransformerBlock):
    """One decoder layer of "Attention Is All You Need" (section 3.1).

    Three sub-layers, each wrapped in dropout, a residual connection and a
    normalization (post-norm by default, pre-norm with `normalize_first`):

        x = norm1(x + dropout(self_attention(x, x, causal)))
        x = norm2(x + dropout(cross_attention(x, encoder_output)))
        x = norm3(x + dropout(feedforward(x)))

    The self-attention is causal by default: position `t` sees positions
    `0 .. t` only. In the cross-attention the queries come from the decoder
    and the keys and values from the encoder output. A block built without an
    encoder sequence has no cross-attention: a decoder-only (GPT) block.

    Caches, for incremental decoding (as `keras_hub.layers.TransformerDecoder`):
    `self_attention_cache` `(B, 2, L, G, K)` is written at
    `self_attention_cache_update_index` with the keys and values of the `T`
    new positions, and attention is causal over the written slots (slots not
    yet written are never attended). `cross_attention_cache` `(B, 2, S, G, K)`
    is filled from `encoder_sequence` when
    `cross_attention_cache_update_index=0` and reused as it is when `None`.

    Args:
        intermediate_dim: positive int, the feed-forward width.
        num_heads: positive int, attention heads.
        **kwargs: the other arguments of `TransformerEncoderBlock` (`dropout`,
            `activation`, `layer_norm_epsilon`, `kernel_initializer`,
            `bias_initializer`, `normalize_first`, `key_dim`,
            `num_key_value_heads`, `score`, `attention_dropout`,
            `feedforward_dropout`, `gated_feedforward`, `normalization`,
            `use_rotary_embedding`, `rotary_max_wavelength`, `use_bias`,
            `seed`), with the same meaning (rotary embeddings apply to the
            self-attention only), and base `keras.layers.Layer` arguments.

    Call arguments:
        decoder_sequence: `(B, T, D)`.
        encoder_sequence: optional `(B, S, De)`, the encoder output.
        decoder_padding_mask: optional `(B, T)`; combined with the Keras mask
            of `decoder_sequence`. With a self-attention cache it masks the
            new queries only; mask earlier cache slots with
            `decoder_attention_mask`.
        decoder_attention_mask: optional `(B, T, T)` (`(B, T, L)` with a
            cache) self-attention mask.
        encoder_padding_mask: optional `(B, S)`; combined with the Keras mask
            of `encoder_sequence`.
        encoder_attention_mask: optional `(B, T, S)` cross-attention mask.
        self_attention_cache: optional `(B, 2, L, G, K)`.
        self_attention_cache_update_index: int or scalar int tensor, where
            the new positions are written.
        cross_attention_cache: optional `(B, 2, S, G, K)`.
        cross_attention_cache_update_index: `0` to fill the cross cache from
            `encoder_sequence`, `None` to reuse it.
        use_causal_mask: bool, causal self-attention (default True). A cached
            self-attention call is always causal over the written slots.
        training: bool, whether dropout is active.
        return_attention_scores: bool, also return the attention weights.

    Returns:
        `output` `(B, T, D)`; with `return_attention_scores`, then the
        self-attention weights `(B, H, T, T|L)` and, with cross-attention, the
        cross-attention weights `(B, H, T, S)`; then the updated
        self-attention cache and cross-attention cache, when given. One
        tensor alone is returned as is, several as a tuple in that order.

    Example:

    >>> import numpy as np
    >>> block = TransformerDecoderBlock(intermediate_dim=64, num_heads=4)
    >>> x = np.random.rand(2, 5, 32).astype("float32")
    >>> memory = np.random.rand(2, 7, 32).astype("float32")
    >>> out, self_w, cross_w = block(x, memory, return_attention_scores=True)
    >>> tuple(out.shape), tuple(self_w.shape), tuple(cross_w.shape)
    ((2, 5, 32), (2, 4, 5, 5), (2, 4, 5, 7))

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
        - [Radford et al., 2019 (GPT-2, pre-norm)](https://openai.com/research/better-language-models)
    """

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        self._check_inputs("decoder_sequence", decoder_sequence_shape)
        # Self attention block.
        self._build_attention_sublayer(
            "self_attention", decoder_sequence_shape, decoder_sequence_shape,
            self.use_rotary_embedding, 0,
        )
        # Cross attention block.
        self.cross_attention = None
        if encoder_sequence_shape is not None:
            self._check_inputs("encoder_sequence", encoder_sequence_shape)
            # Checked here too: Keras builds before `call`, and the
            # cross-attention's own check would name `query` and `value`.
            _validation.check_same_dim(
                "decoder_sequence",
                decoder_sequence_shape[0],
                "encoder_sequence",
                encoder_sequence_shape[0],
                "batch size",
            )
            self._build_attention_sublayer(
                "cross_attention", decoder_sequence_shape, encoder_sequence_shape, False, 2
            )
        # Feedforward block.
        self._build_feedforward_sublayer(decoder_sequence_shape, 4)
        self.built = True

    def call(
        self, decoder_sequence: Tensor, encoder_sequence: Tensor | None = None,
        decoder_padding_mask: Tensor | None = None, decoder_attention_mask: Tensor | None = None,
        encoder_padding_mask: Tensor | None = None, encoder_attention_mask: Tensor | None = None,
        self_attention_cache: Tensor | None = None,
        self_attention_cache_update_index: IntOrTensor | None = None,
        cross_attention_cache: Tensor | None = None,
        cross_attention_cache_update_index: IntOrTensor | None = None,
        use_causal_mask: bool = True, training: bool | None = None,
        return_attention_scores: bool = False,
    ):
        self._check_call(
            decoder_sequence,
            encoder_sequence,
            self_attention_cache,
            self_attention_cache_update_index,
            cross_attention_cache,
            cross_attention_cache_update_index,
        )
        decoder_padding_mask, encoder_padding_mask = _block_io.decoder_padding_masks(
            decoder_sequence, decoder_padding_mask, encoder_sequence, encoder_padding_mask
        )
        has_cross = encoder_sequence is not None or cross_attention_cache is not None

        # Self attention block.
        def self_attend(x):
            kwargs = dict(
                query_mask=decoder_padding_mask,
                attention_mask=decoder_attention_mask,
                return_attention_scores=return_attention_scores,
                training=training,
            )
            if self_attention_cache is None:
                kwargs.update(value_mask=decoder_padding_mask, use_causal_mask=use_causal_mask)
            else:
                # The new positions' padding says nothing about the cache's
                # earlier slots.
                kwargs.update(
                    value_mask=_cache_value_mask(x, self_attention_cache),
                    cache=self_attention_cache,
                    cache_update_index=self_attention_cache_update_index,
                )
            return as_tuple(self.self_attention(x, x, **kwargs))

        x, self_extra = self._sublayer(
            decoder_sequence,
            self.self_attention_layer_norm,
            self.self_attention_residual_dropout,
            self_attend,
            training,
        )
        self_weights = self_extra[0] if return_attention_scores else None
        if self_attention_cache is not None:
            self_attention_cache = self_extra[-1]

        # Cross attention block.
        cross_weights = None
        if has_cross:

            def cross_attend(x):
                kwargs = dict(
                    attention_mask=encoder_attention_mask,
                    return_attention_scores=return_attention_scores,
                    training=training,
                )
                if cross_attention_cache is None:
                    return as_tuple(
                        self.cross_attention(
                            x,
                            encoder_sequence,
                            value_mask=encoder_padding_mask,
                            **kwargs,
                        )
                    )
                cache = cross_attention_cache
                if cross_attention_cache_update_index is not None:
                    update = self.cross_attention.compute_cache(encoder_sequence)
                    cache = kv_cache.write_packed(
                        cache, update, cross_attention_cache_update_index
                    )
                value_mask = encoder_padding_mask
                if value_mask is None:
                    value_mask = _cache_value_mask(x, cache)  # `x`: a placeholder value
                outputs = self.cross_attention(
                    x, x, value_mask=value_mask, cache=cache, **kwargs
                )
                return as_tuple(outputs)

            x, cross_extra = self._sublayer(
                x,
                self.cross_attention_layer_norm,
                self.cross_attention_residual_dropout,
                cross_attend,
                training,
            )
            if return_attention_scores:
                cross_weights = cross_extra[0]
            if cross_attention_cache is not None:
                cross_attention_cache = cross_extra[-1]

        # Feedforward block.
        x, _ = self._sublayer(
            x,
            self.feedforward_layer_norm,
            self.feedforward_residual_dropout,
            lambda x: (self.feedforward(x, training=training),),
            training,
        )

        return _block_io.decoder_outputs(
            x,
            return_attention_scores,
            self_weights,
            cross_weights,
            has_cross,
            self_attention_cache,
            cross_attention_cache,
        )

    def _check_call(
        self,
        decoder_sequence,
        encoder_sequence,
        self_cache,
        self_index,
        cross_cache,
        cross_index,
    ):
        self._check_inputs("decoder_sequence", decoder_sequence.shape)
        if encoder_sequence is not None:
            self._check_inputs("encoder_sequence", encoder_sequence.shape)
            _validation.check_same_dim(
                "decoder_sequence",
                decoder_sequence.shape[0],
                "encoder_sequence",
                encoder_sequence.shape[0],
                "batch size",
            )
        has_cross = encoder_sequence is not None or cross_cache is not None
        if has_cross and self.cross_attention is None:
            raise ValueError(
                "This block was built without an encoder sequence, so it has "
                "no cross-attention (a decoder-only block). Received: "
                "encoder_sequence or cross_attention_cache in a call"
            )
        if self.cross_attention is not None and not has_cross:
            raise ValueError(
                "This block was built with cross-attention and needs "
                "`encoder_sequence` (or a filled `cross_attention_cache`). "
                "Received: encoder_sequence=None"
            )
        if self_index is not None and self_cache is None:
            raise ValueError(
                "`self_attention_cache_update_index` needs a "
                "`self_attention_cache`. Received: self_attention_cache=None, "
                f"self_attention_cache_update_index={self_index!r}"
            )
        if cross_cache is not None and cross_index is None and encoder_sequence is None:
            return
        if cross_cache is not None and cross_index is not None and encoder_sequence is None:
            raise ValueError(
                "Filling the cross-attention cache "
                f"(cross_attention_cache_update_index={cross_index!r}) needs "
                "`encoder_sequence`. Received: encoder_sequence=None"
            )
        if cross_index is not None and cross_cache is None:
            raise ValueError(
                "`cross_attention_cache_update_index` needs a "
                "`cross_attention_cache`. Received: cross_attention_cache=None, "
                f"cross_attention_cache_update_index={cross_index!r}"
            )

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)


def _cache_value_mask(x, cache):
    """The value mask of a cached attention call whose value is `x` itself:
    None (nothing masks the cache's slots), or all-True `(B, L)` where `x`
    carries a Keras mask, which Keras's wrapper would otherwise fill in as
    the value mask, `(B, T)` for the `(B, L)` cache."""
    if masking.implicit_mask(x) is None:
        return None
    batch = x.shape[0] or ops.shape(x)[0]
    return ops.ones((batch, kv_cache.length(cache)), "bool")
