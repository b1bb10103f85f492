"""Boolean attention masks: the one place where masks are built and combined.

Convention, everywhere in `keras_attention`: a mask is boolean and `True`
means "may attend". Integer masks are accepted (0 = masked, anything else =
may attend); float masks are refused, because a float mask is usually meant as
an additive bias and silently reading it as boolean would be wrong.

Shape legend: `B` batch, `H` heads, `T` query length, `S` key length.

- padding masks: `(B, T)` for queries, `(B, S)` for keys and values;
- attention masks: `(B, T, S)`, also `(T, S)` and `(B, H, T, S)`.

Masks combine with AND. Every layer turns its padding masks, Keras implicit
masks, explicit attention mask and causal flag into one attention mask through
`compute_attention_mask`.
"""

import numbers

import keras
import numpy as np
from keras import ops

from keras_attention import _validation
from keras_attention._typing import IntOrTensor
from keras_attention._typing import Tensor


def _is_static_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def causal_mask(
    query_length: IntOrTensor,
    key_length: IntOrTensor | None = None,
    query_start: IntOrTensor | None = None,
) -> Tensor:
    """Returns the boolean causal mask of shape `(query_length, key_length)`.

    Query `i` may attend to keys `0 .. query_start + i`. By default
    `query_start = key_length - query_length`: the mask is bottom-right
    aligned, so when the query block is the end of a longer key sequence (as in
    cached decoding) each query still sees itself and everything before it.
    With `query_length == key_length` this is the usual lower-triangular mask.

    Args:
        query_length: int or scalar integer tensor, the number of queries `T`.
        key_length: int or scalar integer tensor, the number of keys `S`.
            Defaults to `query_length`.
        query_start: optional int or scalar integer tensor, the absolute
            position of the first query among the keys. Defaults to
            `key_length - query_length` (bottom-right alignment). A query
            whose position is below 0 sees no key at all.

    Returns:
        A boolean tensor of shape `(query_length, key_length)`.

    Raises:
        ValueError: if a length is not a positive integer, or `query_start`
            not an integer (a float, even `2.0`, or a float tensor included).

    Example:

    >>> import numpy as np
    >>> np.asarray(causal_mask(2, 4)).astype(int)
    array([[1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    if key_length is None:
        key_length = query_length
    # Python ints, numpy integers and integer tensors (range-checked when
    # their value is known); floats are refused rather than truncated.
    # A known value goes on as a Python int: torch's `arange` takes no numpy
    # array.
    def known(name, value, minimum=None):
        number = _validation.check_integer(name, value, minimum)
        return value if number is None else number

    query_length = known("query_length", query_length, 1)
    key_length = known("key_length", key_length, 1)
    if query_start is None:
        query_start = key_length - query_length
    else:
        query_start = known("query_start", query_start)
    query_positions = ops.arange(query_length, dtype="int32") + ops.cast(
        query_start, "int32"
    )  # (T,)
    key_positions = ops.arange(key_length, dtype="int32")  # (S,)
    return ops.greater_equal(query_positions[:, None], key_positions[None, :])


def sliding_window_mask(
    query_length: IntOrTensor,
    key_length: IntOrTensor,
    window: int,
    query_start: IntOrTensor | None = None,
) -> Tensor:
    """The boolean band `(query_length, key_length)`: query `i` sees key `j`
    when `|query_start + i - j| < window`.

    Positions are aligned as in `causal_mask` (`query_start` defaults to
    `key_length - query_length`, bottom-right), so `causal_mask(T, S) &
    sliding_window_mask(T, S, w)` is the causal sliding window of Mistral:
    each query sees itself and the `w - 1` keys before it.

    Args:
        query_length: int or scalar integer tensor, `T`.
        key_length: int or scalar integer tensor, `S`.
        window: positive int, the band's half-width plus one.
        query_start: optional int or scalar integer tensor, the position of
            the first query among the keys.

    Example:

    >>> import numpy as np
    >>> np.asarray(sliding_window_mask(3, 3, 2)).astype(int)
    array([[1, 1, 0],
           [1, 1, 1],
           [0, 1, 1]])
    """
    window = _validation.check_positive_int("window", window)
    if query_start is None:
        query_start = key_length - query_length
    # |p - j| < w  <=>  j <= p + w - 1 and j >= p - w + 1.
    near_past = causal_mask(query_length, key_length, query_start + window - 1)
    far_past = causal_mask(query_length, key_length, query_start - window)
    return ops.logical_and(near_past, ops.logical_not(far_past))


def padding_mask(token_ids: Tensor, pad_id: int = 0) -> Tensor:
    """Returns `token_ids != pad_id` as a boolean padding mask.

    Args:
        token_ids: integer tensor of shape `(batch, length)`.
        pad_id: int, the id that marks padding. Defaults to 0.

    Returns:
        A boolean tensor of the shape of `token_ids`, `True` on real tokens.

    Example:

    >>> import numpy as np
    >>> np.asarray(padding_mask(np.array([[5, 3, 0, 0]])))
    array([[ True,  True, False, False]])
    """
    if not _is_static_int(pad_id):
        raise ValueError(
            f"`pad_id` must be an integer. Received: pad_id={pad_id!r}"
        )
    token_ids = ops.convert_to_tensor(token_ids)
    return ops.not_equal(token_ids, ops.cast(pad_id, token_ids.dtype))


def standardize_mask(mask: Tensor | None, name: str = "mask", ranks: tuple = (2, 3, 4)) -> Tensor | None:
    """Checks a user mask and returns it as a boolean tensor.

    Args:
        mask: a boolean or integer tensor (0 = masked), or `None`.
        name: the argument name, used in error messages.
        ranks: the ranks accepted for this argument; None: any.

    Returns:
        `None` or a boolean tensor of the same shape.

    Raises:
        TypeError: if the mask has a floating-point dtype.
        ValueError: if the mask has a rank not in `ranks`.
    """
    if mask is None:
        return None
    if not hasattr(mask, "dtype") or not hasattr(mask, "shape"):
        mask = ops.convert_to_tensor(mask)
    dtype = _check_mask(mask, name, ranks)
    if dtype != "bool":
        mask = ops.not_equal(mask, 0)
    return mask


def standardize_numpy_mask(mask, name, shape):
    """`standardize_mask` for a mask whose value is known now (a numpy array,
    an eager tensor) that must have `shape`: a boolean numpy array. A numpy
    mask is checked without a round through the backend: `generate` takes
    this path on every call."""
    mask = _validation.to_numpy(mask)
    dtype = _check_mask(mask, name, (len(shape),))
    if mask.shape != tuple(shape):
        raise ValueError(
            f"`{name}` must have shape {tuple(shape)}. Received: {name} with shape "
            f"{mask.shape}"
        )
    return mask if dtype == "bool" else mask != 0


def _check_mask(mask, name, ranks):
    """Raises for a float mask or a rank not in `ranks`; returns the dtype."""
    if isinstance(mask.dtype, np.dtype):
        # `kind` first: a numpy dtype's `name` is computed in Python, and
        # cold it took as long as a reduction over the mask.
        dtype = "bool" if mask.dtype.kind == "b" else mask.dtype.name
    else:
        dtype = keras.backend.standardize_dtype(mask.dtype)
    if "float" in dtype or "complex" in dtype:
        raise TypeError(
            f"`{name}` must be a boolean or integer mask (True or nonzero = "
            f"may attend). Received: {name} with dtype {dtype}. A float mask "
            "looks like an additive bias; convert it with `mask > 0` or pass a "
            "boolean mask."
        )
    rank = len(mask.shape)
    if ranks is not None and rank not in ranks:
        raise ValueError(
            f"`{name}` must have rank {' or '.join(str(r) for r in ranks)}. "
            f"Received: {name} with shape {tuple(mask.shape)} (rank {rank})"
        )
    return dtype


def merge_masks(*masks: Tensor | None) -> Tensor | None:
    """Combines attention masks with AND, ignoring `None`.

    Masks of rank 2 are read as `(T, S)`, rank 3 as `(B, T, S)` and rank 4 as
    `(B, H, T, S)`. When a rank-4 mask is present, rank-3 masks get a head
    axis, so `(B, T, S)` and `(B, H, T, S)` combine as a user expects (plain
    broadcasting would align `B` with `H`). Size-1 axes broadcast.

    Args:
        *masks: boolean or integer masks, or `None`.

    Returns:
        `None` if every mask is `None`, else the boolean AND of the masks.

    Example:

    >>> import numpy as np
    >>> causal = causal_mask(3)                      # (T, S)
    >>> keys = np.array([[[True, True, False]]])     # (B, 1, S)
    >>> np.asarray(merge_masks(causal, None, keys)).astype(int)[0]
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 0]])
    """
    present = [
        standardize_mask(m, name=f"masks[{i}]")
        for i, m in enumerate(masks)
        if m is not None
    ]
    if not present:
        return None
    max_rank = max(len(m.shape) for m in present)
    merged = None
    for mask in present:
        if max_rank == 4 and len(mask.shape) == 3:
            mask = mask[:, None, :, :]  # (B, T, S) -> (B, 1, T, S)
        merged = mask if merged is None else ops.logical_and(merged, mask)
    return merged


def _check_dim(name, shape, axis, expected, what, broadcast=False):
    """Raises unless `shape[axis]` is `expected` (or 1 when `broadcast`)."""
    if shape is None or expected is None:
        return
    dim = shape[axis]
    if dim is None or int(dim) == int(expected) or (broadcast and int(dim) == 1):
        return
    allowed = f"{expected} (or 1)" if broadcast and int(expected) != 1 else f"{expected}"
    raise ValueError(
        f"`{name}` must have {what} {allowed} on axis {axis}. Received: "
        f"{name} with shape {tuple(shape)}"
    )


def implicit_mask(x):
    """The Keras mask attached to `x` (by `mask_zero=True` embeddings), or None.

    Layers that take a padding mask under another name than `mask` read the
    implicit one with this and combine the two with AND.
    """
    try:
        from keras.src.backend import get_keras_mask
    except ImportError:  # older Keras 3 releases keep it as an attribute
        return getattr(x, "_keras_mask", None)
    return get_keras_mask(x)


def attach_mask(x, mask):
    """Attaches `mask` to `x` as its Keras mask (what `implicit_mask` reads)."""
    try:
        from keras.src.backend import set_keras_mask
    except ImportError:  # older Keras 3 releases keep it as an attribute
        x._keras_mask = mask
        return
    set_keras_mask(x, mask)


def compute_attention_mask(
    query, value, query_mask=None, value_mask=None, key_mask=None, attention_mask=None,
    use_causal_mask=False, num_heads=None,
):
    """Turns padding masks, an attention mask and causality into one mask.

    Keras implicit masks (from `mask_zero=True` embeddings) arrive here as
    `query_mask`, `value_mask` and `key_mask`: Keras fills those arguments
    from the tensors' masks when they are not given explicitly.

    Args:
        query: the query sequence `(B, T, ...)`.
        value: the value (or key) sequence `(B, S, ...)`.
        query_mask: optional padding mask `(B, T)`; a masked query row
            attends to nothing (its output is 0).
        value_mask: optional padding mask `(B, S)`.
        key_mask: optional padding mask `(B, S)`, combined with `value_mask`.
        attention_mask: optional mask `(B, T, S)`, `(T, S)` or
            `(B, H, T, S)`.
        use_causal_mask: bool, adds `causal_mask(T, S)` (bottom-right
            aligned).
        num_heads: optional int, the heads `H` a rank-4 `attention_mask`'s
            axis 1 must match (or be 1); `None` leaves that axis unchecked.

    Every axis of every mask is checked against the inputs where both are
    static: batch (or 1 for attention masks), lengths, heads.

    Returns:
        `None` when nothing is masked, else a boolean mask that broadcasts to
        `(B, T, S)` (or `(B, H, T, S)` if `attention_mask` has a head axis).
    """
    query_shape = tuple(query.shape)
    value_shape = tuple(value.shape)
    query_length, key_length = query_shape[1], value_shape[1]
    batch = query_shape[0]

    masks = []
    query_mask = standardize_mask(query_mask, "query_mask", ranks=(2,))
    if query_mask is not None:
        _check_dim("query_mask", tuple(query_mask.shape), 1, query_length, "length")
        _check_dim("query_mask", tuple(query_mask.shape), 0, batch, "batch size")
        masks.append(query_mask[:, :, None])  # (B, T, 1)
    for name, padding in (("value_mask", value_mask), ("key_mask", key_mask)):
        padding = standardize_mask(padding, name, ranks=(2,))
        if padding is not None:
            _check_dim(name, tuple(padding.shape), 1, key_length, "length")
            _check_dim(name, tuple(padding.shape), 0, batch, "batch size")
            masks.append(padding[:, None, :])  # (B, 1, S)
    attention_mask = standardize_mask(attention_mask, "attention_mask")
    if attention_mask is not None:
        shape = tuple(attention_mask.shape)
        # Size-1 axes broadcast, e.g. (1, T, S) for a batch or (B, 1, S).
        _check_dim(
            "attention_mask", shape, -2, query_length, "query length", True
        )
        _check_dim("attention_mask", shape, -1, key_length, "key length", True)
        if len(shape) > 2:
            _check_dim("attention_mask", shape, 0, batch, "batch size", True)
        if len(shape) == 4:
            _check_dim("attention_mask", shape, 1, num_heads, "heads", True)
        masks.append(attention_mask)
    if use_causal_mask:
        t = query_length if query_length is not None else ops.shape(query)[1]
        s = key_length if key_length is not None else ops.shape(value)[1]
        masks.append(causal_mask(t, s))
    return merge_masks(*masks)
