"""Names for the types in the public signatures.

`Tensor` is whatever a Keras backend computes with and the layers accept: a
backend tensor (TensorFlow, JAX or torch), a numpy array, or nested lists of
numbers. Keras has no common static type for the three backends' tensors, so
the name documents the role; it checks nothing.

The others name what Keras accepts for an argument of that kind: a name
(`"glorot_uniform"`, `"l2"`, `"relu"`, `"scaled_dot"`), a config dict, or
an object.
"""

from typing import Any
from typing import Callable
from typing import Union

import keras

Tensor = Any
Shape = tuple
IntOrTensor = Union[int, Tensor]
Initializer = Union[str, dict, keras.initializers.Initializer]
Regularizer = Union[str, dict, keras.regularizers.Regularizer]
Constraint = Union[str, dict, keras.constraints.Constraint]
Activation = Union[str, Callable[..., Any]]
# A scoring function: a name (`keras_attention.scoring.get`), a config dict
# or a scorer layer.
Scorer = Union[str, dict, keras.layers.Layer]

__all__ = [
    "Activation", "Constraint", "Initializer", "IntOrTensor", "Regularizer", "Scorer", "Shape",
    "Tensor",
]
