"""Tests of `TransformerEncoderStack` and `TransformerDecoderStack`, and of saving the
blocks and stacks.

Shape legend: `B` batch, `T` decoder length, `S` encoder length, `L` cache
length, `D` model width, `H` heads, `G` key/value heads, `K` head size, `N`
blocks.

A functional model built of all four layers (`saving_model`) checks that
they work at several lengths, fit on `tf.data`, and save: the `.keras` file
loads with the default `safe_mode=True`, in this process and in a fresh one
under another backend (`LOADING_BACKEND`), with the same weights and outputs;
the `.weights.h5` file loads there into the model rebuilt by the same code.
The fresh process runs this file's `_WORKER` script; it starts with the first
saving test and is collected by the last tests of this file, so it runs while
the others do.
"""

import os
import re
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import harness
from keras_attention.layers import TransformerDecoderStack
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerEncoderStack
from keras_attention.layers import TransformerEncoderBlock
from test_transformer_decoder_block import S
from test_transformer_decoder_block import decode
from test_transformer_decoder_block import empty_cache
from test_transformer_encoder_block import B
from test_transformer_encoder_block import D
from test_transformer_encoder_block import F
from test_transformer_encoder_block import H
from test_transformer_encoder_block import T
from test_transformer_encoder_block import TOLERANCE
from test_transformer_encoder_block import normal
from test_transformer_encoder_block import numpy_norm
from test_transformer_encoder_block import randomize

BACKEND = keras.backend.backend()
N = 2
VOCABULARY_SIZE = 11
WORKER_TIMEOUT = 300


def _encoder(**kwargs):
    return TransformerEncoderStack(
        **{
            "num_layers": N,
            "intermediate_dim": F,
            "num_heads": H,
            "kernel_initializer": "zeros",
            **kwargs,
        }
    )


def _decoder(**kwargs):
    return TransformerDecoderStack(
        **{
            "num_layers": N,
            "intermediate_dim": F,
            "num_heads": H,
            "kernel_initializer": "zeros",
            **kwargs,
        }
    )


def _inputs(seed=0):
    return normal((B, T, D), seed), normal((B, S, D), seed + 1)


def _block_arguments(stack):
    config = stack.get_config()
    for name in ("num_layers", "final_layer_norm", "name", "trainable", "dtype"):
        config.pop(name)
    return config


def _blocks_by_hand(stack, block_class, *shapes):
    """Fresh blocks with the stack's block arguments and weights."""
    blocks = []
    for original in stack.blocks:
        block = block_class(**_block_arguments(stack))
        block.build(*shapes)
        block.set_weights(original.get_weights())
        blocks.append(block)
    return blocks


# A model of all four layers, saved. The fresh process that loads it starts
# with the first test here and is collected by the last tests of the file.


def saving_model():
    """Token ids through a `mask_zero=True` embedding into every layer.

    The implicit masks reach each layer; the outputs include attention
    weights of a block and of a stack. The variants (pre-norm, RMS norm,
    SwiGLU, GQA, RoPE) are in it, so they train and save too. Zero
    initializers: the tests set random weights.
    """
    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target")
    embedding = keras.layers.Embedding(
        VOCABULARY_SIZE,
        D,
        mask_zero=True,
        embeddings_initializer="zeros",
        name="embedding",
    )
    common = dict(intermediate_dim=F, num_heads=H, kernel_initializer="zeros")
    memory, encoder_weights = TransformerEncoderBlock(
        **common, num_key_value_heads=2, name="encoder_block"
    )(embedding(source), return_attention_scores=True)
    memory = TransformerEncoderStack(
        num_layers=N,
        **common,
        normalize_first=True,
        normalization="rms_norm",
        gated_feedforward=True,
        activation="silu",
        name="encoder",
    )(memory)
    hidden = TransformerDecoderBlock(
        **common, use_rotary_embedding=True, name="decoder_block"
    )(embedding(target), memory)
    hidden, self_weights, cross_weights = TransformerDecoderStack(
        num_layers=1, **common, normalize_first=True, name="decoder"
    )(hidden, memory, return_attention_scores=True)
    logits = keras.layers.Dense(
        VOCABULARY_SIZE, kernel_initializer="zeros", name="logits"
    )(hidden)
    outputs = {
        "logits": logits,
        "encoder_weights": encoder_weights,
        "self_weights": self_weights[0],
        "cross_weights": cross_weights[0],
    }
    return keras.Model({"source": source, "target": target}, outputs)


