"""What a Transformer block and a stack of them share at their doors: the
masks checked and combined on the way in, the outputs (and their symbolic
specs) assembled on the way out.

Shape legend: `B` batch, `T` query (decoder) length, `S` encoder length,
`M` output positions, `H` heads, `D` model width.
"""

import keras

from keras_attention import kv_cache
from keras_attention import masking
from keras_attention.layers._transformer_block import check_positions
from keras_attention.layers._transformer_block import combined_padding_mask


def encoder_masks(inputs, padding_mask, attention_mask, output_positions):
    """An encoder's call arguments checked: `(padding_mask, attention_mask,
    output_positions)`, the padding mask combined with `inputs`' Keras mask,
    the output positions int32 `(B, M)`."""
    padding_mask = combined_padding_mask(inputs, padding_mask)
    attention_mask = masking.standardize_mask(
        attention_mask, "attention_mask", ranks=(2, 3, 4)
    )
    if output_positions is not None:
        output_positions = check_positions(output_positions, inputs)
    return padding_mask, attention_mask, output_positions


class EncoderOutputSpec:
    """`compute_output_spec` of an encoder block and of a stack of them
    (`stacked`): the output `(B, T|M, D)` and, with
    `return_attention_scores`, the weights `(B, H, T, T)`, for the last
    block `(B, H, M, T)` with `output_positions`: one tensor for a block, a
    list of one a block for a stack."""

    stacked = False

    def compute_output_spec(
        self, inputs, return_attention_scores=False, output_positions=None, **kwargs
    ):
        self._check_inputs("inputs", inputs.shape)
        batch, length = inputs.shape[0], inputs.shape[1]
        queries = length if output_positions is None else output_positions.shape[1]
        dtype = self.compute_dtype
        output = keras.KerasTensor((batch, queries) + tuple(inputs.shape[2:]), dtype=dtype)
        if not return_attention_scores:
            return output
        blocks = self.num_layers if self.stacked else 1
        weights = [
            keras.KerasTensor(
                (batch, self.num_heads, length if i < blocks - 1 else queries, length),
                dtype=dtype,
            )
            for i in range(blocks)
        ]
        return output, weights if self.stacked else weights[0]


def decoder_padding_masks(
    decoder_sequence, decoder_padding_mask, encoder_sequence, encoder_padding_mask
):
    """Each padding mask combined with its sequence's Keras mask (the
    encoder's only when there is an encoder sequence)."""
    decoder_padding_mask = combined_padding_mask(
        decoder_sequence,
        decoder_padding_mask,
        "decoder_padding_mask",
        "decoder_sequence",
    )
    if encoder_sequence is not None:
        encoder_padding_mask = combined_padding_mask(
            encoder_sequence,
            encoder_padding_mask,
            "encoder_padding_mask",
            "encoder_sequence",
        )
    return decoder_padding_mask, encoder_padding_mask


def decoder_outputs(
    x, return_attention_scores, self_weights, cross_weights, has_cross, self_cache, cross_cache
):
    """A decoder's outputs in their order: `x`; with
    `return_attention_scores` the self-attention weights, then the
    cross-attention weights when it has cross-attention; then each cache
    given. One alone is returned as is, several as a tuple."""
    outputs = (x,)
    if return_attention_scores:
        outputs += (self_weights,)
        if has_cross:
            outputs += (cross_weights,)
    outputs += tuple(cache for cache in (self_cache, cross_cache) if cache is not None)
    return outputs[0] if len(outputs) == 1 else outputs


class DecoderOutputSpec:
    """`compute_output_spec` of a decoder block and of a stack of them: the
    `KerasTensor`s of `decoder_outputs`, the weights `(B, H, T, keys)` one
    tensor for a block, a list of one a block for a stack (`stacked`, whose
    caches carry the blocks on axis 1)."""

    stacked = False

    def compute_output_spec(
        self,
        decoder_sequence,
        encoder_sequence=None,
        self_attention_cache=None,
        cross_attention_cache=None,
        return_attention_scores=False,
        **kwargs,
    ):
        batch, length = decoder_sequence.shape[0], decoder_sequence.shape[1]
        dtype = self.compute_dtype
        cache_length = kv_cache.stacked_length if self.stacked else kv_cache.length

        def weights(keys):
            specs = [
                keras.KerasTensor((batch, self.num_heads, length, keys), dtype=dtype)
                for _ in range(self.num_layers if self.stacked else 1)
            ]
            return specs if self.stacked else specs[0]

        has_cross = encoder_sequence is not None or cross_attention_cache is not None
        self_weights = cross_weights = None
        if return_attention_scores:
            self_weights = weights(
                length if self_attention_cache is None else cache_length(self_attention_cache)
            )
            if has_cross:
                cross_weights = weights(
                    encoder_sequence.shape[1]
                    if cross_attention_cache is None
                    else cache_length(cross_attention_cache)
                )
        self_cache, cross_cache = (
            None if cache is None else keras.KerasTensor(cache.shape, dtype=cache.dtype)
            for cache in (self_attention_cache, cross_attention_cache)
        )
        return decoder_outputs(
            keras.KerasTensor(decoder_sequence.shape, dtype=dtype),
            return_attention_scores,
            self_weights,
            cross_weights,
            has_cross,
            self_cache,
            cross_cache,
        )
