"""Query chunks: exact attention for long sequences without the whole score
matrix.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `K` key head size, `V` value head size, `N` chunks, `C`
queries in a chunk.
"""

from keras import ops

from keras_attention import masking

# When the full float32 scores would take more than `CHUNK_ABOVE_BYTES`, each
# chunk holds at most `CHUNK_BYTES` of them. Below the threshold one kernel
# call is as fast or faster (fewer, larger matmuls); above it, memory matters
# more (benchmarks/README.md: 8,192 tokens in under 300 MiB).
CHUNK_ABOVE_BYTES = 512 * 2**20
CHUNK_BYTES = 16 * 2**20


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


def chunked_attention(q, k, v, mask, scale, is_causal, chunk, kernel):
    """`kernel` over chunks of `chunk` queries, one after the other.

    Each chunk of queries attends to all keys with its own rows of the mask
    (Rabe and Staats, 2021, without their key chunking): exact, and the peak
    memory of the scores falls from `B H T S` to `B H C S`. `ops.map` runs the
    chunks one after the other (a scan under jit) and differentiates.

    Args:
        q: `(B, T, H, K)`; k: `(B, S, G, K)`; v: `(B, S, G, V)`.
        mask: optional boolean `(B|1, H|1, T, S)`.
        scale: the score scale.
        is_causal: bool, bottom-right causal attention over the whole `T`.
        chunk: positive int, queries per chunk.
        kernel: `kernel(q, k, v, mask, scale)` for one chunk, no causal flag.

    Returns:
        `(B, T, H, V)`.
    """
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
        if mask.shape[-2] == 1:
            mask = ops.repeat(mask, query_length, axis=-2)  # (B|1, H|1, T, S)
        if padding:
            mask = ops.pad(
                mask, ((0, 0), (0, 0), (0, padding), (0, 0)), constant_values=True
            )
        mask_chunks = ops.reshape(
            mask, (mask.shape[0], mask.shape[1], num_chunks, chunk, mask.shape[-1])
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
        return kernel(q_chunk, k, v, chunk_mask, scale)  # (B, C, H, V)

    inputs = (q_chunks, starts) if mask is None else (q_chunks, starts, mask_chunks)
    outputs = ops.map(attend, inputs)  # (N, B, C, H, V)
    outputs = ops.moveaxis(outputs, 0, 1)  # (B, N, C, H, V)
    outputs = ops.reshape(outputs, (batch, num_chunks * chunk, heads, v.shape[-1]))
    return outputs[:, :query_length]  # (B, T, H, V)
