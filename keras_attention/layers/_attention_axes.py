"""Attention over several axes, as `keras.layers.MultiHeadAttention` offers it.

Shape legend: `B` batch, `d_i` the other axes of an input, `T'` and `S'`
the attention axes of the query and the key flattened, `B'` the batch and
the other axes flattened, `H` heads, `D` width, `O` output width.

`MultiHeadAttention` attends over axis 1 of `(B, T, D)` inputs; with
`attention_axes` it attends over any axes of `(B, d_1, ..., d_n, D)`
inputs by bringing them to `(B', T', D)`, calling its sequence path, and
bringing the results back (`AttentionOverAxes`, a mixin of the layer).
"""

import functools
import operator

from keras import ops

from keras_attention import _validation
from keras_attention import masking


class AttentionOverAxes:
    """`MultiHeadAttention`'s calls over `attention_axes` (a mixin: it reads
    the layer's `num_heads`, `attention_axes`, `sliding_window` and calls
    its `_call_sequence`)."""

    def _check_shapes(self, query_shape, value_shape, key_shape=None):
        """The inputs' shapes, against each other and `attention_axes`;
        returns the normalized attention axes."""
        _validation.check_multi_head_shapes(query_shape, value_shape, key_shape)
        rank = len(query_shape)
        axes = _validation.normalize_attention_axes(self.attention_axes, rank)
        others = [a for a in range(1, rank - 1) if a not in axes]
        for axis in others:
            _validation.check_same_dim(
                "query", query_shape[axis], "value", value_shape[axis],
                f"size on axis {axis} (not an attention axis)",
            )
        return axes

    def _is_sequence_attention(self, rank, axes):
        """Whether the call is over `(B, T, D)` inputs (the fast paths)."""
        return rank == 3 and axes == (1,)

    def _call_over_axes(
        self, axes, query, value, key, query_mask, value_mask, key_mask,
        attention_mask, return_attention_scores, training, use_causal_mask,
        cache, cache_update_index,
    ):
        """Attention over `attention_axes` of `(B, d_1, ..., d_n, D)` inputs.

        The other axes `d_i` are batch axes: each query attends to the keys
        that share them. The inputs are brought to `(B', T', D)` (`B'` the
        batch and the other axes, `T'` the attention axes, flattened), which
        the sequence path computes, and the results are brought back; the
        scores have Keras's layout `(B, <other axes>, H, <query attention
        axes>, <key attention axes>)`.
        """
        if cache is not None or cache_update_index is not None:
            raise ValueError(
                "A `cache` needs (batch, length, dim) inputs attended over "
                f"axis 1. Received: query with shape {tuple(query.shape)}, "
                f"attention_axes={self.attention_axes!r}"
            )
        if len(axes) > 1 and (use_causal_mask or self.sliding_window is not None):
            raise ValueError(
                "A causal mask or a sliding window orders positions along one "
                "attention axis. Received: attention_axes="
                f"{self.attention_axes!r}, use_causal_mask={use_causal_mask}, "
                f"sliding_window={self.sliding_window}"
            )
        rank = len(query.shape)
        others = [a for a in range(1, rank - 1) if a not in axes]
        order = [0] + others + list(axes)  # batch axes, then attention axes
        layout = _AxesLayout(order, len(others))
        query_dims = layout.dims(query)
        key_dims = layout.dims(value)
        flat_query = layout.flatten(query)  # (B', T', Dq)
        # The same tensor stays one, for self-attention's fused projection.
        flat_value = flat_query if value is query else layout.flatten(value)  # (B', S', Dv)
        flat_key = None if key is None or key is value else layout.flatten(key)  # (B', S', Dk)
        masks = {}
        for name, mask, dims in (
            ("query_mask", query_mask, query_dims),
            ("value_mask", value_mask, key_dims),
            ("key_mask", key_mask, key_dims),
        ):
            mask = masking.standardize_mask(mask, name, ranks=(rank - 1,))
            masks[name] = None if mask is None else layout.flatten(mask, features=False)
        flat_mask = self._flat_attention_mask(attention_mask, layout, query_dims, key_dims)
        outputs = self._call_sequence(
            flat_query, flat_value, flat_key, masks["query_mask"],
            masks["value_mask"], masks["key_mask"], flat_mask,
            return_attention_scores, training, use_causal_mask, None, None,
        )
        output = outputs[0] if return_attention_scores else outputs  # (B', T', *O)
        output = layout.unflatten(output, query_dims)  # (B, d_1, ..., d_n, *O)
        if not return_attention_scores:
            return output
        scores = ops.reshape(
            outputs[1],
            (query_dims[0],) + layout.batch_dims(query_dims) + (self.num_heads,)
            + layout.attention_dims(query_dims) + layout.attention_dims(key_dims),
        )  # (B, <other axes>, H, <query attention axes>, <key attention axes>)
        return output, scores

    def _flat_attention_mask(self, attention_mask, layout, query_dims, key_dims):
        """A Keras attention mask over attention axes, as `(B', H|1, T', S')`.

        As in Keras, the mask is aligned with the scores `(B, <other axes>,
        H, <query attention axes>, <key attention axes>)` from the right:
        missing axes are added before the query attention axes.
        """
        if attention_mask is None:
            return None
        count = len(layout.attention_dims(query_dims))
        rank = 2 + len(layout.batch_dims(query_dims)) + 2 * count
        mask = masking.standardize_mask(
            attention_mask, "attention_mask", ranks=tuple(range(2, rank + 1))
        )
        while len(mask.shape) < rank:
            mask = ops.expand_dims(mask, -2 * count - 1)
        heads = mask.shape[rank - 2 * count - 1]
        heads = self.num_heads if heads not in (1, None) else 1
        target = (
            (query_dims[0],) + layout.batch_dims(query_dims) + (heads,)
            + layout.attention_dims(query_dims) + layout.attention_dims(key_dims)
        )
        try:
            mask = ops.broadcast_to(mask, target)
        except Exception as error:  # each backend raises its own type
            raise ValueError(
                "`attention_mask` must broadcast to the scores (batch, <other "
                "axes>, heads, <query attention axes>, <key attention axes>) "
                f"= {target}. Received: attention_mask with shape "
                f"{tuple(attention_mask.shape)}"
            ) from error
        batch = functools.reduce(operator.mul, target[: -2 * count - 1], 1)
        queries = functools.reduce(operator.mul, layout.attention_dims(query_dims), 1)
        keys = functools.reduce(operator.mul, layout.attention_dims(key_dims), 1)
        return ops.reshape(mask, (batch, heads, queries, keys))  # (B', H|1, T', S')


