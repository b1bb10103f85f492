"""Argument and shape checks shared by every module.

Each check raises a `ValueError` (or `TypeError`) whose message names the
argument and the value received, so errors read the same on every backend.
"""

import numbers

import numpy as np


def check_positive_int(name, value, allow_none=False):
    """Returns `value` if it is a positive Python int, else raises."""
    if type(value) is int and value > 0:  # the usual case, without `numbers`' checks
        return value
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"The argument `{name}` must be a positive integer. Received: "
            f"{name}={value!r}"
        )
    if value <= 0:
        raise ValueError(
            f"The argument `{name}` must be a positive integer. Received: "
            f"{name}={value!r}"
        )
    return int(value)


def check_rate(name, value):
    """Returns `value` as a float if it lies in [0, 1), else raises."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"`{name}` must be a float in [0, 1). Received: {name}={value!r}"
        )
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"`{name}` must be a float in [0, 1). Received: {name}={value!r}"
        )
    return float(value)


def check_bool(name, value):
    """Returns `value` as a bool if it is a Python or numpy bool, else raises."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return bool(value)


def check_seed(name, value, maximum=None):
    """Returns `value` if it is `None` or a non-negative int (at most
    `maximum`, if given), else raises."""
    if value is None:
        return None
    if type(value) is int and 0 <= value and (maximum is None or value <= maximum):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"`{name}` must be None or an integer >= 0. Received: {name}={value!r}"
        )
    if maximum is not None and value > maximum:
        raise ValueError(f"`{name}` must be at most {maximum}. Received: {name}={value!r}")
    return int(value)


def concrete_value(value):
    """The numpy value of `value` if it is known now, else None.

    Python and numpy numbers and eager tensors are known; a tensor being
    traced (inside `tf.function`, `jax.jit`, `torch.compile`) or a symbolic
    `keras.KerasTensor` is not.
    """
    import keras

    from keras_attention import backend

    if backend.compiling():
        return None  # numpy arrays too: `torch.compile` traces them
    if isinstance(value, (np.ndarray, np.generic, numbers.Number)):
        return np.asarray(value)
    if keras.backend.is_keras_tensor(value):
        return None
    try:
        return np.asarray(keras.ops.convert_to_numpy(value))
    except (TypeError, ValueError, NotImplementedError, RuntimeError, AttributeError):
        # What each backend raises when asked for a traced value.
        return None


def check_integer(name, value, minimum=None):
    """Checks an integer-like scalar; returns its int value, or None if unknown.

    Accepted: a Python int, a numpy integer (or 0-d integer array) and a
    scalar integer tensor. Refused with a `ValueError`: `bool`, floats (even
    `2.0`, which backends would truncate differently), strings, `None`, float
    or boolean tensors and tensors of another rank. The value is compared with
    `minimum` whenever it is known (`concrete_value`); a traced tensor is
    checked by dtype and rank only, and a symbolic dimension (a JAX
    shape-polymorphic length while Keras infers shapes) passes.
    """
    if type(value) is int or (
        isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    ):
        known = int(value)
    elif hasattr(value, "dtype") and hasattr(value, "shape"):
        known = _tensor_integer(name, value)
    elif value is None or isinstance(value, (numbers.Number, str, bytes, np.generic)):
        raise ValueError(f"`{name}` must be an integer. Received: {name}={value!r}")
    else:
        return None  # a symbolic dimension
    if known is not None and minimum is not None and known < minimum:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        raise ValueError(f"`{name}` must be {what}. Received: {name}={known}")
    return known


def _tensor_integer(name, value):
    """The int value of a scalar integer tensor or array, None if traced."""
    import keras

    dtype = keras.backend.standardize_dtype(value.dtype)
    array = concrete_value(value)
    if array is not None and array.size == 1:
        received = f"{name}={array.item()!r} (dtype {dtype})"
    else:
        received = f"{name} with dtype {dtype} and shape {tuple(value.shape)}"
    if "int" not in dtype:
        raise ValueError(f"`{name}` must be an integer. Received: {received}")
    if len(value.shape) != 0:
        raise ValueError(f"`{name}` must be a scalar integer. Received: {received}")
    return None if array is None else int(array)


def check_rank(name, shape, rank):
    """Raises if a tensor of `shape` does not have rank `rank`."""
    if shape is not None and len(shape) != rank:
        raise ValueError(
            f"`{name}` must have rank {rank}. Received: {name} with shape "
            f"{tuple(shape)} (rank {len(shape)})"
        )


def check_same_dim(name_a, dim_a, name_b, dim_b, what):
    """Raises if two static dimensions differ (unknown dims are skipped)."""
    if dim_a is not None and dim_b is not None and int(dim_a) != int(dim_b):
        raise ValueError(
            f"`{name_a}` and `{name_b}` must have the same {what}. Received: "
            f"{name_a} {what}={dim_a}, {name_b} {what}={dim_b}"
        )


