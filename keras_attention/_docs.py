"""Docstring text that several public classes share, written once.

A docstring names a shared piece on a line of its own, as `{name}` indented
where the piece goes; `completes` (a class decorator) replaces the line by
the piece, each of its lines at that indentation, so that `__doc__`,
`help()` and the doctests read the whole text. The API reference's griffe
extension (`docs/_doctest_blocks.py`) fills the same lines by `fill`.

This module imports nothing, so that the documentation build can load it
alone.
"""

import re

PIECES = {
    # The call of a scorer: `Scorer` subclasses.
    "scorer_call": """\
Call arguments:
    query: `(..., T, Dq)`.
    key: `(..., S, Dk)`.

Returns:
    Scores `(..., T, S)`.""",
    # The example call of a scorer made as `scorer` (query and key sizes differ).
    "scorer_example": """\
>>> import numpy as np
>>> tuple(scorer(np.ones((2, 3, 5)), np.ones((2, 4, 6))).shape)
(2, 3, 4)""",
    # The inputs and masks of `SoftAttention` and `HardAttention`'s calls.
    "single_head_call_inputs": """\
query: `(B, T, Dq)`.
value: `(B, S, Dv)`.
key: optional `(B, S, Dk)`; defaults to `value` (normal mode).
query_mask: optional `(B, T)` padding mask of the queries.
value_mask: optional `(B, S)` padding mask of the values.
key_mask: optional `(B, S)` padding mask of the keys; combined with
    `value_mask`.
attention_mask: optional `(B, T, S)` (or `(T, S)`) mask.""",
    # The call arguments of the position tables (learned and sinusoidal).
    "position_table_call_arguments": """\
inputs: `(B, T, D)` (or `(B, ..., T, D)`), only its shape is read.
{position_call_arguments}""",
    # The example call of a position table made as `layer`.
    "position_table_example": """\
>>> import numpy as np
>>> embeddings = np.random.rand(2, 5, 8).astype("float32")
>>> positions = layer(embeddings)
>>> tuple(positions.shape)  # the inputs' shape
(2, 5, 8)""",
    # The position arguments of the position layers' calls.
    "position_call_arguments": """\
start_index: int or scalar int tensor, the position of the first
    element (for cached decoding, also inside `ops.while_loop`).
    Defaults to 0.
positions: optional integer tensor `(T,)` or `(B, T)`, the position of
    each element. Overrides `start_index`.""",
    # The arguments every model's constructor ends with.
    "model_attention_dropout_and_seed": """\
attention_dropout: optional float in [0, 1), the dropout on the
    attention weights alone (None: `dropout`). 0 keeps training on
    the fused attention kernels where the backend's fused kernel
    takes no dropout (JAX, TensorFlow; torch's takes it).
seed: optional int, the seed of the dropout layers.""",
}

_PLACEHOLDER = re.compile(r"^([ \t]*)\{(\w+)\}[ \t]*$", re.MULTILINE)


def fill(text):
    """`text` with each line `{name}` of a piece of `PIECES` replaced by the
    piece, indented as the line; other lines as they are."""

    def piece(match):
        indent, name = match.groups()
        if name not in PIECES:
            return match.group(0)
        # A piece may name other pieces.
        text = fill(PIECES[name])
        return "\n".join(indent + line if line else "" for line in text.split("\n"))

    return _PLACEHOLDER.sub(piece, text)


def completes(cls):
    """Class decorator: `cls.__doc__` with its shared pieces filled in."""
    if cls.__doc__:
        cls.__doc__ = fill(cls.__doc__)
    return cls
