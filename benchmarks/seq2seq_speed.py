"""Translation training and decoding speed against KerasHub, interleaved.

One process per backend (Keras fixes its backend at import). In each, at one
small size (2 encoder + 2 decoder blocks, 4 heads, width 128, feed-forward
256, vocabularies of 1000, sources of 20 tokens):

- training: target tokens/s of one optimizer step (`train_on_batch`, Adam,
  sparse cross-entropy on the logits; batch 8, 20 target tokens) of
  `keras_attention.models.Seq2SeqTransformer` (learned positions, no dropout)
  and of the architecture of the keras.io English-Spanish translation example
  built from `keras_hub.layers.TokenAndPositionEmbedding`,
  `TransformerEncoder` and `TransformerDecoder` (same sizes, a `Dense` output
  layer), alternating A B A B in rounds of `--train-steps` steps;
- decoding: milliseconds per generated token (`--new-tokens` tokens after the
  start token, no end token, so every call runs the whole length) of
  `Seq2SeqTransformer.generate` against `keras_hub.models.BartSeq2SeqLM.generate`
  (no preprocessor, `GreedySampler()` or `BeamSampler(num_beams=4)` set with
  `compile(sampler=...)`; on TensorFlow also with XLA forced on, as our loop
  compiles with XLA), greedy and 4-beam, at the batch sizes of `--batches`.
  Our model takes the BART backbone's weights (`Seq2SeqTransformer.from_keras_hub`),
  so both decode the same function (`same` below: whether the tokens agree).
  On torch, ours is also timed compiled with `jit_compile=True` (each
  one-token step through `torch.compile`; `ours, jit_compile`).
  Each translation is also timed with one new token, in the same rounds: the
  median over rounds of the difference, over the `--new-tokens` - 1 tokens
  between, is the *marginal* time per token (the `marginal` rows): the
  decoding without what a call pays once (the encoder, the dispatch of the
  compiled call, Python). Both models size their caches by the call's
  length, so the difference also holds the longer call's longer cache.
  Greedy is also timed against the keras.io example's loop: a `GreedySampler`
  whose `next` runs the keras_hub-layers model of the training part on the
  whole target at every step (no cache), called as the example calls it, in
  rounds of its own with ours (a call 100 to 300 times as long evicts the
  caches of the call after it).

Medians of `--repeats` rounds after two warm-up (compiling) calls of each;
ratio = peer time / our time (above 1: ours is faster).

    python benchmarks/seq2seq_speed.py                  # all backends
    python benchmarks/seq2seq_speed.py --backends jax --batches 1
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

VOCABULARY = 1000
LAYERS, HEADS, WIDTH, FEEDFORWARD = 2, 4, 128, 256
MAX_LENGTH = 64  # position tables of both models
SOURCE_LENGTH, TARGET_LENGTH, TRAIN_BATCH = 20, 20, 8
BART_START, BART_PAD = 2, 1  # BART's decoder start token `</s>` and `<pad>`


def _compile(model):
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _interleaved(runners, repeats, clock="wall", rounds=False):
    """Medians of `repeats` rounds A B A B ...; `clock="cpu"` times the
    process's CPU seconds (all its threads), which other jobs on a busy
    machine disturb less than the wall clock. Python's garbage collector is
    off during the rounds, as `timeit` keeps it: otherwise the objects one
    runner leaves (KerasHub's `generate` makes many) are collected inside
    the next runner's call. (Collecting before each call instead walks
    every live object and leaves the caches cold for the call.) With
    `rounds`, also each runner's time in every round."""
    clock = CLOCKS[clock]
    for run in runners.values():  # warm-up and compilation
        run()
        run()
    times = {name: [] for name in runners}
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, run in runners.items():
                start = clock()
                run()
                times[name].append(clock() - start)
    finally:
        gc.enable()
    medians = {name: statistics.median(t) for name, t in times.items()}
    return (medians, times) if rounds else medians


