"""A translation model's cached decoding step, for the generation core.

Shape legend: `B` batch, `S` source length, `L` cache length, `G` key/value
heads, `K` head size, `V` target vocabulary size.

`TranslationDecoding` is a mixin of `Seq2SeqTransformer`: the encoder runs
once per call and each decoder block's cross-attention keys and values are
computed once (the cross caches, with the source mask, ride in the caches
the step carries); the step runs the model's own layers. `generate` on
KerasHub's input dictionary continues each decoder prompt as
`BartSeq2SeqLM.generate` does without a preprocessor.
"""

from keras_attention import _validation
from keras_attention import kv_cache
from keras_attention import masking
from keras_attention.models import _continuation
from keras_attention.models import _generation_args
from keras_attention.models import beam_search
from keras_attention.models import generation

PACKED_KEYS = ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids",
               "decoder_padding_mask")


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

    def _generate_packed(self, inputs, max_new_tokens, end_token_id, strip_prompt, **options):
        """`generate` on KerasHub's input dictionary (`PACKED_KEYS`, the
        masks optional): each row's decoder prompt (its mask's `True`
        prefix) continued to the width `W` of `decoder_token_ids` (or by
        `max_new_tokens`), as `BartSeq2SeqLM.generate` without a
        preprocessor (`_continuation.continue_packed`). Returns KerasHub's
        dictionary of the decoder's ids and its mask, `True` up to each
        row's end token (included)."""
        if not {"encoder_token_ids", "decoder_token_ids"} <= set(inputs) <= set(PACKED_KEYS):
            raise ValueError(
                "A dictionary input of Seq2SeqTransformer.generate holds 'encoder_token_ids', "
                "'decoder_token_ids' and optionally 'encoder_padding_mask', "
                f"'decoder_padding_mask'. Received: keys {sorted(inputs)}"
            )
        source, source_mask = _generation_args.check_source(
            self, inputs["encoder_token_ids"], inputs.get("encoder_padding_mask")
        )
        ids = _generation_args.token_batch(
            "decoder_token_ids", inputs["decoder_token_ids"], self.target_vocabulary_size,
            self.max_target_length, "max_target_length",
        )
        _validation.check_same_dim(
            "decoder_token_ids", ids.shape[0], "encoder_token_ids", source.shape[0], "batch size"
        )
        mask = inputs.get("decoder_padding_mask")
        if mask is not None:
            mask = masking.standardize_numpy_mask(mask, "decoder_padding_mask", ids.shape)
        generator = self._get_generator()
        end_token_id = _generation_args.check_end(generator, end_token_id, self.pad_token_id)
        source = source.astype("int32", copy=False)

        def generate(rows, prompt, new, **kwargs):
            context = (source[rows], source_mask[rows])
            return generator.run(prompt, new, pad_token_id=self.pad_token_id, context=context,
                                 **kwargs)

        output, real = _continuation.continue_packed(
            generate, ("max_target_length", self.max_target_length),
            ("decoder_token_ids", "decoder_padding_mask"), ids.astype("int32"), mask,
            max_new_tokens, None, strip_prompt,
            stop_token_ids=None if end_token_id is None else [end_token_id], **options,
        )
        return {"decoder_token_ids": output, "decoder_padding_mask": real}
