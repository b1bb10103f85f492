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
