"""Models built from the package's layers, and the generation core they share."""

from keras_attention.models.gpt import GPT
from keras_attention.models.seq2seq import Seq2SeqTransformer

__all__ = ["GPT", "Seq2SeqTransformer"]
