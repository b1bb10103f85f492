"""Text in, text out, as KerasHub's tasks do it: preprocessors, presets and
the default loss, shared by `GPT`, `BertMaskedLM` and `Seq2SeqTransformer`.

`TextModel` is a mixin. A model gets:

- `preprocessor`: a KerasHub preprocessor (or this package's
  `TranslationPreprocessor`), set by `from_preset` or by the user; with one,
  `generate`, `fill_mask` and `translate` take and return strings. It is not
  part of the model's config or weights: it is saved with KerasHub's
  `preprocessor.save_to_preset(folder)`.
- `from_preset(preset)`: a KerasHub preset (a name that KerasHub downloads,
  or a local folder written by KerasHub's `save_to_preset`), loaded as
  KerasHub's task and taken over by the model's `from_keras_hub`,
  preprocessor included; or a folder written by the model's own
  `save_to_preset` (`model.keras` and the preprocessor's preset files).
- `compile(loss="auto")`: the from-logits cross-entropy when no loss is
  given, as KerasHub's tasks compile; `loss=None` is refused (the models add
  no loss of their own: training would report 0 and change nothing).

KerasHub (and TensorFlow, which its string operations run on) is optional:
imported when first needed, with an error that says how to install it.

Shape legend: `B` batch, `P` prompt length, `T` length.
"""

import json
import os
from typing import Any

import keras
import numpy as np


def import_keras_hub(feature: str) -> Any:
    """`keras_hub`, or an `ImportError` saying that `feature` needs it."""
    try:
        import keras_hub
    except ImportError as error:
        raise ImportError(
            f"{feature} needs KerasHub (and TensorFlow, for its string operations): "
            "`pip install keras-hub tensorflow`"
        ) from error
    return keras_hub


# The files of a folder that `TextModel.save_to_preset` writes: the model
# (a `.keras` file), and the preprocessor as KerasHub saves one.
MODEL_FILE = "model.keras"
PREPROCESSOR_FILE = "preprocessor.json"


def load_preprocessor(folder: str | os.PathLike, overrides: dict | None = None) -> Any:
    """The preprocessor saved into `folder` with `save_to_preset` (a KerasHub
    preprocessor or a `TranslationPreprocessor`): its `preprocessor.json`
    deserialized (with `overrides` of its config), then its tokenizers'
    vocabularies read from the folder's assets, as KerasHub's loader does."""
    path = os.path.join(os.fspath(folder), PREPROCESSOR_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"`preset` must be a folder that holds {PREPROCESSOR_FILE} (written by a "
            f"preprocessor's `save_to_preset`). Received: preset={os.fspath(folder)!r}"
        )
    import_keras_hub("Loading a preprocessor")  # registers KerasHub's classes
    # Registers this package's preprocessor for deserialization.
    from keras_attention.models import translation_preprocessor  # noqa: F401

    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    config["config"] = {**config["config"], **(overrides or {})}
    preprocessor = keras.saving.deserialize_keras_object(config)
    preprocessor.load_preset_assets(os.fspath(folder))
    return preprocessor


def special_token_id(preprocessor: Any, name: str) -> Any:
    """The preprocessor's own `name` (e.g. `"end_token_id"`) where it has one,
    as `TranslationPreprocessor`, else its tokenizer's, as KerasHub's."""
    value = getattr(preprocessor, name, None)
    return getattr(preprocessor.tokenizer, name) if value is None else value


def is_text(value: Any) -> bool:
    """Whether `value` is a string or a non-empty list or array of strings."""
    if isinstance(value, str):
        return True
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "US" or (
            value.dtype == object and value.size > 0 and isinstance(value.flat[0], str)
        )
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(item, str) for item in value)
    )


def keras_hub_backbone(value, argument, backbone_classes, owner):
    """The KerasHub backbone of `value` (a backbone, or a task holding one in
    `.backbone`) whose class is one of `backbone_classes` (names); a
    `ValueError` naming `argument` and what it takes otherwise (with the
    `from_preset` call meant, for a preset name or folder)."""
    names = (backbone_classes,) if isinstance(backbone_classes, str) else tuple(backbone_classes)
    backbone = getattr(value, "backbone", value)
    if any(base.__name__ in names for base in type(backbone).__mro__):
        return backbone
    hint = ""
    if isinstance(value, (str, os.PathLike)):
        hint = f" To load a KerasHub preset by name or folder, call {owner}.from_preset({str(value)!r})."
    wanted = " or ".join(f"keras_hub.models.{name}" for name in names)
    raise ValueError(
        f"`{argument}` must be a {wanted}, or a KerasHub task that holds one in "
        f"`.backbone`. Received: {argument} of type {type(value).__name__} "
        f"({value!r:.60}).{hint}"
    )


