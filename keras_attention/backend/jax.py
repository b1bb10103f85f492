"""JAX: the blocked kernel, chunks, one jit.

Measured on a 2-core CPU (benchmarks/README.md): the blocked kernel wins with
the causal flag (blocks skip work) and without it (Keras's kernel, XLA's
`dot_product_attention`, took 1.2 to 1.6 times as long for a forward and
backward pass at 128 to 1,024 tokens), and more so dividing by the sum of
exponentials after the product with the values (`normalize_last`: 1.1 to 1.25
times as fast at 512 and 1,024 tokens in a compiled model's training step, the
same at 128; on TensorFlow it was slower).
The NaN guard always runs its masked computation outside a cache: XLA fuses
the zeroing into neighbouring operations, while a `cond` would stop fusion
and keep both branches' residuals for the backward pass.

Projections run as one `linear` on rows `(B T, D)` (`linear`): on a
`(B, T, D) x (D, N)` product XLA's CPU compiler gives the weight gradient a
transposed copy of the activation and of the output gradient, and those
copies cost more than the matmuls. Self-attention's Q, K and V as one
product (`fuse_projections`) was 1 to 5% faster in a compiled model's
`train_on_batch` on one device, but under `keras.distribution.ModelParallel`
the concatenated sharded kernels added collectives (in the distribution
test's programs: 82 collective permutes against 45, 64 all-to-alls against
12), so it stays off.
"""

import functools
import inspect
import operator

import jax
import keras
import numpy as np
from keras import ops
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.variables import get_autocast_scope

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
    absorb_cross_attention="beam_search",
    top_k_block=32,
    beam_windows_in_slots=True,
)

fori_loop = common.fori_loop
after = common.after
argmax = common.first_argmax
compiled_loop = common.compiled_loop
unless_nonfinite = common.unless_nonfinite
layer_norm = common.layer_norm
gelu = common.gelu
all_finite = common.all_finite
dropout = common.dropout
dropout_attention = common.dropout_attention
when_finite = common.when_finite
decoder_step = common.decoder_step
block_step = common.block_step
stack_forward = common.stack_forward
decoder_forward = common.decoder_forward


def linear(x, kernel, bias):
    # As a 2-D product the weight gradient is one matmul of the rows. On
    # `(B, T, D)` XLA's CPU compiler copied the activation and the output
    # gradient into `(D, B T)` and `(N, B T)` layouts first: in the GPT
    # example's training step those copies took a third of the time
    # (benchmarks/README.md).
    rows = ops.reshape(x, (-1, x.shape[-1]))  # (B T, D)
    output = common.linear(rows, kernel, bias)  # (B T, N)
    return ops.reshape(output, ops.shape(x)[:-1] + (kernel.shape[-1],))  # (B, T, N)


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


# XLA's GPU runtime evaluates a `while` loop's condition on the host: at
# every decoding step the device waits for the host to read it back before
# the next step's kernels are launched. With `WHILE` and `CONDITIONAL` among
# the command buffer types, the loop becomes one CUDA graph whose condition
# is evaluated on the device (conditional graph nodes; XLA drops the two
# types where the CUDA version lacks them). The other types are XLA's
# default ones but `DYNAMIC_SLICE_FUSION` (none in the loops measured). On
# an H200 at the translation example's `gpu` size, greedy decoding 1.09
# times as fast at batch 1 and 1.07 at batch 32, 4 beams at batch 1
# unchanged (benchmarks/README.md).
GPU_DECODING_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
}
# XLA's CPU compiler rewrites every reduction over more than 32 elements
# into a reduce-window and a reduce, two kernels where one would do: a layer
# norm of a decoding step's row becomes six kernels (two for the mean, two
# for the variance) instead of three, the softmax and the argmax twice as
# many. Without the pass, on a 2-core CPU at benchmarks/seq2seq_speed.py's
# size, a step of one row: greedy decoding 1.07 times as fast, sampling
# 1.03 to 1.08. A step of several rows is not faster (greedy at batch 4
# 0.97 to 1.02, 4-beam search 0.94 to 0.98; a product and a norm chained,
# 4 rows 4% and 16 rows 8% slower without the pass), so only one-row loops
# take it. Sums over vocabulary-sized rows are no less precise against
# float64 (benchmarks/README.md).
CPU_DECODING_OPTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}
_JIT_TAKES_OPTIONS = "compiler_options" in inspect.signature(jax.jit).parameters  # JAX 0.4.36+


def decoding_compiler_options(platform, rows=None):
    """XLA options for a decoding loop on `platform` (`jax.default_backend()`)
    whose step computes `rows` rows (None: unknown): `GPU_DECODING_OPTIONS`
    on a GPU, `CPU_DECODING_OPTIONS` on a CPU for one row, where this JAX
    passes options and its XLA knows them; else none."""
    if not _JIT_TAKES_OPTIONS:
        return {}
    if platform == "gpu":
        options = GPU_DECODING_OPTIONS
    elif platform == "cpu" and rows == 1:
        options = CPU_DECODING_OPTIONS
    else:
        return {}
    items = tuple(sorted(options.items()))
    return dict(items) if _accepted(items) else {}