class _AxesLayout:
    """Moves a tensor's batch axes (the batch, then the axes attention does
    not run over) first and its attention axes after, and flattens each
    group: `(B, d_1, ..., d_n, D) -> (B', T', D)`, and back."""

    def __init__(self, order, count_others):
        self.order = order  # input axes, batch axes first; features excluded
        self.count_others = count_others

    def dims(self, x):
        """`x`'s sizes along `order` (static where known)."""
        shape = ops.shape(x)
        return tuple(shape[a] for a in self.order)

    def batch_dims(self, dims):
        return tuple(dims[1 : 1 + self.count_others])

    def attention_dims(self, dims):
        return tuple(dims[1 + self.count_others :])

    def flatten(self, x, features=True):
        """`(B, d..., D) -> (B', T', D)`, or a mask `(B, d...) -> (B', T')`."""
        perm = self.order + ([len(self.order)] if features else [])
        x = ops.transpose(x, perm)
        dims = self.dims_of_transposed(x)
        batch = functools.reduce(operator.mul, dims[: 1 + self.count_others], 1)
        length = functools.reduce(operator.mul, dims[1 + self.count_others :], 1)
        tail = (x.shape[-1],) if features else ()
        return ops.reshape(x, (batch, length) + tail)

    def dims_of_transposed(self, x):
        shape = ops.shape(x)
        return tuple(shape[: len(self.order)])

    def unflatten(self, x, dims):
        """`(B', T', *O) -> (B, d_1, ..., d_n, *O)`, `dims` the query's
        sizes along `order`."""
        x = ops.reshape(x, tuple(dims) + tuple(x.shape[2:]))  # (B, <others>, <attention>, *O)
        inverse = [self.order.index(a) for a in range(len(self.order))]
        return ops.transpose(x, inverse + list(range(len(self.order), len(x.shape))))