def _strings(values):
    """The detokenized output of a KerasHub preprocessor as a list of str."""
    if isinstance(values, str):
        return [values]
    array = np.asarray(values.numpy() if hasattr(values, "numpy") else values, dtype=object)
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def _numpy(value):
    return np.asarray(value.numpy() if hasattr(value, "numpy") else keras.ops.convert_to_numpy(value))


class TextModel:
    """The mixin: `preprocessor`, `from_preset`, `compile(loss="auto")`.

    A class sets `keras_hub_task`, the name of KerasHub's task base class
    whose presets it loads (`"CausalLM"`, `"MaskedLM"`, `"Seq2SeqLM"`).
    """

    keras_hub_task = None

    @property
    def preprocessor(self):
        """The preprocessor that turns text into this model's ids, or None."""
        return self.__dict__.get("_text_preprocessor")

    def __setattr__(self, name, value):
        # Kept out of Keras's tracking: the preprocessor is no sublayer, so
        # the model's weights, config and `.keras` file stay what they are.
        if name == "preprocessor":
            if value is not None and not hasattr(value, "tokenizer"):
                raise TypeError(
                    "`preprocessor` must be a KerasHub preprocessor (with a `tokenizer`), "
                    "e.g. keras_hub.models.GPT2CausalLMPreprocessor, or None. Received: "
                    f"preprocessor={value!r:.80} (of type {type(value).__name__})"
                )
            object.__setattr__(self, "_text_preprocessor", value)
            return
        super().__setattr__(name, value)

    def require_preprocessor(self, method: str) -> Any:
        """The preprocessor, or a `ValueError` saying how `method` gets one."""
        if self.preprocessor is None:
            name = type(self).__name__
            raise ValueError(
                f"`{name}.{method}` was given text, but the model has no `preprocessor` to "
                f"turn it into ids: load it with `{name}.from_preset(...)`, set "
                f"`model.preprocessor` to a KerasHub preprocessor, or pass token ids."
            )
        return self.preprocessor

    @classmethod
    def from_preset(
        cls, preset: str | os.PathLike, load_weights: bool = True, **kwargs: Any
    ) -> "TextModel":
        """The model of a KerasHub preset, with its preprocessor.

        Loads the preset as KerasHub's task (`keras_hub.models.<task>
        .from_preset`: the task's weights where the preset holds them, its
        backbone's otherwise), then takes it over with `from_keras_hub`.
        A folder written by this model's own `save_to_preset` (it holds
        `model.keras`) loads that model, in safe mode, and its
        preprocessor.

        Args:
            preset: a KerasHub preset name (downloaded by KerasHub) or the
                path of a local preset folder (KerasHub's `save_to_preset`,
                or the model's).
            load_weights: bool; False keeps KerasHub's random initialization
                (KerasHub presets only).
            **kwargs: other constructor arguments of this model (e.g.
                `dtype`; KerasHub presets only).

        Returns:
            A built model with the preset's weights and `preprocessor`.
        """
        if not isinstance(preset, (str, os.PathLike)):
            raise TypeError(
                "`preset` must be a KerasHub preset name or the path of a preset folder. "
                f"Received: preset={preset!r:.80} (of type {type(preset).__name__})"
            )
        if os.path.isfile(os.path.join(os.fspath(preset), MODEL_FILE)):
            return cls._from_saved_preset(preset, kwargs)
        keras_hub = import_keras_hub(f"{cls.__name__}.from_preset")
        task = getattr(keras_hub.models, cls.keras_hub_task).from_preset(
            str(preset), load_weights=load_weights
        )
        model = cls.from_keras_hub(task, **kwargs)
        model.preprocessor = task.preprocessor
        return model

    @classmethod
    def _from_saved_preset(cls, preset, kwargs):
        """The model and preprocessor that `save_to_preset` wrote to `preset`."""
        if kwargs:
            raise ValueError(
                f"A folder written by {cls.__name__}.save_to_preset loads as saved: "
                f"constructor arguments apply to KerasHub presets only. Received: "
                f"{sorted(kwargs)}"
            )
        model = keras.saving.load_model(
            os.path.join(os.fspath(preset), MODEL_FILE), compile=False
        )
        if not isinstance(model, cls):
            raise ValueError(
                f"`preset` holds a {type(model).__name__}, not a {cls.__name__}. "
                f"Received: preset={os.fspath(preset)!r}"
            )
        if os.path.isfile(os.path.join(os.fspath(preset), PREPROCESSOR_FILE)):
            model.preprocessor = load_preprocessor(preset)
        return model

    def save_to_preset(self, preset_dir: str | os.PathLike) -> None:
        """Saves the model and its preprocessor into the folder `preset_dir`,
        for `from_preset`: the model as `model.keras` (its weights and
        config; it loads in safe mode), the preprocessor (if any) as KerasHub
        saves one (`preprocessor.json`, its tokenizers' configurations and
        vocabularies under `assets/`).

        Args:
            preset_dir: the folder (made if missing).
        """
        os.makedirs(preset_dir, exist_ok=True)
        self.save(os.path.join(os.fspath(preset_dir), MODEL_FILE))
        if self.preprocessor is not None:
            self.preprocessor.save_to_preset(os.fspath(preset_dir))

    def compile(self, optimizer: Any = "rmsprop", loss: Any = "auto", **kwargs: Any) -> None:
        """`keras.Model.compile`, with `loss="auto"` by default: the sparse
        categorical cross-entropy of the logits (`from_logits=True`), as
        KerasHub's tasks compile. `loss=None` is refused: the model adds no
        loss of its own, so training would report a loss of 0 and leave the
        weights as they are."""
        if isinstance(loss, str) and loss == "auto":
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        elif loss is None:
            raise ValueError(
                f"`loss` must be given: {type(self).__name__} adds no loss of its own, so "
                "loss=None would train nothing (a loss of 0). Leave it out for the "
                "from-logits cross-entropy (loss='auto'). Received: loss=None"
            )
        super().compile(optimizer=optimizer, loss=loss, **kwargs)


