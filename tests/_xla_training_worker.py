"""Trains a model through every row of the kernel table, compiled (XLA on
TensorFlow and JAX), against the explicit kernel run uncompiled; run in a
process of its own by `tests/kernels/test_xla_training.py`, since a failed
XLA check aborts the process.

Usage: `python _xla_training_worker.py BACKEND`. Prints one line per model,
`NAME: kernels=K1,K2 max_diff=X`, then `done`; any mismatch is an
exception (exit status 1).

One model per setting of the table (fused, blocked, chunked kernels), each
with a `MultiHeadAttention` per mask form and length in `CALLS`: none, the
causal flag, a padding mask on the keys, an attention mask with a fully
masked query row, Keras's implicit mask, causal with padding, and
cross-attention to a padded sequence of another length. The fused model
also holds the explicit rows' layers (`fused=False`, an additive scorer,
value heads of another size); dropout has a model of its own.
"""

import dataclasses
import functools
import os
import sys

os.environ["KERAS_BACKEND"] = sys.argv[1]

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

from keras_attention import backend  # noqa: E402
from keras_attention import kernels  # noqa: E402
from keras_attention.kernels import choice  # noqa: E402
from keras_attention.layers import MultiHeadAttention  # noqa: E402

LENGTHS = (1, 4, 16, 31, 64)
BATCH, DIM, HEADS, KEY_DIM = 2, 6, 2, 3
# (mask form, query length): every form, lengths 1 to 64 among them, both
# sides of the 32 queries where TensorFlow's table changes row.
CALLS = (
    ("none", 64), ("causal", 1), ("causal", 31), ("value_mask", 4),
    ("attention_mask", 16), ("implicit", 31), ("causal_padding", 16), ("cross", 4),
)
# XLA on TensorFlow and JAX; torch trains its step uncompiled (torch.compile
# would take minutes on a CPU, and its kernels are not XLA's).
COMPILED = keras.backend.backend() in ("tensorflow", "jax")


def _preferences(**changes):
    return dataclasses.replace(backend.preferences(), **changes)


# A model per table setting: its preferences and chunk thresholds, and the
# layers beside the mask forms' that take the explicit rows.
# (row, the layer's arguments, its mask form)
EXPLICIT_ROWS = (
    (1, dict(fused=False), "causal_padding"),
    (2, dict(score="additive"), "cross"),
    (4, dict(value_dim=4), "value_mask"),
)
MODELS = {
    "fused": (_preferences(blocked="never", chunk_long_queries=False), {}, EXPLICIT_ROWS),
    "blocked": (
        _preferences(blocked="always", blocked_min_queries=1, chunk_long_queries=False), {}, (),
    ),
    "chunked": (
        _preferences(chunk_long_queries=True),
        dict(chunk_above_bytes=0, chunk_bytes=HEADS * 64 * 4 * 3),
        (),
    ),
    # Dropout draws differ between XLA and a graph: its reference is the
    # explicit kernel compiled alike, with the same seeds. Where the dropout
    # row is the backend's fused kernel (torch's SDPA), which draws noise of
    # its own, the reference is the same training run again: the same seeds
    # must draw the same noise (tests/kernels/test_dropout_kernel.py checks
    # its arithmetic against numpy).
    "dropout": (
        None, {}, tuple((3, dict(dropout=0.5, seed=3), form) for form in ("causal_padding", "cross")),
    ),
}
# The kernels each model must have run (beside them, calls too short to
# chunk take the next row).
EXPECTED = {
    "fused": {choice.FUSED, choice.EXPLICIT},
    "blocked": {choice.BLOCKED},
    "chunked": {choice.CHUNKED},
    "dropout": {choice.DROPOUT if backend.preferences().dropout_kernel else choice.EXPLICIT},
}


def _call(layer, form, x, pad, att, other):
    if form == "none":
        return layer(x, x)
    if form == "causal":
        return layer(x, x, use_causal_mask=True)
    if form == "value_mask":
        return layer(x, x, value_mask=pad)
    if form == "attention_mask":
        return layer(x, x, attention_mask=att)
    if form == "implicit":
        masked = keras.layers.Masking(0.0)(x)
        return layer(masked, masked)
    if form == "causal_padding":
        return layer(x, x, value_mask=pad, use_causal_mask=True)
    return layer(x, other[0], value_mask=other[1])  # cross-attention, T != S


