"""What the backends share: the portable defaults, and the `Preferences` record.

A backend module starts from these functions and overrides what it does
better; a backend the package has no module for (numpy, openvino) runs them
as they are.
"""

import dataclasses

import keras
import numpy as np
from keras import ops


@dataclasses.dataclass(frozen=True)
class Preferences:
    """What a backend prefers; `keras_attention.kernels.choice` reads it.

    Attributes:
        blocked: when the package's blocked kernel replaces Keras's fused
            one: `"always"` or `"never"`.
        blocked_min_queries: the fewest float32 queries a call needs for
            the blocked kernel (a cache read, or another dtype, takes it with
            any number).
        causal_blocks: the most query blocks the blocked kernel splits causal
            attention into: more skip more of the scores above the diagonal
            (eight skip 7/16), and each adds its slices, masks and, in the
            backward pass, the padding of its key and value gradients.
        normalize_last: whether the blocked kernel divides by each row's sum
            of exponentials after the product with the values (a `(T, V)`
            division) instead of normalizing the `(T, S)` weights first.
        chunk_long_queries: whether long sequences go through the kernel in
            query chunks (a backend whose CPU kernel holds the whole score
            matrix).
        repeat_single_key_value_head: whether Keras's kernel needs key/value
            heads repeated for multi-query attention (one key/value head).
        fuse_projections: whether self-attention's Q, K and V projections
            run as one matmul.
        fuse_cached_projections: the same for a call that writes a KV cache
            (a decoding step), where a compiled loop concatenates the kernels
            once, outside the loop.
        linear_projections: whether projections run as one `linear` (bias
            inside the GEMM) instead of the layer call.
        guard_with_cond: whether the NaN guard recomputes only when the
            output is non-finite (a `cond`); otherwise it always runs the
            guarded computation, which a compiler fuses.
        dropout_kernel: whether dot-product attention with dropout on the
            weights (in training, weights not returned) runs in the
            backend's fused kernel with its dropout, `dropout_attention`,
            instead of the explicit kernel (Keras's fused kernel takes no
            dropout).
        cache_windows: whether generation decodes in phases over caches
            that grow (`keras_attention.models.cache_windows`): where the
            loop is compiled with static shapes, a step reads every slot of
            the caches it carries; an eager step can read only the written
            ones (torch's), and more phases would only cost it copies.
        causal_tiles: whether chunked causal attention runs in square tiles
            below the diagonal, one loop each way (`kernels.chunked._Tiles`),
            instead of query chunks in bands.
        direct_calls: whether the layers' calls inside a decoding loop and
            inside a stack's or block's call go to their own `call` where
            Keras's per-call wrapper would add nothing
            (`layers/_direct_calls.py`): on a backend that runs a model
            eagerly, where the wrapper costs about as much as small layers.
    """

    blocked: str = "never"
    blocked_min_queries: int = 0
    causal_blocks: int = 8
    normalize_last: bool = False
    chunk_long_queries: bool = False
    repeat_single_key_value_head: bool = False
    fuse_projections: bool = False
    fuse_cached_projections: bool = False
    linear_projections: bool = False
    guard_with_cond: bool = True
    dropout_kernel: bool = False
    cache_windows: bool = False
    causal_tiles: bool = False
    direct_calls: bool = False


PREFERENCES = Preferences()


def linear(x, kernel, bias):
    kernel = ops.cast(kernel, x.dtype)
    output = ops.matmul(x, kernel)
    return output if bias is None else ops.add(output, ops.cast(bias, x.dtype))


def dense(x, kernel, bias, inputs=1, dtype=None, linear=linear):
    """`x` contracted over its last `inputs` axes with the first `inputs` of
    `kernel`, plus `bias` (of `kernel`'s other axes): an `EinsumDense` of the
    attention projections as one `linear`, `(..., *I) -> (..., *O)` for a
    kernel `(*I, *O)`, computed in `dtype` (by default `x`'s)."""
    x = ops.convert_to_tensor(x, dtype)
    width = 1
    for size in kernel.shape[:inputs]:
        width *= size
    trailing = tuple(kernel.shape[inputs:])
    shape = ops.shape(x)
    leading = tuple(shape[: len(shape) - inputs])
    if inputs > 1:
        x = ops.reshape(x, leading + (width,))  # (..., I)
    if len(kernel.shape) != 2:
        kernel = ops.reshape(kernel, (width, -1))  # (I, O)
    if bias is not None and len(bias.shape) != 1:
        bias = ops.reshape(bias, (-1,))
    output = linear(x, kernel, bias)  # (..., O)
    return output if len(trailing) == 1 else ops.reshape(output, leading + trailing)


