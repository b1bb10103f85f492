"""Tests of `keras_attention.masking`: building, checking and merging masks.

Shape legend: `B` batch, `H` heads, `T` query length, `S` key length.
"""

import keras
import numpy as np
import pytest
from harness import to_numpy
from keras import ops

from keras_attention import masking

B, H, T, S = 2, 3, 4, 6


def _rng(seed=0):
    return np.random.default_rng(seed)


def _random_mask(shape, seed=0, p=0.7):
    return _rng(seed).random(shape) < p


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


def causal_reference(query_length, key_length, query_start=None):
    """Query `i` sees keys `0 .. query_start + i`; `query_start = S - T`."""
    if query_start is None:
        query_start = key_length - query_length
    return np.tril(np.ones((query_length, key_length), bool), k=query_start)


# causal_mask ------------------------------------------------------------


def test_causal_mask_by_hand():
    # Query block at the end of a longer key sequence: bottom-right aligned.
    np.testing.assert_array_equal(
        to_numpy(masking.causal_mask(2, 4)).astype(int),
        [[1, 1, 1, 0], [1, 1, 1, 1]],
    )
    # More queries than keys: the first queries see nothing.
    np.testing.assert_array_equal(
        to_numpy(masking.causal_mask(4, 2)).astype(int),
        [[0, 0], [0, 0], [1, 0], [1, 1]],
    )
    np.testing.assert_array_equal(
        to_numpy(masking.causal_mask(3)).astype(int),
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
    )


@pytest.mark.parametrize(
    "query_length, key_length",
    [(1, 1), (5, 5), (3, 7), (1, 6), (7, 3), (6, 1)],
)
def test_causal_mask_matches_numpy(query_length, key_length):
    mask = masking.causal_mask(query_length, key_length)
    assert _dtype(mask) == "bool"
    assert tuple(mask.shape) == (query_length, key_length)
    expected = causal_reference(query_length, key_length)
    np.testing.assert_array_equal(to_numpy(mask), expected)
    if query_length > key_length:
        # The first T - S queries precede every key.
        assert not to_numpy(mask)[: query_length - key_length].any()
    # The last query always sees every key.
    assert to_numpy(mask)[-1].all()


def test_causal_mask_key_length_defaults_to_query_length():
    np.testing.assert_array_equal(
        to_numpy(masking.causal_mask(5)), np.tril(np.ones((5, 5), bool))
    )


@pytest.mark.parametrize(
    "query_length, key_length, query_start",
    [(3, 5, 0), (3, 5, 2), (3, 5, 1), (2, 6, -1), (2, 3, 5), (4, 4, -4), (1, 8, 3)],
)
def test_causal_mask_query_start(query_length, key_length, query_start):
    mask = masking.causal_mask(query_length, key_length, query_start=query_start)
    assert _dtype(mask) == "bool"
    assert tuple(mask.shape) == (query_length, key_length)
    np.testing.assert_array_equal(
        to_numpy(mask), causal_reference(query_length, key_length, query_start)
    )


def test_causal_mask_query_start_default_is_bottom_right():
    np.testing.assert_array_equal(
        to_numpy(masking.causal_mask(3, 7, query_start=4)),
        to_numpy(masking.causal_mask(3, 7)),
    )


def test_causal_mask_tensor_lengths():
    # Lengths read from tensors: scalar integer tensors, numpy ints and
    # `ops.shape` of a tensor.
    query = ops.zeros((B, 3, 2))
    value = ops.zeros((B, 5, 2))
    expected = causal_reference(3, 5)
    cases = [
        (ops.shape(query)[1], ops.shape(value)[1], None),
        (ops.convert_to_tensor(3, "int32"), ops.convert_to_tensor(5, "int32"), None),
        (np.int64(3), np.int32(5), None),
        (3, 5, ops.convert_to_tensor(2, "int32")),
    ]
    for query_length, key_length, query_start in cases:
        mask = masking.causal_mask(query_length, key_length, query_start)
        assert _dtype(mask) == "bool"
        np.testing.assert_array_equal(to_numpy(mask), expected)


class _CausalMaskLayer(keras.layers.Layer):
    """Outputs `causal_mask(T, S)` as floats, broadcast to `(B, T, S)`."""

    def call(self, query, value):
        mask = masking.causal_mask(ops.shape(query)[1], ops.shape(value)[1])
        return ops.cast(mask, "float32")[None] + ops.zeros_like(query[:, :, :1])


