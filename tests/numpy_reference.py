"""Numpy references of the scorers and of soft attention, in float64.

They read a layer's own weights, so a test can compare the layer with an
independent computation of the equations in its docstring.
"""

import numpy as np

import harness
from keras_attention import scoring


def scores(scorer, query, key):
    """`scorer(query, key)` computed in numpy: `(..., T, S)`."""
    query = np.asarray(query, "float64")
    key = np.asarray(key, "float64")
    if isinstance(scorer, scoring.Additive):
        # v . tanh(q W_q + k W_k + b)
        q = query @ harness.to_numpy(scorer.query_kernel)  # (..., T, U)
        k = key @ harness.to_numpy(scorer.key_kernel)  # (..., S, U)
        bias = harness.to_numpy(scorer.bias)
        hidden = np.tanh(q[..., :, None, :] + k[..., None, :, :] + bias)
        return hidden @ harness.to_numpy(scorer.score_vector)  # (..., T, S)
    if isinstance(scorer, scoring.Bilinear):
        # q W k^T
        kernel = harness.to_numpy(scorer.kernel)  # (Dq, Dk)
        return query @ kernel @ np.swapaxes(key, -1, -2)
    dot = query @ np.swapaxes(key, -1, -2)  # (..., T, S)
    if isinstance(scorer, scoring.ScaledDotProduct):
        scale = scorer.scale
        if scale is None:
            scale = 1.0 / np.sqrt(key.shape[-1])
        return scale * dot
    assert type(scorer) is scoring.DotProduct, scorer
    return dot


def masked_softmax(logits, mask=None):
    """Softmax over the last axis; masked entries and fully masked rows are 0."""
    logits = np.asarray(logits, "float64")
    if mask is None:
        mask = np.ones(logits.shape, bool)
    mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
    logits = np.where(mask, logits, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    exp = np.where(mask, np.exp(logits - row_max), 0.0)
    total = np.sum(exp, axis=-1, keepdims=True)
    return np.where(total > 0, exp / np.where(total > 0, total, 1.0), 0.0)


def attention(scorer, query, key, value, mask=None):
    """`(output, weights)` of soft attention with `scorer`, in numpy."""
    weights = masked_softmax(scores(scorer, query, key), mask)  # (..., T, S)
    return weights @ np.asarray(value, "float64"), weights


def causal_mask(query_length, key_length):
    """Bottom-right aligned: query `i` sees keys `0 .. S - T + i`."""
    return np.tril(
        np.ones((query_length, key_length), bool), k=key_length - query_length
    )


def project(dense, x):
    """An `EinsumDense` head projection `(B, S, D) -> (B, S, heads, size)`."""
    kernel = harness.to_numpy(dense.kernel).astype("float64")  # (D, heads, size)
    y = np.einsum("bsd,dhk->bshk", np.asarray(x, "float64"), kernel)
    if dense.bias is not None:
        y = y + harness.to_numpy(dense.bias)  # (heads, size)
    return y  # (B, S, heads, size)


def projected_heads(layer, query, value, key=None):
    """`(q, k, v)` heads `(B, H, T|S, K|V)`; kv head `h // (H / G)` serves head `h`."""
    key = value if key is None else key
    q = project(layer.query_dense, query)  # (B, T, H, K)
    k = project(layer.key_dense, key)  # (B, S, G, K)
    v = project(layer.value_dense, value)  # (B, S, G, V)
    serving = np.arange(layer.num_heads) // (layer.num_heads // k.shape[2])  # (H,)
    k, v = k[:, :, serving], v[:, :, serving]  # (B, S, H, K|V)
    return tuple(np.transpose(x, (0, 2, 1, 3)) for x in (q, k, v))


def output_projection(layer, heads):
    """The output projection of heads `(B, H, T, V)`: `(B, T, O)`."""
    kernel = harness.to_numpy(layer.output_dense.kernel).astype("float64")
    output = np.einsum("bhtv,hvo->bto", heads, kernel)  # (B, T, O)
    if layer.output_dense.bias is not None:
        output = output + harness.to_numpy(layer.output_dense.bias)
    return output


def head_mask(mask):
    """A `(T, S)`, `(B, T, S)` or `(B, H, T, S)` mask, broadcastable over heads."""
    if mask is None:
        return None
    mask = np.asarray(mask, bool)
    return mask[:, None] if mask.ndim == 3 else mask


def multi_head_attention(layer, query, value, key=None, mask=None):
    """`(output, weights)` of a `MultiHeadAttention` from its own weights, in
    float64: `(B, T, O)`, `(B, H, T, S)`."""
    q, k, v = projected_heads(layer, query, value, key)
    heads, weights = attention(layer.score, q, k, v, head_mask(mask))
    return output_projection(layer, heads), weights
