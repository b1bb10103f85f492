"""Which kernel a call takes: one table, its measured reasons beside it.

`choose_kernel` reads the call (scorer, what it must return, dropout, causal
flag, a cache, lengths, dtype) and the running backend's `Preferences`
(`keras_attention.backend`) and goes down the table below; the first row that
matches decides. The timings behind the reasons are in benchmarks/README.md
(2-core CPU).

    row  when                                          kernel    why
    1    `fused=False`                                 explicit  asked for
    2    the scorer is not `c * q.k`, or a custom      explicit  the one kernel for any scorer
         normalization (hard attention)                          (additive, bilinear) and any
                                                                 normalization
    3    weights returned, or dropout in training      explicit  fused kernels never form them,
                                                                 and Keras's take no dropout
         ... but dropout with `dropout_kernel`,        dropout   the backend's fused kernel with
         weights not returned, rows 1-4 passed                   its own dropout (torch's SDPA
                                                                 `dropout_p`: flash and memory-
                                                                 efficient take it on a GPU),
                                                                 inside the fused guards
    4    value head size != key head size              explicit  Keras's fused kernels need both
                                                                 sizes equal
    5    `chunk_long_queries`, scores over 512 MiB     chunked   exact, memory that grows with
                                                                 the length, not its square
                                                                 (`mha_memory.py`)
    6    `blocked="always"`, static lengths, at least  blocked   causal blocks skip work;
         `blocked_min_queries` queries, a cache read             faster than Keras's kernel
         or a dtype other than float32                           on a CPU, forward and
                                                                 backward (`mha_speed.py`;
                                                                 below 32 queries in training
                                                                 Keras's kernel was as fast)
    7    otherwise                                     fused     the backend's kernel (torch:
                                                                 flash / memory-efficient SDPA)

Beside the kernel, a choice carries the dtype the kernel computes in (JAX's
CPU kernel cannot run float16 under jit: float32) and how the NaN guard runs:
as a `cond` that recomputes only when an output is non-finite, or always
(`guard_with_cond=False`: XLA fuses the masked computation, while a `cond`
stops fusion and keeps both branches for the backward pass). Attending to a
cache takes the `cond` wherever a guard runs: recomputing would read and
write the whole cache at every step (a one-token step whose mask has one
row and one head needs no guard: `fused.attend`). The `cond` decides from
the keys' and values' finiteness (`guard_on_inputs`), so that only the
branch taken is computed and differentiated; a cache read decides from the
output instead, one reduction over `T` queries rather than over the whole
cache (its gradient at a masked NaN may be NaN).
"""

import dataclasses

import keras

from keras_attention import backend
from keras_attention.kernels import chunked

EXPLICIT = "explicit"
DROPOUT = "dropout"
FUSED = "fused"
BLOCKED = "blocked"
CHUNKED = "chunked"


@dataclasses.dataclass(frozen=True)
class Choice:
    """A kernel, the row that chose it, and how it runs."""

    kernel: str
    row: int
    compute_dtype: str = None
    chunk_size: int = None
    guard_with_cond: bool = True
    guard_on_inputs: bool = True


def takes_fused(fused, dot_product, weights_needed, dropout_active, same_head_sizes,
                preferences=None):
    """Rows 1-4: the row number that sends the call to the explicit kernel,
    or 0 when a fused kernel may run (with dropout in training, the
    backend's fused kernel that takes dropout, where it has one)."""
    preferences = preferences or backend.preferences()
    if not fused:
        return 1
    if not dot_product:
        return 2
    if weights_needed or (dropout_active and not preferences.dropout_kernel):
        return 3
    if not same_head_sizes:
        return 4
    return 0


def choose_kernel(
    query_shape, key_shape, value_shape, dtype, *, dot_product, causal=False, cached=False,
    weights_needed=False, dropout_active=False, fused=True, preferences=None,
    chunk_above_bytes=chunked.CHUNK_ABOVE_BYTES, chunk_bytes=chunked.CHUNK_BYTES,
):
    """The kernel for one call (the table above).

    Args:
        query_shape: `(B, T, H, K)`; key_shape: `(B, S, G, K)`;
            value_shape: `(B, S, G, V)` (static dims or None).
        dtype: the queries' dtype.
        dot_product: whether the scorer is `c * q.k` (and no custom
            normalization).
        causal: the causal flag. cached: attending to a KV cache.
        weights_needed: the weights are returned (or recorded).
        dropout_active: dropout on the weights in this call.
        fused: the layer's switch (False: always explicit).
        preferences: a `backend.Preferences`; the running backend's by default.
        chunk_above_bytes, chunk_bytes: row 5's thresholds.

    Returns:
        A `Choice`.
    """
    same_head_sizes = key_shape[-1] == value_shape[-1]
    preferences = preferences or backend.preferences()
    row = takes_fused(
        fused, dot_product, weights_needed, dropout_active, same_head_sizes, preferences
    )
    if row:
        return Choice(EXPLICIT, row)
    extras = dict(
        compute_dtype=backend.kernel_dtype(dtype),
        guard_with_cond=preferences.guard_with_cond or cached,
        guard_on_inputs=not cached,
    )
    if dropout_active:
        return Choice(DROPOUT, 3, **extras)
    batch, query_length, heads = query_shape[:3]
    key_length = key_shape[1]
    static = query_length is not None and key_length is not None
    if preferences.chunk_long_queries and static:
        size = chunked.chunk_size(
            batch, query_length, heads, key_length, chunk_above_bytes, chunk_bytes
        )
        if size is not None:
            # The guard always on: at these lengths its work, O(S) over the
            # keys and values, is small beside attention's O(T S), while a
            # `cond` kept both branches' memory (400 MiB of TensorFlow's
            # step at 8,192 tokens), and TensorFlow cannot differentiate the
            # causal tiles' XLA loops inside a `cond` branch.
            return Choice(CHUNKED, 5, chunk_size=size, **dict(extras, guard_with_cond=cached))
    if (
        preferences.blocked == "always"
        and static
        and (
            cached
            or query_length >= preferences.blocked_min_queries
            or keras.backend.standardize_dtype(dtype) != "float32"  # measured in float32
        )
    ):
        return Choice(BLOCKED, 6, **extras)
    return Choice(FUSED, 7, **extras)
