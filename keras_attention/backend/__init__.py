"""The backend seam: the one package that names a backend.

Every other module of `keras_attention` is written in `keras.ops`; where a
backend has a faster or safer way to do something, the portable code asks
this package, which forwards to the module of the running backend
(`tensorflow.py`, `jax.py`, `torch.py`; `common.py` holds the portable
defaults they share and serves any other backend). What each backend prefers
is declared as data, `Preferences` in `common.py`, so that the kernel choice
(`keras_attention.kernels.choice`) reads as a table.

A fast path decides what it can run from an allow-list and returns `None`
otherwise, so a new option is safe by default: the caller falls back to the
portable layers.
"""

import importlib

import keras

from keras_attention.backend import common
from keras_attention.backend.common import Preferences

_MODULES = {}
_OWN_MODULES = ("tensorflow", "jax", "torch")


def current():
    """The module of the running Keras backend (`common` for any other)."""
    name = keras.backend.backend()
    if name not in _MODULES:
        if name in _OWN_MODULES:
            _MODULES[name] = importlib.import_module(f"keras_attention.backend.{name}")
        else:
            _MODULES[name] = common
    return _MODULES[name]


def preferences():
    """The running backend's `Preferences` (kernel and projection choices)."""
    return current().PREFERENCES


def linear(x, kernel, bias):
    """`x @ kernel + bias`, `(..., D) x (D, N) -> (..., N)`, in `x`'s dtype."""
    return current().linear(x, kernel, bias)


def layer_norm(x, gamma, beta, epsilon):
    """Layer normalization over the last axis, `gamma` and `beta` optional
    `(D,)`, computed in float32 at least and returned in that dtype; or
    None where the backend's own Keras computation is the faster one (the
    caller then runs Keras's)."""
    return current().layer_norm(x, gamma, beta, epsilon)


def gelu(x):
    """The exact GELU, `x Phi(x)`, in `x`'s dtype; or None where Keras's
    `ops.gelu` is the faster one, or for a dtype the backend leaves to it
    (the caller then runs it)."""
    return current().gelu(x)


def unless_nonfinite(output, recompute):
    """`output` if it is all finite, else `recompute()` (same shape, dtype)."""
    return current().unless_nonfinite(output, recompute)


def when_finite(inputs, attempt, recompute):
    """`attempt()` if every tensor of `inputs` is all finite, else
    `recompute()` (same shape and dtype); only the branch taken is
    differentiated."""
    return current().when_finite(inputs, attempt, recompute)


def kernel_dtype(dtype):
    """The dtype the backend's fused kernel can run `dtype` inputs in."""
    return current().kernel_dtype(dtype)


def after(values, dependencies):
    """`values` (a tuple of tensors), available only once `dependencies` are
    computed: the order of two computations that share no data, for a
    backend whose graph would run them at once (and hold both their
    intermediates)."""
    return current().after(values, dependencies)


def fori_loop(lower, upper, body, init):
    """`ops.fori_loop` whose iterations run one after the other, so that a
    loop over chunks holds one chunk's intermediates at a time."""
    return current().fori_loop(lower, upper, body, init)


def compiled_loop(function):
    """`function` (of tensors, to tensors), made to run its loops as one
    compiled program where the backend's graph would copy a loop state at
    every `slice_update`: XLA on TensorFlow; unchanged elsewhere (JAX
    compiles everything, torch updates in place)."""
    return current().compiled_loop(function)


def custom_vjp(forward, backward):
    """A function whose gradient is `backward` instead of autodiff of `forward`.

    `forward(*args) -> (output, residuals)` computes the output (one tensor)
    and what the gradient needs; `backward(residuals, d_output)` returns one
    gradient per argument of `forward` (None for an argument that takes none,
    such as a boolean mask). Only the residuals are kept for the backward
    pass, not the intermediates of `forward`: this is what lets attention
    recompute its scores there instead of storing them. Arguments are
    tensors (no None); a backend without custom gradients differentiates
    `forward` itself.

    Returns:
        `function(*args) -> output`.
    """
    return current().custom_vjp(forward, backward)


def all_finite(*tensors):
    """True if no tensor holds NaN or inf, False if one does, None where the
    backend cannot tell without tracing a branch (the caller keeps its
    guards). Torch answers eagerly, from one reduction."""
    return current().all_finite(*tensors)


def dropout(x, rate, seed):
    """`keras.random.dropout(x, rate, seed=seed)`, or the backend's faster
    draw of the same distribution (torch). A `SeedGenerator` seed advances
    once per call on every backend, so seeded runs repeat and resume."""
    return current().dropout(x, rate, seed)


