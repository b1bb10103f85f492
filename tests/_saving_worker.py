"""Models and the subprocess worker of `test_saving.py`.

The pytest process imports this module to build the models, gives them random
weights, saves them and their inputs, then runs this file as a script in fresh
processes:

    python _saving_worker.py keras_file WORKDIR
        (same backend) `keras.saving.load_model(model.keras)` with the default
        `safe_mode=True` and no `custom_objects`; only `import keras_attention`
        registers the classes.
    python _saving_worker.py cross WORKDIR
        (another backend, chosen by `KERAS_BACKEND`) rebuilds every model with
        the builders below and loads `model.weights.h5`; also loads
        `model.keras`.

`WORKDIR` holds one folder per model: `model.keras`, `model.weights.h5` and
`inputs/<name>.npy`. A task writes `WORKDIR/results/<task>-<backend>/<model>/`:
`outputs/<name>.npy`, `weights.npz` (every variable, in `model.weights` order)
and `meta.json` (layer records and weight paths, or the traceback of a
failure). A failing task is recorded and the worker goes on, so one run
reports every problem.
"""

import json
import os
import sys
import traceback

import keras
import numpy as np

import harness
import keras_attention  # noqa: F401  (registers the classes for loading)
from keras_attention import layers
from keras_attention import scoring

VOCABULARY_SIZE = 16
DIM = 8
BATCH, QUERY_LENGTH, KEY_LENGTH = 3, 6, 7


def build_encoder_decoder():
    """SoftAttention with every scorer over a causal SelfAttention.

    Token queries and a token memory share a `mask_zero=True` embedding, so
    the Keras implicit masks reach every attention layer. The `dot` branch
    also takes an explicit boolean attention mask input; the `bilinear` branch
    runs in key-value mode with keys of another size.
    """
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    memory = keras.Input((None,), dtype="int32", name="memory")
    allowed = keras.Input((None, None), dtype="bool", name="allowed")
    embedding = keras.layers.Embedding(
        VOCABULARY_SIZE, DIM, mask_zero=True, name="embedding"
    )
    x = embedding(tokens)  # (B, T, D)
    m = embedding(memory)  # (B, S, D)
    h = layers.SelfAttention(DIM, name="self_attention")(x, use_causal_mask=True)
    keys = keras.layers.Dense(5, name="key_projection")(m)  # (B, S, 5)
    outputs = {}
    outputs["dot"] = layers.SoftAttention("dot", name="dot")(
        h, m, attention_mask=allowed
    )
    outputs["scaled_dot"] = layers.SoftAttention(
        scoring.ScaledDotProduct(scale=0.3), name="scaled_dot"
    )(h, m)
    outputs["additive"], outputs["additive_weights"] = layers.SoftAttention(
        scoring.Additive(units=6), name="additive"
    )(h, m, return_attention_scores=True)
    outputs["bilinear"], outputs["bilinear_weights"] = layers.SoftAttention(
        "bilinear", dropout=0.25, seed=3, name="bilinear"
    )(h, m, key=keys, return_attention_scores=True)
    inputs = {"tokens": tokens, "memory": memory, "allowed": allowed}
    return keras.Model(inputs, outputs, name="encoder_decoder")


def build_self_attention_stack():
    """Two SelfAttention layers with weighted scorers, then masked pooling."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(
        VOCABULARY_SIZE, DIM, mask_zero=True, name="embedding"
    )(tokens)
    x = layers.SelfAttention(
        6, score="additive", dropout=0.1, seed=7, name="additive_self_attention"
    )(x)
    x, weights = layers.SelfAttention(
        4, score="bilinear", use_bias=False, name="bilinear_self_attention"
    )(x, use_causal_mask=True, return_attention_scores=True)
    # The pooling reads the mask that the attention layers propagate.
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = {"sequence": x, "weights": weights, "pooled": pooled}
    return keras.Model({"tokens": tokens}, outputs, name="self_attention_stack")


BUILDERS = {
    "encoder_decoder": build_encoder_decoder,
    "self_attention_stack": build_self_attention_stack,
}


def make_inputs(name):
    """Deterministic inputs with padding and fully masked rows."""
    tokens = np.array(
        [
            [3, 5, 7, 2, 9, 4],
            [1, 2, 3, 4, 0, 0],  # two padded queries
            [0, 6, 8, 15, 11, 0],  # padding at both ends
        ],
        dtype="int32",
    )
    if name == "self_attention_stack":
        return {"tokens": tokens}
    memory = np.array(
        [
            [2, 4, 6, 8, 10, 12, 14],
            [5, 3, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0],  # nothing to attend to
        ],
        dtype="int32",
    )
    rng = np.random.default_rng(1)
    allowed = rng.random((BATCH, QUERY_LENGTH, KEY_LENGTH)) < 0.6
    allowed[0, 2, :] = False  # one query row fully masked
    return {"tokens": tokens, "memory": memory, "allowed": allowed}


def randomize_weights(model, seed=0):
    """Gives every float variable (biases included) a random value."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        if "float" in dtype:
            value = rng.normal(scale=0.5, size=tuple(variable.shape))
            variable.assign(value.astype(dtype))


