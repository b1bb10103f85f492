"""Multi-head attention with any scorer, grouped-query heads and a KV cache.

Shape legend: `B` batch, `T` query length, `S` key/value length, `L` cache
length, `H` query heads, `G` key/value heads (`H` divisible by `G`), `K` key
head size, `V` value head size, `D` model width, `O` output width.
"""

from typing import Any

import keras
from keras import ops

from keras_attention import _validation
from keras_attention import backend
from keras_attention import kernels
from keras_attention import kv_cache
from keras_attention import masking
from keras_attention import scoring
from keras_attention._typing import Constraint
from keras_attention._typing import Initializer
from keras_attention._typing import IntOrTensor
from keras_attention._typing import Regularizer
from keras_attention._typing import Scorer
from keras_attention._typing import Tensor
from keras_attention.layers import _projection
from keras_attention.layers._attention_axes import AttentionOverAxes
from keras_attention.layers._direct_calls import DirectCalls
from keras_attention.layers._keras_mha import KerasInterface


@keras.saving.register_keras_serializable(package="keras_attention")
class MultiHeadAttention(DirectCalls, AttentionOverAxes, KerasInterface, keras.layers.Layer):
    """Multi-head attention, a drop-in for `keras.layers.MultiHeadAttention`.

    The pipeline of "Attention Is All You Need": project the query to `H`
    heads and the key and value to `G` heads (linear maps), attend per head
    with the scorer (`softmax(s(q, k)) v`), concatenate the heads and project
    back:

        head_h = softmax(s(Q W_q^h, K W_k^g)) V W_v^g,   g = h // (H / G)
        output = concat(head_1, ..., head_H) W_o

    `num_key_value_heads=G < H` is grouped-query attention (each key/value
    head serves `H / G` query heads); `G = 1` is multi-query attention.

    The layer keeps the projections, the heads and the cache; the attention
    is the package's core (`keras_attention.kernels`), whose table
    (`kernels/choice.py`) picks a fused kernel for a (scaled) dot-product
    scorer (the backend's own, a blocked causal kernel, or query chunks for
    long sequences) and the explicit kernel for any other scorer, returned
    scores, dropout in training (but on torch, whose fused kernel takes
    dropout), or `fused=False` (`uses_fused_path` says which). Both give a fully masked query row an output of exactly 0
    (before the output projection); Keras's layer gives it the mean of the
    values. A query that may attend to nothing receives nothing.

    Keras's arguments, with Keras's meaning: `attention_axes` attends over
    those axes of `(B, d_1, ..., d_n, D)` inputs (the other `d_i` act as
    batch axes; scores `(B, <other axes>, H, <query attention axes>, <key
    attention axes>)`); `use_gate` multiplies each head's output by
    `sigmoid(query W_g)` before the output projection (Qiu et al., 2025);
    `sliding_window=w` lets query `t` see keys within `w - 1` of its
    position (with `use_causal_mask`, itself and the `w - 1` before it, as
    Mistral); `flash_attention` is Keras's name for `fused`.

    Masks are boolean, `True` = may attend, and combine with AND (padding,
    attention, causal and Keras implicit masks); the inputs' masks are never
    changed. With `use_causal_mask=True` and `T != S` the causal mask is
    bottom-right aligned: query `t` sees keys `0 .. S - T + t`.

    KV cache (layout: `keras_attention.kv_cache`): one tensor
    `(B, 2, L, G, K)`, keys then values. A call with `cache_update_index=i`
    writes the `T` new keys and values at slots `i .. i + T - 1` (with
    `ops.slice_update`: inside `ops.while_loop` and under jit too) and new
    query `t` attends to slots `0 .. i + t` only, never to unwritten ones.
    With `cache_update_index=None` the cache is read as it is (a filled
    cross-attention cache; `key`/`value` unused). The call then also returns
    the cache.

    Args:
        num_heads: positive int, the number of query heads `H`.
        key_dim: positive int, the size `K` of each query and key head.
        value_dim: optional positive int, the size `V` of each value head.
            Defaults to `key_dim`.
        dropout: float in [0, 1), dropout rate on the attention weights.
        use_bias: bool, whether the projections have biases.
        output_shape: optional int or tuple of ints, the output's trailing
            dimensions `O` (`(B, T, *O)`). Defaults to the query width.
        num_key_value_heads: optional positive int `G` dividing `num_heads`.
            Defaults to `num_heads`.
        score: the scoring function applied per head: `"scaled_dot"`
            (default), `"dot"`, `"additive"`, `"bilinear"`, a
            `keras_attention.scoring.Scorer` or a config. Scorer weights are
            shared by all heads.
        rotary_embedding: optional `keras_attention.layers.RotaryEmbedding`
            (or its config) applied to the query and key heads after the
            projection (RoPE, Su et al. 2021), at positions
            `cache_update_index + t` (from 0 without a cache). Meant for
            self-attention.
        fused: bool, whether a fused kernel may be used. Defaults to True.
        attention_axes: optional int or tuple of ints, the axes of the
            inputs attention runs over (negative ones count from the end, so
            `-2` is the axis before the features). Defaults to every axis but
            the batch and the features: axis 1 of `(B, T, D)` inputs. Inputs
            of rank 3 attended over axis 1 take the fast paths; others are
            brought to that form and back.
        use_gate: bool, whether a sigmoid gate `(D, H, V)` of the query
            scales each head's output. Defaults to False.
        sliding_window: optional positive int `w`: query `t` (at position
            `S - T + t`, or `cache_update_index + t` with a cache,
            bottom-right as the causal mask; Keras aligns top-left, the same
            when `T = S`) sees keys `j` with `|position - j| < w`. Not with
            several attention axes.
        flash_attention: optional bool, Keras's name for `fused`: `None`
            leaves `fused` to decide, `False` is `fused=False`, `True`
            forces the fused kernel and so refuses dropout, returned scores,
            a scorer other than a dot product and `value_dim != key_dim`
            (`ValueError`). `keras.config.enable_flash_attention()` is not
            read.
        seed: optional int, the seed of the dropout.
        kernel_initializer: as in `keras.layers.MultiHeadAttention`.
        bias_initializer: as in `keras.layers.MultiHeadAttention`.
        kernel_regularizer: as in `keras.layers.MultiHeadAttention`.
        bias_regularizer: as in `keras.layers.MultiHeadAttention`.
        activity_regularizer: as in `keras.layers.MultiHeadAttention`.
        kernel_constraint: as in `keras.layers.MultiHeadAttention`.
        bias_constraint: as in `keras.layers.MultiHeadAttention`.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        query: `(B, T, Dq)` (or `(B, d_1, ..., d_n, Dq)` with
            `attention_axes`).
        value: `(B, S, Dv)` (of the query's rank).
        key: optional `(B, S, Dk)`; defaults to `value`. All its dimensions
            but the last must equal the value's.
        query_mask: optional `(B, T)` padding mask.
        value_mask: optional `(B, S)` padding mask (`(B, L)` with a cache).
        key_mask: optional `(B, S)` padding mask, combined with `value_mask`.
        attention_mask: optional `(B, T, S)`, `(T, S)` or `(B, H, T, S)` mask
            (`S = L` with a cache); batch and head axes may be 1. Every axis
            is checked against the inputs, as is the cache's batch axis.
        return_attention_scores: bool, also return the weights
            `(B, H, T, S)`.
        training: bool, whether dropout is active.
        use_causal_mask: bool, query `t` sees keys `0 .. S - T + t`.
        cache: optional `(B, 2, L, G, K)` key/value cache.
        cache_update_index: optional int, numpy integer or scalar integer
            tensor, where the new keys and values are written; `None` reads
            the cache as it is. Whenever its value is known (eagerly) it must
            satisfy `0 <= i` and `i + T <= L`, else a `ValueError`; a float or
            bool is a `ValueError` too. Inside a traced function (`jax.jit`,
            `tf.function`) its value is unknown: it is clipped to
            `[0, L - T]`, so nothing is written outside the cache, and the
            caller's loop keeps it in range.

    Returns:
        `output` `(B, T, O)`, or a tuple of `output`, the scores (when
        `return_attention_scores`) and the updated cache (when `cache` is
        given), in that order.

    Example:

    >>> import numpy as np
    >>> layer = MultiHeadAttention(num_heads=4, key_dim=8)
    >>> x = np.random.rand(2, 6, 32).astype("float32")
    >>> output, scores = layer(x, x, return_attention_scores=True)
    >>> tuple(output.shape), tuple(scores.shape)
    ((2, 6, 32), (2, 4, 6, 6))

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
        - [Shazeer, 2019 (multi-query)](https://arxiv.org/abs/1911.02150)
        - [Ainslie et al., 2023 (grouped-query)](https://arxiv.org/abs/2305.13245)
        - [Rabe and Staats, 2021](https://arxiv.org/abs/2112.05682)
        - [Qiu et al., 2025 (gated attention)](https://arxiv.org/abs/2505.06708)
        - [Beltagy et al., 2020 (sliding window)](https://arxiv.org/abs/2004.05150)
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | tuple[int, ...] | None = None,
        num_key_value_heads: int | None = None,
        score: Scorer = "scaled_dot",
        rotary_embedding: keras.layers.Layer | None = None,
        fused: bool = True,
        seed: int | None = None,
        kernel_initializer: Initializer = "glorot_uniform",
        bias_initializer: Initializer = "zeros",
        kernel_regularizer: Regularizer | None = None,
        bias_regularizer: Regularizer | None = None,
        activity_regularizer: Regularizer | None = None,
        kernel_constraint: Constraint | None = None,
        bias_constraint: Constraint | None = None,
        attention_axes: int | tuple[int, ...] | None = None,
        use_gate: bool = False,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        check = _validation.check_positive_int
        self.num_heads = check("num_heads", num_heads)
        self.key_dim = check("key_dim", key_dim)
        self.value_dim = check("value_dim", value_dim, allow_none=True)
        self.num_key_value_heads = check(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        _validation.check_divisible(
            "num_heads", self.num_heads, "num_key_value_heads", self.num_key_value_heads
        )
        self.dropout = _validation.check_rate("dropout", dropout)
        self.use_bias = bool(use_bias)
        self.output_shape = _validation.check_output_shape(output_shape)
        self.attention_axes = _validation.check_attention_axes(attention_axes)
        self.use_gate = bool(use_gate)
        self.sliding_window = check("sliding_window", sliding_window, allow_none=True)
        self._store_fused(fused, flash_attention)
        # Self-attention's Q/K/V as one matmul, where the backend prefers it;
        # benchmarks/mha_speed.py toggles it.
        self.fuse_projections = backend.preferences().fuse_projections
        self.seed = _validation.check_seed("seed", seed)
        self.score = scoring.get(score, dtype=self.dtype_policy)
        self.rotary_embedding = _validation.check_layer(
            "rotary_embedding", rotary_embedding, "a RotaryEmbedding layer"
        )
        self._store_keras_objects(
            kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer, kernel_constraint, bias_constraint,
        )
        if flash_attention:
            self._check_flash_attention()
        self.seed_generator = (
            keras.random.SeedGenerator(self.seed) if self.dropout > 0 else None
        )
        self.supports_masking = True

    @property
    def _kv_heads(self):
        return self.num_key_value_heads or self.num_heads

    @property
    def _value_dim(self):
        return self.value_dim or self.key_dim

    def build(self, query_shape, value_shape, key_shape=None):
        self._check_shapes(query_shape, value_shape, key_shape)
        key_shape = value_shape if key_shape is None else key_shape
        # Same weight layout as keras.layers.MultiHeadAttention, so weights
        # move between the two unchanged. Inputs of any rank are brought to
        # (B, T, D) before the projections (they act on the last axis).
        (
            self.query_dense,
            self.key_dense,
            self.gate_dense,
            self.value_dense,
            self.output_dense,
        ) = _projection.attention_projections(
            self, query_shape[-1], value_shape[-1], key_shape[-1]
        )
        heads = self.num_heads
        head_shape = (None, heads, None, self.key_dim)
        self.score.build_or_check(head_shape, head_shape)
        if self.rotary_embedding is not None and not self.rotary_embedding.built:
            self.rotary_embedding.build((None, None, heads, self.key_dim))
        self.built = True

    def uses_fused_path(self, training=False, return_attention_scores=False):
        """Whether a call with these arguments takes a fused kernel: a (scaled)
        dot-product scorer, equal key and value head sizes, no returned
        scores, no dropout in training unless the backend's fused kernel
        takes dropout (torch; inference stays fused)."""
        return not kernels.takes_fused(
            self.fused,
            self.score.dot_product_scale(self.key_dim) is not None,
            return_attention_scores,
            bool(training) and self.dropout > 0,
            self._value_dim == self.key_dim,
        )

    def __call__(self, query, value, *args, **kwargs):
        query, value, args, kwargs = _projection.convert_self_attention_inputs(
            self, query, value, args, kwargs
        )
        return super().__call__(query, value, *args, **kwargs)

    def call(
        self,
        query: Tensor,
        value: Tensor,
        key: Tensor | None = None,
        query_mask: Tensor | None = None,
        value_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        return_attention_scores: bool = False,
        training: bool | None = None,
        use_causal_mask: bool = False,
        cache: Tensor | None = None,
        cache_update_index: IntOrTensor | None = None,
    ):
        axes = self._check_shapes(
            query.shape, value.shape, None if key is None else key.shape
        )
        self._check_scores_allowed(return_attention_scores)
        if not self._is_sequence_attention(len(query.shape), axes):
            return self._call_over_axes(
                axes, query, value, key, query_mask, value_mask, key_mask,
                attention_mask, return_attention_scores, training,
                use_causal_mask, cache, cache_update_index,
            )
        return self._call_sequence(
            query, value, key, query_mask, value_mask, key_mask, attention_mask,
            return_attention_scores, training, use_causal_mask, cache,
            cache_update_index,
        )

    def _call_sequence(
        self, query, value, key, query_mask, value_mask, key_mask, attention_mask,
        return_attention_scores, training, use_causal_mask, cache,
        cache_update_index,
    ):
        """`call` on `(B, T, D)` inputs attended over axis 1."""
        # Before the rotary embedding reads the index as its start.
        known_index = kv_cache.check_call(
            cache, cache_update_index, query.shape, value.shape, self._kv_heads, self.key_dim,
            self._value_dim,
        )
        reads_cache = cache is not None and cache_update_index is None
        gate = None
        if self.use_gate:
            gate = _projection.project(self.gate_dense, query)  # (B, T, H, V)
        q, k, v = self._project_heads(
            query, value, key, reads_cache, writes_cache=cache is not None and not reads_cache
        )  # (B, T|S, H|G, K)
        if self.rotary_embedding is not None:
            # The index's value where it is known: the embedding need not
            # read it again.
            start = next(i for i in (known_index, cache_update_index, 0) if i is not None)
            q = self.rotary_embedding(q, start_index=start)  # (B, T, H, K)
            if not reads_cache:
                k = self.rotary_embedding(k, start_index=start)  # (B, S, G, K)
        written = None  # (T, L): the cache slots each new query may see
        # Where the index is known, only the slots written so far are read;
        # scores and recorded weights keep the cache's length `L`.
        written_only = known_index is not None and not (
            return_attention_scores or kernels.is_recording()
        )
        if cache is not None:
            cache, k, v, written = kv_cache.update(
                cache, k, v, cache_update_index, known_index, written_only
            )  # k, v: (B, L, G, K)
        mask = masking.compute_attention_mask(
            query,
            k,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            num_heads=self.num_heads,
        )
        mask = masking.merge_masks(
            mask, written, self._window_mask(q, k, cache_update_index)
        )
        causal = use_causal_mask and cache is None
        if written_only:
            k, v, mask = kv_cache.written_slots(known_index + q.shape[1], k, v, mask)
            causal = True
        if type(self)._compute_attention is MultiHeadAttention._compute_attention:
            output, scores = self._attend(
                q, k, v, mask, causal, cache is not None, return_attention_scores, training
            )  # (B, T, H, V), (B, H, T, S) or None
        else:
            # A subclass's `_compute_attention` (Keras's override point) gets
            # Keras's arguments: one mask, the causal one included.
            if causal:
                mask = masking.merge_masks(
                    mask, masking.causal_mask(ops.shape(q)[1], ops.shape(k)[1])
                )
            output, scores = self._call_compute_attention(
                q, k, v, mask, training, return_attention_scores
            )
        if gate is not None:
            output = output * gate  # (B, T, H, V)
        output = _projection.project(self.output_dense, output, merge_heads=True)

        outputs = (output,)  # (B, T, *O)
        if return_attention_scores:
            outputs += (scores,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _window_mask(self, q, k, cache_update_index):
        """The `(T, S)` sliding-window band, or None without a window: query
        `t` at position `i + t` (`i` the cache index; without one
        `S - T`, bottom-right as the causal mask) sees keys within
        `sliding_window - 1` of it."""
        if self.sliding_window is None:
            return None
        return masking.sliding_window_mask(
            ops.shape(q)[1], ops.shape(k)[1], self.sliding_window,
            query_start=cache_update_index,
        )

    def _attend(self, q, k, v, mask, causal, cached, return_attention_scores, training):
        return kernels.attention(
            q, k, v, self.score,
            mask=mask,
            causal=causal,
            cached=cached,
            dropout=self.dropout, training=training, seed=self.seed_generator,
            return_weights=return_attention_scores,
            fused=self.fused,
            owner=self,
        )

    def _project_heads(self, query, value, key, reads_cache, writes_cache=False):
        """`q` `(B, T, H, K)`, and `k`, `v` `(B, S, G, K|V)` unless the cache
        is read as it is (then None)."""
        denses = (self.query_dense, self.key_dense, self.value_dense)
        fuse = self.fuse_projections or (
            writes_cache and backend.preferences().fuse_cached_projections
        )
        if (
            self.fused
            and fuse
            and not reads_cache
            and query is value
            and (key is None or key is value)
            and _projection.fusable(denses, query.shape[-1])
        ):
            return _projection.project_self(*denses, query)
        q = _projection.project(self.query_dense, query)  # (B, T, H, K)
        if reads_cache:
            return q, None, None
        return (q,) + self._project_key_value(value, key)

    def _project_key_value(self, value, key=None):
        key = value if key is None else key
        return (
            _projection.project(self.key_dense, key),  # (B, S, G, K)
            _projection.project(self.value_dense, value),  # (B, S, G, V)
        )

    def compute_cache(self, value, key=None):
        """The cache `(B, 2, S, G, K)` of a whole `value` `(B, S, Dv)` (and
        `key`, default `value`): a cross-attention cache, filled once from
        the encoder output, for calls with `cache_update_index=None`."""
        kv_cache.check_head_sizes(self.key_dim, self._value_dim)
        k, v = self._project_key_value(value, key)  # (B, S, G, K)
        if self.rotary_embedding is not None:
            k = self.rotary_embedding(k, start_index=0)
        return kv_cache.pack(k, v)  # (B, 2, S, G, K)

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        self._check_shapes(
            query_shape, value_shape, None if key_shape is None else tuple(key_shape)
        )
        if self.output_shape:
            return query_shape[:-1] + tuple(self.output_shape)
        return query_shape

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        return_attention_scores=False,
        cache=None,
        **kwargs,
    ):
        key_shape = None if key is None else key.shape
        axes = self._check_shapes(query.shape, value.shape, key_shape)
        dtype = self.compute_dtype
        outputs = (
            keras.KerasTensor(
                self.compute_output_shape(query.shape, value.shape, key_shape), dtype
            ),
        )
        if return_attention_scores:
            if self._is_sequence_attention(len(query.shape), axes):
                key_length = value.shape[1] if cache is None else kv_cache.length(cache)
                scores_shape = (query.shape[0], self.num_heads, query.shape[1], key_length)
            else:
                rank = len(query.shape)
                others = tuple(query.shape[a] for a in range(1, rank - 1) if a not in axes)
                scores_shape = (
                    (query.shape[0],) + others + (self.num_heads,)
                    + tuple(query.shape[a] for a in axes)
                    + tuple(value.shape[a] for a in axes)
                )
            outputs += (keras.KerasTensor(scores_shape, dtype),)
        if cache is not None:
            outputs += (keras.KerasTensor(cache.shape, dtype=cache.dtype),)
        return outputs[0] if len(outputs) == 1 else outputs
