"""Scoring functions `s(q, k)`: dot, scaled dot, additive and bilinear, and
Keras's projection-free concat and additive scores.

Each scorer is a small serializable Keras layer `scorer(query, key)` that
maps query `(..., T, Dq)` and key `(..., S, Dk)` to scores `(..., T, S)`.
`get` turns a name, an instance or a config into a scorer.
"""

from typing import Any

import keras

from keras_attention.scoring.additive import Additive
from keras_attention.scoring.bilinear import Bilinear
from keras_attention.scoring.concat import Concat
from keras_attention.scoring.dot_product import DotProduct
from keras_attention.scoring.scaled_dot_product import ScaledDotProduct
from keras_attention.scoring.scorer import Scorer
from keras_attention.scoring.unprojected_additive import UnprojectedAdditive

_BY_NAME = {
    "dot": DotProduct,
    "scaled_dot": ScaledDotProduct,
    "additive": Additive,
    "bilinear": Bilinear,
}


def get(identifier: str | dict | Scorer, **kwargs: Any) -> Scorer:
    """Returns a scorer from a name, an instance or a config.

    Args:
        identifier: one of `"dot"`, `"scaled_dot"`, `"additive"`,
            `"bilinear"`; a `Scorer` instance (returned as is); or a config
            dict as written by `keras.saving.serialize_keras_object`.
        **kwargs: passed to the constructor when `identifier` is a name
            (e.g. `dtype` so a scorer follows its parent's dtype policy).

    Returns:
        A `Scorer` layer.

    Raises:
        ValueError: for an unknown name or anything that is not a scorer.

    Example:

    >>> get("additive").__class__.__name__
    'Additive'
    """
    if isinstance(identifier, Scorer):
        return identifier
    if isinstance(identifier, str):
        if identifier not in _BY_NAME:
            raise ValueError(
                f"Unknown scorer `score={identifier!r}`. Expected one of "
                f"{sorted(_BY_NAME)}, a `keras_attention.scoring.Scorer` "
                "instance or a scorer config."
            )
        return _BY_NAME[identifier](**kwargs)
    if isinstance(identifier, dict):
        # The parent layer builds its scorer in its own `build`, so the
        # scorer's weights get the parent's path; an early build from a
        # `build_config` would create them outside it.
        identifier = {k: v for k, v in identifier.items() if k != "build_config"}
        scorer = keras.saving.deserialize_keras_object(identifier)
        if isinstance(scorer, Scorer):
            return scorer
    raise ValueError(
        f"`score` must be one of {sorted(_BY_NAME)}, a "
        "`keras_attention.scoring.Scorer` instance or a scorer config. "
        f"Received: score={identifier!r}"
    )


def serialize(scorer: Scorer) -> dict:
    """The config of a scorer for a parent layer's `get_config`.

    Like `keras.saving.serialize_keras_object`, without the build config:
    the parent builds its scorer, so that the scorer's weights live under the
    parent's path (`attention/additive/query_kernel`) after a reload too.
    """
    config = keras.saving.serialize_keras_object(scorer)
    config.pop("build_config", None)
    return config


__all__ = [
    "Additive",
    "Bilinear",
    "Concat",
    "DotProduct",
    "ScaledDotProduct",
    "Scorer",
    "UnprojectedAdditive",
    "get",
    "serialize",
]
