"""Attention layers."""

from keras_attention.layers.multi_head_attention import MultiHeadAttention
from keras_attention.layers.self_attention import SelfAttention
from keras_attention.layers.soft_attention import SoftAttention

__all__ = ["MultiHeadAttention", "SelfAttention", "SoftAttention"]
