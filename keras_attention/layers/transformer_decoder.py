"""A stack of Transformer decoder blocks, and one block under KerasHub's name.

Shape legend: `B` batch, `T` decoder length, `S` encoder length, `L` cache
length, `D` model width, `H` heads, `G` key/value heads, `K` head size, `N`
blocks.
"""

import keras

from keras_attention import _signatures
from keras_attention import kv_cache
from keras_attention.layers import _block_io
from keras_attention.layers._keras_interop import KerasHubBlockName
from keras_attention.layers._transformer_block import TransformerStack
from keras_attention.layers._transformer_block import as_tuple
from keras_attention.layers.transformer_decoder_block import TransformerDecoderBlock


@keras.saving.register_keras_serializable(package="keras_attention")
class TransformerDecoderStack(_block_io.DecoderOutputSpec, TransformerStack):
    """`num_layers` `TransformerDecoderBlock`s, then an optional final norm.

    Each block has its own weights; masks reach every block, and every block
    attends to the same encoder output. Without an encoder sequence (when
    built) it is a decoder-only (GPT) stack. A pre-norm stack ends with one
    more norm (`final_layer_norm=None` adds it exactly when
    `normalize_first=True`).

    Caches hold every block's cache on an axis after the batch:
    `self_attention_cache` `(B, N, 2, L, G, K)` and `cross_attention_cache`
    `(B, N, 2, S, G, K)`; block `i` reads and writes `cache[:, i]` with the
    semantics of `TransformerDecoderBlock`.

    Args:
        num_layers: positive int, the number of blocks `N`.
        intermediate_dim, num_heads, ...: the arguments of
            `TransformerDecoderBlock`, given to every block. Block `i` gets
            the seed `seed + 10 * i` when `seed` is set.
        final_layer_norm: optional bool, a norm after the last block. `None`
            (default) means `normalize_first`.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        The call arguments of `TransformerDecoderBlock`, with the stacked
        caches above.

    Returns:
        `output` `(B, T, D)`; with `return_attention_scores`, then a list of
        `N` self-attention weights `(B, H, T, T|L)` and, with
        cross-attention, a list of `N` cross-attention weights
        `(B, H, T, S)`; then the updated stacked caches, when given.

    Example:

    >>> import numpy as np
    >>> decoder = TransformerDecoderStack(
    ...     num_layers=2, intermediate_dim=64, num_heads=4, normalize_first=True
    ... )
    >>> x = np.random.rand(2, 5, 32).astype("float32")
    >>> tuple(decoder(x).shape)
    (2, 5, 32)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
    """

    stacked = True
    block_class = TransformerDecoderBlock

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        self._check_inputs("decoder_sequence", decoder_sequence_shape)
        self._build_blocks(decoder_sequence_shape, encoder_sequence_shape)
        self.built = True

    @_signatures.takes_arguments_of(TransformerDecoderBlock.call)
    def call(
        self,
        decoder_sequence,
        encoder_sequence,
        decoder_padding_mask,
        encoder_padding_mask,
        self_attention_cache,
        cross_attention_cache,
        return_attention_scores,
        **block_arguments,
    ):
        # `block_arguments`: the other call arguments, the same for every block.
        self._check_inputs("decoder_sequence", decoder_sequence.shape)
        for name, cache in (
            ("self_attention_cache", self_attention_cache),
            ("cross_attention_cache", cross_attention_cache),
        ):
            if cache is not None:
                kv_cache.check_stacked(cache, self.num_layers, name)
        decoder_padding_mask, encoder_padding_mask = _block_io.decoder_padding_masks(
            decoder_sequence, decoder_padding_mask, encoder_sequence, encoder_padding_mask
        )
        has_cross = encoder_sequence is not None or cross_attention_cache is not None
        x = decoder_sequence
        self_weights, cross_weights = [], []
        self_caches, cross_caches = [], []
        for i, block in enumerate(self.blocks):
            outputs = as_tuple(
                block(
                    x,
                    encoder_sequence,
                    decoder_padding_mask=decoder_padding_mask,
                    encoder_padding_mask=encoder_padding_mask,
                    self_attention_cache=None
                    if self_attention_cache is None
                    else kv_cache.layer_cache(self_attention_cache, i),
                    cross_attention_cache=None
                    if cross_attention_cache is None
                    else kv_cache.layer_cache(cross_attention_cache, i),
                    return_attention_scores=return_attention_scores,
                    **block_arguments,
                )
            )
            x, rest = outputs[0], list(outputs[1:])
            if return_attention_scores:
                self_weights.append(rest.pop(0))
                if has_cross:
                    cross_weights.append(rest.pop(0))
            if self_attention_cache is not None:
                self_caches.append(rest.pop(0))
            if cross_attention_cache is not None:
                cross_caches.append(rest.pop(0))
        if self.output_layer_norm is not None:
            x = self.output_layer_norm(x)

        return _block_io.decoder_outputs(
            x,
            return_attention_scores,
            self_weights,
            cross_weights,
            has_cross,
            # (B, N, 2, L, G, K) and (B, N, 2, S, G, K), when given.
            None if self_attention_cache is None else kv_cache.stack(self_caches),
            None if cross_attention_cache is None else kv_cache.stack(cross_caches),
        )

    def call_with_layer_caches(self, decoder_sequence, caches, cache_update_index):
        """A cached decoder-only pass with one self-attention cache per block.

        The same computation as `call` with a stacked `self_attention_cache`,
        for decoding loops that carry the caches as a list: no block slices
        its cache out of the stacked tensor and no new stacked tensor is
        built, so each step writes only its new keys and values (a compiled
        loop updates each cache in place).

        Args:
            decoder_sequence: `(B, T, D)`.
            caches: a list of `num_layers` caches `(B, 2, L, G, K)`.
            cache_update_index: int or scalar int tensor.

        Returns:
            `(output, caches)`: `(B, T, D)` and the list of updated caches.
        """
        if len(caches) != self.num_layers:
            raise ValueError(
                f"`caches` must hold one cache per block ({self.num_layers}). "
                f"Received: {len(caches)} caches"
            )
        x, updated = decoder_sequence, []
        for block, cache in zip(self.blocks, caches):
            x, cache = block(
                x,
                self_attention_cache=cache,
                self_attention_cache_update_index=cache_update_index,
            )
            updated.append(cache)
        if self.output_layer_norm is not None:
            x = self.output_layer_norm(x)
        return x, updated

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)


