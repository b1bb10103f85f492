"""Multi-head attention with any scorer, grouped-query heads and a KV cache.

Shape legend: `B` batch, `T` query length, `S` key/value length, `L` cache
length, `H` query heads, `G` key/value heads (`H` divisible by `G`), `K` key
head size, `V` value head size, `D` model width, `O` output width.
"""

import keras
import numpy as np
from keras import ops

from keras_attention import _validation
from keras_attention import masking
from keras_attention import ops as attention_ops
from keras_attention import scoring
from keras_attention.layers import _gemm


@keras.saving.register_keras_serializable(package="keras_attention")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention, a drop-in for `keras.layers.MultiHeadAttention`.

    The pipeline of "Attention Is All You Need": project the query to `H`
    heads and the key and value to `G` heads (linear maps), attend per head
    with the scorer (`softmax(s(q, k)) v`), concatenate the heads and project
    back:

        head_h = softmax(s(Q W_q^h, K W_k^g)) V W_v^g,   g = h // (H / G)
        output = concat(head_1, ..., head_H) W_o

    `num_key_value_heads=G < H` is grouped-query attention (each key/value
    head serves `H / G` query heads); `G = 1` is multi-query attention.

    Two paths compute the same function:

    - the fused path, when the scorer is a (scaled) dot product: the backend's
      kernel the backend runs fastest: torch's fused
      `scaled_dot_product_attention`; on TensorFlow (and on JAX for causal
      or short queries) a blocked kernel that, with the causal mask, never
      computes the scores of key blocks a query block cannot see; Keras's
      `ops.dot_product_attention` otherwise. The projections are plain GEMMs
      (one Q/K/V matmul for self-attention on TensorFlow, the bias inside
      the GEMM on torch). Long sequences on backends without a
      memory-efficient kernel are processed in query chunks, so the full
      `(B, H, T, S)` score matrix is never held at once.
    - the explicit path, for every other scorer, for returned attention
      scores, for dropout in training, or with `fused=False`.

    `uses_fused_path(...)` says which one a call takes. Both give fully masked
    query rows an output of exactly 0.

    Masks are boolean, `True` = may attend. Padding masks, attention masks,
    the causal mask and Keras implicit masks combine with AND; the masks of the
    input tensors are never changed. With `use_causal_mask=True` and `T != S`
    the causal mask is bottom-right aligned: query `t` sees keys
    `0 .. S - T + t`.

    KV cache (incremental decoding): `cache` is one tensor
    `(B, 2, L, G, K)` holding keys then values. A call with
    `cache_update_index=i` projects the `T` new key/value positions, writes
    them at slots `i .. i + T - 1` (with `ops.slice_update`, so it works inside
    `ops.while_loop` and under jit) and attends to slots `0 .. i + t` for new
    query `t` only, never to slots not yet written. With
    `cache_update_index=None` the cache is read as it is (a filled
    cross-attention cache) and `key`/`value` are not used. The call then also
    returns the updated cache.

    Args:
        num_heads: positive int, the number of query heads `H`.
        key_dim: positive int, the size `K` of each query and key head.
        value_dim: optional positive int, the size `V` of each value head.
            Defaults to `key_dim`.
        dropout: float in [0, 1), dropout rate on the attention weights.
        use_bias: bool, whether the projections have biases.
        output_shape: optional int (or 1-tuple), the output width `O`.
            Defaults to the query width.
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
        fused: bool, whether the fused kernel may be used. Defaults to True.
        seed: optional int, the seed of the dropout.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as in `keras.layers.MultiHeadAttention`.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        query: `(B, T, Dq)`.
        value: `(B, S, Dv)`.
        key: optional `(B, S, Dk)`; defaults to `value`.
        query_mask: optional `(B, T)` padding mask.
        value_mask: optional `(B, S)` padding mask (`(B, L)` with a cache).
        key_mask: optional `(B, S)` padding mask, combined with `value_mask`.
        attention_mask: optional `(B, T, S)`, `(T, S)` or `(B, H, T, S)` mask
            (`S = L` with a cache).
        return_attention_scores: bool, also return the weights
            `(B, H, T, S)`.
        training: bool, whether dropout is active.
        use_causal_mask: bool, query `t` sees keys `0 .. S - T + t`.
        cache: optional `(B, 2, L, G, K)` key/value cache.
        cache_update_index: optional int or scalar int tensor, where the new
            keys and values are written; `None` reads the cache as it is.

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
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        num_key_value_heads=None,
        score="scaled_dot",
        rotary_embedding=None,
        fused=True,
        seed=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        **kwargs,
    ):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.num_heads = _validation.check_positive_int("num_heads", num_heads)
        self.key_dim = _validation.check_positive_int("key_dim", key_dim)
        self.value_dim = _validation.check_positive_int(
            "value_dim", value_dim, allow_none=True
        )
        self.num_key_value_heads = _validation.check_positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if self.num_heads % self._kv_heads:
            raise ValueError(
                "`num_heads` must be divisible by `num_key_value_heads`. "
                f"Received: num_heads={num_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        self.dropout = _validation.check_rate("dropout", dropout)
        self.use_bias = bool(use_bias)
        self.output_shape = _standardize_output_shape(output_shape)
        self.fused = bool(fused)
        # Self-attention projections as one matmul (part of the fused path):
        # faster on TensorFlow only. XLA runs three projections faster (the
        # backward pass especially) and on torch three GEMMs with the bias
        # inside beat one whose gradient must be concatenated
        # (benchmarks/README.md); benchmarks/mha_speed.py toggles it.
        self.fuse_projections = keras.backend.backend() == "tensorflow"
        self.seed = _validation.check_seed("seed", seed)
        self.score = scoring.get(score, dtype=self.dtype_policy)
        if isinstance(rotary_embedding, dict):
            rotary_embedding = keras.saving.deserialize_keras_object(
                rotary_embedding
            )
        if rotary_embedding is not None and not isinstance(
            rotary_embedding, keras.layers.Layer
        ):
            raise ValueError(
                "`rotary_embedding` must be None, a RotaryEmbedding layer or "
                f"its config. Received: rotary_embedding={rotary_embedding!r}"
            )
        self.rotary_embedding = rotary_embedding
        # Set by `keras_attention.visualization.capture_attention`: a list
        # that each call appends its attention weights to.
        self._attention_recorder = None
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
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

    def _dense(self, equation, output_shape, bias_axes, name):
        initializers = {
            # Fresh initializer instances, so that no two kernels start equal.
            "kernel_initializer": self.kernel_initializer.__class__.from_config(
                self.kernel_initializer.get_config()
            ),
            "bias_initializer": self.bias_initializer.__class__.from_config(
                self.bias_initializer.get_config()
            ),
        }
        dense = keras.layers.EinsumDense(
            equation,
            output_shape=output_shape,
            bias_axes=bias_axes if self.use_bias else None,
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
            name=name,
            **initializers,
        )
        # The projections are position-wise, so a padding mask carries over;
        # without this, Keras warns on every call with a masked input that the
        # projection "destroys the mask".
        dense.supports_masking = True
        return dense

    def build(self, query_shape, value_shape, key_shape=None):
        _check_input_shapes(query_shape, value_shape, key_shape)
        key_shape = value_shape if key_shape is None else key_shape
        heads, kv_heads = self.num_heads, self._kv_heads
        # Same weight layout as keras.layers.MultiHeadAttention, so weights
        # move between the two unchanged.
        self.query_dense = self._dense(
            "btd,dhk->bthk", (None, heads, self.key_dim), "hk", "query"
        )
        self.key_dense = self._dense(
            "bsd,dgk->bsgk", (None, kv_heads, self.key_dim), "gk", "key"
        )
        self.value_dense = self._dense(
            "bsd,dgv->bsgv", (None, kv_heads, self._value_dim), "gv", "value"
        )
        output_width = self.output_shape[-1] if self.output_shape else query_shape[-1]
        self.output_dense = self._dense(
            "bthv,hvo->bto", (None, output_width), "o", "attention_output"
        )
        self.query_dense.build(query_shape)
        self.key_dense.build(key_shape)
        self.value_dense.build(value_shape)
        self.output_dense.build(
            (query_shape[0], query_shape[1], heads, self._value_dim)
        )
        head_query = (None, heads, None, self.key_dim)
        head_key = (None, heads, None, self.key_dim)
        self.score.build_or_check(head_query, head_key)
        if self.rotary_embedding is not None and not self.rotary_embedding.built:
            self.rotary_embedding.build((None, None, heads, self.key_dim))
        self.built = True

    def uses_fused_path(self, training=False, return_attention_scores=False):
        """Whether a call with these arguments takes the fused kernel.

        The fused path needs a (scaled) dot-product scorer, equal key and
        value head sizes, no returned scores, and no active dropout: dropout
        during training takes the explicit path, inference stays fused.
        """
        return (
            self.fused
            and self.score.dot_product_scale(self.key_dim) is not None
            and self._value_dim == self.key_dim
            and not return_attention_scores
            and not (training and self.dropout > 0)
        )

    def __call__(self, query, value, *args, **kwargs):
        key = kwargs.get("key", args[0] if args else None)
        if (
            value is query
            and (key is None or key is query)
            and not ops.is_tensor(query)
            and not isinstance(query, keras.KerasTensor)
        ):
            # Keras converts each argument on its own, so `layer(x, x)` with a
            # numpy `x` would reach `call` as two tensors and miss the fused
            # self-attention projection: convert it once, here. (A numpy
            # array carries no Keras mask to keep.)
            query = value = self.dtype_policy.convert_input(
                query, self.autocast, self.input_dtype
            )
            if key is not None:
                key = query
                if "key" in kwargs:
                    kwargs["key"] = key
                else:
                    args = (key,) + tuple(args[1:])
        return super().__call__(query, value, *args, **kwargs)

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        _check_input_shapes(
            query.shape, value.shape, None if key is None else key.shape
        )
        if cache_update_index is not None and cache is None:
            raise ValueError(
                "`cache_update_index` needs a `cache`. Received: "
                f"cache=None, cache_update_index={cache_update_index!r}"
            )
        reads_cache = cache is not None and cache_update_index is None
        if self._fuses_projections(query, value, key) and not reads_cache:
            q, k, v = self._project_self(query)
        else:
            q = self._project(self.query_dense, query)  # (B, T, H, K)
            if not reads_cache:
                k, v = self._project_key_value(query, value, key)
        if self.rotary_embedding is not None:
            start = 0 if cache_update_index is None else cache_update_index
            q = self.rotary_embedding(q, start_index=start)  # (B, T, H, K)
            if not reads_cache:
                k = self.rotary_embedding(k, start_index=start)  # (B, S, G, K)
        if cache is not None:
            self._check_cache(cache, cache_update_index, query.shape[1])
            new_length, query_length = value.shape[1], query.shape[1]
            if (
                not reads_cache
                and None not in (new_length, query_length)
                and new_length != query_length
            ):
                raise ValueError(
                    "A cache update writes the keys and values of the queries' "
                    "own positions, so `value` must have the query's length; "
                    "fill a cross-attention cache with `compute_cache`. "
                    f"Received: query length={query_length}, value length="
                    f"{new_length}, cache_update_index={cache_update_index!r}"
                )
            if reads_cache:
                k, v = cache[:, 0], cache[:, 1]  # (B, L, G, K)
            else:
                update = ops.stack([k, v], axis=1)  # (B, 2, T, G, K)
                start = [0, 0, cache_update_index, 0, 0]
                cache = ops.slice_update(cache, start, ops.cast(update, cache.dtype))
                k, v = cache[:, 0], cache[:, 1]  # (B, L, G, K)

        mask = masking.compute_attention_mask(
            query,
            k,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
        )
        fused = self.uses_fused_path(training, return_attention_scores)
        query_length, key_length = q.shape[1], k.shape[1]
        # A causal mask alone, on equal static lengths, goes to the kernel as
        # a flag: no (T, S) mask is built and torch can take its flash kernel.
        causal_flag = (
            fused
            and use_causal_mask
            and mask is None
            and cache is None
            and query_length is not None
            and query_length == key_length
        )
        if use_causal_mask and cache is None and not causal_flag:
            mask = masking.merge_masks(
                mask, masking.causal_mask(ops.shape(q)[1], ops.shape(k)[1])
            )
        if cache is not None and cache_update_index is not None:
            written = masking.causal_mask(
                ops.shape(q)[1], ops.shape(k)[1], query_start=cache_update_index
            )  # (T, L)
            mask = masking.merge_masks(mask, written)
        if mask is not None:
            mask = _to_rank4(mask)  # (B|1, H|1, T, S)

        if fused:
            output = self._fused_attention(
                q, k, v, mask, causal_flag, cached=cache is not None
            )
            scores = None
        else:
            output, scores = self._explicit_attention(q, k, v, mask, training)
        if self._attention_recorder is not None:
            self._record(q, k, v, mask, scores, causal_flag)
        output = self._project(self.output_dense, output)  # (B, T, O)

        outputs = (output,)
        if return_attention_scores:
            outputs += (scores,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _fuses_projections(self, query, value, key):
        """Whether Q, K and V come from one matmul: self-attention only."""
        denses = (self.query_dense, self.key_dense, self.value_dense)
        return (
            self.fused
            and self.fuse_projections
            and query is value
            and (key is None or key is value)
            # Quantized or LoRA kernels are not plain weights to concatenate.
            and all(
                d.quantization_mode is None
                and not d.lora_enabled
                and d.kernel.shape[0] == query.shape[-1]
                for d in denses
            )
        )

    def _project_self(self, x):
        """Self-attention's Q, K and V as one `(D, HK + GK + GV)` matmul.

        One large matmul instead of three smaller ones reads `x` once and
        fills the machine better; the kernels stay three weights (Keras's
        layout) and are concatenated on the fly, which costs `O(D * N)` next to
        the matmul's `O(B * T * D * N)`.
        """
        denses = (self.query_dense, self.key_dense, self.value_dense)
        width = x.shape[-1]
        kernel = ops.concatenate(
            [ops.reshape(d.kernel, (width, -1)) for d in denses], axis=1
        )  # (D, N)
        bias = None
        if self.use_bias:
            bias = ops.concatenate([ops.reshape(d.bias, (-1,)) for d in denses])
        qkv = _gemm.linear(x, kernel, bias)  # (B, T, N)
        heads, kv_heads = self.num_heads, self._kv_heads
        q_size, k_size = heads * self.key_dim, kv_heads * self.key_dim
        q, k, v = ops.split(qkv, [q_size, q_size + k_size], axis=-1)
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        q = ops.reshape(q, (batch, length, heads, self.key_dim))  # (B, T, H, K)
        k = ops.reshape(k, (batch, length, kv_heads, self.key_dim))  # (B, T, G, K)
        v = ops.reshape(v, (batch, length, kv_heads, self._value_dim))  # (B, T, G, V)
        return q, k, v

    def _record(self, q, k, v, mask, scores, causal_flag):
        """Hands the weights to `capture_attention`, recomputed if fused."""
        if scores is None:
            if causal_flag:
                causal = masking.causal_mask(ops.shape(q)[1], ops.shape(k)[1])
                mask = _to_rank4(causal)  # (1, 1, T, S)
            _, scores = self._explicit_attention(q, k, v, mask, training=False)
        self._attention_recorder.append((self, scores))

    def compute_cache(self, value, key=None):
        """Projects a whole key/value sequence into the cache layout.

        Fills a cross-attention cache once (from the encoder output), to be
        read by later calls with `cache_update_index=None`.

        Args:
            value: `(B, S, Dv)`.
            key: optional `(B, S, Dk)`; defaults to `value`.

        Returns:
            The cache `(B, 2, S, G, K)`: keys, then values.
        """
        if self._value_dim != self.key_dim:
            raise ValueError(
                "A KV cache needs `value_dim == key_dim`. Received: "
                f"key_dim={self.key_dim}, value_dim={self._value_dim}"
            )
        k, v = self._project_key_value(None, value, key)  # (B, S, G, K)
        if self.rotary_embedding is not None:
            k = self.rotary_embedding(k, start_index=0)
        return ops.stack([k, v], axis=1)  # (B, 2, S, G, K)

    def _project(self, dense, x):
        """A projection layer's call; on torch one GEMM with its bias.

        `EinsumDense` runs an einsum and then adds the bias as a separate
        pass; `torch.nn.functional.linear` adds it inside the GEMM.
        """
        if not _gemm.takes_linear(dense) or (
            dense is self.output_dense
            and self.output_shape is not None
            and len(self.output_shape) != 1
        ):
            return dense(x)
        x = ops.convert_to_tensor(x, dense.compute_dtype)  # as the layer casts
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        if dense is self.output_dense:  # (B, T, H, V) -> (B, T, O)
            x = ops.reshape(x, (batch, length, -1))  # (B, T, H V)
        kernel = ops.reshape(dense.kernel, (x.shape[-1], -1))  # (D, N)
        bias = ops.reshape(dense.bias, (-1,)) if self.use_bias else None  # (N,)
        output = _gemm.linear(x, kernel, bias)
        if dense is self.output_dense:
            return output
        return ops.reshape(output, (batch, length) + tuple(dense.kernel.shape[1:]))

    def _project_key_value(self, query, value, key):
        key = value if key is None else key
        k = self._project(self.key_dense, key)  # (B, S, G, K)
        v = self._project(self.value_dense, value)  # (B, S, G, V)
        return k, v

    def _check_cache(self, cache, cache_update_index, query_length):
        expected = (2, None, self._kv_heads, self.key_dim)
        shape = tuple(cache.shape)
        if len(shape) != 5 or any(
            e is not None and d is not None and d != e
            for d, e in zip(shape[1:], expected)
        ):
            raise ValueError(
                "`cache` must have shape (batch, 2, max_length, "
                f"{self._kv_heads}, {self.key_dim}). Received: cache with "
                f"shape {shape}"
            )
        if self._value_dim != self.key_dim:
            raise ValueError(
                "A KV cache needs `value_dim == key_dim`. Received: "
                f"key_dim={self.key_dim}, value_dim={self._value_dim}"
            )
        if isinstance(cache_update_index, int) and not isinstance(
            cache_update_index, bool
        ):
            max_length = shape[2]
            if cache_update_index < 0 or (
                max_length is not None
                and query_length is not None
                and cache_update_index + query_length > max_length
            ):
                raise ValueError(
                    "`cache_update_index` out of range: writing "
                    f"{query_length} positions at cache_update_index="
                    f"{cache_update_index} into a cache of max_length="
                    f"{max_length}"
                )

    def _repeat_kv(self, x):
        groups = self.num_heads // self._kv_heads
        return x if groups == 1 else ops.repeat(x, groups, axis=1)

    def _explicit_attention(self, q, k, v, mask, training):
        q = ops.transpose(q, (0, 2, 1, 3))  # (B, H, T, K)
        k = self._repeat_kv(ops.transpose(k, (0, 2, 1, 3)))  # (B, H, S, K)
        v = self._repeat_kv(ops.transpose(v, (0, 2, 1, 3)))  # (B, H, S, V)
        output, weights = attention_ops.attention(
            q,
            k,
            v,
            self.score,
            mask=mask,
            dropout=self.dropout,
            training=training,
            seed=self.seed_generator,
        )  # (B, H, T, V), (B, H, T, S)
        return ops.transpose(output, (0, 2, 1, 3)), weights  # (B, T, H, V)

    def _fused_attention(self, q, k, v, mask, is_causal, cached=False):
        """The backend kernel, with fully masked rows set to exactly 0.

        NaN or inf in a key or value must reach only the queries that may see
        it, but inside a kernel `0 * NaN` is NaN, so a masked one can leak. A
        finite output proves nothing leaked (a leak makes NaN), so the plain
        kernel's output is kept when it is finite, and only otherwise is the
        attention recomputed with such positions zeroed and NaN given back to
        the queries that may see one: the check costs one reduction over the
        output instead of passes over every key and value.
        """
        scale = self.score.dot_product_scale(self.key_dim)
        if mask is None and not is_causal:
            # Every query sees every key: nothing is hidden, nothing can leak.
            return _masked_kernel(q, k, v, mask, scale, is_causal)

        def recompute():
            clean_k, clean_v, bad = attention_ops.sanitize_nonfinite(k, v)
            bad = ops.any(bad, axis=-1)  # (B, S)
            output = _masked_kernel(q, clean_k, clean_v, mask, scale, is_causal)
            if mask is None:
                visible = bad[:, None, :]  # (B, 1, S)
                if is_causal:
                    causal = masking.causal_mask(ops.shape(q)[1], ops.shape(k)[1])
                    visible = ops.logical_and(visible, causal[None])  # (B, T, S)
                sees_bad = ops.any(visible, axis=-1)[:, :, None, None]  # (B, T|1, 1, 1)
            else:
                visible = ops.logical_and(mask, bad[:, None, None, :])  # (B, H|1, T, S)
                sees_bad = ops.any(visible, axis=-1, keepdims=True)  # (B, H|1, T, 1)
                sees_bad = ops.transpose(sees_bad, (0, 2, 1, 3))  # (B, T, H|1, 1)
            return attention_ops.poison_outputs(output, sees_bad)

        if keras.backend.backend() == "jax" and not cached:
            # XLA fuses the zeroing into neighbouring operations, while a
            # `cond` would stop fusion across it and keep both branches'
            # residuals for the backward pass (measured slower). Attending to
            # a cache (decoding, no backward pass) takes the `cond`: zeroing
            # would read and write the whole cache at every step.
            return recompute()
        output = _masked_kernel(q, k, v, mask, scale, is_causal)
        return _unless_nonfinite(output, recompute)

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        width = self.output_shape[-1] if self.output_shape else query_shape[-1]
        return tuple(query_shape[:-1]) + (width,)

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        return_attention_scores=False,
        cache=None,
        **kwargs,
    ):
        _check_input_shapes(
            query.shape, value.shape, None if key is None else key.shape
        )
        output = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape),
            dtype=self.compute_dtype,
        )
        outputs = (output,)
        if return_attention_scores:
            key_length = value.shape[1] if cache is None else cache.shape[2]
            outputs += (
                keras.KerasTensor(
                    (query.shape[0], self.num_heads, query.shape[1], key_length),
                    dtype=self.compute_dtype,
                ),
            )
        if cache is not None:
            outputs += (keras.KerasTensor(cache.shape, dtype=cache.dtype),)
        return outputs[0] if len(outputs) == 1 else outputs

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_shape": self.output_shape,
                "num_key_value_heads": self.num_key_value_heads,
                "score": scoring.serialize(self.score),
                "rotary_embedding": None
                if self.rotary_embedding is None
                else keras.saving.serialize_keras_object(self.rotary_embedding),
                "fused": self.fused,
                "seed": self.seed,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(
                    self.bias_initializer
                ),
                "kernel_regularizer": keras.regularizers.serialize(
                    self.kernel_regularizer
                ),
                "bias_regularizer": keras.regularizers.serialize(
                    self.bias_regularizer
                ),
                "activity_regularizer": keras.regularizers.serialize(
                    self.activity_regularizer
                ),
                "kernel_constraint": keras.constraints.serialize(
                    self.kernel_constraint
                ),
                "bias_constraint": keras.constraints.serialize(
                    self.bias_constraint
                ),
            }
        )
        return config

    @classmethod
    def from_keras(cls, layer):
        """Builds a layer equal to a built `keras.layers.MultiHeadAttention`.

        The new layer has the same configuration and takes over copies of the
        weights, so it gives the same outputs on `(batch, length, dim)`
        inputs.

        Args:
            layer: a built `keras.layers.MultiHeadAttention` with the default
                attention axes, no gate and no sliding window (a `ValueError`
                otherwise).

        Returns:
            A built `MultiHeadAttention`.

        Example:

        >>> import keras, numpy as np
        >>> peer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        >>> x = np.random.rand(1, 3, 8).astype("float32")
        >>> _ = peer(x, x)
        >>> ours = MultiHeadAttention.from_keras(peer)
        >>> bool(np.allclose(ours(x, x), peer(x, x), atol=1e-5))
        True
        """
        if not isinstance(layer, keras.layers.MultiHeadAttention):
            raise ValueError(
                "`layer` must be a keras.layers.MultiHeadAttention. "
                f"Received: layer={layer!r}"
            )
        if not layer.built:
            raise ValueError(
                "`layer` must be built (called once) before its weights can "
                f"be taken over. Received: unbuilt layer {layer.name!r}"
            )
        peer = layer.get_config()
        # A sliding window changes which keys each query sees; taking the
        # weights without it would silently give other outputs.
        if (
            peer.get("attention_axes") not in (None, (1,), [1])
            or peer.get("use_gate", False)
            or peer.get("sliding_window") is not None
        ):
            raise ValueError(
                "`from_keras` supports (batch, length, dim) attention without "
                "a gate or a sliding window. Received: attention_axes="
                f"{peer.get('attention_axes')}, use_gate="
                f"{peer.get('use_gate', False)}, sliding_window="
                f"{peer.get('sliding_window')}"
            )
        new = cls(
            num_heads=peer["num_heads"],
            key_dim=peer["key_dim"],
            value_dim=peer["value_dim"],
            dropout=peer["dropout"],
            use_bias=peer["use_bias"],
            output_shape=peer["output_shape"],
            seed=peer["seed"],
            kernel_initializer=peer["kernel_initializer"],
            bias_initializer=peer["bias_initializer"],
            kernel_regularizer=peer["kernel_regularizer"],
            bias_regularizer=peer["bias_regularizer"],
            activity_regularizer=peer["activity_regularizer"],
            kernel_constraint=peer["kernel_constraint"],
            bias_constraint=peer["bias_constraint"],
            dtype=layer.dtype_policy,
            name=layer.name,
        )
        query_shape = (None, None, layer.query_dense.kernel.shape[0])
        key_shape = (None, None, layer.key_dense.kernel.shape[0])
        value_shape = (None, None, layer.value_dense.kernel.shape[0])
        new.build(query_shape, value_shape, key_shape)
        pairs = (
            (new.query_dense, layer.query_dense),
            (new.key_dense, layer.key_dense),
            (new.value_dense, layer.value_dense),
            (new.output_dense, layer.output_dense),
        )
        for ours, theirs in pairs:
            ours.set_weights(theirs.get_weights())
        return new


