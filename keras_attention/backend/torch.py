"""Torch: fused SDPA, projections as `linear`, and decoding in plain torch.

Torch keeps its own fused kernel (`scaled_dot_product_attention`, flash or
memory-efficient on CPU, so no query chunks); a projection is one
`torch.nn.functional.linear` with the bias inside the GEMM.

In training, attention with dropout on the weights runs in
`dropout_attention` (written in torch: the explicit kernel's arithmetic with
fewer operations, its guards only when a key or value is not finite), and
dropout masks are drawn as `random_` int32 words compared with a threshold
instead of `bernoulli_` (`dropout`), seeded from the layer's `SeedGenerator` as Keras
seeds its own torch dropout, so seeded runs repeat and resume.

On torch a decoding step runs eagerly, and through the Keras layers most of
its time is the layer-call and op-dispatch machinery: for the `cpu` preset
of examples/gpt_lm about 22 ms per token, against about 1.4 ms for the same
arithmetic written in torch. `block_step` and `decoder_step` return that
arithmetic for layers whose configuration is on the allow-lists below (an
option not listed, such as a new feature, sends the model to the layers):
the same weights (gathered when the step is made, once per `generate`
call), the same cache layout (`keras_attention.kv_cache`), the same dtype
rules (kernels cast to the compute dtype, layer norm in float32).

The same holds for a whole sequence in training: a step of that preset's
`fit` spent about 19 ms in the forward pass through the layers against
about 10 ms for the same arithmetic in torch (nanoGPT's forward). An
encoder or decoder stack with padding masks at most and, for a decoder,
cross-attention over an encoder output (`stack_forward`: the translation
model's and BERT's stacks), and a GPT's whole forward pass
(`decoder_forward`), run as torch operations on the layers' weights, which
autograd differentiates as it does the layers' operations, with dropout
drawn from the layers' seed generators; anything else (attention masks,
caches, recording) goes to the layers.

Shape legend: `B` batch, `D` width, `H` query heads, `G` key/value heads,
`K` head size, `S` encoder length, `V` vocabulary size, `L` cache length,
`i` the step's position.
"""

import functools
import weakref

import keras
import torch
import torch._dynamo
import torch.nn.functional as F
from keras import ops

from keras_attention import kv_cache
from keras_attention.backend import allow_lists
from keras_attention.backend import common
from keras_attention.backend.common import Preferences

PREFERENCES = Preferences(linear_projections=True, dropout_kernel=True)

kernel_dtype = common.kernel_dtype
fori_loop = common.fori_loop
after = common.after
argmax = common.argmax
compiled_loop = common.compiled_loop


def linear(x, kernel, bias):
    kernel = ops.cast(kernel, x.dtype)
    bias = None if bias is None else ops.cast(bias, x.dtype)
    return _linear(x, kernel.T, bias)


# Products of at least this many multiply-adds go to oneDNN; below it its
# fixed cost per call (about 20 us) loses to torch's GEMM.
ONEDNN_MIN_WORK = 1 << 22


def _linear(x, weight, bias=None):
    """`F.linear(x, weight, bias)`, through oneDNN where that is faster.

    Torch's float32 GEMM on a CPU is its BLAS (MKL): on the AMD EPYC the
    benchmarks ran on it reached about 160 GFLOP/s, where oneDNN, which torch
    also ships, reached about 330 for the same products (benchmarks/README.md).
    So float32 products on a CPU of at least `ONEDNN_MIN_WORK`
    multiply-adds run through oneDNN's linear, with a backward pass of its
    own (`_OneDNNLinear`); anything else, and torch without oneDNN, takes
    `F.linear`.
    """
    rows = x.shape[:-1].numel()
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.dtype != torch.float32
        or (bias is not None and bias.dtype != torch.float32)
        or rows * weight.shape[0] * weight.shape[1] < ONEDNN_MIN_WORK
        or torch.compiler.is_compiling()
        or _onednn_linear() is None
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # (M, K)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    ):
        output = _OneDNNLinear.apply(flat, weight, bias)
    else:
        output = _onednn_linear()(flat, weight, bias, "none", [], "")
    return output.reshape(x.shape[:-1] + (weight.shape[0],))  # (..., N)