def _inputs_and_outputs(name):
    """A functional model: the mask forms' layers (none for the dropout
    model), then its explicit rows' layers, summed into `(B, DIM)`."""
    _, _, extra = MODELS[name]
    inputs = {}
    for length in LENGTHS:
        inputs[f"x{length}"] = keras.Input((length, DIM), name=f"x{length}")
        inputs[f"pad{length}"] = keras.Input((length,), dtype="bool", name=f"pad{length}")
        inputs[f"att{length}"] = keras.Input((length, length), dtype="bool", name=f"att{length}")
    calls = [({}, form, length) for form, length in CALLS if name != "dropout"]
    calls += [(kwargs, form, 16) for _, kwargs, form in extra]
    outputs = []
    for kwargs, form, length in calls:
        layer = MultiHeadAttention(HEADS, KEY_DIM, **kwargs)
        x, pad, att = (inputs[f"{n}{length}"] for n in ("x", "pad", "att"))
        other = (inputs["x31"], inputs["pad31"])
        outputs.append(ops.mean(_call(layer, form, x, pad, att, other), axis=1))  # (B, DIM)
    total = outputs[0]
    for y in outputs[1:]:
        total = total + y
    return inputs, total


def _data():
    rng = np.random.default_rng(0)
    data = {}
    for length in LENGTHS:
        x = rng.normal(size=(BATCH, length, DIM)).astype("float32")
        x[1, length // 2:] = 0.0  # Keras's implicit mask hides these
        pad = np.ones((BATCH, length), bool)
        pad[0, length // 2 + 1:] = False
        att = rng.random((BATCH, length, length)) < 0.6
        att[:, :, 0] = True
        att[1, -1] = False  # a query that sees no key
        data.update({f"x{length}": x, f"pad{length}": pad, f"att{length}": att})
    return data, rng.normal(size=(BATCH, DIM)).astype("float32")


def _explicit_choice(*args, **kwargs):
    return choice.Choice(choice.EXPLICIT, 1)


def _train(name, chooser, weights, compiled):
    """One SGD step of a fresh model; its loss, its weights, the kernels
    the table chose while the step was traced."""
    original = kernels.choose_kernel
    kernels.choose_kernel = chooser
    try:
        keras.utils.set_random_seed(1)
        model = keras.Model(*_inputs_and_outputs(name))
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", jit_compile=compiled
        )
        data, target = _data()
        # `fit`, not `train_on_batch`, in batches larger than the data: on
        # TensorFlow the batches then come from a `tf.data` iterator whose
        # batch size is unknown, which XLA's bridge compiles as a dynamic
        # dimension (what it failed on); full batches have a static size.
        with kernels.tracing() as traced:
            history = model.fit(data, target, batch_size=BATCH + 1, shuffle=False, verbose=0)
        loss = history.history["loss"][0]
        return loss, model.get_weights(), {c.kernel for _, c in traced}
    finally:
        kernels.choose_kernel = original


def main():
    for name, (preferences, thresholds, _) in MODELS.items():
        chooser = functools.partial(choice.choose_kernel, preferences=preferences, **thresholds)
        keras.utils.set_random_seed(1)
        initial = keras.Model(*_inputs_and_outputs(name)).get_weights()
        loss, weights, used = _train(name, chooser, initial, COMPILED)
        if name == "dropout" and backend.preferences().dropout_kernel:
            expected_loss, expected, _ = _train(name, chooser, initial, COMPILED)
        else:
            expected_loss, expected, _ = _train(
                name, _explicit_choice, initial, COMPILED and name == "dropout"
            )
        if not EXPECTED[name] <= used:
            raise AssertionError(f"{name}: kernels {used}, expected {EXPECTED[name]}")
        if not np.isfinite(loss) or not np.isclose(loss, expected_loss, rtol=1e-4, atol=1e-6):
            raise AssertionError(f"{name}: loss {loss}, explicit kernel {expected_loss}")
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, expected))
        changed = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, initial))
        if diff > 1e-4 or changed == 0.0:
            raise AssertionError(f"{name}: weights differ by {diff}, changed by {changed}")
        print(f"{name}: kernels={','.join(sorted(used))} max_diff={diff:.2e}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
