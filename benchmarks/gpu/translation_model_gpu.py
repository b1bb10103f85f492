"""GPU check of the translation model alone: bf16 training, MFU, kernels, decoding.

The `gpu` preset's Transformer of examples/translation (6 + 6 blocks, 8
heads, width 512, feed-forward 2,048, vocabularies of 8,000) under
`mixed_bfloat16`, on random token ids, on one backend:

- training: target tokens/s of the example's compiled step (its model, Adam
  on the warm-up schedule and label-smoothed loss) on a batch of the preset's
  largest shape (`batch_tokens // max_length` pairs of `max_length` tokens),
  and the model FLOPs utilization against the GPU's dense bf16 peak, the
  FLOPs estimated as train_translation_gpu.py does;
- which attention kernel ran (this package's table, and the backend's fused
  kernel);
- decoding: milliseconds per generated token of `Seq2SeqTransformer.generate`
  against `keras_hub.models.BartSeq2SeqLM.generate` of the same sizes with the
  same weights (`from_keras_hub`; BART is what KerasHub has of a translation
  model), greedy and 4 beams, at each batch size of `--batches`, alternating
  A B A B as seq2seq_speed.py does, with the marginal milliseconds per token
  (each call also timed with one new token in the same rounds) and whether
  the tokens agree.

It needs neither TensorFlow nor the example's data, as the example does (its
`tf.data` pipeline and WordPiece tokenizer), so it runs where only JAX or
torch is installed; train_translation_gpu.py trains the example itself.

    python benchmarks/gpu/translation_model_gpu.py --backend jax
    python benchmarks/gpu/translation_model_gpu.py --backend torch --batches 1,32
    python benchmarks/gpu/translation_model_gpu.py --preset tiny   # seconds, on a CPU
"""

import argparse
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "translation"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="jax", choices=("jax", "tensorflow", "torch"))
    parser.add_argument("--preset", default="gpu", choices=("gpu", "tiny"))
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the GPU's dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps")
    parser.add_argument("--batches", default="1,32", help="decoding batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="decoding rounds")
    parser.add_argument("--no-keras-hub", action="store_true",
                        help="time our decoding alone")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    # The marginal time per token is the difference from a one-token call.
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2. Received: --new-tokens {args.new_tokens}")
    return args


def main(argv=None):
    args = parse_args(argv)
    # The example's module reads `--backend` before Keras loads.
    sys.argv = [sys.argv[0], "--backend", args.backend]
    sys.path[:0] = [str(HERE), str(HERE.parent), str(EXAMPLE)]
    import train  # noqa: E402  (sets KERAS_BACKEND)

    import _measure  # noqa: E402
    import keras  # noqa: E402

    keras.config.set_dtype_policy("mixed_bfloat16")
    config = train.Config(**train.PRESETS[args.preset])
    results = {"backend": args.backend, "preset": args.preset, "device": _device()}
    if args.backend == "jax":  # what XLA compiles the decoding loops with
        import jax

        from keras_attention.backend import jax as jax_backend

        platform = jax.default_backend()
        results["decoding_xla_options"] = {
            "one_row": jax_backend.decoding_compiler_options(platform, rows=1),
            "several_rows": jax_backend.decoding_compiler_options(platform, rows=2),
        }
    print(json.dumps(results), flush=True)
    results["train"] = training(train, _measure, config, args)
    print(json.dumps(results["train"]), flush=True)
    results["decode"] = []
    for row in decoding(config, args):
        print(json.dumps(row), flush=True)
        results["decode"].append(row)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


def _device():
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return str(jax.devices()[0].device_kind)
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return gpus[0].name if gpus else "cpu"


class _Vocabularies:
    """What `train.build_model` reads of a tokenizer."""

    def __init__(self, size):
        self.source_vocabulary_size = self.target_vocabulary_size = size


def training(train, _measure, config, args):
    model = train.build_model(config, _Vocabularies(config.vocabulary_size))
    train.compile_model(model, config)
    length = config.max_length
    rows = max(config.batch_tokens // length, 1)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, config.vocabulary_size, (rows, length + 1)).astype("int32")
    x = {"encoder_token_ids": ids[:, 1:], "decoder_token_ids": ids[:, :-1]}
    weights = np.ones((rows, length), "float32")
    seconds = _measure.step_seconds(model, x, ids[:, 1:], weights, steps=args.steps)
    blocks = config.num_encoder_layers * length**2 + config.num_decoder_layers * 2 * length**2
    flops = 6 * model.count_params() * rows * length + 12 * config.hidden_dim * blocks * rows
    tokens_per_second = rows * length / seconds
    return {
        "kind": "train",
        "batch": [rows, length],
        "step_ms": 1e3 * seconds,
        "tokens_per_second": tokens_per_second,
        "mfu": tokens_per_second * flops / (rows * length) / (args.peak_tflops * 1e12),
        "kernels": _measure.attention_kernels(model, x),
    }


def decoding(config, args):
    """One row per (sampling, batch): ms per token, ours against KerasHub's."""
    import keras_hub
    from seq2seq_speed import _interleaved
    from seq2seq_speed import bart_runner
    from seq2seq_speed import marginal_seconds
    from seq2seq_speed import our_runner

    from keras_attention.models import Seq2SeqTransformer

    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=config.vocabulary_size, num_layers=config.num_decoder_layers,
        num_heads=config.num_heads, hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim, dropout=0.0,
        max_sequence_length=config.max_length,
    )
    ours = Seq2SeqTransformer.from_keras_hub(backbone)
    samplers = {
        "greedy": keras_hub.samplers.GreedySampler,
        "beam": lambda: keras_hub.samplers.BeamSampler(num_beams=4),
    }
    rng = np.random.default_rng(1)
    new, short = min(args.new_tokens, config.max_length - 1), 1
    source_length = config.max_length // 2
    for batch in [int(b) for b in args.batches.split(",")]:
        source = rng.integers(3, config.vocabulary_size, (batch, source_length)).astype("int32")
        source_mask = np.ones_like(source, bool)
        for sampling, sampler in samplers.items():
            outputs = {}

            runners = {
                name: our_runner(ours, source, source_mask, length, sampling, outputs, name)
                for name, length in (("ours", new), ("ours_short", short))
            }
            if not args.no_keras_hub:
                bart = keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
                bart.compile(sampler=sampler())
                for name, length in (("keras_hub", new), ("keras_hub_short", short)):
                    runners[name] = bart_runner(bart, source, source_mask, length, outputs, name)
            medians, times = _interleaved(runners, args.repeats, rounds=True)
            names = [n for n in ("ours", "keras_hub") if n in runners]
            row = {
                "kind": "decode", "sampling": sampling, "batch": batch,
                "source_length": source_length, "new_tokens": new,
                "ms_per_token": {n: 1e3 * medians[n] / new for n in names},
                "marginal_ms_per_token": {
                    n: 1e3 * m for n, m in marginal_seconds(times, names, new - short).items()
                },
            }
            if "keras_hub" in runners:
                row["ratio"] = medians["keras_hub"] / medians["ours"]
                marginal = row["marginal_ms_per_token"]
                row["marginal_ratio"] = marginal["keras_hub"] / marginal["ours"]
                # Under bf16 the two models' roundings can part on a near tie.
                row["same"] = bool(
                    np.array_equal(np.asarray(outputs["ours"]), np.asarray(outputs["keras_hub"]))
                )
            yield row


if __name__ == "__main__":
    main()