def keras_hub_translator():
    """The keras.io English-Spanish example's model, at this benchmark's sizes:
    token + learned position embeddings (id 0 masked), post-norm encoder and
    decoder blocks, a dense layer to the target vocabulary (logits)."""
    import keras
    import keras_hub

    def embedding(name):
        return keras_hub.layers.TokenAndPositionEmbedding(
            vocabulary_size=VOCABULARY,
            sequence_length=MAX_LENGTH,
            embedding_dim=WIDTH,
            mask_zero=True,
            name=name,
        )

    source = keras.Input((None,), dtype="int32", name="encoder_inputs")
    target = keras.Input((None,), dtype="int32", name="decoder_inputs")
    encoded = embedding("source_embedding")(source)
    for i in range(LAYERS):
        encoded = keras_hub.layers.TransformerEncoder(
            intermediate_dim=FEEDFORWARD, num_heads=HEADS, name=f"encoder_{i}"
        )(encoded)
    x = embedding("target_embedding")(target)
    for i in range(LAYERS):
        x = keras_hub.layers.TransformerDecoder(
            intermediate_dim=FEEDFORWARD, num_heads=HEADS, name=f"decoder_{i}"
        )(decoder_sequence=x, encoder_sequence=encoded)
    logits = keras.layers.Dense(VOCABULARY, name="logits")(x)
    return keras.Model({"encoder_inputs": source, "decoder_inputs": target}, logits)