@functools.cache
def _onednn_linear():
    """oneDNN's linear `(x, weight, bias, "none", [], "")`, or None where
    torch lacks it or it disagrees with `F.linear` (checked once)."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        x = torch.linspace(-1.0, 1.0, 96).reshape(8, 12)
        weight = torch.linspace(1.0, -2.0, 60).reshape(5, 12)
        bias = torch.linspace(0.0, 1.0, 5)
        got = op(x, weight.T.contiguous().T, bias, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    return op if torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-6) else None


class _OneDNNLinear(torch.autograd.Function):
    """`x weight^T + bias` for `x` `(M, K)`, `weight` `(N, K)`: oneDNN forward
    and input gradient; the weight gradient `dy^T x` through torch's GEMM,
    which reads both operands transposed in place (oneDNN would need copies)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear()(x, weight, bias, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_output):
        x, weight = ctx.saved_tensors
        d_x = d_weight = d_bias = None
        if ctx.needs_input_grad[0]:
            d_x = _onednn_linear()(d_output, weight.T, None, "none", [], "")  # (M, K)
        if ctx.needs_input_grad[1]:
            d_weight = d_output.T @ x  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            d_bias = d_output.sum(0)
        return d_x, d_weight, d_bias


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


@torch._dynamo.disable()  # torch.Generator is not traceable (as in Keras)
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


def compile_decoding(loop, variables, fast_step=None, rows=None):
    """The loop run eagerly without autograd, on the fast step if any."""

    def function(*args):
        with torch.no_grad():
            args = [ops.convert_to_tensor(a) for a in args]
            step = None if fast_step is None else fast_step()
            return loop(*args, step=step)

    return function


def block_step(block):
    if not allow_lists.block_allowed(block):
        return None
    return _BlockStep(block)


def decoder_step(embedding, blocks, final_norm):
    if not (
        allow_lists.embedding_allowed(embedding)
        and (final_norm is None or allow_lists.plain_norm(final_norm))
    ):
        return None
    steps = [block_step(block) for block in blocks]
    if any(step is None for step in steps):
        return None
    return _DecoderStep(embedding, steps, final_norm)


# Blocks whose options allow the sequence pass (the `get_config()` check
# costs about 0.1 ms a block: made once per block, options are fixed).
_SEQUENCE_OPTIONS_ALLOWED = weakref.WeakKeyDictionary()


def _sequence_allowed(block, training):
    allowed = _SEQUENCE_OPTIONS_ALLOWED.get(block)
    if allowed is None:
        allowed = allow_lists.sequence_options_allowed(block)
        _SEQUENCE_OPTIONS_ALLOWED[block] = allowed
    return (
        allowed
        and allow_lists.weights_plain(block)
        and allow_lists.call_adds_nothing(block)
        and (not training or allow_lists.dropout_drawn_as_the_layers(block))
    )


def stack_forward(
    blocks, x, use_causal_mask, training, padding_mask=None, memory=None, memory_mask=None
):
    """The blocks applied in plain torch (see `backend.stack_forward`).

    Through the layers, a training step of the `cpu` preset of
    examples/gpt_lm spends about 4 ms a block in Keras's layer-call and
    op-dispatch Python, against 2.2 to 2.7 ms for this arithmetic. Autograd
    differentiates it as it would the layers' operations. A non-finite
    output gives None: the layers then apply their rules for NaN and inf
    (which keys reach which queries), which this pass does not compute.

    The masks are the layers': a padded position neither queries (its
    attention output is 0) nor is seen, in self-attention; a padded memory
    position is not seen in cross-attention. A mask of all True is no mask.

    In training, dropout is drawn from the layers' own seed generators with
    the layers' arithmetic (`dropout`, `dropout_attention`), so a seeded
    run draws the masks the layers would. A pass given back for a
    non-finite output has drawn them already: the layers' recomputation
    draws the next ones (seeded runs still repeat).
    """
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return None
    if not blocks or not all(_sequence_allowed(block, training) for block in blocks):
        return None
    if any((allow_lists.cross_attention(b) is None) != (memory is None) for b in blocks):
        return None  # the layers raise: a cross-attention without its memory, or the reverse
    causal = bool(use_causal_mask)
    mask = _padding_attention_mask(padding_mask, causal, padded_queries=True)  # (B, 1, T, T)
    if memory is not None:
        memory = memory.to(_torch_dtype(blocks[0]))
        memory_mask = _padding_attention_mask(memory_mask, False, padded_queries=False)
    for block in blocks:
        x = _BlockStep(block).sequence(
            x.to(_torch_dtype(block)), causal, bool(training), mask, memory, memory_mask
        )
    if not bool(torch.isfinite(x).all()):
        return None
    return x


