"""The drop-ins for KerasHub's layers, against KerasHub's layers themselves.

Shape legend: `B` batch, `T` (decoder) length, `S` encoder length, `D` model
width, `H` heads, `K` head size, `F` feed-forward width.

KerasHub ships no test files in its wheel, so these are this package's tests
of the behaviours a KerasHub user relies on: the constructor and call
arguments, input ranks, cached calls equal to a full pass, dtype policies and
`get_config` round trips, each against the KerasHub layer with copied weights
(`from_keras`, or the tables assigned). Where the package's rules differ
(padded queries attend to nothing), the comparison reads the rows both
define, and the README's "Coming from Keras or KerasHub" says why.
"""

import inspect

import keras
import numpy as np
import pytest

import harness
from keras_attention import layers
from keras_attention import masking

keras_hub = pytest.importorskip("keras_hub")

B, T, S, D, H, F = 2, 5, 6, 16, 4, 32
K = D // H
TOLERANCE = 1e-5
PADDING = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)  # (B, T)
# Half-precision policies: loose, since both layers round differently.
HALF_TOLERANCE = 5e-2
# KerasHub's Transformer block constructor arguments, read from its layers.
HUB_BLOCK_ARGUMENTS = [
    name
    for name in inspect.signature(keras_hub.layers.TransformerDecoder.__init__).parameters
    if name not in ("self", "kwargs")
]


def normal(shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).normal(size=shape)).astype("float32")


def randomize(layer, seed=0):
    """Random values for every weight of a built layer (norms around 1)."""
    for i, weight in enumerate(layer.weights):
        value = normal(tuple(weight.shape), seed=seed + i, scale=0.3)
        if weight.path.endswith(("gamma", "scale")):
            value += 1.0
        weight.assign(value)


def close(a, b, tolerance=TOLERANCE):
    np.testing.assert_allclose(
        harness.to_numpy(a).astype("float32"),
        harness.to_numpy(b).astype("float32"),
        atol=tolerance,
        rtol=tolerance,
    )


def causal(length, batch=B):
    return np.tril(np.ones((length, length), "int32"))[None].repeat(batch, 0)


# TransformerEncoder and TransformerDecoder: one block, as in KerasHub.

BLOCK_ARGUMENTS = [
    {"intermediate_dim": F, "num_heads": H},
    {
        "intermediate_dim": F, "num_heads": H, "dropout": 0.1, "activation": "gelu",
        "layer_norm_epsilon": 1e-6, "kernel_initializer": "he_normal",
        "bias_initializer": "ones", "normalize_first": True,
    },
]
BLOCK_IDS = ["defaults", "every-argument"]


def _hub_encoder(kwargs, seed=0):
    hub = keras_hub.layers.TransformerEncoder(**kwargs)
    hub(normal((B, T, D)))
    randomize(hub, seed)
    return hub


@pytest.mark.parametrize("kwargs", BLOCK_ARGUMENTS, ids=BLOCK_IDS)
def test_encoder_takes_keras_hub_arguments_and_weights(kwargs):
    hub = _hub_encoder(kwargs)
    ours = layers.TransformerEncoder.from_keras(hub)
    assert isinstance(ours, layers.TransformerEncoderBlock)
    hub_config, config = hub.get_config(), ours.get_config()
    for name in HUB_BLOCK_ARGUMENTS:
        assert config[name] == hub_config[name], name
    harness.check_config_round_trip(ours)
    x = normal((B, T, D), 1)
    close(ours(x), hub(x))
    # Padding: the real tokens agree; a padded query attends to nothing here
    # (KerasHub lets it attend to the real tokens).
    got, want = ours(x, padding_mask=PADDING), hub(x, padding_mask=PADDING)
    close(harness.to_numpy(got)[PADDING], harness.to_numpy(want)[PADDING])
    mask = causal(T) > 0
    close(ours(x, attention_mask=mask), hub(x, attention_mask=mask))
    scored, scores = ours(x, attention_mask=mask, return_attention_scores=True)
    assert tuple(scores.shape) == (B, H, T, T)
    close(scored, hub(x, attention_mask=mask))


