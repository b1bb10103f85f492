"""Tests of the position layers and the token-and-position embedding.

`SinusoidalPositionEncoding`, `PositionEmbedding`, `RotaryEmbedding` and
`TokenAndPositionEmbedding`, each against numpy references written here from
the papers' formulas. Shapes are shared between tests (JAX compiles each new
shape once).
"""

import keras
import numpy as np
import pytest
from keras import ops

import harness
from keras_attention.layers import PositionEmbedding
from keras_attention.layers import RotaryEmbedding
from keras_attention.layers import SinusoidalPositionEncoding
from keras_attention.layers import TokenAndPositionEmbedding
from keras_attention.layers import _direct_calls

BATCH, LENGTH, DIM = 2, 5, 8
HEADS, HEAD_DIM = 2, 8
VOCABULARY_SIZE, SEQUENCE_LENGTH = 20, 8


def _embeddings(length=LENGTH, dim=DIM, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, length, dim)).astype("float32")


def _heads(length=LENGTH, seed=0):
    """Queries or keys `(B, T, H, D)`."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, length, HEADS, HEAD_DIM)).astype("float32")


def _ids():
    # Example 0 has 4 real tokens, example 1 has 2; 0 is padding.
    return np.array([[3, 1, 4, 1, 0], [5, 9, 0, 0, 0]], "int32")


def _compiled(fn):
    """`fn` compiled by the backend (jax.jit, tf.function); torch runs eagerly.

    Under tf.function a second call at another length retraces with an
    unknown length, so lengths are dynamic there.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(fn)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, reduce_retracing=True)
    return fn


def _save_and_load(model, tmp_path):
    """Saves `model` as `.keras` and loads it back in safe mode."""
    path = str(tmp_path / "model.keras")
    model.save(path)
    return keras.saving.load_model(path, safe_mode=True)


# numpy references, written from the papers.


def sinusoidal_reference(positions, dim, max_wavelength=10000.0):
    """Vaswani et al. (3.5): PE[pos, 2i] = sin(pos / w^(2i/d)), 2i+1: cos."""
    table = np.zeros(positions.shape + (dim,))
    for column in range(dim):
        i = column // 2
        angle = positions / max_wavelength ** (2 * i / dim)
        table[..., column] = np.sin(angle) if column % 2 == 0 else np.cos(angle)
    return table


def rotary_reference(x, positions, max_wavelength=10000.0, scaling_factor=1.0):
    """Rotate-half RoPE: pair (i, i + D/2) turns by pos w^(-2i/D) / s.

    `x` is `(B, T, H, D)`, `positions` `(T,)`.
    """
    half = x.shape[-1] // 2
    y = np.empty_like(x, dtype="float64")
    for t, pos in enumerate(positions):
        for i in range(half):
            theta = pos * max_wavelength ** (-2 * i / x.shape[-1]) / scaling_factor
            a, b = x[:, t, :, i], x[:, t, :, i + half]
            y[:, t, :, i] = a * np.cos(theta) - b * np.sin(theta)
            y[:, t, :, i + half] = b * np.cos(theta) + a * np.sin(theta)
    return y


# SinusoidalPositionEncoding.


def test_sinusoidal_layer_harness():
    harness.run_layer_test(
        SinusoidalPositionEncoding,
        {"max_wavelength": 100},
        inputs={"inputs": _embeddings()},
        expected_output_shapes=[(BATCH, LENGTH, DIM)],
        run_training_check=False,  # no weights
    )


@pytest.mark.parametrize("dim, max_wavelength", [(DIM, 10000), (7, 50.0)])
def test_sinusoidal_equals_the_papers_formula(dim, max_wavelength):
    x = _embeddings(dim=dim)
    layer = SinusoidalPositionEncoding(max_wavelength=max_wavelength)
    output = harness.to_numpy(layer(x))
    expected = sinusoidal_reference(np.arange(LENGTH), dim, max_wavelength)
    assert output.shape == x.shape
    for example in output:  # broadcast over the batch
        np.testing.assert_allclose(example, expected, atol=1e-6)
    # Position 0: sin(0) = 0 in even columns, cos(0) = 1 in odd ones.
    np.testing.assert_array_equal(output[0, 0, 0::2], 0.0)
    np.testing.assert_array_equal(output[0, 0, 1::2], 1.0)


