"""The backend seam: the one package that names a backend.

Every other module of `keras_attention` is written in `keras.ops`; where a
backend has a faster or safer way to do something, the portable code asks
this package, which forwards to the module of the running backend
(`tensorflow.py`, `jax.py`, `torch.py`; `common.py` holds the portable
defaults: a backend module defines only the primitives it does otherwise,
and `common` serves the rest, and any other backend). What each backend prefers
is declared as data, `Preferences` in `common.py`, so that the kernel choice
(`keras_attention.kernels.choice`) reads as a table.

It holds tensor primitives only (projections, norms, activations, dropout
masks, attention kernels, custom gradients, loop compilation) and imports
nothing from the layers or models: every model runs its layers' own code.
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


def _primitive(name):
    """The running backend's primitive `name`, or the portable default in
    `common` where the backend module has none of its own."""
    return getattr(current(), name, None) or getattr(common, name)


def preferences():
    """The running backend's `Preferences` (kernel and projection choices)."""
    return current().PREFERENCES


def linear(x, kernel, bias):
    """`x @ kernel + bias`, `(..., D) x (D, N) -> (..., N)`, in `x`'s dtype."""
    return _primitive("linear")(x, kernel, bias)


def dense(x, kernel, bias, inputs=1, dtype=None):
    """`x` `(..., *I)` contracted with `kernel` `(*I, *O)` over its last
    `inputs` axes, plus `bias` `(*O)` or None: `(..., *O)` in `dtype` (by
    default `x`'s). An attention projection's `EinsumDense` as one GEMM with
    the bias inside where the backend has one (torch's `linear`)."""
    return _primitive("dense")(x, kernel, bias, inputs, dtype)


def layer_norm(x, gamma, beta, epsilon):
    """Layer normalization over the last axis, `gamma` and `beta` optional
    `(D,)`, computed in float32 at least and returned in that dtype."""
    return _primitive("layer_norm")(x, gamma, beta, epsilon)


def rms_norm(x, scale, epsilon):
    """RMS normalization over the last axis, `scale` optional `(D,)`,
    computed in float32 at least and returned in that dtype; or None where
    Keras's computation is the one to run (the caller then runs it)."""
    return _primitive("rms_norm")(x, scale, epsilon)


def cast(x, dtype):
    """`x` in `dtype`: `x` itself where it already has it, with no
    `keras.ops` call (eagerly, as torch decodes, a call costs more than a
    decoding step's small tensors)."""
    return _primitive("cast")(x, dtype)


def gelu(x):
    """The exact GELU, `x Phi(x)`, in `x`'s dtype; or None where Keras's
    `ops.gelu` is the faster one, or for a dtype the backend leaves to it
    (the caller then runs it)."""
    return _primitive("gelu")(x)


def unless_nonfinite(output, recompute):
    """`output` if it is all finite, else `recompute()` (same shape, dtype)."""
    return _primitive("unless_nonfinite")(output, recompute)


def when_finite(inputs, attempt, recompute):
    """`attempt()` if every tensor of `inputs` is all finite, else
    `recompute()` (same shape and dtype); only the branch taken is
    differentiated."""
    return _primitive("when_finite")(inputs, attempt, recompute)


def kernel_dtype(dtype):
    """The dtype the backend's fused kernel can run `dtype` inputs in."""
    return _primitive("kernel_dtype")(dtype)


def after(values, dependencies):
    """`values` (a tuple of tensors), available only once `dependencies` are
    computed: the order of two computations that share no data, for a
    backend whose graph would run them at once (and hold both their
    intermediates)."""
    return _primitive("after")(values, dependencies)


def fori_loop(lower, upper, body, init):
    """`ops.fori_loop` whose iterations run one after the other, so that a
    loop over chunks holds one chunk's intermediates at a time."""
    return _primitive("fori_loop")(lower, upper, body, init)


def compiled_loop(function):
    """`function` (of tensors, to tensors), made to run its loops as one
    compiled program where the backend's graph would copy a loop state at
    every `slice_update`: XLA on TensorFlow; unchanged elsewhere (JAX
    compiles everything, torch updates in place)."""
    return _primitive("compiled_loop")(function)


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
    return _primitive("custom_vjp")(forward, backward)


def all_finite(*tensors):
    """True if no tensor holds NaN or inf, False if one does, None where the
    backend cannot tell without tracing a branch (the caller keeps its
    guards). Torch answers eagerly, from one reduction."""
    return _primitive("all_finite")(*tensors)