def predict(model, inputs):
    """The model's outputs on `inputs` in one batch, as numpy arrays."""
    outputs = model.predict(inputs, batch_size=BATCH, verbose=0)
    return {name: np.asarray(value) for name, value in outputs.items()}


def _jsonable(value):
    return json.loads(json.dumps(value, default=repr))


def _class_name(obj):
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_records(model):
    """Class, registered name, config and scorer of each layer, as JSON data."""
    records = {}
    for layer in model.layers:
        record = {
            "class": _class_name(layer),
            "registered_name": keras.saving.get_registered_name(type(layer)),
            "config": layer.get_config(),
        }
        score = getattr(layer, "score", None)
        if score is not None:
            record["score"] = {
                "class": _class_name(score),
                "registered_name": keras.saving.get_registered_name(type(score)),
                "config": score.get_config(),
            }
        records[layer.name] = record
    return _jsonable(records)


def weight_paths(model):
    return [variable.path for variable in model.weights]


def weight_values(model):
    return [harness.to_numpy(v) for v in model.weights]


def load_inputs(model_dir):
    folder = os.path.join(model_dir, "inputs")
    return {
        name[: -len(".npy")]: np.load(os.path.join(folder, name))
        for name in sorted(os.listdir(folder))
    }


def write_result(out_dir, model, outputs, error=None):
    """Writes the outputs, weights and metadata of one task."""
    os.makedirs(os.path.join(out_dir, "outputs"), exist_ok=True)
    meta = {"backend": keras.backend.backend(), "error": error}
    if model is not None:
        meta["layers"] = layer_records(model)
        meta["weight_paths"] = weight_paths(model)
        values = weight_values(model)
        np.savez(
            os.path.join(out_dir, "weights.npz"),
            **{str(i): value for i, value in enumerate(values)},
        )
    for name, value in (outputs or {}).items():
        np.save(os.path.join(out_dir, "outputs", f"{name}.npy"), value)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f)


def build(name):
    """Builds model `name` with fresh layer names, as a new process would."""
    keras.backend.clear_session()
    return BUILDERS[name]()


def _load_keras_file(model_dir, name):
    # The default safe_mode (True) and no custom_objects: the classes are
    # found through their registration by `import keras_attention`.
    keras.backend.clear_session()
    return keras.saving.load_model(os.path.join(model_dir, "model.keras"))


def _rebuild_and_load_weights(model_dir, name):
    model = build(name)
    model.load_weights(os.path.join(model_dir, "model.weights.h5"))
    return model


TASKS = {
    "keras_file": [("keras_file", _load_keras_file)],
    "cross": [
        ("cross_weights", _rebuild_and_load_weights),
        ("cross_keras_file", _load_keras_file),
    ],
}


def run(mode, workdir):
    backend = keras.backend.backend()
    for task, load in TASKS[mode]:
        for name in BUILDERS:
            model_dir = os.path.join(workdir, name)
            out_dir = os.path.join(workdir, "results", f"{task}-{backend}", name)
            model = outputs = None
            try:
                model = load(model_dir, name)
                outputs = predict(model, load_inputs(model_dir))
                write_result(out_dir, model, outputs)
            except Exception:
                error = traceback.format_exc()
                print(f"[{task}-{backend}/{name}]\n{error}", file=sys.stderr)
                try:
                    write_result(out_dir, model, outputs, error=error)
                except Exception:
                    write_result(out_dir, None, None, error=error)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
