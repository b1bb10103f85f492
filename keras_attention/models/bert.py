"""A BERT-style masked language model.

Shape legend: `B` batch, `T` length, `M` masked positions per row, `V`
vocabulary size, `D` width (`hidden_dim`), `k` the tokens kept per mask.
"""

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_attention import _docs
from keras_attention import _signatures
from keras_attention._typing import Tensor
from keras_attention.layers._transformer_block import rows_at
from keras_attention.layers.layer_normalization import LayerNormalization
from keras_attention.models import _text
from keras_attention.models import _text_tasks
from keras_attention.models import layouts
from keras_attention.models.bert_encoder import ENCODER_ARGUMENTS
from keras_attention.models.bert_encoder import BertEncoder


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class BertMaskedLM(_text_tasks.MaskedTextModel, layouts.TensorParallel, keras.Model):
    """BERT pretrained by masking: logits for the tokens at masked positions.

    `BertEncoder` (token + learned position + segment embeddings, layer
    norm, post-norm encoder blocks whose self-attention sees both sides of
    every position, a pooled output for fine-tuning), then the masked-LM
    head at the masked positions only: gather -> dense -> GELU -> layer
    norm -> logits through the transposed token embedding plus an output
    bias (input and output embeddings tied).

    The arguments, the inputs and the weight layout are those of
    `keras_hub.models.BertBackbone` and `keras_hub.models.BertMaskedLM`:
    the dictionary `keras_hub.models.BertMaskedLMPreprocessor` makes trains
    it as it is (`(x, y, sample_weight)` with `y` the original tokens at
    `mask_positions`), and `BertMaskedLM.from_keras_hub` takes over a
    KerasHub model's weights. With the BERT-base configuration
    (`vocabulary_size=30522, num_layers=12, num_heads=12, hidden_dim=768,
    intermediate_dim=3072`) it has 110,104,890 parameters, as KerasHub's.
    The pooled output's dense layer is not on the path to the logits (it
    trains when a classifier fine-tunes the encoder); as in KerasHub it
    is counted.

    Departures from the original BERT: no next-sentence-prediction head
    (RoBERTa showed it unnecessary); the blocks use the tanh approximation
    of GELU, as KerasHub's, and the head exact GELU. Padded positions (of
    `padding_mask`) are masked as keys and give zeros as queries, so they
    change no real position's output.

    Args:
        vocabulary_size: positive int `V`.
        num_layers: positive int, encoder blocks.
        num_heads: positive int dividing `hidden_dim`.
        hidden_dim: positive int `D`.
        intermediate_dim: positive int, the feed-forward width.
        dropout: float in [0, 1) (BERT: 0.1).
        max_sequence_length: positive int, the longest sequence.
        num_segments: positive int, the segment ids (BERT: 2, for sentence
            pairs).
        layer_norm_epsilon: positive float, of the encoder's norms (BERT:
            1e-12); the head's norm uses KerasHub's 1e-5.
        initializer_range: positive float, the standard deviation of the
            truncated normal initializer (BERT: 0.02).
        {model_attention_dropout_and_seed}
        **kwargs: base `keras.Model` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: a dict with `"token_ids"` `(B, T)`, `"mask_positions"`
            `(B, M)` (the positions to predict, in `[0, T)`), and optionally
            `"segment_ids"` and `"padding_mask"` (see `BertEncoder`).
        training: bool, whether dropout is active.

    Returns:
        Logits `(B, M, V)`: row `m` scores the token at `mask_positions[:, m]`.

    Example:

    >>> import numpy as np
    >>> model = BertMaskedLM(50, num_layers=1, num_heads=2, hidden_dim=8,
    ...                      intermediate_dim=16, max_sequence_length=16)
    >>> inputs = {"token_ids": np.array([[2, 7, 4, 9, 3]]),
    ...           "segment_ids": np.zeros((1, 5), "int32"),
    ...           "padding_mask": np.ones((1, 5), bool),
    ...           "mask_positions": np.array([[2]])}
    >>> tuple(model(inputs).shape)
    (1, 1, 50)

    References:
        - [Devlin et al., 2019](https://arxiv.org/abs/1810.04805)
        - [Liu et al., 2019 (RoBERTa)](https://arxiv.org/abs/1907.11692)
    """

    @_signatures.takes_arguments_of(BertEncoder.__init__)
    def __init__(self, **arguments):
        # The encoder's arguments are the model's; the encoder validates them,
        # and they are the model's attributes too.
        encoder_arguments = {name: arguments.pop(name) for name in ENCODER_ARGUMENTS}
        super().__init__(**arguments)
        dtype = self.dtype_policy
        self.encoder = BertEncoder(**encoder_arguments, dtype=dtype, name="encoder")
        for name in ENCODER_ARGUMENTS:
            setattr(self, name, getattr(self.encoder, name))
        # Masked-LM head.
        self.mlm_dense = keras.layers.Dense(
            self.hidden_dim, activation="gelu",
            kernel_initializer=keras.initializers.TruncatedNormal(stddev=self.initializer_range),
            dtype=dtype, name="mlm_dense",
        )
        self.mlm_layer_norm = LayerNormalization(
            epsilon=1e-5, dtype=dtype, name="mlm_layer_norm"
        )

    @property
    def token_embedding(self):
        return self.encoder.token_embedding

    def build(self, inputs_shape=None):
        self.encoder.build()
        self.mlm_dense.build((None, None, self.hidden_dim))
        self.mlm_layer_norm.build((None, None, self.hidden_dim))
        self.mlm_output_bias = self.add_weight(
            name="mlm_output_bias", shape=(self.vocabulary_size,), initializer="zeros"
        )
        self.built = True

    def __call__(self, inputs, *args, **kwargs):
        self.encoder.check_inputs(inputs)
        if "mask_positions" not in inputs:
            raise ValueError(
                f"`inputs` must hold 'mask_positions'. Received: keys {sorted(inputs)}"
            )
        self.encoder.check_positions("mask_positions", inputs["mask_positions"], inputs)
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs: dict[str, Tensor], training: bool | None = None):
        # Only the mask positions' rows of the last block: its queries, output
        # projection and feed-forward network run on M rows instead of T.
        x = self.encoder(
            inputs, training=training, output_positions=inputs["mask_positions"]
        )["sequence_output"]  # (B, M, D)
        return self.head(x)

    def mask_logits(self, sequence, mask_positions):
        """The head: logits `(B, M, V)` of the sequence output `(B, T, D)` at
        `mask_positions` `(B, M)`."""
        return self.head(rows_at(sequence, mask_positions))  # (B, M, D) rows first

    def head(self, x):
        """The head on the sequence output's rows at the mask positions:
        `(B, M, D)` -> logits `(B, M, V)`."""
        x = self.mlm_layer_norm(self.mlm_dense(x))
        logits = self.token_embedding(x, reverse=True)  # (B, M, V)
        return logits + ops.cast(self.mlm_output_bias, logits.dtype)

    def fill_mask(
        self,
        token_ids: Tensor | str | list[str],
        mask_token_id: int | None = None,
        top_k: int = 5,
        segment_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ):
        """The `top_k` most likely tokens, with their probabilities, at every
        `mask_token_id` of each row.

        With a `preprocessor` (`from_preset` sets it), `token_ids` may be text
        (a string or a list of strings, each holding the tokenizer's mask
        token, such as `"the [MASK] sat"`): the result is then, for each text,
        one list per mask of `(token, probability)` pairs, most likely first.

        Args:
            token_ids: int `(B, T)` (or `(T,)` for one row), or text.
            mask_token_id: int, the id of `[MASK]` (default: the
                preprocessor's tokenizer's).
            top_k: positive int, at most `vocabulary_size`.
            segment_ids: optional int `(B, T)`, as for `call`.
            padding_mask: optional bool `(B, T)`, as for `call`.

        Returns:
            One list per row of `(position, ids, probabilities)` per mask, in
            order: `ids` int `(k,)` most likely first, `probabilities`
            float `(k,)` (the softmax of the logits, so at most 1 in sum).

        Raises:
            ValueError: if a row holds no `mask_token_id`, or `top_k` is not
                in `[1, vocabulary_size]`.
        """
        if _text.is_text(token_ids):
            return _text_tasks.fill_mask_text(self, token_ids, top_k)
        if mask_token_id is None:
            if self.preprocessor is None:
                raise ValueError(
                    "`mask_token_id` is needed for token ids when the model has no "
                    "preprocessor. Received: mask_token_id=None"
                )
            mask_token_id = self.preprocessor.tokenizer.mask_token_id
        ids = np.asarray(keras.ops.convert_to_numpy(token_ids))
        if ids.ndim not in (1, 2):
            raise ValueError(
                "`token_ids` must be ids of shape (batch, length) or (length,), or text. "
                f"Received: token_ids={token_ids!r:.60} with shape {ids.shape}"
            )
        if ids.ndim == 1:
            ids = ids[None]
            segment_ids = None if segment_ids is None else np.asarray(segment_ids)[None]
            padding_mask = None if padding_mask is None else np.asarray(padding_mask)[None]
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not (
            1 <= top_k <= self.vocabulary_size
        ):
            raise ValueError(
                f"`top_k` must be an int in [1, {self.vocabulary_size}]. Received: "
                f"top_k={top_k!r}"
            )
        masked = ids == mask_token_id  # (B, T)
        counts = masked.sum(axis=1)
        if not counts.all():
            raise ValueError(
                f"Every row of `token_ids` must hold `mask_token_id`={mask_token_id}. "
                f"Received: rows {np.flatnonzero(counts == 0).tolist()} without it"
            )
        # Each row's mask positions, padded with its last one to the most masks.
        width = int(counts.max())
        positions = np.zeros((len(ids), width), "int32")  # (B, M)
        for row, where in enumerate(masked):
            found = np.flatnonzero(where)
            positions[row] = np.concatenate([found, np.repeat(found[-1:], width - len(found))])
        inputs = {"token_ids": ids.astype("int32"), "mask_positions": positions}
        if segment_ids is not None:
            inputs["segment_ids"] = np.asarray(segment_ids, "int32")
        if padding_mask is not None:
            inputs["padding_mask"] = np.asarray(padding_mask).astype(bool)
        # The call's checks of the ids, which a traced call cannot make; then
        # Keras's compiled prediction, kept per input shape (on JAX an eager
        # call compiles each operation for every new shape).
        self.encoder.check_inputs(inputs)
        logits = np.asarray(self.predict_on_batch(inputs), "float64")
        logits -= logits.max(axis=-1, keepdims=True)
        probabilities = np.exp(logits)
        probabilities /= probabilities.sum(axis=-1, keepdims=True)  # (B, M, V)
        top = np.argsort(-probabilities, axis=-1, kind="stable")[..., :top_k]  # (B, M, k)
        results = []
        for row, count in enumerate(counts):
            results.append([
                (int(positions[row, m]), top[row, m],
                 probabilities[row, m, top[row, m]].astype("float32"))
                for m in range(count)
            ])
        return results

    @classmethod
    def from_keras_hub(cls, model: Any, **kwargs: Any) -> "BertMaskedLM":
        """A `BertMaskedLM` holding a KerasHub BERT's weights.

        Args:
            model: a `keras_hub.models.BertMaskedLM` (the backbone and the
                masked-LM head are taken over; the logits agree) or a bare
                `keras_hub.models.BertBackbone` (the head starts newly
                initialized). Nothing is downloaded: pass a model built or
                loaded locally.
            **kwargs: other constructor arguments (e.g. `dtype`).

        Returns:
            A built `BertMaskedLM` with copies of the weights.
        """
        backbone = getattr(model, "backbone", model)
        if not hasattr(backbone, "transformer_layers") or not hasattr(backbone, "pooled_dense"):
            raise ValueError(
                "`model` must be a keras_hub.models.BertMaskedLM or BertBackbone. "
                f"Received: model={type(model).__name__}"
            )
        encoder = BertEncoder.from_keras_hub(backbone)
        config = {name: getattr(encoder, name) for name in ENCODER_ARGUMENTS}
        new = cls(**{**config, **kwargs})
        new.build()
        new.encoder.set_weights(encoder.get_weights())
        head = getattr(model, "masked_lm_head", None)
        if head is not None:
            new.mlm_dense.set_weights(head._intermediate_dense.get_weights())
            new.mlm_layer_norm.set_weights(head._intermediate_layer_norm.get_weights())
            new.mlm_output_bias.assign(keras.ops.convert_to_numpy(head._bias))
        return new

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in ENCODER_ARGUMENTS})
        return config
