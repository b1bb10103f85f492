"""`.keras` files saved by an earlier version of the package still work.

`tests/data/legacy/` holds small models saved under TensorFlow by
`make_legacy_files.py` at a fixed commit (see its README), with their inputs
and inference-mode outputs. On the backend of this run (`KERAS_BACKEND`),
each file must:

1. load with `keras.saving.load_model`, default `safe_mode=True`, no
   `custom_objects` (only `import keras_attention`), and give the stored
   outputs; HardAttention's argmax selection and selected values exactly;
2. keep the constructor arguments the file was made with (scorers included);
3. save and load again: the same config and the same outputs.

Unlike `test_saving.py`, which saves and loads with the current code, these
files are never regenerated with it: they check that what an older version
wrote keeps loading.
"""

import json
import zipfile

import keras
import numpy as np
import pytest

import harness
import keras_attention  # noqa: F401  (registers the classes for loading)
from keras_attention import layers
from keras_attention import scoring

DATA = harness.ROOT / "tests" / "data" / "legacy"
TOLERANCE = 1e-5
# Outputs that must match bit for bit: the one-hot selection, and the
# selected values (copies of the stored encoder inputs).
EXACT = {"decoder_block_hard": ("output", "selection")}

# The arguments each file's layers were made with, by layer name (None: the
# model itself). "score" is compared as the scorer class it resolves to.
ARGUMENTS = {
    "gpt": {
        None: dict(
            vocabulary_size=23,
            max_sequence_length=16,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
        ),
    },
    "functional_mha_encoder_soft": {
        "multi_head_attention": dict(num_heads=2, key_dim=4, score="Bilinear"),
        "encoder": dict(num_layers=2, intermediate_dim=16, num_heads=2),
        "soft_attention": dict(score="ScaledDotProduct"),
        "self_attention": dict(units=8, score="Additive"),
    },
    "decoder_block_hard": {
        "decoder_block": dict(intermediate_dim=16, num_heads=2),
        "hard_attention": dict(score="DotProduct", selection="argmax"),
    },
    "rotary_gqa_decoder": {
        "decoder": dict(
            num_layers=2,
            intermediate_dim=16,
            num_heads=2,
            num_key_value_heads=1,
            use_rotary_embedding=True,
            normalize_first=True,
        ),
    },
    "transformer_stacks": {
        "encoder_stack": dict(num_layers=2, intermediate_dim=16, num_heads=2),
        "decoder_stack": dict(num_layers=2, intermediate_dim=16, num_heads=2),
    },
}
NAMES = sorted(ARGUMENTS)
# Names that meant the stacks when the files were saved, and now mean one
# block as in KerasHub: a config with `num_layers` under them loads as the
# stack, of a subclass that keeps the old class name (the weights file's
# paths follow it), registered apart.
RENAMED = {
    "keras_attention>TransformerEncoder": "keras_attention_legacy>TransformerEncoder",
    "keras_attention>TransformerDecoder": "keras_attention_legacy>TransformerDecoder",
}


def _load_arrays(name):
    """The stored inputs and outputs of file `name`, as two dicts."""
    with np.load(DATA / f"{name}.npz") as data:
        arrays = {key: data[key] for key in data.files}
    split = {"input": {}, "output": {}}
    for key, value in arrays.items():
        kind, _, array_name = key.partition(".")
        split[kind][array_name] = value
    return split["input"], split["output"]


def _run(model, inputs):
    """Inference-mode outputs as a dict of numpy arrays (`output` if single)."""
    args = next(iter(inputs.values())) if len(inputs) == 1 else inputs
    result = model(args, training=False)
    if not isinstance(result, dict):
        result = {"output": result}
    return {key: harness.to_numpy(value) for key, value in result.items()}


def _load(path):
    return keras.saving.load_model(path)


def _without_object_ids(config):
    """A config without Keras's `shared_object_id`s (they differ per process)."""
    if isinstance(config, dict):
        return {
            k: _without_object_ids(v)
            for k, v in config.items()
            if k != "shared_object_id"
        }
    if isinstance(config, list):
        return [_without_object_ids(v) for v in config]
    return config