def new_token_count(max_new_tokens, max_length, prompt_length):
    """`max_new_tokens`, or the new tokens that `max_length` leaves after a
    prompt of `prompt_length` (KerasHub's meaning: the length of the output,
    prompt included); exactly one of the two must be given."""
    if (max_new_tokens is None) == (max_length is None):
        raise ValueError(
            "Pass exactly one of `max_new_tokens` (the tokens to add) and `max_length` "
            "(the output's length, prompt included, as KerasHub's `generate`). Received: "
            f"max_new_tokens={max_new_tokens!r}, max_length={max_length!r}"
        )
    if max_length is None:
        return max_new_tokens
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
        raise ValueError(f"`max_length` must be an int. Received: max_length={max_length!r}")
    if max_length <= prompt_length:
        raise ValueError(
            "`max_length` (the output's length, prompt included) must exceed the prompt's "
            f"length, {prompt_length} tokens. Received: max_length={max_length}"
        )
    return int(max_length) - prompt_length


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
    ids = _numpy(packed["token_ids"]).astype("int32")  # (B, limit)
    mask = _numpy(packed["padding_mask"]).astype(bool)  # (B, limit)
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
    strings = _strings(
        preprocessor.generate_postprocess({"token_ids": output, "padding_mask": real})
    )
    return strings[0] if isinstance(prompts, str) else strings


def _tokenize(tokenizer, text):
    return _numpy(tokenizer(text)).astype("int32").reshape(-1)


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
    source = _numpy(packed["encoder_token_ids"]).astype("int32")  # (B, limit)
    source_mask = _numpy(packed["encoder_padding_mask"]).astype(bool)
    lengths = source_mask.sum(axis=1)
    if lengths.max() >= limit:
        row = int(np.argmax(lengths))
        raise ValueError(
            f"Text {row} is longer than the model's max_source_length "
            f"({model.max_source_length} tokens). Received: {texts[row][:60]!r}"
        )
    width = int(lengths.max())
    start = _numpy(packed["decoder_token_ids"])[0]
    start = start[_numpy(packed["decoder_padding_mask"])[0].astype(bool)].astype("int32")
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
    strings = _strings(
        preprocessor.generate_postprocess(
            {"decoder_token_ids": output, "decoder_padding_mask": real}
        )
    )
    return strings[0] if single else strings


def unpack_token_inputs(inputs, kwargs, owner):
    """KerasHub's input dictionary `{"token_ids", "padding_mask"}` as the
    positional `token_ids` and the `padding_mask` keyword of `kwargs`."""
    unknown = sorted(set(inputs) - {"token_ids", "padding_mask"})
    if "token_ids" not in inputs or unknown:
        raise ValueError(
            f"A dictionary input of {owner} holds 'token_ids' and optionally "
            f"'padding_mask'. Received: keys {sorted(inputs)}"
        )
    if "padding_mask" in inputs:
        if kwargs.get("padding_mask") is not None:
            raise ValueError(
                "`padding_mask` was given twice: in the input dictionary and as an argument."
            )
        kwargs = {**kwargs, "padding_mask": inputs["padding_mask"]}
    return inputs["token_ids"], kwargs


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
