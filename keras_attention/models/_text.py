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

The text versions of `generate`, `fill_mask` and `translate`, and each
model's mixin, are in `_text_tasks.py`.

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


def to_strings(values):
    """The detokenized output of a KerasHub preprocessor as a list of str."""
    if isinstance(values, str):
        return [values]
    array = np.asarray(values.numpy() if hasattr(values, "numpy") else values, dtype=object)
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def to_numpy(value):
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

    def compile_from_config(self, config: dict) -> None:
        """Compiles as `compile(**config)` when a `.keras` file loads (Keras
        skips a custom `compile` there), and builds the optimizer, so that
        its saved state loads too."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built and getattr(self, "optimizer", None) is not None:
            self.optimizer.build(self.trainable_variables)


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
