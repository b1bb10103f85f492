"""JAX: the blocked kernel, chunks, one jit.

Measured on a 2-core CPU (benchmarks/README.md): the blocked kernel wins with
the causal flag (blocks skip work) and without it (Keras's kernel, XLA's
`dot_product_attention`, took longer for a forward and backward pass at 128 to
1,024 tokens; `mha_speed.py`), and more so dividing by the sum of
exponentials after the product with the values (`normalize_last`: faster at
512 and 1,024 tokens in a compiled model's training step, the same at 128; on
TensorFlow it was slower).
The NaN guard always runs its masked computation outside a cache: XLA fuses
the zeroing into neighbouring operations, while a `cond` would stop fusion
and keep both branches' residuals for the backward pass.

Projections run as one `linear` on rows `(B T, D)` (`linear`): on a
`(B, T, D) x (D, N)` product XLA's CPU compiler gives the weight gradient a
transposed copy of the activation and of the output gradient, and those
copies cost more than the matmuls. Self-attention's Q, K and V as one
product (`fuse_projections`) was within the noise of three in a compiled
model's `train_on_batch` on one device, but under `keras.distribution.ModelParallel`
the concatenated sharded kernels added collectives (in the distribution
test's programs: 82 collective permutes against 45, 64 all-to-alls against
12), so it stays off.
"""

import jax
import keras
import numpy as np
from keras import ops

from keras_attention.backend import common
from keras_attention.backend.common import Preferences

# On a GPU neither the blocked kernel nor the chunks: both were measured on a
# CPU, where XLA's code for Keras's kernel was the slower one; on a GPU,
# Keras's kernel calls cuDNN's fused attention (`jax.nn.dot_product_attention`,
# implementation "cudnn") where cuDNN's checks pass (bfloat16 or float16, its
# head sizes), which neither forms the `(T, S)` scores nor needs query chunks,
# and XLA's own kernel elsewhere. Which one a run took: the profile in
# benchmarks/gpu/run_all.py's table.
_ON_GPU = jax.default_backend() == "gpu"

PREFERENCES = Preferences(
    blocked="never" if _ON_GPU else "always",
    normalize_last=True,
    chunk_long_queries=not _ON_GPU,
    guard_with_cond=False,
    linear_projections=True,
    cache_windows=True,
    causal_tiles=True,
)


def linear(x, kernel, bias):
    # As a 2-D product the weight gradient is one matmul of the rows. On
    # `(B, T, D)` XLA's CPU compiler copied the activation and the output
    # gradient into `(D, B T)` and `(N, B T)` layouts first: in the GPT
    # example's training step those copies took a third of the time
    # (benchmarks/README.md).
    rows = ops.reshape(x, (-1, x.shape[-1]))  # (B T, D)
    output = common.linear(rows, kernel, bias)  # (B T, N)
    return ops.reshape(output, ops.shape(x)[:-1] + (kernel.shape[-1],))  # (B, T, N)


def dense(x, kernel, bias, inputs=1, dtype=None):
    return common.dense(x, kernel, bias, inputs, dtype, linear=linear)


def kernel_dtype(dtype):
    # XLA's CPU dot_general has no float16 x float16 -> float32 variant,
    # which jax.nn.dot_product_attention asks for under jit.
    if keras.backend.standardize_dtype(dtype) == "float16":
        if jax.default_backend() == "cpu":
            return "float32"
    return dtype


def custom_vjp(forward, backward):
    @jax.custom_vjp
    def function(*args):
        return forward(*args)[0]

    def function_forward(*args):
        return forward(*args)

    def function_backward(residuals, d_output):
        # None for a boolean argument: JAX reads it as a zero (float0)
        # cotangent.
        return tuple(backward(residuals, d_output))

    function.defvjp(function_forward, function_backward)
    return function


def stateless_uniform(like, seed, step):
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.uniform(key, like.shape, minval=1e-12, maxval=1.0)


def _stateless_jit(function, variables):
    """`function(*args)` as one `jax.jit` of a pure function of the
    variables' values: a callable of `args` that passes their current values
    and assigns, after the call, the values the function assigned."""
    variables = list(variables)

    @jax.jit
    def stateless(values, *args):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            before = [scope.get_current_value(v) for v in variables]
            outputs = function(*args)
            after = [scope.get_current_value(v) for v in variables]
        # Only what changed comes back: an output of each unchanged variable
        # would be a copy of it at every call.
        return outputs, [new if new is not old else None for new, old in zip(after, before)]

    def call(*args):
        outputs, assigned = stateless([v.value for v in variables], *args)
        for variable, value in zip(variables, assigned):
            if value is not None:
                variable.assign(value)
        return outputs

    return call


def compile_decoding(loop, variables):
    """The loop as one `jax.jit` (`_stateless_jit`), returning numpy
    arrays."""
    compiled = _stateless_jit(loop, variables)

    def function(*args):
        outputs = compiled(*args)
        # `np.array` also waits for the asynchronous dispatch.
        if isinstance(outputs, tuple):
            return tuple(np.array(output) for output in outputs)
        return np.array(outputs)

    return function


def run_once(function, variables):
    """`function()` as one `jax.jit` (`_stateless_jit`)."""
    return _stateless_jit(function, variables)()
