"""Recording the weights every attention call applied (`capture_attention`).

While `recording()` is open, the core (`kernels.attention`) hands the weights
of each call made on behalf of a layer (`owner`) to the recorder, computing
them through the explicit kernel where a fused kernel ran (the fused kernels
never form the weights). Layers need no hook of their own.
"""

import contextlib

_RECORDERS = []


@contextlib.contextmanager
def recording():
    """Collects `(owner, weights)` pairs, weights `(B, H, T, S)`, in call order."""
    records = []
    _RECORDERS.append(records)
    try:
        yield records
    finally:
        _RECORDERS.remove(records)


def is_recording():
    """Whether a `recording()` is open (fast paths that skip the core step
    aside)."""
    return bool(_RECORDERS)


def record(owner, weights):
    for records in _RECORDERS:
        records.append((owner, weights))


_TRACERS = []


@contextlib.contextmanager
def tracing():
    """Collects `(owner, choice)` for every core call: which kernel ran, and
    the row of `choice.py`'s table that chose it. Under a compiler the choice
    is made once, when the function is traced."""
    choices = []
    _TRACERS.append(choices)
    try:
        yield choices
    finally:
        _TRACERS.remove(choices)


def is_tracing():
    """Whether a `tracing()` is open."""
    return bool(_TRACERS)


def trace(owner, choice):
    for choices in _TRACERS:
        choices.append((owner, choice))
