"""Writes the `.keras` files that `tests/test_legacy_files.py` loads.

Each model is small (a few KB), built with fixed seeds, given random weights
(biases and norm parameters included, so a weight loaded into the wrong
variable changes the outputs) and saved as `<name>.keras` (its archive
members then compressed: uncompressed, the files are 75-130 KB), next to
`<name>.npz`: its inputs (`input.<name>`) and its inference-mode outputs
(`output.<name>`). `README.md` records the commit, backend and Keras version.

The files pin the behaviour of one version of the package, so run this from a
clean checkout of that version, with that checkout first on the path:

    cd CHECKOUT && PYTHONPATH=CHECKOUT KERAS_BACKEND=tensorflow \\
        python tests/data/legacy/make_legacy_files.py --out tests/data/legacy

The script stops if the imported `keras_attention` is not the one under the
current directory, or if that checkout has uncommitted changes to the package.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import zipfile

import keras
import numpy as np

import keras_attention
from keras_attention import layers

DIM = 8
WEIGHT_SCALE = 0.3
# The smallest accepted gap between the best and second-best HardAttention
# score of a query: a near tie could select differently on another backend.
MIN_ARGMAX_GAP = 1e-2


def randomize_weights(model, seed):
    """Gives every float variable a random value (norm scales around 1)."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        if "float" not in dtype:
            continue
        value = rng.normal(scale=WEIGHT_SCALE, size=tuple(variable.shape))
        if variable.path.endswith(("/gamma", "/scale")):
            value += 1.0
        variable.assign(value.astype(dtype))


def _outputs(result):
    """A model's result as a dict of numpy arrays."""
    if not isinstance(result, dict):
        result = {"output": result}
    return {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in result.items()}


def run(model, inputs):
    """The model on `inputs` (a dict) in inference mode, as numpy arrays."""
    args = next(iter(inputs.values())) if len(inputs) == 1 else inputs
    return _outputs(model(args, training=False))


def make_gpt(rng):
    model = keras_attention.models.GPT(
        vocabulary_size=23,
        max_sequence_length=16,
        num_layers=2,
        num_heads=2,
        hidden_dim=DIM,
        intermediate_dim=16,
    )
    inputs = {"token_ids": rng.integers(0, 23, size=(2, 7)).astype("int32")}
    model(inputs["token_ids"])
    return model, inputs


def make_functional_mha_encoder_soft(rng):
    sequence = keras.Input((None, DIM), name="sequence")
    x = layers.MultiHeadAttention(
        num_heads=2, key_dim=4, score="bilinear", name="multi_head_attention"
    )(sequence, sequence, use_causal_mask=True)
    x = layers.TransformerEncoderStack(
        num_layers=2, intermediate_dim=16, num_heads=2, name="encoder"
    )(x)
    soft = layers.SoftAttention(name="soft_attention")(x, sequence)
    self_attention = layers.SelfAttention(
        units=DIM, score="additive", name="self_attention"
    )(sequence)
    model = keras.Model(
        sequence,
        {"soft_attention": soft, "self_attention": self_attention},
        name="functional_mha_encoder_soft",
    )
    # Inputs of scale 2, so that the attention weights are far from uniform.
    inputs = {"sequence": rng.normal(scale=2.0, size=(2, 6, DIM)).astype("float32")}
    return model, inputs


def make_decoder_block_hard(rng):
    decoder_sequence = keras.Input((None, DIM), name="decoder_sequence")
    encoder_sequence = keras.Input((None, DIM), name="encoder_sequence")
    x = layers.TransformerDecoderBlock(
        intermediate_dim=16, num_heads=2, name="decoder_block"
    )(decoder_sequence, encoder_sequence)
    output, probabilities, selection = layers.HardAttention(
        score="dot", selection="argmax", name="hard_attention"
    )(x, encoder_sequence, return_attention_scores=True)
    model = keras.Model(
        {"decoder_sequence": decoder_sequence, "encoder_sequence": encoder_sequence},
        {"output": output, "probabilities": probabilities, "selection": selection},
        name="decoder_block_hard",
    )
    inputs = {
        "decoder_sequence": rng.normal(size=(2, 5, DIM)).astype("float32"),
        "encoder_sequence": rng.normal(size=(2, 6, DIM)).astype("float32"),
    }
    return model, inputs


def make_rotary_gqa_decoder(rng):
    sequence = keras.Input((None, DIM), name="sequence")
    output = layers.TransformerDecoderStack(
        num_layers=2,
        intermediate_dim=16,
        num_heads=2,
        num_key_value_heads=1,
        use_rotary_embedding=True,
        normalize_first=True,
        name="decoder",
    )(sequence)
    model = keras.Model(sequence, output, name="rotary_gqa_decoder")
    inputs = {"sequence": rng.normal(size=(2, 7, DIM)).astype("float32")}
    return model, inputs


def make_transformer_stacks(rng):
    source = keras.Input((None, DIM), name="source")
    target = keras.Input((None, DIM), name="target")
    encoded = layers.TransformerEncoderStack(
        num_layers=2, intermediate_dim=16, num_heads=2, name="encoder_stack"
    )(source)
    decoded = layers.TransformerDecoderStack(
        num_layers=2, intermediate_dim=16, num_heads=2, name="decoder_stack"
    )(target, encoded)
    model = keras.Model(
        {"source": source, "target": target},
        {"encoded": encoded, "decoded": decoded},
        name="transformer_stacks",
    )
    inputs = {
        "source": rng.normal(size=(2, 6, DIM)).astype("float32"),
        "target": rng.normal(size=(2, 5, DIM)).astype("float32"),
    }
    return model, inputs


