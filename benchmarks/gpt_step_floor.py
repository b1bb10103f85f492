"""The GPT example's training step against two references, in one process.

`nanogpt_side_by_side.py` times whole runs, one process each. This script
times the training step alone, interleaved in one process, so that a
backend's step can be read against what its arithmetic costs without Keras:

- `nanogpt`: nanoGPT's step in plain PyTorch (`nanogpt_side_by_side.py`'s
  model and AdamW: forward with the loss, backward, `clip_grad_norm_`,
  `step`, `zero_grad`, `loss.item()`);
- `plain_jax`: the same model and update written directly in `jax.numpy`
  and compiled as one `jax.jit` (no Keras): pre-norm blocks without biases,
  one Q/K/V product, `jax.nn.dot_product_attention` with the causal flag,
  the exact GELU, tied logits, cross-entropy, global clipping at 1.0 and
  AdamW with weight decay on matrices. It is the step a JAX user would
  write by hand;
- `plain_jax_einsum`: the same with the attention written out (two einsums,
  the causal mask, softmax), which XLA's CPU code runs faster than its
  `dot_product_attention` here: with `plain_jax`, the floor for a JAX step
  of this arithmetic on this machine;
- `ours`: `examples/gpt_lm/train.py`'s model, optimizer and loss (the `cpu`
  preset) on the chosen Keras backend, through `train_on_batch`.

Sizes: batch 12, context 64, 4 layers, 4 heads, width 128, 65 tokens (the
`cpu` preset and nanoGPT's CPU run). The batches are random tokens, the same
for every run. Medians of `--rounds` rounds of `--steps` steps each, the
runs in turn within a round.

    python benchmarks/gpt_step_floor.py --backend jax     # tensorflow, torch
    python benchmarks/gpt_step_floor.py --backend jax --profile

`--profile` (JAX) times every operation of `--steps` steps instead: nanoGPT's
under `torch.profiler` (each op's own time), ours and the hand-written step
with einsum attention (`plain_jax_einsum`) under `jax.profiler` (each XLA
kernel's time), and prints them grouped into
products (torch's `mm`; XLA's dots, run as `dot` or YNNPACK fusions), fused
attention kernels (torch's), and the rest (elementwise work, reductions,
copies, the optimizer), in ms a step.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

BATCH, CONTEXT, LAYERS, HEADS, WIDTH, VOCABULARY = 12, 64, 4, 4, 128, 65


def nanogpt_step(xs, ys):
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from nanogpt_side_by_side import nanogpt_model, nanogpt_optimizer

    torch.manual_seed(1337)
    model = nanogpt_model(VOCABULARY, CONTEXT, LAYERS, HEADS, WIDTH)
    optimizer = nanogpt_optimizer(model, 1e-3)
    xs = [torch.from_numpy(x.astype("int64")) for x in xs]
    ys = [torch.from_numpy(y.astype("int64")) for y in ys]

    def step(i):
        _, loss = model(xs[i], ys[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def plain_jax_step(xs, ys, attention="xla"):
    """The step in `jax.numpy`; `attention`: "xla" for
    `jax.nn.dot_product_attention`, "einsum" for the arithmetic written out
    (scores, causal mask, softmax, weighted sum)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    head_size = WIDTH // HEADS
    generator = np.random.default_rng(1337)

    def normal(*shape, std=0.02):
        return jnp.asarray(generator.normal(0.0, std, shape), "float32")

    projection_std = 0.02 / np.sqrt(2 * LAYERS)
    params = {
        "token": normal(VOCABULARY, WIDTH),
        "position": normal(CONTEXT, WIDTH),
        "final_norm": jnp.ones(WIDTH),
        "blocks": [
            {
                "norm_1": jnp.ones(WIDTH),
                "qkv": normal(WIDTH, 3 * WIDTH),
                "output": normal(WIDTH, WIDTH, std=projection_std),
                "norm_2": jnp.ones(WIDTH),
                "up": normal(WIDTH, 4 * WIDTH),
                "down": normal(4 * WIDTH, WIDTH, std=projection_std),
            }
            for _ in range(LAYERS)
        ],
    }

    def layer_norm(x, scale):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale

    causal = np.tril(np.ones((CONTEXT, CONTEXT), bool))  # (T, T)

    def loss_of(params, tokens, targets):
        rows = BATCH * CONTEXT
        x = params["token"][tokens] + params["position"][None]  # (B, T, D)
        for block in params["blocks"]:
            qkv = layer_norm(x, block["norm_1"]).reshape(rows, WIDTH) @ block["qkv"]
            q, k, v = (
                t.reshape(BATCH, CONTEXT, HEADS, head_size)
                for t in jnp.split(qkv, 3, axis=-1)
            )
            if attention == "xla":
                attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_size)
                scores = jnp.where(causal, scores, -jnp.inf)
                weights = jax.nn.softmax(scores, axis=-1)
                attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
            x = x + (attended.reshape(rows, WIDTH) @ block["output"]).reshape(x.shape)
            hidden = layer_norm(x, block["norm_2"]).reshape(rows, WIDTH) @ block["up"]
            hidden = jax.nn.gelu(hidden, approximate=False)
            x = x + (hidden @ block["down"]).reshape(x.shape)
        logits = layer_norm(x, params["final_norm"]).reshape(rows, WIDTH) @ params["token"].T
        picked = jnp.take_along_axis(logits, targets.reshape(rows, 1), axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    learning_rate, beta_1, beta_2, epsilon, decay = 1e-3, 0.9, 0.99, 1e-8, 0.1

    def train_step(params, first, second, count, tokens, targets):
        loss, grads = jax.value_and_grad(loss_of)(params, tokens, targets)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)
        count = count + 1
        first = jax.tree.map(lambda m, g: beta_1 * m + (1 - beta_1) * g, first, grads)
        second = jax.tree.map(lambda s, g: beta_2 * s + (1 - beta_2) * g * g, second, grads)

        def update(p, m, s):
            p = p * (1 - learning_rate * decay) if p.ndim >= 2 else p
            m_hat = m / (1 - beta_1**count)
            s_hat = s / (1 - beta_2**count)
            return p - learning_rate * m_hat / (jnp.sqrt(s_hat) + epsilon)

        params = jax.tree.map(update, params, first, second)
        return params, first, second, count, loss

    compiled = jax.jit(train_step, donate_argnums=(0, 1, 2))
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = [params, zeros, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), "float32")]
    xs = [jnp.asarray(x) for x in xs]
    ys = [jnp.asarray(y) for y in ys]

    def step(i):
        *updated, loss = compiled(*state, xs[i], ys[i])
        state[:] = updated
        return float(loss)  # one host read a step, as the others

    return step


