"""The decoding step in `keras.ops`, for loops a compiler traces once.

Shape legend: `B` batch, `D` width, `H` query heads, `G` key/value heads,
`R = H / G`, `K` head size, `n` keys attended, `L` cache length, `S`
encoder length.

Under XLA (TensorFlow's and JAX's decoding loops) a step's cost on a CPU is
mostly the number of kernels it launches, not its arithmetic: at the sizes
of benchmarks/seq2seq_speed.py (width 128) a token costs about 0.09 ms
through the layers, against about 0.05 ms for the same arithmetic written
out. A block's step here differs from the layers' in three ways:

- self-attention's Q, K and V come from one matmul on kernels concatenated
  once per call, before the loop;
- attention runs without the guards the layers need for any cache a caller
  may pass. The loop's own caches make them unnecessary: the self-attention
  cache is zeros past the step's position (`kv_cache.empty`, written one
  slot per step) and a query always sees its own slot, and the cross
  caches' hidden positions are zeroed once when they are made
  (`kv_cache.hide`), so no row is fully masked by the cache and no hidden
  non-finite value exists to leak. A source that is all padding still gets
  an output of exactly 0, as from the layers;
- over a long cache, attention is two plain matmuls against a block-diagonal
  matrix of the queries (`_attend`): per-head einsums have XLA transpose the
  whole cache at every step, which made a step's time grow with the cache
  twice as fast.

Norms, feed-forward networks, embeddings and logits run through their
layers, which compile to the same kernels.
"""

import keras
from keras import ops

from keras_attention import kv_cache
from keras_attention.backend import allow_lists


def block_step(block):
    """`step(x, self_cache, index, cross_cache=None, cross_mask=None) -> (x,
    self_cache)` for a block on the allow-lists, else None."""
    if not allow_lists.block_allowed(block):
        return None
    return _BlockStep(block)


def decoder_step(embedding, blocks, final_norm):
    """`step(token_ids, caches, index) -> (logits, caches)` for a
    decoder-only model, or None when a block is not on the allow-lists."""
    steps = [block_step(block) for block in blocks]
    if any(step is None for step in steps):
        return None

    def step(token_ids, caches, index):
        x = embedding(token_ids, start_index=index)  # (B, 1, D)
        updated = []
        for block_step_, cache in zip(steps, caches):
            x, cache = block_step_(x, cache, index)
            updated.append(cache)
        if final_norm is not None:
            x = final_norm(x)
        return embedding(x, reverse=True), tuple(updated)  # (B, 1, V)

    return step


# Above this many cache slots per key/value head a step attends through two
# plain matmuls (`_attend_block_diagonal`), below through per-head einsums:
# the matmuls do `G` times the multiply-adds, the einsums transpose the cache.
# Measured in the compiled decoding loops (benchmarks/README.md): with 4
# key/value heads the einsums took a GPT step at 64 slots from 0.17 to 0.11-
# 0.15 ms on JAX (`gpt_speed.py`), and 4-beam translation over 33 slots from
# 1.77 to 0.53 ms (`seq2seq_speed.py`); the matmuls keep 512 slots at 0.22-
# 0.25 ms, where a step with the einsums grew twice as fast with the cache.
BLOCK_DIAGONAL_SLOTS_PER_GROUP = 16


def _attend(q, keys, values, mask, scale):
    """One query per row: `q` `(B, 1, H, K)`, keys and values `(B, n, G, K)`,
    `mask` optional bool `(B|1, n)` -> `(B, 1, H, K)`, through per-head
    einsums or, for a long cache, block-diagonal matmuls. The scores and
    softmax are in float32 at least; the block-diagonal sums in the cache's
    dtype, the einsums in float32 at least; the output in the cache's
    dtype."""
    length, groups = keys.shape[1], keys.shape[2]
    if length is not None and length > BLOCK_DIAGONAL_SLOTS_PER_GROUP * groups:
        return _attend_block_diagonal(q, keys, values, mask, scale)
    return _attend_per_head(q, keys, values, mask, scale)