def test_sinusoidal_start_index_and_positions():
    x = _embeddings()
    layer = SinusoidalPositionEncoding()
    full = sinusoidal_reference(np.arange(20), DIM)
    shifted = harness.to_numpy(layer(x, start_index=7))
    np.testing.assert_allclose(shifted[1], full[7:12], atol=1e-5)
    as_tensor = harness.to_numpy(layer(x, start_index=ops.convert_to_tensor(7)))
    np.testing.assert_allclose(as_tensor, shifted, atol=1e-6)
    # Unbatched positions, then one row of positions per example.
    positions = np.array([4, 0, 19, 2, 2], "int32")
    output = harness.to_numpy(layer(x, positions=positions))
    np.testing.assert_allclose(output[0], full[positions], atol=1e-5)
    batched = np.stack([positions, np.arange(5, 10)]).astype("int32")
    output = harness.to_numpy(layer(x, positions=batched))
    np.testing.assert_allclose(output[0], full[positions], atol=1e-5)
    np.testing.assert_allclose(output[1], full[5:10], atol=1e-5)


def test_sinusoidal_in_a_functional_model_at_several_lengths():
    inputs = keras.Input((None, DIM))
    model = keras.Model(inputs, SinusoidalPositionEncoding()(inputs))
    assert tuple(model.output.shape) == (None, None, DIM)
    for length in (3, LENGTH):
        output = model.predict(_embeddings(length), verbose=0)
        expected = sinusoidal_reference(np.arange(length), DIM)
        np.testing.assert_allclose(output[0], expected, atol=1e-6)


def test_sinusoidal_mask_passes_through():
    ids = _ids()
    embedded = keras.layers.Embedding(10, DIM, mask_zero=True)(ids)
    output = SinusoidalPositionEncoding()(embedded)
    np.testing.assert_array_equal(harness.to_numpy(output._keras_mask), ids != 0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_sinusoidal_mixed_precision_close_to_float32(policy):
    x = _embeddings()
    expected = harness.to_numpy(SinusoidalPositionEncoding()(x, start_index=3))
    output = SinusoidalPositionEncoding(dtype=policy)(x, start_index=3)
    assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
    np.testing.assert_allclose(
        harness.to_numpy(output).astype("float32"), expected, atol=1e-2
    )


@pytest.mark.parametrize("value", [0, -1, "10000", None, True, float("inf")])
def test_sinusoidal_rejects_bad_max_wavelength(value):
    with pytest.raises(ValueError, match=r"`max_wavelength` must be a positive"):
        SinusoidalPositionEncoding(max_wavelength=value)


def test_sinusoidal_rejects_bad_calls():
    layer = SinusoidalPositionEncoding()
    with pytest.raises(ValueError, match=r"`inputs` must have rank 3.*\(2, 5\)"):
        layer(np.zeros((2, 5), "float32"))
    with pytest.raises(ValueError, match=r"`start_index`.*start_index=-1"):
        layer(_embeddings(), start_index=-1)
    with pytest.raises(ValueError, match=r"`positions` must have shape"):
        layer(_embeddings(), positions=np.zeros((1, 2, 5), "int32"))
    with pytest.raises(ValueError, match=r"positions length=4, inputs length=5"):
        layer(_embeddings(), positions=np.arange(4))


# PositionEmbedding.


def test_position_embedding_layer_harness():
    harness.run_layer_test(
        PositionEmbedding,
        {"sequence_length": SEQUENCE_LENGTH, "initializer": "he_normal"},
        inputs={"inputs": _embeddings()},
        expected_output_shapes=[(BATCH, LENGTH, DIM)],
    )


def _position_embedding(sequence_length=SEQUENCE_LENGTH):
    layer = PositionEmbedding(sequence_length, name="positions")
    layer.build((None, None, DIM))
    table = np.arange(sequence_length * DIM, dtype="float32").reshape(-1, DIM)
    layer.embeddings.assign(table)
    return layer, table


def test_position_embedding_rows():
    layer, table = _position_embedding()
    x = _embeddings()
    assert [w.path for w in layer.weights] == ["positions/embeddings"]
    assert tuple(layer.embeddings.shape) == (SEQUENCE_LENGTH, DIM)
    output = harness.to_numpy(layer(x))
    np.testing.assert_array_equal(output, np.broadcast_to(table[:LENGTH], x.shape))
    output = harness.to_numpy(layer(x, start_index=3))
    np.testing.assert_array_equal(output[1], table[3:8])
    output = harness.to_numpy(layer(x, start_index=ops.convert_to_tensor(2)))
    np.testing.assert_array_equal(output[0], table[2:7])
    positions = np.array([[7, 0, 0, 3, 1], [0, 1, 2, 3, 4]], "int32")
    output = harness.to_numpy(layer(x, positions=positions))
    np.testing.assert_array_equal(output, table[positions])


def test_position_embedding_rejects_too_long_sequences():
    layer = PositionEmbedding(SEQUENCE_LENGTH)
    with pytest.raises(ValueError, match=r"length=10 > sequence_length=8"):
        layer(_embeddings(length=10))
    with pytest.raises(
        ValueError, match=r"start_index=4 \+ length=5 > sequence_length=8"
    ):
        layer(_embeddings(), start_index=4)
    # Symbolic inputs of a static length are checked when the model is built.
    with pytest.raises(ValueError, match=r"length=12 > sequence_length=8"):
        PositionEmbedding(SEQUENCE_LENGTH)(keras.Input((12, DIM)))


def test_position_embedding_gradient_reaches_only_the_used_rows():
    inputs = keras.Input((LENGTH, DIM))
    layer = PositionEmbedding(16)
    model = keras.Model(inputs, layer(inputs, start_index=3))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    before = harness.to_numpy(layer.embeddings).copy()
    model.train_on_batch(_embeddings(), np.ones((BATCH, LENGTH, DIM), "float32"))
    changed = np.any(harness.to_numpy(layer.embeddings) != before, axis=-1)
    np.testing.assert_array_equal(np.flatnonzero(changed), np.arange(3, 8))


def test_position_embedding_in_a_functional_model_at_several_lengths():
    inputs = keras.Input((None, DIM))
    layer, table = _position_embedding()
    model = keras.Model(inputs, layer(inputs))
    for length in (3, LENGTH, SEQUENCE_LENGTH):
        output = model.predict(_embeddings(length), verbose=0)
        np.testing.assert_array_equal(output[1], table[:length])


def test_position_embedding_in_a_while_loop_with_a_tensor_start_index():
    """Cached decoding: one row per step, the index a loop variable."""
    layer, table = _position_embedding()
    step = _embeddings(length=1)  # (B, 1, D)

    def decode(start):
        def body(index, rows):
            row = layer(step, start_index=index)  # (B, 1, D)
            return index + 1, ops.slice_update(rows, (0, index, 0), row)

        rows = ops.zeros((BATCH, SEQUENCE_LENGTH, DIM))
        _, rows = ops.while_loop(
            lambda index, rows: index < SEQUENCE_LENGTH, body, (start, rows)
        )
        return rows

    rows = harness.to_numpy(_compiled(decode)(ops.convert_to_tensor(2, "int32")))
    np.testing.assert_array_equal(rows[0, 2:], table[2:])
    np.testing.assert_array_equal(rows[:, :2], 0.0)


def test_position_embedding_compiled_with_dynamic_lengths():
    layer, table = _position_embedding()
    call = _compiled(lambda x, start: layer(x, start_index=start))
    for length, start in [(3, 5), (LENGTH, 1)]:
        x = _embeddings(length)
        rows = harness.to_numpy(call(x, ops.convert_to_tensor(start, "int32")))
        np.testing.assert_array_equal(rows[1], table[start : start + length])


def test_position_embedding_saves_and_loads(tmp_path):
    inputs = keras.Input((None, DIM))
    layer = PositionEmbedding(SEQUENCE_LENGTH, name="positions")
    model = keras.Model(inputs, layer(inputs))
    x = _embeddings()
    restored = _save_and_load(model, tmp_path)
    np.testing.assert_array_equal(
        harness.to_numpy(restored(x)), harness.to_numpy(model(x))
    )
    assert restored.get_layer("positions").get_config() == layer.get_config()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sequence_length": 0}, r"`sequence_length` must be a positive integer"),
        ({"sequence_length": 4.5}, r"sequence_length=4.5"),
        ({"sequence_length": None}, r"sequence_length=None"),
        ({"sequence_length": 8, "initializer": "nope"}, r"nope"),
    ],
)
def test_position_embedding_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PositionEmbedding(**kwargs)


