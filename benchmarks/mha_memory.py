"""Peak memory of one long-sequence forward pass, one fresh process per case.

Each case runs in its own process: build the inputs and the layer, reset the
kernel's peak-RSS counter, run one forward pass, and report how far the peak
resident memory rose above the setup. Linux only (reads /proc/self).

    python benchmarks/mha_memory.py                  # all backends, length 8192
    python benchmarks/mha_memory.py --length 4096 --backends jax

Cases: `ours` (keras_attention MultiHeadAttention), `keras_mha`
(keras.layers.MultiHeadAttention), `keras_ops` (keras.ops.dot_product_attention
on the projected heads), and on torch `torch_sdpa`
(torch.nn.functional.scaled_dot_product_attention).
"""

import argparse
import json
import os
import subprocess
import sys

CASES = ("ours", "keras_mha", "keras_ops", "torch_sdpa")


def _rss_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.length, args.batch, args.heads, args.head_dim, args.causal)
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
            env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
            command = [sys.executable, __file__, "--worker", case]
            for flag in ("length", "batch", "heads", "head_dim"):
                command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            if args.causal:
                command.append("--causal")
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                tail = result.stderr.strip().splitlines()[-1:] or ["?"]
                print(f"{backend:<12}{case:<12}{'failed':>10}  {tail[0][:80]}")
                continue
            row = json.loads(result.stdout.strip().splitlines()[-1])
            print(
                f"{backend:<12}{case:<12}{row['delta_mib']:>10.0f}"
                f"{row['setup_mib']:>11.0f}"
            )


if __name__ == "__main__":
    main()
