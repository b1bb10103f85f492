"""Text in, text out for each kind of model: `generate` on prompts,
`fill_mask` on texts with mask tokens, `translate` on sources, through the
model's KerasHub preprocessor (`keras_attention.models._text.TextModel`), and
the mixins that give each model its KerasHub task.

Shape legend: `B` batch, `P` prompt length, `L` output length.
"""

from typing import Any

import numpy as np

from keras_attention.models._text import TextModel
from keras_attention.models._text import new_token_count
from keras_attention.models._text import special_token_id
from keras_attention.models._text import to_numpy
from keras_attention.models._text import to_strings


def generate_text(model, prompts, max_new_tokens=None, max_length=None, **kwargs):
    """`GPT.generate` on text: each prompt with its continuation, as text.

    The preprocessor's `generate_preprocess` makes the ids (its start token
    first), the rows end at the tokenizer's end token unless
    `stop_token_ids` says otherwise, and `generate_postprocess` turns the
    output back into text (the special tokens stripped). Without
    `max_new_tokens` or `max_length`, `max_length` is the preprocessor's
    `sequence_length`, as in KerasHub.
    """
    preprocessor = model.require_preprocessor("generate")
    tokenizer = preprocessor.tokenizer
    texts = [prompts] if isinstance(prompts, str) else [str(p) for p in np.asarray(prompts).reshape(-1)]
    if max_new_tokens is None and max_length is None:
        max_length = preprocessor.sequence_length
    # One position more than the model holds: a prompt that fills it is too
    # long, which the packer would otherwise cut silently.
    limit = model.max_sequence_length + 1
    packed = preprocessor.generate_preprocess(texts, sequence_length=limit)
    ids = to_numpy(packed["token_ids"]).astype("int32")  # (B, limit)
    mask = to_numpy(packed["padding_mask"]).astype(bool)  # (B, limit)
    lengths = mask.sum(axis=1)  # (B,)
    if lengths.max() >= limit:
        row = int(np.argmax(lengths))
        raise ValueError(
            f"`prompt` {row} is longer than the model's max_sequence_length "
            f"({model.max_sequence_length} tokens). Received: {texts[row][:60]!r}..."
        )
    prompt_length, shortest = int(lengths.max()), int(lengths.min())
    new = new_token_count(max_new_tokens, max_length, prompt_length)
    if kwargs.get("stop_token_ids") is None:
        kwargs["stop_token_ids"] = [tokenizer.end_token_id]
    kwargs["pad_token_id"] = tokenizer.pad_token_id
    if max_length is not None and max_length > model.max_sequence_length:
        raise ValueError(
            f"`max_length` must be at most the model's max_sequence_length "
            f"({model.max_sequence_length}). Received: max_length={max_length}"
        )
    if max_length is not None:
        # KerasHub's `max_length`: every row continues to `max_length`
        # tokens, a shorter prompt with more new ones. Each row gets the new
        # tokens of the shortest, and is cut at `max_length`; rows decode
        # independently, so the cut rows are what a row alone would give.
        new = max_length - shortest
        if prompt_length + new > model.max_sequence_length:
            # Too long for one call: one call per prompt length.
            output = np.full((len(texts), max_length), tokenizer.pad_token_id, "int32")
            for length in np.unique(lengths):
                rows = np.flatnonzero(lengths == length)
                output[rows] = model.generate(ids[rows, :length], max_length - int(length), **kwargs)
            return _postprocess_generated(preprocessor, output, lengths, max_length, kwargs, prompts)
    ids, mask = ids[:, :prompt_length], mask[:, :prompt_length]  # (B, P)
    output = model.generate(
        ids, new, prompt_padding_mask=None if mask.all() else mask, **kwargs
    )  # (B, P + new)
    limits = lengths + new if max_length is None else np.full_like(lengths, max_length)
    return _postprocess_generated(preprocessor, output, lengths, limits, kwargs, prompts)


