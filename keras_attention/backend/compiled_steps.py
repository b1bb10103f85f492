"""The decoding step in `keras.ops`, for loops a compiler traces once.

Shape legend: `B` batch (sources, in the grouped layout), `D` width, `H`
query heads, `G` key/value heads, `R = H / G`, `K` head size, `n` keys
attended, `L` cache length, `S` encoder length, `E` hypotheses per source
(beams; 1 outside beam search).

Under XLA (TensorFlow's and JAX's decoding loops) a step's cost on a CPU is
mostly the number of kernels it launches, not its arithmetic: at the sizes
of benchmarks/seq2seq_speed.py (width 128) a token costs about 0.09 ms
through the layers, against about 0.05 ms for the same arithmetic written
out. A block's step here differs from the layers' in four ways:

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
  twice as fast;
- a decoder-only model's loop carries each block's caches in the grouped
  layout below (`group_caches`, the step's `enter_caches` and
  `leave_caches`), not the layers' packed cache, out of which XLA copied
  the keys and the values at every step.

Every kernel a step multiplies by is cast to the compute dtype once, when
the step is made (`_Projection`), not at every step as the layers cast
their variables: under mixed precision XLA's GPU compiler kept those casts
in the loop's body, reading each float32 kernel again at every step. Norms
and embeddings run through their layers, which compile to the same kernels.

An encoder-decoder model's step (`_BlockStep.grouped`) keeps its caches in
a layout of its own, the *grouped* layout, which the layers never see:

- per source and key/value head, keys as `(B G, K, n)` and values as `(B G,
  n, K)`: the order XLA's CPU dot takes its right operand in, so a step
  reads them as they lie. From the layers' `(B, 2, L, G, K)` XLA copied
  every cache into that order at every step;
- the cross caches once per source, not once per hypothesis: the `E`
  hypotheses of a source are `E` queries against the same keys;
- in beam search, the self-attention caches are never reordered. Slot `s E
  + j` holds position `s` as row `j` of the source computed it, and an
  ancestry `(B, E, L)` says, per hypothesis and position, which row holds
  its history (`grouped_visible`). A step attends over its source's `E`
  rows with the slots of other histories masked, and following the
  survivors reorders only the ancestry: `E` times the attention arithmetic,
  which at these sizes costs less than gathering the caches.

Under `jax.profiler`, 32 4-beam steps at batch 4 (benchmarks/seq2seq_speed.py)
spent 3.4 of their 19 ms copying the self caches into the dot's order, 1.3
copying the cross caches and 2.7 gathering the self caches after each step;
with the grouped layout the whole translation took 0.57 times as long.

Where the backend prefers it (`Preferences.absorb_cross_attention`:
TensorFlow always, JAX in beam search), the cross caches are instead folded
into the cross-attention's projections once per call (`absorbed_cross_cache`):
the query kernel times each head's keys, and each head's values times its
rows of the output kernel. A step then attends to the source with two
products, `x (D, H S)` for the scores of every head and `weights (H S, D')`
for the output, where it took four (query projection, scores, weighted
values, output projection). It is taken only where it is no more
arithmetic, `H S <= D + S` for `H K = D`. At benchmarks/seq2seq_speed.py's
sizes (20 source tokens, 4 heads, width 128), in one process against the
grouped caches: a 32-token translation 1.09 times as fast greedy and 1.07
with 4 beams at batch 1 on TensorFlow, 1.01 and 1.12 at batch 4 (a step at
batch 1 from 92-97 to 70 us, the folding 0.2 to 0.3 ms a call); on JAX 1.22
and 1.04 with 4 beams, 0.97 and 0.99 greedy.
"""

