"""Property tests: drawn malformed calls get a clear `ValueError`/`TypeError`.

Each example draws a kind of bad input (a wrong rank, axes that disagree, a
float mask, an index out of range or not an integer, a bad constructor
value) for a public layer, model or function, and requires a `ValueError`
or `TypeError` itself (no backend exception type, no subclass of them a
backend defines) whose message names the argument and the value received.
"""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from keras import ops

import strategies as s
from keras_attention import kv_cache
from keras_attention import masking
from keras_attention import ops as ka_ops
from keras_attention.layers import HardAttention
from keras_attention.layers import MultiHeadAttention
from keras_attention.layers import PositionEmbedding
from keras_attention.layers import RotaryEmbedding
from keras_attention.layers import SelfAttention
from keras_attention.layers import SinusoidalPositionEncoding
from keras_attention.layers import SoftAttention
from keras_attention.layers import TokenAndPositionEmbedding
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerEncoderBlock
from keras_attention.models import GPT

B, T, S, L, D = 2, 3, 4, 4, 8
_X = np.random.default_rng(0).normal(size=(B, T, D)).astype("float32")
_V = np.random.default_rng(1).normal(size=(B, S, D)).astype("float32")


def _mha(heads=2):
    return s.cached_layer(
        ("bad-mha", heads),
        lambda: MultiHeadAttention(num_heads=heads, key_dim=4, kernel_initializer="zeros"),
        _X, _V,
    )


def _expect_error(call, name, value):
    """`call()` raises exactly a ValueError or TypeError naming `name` and
    showing `value`."""
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert type(info.value) in (ValueError, TypeError), type(info.value)
    # The message itself, without the arguments Keras appends to errors
    # raised in `call` (which would show any value).
    message = str(info.value).split("Arguments received by")[0]
    assert f"`{name}`" in message, message
    assert re.search(value, message), (value, message)


# The bad values, each with the pattern its message must show.
_NOT_INTEGERS = st.sampled_from(
    [(1.5, r"=1\.5"), (1.0, r"=1\.0"), (True, r"=True"), ("1", r"='1'"),
     (np.float32(2.0), r"2\.0")]
)


@st.composite
def index_out_of_range(draw, length, new_length=1):
    """An integer-like index with `index < 0` or `index + new_length > length`."""
    value = draw(st.one_of(st.integers(-5, -1), st.integers(length - new_length + 1, length + 5)))
    return draw(s.integer_like(value)), rf"={value}\b"


@st.composite
def cache_index_calls(draw):
    """An out-of-range or non-integer `cache_update_index`, on any form."""
    step = _X[:, :1]
    cache = np.zeros((B, 2, L, 2, 4), "float32")
    if draw(st.booleans()):
        index, pattern = draw(index_out_of_range(L))
    else:
        index, pattern = draw(_NOT_INTEGERS)
    return (
        lambda: _mha()(step, step, cache=cache, cache_update_index=index),
        "cache_update_index", pattern,
    )


@st.composite
def mha_shape_calls(draw):
    """Axes that disagree, wrong ranks and float masks for MultiHeadAttention."""
    kind = draw(
        st.sampled_from(
            ["mask heads", "mask batch", "mask length", "float mask", "key batch",
             "key length", "query rank", "cache batch", "cache heads", "padding length"]
        )
    )
    layer = _mha()
    if kind == "mask heads":
        heads = draw(st.sampled_from([3, 4]))
        shape = (B, heads, T, S)
        return (lambda: layer(_X, _V, attention_mask=np.ones(shape, bool)),
                "attention_mask", re.escape(str(shape)))
    if kind == "mask batch":
        shape = (3, T, S)
        return (lambda: layer(_X, _V, attention_mask=np.ones(shape, bool)),
                "attention_mask", re.escape(str(shape)))
    if kind == "mask length":
        shape = draw(st.sampled_from([(B, T + 1, S), (B, T, S + 1), (T, S - 1)]))
        return (lambda: layer(_X, _V, attention_mask=np.ones(shape, bool)),
                "attention_mask", re.escape(str(shape)))
    if kind == "float mask":
        name = draw(st.sampled_from(["attention_mask", "query_mask", "value_mask"]))
        shape = {"attention_mask": (B, T, S), "query_mask": (B, T), "value_mask": (B, S)}[name]
        return (lambda: layer(_X, _V, **{name: np.ones(shape, "float32")}), name, "float32")
    if kind == "key batch":
        return (lambda: layer(_X, _V, key=np.zeros((3, S, D), "float32")), "key", "batch size=3")
    if kind == "key length":
        return (lambda: layer(_X, _V, key=np.zeros((B, S + 1, D), "float32")), "key", f"length={S + 1}")
    if kind == "query rank":
        shape = draw(st.sampled_from([(B, D), (B, 1, T, D)]))
        return (lambda: layer(np.zeros(shape, "float32"), _V), "query", re.escape(str(shape)))
    if kind == "padding length":
        shape = (B, S + 1)
        return (lambda: layer(_X, _V, value_mask=np.ones(shape, bool)), "value_mask", re.escape(str(shape)))
    shape = (3, 2, L, 2, 4) if kind == "cache batch" else (B, 2, L, 3, 4)
    step = _X[:, :1]
    return (lambda: layer(step, step, cache=np.zeros(shape, "float32"), cache_update_index=0),
            "cache", re.escape(str(shape)))


