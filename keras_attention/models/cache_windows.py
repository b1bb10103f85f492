"""Cache windows: a decoding loop in phases over caches that grow.

Shape legend: `B` batch, `L` total length, `W` a window (the cache length
of one phase).

A compiled loop carries tensors of one static shape, so caches made for the
whole length `L` have every step read all `L` slots, written or not: the
per-token time of a loop over preallocated caches grows with `L`, not with
the position. In phases instead, each its own `ops.while_loop` over caches
of a static length `W`, a step at position `i` reads the first window above
`i`. The windows are `FIRST_WINDOW` times 1, 1.5, 2, 3, 4, 6, 8, ... (each
at most 1.5 times the one before) and the last is `L`: a step reads at most
`max(1.5 i, FIRST_WINDOW)` slots, at the price of tracing and compiling the
step once per phase (`2 ceil(log2(L / FIRST_WINDOW)) + 1` phases at most:
7 for 512 positions). Between two phases the caches that grow with the
length are padded with zeros, which is what an empty cache holds there.

Doubling windows would compile fewer phases, but a step would read up to
twice its position (at the sizes of benchmarks/gpt_speed.py on JAX, a
token at 512 positions took more time against one at 64 with doubling
windows than with these).

A phase computes what one loop over caches of length `L` computes: the same
steps on the same written slots, the slots past them zero and masked from
every query. Only the number of masked slots changes, so results agree to
float rounding: the tests require the same tokens.
"""

import keras
from keras import ops

# The first window: a run of at most this many positions has one phase (one
# trace of the step), and no phase of a longer run reads fewer slots. Up to
# 64 slots, reading the cache is a small part of a step on a CPU (at the
# sizes of benchmarks/gpt_speed.py, about a tenth of it).
FIRST_WINDOW = 64


def lengths(start, total):
    """The cache lengths of the phases of a loop whose first step is at
    position `start` and whose last is at `total - 1`: the windows above
    `start` and below `total`, then `total`."""
    windows = []
    window = FIRST_WINDOW
    while window < total:
        for size in (window, window * 3 // 2):
            if start < size < total:
                windows.append(size)
        window *= 2
    return tuple(windows) + (total,)


class Phases:
    """The phases of one decoding loop: their cache lengths, and which cache
    leaves grow with the length, along which axis.

    Args:
        lengths: increasing ints, the cache length of each phase (the last is
            the total length).
        axes: per leaf of the caches (in `keras.tree.flatten` order), the
            axis that holds the positions, or None for a leaf that does not
            grow (a translation model's cross-attention caches).
    """

    def __init__(self, lengths, axes):
        self.lengths = tuple(lengths)
        self.axes = tuple(axes)

    @classmethod
    def plan(cls, empty_caches, batch, start, total, context=(), windowed=True):
        """The first phase's caches and the `Phases` of a loop.

        Args:
            empty_caches: `empty_caches(batch, length, *context)`, the
                model's empty caches for `length` positions.
            batch: the caches' batch size.
            start: the position of the loop's first step (the prompt before
                it is prefilled into the first phase's caches).
            total: the total length.
            context: the model's arrays for `empty_caches`.
            windowed: False for one phase over caches of length `total`.

        Returns:
            `(caches, phases)`. One phase where `windowed` is False, where
            `total` fits the first window, or where the caches for two
            lengths differ otherwise than in one axis per leaf that holds
            the length. The caches for
            `total` serve for their shapes only: under a compiler they are
            never computed (an eager loop, as on torch, runs one phase:
            `windowed=False`).
        """
        windows = lengths(start, total) if windowed else (total,)
        if len(windows) == 1:
            return empty_caches(batch, total, *context), cls.single(total)
        caches = empty_caches(batch, windows[0], *context)
        full = empty_caches(batch, total, *context)
        axes = _growing_axes(caches, full, windows[0], total)
        if axes is None:
            return full, cls.single(total)
        return caches, cls(windows, axes)

    @classmethod
    def single(cls, total):
        """One phase over caches of length `total`: a plain loop."""
        return cls((total,), ())

    def grow(self, caches, length):
        """`caches` with every growing leaf padded with zeros to `length`."""
        leaves = keras.tree.flatten(caches)
        grown = []
        for leaf, axis in zip(leaves, self.axes):
            if axis is not None:
                padding = [(0, 0)] * len(leaf.shape)
                padding[axis] = (0, length - leaf.shape[axis])
                leaf = ops.pad(leaf, padding)
            grown.append(leaf)
        return keras.tree.pack_sequence_as(caches, grown)

    def while_loop(self, condition, body, state, caches_at):
        """`ops.while_loop(condition, body, state)` in phases.

        `state[0]` is the position of the next step (which writes that
        slot) and `state[caches_at]` the caches. Phase `n` runs while the
        position is below `lengths[n]` and `condition` holds, after growing
        the caches to `lengths[n]`; a loop that ends early (the condition
        false) runs no step in the phases after, only their padding.
        """
        for n, length in enumerate(self.lengths):
            if n:
                state = list(state)
                state[caches_at] = self.grow(state[caches_at], length)
                state = tuple(state)

            def phase_condition(*state, length=length):
                return ops.logical_and(state[0] < length, condition(*state))

            state = ops.while_loop(phase_condition, body, tuple(state))
        return state


def _growing_axes(small, full, small_length, full_length):
    """Per leaf, the axis where `small` (caches for `small_length`) and
    `full` (for `full_length`) differ, of those lengths, or None where they
    agree; None altogether where a leaf differs otherwise."""
    small_leaves = keras.tree.flatten(small)
    full_leaves = keras.tree.flatten(full)
    if len(small_leaves) != len(full_leaves):
        return None
    axes = []
    for a, b in zip(small_leaves, full_leaves):
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        if len(a_shape) != len(b_shape) or None in a_shape + b_shape or a.dtype != b.dtype:
            return None
        differ = [n for n, (x, y) in enumerate(zip(a_shape, b_shape)) if x != y]
        if not differ:
            axes.append(None)
        elif len(differ) == 1 and (a_shape[differ[0]], b_shape[differ[0]]) == (
            small_length,
            full_length,
        ):
            axes.append(differ[0])
        else:
            return None
    return axes
