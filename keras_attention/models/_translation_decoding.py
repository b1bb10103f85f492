"""A translation model's cached decoding step, for the generation core.

Shape legend: `B` batch, `S` source length, `L` cache length, `G` key/value
heads, `K` head size, `V` target vocabulary size.

`TranslationDecoding` is a mixin of `Seq2SeqTransformer`: the encoder runs
once per call and each decoder block's cross-attention keys and values are
computed once (the cross caches, with the source mask, ride in the caches
the step carries); the step runs the model's own layers.
"""

from keras_attention import kv_cache
from keras_attention.models import beam_search
from keras_attention.models import generation


class TranslationDecoding:
    """The step, caches and generator of `Seq2SeqTransformer.generate` (a
    mixin: it reads the model's embeddings, encoder and decoder)."""

    def _cross_caches(self, encoder_token_ids, encoder_padding_mask):
        """`(cross caches, source mask)`: the encoder run once, each block's
        cross-attention keys and values `(B, 2, S, G, K)` computed once."""
        encoded, mask = self.encode(encoder_token_ids, encoder_padding_mask)
        cross_caches = tuple(
            b.cross_attention.compute_cache(encoded) for b in self.decoder.blocks
        )
        return cross_caches, mask

    def _decoding_caches(self, batch, length, encoder_token_ids, encoder_padding_mask):
        """`(self caches, cross caches, source mask)` of the layers' step."""
        cross_caches, mask = self._cross_caches(encoder_token_ids, encoder_padding_mask)
        self_caches = tuple(
            kv_cache.empty(
                batch, length, b.num_key_value_heads or b.num_heads,
                self.hidden_dim // self.num_heads, self.compute_dtype,
            )
            for b in self.decoder.blocks
        )
        return self_caches, cross_caches, mask

    def _decoding_step(self, token_ids, caches, index):
        """`T` target tokens at positions `index ..` through the decoder
        with its caches: `(logits (B, T, V), caches)`."""
        self_caches, cross_caches, mask = caches
        x = self._embed(token_ids, "target", start_index=index)
        updated = []
        for block, self_cache, cross_cache in zip(self.decoder.blocks, self_caches, cross_caches):
            x, self_cache, _ = block(
                x,
                self_attention_cache=self_cache,
                self_attention_cache_update_index=index,
                cross_attention_cache=cross_cache,
                encoder_padding_mask=mask,
            )
            updated.append(self_cache)
        if self.decoder.output_layer_norm is not None:
            x = self.decoder.output_layer_norm(x)
        return self.token_embedding(x, reverse=True), (tuple(updated), cross_caches, mask)

    @staticmethod
    def _reorder_caches(caches, rows):
        """Beam search's reordering: the self-attention caches follow the
        hypotheses; the cross caches and the source mask are the same for
        every beam of a source, so they stay as they are."""
        self_caches, cross_caches, mask = caches
        return beam_search.take_rows(self_caches, rows), cross_caches, mask

    def _get_generator(self):
        return generation.model_generator(
            self, self._decoding_step, self._decoding_caches, self.target_vocabulary_size,
            max_length_name="max_target_length",
            reorder_caches=self._reorder_caches,
            # The decoder reads the pad id as padding: never generated.
            pad_is_padding=True,
        )