def saving_inputs(source_length=S, target_length=T):
    rng = np.random.default_rng(7)
    source = rng.integers(1, VOCABULARY_SIZE, (B, source_length)).astype("int32")
    target = rng.integers(1, VOCABULARY_SIZE, (B, target_length)).astype("int32")
    source[1, source_length - 2 :] = 0  # padding
    target[0, target_length - 1 :] = 0
    return {"source": source, "target": target}


def _randomize_model(model, seed=0):
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        variable.assign((0.3 * rng.normal(size=variable.shape)).astype("float32"))


def _predict(model, inputs):
    outputs = model.predict(inputs, batch_size=B, verbose=0)
    return {name: np.asarray(value) for name, value in outputs.items()}


_WORKER = """
import sys
import keras
import numpy as np
import keras_attention  # noqa: F401  (registers the classes)

workdir = sys.argv[1]
with np.load(f"{workdir}/inputs.npz") as data:
    inputs = dict(data)
results = {}
# The default safe_mode=True and no custom_objects.
model = keras.saving.load_model(f"{workdir}/model.keras")
outputs = model.predict(inputs, batch_size=len(inputs["source"]), verbose=0)
for name, value in outputs.items():
    results[f"output/{name}"] = np.asarray(value)
# The same code builds the same model, which takes the weights file.
import test_transformer_stacks

rebuilt = test_transformer_stacks.saving_model()
rebuilt.load_weights(f"{workdir}/model.weights.h5")
for kind, loaded in (("keras_file", model), ("weights_file", rebuilt)):
    for i, variable in enumerate(loaded.weights):
        value = keras.ops.convert_to_numpy(variable)
        results[f"{kind}/weight/{i}/{variable.path}"] = value
np.savez(f"{workdir}/results.npz", **results)
"""

# Each run loads under the next backend: over the three runs, every backend
# saves and every backend loads.
LOADING_BACKEND = {"tensorflow": "jax", "jax": "torch", "torch": "tensorflow"}[BACKEND]


