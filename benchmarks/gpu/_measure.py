"""What the GPU scripts measure besides the example's own metric.

- `train_example`: the options the scripts share, and the example's
  `train.main` run on its preset in bfloat16.
- `PEAKS`: dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from the
  vendors' data sheets, for the MFU.
- `step_seconds`: the median time of one compiled training step on a fixed
  batch (`train_on_batch`, synchronised by reading the loss back).
- `attention_kernels`: which kernel the attention layers take, in this
  package's table (`keras_attention.kernels.tracing`: fused, blocked,
  chunked, explicit) and, for the fused rows, the kernel the backend
  launches: on torch the scaled-dot-product kernels a profiled step runs
  (flash, memory-efficient, cuDNN or the math fallback); on JAX whether the
  compiled step calls cuDNN's fused attention; TensorFlow's fused kernel is
  XLA's.
"""

import argparse
import collections
import os
import statistics
import sys
import time

PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


def train_example(description, example, output_dir, extra=()):
    """Parses the command line (`--backend`, `--steps`, `--preset`,
    `--peak-tflops`, `--output-dir`), selects the backend, then runs
    `train.main` of the example folder `example` on the preset in bfloat16
    with `extra` options; returns `(args, the result train.main returns)`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", default="jax", choices=["jax", "tensorflow", "torch"])
    parser.add_argument("--steps", type=int, help="default: the preset's")
    parser.add_argument("--preset", default="gpu", choices=["gpu", "tiny"])
    parser.add_argument("--peak-tflops", type=float, default=PEAKS["H200"], help="H100/H200 bf16")
    parser.add_argument("--output-dir", default=output_dir)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    sys.path.insert(0, str(example))
    import train  # noqa: E402  (after KERAS_BACKEND)

    argv = ["--tiny"] if args.preset == "tiny" else ["--config", "gpu"]
    # `--jit` is XLA on TensorFlow (JAX always compiles); torch runs eagerly
    # with the package's torch fast paths (`torch.compile` is not wired).
    argv += ["--jit"] if args.backend == "tensorflow" else []
    argv += ["--mixed-precision", "--fresh", "--output-dir", args.output_dir, *extra]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    return args, train.main(argv)


def step_seconds(model, x, y, sample_weight=None, steps=20, warmup=3):
    """The median seconds of one `train_on_batch` over `steps` steps."""
    import keras

    for _ in range(warmup):
        model.train_on_batch(x, y, sample_weight=sample_weight)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logs = model.train_on_batch(x, y, sample_weight=sample_weight)
        float(keras.ops.convert_to_numpy(keras.tree.flatten(logs)[0]))  # waits for it
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def translation_batch(config):
    """A full-length batch of the translation preset `config` on random ids:
    `(x, labels, weights, tokens)`, `tokens` the target positions."""
    import numpy as np

    length = config.max_length
    rows = max(config.batch_tokens // length, 1)
    ids = np.random.default_rng(0).integers(4, 100, (rows, length + 1)).astype("int32")
    x = {"encoder_token_ids": ids[:, 1:], "decoder_token_ids": ids[:, :-1]}
    return x, ids[:, 1:], np.ones((rows, length), "float32"), rows * length


def translation_flops(model, config):
    """The FLOPs of a training step on `translation_batch(config)`: `6 N` per
    target position, and `12 D` per score of every attention (encoder self,
    decoder self and cross)."""
    length = config.max_length
    rows = max(config.batch_tokens // length, 1)
    blocks = config.num_encoder_layers * length**2 + config.num_decoder_layers * 2 * length**2
    return 6 * model.count_params() * rows * length + 12 * config.hidden_dim * blocks * rows


def bert_batch(model, config):
    """A full batch of the BERT preset `config` on random ids: `(x,
    mask_ids, mask_weights, tokens)`."""
    import numpy as np

    rows, length, masks = config.batch_size, config.sequence_length, config.mask_selection_length
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(5, model.vocabulary_size, (rows, length)).astype("int32"),
        "segment_ids": np.repeat([[0] * (length // 2) + [1] * (length - length // 2)], rows, 0),
        "padding_mask": np.ones((rows, length), bool),
        "mask_positions": np.sort(rng.permuted(np.tile(np.arange(length), (rows, 1)), axis=1)
                                  [:, :masks], axis=1).astype("int32"),
    }
    y = np.take_along_axis(x["token_ids"], x["mask_positions"], axis=1)
    return x, y, np.ones((rows, masks), "float32"), rows * length


def bert_flops_per_token(model, config):
    """`6 N + 12 L D T`, as nanoGPT counts a token."""
    return 6 * model.count_params() + 12 * (
        config.num_layers * config.hidden_dim * config.sequence_length
    )


def attention_kernels(model, x):
    """A line naming the kernels the attention layers of `model` take on `x`.

    One training-mode forward pass both records this package's choices
    (`kernels.tracing`) and shows what the backend launches: torch's runs
    under the profiler, JAX's is the trace of the compiled program (an eager
    JAX pass would compile every operation on its own, for nothing).
    """
    import keras

    from keras_attention import kernels

    backend = keras.backend.backend()
    with kernels.tracing() as taken:
        if backend == "torch":
            launched = "torch launches: " + (_torch_kernels(model, x) or "no attention kernel seen")
        elif backend == "jax":
            launched = "JAX compiled step: " + _jax_kernels(model, x)
        else:
            model(x, training=True)
            launched = "TensorFlow: XLA's fused kernel where ours is fused"
    ours = collections.Counter(choice.kernel for _, choice in taken)
    return "attention kernels (ours): " + ", ".join(
        f"{kernel} x{count}" for kernel, count in sorted(ours.items())
    ) + "; " + launched


def _torch_kernels(model, x):
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as profiler:
        model(x, training=True)
        if gpu:
            torch.cuda.synchronize()
    names = {event.key for event in profiler.key_averages()}
    found = []
    for label, marks in (
        ("flash", ("flash",)),
        ("memory-efficient", ("efficient_attention", "fmha_cutlass", "mem_eff")),
        ("cuDNN", ("cudnn_attention", "cudnn_sdpa", "cudnn::fmha")),
        ("math fallback", ("_scaled_dot_product_attention_math",)),
    ):
        if any(any(mark in name.lower() for mark in marks) for name in names):
            found.append(label)
    return ", ".join(found)


def _jax_kernels(model, x):
    import jax

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def forward(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x, training=True)[0]

    text = jax.jit(forward).lower(trainable, non_trainable, x).compile().as_text()
    if "cudnn$fmha" in text or "__cudnn$fmha" in text:
        return "cuDNN fused attention"
    return "no cuDNN attention call (XLA's kernels)"


def report(tokens_per_second, flops_per_token, peak_tflops):
    """The lines the scripts print: tokens/s and the MFU."""
    mfu = tokens_per_second * flops_per_token / (peak_tflops * 1e12)
    return [
        f"train tokens/s: {tokens_per_second:,.0f}",
        f"MFU: {100 * mfu:.1f}% of {peak_tflops:g} TFLOP/s bf16",
    ]
