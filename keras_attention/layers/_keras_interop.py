"""Taking over the weights of Keras's and KerasHub's own layers.

`MultiHeadAttention.from_keras` builds our layer from a built
`keras.layers.MultiHeadAttention`: the same configuration (attention axes,
gate and sliding window included), copies of the weights (the kernels have
the same layout), the same outputs. Keras aligns its causal mask and sliding
window top-left and ours bottom-right, which differ only when the query and
key lengths differ (see the README).

The layers named after KerasHub's (`TransformerEncoder`,
`TransformerDecoder`) take over a KerasHub block the same way
(`from_keras`), and load the `.keras` files of the time when those
names meant stacks (`KerasHubBlockName`).
"""

from typing import Any

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
    check_built_peer(
        layer, keras.layers.MultiHeadAttention, "keras.layers.MultiHeadAttention"
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


def from_keras_attention(cls, layer):
    """A built `cls` (our `Attention` or `AdditiveAttention`) equal to
    Keras's layer of the same name."""
    additive = keras.layers.AdditiveAttention
    if cls.__name__ == "AdditiveAttention":
        check_built_peer(layer, additive, "keras.layers.AdditiveAttention")
    elif isinstance(layer, additive):
        raise ValueError(
            "`layer` must be a keras.layers.Attention; take over a "
            "keras.layers.AdditiveAttention with AdditiveAttention.from_keras. "
            f"Received: layer={layer!r}"
        )
    else:
        check_built_peer(layer, keras.layers.Attention, "keras.layers.Attention")
    peer = layer.get_config()
    arguments = {"use_scale": peer["use_scale"], "dropout": peer["dropout"]}
    arguments["seed"] = peer.get("seed")
    if "score_mode" in peer and cls.__name__ != "AdditiveAttention":
        arguments["score_mode"] = peer["score_mode"]
    new = cls(**arguments, dtype=layer.dtype_policy, name=layer.name)
    # The widths Keras built with, where it recorded them; any will do for a
    # layer whose weights are scalars.
    built = getattr(layer, "_build_shapes_dict", None) or {}
    shapes = built.get("input_shape")
    if shapes is None:
        width = layer.scale.shape[0] if additive_scale(layer) else 1
        shapes = [(None, None, width), (None, None, width)]
    new.build([tuple(shape) for shape in shapes])
    for name in ("scale", "concat_score_weight"):
        theirs = getattr(layer, name, None)
        if theirs is not None:
            getattr(new.score, name).assign(theirs)
    return new


def additive_scale(layer):
    """Whether Keras's `layer` holds the vector `scale` of AdditiveAttention."""
    return isinstance(layer, keras.layers.AdditiveAttention) and layer.scale is not None


def check_built_peer(layer, expected, name):
    """Refuses anything but a built instance of `expected` (a class or a
    tuple of classes) named `name` in the message."""
    if not isinstance(layer, expected):
        raise ValueError(f"`layer` must be a {name}. Received: layer={layer!r}")
    if not layer.built:
        raise ValueError(
            "`layer` must be built (called once) before its weights can "
            f"be taken over. Received: unbuilt layer {layer.name!r}"
        )


def keras_hub_block_pairs(ours, theirs, cross=False):
    """(our sublayer, KerasHub's) pairs of one Transformer block, in weight
    order: `ours` a `TransformerEncoderBlock` or `TransformerDecoderBlock`,
    `theirs` a `keras_hub.layers.TransformerEncoder` or `TransformerDecoder`
    (`cross=True` for the decoder's cross-attention). The sublayers hold
    kernels of the same layout (attention kernels `(D, H, K)`, biases
    `(H, K)`), so each pair copies with `set_weights`."""
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


# KerasHub's Transformer block arguments; ours take them all, same meaning.
_KERAS_HUB_BLOCK_ARGUMENTS = (
    "intermediate_dim",
    "num_heads",
    "dropout",
    "activation",
    "layer_norm_epsilon",
    "kernel_initializer",
    "bias_initializer",
    "normalize_first",
)


def former_stack_name(stack_class, name):
    """`stack_class` under the class name `name` it had before the rename,
    for the stacks loaded from `.keras` files of that time.

    Keras names a functional model's layers in the weights file after their
    class (`layers/transformer_encoder/...`), so a stack saved as
    `TransformerEncoder` loads its weights only into a class of that name.
    Registered under the package `keras_attention_legacy`: such a model saves
    and loads again as it was.
    """
    former = type(
        name,
        (stack_class,),
        {
            "__doc__": f"`{stack_class.__name__}` loaded from a file saved when "
            f"it was named `{name}` (a `.keras` file's weight paths follow the "
            "class name).",
            "__module__": stack_class.__module__,
            "__qualname__": f"former_stack_name.<{name}>",
        },
    )
    register = keras.saving.register_keras_serializable(
        package="keras_attention_legacy", name=name
    )
    return register(former)


class KerasHubBlockName:
    """What our blocks under KerasHub's names add to the block: the
    KerasHub block's weights (`from_keras`), and the `.keras` files saved
    when the name meant a stack of `num_layers` blocks (such a config loads
    as `former_stack_class`, the stack under its former class name)."""

    stack_class = None
    former_stack_class = None

    def __init_subclass__(cls, stack=None, **kwargs):
        # `class TransformerEncoder(KerasHubBlockName, ..., stack=...)`: the
        # stack that the name meant before, under the same class name.
        super().__init_subclass__(**kwargs)
        if stack is not None:
            cls.stack_class = stack
            cls.former_stack_class = former_stack_name(stack, cls.__name__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "num_layers" in kwargs:
            raise TypeError(
                f"`{type(self).__name__}` is one block, as "
                f"`keras_hub.layers.{type(self).__name__}`; a stack of "
                f"`num_layers` blocks is `{self.stack_class.__name__}`. "
                f"Received: num_layers={kwargs['num_layers']!r}"
            )
        super().__init__(*args, **kwargs)

    @classmethod
    def peer_name(cls):
        """The name of the KerasHub class (for a subclass of ours, that of
        the first class of its line that took a `stack`)."""
        for klass in cls.__mro__:
            if "stack_class" in vars(klass):
                return klass.__name__
        return cls.__name__

    @classmethod
    def from_config(cls, config):
        if "num_layers" in config:
            return cls.former_stack_class.from_config(config)
        return super().from_config(config)

    @classmethod
    def from_keras(cls, layer):
        """A built block equal to a built KerasHub block of this name
        (`keras_hub.layers.TransformerEncoder` or `TransformerDecoder`): its
        arguments, dtype policy, name and weights, the same outputs (at the
        positions that are not padding; see the README)."""
        import keras_hub  # an optional dependency, needed only here

        name = cls.peer_name()
        check_built_peer(layer, getattr(keras_hub.layers, name), f"keras_hub.layers.{name}")
        peer = layer.get_config()
        new = cls(
            **{name: peer[name] for name in _KERAS_HUB_BLOCK_ARGUMENTS},
            dtype=layer.dtype_policy,
            name=layer.name,
        )
        attention = layer._self_attention_layer
        sequence_shape = (None, None, attention._query_dense.kernel.shape[0])
        cross = getattr(layer, "_cross_attention_layer", None) is not None
        if cross:
            encoder_width = layer._cross_attention_layer._key_dense.kernel.shape[0]
            new.build(sequence_shape, (None, None, encoder_width))
        else:
            new.build(sequence_shape)
        for ours, theirs in keras_hub_block_pairs(new, layer, cross=cross):
            ours.set_weights(theirs.get_weights())
        return new