def _attend_per_head(q, keys, values, mask, scale):
    """`_attend` as two einsums batched over `(B, G)`; XLA transposes the
    keys and the values into that head-major order for them at every step.
    The einsums run in float32 at least: a half-precision einsum outside
    XLA (TensorFlow's eager op on a CPU) lost a percent of the logits of a
    float16 model, and over a short cache the casts cost little."""
    heads, head_size = q.shape[2], q.shape[3]
    groups = keys.shape[2]
    batch = ops.shape(q)[0]
    dtype = values.dtype
    compute = keras.backend.result_type(dtype, "float32")
    q, keys, values = (ops.cast(x, compute) for x in (q, keys, values))
    q = ops.reshape(q * ops.cast(scale, compute), (batch, groups, heads // groups, head_size))
    scores = ops.einsum("bgrk,bngk->bgrn", q, keys)  # (B, G, R, n)
    if mask is not None:
        scores = ops.where(mask[:, None, None, :], scores, float("-inf"))
    probs = ops.softmax(scores, axis=-1)
    output = ops.einsum("bgrn,bngk->bgrk", probs, values)  # (B, G, R, K)
    return ops.cast(ops.reshape(output, (batch, 1, heads, head_size)), dtype)


def _attend_block_diagonal(q, keys, values, mask, scale):
    """`_attend` as two plain matmuls over the cache as it lies, `(B, n, G
    K)`: the scores against a block-diagonal `(G K, G R)` matrix of the
    queries (group `g`'s rows hold its `R` queries, the other rows zeros),
    then the weighted sum of the values into `(B, G R, G K)`, of which the
    output is the diagonal blocks. `G` times the multiply-adds, and no
    transposition of the cache (XLA copies the keys and the values out of
    it for the matmuls, in the order they lie)."""
    heads, head_size = q.shape[2], q.shape[3]
    groups = keys.shape[2]
    per_group = heads // groups
    batch = ops.shape(q)[0]
    eye = ops.eye(groups, dtype=q.dtype)  # (G, G)
    q = ops.reshape(q * ops.cast(scale, q.dtype), (batch, groups, per_group, head_size))
    queries = ops.transpose(q, (0, 1, 3, 2))[:, :, :, None, :] * eye[:, None, :, None]
    queries = ops.reshape(queries, (batch, groups * head_size, heads))  # (B, G K, G R)
    keys = ops.reshape(keys, (batch, -1, groups * head_size))  # (B, n, G K)
    scores = ops.matmul(keys, queries)  # (B, n, G R)
    scores = ops.cast(scores, keras.backend.result_type(scores.dtype, "float32"))
    if mask is not None:
        scores = ops.where(mask[:, :, None], scores, float("-inf"))
    probs = ops.cast(ops.softmax(scores, axis=1), values.dtype)
    values = ops.reshape(values, (batch, -1, groups * head_size))  # (B, n, G K)
    every = ops.einsum("bnh,bnc->bhc", probs, values)  # (B, G R, G K)
    every = ops.reshape(every, (batch, groups, per_group, groups, head_size))
    output = ops.sum(every * ops.cast(eye, values.dtype)[:, None, :, None], axis=3)  # (B, G, R, K)
    return ops.reshape(output, (batch, 1, heads, head_size))


def _linear(x, dense, width):
    """`x` `(B, 1, W)` through an attention projection's kernel, flattened to
    `(W, width)`, in the layer's compute dtype (as the layer casts)."""
    dtype = dense.compute_dtype
    output = ops.matmul(ops.cast(x, dtype), ops.cast(ops.reshape(dense.kernel, (-1, width)), dtype))
    if dense.bias is not None:
        output = output + ops.cast(ops.reshape(dense.bias, (-1,)), dtype)
    return output


class _BlockStep:
    """One decoder block's step; the fused Q/K/V kernel made when created."""

    def __init__(self, block):
        self.block = block
        attention = block.self_attention
        denses = (attention.query_dense, attention.key_dense, attention.value_dense)
        width = attention.query_dense.kernel.shape[0]
        dtype = attention.compute_dtype
        self.qkv_kernel = ops.concatenate(
            [ops.cast(ops.reshape(d.kernel, (width, -1)), dtype) for d in denses], axis=1
        )  # (D, H K + 2 G K)
        self.qkv_bias = None
        if attention.query_dense.bias is not None:
            self.qkv_bias = ops.concatenate(
                [ops.cast(ops.reshape(d.bias, (-1,)), dtype) for d in denses]
            )
        self.heads = attention.num_heads
        self.kv_heads = attention.num_key_value_heads or attention.num_heads
        self.head_size = attention.key_dim
        self.scale = attention.score.dot_product_scale(attention.key_dim)
        self.output_width = attention.output_dense.kernel.shape[-1]
        cross = block.cross_attention
        if cross is not None:
            self.cross_scale = cross.score.dot_product_scale(cross.key_dim)

    def _sublayer(self, x, norm, fn):
        if self.block.normalize_first:
            return x + fn(norm(x))
        return norm(x + fn(x))

    def __call__(self, x, self_cache, index, cross_cache=None, cross_mask=None):
        block = self.block
        attention = block.self_attention

        def self_attend(h):
            nonlocal self_cache
            h = ops.cast(h, self.qkv_kernel.dtype)
            qkv = ops.matmul(h, self.qkv_kernel)  # (B, 1, H K + 2 G K)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            query_width = self.heads * self.head_size
            kv_width = self.kv_heads * self.head_size
            q, k, v = ops.split(qkv, [query_width, query_width + kv_width], axis=-1)
            batch = ops.shape(h)[0]
            kv_shape = (batch, 1, self.kv_heads, self.head_size)
            self_cache = kv_cache.write(
                self_cache, ops.reshape(k, kv_shape), ops.reshape(v, kv_shape), index
            )
            keys, values = kv_cache.read(self_cache)  # (B, L, G, K)
            seen = ops.arange(kv_cache.length(self_cache)) <= index  # (L,)
            q = ops.reshape(q, (batch, 1, self.heads, self.head_size))
            attended = _attend(q, keys, values, seen[None], self.scale)
            attended = ops.reshape(attended, (batch, 1, -1))  # (B, 1, H K)
            return _linear(attended, attention.output_dense, self.output_width)

        x = self._sublayer(x, block.self_attention_layer_norm, self_attend)
        if block.cross_attention is not None:
            cross = block.cross_attention

            def cross_attend(h):
                batch = ops.shape(h)[0]
                q = _linear(h, cross.query_dense, cross.num_heads * cross.key_dim)
                q = ops.reshape(q, (batch, 1, cross.num_heads, cross.key_dim))
                keys, values = kv_cache.read(cross_cache)  # (B, S, G, K)
                mask = None if cross_mask is None else ops.cast(cross_mask, "bool")
                attended = _attend(q, keys, values, mask, self.cross_scale)
                if mask is not None:  # a source that is all padding: 0
                    has_key = ops.any(mask, axis=-1)[:, None, None, None]  # (B, 1, 1, 1)
                    attended = ops.where(has_key, attended, ops.zeros_like(attended))
                attended = ops.reshape(attended, (batch, 1, -1))  # (B, 1, H K)
                return _linear(attended, cross.output_dense, self.output_width)

            x = self._sublayer(x, block.cross_attention_layer_norm, cross_attend)
        x = self._sublayer(x, block.feedforward_layer_norm, block.feedforward)
        return x, self_cache
