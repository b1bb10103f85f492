"""Torch: fused SDPA, projections as `linear`, dropout drawn in torch.

Torch keeps its own fused kernel (`scaled_dot_product_attention`, flash or
memory-efficient on CPU, so no query chunks), called on the heads as views
(`fused_attention`); a projection is one `torch.nn.functional.linear` with
the bias inside the GEMM.

In training, attention with dropout on the weights runs in the same fused
kernel, given `dropout_p` (`dropout_attention`), which Keras's
`ops.dot_product_attention` cannot pass. Dropout masks elsewhere are drawn
as `random_` int32 words compared with a threshold instead of `bernoulli_`
(`dropout`). Both are seeded from the layer's `SeedGenerator` as Keras seeds
its own torch dropout, so seeded runs repeat and resume.

Under `torch.compile` the non-finite guards run their guarded computation
(no data-dependent branch) and values are not read back, so that Dynamo
traces a model's call as one graph; the seeded dropout draws are the one
cut (`torch.Generator` is not traceable, as in Keras's own dropout).

Torch runs a model eagerly: decoding loops run as Python loops without
autograd over the layers' own calls, straight to `call` where Keras's
per-call wrapper would add nothing (`direct_calls`).
"""

import contextlib

import keras
import torch
import torch.nn.functional as F
from keras import ops

from keras_attention.backend import common
from keras_attention.backend.common import Preferences

PREFERENCES = Preferences(linear_projections=True, dropout_kernel=True, direct_calls=True)


def linear(x, kernel, bias):
    kernel = ops.cast(kernel, x.dtype)
    bias = None if bias is None else ops.cast(bias, x.dtype)
    return F.linear(x, kernel.T, bias)


def dense(x, kernel, bias, inputs=1, dtype=None):
    """`common.dense` in torch operations: a view, one `F.linear`, a view."""
    if not isinstance(x, torch.Tensor):
        x = ops.convert_to_tensor(x)
    if dtype is not None and x.dtype != getattr(torch, dtype):
        x = x.to(getattr(torch, dtype))
    kernel = _tensor(kernel).to(x.dtype)
    width = kernel.shape[:inputs].numel()
    leading = x.shape[: x.dim() - inputs]
    weight = kernel.reshape(width, -1).T  # (O, I)
    if bias is not None:
        bias = _tensor(bias).to(x.dtype).reshape(-1)
    output = F.linear(x.reshape(*leading, width), weight, bias)  # (..., O)
    return output.reshape(*leading, *kernel.shape[inputs:])


def cast(x, dtype):
    """`common.cast` with the dtype compared as torch's (Keras's
    `standardize_dtype` costs more than a decoding step's small tensors)."""
    if isinstance(x, torch.Tensor) and x.dtype == getattr(torch, str(dtype), None):
        return x
    return common.cast(x, dtype)


def _tensor(x):
    """`x` itself if a torch tensor, a variable's value, or `x` as a tensor."""
    if isinstance(x, torch.Tensor):
        return x
    return x.value if isinstance(x, keras.Variable) else ops.convert_to_tensor(x)


# The norms call the kernels Keras's layers call, `F.layer_norm` and
# `F.rms_norm`, without the per-call conversions of `keras.ops` around them,
# which cost more than the kernel on a decoding step's row
# (benchmarks/gpt_speed.py). At least float32, as Keras computes them.


def layer_norm(x, gamma, beta, epsilon):
    x, gamma, beta = _norm_operands(x, gamma, beta)
    return F.layer_norm(x, x.shape[-1:], gamma, beta, epsilon)


def rms_norm(x, scale, epsilon):
    x, scale = _norm_operands(x, scale)
    return F.rms_norm(x, x.shape[-1:], scale, epsilon)


def _norm_operands(x, *weights):
    x = _tensor(x)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    return (x,) + tuple(None if w is None else _tensor(w).to(x.dtype) for w in weights)


def gelu(x):
    # Keras's `ops.gelu` on torch is `F.gelu`, one kernel.
    return None


