"""Argument and shape checks shared by every module.

Each check raises a `ValueError` (or `TypeError`) whose message names the
argument and the value received, so errors read the same on every backend.
"""

import numbers


def check_positive_int(name, value, allow_none=False):
    """Returns `value` if it is a positive Python int, else raises."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}"
        )
    if value <= 0:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}"
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


def check_seed(name, value):
    """Returns `value` if it is `None` or a non-negative int, else raises."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`{name}` must be None or an integer. Received: {name}={value!r}"
        )
    return int(value)


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
