"""GPT training and decoding speed against KerasHub's GPT-2, interleaved.

One process per backend (Keras fixes its backend at import). In each:

- training: tokens/s of one optimizer step (`train_on_batch`, AdamW,
  sparse cross-entropy on the logits) of `keras_attention.models.GPT` and of
  a `keras_hub.models.GPT2CausalLM` of the same sizes (the `cpu` preset of
  examples/gpt_lm: 4 layers, 4 heads, width 128, context 64, batch 12,
  65 tokens), alternating A B A B in rounds of `--train-steps` steps;
- decoding: seconds per new token of `GPT.generate` (KV cache, compiled loop;
  on torch, eager, also compiled with `jit_compile=True`: `torch.compile`
  of each one-token step) and `GPT2CausalLM.generate` (greedy sampler, its
  cache; on TensorFlow also with XLA forced on, as `GPT.generate`
  compiles), batch 1, a prompt
  of 16 tokens, at several total lengths, alternating likewise. Time per
  token flat in the length means the cache works: no step recomputes the
  prefix.

Both models get the same weights (`GPT.from_keras_hub`), so the work is the
same. Medians of `--repeats` rounds; ratio = KerasHub time / our time (above
1: ours is faster).

`--sections llama` (or `gpt2,llama`) times `GPT` in the LLaMA configuration
(RMS norms, rotary positions, SwiGLU, no biases, untied output) next to `GPT`
in GPT-2's of equal FLOPs: the same width, depth and heads, the SwiGLU width
2/3 of GPT-2's feed-forward width (three kernels instead of two), and
KerasHub's `LlamaCausalLM` with our LLaMA's weights; the same training step
and decoding as above. Ratios there: GPT-2's time / LLaMA's (ours) and
KerasHub's Llama time / our LLaMA's.

    python benchmarks/gpt_speed.py                    # all backends
    python benchmarks/gpt_speed.py --backends jax --lengths 64,256
    python benchmarks/gpt_speed.py --sections llama   # the LLaMA section only
"""

import argparse
import functools
import json
import os
import subprocess
import sys

import _timing

SIZES = dict(
    vocabulary_size=65, num_layers=4, num_heads=4, hidden_dim=128, intermediate_dim=512
)
# SwiGLU has three (D, F) kernels where GPT-2's network has two: 2/3 of the
# width gives the same feed-forward FLOPs (341 * 3 against 512 * 2, to 0.1%).
LLAMA_INTERMEDIATE_DIM = round(2 * SIZES["intermediate_dim"] / 3)
SECTIONS = ("gpt2", "llama")


def _compile(model):
    import keras

    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3, global_clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


CONTEXT, BATCH, PROMPT_LENGTH = 64, 12, 16


def _train_runner(model, inputs, labels, steps):
    def run():
        for _ in range(steps):
            model.train_on_batch(inputs, labels)

    return run


def _decode_prompt(rng, length):
    """A prompt `(1, PROMPT_LENGTH)`, and KerasHub's inputs for it padded to
    `length` (its generate fills the padded positions)."""
    import numpy as np

    prompt = rng.integers(1, SIZES["vocabulary_size"], (1, PROMPT_LENGTH)).astype("int32")
    padded = np.zeros((1, length), "int32")
    padded[:, :PROMPT_LENGTH] = prompt
    mask = np.zeros((1, length), bool)
    mask[:, :PROMPT_LENGTH] = True
    return prompt, {"token_ids": padded, "padding_mask": mask}


def _hub_generate(model, inputs):
    return lambda: model.generate(inputs, stop_token_ids=None)


def worker(args):
    import keras
    import numpy as np

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    sections = args.sections.split(",")
    if "gpt2" in sections:
        _gpt2_section(args, backend, rng)
    if "llama" in sections:
        _llama_section(args, backend, rng)


def _gpt2_section(args, backend, rng):
    import keras_hub
    import numpy as np

    from keras_attention.models import GPT

    # Training step.
    context, batch = CONTEXT, BATCH
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

    medians = _timing.interleaved(
        {
            "ours": _train_runner(ours, x, y, args.train_steps),
            "keras_hub": _train_runner(theirs, their_x, y, args.train_steps),
        },
        args.repeats,
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
    prompt_length = PROMPT_LENGTH
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
    # Torch decodes eagerly unless the model asks for its compiler: then
    # each one-token step runs through `torch.compile` (the warm-up calls
    # compile it).
    ours_jit = None
    if backend == "torch":
        ours_jit = GPT.from_keras_hub(backbone)
        ours_jit.compile(jit_compile=True)
    for length in lengths:
        new = length - prompt_length
        prompt, their_inputs = _decode_prompt(rng, length)

        def our_generate(prompt=prompt, new=new, model=ours):
            model.generate(prompt, new)

        runners = {"ours": our_generate, "keras_hub": _hub_generate(theirs, their_inputs)}
        if theirs_xla is not None:
            runners["keras_hub_xla"] = _hub_generate(theirs_xla, their_inputs)
        if ours_jit is not None:
            runners["ours_jit"] = functools.partial(our_generate, model=ours_jit)
        medians = _timing.interleaved(runners, args.repeats)
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
                    "ratio_jit": (
                        medians["keras_hub"] / medians["ours_jit"]
                        if "ours_jit" in medians
                        else None
                    ),
                }
            ),
            flush=True,
        )