def compiling():
    return torch.compiler.is_compiling()


def unless_nonfinite(output, recompute):
    """A Python `if` eagerly; under `torch.compile` (or on meta tensors,
    where values are unknown) always the recomputation."""
    if compiling() or output.device.type == "meta":
        return recompute()
    finite = torch.isfinite(torch.sum(output.float()))
    return output if bool(finite) else recompute()


def custom_vjp(forward, backward):
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output, residuals = forward(*args)
            ctx.save_for_backward(*residuals)
            return output

        @staticmethod
        def backward(ctx, d_output):
            return tuple(backward(tuple(ctx.saved_tensors), d_output))

    return Function.apply


def all_finite(*tensors):
    """One float32 sum over all the tensors (NaN and inf survive a sum), read
    eagerly; None under `torch.compile` or on meta tensors."""
    tensors = [ops.convert_to_tensor(t) for t in tensors]
    if compiling() or any(t.device.type == "meta" for t in tensors):
        return None
    total = sum(torch.sum(t, dtype=torch.float32) for t in tensors)
    return bool(torch.isfinite(total))


def constant(values, dtype, like):
    return torch.tensor(values, dtype=getattr(torch, dtype), device=_tensor(like).device)


def when_finite(inputs, attempt, recompute):
    # Eager: one branch runs, chosen by the sum `all_finite` reads back.
    # Under `torch.compile` (or on meta tensors) the guarded computation, as
    # in `unless_nonfinite`: `keras.ops.cond` makes a new named operation at
    # every call, on whose name Dynamo recompiled the step until its limit.
    finite = all_finite(*inputs)
    if finite is None:
        return recompute()
    return attempt() if finite else recompute()


@torch.compiler.disable()  # torch.Generator is not traceable (as in Keras)
def _generator(seed, device):
    """A generator seeded as Keras's torch dropout seeds one: from the next
    seed of a `SeedGenerator` (which advances it), from an int, or (None)
    from torch's global generator; None on the meta device."""
    if device.type == "meta":
        return None
    if isinstance(seed, keras.random.SeedGenerator):
        first, second = seed.next().tolist()
    elif seed is None:
        first, second = int(torch.randint(2**31, ())), 0
    else:
        first, second = int(seed), 0
    generator = torch.Generator(device=device)
    generator.manual_seed((int(first) + int(second)) & 0xFFFFFFFF)
    return generator


def _keep_mask(shape, rate, generator, device):
    """Booleans that are True with probability `1 - rate` (to within 2^-32).

    `random_` fills an int32 with 31 uniform random bits, compared with
    `rate * 2^31`: about twice as fast on a CPU as `bernoulli_`, which
    Keras's torch dropout calls (benchmarks/README.md, `bert_speed.py`).
    """
    words = torch.empty(shape, dtype=torch.int32, device=device)
    return words.random_(generator=generator) >= round(rate * 2**31)


def dropout(x, rate, seed):
    x = ops.convert_to_tensor(x)
    if rate == 0:
        return x
    if rate >= 1:
        return torch.zeros_like(x)
    keep = _keep_mask(tuple(x.shape), rate, _generator(seed, x.device), x.device)
    # One multiply forward and one backward: `x * noise`, noise 0 or
    # 1 / (1 - rate) (`keep * scale`: the bool-to-float conversion inside
    # the multiply).
    noise = keep * (1 / (1 - rate))  # float32
    return x * (noise if noise.dtype == x.dtype else noise.to(x.dtype))


def fused_attention(q, k, v, mask, scale, is_causal):
    """Torch's `scaled_dot_product_attention` on the `(B, T, H, K)` heads as
    views, the boolean mask as it is. Keras's `ops.dot_product_attention`
    on torch copies the heads contiguous, turns the mask into additive
    floats and asks for the flash kernel through a `SDPAParams` object at
    every call, which `torch.compile` cannot trace (a graph break at every
    attention layer); torch picks its kernel itself."""
    return _sdpa(q, k, v, mask, scale, is_causal, 0.0)


