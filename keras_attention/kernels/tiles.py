"""Causal attention in square tiles below the diagonal, forward and
backward, one loop each: what `chunked.chunked_attention` runs with the
causal flag where the backend prefers it (`Preferences.causal_tiles`).

Shape legend: `B` batch, `T` query length, `S` key length, `H` query heads,
`G` key/value heads, `R = H / G` query heads per key/value head, `K` key head
size, `V` value head size, `N` query chunks, `C` queries in a chunk (and keys
in a block).
"""

import numpy as np
from keras import ops

from keras_attention import backend
from keras_attention.kernels._query_chunks import QueryChunks

# Each loop compiled once per configuration and input shapes.
_COMPILED_LOOPS = {}


class Tiles(QueryChunks):
    """Causal attention in square tiles, both ways, in one loop each.

    Query chunk `i` (`C` queries) meets key block `j` (`C` keys) for every
    block holding a key it may see, so the loop runs over the pairs
    `(i, j)` below the diagonal, row after row: `N (N + 1) / 2` tiles of
    `C x C` scores (for `T = S`) instead of `N` chunks of `C x S`. The
    forward pass keeps a running maximum, sum and weighted sum per query
    row (the online softmax of FlashAttention, Dao et al., 2022) and writes
    the chunk's output and log-sum-exp after each tile; the backward pass
    recomputes each tile's weights from the log-sum-exp and adds its share
    to the query chunk's gradient and to the key and value blocks'. One
    loop holds one tile's intermediates, and its state is the same
    buffers throughout, where the bands of `_Chunks` each held their own.
    """

    def __init__(self, q, k, v, mask, scale, tile):
        super().__init__(q, k, mask, scale, tile)
        self.num_blocks = -(-self.key_length // tile)
        # The tiles, row after row: chunk i sees keys [0, offset + (i+1) C).
        rows, columns, firsts = [], [], []
        for i in range(self.num_chunks):
            seen = min(self.num_blocks, -(-(self.offset + (i + 1) * tile) // tile))
            rows += [i] * seen
            columns += list(range(seen))
            firsts += [1] + [0] * (seen - 1)
        self.plan = (
            np.asarray(rows, "int32"), np.asarray(columns, "int32"),
            np.asarray(firsts, "int32"),
        )

    def blocks(self, x):
        """`(B, S, G, D)` -> `(M, B, G, C, D)`, padded with zeros."""
        padding = self.num_blocks * self.chunk - self.key_length
        if padding:
            x = ops.pad(x, ((0, 0), (0, padding), (0, 0), (0, 0)))
        x = ops.reshape(x, (-1, self.num_blocks, self.chunk) + tuple(x.shape[2:]))
        return ops.transpose(x, (1, 0, 3, 2, 4))

    def unblock(self, x):
        """`(M, B, G, C, D)` -> `(B, S, G, D)`."""
        x = ops.transpose(x, (1, 0, 3, 2, 4))  # (B, M, C, G, D)
        x = ops.reshape(x, (-1, self.num_blocks * self.chunk) + tuple(x.shape[3:]))
        return x[:, : self.key_length]

    def mask_tiles(self, mask):
        """`(B|1, H|1, T|1, S|1)` -> `(tiles, keyed, rows)`: `mask_chunks`'s
        layout, with the keys in blocks in front where the mask has them
        (`keyed`): `(M, N, B|1, G|1, R|1, C, C)`, or `(M, B|1, G|1, R|1, 1,
        C)` for a row every query shares (not `rows`)."""
        mask = self.mask_chunks(mask)
        rows = len(mask.shape) == 6
        keyed = mask.shape[-1] > 1
        if keyed:
            padding = self.num_blocks * self.chunk - self.key_length
            if padding:
                pads = ((0, 0),) * (len(mask.shape) - 1) + ((0, padding),)
                mask = ops.pad(mask, pads, constant_values=False)
            shape = tuple(mask.shape[:-1]) + (self.num_blocks, self.chunk)
            mask = ops.moveaxis(ops.reshape(mask, shape), -2, 0)
        return mask, keyed, rows

    def tile_mask(self, masks, i, j):
        """Tile `(i, j)`'s part of `mask_tiles`: `(B|1, G|1, R|1, C|1, C|1)`."""
        if masks is None:
            return None
        mask, keyed, rows = masks
        if keyed:
            mask = mask[j]
        return mask[i] if rows else mask

    def scores(self, q_chunk, k_block, i, j, tile_mask):
        """Tile `(i, j)`'s masked float32 scores `(B, G, R C, C)`."""
        c = self.chunk
        scores = ops.cast(ops.einsum("bgqk,bgsk->bgqs", q_chunk, k_block), self.dtype)
        queries = ops.arange(c)[:, None] + i * c + self.offset
        keys = ops.arange(c)[None, :] + j * c
        allowed = ops.logical_and(keys <= queries, keys < self.key_length)  # (C, C)
        if tile_mask is not None:
            allowed = ops.logical_and(tile_mask, allowed)
        shape = (-1, self.groups, self.ratio, c, c)
        scores = ops.where(allowed, ops.reshape(scores, shape), float("-inf"))
        return ops.reshape(scores, (-1, self.groups, self.ratio * c, c))

    def compiled(self, direction, tensors):
        """The `direction` loop as `backend.compiled_loop` makes it, made
        once per configuration and input shapes (a compiler would trace
        and compile it again for a new function at every eager call)."""
        key = (
            direction, backend.current().__name__, self.query_length, self.key_length,
            self.heads, self.groups, self.scale, self.chunk, self.dtype,
        ) + tuple((tuple(x.shape), str(x.dtype)) for x in tensors)
        if key not in _COMPILED_LOOPS:
            loop = self._forward_loop if direction == "forward" else self._backward_loop
            _COMPILED_LOOPS[key] = backend.compiled_loop(loop)
        return _COMPILED_LOOPS[key]

    def plan_tensors(self):
        return tuple(ops.convert_to_tensor(x) for x in self.plan)

    @staticmethod
    def at(plan, step):
        """`(i, j, first)` of tile number `step`."""
        rows, columns, firsts = plan
        return rows[step], columns[step], ops.cast(firsts[step], "bool")

    def forward(self, q, k, v, mask=None):
        q_chunks = self.to_chunks(ops.multiply(q, ops.cast(self.scale, q.dtype)))
        k_blocks, v_blocks = self.blocks(k), self.blocks(v)  # (M, B, G, C, K|V)
        tensors = (q_chunks, k_blocks, v_blocks) + (() if mask is None else (mask,))
        output, lse = self.compiled("forward", tensors)(*tensors)
        residuals = (q_chunks, k_blocks, v_blocks, output, lse)
        if mask is not None:
            residuals += (mask,)
        return self.from_chunks(output), residuals

    def _forward_loop(self, q_chunks, k_blocks, v_blocks, mask=None):
        """The tiles' loop: the chunked output `(N, B, G, R C, V)` and each
        row's log-sum-exp `(N, B, G, R C)`."""
        masks = None if mask is None else self.mask_tiles(mask)
        plan = self.plan_tensors()
        dtype = v_blocks.dtype

        def attend(step, carry):
            top, total, weighted, outputs, lses = carry
            i, j, first = self.at(plan, step)
            top = ops.where(first, float("-inf"), top)  # a new row of tiles
            total = ops.where(first, 0.0, total)
            weighted = ops.where(first, 0.0, weighted)
            scores = self.scores(q_chunks[i], k_blocks[j], i, j, self.tile_mask(masks, i, j))
            new_top = ops.maximum(top, ops.max(scores, axis=-1))  # (B, G, R C)
            # Rows that have seen no key yet keep -inf: shift them by 0.
            shift = ops.where(ops.isfinite(new_top), new_top, 0.0)
            weights = ops.exp(scores - shift[..., None])
            rescale = ops.exp(top - shift)
            total = total * rescale + ops.sum(weights, axis=-1)
            block = ops.einsum("bgqs,bgsv->bgqv", ops.cast(weights, dtype), v_blocks[j])
            weighted = weighted * rescale[..., None] + ops.cast(block, self.dtype)
            top = new_top
            output = weighted / ops.where(total > 0, total, 1.0)[..., None]
            outputs = ops.slice_update(
                outputs, (i, 0, 0, 0, 0), ops.cast(output, dtype)[None]
            )
            lses = ops.slice_update(lses, (i, 0, 0, 0), (top + ops.log(total))[None])
            return top, total, weighted, outputs, lses

        rows = ops.zeros_like(q_chunks[0, ..., 0], dtype=self.dtype)  # (B, G, R C)
        weighted = rows[..., None] + ops.zeros((v_blocks.shape[-1],), self.dtype)
        outputs = ops.zeros_like(q_chunks[..., :1], dtype=dtype) + ops.zeros(
            (v_blocks.shape[-1],), dtype
        )  # (N, B, G, R C, V)
        lses = ops.zeros_like(q_chunks[..., 0], dtype=self.dtype)  # (N, B, G, R C)
        init = (rows, rows, weighted, outputs, lses)
        _, _, _, output, lse = backend.fori_loop(0, len(self.plan[0]), attend, init)
        return output, lse

    def backward(self, residuals, d_output):
        q_chunks, k_blocks, v_blocks, output, lse = residuals[:5]
        mask = residuals[5] if self.masked else None
        d_chunks = ops.cast(self.to_chunks(d_output), v_blocks.dtype)
        delta = ops.sum(
            ops.cast(d_chunks, lse.dtype) * ops.cast(output, lse.dtype), axis=-1
        )  # (N, B, G, R C): D = rowsum(dO * O)
        tensors = (q_chunks, k_blocks, v_blocks, d_chunks, lse, delta)
        tensors += () if mask is None else (mask,)
        d_q, d_k, d_v = self.compiled("backward", tensors)(*tensors)
        grads = (
            ops.cast(self.from_chunks(d_q) * self.scale, q_chunks.dtype),
            ops.cast(self.unblock(d_k), k_blocks.dtype),
            ops.cast(self.unblock(d_v), v_blocks.dtype),
        )
        return grads + ((None,) if self.masked else ())

    def _backward_loop(self, q_chunks, k_blocks, v_blocks, d_chunks, lse, delta, mask=None):
        """The tiles' loop backwards: float32 `dq` in chunks, `dk` and `dv`
        in blocks (`dq` unscaled)."""
        masks = None if mask is None else self.mask_tiles(mask)
        plan = self.plan_tensors()

        def step(index, carry):
            d_q, d_k, d_v = carry
            i, j, _ = self.at(plan, index)
            q_chunk, d_out = q_chunks[i], d_chunks[i]
            k_block, v_block = k_blocks[j], v_blocks[j]
            scores = self.scores(q_chunk, k_block, i, j, self.tile_mask(masks, i, j))
            weights = ops.exp(scores - lse[i][..., None])  # (B, G, R C, C)
            d_v_block = ops.einsum("bgqs,bgqv->bgsv", ops.cast(weights, d_out.dtype), d_out)
            d_weights = ops.cast(ops.einsum("bgqv,bgsv->bgqs", d_out, v_block), self.dtype)
            d_scores = ops.cast(weights * (d_weights - delta[i][..., None]), q_chunk.dtype)
            d_k_block = ops.einsum("bgqs,bgqk->bgsk", d_scores, q_chunk)
            d_q_chunk = ops.einsum("bgqs,bgsk->bgqk", d_scores, k_block)
            d_q = ops.slice_update(
                d_q, (i, 0, 0, 0, 0), (d_q[i] + ops.cast(d_q_chunk, self.dtype))[None]
            )
            d_k = ops.slice_update(
                d_k, (j, 0, 0, 0, 0), (d_k[j] + ops.cast(d_k_block, self.dtype))[None]
            )
            d_v = ops.slice_update(
                d_v, (j, 0, 0, 0, 0), (d_v[j] + ops.cast(d_v_block, self.dtype))[None]
            )
            return d_q, d_k, d_v

        init = (
            ops.zeros_like(q_chunks, dtype=self.dtype),
            ops.zeros_like(k_blocks, dtype=self.dtype),
            ops.zeros_like(v_blocks, dtype=self.dtype),
        )
        return backend.fori_loop(0, len(self.plan[0]), step, init)