def worker(args):
    import warnings

    # KerasHub's embedding hands its mask to sublayers that drop it.
    warnings.filterwarnings("ignore", message=".*does not support masking")
    import keras
    import keras_hub
    import numpy as np

    from keras_attention.models import Seq2SeqTransformer

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)

    # Training step.
    ours = Seq2SeqTransformer(
        VOCABULARY, VOCABULARY, MAX_LENGTH, MAX_LENGTH,
        num_encoder_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
        hidden_dim=WIDTH, intermediate_dim=FEEDFORWARD, dropout=0.0,
        positions="learned", seed=0,
    )
    theirs = keras_hub_translator()
    _compile(ours)
    _compile(theirs)
    source = rng.integers(1, VOCABULARY, (TRAIN_BATCH, SOURCE_LENGTH)).astype("int32")
    target = rng.integers(1, VOCABULARY, (TRAIN_BATCH, TARGET_LENGTH + 1)).astype("int32")
    y = target[:, 1:]
    our_x = {"encoder_token_ids": source, "decoder_token_ids": target[:, :-1]}
    their_x = {"encoder_inputs": source, "decoder_inputs": target[:, :-1]}

    def train(model, inputs):
        def run():
            for _ in range(args.train_steps):
                model.train_on_batch(inputs, y)

        return run

    medians = _interleaved(
        {"ours": train(ours, our_x), "keras_hub": train(theirs, their_x)}, args.repeats,
        args.clock,
    )
    tokens = args.train_steps * TRAIN_BATCH * TARGET_LENGTH
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
    translator = theirs  # the keras_hub-layers model, for the uncached loop

    # Decoding.
    new = args.new_tokens
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=VOCABULARY, num_layers=LAYERS, num_heads=HEADS,
        hidden_dim=WIDTH, intermediate_dim=FEEDFORWARD, dropout=0.0,
        max_sequence_length=MAX_LENGTH,
    )
    ours = Seq2SeqTransformer.from_keras_hub(backbone)
    # Torch decodes eagerly unless the model asks for its compiler: then each
    # one-token step runs through `torch.compile` (the warm-up compiles it).
    ours_jit = None
    if backend == "torch":
        ours_jit = Seq2SeqTransformer.from_keras_hub(backbone)
        ours_jit.compile(jit_compile=True)
    samplers = {
        "greedy": keras_hub.samplers.GreedySampler,
        "beam": lambda: keras_hub.samplers.BeamSampler(num_beams=4),
    }
    bart, bart_xla = {}, {}
    for sampling, sampler in samplers.items():
        bart[sampling] = keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
        bart[sampling].compile(sampler=sampler())
        # Keras turns XLA off on CPU-only TensorFlow; our loop compiles with
        # XLA, so KerasHub's is also timed with XLA forced on.
        if backend == "tensorflow":
            bart_xla[sampling] = keras_hub.models.BartSeq2SeqLM(
                backbone=backbone, preprocessor=None
            )
            bart_xla[sampling].compile(sampler=sampler(), jit_compile=True)

    short = 1  # one new token: what a call pays once, and one step
    for batch in [int(b) for b in args.batches.split(",")]:
        # Ids from 3: no <s>, <pad> or </s> in the sources.
        source = rng.integers(3, VOCABULARY, (batch, SOURCE_LENGTH)).astype("int32")
        source_mask = np.ones_like(source, bool)

        for sampling in samplers:
            outputs = {}

            def our_generate(length, name, sampling=sampling):
                return our_runner(ours, source, source_mask, length, sampling, outputs, name)

            def their_generate(model, length, name):
                return bart_runner(model, source, source_mask, length, outputs, name)

            peers = {"keras_hub": bart[sampling]}
            if sampling in bart_xla:
                peers["keras_hub_xla"] = bart_xla[sampling]
            # Each translation also with one new token, in the same rounds:
            # the difference is the cost of the other `new - 1` tokens,
            # without what a call pays once (the encoder, the dispatch,
            # Python). Both models' caches are sized by the call's length,
            # so the longer call's first step also reads a longer cache.
            runners = {"ours": our_generate(new, "ours")}
            runners.update(
                (name, their_generate(model, new, name)) for name, model in peers.items()
            )
            runners["ours_short"] = our_generate(short, "ours_short")
            if ours_jit is not None:
                runners["ours_jit"] = our_runner(
                    ours_jit, source, source_mask, new, sampling, outputs, "ours_jit"
                )
            runners.update(
                (f"{name}_short", their_generate(model, short, f"{name}_short"))
                for name, model in peers.items()
            )
            all_medians, times = _interleaved(runners, args.repeats, args.clock, rounds=True)
            medians = {name: all_medians[name] for name in ["ours", *peers]}
            ratios = {n: m / medians["ours"] for n, m in medians.items() if n != "ours"}
            marginal = marginal_seconds(times, ["ours", *peers], new - short)
            if "ours_jit" in all_medians:
                medians["ours_jit"] = all_medians["ours_jit"]
                ratios["ours_jit"] = medians["keras_hub"] / medians["ours_jit"]
            if sampling == "greedy":
                # In its own rounds: 100 to 300 times as long as a cached
                # call, it evicts the caches the call after it finds, and in
                # one round with the others it made our greedy calls (which
                # came next) about 1.7 times as slow.
                uncached = _interleaved(
                    {
                        "ours": our_generate(new, "ours"),
                        "uncached": uncached_loop(translator, source, new),
                    },
                    args.repeats, args.clock,
                )
                medians["uncached"] = uncached["uncached"]
                ratios["uncached"] = uncached["uncached"] / uncached["ours"]
            same = bool(
                np.array_equal(np.asarray(outputs["ours"]), outputs["keras_hub"])
                and np.array_equal(np.asarray(outputs["ours_short"]), outputs["keras_hub_short"])
                and np.array_equal(np.asarray(outputs.get("ours_jit", outputs["ours"])),
                                   outputs["keras_hub"])
            )
            print(
                json.dumps(
                    {
                        "backend": backend,
                        "kind": "decode",
                        "sampling": sampling,
                        "batch": batch,
                        "same": same,
                        "ms_per_token": {n: 1e3 * m / new for n, m in medians.items()},
                        "ratios": ratios,
                        "marginal_ms_per_token": {n: 1e3 * m for n, m in marginal.items()},
                        "marginal_ratios": {
                            n: m / marginal["ours"] for n, m in marginal.items() if n != "ours"
                        },
                    }
                ),
                flush=True,
            )


def marginal_seconds(times, names, extra_tokens):
    """Per name, the seconds a token costs beyond a call's fixed part: the
    median over rounds of the difference between the call's time
    (`times[name]`) and the shorter call's (`times[name + "_short"]`),
    divided by the `extra_tokens` between them. The two calls of a round see
    the same state of the host."""
    return {
        name: statistics.median(
            full - part for full, part in zip(times[name], times[f"{name}_short"])
        ) / extra_tokens
        for name in names
    }


def our_runner(model, source, source_mask, length, sampling, outputs, name):
    """A call of `Seq2SeqTransformer.generate` (`length` new tokens after
    BART's start token, 4 beams in beam search) that keeps its tokens in
    `outputs[name]`."""

    def run():
        outputs[name] = model.generate(
            source, length, start_token_id=BART_START, sampling=sampling,
            num_beams=4, encoder_padding_mask=source_mask,
        )

    return run


