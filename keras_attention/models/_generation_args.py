"""The checks of the generation core's arguments (`generation.Generator`),
shared by every model's `generate`: each raises a `ValueError` that names the
argument and the value received.

Shape legend: `B` batch, `P` prompt length.
"""

import numpy as np

from keras_attention import _validation
from keras_attention import masking
from keras_attention.models import sampling as sampling_lib

# The largest seed: the compiled loop takes it as an int32.
SEED_LIMIT = 2**31 - 1

# Every `sampling` of `Generator.run`: beam search and `sampling_lib`'s.
MODES = ("greedy", "beam") + sampling_lib.SAMPLING[1:]


def check_modes(sampling, num_beams, num_return_sequences):
    """Raises for an unknown `sampling`, a bad `num_beams`, or more returned
    sequences than beams (or than 1 without beam search); returns
    `(num_beams, num_return_sequences)` as ints."""
    if sampling not in MODES:
        raise ValueError(
            f"`sampling` must be one of {MODES}. Received: sampling={sampling!r}"
        )
    num_beams = _validation.check_positive_int("num_beams", num_beams)
    num_return_sequences = _validation.check_positive_int(
        "num_return_sequences", num_return_sequences
    )
    limit = num_beams if sampling == "beam" else 1
    if num_return_sequences > limit:
        raise ValueError(
            "`num_return_sequences` must be at most `num_beams` with "
            "sampling='beam' (1 otherwise). Received: "
            f"num_return_sequences={num_return_sequences}, num_beams={num_beams}, "
            f"sampling={sampling!r}"
        )
    return num_beams, num_return_sequences


def check_length_penalty(length_penalty):
    """Raises unless `length_penalty` is a real number; returns a float."""
    if isinstance(length_penalty, bool) or not isinstance(
        length_penalty, (int, float, np.integer, np.floating)
    ):
        raise ValueError(
            "`length_penalty` must be a float. Received: "
            f"length_penalty={length_penalty!r}"
        )
    return float(length_penalty)


def check_sampling(sampling, temperature, top_k, top_p):
    """Raises for a bad sampling configuration; returns `top_k` as an int."""
    if sampling not in sampling_lib.SAMPLING:
        raise ValueError(
            f"`sampling` must be one of {sampling_lib.SAMPLING}. Received: "
            f"sampling={sampling!r}"
        )
    if isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float)) and temperature > 0
    ):
        raise ValueError(
            "`temperature` must be a positive float. Received: "
            f"temperature={temperature!r}"
        )
    if sampling == "top_k":
        top_k = _validation.check_positive_int("top_k", top_k)
    if sampling == "top_p" and not (
        isinstance(top_p, (int, float)) and 0 < top_p <= 1
    ):
        raise ValueError(
            f"`top_p` must be a float in (0, 1]. Received: top_p={top_p!r}"
        )
    return top_k


def prompt_lengths(prompt, prompt_padding_mask, names=("prompt_ids", "prompt_padding_mask")):
    """Each row's prompt length `(B,)`, the mask's True prefix; `names`: the
    arguments the prompt and the mask came as."""
    batch, prompt_length = prompt.shape
    mask = _validation.to_numpy(prompt_padding_mask).astype(bool)
    lengths = mask.sum(axis=1)
    wrong_rows = None  # (B,): rows that are not a non-empty prefix
    if mask.shape == prompt.shape:
        prefix = np.arange(prompt_length)[None] < lengths[:, None]  # (B, P)
        wrong_rows = (mask != prefix).any(axis=1) | (lengths == 0)
    if wrong_rows is None or wrong_rows.any():
        wrong = f"a mask of shape {mask.shape}"
        if wrong_rows is not None:
            row = int(np.argmax(wrong_rows))
            wrong = f"row {row} of the mask: {mask[row].astype(int).tolist()}"
        raise ValueError(
            f"`{names[1]}` must have the shape of `{names[0]}` "
            "and mark a non-empty prefix of each row (right padding). "
            f"Received: {wrong}"
        )
    return lengths