@keras.saving.register_keras_serializable(package="keras_attention")
class TransformerDecoder(
    KerasHubBlockName, TransformerDecoderBlock, stack=TransformerDecoderStack
):
    """One decoder block under KerasHub's name: `keras_hub.layers.TransformerDecoder`.

    `TransformerDecoderBlock` (causal self-attention, cross-attention when
    an `encoder_sequence` is given, the feed-forward network) registered as
    `TransformerDecoder`, with KerasHub's constructor arguments and call,
    caches included: `self_attention_cache` `(B, 2, L, H, K)` with its
    update index gives `(output, self_cache)`, and with
    `cross_attention_cache` too `(output, self_cache, cross_cache)`
    (`cross_attention_cache_update_index=0` fills it from the encoder
    sequence, `None` reads it). `from_keras(layer)` takes over a built
    KerasHub decoder. A stack is `TransformerDecoderStack`, which also
    loads the configs with `num_layers` saved under this name.

    Args:
        intermediate_dim: positive int, the feed-forward width.
        num_heads: positive int, the attention heads.
        **kwargs: the other arguments of KerasHub's decoder, and this
            package's (`TransformerDecoderBlock`).

    Call arguments:
        decoder_sequence: `(B, T, D)`.
        encoder_sequence: optional `(B, S, D)`.
        decoder_padding_mask, decoder_attention_mask, encoder_padding_mask,
        encoder_attention_mask, self_attention_cache,
        self_attention_cache_update_index, cross_attention_cache,
        cross_attention_cache_update_index, use_causal_mask, training: as
            KerasHub's (boolean masks; a padded query attends to nothing).

    Returns:
        `(B, T, D)`, then the updated caches that were given.

    Example:

    >>> import numpy as np
    >>> layer = TransformerDecoder(intermediate_dim=64, num_heads=4)
    >>> x = np.random.rand(2, 5, 32).astype("float32")
    >>> memory = np.random.rand(2, 7, 32).astype("float32")
    >>> tuple(layer(x, memory).shape)
    (2, 5, 32)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), section 3.1
    """
