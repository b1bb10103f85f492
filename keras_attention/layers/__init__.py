"""Attention layers."""

from keras_attention.layers.additive_attention import AdditiveAttention
from keras_attention.layers.attention import Attention
from keras_attention.layers.cached_multi_head_attention import (
    CachedMultiHeadAttention,
)
from keras_attention.layers.feed_forward import FeedForward
from keras_attention.layers.hard_attention import HardAttention
from keras_attention.layers.layer_normalization import LayerNormalization
from keras_attention.layers.multi_head_attention import MultiHeadAttention
from keras_attention.layers.position_embedding import PositionEmbedding
from keras_attention.layers.rms_normalization import RMSNormalization
from keras_attention.layers.rotary_embedding import RotaryEmbedding
from keras_attention.layers.self_attention import SelfAttention
from keras_attention.layers.sinusoidal_position_encoding import (
    SinusoidalPositionEncoding,
)
from keras_attention.layers.soft_attention import SoftAttention
from keras_attention.layers.token_and_position_embedding import (
    TokenAndPositionEmbedding,
)
from keras_attention.layers.transformer_decoder import TransformerDecoder
from keras_attention.layers.transformer_decoder import TransformerDecoderStack
from keras_attention.layers.transformer_decoder_block import TransformerDecoderBlock
from keras_attention.layers.transformer_encoder import TransformerEncoder
from keras_attention.layers.transformer_encoder import TransformerEncoderStack
from keras_attention.layers.transformer_encoder_block import TransformerEncoderBlock

__all__ = [
    "AdditiveAttention",
    "Attention",
    "CachedMultiHeadAttention",
    "FeedForward",
    "HardAttention",
    "LayerNormalization",
    "MultiHeadAttention",
    "PositionEmbedding",
    "RMSNormalization",
    "RotaryEmbedding",
    "SelfAttention",
    "SinusoidalPositionEncoding",
    "SoftAttention",
    "TokenAndPositionEmbedding",
    "TransformerDecoder",
    "TransformerDecoderBlock",
    "TransformerDecoderStack",
    "TransformerEncoder",
    "TransformerEncoderBlock",
    "TransformerEncoderStack",
]