def _padding_attention_mask(padding_mask, causal, padded_queries):
    """`(B, 1, T, S)` booleans (`(B, 1, 1, S)` without `padded_queries`),
    True where a query sees a key, from a padding mask `(B, S)` (or None):
    padded keys are seen by no query; with `padded_queries` (self-attention)
    a padded query sees nothing, and `causal` adds causality. None when
    nothing is padded (the kernel's causal flag covers causality)."""
    if padding_mask is None:
        return None
    padding_mask = ops.convert_to_tensor(padding_mask).bool()
    if bool(padding_mask.all()):
        return None
    mask = padding_mask[:, None, None, :]  # (B, 1, 1, S)
    if padded_queries:
        mask = mask & padding_mask[:, None, :, None]  # (B, 1, T, S)
        if causal:
            length = mask.shape[-1]
            mask = mask & torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return mask


def decoder_forward(
    embedding, blocks, final_norm, token_ids, training, embedding_dropout=None
):
    """A decoder-only model's logits in plain torch (see
    `backend.decoder_forward`)."""
    if not (
        _embedding_allowed(embedding)
        and (final_norm is None or allow_lists.plain_norm(final_norm))
        and (
            not training
            or embedding_dropout is None
            or allow_lists.own_dropout(embedding_dropout)
        )
    ):
        return None
    dtype = _torch_dtype(embedding)
    token_table = _weight(embedding.token_embedding.embeddings, dtype)  # (V, D)
    position_table = _weight(embedding.position_embedding.embeddings, dtype)  # (L, D)
    token_ids = ops.convert_to_tensor(token_ids)
    if token_ids.device.type == "meta":
        return None
    x = F.embedding(token_ids, token_table) + position_table[: token_ids.shape[1]]
    x = _dropped(x, embedding_dropout, training)
    x = stack_forward(blocks, x, True, training)  # (B, T, D)
    if x is None:
        return None
    if final_norm is not None:
        x = _layer_norm(x, _norm_weights(final_norm))
    return torch.matmul(x, token_table.T)  # (B, T, V)


def _embedding_allowed(embedding):
    allowed = _SEQUENCE_OPTIONS_ALLOWED.get(embedding)
    if allowed is None:
        allowed = allow_lists.embedding_allowed(embedding) and not embedding.mask_zero
        _SEQUENCE_OPTIONS_ALLOWED[embedding] = allowed
    return allowed and allow_lists.plain(embedding.token_embedding)


def _dropped(x, layer, training):
    """What the package's `Dropout` layer (or None) gives."""
    if not training or layer is None or layer.rate == 0:
        return x
    return dropout(x, layer.rate, layer.seed_generator)


def _torch_dtype(layer):
    return getattr(torch, keras.backend.standardize_dtype(layer.compute_dtype))


def _weight(variable, dtype):
    return None if variable is None else variable.value.to(dtype)