def check_text_generation(**arguments):
    """Refuses the id-level arguments of `generate` that text does not take:
    `arguments` maps each name to `(value, default)`. The preprocessor makes
    the padding and its tokenizer gives the pad id; a string comes back per
    prompt, without scores."""
    for name, (value, default) in arguments.items():
        if value is not default and not (isinstance(value, (bool, int)) and value == default):
            raise ValueError(
                f"`{name}` is for prompts of ids; with text the preprocessor makes the "
                f"padding and one string comes back per prompt. Received: {name}={value!r:.60}"
            )


def _postprocess_generated(preprocessor, output, lengths, limits, kwargs, prompts):
    """The text of `output` `(B, L)`: each row's prompt (`lengths`), then its
    new tokens up to `limits` and its first stop token (stripped, with the
    other special tokens, by `generate_postprocess`)."""
    positions = np.arange(output.shape[1])[None, :]  # (1, L)
    generated = positions >= lengths[:, None]  # (B, L)
    stops = np.isin(output, np.asarray(kwargs["stop_token_ids"], "int32")) & generated
    first_stop = np.where(stops.any(axis=1), stops.argmax(axis=1), output.shape[1])
    real = (positions < np.broadcast_to(limits, lengths.shape)[:, None]) & (
        positions <= first_stop[:, None]
    )
    strings = to_strings(
        preprocessor.generate_postprocess({"token_ids": output, "padding_mask": real})
    )
    return strings[0] if isinstance(prompts, str) else strings


def _tokenize(tokenizer, text):
    return to_numpy(tokenizer(text)).astype("int32").reshape(-1)


def fill_mask_text(model, texts, top_k):
    """`BertMaskedLM.fill_mask` on text: for each `[MASK]` (the tokenizer's
    mask token) of each text, the `top_k` most likely tokens as
    `(token, probability)` pairs, most likely first."""
    preprocessor = model.require_preprocessor("fill_mask")
    tokenizer = preprocessor.tokenizer
    single = isinstance(texts, str)
    texts = [texts] if single else [str(t) for t in np.asarray(texts).reshape(-1)]
    mask_token = tokenizer.id_to_token(tokenizer.mask_token_id)
    rows = []
    for index, text in enumerate(texts):
        pieces = text.split(mask_token)
        if len(pieces) == 1:
            raise ValueError(
                f"Every text must hold the mask token {mask_token!r}. Received: text {index} "
                f"= {text[:60]!r}"
            )
        ids = [tokenizer.cls_token_id]
        for i, piece in enumerate(pieces):
            if i:
                ids.append(tokenizer.mask_token_id)
            ids.extend(_tokenize(tokenizer, piece).tolist())
        ids.append(tokenizer.sep_token_id)
        if len(ids) > model.max_sequence_length:
            raise ValueError(
                f"Text {index} is {len(ids)} tokens long with [CLS] and [SEP], more than the "
                f"model's max_sequence_length ({model.max_sequence_length}). Received: "
                f"{text[:60]!r}"
            )
        rows.append(ids)
    width = max(len(r) for r in rows)
    token_ids = np.full((len(rows), width), tokenizer.pad_token_id, "int32")  # (B, T)
    for row, ids in enumerate(rows):
        token_ids[row, : len(ids)] = ids
    padding_mask = np.arange(width)[None, :] < np.array([len(r) for r in rows])[:, None]
    results = model.fill_mask(
        token_ids, tokenizer.mask_token_id, top_k=top_k, padding_mask=padding_mask
    )
    words = [
        [
            [(tokenizer.id_to_token(int(i)), float(p)) for i, p in zip(ids, probabilities)]
            for _, ids, probabilities in row
        ]
        for row in results
    ]
    return words[0] if single else words


