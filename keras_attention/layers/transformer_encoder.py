"""A stack of Transformer encoder blocks, and one block under KerasHub's name.

Shape legend: `B` batch, `T` length, `D` model width, `H` heads, `N` blocks.
"""

import keras

from keras_attention import _signatures
from keras_attention.layers import _block_io
from keras_attention.layers._keras_interop import KerasHubBlockName
from keras_attention.layers._transformer_block import TransformerStack
from keras_attention.layers._transformer_block import ChecksOutputPositions
from keras_attention.layers._transformer_block import as_tuple
from keras_attention.layers.transformer_encoder_block import TransformerEncoderBlock


@keras.saving.register_keras_serializable(package="keras_attention")
class TransformerEncoderStack(_block_io.EncoderOutputSpec, ChecksOutputPositions, TransformerStack):
    """`num_layers` `TransformerEncoderBlock`s, then an optional final norm.

    The paper's encoder is a stack of N = 6 identical blocks. Each block has
    its own weights; the padding and attention masks reach every block. A
    pre-norm stack (`normalize_first=True`) leaves its output unnormalized,
    so it ends with one more norm (`final_layer_norm=None` adds it exactly
    then, as GPT-2 and most pre-norm models do).

    Args:
        num_layers: positive int, the number of blocks `N`.
        intermediate_dim, num_heads, ...: the arguments of
            `TransformerEncoderBlock`, given to every block. Block `i` gets
            the seed `seed + 10 * i` when `seed` is set.
        final_layer_norm: optional bool, a norm (of the blocks'
            `normalization`) after the last block. `None` (default) means
            `normalize_first`.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: `(B, T, D)`.
        padding_mask: optional `(B, T)` boolean mask, combined with the
            Keras mask of `inputs`.
        attention_mask: optional `(B, T, T)` boolean mask.
        training: bool, whether dropout is active.
        return_attention_scores: bool, also return every block's weights.
        output_positions: optional int `(B, M)`: the output only at these
            positions. Every block but the last computes all `T` rows (the
            last one's keys and values need them); the last computes `M`
            (`TransformerEncoderBlock` says how).

    Returns:
        `(B, T, D)` (`(B, M, D)` with `output_positions`), or
        `(output, weights)` where `weights` is a list of `N` tensors
        `(B, H, T, T)`, one per block (the last `(B, H, M, T)`).

    Example:

    >>> import numpy as np
    >>> encoder = TransformerEncoderStack(num_layers=2, intermediate_dim=64, num_heads=4)
    >>> x = np.random.rand(2, 5, 32).astype("float32")
    >>> out, weights = encoder(x, return_attention_scores=True)
    >>> tuple(out.shape), len(weights), tuple(weights[0].shape)
    ((2, 5, 32), 2, (2, 4, 5, 5))

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
    """

    stacked = True
    block_class = TransformerEncoderBlock

    def build(self, inputs_shape):
        self._check_inputs("inputs", inputs_shape)
        self._build_blocks(inputs_shape)
        self.built = True

    @_signatures.takes_arguments_of(TransformerEncoderBlock.call)
    def call(
        self,
        inputs,
        padding_mask,
        attention_mask,
        output_positions,
        return_attention_scores,
        training,
    ):
        self._check_inputs("inputs", inputs.shape)
        padding_mask, attention_mask, output_positions = _block_io.encoder_masks(
            inputs, padding_mask, attention_mask, output_positions
        )
        x, weights = inputs, []
        for i, block in enumerate(self.blocks):
            last = i == len(self.blocks) - 1
            x, *extra = as_tuple(
                block(
                    x,
                    padding_mask=padding_mask,
                    attention_mask=attention_mask,
                    return_attention_scores=return_attention_scores,
                    output_positions=output_positions if last else None,
                    training=training,
                )
            )
            weights += extra
        if self.output_layer_norm is not None:
            x = self.output_layer_norm(x)
        if return_attention_scores:
            return x, weights
        return x

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)


@keras.saving.register_keras_serializable(package="keras_attention")
class TransformerEncoder(
    KerasHubBlockName, TransformerEncoderBlock, stack=TransformerEncoderStack
):
    """One encoder block under KerasHub's name: `keras_hub.layers.TransformerEncoder`.

    This is `TransformerEncoderBlock` (self-attention, then the feed-forward
    network, post-norm or pre-norm), registered as `TransformerEncoder` so
    that KerasHub code runs by changing its import: KerasHub's constructor
    arguments, `call(inputs, padding_mask, attention_mask, training,
    return_attention_scores)`, and `from_keras(layer)` for a built KerasHub
    encoder's weights. For a stack of `num_layers` of them use
    `TransformerEncoderStack`; a config with `num_layers` (a `.keras` file
    saved when this name meant the stack) loads as that stack.

    Args:
        intermediate_dim: positive int, the feed-forward width.
        num_heads: positive int, the attention heads.
        **kwargs: KerasHub's other arguments (`dropout`, `activation`,
            `layer_norm_epsilon`, `kernel_initializer`, `bias_initializer`,
            `normalize_first`) and this package's, as `TransformerEncoderBlock`
            documents them.

    Call arguments:
        inputs: `(B, T, D)`.
        padding_mask: optional boolean `(B, T)`; a padded position attends
            to nothing (KerasHub's attends to the real tokens).
        attention_mask, training, return_attention_scores: as KerasHub's.

    Returns:
        `(B, T, D)`, with the weights `(B, H, T, T)` after it when
        `return_attention_scores=True`.

    Example:

    >>> import numpy as np
    >>> layer = TransformerEncoder(intermediate_dim=64, num_heads=4)
    >>> x = np.random.rand(2, 5, 32).astype("float32")
    >>> tuple(layer(x, padding_mask=np.array([[1, 1, 1, 0, 0]] * 2) > 0).shape)
    (2, 5, 32)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762), section 3.1
    """