BUILDERS = {
    "gpt": (make_gpt, "`keras_attention.models.GPT`, 2 blocks, width 8, "
            "vocabulary 23; input token ids `(2, 7)`, output logits."),
    "functional_mha_encoder_soft": (
        make_functional_mha_encoder_soft,
        "functional: causal `MultiHeadAttention` (bilinear scorer) -> "
        "`TransformerEncoderStack` (2 blocks) -> `SoftAttention` (query: encoder "
        "output, value: the input); `SelfAttention(units=8)` (additive "
        "scorer) on the input; outputs of both attention layers.",
    ),
    "decoder_block_hard": (
        make_decoder_block_hard,
        "functional, two inputs: `TransformerDecoderBlock` with "
        "cross-attention -> `HardAttention(score=\"dot\", "
        "selection=\"argmax\")` from the block output to the encoder "
        "sequence; outputs the selected values, probabilities and one-hot "
        "selection.",
    ),
    "rotary_gqa_decoder": (
        make_rotary_gqa_decoder,
        "functional: pre-norm `TransformerDecoderStack` (2 blocks, decoder-only) "
        "with rotary embeddings and one key/value head (GQA).",
    ),
    "transformer_stacks": (
        make_transformer_stacks,
        "functional, two inputs: a post-norm `TransformerEncoderStack` "
        "(2 blocks) whose output a `TransformerDecoderStack` (2 blocks, "
        "cross-attention) reads; outputs of both stacks.",
    ),
}


def deflate(path):
    """Rewrites the `.keras` archive `path` with its members compressed.

    `model.save` stores them uncompressed, and the HDF5 weights file of a
    tiny model is mostly padding; the members' bytes are kept as they are.
    """
    with zipfile.ZipFile(path) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in members:
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data, compresslevel=9)


def check_argmax_gaps(name, inputs, outputs):
    """Fails on a near tie among the HardAttention scores (log-probabilities)."""
    if "selection" not in outputs:
        return
    with np.errstate(divide="ignore"):
        log_p = np.log(outputs["probabilities"].astype("float64"))
    top2 = np.sort(log_p, axis=-1)[..., -2:]
    gap = float(np.min(top2[..., 1] - top2[..., 0]))
    if gap < MIN_ARGMAX_GAP:
        sys.exit(f"{name}: HardAttention score gap {gap:.2e} < {MIN_ARGMAX_GAP}")


def _git(checkout, *args):
    return subprocess.run(
        ["git", "-C", str(checkout), *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def check_source(checkout):
    package = pathlib.Path(keras_attention.__file__).resolve().parent
    if checkout not in package.parents:
        sys.exit(
            f"keras_attention is imported from {package}, not from under the "
            f"current directory {checkout}; set PYTHONPATH={checkout}"
        )
    if _git(checkout, "status", "--porcelain", "--", "keras_attention"):
        sys.exit(f"{checkout}/keras_attention has uncommitted changes")
    return _git(checkout, "rev-parse", "HEAD")


README = """\
# Models saved by an earlier version of keras_attention

`tests/test_legacy_files.py` loads these files with
`keras.saving.load_model` (default `safe_mode=True`, no `custom_objects`)
under every backend and checks that they give the stored outputs. They are
not regenerated when the package changes: they pin what files saved by
this version must keep doing.

- Package commit: `{commit}`
- Saved under the `{backend}` backend, Keras {keras_version}, NumPy
  {numpy_version}, Python {python_version}.
- Each model: `<name>.keras` (`model.save`, then the archive rewritten
  with its members deflate-compressed, their bytes unchanged) and
  `<name>.npz`, with its inputs (`input.<name>`, fixed random numpy arrays)
  and the saved model's outputs on them in inference mode
  (`output.<name>`). Every weight is random
  (normal, scale {scale}; norm scales around 1).

| File | Size | Model |
| --- | --- | --- |
{rows}

Regenerate (only on purpose: the point of the files is that they are old),
from a clean checkout of the version to pin:

    cd CHECKOUT && PYTHONPATH=CHECKOUT KERAS_BACKEND=tensorflow \\
        python tests/data/legacy/make_legacy_files.py --out tests/data/legacy
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    checkout = pathlib.Path(os.getcwd()).resolve()
    commit = check_source(checkout)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for index, (name, (builder, description)) in enumerate(BUILDERS.items()):
        keras.backend.clear_session()
        keras.utils.set_random_seed(1000 + index)
        model, inputs = builder(np.random.default_rng(index))
        randomize_weights(model, seed=index)
        expected = run(model, inputs)
        check_argmax_gaps(name, inputs, expected)
        path = out / f"{name}.keras"
        model.save(path)
        deflate(path)
        # The outputs stored are those of the saved file.
        reloaded = keras.saving.load_model(path)
        outputs = run(reloaded, inputs)
        for key, value in expected.items():
            np.testing.assert_array_equal(outputs[key], value, err_msg=key)
        arrays = {f"input.{k}": v for k, v in inputs.items()}
        arrays.update({f"output.{k}": v for k, v in outputs.items()})
        np.savez(out / f"{name}.npz", **arrays)
        sizes = [os.path.getsize(out / f"{name}{s}") for s in (".keras", ".npz")]
        rows.append(
            f"| `{name}.keras`, `.npz` | {sizes[0] / 1024:.0f} KB, "
            f"{sizes[1] / 1024:.0f} KB | {description} |"
        )
        print(f"{name}: {sizes[0]} + {sizes[1]} bytes")

    (out / "README.md").write_text(
        README.format(
            commit=commit,
            backend=keras.backend.backend(),
            keras_version=keras.__version__,
            numpy_version=np.__version__,
            python_version=".".join(map(str, sys.version_info[:3])),
            scale=WEIGHT_SCALE,
            rows="\n".join(rows),
        )
    )


if __name__ == "__main__":
    main()