def bart_runner(model, source, source_mask, length, outputs, name):
    """A call of `BartSeq2SeqLM.generate` on preprocessed inputs (the start
    token, then `length` padding positions to fill, no stop token) that
    keeps its tokens in `outputs[name]`."""
    import numpy as np

    batch = source.shape[0]
    decoder_ids = np.full((batch, 1 + length), BART_PAD, "int32")
    decoder_ids[:, 0] = BART_START
    decoder_mask = np.zeros_like(decoder_ids, bool)
    decoder_mask[:, 0] = True
    inputs = {
        "encoder_token_ids": source,
        "encoder_padding_mask": source_mask,
        "decoder_token_ids": decoder_ids,
        "decoder_padding_mask": decoder_mask,
    }

    def run():
        # numpy out, as ours: the work is done when it returns.
        outputs[name] = model.generate(inputs, stop_token_ids=None)["decoder_token_ids"]

    return run


def uncached_loop(translator, source, new):
    """The keras.io example's greedy decoding: the sampler called directly,
    `next` running the model on the whole target and reading one position."""
    import keras_hub
    from keras import ops

    batch = source.shape[0]
    encoder_ids = ops.convert_to_tensor(source)
    start = ops.full((batch, 1), 1, dtype="int32")  # any nonzero start id
    pad = ops.zeros((batch, new), dtype="int32")

    def next(prompt, cache, index):
        logits = translator({"encoder_inputs": encoder_ids, "decoder_inputs": prompt})
        return logits[:, index - 1, :], None, cache

    def run():
        prompt = ops.concatenate((start, pad), axis=-1)
        ids = keras_hub.samplers.GreedySampler()(next, prompt, stop_token_ids=None, index=1)
        ops.convert_to_numpy(ids)  # waits for JAX's asynchronous dispatch

    return run


def _load():
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="wall: elapsed time; cpu: the process's CPU time (a busy machine)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not 2 <= args.new_tokens < MAX_LENGTH:
        parser.error(f"--new-tokens must be at least 2 and below {MAX_LENGTH}")
    print(
        "Seq2SeqTransformer (2+2 layers, width 128) against keras_hub: training "
        "against the keras.io example's model, decoding against BartSeq2SeqLM "
        f"(same weights) and the example's uncached loop; median of {args.repeats} "
        f"interleaved rounds ({args.clock} clock); ratio = peer time / our time"
    )
    print(f"before: {_load()}", flush=True)
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        command = [sys.executable, __file__, "--worker", "--batches", args.batches,
                   "--new-tokens", str(args.new_tokens), "--train-steps",
                   str(args.train_steps), "--repeats", str(args.repeats), "--clock", args.clock]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if row["kind"] == "train":
                t = row["tokens_per_s"]
                print(
                    f"{backend:<11} {'train':<9}tokens/s ours {t['ours']:>9,.0f}  "
                    f"keras_hub {t['keras_hub']:>9,.0f}  ratio {row['ratio']:.2f}",
                    flush=True,
                )
            else:
                m, r = row["ms_per_token"], row["ratios"]
                peers = "".join(
                    f"  {name} {m[name]:>7.2f}  ratio {r[name]:.2f}"
                    for name in ("keras_hub", "keras_hub_xla", "uncached")
                    if name in m
                )
                if "ours_jit" in m:
                    peers += (
                        f"  ours, jit_compile {m['ours_jit']:>7.2f}  keras_hub / it "
                        f"{r['ours_jit']:.2f}"
                    )
                print(
                    f"{backend:<11} {'decode':<9}{row['sampling']:<6} batch {row['batch']}  "
                    f"ms/token ours {m['ours']:>7.2f}{peers}  same {row['same']}",
                    flush=True,
                )
                m, r = row["marginal_ms_per_token"], row["marginal_ratios"]
                peers = "".join(
                    f"  {name} {m[name]:>7.3f}  ratio {r[name]:.2f}"
                    for name in ("keras_hub", "keras_hub_xla")
                    if name in m
                )
                print(
                    f"{'':<11} {'marginal':<9}{row['sampling']:<6} batch {row['batch']}  "
                    f"ms/token ours {m['ours']:>7.3f}{peers}",
                    flush=True,
                )
        if proc.wait() != 0:
            print(f"{backend}: worker failed with exit code {proc.returncode}")
    print(f"after: {_load()}", flush=True)


if __name__ == "__main__":
    main()