def _llama_section(args, backend, rng):
    """Our LLaMA configuration against our GPT-2 one of equal FLOPs and
    against KerasHub's Llama with the same weights."""
    import keras_hub
    import numpy as np

    from keras_attention.models import GPT

    lengths = [int(n) for n in args.lengths.split(",")]
    longest = max(lengths + [CONTEXT])
    sizes = dict(SIZES, dropout=0.0, max_sequence_length=longest)
    gpt2 = GPT(**sizes)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=SIZES["vocabulary_size"],
        num_layers=SIZES["num_layers"],
        num_query_heads=SIZES["num_heads"],
        num_key_value_heads=SIZES["num_heads"],  # no grouping: GPT-2's FLOPs
        hidden_dim=SIZES["hidden_dim"],
        intermediate_dim=LLAMA_INTERMEDIATE_DIM,
    )
    hub_llama = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    llama = GPT.from_keras_hub(backbone, max_sequence_length=longest)
    models = {"gpt2_config": gpt2, "llama_config": llama, "keras_hub_llama": hub_llama}

    ids = rng.integers(0, SIZES["vocabulary_size"], (BATCH, CONTEXT + 1)).astype("int32")
    x, y = ids[:, :-1], ids[:, 1:]
    hub_x = {"token_ids": x, "padding_mask": np.ones_like(x, bool)}
    runners = {}
    for name, model in models.items():
        _compile(model)
        inputs = hub_x if name == "keras_hub_llama" else x
        runners[name] = _train_runner(model, inputs, y, args.train_steps)
    medians = _timing.interleaved(runners, args.repeats)
    tokens = args.train_steps * BATCH * CONTEXT
    print(
        json.dumps(
            {
                "backend": backend,
                "kind": "llama_train",
                "tokens_per_s": {n: tokens / m for n, m in medians.items()},
                "ratio": medians["gpt2_config"] / medians["llama_config"],
                "ratio_keras_hub": medians["keras_hub_llama"] / medians["llama_config"],
            }
        ),
        flush=True,
    )

    hub_llama.compile(sampler="greedy")
    for length in lengths:
        new = length - PROMPT_LENGTH
        prompt, hub_inputs = _decode_prompt(rng, length)
        runners = {
            "gpt2_config": lambda prompt=prompt, new=new: gpt2.generate(prompt, new),
            "llama_config": lambda prompt=prompt, new=new: llama.generate(prompt, new),
            "keras_hub_llama": _hub_generate(hub_llama, hub_inputs),
        }
        medians = _timing.interleaved(runners, args.repeats)
        print(
            json.dumps(
                {
                    "backend": backend,
                    "kind": "llama_decode",
                    "length": length,
                    "ms_per_token": {n: 1e3 * m / new for n, m in medians.items()},
                    "ratio": medians["gpt2_config"] / medians["llama_config"],
                    "ratio_keras_hub": medians["keras_hub_llama"] / medians["llama_config"],
                }
            ),
            flush=True,
        )


def _print_llama_row(backend, row):
    t = row.get("tokens_per_s") or row["ms_per_token"]
    unit = "tokens/s" if "tokens_per_s" in row else "ms/token"
    where = "train  " if row["kind"] == "llama_train" else f"decode  length {row['length']:>4}"
    print(
        f"{backend:<11} llama {where}  {unit} GPT-2 config {t['gpt2_config']:>9,.3f}  "
        f"LLaMA config {t['llama_config']:>9,.3f}  keras_hub Llama "
        f"{t['keras_hub_llama']:>9,.3f}  ratio GPT-2/LLaMA {row['ratio']:.2f}  "
        f"keras_hub/LLaMA {row['ratio_keras_hub']:.2f}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--lengths", default="64,128,256,512")
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sections", default="gpt2",
        help="comma-separated: gpt2 (against KerasHub's GPT-2), llama (the LLaMA "
        "configuration against GPT-2's of equal FLOPs and KerasHub's Llama)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections takes {', '.join(SECTIONS)}. Received: {args.sections}")
    if args.worker:
        worker(args)
        return
    print(
        "GPT (cpu preset sizes) against keras_hub GPT2CausalLM, same weights; "
        f"median of {args.repeats} interleaved rounds; ratio = keras_hub time / our time; "
        f"sections: {args.sections}"
    )
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        command = [sys.executable, __file__, "--worker", "--lengths", args.lengths,
                   "--train-steps", str(args.train_steps), "--repeats", str(args.repeats),
                   "--sections", args.sections]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        ours = {}  # ms a token by total length
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if row["kind"].startswith("llama"):
                _print_llama_row(backend, row)
            elif row["kind"] == "train":
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
                if row["ratio_jit"] is not None:
                    xla += (
                        f"  ours, jit_compile {m['ours_jit']:>7.3f}  "
                        f"ratio {row['ratio_jit']:.2f}"
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