def test_causal_mask_symbolic_lengths_in_compiled_model():
    # Inside a functional model with unknown lengths, compiled by `predict`
    # (tf.function / jax.jit), the lengths are symbolic or traced.
    query = keras.Input((None, 2))
    value = keras.Input((None, 2))
    model = keras.Model([query, value], _CausalMaskLayer()(query, value))
    for query_length, key_length in [(3, 5), (4, 4), (5, 2)]:
        out = model.predict(
            [np.zeros((B, query_length, 2)), np.zeros((B, key_length, 2))],
            verbose=0,
        )
        expected = causal_reference(query_length, key_length)
        np.testing.assert_array_equal(np.asarray(out) > 0.5, np.stack([expected] * B))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"query_length": 0}, r"`query_length` must be a positive integer.*=0"),
        ({"query_length": -1}, r"`query_length` must be a positive integer.*=-1"),
        ({"query_length": 2.5}, r"`query_length` must be an integer.*=2\.5"),
        ({"query_length": 3.0}, r"`query_length` must be an integer.*=3\.0"),
        ({"query_length": np.float32(2.5)}, r"`query_length` must be an integer.*2\.5"),
        ({"query_length": True}, r"`query_length` must be an integer.*=True"),
        ({"query_length": "3"}, r"`query_length` must be an integer"),
        ({"query_length": 3, "key_length": 0}, r"`key_length` must be a positive.*=0"),
        (
            {"query_length": 3, "key_length": -1},
            r"`key_length` must be a positive.*=-1",
        ),
        (
            {"query_length": 3, "key_length": 2.5},
            r"`key_length` must be an integer.*2\.5",
        ),
        (
            {"query_length": 3, "query_start": 1.5},
            r"`query_start` must be an integer.*1\.5",
        ),
        (
            {"query_length": 3, "query_start": False},
            r"`query_start` must be an integer",
        ),
    ],
)
def test_causal_mask_bad_lengths(kwargs, message):
    with pytest.raises(ValueError, match=message):
        masking.causal_mask(**kwargs)


def test_causal_mask_float_tensor_length():
    with pytest.raises(ValueError, match=r"`query_length` must be an integer.*float32"):
        masking.causal_mask(ops.convert_to_tensor(2.5, "float32"))
    with pytest.raises(ValueError, match=r"`key_length` must be an integer.*float32"):
        masking.causal_mask(2, ops.convert_to_tensor(4.0, "float32"))


# padding_mask -----------------------------------------------------------


@pytest.mark.parametrize("pad_id", [0, 3, -1])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_padding_mask_matches_numpy(pad_id, dtype):
    token_ids = _rng(1).integers(-1, 5, size=(3, 7)).astype(dtype)
    token_ids[:, -2:] = pad_id  # trailing padding
    mask = masking.padding_mask(ops.convert_to_tensor(token_ids), pad_id=pad_id)
    assert _dtype(mask) == "bool"
    assert tuple(mask.shape) == token_ids.shape
    np.testing.assert_array_equal(to_numpy(mask), token_ids != pad_id)
    assert not to_numpy(mask)[:, -2:].any()


def test_padding_mask_default_pad_id_is_zero():
    mask = masking.padding_mask(np.array([[5, 3, 0, 0], [0, 1, 2, 0]]))
    np.testing.assert_array_equal(
        to_numpy(mask), [[True, True, False, False], [False, True, True, False]]
    )


@pytest.mark.parametrize("pad_id", [1.0, np.float32(0), "0", None, True])
def test_padding_mask_non_int_pad_id(pad_id):
    with pytest.raises(ValueError, match=r"`pad_id` must be an integer.*pad_id="):
        masking.padding_mask(np.array([[1, 0]]), pad_id=pad_id)


# standardize_mask -------------------------------------------------------


def test_standardize_mask_none():
    assert masking.standardize_mask(None, "query_mask") is None


def test_standardize_mask_bool_passes_through():
    mask = _random_mask((B, T, S))
    out = masking.standardize_mask(ops.convert_to_tensor(mask), "attention_mask")
    assert _dtype(out) == "bool"
    assert tuple(out.shape) == mask.shape
    np.testing.assert_array_equal(to_numpy(out), mask)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64"])