# RotaryEmbedding.


def test_rotary_layer_harness():
    harness.run_layer_test(
        RotaryEmbedding,
        {"max_wavelength": 100, "scaling_factor": 2.0},
        inputs={"inputs": _heads()},
        call_kwargs={"start_index": 2},
        expected_output_shapes=[(BATCH, LENGTH, HEADS, HEAD_DIM)],
        run_training_check=False,  # no weights
    )


@pytest.mark.parametrize(
    "max_wavelength, scaling_factor, start_index",
    [(10000, 1.0, 0), (100, 2.0, 3)],
)
def test_rotary_equals_numpy(max_wavelength, scaling_factor, start_index):
    x = _heads()
    layer = RotaryEmbedding(max_wavelength, scaling_factor)
    output = harness.to_numpy(layer(x, start_index=start_index))
    positions = np.arange(start_index, start_index + LENGTH)
    expected = rotary_reference(x, positions, max_wavelength, scaling_factor)
    np.testing.assert_allclose(output, expected, atol=1e-5)


def test_rotary_hand_worked_pair():
    # Head size 2: one pair (x0, x1) turned by pos radians.
    x = np.zeros((1, 3, 1, 2), "float32")
    x[..., 0] = 1.0
    output = harness.to_numpy(RotaryEmbedding()(x))
    angles = np.arange(3)
    np.testing.assert_allclose(output[0, :, 0, 0], np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(output[0, :, 0, 1], np.sin(angles), atol=1e-6)


def test_rotary_preserves_norms():
    x = _heads()
    output = harness.to_numpy(RotaryEmbedding()(x, start_index=1000))
    np.testing.assert_allclose(
        np.linalg.norm(output, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )


def test_rotary_dot_products_depend_only_on_the_offset():
    rng = np.random.default_rng(3)
    q, k = rng.normal(size=(2, HEAD_DIM)).astype("float32")
    length = 24
    # The same q and k vectors at every position 0 .. 23.
    qs = np.broadcast_to(q, (BATCH, length, HEADS, HEAD_DIM)).copy()
    ks = np.broadcast_to(k, (BATCH, length, HEADS, HEAD_DIM)).copy()
    layer = RotaryEmbedding()
    q_rot = harness.to_numpy(layer(qs))[0, :, 0]  # (T, D)
    k_rot = harness.to_numpy(layer(ks))[0, :, 0]
    scores = q_rot @ k_rot.T  # (T, T), scores[m, n] = q_m . k_n
    for m, n, c in [(0, 3, 5), (7, 2, 11), (4, 4, 19), (1, 9, 14)]:
        np.testing.assert_allclose(scores[m, n], scores[m + c, n + c], atol=1e-4)
    # And they do depend on the offset.
    assert abs(scores[0, 0] - scores[0, 3]) > 1e-3


def test_rotary_start_index_equals_slicing_the_full_rotation():
    x = _heads(length=SEQUENCE_LENGTH)
    layer = RotaryEmbedding()
    full = harness.to_numpy(layer(x))
    part = harness.to_numpy(layer(x[:, 3:], start_index=3))
    np.testing.assert_allclose(part, full[:, 3:], atol=1e-5)
    part = harness.to_numpy(layer(x[:, 3:], start_index=ops.convert_to_tensor(3)))
    np.testing.assert_allclose(part, full[:, 3:], atol=1e-5)
    positions = np.arange(3, SEQUENCE_LENGTH)
    part = harness.to_numpy(layer(x[:, 3:], positions=positions))
    np.testing.assert_allclose(part, full[:, 3:], atol=1e-5)


def test_rotary_batched_positions():
    x = _heads()
    positions = np.array([[0, 1, 2, 3, 4], [9, 3, 3, 0, 7]], "int32")
    output = harness.to_numpy(RotaryEmbedding()(x, positions=positions))
    for b in range(BATCH):
        expected = rotary_reference(x[b : b + 1], positions[b])
        np.testing.assert_allclose(output[b : b + 1], expected, atol=1e-5)


def test_rotary_in_a_while_loop_with_a_tensor_start_index():
    """Decoding one position per step equals rotating the whole sequence."""
    x = _heads(length=SEQUENCE_LENGTH)
    layer = RotaryEmbedding()
    expected = harness.to_numpy(layer(x))

    def decode(x):
        def body(index, rotated):
            step = ops.slice(x, (0, index, 0, 0), (BATCH, 1, HEADS, HEAD_DIM))
            row = layer(step, start_index=index)  # (B, 1, H, D)
            return index + 1, ops.slice_update(rotated, (0, index, 0, 0), row)

        start = ops.convert_to_tensor(0, "int32")
        _, rotated = ops.while_loop(
            lambda index, rotated: index < SEQUENCE_LENGTH,
            body,
            (start, ops.zeros_like(x)),
        )
        return rotated

    rotated = harness.to_numpy(_compiled(decode)(x))
    np.testing.assert_allclose(rotated, expected, atol=1e-5)


@pytest.mark.parametrize("rope_type", ["linear", "yarn"])
def test_rotary_inside_a_decoding_loop_slices_the_angles_it_computed(rope_type):
    """Inside `inference()` (an eager decoding loop) a known start reads
    `cos` and `sin` from those computed for the positions so far: the same
    values as a call outside, as the table grows, for several ranks and
    after the loop ends."""
    kwargs = {"rope_type": rope_type, "scaling_factor": 4.0}
    layer = RotaryEmbedding(**kwargs)
    x = _heads(length=SEQUENCE_LENGTH)  # (B, T, H, D)
    x3 = x[:, :, 0]  # (B, T, D)
    expected = harness.to_numpy(layer(x))
    expected3 = harness.to_numpy(layer(x3))
    with _direct_calls.inference():
        table = _direct_calls.memo(layer._memo_key())
        # A 2-token prompt, then one token a step: the table is computed for 2
        # positions, then 4, then 8.
        pieces = [layer(ops.convert_to_tensor(x[:, :2]), start_index=0)]
        for start in range(2, SEQUENCE_LENGTH):
            step = ops.convert_to_tensor(x[:, start : start + 1])
            pieces.append(layer(step, start_index=start))
        assert sorted(known for known, _ in table.values()) == [SEQUENCE_LENGTH]
        rank3 = layer(ops.convert_to_tensor(x3[:, 5:7]), start_index=5)
    got = np.concatenate([harness.to_numpy(piece) for piece in pieces], axis=1)
    # Equal up to the last bit of float32's cos and sin, which TensorFlow
    # computes differently for tensors of other lengths.
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(harness.to_numpy(rank3), expected3[:, 5:7], rtol=0, atol=1e-6)
    if rope_type == "linear":
        reference = rotary_reference(x, np.arange(SEQUENCE_LENGTH), scaling_factor=4.0)
        np.testing.assert_allclose(got, reference, atol=1e-5)
    assert _direct_calls.memo(layer._memo_key()) is None  # nothing is kept after the loop


class _ShiftedRotary(RotaryEmbedding):
    """Frequencies from an attribute outside the configuration."""

    shift = 0.0

    def _inverse_frequency(self, head_dim):
        return [frequency + self.shift for frequency in super()._inverse_frequency(head_dim)]


def test_rotary_layers_of_one_configuration_share_the_loops_angles():
    """Every block's rotary embedding of one configuration reads one table
    in a decoding loop; another configuration, or a subclass (whose angles
    may depend on more than its configuration), has its own."""
    x = ops.convert_to_tensor(_heads(length=SEQUENCE_LENGTH))
    first, second, other = RotaryEmbedding(), RotaryEmbedding(), RotaryEmbedding(100)
    shifted = _ShiftedRotary()
    shifted.shift = 0.5
    expected = {name: harness.to_numpy(layer(x, start_index=3)) for name, layer in
                (("first", first), ("other", other), ("shifted", shifted))}
    with _direct_calls.inference():
        got = {name: harness.to_numpy(layer(x, start_index=3)) for name, layer in
               (("first", first), ("second", second), ("other", other), ("shifted", shifted))}
        assert first._memo_key() == second._memo_key()
        assert len({first._memo_key(), other._memo_key(), shifted._memo_key()}) == 3
    close = {"rtol": 0, "atol": 1e-6}  # float32's last bit (the test above)
    np.testing.assert_allclose(got["first"], expected["first"], **close)
    np.testing.assert_allclose(got["second"], expected["first"], **close)
    np.testing.assert_allclose(got["other"], expected["other"], **close)
    np.testing.assert_allclose(got["shifted"], expected["shifted"], **close)
    assert np.abs(expected["shifted"] - expected["first"]).max() > 1e-2


def test_rotary_and_sinusoidal_compiled_with_dynamic_lengths():
    rotary, sinusoidal = RotaryEmbedding(), SinusoidalPositionEncoding()
    rotate = _compiled(lambda x, start: rotary(x, start_index=start))
    encode = _compiled(lambda x, start: sinusoidal(x, start_index=start))
    for length, start in [(3, 5), (LENGTH, 1)]:
        positions = np.arange(start, start + length)
        x = _heads(length)
        output = harness.to_numpy(rotate(x, ops.convert_to_tensor(start, "int32")))
        np.testing.assert_allclose(output, rotary_reference(x, positions), atol=1e-5)
        x = _embeddings(length)
        output = harness.to_numpy(encode(x, ops.convert_to_tensor(start, "int32")))
        np.testing.assert_allclose(
            output[0], sinusoidal_reference(positions, DIM), atol=1e-5
        )


def test_rotary_in_a_functional_model_at_several_lengths():
    inputs = keras.Input((None, HEADS, HEAD_DIM))
    model = keras.Model(inputs, RotaryEmbedding()(inputs))
    for length in (3, LENGTH):
        x = _heads(length)
        output = model.predict(x, verbose=0)
        np.testing.assert_allclose(
            output, rotary_reference(x, np.arange(length)), atol=1e-5
        )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_rotary_mixed_precision_close_to_float32(policy):
    x = _heads()
    expected = harness.to_numpy(RotaryEmbedding()(x, start_index=100))
    output = RotaryEmbedding(dtype=policy)(x, start_index=100)
    assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
    np.testing.assert_allclose(
        harness.to_numpy(output).astype("float32"), expected, atol=5e-2, rtol=2e-2
    )


def test_rotary_keeps_the_input_dtype():
    x = ops.cast(_heads(), "float16")
    layer = RotaryEmbedding(dtype="float16")
    assert keras.backend.standardize_dtype(layer(x).dtype) == "float16"


def test_rotary_rejects_bad_inputs():
    layer = RotaryEmbedding()
    with pytest.raises(ValueError, match=r"must be known and even.*head size 7"):
        layer(np.zeros((1, 3, 2, 7), "float32"))
    with pytest.raises(ValueError, match=r"`inputs` must have rank 3"):
        layer(np.zeros((3, 8), "float32"))
    with pytest.raises(ValueError, match=r"`sequence_axis`.*sequence_axis=0"):
        RotaryEmbedding(sequence_axis=0)(np.zeros((1, 3, 8), "float32"))
    with pytest.raises(ValueError, match=r"`feature_axis`.*feature_axis=3"):
        RotaryEmbedding(feature_axis=3)(np.zeros((1, 3, 8), "float32"))
    with pytest.raises(ValueError, match=r"must differ.*sequence_axis=2, feature_axis=-1"):
        RotaryEmbedding(sequence_axis=2)(np.zeros((1, 3, 8), "float32"))
    with pytest.raises(ValueError, match=r"head size 5"):
        layer(keras.Input((None, 2, 5)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_wavelength": 0}, r"`max_wavelength`.*max_wavelength=0"),
        ({"scaling_factor": -1.0}, r"`scaling_factor`.*scaling_factor=-1.0"),
        ({"scaling_factor": "2"}, r"scaling_factor='2'"),
        ({"rope_type": "ntk"}, r"`rope_type`.*rope_type='ntk'"),
        ({"beta_fast": 0}, r"`beta_fast`.*beta_fast=0"),
        ({"original_max_position_embeddings": 0}, r"original_max_position_embeddings=0"),
        ({"truncate": "yes"}, r"`truncate`.*truncate='yes'"),
        ({"sequence_axis": 1.5}, r"`sequence_axis`.*sequence_axis=1.5"),
        ({"denominator_dim": -2}, r"`denominator_dim`.*denominator_dim=-2"),
    ],
)
def test_rotary_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(**kwargs)


# TokenAndPositionEmbedding.


@pytest.mark.parametrize(
    "init_kwargs, call_kwargs, input_kind",
    [
        ({"mask_zero": True}, {}, "ids"),
        ({"position": "sinusoidal", "max_wavelength": 100}, {"start_index": 2}, "ids"),
        ({"tie_weights": False}, {"reverse": True}, "hidden"),
    ],
    ids=["learned", "sinusoidal", "reverse_untied"],
)
def test_token_and_position_layer_harness(init_kwargs, call_kwargs, input_kind):
    init_kwargs = {
        "vocabulary_size": VOCABULARY_SIZE,
        "sequence_length": SEQUENCE_LENGTH,
        "embedding_dim": DIM,
        **init_kwargs,
    }
    if input_kind == "ids":
        inputs, shape = _ids(), (BATCH, LENGTH, DIM)
    else:
        inputs, shape = _embeddings(), (BATCH, LENGTH, VOCABULARY_SIZE)
    harness.run_layer_test(
        TokenAndPositionEmbedding,
        init_kwargs,
        inputs={"inputs": inputs},
        call_kwargs=call_kwargs,
        expected_output_shapes=[shape],
        # In reverse the token table (and the position table) are unused.
        run_training_check=input_kind == "ids",
    )


def _token_and_position(**kwargs):
    layer = TokenAndPositionEmbedding(
        VOCABULARY_SIZE, SEQUENCE_LENGTH, DIM, name="embedding", **kwargs
    )
    layer.build((None, None))
    rng = np.random.default_rng(5)
    for variable in layer.weights:
        variable.assign(rng.normal(size=variable.shape).astype("float32"))
    return layer


def test_token_and_position_is_token_plus_position():
    layer = _token_and_position()
    assert [w.path for w in layer.weights] == [
        "embedding/token_embedding/embeddings",
        "embedding/position_embedding/embeddings",
    ]
    tokens = harness.to_numpy(layer.token_embedding.embeddings)
    positions = harness.to_numpy(layer.position_embedding.embeddings)
    ids = _ids()
    output = harness.to_numpy(layer(ids))
    np.testing.assert_allclose(output, tokens[ids] + positions[:LENGTH], atol=1e-6)
    output = harness.to_numpy(layer(ids[:, :3], start_index=5))
    np.testing.assert_allclose(output, tokens[ids[:, :3]] + positions[5:8], atol=1e-6)


def test_token_and_position_with_sinusoidal_positions():
    layer = _token_and_position(position="sinusoidal", max_wavelength=100)
    assert isinstance(layer.position_embedding, SinusoidalPositionEncoding)
    assert len(layer.weights) == 1  # the token table only
    tokens = harness.to_numpy(layer.token_embedding.embeddings)
    ids = _ids()
    output = harness.to_numpy(layer(ids, start_index=2))
    expected = tokens[ids] + sinusoidal_reference(np.arange(2, 7), DIM, 100)
    np.testing.assert_allclose(output, expected, atol=1e-5)


def test_token_and_position_without_positions_is_the_token_table():
    """`position=None` (positions enter elsewhere, e.g. rotary): `E[ids]`
    at any start index, no position weights, the length still bounded."""
    layer = _token_and_position(position=None, tie_weights=False)
    assert layer.position_embedding is None
    assert [w.path for w in layer.weights] == [
        "embedding/token_embedding/embeddings",
        "embedding/token_embedding/reverse_embeddings",
    ]
    tokens = harness.to_numpy(layer.token_embedding.embeddings)
    ids = _ids()
    np.testing.assert_array_equal(harness.to_numpy(layer(ids)), tokens[ids])
    np.testing.assert_array_equal(
        harness.to_numpy(layer(ids[:, :2], start_index=5)), tokens[ids[:, :2]]
    )
    with pytest.raises(ValueError, match=r"length=10 > sequence_length=8"):
        layer(np.ones((BATCH, 10), "int32"))
    config = layer.get_config()
    assert config["position"] is None
    assert TokenAndPositionEmbedding.from_config(config).position_embedding is None


def test_token_and_position_mask_zero():
    layer = _token_and_position(mask_zero=True)
    ids = _ids()
    output = layer(ids)
    np.testing.assert_array_equal(harness.to_numpy(output._keras_mask), ids != 0)
    np.testing.assert_array_equal(harness.to_numpy(layer.compute_mask(ids)), ids != 0)
    assert _token_and_position().compute_mask(ids) is None
    # A downstream layer reads the mask: the mean over real tokens only.
    inputs = keras.Input((None,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(layer(inputs))
    model = keras.Model(inputs, pooled)
    hidden = harness.to_numpy(output)
    expected = [hidden[b][ids[b] != 0].mean(axis=0) for b in range(BATCH)]
    np.testing.assert_allclose(model.predict(ids, verbose=0), expected, atol=1e-5)


def test_token_and_position_reverse_tied_is_h_times_the_transposed_table():
    layer = _token_and_position(mask_zero=True)
    hidden = _embeddings()
    logits = layer(hidden, reverse=True)
    table = harness.to_numpy(layer.token_embedding.embeddings)  # (V, D)
    np.testing.assert_allclose(harness.to_numpy(logits), hidden @ table.T, atol=1e-4)
    assert getattr(logits, "_keras_mask", None) is None
    assert layer.compute_mask(hidden) is None


def test_token_and_position_untied_has_a_separate_reverse_kernel():
    layer = _token_and_position(tie_weights=False)
    names = [w.path.split("/")[-1] for w in layer.weights]
    assert names == ["embeddings", "reverse_embeddings", "embeddings"]
    reverse = harness.to_numpy(layer.token_embedding.reverse_embeddings)  # (D, V)
    assert reverse.shape == (DIM, VOCABULARY_SIZE)
    hidden = _embeddings()
    logits = harness.to_numpy(layer(hidden, reverse=True))
    np.testing.assert_allclose(logits, hidden @ reverse, atol=1e-4)
    table = harness.to_numpy(layer.token_embedding.embeddings)
    assert not np.allclose(logits, hidden @ table.T, atol=1e-2)


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_token_and_position_rejects_too_long_sequences(position):
    layer = TokenAndPositionEmbedding(
        VOCABULARY_SIZE, SEQUENCE_LENGTH, DIM, position=position
    )
    with pytest.raises(ValueError, match=r"length=10 > sequence_length=8"):
        layer(np.ones((BATCH, 10), "int32"))
    with pytest.raises(
        ValueError, match=r"start_index=6 \+ length=5 > sequence_length=8"
    ):
        layer(_ids(), start_index=6)
    with pytest.raises(ValueError, match=r"length=9 > sequence_length=8"):
        layer(keras.Input((9,), dtype="int32"))


def test_token_and_position_in_a_functional_model_at_several_lengths():
    layer = _token_and_position(mask_zero=True)
    ids = keras.Input((None,), dtype="int32")
    hidden = layer(ids)
    model = keras.Model(ids, [hidden, layer(hidden, reverse=True)])
    assert [tuple(o.shape) for o in model.outputs] == [
        (None, None, DIM),
        (None, None, VOCABULARY_SIZE),
    ]
    tokens = harness.to_numpy(layer.token_embedding.embeddings)
    positions = harness.to_numpy(layer.position_embedding.embeddings)
    for length in (3, LENGTH):
        batch = _ids()[:, :length]
        hidden, logits = model.predict(batch, verbose=0)
        np.testing.assert_allclose(
            hidden, tokens[batch] + positions[:length], atol=1e-5
        )
        np.testing.assert_allclose(logits, hidden @ tokens.T, atol=1e-4)


@pytest.mark.parametrize("position", ["learned", "sinusoidal", None])
def test_token_and_position_saves_and_loads(tmp_path, position):
    ids = keras.Input((None,), dtype="int32")
    layer = TokenAndPositionEmbedding(
        VOCABULARY_SIZE,
        SEQUENCE_LENGTH,
        DIM,
        mask_zero=True,
        tie_weights=False,
        position=position,
        max_wavelength=500,
        name="embedding",
    )
    hidden = layer(ids)
    model = keras.Model(ids, [hidden, layer(hidden, reverse=True)])
    restored = _save_and_load(model, tmp_path)
    for want, have in zip(model(_ids()), restored(_ids())):
        np.testing.assert_array_equal(harness.to_numpy(have), harness.to_numpy(want))
    restored_layer = restored.get_layer("embedding")
    assert restored_layer.get_config() == layer.get_config()
    assert [w.path for w in restored.weights] == [w.path for w in model.weights]


def test_token_and_position_mixed_precision_close_to_float32():
    layer = _token_and_position(mask_zero=True)
    mixed = TokenAndPositionEmbedding(
        VOCABULARY_SIZE, SEQUENCE_LENGTH, DIM, mask_zero=True, dtype="mixed_bfloat16"
    )
    mixed.build((None, None))
    for source, target in zip(layer.weights, mixed.weights):
        target.assign(source)
    for args in [(_ids(),), (_embeddings(),)]:
        reverse = args[0].dtype == np.float32
        expected = harness.to_numpy(layer(*args, reverse=reverse))
        output = mixed(*args, reverse=reverse)
        assert keras.backend.standardize_dtype(output.dtype) == "bfloat16"
        np.testing.assert_allclose(
            harness.to_numpy(output).astype("float32"), expected, atol=0.1, rtol=0.02
        )


def test_token_and_position_config_round_trip():
    layer = TokenAndPositionEmbedding(
        VOCABULARY_SIZE,
        SEQUENCE_LENGTH,
        DIM,
        mask_zero=True,
        tie_weights=False,
        embeddings_initializer="he_uniform",
        position="sinusoidal",
        max_wavelength=123.0,
    )
    harness.check_config_round_trip(layer)
    config = layer.get_config()
    assert config["vocabulary_size"] == VOCABULARY_SIZE
    assert config["sequence_length"] == SEQUENCE_LENGTH
    assert config["embedding_dim"] == DIM
    assert config["mask_zero"] is True and config["tie_weights"] is False
    assert config["position"] == "sinusoidal" and config["max_wavelength"] == 123.0
    assert config["embeddings_initializer"]["class_name"] == "HeUniform"
    clone = TokenAndPositionEmbedding.from_config(config)
    assert clone.token_embedding.tie_weights is False
    assert clone.position_embedding.max_wavelength == 123.0


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 8, 8), {}, r"vocabulary_size=0"),
        ((20, 2.5, 8), {}, r"`sequence_length`.*sequence_length=2.5"),
        ((20, 8, -4), {}, r"`embedding_dim`.*embedding_dim=-4"),
        ((20, 8, 8), {"position": "rotary"}, r"`position` must be one of.*'rotary'"),
        ((20, 8, 8), {"max_wavelength": 0}, r"max_wavelength=0"),
    ],
)
def test_token_and_position_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenAndPositionEmbedding(*args, **kwargs)


