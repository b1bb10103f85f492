"""Multi-head attention called as `keras_hub.layers.CachedMultiHeadAttention` is.

Shape legend: `B` batch, `T` query length, `S` key/value length, `L` cache
length, `G` key/value heads, `K` head size.
"""

import keras

from keras_attention.layers.multi_head_attention import MultiHeadAttention

KERAS_HUB_CALL_ORDER = (
    "key",
    "attention_mask",
    "cache",
    "cache_update_index",
    "return_attention_scores",
    "training",
)


@keras.saving.register_keras_serializable(package="keras_attention")
class CachedMultiHeadAttention(MultiHeadAttention):
    """`MultiHeadAttention` with the call of
    `keras_hub.layers.CachedMultiHeadAttention`.

    The same layer, constructor arguments and weights as `MultiHeadAttention`
    (Keras's, and this package's extras); only the order of the call
    arguments is KerasHub's, so `layer(query, value, key, attention_mask,
    cache, cache_update_index)` reads as it does there (Keras takes tensors
    only by position: pass the index by name). The cache is one
    tensor `(B, 2, L, G, K)` (keys, then values), as in KerasHub:

    - `cache=None`: plain attention; `cache_update_index` must then be None;
    - `cache` and `cache_update_index=i`: the `T` new keys and values are
      written at slots `i .. i + T - 1`, and new query `t` attends to slots
      `0 .. i + t`;
    - `cache` and `cache_update_index=None`: the cache is read as it is (a
      filled cross-attention cache).

    Where KerasHub's layer attends wherever `attention_mask` allows (slots
    not yet written included, unless the mask excludes them), this one never
    attends to unwritten slots, and the new positions see each other
    causally; with KerasHub's usual causal mask the two agree. A query that
    may attend to nothing gives 0.

    Args:
        num_heads, key_dim, ...: the arguments of `MultiHeadAttention`.

    Call arguments:
        query: `(B, T, D)`.
        value: `(B, S, Dv)`.
        key: optional `(B, S, Dk)`; defaults to `value`.
        attention_mask: optional boolean `(B, T, S)` (`(B, T, L)` with a
            cache), `True` = may attend.
        cache: optional `(B, 2, L, G, K)`.
        cache_update_index: optional int or scalar integer tensor.
        return_attention_scores: bool, also return the weights
            `(B, H, T, S|L)`.
        training: bool, whether dropout is active.
        The other call arguments of `MultiHeadAttention` (`query_mask`,
        `value_mask`, `key_mask`, `use_causal_mask`) by name.

    Returns:
        `output` `(B, T, D)`; `(output, cache)` with a cache;
        `(output, scores)` or `(output, scores, cache)` with
        `return_attention_scores=True`.

    Example:

    >>> import numpy as np
    >>> layer = CachedMultiHeadAttention(num_heads=2, key_dim=4)
    >>> x = np.random.rand(1, 3, 8).astype("float32")
    >>> cache = np.zeros((1, 2, 5, 2, 4), "float32")
    >>> output, cache = layer(x, x, cache=cache, cache_update_index=0)
    >>> step, cache = layer(x[:, :1], x[:, :1], cache=cache, cache_update_index=3)
    >>> tuple(output.shape), tuple(step.shape), tuple(cache.shape)
    ((1, 3, 8), (1, 1, 8), (1, 2, 5, 2, 4))

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
    """

    def __call__(self, query, value, *args, **kwargs):
        # KerasHub's order of the call arguments after `value`, passed on by
        # name to `MultiHeadAttention` (whose own order differs).
        if len(args) > len(KERAS_HUB_CALL_ORDER):
            raise TypeError(
                "`CachedMultiHeadAttention` takes at most "
                f"{2 + len(KERAS_HUB_CALL_ORDER)} positional arguments "
                f"(query, value, {', '.join(KERAS_HUB_CALL_ORDER)}). "
                f"Received: {2 + len(args)}"
            )
        for name, arg in zip(KERAS_HUB_CALL_ORDER, args):
            if name in kwargs:
                raise TypeError(
                    f"`{name}` was given both by position and by name. "
                    f"Received: {name}={kwargs[name]!r}"
                )
            kwargs[name] = arg
        return super().__call__(query, value, **kwargs)
