"""The base class of scoring functions."""

from typing import Any

import keras
from keras import ops

from keras_attention import _validation
from keras_attention.layers._direct_calls import DirectCalls


class Scorer(DirectCalls, keras.layers.Layer):
    """Base class of scoring functions `s(q, k)`.

    A scorer is a small Keras layer `scorer(query, key) -> scores` with query
    `(..., T, Dq)`, key `(..., S, Dk)` and scores `(..., T, S)`. Leading axes
    (batch, heads) are carried through, so one scorer serves single-head and
    multi-head attention alike.

    Subclasses implement `call(query, key)` and, when they have weights,
    `build(query_shape, key_shape)`. A scorer that is a (scaled) dot product
    returns its scale from `dot_product_scale`, which lets multi-head attention
    use a fused kernel.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.supports_masking = True

    def build(self, query_shape, key_shape):
        self.check_shapes(query_shape, key_shape)

    def build_or_check(self, query_shape, key_shape):
        """Builds the scorer, or only checks the shapes if it is built.

        A scorer restored from its config, or shared by several layers, is
        built already; its owner must not create its weights twice.
        """
        if self.built:
            self.check_shapes(query_shape, key_shape)
        else:
            self.build(query_shape, key_shape)

    def check_shapes(self, query_shape, key_shape):
        """Raises a `ValueError` for query and key shapes this scorer rejects.

        Subclasses extend this rather than calling `super().build`, which
        would mark the layer built before its weights exist.
        """
        _validation.check_rank("query", query_shape, len(key_shape))

    @staticmethod
    def pairwise_sum(query, key):
        """`q_t + k_s` for every pair: `(..., T, D)` and `(..., S, D)` ->
        `(..., T, S, D)` (the scores without projections add features)."""
        return query[..., :, None, :] + key[..., None, :, :]  # (..., T, S, D)

    def compute_mask(self, inputs, previous_mask=None):
        # Scores carry no Keras mask: masking is the attention layer's job.
        return None

    def compute_output_shape(self, query_shape, key_shape):
        return tuple(query_shape[:-1]) + (key_shape[-2],)

    def get_config(self):
        # Defined here so that scorers without arguments serialize too.
        return super().get_config()

    def dot_product_scale(self, key_dim):
        """The scale `c` if this scorer is `c * q.k`, else `None`."""
        return None


class FeatureWiseScorer(Scorer):
    """Base of the scores without projections: query and key of one size
    `D`, compared feature by feature, with an optional learned scale.

    With `use_scale=True` the scorer holds the weight `scale` of shape
    `scale_shape(D)` (a scalar by default), initialized by
    `scale_initializer`; `scaled(x)` multiplies by it. Keras's
    `Attention` and `AdditiveAttention` scores are of this kind.
    """

    scale_initializer = "ones"

    def __init__(self, use_scale: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_scale = _validation.check_bool("use_scale", use_scale)

    def build(self, query_shape, key_shape):
        self.check_shapes(query_shape, key_shape)
        self.scale = None
        if self.use_scale:
            self.scale = self.add_weight(
                name="scale",
                shape=self.scale_shape(query_shape[-1]),
                initializer=self.scale_initializer,
            )

    def scale_shape(self, dim):
        """The shape of `scale` for features of size `dim`."""
        return ()

    def check_shapes(self, query_shape, key_shape):
        super().check_shapes(query_shape, key_shape)
        _validation.check_same_dim(
            "query", query_shape[-1], "key", key_shape[-1], "feature size"
        )

    def scaled(self, x):
        """`x` times the learned scale (broadcast), or `x` without one."""
        if not self.use_scale:
            return x
        return x * ops.cast(self.scale, x.dtype)

    def get_config(self):
        config = super().get_config()
        config["use_scale"] = self.use_scale
        return config
