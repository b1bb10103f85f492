"""Speed of MultiHeadAttention against its peers, interleaved in one process.

For each backend (one process per backend, since Keras fixes its backend at
import), each sequence length, causal or not, forward or forward+backward, the
cases run in turn A B C A B C ... and the table reports the median time, the
ratio `peer time / our time` (above 1: ours is faster) and the achieved
GFLOP/s against the float32 matmul rate of the machine, measured in the same
process.

    python benchmarks/mha_speed.py                      # all backends, both paths
    python benchmarks/mha_speed.py --backends torch --lengths 128,512
    python benchmarks/mha_speed.py --path fit           # the fit path alone

Two paths: `kernel`, the layer alone in a step of its own (forward, and
forward+backward with the input's gradient), and `fit`, what users run: one
`train_on_batch` of a compiled functional model around the layer (SGD, mean
squared error, the batch unknown to the model's input), `ours` against
`keras` only.

Cases:
- `ours`: keras_attention.layers.MultiHeadAttention (self-attention);
- `keras`: keras.layers.MultiHeadAttention with the same weights;
- `toggle`: ours with `fuse_projections` switched (one Q/K/V matmul where the
  default is three, three where it is one), to measure what the backend's
  default brings: the column `toggle/ours` above 1 means the default is the
  faster choice;
- on torch, `sdpa`: torch.nn.functional.scaled_dot_product_attention on
  pre-projected heads (the kernel alone, a lower bound), and `torch_mha`:
  torch.nn.MultiheadAttention (batch_first, the same width and heads).

JAX cases are jitted, TensorFlow cases run in a `tf.function` (as `fit` runs
them), torch runs eagerly.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _timing


def _flops(batch, length, width, heads, head_dim):
    projections = 4 * 2 * batch * length * width * width  # q, k, v, output
    attention = 2 * 2 * batch * heads * length * length * head_dim  # QK^T, AV
    return projections + attention


def _make_runner(name, layer, x, causal, backward):
    """A no-argument function that runs one step and blocks until done."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss(trainable, x):
            out, _ = layer.stateless_call(
                trainable, non_trainable, x, x, use_causal_mask=causal
            )
            return jax.numpy.mean(out**2)

        fn = jax.jit(jax.grad(loss, argnums=(0, 1)) if backward else loss)
        return lambda: jax.block_until_ready(fn(trainable, x))
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step(x):
            if not backward:
                return layer(x, x, use_causal_mask=causal)
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x, x, use_causal_mask=causal)
                loss = tf.reduce_mean(out**2)
            return tape.gradient(loss, [x] + layer.trainable_weights)

        return lambda: [t.numpy() for t in tf.nest.flatten(step(x))]
    import torch

    def step():
        if not backward:
            with torch.no_grad():
                return layer(x, x, use_causal_mask=causal)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = layer(x, x, use_causal_mask=causal)
        (out**2).mean().backward()

    return step


def _fit_runner(layer, x, causal):
    """One `train_on_batch` of a compiled functional model around `layer`:
    the path users take (Keras builds and compiles the step: a
    `tf.function`, a `jax.jit`, torch eagerly)."""
    import keras
    import numpy as np

    inputs = keras.Input(tuple(x.shape[1:]))
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=causal))
    model.compile(optimizer="sgd", loss="mse")
    x_np = np.asarray(keras.ops.convert_to_numpy(x))
    y_np = np.zeros_like(x_np)
    return lambda: model.train_on_batch(x_np, y_np)


def _torch_runners(x, heads, causal, backward):
    import torch

    batch, length, width = x.shape
    mha = torch.nn.MultiheadAttention(width, heads, batch_first=True)
    q = torch.randn(batch, heads, length, width // heads, requires_grad=backward)
    mask = (
        torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.bool)
        if causal
        else None
    )
    xt = x.detach().clone().requires_grad_(backward)

    def sdpa():
        if not backward:
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(
                    q, q, q, is_causal=causal
                )
        q.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=causal)
        (out**2).mean().backward()

    def torch_mha():
        if not backward:
            with torch.no_grad():
                return mha(xt, xt, xt, attn_mask=mask, is_causal=causal, need_weights=False)
        mha.zero_grad(set_to_none=True)
        xt.grad = None
        out, _ = mha(xt, xt, xt, attn_mask=mask, is_causal=causal, need_weights=False)
        (out**2).mean().backward()

    return {"sdpa": sdpa, "torch_mha": torch_mha}


