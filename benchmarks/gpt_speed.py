"""GPT training and decoding speed against KerasHub's GPT-2, interleaved.

One process per backend (Keras fixes its backend at import). In each:

- training: tokens/s of one optimizer step (`train_on_batch`, AdamW,
  sparse cross-entropy on the logits) of `keras_attention.models.GPT` and of
  a `keras_hub.models.GPT2CausalLM` of the same sizes (the `cpu` preset of
  examples/gpt_lm: 4 layers, 4 heads, width 128, context 64, batch 12,
  65 tokens), alternating A B A B in rounds of `--train-steps` steps;
- decoding: seconds per new token of `GPT.generate` (KV cache, compiled loop)
  and `GPT2CausalLM.generate` (greedy sampler, its cache; on TensorFlow also
  with XLA forced on, as `GPT.generate` compiles), batch 1, a prompt
  of 16 tokens, at several total lengths, alternating likewise. Time per
  token flat in the length means the cache works: no step recomputes the
  prefix.

Both models get the same weights (`GPT.from_keras_hub`), so the work is the
same. Medians of `--repeats` rounds; ratio = KerasHub time / our time (above
1: ours is faster).

    python benchmarks/gpt_speed.py                    # all backends
    python benchmarks/gpt_speed.py --backends jax --lengths 64,256
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = dict(
    vocabulary_size=65, num_layers=4, num_heads=4, hidden_dim=128, intermediate_dim=512
)


def _compile(model):
    import keras

    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3, global_clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def _interleaved(runners, repeats):
    for run in runners.values():  # warm-up and compilation
        run()
        run()
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def worker(args):
    import keras
    import keras_hub
    import numpy as np

    from keras_attention.models import GPT

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)

    # Training step.
    context, batch = 64, 12
    backbone = keras_hub.models.GPT2Backbone(
        **SIZES, dropout=0.0, max_sequence_length=context
    )
    theirs = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    ours = GPT.from_keras_hub(backbone)
    _compile(ours)
    _compile(theirs)
    ids = rng.integers(0, SIZES["vocabulary_size"], (batch, context + 1)).astype("int32")
    x, y = ids[:, :-1], ids[:, 1:]
    their_x = {"token_ids": x, "padding_mask": np.ones_like(x, bool)}

    def train(model, inputs):
        def run():
            for _ in range(args.train_steps):
                model.train_on_batch(inputs, y)

        return run

    medians = _interleaved(
        {"ours": train(ours, x), "keras_hub": train(theirs, their_x)}, args.repeats
    )
    tokens = args.train_steps * batch * context
    print(
        json.dumps(
            {
                "backend": backend,
                "kind": "train",
                "tokens_per_s": {n: tokens / m for n, m in medians.items()},
                "ratio": medians["keras_hub"] / medians["ours"],
            }
        ),
        flush=True,
    )

    # Decoding.
    lengths = [int(n) for n in args.lengths.split(",")]
    prompt_length = 16
    backbone = keras_hub.models.GPT2Backbone(
        **SIZES, dropout=0.0, max_sequence_length=max(lengths)
    )
    theirs = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    theirs.compile(sampler="greedy")
    # Keras turns XLA off on CPU-only TensorFlow; GPT.generate compiles its
    # loop with XLA, so KerasHub's is also timed with XLA forced on.
    theirs_xla = None
    if backend == "tensorflow":
        theirs_xla = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        theirs_xla.compile(sampler="greedy", jit_compile=True)
    ours = GPT.from_keras_hub(backbone)
    for length in lengths:
        new = length - prompt_length
        prompt = rng.integers(1, SIZES["vocabulary_size"], (1, prompt_length)).astype("int32")
        padded = np.zeros((1, length), "int32")
        padded[:, :prompt_length] = prompt
        mask = np.zeros((1, length), bool)
        mask[:, :prompt_length] = True

        def our_generate(prompt=prompt, new=new):
            ours.generate(prompt, new)

        def their_generate(model, padded=padded, mask=mask):
            return lambda: model.generate(
                {"token_ids": padded, "padding_mask": mask}, stop_token_ids=None
            )

        runners = {"ours": our_generate, "keras_hub": their_generate(theirs)}
        if theirs_xla is not None:
            runners["keras_hub_xla"] = their_generate(theirs_xla)
        medians = _interleaved(runners, args.repeats)
        print(
            json.dumps(
                {
                    "backend": backend,
                    "kind": "decode",
                    "length": length,
                    "ms_per_token": {n: 1e3 * m / new for n, m in medians.items()},
                    "ratio": medians["keras_hub"] / medians["ours"],
                    "ratio_xla": (
                        medians["keras_hub_xla"] / medians["ours"]
                        if "keras_hub_xla" in medians
                        else None
                    ),
                }
            ),
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--lengths", default="64,128,256,512")
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(
        "GPT (cpu preset sizes) against keras_hub GPT2CausalLM, same weights; "
        f"median of {args.repeats} interleaved rounds; ratio = keras_hub time / our time"
    )
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        command = [sys.executable, __file__, "--worker", "--lengths", args.lengths,
                   "--train-steps", str(args.train_steps), "--repeats", str(args.repeats)]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        ours = {}  # ms a token by total length
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if row["kind"] == "train":
                t = row["tokens_per_s"]
                print(
                    f"{backend:<11} train   tokens/s ours {t['ours']:>9,.0f}  "
                    f"keras_hub {t['keras_hub']:>9,.0f}  ratio {row['ratio']:.2f}",
                    flush=True,
                )
            else:
                m = row["ms_per_token"]
                ours[row["length"]] = m["ours"]
                xla = ""
                if row["ratio_xla"] is not None:
                    xla = (
                        f"  keras_hub+XLA {m['keras_hub_xla']:>7.3f}  "
                        f"ratio {row['ratio_xla']:.2f}"
                    )
                print(
                    f"{backend:<11} decode  length {row['length']:>4}  ms/token ours "
                    f"{m['ours']:>7.3f}  keras_hub {m['keras_hub']:>7.3f}  "
                    f"ratio {row['ratio']:.2f}{xla}",
                    flush=True,
                )
        if len(ours) > 1:
            longest, shortest = max(ours), min(ours)
            print(f"{backend:<11} decode  ours per token at {longest} / at {shortest}: "
                  f"{ours[longest] / ours[shortest]:.2f} (target: at most 1.5)", flush=True)
        if proc.wait() != 0:
            print(f"{backend}: worker failed with exit code {proc.returncode}")


if __name__ == "__main__":
    main()
