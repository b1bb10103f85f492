"""Keras's own test files for its attention layers, run against ours.

The README calls `keras_attention.layers.MultiHeadAttention`, `Attention`
and `AdditiveAttention` drop-ins for Keras's layers of the same names; this
module holds them to that. It loads Keras's test files
(`keras/src/layers/attention/*_test.py`) from the installed Keras wheel (a
fresh copy, so Keras's own module is left alone), points the layer names
inside them at our classes and runs every test, so a Keras release that adds
a test shows up here as a new test.

Two departures are deliberate (see the layers' docstrings and the README):

- a fully masked query row gives 0 here, the mean of the values in Keras, so
  `test_masking_causal` is an expected failure; in `Attention` and
  `AdditiveAttention` a masked query's weights are 0 too (Keras returns the
  softmax), so each file's `test_attention_with_mask` is one;
- a float 0/1 mask is refused here (it could be meant as an additive bias),
  so the one MultiHeadAttention test that passes one runs with that mask
  cast to bool, and the three `compute_mask` tests of `attention_test.py`
  that pass float masks are expected failures.

Four tests of `attention_test.py` call Keras's private methods
`_calculate_scores` and `_calculate_score_mask`, which our layer does not
have (it scores through its scorer): expected failures too. Every expected
failure is strict, so a change that makes one pass shows up.
"""

import importlib.util
import os
import types

import keras
import pytest

from keras_attention import layers as our_layers

_KERAS_DIR = os.path.dirname(keras.__file__)
_MHA_TESTS = os.path.join(
    _KERAS_DIR, "src", "layers", "attention", "multi_head_attention_test.py"
)
_GQA_TESTS = os.path.join(
    _KERAS_DIR, "src", "layers", "attention", "grouped_query_attention_test.py"
)
_ATTENTION_TESTS = os.path.join(_KERAS_DIR, "src", "layers", "attention", "attention_test.py")
_ADDITIVE_TESTS = os.path.join(
    _KERAS_DIR, "src", "layers", "attention", "additive_attention_test.py"
)

pytest.importorskip("absl.testing.parameterized")
for _path in (_MHA_TESTS, _GQA_TESTS, _ATTENTION_TESTS, _ADDITIVE_TESTS):
    if not os.path.exists(_path):
        pytest.skip(f"Keras's test file is not installed: {_path}", allow_module_level=True)


class _Namespace(types.ModuleType):
    """A module that reads as `base`, except for the names given."""

    def __init__(self, base, **names):
        super().__init__(base.__name__)
        self.__dict__.update(names)
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)


def _load(path, name, **replacements):
    """A fresh copy of the test module at `path`, with module-level names
    replaced."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in replacements.items():
        setattr(module, key, value(getattr(module, key)))
    return module


_mha = _load(
    _MHA_TESTS,
    "_keras_multi_head_attention_test",
    layers=lambda keras_layers: _Namespace(
        keras_layers, MultiHeadAttention=our_layers.MultiHeadAttention
    ),
)


FULLY_MASKED_ROWS = (
    "by design: a fully masked query row attends to nothing and gives 0 here; "
    "Keras gives the mean of the values"
)

class TestKerasMultiHeadAttention(_mha.MultiHeadAttentionTest):
    """Keras's `MultiHeadAttentionTest`, with our layer."""

    @pytest.mark.xfail(
        reason=FULLY_MASKED_ROWS,
        strict=True,
    )
    def test_masking_causal(self):
        super().test_masking_causal()

    def test_masking_with_different_shapes(self):
        # Keras's test builds its mask as float 0/1 (`ops.tril(ops.ones(..))`),
        # which our layer refuses: here that mask is cast to bool.
        keras_ops = _mha.ops
        _mha.ops = _Namespace(
            keras_ops, tril=lambda x, k=0: keras_ops.cast(keras_ops.tril(x, k), "bool")
        )
        try:
            super().test_masking_with_different_shapes()
        finally:
            _mha.ops = keras_ops


@keras.saving.register_keras_serializable(package="keras_attention_tests")
class GroupedQueryAttention(our_layers.MultiHeadAttention):
    """Keras's `GroupedQueryAttention` arguments on our layer.

    `head_dim` is our `key_dim` (and the value head size),
    `num_query_heads` our `num_heads`; `num_key_value_heads`, the gate, the
    sliding window, `flash_attention` and the rest keep their names. (Keras's
    layer has no `value_dim`, `output_shape` or `attention_axes`; ours keep
    their defaults.)
    """

    def __init__(self, head_dim, num_query_heads, num_key_value_heads, **kwargs):
        super().__init__(
            num_heads=num_query_heads,
            key_dim=head_dim,
            num_key_value_heads=num_key_value_heads,
            **kwargs,
        )

    head_dim = property(lambda self: self.key_dim)
    num_query_heads = property(lambda self: self.num_heads)

    def get_config(self):
        config = super().get_config()
        config["head_dim"] = config.pop("key_dim")
        config["num_query_heads"] = config.pop("num_heads")
        return config


