"""Text in, text out for each kind of model: `generate` on prompts,
`fill_mask` on texts with mask tokens, `translate` on sources, through the
model's KerasHub preprocessor (`keras_attention.models._text.TextModel`), and
the mixins that give each model its KerasHub task.

Shape legend: `B` batch, `P` prompt length, `L` output length.
"""

from typing import Any

import keras
import numpy as np

from keras_attention.models import _continuation
from keras_attention.models import _text
from keras_attention.models._text import TextModel
from keras_attention.models._text import import_keras_hub
from keras_attention.models._text import new_token_count
from keras_attention.models._text import special_token_id
from keras_attention.models._text import to_numpy
from keras_attention.models._text import to_strings


def generate_inputs(
    model, inputs, max_new_tokens, max_length, prompt_padding_mask, pad_token_id,
    num_return_sequences, return_scores, strip_prompt=False, **kwargs,
):
    """`GPT.generate` on text (`generate_text`) or on KerasHub's input
    dictionary (`generate_packed`), refusing the id-level arguments each
    cannot honour."""
    refused = dict(prompt_padding_mask=(prompt_padding_mask, None),
                   num_return_sequences=(num_return_sequences, 1),
                   return_scores=(return_scores, False))
    if isinstance(inputs, dict):
        check_text_generation(**refused)
        return generate_packed(
            model, inputs, max_new_tokens, max_length, strip_prompt,
            pad_token_id=pad_token_id, **kwargs,
        )
    check_text_generation(pad_token_id=(pad_token_id, 0), **refused)
    return generate_text(model, inputs, max_new_tokens, max_length, strip_prompt, **kwargs)


