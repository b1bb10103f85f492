"""Query chunks: exact attention for long sequences without the whole score
matrix, in the forward pass and in the backward pass.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `R = H / G` query heads per key/value head, `K` key head
size, `V` value head size, `N` chunks, `C` queries in a chunk, `E` the keys a
band of chunks attends to.
"""

from keras import ops

from keras_attention import backend
from keras_attention import masking
from keras_attention.kernels import tiles as tiles_lib
from keras_attention.kernels._query_chunks import QueryChunks

# When the full float32 scores would take more than `CHUNK_ABOVE_BYTES`, each
# chunk holds at most `CHUNK_BYTES` of them. Below the threshold one kernel
# call is as fast or faster (fewer, larger matmuls); above it, memory matters
# more (benchmarks/README.md: 8,192 tokens in under 300 MiB).
CHUNK_ABOVE_BYTES = 512 * 2**20
CHUNK_BYTES = 16 * 2**20
# With the causal flag the chunks are grouped into at most `MAX_BANDS` bands,
# and a band attends only to the keys its last query may see: 16 bands skip
# 15/32 of the scores (half is the limit), for 16 loop bodies to compile.
MAX_BANDS = 16
# With the causal flag, where the backend prefers it (`causal_tiles`), the
# scores go in square tiles of at most `TILE_BYTES` (`tiles.Tiles`) instead:
# 256 x 256 for one sequence of 8 heads. At 8,192 tokens
# (benchmarks/mha_memory.py), 512 x 512 tiles made TensorFlow's training
# step slower and JAX's forward pass larger.
TILE_BYTES = 2 * 2**20


