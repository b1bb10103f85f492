"""A classifier on BERT's pooled output, for fine-tuning a pretrained encoder.

Shape legend: `B` batch, `T` length, `D` width, `C` classes.
"""

from typing import Any

import keras
from keras import ops

from keras_attention import _validation
from keras_attention._typing import Activation
from keras_attention._typing import Tensor
from keras_attention.layers._dropout import Dropout
from keras_attention.models.bert_encoder import BertEncoder


@keras.saving.register_keras_serializable(package="keras_attention")
class BertClassifier(keras.Model):
    """Classes from the pooled output of a `BertEncoder`.

    encoder -> pooled output (`tanh` dense on the first position) ->
    dropout -> dense to `num_classes` logits, as
    `keras_hub.models.BertTextClassifier`. Fine-tuning trains every weight,
    the encoder's included; `BertClassifier.from_masked_lm` starts from a
    pretrained `BertMaskedLM` (a copy of its encoder, so the masked LM is
    left as it was). The encoder's last block computes the first position
    only (`output_positions`), the one row the pooled output reads.

    Args:
        encoder: a `BertEncoder` (or its config).
        num_classes: positive int `C`.
        activation: optional activation of the output (`None`: logits;
            `"softmax"`: probabilities).
        dropout: float in [0, 1), before the output layer (BERT: 0.1).
        seed: optional int, the seed of the dropout.
        **kwargs: base `keras.Model` arguments.

    Call arguments:
        inputs: a dict with `"token_ids"` `(B, T)` and optionally
            `"segment_ids"` and `"padding_mask"` (KerasHub's
            `BertTextClassifierPreprocessor` outputs).
        training: bool, whether dropout is active.

    Returns:
        `(B, C)`: logits, or the output of `activation`.

    Example:

    >>> import numpy as np
    >>> from keras_attention.models import BertMaskedLM
    >>> pretrained = BertMaskedLM(50, num_layers=1, num_heads=2, hidden_dim=8,
    ...                           intermediate_dim=16, max_sequence_length=16)
    >>> classifier = BertClassifier.from_masked_lm(pretrained, num_classes=3)
    >>> tuple(classifier({"token_ids": np.array([[2, 7, 4, 3]])}).shape)
    (1, 3)

    References:
        - [Devlin et al., 2019](https://arxiv.org/abs/1810.04805), section 4.
    """

    def __init__(
        self,
        encoder: keras.Model,
        num_classes: int,
        activation: Activation | None = None,
        dropout: float = 0.1,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(encoder, dict):
            encoder = keras.saving.deserialize_keras_object(encoder)
        if not isinstance(encoder, BertEncoder):
            raise ValueError(
                "`encoder` must be a BertEncoder or its config. Received: "
                f"encoder={encoder!r}"
            )
        self.encoder = encoder
        self.num_classes = _validation.check_positive_int("num_classes", num_classes)
        self.activation = keras.activations.get(activation)
        self.dropout = _validation.check_rate("dropout", dropout)
        self.seed = _validation.check_seed("seed", seed)
        self.output_dropout = Dropout(
            dropout, seed=seed, dtype=self.dtype_policy, name="output_dropout"
        )
        self.output_dense = keras.layers.Dense(
            num_classes,
            activation=activation,
            kernel_initializer=keras.initializers.TruncatedNormal(
                stddev=encoder.initializer_range
            ),
            dtype=self.dtype_policy,
            name="output_dense",
        )

    @classmethod
    def from_masked_lm(cls, masked_lm, num_classes, **kwargs):
        """A built classifier whose encoder is a copy of `masked_lm`'s (a
        `BertMaskedLM`, e.g. after pretraining); the output layer is new.

        Args:
            masked_lm: a `BertMaskedLM`.
            num_classes: positive int.
            **kwargs: the other constructor arguments (`dropout`, ...).
        """
        source = masked_lm.encoder
        if not source.built:
            source.build()
        encoder = BertEncoder.from_config(source.get_config())
        encoder.build()
        encoder.set_weights(source.get_weights())
        classifier = cls(encoder, num_classes, **kwargs)
        classifier.build()
        return classifier

    def build(self, inputs_shape=None):
        if not self.encoder.built:
            self.encoder.build()
        self.output_dense.build((None, self.encoder.hidden_dim))
        self.built = True

    def __call__(self, inputs, *args, **kwargs):
        self.encoder.check_inputs(inputs)
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs: dict[str, Tensor], training: bool | None = None):
        # The last block at the first position only: the pooled output reads
        # no other row of it.
        first = ops.zeros_like(inputs["token_ids"][:, :1], dtype="int32")  # (B, 1)
        rows = self.encoder(inputs, training=training, output_positions=first)
        pooled = self.encoder.pool(rows["sequence_output"][:, 0, :])  # (B, D)
        return self.output_dense(self.output_dropout(pooled, training=training))  # (B, C)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "encoder": keras.saving.serialize_keras_object(self.encoder),
                "num_classes": self.num_classes,
                "activation": keras.activations.serialize(self.activation),
                "dropout": self.dropout,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["encoder"] = keras.saving.deserialize_keras_object(config["encoder"])
        return cls(**config)