def generate_text(model, prompts, max_new_tokens=None, max_length=None, strip_prompt=False,
                  **kwargs):
    """`GPT.generate` on text: each prompt with its continuation, as text.

    The preprocessor's `generate_preprocess` makes the ids (its start token
    first), the rows end at the tokenizer's end token unless
    `stop_token_ids` says otherwise, and `generate_postprocess` turns the
    output back into text (the special tokens stripped). Without
    `max_new_tokens` or `max_length`, `max_length` is the preprocessor's
    `sequence_length`, as in KerasHub. With `strip_prompt`, the
    continuations alone.
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
    if kwargs.get("stop_token_ids") is None:
        kwargs["stop_token_ids"] = model.stop_token_arguments("auto")
    kwargs["pad_token_id"] = tokenizer.pad_token_id
    output, limits = _continuation.continue_rows(
        _continuation.all_rows(model.generate), ("max_sequence_length", model.max_sequence_length),
        ids, mask, max_new_tokens, max_length, **kwargs,
    )
    real = _continuation.real_tokens(
        output, lengths, limits, kwargs["stop_token_ids"], strip_prompt
    )
    strings = to_strings(
        preprocessor.generate_postprocess({"token_ids": output, "padding_mask": real})
    )
    return strings[0] if isinstance(prompts, str) else strings


def generate_packed(model, inputs, max_new_tokens=None, max_length=None, strip_prompt=False,
                    **kwargs):
    """`GPT.generate` on KerasHub's input dictionary `{"token_ids",
    "padding_mask"}`, as KerasHub's `generate` without a preprocessor
    (`continue_packed`)."""
    ids, extra = _text.unpack_token_inputs(inputs, {}, "GPT.generate")
    output, real = _continuation.continue_packed(
        _continuation.all_rows(model.generate), ("max_sequence_length", model.max_sequence_length),
        ("token_ids", "padding_mask"), to_numpy(ids), extra.get("padding_mask"), max_new_tokens,
        max_length, strip_prompt,
        **kwargs,
    )
    return {"token_ids": output, "padding_mask": real}


def check_text_generation(**arguments):
    """Refuses the arguments of `generate` on an id array that text (or an
    input dictionary) does not take: `arguments` maps each name to `(value,
    default)`. The preprocessor (the dictionary) gives the padding and the
    tokenizer the pad id; one sequence comes back per prompt, without scores."""
    for name, (value, default) in arguments.items():
        if value is not default and not (isinstance(value, (bool, int)) and value == default):
            raise ValueError(
                f"`{name}` is for prompts given as an id array; with text or an input "
                "dictionary, the padding comes with the prompts and one sequence comes "
                f"back per prompt. Received: {name}={value!r:.60}"
            )


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


# KerasHub's sampler names (`keras_hub.samplers.get`) as `generate`
# arguments, with KerasHub's defaults.
SAMPLER_NAMES = {
    "greedy": {"sampling": "greedy"},
    "random": {"sampling": "random"},
    "top_k": {"sampling": "top_k", "top_k": 5},
    "top_p": {"sampling": "top_p", "top_p": 0.1},
    "beam": {"sampling": "beam", "num_beams": 5},
}


def sampler_options(sampler):
    """The `generate` arguments a KerasHub sampler stands for: a name of
    `SAMPLER_NAMES`, or a `keras_hub.samplers` `GreedySampler`,
    `RandomSampler`, `TopKSampler`, `TopPSampler` or `BeamSampler` of that
    very class (a subclass may choose tokens in code the compiled loop does
    not run). What the loop cannot honour is refused, by name."""
    if sampler is None:
        return {}
    if isinstance(sampler, str):
        if sampler not in SAMPLER_NAMES:
            raise ValueError(
                f"`sampler` must be one of {sorted(SAMPLER_NAMES)} or a KerasHub sampler of "
                f"one of these kinds. Received: sampler={sampler!r}"
            )
        return dict(SAMPLER_NAMES[sampler])
    samplers = import_keras_hub("A KerasHub sampler").samplers
    kind = type(sampler)
    temperature = getattr(sampler, "temperature", 1.0)

    def refuse(why):
        raise ValueError(f"`sampler` {why}. Received: sampler={kind.__name__}")

    if kind is samplers.GreedySampler:
        return {"sampling": "greedy"}
    if kind is samplers.BeamSampler:
        if sampler.return_all_beams:
            refuse("with return_all_beams=True: pass num_return_sequences to generate instead")
        if temperature != 1.0:
            refuse(f"is a BeamSampler with temperature={temperature}: beam search ranks by "
                   "the model's log-probabilities as they are")
        return {"sampling": "beam", "num_beams": sampler.num_beams}
    drawn = {"temperature": temperature, "seed": sampler.seed} if hasattr(sampler, "seed") else {}
    if kind is samplers.RandomSampler:
        return {"sampling": "random", **drawn}
    if kind is samplers.TopKSampler:
        return {"sampling": "top_k", "top_k": sampler.k, **drawn}
    if kind is samplers.TopPSampler:
        if sampler.k is not None:
            refuse(f"is a TopPSampler with k={sampler.k}: top-p sampling here keeps no top-k cut")
        return {"sampling": "top_p", "top_p": sampler.p, **drawn}
    refuse(
        "must be a name or a GreedySampler, RandomSampler, TopKSampler, TopPSampler or "
        "BeamSampler of keras_hub.samplers (the loop runs these, not a sampler's own code)"
    )


class GeneratingTextModel(TextModel):
    """`TextModel` of a model with `generate`: `compile` also takes
    KerasHub's `sampler`, the default of `generate`'s sampling arguments."""

    def compile(
        self, optimizer: Any = "rmsprop", loss: Any = "auto", *, sampler: Any = None,
        **kwargs: Any,
    ) -> None:
        """`TextModel.compile`, and KerasHub's `sampler`: a name (`"greedy"`,
        `"random"`, `"top_k"`, `"top_p"`, `"beam"`, with KerasHub's defaults:
        `k=5`, `p=0.1`, 5 beams) or a `keras_hub.samplers` sampler of those
        kinds. `generate` then samples as it says, unless it is given its own
        `sampling`; its other sampling arguments (`temperature`, `top_k`,
        `top_p`, `seed`, `num_beams`) override the sampler's. None (the
        default, unlike KerasHub's `"top_k"`) leaves `generate` greedy."""
        # Kept out of Keras's tracking, as the preprocessor.
        object.__setattr__(self, "_sampler_options", sampler_options(sampler))
        object.__setattr__(self, "sampler", sampler)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def get_compile_config(self) -> dict:
        """Keras's compile config and the sampler, for `.keras` files."""
        config = super().get_compile_config()
        sampler = getattr(self, "sampler", None)
        if config and sampler is not None:
            config["sampler"] = keras.saving.serialize_keras_object(sampler)
        return config

    def compile_from_config(self, config: dict) -> None:
        if isinstance(config.get("sampler"), dict):
            import_keras_hub("Loading a model compiled with a KerasHub sampler")
        super().compile_from_config(config)

    def sampling_arguments(self, sampling, temperature, top_k, top_p, seed, num_beams):
        """`generate`'s `(sampling, temperature, top_k, top_p, seed,
        num_beams)`: each as given, else (None; `"auto"` for `sampling`) the
        compiled sampler's (unless `sampling` is given), else the default."""
        auto = isinstance(sampling, str) and sampling == "auto"
        options = getattr(self, "_sampler_options", {}) if auto else {}
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     num_beams=num_beams)
        defaults = {"temperature": 1.0, "num_beams": 4}
        return (options.get("sampling", "greedy") if auto else sampling,) + tuple(
            value if value is not None else options.get(name, defaults.get(name))
            for name, value in given.items()
        )


class CausalTextModel(GeneratingTextModel):
    """`TextModel` of a causal LM: KerasHub's `CausalLM` presets and
    `score`."""

    keras_hub_task = "CausalLM"

    def stop_token_arguments(self, stop_token_ids):
        """`stop_token_ids` as given, but KerasHub's `"auto"`: the
        preprocessor's tokenizer's end token(s)."""
        if not (isinstance(stop_token_ids, str) and stop_token_ids == "auto"):
            return stop_token_ids
        if self.preprocessor is None:
            raise ValueError(
                'stop_token_ids="auto" takes the end token of the preprocessor\'s tokenizer, '
                "and this model has no preprocessor: pass the ids, or None to generate every "
                "token. Received: stop_token_ids='auto'"
            )
        tokenizer = self.preprocessor.tokenizer
        ends = [getattr(tokenizer, name, None) for name in ("end_token_id", "end_token2_id")]
        return [end for end in ends if end is not None]

    def score(
        self, token_ids: Any, padding_mask: Any = None, scoring_mode: str = "logits",
        layer_intercept_fn: Any = None, target_ids: Any = None,
    ) -> Any:
        """Per-token scores of `token_ids` `(B, T)`, as KerasHub's
        `CausalLM.score`: the logits `(B, T, V)` (`scoring_mode="logits"`),
        or the cross-entropy of each position's logits against `target_ids`
        `(B, T)` (`"loss"`: `(B, T)`, unreduced), from the model's own
        forward pass (differentiable; `padding_mask` as the model's call:
        the scores at padded positions are no prediction).

        `layer_intercept_fn` is refused: the blocks run as they are. To change
        what a block computes, subclass it and override its `call`, which
        every path of the model honours."""
        if scoring_mode not in ("logits", "loss"):
            raise ValueError(
                "`scoring_mode` must be 'logits' or 'loss'. Received: "
                f"scoring_mode={scoring_mode!r}"
            )
        if scoring_mode == "loss" and target_ids is None:
            raise ValueError("`target_ids` must be given with scoring_mode='loss'. Received: None")
        if layer_intercept_fn is not None:
            raise ValueError(
                "`layer_intercept_fn` is not supported: the blocks run as they are (a block "
                "subclass that overrides `call` changes them on every path). Received: "
                f"layer_intercept_fn={layer_intercept_fn!r:.60}"
            )
        logits = self(token_ids, padding_mask=padding_mask)  # (B, T, V)
        if scoring_mode == "logits":
            return logits
        return keras.losses.sparse_categorical_crossentropy(target_ids, logits, from_logits=True)


class MaskedTextModel(TextModel):
    """`TextModel` of a masked LM: KerasHub's `MaskedLM` presets."""

    keras_hub_task = "MaskedLM"


class TranslationTextModel(GeneratingTextModel):
    """`TextModel` of an encoder-decoder: KerasHub's `Seq2SeqLM` presets,
    and `translate`, text to text."""

    keras_hub_task = "Seq2SeqLM"

    def translate(
        self, texts: str | list[str], max_length: int | None = None,
        sampling: str = "auto", **kwargs: Any,
    ) -> str | list[str]:
        """The translations of `texts` (a string or a list of strings), as text.

        Needs a `preprocessor` (`from_preset` sets it; for two vocabularies,
        `keras_attention.models.TranslationPreprocessor`).

        Args:
            texts: a string or a list of strings, the sources.
            max_length: the longest target, its start token(s) included
                (default: the preprocessor's `decoder_sequence_length`, at
                most `max_target_length`).
            sampling: as `generate` (`"greedy"`, `"beam"`, ...; `"auto"`:
                the sampler given to `compile`, else greedy).
            **kwargs: other `generate` arguments (`num_beams`, `seed`, ...).

        Returns:
            A string per source (a string for a string).
        """
        return translate_text(self, texts, max_length, sampling=sampling, **kwargs)
