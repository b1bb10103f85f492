"""Taking over the weights of Keras's own layers.

`MultiHeadAttention.from_keras` builds our layer from a built
`keras.layers.MultiHeadAttention`: the same configuration (attention axes,
gate and sliding window included), copies of the weights (the kernels have
the same layout), the same outputs. Keras aligns its causal mask and sliding
window top-left and ours bottom-right, which differ only when the query and
key lengths differ (see the README).
"""

import keras

# Keras arguments that our layer takes under the same name and meaning.
_SHARED_ARGUMENTS = (
    "num_heads",
    "key_dim",
    "value_dim",
    "dropout",
    "use_bias",
    "output_shape",
    "seed",
    "kernel_initializer",
    "bias_initializer",
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "attention_axes",
    "use_gate",
    "sliding_window",
)


def from_keras_multi_head_attention(cls, layer):
    """A built `cls` (our `MultiHeadAttention`) equal to Keras's `layer`."""
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise ValueError(
            "`layer` must be a keras.layers.MultiHeadAttention. "
            f"Received: layer={layer!r}"
        )
    if not layer.built:
        raise ValueError(
            "`layer` must be built (called once) before its weights can "
            f"be taken over. Received: unbuilt layer {layer.name!r}"
        )
    peer = layer.get_config()
    new = cls(
        **{name: peer.get(name) for name in _SHARED_ARGUMENTS if name in peer},
        dtype=layer.dtype_policy,
        name=layer.name,
    )
    # The shapes Keras built with (their rank matters with attention axes);
    # (B, T, D) of the kernels' widths where Keras did not record them.
    built = getattr(layer, "_build_shapes_dict", None) or {}
    query_shape = built.get("query_shape") or (None, None, layer.query_dense.kernel.shape[0])
    value_shape = built.get("value_shape") or (None, None, layer.value_dense.kernel.shape[0])
    key_shape = built.get("key_shape") or (
        tuple(value_shape[:-1]) + (layer.key_dense.kernel.shape[0],)
    )
    new.build(tuple(query_shape), tuple(value_shape), tuple(key_shape))
    pairs = (
        (new.query_dense, layer.query_dense),
        (new.key_dense, layer.key_dense),
        (new.value_dense, layer.value_dense),
        (new.output_dense, layer.output_dense),
    )
    if new.use_gate:
        pairs += ((new.gate_dense, layer._gate_dense),)
    for ours, theirs in pairs:
        ours.set_weights(theirs.get_weights())
    return new
