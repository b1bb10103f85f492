"""Taking over the weights of KerasHub's Transformer blocks.

KerasHub's `TransformerEncoder` / `TransformerDecoder` layers hold the same
sublayers as our blocks, in kernels of the same layout (attention kernels
`(D, H, K)`, biases `(H, K)`), so each pair copies with `set_weights`.
"""


def block_pairs(ours, theirs, cross=False):
    """(our sublayer, KerasHub's) pairs of one Transformer block, in weight
    order: `ours` a `TransformerEncoderBlock` or `TransformerDecoderBlock`,
    `theirs` a `keras_hub.layers.TransformerEncoder` or `TransformerDecoder`
    (`cross=True` for the decoder's cross-attention)."""
    attention = theirs._self_attention_layer
    pairs = [
        (ours.self_attention.query_dense, attention._query_dense),
        (ours.self_attention.key_dense, attention._key_dense),
        (ours.self_attention.value_dense, attention._value_dense),
        (ours.self_attention.output_dense, attention._output_dense),
        (ours.self_attention_layer_norm, theirs._self_attention_layer_norm),
    ]
    if cross:
        attention = theirs._cross_attention_layer
        pairs += [
            (ours.cross_attention.query_dense, attention._query_dense),
            (ours.cross_attention.key_dense, attention._key_dense),
            (ours.cross_attention.value_dense, attention._value_dense),
            (ours.cross_attention.output_dense, attention._output_dense),
            (ours.cross_attention_layer_norm, theirs._cross_attention_layer_norm),
        ]
    pairs += [
        (ours.feedforward.intermediate_dense, theirs._feedforward_intermediate_dense),
        (ours.feedforward.output_dense, theirs._feedforward_output_dense),
        (ours.feedforward_layer_norm, theirs._feedforward_layer_norm),
    ]
    return pairs