class _AttentionWeights:
    """One attention layer's weights as `linear` operands."""

    def __init__(self, attention, dtype, fuse_qkv):
        denses = (attention.query_dense, attention.key_dense, attention.value_dense)
        width = attention.query_dense.kernel.shape[0]
        matrices = [_weight(d.kernel, dtype).reshape(d.kernel.shape[0], -1) for d in denses]
        biases = [_weight(d.bias, dtype) for d in denses]
        biases = [None if b is None else b.reshape(-1) for b in biases]
        self.splits = [m.shape[1] for m in matrices]
        if fuse_qkv:
            # One (3 widths, D) weight: a single GEMM gives q, k and v (the
            # only copy; the other kernels are used through transposed views).
            self.qkv = (
                torch.cat(matrices, dim=1).T,
                None if biases[0] is None else torch.cat(biases),
            )
        self.query = (matrices[0].T, biases[0])
        self._key_value_parts = (matrices[1:], biases[1:])
        output = attention.output_dense
        self.output = (
            _weight(output.kernel, dtype).reshape(-1, output.kernel.shape[-1]).T,
            _weight(output.bias, dtype),
        )
        self.heads = attention.num_heads
        self.kv_heads = attention.num_key_value_heads or attention.num_heads
        self.groups = self.heads // self.kv_heads
        self.head_size = attention.key_dim
        self.scale = attention.score.dot_product_scale(attention.key_dim)
        self.width = width

    def attend_sequence(self, h, causal, dropout_rate=0.0, seed=None, mask=None):
        """Self-attention of a whole `h` `(B, T, D)` -> `(B, T, D)`: causal
        or not, `mask` (None or boolean `(B, 1, T, T)`, causality included)
        the positions each query sees, with dropout on the weights at
        `dropout_rate` (drawn from `seed`)."""
        q, k, v = torch.split(_linear(h, *self.qkv), self.splits, dim=-1)
        return self._attend_heads(q, k, v, causal, mask, dropout_rate, seed)

    def attend_memory(self, h, memory, mask=None, dropout_rate=0.0, seed=None):
        """Cross-attention of `h` `(B, T, D)` over `memory` `(B, S, D)` ->
        `(B, T, D)`, `mask` (None or boolean `(B, 1, 1, S)`) the memory
        positions every query sees."""
        k, v = torch.split(_linear(memory, *self.key_value), self.splits[1:], dim=-1)
        q = _linear(h, *self.query)
        return self._attend_heads(q, k, v, False, mask, dropout_rate, seed)

    @functools.cached_property
    def key_value(self):
        """One `(2 widths, D)` weight for a memory's keys and values, and its
        bias: made when first read (decoding reads the cross caches)."""
        kernels, biases = self._key_value_parts
        return (
            torch.cat(kernels, dim=1).T,
            None if biases[0] is None else torch.cat(biases),
        )

    def _attend_heads(self, q, k, v, causal, mask, dropout_rate, seed):
        """Projected `q` `(B, T, H K)`, `k`, `v` `(B, S, G K)` -> the output
        projection of their attention `(B, T, D)`, with the layers' rules:
        a query that sees no key outputs 0 before the output projection."""
        batch, length, memory = q.shape[0], q.shape[1], k.shape[1]
        q = q.view(batch, length, self.heads, -1)
        k = k.view(batch, memory, self.kv_heads, -1)
        v = v.view(batch, memory, self.kv_heads, -1)
        if dropout_rate > 0:
            # The layers' kernel for attention dropout, with their mask.
            if mask is None and causal:
                mask = torch.ones(length, memory, dtype=torch.bool, device=q.device).tril()
                mask = mask[None, None]  # (1, 1, T, S)
            attended = dropout_attention(q, k, v, mask, self.scale, dropout_rate, seed)
            return _linear(attended.reshape(batch, length, -1), *self.output)  # (B, T, H K)
        q = q.transpose(1, 2)  # (B, H, T, K)
        k = k.transpose(1, 2)  # (B, G, S, K)
        v = v.transpose(1, 2)  # (B, G, S, K)
        if self.groups > 1:  # query head h reads key/value head h // groups
            k = k.repeat_interleave(self.groups, dim=1)  # (B, H, S, K)
            v = v.repeat_interleave(self.groups, dim=1)
        if mask is None:
            attended = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=self.scale
            )  # (B, H, T, K)
        else:
            has_key = mask.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask | ~has_key, scale=self.scale
            )
            attended = torch.where(has_key, attended, torch.zeros_like(attended))
        attended = attended.transpose(1, 2).reshape(batch, length, -1)  # (B, T, H K)
        return _linear(attended, *self.output)

    def attend(self, q, keys, values, mask=None):
        """`q` `(B, 1, H K)`, keys and values `(B, n, G, K)` -> `(B, 1, D)`."""
        batch = q.shape[0]
        q = q.reshape(batch, 1, self.heads, self.head_size).transpose(1, 2)  # (B, H, 1, K)
        keys = keys.transpose(1, 2)  # (B, G, n, K)
        values = values.transpose(1, 2)  # (B, G, n, K)
        if self.groups > 1:  # query head h reads key/value head h // groups
            keys = keys.repeat_interleave(self.groups, dim=1)  # (B, H, n, K)
            values = values.repeat_interleave(self.groups, dim=1)
        attended = _guarded_sdpa(q, keys, values, mask, self.scale)  # (B, H, 1, K)
        attended = attended.transpose(1, 2).reshape(batch, 1, -1)  # (B, 1, H K)
        return _linear(attended, *self.output)


