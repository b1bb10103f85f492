"""Peak memory of one long-sequence forward pass or training step, one fresh
process per case.

Each case runs in its own process: build the inputs and the layer (with
`--train`, a compiled functional model), reset the kernel's peak-RSS counter,
run one forward pass (one `train_on_batch`, tracing and compilation
included), and report how far the peak resident memory rose above the
setup. Linux only (reads /proc/self).

    python benchmarks/mha_memory.py                  # all backends, length 8192
    python benchmarks/mha_memory.py --length 4096 --backends jax
    python benchmarks/mha_memory.py --train --causal --length 4096

Forward cases: `ours` (keras_attention MultiHeadAttention), `keras_mha`
(keras.layers.MultiHeadAttention), `keras_ops` (keras.ops.dot_product_attention
on the projected heads), and on torch `torch_sdpa`
(torch.nn.functional.scaled_dot_product_attention).

Training cases (`--train`): `ours`, `ours_plain` (ours with the query chunks
switched off, TensorFlow and JAX: the plain path the chunks replace) and
`keras_mha`, each the only layer of a functional model compiled with SGD and
the mean squared error. Beside the first step's memory, a second step's
(the peak above the memory before it: compiled, warm) and the median time of
`--steps` further steps.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ("ours", "keras_mha", "keras_ops", "torch_sdpa")
TRAIN_CASES = ("ours", "ours_plain", "keras_mha")


def _rss_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_mib("VmRSS")


def train_worker(case, length, batch, heads, head_dim, causal, steps):
    import keras
    import numpy as np

    from keras_attention import backend
    from keras_attention.layers import MultiHeadAttention

    width = heads * head_dim
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, length, width)).astype("float32")
    target = rng.normal(size=(batch, length, width)).astype("float32")
    if case == "ours_plain":
        # The running backend's preferences without the query chunks.
        module = backend.current()
        module.PREFERENCES = dataclasses.replace(
            module.PREFERENCES, chunk_long_queries=False
        )
    if case in ("ours", "ours_plain"):
        layer = MultiHeadAttention(heads, head_dim)
    elif case == "keras_mha":
        layer = keras.layers.MultiHeadAttention(heads, head_dim)
    else:
        raise ValueError(f"unknown case {case!r}")
    inputs = keras.Input((length, width), batch_size=batch)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=causal))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    setup = _reset_peak()
    model.train_on_batch(x, target)
    first = _rss_mib("VmHWM") - setup
    before = _reset_peak()
    model.train_on_batch(x, target)
    warm = _rss_mib("VmHWM") - before
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(x, target)
        times.append(time.perf_counter() - start)
    print(json.dumps({
        "setup_mib": setup, "delta_mib": first, "warm_mib": warm,
        "step_ms": 1000 * statistics.median(times) if times else None,
    }))


def worker(case, length, batch, heads, head_dim, causal):
    import keras
    import numpy as np

    from keras_attention.layers import MultiHeadAttention

    width = heads * head_dim
    rng = np.random.default_rng(0)
    x = keras.ops.convert_to_tensor(
        rng.normal(size=(batch, length, width)).astype("float32")
    )
    if case == "ours":
        layer = MultiHeadAttention(heads, head_dim)
        layer.build(x.shape, x.shape)
        run = lambda: layer(x, x, use_causal_mask=causal)  # noqa: E731
    elif case == "keras_mha":
        layer = keras.layers.MultiHeadAttention(heads, head_dim)
        layer.build(x.shape, x.shape)
        run = lambda: layer(x, x, use_causal_mask=causal)  # noqa: E731
    elif case == "keras_ops":
        q = keras.ops.reshape(x, (batch, length, heads, head_dim))
        run = lambda: keras.ops.dot_product_attention(  # noqa: E731
            q, q, q, is_causal=causal
        )
    elif case == "torch_sdpa":
        import torch

        q = torch.as_tensor(
            rng.normal(size=(batch, heads, length, head_dim)).astype("float32")
        )
        run = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, q, q, is_causal=causal
        )
    else:
        raise ValueError(f"unknown case {case!r}")
    # Reset the peak-RSS counter, so the peak is that of the forward pass.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    setup = _rss_mib("VmRSS")
    out = run()
    _ = keras.ops.convert_to_numpy(out[..., :1]) if case != "torch_sdpa" else out
    peak = _rss_mib("VmHWM")
    print(json.dumps({"setup_mib": setup, "peak_mib": peak, "delta_mib": peak - setup}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--train", action="store_true", help="one training step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (--train)")
    parser.add_argument(
        "--cases", default=None, help="comma-separated cases (default: all)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sizes = (args.length, args.batch, args.heads, args.head_dim, args.causal)
        if args.train:
            train_worker(args.worker, *sizes, args.steps)
        else:
            worker(args.worker, *sizes)
        return
    if args.train:
        _train_table(args)
        return
    print(
        f"forward pass, batch {args.batch}, {args.heads} heads of {args.head_dim}, "
        f"length {args.length}, causal={args.causal}: peak RSS above setup (MiB)"
    )
    print(f"{'backend':<12}{'case':<12}{'delta MiB':>10}{'setup MiB':>11}")
    for backend in args.backends.split(","):
        for case in CASES:
            if case == "torch_sdpa" and backend != "torch":
                continue
            row, error = _run_worker(args, backend, case)
            if row is None:
                print(f"{backend:<12}{case:<12}{'failed':>10}  {error}")
                continue
            print(
                f"{backend:<12}{case:<12}{row['delta_mib']:>10.0f}"
                f"{row['setup_mib']:>11.0f}"
            )


def _run_worker(args, backend, case):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, __file__, "--worker", case]
    for flag in ("length", "batch", "heads", "head_dim", "steps"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.causal:
        command.append("--causal")
    if args.train:
        command.append("--train")
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["?"]
        return None, tail[0][:80]
    return json.loads(result.stdout.strip().splitlines()[-1]), None


def _train_table(args):
    cases = args.cases.split(",") if args.cases else TRAIN_CASES
    print(
        f"train_on_batch, batch {args.batch}, {args.heads} heads of {args.head_dim}, "
        f"length {args.length}, causal={args.causal}: peak RSS above setup (MiB) of "
        f"the first and of a warm step, median step time of {args.steps} (ms), "
        "and its ratio to ours_plain"
    )
    print(
        f"{'backend':<12}{'case':<12}{'first MiB':>10}{'warm MiB':>10}"
        f"{'setup MiB':>11}{'step ms':>10}{'/plain':>8}"
    )
    for backend in args.backends.split(","):
        rows = {}
        for case in cases:
            if case == "ours_plain" and backend == "torch":
                continue  # torch never chunks: its plain path is `ours`
            row, error = _run_worker(args, backend, case)
            if row is None:
                print(f"{backend:<12}{case:<12}{'failed':>10}  {error}", flush=True)
                continue
            rows[case] = row
        plain = rows.get("ours_plain", {}).get("step_ms")
        for case, row in rows.items():
            step = row["step_ms"]
            ratio = f"{step / plain:.2f}" if plain and step else ""
            print(
                f"{backend:<12}{case:<12}{row['delta_mib']:>10.0f}{row['warm_mib']:>10.0f}"
                f"{row['setup_mib']:>11.0f}{step or float('nan'):>10.0f}{ratio:>8}",
                flush=True,
            )


if __name__ == "__main__":
    main()