@st.composite
def other_layer_calls(draw):
    """Bad calls of the other layers: ranks, axes, masks, start indices."""
    kind = draw(
        st.sampled_from(
            ["soft key batch", "soft rank-4 mask", "hard float mask", "self mask length",
             "position start", "sinusoidal start", "rotary start", "token start",
             "encoder padding", "decoder cache index", "rotary rank"]
        )
    )
    if kind == "soft key batch":
        layer = s.cached_layer("bad-soft", SoftAttention, _X, _V)
        return (lambda: layer(_X, _V, key=np.zeros((3, S, D), "float32")), "key", "batch size=3")
    if kind == "soft rank-4 mask":
        layer = s.cached_layer("bad-soft", SoftAttention, _X, _V)
        shape = (B, 1, T, S)
        return (lambda: layer(_X, _V, attention_mask=np.ones(shape, bool)),
                "attention_mask", re.escape(str(shape)))
    if kind == "hard float mask":
        layer = s.cached_layer("bad-hard", lambda: HardAttention(selection="argmax"), _X, _V)
        return (lambda: layer(_X, _V, value_mask=np.ones((B, S), "float32")), "value_mask", "float32")
    if kind == "self mask length":
        layer = s.cached_layer("bad-self", lambda: SelfAttention(4), _X)
        return (lambda: layer(_X, mask=np.ones((B, T + 1), bool)), "mask", f"length={T + 1}")
    if kind == "rotary rank":
        return (lambda: RotaryEmbedding()(_X[0]), "inputs", re.escape(str(_X[0].shape)))
    if kind == "encoder padding":
        layer = s.cached_layer("bad-encoder", lambda: TransformerEncoderBlock(16, 2), _X)
        shape, pattern = draw(st.sampled_from([((B, T + 1), f"length={T + 1}"), ((3, T), "batch size=3")]))
        return (lambda: layer(_X, padding_mask=np.ones(shape, bool)), "padding_mask", pattern)
    if kind == "decoder cache index":
        layer = s.cached_layer("bad-decoder", lambda: TransformerDecoderBlock(16, 2), _X)
        step = _X[:, :1]
        if draw(st.booleans()):
            index, pattern = draw(index_out_of_range(L))
        else:
            index, pattern = draw(_NOT_INTEGERS)
        return (
            lambda: layer(
                step, self_attention_cache=np.zeros((B, 2, L, 2, 4), "float32"),
                self_attention_cache_update_index=index,
            ),
            "cache_update_index", pattern,
        )
    # A start index: negative, not an integer, or past the position table.
    choice = draw(st.sampled_from(["negative", "not integer", "past table"]))
    if choice == "negative":
        value = draw(st.integers(-4, -1))
        start, pattern = draw(s.integer_like(value)), rf"={value}\b"
    elif choice == "not integer" or kind in ("sinusoidal start", "rotary start"):
        start, pattern = draw(_NOT_INTEGERS)
    else:
        value = draw(st.integers(6 - T + 1, 8))
        start, pattern = draw(s.integer_like(value)), rf"start_index={value}\b"
    if kind == "position start":
        layer = s.cached_layer("bad-position", lambda: PositionEmbedding(6), _X)
        call = lambda: layer(_X, start_index=start)  # noqa: E731
    elif kind == "sinusoidal start":
        call = lambda: SinusoidalPositionEncoding()(_X, start_index=start)  # noqa: E731
    elif kind == "rotary start":
        heads = _X.reshape(B, T, 2, 4)
        call = lambda: RotaryEmbedding()(heads, start_index=start)  # noqa: E731
    else:
        layer = s.cached_layer(
            "bad-token", lambda: TokenAndPositionEmbedding(10, 6, D), np.zeros((1, T), "int32")
        )
        call = lambda: layer(np.ones((B, T), "int32"), start_index=start)  # noqa: E731
    return call, "start_index", pattern