def test_token_and_position_rejects_bad_calls():
    layer = TokenAndPositionEmbedding(VOCABULARY_SIZE, SEQUENCE_LENGTH, DIM)
    with pytest.raises(ValueError, match=r"`inputs` must have rank 2"):
        layer(_embeddings())
    with pytest.raises(ValueError, match=r"inputs width=4, embedding_dim width=8"):
        layer(np.zeros((BATCH, LENGTH, 4), "float32"), reverse=True)


def _tensors_refuse_numpy(patch):
    """On torch, tensors that refuse to become numpy arrays, as a GPU tensor
    does: a numpy constant meeting a tensor in an operator then fails (on a
    GPU, `SinusoidalPositionEncoding` did, before its constants became
    tensors). The other backends are left as they are."""
    if keras.backend.backend() == "torch":
        import torch

        def refuse(self, *args, **kwargs):
            raise TypeError("can't convert this tensor to numpy")

        patch.setattr(torch.Tensor, "__array__", refuse)


def test_position_layers_keep_their_constants_on_the_backend(monkeypatch):
    x = ops.convert_to_tensor(_embeddings())
    heads = ops.convert_to_tensor(_heads())
    with monkeypatch.context() as patch:
        _tensors_refuse_numpy(patch)
        sines = SinusoidalPositionEncoding()(x, start_index=2)
        rotated = RotaryEmbedding()(heads, start_index=2)
    positions = np.arange(2, 2 + LENGTH)
    np.testing.assert_allclose(
        harness.to_numpy(sines)[0], sinusoidal_reference(positions, DIM, 10000), atol=1e-5
    )
    np.testing.assert_allclose(
        harness.to_numpy(rotated), rotary_reference(_heads(), positions, 10000, 1.0), atol=1e-5
    )