def _guarded_sdpa(q, keys, values, mask, scale):
    """SDPA with the package's rules: a query that sees no key outputs 0, and
    a non-finite key or value reaches only the queries that see it."""
    if mask is None:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale)
    allowed = mask[:, None, None, :]  # (B, 1, 1, n)
    has_key = allowed.any(dim=-1, keepdim=True)  # (B, 1, 1, 1)
    kernel_mask = allowed | ~has_key
    output = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=kernel_mask, scale=scale
    )
    output = torch.where(has_key, output, torch.zeros_like(output))
    if bool(torch.isfinite(output).all()):
        return output
    bad = ~(torch.isfinite(keys).all(-1) & torch.isfinite(values).all(-1))  # (B, H, n)
    keys = torch.where(bad[..., None], torch.zeros_like(keys), keys)
    values = torch.where(bad[..., None], torch.zeros_like(values), values)
    output = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=kernel_mask, scale=scale
    )
    output = torch.where(has_key, output, torch.zeros_like(output))
    sees_bad = (bad[:, :, None, :] & allowed).any(-1, keepdim=True)  # (B, H, 1, 1)
    return torch.where(sees_bad, torch.full_like(output, float("nan")), output)


class _BlockStep:
    """One decoder block's cached step: weights gathered when made."""

    def __init__(self, block):
        dtype = _torch_dtype(block)
        self.block = block
        self.normalize_first = block.normalize_first
        self.self_attention = _AttentionWeights(block.self_attention, dtype, True)
        self.norm1 = _norm_weights(block.self_attention_layer_norm)
        self.cross_attention = None
        if allow_lists.cross_attention(block) is not None:
            self.cross_attention = _AttentionWeights(block.cross_attention, dtype, False)
            self.norm_cross = _norm_weights(block.cross_attention_layer_norm)
        feedforward = block.feedforward
        self.intermediate = (
            _weight(feedforward.intermediate_dense.kernel, dtype).T,
            _weight(feedforward.intermediate_dense.bias, dtype),
        )
        self.activation = feedforward.activation
        self.feedforward_output = (
            _weight(feedforward.output_dense.kernel, dtype).T,
            _weight(feedforward.output_dense.bias, dtype),
        )
        self.norm2 = _norm_weights(block.feedforward_layer_norm)

    def _sublayer(self, x, norm, fn):
        if self.normalize_first:
            return x + fn(_layer_norm(x, norm))
        return _layer_norm(x + fn(x), norm)

    def __call__(self, x, self_cache, index, cross_cache=None, cross_mask=None):
        i = int(index)
        attention = self.self_attention
        if not self_cache.is_contiguous():
            # The step writes in place: a broadcast view (repeated beams)
            # would share memory between rows.
            self_cache = self_cache.contiguous()

        def self_attend(h):
            q, k, v = torch.split(_linear(h, *attention.qkv), attention.splits, dim=-1)
            batch = h.shape[0]
            shape = (batch, attention.kv_heads, attention.head_size)
            self_cache[:, kv_cache.KEYS, i] = k.reshape(shape)  # (B, G, K)
            self_cache[:, kv_cache.VALUES, i] = v.reshape(shape)  # (B, G, K)
            keys = self_cache[:, kv_cache.KEYS, : i + 1]  # (B, i + 1, G, K)
            values = self_cache[:, kv_cache.VALUES, : i + 1]
            return attention.attend(q, keys, values)

        x = self._sublayer(x, self.norm1, self_attend)
        if self.cross_attention is not None:
            cross = self.cross_attention

            def cross_attend(h):
                q = _linear(h, *cross.query)  # (B, 1, H K)
                keys = cross_cache[:, kv_cache.KEYS]  # (B, S, G, K)
                values = cross_cache[:, kv_cache.VALUES]
                mask = None if cross_mask is None else cross_mask.bool()  # (B, S)
                return cross.attend(q, keys, values, mask)

            x = self._sublayer(x, self.norm_cross, cross_attend)

        def feedforward(h):
            h = self.activation(_linear(h, *self.intermediate))
            return _linear(h, *self.feedforward_output)

        x = self._sublayer(x, self.norm2, feedforward)
        return x, self_cache

    def sequence(self, x, causal, training=False, mask=None, memory=None, memory_mask=None):
        """The block on a whole sequence `x` `(B, T, D)`: self-attention
        (causal or not; `mask`, None or `(B, 1, T, T)`, the positions each
        query sees, causality included), cross-attention over `memory`
        `(B, S, D)` if given (`memory_mask`, None or `(B, 1, 1, S)`), and
        the feedforward, no cache; in training, the layers' dropout drawn
        from their seed generators."""
        block = self.block

        def self_attend(h):
            attention = block.self_attention
            h = self.self_attention.attend_sequence(
                h, causal, attention.dropout if training else 0.0,
                attention.seed_generator, mask,
            )
            return _dropped(h, block.self_attention_residual_dropout, training)

        def cross_attend(h):
            attention = block.cross_attention
            h = self.cross_attention.attend_memory(
                h, memory, memory_mask, attention.dropout if training else 0.0,
                attention.seed_generator,
            )
            return _dropped(h, block.cross_attention_residual_dropout, training)

        def feedforward(h):
            h = self.activation(_linear(h, *self.intermediate))
            h = _dropped(h, block.feedforward.dropout_layer, training)
            h = _linear(h, *self.feedforward_output)
            return _dropped(h, block.feedforward_residual_dropout, training)

        x = self._sublayer(x, self.norm1, self_attend)
        if memory is not None:
            x = self._sublayer(x, self.norm_cross, cross_attend)
        return self._sublayer(x, self.norm2, feedforward)


