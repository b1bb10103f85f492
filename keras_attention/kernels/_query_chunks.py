"""The layout both long-sequence kernels share: queries in chunks of `C`,
each chunk's heads as the rows of one product.

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `R = H / G` query heads per key/value head, `D` a head
size, `N` chunks, `C` queries in a chunk.
"""

import keras
from keras import ops


class QueryChunks:
    """The static sizes of one call and its chunk layout, for `chunked`'s
    bands of chunks and `tiles`' square tiles."""

    def __init__(self, q, k, mask, scale, chunk):
        self.query_length, self.heads, _ = q.shape[1:]
        self.key_length, self.groups = k.shape[1], k.shape[2]
        self.ratio = self.heads // self.groups
        self.scale = scale
        self.chunk = chunk
        self.num_chunks = -(-self.query_length // chunk)
        # Bottom-right causality: query `t` sits at `t + offset` among the keys.
        self.offset = self.key_length - self.query_length
        self.masked = mask is not None
        # Scores, statistics and gradient sums: at least float32.
        self.dtype = keras.backend.result_type(q.dtype, "float32")

    def to_chunks(self, x):
        """`(B, T, H, D)` -> `(N, B, G, R C, D)`: a chunk's heads as matmul rows."""
        n, c, g, r = self.num_chunks, self.chunk, self.groups, self.ratio
        padding = n * c - self.query_length
        if padding:
            x = ops.pad(x, ((0, 0), (0, padding), (0, 0), (0, 0)))
        x = ops.reshape(x, (-1, n, c, g, r, x.shape[-1]))
        x = ops.transpose(x, (1, 0, 3, 4, 2, 5))  # (N, B, G, R, C, D)
        return ops.reshape(x, (n, -1, g, r * c, x.shape[-1]))

    def from_chunks(self, x):
        """`(N, B, G, R C, D)` -> `(B, T, H, D)`."""
        n, c, g, r = self.num_chunks, self.chunk, self.groups, self.ratio
        x = ops.reshape(x, (n, -1, g, r, c, x.shape[-1]))
        x = ops.transpose(x, (1, 0, 4, 2, 3, 5))  # (B, N, C, G, R, D)
        x = ops.reshape(x, (-1, n * c, self.heads, x.shape[-1]))
        return x[:, : self.query_length]

    def mask_chunks(self, mask):
        """`(B|1, H|1, T|1, S|1)` -> `(N, B|1, G|1, R|1, C, S|1)`, or the one
        row `(B|1, G|1, R|1, 1, S|1)` that every query shares."""
        heads = mask.shape[1] > 1
        g, r = (self.groups, self.ratio) if heads else (1, 1)
        mask = ops.reshape(mask, (-1, g, r) + tuple(mask.shape[2:]))
        if mask.shape[-2] == 1:
            return mask
        n, c = self.num_chunks, self.chunk
        padding = n * c - self.query_length
        if padding:
            mask = ops.pad(
                mask, ((0, 0),) * 3 + ((0, padding), (0, 0)), constant_values=True
            )
        mask = ops.reshape(mask, (-1, g, r, n, c, mask.shape[-1]))
        return ops.moveaxis(mask, 3, 0)  # (N, B|1, G|1, R|1, C, S|1)
