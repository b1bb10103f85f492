"""Choosing the next token from logits: greedy, random, top-k, top-p.

Shape legend: `B` batch, `V` vocabulary size.

Random choices use the Gumbel-max trick, `argmax(logits / temperature + g)`
with `g = -log(-log(u))`, `u ~ U(0, 1)`, which draws exactly from
`softmax(logits / temperature)`. The uniform noise is *stateless*: a pure
function of `(seed, step)`, so a decoding loop compiled once (jit,
`tf.function`, `while_loop`) carries no random state, and the same seed gives
the same tokens on every call. Keras's `keras.random` takes a tensor seed only
on JAX, so this one function has a branch per backend.
"""

import keras
from keras import ops

SAMPLING = ("greedy", "random", "top_k", "top_p")


def stateless_uniform(like, seed, step):
    """`U(0, 1)` noise shaped like `like`, a pure function of `seed` and `step`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.uniform(key, like.shape, minval=1e-12, maxval=1.0)
    if backend == "tensorflow":
        import tensorflow as tf

        pair = tf.stack([tf.cast(seed, "int64"), tf.cast(step, "int64")])
        return tf.random.stateless_uniform(
            tf.shape(like), seed=pair, minval=1e-12, maxval=1.0
        )
    if backend == "torch":
        import torch

        generator = torch.Generator(device="cpu")
        generator.manual_seed(int(seed) * 1_000_003 + int(step))
        noise = torch.rand(tuple(like.shape), generator=generator)
        return noise.clamp_min_(1e-12).to(like.device)
    raise NotImplementedError(f"Sampling is not available on the {backend} backend")


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
        return ops.cast(ops.argmax(logits, axis=-1), "int32")
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
    uniform = stateless_uniform(logits, seed, step)
    gumbel = -ops.log(-ops.log(ops.cast(uniform, "float32")))
    return ops.argmax(logits + gumbel, axis=-1)
