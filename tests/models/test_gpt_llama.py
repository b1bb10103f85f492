"""Tests of `GPT` in the LLaMA configuration: KerasHub parity, decoding, saving, training.

Shape legend: `B` batch, `T` length, `P` prompt length, `V` vocabulary size,
`D` width, `H` query heads, `G` key/value heads, `K` head size.

LLaMA is `GPT` with RMS norms, rotary positions, a SwiGLU feed-forward
network, no biases and an untied output projection (`LLAMA`). The reference
is KerasHub's `LlamaBackbone` with the same weights (its logits:
`token_embedding(hidden, reverse=True)`) and, for decoding, the model's own
full passes recomputed at every step. Most tests read one shared model with
random weights (`model`), which no test changes.
"""

import re

import keras
import numpy as np
import pytest

import harness
from keras_attention.models import GPT

V, MAX_LENGTH = 37, 24
LLAMA = dict(
    vocabulary_size=V,
    max_sequence_length=MAX_LENGTH,
    num_layers=2,
    num_heads=4,
    hidden_dim=16,
    intermediate_dim=24,
    activation="silu",
    layer_norm_epsilon=1e-6,
    num_key_value_heads=2,
    use_bias=False,
    normalization="rms_norm",
    positions="rotary",
    # Not the default, so that a wavelength that does not reach the
    # attention layers shows in the logits.
    rotary_max_wavelength=500,
    gated_feedforward=True,
    tie_weights=False,
)
# KerasHub's names for the same configuration.
HUB_LLAMA = dict(
    vocabulary_size=V,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=24,
    rope_max_wavelength=500,
    layer_norm_epsilon=1e-6,
)
TOLERANCE = 1e-4
ROWS = 4  # the batch of every reference pass, so JAX compiles it once


def _llama(seed=0, **kwargs):
    model = GPT(**{**LLAMA, **kwargs})
    model.build((None, None))
    return harness.randomize_weights(model, seed)


def _hub_backbone(seed=0, **kwargs):
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.LlamaBackbone(**{**HUB_LLAMA, **kwargs})
    return harness.randomize_weights(backbone, seed)


def _ids(shape, seed=0):
    return np.random.default_rng(seed).integers(0, V, size=shape).astype("int32")


def _forward(model, ids):
    return harness.padded_logits(model, ids, ROWS, MAX_LENGTH)


def _greedy_reference(model, prompt, max_new_tokens):
    return harness.greedy_reference(model, prompt, max_new_tokens, ROWS, MAX_LENGTH)


@pytest.fixture(scope="module")
def model():
    """A small LLaMA-configured GPT with random weights, only read."""
    return _llama()


@pytest.fixture(scope="module")
def prompt():
    return _ids((3, 4), seed=1)


# KerasHub parity.


@pytest.mark.parametrize(
    "tied, masked",
    [(False, False), (False, True), (True, False)],
    ids=["untied", "untied_padding_mask", "tied"],
)
def test_from_keras_hub_reproduces_the_llama_backbone(tied, masked):
    backbone = _hub_backbone(seed=3, tie_word_embeddings=tied)
    ours = GPT.from_keras_hub(backbone, max_sequence_length=MAX_LENGTH)
    assert ours.count_params() == backbone.count_params()
    assert ours.tie_weights is tied and ours.positions == "rotary"
    ids = _ids((2, 11), seed=4)
    mask = np.ones(ids.shape, bool)
    if masked:
        mask[0, 8:] = False  # right padding: the real positions keep theirs
        mask[1, [2, 5]] = False  # holes
    hidden = backbone({"token_ids": ids, "padding_mask": mask})
    expected = harness.to_numpy(backbone.token_embedding(hidden, reverse=True))
    kwargs = {"padding_mask": mask} if masked else {}
    got = harness.to_numpy(ours(ids, **kwargs))
    difference = np.abs(got[mask] - expected[mask]).max()
    print(f"max logit difference against LlamaBackbone: {difference:.2e}")
    np.testing.assert_allclose(got[mask], expected[mask], rtol=TOLERANCE, atol=TOLERANCE)
    if masked:
        # The mask mattered: without it the real positions differ.
        assert np.abs(harness.to_numpy(ours(ids))[mask] - expected[mask]).max() > 1e-2