def chunk_size(
    batch, query_length, heads, key_length,
    above_bytes=CHUNK_ABOVE_BYTES, chunk_bytes=CHUNK_BYTES,
):
    """The query chunk length, or None when one block is the better choice.

    `batch` may be None (unknown: counted as 1); unknown lengths give None.
    """
    if query_length is None or key_length is None:
        return None
    per_query = (batch or 1) * heads * key_length * 4
    if per_query * query_length <= above_bytes:
        return None
    chunk = max(1, chunk_bytes // per_query)
    return chunk if chunk < query_length else None


def bands(num_chunks, chunk, query_length, key_length, is_causal, max_bands=MAX_BANDS):
    """`(first, stop, keys)` per band: chunks `[first, stop)` read keys `[0, keys)`.

    One band of every key without the causal flag (or with fewer keys than
    queries, where nothing can be skipped).
    """
    if not is_causal or key_length < query_length:
        return [(0, num_chunks, key_length)]
    count = min(num_chunks, max_bands)
    bounds = [round(i * num_chunks / count) for i in range(count + 1)]
    offset = key_length - query_length  # bottom-right causal alignment
    return [
        (first, stop, min(key_length, offset + stop * chunk))
        for first, stop in zip(bounds[:-1], bounds[1:])
    ]


def chunked_attention(
    q, k, v, mask, scale, is_causal, chunk, max_bands=MAX_BANDS, tile=None
):
    """`softmax(q k^T * scale) v`, `chunk` queries at a time, both ways.

    Each chunk of queries attends to the keys with its own rows of the mask
    (Rabe and Staats, 2021, without their key chunking): exact, and the
    scores held at once fall from `B H T S` to `B H C S`. With the causal
    flag the chunks go in bands (`bands`), each reading only the keys its
    last query may see, which skips almost half of the work.

    The backward pass is written out (`backend.custom_vjp`) rather than left
    to autodiff, which would keep every chunk's scores for it: the forward
    pass keeps the outputs and each row's log-sum-exp, `O(T)`, and the
    backward pass recomputes each chunk's weights from them (Dao et al.,
    2022, FlashAttention's backward pass, in query chunks): with
    `P = exp(q k^T scale - lse)` and `D = rowsum(dO * O)`,
    `dV = P^T dO`, `dS = P * (dO V^T - D)`, `dQ = scale dS K`,
    `dK = scale dS^T Q`. A backend without custom gradients
    differentiates the forward pass.

    Args:
        q: `(B, T, H, K)`; k: `(B, S, G, K)`; v: `(B, S, G, V)`; static `T`,
            `S`, `H`, `G`.
        mask: optional boolean `(B|1, H|1, T|1, S|1)`; every row must see at
            least one key (`fused.masked_kernel` sees to that).
        scale: the score scale, a Python number.
        is_causal: bool, bottom-right causal attention over the whole `T`.
        chunk: positive int, queries per chunk.
        max_bands: the most bands with the causal flag.
        tile: the side of the causal tiles where the backend prefers them
            (`Preferences.causal_tiles`); by default `tile_size`'s. Query
            chunks in bands where it is not below `T`.

    Returns:
        `(B, T, H, V)`.
    """
    args = (q, k, v) if mask is None else (q, k, v, mask)
    if is_causal and k.shape[1] >= q.shape[1] and backend.preferences().causal_tiles:
        tile = tile or tile_size(q.shape[0], q.shape[2])
        if tile < q.shape[1]:
            tiles = tiles_lib.Tiles(q, k, v, mask, scale, tile)
            return backend.custom_vjp(tiles.forward, tiles.backward)(*args)
    chunks = _Chunks(q, k, v, mask, scale, is_causal, chunk, max_bands)
    return backend.custom_vjp(chunks.forward, chunks.backward)(*args)


def tile_size(batch, heads, tile_bytes=TILE_BYTES):
    """The side of a square tile of float32 scores `(B, H, C, C)` of at
    most `tile_bytes`, a power of two (at least 16)."""
    per_pair = (batch or 1) * heads * 4
    side = 16
    while (2 * side) ** 2 * per_pair <= tile_bytes:
        side *= 2
    return side


class _Chunks(QueryChunks):
    """The static plan of one call: its layout and bands; both passes."""

    def __init__(self, q, k, v, mask, scale, is_causal, chunk, max_bands):
        super().__init__(q, k, mask, scale, chunk)
        self.is_causal = is_causal
        self.bands = bands(
            self.num_chunks, chunk, self.query_length, self.key_length,
            is_causal, max_bands,
        )

    def band_mask(self, mask, first, stop, keys):
        """The band's part of `mask_chunks`: its chunks, its `keys` keys."""
        if mask is None:
            return None
        if mask.shape[-1] > 1:
            mask = mask[..., :keys]
        return mask if len(mask.shape) == 5 else mask[first:stop]

    # One chunk.

    def scores(self, q_chunk, k_band, index, chunk_mask):
        """Chunk `index`'s masked float32 scores `(B, G, R C, E)`; `q_chunk`
        `(B, G, R C, K)` is scaled already, `k_band` `(B, G, E, K)`."""
        keys = k_band.shape[2]
        scores = ops.einsum("bgqk,bgsk->bgqs", q_chunk, k_band)
        scores = ops.cast(scores, self.dtype)
        allowed = chunk_mask  # (B|1, G|1, R|1, C|1, E|1)
        if self.is_causal:
            # Query `c` of the chunk sits at `index C + offset + c` among the keys.
            start = index * self.chunk + self.offset
            causal = masking.causal_mask(self.chunk, keys, query_start=start)  # (C, E)
            allowed = causal if allowed is None else ops.logical_and(allowed, causal)
        if allowed is None:
            return scores
        shape = (-1, self.groups, self.ratio, self.chunk, keys)
        scores = ops.where(allowed, ops.reshape(scores, shape), float("-inf"))
        return ops.reshape(scores, (-1, self.groups, self.ratio * self.chunk, keys))

    # The passes.

    def forward(self, q, k, v, mask=None):
        """The output, and the residuals the backward pass needs: the chunked
        scaled queries, the keys and values, the chunked output and each
        row's log-sum-exp."""
        q_chunks = self.to_chunks(ops.multiply(q, ops.cast(self.scale, q.dtype)))
        k_heads = ops.transpose(k, (0, 2, 1, 3))  # (B, G, S, K)
        v_heads = ops.transpose(v, (0, 2, 1, 3))  # (B, G, S, V)
        mask_chunks = None if mask is None else self.mask_chunks(mask)
        outputs, lses = [], []
        for first, stop, keys in self.bands:
            k_band, v_band = k_heads[:, :, :keys], v_heads[:, :, :keys]
            band_mask = self.band_mask(mask_chunks, first, stop, keys)
            shared_row = band_mask is not None and len(band_mask.shape) == 5
            band_queries = q_chunks[first:stop]

            def attend(i, carry, band_queries=band_queries, k_band=k_band,
                       v_band=v_band, band_mask=band_mask, shared_row=shared_row,
                       first=first):
                outputs, lses = carry
                chunk_mask = band_mask if shared_row or band_mask is None else band_mask[i]
                scores = self.scores(band_queries[i], k_band, first + i, chunk_mask)
                top = ops.max(scores, axis=-1, keepdims=True)
                weights = ops.exp(scores - top)  # (B, G, R C, E), unnormalized
                total = ops.sum(weights, axis=-1, keepdims=True)
                output = ops.einsum(
                    "bgqs,bgsv->bgqv", ops.cast(weights, v.dtype), v_band
                )
                output = ops.cast(output, total.dtype) / total
                lse = ops.squeeze(top + ops.log(total), -1)  # (B, G, R C)
                outputs = ops.slice_update(
                    outputs, (i, 0, 0, 0, 0), ops.cast(output, v.dtype)[None]
                )
                lses = ops.slice_update(lses, (i, 0, 0, 0), lse[None])
                return outputs, lses

            # Shaped after the queries: the batch may be known only at run time.
            init = (
                ops.zeros_like(band_queries[..., :1], dtype=v.dtype)
                + ops.zeros((v.shape[-1],), v.dtype),
                ops.zeros_like(band_queries[..., 0], dtype=self.dtype),
            )  # (n, B, G, R C, V), (n, B, G, R C)
            # One band after the other (`backend.after`): a graph would run
            # them all at once.
            init = backend.after(init, outputs[-1:] + lses[-1:])
            output, lse = backend.fori_loop(0, stop - first, attend, init)
            outputs.append(output)
            lses.append(lse)
        output = concatenate(outputs)  # (N, B, G, R C, V)
        lse = concatenate(lses)  # (N, B, G, R C)
        residuals = (q_chunks, k_heads, v_heads, output, lse)
        if mask is not None:
            residuals += (mask,)
        return self.from_chunks(output), residuals

    def backward(self, residuals, d_output):
        """`(dq, dk, dv)` (and None for the mask) from the forward residuals."""
        q_chunks, k_heads, v_heads, output, lse = residuals[:5]
        mask = residuals[5] if self.masked else None
        mask_chunks = None if mask is None else self.mask_chunks(mask)
        d_chunks = ops.cast(self.to_chunks(d_output), v_heads.dtype)  # (N, B, G, R C, V)
        # D = rowsum(dO * O), the softmax's share of each row's gradient.
        delta = ops.sum(
            ops.cast(d_chunks, lse.dtype) * ops.cast(output, lse.dtype), axis=-1
        )  # (N, B, G, R C)
        d_queries = []
        d_key = d_value = None
        for first, stop, keys in self.bands:
            k_band, v_band = k_heads[:, :, :keys], v_heads[:, :, :keys]
            band_mask = self.band_mask(mask_chunks, first, stop, keys)
            shared_row = band_mask is not None and len(band_mask.shape) == 5
            band = slice(first, stop)
            band_inputs = (q_chunks[band], d_chunks[band], lse[band], delta[band])

            def step(i, carry, band_inputs=band_inputs, k_band=k_band,
                     v_band=v_band, band_mask=band_mask, shared_row=shared_row,
                     first=first):
                d_k, d_v, d_q = carry
                q_chunk, d_out, row_lse, row_delta = (x[i] for x in band_inputs)
                chunk_mask = band_mask if shared_row or band_mask is None else band_mask[i]
                scores = self.scores(q_chunk, k_band, first + i, chunk_mask)
                weights = ops.exp(scores - row_lse[..., None])  # (B, G, R C, E)
                d_v = d_v + ops.cast(
                    ops.einsum("bgqs,bgqv->bgsv", ops.cast(weights, d_out.dtype), d_out),
                    d_v.dtype,
                )
                d_weights = ops.cast(
                    ops.einsum("bgqv,bgsv->bgqs", d_out, v_band), weights.dtype
                )
                d_scores = weights * (d_weights - row_delta[..., None])
                d_scores = ops.cast(d_scores, q_chunk.dtype)
                d_k = d_k + ops.cast(
                    ops.einsum("bgqs,bgqk->bgsk", d_scores, q_chunk), d_k.dtype
                )
                d_q_chunk = ops.einsum("bgqs,bgsk->bgqk", d_scores, k_band)
                d_q = ops.slice_update(
                    d_q, (i, 0, 0, 0, 0), ops.cast(d_q_chunk, d_q.dtype)[None]
                )
                return d_k, d_v, d_q

            init = (
                ops.zeros_like(k_band, dtype=self.dtype),
                ops.zeros_like(v_band, dtype=self.dtype),
                ops.zeros_like(q_chunks[band], dtype=self.dtype),
            )
            init = backend.after(init, d_queries[-1:])
            d_k, d_v, d_q = backend.fori_loop(0, stop - first, step, init)
            d_queries.append(d_q)
            padding = self.key_length - keys
            if padding:
                pads = ((0, 0), (0, 0), (0, padding), (0, 0))
                d_k, d_v = ops.pad(d_k, pads), ops.pad(d_v, pads)
            d_key = d_k if d_key is None else d_key + d_k
            d_value = d_v if d_value is None else d_value + d_v
        d_query = self.from_chunks(concatenate(d_queries)) * self.scale
        grads = (
            ops.cast(d_query, q_chunks.dtype),
            ops.cast(ops.transpose(d_key, (0, 2, 1, 3)), k_heads.dtype),
            ops.cast(ops.transpose(d_value, (0, 2, 1, 3)), v_heads.dtype),
        )
        return grads + ((None,) if self.masked else ())


def concatenate(parts):
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=0)
