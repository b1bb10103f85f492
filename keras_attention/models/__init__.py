"""Models built from the package's layers, and the generation core they share."""

from keras_attention.models.bert import BertMaskedLM
from keras_attention.models.bert_classifier import BertClassifier
from keras_attention.models.bert_encoder import BertEncoder
from keras_attention.models.gpt import GPT
from keras_attention.models.seq2seq import Seq2SeqTransformer

__all__ = ["BertClassifier", "BertEncoder", "BertMaskedLM", "GPT", "Seq2SeqTransformer"]