def test_from_keras_hub_takes_the_rotary_wavelength_and_copies_the_weights():
    backbone = _hub_backbone(seed=5)
    ours = GPT.from_keras_hub(backbone, max_sequence_length=MAX_LENGTH)
    assert ours.rotary_max_wavelength == 500
    ids = _ids((1, 9), seed=6)
    before = _forward(ours, ids)
    # The weights are copies: changing the backbone's changes nothing here.
    harness.randomize_weights(backbone, seed=99)
    np.testing.assert_array_equal(_forward(ours, ids), before)
    # The wavelength matters: the default one gives other logits.
    other = GPT(**{**LLAMA, "rotary_max_wavelength": 10000})
    other.build((None, None))
    other.set_weights(ours.get_weights())
    assert np.abs(_forward(other, ids) - before).max() > 1e-2


def test_from_keras_hub_rejects_what_it_cannot_take():
    keras_hub = pytest.importorskip("keras_hub")
    takes = "must be a keras_hub.models.GPT2Backbone or keras_hub.models.LlamaBackbone"
    with pytest.raises(ValueError, match=re.escape(takes) + r".*Received: backbone of type str"):
        GPT.from_keras_hub("llama2_7b_en")
    other = keras_hub.models.MistralBackbone(
        vocabulary_size=V, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=8, intermediate_dim=16,
    )
    with pytest.raises(ValueError, match=re.escape(takes) + r".*type MistralBackbone"):
        GPT.from_keras_hub(other)
    scaled = keras_hub.models.LlamaBackbone(**HUB_LLAMA, rope_position_scaling_factor=2.0)
    with pytest.raises(
        ValueError, match=r"`rope_position_scaling_factor=1.0`.*Received: "
        r"rope_position_scaling_factor=2.0"
    ):
        GPT.from_keras_hub(scaled)
    llama31 = keras_hub.models.LlamaBackbone(
        **HUB_LLAMA, rope_frequency_adjustment_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_pretraining_sequence_length=8192,
    )
    with pytest.raises(
        ValueError, match=r"`rope_frequency_adjustment_factor=None`.*Received: "
        r"rope_frequency_adjustment_factor=8.0"
    ):
        GPT.from_keras_hub(llama31)
    gpt2 = keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=MAX_LENGTH,
    )
    with pytest.raises(ValueError, match=r"`max_sequence_length`.*max_sequence_length=99"):
        GPT.from_keras_hub(gpt2, max_sequence_length=99)