def compiling():
    """True while `torch.compile` traces the running code: its tensors then
    convert to numpy as traced values, not known ones (JAX and TensorFlow
    raise when asked for a traced value instead)."""
    return _primitive("compiling")()


def constant(values, dtype, like):
    """The Python numbers `values` (a flat sequence) as a tensor of `dtype`
    on `like`'s device; under `torch.compile` a constant of the graph, where
    a numpy array would be traced as an input."""
    return _primitive("constant")(values, dtype, like)


def dropout(x, rate, seed):
    """`keras.random.dropout(x, rate, seed=seed)`, or the backend's faster
    draw of the same distribution (torch). A `SeedGenerator` seed advances
    once per call on every backend, so seeded runs repeat and resume."""
    return _primitive("dropout")(x, rate, seed)


def fused_attention(q, k, v, mask, scale, is_causal):
    """The backend's fused attention kernel on `(B, T, H, K)` heads (`k`,
    `v` with `G` heads dividing `H`), a boolean `mask` `(B|1, H|1, T, S)`
    or None, every row of which sees a key: `(B, T, H, V)`; or None where
    Keras's `ops.dot_product_attention` is the one to run (the caller then
    runs it)."""
    return _primitive("fused_attention")(q, k, v, mask, scale, is_causal)


def dropout_attention(q, k, v, mask, scale, is_causal, rate, seed):
    """Dot-product attention with dropout on the weights in the backend's
    fused kernel, where `Preferences.dropout_kernel` says it takes dropout
    (torch's `scaled_dot_product_attention`). A fused kernel alone: the
    caller (`kernels.fused.attend`) keeps the fully-masked-row and
    non-finite rules around it.

    Args:
        q: `(B, T, H, K)`; k: `(B, S, G, K)`; v: `(B, S, G, V)`.
        mask: optional boolean `(B|1, H|1, T, S)`, `True` = may attend;
            every row sees a key.
        scale: the score scale. is_causal: bool, causal with `T == S` (no
            mask then). rate: the dropout rate, in (0, 1).
        seed: a `keras.random.SeedGenerator` (advanced once), an int or
            None, as for `dropout`: the same seed gives the same noise.

    Returns:
        `(B, T, H, V)`: the softmax weights, dropped with probability
        `rate` and the rest scaled by `1 / (1 - rate)`, times the values.
    """
    return _primitive("dropout_attention")(q, k, v, mask, scale, is_causal, rate, seed)


def argmax(x):
    """The index of the largest value along the last axis, the first one
    on ties, NaN counting as the largest (as numpy's, JAX's and torch's
    argmax; TensorFlow's skips NaN: its own from plain reductions)."""
    return _primitive("argmax")(x)


def stateless_uniform(like, seed, step):
    """`U(0, 1)` noise shaped like `like`, a pure function of `(seed, step)`."""
    return _primitive("stateless_uniform")(like, seed, step)


def compile_decoding(loop, variables):
    """A decoding loop made into the backend's fastest callable, which
    returns the loop's outputs as tensors or (on JAX) numpy arrays.

    Args:
        loop: `loop(*args)`, written in `keras.ops` over the model's layers.
        variables: the model's variables, which the loop reads (JAX passes
            their current values to the compiled function at every call).
    """
    return _primitive("compile_decoding")(loop, variables)


def compile_step(step):
    """A model's decoding step `step(token_ids, caches, index)` compiled on
    its own, for a model that asks for its backend's compiler
    (`jit_compile=True`) where the decoding loop runs eagerly: torch's
    `torch.compile`, for one-token steps. Elsewhere the step as it is: the
    whole loop is compiled (`compile_decoding`)."""
    return _primitive("compile_step")(step)


def run_once(function, variables):
    """`function()`, a computation that reads `variables` (a model's), run
    once in the backend's quickest way for a single call: on JAX as one
    compiled program (eagerly, JAX compiles each operation on its first
    call, some hundreds for a small model), elsewhere eagerly. What the
    function assigns to `variables` (a seed generator's state) is kept, as
    eagerly. Returns its outputs, tensors."""
    return _primitive("run_once")(function, variables)


__all__ = [
    "after",
    "Preferences",
    "all_finite",
    "compiling",
    "constant",
    "argmax",
    "compile_decoding",
    "compile_step",
    "current",
    "custom_vjp",
    "dense",
    "fori_loop",
    "fused_attention",
    "dropout",
    "dropout_attention",
    "kernel_dtype",
    "linear",
    "preferences",
    "run_once",
    "stateless_uniform",
    "unless_nonfinite",
    "when_finite",
]
