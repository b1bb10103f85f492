"""Hypothesis strategies shared by the property suite.

Shape legend: `B` batch, `T` query length, `S` key length, `L` cache length,
`H` query heads, `G` key/value heads, `K` key head size.

Sizes are drawn from small sets, so that the examples of a run share shapes:
a backend compiles each operation once per shape, and a few shapes keep the
whole suite within seconds. Layers are made once per configuration
(`cached_layer`) with random weights, and reused by every example that draws
that configuration.
"""

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from keras import ops

WIDTH = 8  # the model width of queries, keys and values
_LAYERS = {}


def examples(count):
    """The test's fixed example count under the `ci` profile (the default);
    under another profile (`HYPOTHESIS_PROFILE=dev`) that profile's count."""
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci":
        return lambda test: test
    return settings(max_examples=count)


def cached_layer(key, make, *build_args, seed=0):
    """The layer `make()` built on `build_args`, with random weights, made
    once per `key` and reused."""
    if key not in _LAYERS:
        layer = make()
        layer(*build_args)
        rng = np.random.default_rng(seed)
        layer.set_weights(
            [(0.5 * rng.normal(size=w.shape)).astype("float32") for w in layer.get_weights()]
        )
        _LAYERS[key] = layer
    return _LAYERS[key]


def normal(rng, shape):
    return rng.normal(size=shape).astype("float32")


@st.composite
def head_counts(draw):
    """`(H, G)` with `G` dividing `H`."""
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    return heads, kv_heads


@st.composite
def integer_like(draw, value):
    """`value` as a Python int, a numpy integer, a 0-d numpy array or a tensor."""
    form = draw(st.sampled_from(["int", "numpy", "array", "tensor"]))
    if form == "int":
        return int(value)
    if form == "numpy":
        return draw(st.sampled_from([np.int32, np.int64]))(value)
    if form == "array":
        return np.array(value, "int32")
    return ops.convert_to_tensor(value, "int32")


@st.composite
def attention_masks(draw, batch, heads, query_length, key_length, rng):
    """`(kwargs, reference)`: mask arguments of every form, and their AND as a
    numpy `(B, H, T, S)` boolean mask.

    Forms: padding masks of queries, values and keys; attention masks
    `(T, S)`, `(B, T, S)`, `(1, T, S)`, `(B, 1, S)`, `(B, H, T, S)`,
    `(B, 1, T, S)`, as booleans or integers (0 = masked); with some
    probability one query row is masked entirely.
    """
    kwargs = {}
    reference = np.ones((batch, heads, query_length, key_length), bool)

    def bits(shape):
        return rng.random(shape) < 0.7

    for name, shape, expand in (
        ("query_mask", (batch, query_length), lambda m: m[:, None, :, None]),
        ("value_mask", (batch, key_length), lambda m: m[:, None, None, :]),
        ("key_mask", (batch, key_length), lambda m: m[:, None, None, :]),
    ):
        if draw(st.booleans()):
            mask = bits(shape)
            kwargs[name] = mask
            reference &= expand(mask)
    form = draw(
        st.sampled_from(
            [None, "TS", "BTS", "1TS", "B1S", "BHTS", "B1TS"]
        )
    )
    if form is not None:
        shape = {
            "TS": (query_length, key_length),
            "BTS": (batch, query_length, key_length),
            "1TS": (1, query_length, key_length),
            "B1S": (batch, 1, key_length),
            "BHTS": (batch, heads, query_length, key_length),
            "B1TS": (batch, 1, query_length, key_length),
        }[form]
        mask = bits(shape)
        if draw(st.booleans()):
            # A fully masked query row: it attends to nothing.
            mask[..., draw(st.integers(0, shape[-2] - 1)), :] = False
        reference &= mask if len(shape) == 4 else (
            mask[None, None] if len(shape) == 2 else mask[:, None]
        )
        kwargs["attention_mask"] = (
            mask.astype("int32") if draw(st.booleans()) else mask
        )
    return kwargs, reference


def causal(query_length, key_length):
    """Bottom-right aligned: query `t` sees keys `0 .. S - T + t`."""
    return np.tril(np.ones((query_length, key_length), bool), k=key_length - query_length)