def test_standardize_mask_int_to_bool(dtype):
    values = np.array([[0, 1, 2, 0], [3, 0, 0, 1]], dtype)
    if "uint" not in dtype:
        values[1, 0] = -1
    out = masking.standardize_mask(ops.convert_to_tensor(values), "value_mask")
    assert _dtype(out) == "bool"
    np.testing.assert_array_equal(
        to_numpy(out), [[False, True, True, False], [True, False, False, True]]
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("name", ["attention_mask", "value_mask"])
def test_standardize_mask_float_is_type_error(dtype, name):
    if dtype == "bfloat16":
        mask = ops.cast(ops.ones((B, S)), dtype)
    else:
        mask = np.ones((B, S), dtype)  # float64 stays float64 (JAX without x64)
    with pytest.raises(TypeError, match=rf"`{name}`.*{dtype}.*bias"):
        masking.standardize_mask(mask, name)


def test_standardize_mask_float_default_name():
    with pytest.raises(TypeError, match=r"`mask`.*bias"):
        masking.standardize_mask(np.ones((2, 2), "float32"))


@pytest.mark.parametrize(
    "shape, ranks",
    [((S,), (2, 3, 4)), ((1, 2, 1, 1, 3), (2, 3, 4)), ((B, T, S), (2,)), ((B,), (2,))],
)
def test_standardize_mask_wrong_rank(shape, ranks):
    shape_text = r"\(" + r",\s*".join(str(d) for d in shape)
    with pytest.raises(ValueError, match=rf"`key_mask` must have rank.*{shape_text}"):
        masking.standardize_mask(np.ones(shape, bool), "key_mask", ranks=ranks)


# merge_masks ------------------------------------------------------------


def test_merge_masks_all_none():
    assert masking.merge_masks() is None
    assert masking.merge_masks(None) is None
    assert masking.merge_masks(None, None, None) is None


def test_merge_masks_single_mask():
    mask = _random_mask((T, S))
    out = masking.merge_masks(None, mask, None)
    assert _dtype(out) == "bool"
    np.testing.assert_array_equal(to_numpy(out), mask)


def test_merge_masks_by_hand():
    a = np.array([[True, True, False], [False, True, True]])
    b = np.array([[True, False, False], [True, True, True]])
    np.testing.assert_array_equal(
        to_numpy(masking.merge_masks(a, None, b)),
        [[True, False, False], [False, True, True]],
    )


def test_merge_masks_and_of_many():
    masks = [_random_mask((B, T, S), seed=i) for i in range(4)]
    out = masking.merge_masks(*masks[:2], None, *masks[2:])
    np.testing.assert_array_equal(to_numpy(out), np.logical_and.reduce(masks))


def test_merge_masks_rank2_with_rank3():
    a = _random_mask((T, S), seed=1)
    b = _random_mask((B, T, S), seed=2)
    out = masking.merge_masks(a, b)
    assert tuple(out.shape) == (B, T, S)
    np.testing.assert_array_equal(to_numpy(out), a[None] & b)


@pytest.mark.parametrize("heads", [H, B])  # H == B would hide a misalignment.
def test_merge_masks_rank3_gets_head_axis(heads):
    a = _random_mask((B, T, S), seed=3)
    b = _random_mask((B, heads, T, S), seed=4)
    expected = np.expand_dims(a, 1) & b
    for masks in [(a, b), (b, a)]:
        out = masking.merge_masks(*masks)
        assert tuple(out.shape) == (B, heads, T, S)
        np.testing.assert_array_equal(to_numpy(out), expected)


def test_merge_masks_rank2_with_rank4():
    a = _random_mask((T, S), seed=5)
    b = _random_mask((B, H, T, S), seed=6)
    out = masking.merge_masks(a, b)
    np.testing.assert_array_equal(to_numpy(out), a[None, None] & b)


def test_merge_masks_padding_shapes_with_rank4():
    # Query (B, T, 1), key (B, 1, S) and a (B, H, T, S) mask.
    query = _random_mask((B, T, 1), seed=7)
    keys = _random_mask((B, 1, S), seed=8)
    full = _random_mask((B, H, T, S), seed=9)
    out = masking.merge_masks(query, keys, None, full)
    expected = query[:, None] & keys[:, None] & full
    np.testing.assert_array_equal(to_numpy(out), expected)


def test_merge_masks_int_masks():
    a = _rng(10).integers(0, 3, size=(B, T, S)).astype("int32")
    b = _random_mask((T, S), seed=11)
    out = masking.merge_masks(a, b)
    assert _dtype(out) == "bool"
    np.testing.assert_array_equal(to_numpy(out), (a != 0) & b)


def test_merge_masks_float_mask_is_type_error():
    with pytest.raises(TypeError, match=r"masks\[1\].*bias"):
        masking.merge_masks(np.ones((T, S), bool), np.ones((T, S), "float32"))


# compute_attention_mask -------------------------------------------------


def attention_mask_reference(
    query_length,
    key_length,
    query_mask=None,
    value_mask=None,
    key_mask=None,
    attention_mask=None,
    use_causal_mask=False,
):
    """The combined mask, spelled out, as `(B, T, S)` or `(B, H, T, S)`."""
    mask = np.ones((B, query_length, key_length), bool)
    if query_mask is not None:
        mask = mask & query_mask[:, :, None]
    if value_mask is not None:
        mask = mask & value_mask[:, None, :]
    if key_mask is not None:
        mask = mask & key_mask[:, None, :]
    if use_causal_mask:
        mask = mask & causal_reference(query_length, key_length)[None]
    if attention_mask is not None:
        if attention_mask.ndim == 4:
            mask = mask[:, None]
        mask = mask & attention_mask
    return mask


@pytest.mark.parametrize("query_length, key_length", [(T, S), (S, T), (T, T)])
@pytest.mark.parametrize(
    "names",
    [
        ("query_mask",),
        ("value_mask",),
        ("key_mask",),
        ("attention_mask_2",),
        ("attention_mask_3",),
        ("attention_mask_4",),
        ("causal",),
        ("query_mask", "value_mask"),
        ("value_mask", "key_mask", "causal"),
        ("query_mask", "value_mask", "attention_mask_3", "causal"),
        ("query_mask", "key_mask", "attention_mask_4", "causal"),
        ("query_mask", "value_mask", "key_mask", "attention_mask_2", "causal"),
    ],
)
def test_compute_attention_mask_matches_numpy(query_length, key_length, names):
    query = np.zeros((B, query_length, 3), "float32")
    value = np.zeros((B, key_length, 5), "float32")
    masks = {
        "query_mask": _random_mask((B, query_length), seed=1),
        "value_mask": _random_mask((B, key_length), seed=2),
        "key_mask": _random_mask((B, key_length), seed=3),
        "attention_mask_2": _random_mask((query_length, key_length), seed=4),
        "attention_mask_3": _random_mask((B, query_length, key_length), seed=5),
        "attention_mask_4": _random_mask((B, H, query_length, key_length), seed=6),
    }
    kwargs = {}
    for name in names:
        if name == "causal":
            kwargs["use_causal_mask"] = True
        elif name.startswith("attention_mask"):
            kwargs["attention_mask"] = masks[name]
        else:
            kwargs[name] = masks[name]
    expected = attention_mask_reference(query_length, key_length, **kwargs)

    out = masking.compute_attention_mask(query, value, **kwargs)
    assert _dtype(out) == "bool"
    out = to_numpy(out)
    assert np.broadcast_shapes(out.shape, expected.shape) == expected.shape
    np.testing.assert_array_equal(np.broadcast_to(out, expected.shape), expected)

    # Integer masks (0 = masked) give the same result.
    int_kwargs = {
        k: (v.astype("int32") * 7 if isinstance(v, np.ndarray) else v)
        for k, v in kwargs.items()
    }
    int_out = to_numpy(masking.compute_attention_mask(query, value, **int_kwargs))
    np.testing.assert_array_equal(np.broadcast_to(int_out, expected.shape), expected)


def test_compute_attention_mask_nothing_masked():
    query = np.zeros((B, T, 3), "float32")
    value = np.zeros((B, S, 3), "float32")
    assert masking.compute_attention_mask(query, value) is None


def test_compute_attention_mask_tensor_inputs():
    # Backend tensors for inputs and masks, a masked query row included.
    query_mask = np.ones((B, T), bool)
    query_mask[0, 1] = False
    value_mask = _random_mask((B, S), seed=12)
    out = masking.compute_attention_mask(
        ops.zeros((B, T, 3)),
        ops.zeros((B, S, 3)),
        query_mask=ops.convert_to_tensor(query_mask),
        value_mask=ops.convert_to_tensor(value_mask),
        use_causal_mask=True,
    )
    expected = attention_mask_reference(
        T, S, query_mask=query_mask, value_mask=value_mask, use_causal_mask=True
    )
    np.testing.assert_array_equal(
        np.broadcast_to(to_numpy(out), expected.shape), expected
    )
    assert not to_numpy(out)[0, 1].any()


@pytest.mark.parametrize(
    "name, shape, message",
    [
        (
            "query_mask",
            (B, T + 1),
            r"`query_mask` must have length 4 on axis 1.*\(2, 5\)",
        ),
        ("query_mask", (B + 1, T), r"`query_mask` must have batch size 2.*\(3, 4\)"),
        (
            "value_mask",
            (B, S - 1),
            r"`value_mask` must have length 6 on axis 1.*\(2, 5\)",
        ),
        ("value_mask", (B + 2, S), r"`value_mask` must have batch size 2.*\(4, 6\)"),
        ("key_mask", (B, S + 2), r"`key_mask` must have length 6 on axis 1.*\(2, 8\)"),
        ("key_mask", (1, S), r"`key_mask` must have batch size 2.*\(1, 6\)"),
        ("attention_mask", (B, T, S + 1), r"`attention_mask` must have key length 6"),
        ("attention_mask", (B, T - 1, S), r"`attention_mask` must have query length 4"),
        ("attention_mask", (B + 1, T, S), r"`attention_mask` must have batch size 2"),
        ("attention_mask", (T, S - 1), r"`attention_mask` must have key length 6"),
        (
            "attention_mask",
            (B, H, T + 1, S),
            r"`attention_mask` must have query length",
        ),
        ("attention_mask", (B + 1, H, T, S), r"`attention_mask` must have batch size"),
        ("query_mask", (B, T, 1), r"`query_mask` must have rank 2.*\(2, 4, 1\)"),
        ("value_mask", (S,), r"`value_mask` must have rank 2.*\(6,\)"),
        ("attention_mask", (S,), r"`attention_mask` must have rank.*\(6,\)"),
    ],
)
def test_compute_attention_mask_bad_shapes(name, shape, message):
    query = np.zeros((B, T, 3), "float32")
    value = np.zeros((B, S, 3), "float32")
    with pytest.raises(ValueError, match=message):
        masking.compute_attention_mask(query, value, **{name: np.ones(shape, bool)})


@pytest.mark.parametrize(
    "name, shape",
    [
        ("query_mask", (B, T)),
        ("value_mask", (B, S)),
        ("key_mask", (B, S)),
        ("attention_mask", (B, T, S)),
    ],
)
def test_compute_attention_mask_float_mask_is_type_error(name, shape):
    query = np.zeros((B, T, 3), "float32")
    value = np.zeros((B, S, 3), "float32")
    with pytest.raises(TypeError, match=rf"`{name}`.*float32.*bias"):
        masking.compute_attention_mask(
            query, value, **{name: ops.ones(shape, "float32")}
        )


def test_compute_attention_mask_size_one_axes_broadcast():
    """`(1, T, S)` and `(B, 1, S)` attention masks broadcast like numpy."""
    batch, query_length, key_length = 2, 3, 4
    query = np.zeros((batch, query_length, 5), "float32")
    value = np.zeros((batch, key_length, 5), "float32")
    shared = np.random.default_rng(1).random((1, query_length, key_length)) > 0.5
    per_key = np.array([[[1, 1, 0, 1]], [[0, 1, 1, 1]]], bool)  # (B, 1, S)
    value_mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    got = to_numpy(
        masking.compute_attention_mask(
            query, value, value_mask=value_mask, attention_mask=shared
        )
    )
    expected = shared & value_mask[:, None, :]
    np.testing.assert_array_equal(np.broadcast_to(got, expected.shape), expected)
    got = to_numpy(masking.compute_attention_mask(query, value, attention_mask=per_key))
    np.testing.assert_array_equal(got, per_key)
    with pytest.raises(ValueError, match=r"`attention_mask` must have batch size 2"):
        masking.compute_attention_mask(
            query, value, attention_mask=np.ones((3, query_length, key_length), bool)
        )