def check_attention_shapes(query_shape, value_shape, key_shape=None):
    """Rank-3 `(batch, length, dim)` inputs; keys and values of the same
    length and batch, queries of the same batch."""
    check_rank("query", query_shape, 3)
    check_rank("value", value_shape, 3)
    if key_shape is not None:
        check_rank("key", key_shape, 3)
        check_same_dim("key", key_shape[1], "value", value_shape[1], "length")
        check_same_dim("key", key_shape[0], "value", value_shape[0], "batch size")
    check_same_dim("query", query_shape[0], "value", value_shape[0], "batch size")


def check_output_shape(output_shape):
    """`None`, or a positive int or a non-empty tuple of positive ints (the
    output's trailing dimensions), as a tuple; else raises."""
    if output_shape is None:
        return None
    shape = _int_tuple(output_shape)
    if shape is None or any(d <= 0 for d in shape):
        raise ValueError(
            "Invalid `output_shape`: `output_shape` must be None, a positive "
            "int or a tuple of positive ints. "
            f"Received: output_shape={output_shape!r}"
        )
    return shape


def _int_tuple(value):
    """`value`, an int or a non-empty list or tuple of ints, as a tuple of
    Python ints; `None` for anything else (bools are not ints here). The
    caller's message reports the value it received."""
    items = (value,) if isinstance(value, numbers.Integral) else value
    if (
        not isinstance(items, (tuple, list))
        or not items
        or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in items)
    ):
        return None
    return tuple(int(i) for i in items)


def check_attention_axes(attention_axes):
    """`None`, or an int or a non-empty list or tuple of distinct ints (as a
    tuple); else raises. Their range is checked against the input's rank
    when it is known (`normalize_attention_axes`)."""
    if attention_axes is None:
        return None
    axes = _int_tuple(attention_axes)
    if axes is None or len(set(axes)) != len(axes):
        raise ValueError(
            "`attention_axes` must be None, an int, or a non-empty list or "
            f"tuple of distinct ints. Received: attention_axes={attention_axes!r}"
        )
    return axes