def ours_step(xs, ys):
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "examples" / "gpt_lm"))
    import train

    config = train.Config(**train.PRESETS["cpu"])
    model = train.build_model(config, VOCABULARY)
    train.compile_model(model, config)

    def step(i):
        return float(model.train_on_batch(xs[i], ys[i]))

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="jax", choices=("tensorflow", "jax", "torch"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--profile", action="store_true",
                        help="time each operation instead (JAX): products, attention, the rest")
    args = parser.parse_args()
    if args.profile and args.backend != "jax":
        sys.exit("--profile reads XLA's kernels: run it with --backend jax")
    if "keras" in sys.modules:
        sys.exit("run this script in a fresh process")
    os.environ["KERAS_BACKEND"] = args.backend

    import numpy as np

    generator = np.random.default_rng(0)
    shape = (args.steps, BATCH, CONTEXT)
    xs = generator.integers(0, VOCABULARY, shape).astype("int32")
    ys = generator.integers(0, VOCABULARY, shape).astype("int32")
    steps = {
        "nanogpt": nanogpt_step(xs, ys),
        "plain_jax": plain_jax_step(xs, ys),
        "plain_jax_einsum": plain_jax_step(xs, ys, attention="einsum"),
        f"ours_{args.backend}": ours_step(xs, ys),
    }
    for step in steps.values():  # compilation and warm-up
        for i in range(3):
            step(i)
    if args.profile:
        profile(steps, args.steps)
        return
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for i in range(args.steps):
                step(i)
            times[name].append(1e3 * (time.perf_counter() - start) / args.steps)
    reference = statistics.median(times["nanogpt"])
    print(f"{'run':16s} {'ms/step':>8s} {'/ nanogpt':>10s}   rounds")
    for name, values in times.items():
        median = statistics.median(values)
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{name:16s} {median:8.1f} {median / reference:10.2f}   {rounds}")


# Per-operation profiles (`--profile`).

TORCH_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear")


def _torch_ops(step, steps):
    """`{op: ms a step}` of each torch op's own time over `steps` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as recorded:
        for i in range(steps):
            step(i)
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in recorded.key_averages()}


def _xla_ops(step, steps):
    """`{kernel kind: ms a step}` of the XLA kernels over `steps` steps, from
    a perfetto trace (the kernel names with their numbers dropped)."""
    import jax

    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for i in range(steps):
                step(i)
        (path,) = glob.glob(f"{directory}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as file:
            trace = json.load(file)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = collections.Counter()
    for event in events:
        name = event.get("name", "")
        # XLA's kernels are named after their HLO instruction (`dot.3`,
        # `ynn_fusion.12`, `add_multiply_fusion`); the rest is the host's.
        if event.get("ph") != "X" or not re.fullmatch(r"[a-z][a-z0-9_-]*(\.\d+)?", name):
            continue
        kernels[re.sub(r"\.\d+$", "", name)] += event.get("dur", 0) / 1e3 / steps
    return kernels


def _split(times, products, attention=()):
    groups = {"products": 0.0, "attention": 0.0, "rest": 0.0}
    for name, ms in times.items():
        if name in products or name.startswith(("dot", "ynn_fusion")):
            groups["products"] += ms
        elif any(a in name for a in attention):
            groups["attention"] += ms
        else:
            groups["rest"] += ms
    return groups


def profile(steps, count):
    """Prints each step's operations grouped, and the largest of the rest."""
    rows = {"nanogpt": _split(_torch_ops(steps["nanogpt"], count), TORCH_PRODUCTS,
                              attention=("scaled_dot_product",))}
    rests = {}
    for name in ("plain_jax_einsum", "ours_jax"):
        kernels = _xla_ops(steps[name], count)
        rows[name] = _split(kernels, ())
        rests[name] = [
            (kind, ms) for kind, ms in kernels.most_common()
            if not kind.startswith(("dot", "ynn_fusion"))
        ][:8]
    print(f"{'run':16s} {'products':>9s} {'attention':>10s} {'rest':>7s} {'sum':>7s}  (ms a step)")
    for name, groups in rows.items():
        total = sum(groups.values())
        print(f"{name:16s} {groups['products']:9.2f} {groups['attention']:10.2f} "
              f"{groups['rest']:7.2f} {total:7.2f}")
    for name, largest in rests.items():
        print(f"largest of the rest, {name}: "
              + ", ".join(f"{kind} {ms:.2f}" for kind, ms in largest))


if __name__ == "__main__":
    main()
