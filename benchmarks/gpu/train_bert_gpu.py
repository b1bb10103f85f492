"""GPU check: the `gpu` preset of examples/bert_mlm in bf16, with tokens/s and MFU.

Pretrains BERT-base's shape (12 blocks, 12 heads, width 768, feed-forward
3,072; 128 tokens a pair, 128 pairs a batch) on the Bible with
`--mixed-precision` (and `--jit` on TensorFlow) on one backend (JAX by default), scores it, then
times the training step on a batch of the preset's shape and prints

- the training throughput in tokens/s (every position of the batch),
- the model FLOPs utilization against the GPU's dense bf16 peak, with the
  FLOPs of a token estimated as `6 N + 12 L D T` (N parameters, L blocks, D
  width, T tokens a pair; the masked-LM head runs on the masked positions
  only, so this slightly overcounts),
- which attention kernel ran (this package's table, and the backend's
  fused kernel: flash / cuDNN / memory-efficient),
- the masked-token accuracy reached on the test books.

    python benchmarks/gpu/train_bert_gpu.py                  # H100/H200 peak
    python benchmarks/gpu/train_bert_gpu.py --backend torch --peak-tflops 312
    python benchmarks/gpu/train_bert_gpu.py --steps 500      # a short check
    python benchmarks/gpu/train_bert_gpu.py --preset tiny    # seconds, on a CPU
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _measure  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "bert_mlm"


def main():
    args, result = _measure.train_example(
        __doc__.splitlines()[0], EXAMPLE, "bert_mlm_gpu_output", extra=("--pretrain-only",)
    )
    model, config = result["model"], result["config"]

    x, y, weights, tokens = _measure.bert_batch(model, config)
    seconds = _measure.step_seconds(model, x, y, weights)
    flops_per_token = _measure.bert_flops_per_token(model, config)
    print(f"backend: {args.backend}, steps: {config.steps}")
    print(_measure.attention_kernels(model, x))
    for line in _measure.report(tokens / seconds, flops_per_token, args.peak_tflops):
        print(line)
    print(f"training: {result['train_seconds']:.0f} s")
    print(f"perplexity: {result['perplexity']:.2f}")
    print(f"masked_accuracy: {result['accuracy']:.4f}")


if __name__ == "__main__":
    main()
