"""Torch: fused SDPA, projections as `linear`, dropout drawn in torch.

Torch keeps its own fused kernel (`scaled_dot_product_attention`, flash or
memory-efficient on CPU, so no query chunks); a projection is one
`torch.nn.functional.linear` with the bias inside the GEMM.

In training, attention with dropout on the weights runs in
`dropout_attention` (written in torch: the explicit kernel's arithmetic with
fewer operations, its guards only when a key or value is not finite), and
dropout masks are drawn as `random_` int32 words compared with a threshold
instead of `bernoulli_` (`dropout`), seeded from the layer's `SeedGenerator`
as Keras seeds its own torch dropout, so seeded runs repeat and resume.

Torch runs a model eagerly: decoding loops run as Python loops without
autograd over the layers' own calls, straight to `call` where Keras's
per-call wrapper would add nothing (`direct_calls`).
"""


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


def _tensor(x):
    """A variable's value (a torch tensor), or `x` as a tensor."""
    return x.value if isinstance(x, keras.Variable) else ops.convert_to_tensor(x)


def layer_norm(x, gamma, beta, epsilon):
    # Keras's layer on torch already calls `F.layer_norm`, one kernel.
    return None


def gelu(x):
    # Keras's `ops.gelu` on torch is `F.gelu`, one kernel.
    return None


def unless_nonfinite(output, recompute):
    """A Python `if` eagerly; under `torch.compile` (or on meta tensors,
    where values are unknown) always the recomputation."""
    if torch.compiler.is_compiling() or output.device.type == "meta":
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
    if torch.compiler.is_compiling() or any(t.device.type == "meta" for t in tensors):
        return None
    total = sum(torch.sum(t, dtype=torch.float32) for t in tensors)
    return bool(torch.isfinite(total))


def when_finite(inputs, attempt, recompute):
    # Eager: one branch runs, chosen by the sum `all_finite` reads back.
    finite = all_finite(*inputs)
    if finite is None:
        return common.when_finite(inputs, attempt, recompute)
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


def dropout_attention(q, k, v, mask, scale, rate, seed):
    """The explicit kernel's softmax, dropout and sum in torch: one masked
    fill, a softmax in float32 for half precision, one multiply by the
    dropout noise (dropped or masked positions 0: a fully masked row is 0),
    the NaN guards only when a key or value is not finite."""
    q, k, v = (ops.convert_to_tensor(x) for x in (q, k, v))
    heads, groups = q.shape[2], k.shape[2]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q = (q * scale).transpose(1, 2)  # (B, H, T, K)
    k = k.transpose(1, 2)  # (B, G, S, K)
    v = v.transpose(1, 2)  # (B, G, S, V)
    bad = None
    if not all_finite(k, v):
        bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, G, S)
        k = torch.where(bad[..., None], torch.zeros_like(k), k)
        v = torch.where(bad[..., None], torch.zeros_like(v), v)
    if groups != heads:  # query head h reads key/value head h // (H / G)
        k = k.repeat_interleave(heads // groups, dim=1)  # (B, H, S, K)
        v = v.repeat_interleave(heads // groups, dim=1)  # (B, H, S, V)
        bad = None if bad is None else bad.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(work)  # (B, H, T, S)
    if mask is not None:
        # In place: nothing saved for the backward pass reads the scores.
        mask = ops.convert_to_tensor(mask).bool()
        scores.masked_fill_(~mask, -0.5 * torch.finfo(work).max)
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, S)
    keep = _keep_mask(tuple(weights.shape), rate, _generator(seed, q.device), q.device)
    if mask is not None:
        keep = keep & mask
    weights = weights * (keep * (1 / (1 - rate)))
    output = torch.matmul(weights.to(v.dtype), v)  # (B, H, T, V)
    if bad is not None:
        visible = bad[:, :, None, :] if mask is None else mask & bad[:, :, None, :]
        sees_bad = visible.any(dim=-1, keepdim=True)  # (B, H, T, 1)
        output = torch.where(sees_bad, torch.full_like(output, float("nan")), output)
    return output.transpose(1, 2)  # (B, T, H, V)


def stateless_uniform(like, seed, step):
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed) * 1_000_003 + int(step))
    noise = torch.rand(tuple(like.shape), generator=generator)
    return noise.clamp_min_(1e-12).to(like.device)


def compile_decoding(loop, variables):
    """The loop run eagerly without autograd."""

    def function(*args):
        with torch.no_grad():
            return loop(*[ops.convert_to_tensor(a) for a in args])

    return function
