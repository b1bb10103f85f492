"""The blocked kernel: scaled dot-product attention that skips what a causal
block cannot see.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `R = H / G` query heads per key/value head, `K` key head
size, `V` value head size, `C` queries in a block.
"""

import keras
from keras import ops

from keras_attention import masking

# Causal blocks of at least `BLOCK_SIZE` queries, at most `MAX_BLOCKS` of
# them: fewer, larger matmuls cost less per query than many small ones, and
# eight blocks already skip 7/16 of the scores (half is the limit).
BLOCK_SIZE = 128
MAX_BLOCKS = 8


def causal_blocks(query_length, key_length, block_size=BLOCK_SIZE, max_blocks=MAX_BLOCKS):
    """`(start, stop)` query ranges; one range when blocking saves nothing."""
    if key_length < query_length:
        return [(0, query_length)]
    count = min(query_length // block_size, max_blocks)
    if count < 2:
        return [(0, query_length)]
    bounds = [round(i * query_length / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def blocked_attention(
    q,
    k,
    v,
    mask,
    scale,
    is_causal,
    block_size=BLOCK_SIZE,
    max_blocks=MAX_BLOCKS,
    normalize_last=False,
):
    """`softmax(q k^T * scale) v`, skipping the keys a causal block cannot see.

    The textbook computation (the softmax in at least float32) with the scale
    applied to the queries (`T K` products instead of `T S`) and the heads
    laid out for plain batched matmuls: queries `(B, G, R T, K)` against keys
    `(B, G, S, K)`, so grouped-query attention repeats nothing. With the
    causal flag, the queries are split into blocks and a block `[a, b)`
    attends only to the keys `[0, offset + b)` (bottom-right alignment,
    `offset = S - T`): the scores above the diagonal blocks are never
    computed, which saves up to half of the attention's work.

    Args:
        q: `(B, T, H, K)`; k: `(B, S, G, K)`; v: `(B, S, G, V)`, static `T`
            and `S`.
        mask: optional boolean `(B|1, H|1, T|1, S)`; every row must see at
            least one key (`fused.masked_kernel` sees to that).
        scale: the score scale.
        is_causal: bool, bottom-right causal attention.
        block_size, max_blocks: the causal blocks (`causal_blocks`).
        normalize_last: divide the product of the exponentials and the
            values by each row's sum (`(T, V)` divisions) instead of
            normalizing the `(T, S)` weights before it; the same function.

    Returns:
        `(B, T, H, V)`.
    """
    _, query_length, heads, head_dim = q.shape
    key_length, groups = k.shape[1], k.shape[2]
    ratio = heads // groups
    value_dim = v.shape[-1]
    q = ops.multiply(q, ops.cast(scale, q.dtype))
    q = ops.reshape(q, (-1, query_length, groups, ratio, head_dim))
    q = ops.transpose(q, (0, 2, 3, 1, 4))  # (B, G, R, T, K)
    k = ops.transpose(k, (0, 2, 1, 3))  # (B, G, S, K)
    v = ops.transpose(v, (0, 2, 1, 3))  # (B, G, S, V)
    if mask is not None:  # (B|1, H|1, T, S) -> (B|1, G|1, R|1, T, S)
        mask_heads = mask.shape[1]
        mask = ops.reshape(
            mask,
            (-1, groups if mask_heads > 1 else 1, ratio if mask_heads > 1 else 1)
            + tuple(mask.shape[2:]),
        )
    offset = key_length - query_length
    if is_causal:
        blocks = causal_blocks(query_length, key_length, block_size, max_blocks)
    else:
        blocks = [(0, query_length)]
    outputs = []
    for start, stop in blocks:
        length = stop - start
        end = min(key_length, offset + stop) if is_causal else key_length
        q_block = q if len(blocks) == 1 else q[:, :, :, start:stop]
        q_block = ops.reshape(q_block, (-1, groups, ratio * length, head_dim))
        k_block = k if end == key_length else k[:, :, :end]
        v_block = v if end == key_length else v[:, :, :end]
        scores = ops.einsum("bgqk,bgsk->bgqs", q_block, k_block)
        scores = ops.reshape(scores, (-1, groups, ratio, length, end))
        dtype = keras.backend.result_type(scores.dtype, "float32")
        scores = ops.cast(scores, dtype)  # (B, G, R, C, S')
        allowed = None
        if is_causal:
            # Query `c` of the block sits at `start + offset + c` among the keys.
            allowed = masking.causal_mask(length, end, query_start=start + offset)
        if mask is not None:
            rows = slice(None) if mask.shape[-2] == 1 else slice(start, stop)
            columns = slice(None) if mask.shape[-1] == 1 else slice(0, end)
            mask_block = mask[..., rows, columns]
            allowed = mask_block if allowed is None else ops.logical_and(
                mask_block, allowed
            )
        if allowed is not None:
            scores = ops.where(allowed, scores, float("-inf"))
        # The softmax over 4-D rows: over the 5-D scores XLA's CPU code took
        # far longer for the kernel's forward and backward pass (JAX, 1,024
        # tokens; benchmarks/mha_speed.py).
        scores = ops.reshape(scores, (-1, groups, ratio * length, end))
        total = None  # the rows' sums, when they divide the output instead
        if end == 1:
            # One key, which every row sees: its weight is 1 (and Keras warns
            # about a softmax over one position).
            weights = ops.ones_like(scores)
        elif normalize_last:
            peak = ops.stop_gradient(ops.max(scores, axis=-1, keepdims=True))
            weights = ops.exp(ops.subtract(scores, peak))  # unnormalized
            total = ops.sum(weights, axis=-1, keepdims=True)
        else:
            weights = ops.softmax(scores, axis=-1)
        output = ops.einsum("bgqs,bgsv->bgqv", ops.cast(weights, v.dtype), v_block)
        if total is not None:
            output = ops.cast(ops.divide(output, total), v.dtype)
        outputs.append(ops.reshape(output, (-1, groups, ratio, length, value_dim)))
    output = outputs[0] if len(outputs) == 1 else ops.concatenate(outputs, axis=3)
    output = ops.transpose(output, (0, 3, 1, 2, 4))  # (B, T, G, R, V)
    return ops.reshape(output, (-1, query_length, heads, value_dim))
