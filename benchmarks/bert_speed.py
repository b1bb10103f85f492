"""Masked-LM training speed of `BertMaskedLM` against KerasHub's, interleaved.

One process per backend (Keras fixes its backend at import). In each, at the
size of the `cpu` preset of `examples/bert_mlm` (4 blocks, 4 heads, width
128, feed-forward 512, a vocabulary of 4,164, pairs of 64 tokens, 10 masks
each, batch 32, dropout 0.1 unless `--dropout`): one optimizer step
(`train_on_batch`, AdamW, sparse cross-entropy from the logits at the masked
positions, weighted by the mask weights) of `keras_hub.models.BertMaskedLM`
(`preprocessor=None`) and of `keras_attention.models.BertMaskedLM` holding
its weights (`BertMaskedLM.from_keras_hub`), alternating A B A B in rounds
of `--train-steps` steps. Before timing, both models' logits on the batch
are compared (`max_diff`), so both compute the same function.

Medians of `--repeats` rounds after two warm-up (compiling) calls of each;
tokens/s counts every position of every sequence (`B * T` per step); ratio =
KerasHub's time / ours (above 1: ours is faster).

    python benchmarks/bert_speed.py                  # all backends
    python benchmarks/bert_speed.py --backends jax --dropout 0
"""

import argparse
import json
import os
import subprocess
import sys

import _timing

VOCABULARY = 4164
LAYERS, HEADS, WIDTH, FEEDFORWARD = 4, 4, 128, 512
LENGTH, MASKS, BATCH = 64, 10, 32


def _compile(model):
    import keras

    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
    )


def worker(args):
    import keras
    import keras_hub
    import numpy as np

    from keras_attention.models import BertMaskedLM

    backend = keras.backend.backend()
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=LAYERS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FEEDFORWARD, dropout=args.dropout, max_sequence_length=LENGTH,
    )
    theirs = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    ours = BertMaskedLM.from_keras_hub(theirs)

    rng = np.random.default_rng(0)
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, BATCH)  # some padding
    padding = np.arange(LENGTH)[None, :] < lengths[:, None]
    x = {
        "token_ids": np.where(padding, rng.integers(5, VOCABULARY, (BATCH, LENGTH)), 0)
        .astype("int32"),
        "segment_ids": (np.arange(LENGTH)[None, :] >= lengths[:, None] // 2).astype("int32")
        * padding,
        "padding_mask": padding,
        "mask_positions": np.sort(rng.integers(1, LENGTH // 2, (BATCH, MASKS)), axis=1)
        .astype("int32"),
    }
    y = rng.integers(5, VOCABULARY, (BATCH, MASKS)).astype("int32")
    weights = np.ones((BATCH, MASKS), "float32")
    max_diff = float(np.abs(
        keras.ops.convert_to_numpy(ours(x)) - keras.ops.convert_to_numpy(theirs(x))
    ).max())
    _compile(ours)
    _compile(theirs)

    def train(model):
        def run():
            for _ in range(args.train_steps):
                model.train_on_batch(x, y, sample_weight=weights)

        return run

    medians = _timing.interleaved({"ours": train(ours), "keras_hub": train(theirs)}, args.repeats)
    tokens = args.train_steps * BATCH * LENGTH
    print(
        json.dumps(
            {
                "backend": backend,
                "max_diff": max_diff,
                "tokens_per_s": {n: tokens / m for n, m in medians.items()},
                "ms_per_step": {n: 1e3 * m / args.train_steps for n, m in medians.items()},
                "ratio": medians["keras_hub"] / medians["ours"],
            }
        ),
        flush=True,
    )


def _load():
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(
        f"BertMaskedLM ({LAYERS} layers, width {WIDTH}, batch {BATCH} x {LENGTH} tokens, "
        f"{MASKS} masks, dropout {args.dropout}) against keras_hub.models.BertMaskedLM "
        f"with the same weights; median of {args.repeats} interleaved rounds of "
        f"{args.train_steps} steps; ratio = keras_hub time / our time"
    )
    print(f"before: {_load()}", flush=True)
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        command = [sys.executable, __file__, "--worker", "--train-steps",
                   str(args.train_steps), "--repeats", str(args.repeats),
                   "--dropout", str(args.dropout)]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            t, ms = row["tokens_per_s"], row["ms_per_step"]
            print(
                f"{backend:<11} tokens/s ours {t['ours']:>8,.0f} ({ms['ours']:.0f} ms/step)  "
                f"keras_hub {t['keras_hub']:>8,.0f} ({ms['keras_hub']:.0f} ms/step)  "
                f"ratio {row['ratio']:.2f}  max logit diff {row['max_diff']:.1e}",
                flush=True,
            )
        if proc.wait() != 0:
            print(f"{backend}: worker failed with exit code {proc.returncode}")
    print(f"after: {_load()}", flush=True)


if __name__ == "__main__":
    main()