def test_from_keras_hub_takes_a_llama3_backbone():
    """Llama 3's backbone class is a LlamaBackbone; without rotary scaling
    it is the same model."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = harness.randomize_weights(keras_hub.models.Llama3Backbone(**HUB_LLAMA), seed=7)
    ours = GPT.from_keras_hub(backbone)
    assert ours.max_sequence_length == 4096  # the default bound
    ids = _ids((1, 7), seed=8)
    hidden = backbone({"token_ids": ids, "padding_mask": np.ones_like(ids)})
    expected = harness.to_numpy(backbone.token_embedding(hidden, reverse=True))
    np.testing.assert_allclose(
        harness.to_numpy(ours(ids)), expected, rtol=TOLERANCE, atol=TOLERANCE
    )


# The configuration.


def test_the_llama_configuration_has_llama_layers_and_no_gpt2_weights(model):
    assert model.embedding.position_embedding is None
    paths = [w.path for w in model.weights]
    assert not any("position" in p or "bias" in p or "beta" in p for p in paths), paths
    block = model.decoder.blocks[0]
    for norm in (block.self_attention_layer_norm, block.feedforward_layer_norm,
                 model.decoder.output_layer_norm):
        assert isinstance(norm, keras.layers.RMSNormalization)
    assert block.feedforward.gated
    assert block.self_attention.rotary_embedding.max_wavelength == 500
    assert tuple(block.self_attention.key_dense.kernel.shape) == (16, 2, 4)  # (D, G, K)
    assert tuple(model.embedding.token_embedding.reverse_embeddings.shape) == (16, V)


def test_full_pass_equals_the_layers_one_by_one(model):
    """The model's pass against its layers called in LLaMA's order, the
    output projection as a numpy product with the untied kernel."""
    ids = _ids((2, 9), seed=7)
    x = model.embedding.token_embedding(ids)  # (B, T, D): no positions added
    for block in model.decoder.blocks:
        x = block(x)  # causal, rotary positions 0 .. T - 1
    x = harness.to_numpy(model.decoder.output_layer_norm(x)).astype("float64")
    kernel = harness.to_numpy(model.embedding.token_embedding.reverse_embeddings)  # (D, V)
    expected = x @ kernel.astype("float64")  # (B, T, V)
    np.testing.assert_allclose(_forward(model, ids), expected, rtol=1e-5, atol=1e-5)


def test_cached_decoding_equals_the_full_pass(model):
    ids = _ids((2, 10), seed=8)
    full = _forward(model, ids)
    cache = model.empty_cache(2, MAX_LENGTH)
    logits, cache = model.call_with_cache(ids[:, :6], cache, 0)  # prefill
    steps = [harness.to_numpy(logits)]
    for index in range(6, 10):  # one token per step, rotated at its index
        logits, cache = model.call_with_cache(ids[:, index : index + 1], cache, index)
        steps.append(harness.to_numpy(logits))
    np.testing.assert_allclose(
        np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5
    )


# Generation.


def test_greedy_generation_equals_recomputing_every_step(model, prompt):
    out = model.generate(prompt, max_new_tokens=8)
    assert out.shape == (3, 12)
    np.testing.assert_array_equal(out, _greedy_reference(model, prompt, 8))
    # Not one token over and over: the comparison means something.
    assert len(np.unique(out[:, 4:])) > 2


def test_ragged_prompts_equal_generating_each_alone(model):
    prompts = _ids((2, 6), seed=9)
    mask = np.ones(prompts.shape, bool)
    mask[1, 3:] = False  # the second prompt is 3 tokens long
    out = model.generate(prompts, max_new_tokens=5, prompt_padding_mask=mask)
    np.testing.assert_array_equal(out[0], _greedy_reference(model, prompts[:1], 5)[0])
    np.testing.assert_array_equal(
        out[1, :8], _greedy_reference(model, prompts[1:, :3], 5)[0]
    )


def test_sampling_through_the_cache(model, prompt):
    greedy = _greedy_reference(model, prompt, 6)
    top_k_1 = model.generate(prompt, max_new_tokens=6, sampling="top_k", top_k=1, seed=0)
    np.testing.assert_array_equal(top_k_1, greedy)
    tiny_top_p = model.generate(prompt, max_new_tokens=6, sampling="top_p", top_p=1e-6, seed=0)
    np.testing.assert_array_equal(tiny_top_p, greedy)
    first = model.generate(prompt, max_new_tokens=6, sampling="random", temperature=2.0, seed=3)
    again = model.generate(prompt, max_new_tokens=6, sampling="random", temperature=2.0, seed=3)
    np.testing.assert_array_equal(first, again)
    assert first.min() >= 0 and first.max() < V
    np.testing.assert_array_equal(first[:, :4], prompt)
    assert not np.array_equal(first, greedy)


# Errors.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(positions="sinusoidal"), r"`positions` must be one of 'learned', 'rotary'\. "
         r"Received: positions='sinusoidal'"),
        (dict(positions=None), r"`positions`.*positions=None"),
        (dict(normalization="batch_norm"), r"`normalization`.*normalization='batch_norm'"),
        (dict(tie_weights="no"), r"`tie_weights` must be True or False.*tie_weights='no'"),
        (dict(gated_feedforward=1), r"`gated_feedforward`.*gated_feedforward=1"),
        (dict(rotary_max_wavelength=0), r"`rotary_max_wavelength`.*rotary_max_wavelength=0"),
        (dict(num_key_value_heads=3), r"`num_heads`.*`num_key_value_heads`"),
    ],
)
def test_rejects_bad_llama_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT(**{**LLAMA, **kwargs})


def test_rejects_a_sequence_longer_than_max_sequence_length(model):
    """No position table, yet `max_sequence_length` still bounds the input."""
    with pytest.raises(ValueError, match=f"max_sequence_length={MAX_LENGTH}"):
        model(_ids((1, MAX_LENGTH + 1)))
    with pytest.raises(ValueError, match=f"max_sequence_length={MAX_LENGTH}"):
        model.generate(_ids((1, 20)), max_new_tokens=5)


# Serialization.


def test_config_round_trip(model):
    harness.check_config_round_trip(model)
    config = model.get_config()
    for name, value in LLAMA.items():
        assert config[name] == value, name
    clone = GPT.from_config(config)
    assert clone.get_config() == config
    assert clone.decoder.block_arguments() == model.decoder.block_arguments()


def test_gpt2_defaults_are_unchanged():
    config = GPT(**{k: LLAMA[k] for k in list(LLAMA)[:6]}).get_config()
    assert {k: config[k] for k in (
        "normalization", "positions", "gated_feedforward", "tie_weights", "use_bias",
        "activation", "layer_norm_epsilon",
    )} == dict(
        normalization="layer_norm", positions="learned", gated_feedforward=False,
        tie_weights=True, use_bias=True, activation="gelu_approximate",
        layer_norm_epsilon=1e-5,
    )


def test_keras_file_round_trip(model, tmp_path):
    path = str(tmp_path / "llama.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)  # safe_mode=True, no custom_objects
    assert type(loaded) is GPT and loaded.get_config() == model.get_config()
    ids = _ids((ROWS, MAX_LENGTH), seed=10)
    np.testing.assert_allclose(_forward(loaded, ids), _forward(model, ids), rtol=1e-6, atol=1e-6)
    prompt = _ids((2, 3), seed=11)
    np.testing.assert_array_equal(
        loaded.generate(prompt, max_new_tokens=4), model.generate(prompt, max_new_tokens=4)
    )


# Precision and training.


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_bfloat16", 0.04), ("mixed_float16", 0.005)]
)
def test_mixed_precision_close_to_float32_and_generates(model, prompt, policy, tolerance):
    """Float32 weights, half-precision logits near float32's (rotations
    and RMS norms run in float32 inside), and a cache of the compute dtype.
    The bounds are GPT-2's (`test_gpt.py`); measured on JAX: mean error
    2.4% (bfloat16) and 0.26% (float16) of the logits' spread."""
    mixed = GPT(**LLAMA, dtype=policy)
    mixed.build((None, None))
    mixed.set_weights(model.get_weights())
    ids = _ids((ROWS, MAX_LENGTH), seed=12)
    logits = mixed(ids)
    assert keras.backend.standardize_dtype(logits.dtype) == policy.split("_")[1]
    got, expected = harness.to_numpy(logits).astype("float64"), _forward(model, ids)
    error = np.abs(got - expected)
    assert error.mean() <= tolerance * expected.std(), error.mean()
    assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.9
    cache = mixed.empty_cache(3, MAX_LENGTH)
    assert keras.backend.standardize_dtype(cache.dtype) == policy.split("_")[1]
    out = mixed.generate(prompt, max_new_tokens=4)
    assert out.shape == (3, 8) and out.min() >= 0 and out.max() < V
    np.testing.assert_array_equal(out[:, :4], prompt)




@pytest.mark.slow  # compiling the train step: 5 to 15 s
def test_fit_trains_every_weight_and_lowers_the_loss():
    tf = pytest.importorskip("tensorflow")
    gpt = GPT(**LLAMA, dropout=0.1, seed=0)
    gpt.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    gpt.build((None, None))
    # Counting: `start, start + 1, ...` mod V, the next token from each.
    starts = np.random.default_rng(0).integers(0, V, size=(8, 1))
    sequences = ((starts + np.arange(11)) % V).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices(
        (sequences[:, :-1], sequences[:, 1:])
    ).batch(8)
    with harness.trains_every_weight(gpt):
        losses = gpt.fit(dataset, epochs=6, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.2, losses