@torch.compiler.disable()  # the default generator's state is swapped (not traceable)
def dropout_attention(q, k, v, mask, scale, is_causal, rate, seed):
    """Torch's fused `scaled_dot_product_attention` with `dropout_p`: on a
    GPU its flash and memory-efficient kernels take dropout, so the `(T, S)`
    weights never go through memory. The caller (`kernels.fused.attend`)
    keeps the package's rules around it, as for every fused kernel.

    SDPA draws its dropout from the device's default generator and takes no
    `generator=`. So that a seed gives the same noise on every call, as
    `dropout` does, the default generator runs from the state of the
    generator `_generator` seeds from the Keras seed (a `SeedGenerator`
    advances once) and is restored afterwards (`fork_rng`), leaving torch's
    global stream as it was. The backward pass draws nothing: the math
    kernel keeps its dropout mask, flash and memory-efficient keep the
    seed and offset they ran with. Without a seed SDPA draws from the
    global stream, as Keras's unseeded torch dropout does.
    """
    with _seeded_default_generator(seed, _tensor(q).device):
        return _sdpa(q, k, v, mask, scale, is_causal, rate)


def _sdpa(q, k, v, mask, scale, is_causal, rate):
    q, k, v = (_tensor(x) for x in (q, k, v))
    heads, groups = q.shape[2], k.shape[2]
    q = q.transpose(1, 2)  # (B, H, T, K)
    k = k.transpose(1, 2)  # (B, G, S, K)
    v = v.transpose(1, 2)  # (B, G, S, V)
    if groups != heads:
        # Repeated rather than `enable_gqa=True`, which not every SDPA
        # kernel takes.
        k = k.repeat_interleave(heads // groups, dim=1)  # (B, H, S, K)
        v = v.repeat_interleave(heads // groups, dim=1)  # (B, H, S, V)
    if mask is not None:
        mask = _tensor(mask).bool()  # (B|1, H|1, T, S)
    output = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=rate, is_causal=is_causal, scale=scale
    )  # (B, H, T, V)
    return output.transpose(1, 2)  # (B, T, H, V)


@contextlib.contextmanager
def _seeded_default_generator(seed, device):
    """The device's default generator in the state `_generator(seed, device)`
    starts from, for the block; as it was afterwards. Nothing with no seed."""
    if seed is None or device.type == "meta":
        yield
        return
    state = _generator(seed, device).get_state()
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)
        yield


def stateless_uniform(like, seed, step):
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed) * 1_000_003 + int(step))
    noise = torch.rand(tuple(like.shape), generator=generator)
    return noise.clamp_min_(1e-12).to(like.device)


def compile_step(step):
    """One-token steps through `torch.compile` (a prompt, whose length moves
    from call to call, eagerly). The index goes in as a tensor: as a Python
    int Dynamo would compile the step anew for each position. Compiled, the
    layers cannot read the index, so a step attends over the whole cache
    through its mask, as a compiled loop's step on JAX does, and its shapes
    do not change from one step to the next. Torch's own policy for new
    shapes holds: a second batch size or length compiles the step once more
    with that size symbolic, and a graph break (a user's layer that Dynamo
    cannot trace) runs that part eagerly."""
    compiled = torch.compile(step)

    def function(token_ids, caches, index):
        if token_ids.shape[1] != 1:
            return step(token_ids, caches, index)
        return compiled(token_ids, caches, ops.convert_to_tensor(index, "int32"))

    return function


def compile_decoding(loop, variables):
    """The loop run eagerly without autograd, in `torch.inference_mode`.

    Inference mode also skips the view and version tracking that `no_grad`
    keeps: every operation of an eager step costs less, and GPT's and the
    translation model's decoding took less time than under `no_grad`
    (benchmarks/gpt_speed.py, seq2seq_speed.py). The tensors made
    inside cannot enter autograd afterwards; the generation core hands
    numpy arrays back.
    """

    def function(*args):
        with torch.inference_mode():
            return loop(*[ops.convert_to_tensor(a) for a in args])

    return function
