"""BERT's encoder: embeddings, bidirectional encoder blocks, the pooled output.

Shape legend: `B` batch, `T` length, `D` width (`hidden_dim`), `V`
vocabulary size, `N` blocks.
"""

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_attention import _docs
from keras_attention import _validation
from keras_attention._typing import Tensor
from keras_attention.layers._dropout import Dropout
from keras_attention.layers.layer_normalization import LayerNormalization
from keras_attention.layers.position_embedding import PositionEmbedding
from keras_attention.layers.token_and_position_embedding import ReversibleEmbedding
from keras_attention.layers.transformer_encoder import TransformerEncoderStack
from keras_attention.models import _keras_hub
from keras_attention.models import _model_arguments

# The names of the inputs, as KerasHub's `BertBackbone` takes them.
INPUT_NAMES = ("token_ids", "segment_ids", "padding_mask")

# The constructor arguments, saved by `get_config` as the attributes hold
# them (`BertMaskedLM` takes them too).
ENCODER_ARGUMENTS = (
    "vocabulary_size", "num_layers", "num_heads", "hidden_dim",
    "intermediate_dim", "dropout", "max_sequence_length", "num_segments",
    "layer_norm_epsilon", "initializer_range", "attention_dropout", "seed",
)


def _arguments(
    vocabulary_size: int, num_layers: int, num_heads: int, hidden_dim: int, intermediate_dim: int,
    dropout: float = 0.1, max_sequence_length: int = 512, num_segments: int = 2,
    layer_norm_epsilon: float = 1e-12, initializer_range: float = 0.02,
):
    """`BertEncoder`'s own constructor arguments, before those every model ends
    with (`_model_arguments.ends_with`)."""


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class BertEncoder(keras.layers.Layer):
    """The encoder of BERT, shared by `BertMaskedLM` and `BertClassifier`.

    token ids -> token embedding + learned position embedding + segment
    embedding -> layer norm -> dropout -> `num_layers` post-norm encoder
    blocks (self-attention over every unmasked position, on both sides;
    GELU feed-forward) -> the sequence output; the pooled output is a
    `tanh` dense layer on the first position (BERT's `[CLS]`), what a
    classifier reads.

    The arguments and the weight layout are those of
    `keras_hub.models.BertBackbone`: blocks with the tanh approximation of
    GELU, layer norms with epsilon `1e-12`, every kernel and embedding drawn
    from a normal truncated at two standard deviations of `0.02`. With the
    BERT-base configuration (`vocabulary_size=30522, num_layers=12,
    num_heads=12, hidden_dim=768, intermediate_dim=3072`) it holds
    109,482,240 parameters.

    Args:
        vocabulary_size: positive int `V`.
        num_layers: positive int `N`.
        num_heads: positive int dividing `hidden_dim`.
        hidden_dim: positive int `D`.
        intermediate_dim: positive int, the feed-forward width.
        dropout: float in [0, 1), on the embeddings, the attention weights
            (unless `attention_dropout` is given) and each residual branch
            (BERT: 0.1).
        max_sequence_length: positive int, the length of the position table.
        num_segments: positive int, the segment ids `0 .. num_segments - 1`.
        layer_norm_epsilon: positive float (BERT: 1e-12).
        initializer_range: positive float, the standard deviation of the
            truncated normal initializer (BERT: 0.02).
        {model_attention_dropout_and_seed}
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: a dict with `"token_ids"` `(B, T)`, and optionally
            `"segment_ids"` `(B, T)` (default all 0) and `"padding_mask"`
            `(B, T)` (bool or 0/1, True for real tokens; default all True).
        training: bool, whether dropout is active.
        output_positions: optional int `(B, M)`: the sequence output only at
            these positions, the last block computing `M` rows instead of
            `T` (what a masked-LM head reads; `TransformerEncoderBlock` says
            how).

    Returns:
        A dict: `"sequence_output"` `(B, T, D)` and `"pooled_output"`
        `(B, D)`; with `output_positions`, `"sequence_output"` `(B, M, D)`
        alone (the pooled output reads position 0 of every row).

    Example:

    >>> import numpy as np
    >>> encoder = BertEncoder(50, num_layers=1, num_heads=2, hidden_dim=8,
    ...                       intermediate_dim=16, max_sequence_length=16)
    >>> outputs = encoder({"token_ids": np.array([[2, 7, 9, 3, 0]]),
    ...                    "padding_mask": np.array([[1, 1, 1, 1, 0]])})
    >>> tuple(outputs["sequence_output"].shape), tuple(outputs["pooled_output"].shape)
    ((1, 5, 8), (1, 8))

    References:
        - [Devlin et al., 2019](https://arxiv.org/abs/1810.04805)
    """

    @_model_arguments.takes_arguments(_arguments)
    def __init__(
        self, vocabulary_size, num_layers, num_heads, hidden_dim, intermediate_dim, dropout,
        max_sequence_length, num_segments, layer_norm_epsilon, initializer_range, attention_dropout,
        seed, **kwargs,
    ):
        super().__init__(**kwargs)
        _model_arguments.store_sizes(
            self, num_heads, hidden_dim, intermediate_dim, dropout,
            vocabulary_size=vocabulary_size, num_layers=num_layers,
            max_sequence_length=max_sequence_length, num_segments=num_segments,
        )
        positive = _validation.check_positive_float
        self.layer_norm_epsilon = positive("layer_norm_epsilon", layer_norm_epsilon)
        self.initializer_range = positive("initializer_range", initializer_range)
        self.attention_dropout = _validation.check_optional_rate(
            "attention_dropout", attention_dropout
        )
        self.seed = _validation.check_seed("seed", seed)
        dtype = self.dtype_policy

        # Embeddings.
        self.token_embedding = ReversibleEmbedding(
            vocabulary_size,
            hidden_dim,
            tie_weights=True,
            embeddings_initializer=self._initializer(),
            # An Embedding does not autocast: without this, float32 variables
            # would turn the MLM logits float32 under mixed precision.
            reverse_dtype=self.compute_dtype,
            dtype=dtype,
            name="token_embedding",
        )
        self.position_embedding = PositionEmbedding(
            max_sequence_length, initializer=self._initializer(), dtype=dtype,
            name="position_embedding",
        )
        self.segment_embedding = keras.layers.Embedding(
            num_segments, hidden_dim, embeddings_initializer=self._initializer(),
            dtype=dtype, name="segment_embedding",
        )
        self.embeddings_layer_norm = LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="embeddings_layer_norm"
        )
        self.embeddings_dropout = Dropout(
            dropout, seed=seed, dtype=dtype, name="embeddings_dropout"
        )
        # Encoder blocks.
        self.encoder = TransformerEncoderStack(
            num_layers,
            intermediate_dim,
            num_heads,
            dropout=dropout,
            attention_dropout=self.attention_dropout,
            activation="gelu_approximate",
            layer_norm_epsilon=layer_norm_epsilon,
            kernel_initializer=self._initializer(),
            seed=None if seed is None else seed + 1,
            dtype=dtype,
            name="encoder",
        )
        # Pooler.
        self.pooled_dense = keras.layers.Dense(
            hidden_dim, activation="tanh", kernel_initializer=self._initializer(),
            dtype=dtype, name="pooled_dense",
        )

    def _initializer(self):
        return keras.initializers.TruncatedNormal(stddev=self.initializer_range)

    def build(self, inputs_shape=None):
        ids, hidden = (None, None), (None, None, self.hidden_dim)
        self.token_embedding.build(ids)
        self.position_embedding.build(hidden)
        self.segment_embedding.build(ids)
        self.embeddings_layer_norm.build(hidden)
        self.encoder.build(hidden)
        self.pooled_dense.build((None, self.hidden_dim))
        self.built = True

    def __call__(self, inputs, *args, **kwargs):
        # Before Keras makes numpy positions a tensor (a gather would clamp them).
        self.check_positions("output_positions", kwargs.get("output_positions"), inputs)
        return super().__call__(inputs, *args, **kwargs)

    @staticmethod
    def check_positions(name, positions, inputs):
        """Raises a `ValueError` naming `name` for numpy (or list) `positions`
        outside `[0, T)`, `T` the length of `inputs["token_ids"]`; tensors
        pass unchecked."""
        if isinstance(positions, (np.ndarray, list, tuple)):
            ids = inputs["token_ids"]
            length = (ids.shape if hasattr(ids, "shape") else np.shape(ids))[-1]
            _validation.check_positions(name, np.asarray(positions), length, "token_ids")

    def call(
        self,
        inputs: dict[str, Tensor],
        training: bool | None = None,
        output_positions: Tensor | None = None,
    ):
        token_ids = inputs["token_ids"]
        segment_ids = inputs.get("segment_ids")
        if segment_ids is None:
            segment_ids = ops.zeros_like(token_ids)
        padding_mask = inputs.get("padding_mask")
        if padding_mask is None:
            padding_mask = ops.ones_like(token_ids)
        padding_mask = ops.cast(padding_mask, "bool")  # KerasHub feeds 0/1 ints

        tokens = self.token_embedding(token_ids)  # (B, T, D)
        x = tokens + self.position_embedding(tokens) + self.segment_embedding(segment_ids)
        x = self.embeddings_layer_norm(x)
        x = self.embeddings_dropout(x, training=training)
        x = self.encoder(
            x, padding_mask=padding_mask, training=training, output_positions=output_positions
        )  # (B, T, D), or (B, M, D) at output_positions
        if output_positions is not None:
            return {"sequence_output": x}
        return {"sequence_output": x, "pooled_output": self.pool(x[:, 0, :])}

    def pool(self, first):
        """The pooled output `(B, D)` of the sequence output's first row
        `(B, D)` (`[CLS]`'s): a `tanh` dense layer."""
        return self.pooled_dense(first)

    def compute_output_spec(self, inputs, training=None, output_positions=None):
        shape = tuple(inputs["token_ids"].shape)
        rows = shape if output_positions is None else shape[:1] + tuple(output_positions.shape[1:])
        spec = {"sequence_output": keras.KerasTensor(rows + (self.hidden_dim,), self.compute_dtype)}
        if output_positions is None:
            spec["pooled_output"] = keras.KerasTensor(
                shape[:1] + (self.hidden_dim,), self.compute_dtype
            )
        return spec

    def check_inputs(self, inputs):
        """Raises a `ValueError` naming the input and the value for numpy
        (or list) inputs outside what the encoder can read: an id outside
        the vocabulary, a sequence longer than `max_sequence_length`, a
        segment id outside `[0, num_segments)`, a missing `token_ids`, or
        inputs of different shapes. Tensors pass unchecked (a traced
        function cannot raise on values)."""
        if not isinstance(inputs, dict) or "token_ids" not in inputs:
            received = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(
                "`inputs` must be a dict holding 'token_ids' (and optionally "
                f"'segment_ids', 'padding_mask'). Received: {received}"
            )
        arrays = {
            name: np.asarray(inputs[name])
            for name in INPUT_NAMES
            if isinstance(inputs.get(name), (np.ndarray, list, tuple))
        }
        if "token_ids" in arrays:
            _validation.check_token_ids(
                "token_ids", arrays["token_ids"], self.vocabulary_size,
                self.max_sequence_length, "max_sequence_length",
            )
        if "segment_ids" in arrays:
            _validation.check_token_ids(
                "segment_ids", arrays["segment_ids"], self.num_segments,
                self.max_sequence_length, "max_sequence_length",
            )
        shapes = {name: array.shape for name, array in arrays.items()}
        if len(set(shapes.values())) > 1:
            raise ValueError(
                "`token_ids`, `segment_ids` and `padding_mask` must have one "
                f"shape (batch, length). Received: {shapes}"
            )

    @classmethod
    def from_keras_hub(cls, backbone: Any, **kwargs: Any) -> "BertEncoder":
        """A built `BertEncoder` holding a `keras_hub.models.BertBackbone`'s
        weights (nothing is downloaded: pass a backbone built or loaded
        locally); `kwargs` are other constructor arguments (e.g. `dtype`)."""
        config = backbone.get_config()
        encoder = cls(
            **{name: config[name] for name in (
                "vocabulary_size", "num_layers", "num_heads", "hidden_dim",
                "intermediate_dim", "dropout", "max_sequence_length", "num_segments",
            )},
            **kwargs,
        )
        return _keras_hub.built_from(encoder, backbone, _keras_hub.bert_pairs)

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in ENCODER_ARGUMENTS})
        return config