class _DecoderStep:
    """A decoder-only model's step: embedding, blocks, norm, tied logits."""

    def __init__(self, embedding, steps, final_norm):
        dtype = _torch_dtype(embedding)
        self.token_table = _weight(embedding.token_embedding.embeddings, dtype)  # (V, D)
        self.position_table = _weight(
            embedding.position_embedding.embeddings, dtype
        )  # (L, D)
        self.steps = steps
        self.final_norm = None if final_norm is None else _norm_weights(final_norm)

    def __call__(self, token_ids, caches, index):
        i = int(index)
        x = F.embedding(token_ids, self.token_table) + self.position_table[i]  # (B, 1, D)
        updated = []
        for step, cache in zip(self.steps, caches):
            x, cache = step(x, cache, i)
            updated.append(cache)
        if self.final_norm is not None:
            x = _layer_norm(x, self.final_norm)
        return torch.matmul(x, self.token_table.T), tuple(updated)  # (B, 1, V)


def _norm_weights(norm):
    gamma = None if norm.gamma is None else norm.gamma.value.float()
    beta = None if norm.beta is None else norm.beta.value.float()
    return gamma, beta, norm.epsilon


def _layer_norm(x, weights):
    """Keras's `LayerNormalization`: computed in float32, returned in `x`'s dtype."""
    gamma, beta, epsilon = weights
    output = F.layer_norm(x.float(), (x.shape[-1],), gamma, beta, epsilon)
    return output.to(x.dtype)