def layer_norm(x, gamma, beta, epsilon):
    # The centered input once, its mean square, and the scale and shift
    # applied to the normalized rows. Keras's own computation folds gamma
    # into the inverse deviation and the mean into a shift, two tensors of
    # the input's shape; XLA's CPU code wrote both out (their consumers are
    # matmuls, which take no fused producer), forward and backward: the GPT
    # example's training step took longer with it on TensorFlow and JAX
    # (benchmarks/gpt_step_floor.py times that step).
    dtype = keras.backend.result_type(x.dtype, "float32")
    x = ops.cast(x, dtype)
    centered = x - ops.mean(x, axis=-1, keepdims=True)
    variance = ops.mean(ops.square(centered), axis=-1, keepdims=True)
    output = centered * ops.rsqrt(variance + epsilon)
    if gamma is not None:
        output = output * ops.cast(gamma, dtype)
    if beta is not None:
        output = output + ops.cast(beta, dtype)
    return output


def rms_norm(x, scale, epsilon):
    return None


def cast(x, dtype):
    if keras.backend.standardize_dtype(x.dtype) == dtype:
        return x
    return ops.cast(x, dtype)


SQRT_HALF = 0.7071067811865476


def gelu(x):
    # `x (1 + erf(x / sqrt 2)) / 2`, the form torch's kernel computes. JAX's
    # `jax.nn.gelu` takes `x erfc(-x / sqrt 2) / 2`, and XLA expands erfc into
    # two polynomials and a select per element: in the GPT example's
    # training step on a CPU the GELU fusions cost about twice as much that
    # way (benchmarks/README.md). In float32 both are within 1.1e-6 of the
    # exact value. Other dtypes take Keras's `ops.gelu`: in float16 or
    # bfloat16 `1 + erf` cancels to 0 below about x = -2, and even computed
    # in float32 it loses the tail below x = -5 that bfloat16 can hold.
    x = ops.convert_to_tensor(x)
    if keras.backend.standardize_dtype(x.dtype) != "float32":
        return None
    return ops.multiply(ops.multiply(x, 0.5), ops.add(1.0, ops.erf(ops.multiply(x, SQRT_HALF))))


def unless_nonfinite(output, recompute):
    # One summing pass: NaN and inf survive a sum (a finite sum too large for
    # float32 only means a needless recomputation).
    finite = ops.isfinite(ops.sum(ops.cast(output, "float32")))
    return ops.cond(finite, lambda: output, recompute)


def when_finite(inputs, attempt, recompute):
    # Decided before either computation runs, from the inputs: a `cond` on
    # the attempt's own output would differentiate the discarded attempt
    # too, and its gradient is `0 * NaN` at a masked NaN.
    # One summing pass per input, as `unless_nonfinite`: on torch,
    # `isfinite` and `all` through `keras.ops` took several hundred times
    # as long as the sums (benchmarks/mha_speed.py).
    total = sum(ops.sum(ops.cast(x, "float32")) for x in inputs)
    return ops.cond(ops.isfinite(total), attempt, recompute)


def kernel_dtype(dtype):
    return dtype


def fori_loop(lower, upper, body, init):
    return ops.fori_loop(lower, upper, body, init)


def after(values, dependencies):
    return values


def compiled_loop(function):
    return function


def custom_vjp(forward, backward):
    # No custom gradients here: the backend's autodiff differentiates the
    # forward computation (exact, at its memory cost).
    def function(*args):
        return forward(*args)[0]

    return function


def all_finite(*tensors):
    # Unknown where values are not Python's to read (under a compiler): the
    # caller then keeps its guards.
    return None


def compiling():
    return False


def constant(values, dtype, like):
    return ops.convert_to_tensor(np.asarray(values, dtype))


def dropout(x, rate, seed):
    return keras.random.dropout(x, rate, seed=seed)


def fused_attention(q, k, v, mask, scale, is_causal):
    return None


def dropout_attention(q, k, v, mask, scale, is_causal, rate, seed):
    raise NotImplementedError(
        "`dropout_attention` is a backend kernel; this backend has none "
        "(`Preferences.dropout_kernel` is False)."
    )


def argmax(x):
    return ops.argmax(x, axis=-1)


def stateless_uniform(like, seed, step):
    raise NotImplementedError(
        "Stateless sampling needs the tensorflow, jax or torch backend."
    )


def compile_decoding(loop, variables):
    return loop


def compile_step(step):
    return step


def run_once(function, variables):
    return function()