@functools.cache
def _accepted(items):
    """Whether XLA compiles a trivial program with the options `items`: an
    older XLA refuses a command buffer type it does not know, and decoding
    then compiles without them."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(items)).lower(np.zeros(2, "float32")).compile()
    except (RuntimeError, ValueError):  # XLA's runtime error derives from RuntimeError
        return False
    return True


# On a CPU a one-row decoding loop compiles a small model's weights into the
# program as constants once two calls in a row have found the same ones, as
# long as they stay those: a call then passes only its inputs. At
# benchmarks/seq2seq_speed.py's size (91 arrays, 2.3 MB) handing the arrays
# to the compiled call took about 80 us with the caches cold after another
# model's call (a 32-token greedy translation takes about 1.6 ms), and the
# arrays derived from the weights (the transposed output table, the
# concatenated projections) are folded when the program compiles instead of
# made at every call: greedy decoding at batch 1 1.00 to 1.13 times as fast
# in one process (median 1.06 over ten runs). Steps of several rows were
# slower with constant weights (why is not known; greedy at batch 4 0.87
# and 1.00, 4 beams at batch 1 0.89 and 0.97), so they take the weights as
# arguments. Larger weights would be a second copy in memory for a fixed
# cost that matters less beside their products (benchmarks/README.md).
CONSTANT_WEIGHTS_BYTES = 16 * 2**20


def compile_decoding(loop, variables, fast_step=None, rows=None):
    """`jax.jit` of the loop as a pure function of the variables' values,
    with `decoding_compiler_options` for the default platform.

    On a CPU a one-row loop whose weights are at most
    `CONSTANT_WEIGHTS_BYTES` on one device (`_weights_to_embed`) takes them
    as arguments until two calls in a row find the same arrays; it then
    compiles them in as constants, once. A later call that finds other
    weights (assigned, trained, loaded) goes back to the program taking
    them as arguments, for good: a model that changed once changes again.
    So a model sampled between training intervals compiles its loop once,
    and a model that decodes call after call with the same weights twice.
    """
    variables = list(variables)

    def stateless(values, *args):
        mapping = list(zip(variables, values))
        with keras.StatelessScope(state_mapping=mapping):
            # The step is made inside the trace: it reads the weights
            # mapped above.
            return loop(*args, step=None if fast_step is None else fast_step())

    options = decoding_compiler_options(jax.default_backend(), rows)

    def jit(fn):
        return jax.jit(fn, compiler_options=options) if options else jax.jit(fn)

    # `embedded`: the weights compiled in and that program, while they are
    # the variables' values; `may_embed`: whether this loop may still compile
    # them in (None until its first call); `previous`: the identities of the
    # arrays the last call found.
    state = {"embedded": None, "with_arguments": None, "may_embed": None, "previous": None}

    def call(values, args):
        embedded = state["embedded"]
        if embedded is not None:
            weights, program = embedded
            if all(map(operator.is_, weights, values)):
                return program(*args)
            # Other weights: a model that changed once changes again.
            state["embedded"], state["may_embed"] = None, False
        elif state["may_embed"] is None:  # the first call
            state["may_embed"] = rows == 1 and _weights_to_embed(values)
            state["previous"] = tuple(map(id, values))
        elif state["may_embed"]:
            identities = tuple(map(id, values))
            if identities == state["previous"]:  # the same weights twice in a row
                weights = list(values)
                program = jit(functools.partial(stateless, weights))
                state["embedded"] = (weights, program)
                return program(*args)
            state["previous"] = identities
        if state["with_arguments"] is None:
            state["with_arguments"] = jit(stateless)
        return state["with_arguments"](values, *args)

    def function(*args):
        # numpy out (writable copies; `np.array` also waits for the
        # asynchronous dispatch), without the checks of Keras's conversion:
        # in a short translation every step of Python before and after the
        # compiled call runs with cold caches (benchmarks/README.md).
        outputs = call(_values(variables), args)
        if isinstance(outputs, tuple):
            return tuple(np.array(output) for output in outputs)
        return np.array(outputs)

    function.compiled_weights = lambda: state["embedded"] is not None
    return function


def _weights_to_embed(values):
    """Whether a CPU decoding loop compiles `values` in as constants: on a
    CPU, outside a stateless or autocast scope (where they are the stored
    arrays), each on one device (not sharded or replicated by a
    distribution) and `CONSTANT_WEIGHTS_BYTES` at most in all."""
    if jax.default_backend() != "cpu":
        return False
    if in_stateless_scope() or get_autocast_scope() is not None:
        return False
    total = 0
    for value in values:
        if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
            return False
        if len(value.sharding.device_set) != 1:
            return False
        total += value.nbytes
    return total <= CONSTANT_WEIGHTS_BYTES


def _values(variables):
    """The variables' current arrays. Outside a stateless or autocast scope
    (where `generate` runs) `value` is the stored array, read here without
    its per-variable scope lookups: about 0.25 ms a call for the 91
    variables of benchmarks/seq2seq_speed.py's model, 7% of a 32-token
    translation."""
    if in_stateless_scope() or get_autocast_scope() is not None:
        return [v.value for v in variables]
    try:
        return [v._value for v in variables]
    except AttributeError:  # a Keras without the attribute
        return [v.value for v in variables]