import math

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
    decoder-only model, or None when a block is not on the allow-lists.
    The step takes the layers' caches, or in a compiled loop the grouped
    ones its `enter_caches` makes (`group_caches`, undone by
    `leave_caches`)."""
    steps = [block_step(block) for block in blocks]
    if any(step is None for step in steps):
        return None

    def step(token_ids, caches, index):
        x = embedding(token_ids, start_index=index)  # (B, 1, D)
        updated = []
        for block_step_, cache in zip(steps, caches):
            if isinstance(cache, tuple):  # grouped: keys (B G, K, L), values (B G, L, K)
                visible = grouped_visible(index, cache[0].shape[-1])
                x, cache = block_step_.grouped(x, cache, index, visible)
            else:
                x, cache = block_step_(x, cache, index)
            updated.append(cache)
        if final_norm is not None:
            x = final_norm(x)
        return embedding(x, reverse=True), tuple(updated)  # (B, 1, V)

    step.enter_caches = group_caches
    step.leave_caches = lambda caches: ungroup_caches(caches, [s.kv_heads for s in steps])
    return step


def group_caches(caches):
    """Per block, the layers' cache `(B, 2, L, G, K)` in the grouped layout
    (module docstring): keys `(B G, K, L)` and values `(B G, L, K)`, what a
    compiled loop carries (`cache_windows.Phases.while_loop`). A step then
    attends per key/value head over the cache as it lies; from `(L, G K)`
    (keys and values apart, as they lie in the layers' cache) it took `G`
    times the multiply-adds over a long cache and XLA transposed a short
    one at every step (benchmarks/README.md)."""
    return tuple(grouped_cache(cache) for cache in caches)


def ungroup_caches(caches, groups):
    """`group_caches` undone: per block `(B, 2, L, G, K)`, for the blocks'
    numbers of key/value heads `groups`."""
    packed = []
    for (keys, values), groups in zip(caches, groups):
        head_size, length = keys.shape[1], keys.shape[2]
        keys = ops.transpose(ops.reshape(keys, (-1, groups, head_size, length)), (0, 3, 1, 2))
        values = ops.transpose(ops.reshape(values, (-1, groups, length, head_size)), (0, 2, 1, 3))
        packed.append(kv_cache.pack(keys, values))  # (B, 2, L, G, K)
    return tuple(packed)


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


def grouped_self_cache(batch, length, beams, groups, head_size, dtype):
    """An empty self-attention cache in the grouped layout: keys `(B G, K, L
    E)` and values `(B G, L E, K)`, slot `s E + j` for position `s` of the
    source's row `j`."""
    keys = ops.zeros((batch * groups, head_size, length * beams), dtype)
    values = ops.zeros((batch * groups, length * beams, head_size), dtype)
    return keys, values


def grouped_cache(cache):
    """A layers' cache `(B, 2, S, G, K)` (cross-attention's, or a decoder-only
    model's self-attention cache in its loop) in the grouped layout: keys
    `(B G, K, S)` and values `(B G, S, K)`."""
    keys, values = kv_cache.read(cache)  # (B, S, G, K)
    batch, length, groups, head_size = keys.shape
    keys = ops.reshape(ops.transpose(keys, (0, 2, 3, 1)), (batch * groups, head_size, length))
    values = ops.reshape(ops.transpose(values, (0, 2, 1, 3)), (batch * groups, length, head_size))
    return keys, values


def grouped_visible(index, length, ancestry=None):
    """The self-attention slots each hypothesis reads at position `index`:
    bool `(1, 1, L)` without an ancestry (one row per source), else `(B, E,
    L E)`: slot `s E + j` where `s <= index` and row `j` holds position `s`
    of the hypothesis (`ancestry` int32 `(B, E, L)`)."""
    seen = ops.arange(length) <= index  # (L,)
    if ancestry is None:
        return seen[None, None, :]
    batch, beams = ancestry.shape[0], ancestry.shape[1]
    rows = ops.arange(beams, dtype=ancestry.dtype)  # (E,)
    holds = ancestry[:, :, :, None] == rows[None, None, None, :]  # (B, E, L, E)
    visible = ops.logical_and(holds, seen[None, None, :, None])
    return ops.reshape(visible, (batch, beams, length * beams))  # (B, E, L E)


def _attend_grouped(q, keys, values, visible, scale, groups):
    """`q` `(B E, 1, H, K)`, the `E` hypotheses of each source; `keys` `(B G,
    K, n)` and `values` `(B G, n, K)` shared by a source's hypotheses;
    `visible` bool `(B|1, E|1, n)` or None -> `(B E, 1, H, K)` in the
    values' dtype. In float32 at least (as `_attend_per_head`, for half
    precision caches); a row that sees no slot comes out NaN (the caller
    zeroes it)."""
    heads, head_size = q.shape[2], q.shape[3]
    batch, slots = keys.shape[0] // groups, keys.shape[2]
    beams = q.shape[0] // batch
    per_group = heads // groups
    dtype = values.dtype
    compute = keras.backend.result_type(dtype, "float32")
    q, keys, values = (ops.cast(x, compute) for x in (q, keys, values))
    q = ops.reshape(q * ops.cast(scale, compute), (batch, beams, groups, per_group, head_size))
    if beams > 1:
        q = ops.transpose(q, (0, 2, 1, 3, 4))  # (B, G, E, R, K)
    q = ops.reshape(q, (batch * groups, beams * per_group, head_size))  # (B G, E R, K)
    scores = ops.matmul(q, keys)  # (B G, E R, n)
    if visible is not None:
        scores = ops.reshape(scores, (batch, groups, beams, per_group, slots))
        scores = ops.where(visible[:, None, :, None, :], scores, float("-inf"))
        scores = ops.reshape(scores, (batch * groups, beams * per_group, slots))
    probs = ops.softmax(scores, axis=-1)
    output = ops.matmul(probs, values)  # (B G, E R, K)
    output = ops.reshape(output, (batch, groups, beams, per_group, head_size))
    if beams > 1:
        output = ops.transpose(output, (0, 2, 1, 3, 4))  # (B, E, G, R, K)
    return ops.cast(ops.reshape(output, (batch * beams, 1, heads, head_size)), dtype)


def absorbs_cross_attention(cross, source_length):
    """Whether `absorbed_cross_cache` costs a query no more multiply-adds,
    `H S (D + D')`, than the projections and the attention, `D H K + H K D'
    + 2 H K S`, over a source of `source_length` (static) tokens: for `H K =
    D = D'`, where `H S <= D + S`."""
    if source_length is None:
        return False
    width = cross.query_dense.kernel.shape[0]
    inner = cross.num_heads * cross.key_dim
    output = cross.output_dense.kernel.shape[-1]
    absorbed = cross.num_heads * source_length * (width + output)
    plain = width * inner + inner * output + 2 * inner * source_length
    return absorbed <= plain


def absorbed_cross_cache(cache, cross, scale):
    """The layers' cross cache `(B, 2, S, G, K)` folded into the
    cross-attention's projections, once per source: `(query_keys (B, D, H
    S), query_bias (B, 1, H S), value_outputs (B, H S, D'))`, in float32 at
    least.

    Column `h S + s` of `query_keys` is `scale W_q[:, h] k_s` (head `h`'s
    query kernel against its key at source position `s`), and `query_bias`
    the same of the query bias, so that a query's scores for every head are
    one product `x query_keys + query_bias`. Row `h S + s` of
    `value_outputs` is `v_s W_o[h]`, head `h`'s value at `s` through its
    rows of the output kernel, so that the weighted values of every head and
    the output projection are one product of the weights `(H S)`.
    """
    keys, values = kv_cache.read(cache)  # (B, S, G, K)
    batch, length, groups, head_size = keys.shape
    heads = cross.num_heads
    per_group = heads // groups
    compute = keras.backend.result_type(values.dtype, "float32")
    keys, values = ops.cast(keys, compute), ops.cast(values, compute)
    scale = ops.cast(scale, compute)
    query = cross.query_dense
    width = query.kernel.shape[0]
    query_kernel = ops.reshape(
        ops.cast(query.kernel, compute), (width, groups, per_group, head_size)
    )  # (D, G, R, K)
    query_keys = ops.einsum("dgrk,bsgk->bdgrs", query_kernel * scale, keys)
    query_keys = ops.reshape(query_keys, (batch, width, heads * length))
    if query.bias is None:
        query_bias = ops.zeros((batch, 1, heads * length), compute)
    else:
        bias = ops.reshape(ops.cast(query.bias, compute), (groups, per_group, head_size))
        query_bias = ops.einsum("grk,bsgk->bgrs", bias * scale, keys)
        query_bias = ops.reshape(query_bias, (batch, 1, heads * length))
    output_kernel = ops.reshape(
        ops.cast(cross.output_dense.kernel, compute), (groups, per_group, head_size, -1)
    )  # (G, R, K, D')
    value_outputs = ops.einsum("bsgk,grkc->bgrsc", values, output_kernel)
    value_outputs = ops.reshape(value_outputs, (batch, heads * length, -1))
    return query_keys, query_bias, value_outputs


def _attend_absorbed(h, cache, mask, cross):
    """Cross-attention of `h` `(B E, 1, D)`, the `E` hypotheses of each of
    `B` sources, through `absorbed_cross_cache`'s `cache`, with `mask`
    optional bool `(B, S)`, True at source tokens: `(B E, 1, D')` in the
    output projection's compute dtype. A source that is all padding gets
    the output bias alone (no weight on any position), as the layers' zero
    attention output through the projection."""
    query_keys, query_bias, value_outputs = cache
    batch, width = query_keys.shape[0], query_keys.shape[1]
    heads = cross.num_heads
    length = query_keys.shape[2] // heads
    rows = h.shape[0]
    beams = rows // batch
    x = ops.reshape(ops.cast(h, query_keys.dtype), (batch, beams, width))
    scores = ops.matmul(x, query_keys) + query_bias  # (B, E, H S)
    scores = ops.reshape(scores, (batch, beams, heads, length))
    if mask is not None:
        mask = ops.cast(mask, "bool")
        scores = ops.where(mask[:, None, None, :], scores, float("-inf"))
    weights = ops.softmax(scores, axis=-1)
    if mask is not None:  # a source that is all padding: no weight, not NaN
        has_key = ops.any(mask, axis=-1)[:, None, None, None]  # (B, 1, 1, 1)
        weights = ops.where(has_key, weights, ops.zeros_like(weights))
    weights = ops.reshape(weights, (batch, beams, heads * length))
    output = ops.matmul(weights, value_outputs)  # (B, E, D')
    dense = cross.output_dense
    if dense.bias is not None:
        output = output + ops.cast(dense.bias, output.dtype)
    return ops.reshape(ops.cast(output, dense.compute_dtype), (rows, 1, -1))


class _Projection:
    """`x -> x kernel + bias` in a compute dtype, on a dense layer's kernel
    flattened to `(W, N)` and its bias `(N,)`, cast when the projection is
    made (`of`): once per call, before the loop. Cast inside the loop (as
    the layers cast their variables at every call), the casts stayed in the
    loop's body under mixed precision: XLA's GPU compiler read every float32
    kernel and converted it again at every step. Torch's step casts its
    weights once as well (`backend/torch.py`)."""

    def __init__(self, kernel, bias, dtype):
        self.kernel = kernel  # (W, N)
        self.bias = bias  # (N,) or None
        self.dtype = dtype

    @classmethod
    def of(cls, dense, width):
        """`dense`'s kernel as `(W, width)` and its bias, in its compute dtype."""
        dtype = dense.compute_dtype
        kernel = ops.cast(ops.reshape(dense.kernel, (-1, width)), dtype)
        bias = None if dense.bias is None else ops.cast(ops.reshape(dense.bias, (-1,)), dtype)
        return cls(kernel, bias, dtype)

    @classmethod
    def joined(cls, projections):
        """Projections of one input (all with biases or none) as one
        product: their kernels side by side, `(W, N_1 + N_2 + ...)`."""
        first = projections[0]
        kernel = ops.concatenate([p.kernel for p in projections], axis=1)
        bias = None if first.bias is None else ops.concatenate([p.bias for p in projections])
        return cls(kernel, bias, first.dtype)

    def __call__(self, x):
        """`x` `(B, 1, W)` -> `(B, 1, N)` in the compute dtype (as the
        layer casts its input)."""
        output = ops.matmul(ops.cast(x, self.dtype), self.kernel)
        return output if self.bias is None else output + self.bias


class _BlockStep:
    """One decoder block's step; the fused Q/K/V kernel and every other
    kernel in the compute dtype made when created (`_Projection`)."""

    def __init__(self, block):
        self.block = block
        attention = block.self_attention
        denses = (attention.query_dense, attention.key_dense, attention.value_dense)
        self.qkv = _Projection.joined(
            [_Projection.of(d, math.prod(d.kernel.shape[1:])) for d in denses]
        )  # (D, H K + 2 G K)
        self.heads = attention.num_heads
        self.kv_heads = attention.num_key_value_heads or attention.num_heads
        self.head_size = attention.key_dim
        self.scale = attention.score.dot_product_scale(attention.key_dim)
        self.output_width = attention.output_dense.kernel.shape[-1]
        self.output = _Projection.of(attention.output_dense, self.output_width)
        cross = block.cross_attention
        if cross is not None:
            self.cross_scale = cross.score.dot_product_scale(cross.key_dim)
            self.cross_query = _Projection.of(cross.query_dense, cross.num_heads * cross.key_dim)
            self.cross_output = _Projection.of(cross.output_dense, self.output_width)
        # The feed-forward network is plain on the allow-lists.
        feedforward = block.feedforward
        self.intermediate = _Projection.of(feedforward.intermediate_dense, feedforward.intermediate_dim)
        self.feedforward_output = _Projection.of(
            feedforward.output_dense, feedforward.output_dense.kernel.shape[-1]
        )

    def _sublayer(self, x, norm, fn):
        if self.block.normalize_first:
            return x + fn(norm(x))
        return norm(x + fn(x))

    def __call__(self, x, self_cache, index, cross_cache=None, cross_mask=None):
        def self_attend(h):
            nonlocal self_cache
            q, k, v = self._project(h)  # (B, 1, H, K), (B, 1, G, K) twice
            self_cache = kv_cache.write(self_cache, k, v, index)
            keys, values = kv_cache.read(self_cache)  # (B, L, G, K)
            seen = ops.arange(keys.shape[1]) <= index  # (L,)
            attended = _attend(q, keys, values, seen[None], self.scale)
            attended = ops.reshape(attended, (ops.shape(h)[0], 1, -1))  # (B, 1, H K)
            return self.output(attended)

        cross_attend = None
        if self.block.cross_attention is not None:
            cross = self.block.cross_attention

            def cross_attend(h):
                batch = ops.shape(h)[0]
                q = self.cross_query(h)
                q = ops.reshape(q, (batch, 1, cross.num_heads, cross.key_dim))
                keys, values = kv_cache.read(cross_cache)  # (B, S, G, K)
                mask = None if cross_mask is None else ops.cast(cross_mask, "bool")
                attended = _attend(q, keys, values, mask, self.cross_scale)
                if mask is not None:  # a source that is all padding: 0
                    has_key = ops.any(mask, axis=-1)[:, None, None, None]  # (B, 1, 1, 1)
                    attended = ops.where(has_key, attended, ops.zeros_like(attended))
                attended = ops.reshape(attended, (batch, 1, -1))  # (B, 1, H K)
                return self.cross_output(attended)

        return self._sublayers(x, self_attend, cross_attend), self_cache

    # The grouped layout's caches for this block (module docstring).
    visible = staticmethod(grouped_visible)

    def empty_grouped(self, batch, length, beams):
        """An empty self-attention cache in the grouped layout for `batch`
        sources of `beams` hypotheses and `length` positions."""
        dtype = self.block.self_attention.compute_dtype
        return grouped_self_cache(batch, length, beams, self.kv_heads, self.head_size, dtype)

    def grouped_cross(self, cache, absorb=False):
        """The layers' cross cache `(B, 2, S, G, K)` in the grouped layout;
        with `absorb`, folded into the cross-attention's projections
        (`absorbed_cross_cache`) where that is no more arithmetic
        (`absorbs_cross_attention`)."""
        cross = self.block.cross_attention
        if absorb and absorbs_cross_attention(cross, cache.shape[2]):
            return absorbed_cross_cache(cache, cross, self.cross_scale)
        return grouped_cache(cache)

    def grouped(self, x, self_cache, index, visible, cross_cache=None, cross_mask=None):
        """The step in the grouped layout (module docstring).

        Args:
            x: `(B E, 1, D)`, the `E` hypotheses of each of `B` sources.
            self_cache: `(keys (B G, K, L E), values (B G, L E, K))`
                (`grouped_self_cache`); position `index` is written at
                slots `index E .. index E + E - 1`.
            index: the position of the step.
            visible: bool `(B|1, E|1, L E)`, the slots each hypothesis
                reads (`grouped_visible`).
            cross_cache: optional `(keys (B G, K, S), values (B G, S, K))`
                (`grouped_cache`), or the three arrays of
                `absorbed_cross_cache` (`grouped_cross`'s result either way).
            cross_mask: optional bool `(B, S)`, True at source tokens.

        Returns:
            `(x (B E, 1, D), self_cache)`.
        """
        rows = x.shape[0]

        def self_attend(h):
            nonlocal self_cache
            q, k, v = self._project(h)  # (B E, 1, H, K), (B E, 1, G, K) twice
            keys, values = self_cache
            groups, head_size = self.kv_heads, self.head_size
            batch = keys.shape[0] // groups
            beams = rows // batch
            k = ops.reshape(k, (batch, beams, groups, head_size))
            v = ops.reshape(v, (batch, beams, groups, head_size))
            if beams > 1:
                k = ops.transpose(k, (0, 2, 3, 1))  # (B, G, K, E)
                v = ops.transpose(v, (0, 2, 1, 3))  # (B, G, E, K)
            k = ops.reshape(k, (batch * groups, head_size, beams))  # (B G, K, E)
            v = ops.reshape(v, (batch * groups, beams, head_size))  # (B G, E, K)
            keys = ops.slice_update(keys, (0, 0, index * beams), ops.cast(k, keys.dtype))
            values = ops.slice_update(values, (0, index * beams, 0), ops.cast(v, values.dtype))
            self_cache = (keys, values)
            attended = _attend_grouped(q, keys, values, visible, self.scale, groups)
            attended = ops.reshape(attended, (rows, 1, -1))  # (B E, 1, H K)
            return self.output(attended)

        cross_attend = None
        if self.block.cross_attention is not None:
            cross = self.block.cross_attention

            def cross_attend(h):
                if len(cross_cache) == 3:
                    return _attend_absorbed(h, cross_cache, cross_mask, cross)
                q = self.cross_query(h)
                q = ops.reshape(q, (rows, 1, cross.num_heads, cross.key_dim))
                keys, values = cross_cache
                groups = cross.num_key_value_heads or cross.num_heads
                mask = None if cross_mask is None else ops.cast(cross_mask, "bool")
                seen = None if mask is None else mask[:, None, :]  # (B, 1, S)
                attended = _attend_grouped(q, keys, values, seen, self.cross_scale, groups)
                if mask is not None:  # a source that is all padding: 0, not NaN
                    batch = mask.shape[0]
                    attended = ops.reshape(attended, (batch, rows // batch, -1))  # (B, E, H K)
                    has_key = ops.any(mask, axis=-1)[:, None, None]  # (B, 1, 1)
                    attended = ops.where(has_key, attended, ops.zeros_like(attended))
                attended = ops.reshape(attended, (rows, 1, -1))  # (B E, 1, H K)
                return self.cross_output(attended)

        return self._sublayers(x, self_attend, cross_attend), self_cache

    def _project(self, h):
        """Self-attention's query, key and value of `h` `(B, 1, D)`, as one
        matmul: `(B, 1, H, K)`, `(B, 1, G, K)`, `(B, 1, G, K)`."""
        qkv = self.qkv(h)  # (B, 1, H K + 2 G K)
        query_width = self.heads * self.head_size
        kv_width = self.kv_heads * self.head_size
        q, k, v = ops.split(qkv, [query_width, query_width + kv_width], axis=-1)
        batch = ops.shape(h)[0]
        kv_shape = (batch, 1, self.kv_heads, self.head_size)
        q = ops.reshape(q, (batch, 1, self.heads, self.head_size))
        return q, ops.reshape(k, kv_shape), ops.reshape(v, kv_shape)

    def _sublayers(self, x, self_attend, cross_attend):
        block = self.block
        x = self._sublayer(x, block.self_attention_layer_norm, self_attend)
        if cross_attend is not None:
            x = self._sublayer(x, block.cross_attention_layer_norm, cross_attend)
        return self._sublayer(x, block.feedforward_layer_norm, self._feedforward)

    def _feedforward(self, h):
        """The block's feed-forward network (plain, no dropout at
        inference) on the kernels made once."""
        return self.feedforward_output(self.block.feedforward.activation(self.intermediate(h)))