class _Saved:
    """A saved model, its outputs, and a fresh process loading it under
    `LOADING_BACKEND`."""

    def __init__(self, workdir):
        self.workdir = workdir
        model = saving_model()
        _randomize_model(model)
        self.model = model
        self.inputs = saving_inputs()
        self.expected = _predict(model, self.inputs)
        self.weights = [(v.path, harness.to_numpy(v)) for v in model.weights]
        model.save(os.path.join(workdir, "model.keras"))
        model.save_weights(os.path.join(workdir, "model.weights.h5"))
        np.savez(os.path.join(workdir, "inputs.npz"), **self.inputs)
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [os.path.dirname(tests), tests, os.path.join(tests, "layers")]
        env = dict(os.environ, KERAS_BACKEND=LOADING_BACKEND, TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")])
        self.worker = subprocess.Popen(
            [sys.executable, "-c", _WORKER, workdir],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._results = None

    def results(self):
        if self._results is None:
            try:
                _, stderr = self.worker.communicate(timeout=WORKER_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"the {LOADING_BACKEND} worker ran past {WORKER_TIMEOUT} s")
            assert self.worker.returncode == 0, (
                f"the {LOADING_BACKEND} worker failed:\n{stderr[-4000:]}"
            )
            with np.load(os.path.join(self.workdir, "results.npz")) as data:
                self._results = dict(data)
        return self._results

    def kill(self):
        if self.worker.poll() is None:
            self.worker.kill()
            self.worker.wait()
        if not self.worker.stderr.closed:
            self.worker.stderr.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    result = _Saved(str(tmp_path_factory.mktemp("transformer_saving")))
    yield result
    result.kill()


def test_keras_file_loads_in_process_in_safe_mode(saved):
    # The fixture has started the fresh process; it runs meanwhile.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = keras.saving.load_model(os.path.join(saved.workdir, "model.keras"))
        outputs = _predict(restored, saved.inputs)
    # The masks pass every sublayer (RMS norms included) without a warning
    # that one "destroys" them.
    assert not [str(w.message) for w in caught if "mask" in str(w.message)]
    for name, want in saved.expected.items():
        np.testing.assert_allclose(outputs[name], want, rtol=1e-6, atol=1e-6)
    for layer in saved.model.layers:
        assert restored.get_layer(layer.name).get_config() == layer.get_config()
    assert [v.path for v in restored.weights] == [path for path, _ in saved.weights]
    for variable, (path, want) in zip(restored.weights, saved.weights):
        np.testing.assert_array_equal(harness.to_numpy(variable), want, err_msg=path)
    # Masks reached the layers: padded keys get no weight.
    source = saved.inputs["source"]
    assert np.all(outputs["encoder_weights"][1, :, :, source[1] == 0] == 0)
    assert np.all(outputs["cross_weights"][1, :, :, source[1] == 0] == 0)


# Layer harness.


def test_encoder_layer_harness():
    padding_mask = np.ones((B, T), bool)
    padding_mask[1, 3:] = False
    harness.run_layer_test(
        TransformerEncoderStack,
        {"num_layers": N, "intermediate_dim": F, "num_heads": H},
        inputs={"inputs": normal((B, T, D)), "padding_mask": padding_mask},
        expected_output_shapes=[(B, T, D)],
    )


def test_decoder_layer_harness():
    # With cross-attention and a final norm; decoder-only stacks are checked
    # against their blocks below.
    decoder_padding_mask = np.ones((B, T), bool)
    decoder_padding_mask[1, 4:] = False
    encoder_padding_mask = np.ones((B, S), bool)
    encoder_padding_mask[0, 5:] = False
    x, encoder = _inputs()
    harness.run_layer_test(
        TransformerDecoderStack,
        {
            "num_layers": N,
            "intermediate_dim": F,
            "num_heads": H,
            "final_layer_norm": True,
        },
        inputs={
            "decoder_sequence": x,
            "encoder_sequence": encoder,
            "decoder_padding_mask": decoder_padding_mask,
            "encoder_padding_mask": encoder_padding_mask,
        },
        expected_output_shapes=[(B, T, D)],
    )


def test_config_round_trip_and_seeds():
    for stack in (
        _encoder(final_layer_norm=False, seed=4, dropout=0.1, name="encoder"),
        _decoder(final_layer_norm=True, num_key_value_heads=2, name="decoder"),
    ):
        harness.check_config_round_trip(stack)
        config = stack.get_config()
        assert config["num_layers"] == N
        restored = type(stack).from_config(config)
        assert restored.final_layer_norm == stack.final_layer_norm
    encoder = _encoder(seed=4, dropout=0.1)
    encoder.build((None, None, D))
    # Each block gets its own seed, so their dropout masks differ.
    assert [block.seed for block in encoder.blocks] == [4, 14]


def test_blocks_get_copies_of_the_stack_initializers():
    """Each block gets its own initializer of the stack's class and config
    (a stateful or seeded initializer is never shared), and the weights are
    those of blocks made from the serialized config, as before."""
    initializer = keras.initializers.RandomNormal(stddev=0.3, seed=5)
    stack = _decoder(kernel_initializer=initializer, bias_initializer="ones")
    stack.build((None, None, D), (None, None, D))
    given = [block.kernel_initializer for block in stack.blocks]
    assert all(type(init) is keras.initializers.RandomNormal for init in given)
    assert len({id(init) for init in given + [initializer]}) == N + 1
    assert all(init.get_config() == initializer.get_config() for init in given)
    config = stack.get_config()
    for i, block in enumerate(stack.blocks):
        twin = TransformerDecoderBlock.from_config(
            {**{k: config[k] for k in stack.arguments.names()}, "seed": block.seed}
        )
        twin.build((None, None, D), (None, None, D))
        assert len(block.weights) == len(twin.weights)
        for mine, theirs in zip(block.weights, twin.weights):
            np.testing.assert_array_equal(harness.to_numpy(mine), harness.to_numpy(theirs))


def test_building_a_stack_does_not_import_tensorflow():
    """Keras's serialization imports TensorFlow where it is installed (about
    1.5 s); building a stack's blocks does not serialize. Run on JAX or torch
    in a fresh process (on TensorFlow the backend itself imports it)."""
    pytest.importorskip("tensorflow")  # nothing to import otherwise
    backend = "jax" if BACKEND == "tensorflow" else BACKEND
    code = (
        "import sys\n"
        "from keras_attention.layers import TransformerDecoderStack\n"
        "stack = TransformerDecoderStack(2, 32, 4, kernel_initializer='he_normal')\n"
        "stack.build((None, None, 16))\n"
        "assert len(stack.blocks) == 2\n"
        "print('tensorflow' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, KERAS_BACKEND=backend),
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


# Stacks equal their blocks chained by hand.


@pytest.mark.parametrize(
    "normalize_first, final_layer_norm, normalization, has_final_norm",
    [
        (False, None, "layer_norm", False),
        (True, None, "layer_norm", True),
        (True, None, "rms_norm", True),
        (False, True, "layer_norm", True),
        (True, False, "rms_norm", False),
    ],
)
def test_encoder_equals_its_blocks_chained_by_hand(
    normalize_first, final_layer_norm, normalization, has_final_norm
):
    encoder = _encoder(
        normalize_first=normalize_first,
        final_layer_norm=final_layer_norm,
        normalization=normalization,
        num_key_value_heads=2,
    )
    encoder.build((None, None, D))
    randomize(encoder)
    # The final norm is there exactly when asked for (by default: pre-norm),
    # of the blocks' kind; and every block has its own weights.
    norm_class = {
        "layer_norm": keras.layers.LayerNormalization,
        "rms_norm": keras.layers.RMSNormalization,
    }[normalization]
    assert (encoder.output_layer_norm is not None) is has_final_norm
    if has_final_norm:
        assert isinstance(encoder.output_layer_norm, norm_class)
    block_weights = len(encoder.blocks[0].weights)
    assert len(encoder.weights) == N * block_weights + has_final_norm * (
        1 if normalization == "rms_norm" else 2
    )
    assert len(encoder.blocks) == N
    x = normal((B, T, D))
    padding_mask = np.ones((B, T), bool)
    padding_mask[0, 3:] = False
    output, weights = harness.to_numpy(
        encoder(x, padding_mask=padding_mask, return_attention_scores=True)
    )
    expected, expected_weights = harness.to_numpy(x), []
    for block in _blocks_by_hand(encoder, TransformerEncoderBlock, (None, None, D)):
        expected, block_weights = harness.to_numpy(
            block(expected, padding_mask=padding_mask, return_attention_scores=True)
        )
        expected_weights.append(block_weights)
    if has_final_norm:
        expected = numpy_norm(encoder, encoder.output_layer_norm, expected)
    np.testing.assert_allclose(output, expected, rtol=TOLERANCE, atol=TOLERANCE)
    assert isinstance(weights, list) and len(weights) == N
    for got, want in zip(weights, expected_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(weights[0], weights[1], atol=1e-3)
    # The fused path gives the same output.
    fused = harness.to_numpy(encoder(x, padding_mask=padding_mask))
    np.testing.assert_allclose(fused, expected, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("normalize_first", [False, True])
def test_encoder_output_positions_are_the_full_outputs_rows(normalize_first):
    # Only the last block computes fewer rows; the final norm follows them.
    encoder = _encoder(normalize_first=normalize_first)
    encoder.build((None, None, D))
    randomize(encoder)
    x = normal((B, T, D))
    padding_mask = np.ones((B, T), bool)
    padding_mask[0, 3:] = False
    positions = np.array([[2, 0], [4, 4]])
    full, full_weights = harness.to_numpy(
        encoder(x, padding_mask=padding_mask, return_attention_scores=True)
    )
    rows, weights = harness.to_numpy(
        encoder(
            x, padding_mask=padding_mask, output_positions=positions,
            return_attention_scores=True,
        )
    )
    np.testing.assert_allclose(
        rows, np.take_along_axis(full, positions[:, :, None], axis=1), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(weights[0], full_weights[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        weights[-1], np.take_along_axis(full_weights[-1], positions[:, None, :, None], axis=2),
        rtol=1e-5, atol=1e-6,
    )
    symbolic = encoder.compute_output_spec(
        keras.KerasTensor((B, T, D)), output_positions=keras.KerasTensor((B, 2), "int32"),
        return_attention_scores=True,
    )
    assert tuple(symbolic[0].shape) == (B, 2, D)
    assert [tuple(w.shape) for w in symbolic[1]] == [(B, H, T, T), (B, H, 2, T)]


@pytest.mark.parametrize(
    "normalize_first, final_layer_norm, cross, has_final_norm",
    [
        (False, None, True, False),
        (True, None, True, True),
        (True, None, False, True),
        (False, True, False, True),
    ],
    ids=["post_norm", "pre_norm", "decoder_only_pre_norm", "decoder_only_final_norm"],
)
def test_decoder_equals_its_blocks_chained_by_hand(
    normalize_first, final_layer_norm, cross, has_final_norm
):
    decoder = _decoder(
        normalize_first=normalize_first, final_layer_norm=final_layer_norm
    )
    shapes = [(None, None, D)] + ([(None, None, D)] if cross else [])
    decoder.build(*shapes)
    randomize(decoder)
    assert (decoder.output_layer_norm is not None) is has_final_norm
    assert all((block.cross_attention is not None) is cross for block in decoder.blocks)
    x, encoder = _inputs()
    encoder = encoder if cross else None
    decoder_padding_mask = np.ones((B, T), bool)
    decoder_padding_mask[1, 4:] = False
    masks = dict(decoder_padding_mask=decoder_padding_mask)
    if cross:
        encoder_padding_mask = np.ones((B, S), bool)
        encoder_padding_mask[0, 4:] = False
        masks["encoder_padding_mask"] = encoder_padding_mask
    outputs = harness.to_numpy(
        decoder(x, encoder, return_attention_scores=True, **masks)
    )
    assert len(outputs) == (3 if cross else 2)
    expected, expected_weights = harness.to_numpy(x), []
    for block in _blocks_by_hand(decoder, TransformerDecoderBlock, *shapes):
        expected, *block_weights = harness.to_numpy(
            block(expected, encoder, return_attention_scores=True, **masks)
        )
        expected_weights.append(block_weights)
    if has_final_norm:
        expected = numpy_norm(decoder, decoder.output_layer_norm, expected)
    np.testing.assert_allclose(outputs[0], expected, rtol=TOLERANCE, atol=TOLERANCE)
    # Lists of N self-attention weights (B, H, T, T), then of N cross ones.
    for kind, weights in enumerate(outputs[1:]):
        assert isinstance(weights, list) and len(weights) == N
        for got, want in zip(weights, expected_weights):
            np.testing.assert_allclose(got, want[kind], rtol=1e-5, atol=1e-6)
    fused = harness.to_numpy(decoder(x, encoder, **masks))
    np.testing.assert_allclose(fused, expected, rtol=TOLERANCE, atol=TOLERANCE)


# Masks reach every block.


def test_encoder_masks_reach_every_block():
    encoder = _encoder(normalize_first=True)
    encoder.build((None, None, D))
    randomize(encoder)
    x = normal((B, T, D))
    # Padding: f([a b c PAD PAD])[:3] == f([a b c]); a block that missed the
    # mask would read the padding (random here).
    padding_mask = np.zeros((B, T), bool)
    padding_mask[:, :3] = True
    padded, weights = harness.to_numpy(
        encoder(x, padding_mask=padding_mask, return_attention_scores=True)
    )
    alone = harness.to_numpy(encoder(x[:, :3]))
    np.testing.assert_allclose(padded[:, :3], alone, rtol=1e-5, atol=1e-5)
    # Attention masks: every block's weights are 0 where it is False.
    attention_mask = np.random.default_rng(3).random((B, T, T)) < 0.6
    attention_mask[:, :, 0] = True
    _, masked_weights = harness.to_numpy(
        encoder(x, attention_mask=attention_mask, return_attention_scores=True)
    )
    for block_weights, masked in zip(weights, masked_weights):
        assert np.all(block_weights[..., 3:] == 0)
        hidden = np.broadcast_to(~attention_mask[:, None], masked.shape)
        assert np.all(masked[hidden] == 0)
        np.testing.assert_allclose(masked.sum(-1), 1.0, rtol=1e-5)


def test_decoder_masks_reach_every_block():
    decoder = _decoder(normalize_first=True)
    decoder.build((None, None, D), (None, None, D))
    randomize(decoder)
    x, encoder = _inputs()
    real = 3
    decoder_padding_mask = np.zeros((B, T), bool)
    decoder_padding_mask[:, :real] = True
    encoder_padding_mask = np.zeros((B, S), bool)
    encoder_padding_mask[:, :4] = True
    poisoned = encoder.copy()
    poisoned[:, 4:] = np.nan
    padded, self_weights, cross_weights = harness.to_numpy(
        decoder(
            x,
            poisoned,
            decoder_padding_mask=decoder_padding_mask,
            encoder_padding_mask=encoder_padding_mask,
            return_attention_scores=True,
        )
    )
    alone = harness.to_numpy(decoder(x[:, :real], encoder[:, :4]))
    np.testing.assert_allclose(padded[:, :real], alone, rtol=1e-5, atol=1e-5)
    for self_w, cross_w in zip(self_weights, cross_weights):
        assert np.all(self_w[..., real:] == 0)
        assert np.all(cross_w[..., 4:] == 0)
    # Explicit self- and cross-attention masks too.
    decoder_attention_mask = np.random.default_rng(3).random((B, T, T)) < 0.6
    encoder_attention_mask = np.random.default_rng(4).random((B, T, S)) < 0.6
    decoder_attention_mask[:, :, 0] = encoder_attention_mask[:, :, 0] = True
    _, self_weights, cross_weights = harness.to_numpy(
        decoder(
            x,
            encoder,
            decoder_attention_mask=decoder_attention_mask,
            encoder_attention_mask=encoder_attention_mask,
            return_attention_scores=True,
        )
    )
    for weights, mask in (
        (self_weights, decoder_attention_mask),
        (cross_weights, encoder_attention_mask),
    ):
        for w in weights:
            assert np.all(w[np.broadcast_to(~mask[:, None], w.shape)] == 0)
            np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)


# Stacked caches.


def _stacked_cache(decoder, length, fill=0.0):
    """`(B, N, 2, L, G, K)`."""
    cache = empty_cache(decoder, length, fill)  # (B, 2, L, G, K)
    return np.stack([cache] * decoder.num_layers, axis=1)


@pytest.mark.parametrize("cross", [True, False], ids=["cross", "decoder_only"])
def test_cached_decoding_equals_full_pass(cross):
    decoder = _decoder(
        normalize_first=not cross,
        num_key_value_heads=2,
        use_rotary_embedding=not cross,
    )
    x, encoder = _inputs()
    kwargs = {}
    if cross:
        encoder_padding_mask = np.ones((B, S), bool)
        encoder_padding_mask[0, 5:] = False
        kwargs["encoder_padding_mask"] = encoder_padding_mask
    else:
        encoder = None
    decoder.build((None, None, D), None if encoder is None else (None, None, D))
    randomize(decoder)
    full = harness.to_numpy(decoder(x, encoder, **kwargs))
    prefill, max_length = 2, T + 2
    self_cache = _stacked_cache(decoder, max_length, fill=np.nan)
    cross_cache = _stacked_cache(decoder, S) if cross else None

    outputs, self_cache, cross_cache = decode(
        decoder, x, encoder, prefill, self_cache, cross_cache, **kwargs
    )
    np.testing.assert_allclose(outputs, full, rtol=1e-5, atol=1e-5)
    assert self_cache.shape == (B, N, 2, max_length, 2, D // H)
    assert np.all(np.isfinite(self_cache[:, :, :, :T]))
    assert np.all(np.isnan(self_cache[:, :, :, T:]))
    # Block i's slice is block i's own cache: its keys differ from block 0's.
    assert not np.allclose(self_cache[:, 0, :, :T], self_cache[:, 1, :, :T])
    if cross:
        for i, block in enumerate(decoder.blocks):
            np.testing.assert_allclose(
                cross_cache[:, i],
                harness.to_numpy(block.cross_attention.compute_cache(encoder)),
                rtol=1e-6,
                atol=1e-6,
            )


def test_layer_caches_equal_the_stacked_cache():
    # `call_with_layer_caches` (one cache per block, for decoding loops) is
    # the stacked-cache call without the slicing and re-stacking.
    decoder = _decoder(
        normalize_first=True, num_key_value_heads=2, use_rotary_embedding=True
    )
    x, _ = _inputs()
    decoder.build((None, None, D))
    randomize(decoder)
    full = harness.to_numpy(decoder(x))
    stacked = _stacked_cache(decoder, T + 2, fill=np.nan)
    want, want_cache = decoder(
        x[:, :3], self_attention_cache=stacked, self_attention_cache_update_index=0
    )
    caches = [stacked[:, i] for i in range(decoder.num_layers)]
    got, caches = decoder.call_with_layer_caches(x[:, :3], caches, 0)
    np.testing.assert_allclose(harness.to_numpy(got), harness.to_numpy(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(
        np.stack([harness.to_numpy(c) for c in caches], axis=1), harness.to_numpy(want_cache)
    )
    for i in range(3, T):  # then token by token, against the full pass
        got, caches = decoder.call_with_layer_caches(x[:, i : i + 1], caches, i)
        np.testing.assert_allclose(harness.to_numpy(got)[:, 0], full[:, i], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"one cache per block \(2\)\. Received: 1"):
        decoder.call_with_layer_caches(x[:, :1], caches[:1], 0)


def test_symbolic_shapes_with_stacked_caches():
    decoder = _decoder(num_key_value_heads=2)
    output, self_weights, cross_weights, self_cache, cross_cache = decoder(
        keras.Input((1, D)),
        self_attention_cache=keras.Input((N, 2, 9, 2, D // H)),
        self_attention_cache_update_index=3,
        cross_attention_cache=keras.Input((N, 2, S, 2, D // H)),
        return_attention_scores=True,
    )
    assert tuple(output.shape) == (None, 1, D)
    assert [tuple(w.shape) for w in self_weights] == [(None, H, 1, 9)] * N
    assert [tuple(w.shape) for w in cross_weights] == [(None, H, 1, S)] * N
    assert tuple(self_cache.shape) == (None, N, 2, 9, 2, D // H)
    assert tuple(cross_cache.shape) == (None, N, 2, S, 2, D // H)
    encoder = _encoder()
    output, weights = encoder(keras.Input((None, D)), return_attention_scores=True)
    assert tuple(output.shape) == (None, None, D)
    assert [tuple(w.shape) for w in weights] == [(None, H, None, None)] * N


# Mixed precision.


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 1e-2), ("mixed_bfloat16", 6e-2)]
)
def test_mixed_precision_close_to_float32(policy, tolerance):
    x, encoder = _inputs()
    compute_dtype = policy.split("_")[1]
    for make, shapes, args in (
        (_encoder, [(None, None, D)], (x,)),
        (_decoder, [(None, None, D), (None, None, D)], (x, encoder)),
    ):
        reference = make(normalize_first=True)
        reference.build(*shapes)
        randomize(reference)
        mixed = make(normalize_first=True, dtype=policy)
        mixed.build(*shapes)
        mixed.set_weights(reference.get_weights())
        assert all(
            keras.backend.standardize_dtype(w.dtype) == "float32" for w in mixed.weights
        )
        expected = harness.to_numpy(reference(*args))
        output = mixed(*args)
        assert keras.backend.standardize_dtype(output.dtype) == compute_dtype
        output = harness.to_numpy(output).astype("float32")
        assert np.all(np.isfinite(output))
        np.testing.assert_allclose(output, expected, rtol=tolerance, atol=tolerance)


# Error messages.


@pytest.mark.parametrize("num_layers", [0, -1, 2.5, True, "2", None])
@pytest.mark.parametrize("stack", [TransformerEncoderStack, TransformerDecoderStack])
def test_rejects_bad_num_layers(stack, num_layers):
    with pytest.raises(
        ValueError,
        match=r"`num_layers` must be a positive integer\. "
        rf"Received: num_layers={re.escape(repr(num_layers))}$",
    ):
        stack(num_layers=num_layers, intermediate_dim=F, num_heads=H)


@pytest.mark.parametrize("stack", [TransformerEncoderStack, TransformerDecoderStack])
def test_rejects_bad_block_arguments(stack):
    with pytest.raises(
        ValueError, match=r"`final_layer_norm` must be None, True or False.*'yes'"
    ):
        stack(num_layers=N, intermediate_dim=F, num_heads=H, final_layer_norm="yes")
    with pytest.raises(
        ValueError, match=r"`dropout` must be a float in \[0, 1\).*dropout=2"
    ):
        stack(num_layers=N, intermediate_dim=F, num_heads=H, dropout=2)
    with pytest.raises(
        ValueError, match=r"`normalization` must be one of.*'batch_norm'"
    ):
        stack(num_layers=N, intermediate_dim=F, num_heads=H, normalization="batch_norm")


def test_rejects_bad_inputs():
    x, encoder = _inputs()
    divisible = r"`hidden_dim` .* divisible by `num_heads`.*hidden_dim=16, num_heads=3"
    with pytest.raises(ValueError, match=divisible):
        _encoder(num_heads=3)(x)
    with pytest.raises(ValueError, match=divisible):
        _decoder(num_heads=3)(x, encoder)
    with pytest.raises(ValueError, match=r"`inputs` must have rank 3.*\(rank 2\)"):
        _encoder()(x[:, 0])
    with pytest.raises(ValueError, match=r"`decoder_sequence` must have rank 3"):
        _decoder()(x[:, 0])
    with pytest.raises(ValueError, match=r"`encoder_sequence` must have rank 3"):
        _decoder()(x, encoder[:, 0])
    with pytest.raises(
        ValueError,
        match=r"`decoder_sequence` and `encoder_sequence` must have the same "
        r"batch size\. "
        r"Received: decoder_sequence batch size=2, encoder_sequence batch size=1",
    ):
        _decoder()(x, encoder[:1])


def test_rejects_bad_caches():
    decoder = _decoder()
    x, _ = _inputs()
    with pytest.raises(
        ValueError,
        match=r"`self_attention_cache_update_index` needs a `self_attention_cache`",
    ):
        decoder(x, self_attention_cache_update_index=0)
    # A block's cache is not a stacked cache.
    with pytest.raises(
        ValueError,
        match=r"`self_attention_cache` must have shape \(batch, num_layers=2, 2, "
        r"length, key_value_heads, key_dim\)\. Received: self_attention_cache "
        r"with shape \(2, 2, 7, 4, 4\)",
    ):
        decoder(
            x[:, :1],
            self_attention_cache=empty_cache(decoder, T + 2),
            self_attention_cache_update_index=0,
        )
    with pytest.raises(ValueError, match=r"num_layers=2.*shape \(2, 3, 2, 7, 4, 4\)"):
        decoder(
            x[:, :1],
            self_attention_cache=np.zeros((B, 3, 2, T + 2, H, D // H), "float32"),
            self_attention_cache_update_index=0,
        )


# The model of all four layers: lengths, tf.data.


def test_model_of_every_layer_at_several_lengths_and_fit_on_tf_data(saved):
    import tensorflow as tf  # tf.data feeds models on every backend

    # The saved model (its outputs and weights are recorded) predicted at
    # (S, T); it now trains at other lengths.
    model = saved.model
    assert saved.expected["logits"].shape == (B, T, VOCABULARY_SIZE)
    inputs = saving_inputs(source_length=4, target_length=3)
    labels = np.roll(inputs["target"], -1, axis=1)
    dataset = tf.data.Dataset.from_tensor_slices((inputs, {"logits": labels})).batch(B)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
    )
    with harness.trains_every_weight(model, unless=("key/bias",)):
        history = model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][0])


# The saved model in fresh processes.


def test_keras_file_loads_in_a_fresh_process_under_another_backend(saved):
    results = saved.results()
    context = f"saved under {BACKEND}, loaded under {LOADING_BACKEND}"
    for name, want in saved.expected.items():
        got = results[f"output/{name}"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=context)
        # Masked weights are exactly 0 there too.
        np.testing.assert_array_equal(got == 0, want == 0, err_msg=context)


@pytest.mark.parametrize("kind", ["keras_file", "weights_file"])
def test_weights_load_under_another_backend(saved, kind):
    results = saved.results()
    context = f"{kind} saved under {BACKEND}, loaded under {LOADING_BACKEND}"
    weights = {k: v for k, v in results.items() if k.startswith(f"{kind}/")}
    assert len(weights) == len(saved.weights), context
    for i, (path, want) in enumerate(saved.weights):
        np.testing.assert_array_equal(
            results[f"{kind}/weight/{i}/{path}"], want, err_msg=context
        )
