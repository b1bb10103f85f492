"""TensorFlow: the blocked kernel for static shapes, chunks, XLA loops.

Each choice was measured on the path users take, on a CPU
(benchmarks/README.md names the scripts):

- The blocked kernel runs faster than Keras's TensorFlow kernel from 64
  queries on; below 32 queries, in a compiled model's training step, Keras's
  kernel was as fast or faster, so short self-attention, such as a
  translation model's sentences, keeps it (a cache read keeps the blocked
  kernel, and so do float16 and bfloat16, which were not measured). Keras's
  kernel repeats key/value heads only for more than one key/value head, so
  multi-query attention repeats them itself (`mha_speed.py`).
- Self-attention's Q/K/V as one matmul (`fuse_projections`) was faster for
  the layer alone but slower on the path users take, a compiled model's
  `train_on_batch`, so it is off here too. In a decoding step of the
  compiled loop (`fuse_cached_projections`), whose kernels XLA concatenates
  once outside the loop, the one matmul decodes faster (`gpt_speed.py`);
  JAX's loop ran as fast either way, and torch's eager step would
  concatenate at every step.
- Projections run as one `linear` (`linear_projections`) instead of the
  `EinsumDense` and `Dense` calls: the translation model's training step
  runs faster that way (`seq2seq_speed.py`), the GPT example's and
  `MultiHeadAttention`'s alone as fast. A bias-free product of one row under
  XLA gets a zero bias (`linear`), so that XLA runs it as the one fused
  kernel it makes of a product and its bias add: a model without biases
  decodes as fast as one with them (`gpt_speed.py --sections llama`).
- Causal attention takes two query blocks, not eight: in a compiled model's
  training step at 512 and 1,024 tokens each block's slices, mask and padded
  key/value gradients cost more than the scores it skips (`mha_speed.py`).
"""

import numpy as np
import tensorflow as tf
from keras import ops
from tensorflow.python.ops import control_flow_util

from keras_attention.backend import common
from keras_attention.backend.common import Preferences

PREFERENCES = Preferences(
    blocked="always", blocked_min_queries=32, causal_blocks=2, chunk_long_queries=True,
    linear_projections=True, fuse_cached_projections=True, repeat_single_key_value_head=True,
    cache_windows=True, causal_tiles=True,
)


def argmax(x):
    """`argmax` over the last axis from plain reductions: the largest
    value, then the first index holding it; in a row with a NaN, the first
    NaN (NaN counts as the largest, as in numpy's, JAX's and torch's
    argmax; TensorFlow's own skips NaN).
    """
    largest = ops.max(x, axis=-1, keepdims=True)
    nan = ops.isnan(x)
    hit = ops.where(ops.any(nan, axis=-1, keepdims=True), nan, x == largest)
    size = x.shape[-1]
    positions = ops.arange(size, dtype="int32")
    return ops.min(ops.where(hit, positions, size), axis=-1)


def linear(x, kernel, bias):
    # XLA's CPU compiler emits a one-row product followed by a bias add as
    # one fused kernel, and a bias-free one as a call to its library
    # product, which costs more in a decoding step: the bias-free LLaMA
    # configuration decoded slower than GPT-2's of equal FLOPs, and as fast
    # with a zero bias (benchmarks/gpt_speed.py --sections llama). The zero
    # is one XLA cannot fold away; it hoists it out of the loop.
    if bias is None and _one_row(x) and _compiled_by_xla():
        bias = _zero(kernel[0])
    return common.linear(x, kernel, bias)


def dense(x, kernel, bias, inputs=1, dtype=None):
    return common.dense(x, kernel, bias, inputs, dtype, linear=linear)


def _one_row(x):
    rows = 1
    for size in x.shape[:-1]:
        if size is None:
            return False
        rows *= size
    return rows == 1


def _zero(like):
    """Zeros of `like`'s shape that XLA does not fold as a constant (a
    non-finite entry gives 0 too)."""
    return ops.where(ops.isfinite(like), ops.multiply(like, 0), 0)


def gelu(x):
    # `tf.nn.gelu` (the erfc form) took the GPT example's training step as
    # long as the erf form did (benchmarks/gpt_speed.py), so Keras's runs.
    return None


def when_finite(inputs, attempt, recompute):
    # Under XLA (`jit_compile=True`, which `compile()`'s "auto" picks on a
    # GPU) the guarded computation runs always, as on JAX: XLA fuses it, and
    # TensorFlow's XLA bridge aborted the process (a failed check on a
    # `SetDimensionSize` in dynamic_dimension_inference.cc) compiling the
    # gradient of Keras's kernel, whose `tf.einsum` gradient reshapes by the
    # shapes it reads, inside the `cond`'s branch
    # (tests/kernels/test_xla_training.py). A graph outside XLA keeps the
    # `cond`, which skips the guard's work when the inputs are finite.
    if _compiled_by_xla():
        return recompute()
    return common.when_finite(inputs, attempt, recompute)


def _compiled_by_xla():
    # `tf.function(jit_compile=True)` traces inside an XLA control-flow
    # context on the graph that calls it, which TensorFlow's own loops
    # consult the same way.
    graph = tf.compat.v1.get_default_graph()
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def after(values, dependencies):
    # A graph runs ops that share no data at once: the bands of a chunked
    # attention would all hold their chunks' scores together.
    with tf.control_dependencies(list(dependencies)):
        return tuple(tf.identity(value) for value in values)


def fori_loop(lower, upper, body, init):
    # A graph's `tf.while_loop` runs up to 10 iterations at once by default
    # (Keras's `fori_loop` keeps it): ten chunks' scores at a time.
    return tf.while_loop(
        lambda i, _: i < upper,
        lambda i, value: (i + 1, body(i, value)),
        (lower, init),
        parallel_iterations=1,
    )[1]


def compiled_loop(function):
    # Outside XLA, `slice_update` (XLA's DynamicUpdateSlice) copies its whole
    # input at every iteration of a graph loop: for the causal tiles at 8,192
    # tokens, 48 MiB a tile in the backward pass. XLA updates in place.
    return tf.function(function, jit_compile=True, autograph=False)


def custom_vjp(forward, backward):
    def function(*args):
        @tf.custom_gradient
        def with_gradient(*args):
            output, residuals = forward(*args)
            return output, lambda d_output: tuple(backward(residuals, d_output))

        return with_gradient(*args)

    return function


def stateless_uniform(like, seed, step):
    pair = tf.stack([tf.cast(seed, "int64"), tf.cast(step, "int64")])
    return tf.random.stateless_uniform(
        tf.shape(like), seed=pair, minval=1e-12, maxval=1.0
    )


def compile_decoding(loop, variables):
    # XLA fuses a step's few hundred small ops: without it the graph
    # executor's per-op overhead is most of a step on a CPU.
    function = tf.function(loop, jit_compile=True, autograph=False)
    concrete = {}

    def call(*args):
        # The concrete function of the arguments' shapes and dtypes, called
        # directly: `tf.function`'s own dispatch (canonicalizing, hashing and
        # looking up the call's type) is a large part of a short call
        # (benchmarks/seq2seq_speed.py).
        if not all(isinstance(a, (np.ndarray, np.generic)) for a in args):
            return function(*args)
        key = tuple((a.shape, a.dtype.str) for a in args)
        if key not in concrete:
            concrete[key] = function.get_concrete_function(*args)
        return concrete[key](*args)

    return call
