"""Models built from the package's layers, and the generation core they share.

`TranslationPreprocessor` needs KerasHub (optional): its module is imported
when the name is first used.
"""

from typing import TYPE_CHECKING
from typing import Any

from keras_attention.models.bert import BertMaskedLM
from keras_attention.models.bert_classifier import BertClassifier
from keras_attention.models.bert_encoder import BertEncoder
from keras_attention.models.gpt import GPT
from keras_attention.models.seq2seq import Seq2SeqTransformer

if TYPE_CHECKING:
    from keras_attention.models.translation_preprocessor import TranslationPreprocessor

__all__ = [
    "BertClassifier", "BertEncoder", "BertMaskedLM", "GPT", "Seq2SeqTransformer",
    "TranslationPreprocessor",
]


def __getattr__(name: str) -> Any:
    if name == "TranslationPreprocessor":
        from keras_attention.models.translation_preprocessor import TranslationPreprocessor

        return TranslationPreprocessor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