def _matmul_rate(repeats):
    """The machine's float32 matmul rate (GFLOP/s) on this backend."""
    import keras
    import numpy as np

    n = 2048
    a = keras.ops.convert_to_tensor(np.random.rand(n, n).astype("float32"))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        keras.ops.convert_to_numpy(keras.ops.matmul(a, a)[:1, :1])
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def worker(args):
    import keras
    import numpy as np

    from keras_attention.layers import MultiHeadAttention

    backend = keras.backend.backend()
    heads, head_dim = args.heads, args.head_dim
    width = heads * head_dim
    rows = []
    peak = _matmul_rate(args.repeats + 2)
    paths = ("kernel", "fit") if args.path == "both" else (args.path,)
    for length in [int(n) for n in args.lengths.split(",")]:
        rng = np.random.default_rng(0)
        x_np = rng.normal(size=(args.batch, length, width)).astype("float32")
        x = keras.ops.convert_to_tensor(x_np)
        if backend == "torch":
            x.requires_grad_(True)
        peer = keras.layers.MultiHeadAttention(heads, head_dim)
        peer.build(x.shape, x.shape)
        ours = MultiHeadAttention.from_keras(peer)
        toggle = MultiHeadAttention.from_keras(peer)
        toggle.fuse_projections = not ours.fuse_projections
        cases = [
            (path, causal, backward)
            for path in paths
            for causal in (False, True)
            for backward in ((True,) if path == "fit" else (False, True))
        ]
        for path, causal, backward in cases:
            if path == "fit":
                # Fresh layers of the same weights: a layer joins one model.
                fit_peer = keras.layers.MultiHeadAttention(heads, head_dim)
                fit_peer.build(x.shape, x.shape)
                fit_peer.set_weights(peer.get_weights())
                runners = {
                    "ours": _fit_runner(MultiHeadAttention.from_keras(fit_peer), x, causal),
                    "keras": _fit_runner(fit_peer, x, causal),
                }
            else:
                runners = {
                    "ours": _make_runner("ours", ours, x, causal, backward),
                    "keras": _make_runner("keras", peer, x, causal, backward),
                    "toggle": _make_runner("toggle", toggle, x, causal, backward),
                }
                if backend == "torch":
                    runners.update(_torch_runners(x, heads, causal, backward))
            calls = _timing.calls_per_sample(runners, args.sample_seconds)
            medians = _timing.interleaved(runners, args.repeats, warmups=0, calls=calls)
            flops = _flops(args.batch, length, width, heads, head_dim)
            flops *= 3 if backward else 1
            rows.append(
                {
                    "backend": backend,
                    "length": length,
                    "causal": causal,
                    "pass": "fit" if path == "fit" else ("fwd+bwd" if backward else "fwd"),
                    "medians_ms": {n: m * 1e3 for n, m in medians.items()},
                    "ratios": {
                        n: m / medians["ours"] for n, m in medians.items() if n != "ours"
                    },
                    "ours_gflops": flops / medians["ours"] / 1e9,
                    "matmul_gflops": peak,
                }
            )
            print(json.dumps(rows[-1]), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--lengths", default="128,512,1024")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--sample-seconds", type=float, default=0.3,
        help="each timed sample repeats a case's call until it lasts about this long",
    )
    parser.add_argument(
        "--path", choices=("kernel", "fit", "both"), default="both",
        help="kernel: the layer alone in a step of its own; fit: a compiled "
        "functional model's train_on_batch",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; received {args.repeats}")
    if not args.sample_seconds > 0:
        parser.error(f"--sample-seconds must be positive; received {args.sample_seconds}")
    if args.worker:
        worker(args)
        return
    print(
        f"self-attention, batch {args.batch}, {args.heads} heads of {args.head_dim}; "
        f"median of {args.repeats} interleaved samples of about {args.sample_seconds:g} s; "
        f"ratio = peer time / our time"
    )
    header = (
        f"{'backend':<11}{'len':>5} {'causal':<7}{'pass':<8}{'ours ms':>9}"
        f"{'keras ms':>10}{'keras/ours':>11}{'toggle/ours':>12}{'sdpa ms':>9}{'mha ms':>9}"
        f"{'torch_mha/ours':>15}{'GFLOP/s':>9}{'matmul':>8}"
    )
    print(header)
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        command = [sys.executable, __file__, "--worker"]
        for flag in ("lengths", "batch", "heads", "head_dim", "repeats", "sample_seconds", "path"):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            m, r = row["medians_ms"], row["ratios"]
            print(
                f"{backend:<11}{row['length']:>5} {str(row['causal']):<7}{row['pass']:<8}"
                f"{m['ours']:>9.1f}{m['keras']:>10.1f}{r['keras']:>11.2f}"
                f"{r.get('toggle', float('nan')):>12.2f}"
                f"{m.get('sdpa', float('nan')):>9.1f}{m.get('torch_mha', float('nan')):>9.1f}"
                f"{r.get('torch_mha', float('nan')):>15.2f}"
                f"{row['ours_gflops']:>9.1f}{row['matmul_gflops']:>8.1f}",
                flush=True,
            )
        if proc.wait() != 0:
            print(f"{backend}: worker failed with exit code {proc.returncode}")


if __name__ == "__main__":
    main()
