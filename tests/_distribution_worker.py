"""Runs in a fresh process with several CPU devices (see test_distribution.py).

    python tests/_distribution_worker.py jax      # 4 virtual devices
    python tests/_distribution_worker.py tensorflow  # 2 logical devices

Prints one JSON line of measured differences against one device: the
test reads them. Every check builds the same small models with the same
weights on one device and under a distribution.
"""

import json
import os
import sys

BACKEND = sys.argv[1]
os.environ["KERAS_BACKEND"] = BACKEND
if BACKEND == "jax":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import numpy as np  # noqa: E402

if BACKEND == "tensorflow":
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )

import keras  # noqa: E402

from keras_attention.models import GPT  # noqa: E402
from keras_attention.models import Seq2SeqTransformer  # noqa: E402

V, LENGTH, BATCH = 32, 8, 4
rng = np.random.default_rng(0)
IDS = rng.integers(1, V, (BATCH, LENGTH + 1)).astype("int32")
X, Y = IDS[:, :-1], IDS[:, 1:]


def gpt():
    return GPT(
        vocabulary_size=V, max_sequence_length=16, num_layers=2, num_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0,
    )


def seq2seq():
    return Seq2SeqTransformer(
        V, V, 16, 16, num_encoder_layers=1, num_decoder_layers=1, num_heads=4,
        hidden_dim=16, intermediate_dim=32, dropout=0.0, positions="learned",
    )


def initial_weights(make, inputs):
    model = make()
    model(inputs)
    return [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]


def compiled(make, inputs, weights):
    model = make()
    model(inputs)
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def step(model, inputs):
    """The logits, one training step's loss and the weights after it."""
    logits = np.asarray(keras.ops.convert_to_numpy(model(inputs)))
    loss = float(model.train_on_batch(inputs, Y))
    weights = [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]
    return logits, loss, weights


def differences(one, many):
    (logits, loss, weights), (logits_d, loss_d, weights_d) = one, many
    return {
        "logits": float(np.max(np.abs(logits - logits_d))),
        "loss": abs(loss - loss_d),
        "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(weights, weights_d)),
        "moved": max(float(np.max(np.abs(a - b))) for a, b in zip(weights, WEIGHTS[id(weights)])),
    }


WEIGHTS = {}


def single(make, inputs, weights):
    result = step(compiled(make, inputs, weights), inputs)
    WEIGHTS[id(result[2])] = weights  # to report how far the step moved them
    return result


def generated(model, name):
    """What the model generates: greedy for GPT, 2-beam for the translator."""
    if name == "gpt":
        return model.generate(X[:, :3], max_new_tokens=5)
    return model.generate(X[:, :5], 4, start_token_id=1, sampling="beam", num_beams=2)


def run_jax():
    from keras.distribution import DataParallel
    from keras.distribution import DeviceMesh
    from keras.distribution import ModelParallel
    from keras.distribution import list_devices

    report = {"devices": len(list_devices())}
    seq_inputs = {"encoder_token_ids": X, "decoder_token_ids": X}
    for name, make, inputs in (("gpt", gpt, X), ("seq2seq", seq2seq, seq_inputs)):
        weights = initial_weights(make, inputs)
        expected_tokens = generated(compiled(make, inputs, weights), name)
        one = single(make, inputs, weights)
        with DataParallel(devices=list_devices()).scope():
            model = compiled(make, inputs, weights)
            report[f"{name}_data_generate_equal"] = bool(
                np.array_equal(generated(model, name), expected_tokens)
            )
            report[f"{name}_data"] = differences(one, step(model, inputs))
        mesh = DeviceMesh((2, 2), ("batch", "model"), list_devices())
        layout_map = type(make()).get_layout_map(mesh)
        with ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
            model = compiled(make, inputs, weights)
            report[f"{name}_shardings"] = {
                v.path: str(v.value.sharding.spec) for v in model.weights
            }
            report[f"{name}_model_generate_equal"] = bool(
                np.array_equal(generated(model, name), expected_tokens)
            )
            report[f"{name}_model"] = differences(one, step(model, inputs))
    return report


def run_tensorflow():
    report = {"devices": len(tf.config.list_logical_devices("CPU"))}
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    report["replicas"] = strategy.num_replicas_in_sync
    weights = initial_weights(gpt, X)
    one = single(gpt, X, weights)
    with strategy.scope():
        model = compiled(gpt, X, weights)
    report["gpt_data"] = differences(one, step(model, X))
    return report


if __name__ == "__main__":
    report = run_jax() if BACKEND == "jax" else run_tensorflow()
    print("REPORT " + json.dumps(report))
