"""Names for the types in the public signatures.

`Tensor` is whatever a Keras backend computes with and the layers accept: a
backend tensor (TensorFlow, JAX or torch), a numpy array, or nested lists of
numbers. Keras has no common static type for the three backends' tensors, so
the name documents the role; it checks nothing.
"""

from typing import Any
from typing import Union

Tensor = Any
Shape = tuple
IntOrTensor = Union[int, Tensor]

__all__ = ["IntOrTensor", "Shape", "Tensor"]