def check_stop(stop_token_ids, pad_token_id, vocabulary_size):
    """Raises unless every stop id and the pad id are ids of the
    vocabulary; returns the stop ids as a tuple of ints."""
    stop = tuple(int(t) for t in (stop_token_ids or ()))
    for token in stop + (pad_token_id,):
        if not 0 <= token < vocabulary_size:
            raise ValueError(
                "`stop_token_ids` and `pad_token_id` must be ids in "
                f"[0, {vocabulary_size}). Received: {token}"
            )
    return stop


def token_batch(name, ids, vocabulary_size, max_length, limit_name):
    """`ids` as numpy `(B, L)`: raises unless `L >= 1`, `L <= max_length`
    (the model's `limit_name`) and every id is one of the vocabulary's."""
    array = _validation.to_numpy(ids)
    if array.ndim != 2 or array.shape[1] == 0:
        raise ValueError(
            f"`{name}` must have shape (batch, length) with length >= 1. "
            f"Received: {name} with shape {array.shape}"
        )
    _validation.check_token_ids(
        name, _validation.known_token_ids(name, array), vocabulary_size, max_length, limit_name
    )
    return array


def check_prompt(model, prompt_ids, prompt_padding_mask):
    """A causal LM's prompts as numpy `(B, P)`, and their mask or None."""
    prompt = token_batch(
        "prompt_ids", prompt_ids, model.vocabulary_size, model.max_sequence_length,
        "max_sequence_length",
    )
    if prompt_padding_mask is not None:
        prompt_padding_mask = masking.standardize_numpy_mask(
            prompt_padding_mask, "prompt_padding_mask", prompt.shape
        )
    return prompt, prompt_padding_mask


def check_source(model, encoder_token_ids, encoder_padding_mask):
    """A translation model's sources as numpy `(B, S)` and their mask: the
    given one, or the positions that are not the model's pad id."""
    source = token_batch(
        "encoder_token_ids", encoder_token_ids, model.source_vocabulary_size,
        model.max_source_length, "max_source_length",
    )
    if encoder_padding_mask is None:
        return source, source != model.pad_token_id
    return source, masking.standardize_numpy_mask(
        encoder_padding_mask, "encoder_padding_mask", source.shape
    )


def check_start_and_end(generator, start_token_id, end_token_id, pad_token_id):
    """A translation's start ids (one, or several: BART's decoder prompt) and
    end id, checked; the end id may not be the pad id, which the decoder
    reads as padding and never generates."""
    start_ids = [generator.check_token("start_token_id", i) for i in np.ravel(start_token_id)]
    return start_ids, check_end(generator, end_token_id, pad_token_id)


def require_with_ids(**arguments):
    """Raises for the arguments of a translation's `generate` that sources
    given as ids need (KerasHub's input dictionary holds the prompts)."""
    for name, value in arguments.items():
        if value is None:
            raise ValueError(
                f"`{name}` is required with sources given as ids (KerasHub's input "
                f"dictionary holds the decoder prompts). Received: {name}=None"
            )


def check_end(generator, end_token_id, pad_token_id):
    """A translation's end id (or None), checked: not the pad id."""
    if end_token_id is None:
        return None
    end_token_id = generator.check_token("end_token_id", end_token_id)
    if end_token_id == pad_token_id:
        raise ValueError(
            "`end_token_id` must differ from the model's `pad_token_id`, "
            "which the decoder reads as padding and never generates. "
            f"Received: end_token_id={end_token_id}, pad_token_id={pad_token_id}"
        )
    return end_token_id


def strip_prompts(result, prompt, prompt_padding_mask, max_new_tokens):
    """`generate`'s `result` (ids `(B, L)` or `(B, R, L)`, with scores when a
    tuple) with each row's `max_new_tokens` new tokens only, taken from the
    end of its own prompt: `(B, N)` or `(B, R, N)`."""
    ids, *scores = result if isinstance(result, tuple) else (result,)
    lengths = np.full(prompt.shape[0], prompt.shape[1])
    if prompt_padding_mask is not None:
        lengths = prompt_lengths(prompt, prompt_padding_mask)
    positions = lengths[:, None] + np.arange(max_new_tokens)  # (B, N)
    if ids.ndim == 3:
        positions = np.broadcast_to(positions[:, None], ids.shape[:2] + (max_new_tokens,))
    new = np.take_along_axis(ids, positions, axis=-1)
    return (new, *scores) if scores else new
