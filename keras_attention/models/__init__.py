"""Models built from the package's layers."""

from keras_attention.models.gpt import GPT

__all__ = ["GPT"]