def _stored_config(name):
    with zipfile.ZipFile(DATA / f"{name}.keras") as archive:
        return json.loads(archive.read("config.json"))


def _assert_outputs(name, got, expected, tolerance=TOLERANCE):
    assert sorted(got) == sorted(expected), name
    for key, want in expected.items():
        have = got[key]
        message = f"{name}: output {key!r} on {keras.backend.backend()}"
        assert have.shape == want.shape, message
        assert have.dtype == want.dtype, message
        if key in EXACT.get(name, ()):
            np.testing.assert_array_equal(have, want, err_msg=message)
        else:
            np.testing.assert_allclose(
                have, want, rtol=tolerance, atol=tolerance, err_msg=message
            )


def test_every_file_is_tested():
    files = sorted(p.stem for p in DATA.glob("*.keras"))
    assert files == NAMES
    assert sorted(p.stem for p in DATA.glob("*.npz")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_legacy_file_gives_stored_outputs(name):
    model = _load(DATA / f"{name}.keras")
    inputs, expected = _load_arrays(name)
    _assert_outputs(name, _run(model, inputs), expected)


@pytest.mark.parametrize("name", NAMES)
def test_legacy_file_keeps_its_arguments(name):
    model = _load(DATA / f"{name}.keras")
    stored = _stored_config(name)
    assert stored["registered_name"] in ("Functional", "keras_attention>GPT")
    for layer_name, arguments in ARGUMENTS[name].items():
        layer = model if layer_name is None else model.get_layer(layer_name)
        if layer_name is None:
            registered = stored["registered_name"]
        else:
            (record,) = [
                r for r in stored["config"]["layers"] if r["name"] == layer_name
            ]
            registered = record["registered_name"]
        # The class the file names is still the one that loads it (the
        # stacks under their new names).
        loaded = keras.saving.get_registered_name(type(layer))
        assert loaded == RENAMED.get(registered, registered)
        assert registered.startswith("keras_attention>")
        config = layer.get_config()
        for key, want in arguments.items():
            have = config[key]
            if key == "score":
                have = type(scoring.get(have)).__name__
            assert have == want, f"{name}: {layer_name}.{key}"


def test_stacks_saved_under_their_old_names_load_as_stacks():
    stored = _stored_config("transformer_stacks")["config"]["layers"]
    names = {r["name"]: r["registered_name"] for r in stored}
    assert names["encoder_stack"] == "keras_attention>TransformerEncoder"
    assert names["decoder_stack"] == "keras_attention>TransformerDecoder"
    model = _load(DATA / "transformer_stacks.keras")
    encoder = model.get_layer("encoder_stack")
    decoder = model.get_layer("decoder_stack")
    assert isinstance(encoder, layers.TransformerEncoderStack)
    assert isinstance(decoder, layers.TransformerDecoderStack)
    assert type(encoder).__name__ == "TransformerEncoder"
    assert [len(encoder.blocks), len(decoder.blocks)] == [2, 2]
    assert all(type(b) is layers.TransformerDecoderBlock for b in decoder.blocks)
    # The old names now mean one block, as in KerasHub.
    assert issubclass(layers.TransformerEncoder, layers.TransformerEncoderBlock)
    assert issubclass(layers.TransformerDecoder, layers.TransformerDecoderBlock)


@pytest.mark.parametrize("name", NAMES)
def test_legacy_file_saves_and_loads_again(name, tmp_path):
    model = _load(DATA / f"{name}.keras")
    config = _without_object_ids(keras.saving.serialize_keras_object(model))
    # The config alone rebuilds a model with the same config.
    rebuilt = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(model)
    )
    assert type(rebuilt) is type(model)
    assert _without_object_ids(rebuilt.get_config()) == config["config"]
    # Saved by this version, it loads with the same config and outputs.
    path = tmp_path / f"{name}.keras"
    model.save(path)
    again = _load(path)
    assert _without_object_ids(keras.saving.serialize_keras_object(again)) == config
    inputs, expected = _load_arrays(name)
    first = _run(model, inputs)
    _assert_outputs(name, _run(again, inputs), first, tolerance=1e-6)
    _assert_outputs(name, first, expected)

