"""Taking over the weights of KerasHub's Transformer blocks.

KerasHub's `TransformerEncoder` / `TransformerDecoder` layers hold the same
sublayers as our blocks, in kernels of the same layout (attention kernels
`(D, H, K)`, biases `(H, K)`), so each pair copies with `set_weights`; the
pairs are listed once, in `keras_attention.layers._keras_interop`.
"""

from keras_attention.layers._keras_interop import keras_hub_block_pairs as block_pairs

__all__ = ["block_pairs"]
