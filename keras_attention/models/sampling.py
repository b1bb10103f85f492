"""Choosing the next token from logits: greedy, random, top-k, top-p.

Shape legend: `B` batch, `V` vocabulary size.

Random choices use the Gumbel-max trick, `argmax(logits / temperature + g)`
with `g = -log(-log(u))`, `u ~ U(0, 1)`, which draws exactly from
`softmax(logits / temperature)`. The uniform noise is *stateless*: a pure
function of `(seed, step)`, so a decoding loop compiled once (jit,
`tf.function`, `while_loop`) carries no random state, and the same seed gives
the same tokens on every call. Keras's `keras.random` takes a tensor seed only
on JAX, so the noise comes from the backend seam (`backend.stateless_uniform`).
"""

from keras import ops

from keras_attention import backend

SAMPLING = ("greedy", "random", "top_k", "top_p")


def exclude(logits, token_id, value=-1e30):
    """`logits` `(B, V)` with column `token_id` set to `value` (none for
    None): a token never chosen."""
    if token_id is None:
        return logits
    vocabulary = ops.arange(logits.shape[-1], dtype="int32")  # (V,)
    return ops.where(vocabulary == token_id, ops.cast(value, logits.dtype), logits)


def next_token(logits, sampling, temperature, top_k, top_p, seed, step):
    """One token per row of `logits` `(B, V)`, as int32 `(B,)`.

    Args:
        logits: `(B, V)` float.
        sampling: one of `SAMPLING`.
        temperature: positive scalar (float or tensor); ignored by greedy.
        top_k: positive int (static), used by `"top_k"`.
        top_p: scalar in (0, 1], used by `"top_p"`: the smallest set of most
            likely tokens whose probabilities sum to at least `top_p` (the
            most likely token is always kept).
        seed, step: the stateless noise's key.
    """
    logits = ops.cast(logits, "float32")
    if sampling == "greedy":
        return ops.cast(backend.argmax(logits), "int32")
    logits = logits / ops.cast(temperature, "float32")
    vocabulary = logits.shape[-1]
    if sampling == "top_k":
        k = min(int(top_k), vocabulary)
        values, indices = ops.top_k(logits, k=k)  # (B, k)
        choice = _gumbel_argmax(values, seed, step)  # (B,)
        return ops.cast(ops.take_along_axis(indices, choice[:, None], axis=-1)[:, 0], "int32")
    if sampling == "top_p":
        values, indices = ops.top_k(logits, k=vocabulary)  # sorted, (B, V)
        probabilities = ops.softmax(values, axis=-1)
        before = ops.cumsum(probabilities, axis=-1) - probabilities  # mass above
        keep = before < ops.cast(top_p, "float32")  # the first is always kept
        values = ops.where(keep, values, ops.full_like(values, -1e30))
        choice = _gumbel_argmax(values, seed, step)
        return ops.cast(ops.take_along_axis(indices, choice[:, None], axis=-1)[:, 0], "int32")
    return ops.cast(_gumbel_argmax(logits, seed, step), "int32")


def _gumbel_argmax(logits, seed, step):
    uniform = backend.stateless_uniform(logits, seed, step)
    gumbel = -ops.log(-ops.log(ops.cast(uniform, "float32")))
    return backend.argmax(logits + gumbel)
