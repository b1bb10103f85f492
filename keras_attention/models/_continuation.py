"""Prompts continued as KerasHub's `generate` continues them: packed with a
padding mask (right padding), each row after its own prompt, to a width or
by a number of new tokens, with the mask of the real tokens back.

Shape legend: `B` batch, `W` packed width, `P` longest prompt, `L` output
length.
"""

import numpy as np

from keras_attention.models import _generation_args
from keras_attention.models._text import new_token_count
from keras_attention.models._text import to_numpy


def all_rows(generate):
    """`continue_rows`'s `generate` from a model's `generate`, which takes
    the prompts of the rows it is given alone."""
    return lambda rows, *args, **kwargs: generate(*args, **kwargs)


def continue_packed(generate, limit, names, ids, mask, max_new_tokens, max_length, strip_prompt,
                    **kwargs):
    """`(ids, mask)`: the prompts `ids` `(B, W)` packed with their `mask`
    (right padding; None: none) continued as KerasHub's `generate` without a
    preprocessor continues them (`continue_rows`'s `generate` and `limit`):
    by default each row to the width `W` (`max_length` to another width;
    `max_new_tokens` for as many tokens after each prompt), the mask `True`
    up to each row's first stop token (included). With `strip_prompt`, as
    KerasHub's: each row shifted left by its prompt's length, the mask
    `True` on the new tokens only. `names`: the keys of the ids and the
    mask, for errors."""
    mask = np.ones(ids.shape, bool) if mask is None else to_numpy(mask).astype(bool)
    lengths = _generation_args.prompt_lengths(ids, mask, names)
    if max_new_tokens is None and max_length is None:
        if mask.all():  # no position left to fill: the prompts back, as KerasHub's loop
            return ids, np.full(ids.shape, not strip_prompt)
        max_length = ids.shape[-1]
    output, limits = continue_rows(generate, limit, ids, mask, max_new_tokens, max_length, **kwargs)
    stop = kwargs.get("stop_token_ids") or []
    real = real_tokens(output, lengths, limits, stop, strip_prompt)
    if strip_prompt:
        width = output.shape[1]
        shifted = (lengths[:, None] + np.arange(width)) % width  # (B, L)
        output = np.take_along_axis(output, shifted, axis=1)
        real = np.take_along_axis(real, shifted, axis=1)
    return output, real


def continue_rows(generate, limit, ids, mask, max_new_tokens, max_length, **kwargs):
    """`(output (B, L), limits (B,))`: each row of `ids` `(B, W)` continued
    after its prompt (its `mask`'s `True` prefix) by `max_new_tokens`, or to
    `max_length` tokens (KerasHub's meaning: a shorter prompt gets more new
    tokens), by `generate(rows, prompt, new, **kwargs)` (a model's
    `generate` for the `rows` of `ids`) with `kwargs`; a row's tokens stand
    before its limit. `limit`: `(name, value)`, the model's length limit."""
    limit_name, limit = limit
    lengths = mask.sum(axis=1)  # (B,)
    prompt_length, shortest = int(lengths.max()), int(lengths.min())
    # With `max_length`, every row continues to `max_length` tokens, a
    # shorter prompt with more new ones: each row gets the new tokens of the
    # shortest and is cut at `max_length`; rows decode independently, so the
    # cut rows are what a row alone would give. A row as long as it gets no
    # new token, as in KerasHub's loop, but some row must get one.
    longest_or_shortest = prompt_length if max_length is None else shortest
    new = new_token_count(max_new_tokens, max_length, longest_or_shortest)
    if max_length is not None and not prompt_length <= max_length <= limit:
        raise ValueError(
            f"`max_length` must be at least the longest prompt ({prompt_length} tokens) and "
            f"at most the model's {limit_name} ({limit}). Received: max_length={max_length}"
        )
    if max_length is not None and prompt_length + new > limit:
        # Too long for one call: one call per prompt length.
        output = np.full((len(ids), max_length), kwargs.get("pad_token_id", 0), "int32")
        for length in np.unique(lengths):
            rows = np.flatnonzero(lengths == length)
            new = max_length - int(length)  # none for prompts that fill it
            prompt = ids[rows, :length]
            output[rows] = generate(rows, prompt, new, **kwargs) if new else prompt
        return output, np.full_like(lengths, max_length)
    ids, mask = ids[:, :prompt_length], mask[:, :prompt_length]  # (B, P)
    output = generate(
        slice(None), ids, new, prompt_padding_mask=None if mask.all() else mask, **kwargs
    )  # (B, P + new)
    if max_length is None:
        return output, lengths + new
    return output[:, :max_length], np.full_like(lengths, max_length)


def real_tokens(output, lengths, limits, stop_token_ids, new_only=False):
    """bool `(B, L)`: each row's prompt (`lengths`; not with `new_only`),
    then its new tokens before `limits` up to its first stop token, included."""
    positions = np.arange(output.shape[1])[None, :]  # (1, L)
    generated = positions >= lengths[:, None]  # (B, L)
    stops = np.isin(output, np.asarray(stop_token_ids, "int32")) & generated
    first_stop = np.where(stops.any(axis=1), stops.argmax(axis=1), output.shape[1])
    real = (positions < limits[:, None]) & (positions <= first_stop[:, None])
    return real & generated if new_only else real


