"""Text to token ids and back for a translation model with two vocabularies.

KerasHub's `Seq2SeqLMPreprocessor` holds one tokenizer for the source and
the target; a translation model usually has one vocabulary per language.
`TranslationPreprocessor` is that preprocessor with two tokenizers, in
KerasHub's form (a `keras_hub.models.Preprocessor`: `call` for `fit`,
`generate_preprocess` and `generate_postprocess` for generation,
`save_to_preset`), so that `Seq2SeqTransformer.translate` takes and returns
text with it.

This module imports KerasHub (optional for the package): `keras_attention
.models.TranslationPreprocessor` loads it when the name is first used.

Shape legend: `B` batch, `S` encoder length, `T` decoder length.
"""

import os
from typing import Any

import keras
import numpy as np

from keras_attention import _validation
from keras_attention.models import _text

keras_hub = _text.import_keras_hub("keras_attention.models.TranslationPreprocessor")

# The target tokenizer keeps KerasHub's `tokenizer.json` (it is the
# preprocessor's `tokenizer`, whose tokens the model generates); the source
# tokenizer is saved beside it under this name.
SOURCE_TOKENIZER_CONFIG_FILE = "source_tokenizer.json"


@keras.saving.register_keras_serializable(package="keras_attention")
class TranslationPreprocessor(keras_hub.models.Preprocessor):
    """Source and target text to `Seq2SeqTransformer` inputs, with two tokenizers.

    The source is tokenized by `source_tokenizer` and packed to
    `encoder_sequence_length` (cut, optionally between
    `source_start_token_id` and `source_end_token_id`, padded with
    `pad_token_id`). The target is tokenized by `target_tokenizer` and packed
    as `[start] target [end]` to `decoder_sequence_length + 1` tokens: the
    decoder inputs are all but the last (`[start] target`), the labels all
    but the first (`target [end]`), the sample weights 1 on real labels and
    0 on padding, as KerasHub's `Seq2SeqLMPreprocessor` makes them for one
    tokenizer (the end token is a decoder input too, where its label is
    padding: causal attention keeps it from the real positions). A target
    longer than `decoder_sequence_length - 1` tokens is cut, and its end
    token kept.

    `preprocessor(x)` takes KerasHub's dictionary `{"encoder_text": sources,
    "decoder_text": targets}` or the pair `(sources, targets)`;
    `preprocessor(sources, targets)` reads the same (so a `tf.data` dataset
    of `(source, target)` pairs maps through it). Strings or lists of
    strings; it runs in `tf.data` pipelines too.

    The preprocessor's `tokenizer` is the target tokenizer, as in KerasHub:
    the one whose tokens the model generates.

    Args:
        source_tokenizer: a `keras_hub.tokenizers.Tokenizer` of the source
            language (e.g. a `WordPieceTokenizer`). When its `config_file`
            is the target tokenizer's (KerasHub's `"tokenizer.json"` for
            both), it is set to `"source_tokenizer.json"` on this object, so
            that `save_to_preset` writes the two side by side.
        target_tokenizer: a `keras_hub.tokenizers.Tokenizer` of the target
            language, or `None`: `source_tokenizer` for both (one
            vocabulary, as for a model with `share_embeddings=True`).
        encoder_sequence_length: positive int `S`, the packed source length
            (at most the model's `max_source_length`).
        decoder_sequence_length: positive int `T`, the packed decoder input
            and label length (at most the model's `max_target_length`).
        start_token_id: the target id that starts the decoder input; default
            the target tokenizer's `start_token_id` (KerasHub's model
            tokenizers have one; a `WordPieceTokenizer` does not).
        end_token_id: the target id that ends a target (and generation);
            default the target tokenizer's `end_token_id`.
        pad_token_id: the id that pads both sides (the model's
            `pad_token_id`); default the target tokenizer's `pad_token_id`.
        source_start_token_id: optional source id put before each source
            (default: none).
        source_end_token_id: optional source id put after each source
            (default: none).
        **kwargs: base layer arguments (`name`, ...).

    Call arguments:
        x: `{"encoder_text", "decoder_text"}`, or `(sources, targets)`, or
            the sources (with the targets in `y`).
        y: the targets when `x` holds the sources only; else `None`.
        sample_weight: must be `None`: the weights come from the padding.
        encoder_sequence_length: optional int, overrides the attribute for
            this call.
        decoder_sequence_length: optional int, likewise.

    Returns:
        `(x, y, sample_weight)`: `x` the model's inputs
        `{"encoder_token_ids" (B, S), "encoder_padding_mask" (B, S),
        "decoder_token_ids" (B, T), "decoder_padding_mask" (B, T)}`, `y` the
        labels `(B, T)`, `sample_weight` bool `(B, T)`.

    Example:

    >>> import keras_hub
    >>> source = keras_hub.tokenizers.WordPieceTokenizer(
    ...     vocabulary=["[PAD]", "[UNK]", "[START]", "[END]", "the", "cat"])
    >>> target = keras_hub.tokenizers.WordPieceTokenizer(
    ...     vocabulary=["[PAD]", "[UNK]", "[START]", "[END]", "el", "gato"])
    >>> preprocessor = TranslationPreprocessor(source, target,
    ...     encoder_sequence_length=4, decoder_sequence_length=4,
    ...     start_token_id=2, end_token_id=3, pad_token_id=0)
    >>> x, y, weights = preprocessor(("the cat", "el gato"))
    >>> [int(i) for i in x["encoder_token_ids"]]
    [4, 5, 0, 0]
    >>> [int(i) for i in x["decoder_token_ids"]], [int(i) for i in y]
    ([2, 4, 5, 3], [4, 5, 3, 0])
    >>> [bool(w) for w in weights]
    [True, True, True, False]
    >>> preprocessor.generate_postprocess({"decoder_token_ids": [[2, 5, 4, 3, 0]]})
    ['gato el']
    """

    def __init__(
        self,
        source_tokenizer: Any,
        target_tokenizer: Any = None,
        encoder_sequence_length: int = 128,
        decoder_sequence_length: int = 128,
        start_token_id: int | None = None,
        end_token_id: int | None = None,
        pad_token_id: int | None = None,
        source_start_token_id: int | None = None,
        source_end_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (
            ("source_tokenizer", source_tokenizer), ("target_tokenizer", target_tokenizer),
        ):
            if not (value is None and name == "target_tokenizer") and not isinstance(
                value, keras_hub.tokenizers.Tokenizer
            ):
                raise TypeError(
                    f"`{name}` must be a keras_hub.tokenizers.Tokenizer (e.g. a "
                    f"WordPieceTokenizer). Received: {name}={value!r:.80} (of type "
                    f"{type(value).__name__})"
                )
        self.shared = target_tokenizer is None or target_tokenizer is source_tokenizer
        target_tokenizer = source_tokenizer if target_tokenizer is None else target_tokenizer
        if not self.shared and source_tokenizer.config_file == target_tokenizer.config_file:
            # Two tokenizers saved into one preset need two file names.
            source_tokenizer.config_file = SOURCE_TOKENIZER_CONFIG_FILE
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer
        self.tokenizer = target_tokenizer
        check = _validation.check_positive_int
        self.encoder_sequence_length = check("encoder_sequence_length", encoder_sequence_length)
        self.decoder_sequence_length = check("decoder_sequence_length", decoder_sequence_length)
        self.start_token_id = self._token_id("start_token_id", start_token_id, target_tokenizer)
        self.end_token_id = self._token_id("end_token_id", end_token_id, target_tokenizer)
        self.pad_token_id = self._token_id("pad_token_id", pad_token_id, target_tokenizer)
        self.source_start_token_id = self._token_id(
            "source_start_token_id", source_start_token_id, source_tokenizer, optional=True
        )
        self.source_end_token_id = self._token_id(
            "source_end_token_id", source_end_token_id, source_tokenizer, optional=True
        )
        for side, start, end in (
            ("encoder", self.source_start_token_id, self.source_end_token_id),
            ("decoder", self.start_token_id, self.end_token_id),
        ):
            packer = keras_hub.layers.StartEndPacker(
                sequence_length=getattr(self, f"{side}_sequence_length"),
                start_value=start,
                end_value=end,
                pad_value=self.pad_token_id,
                return_padding_mask=True,
                name=f"{side}_packer",
            )
            setattr(self, f"{side}_packer", packer)

    @staticmethod
    def _token_id(name, value, tokenizer, optional=False):
        """`value` checked as an id of `tokenizer`'s vocabulary (when it has
        one yet: a tokenizer made from a config gets it from the preset's
        assets), or the tokenizer's own `name` for `None`."""
        if value is None and not optional:
            value = getattr(tokenizer, name, None)
            if value is None:
                raise ValueError(
                    f"`{name}` must be given: the tokenizer ({type(tokenizer).__name__}) "
                    f"has no `{name}` of its own. Received: {name}=None"
                )
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative int. Received: {name}={value!r}")
        size = _vocabulary_size(tokenizer)
        if size is not None and value >= size:
            raise ValueError(
                f"`{name}` must be an id of its tokenizer's vocabulary of {size} tokens. "
                f"Received: {name}={value}"
            )
        return int(value)

    def _texts(self, x, y):
        """`(sources, targets)` of the call's `x` and `y` (eager lists as
        lists; tensors, as a `tf.data` map passes them, as they are)."""
        if isinstance(x, dict):
            unknown = sorted(set(x) - {"encoder_text", "decoder_text"})
            if "encoder_text" not in x or "decoder_text" not in x or unknown:
                raise ValueError(
                    "A dictionary input of TranslationPreprocessor holds 'encoder_text' and "
                    f"'decoder_text'. Received: keys {sorted(x)}"
                )
            sources, targets = x["encoder_text"], x["decoder_text"]
        elif isinstance(x, tuple) and len(x) == 2 and y is None:
            sources, targets = x
        else:
            sources, targets = x, y
        if targets is None:
            raise ValueError(
                "TranslationPreprocessor needs the targets to make labels: pass "
                "{'encoder_text': sources, 'decoder_text': targets}, (sources, targets), or "
                "the targets as `y`. Received: no targets (y=None)"
            )
        return _text_list(sources), _text_list(targets)

    def call(
        self, x: Any, y: Any = None, sample_weight: Any = None, *,
        encoder_sequence_length: int | None = None, decoder_sequence_length: int | None = None,
    ) -> tuple:
        if sample_weight is not None:
            raise ValueError(
                "`sample_weight` must be None: TranslationPreprocessor makes the weights "
                f"from the padding. Received: sample_weight={sample_weight!r:.60}"
            )
        sources, targets = self._texts(x, y)
        encoder_ids, encoder_mask = self.encoder_packer(
            self.source_tokenizer(sources),
            sequence_length=encoder_sequence_length or self.encoder_sequence_length,
        )  # (B, S)
        decoder_length = decoder_sequence_length or self.decoder_sequence_length
        ids, mask = self.decoder_packer(
            self.target_tokenizer(targets), sequence_length=decoder_length + 1
        )  # (B, T + 1): [start] target [end] [pad]...
        inputs = {
            "encoder_token_ids": encoder_ids,
            "encoder_padding_mask": encoder_mask,
            "decoder_token_ids": ids[..., :-1],  # (B, T)
            "decoder_padding_mask": mask[..., :-1],
        }
        return keras.utils.pack_x_y_sample_weight(inputs, ids[..., 1:], mask[..., 1:])

    def generate_preprocess(
        self,
        x: Any,
        *,
        encoder_sequence_length: int | None = None,
        decoder_sequence_length: int | None = None,
    ) -> dict:
        """The sources as model inputs for generation: the packed sources and
        the decoder's start (`[start]`, then padding; no end token).

        Args:
            x: the sources (a string or a list of strings), or
                `{"encoder_text": sources, "decoder_text": target prompts}`.
            encoder_sequence_length: optional int, overrides the attribute.
            decoder_sequence_length: optional int, overrides the attribute.

        Returns:
            A dict of `"encoder_token_ids"`, `"encoder_padding_mask"` `(B,
            S)`, `"decoder_token_ids"` and `"decoder_padding_mask"` `(B, T)`.
        """
        if isinstance(x, dict):
            sources, prompts = self._texts(x, None)
        else:
            sources = _text_list(x)
            prompts = "" if isinstance(sources, str) else [""] * len(sources)
        encoder_ids, encoder_mask = self.encoder_packer(
            self.source_tokenizer(sources),
            sequence_length=encoder_sequence_length or self.encoder_sequence_length,
        )
        decoder_ids, decoder_mask = self.decoder_packer(
            self.target_tokenizer(prompts),
            sequence_length=decoder_sequence_length or self.decoder_sequence_length,
            add_end_value=False,
        )
        return {
            "encoder_token_ids": encoder_ids,
            "encoder_padding_mask": encoder_mask,
            "decoder_token_ids": decoder_ids,
            "decoder_padding_mask": decoder_mask,
        }

    def generate_postprocess(self, x: dict) -> str | list[str]:
        """The text of generated target ids: the padding (where
        `"decoder_padding_mask"` is False, if given) and the start, end and
        pad ids removed, the rest detokenized by the target tokenizer.

        Args:
            x: a dict with `"decoder_token_ids"` `(B, T)` (or `(T,)`) and
                optionally `"decoder_padding_mask"`.

        Returns:
            A list of strings (a string for one row `(T,)`).
        """
        ids = _text.to_numpy(x["decoder_token_ids"]).astype("int32")
        mask = x.get("decoder_padding_mask")
        keep = np.ones(ids.shape, bool) if mask is None else _text.to_numpy(mask).astype(bool)
        keep &= ~np.isin(ids, [self.start_token_id, self.end_token_id, self.pad_token_id])
        rows = [row[k].tolist() for row, k in zip(np.atleast_2d(ids), np.atleast_2d(keep))]
        texts = _text.to_strings(self.target_tokenizer.detokenize(rows)) if rows else []
        return texts[0] if ids.ndim == 1 else texts

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("tokenizer", None)  # the target tokenizer, saved below
        config.update(
            {
                "source_tokenizer": keras.layers.serialize(self.source_tokenizer),
                "target_tokenizer": (
                    None if self.shared else keras.layers.serialize(self.target_tokenizer)
                ),
                "encoder_sequence_length": self.encoder_sequence_length,
                "decoder_sequence_length": self.decoder_sequence_length,
                "start_token_id": self.start_token_id,
                "end_token_id": self.end_token_id,
                "pad_token_id": self.pad_token_id,
                "source_start_token_id": self.source_start_token_id,
                "source_end_token_id": self.source_end_token_id,
            }
        )
        return config

    @classmethod
    def from_config(cls, config: dict) -> "TranslationPreprocessor":
        config = dict(config)
        for name in ("source_tokenizer", "target_tokenizer"):
            if isinstance(config.get(name), dict):
                config[name] = keras.layers.deserialize(config[name])
        return cls(**config)

    @classmethod
    def from_preset(cls, preset: str | os.PathLike, **kwargs: Any) -> "TranslationPreprocessor":
        """The preprocessor that `save_to_preset` wrote into the folder `preset`.

        The folder holds KerasHub's preset files of a preprocessor:
        `preprocessor.json` (this configuration, the tokenizers'
        included), `tokenizer.json` and `source_tokenizer.json` (the target
        and source tokenizers' configurations) and their vocabularies under
        `assets/tokenizer/` and `assets/source_tokenizer/`.

        Args:
            preset: the path of the folder.
            **kwargs: configuration entries to override (e.g.
                `encoder_sequence_length`).
        """
        preprocessor = _text.load_preprocessor(preset, kwargs)
        if not isinstance(preprocessor, cls):
            raise ValueError(
                f"`preset` holds a {type(preprocessor).__name__}, not a {cls.__name__}. "
                f"Received: preset={str(preset)!r}"
            )
        return preprocessor


def _vocabulary_size(tokenizer):
    """The size of `tokenizer`'s vocabulary, or None before it has one."""
    try:
        return int(tokenizer.vocabulary_size())
    except (ValueError, AttributeError, TypeError, RuntimeError):
        return None


def _text_list(texts):
    """Eager text as a str or a list of str; tensors (`tf.data`) unchanged."""
    if isinstance(texts, (str, bytes)):
        return texts.decode("utf-8") if isinstance(texts, bytes) else texts
    if isinstance(texts, (list, tuple, np.ndarray)):
        return [t.decode("utf-8") if isinstance(t, bytes) else str(t)
                for t in np.asarray(texts, dtype=object).reshape(-1)]
    return texts