def dropout_attention(q, k, v, mask, scale, rate, seed):
    """Dot-product attention with dropout on the weights, in the backend's
    own kernel, where `Preferences.dropout_kernel` says it has one (torch).

    Args:
        q: `(B, T, H, K)`; k: `(B, S, G, K)`; v: `(B, S, G, V)`.
        mask: optional boolean `(B|1, H|1, T, S)`, `True` = may attend.
        scale: the score scale. rate: the dropout rate, in (0, 1).
        seed: a `keras.random.SeedGenerator`, an int or None, as for
            `dropout`, whose mask it draws for the `(B, H, T, S)` weights.

    Returns:
        `(B, T, H, V)`, what the explicit kernel gives for the same mask
        (fully masked rows 0; NaN or inf in a key or value only for the
        queries that may see it).
    """
    return current().dropout_attention(q, k, v, mask, scale, rate, seed)


def argmax(x):
    """The index of the largest value along the last axis, the first one
    on ties, NaN counting as the largest (as numpy's, JAX's and torch's
    argmax; TensorFlow's skips NaN): through plain reductions under XLA
    (`common.first_argmax`), `ops.argmax` on torch."""
    return current().argmax(x)


def stateless_uniform(like, seed, step):
    """`U(0, 1)` noise shaped like `like`, a pure function of `(seed, step)`."""
    return current().stateless_uniform(like, seed, step)


def compile_decoding(loop, variables, fast_step=None, rows=None):
    """A decoding loop made into the backend's fastest callable, which
    returns the loop's outputs as tensors or (on JAX) numpy arrays.

    Args:
        loop: `loop(*args, step=None)`, written in `keras.ops`; `step=None`
            means the model's own (Keras layers) step.
        variables: the model's variables, which the loop reads.
        fast_step: optional zero-argument function returning the model's
            step outside the layers (`decoder_step`, `block_step`) or None,
            asked once per call (inside the trace where the loop compiles)
            so that it sees the current weights.
        rows: the rows each step computes (sources times hypotheses), or
            None; on JAX a CPU compiles a one-row loop with other XLA
            options.
    """
    return current().compile_decoding(loop, variables, fast_step, rows)


def decoder_step(embedding, blocks, final_norm):
    """A one-token step of a decoder outside the layers, or None: in plain
    torch on torch, in `keras.ops` with fewer kernels elsewhere
    (`compiled_steps`).

    `step(token_ids, caches, index) -> (logits, caches)` with the contract of
    `GPT._call_with_layer_caches`; None where the backend has none or the
    layers' configuration is not on its allow-list.
    """
    return current().decoder_step(embedding, blocks, final_norm)


def block_step(block):
    """A decoder block's cached step outside the layers, or None (as
    `decoder_step`).

    `step(x, self_cache, index, cross_cache=None, cross_mask=None) -> (x,
    self_cache)`, computing what `block(x, self_attention_cache=...,
    cross_attention_cache=..., encoder_padding_mask=cross_mask)` computes
    for one new position.
    """
    return current().block_step(block)


def stack_forward(
    blocks, x, use_causal_mask, training, padding_mask=None, memory=None, memory_mask=None
):
    """Encoder or decoder blocks applied to a whole sequence outside the
    layers, or None.

    `x` `(B, T, D)` -> `(B, T, D)`, what `block(x, ...)` over the blocks in
    turn computes with `padding_mask` `(B, T)` (None: no padding) on the
    self-attention, causal when `use_causal_mask`, cross-attention over
    `memory` `(B, S, D)` (None: none) with `memory_mask` `(B, S)`, and
    `training`; no attention masks or caches (the caller sends those to the
    layers). Differentiable as the layers are, with dropout drawn as the
    layers draw it. On torch, where Keras runs a model eagerly and a
    layer's call costs more than its arithmetic at small sizes, the blocks'
    arithmetic in plain torch; None for an empty `blocks`, where a block's
    options are off the allow-list (`allow_lists.sequence_options_allowed`),
    its call would add to its arithmetic, the output is not finite, or on a
    backend that compiles its steps (TensorFlow, JAX: nothing to spare).
    """
    return current().stack_forward(
        blocks, x, use_causal_mask, training, padding_mask, memory, memory_mask
    )


def decoder_forward(
    embedding, blocks, final_norm, token_ids, training, embedding_dropout=None
):
    """A decoder-only model's logits outside the layers, or None.

    `token_ids` `(B, T)` -> logits `(B, T, V)`: the learned token and
    position embedding (`embedding`, a `TokenAndPositionEmbedding` with tied
    logits), `embedding_dropout` (a dropout layer or None) in training, the
    causal `blocks` (as `stack_forward`), `final_norm` (or None) and the
    tied output projection; what `GPT.call` computes without a padding
    mask. None where `stack_forward` gives None or the embedding is off its
    allow-list (`mask_zero` included: its mask would reach the blocks).
    """
    return current().decoder_forward(
        embedding, blocks, final_norm, token_ids, training, embedding_dropout
    )


__all__ = [
    "after",
    "Preferences",
    "all_finite",
    "argmax",
    "block_step",
    "compile_decoding",
    "current",
    "custom_vjp",
    "decoder_forward",
    "decoder_step",
    "fori_loop",
    "dropout",
    "dropout_attention",
    "kernel_dtype",
    "linear",
    "preferences",
    "stack_forward",
    "stateless_uniform",
    "unless_nonfinite",
    "when_finite",
]
