"""The KV cache layout, in one place: create, write, read, check.

Shape legend: `B` batch, `L` cache length (slots), `G` key/value heads, `K`
head size, `N` blocks of a stack.

One attention layer's cache is one tensor `(B, 2, L, G, K)`: the keys at
index `KEYS` of axis 1, the values at `VALUES`. A stack of `N` blocks holds
theirs on an axis after the batch, `(B, N, 2, L, G, K)`. Writes use
`ops.slice_update`, so they work inside `ops.while_loop` and under jit.
"""

from keras import ops

from keras_attention import _validation
from keras_attention import masking

KEYS = 0
VALUES = 1


def shape(batch, length, num_heads, head_dim):
    """The shape `(B, 2, L, G, K)` of one layer's cache."""
    return (batch, 2, length, num_heads, head_dim)


def empty(batch, length, num_heads, head_dim, dtype):
    """A zero cache `(B, 2, L, G, K)`: no slot written."""
    return ops.zeros(shape(batch, length, num_heads, head_dim), dtype)


def pack(keys, values):
    """A cache `(B, 2, S, G, K)` holding `keys` and `values` `(B, S, G, K)`."""
    return ops.stack([keys, values], axis=1)


def read(cache):
    """`(keys, values)`, each `(B, L, G, K)`."""
    return cache[:, KEYS], cache[:, VALUES]


def write(cache, keys, values, index):
    """The cache with `keys`/`values` `(B, T, G, K)` at slots `index .. index + T - 1`."""
    update = ops.cast(pack(keys, values), cache.dtype)  # (B, 2, T, G, K)
    return ops.slice_update(cache, [0, 0, index, 0, 0], update)


def write_packed(cache, update, index):
    """`write` for an update already packed `(B, 2, T, G, K)`."""
    return ops.slice_update(cache, [0, 0, index, 0, 0], ops.cast(update, cache.dtype))


def length(cache):
    """The number of slots `L` (static if known) of one layer's cache."""
    static = cache.shape[2]
    return static if static is not None else ops.shape(cache)[2]


def stacked_length(cache):
    """The static number of slots `L` of a stacked `(B, N, 2, L, G, K)`."""
    return cache.shape[3]


def layer_cache(stacked, block):
    """Block `block`'s cache `(B, 2, L, G, K)` of a stacked `(B, N, 2, L, G, K)`."""
    return stacked[:, block]


def stack(caches):
    """Per-block caches as one stacked `(B, N, 2, L, G, K)`."""
    return ops.stack(caches, axis=1)


def check(cache, num_heads, head_dim, name="cache", batch=None):
    """Raises unless `cache` has the shape `(batch, 2, max_length, G, K)`.

    `batch`, if given (the query's batch size), must be the cache's (where
    both are static)."""
    expected = (batch, 2, None, num_heads, head_dim)
    got = tuple(cache.shape)
    if len(got) != 5 or any(
        e is not None and d is not None and d != e for d, e in zip(got, expected)
    ):
        query = "" if batch is None else f" for a query of batch size {batch}"
        raise ValueError(
            f"`{name}` must have shape (batch, 2, max_length, {num_heads}, "
            f"{head_dim}). Received: {name} with shape {got}{query}"
        )


def check_stacked(cache, num_layers, name):
    """Raises unless `cache` has the stacked shape `(batch, N, 2, L, G, K)`."""
    if len(cache.shape) != 6 or cache.shape[1] != num_layers:
        raise ValueError(
            f"`{name}` must have shape (batch, num_layers={num_layers}, 2, "
            f"length, key_value_heads, key_dim). Received: {name} with shape "
            f"{tuple(cache.shape)}"
        )


def check_index(index, new_length, max_length, name="cache_update_index"):
    """Checks where `new_length` positions are written into `max_length` slots.

    `index` is a Python int, a numpy integer or a scalar integer tensor
    (anything else is a `ValueError` naming `name`); whenever its value is
    known (eagerly) it must satisfy `0 <= index` and `index + new_length <=
    max_length`, else a `ValueError`: an index is never clamped silently.

    Returns:
        The index's int value, or None when it is not known (a tensor traced
        by `tf.function`, `jax.jit` or `torch.compile`; see `update`).
    """
    known = _validation.check_integer(name, index)
    if known is not None and (
        known < 0
        or (max_length is not None and new_length is not None and known + new_length > max_length)
    ):
        raise ValueError(
            f"`{name}` out of range: writing {new_length} positions at "
            f"{name}={known} into a cache of max_length={max_length}"
        )
    return known


