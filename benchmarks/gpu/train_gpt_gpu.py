"""GPU check: the `gpu` preset of examples/gpt_lm in bf16, with tokens/s and MFU.

Trains nanoGPT's GPU configuration (6 layers, 6 heads, width 384, context
256, batch 64, 5000 steps, dropout 0.2) with `--mixed-precision` (and `--jit`
on TensorFlow) on one backend (JAX by default: XLA fuses the most on GPUs), then prints

- the training throughput in tokens/s (the median over evaluation intervals,
  evaluation time excluded),
- the model FLOPs utilization: achieved FLOP/s over the GPU's dense bf16 peak,
  with the FLOPs of a training token estimated as in nanoGPT (PaLM, appendix
  B): `6 N + 12 L D T` (N parameters, L layers, D width, T context),
- which attention kernel ran (this package's table, and the backend's fused
  kernel: flash / cuDNN / memory-efficient),
- the validation loss reached on the whole validation split (nanoGPT: 1.4697).

    python benchmarks/gpu/train_gpt_gpu.py                     # H100/H200 peak
    python benchmarks/gpu/train_gpt_gpu.py --backend torch --peak-tflops 312  # A100
    python benchmarks/gpu/train_gpt_gpu.py --steps 500         # a short check
"""

import argparse
import os
import pathlib
import statistics
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "gpt_lm"

PEAK_H200 = 989.0  # dense bf16 TFLOP/s, no sparsity (benchmarks/gpu/_measure.PEAKS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="jax", choices=["jax", "tensorflow", "torch"])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--peak-tflops", type=float, default=PEAK_H200)
    parser.add_argument("--output-dir", default="gpt_lm_gpu_output")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.path.insert(0, str(EXAMPLE))
    import numpy as np

    import _measure
    import train  # noqa: E402  (after KERAS_BACKEND)

    # `--jit` is XLA on TensorFlow (JAX always compiles); torch runs eagerly
    # with the package's torch fast paths (`torch.compile` is not wired).
    jit = ["--jit"] if args.backend == "tensorflow" else []
    result = train.main(
        [
            "--config", "gpu", "--mixed-precision", *jit, "--fresh",
            "--steps", str(args.steps), "--output-dir", args.output_dir,
        ]
    )
    config = result["config"]
    batch = np.zeros((config.batch_size, config.context_length), "int32")
    tokens_per_second = statistics.median(result["train_tokens_per_second"])
    flops_per_token = 6 * result["parameters"] + 12 * (
        config.num_layers * config.hidden_dim * config.context_length
    )
    mfu = tokens_per_second * flops_per_token / (args.peak_tflops * 1e12)
    print(f"backend: {args.backend}, steps: {args.steps}")
    print(_measure.attention_kernels(result["model"], batch))
    print(f"train tokens/s: {tokens_per_second:,.0f}")
    print(f"MFU: {100 * mfu:.1f}% of {args.peak_tflops:g} TFLOP/s bf16")
    print(f"wall: {result['seconds']:.0f} s")
    print(f"val_loss: {result['val_loss']:.4f}")


if __name__ == "__main__":
    main()
