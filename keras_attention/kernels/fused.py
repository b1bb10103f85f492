"""The fused kernels with the package's rules around them.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `K` head size, `V` value head size.

A fused kernel never forms the weights, so the two rules the explicit kernel
keeps by construction are kept around it: a query that may see no key gets
an output of exactly 0 (kernels give it the mean of the values, or NaN), and
NaN or inf in a key or value reaches only the queries that may see it.
"""

from keras import ops

from keras_attention import backend
from keras_attention.kernels import choice as choices
from keras_attention.kernels import explicit
from keras_attention.kernels.blocked import blocked_attention
from keras_attention.kernels.chunked import chunked_attention


def _backend_kernel(q, k, v, mask, scale, is_causal=False):
    """The backend's fused kernel: its own call where it has one, else
    Keras's `ops.dot_product_attention`."""
    output = backend.fused_attention(q, k, v, mask, scale, is_causal)
    if output is not None:
        return output
    heads, groups = q.shape[2], k.shape[2]
    if backend.preferences().repeat_single_key_value_head and groups == 1 < heads:
        # Keras's TensorFlow kernel repeats key/value heads only for G > 1.
        k = ops.repeat(k, heads, axis=2)  # (B, S, H, K)
        v = ops.repeat(v, heads, axis=2)  # (B, S, H, V)
    return ops.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=is_causal
    )  # (B, T, H, V)


def run(choice, q, k, v, mask, scale, is_causal, dropout=None):
    """The chosen kernel alone; every row of `mask` must see a key."""
    dtype = q.dtype
    if choice.compute_dtype is not None and choice.compute_dtype != dtype:
        q, k, v = (ops.cast(x, choice.compute_dtype) for x in (q, k, v))
        return ops.cast(run(choice, q, k, v, mask, scale, is_causal, dropout), dtype)
    if choice.kernel == choices.DROPOUT:
        rate, seed = dropout
        return backend.dropout_attention(q, k, v, mask, scale, is_causal, rate, seed)
    if choice.kernel == choices.BLOCKED:
        preferences = backend.preferences()
        return blocked_attention(  # any G
            q, k, v, mask, scale, is_causal,
            max_blocks=preferences.causal_blocks,
            normalize_last=preferences.normalize_last,
        )
    if choice.kernel == choices.CHUNKED:
        return chunked_attention(q, k, v, mask, scale, is_causal, choice.chunk_size)
    return _backend_kernel(q, k, v, mask, scale, is_causal)


def masked_kernel(choice, q, k, v, mask, scale, is_causal, dropout=None):
    """The kernel with a boolean mask; fully masked rows come out as 0."""
    if mask is None:
        return run(choice, q, k, v, None, scale, is_causal, dropout)
    # Such rows see every key inside the kernel and are zeroed after it.
    has_key = ops.any(mask, axis=-1, keepdims=True)  # (B|1, H|1, T, 1)
    kernel_mask = ops.logical_or(mask, ops.logical_not(has_key))
    output = run(choice, q, k, v, kernel_mask, scale, False, dropout)
    has_key = ops.transpose(has_key, (0, 2, 1, 3))  # (B|1, T, H|1, 1)
    return ops.where(has_key, output, ops.zeros_like(output))


def attend(choice, q, k, v, mask, scale, is_causal, dropout=None):
    """A fused kernel that keeps both rules.

    Where every query sees the same keys (a mask of one row and one head: a
    one-token decoding step, a padding mask alone), the keys and values
    hidden from all of them are zeroed before the kernel, and nothing is
    checked. Otherwise finite keys and values cannot leak, so with
    `choice.guard_on_inputs` the plain kernel runs when they are all finite,
    and only otherwise is the attention recomputed with non-finite positions
    zeroed and NaN given back to the queries that may see one: the check
    costs one reduction over the keys and values. The branch is decided from
    the inputs, not from the plain kernel's output, because a `cond` on the
    output would differentiate the plain kernel too, kept or not: its
    gradient at a masked NaN key is `0 * NaN` (`dQ = dS K` with `dS = 0`
    there), and at a masked NaN value its output is NaN, which
    `D = rowsum(dO * O)` spreads over the whole row. A cache read
    (`guard_on_inputs=False`) checks the output instead: one reduction over
    `T` queries, not the whole cache.

    Args:
        choice: a `choice.Choice` of a fused kernel.
        q: `(B, T, H, K)`; k: `(B, S, G, K)`; v: `(B, S, G, V)`.
        mask: optional boolean `(B|1, H|1, T, S)`; with `is_causal` None.
        scale: the score scale.
        is_causal: bool, causal attention with `T == S`.
        dropout: `(rate, seed)` for the dropout kernel, which draws its
            noise once, in whichever branch runs (the same seed gives the
            same noise in both).

    Returns:
        `(B, T, H, V)`.
    """
    if mask is None and not is_causal:
        # Every query sees every key: nothing is hidden, nothing can leak.
        return run(choice, q, k, v, None, scale, False, dropout)
    if not is_causal and mask.shape[1] == 1 and mask.shape[2] == 1:
        # No check and no `cond`: a compiler fuses the zeroing into the
        # kernel's reads of the keys and values, where a decoding step's
        # `cond` a block cost a tenth of JAX's step on a CPU
        # (benchmarks/gpt_decode_floor.py).
        visible = ops.transpose(mask[:, 0], (0, 2, 1))[..., None]  # (B|1, S, 1, 1)
        k = ops.where(visible, k, ops.zeros_like(k))
        v = ops.where(visible, v, ops.zeros_like(v))
        return masked_kernel(choice, q, k, v, mask, scale, False, dropout)

    def recompute():
        clean_k, clean_v, bad = explicit.sanitize_nonfinite(k, v)
        bad = ops.any(bad, axis=-1)  # (B, S)
        output = masked_kernel(choice, q, clean_k, clean_v, mask, scale, is_causal, dropout)
        if mask is None and is_causal:
            # Query t (at key t + S - T) sees a bad key when the first one is
            # at or before it: O(T), where the causal matrix would be O(T S).
            query_length, key_length = ops.shape(q)[1], ops.shape(k)[1]
            keys = ops.arange(key_length)
            first_bad = ops.amin(ops.where(bad, keys[None], key_length), axis=-1)  # (B,)
            queries = ops.arange(query_length) + (key_length - query_length)
            sees_bad = (queries[None] >= first_bad[:, None])[:, :, None, None]  # (B, T, 1, 1)
        elif mask is None:
            sees_bad = ops.any(bad, axis=-1)[:, None, None, None]  # (B, 1, 1, 1)
        else:
            visible = ops.logical_and(mask, bad[:, None, None, :])  # (B, H|1, T, S)
            sees_bad = ops.any(visible, axis=-1, keepdims=True)  # (B, H|1, T, 1)
            sees_bad = ops.transpose(sees_bad, (0, 2, 1, 3))  # (B, T, H|1, 1)
        return explicit.poison_outputs(output, sees_bad)

    if not choice.guard_with_cond:
        return recompute()
    if choice.guard_on_inputs:
        return backend.when_finite(
            (k, v),
            lambda: masked_kernel(choice, q, k, v, mask, scale, is_causal, dropout),
            recompute,
        )
    output = masked_kernel(choice, q, k, v, mask, scale, is_causal, dropout)
    return backend.unless_nonfinite(output, recompute)
