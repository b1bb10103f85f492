"""The attention core: every attention layer of the package calls `attention`.

Shape legend: `B` batch, `T` query length, `S` key/value length, `H` query
heads, `G` key/value heads (`H` divisible by `G`), `K` key head size, `V`
value head size.

One entry, four kernels, one table that chooses among them (`choice.py`):

- `explicit.py`: score -> mask -> normalize -> dropout -> weighted sum, with
  any scorer and any normalization (soft or hard); it forms the weights;
- `fused.py`: the backend's fused kernel (`ops.dot_product_attention`, or
  in training with dropout `backend.dropout_attention` where the backend's
  kernel takes dropout: torch's SDPA), with the fully-masked-row and NaN
  guards around every fused kernel;
- `blocked.py`: a dot-product kernel that skips the keys a causal block
  cannot see;
- `chunked.py`: long sequences in query chunks, so the whole score matrix is
  never held at once.

`recording.py` lets `keras_attention.visualization.capture_attention` see
the weights of every call, whichever kernel ran, and `tracing()` tell which
kernel each call took.
"""

from keras import ops

from keras_attention import masking
from keras_attention.kernels import choice as choices
from keras_attention.kernels import explicit
from keras_attention.kernels import fused as fused_kernels
from keras_attention.kernels.choice import choose_kernel
from keras_attention.kernels.choice import takes_fused
from keras_attention.kernels.recording import is_recording
from keras_attention.kernels.recording import is_tracing
from keras_attention.kernels.recording import record
from keras_attention.kernels.recording import recording
from keras_attention.kernels.recording import trace
from keras_attention.kernels.recording import tracing


def as_rank4(mask):
    """`(T, S)` -> `(1, 1, T, S)`; `(B, T, S)` -> `(B, 1, T, S)`; rank 4 as is."""
    if mask is None:
        return None
    if len(mask.shape) == 2:
        return mask[None, None]
    if len(mask.shape) == 3:
        return mask[:, None]
    return mask


def attention(
    query, key, value, scorer, mask=None, causal=False, cached=False, dropout=0.0,
    training=False, seed=None, normalize=None, return_weights=False, fused=True, owner=None,
):
    """Multi-head attention of projected heads, on the kernel the table picks.

    Args:
        query: `(B, T, H, K)`.
        key: `(B, S, G, K)`; query head `h` reads key/value head
            `h // (H / G)`.
        value: `(B, S, G, V)`.
        scorer: a `keras_attention.scoring.Scorer` (or any callable
            `scorer(q, k) -> scores` on `(..., T, K)` and `(..., S, K)`).
        mask: optional boolean mask `(T, S)`, `(B, T, S)` or
            `(B|1, H|1, T, S)`, `True` = may attend.
        causal: bool, query `t` sees keys `0 .. S - T + t` (bottom-right).
        cached: bool, the keys and values are a KV cache (decoding).
        dropout, training, seed: dropout on the weights (explicit kernel,
            or the backend's fused kernel with dropout).
        normalize: optional `normalize(scores, mask) -> weights` instead of
            the masked softmax (hard attention); explicit kernel.
        return_weights: bool, the weights are needed (explicit kernel).
        fused: bool, whether a fused kernel may run.
        owner: the layer calling, for `recording()`.

    Returns:
        `(output, weights)`: output `(B, T, H, V)`; weights `(B, H, T, S)`
        from the explicit kernel, else None.
    """
    mask = as_rank4(mask)
    # Aligned bottom-right, one query sees every key: nothing to mask.
    causal = causal and query.shape[1] != 1
    scale = None if normalize is not None else scorer.dot_product_scale(key.shape[-1])
    chosen = choose_kernel(
        tuple(query.shape),
        tuple(key.shape),
        tuple(value.shape),
        query.dtype,
        dot_product=scale is not None,
        causal=causal,
        cached=cached,
        weights_needed=return_weights,
        dropout_active=bool(training) and dropout > 0,
        fused=fused,
    )
    trace(owner, chosen)
    query_length, key_length = query.shape[1], key.shape[1]
    # A causal mask alone, on equal static lengths, goes to a fused kernel as
    # a flag: no (T, S) mask is built and torch can take its flash kernel.
    causal_flag = (
        causal
        and chosen.kernel != choices.EXPLICIT
        and mask is None
        and query_length is not None
        and query_length == key_length
    )
    if causal and not causal_flag:
        causal_rows = masking.causal_mask(ops.shape(query)[1], ops.shape(key)[1])
        mask = masking.merge_masks(mask, causal_rows[None, None])  # (B|1, H|1, T, S)
    if chosen.kernel == choices.EXPLICIT:
        output, weights = _explicit(
            query, key, value, scorer, mask, dropout, training, seed, normalize
        )
    else:
        output = fused_kernels.attend(
            chosen, query, key, value, mask, scale, causal_flag, dropout=(dropout, seed)
        )
        weights = None
    if owner is not None and is_recording():
        if weights is None:
            if causal_flag:
                mask = masking.causal_mask(query_length, key_length)[None, None]
            _, weights = _explicit(query, key, value, scorer, mask, 0.0, False, None, None)
        record(owner, weights)
    return output, weights


def _explicit(query, key, value, scorer, mask, dropout, training, seed, normalize):
    """The explicit kernel on `(B, T, H, K)` heads; weights `(B, H, T, S)`."""
    heads, groups = query.shape[2], key.shape[2]
    kwargs = dict(dropout=dropout, training=training, seed=seed)
    if normalize is not None:
        kwargs["normalize"] = normalize
    if heads == 1 and groups == 1:
        # One head: the scorer and the normalization see `(B, T, D)`, as
        # single-head attention defines them.
        mask = None if mask is None else mask[:, 0]  # (B|1, T, S)
        output, weights = explicit.attention(
            query[:, :, 0], key[:, :, 0], value[:, :, 0], scorer, mask=mask, **kwargs
        )  # (B, T, V), (B, T, S)
        return output[:, :, None], weights[:, None]
    q = ops.transpose(query, (0, 2, 1, 3))  # (B, H, T, K)
    k = ops.transpose(key, (0, 2, 1, 3))  # (B, G, S, K)
    v = ops.transpose(value, (0, 2, 1, 3))  # (B, G, S, V)
    if heads != groups:
        k = ops.repeat(k, heads // groups, axis=1)  # (B, H, S, K)
        v = ops.repeat(v, heads // groups, axis=1)  # (B, H, S, V)
    output, weights = explicit.attention(q, k, v, scorer, mask=mask, **kwargs)
    return ops.transpose(output, (0, 2, 1, 3)), weights  # (B, T, H, V), (B, H, T, S)


__all__ = [
    "as_rank4",
    "attention",
    "choose_kernel",
    "is_recording",
    "is_tracing",
    "recording",
    "takes_fused",
    "tracing",
]