def test_encoder_layer_harness():
    # No training check: the key projection's bias gets no gradient (it
    # shifts every score of a query alike), here as in KerasHub.
    harness.run_layer_test(
        layers.TransformerEncoder,
        BLOCK_ARGUMENTS[1],
        inputs={"inputs": normal((B, T, D))},
        call_kwargs={"padding_mask": PADDING},
        expected_output_shapes=[(B, T, D)],
        run_training_check=False,
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_encoder_dtype_policies_follow_keras_hub(policy):
    hub = keras_hub.layers.TransformerEncoder(F, H, dtype=policy)
    x = normal((B, T, D), 2)
    want = hub(x)
    randomize(hub)
    want = hub(x)
    ours = layers.TransformerEncoder.from_keras(hub)
    got = ours(x)
    assert keras.backend.standardize_dtype(got.dtype) == keras.backend.standardize_dtype(
        want.dtype
    )
    assert ours.dtype_policy.name == policy
    close(got, want, HALF_TOLERANCE)


def _hub_decoder(kwargs, cross, seed=0):
    hub = keras_hub.layers.TransformerDecoder(**kwargs)
    if cross:
        hub(normal((B, T, D)), normal((B, S, D)))
    else:
        hub(normal((B, T, D)))
    randomize(hub, seed)
    return hub


@pytest.mark.parametrize("cross", [False, True], ids=["decoder-only", "cross"])
@pytest.mark.parametrize("kwargs", BLOCK_ARGUMENTS, ids=BLOCK_IDS)
def test_decoder_takes_keras_hub_arguments_and_weights(kwargs, cross):
    hub = _hub_decoder(kwargs, cross)
    ours = layers.TransformerDecoder.from_keras(hub)
    assert isinstance(ours, layers.TransformerDecoderBlock)
    hub_config, config = hub.get_config(), ours.get_config()
    for name in HUB_BLOCK_ARGUMENTS:
        assert config[name] == hub_config[name], name
    harness.check_config_round_trip(ours)
    x, memory = normal((B, T, D), 1), normal((B, S, D), 2)
    args = (x, memory) if cross else (x,)
    close(ours(*args), hub(*args))
    # Real tokens agree under padding (padded queries differ by design).
    kwargs = dict(decoder_padding_mask=PADDING)
    if cross:
        kwargs["encoder_padding_mask"] = np.arange(S)[None].repeat(B, 0) < [[6], [4]]
    got, want = ours(*args, **kwargs), hub(*args, **kwargs)
    close(harness.to_numpy(got)[PADDING], harness.to_numpy(want)[PADDING])
    # `use_causal_mask=False` with an explicit mask.
    mask = causal(T) > 0
    close(
        ours(*args, decoder_attention_mask=mask, use_causal_mask=False),
        hub(*args, decoder_attention_mask=mask, use_causal_mask=False),
    )


@pytest.mark.parametrize("cross", [False, True], ids=["decoder-only", "cross"])
def test_decoder_cached_calls_equal_keras_hub_and_a_full_pass(cross):
    hub = _hub_decoder(BLOCK_ARGUMENTS[1], cross)
    ours = layers.TransformerDecoder.from_keras(hub)
    x, memory = normal((B, T, D), 3), normal((B, S, D), 4)
    full = ours(x, memory) if cross else ours(x)
    close(full, hub(x, memory) if cross else hub(x))
    self_cache = np.zeros((B, 2, T, H, K), "float32")
    cross_cache = np.zeros((B, 2, S, H, K), "float32") if cross else None
    steps = []
    for i in range(T):
        kwargs = dict(self_attention_cache=self_cache, self_attention_cache_update_index=i)
        if cross:
            kwargs.update(
                cross_attention_cache=cross_cache,
                # The first step fills the cross cache, the others read it.
                cross_attention_cache_update_index=0 if i == 0 else None,
            )
        args = (x[:, i : i + 1], memory) if cross else (x[:, i : i + 1],)
        mine = ours(*args, **kwargs)
        theirs = hub(*args, **kwargs)
        assert len(mine) == len(theirs) == (3 if cross else 2)
        for a, b in zip(mine, theirs):
            close(a, b)
        steps.append(harness.to_numpy(mine[0]))
        self_cache = mine[1]
        if cross:
            cross_cache = mine[2]
    close(np.concatenate(steps, axis=1), full)


def test_decoder_layer_harness():
    harness.run_layer_test(
        layers.TransformerDecoder,
        BLOCK_ARGUMENTS[1],
        inputs={"decoder_sequence": normal((B, T, D)), "encoder_sequence": normal((B, S, D))},
        expected_output_shapes=[(B, T, D)],
        run_training_check=False,
    )


@pytest.mark.parametrize("cls", [layers.TransformerEncoder, layers.TransformerDecoder])
def test_the_block_names_are_not_stacks(cls):
    stack = {"TransformerEncoder": "TransformerEncoderStack"}.get(
        cls.__name__, "TransformerDecoderStack"
    )
    with pytest.raises(TypeError, match=rf"is one block.*`{stack}`.*num_layers=2"):
        cls(num_layers=2, intermediate_dim=F, num_heads=H)
    with pytest.raises(ValueError, match=r"must be a keras_hub.layers"):
        cls.from_keras(keras.layers.Dense(3))


def test_block_saved_under_keras_hub_name_loads_as_the_block(tmp_path):
    sequence = keras.Input((None, D))
    output = layers.TransformerEncoder(F, H, name="encoder")(sequence)
    model = keras.Model(sequence, output)
    randomize(model)
    path = tmp_path / "encoder.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.get_layer("encoder")) is layers.TransformerEncoder
    x = normal((B, T, D), 5)
    close(loaded(x), model(x), 1e-6)


# CachedMultiHeadAttention.


def _hub_attention(**kwargs):
    hub = keras_hub.layers.CachedMultiHeadAttention(num_heads=H, key_dim=K, **kwargs)
    hub(normal((B, T, D)), normal((B, T, D)))
    randomize(hub)
    return hub


def test_cached_attention_equals_keras_hub():
    hub = _hub_attention()
    ours = layers.CachedMultiHeadAttention.from_keras(hub)
    assert type(ours) is layers.CachedMultiHeadAttention
    x, memory = normal((B, T, D), 1), normal((B, S, D), 2)
    close(ours(x, memory), hub(x, memory))
    mask = causal(T)
    close(ours(x, x, attention_mask=mask), hub(x, x, attention_mask=mask))
    # KerasHub's order of the call arguments: key, then the mask.
    close(ours(x, memory[:, :T], x, mask), hub(x, memory[:, :T], x, mask))
    # Prefill the whole cache, then compare every returned piece.
    cache = np.zeros((B, 2, T, H, K), "float32")
    mine = ours(x, x, attention_mask=mask, cache=cache, cache_update_index=0, return_attention_scores=True)
    theirs = hub(x, x, attention_mask=mask, cache=cache, cache_update_index=0, return_attention_scores=True)
    assert len(mine) == len(theirs) == 3
    for a, b in zip(mine, theirs):
        close(a, b)
    # Read a filled cache as it is (cross-attention).
    filled = mine[2]
    mine, theirs = ours(x, x, cache=filled), hub(x, x, cache=filled)
    assert len(mine) == len(theirs) == 2
    close(mine[0], theirs[0])


def test_cached_steps_equal_a_full_pass():
    hub = _hub_attention()
    ours = layers.CachedMultiHeadAttention.from_keras(hub)
    x, mask = normal((B, T, D), 3), causal(T)
    full = ours(x, x, attention_mask=mask)
    cache = np.zeros((B, 2, T, H, K), "float32")
    steps = []
    for i in range(T):
        step = x[:, i : i + 1]
        output, cache = ours(
            step, step, attention_mask=mask[:, i : i + 1], cache=cache, cache_update_index=i
        )
        theirs, _ = hub(
            step, step, attention_mask=mask[:, i : i + 1], cache=cache, cache_update_index=i
        )
        close(output, theirs)
        steps.append(harness.to_numpy(output))
    close(np.concatenate(steps, axis=1), full)


def test_cached_call_never_reads_unwritten_slots():
    # KerasHub reads any slot its mask allows; here slots not yet written
    # are never attended, whatever they hold.
    ours = layers.CachedMultiHeadAttention.from_keras(_hub_attention())
    x = normal((B, 2, D), 4)
    empty = np.zeros((B, 2, T, H, K), "float32")
    garbage = normal((B, 2, T, H, K), 5) * 100
    clean, _ = ours(x, x, cache=empty, cache_update_index=0)
    noisy, _ = ours(x, x, cache=garbage, cache_update_index=0)
    close(noisy, clean)


def test_cached_attention_layer_harness_and_errors():
    harness.run_layer_test(
        layers.CachedMultiHeadAttention,
        dict(num_heads=H, key_dim=K, dropout=0.1),
        inputs={"query": normal((B, T, D)), "value": normal((B, S, D))},
        expected_output_shapes=[(B, T, D)],
    )
    layer = layers.CachedMultiHeadAttention(num_heads=H, key_dim=K)
    x = normal((B, T, D))
    with pytest.raises(ValueError, match=r"`cache_update_index` needs a `cache`.*cache_update_index=0"):
        layer(x, x, cache_update_index=0)
    query, cache = keras.Input((None, D)), keras.Input((2, T, H, K))
    output, new_cache = layer(query, query, cache=cache, cache_update_index=0)
    assert tuple(output.shape) == (None, None, D)
    assert tuple(new_cache.shape) == (None, 2, T, H, K)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_cached_attention_dtype_policies_follow_keras_hub(policy):
    hub = keras_hub.layers.CachedMultiHeadAttention(num_heads=H, key_dim=K, dtype=policy)
    x = normal((B, T, D), 6)
    hub(x, x)
    randomize(hub)
    ours = layers.CachedMultiHeadAttention.from_keras(hub)
    cache = np.zeros((B, 2, T, H, K), policy.split("_")[1])
    mine = ours(x, x, attention_mask=causal(T), cache=cache, cache_update_index=0)
    theirs = hub(x, x, attention_mask=causal(T), cache=cache, cache_update_index=0)
    for a, b in zip(mine, theirs):
        assert keras.backend.standardize_dtype(a.dtype) == keras.backend.standardize_dtype(b.dtype)
        close(a, b, HALF_TOLERANCE)


# Position layers.


@pytest.mark.parametrize("shape", [(B, T, D), (B, 3, T, D)], ids=["rank3", "rank4"])
def test_position_embedding_equals_keras_hub(shape):
    x = normal(shape)
    hub = keras_hub.layers.PositionEmbedding(sequence_length=8)
    hub(x)
    randomize(hub)
    ours = layers.PositionEmbedding(sequence_length=8)
    ours(x)
    assert ours.position_embeddings is ours.embeddings
    ours.position_embeddings.assign(hub.position_embeddings)
    for kwargs in (dict(), dict(start_index=2), dict(positions=np.array([4, 0, 1, 7, 2]))):
        close(ours(x, **kwargs), hub(x, **kwargs))
    hub_config, config = hub.get_config(), ours.get_config()
    for name in ("sequence_length", "initializer"):
        assert config[name] == hub_config[name]
    symbolic = ours(keras.Input(shape[1:]))
    assert tuple(symbolic.shape) == (None,) + shape[1:]


@pytest.mark.parametrize("shape", [(B, T, D), (B, 3, T, D), (B, T, 7)], ids=["rank3", "rank4", "odd"])
def test_sinusoidal_encoding_equals_keras_hub(shape):
    x = normal(shape)
    hub = keras_hub.layers.SinePositionEncoding(max_wavelength=500)
    ours = layers.SinusoidalPositionEncoding(max_wavelength=500)
    for kwargs in (dict(), dict(start_index=3), dict(positions=np.array([4, 0, 1, 9, 2]))):
        close(ours(x, **kwargs), hub(x, **kwargs), 1e-6)
    assert ours.get_config()["max_wavelength"] == hub.get_config()["max_wavelength"]


def test_position_tables_refuse_too_short_inputs():
    with pytest.raises(ValueError, match=r"`inputs` must have rank 3.*\(5, 16\)"):
        layers.PositionEmbedding(8)(normal((T, D)))
    with pytest.raises(ValueError, match=r"`inputs` must have rank 3"):
        layers.SinusoidalPositionEncoding()(normal((T, D)))
    with pytest.raises(ValueError, match=r"longer than the position table.*length=5 > sequence_length=4"):
        layers.PositionEmbedding(4)(normal((B, 3, T, D)))


ROTARY = [
    ((B, T, H, K), dict()),
    ((B, T, D), dict()),
    ((B, H, T, K), dict(sequence_axis=2)),
    ((B, K, T), dict(sequence_axis=2, feature_axis=1)),
    ((B, T, H, K), dict(rope_type="dynamic", scaling_factor=4.0, max_wavelength=500)),
    ((B, T, H, 16), dict(rope_type="yarn", scaling_factor=4.0, original_max_position_embeddings=64)),
    ((B, T, H, 16), dict(rope_type="yarn", scaling_factor=8.0, truncate=False, beta_fast=16.0, beta_slow=2.0)),
    ((B, T, H, K), dict(denominator_dim=2 * K, scaling_factor=2.0)),
]
ROTARY_IDS = ["heads", "rank3", "sequence-axis", "both-axes", "dynamic", "yarn", "yarn-untruncated", "denominator"]


@pytest.mark.parametrize("shape, kwargs", ROTARY, ids=ROTARY_IDS)
def test_rotary_embedding_equals_keras_hub(shape, kwargs):
    x = normal(shape)
    hub = keras_hub.layers.RotaryEmbedding(**kwargs)
    ours = layers.RotaryEmbedding(**kwargs)
    length = shape[kwargs.get("sequence_axis", 1)]
    positions = np.arange(length)[::-1].copy()
    for call in (dict(), dict(start_index=3), dict(positions=positions)):
        close(ours(x, **call), hub(x, **call))
    # Every KerasHub argument, under its name.
    hub_config = {k: v for k, v in hub.get_config().items() if k not in ("trainable", "dtype", "name")}
    again = layers.RotaryEmbedding(**hub_config)
    close(again(x), hub(x))
    harness.check_config_round_trip(again)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_rotary_output_follows_the_dtype_policy(policy):
    x = normal((B, T, H, K))
    hub = keras_hub.layers.RotaryEmbedding(dtype=policy)
    ours = layers.RotaryEmbedding(dtype=policy)
    got, want = ours(x), hub(x)
    assert keras.backend.standardize_dtype(got.dtype) == policy.split("_")[1]
    assert keras.backend.standardize_dtype(want.dtype) == policy.split("_")[1]
    close(got, want, HALF_TOLERANCE)
    symbolic = ours(keras.Input((None, H, K)))
    assert keras.backend.standardize_dtype(symbolic.dtype) == policy.split("_")[1]


def test_token_and_position_embedding_initializer_sets_both_tables():
    layer = layers.TokenAndPositionEmbedding(
        vocabulary_size=10,
        sequence_length=T,
        embedding_dim=D,
        embeddings_initializer=keras.initializers.Constant(0.25),
    )
    layer(np.zeros((1, T), "int32"))
    assert np.all(harness.to_numpy(layer.token_embedding.embeddings) == 0.25)
    assert np.all(harness.to_numpy(layer.position_embedding.embeddings) == 0.25)
    assert layer.get_config()["position_initializer"] is None
    harness.check_config_round_trip(layer)
    # A seeded initializer draws the tables KerasHub's layer draws.
    initializer = keras.initializers.RandomNormal(seed=3)
    seeded = layers.TokenAndPositionEmbedding(10, T, D, embeddings_initializer=initializer)
    hub = keras_hub.layers.TokenAndPositionEmbedding(10, T, D, embeddings_initializer=initializer)
    seeded(np.zeros((1, T), "int32"))
    hub(np.zeros((1, T), "int32"))
    close(seeded.token_embedding.embeddings, hub.token_embedding.embeddings, 0)
    close(seeded.position_embedding.embeddings, hub.position_embedding.position_embeddings, 0)
    # `position_initializer`, when given, sets the position table alone.
    apart = layers.TokenAndPositionEmbedding(
        10, T, D, embeddings_initializer="zeros", position_initializer="ones"
    )
    apart(np.zeros((1, T), "int32"))
    assert np.all(harness.to_numpy(apart.position_embedding.embeddings) == 1.0)
    assert np.all(harness.to_numpy(apart.token_embedding.embeddings) == 0.0)


@pytest.mark.parametrize("mask_zero", [False, True])
def test_token_and_position_embedding_equals_keras_hub(mask_zero):
    kwargs = dict(
        vocabulary_size=10,
        sequence_length=8,
        embedding_dim=D,
        tie_weights=False,
        embeddings_initializer="glorot_uniform",
        mask_zero=mask_zero,
    )
    ids = np.array([[3, 4, 5, 0, 0], [1, 2, 0, 0, 0]], "int32")
    hub = keras_hub.layers.TokenAndPositionEmbedding(**kwargs)
    hub(ids)
    randomize(hub)
    ours = layers.TokenAndPositionEmbedding(**kwargs)
    ours(ids)
    ours.token_embedding.embeddings.assign(hub.token_embedding.embeddings)
    ours.position_embedding.position_embeddings.assign(hub.position_embedding.position_embeddings)
    for call in (dict(), dict(start_index=2)):
        close(ours(ids, **call), hub(ids, **call))
    got, want = masking.implicit_mask(ours(ids)), masking.implicit_mask(hub(ids))
    if mask_zero:
        np.testing.assert_array_equal(harness.to_numpy(got), harness.to_numpy(want))
    else:
        assert got is None and want is None
    hub_config = hub.get_config()
    config = ours.get_config()
    for name in ("vocabulary_size", "sequence_length", "embedding_dim", "tie_weights", "mask_zero"):
        assert config[name] == hub_config[name]