_gqa = _load(
    _GQA_TESTS,
    "_keras_grouped_query_attention_test",
    layers=lambda keras_layers: _Namespace(
        keras_layers, GroupedQueryAttention=GroupedQueryAttention
    ),
)


class TestKerasGroupedQueryAttention(_gqa.GroupedQueryAttentionTest):
    """Keras's `GroupedQueryAttentionTest`, with our layer's
    `num_key_value_heads` under Keras's argument names."""

    @pytest.mark.xfail(
        reason=FULLY_MASKED_ROWS,
        strict=True,
    )
    def test_masking_causal(self):
        super().test_masking_causal()

    @pytest.mark.xfail(
        reason="Keras's GroupedQueryAttention requires the query and value "
        "widths to be equal; ours follows keras.layers.MultiHeadAttention, "
        "which allows them to differ (the value is projected to heads)",
        strict=True,
    )
    def test_shape_mismatch_error_query_value_dim_mismatch(self):
        super().test_shape_mismatch_error_query_value_dim_mismatch()


_attention = _load(
    _ATTENTION_TESTS,
    "_keras_attention_test",
    layers=lambda keras_layers: _Namespace(keras_layers, Attention=our_layers.Attention),
)
_additive = _load(
    _ADDITIVE_TESTS,
    "_keras_additive_attention_test",
    layers=lambda keras_layers: _Namespace(
        keras_layers, AdditiveAttention=our_layers.AdditiveAttention
    ),
)


MASKED_QUERY_WEIGHTS = (
    "by design: a masked query attends to nothing, so its weights are 0 here "
    "(its output is 0 in both); Keras masks only the output and returns the "
    "softmax over the values as the query's weights"
)
FLOAT_MASKS = (
    "by design: a float mask is refused with a TypeError (it could be meant "
    "as an additive bias); Keras passes a float query mask through as the "
    "output mask"
)


def _private(method):
    return (
        f"reads Keras's private method `{method}`, which ours does not have: "
        "our layer scores through its scorer (`layer.score`) and builds masks "
        "in `keras_attention.masking`"
    )


class TestKerasAttention(_attention.AttentionTest):
    """Keras's `AttentionTest`, with our layer."""

    @pytest.mark.xfail(reason=MASKED_QUERY_WEIGHTS, strict=True)
    def test_attention_with_mask(self):
        super().test_attention_with_mask()

    @pytest.mark.xfail(reason=FLOAT_MASKS, raises=TypeError, strict=True)
    def test_attention_compute_mask_with_tolerance_1e_3(self):
        super().test_attention_compute_mask_with_tolerance_1e_3()

    @pytest.mark.xfail(reason=FLOAT_MASKS, raises=TypeError, strict=True)
    def test_attention_compute_mask_with_tolerance_1e_5(self):
        super().test_attention_compute_mask_with_tolerance_1e_5()

    @pytest.mark.xfail(reason=FLOAT_MASKS, raises=TypeError, strict=True)
    def test_attention_compute_mask_with_tolerance_1e_7(self):
        super().test_attention_compute_mask_with_tolerance_1e_7()

    @pytest.mark.xfail(
        reason=_private("_calculate_scores"), raises=AttributeError, strict=True
    )
    def test_attention_calculate_scores_with_scale(self):
        super().test_attention_calculate_scores_with_scale()

    @pytest.mark.xfail(
        reason=_private("_calculate_score_mask"), raises=AttributeError, strict=True
    )
    def test_attention_calculate_score_mask_no_causal_no_vmask(self):
        super().test_attention_calculate_score_mask_no_causal_no_vmask()

    @pytest.mark.xfail(
        reason=_private("_calculate_score_mask")
        + "; with 3 queries and 4 keys Keras's causal mask is also aligned "
        "top-left, ours bottom-right",
        raises=AttributeError,
        strict=True,
    )
    def test_attention_calculate_score_mask_with_causal_no_vmask(self):
        super().test_attention_calculate_score_mask_with_causal_no_vmask()

    @pytest.mark.xfail(
        reason=_private("_calculate_score_mask")
        + "; with 3 queries and 4 keys Keras's causal mask is also aligned "
        "top-left, ours bottom-right",
        raises=AttributeError,
        strict=True,
    )
    def test_attention_calculate_score_mask_with_causal_and_vmask(self):
        super().test_attention_calculate_score_mask_with_causal_and_vmask()


class TestKerasAdditiveAttention(_additive.AdditiveAttentionTest):
    """Keras's `AdditiveAttentionTest`, with our layer."""

    @pytest.mark.xfail(reason=MASKED_QUERY_WEIGHTS, strict=True)
    def test_attention_with_mask(self):
        super().test_attention_with_mask()
