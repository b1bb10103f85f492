"""Runs in a fresh process with several CPU devices (see test_distribution.py).

    python tests/_distribution_worker.py jax      # 4 virtual devices
    python tests/_distribution_worker.py tensorflow  # 2 logical devices

Prints one JSON line of measured differences against one device: the
test reads them. Every check builds the same small models with the same
weights on one device and under a distribution; the kernels (blocked,
chunked, fused with a padding mask) and hard attention's sampling run on
inputs split over the devices (batch and heads) against the same inputs on
one device.
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

from keras_attention.kernels import choice as kernel_choice  # noqa: E402
from keras_attention.kernels import fused as fused_kernels  # noqa: E402
from keras_attention.layers import HardAttention  # noqa: E402
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


# The kernels: (B, T, H, K) heads, 4 query heads reading 2 key/value heads.
HEADS = rng.normal(size=(3, BATCH, 32, 4, 8)).astype("float32")
HEADS[1:, :, :, 2:] = HEADS[1:, :, :, :2]  # k, v: (B, S, 2, K) after the slice
COTANGENT = rng.normal(size=(BATCH, 32, 4, 8)).astype("float32")
PADDING = np.ones((BATCH, 1, 1, 32), bool)
PADDING[1, ..., 20:] = PADDING[3, ..., 5:] = False
KERNEL_CASES = {
    # name: (choice, mask, causal flag)
    "blocked_causal": (kernel_choice.Choice(kernel_choice.BLOCKED, 6), None, True),
    "chunked_causal": (
        kernel_choice.Choice(kernel_choice.CHUNKED, 5, chunk_size=8, guard_with_cond=False),
        None, True,
    ),
    "chunked_padding": (
        kernel_choice.Choice(kernel_choice.CHUNKED, 5, chunk_size=8, guard_with_cond=False),
        PADDING, False,
    ),
    "fused_padding": (kernel_choice.Choice(kernel_choice.FUSED, 7), PADDING, False),
}


def kernel_loss(case, q, k, v, cotangent, mask):
    choice, _, causal = KERNEL_CASES[case]
    output = fused_kernels.attend(choice, q, k, v, mask, 8**-0.5, causal)
    return keras.ops.sum(output * cotangent), output


def kernel_inputs():
    q, k, v = HEADS
    return q, k[:, :, :2], v[:, :, :2]


def kernel_differences(one, many):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(one, many))


def hard_attention_model(inference_selection="sample"):
    query = keras.Input((6, 8))
    value = keras.Input((10, 8))
    layer = HardAttention(
        selection="sample", inference_selection=inference_selection, seed=5
    )
    return keras.Model([query, value], layer(query, value))


HARD_INPUTS = [rng.normal(size=(BATCH, 6, 8)).astype("float32"),
               rng.normal(size=(BATCH, 10, 8)).astype("float32")]


def hard_selections_valid(output):
    """Every output row is one of its example's value rows."""
    values = HARD_INPUTS[1]
    distances = np.abs(output[:, :, None, :] - values[:, None, :, :]).max(-1)  # (B, T, S)
    return bool((distances.min(-1) < 1e-6).all())


def run_jax_kernels(report):
    import jax
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("batch", "model"))
    heads = NamedSharding(mesh, PartitionSpec("batch", None, "model", None))
    rows = NamedSharding(mesh, PartitionSpec("batch"))
    for case, (_, mask, _) in KERNEL_CASES.items():
        def loss(q, k, v, cotangent, mask, case=case):
            return kernel_loss(case, q, k, v, cotangent, mask)

        run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        q, k, v = kernel_inputs()
        (_, out), grads = run(q, k, v, COTANGENT, mask)
        placed = [jax.device_put(x, heads) for x in (q, k, v, COTANGENT)]
        placed_mask = None if mask is None else jax.device_put(mask, rows)
        (_, out_d), grads_d = run(*placed, placed_mask)
        report[f"kernel_{case}"] = {
            "output": kernel_differences([out], [out_d]),
            "gradients": kernel_differences(grads, grads_d),
            "sharded": str(out_d.sharding.spec),
        }
    expected = hard_attention_model().predict(HARD_INPUTS, verbose=0)
    from keras.distribution import DataParallel
    from keras.distribution import list_devices

    with DataParallel(devices=list_devices()).scope():
        output = hard_attention_model().predict(HARD_INPUTS, verbose=0)
    report["hard_attention_data"] = {
        "equal": bool(np.array_equal(output, expected)),
        "valid": hard_selections_valid(output),
        "sampled": not np.array_equal(output, hard_attention_model("argmax").predict(
            HARD_INPUTS, verbose=0)),
    }


def run_tensorflow_kernels(report, strategy):
    replicas = strategy.num_replicas_in_sync
    share = BATCH // replicas

    def split(x):
        return strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(x[context.replica_id_in_sync_group * share:][:share])
        )

    for case, (_, mask, _) in KERNEL_CASES.items():
        def run(q, k, v, cotangent, mask, case=case):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                loss, out = kernel_loss(case, q, k, v, cotangent, mask)
            return (out, *tape.gradient(loss, [q, k, v]))

        q, k, v = kernel_inputs()
        one = tf.function(run)(q, k, v, COTANGENT, mask)
        inputs = [split(x) for x in (q, k, v, COTANGENT)]
        inputs.append(None if mask is None else split(mask))
        many = strategy.run(tf.function(run), args=tuple(inputs))
        many = [strategy.gather(x, axis=0) for x in many]
        report[f"kernel_{case}"] = {
            "output": kernel_differences(one[:1], many[:1]),
            "gradients": kernel_differences(one[1:], many[1:]),
        }
    with strategy.scope():
        model = hard_attention_model()
    output = model.predict(HARD_INPUTS, verbose=0, batch_size=BATCH)
    report["hard_attention_data"] = {"valid": hard_selections_valid(output)}


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
    run_jax_kernels(report)
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
    run_tensorflow_kernels(report, strategy)
    return report


if __name__ == "__main__":
    report = run_jax() if BACKEND == "jax" else run_tensorflow()
    print("REPORT " + json.dumps(report))
