"""GPU check: the `gpu` preset of examples/translation in bf16, with tokens/s and MFU.

Trains the base Transformer of the translation example (6 + 6 blocks, 8
heads, width 512, feed-forward 2,048; batches of about 8,192 tokens a side)
with `--mixed-precision` (and `--jit` on TensorFlow) on one backend (JAX by default), scores it
(BLEU, greedy and 4-beam), then times the training step on a batch of the
preset's largest shape and prints

- the training throughput in target tokens/s (the median step on a full
  batch of `max_length`-token pairs; real batches are bucketed and shorter),
- the model FLOPs utilization against the GPU's dense bf16 peak, with the
  FLOPs of a step estimated as `6 N t` (N parameters, t target tokens) plus
  the attention's `12 D (L_enc S^2 + L_dec (T^2 + T S))` per pair (D width,
  S and T the source and target lengths),
- which attention kernel ran (this package's table, and the backend's
  fused kernel: flash / cuDNN / memory-efficient),
- the BLEU reached.

    python benchmarks/gpu/train_translation_gpu.py                  # H100/H200 peak
    python benchmarks/gpu/train_translation_gpu.py --backend torch --peak-tflops 312
    python benchmarks/gpu/train_translation_gpu.py --steps 500      # a short check
    python benchmarks/gpu/train_translation_gpu.py --preset tiny    # seconds, on a CPU
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _measure  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "translation"


def main():
    args, result = _measure.train_example(
        __doc__.splitlines()[0], EXAMPLE, "translation_gpu_output", extra=()
    )
    model, config = result["model"], result["config"]

    x, y, weights, tokens = _measure.translation_batch(config)
    seconds = _measure.step_seconds(model, x, y, weights)
    flops = _measure.translation_flops(model, config)
    print(f"backend: {args.backend}, steps: {config.steps}")
    print(_measure.attention_kernels(model, x))
    for line in _measure.report(tokens / seconds, flops / tokens, args.peak_tflops):
        print(line)
    print(f"training: {result['train_seconds']:.0f} s")
    print(f"greedy bleu: {result['greedy']['bleu']:.2f}")
    print(f"bleu: {result['beam']['bleu']:.2f}")


if __name__ == "__main__":
    main()