def translate_text(model, texts, max_length=None, **kwargs):
    """`Seq2SeqTransformer.translate`: the translations of `texts`, as text.

    The preprocessor packs the sources and the decoder's start (its
    `generate_preprocess` with an empty target); decoding stops at the
    tokenizer's end token; `generate_postprocess` strips the special tokens.
    `max_length` is the target's length with its start (default: the
    preprocessor's `decoder_sequence_length`, at most the model's
    `max_target_length`).
    """
    check_text_generation(
        **{
            name: (kwargs[name], default)
            for name, default in [
                ("num_return_sequences", 1), ("return_scores", False),
                ("encoder_padding_mask", None), ("start_token_id", None),
            ]
            if name in kwargs
        }
    )
    preprocessor = model.require_preprocessor("translate")
    single = isinstance(texts, str)
    texts = [texts] if single else [str(t) for t in np.asarray(texts).reshape(-1)]
    if max_length is None:
        max_length = min(
            getattr(preprocessor, "decoder_sequence_length", None) or model.max_target_length,
            model.max_target_length,
        )
    limit = model.max_source_length + 1
    packed = preprocessor.generate_preprocess(texts, encoder_sequence_length=limit)
    source = to_numpy(packed["encoder_token_ids"]).astype("int32")  # (B, limit)
    source_mask = to_numpy(packed["encoder_padding_mask"]).astype(bool)
    lengths = source_mask.sum(axis=1)
    if lengths.max() >= limit:
        row = int(np.argmax(lengths))
        raise ValueError(
            f"Text {row} is longer than the model's max_source_length "
            f"({model.max_source_length} tokens). Received: {texts[row][:60]!r}"
        )
    width = int(lengths.max())
    start = to_numpy(packed["decoder_token_ids"])[0]
    start = start[to_numpy(packed["decoder_padding_mask"])[0].astype(bool)].astype("int32")
    new = new_token_count(None, max_length, len(start))
    end = kwargs.pop("end_token_id", special_token_id(preprocessor, "end_token_id"))
    output = model.generate(
        source[:, :width],
        new,
        start_token_id=int(start[0]) if len(start) == 1 else start.tolist(),
        end_token_id=end,
        encoder_padding_mask=source_mask[:, :width],
        **kwargs,
    )  # (B, len(start) + new)
    positions = np.arange(output.shape[1])[None, :]
    ends = (output == end) & (positions >= len(start))
    first_end = np.where(ends.any(axis=1), ends.argmax(axis=1), output.shape[1])
    real = positions <= first_end[:, None]
    strings = to_strings(
        preprocessor.generate_postprocess(
            {"decoder_token_ids": output, "decoder_padding_mask": real}
        )
    )
    return strings[0] if single else strings


class CausalTextModel(TextModel):
    """`TextModel` of a causal LM: KerasHub's `CausalLM` presets."""

    keras_hub_task = "CausalLM"


class MaskedTextModel(TextModel):
    """`TextModel` of a masked LM: KerasHub's `MaskedLM` presets."""

    keras_hub_task = "MaskedLM"


class TranslationTextModel(TextModel):
    """`TextModel` of an encoder-decoder: KerasHub's `Seq2SeqLM` presets,
    and `translate`, text to text."""

    keras_hub_task = "Seq2SeqLM"

    def translate(
        self, texts: str | list[str], max_length: int | None = None, sampling: str = "greedy",
        **kwargs: Any,
    ) -> str | list[str]:
        """The translations of `texts` (a string or a list of strings), as text.

        Needs a `preprocessor` (`from_preset` sets it; for two vocabularies,
        `keras_attention.models.TranslationPreprocessor`).

        Args:
            texts: a string or a list of strings, the sources.
            max_length: the longest target, its start token(s) included
                (default: the preprocessor's `decoder_sequence_length`, at
                most `max_target_length`).
            sampling: as `generate` (`"greedy"`, `"beam"`, ...).
            **kwargs: other `generate` arguments (`num_beams`, `seed`, ...).

        Returns:
            A string per source (a string for a string).
        """
        return translate_text(self, texts, max_length, sampling=sampling, **kwargs)