# Backends whose CPU kernel holds the whole (B, H, T, S) score matrix process
# long sequences in query chunks: when the full scores would take more than
# `_CHUNK_ABOVE_SCORE_BYTES`, each chunk holds at most `_CHUNK_SCORE_BYTES`.
# Below the threshold one kernel call is as fast or faster (fewer, larger
# matmuls); above it, memory matters more (benchmarks/README.md).
_CHUNK_ABOVE_SCORE_BYTES = 512 * 2**20
_CHUNK_SCORE_BYTES = 16 * 2**20
_CHUNKED_BACKENDS = ("tensorflow", "jax")


def _query_chunk_size(q, k):
    """The query chunk length for long sequences, or None for one block."""
    if keras.backend.backend() not in _CHUNKED_BACKENDS:
        return None
    batch, query_length, heads, _ = q.shape
    key_length = k.shape[1]
    if query_length is None or key_length is None:
        return None
    per_query = (batch or 1) * heads * key_length * 4
    if per_query * query_length <= _CHUNK_ABOVE_SCORE_BYTES:
        return None
    chunk = max(1, _CHUNK_SCORE_BYTES // per_query)
    return chunk if chunk < query_length else None


def _dot_product_attention(q, k, v, mask, scale, is_causal):
    """`ops.dot_product_attention`, in query chunks for long sequences.

    Each chunk of queries attends to all keys with its own rows of the mask
    (Rabe and Staats, 2021, without their key chunking): exact, and the peak
    memory of the scores falls from `B H T S` to `B H C S`. `ops.map` runs the
    chunks one after the other (a scan under jit) and differentiates.
    """
    if _needs_float32_kernel(q):
        # XLA's CPU dot_general has no float16 x float16 -> float32 variant,
        # which jax.nn.dot_product_attention asks for under jit.
        dtype = q.dtype
        q, k, v = (ops.cast(x, "float32") for x in (q, k, v))
        output = _dot_product_attention(q, k, v, mask, scale, is_causal)
        return ops.cast(output, dtype)
    chunk = _query_chunk_size(q, k)
    if chunk is None and _takes_blocked_kernel(q, k, is_causal):
        return _blocked_attention(q, k, v, mask, scale, is_causal)  # any G
    if keras.backend.backend() == "tensorflow" and k.shape[2] == 1 < q.shape[2]:
        # Keras's TensorFlow kernel repeats key/value heads only for G > 1:
        # multi-query attention (G = 1) fails there with a shape error.
        k = ops.repeat(k, q.shape[2], axis=2)  # (B, S, H, K)
        v = ops.repeat(v, q.shape[2], axis=2)  # (B, S, H, V)
    if chunk is None:
        return ops.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=is_causal
        )  # (B, T, H, V)
    batch, query_length, heads, head_dim = ops.shape(q)
    key_length = k.shape[1]
    num_chunks = -(-query_length // chunk)
    padding = num_chunks * chunk - query_length
    if padding:
        q = ops.pad(q, ((0, 0), (0, padding), (0, 0), (0, 0)))
    q_chunks = ops.reshape(q, (batch, num_chunks, chunk, heads, head_dim))
    q_chunks = ops.moveaxis(q_chunks, 1, 0)  # (N, B, C, H, K)
    starts = ops.arange(num_chunks, dtype="int32") * chunk  # (N,)
    if mask is not None:
        if padding:
            mask = ops.pad(
                mask, ((0, 0), (0, 0), (0, padding), (0, 0)), constant_values=True
            )
        mask_chunks = ops.reshape(
            mask, (mask.shape[0], mask.shape[1], num_chunks, chunk, key_length)
        )
        mask_chunks = ops.moveaxis(mask_chunks, 2, 0)  # (N, B|1, H|1, C, S)
    offset = key_length - query_length  # bottom-right causal alignment

    def attend(inputs):
        if mask is None:
            q_chunk, start = inputs
            chunk_mask = None
        else:
            q_chunk, start, chunk_mask = inputs
        if is_causal:
            causal = masking.causal_mask(
                chunk, key_length, query_start=start + offset
            )[None, None]  # (1, 1, C, S)
            chunk_mask = masking.merge_masks(chunk_mask, causal)
        return ops.dot_product_attention(
            q_chunk, k, v, mask=chunk_mask, scale=scale
        )  # (B, C, H, V)

    inputs = (q_chunks, starts) if mask is None else (q_chunks, starts, mask_chunks)
    outputs = ops.map(attend, inputs)  # (N, B, C, H, V)
    outputs = ops.moveaxis(outputs, 0, 1)  # (B, N, C, H, V)
    outputs = ops.reshape(
        outputs, (batch, num_chunks * chunk, heads, v.shape[-1])
    )
    return outputs[:, :query_length]  # (B, T, H, V)


# TensorFlow and JAX run `_blocked_attention` instead of Keras's kernel: the
# causal mask then skips the key blocks no query of a block may see, in
# blocks of `_CAUSAL_BLOCK` queries (at most `_MAX_CAUSAL_BLOCKS` of them).
_BLOCKED_BACKENDS = ("tensorflow", "jax")
_CAUSAL_BLOCK = 128
_MAX_CAUSAL_BLOCKS = 8


def _takes_blocked_kernel(q, k, is_causal):
    """Static lengths on TensorFlow; on JAX causal or short queries; not torch.

    Torch keeps its fused C++ kernel. On JAX, Keras's kernel is as fast for
    long queries without the causal flag (its backward pass faster), while
    `_blocked_attention` wins with the causal flag (blocks skip work) and for
    up to `_CAUSAL_BLOCK` queries (a decoding step attending to its cache
    included).
    """
    backend = keras.backend.backend()
    if backend not in _BLOCKED_BACKENDS:
        return False
    if q.shape[1] is None or k.shape[1] is None:
        return False
    return backend == "tensorflow" or is_causal or q.shape[1] <= _CAUSAL_BLOCK


def _causal_blocks(query_length, key_length):
    """`(start, stop)` query ranges; one range when blocking saves nothing."""
    if key_length < query_length:
        return [(0, query_length)]
    count = min(query_length // _CAUSAL_BLOCK, _MAX_CAUSAL_BLOCKS)
    if count < 2:
        return [(0, query_length)]
    bounds = [round(i * query_length / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _blocked_attention(q, k, v, mask, scale, is_causal):
    """Scaled dot-product attention, skipping the keys a causal block cannot see.

    The textbook computation (`softmax(q k^T * scale) v`, the softmax in at
    least float32) with the scale applied to the queries (`T K` products
    instead of `T S`) and the heads laid out for plain batched matmuls:
    queries `(B, G, R T, K)` against keys `(B, G, S, K)`, `R = H / G` query
    heads per key/value head, so grouped-query attention repeats nothing.
    With the causal flag, the queries are split into blocks and a block
    `[a, b)` attends only to the keys `[0, offset + b)` (bottom-right
    alignment, `offset = S - T`): the scores above the diagonal blocks are
    never computed, which saves up to half of the attention's work.

    Every row must see at least one key (the callers make fully masked rows
    see every key and zero them afterwards).
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
        blocks = _causal_blocks(query_length, key_length)
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
            positions = np.arange(start, stop)[:, None] + offset
            allowed = ops.convert_to_tensor(positions >= np.arange(end)[None])
        if mask is not None:
            rows = slice(None) if mask.shape[-2] == 1 else slice(start, stop)
            columns = slice(None) if mask.shape[-1] == 1 else slice(0, end)
            mask_block = mask[..., rows, columns]
            allowed = mask_block if allowed is None else ops.logical_and(
                mask_block, allowed
            )
        if allowed is not None:
            scores = ops.where(allowed, scores, float("-inf"))
        probs = ops.cast(ops.softmax(scores, axis=-1), v.dtype)
        probs = ops.reshape(probs, (-1, groups, ratio * length, end))
        output = ops.einsum("bgqs,bgsv->bgqv", probs, v_block)
        outputs.append(ops.reshape(output, (-1, groups, ratio, length, value_dim)))
    output = outputs[0] if len(outputs) == 1 else ops.concatenate(outputs, axis=3)
    output = ops.transpose(output, (0, 3, 1, 2, 4))  # (B, T, G, R, V)
    return ops.reshape(output, (-1, query_length, heads, value_dim))


def _masked_kernel(q, k, v, mask, scale, is_causal):
    """The kernel with a boolean mask; fully masked rows come out as 0."""
    if mask is None:
        return _dot_product_attention(q, k, v, None, scale, is_causal)
    # Kernels give a fully masked row the mean of the values (or NaN); such
    # rows see every key inside the kernel and are zeroed after it.
    has_key = ops.any(mask, axis=-1, keepdims=True)  # (B|1, H|1, T, 1)
    kernel_mask = ops.logical_or(mask, ops.logical_not(has_key))
    output = _dot_product_attention(q, k, v, kernel_mask, scale, False)
    has_key = ops.transpose(has_key, (0, 2, 1, 3))  # (B|1, T, H|1, 1)
    return ops.where(has_key, output, ops.zeros_like(output))


def _unless_nonfinite(output, recompute):
    """`output` if it is all finite, else `recompute()` (same shape and dtype).

    A branch that runs only one side: a Python `if` on eager torch, `cond`
    under TensorFlow tracing (the graph holds both and runs one).
    """
    # One summing pass: NaN and inf survive a sum (a finite sum too large for
    # float32 only means a needless recomputation).
    finite = ops.isfinite(ops.sum(ops.cast(output, "float32")))
    if keras.backend.backend() == "torch":
        import torch

        if torch.compiler.is_compiling() or output.device.type == "meta":
            return recompute()
        return output if bool(finite) else recompute()
    return ops.cond(finite, lambda: output, recompute)


def _needs_float32_kernel(q):
    """float16 on JAX's CPU backend, which its kernel cannot run under jit."""
    if keras.backend.backend() != "jax":
        return False
    if keras.backend.standardize_dtype(q.dtype) != "float16":
        return False
    import jax

    return jax.default_backend() == "cpu"


def _to_rank4(mask):
    """`(T, S)` -> `(1, 1, T, S)`; `(B, T, S)` -> `(B, 1, T, S)`."""
    if len(mask.shape) == 2:
        return mask[None, None]
    if len(mask.shape) == 3:
        return mask[:, None]
    return mask


def _standardize_output_shape(output_shape):
    if output_shape is None:
        return None
    # The message reports the value received, before it is made a tuple.
    shape = output_shape
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if (
        not isinstance(shape, (tuple, list))
        or len(shape) != 1
        or isinstance(shape[0], bool)
        or not isinstance(shape[0], int)
        or shape[0] <= 0
    ):
        raise ValueError(
            "`output_shape` must be None, a positive int or a 1-tuple of one. "
            f"Received: output_shape={output_shape!r}"
        )
    return (int(shape[0]),)


def _check_input_shapes(query_shape, value_shape, key_shape):
    _validation.check_rank("query", query_shape, 3)
    _validation.check_rank("value", value_shape, 3)
    _validation.check_same_dim(
        "query", query_shape[0], "value", value_shape[0], "batch size"
    )
    if key_shape is not None:
        _validation.check_rank("key", key_shape, 3)
        _validation.check_same_dim(
            "key", key_shape[1], "value", value_shape[1], "length"
        )
