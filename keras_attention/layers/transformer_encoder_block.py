"""The Transformer encoder block: self-attention, then a feed-forward network.

Shape legend: `B` batch, `T` length, `D` model width (`hidden_dim`), `H`
heads.
"""

import keras

from keras_attention import masking
from keras_attention._typing import Tensor
from keras_attention.layers import _block_io
from keras_attention.layers._transformer_block import TransformerBlock
from keras_attention.layers._transformer_block import ChecksOutputPositions
from keras_attention.layers._transformer_block import as_tuple
from keras_attention.layers._transformer_block import rows_at


@keras.saving.register_keras_serializable(package="keras_attention")
class TransformerEncoderBlock(_block_io.EncoderOutputSpec, ChecksOutputPositions, TransformerBlock):
    """One encoder layer of "Attention Is All You Need" (section 3.1).

    Two sub-layers, each wrapped in dropout, a residual connection and a
    normalization:

        x = norm1(x + dropout(self_attention(x, x)))    # post-norm (the paper)
        x = norm2(x + dropout(feedforward(x)))

    With `normalize_first=True` the norm moves inside the residual branch
    (pre-norm, as in GPT-2 and most later models), `x = x + dropout(f(norm(x)))`,
    which trains deep stacks without warm-up tricks; the output is then not
    normalized, so a stack of pre-norm blocks ends with a final norm
    (`TransformerEncoderStack` adds it).

    Every token attends to every unmasked token (no causal mask). The arguments
    are those of `keras_hub.layers.TransformerEncoder` (`TransformerEncoder`
    is this block under that name), plus the variants
    later work introduced, each off by default.

    Args:
        intermediate_dim: positive int, the hidden width of the feed-forward
            network.
        num_heads: positive int, the number of attention heads.
        dropout: float in [0, 1), the dropout on each sub-layer's output
            before the residual add; also the attention-weight dropout unless
            `attention_dropout` is given.
        activation: the feed-forward activation (name or callable).
        layer_norm_epsilon: positive float, the epsilon of the norms.
        kernel_initializer: initializer of every kernel.
        bias_initializer: initializer of every bias.
        normalize_first: bool, pre-norm if True (GPT-2); the paper's post-norm
            if False (default).
        key_dim: optional positive int, the head size. Defaults to
            `hidden_dim // num_heads`, where `hidden_dim` is the width of the
            inputs (which must then be divisible by `num_heads`).
        num_key_value_heads: optional positive int dividing `num_heads`:
            grouped-query attention.
        score: the attention scorer (`"scaled_dot"`, `"dot"`, `"additive"`,
            `"bilinear"` or a scorer config), one per attention layer.
        attention_dropout: optional float in [0, 1), the dropout on the
            attention weights. Defaults to `dropout`.
        feedforward_dropout: float in [0, 1), the dropout after the
            feed-forward activation. Defaults to 0.
        gated_feedforward: bool, a gated (GLU-family) feed-forward network:
            with `activation="silu"` it is SwiGLU (Shazeer, 2020).
        normalization: `"layer_norm"` (default) or `"rms_norm"`
            (Zhang and Sennrich, 2019).
        use_rotary_embedding: bool, rotary position embeddings (RoPE) on the
            attention's queries and keys.
        rotary_max_wavelength: positive int, RoPE's maximum wavelength.
        use_bias: bool, biases in the attention and feed-forward projections.
        seed: optional int, the seed of the dropout layers.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: `(B, T, D)`.
        padding_mask: optional `(B, T)` boolean mask, `True` for real tokens.
            Combined (AND) with the Keras mask of `inputs`.
        attention_mask: optional `(B, T, T)` boolean mask.
        training: bool, whether dropout is active.
        return_attention_scores: bool, also return the attention weights.
        output_positions: optional int `(B, M)`, positions in `[0, T)`: the
            block's output only at these positions. Keys and values still
            come from every position, so each row equals the full output's
            row at its position, while the queries, the output projection
            and the feed-forward network run on `M` rows instead of `T`. A
            masked-LM head that reads the last block at its mask positions
            needs nothing more.

    Returns:
        `(B, T, D)` (`(B, M, D)` with `output_positions`), or
        `(output, weights)` with weights `(B, H, T, T)` (`(B, H, M, T)`).

    Example:

    >>> import numpy as np
    >>> block = TransformerEncoderBlock(intermediate_dim=64, num_heads=4)
    >>> x = np.random.rand(2, 5, 32).astype("float32")
    >>> tuple(block(x).shape)
    (2, 5, 32)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
        - [Xiong et al., 2020 (pre-norm)](https://arxiv.org/abs/2002.04745)
    """

    def build(self, inputs_shape):
        self._check_inputs("inputs", inputs_shape)
        # Self attention block.
        self._build_attention_sublayer(
            "self_attention", inputs_shape, inputs_shape, self.use_rotary_embedding, 0
        )
        # Feedforward block.
        self._build_feedforward_sublayer(inputs_shape, 2)
        self.built = True

    def call(
        self,
        inputs: Tensor,
        padding_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        training: bool | None = None,
        return_attention_scores: bool = False,
        output_positions: Tensor | None = None,
    ):
        self._check_inputs("inputs", inputs.shape)
        padding_mask, attention_mask, output_positions = _block_io.encoder_masks(
            inputs, padding_mask, attention_mask, output_positions
        )
        query_mask, residual = padding_mask, None
        if output_positions is not None:
            residual = rows_at(inputs, output_positions)  # (B, M, D)
            if query_mask is not None:
                query_mask = rows_at(query_mask, output_positions)
            if attention_mask is not None:  # the query axis is the second last
                axis = len(attention_mask.shape) - 2
                attention_mask = rows_at(attention_mask, output_positions, axis)

        # Self attention block.
        def attend(x):
            query = x if output_positions is None else rows_at(x, output_positions)
            return self.self_attention(
                query,
                x,
                query_mask=query_mask,
                value_mask=padding_mask,
                attention_mask=attention_mask,
                return_attention_scores=return_attention_scores,
                training=training,
            )

        x, weights = self._sublayer(
            inputs,
            self.self_attention_layer_norm,
            self.self_attention_residual_dropout,
            lambda x: as_tuple(attend(x)),
            training,
            residual=residual,
        )

        # Feedforward block.
        x, _ = self._sublayer(
            x,
            self.feedforward_layer_norm,
            self.feedforward_residual_dropout,
            lambda x: (self.feedforward(x, training=training),),
            training,
        )
        implicit = masking.implicit_mask(inputs)
        if output_positions is not None and implicit is not None:
            # The output's Keras mask: the input mask's rows (Keras would
            # give the input's, of the wrong length).
            masking.attach_mask(x, rows_at(implicit, output_positions))
        if return_attention_scores:
            return x, weights[0]
        return x

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)
