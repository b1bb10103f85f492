"""What the two decoding floors share (`gpt_decode_floor.py`,
`seq2seq_decode_floor.py`): the JAX pieces of a model written by hand, the
check that the script runs on JAX, and the interleaved timing of the floor,
ours and KerasHub's, which must decode the same tokens."""

import argparse
import json
import os

import _timing


def argument_parser(doc):
    """A parser described by the first line of `doc`, with `--repeats`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="rounds timed")
    return parser


def check_run(parser, args):
    """Ends the script, naming the option or variable, unless `--repeats`
    is at least 1 and Keras is to run on JAX; sets `KERAS_BACKEND=jax`
    before Keras is imported."""
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; received {args.repeats}")
    if os.environ.get("KERAS_BACKEND", "jax") != "jax":
        parser.error(
            f"this benchmark runs on JAX: KERAS_BACKEND must be jax or unset; "
            f"received {os.environ['KERAS_BACKEND']!r}"
        )
    os.environ["KERAS_BACKEND"] = "jax"


def integer_list(parser, flag, text, minimum):
    """`text`, integers separated by commas, as a list; ends the script
    naming `flag` and the value if one is not an integer of at least
    `minimum`."""
    values = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < minimum:
            parser.error(f"{flag} must be integers of at least {minimum}; received {text!r}")
        values.append(int(part))
    return values


def layer_norm(x, gamma_beta, epsilon):
    """Layer normalization over the last axis, in `jax.numpy`."""
    import jax
    import jax.numpy as jnp

    gamma, beta = gamma_beta
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + epsilon) * gamma + beta


def dense(x, kernel_bias):
    kernel, bias = kernel_bias
    return x @ kernel + bias


def time_against_floor(runners, repeats, new_tokens, row):
    """Runs `runners` (`floor`, `ours`, `keras_hub`: no-argument calls that
    return numpy tokens) once to compile, ends the script if any decodes
    other tokens than `floor`, then times them in turn for `repeats` rounds
    and prints `row` (a dict naming the case) with the medians in ms a new
    token and the ratios, as one JSON line."""
    import numpy as np

    outputs = {name: run() for name, run in runners.items()}  # compiles
    for name, tokens in outputs.items():
        if not np.array_equal(tokens, outputs["floor"]):
            raise SystemExit(f"{name} decoded other tokens than the floor: {row}")
    medians = _timing.interleaved(runners, repeats, warmups=0)
    row = dict(
        row,
        ms_per_token={n: round(1e3 * m / new_tokens, 4) for n, m in medians.items()},
    )
    row["keras_hub / floor"] = round(medians["keras_hub"] / medians["floor"], 2)
    row["keras_hub / ours"] = round(medians["keras_hub"] / medians["ours"], 2)
    row["ours / floor"] = round(medians["ours"] / medians["floor"], 2)
    print(json.dumps(row), flush=True)
