"""Taking over the weights of Keras's own layers.

`MultiHeadAttention.from_keras` builds our layer from a built
`keras.layers.MultiHeadAttention`: the same configuration, copies of the
weights (the kernels have the same layout), the same outputs.
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
    # A sliding window changes which keys each query sees; taking the
    # weights without it would silently give other outputs.
    if (
        peer.get("attention_axes") not in (None, (1,), [1])
        or peer.get("use_gate", False)
        or peer.get("sliding_window") is not None
    ):
        raise ValueError(
            "`from_keras` supports (batch, length, dim) attention without "
            "a gate or a sliding window. Received: attention_axes="
            f"{peer.get('attention_axes')}, use_gate="
            f"{peer.get('use_gate', False)}, sliding_window="
            f"{peer.get('sliding_window')}"
        )
    new = cls(
        **{name: peer[name] for name in _SHARED_ARGUMENTS},
        dtype=layer.dtype_policy,
        name=layer.name,
    )
    query_shape = (None, None, layer.query_dense.kernel.shape[0])
    key_shape = (None, None, layer.key_dense.kernel.shape[0])
    value_shape = (None, None, layer.value_dense.kernel.shape[0])
    new.build(query_shape, value_shape, key_shape)
    pairs = (
        (new.query_dense, layer.query_dense),
        (new.key_dense, layer.key_dense),
        (new.value_dense, layer.value_dense),
        (new.output_dense, layer.output_dense),
    )
    for ours, theirs in pairs:
        ours.set_weights(theirs.get_weights())
    return new