def normalize_attention_axes(attention_axes, rank):
    """The attention axes of a rank-`rank` input `(batch, ..., dim)` as
    non-negative axes of that input, in the order given (`None`: every axis
    but the batch and the features). Negative axes count from the end of the
    input, so `-2` is the axis before the features."""
    if attention_axes is None:
        return tuple(range(1, rank - 1))
    axes = tuple(a if a >= 0 else rank + a for a in attention_axes)
    if any(not 1 <= a <= rank - 2 for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(
            f"`attention_axes` must name distinct axes 1 .. {rank - 2} (or "
            f"-{rank - 1} .. -2) of a query of rank {rank}, not its batch or "
            f"feature axis. Received: attention_axes={attention_axes!r}"
        )
    return axes


def _same(a, b):
    return len(a) == len(b) and all(
        x is None or y is None or int(x) == int(y) for x, y in zip(a, b)
    )


def check_multi_head_shapes(query_shape, value_shape, key_shape=None):
    """Multi-head attention's inputs: `(batch, ..., dim)` of rank 3 or more,
    query and value of the same rank and batch; key and value equal in all
    dimensions but the last (unknown dimensions are skipped)."""
    query_shape, value_shape = tuple(query_shape), tuple(value_shape)
    for name, shape in (("query", query_shape), ("value", value_shape)):
        if len(shape) < 3:
            raise ValueError(
                f"`{name}` must have rank 3 or more, (batch, ..., dim). "
                f"Received: {name} with shape {shape} (rank {len(shape)})"
            )
    if key_shape is not None:
        key_shape = tuple(key_shape)
        if len(key_shape) != len(value_shape):
            raise ValueError(
                f"`key` must have rank {len(value_shape)}, as `value`: all "
                "dimensions of `value` and `key`, except the last one, must be "
                f"equal. Received: key with shape {key_shape} (rank "
                f"{len(key_shape)}), value_shape={value_shape}"
            )
        if not _same(key_shape[1:-1], value_shape[1:-1]):
            if len(key_shape) == 3:
                received = f"key length={key_shape[1]}, value length={value_shape[1]}"
            else:
                received = f"key_shape={key_shape}, value_shape={value_shape}"
            raise ValueError(
                "`key` and `value` must have the same length: all their "
                "dimensions, except the last one, must be equal. "
                f"Received: {received}"
            )
    if len(query_shape) != len(value_shape):
        raise ValueError(
            "`query` and `value` must have the same rank. Received: "
            f"query_shape={query_shape}, value_shape={value_shape}"
        )
    if key_shape is not None:
        check_same_dim("key", key_shape[0], "value", value_shape[0], "batch size")
    check_same_dim("query", query_shape[0], "value", value_shape[0], "batch size")


def check_layer(name, value, what):
    """`None`, a Keras layer, or a layer config (deserialized); else raises."""
    import keras

    if isinstance(value, dict):
        value = keras.saving.deserialize_keras_object(value)
    if value is not None and not isinstance(value, keras.layers.Layer):
        raise ValueError(
            f"`{name}` must be None, {what} or its config. Received: "
            f"{name}={value!r}"
        )
    return value


def check_divisible(name, value, divisor_name, divisor):
    """Raises unless `divisor` (if not None) divides `value`."""
    if divisor is not None and value % divisor:
        raise ValueError(
            f"`{name}` must be divisible by `{divisor_name}`. Received: "
            f"{name}={value}, {divisor_name}={divisor}"
        )


def check_optional_rate(name, value):
    """`None`, or `value` checked by `check_rate`."""
    return None if value is None else check_rate(name, value)


def check_token_id(name, value, vocabulary_size):
    """Returns an integer-like `value` in `[0, vocabulary_size)` as an int."""
    if check_integer(name, value) is None or not 0 <= int(value) < vocabulary_size:
        raise ValueError(
            f"`{name}` must be an id in [0, {vocabulary_size}). "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_token_id_list(name, values, vocabulary_size):
    """`None` (as `None`), one id or a sequence of ids (as a tuple of ints)."""
    if values is None:
        return None
    if isinstance(values, (list, tuple, np.ndarray)) and np.ndim(values) == 1:
        return tuple(check_token_id(name, v, vocabulary_size) for v in values)
    if np.ndim(values) == 0:
        return (check_token_id(name, values, vocabulary_size),)
    raise ValueError(
        f"`{name}` must be None, an id or a list of ids. Received: {name}={values!r}"
    )


def to_numpy(value):
    """`value` (an array or a tensor whose value is known) as a numpy array;
    a numpy array as it is, without the round through Keras."""
    if isinstance(value, np.ndarray):
        return value
    import keras

    return np.asarray(keras.ops.convert_to_numpy(value))


def known_token_ids(name, ids):
    """The numpy value of token ids known now (None if symbolic or traced),
    refused with a `TypeError` if they are not integers."""
    array = concrete_value(ids) if not isinstance(ids, (list, tuple)) else np.asarray(ids)
    if array is not None and array.size and array.dtype.kind not in "iu":
        raise TypeError(
            f"`{name}` must hold integer token ids. Received: {name} with dtype "
            f"{array.dtype}"
        )
    return array


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def check_token_ids(name, ids, vocabulary_size, max_length, length_name):
    """Raises unless the numpy `ids` lie in `[0, vocabulary_size)` and a
    `(batch, length)` array is at most `max_length` long."""
    # One pass over the ids: signed ids read as unsigned of the same width,
    # where a negative id is larger than any vocabulary; `argmax`, which
    # numpy runs without its reduction machinery. Before a short
    # translation's compiled call, with the caches cold after other work,
    # it took half the time of `min` and `max` (benchmarks/seq2seq_speed.py
    # times that call).
    unsigned = ids.view(_UNSIGNED[ids.itemsize]) if ids.dtype.kind == "i" else ids
    if ids.size and unsigned.ravel()[unsigned.argmax()] >= vocabulary_size:
        bad = ids[(ids < 0) | (ids >= vocabulary_size)][0]
        raise ValueError(
            f"`{name}` must hold ids in [0, {vocabulary_size}). Received: an id {int(bad)}"
        )
    if ids.ndim == 2 and ids.shape[1] > max_length:
        raise ValueError(
            f"`{name}` is longer than {length_name}={max_length}. "
            f"Received: length {ids.shape[1]}"
        )


def check_positions(name, positions, length, sequence_name):
    """Raises unless every value of numpy `positions` is in `[0, length)`
    (`length` the last axis of `sequence_name`; None skips the check)."""
    if positions.size and length is not None and (
        positions.min() < 0 or positions.max() >= length
    ):
        bad = positions[(positions < 0) | (positions >= length)][0]
        raise ValueError(
            f"`{name}` must hold positions in [0, {length}), the length of "
            f"`{sequence_name}`. Received: a position {int(bad)}"
        )


def is_positive_number(value):
    """Whether `value` is a finite real number above 0 (a bool is not)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and bool(np.isfinite(value))
        and value > 0
    )


def check_positive_float(name, value):
    """Returns `value` as a float if it is a positive real number, else raises."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
        raise ValueError(f"`{name}` must be a positive float. Received: {name}={value!r}")
    return float(value)


def check_choice(name, value, choices):
    """Returns `value` if it is one of the strings `choices`, else raises."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(repr(c) for c in choices)}. "
            f"Received: {name}={value!r}"
        )
    return value
