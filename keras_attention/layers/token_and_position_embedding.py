"""Token embedding plus position embedding, reversible into logits.

Shape legend: `B` batch, `T` sequence length, `V` vocabulary size, `D`
embedding width.
"""

from typing import Any

import keras
from keras import ops

from keras_attention import _keras_objects
from keras_attention import _validation
from keras_attention._typing import Initializer
from keras_attention._typing import IntOrTensor
from keras_attention._typing import Tensor
from keras_attention.layers._direct_calls import DirectCalls
from keras_attention.layers.position_embedding import PositionEmbedding
from keras_attention.layers.position_embedding import check_length
from keras_attention.layers.sinusoidal_position_encoding import (
    SinusoidalPositionEncoding,
)
from keras_attention.layers.sinusoidal_position_encoding import (
    check_positive_number,
)

POSITIONS = ("learned", "sinusoidal", None)


class ReversibleEmbedding(DirectCalls, keras.layers.ReversibleEmbedding):
    """Keras's `ReversibleEmbedding`, called directly while a model decodes
    (`layers/_direct_calls.py`), as the blocks' sublayers are: the token table
    and the output projection are called at every decoding step."""


@keras.saving.register_keras_serializable(package="keras_attention")
class TokenAndPositionEmbedding(DirectCalls, keras.layers.Layer):
    """Token embedding plus position embedding, the input of a Transformer.

    `output = E[ids] + P[start_index .. start_index + T - 1]`, where `E` is
    the token table `(V, D)` of a `keras.layers.ReversibleEmbedding`
    (`token_embedding`) and `P` the position table: a learned
    `PositionEmbedding(sequence_length)` (`position="learned"`, GPT and BERT)
    or the fixed `SinusoidalPositionEncoding(max_wavelength)`
    (`position="sinusoidal"`, "Attention Is All You Need"), or none at all
    (`position=None`: `output = E[ids]`, for models whose positions enter
    elsewhere, as rotary embeddings in the attention of LLaMA). Sequences
    longer than `sequence_length` are refused with every kind (checked when
    the length, or a Python `start_index` plus the length, is static).

    The paper scales the token embedding by `sqrt(D)` before adding the
    sinusoidal table (section 3.4); this layer does not: scale the output, or
    the initializer, where a model wants it.

    `reverse=True` maps hidden states back to vocabulary logits through the
    token embedding: with `tie_weights=True` (default) `logits = h E^T`, the
    input and output embeddings shared (Press and Wolf, 2017); with
    `tie_weights=False` a separate `(D, V)` kernel `reverse_embeddings`. No
    bias is added.

    With `mask_zero=True`, token id 0 is padding: the output carries the Keras
    mask `ids != 0` (the logits of `reverse=True` carry none).

    Args:
        vocabulary_size: positive int, the number of token ids `V`.
        sequence_length: positive int, the longest sequence accepted (the
            length of a learned table).
        embedding_dim: positive int, the embedding width `D`.
        mask_zero: bool, whether id 0 is padding to be masked.
        tie_weights: bool, whether `reverse=True` uses the transposed token
            table (`True`, default) or a separate kernel.
        embeddings_initializer: initializer of the token table (and of the
            reverse kernel), and of the learned position table unless
            `position_initializer` is given, as in KerasHub. Defaults to
            `"uniform"`, as `keras.layers.Embedding`.
        position: `"learned"` (default), `"sinusoidal"` or `None` (no
            position table).
        max_wavelength: positive number, the longest wavelength of the
            sinusoidal table (used with `position="sinusoidal"`).
        position_initializer: optional initializer of the learned position
            table. Defaults to None: a copy of `embeddings_initializer`.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: token ids `(B, T)`, or hidden states `(B, T, D)` with
            `reverse=True`.
        start_index: int or scalar int tensor, the position of the first
            token (for cached decoding). Defaults to 0.
        positions: optional integer tensor `(T,)` or `(B, T)`, the position of
            each token. Overrides `start_index`.
        reverse: bool, project hidden states to logits instead.

    Returns:
        Embeddings `(B, T, D)`, or logits `(B, T, V)` with `reverse=True`.

    Example:

    >>> import numpy as np
    >>> layer = TokenAndPositionEmbedding(100, 16, 8, mask_zero=True)
    >>> ids = np.array([[5, 9, 2, 0], [7, 1, 0, 0]])
    >>> hidden = layer(ids)
    >>> tuple(hidden.shape)
    (2, 4, 8)
    >>> np.asarray(layer.compute_mask(ids)).tolist()
    [[True, True, True, False], [True, True, False, False]]
    >>> tuple(layer(hidden, reverse=True).shape)
    (2, 4, 100)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), sections
          3.4 and 3.5.
        - [Press and Wolf, 2017](https://arxiv.org/abs/1608.05859)
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int,
        embedding_dim: int,
        mask_zero: bool = False,
        tie_weights: bool = True,
        embeddings_initializer: Initializer = "uniform",
        position: str | None = "learned",
        max_wavelength: int = 10000,
        position_initializer: Initializer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.vocabulary_size = _validation.check_positive_int(
            "vocabulary_size", vocabulary_size
        )
        self.sequence_length = _validation.check_positive_int(
            "sequence_length", sequence_length
        )
        self.embedding_dim = _validation.check_positive_int(
            "embedding_dim", embedding_dim
        )
        if position not in POSITIONS:
            raise ValueError(
                f"`position` must be one of {POSITIONS}. Received: "
                f"position={position!r}"
            )
        self.position = position
        self.max_wavelength = check_positive_number("max_wavelength", max_wavelength)
        self.mask_zero = bool(mask_zero)
        self.tie_weights = bool(tie_weights)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.position_initializer = (
            None
            if position_initializer is None
            else keras.initializers.get(position_initializer)
        )
        # Sublayers exist from construction (their shapes do not depend on the
        # inputs), so weights can be shared or copied before the first call.
        self.token_embedding = ReversibleEmbedding(
            self.vocabulary_size,
            self.embedding_dim,
            tie_weights=self.tie_weights,
            embeddings_initializer=self.embeddings_initializer,
            mask_zero=self.mask_zero,
            # An Embedding does not autocast: without this, float32 variables
            # would turn the logits float32 under mixed precision.
            reverse_dtype=self.compute_dtype,
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        if position == "learned":
            # As in KerasHub, `embeddings_initializer` initializes both
            # tables (a copy of it, as KerasHub's) unless
            # `position_initializer` is given.
            self.position_embedding = PositionEmbedding(
                self.sequence_length,
                initializer=_keras_objects.copy_initializer(
                    self.position_initializer or self.embeddings_initializer
                ),
                dtype=self.dtype_policy,
                name="position_embedding",
            )
        elif position == "sinusoidal":
            self.position_embedding = SinusoidalPositionEncoding(
                self.max_wavelength,
                dtype=self.dtype_policy,
                name="position_embedding",
            )
        else:
            self.position_embedding = None
        # Masks from `mask_zero` are computed here; with `reverse=True` a mask
        # on the hidden states is dropped quietly (logits carry none).
        self.supports_masking = True

    def build(self, inputs_shape):
        self.token_embedding.build(inputs_shape)
        if self.position_embedding is not None and not self.position_embedding.built:
            self.position_embedding.build(
                (inputs_shape[0], None, self.embedding_dim)
            )
        self.built = True

    def call(
        self,
        inputs: Tensor,
        start_index: IntOrTensor = 0,
        positions: Tensor | None = None,
        reverse: bool = False,
    ):
        if reverse:
            _check_hidden(inputs.shape, self.embedding_dim)
            return self.token_embedding(inputs, reverse=True)  # (B, T, V)
        _check_ids(inputs.shape, start_index, self.sequence_length)
        tokens = self.token_embedding(inputs)  # (B, T, D)
        if self.position_embedding is None:
            return tokens
        positions = self.position_embedding(
            tokens, start_index=start_index, positions=positions
        )  # (B, T, D)
        return ops.add(tokens, positions)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero or "float" in keras.backend.standardize_dtype(
            inputs.dtype
        ):
            # Hidden states (reverse=True): logits carry no mask.
            return None
        return ops.not_equal(inputs, 0)  # (B, T)

    def compute_output_shape(self, inputs_shape, reverse=False):
        if reverse:
            return tuple(inputs_shape[:-1]) + (self.vocabulary_size,)
        return tuple(inputs_shape) + (self.embedding_dim,)

    def compute_output_spec(
        self, inputs, start_index=0, positions=None, reverse=False
    ):
        if reverse:
            _check_hidden(inputs.shape, self.embedding_dim)
        else:
            _check_ids(inputs.shape, start_index, self.sequence_length)
        return keras.KerasTensor(
            self.compute_output_shape(inputs.shape, reverse=reverse),
            dtype=self.compute_dtype,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "sequence_length": self.sequence_length,
                "embedding_dim": self.embedding_dim,
                "mask_zero": self.mask_zero,
                "tie_weights": self.tie_weights,
                # None serializes as None.
                "position_initializer": keras.initializers.serialize(
                    self.position_initializer
                ),
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "position": self.position,
                "max_wavelength": self.max_wavelength,
            }
        )
        return config


def _check_ids(shape, start_index, sequence_length):
    _validation.check_rank("inputs", shape, 2)
    start = _validation.check_integer("start_index", start_index, minimum=0)
    check_length(shape[1], start, sequence_length)


def _check_hidden(shape, embedding_dim):
    _validation.check_rank("inputs", shape, 3)
    _validation.check_same_dim(
        "inputs", shape[-1], "embedding_dim", embedding_dim, "width"
    )