@st.composite
def constructor_calls(draw):
    """Bad constructor values: heads, sizes, rates, seeds, divisibility."""
    kind = draw(st.sampled_from(["num_heads", "key_dim", "dropout", "seed", "num_key_value_heads"]))
    value = {
        "num_heads": st.sampled_from([0, -1, 1.5, True, "2", None]),
        "key_dim": st.sampled_from([0, -3, 2.0, False]),
        "dropout": st.sampled_from([1.0, -0.1, 1.5, True, "0.1"]),
        "seed": st.sampled_from([1.5, "a", True, -1]),
        "num_key_value_heads": st.sampled_from([3, 0, 1.5]),
    }[kind]
    value = draw(value)
    kwargs = {"num_heads": 2, "key_dim": 4, kind: value}
    return lambda: MultiHeadAttention(**kwargs), kind, re.escape(repr(value)) if kind != "num_key_value_heads" else re.escape(str(value))


@st.composite
def function_calls(draw):
    """Bad arguments of the public functions: masking, ops, kv_cache."""
    kind = draw(st.sampled_from(["causal length", "query_start", "float softmax mask", "kv index", "pad_id"]))
    if kind == "causal length":
        value, pattern = draw(st.sampled_from([(0, "=0"), (-2, "=-2"), (2.5, r"=2\.5"), (True, "=True")]))
        return lambda: masking.causal_mask(value), "query_length", pattern
    if kind == "query_start":
        value, pattern = draw(_NOT_INTEGERS)
        return lambda: masking.causal_mask(3, 4, query_start=value), "query_start", pattern
    if kind == "float softmax mask":
        logits = np.zeros((B, T, S), "float32")
        return lambda: ka_ops.masked_softmax(logits, np.ones((B, T, S), "float32")), "mask", "float32"
    if kind == "kv index":
        index, pattern = draw(index_out_of_range(L, 2))
        return lambda: kv_cache.check_index(index, 2, L), "cache_update_index", pattern
    value = draw(st.sampled_from([1.5, True, "0"]))
    return lambda: masking.padding_mask(np.ones((B, T), "int32"), value), "pad_id", re.escape(repr(value))


def _gpt():
    return s.cached_layer(
        "bad-gpt",
        lambda: GPT(vocabulary_size=11, max_sequence_length=8, num_layers=1, num_heads=2,
                    hidden_dim=8, intermediate_dim=16),
        np.zeros((1, 2), "int32"),
    )


@st.composite
def model_calls(draw):
    """Bad calls of `GPT` and its `generate`."""
    prompt = np.ones((B, T), "int32")
    kind = draw(
        st.sampled_from(
            ["max_new_tokens", "pad_token_id", "stop_token_ids", "prompt mask", "float ids",
             "ids range", "cache index", "cache batch"]
        )
    )
    model = _gpt()
    if kind == "max_new_tokens":
        value, pattern = draw(st.sampled_from([(0, "=0"), (2.0, r"=2\.0"), (True, "=True"), (6, "=6")]))
        return lambda: model.generate(prompt, value), "max_new_tokens", pattern
    if kind in ("pad_token_id", "stop_token_ids"):
        value, pattern = draw(st.sampled_from([(11, "=11"), (-1, "=-1"), (1.5, r"=1\.5"), (True, "=True")]))
        arg = value if kind == "pad_token_id" else [value]
        return lambda: model.generate(prompt, 2, **{kind: arg}), kind, pattern
    if kind == "prompt mask":
        return (lambda: model.generate(prompt, 2, prompt_padding_mask=np.ones((B, T), "float32")),
                "prompt_padding_mask", "float32")
    if kind == "float ids":
        ids = np.ones((B, T), "float32")
        if draw(st.booleans()):
            ids = ops.convert_to_tensor(ids)
        return lambda: model(ids), "token_ids", "float32"
    if kind == "ids range":
        value = draw(st.sampled_from([11, 20, -1]))
        ids = np.full((B, T), value, "int32")
        if draw(st.booleans()):
            ids = ops.convert_to_tensor(ids)
        return lambda: model(ids), "token_ids", rf"id {value}\b"
    if kind == "cache index":
        index, pattern = draw(index_out_of_range(L))
        return (lambda: model.call_with_cache(prompt[:, :1], model.empty_cache(B, L), index),
                "cache_update_index", pattern)
    return (lambda: model.call_with_cache(prompt[:, :1], model.empty_cache(3, L), 0),
            "cache", r"\(3, 2, 4")


@s.examples(16)
@given(call=cache_index_calls())
def test_bad_cache_index_is_named(call):
    _expect_error(*call)


@s.examples(16)
@given(call=mha_shape_calls())
def test_multi_head_attention_bad_shapes_are_named(call):
    _expect_error(*call)


@s.examples(20)
@given(call=other_layer_calls())
def test_other_layers_bad_calls_are_named(call):
    _expect_error(*call)


@s.examples(12)
@given(call=constructor_calls())
def test_bad_constructor_values_are_named(call):
    _expect_error(*call)


@s.examples(12)
@given(call=function_calls())
def test_functions_bad_arguments_are_named(call):
    _expect_error(*call)


@s.examples(12)
@given(call=model_calls())
def test_models_bad_calls_are_named(call):
    _expect_error(*call)