def check_head_sizes(key_dim, value_dim):
    """A cache holds keys and values in one tensor: their sizes must match."""
    if value_dim != key_dim:
        raise ValueError(
            "A KV cache needs `value_dim == key_dim`. Received: "
            f"key_dim={key_dim}, value_dim={value_dim}"
        )


def update(cache, keys, values, index, known_index=None, written_only=False):
    """An attention call's cache, checked by `check_update`: written at
    `index` and read.

    Args:
        cache: `(B, 2, L, G, K)`, its shape checked (`check`).
        keys, values: the new positions `(B, T, G, K)` (None when `index`
            is None: the cache is read as it is).
        index: where to write, or None.
        known_index: the index's value as `check_update` returned it, or
            None where it is not known.
        written_only: no mask (a known index only): the caller reads only
            the slots written so far (`written_slots`).

    Returns:
        `(cache, keys, values, written)`: the updated cache, all its keys and
        values `(B, L, G, K)`, and the `(T, L)` mask of the slots query `t`
        may see (`0 .. index + t`), or None when reading only or with
        `written_only`.

    An index whose value is known has been range-checked (`check_index`).
    One that is not (traced) cannot be: it is clipped to `[0, L - T]` before
    the write and the mask, so a call never writes outside the cache, and an
    out-of-range traced index writes (and attends to) the nearest slots in
    range, the same on every backend. Keeping a traced index in range is the
    caller's loop's job (`keras_attention.models.generation` checks the
    prompt and length before it starts).
    """
    if index is None:
        return (cache,) + read(cache) + (None,)
    new_length = keys.shape[1]
    if known_index is not None:
        # A Python int where the value is known (eagerly): a backend writes
        # and masks at a constant offset instead of building index tensors.
        index = known_index
    elif new_length is not None and cache.shape[2] is not None:
        index = ops.clip(ops.cast(index, "int32"), 0, cache.shape[2] - new_length)
    cache = write(cache, keys, values, index)
    if written_only:
        return (cache,) + read(cache) + (None,)
    written = masking.causal_mask(
        ops.shape(keys)[1], length(cache), query_start=index
    )  # (T, L): causal among the new positions
    return (cache,) + read(cache) + (written,)


def check_call(cache, index, query_shape, value_shape, num_heads, head_dim, value_dim):
    """The checks of an attention call's `cache` (or None) and `index`
    (`check` and `check_update`); returns the index's value where it is
    known, else None."""
    if index is not None and cache is None:
        raise ValueError(
            "`cache_update_index` needs a `cache`. Received: "
            f"cache=None, cache_update_index={index!r}"
        )
    if cache is None:
        return None
    check(cache, num_heads, head_dim, batch=query_shape[0])
    return check_update(cache, index, query_shape[1], value_shape[1], value_dim)


def check_update(cache, index, query_length, value_length, value_dim):
    """The checks of an attention call with a `cache` of a checked shape
    (`index` None: read only).

    Raises a `ValueError` for value heads of another size than key heads, an
    index that is not an integer or is out of range, or new keys and values
    whose length is not the queries' (a cache update writes the queries' own
    positions). Returns the index's value where it is known, else None.
    """
    check_head_sizes(cache.shape[4], value_dim)
    known = None if index is None else check_index(index, query_length, cache.shape[2])
    if (
        index is not None
        and None not in (value_length, query_length)
        and value_length != query_length
    ):
        raise ValueError(
            "A cache update writes the keys and values of the queries' "
            "own positions, so `value` must have the query's length; "
            "fill a cross-attention cache with `compute_cache`. "
            f"Received: query length={query_length}, value length="
            f"{value_length}, cache_update_index={index!r}"
        )
    return known


def written_slots(end, *tensors):
    """Keys, values `(B, L, ...)` and masks `(..., L)` (or None) cut to the
    slots `0 .. end - 1`.

    Eagerly, where a call's index `i` is known, attending to the `i + T`
    slots written so far with causal attention aligned bottom-right (query
    `t` sees keys `0 .. i + t`) is the masked attention over all `L` slots
    without the mask: its `T x L` mask, the kernel's guards for masked rows
    and masked non-finite values, and the reads of slots that hold nothing.
    """
    keys, values, *masks = tensors
    masks = [None if mask is None else mask[..., :end] for mask in masks]
    return (keys[:, :end], values[:, :end], *masks)
