"""What a pass written outside the layers may compute.

A backend's decoding step (`backend.block_step`, `backend.decoder_step`) and
its sequence pass (`backend.stack_forward`) replace the Keras layers of a
decoder block with the same arithmetic written out. They may do so only for
configurations they compute: each option of a layer's `get_config()` is
listed below with the values the steps accept (`_ANY`: every value). An
option not listed (a new feature, say) or a value not accepted sends the
block to the layers, so a step never silently computes something else than
the layer would.

The sequence pass also runs in training, where the layers' call does more
than their arithmetic: it draws dropout, adds activity regularization
losses and rematerializes under `keras.RematScope`. The pass draws dropout
from the layers' own seed generators, as they would (`own_dropout`); a
block whose call would do anything else goes to the layers
(`call_adds_nothing`).
"""

import keras

_ANY = None
_BASE = {"name": _ANY, "trainable": _ANY, "dtype": _ANY}
_BLOCK_OPTIONS = {
    **_BASE,
    "intermediate_dim": _ANY,
    "num_heads": _ANY,
    "dropout": _ANY,  # decoding is inference: no dropout
    "activation": _ANY,  # applied as the layer applies it
    "layer_norm_epsilon": _ANY,
    "kernel_initializer": _ANY,
    "bias_initializer": _ANY,
    "normalize_first": _ANY,  # pre- and post-norm
    "key_dim": _ANY,
    "num_key_value_heads": _ANY,
    "score": _ANY,  # checked on the attention layer: a dot product
    "attention_dropout": _ANY,
    "feedforward_dropout": _ANY,
    "gated_feedforward": (False,),
    "normalization": ("layer_norm",),
    "use_rotary_embedding": (False,),
    "rotary_max_wavelength": _ANY,
    "use_bias": _ANY,
    "seed": _ANY,
}
_ATTENTION_OPTIONS = {
    **_BASE,
    "num_heads": _ANY,
    "key_dim": _ANY,
    "value_dim": _ANY,  # a cache needs it equal to key_dim: the layer checks
    "dropout": _ANY,
    "use_bias": _ANY,
    "output_shape": (None,),
    "num_key_value_heads": _ANY,
    "score": _ANY,
    "rotary_embedding": (None,),
    "fused": _ANY,
    "seed": _ANY,
    "kernel_initializer": _ANY,
    "bias_initializer": _ANY,
    "kernel_regularizer": _ANY,
    "bias_regularizer": _ANY,
    "activity_regularizer": _ANY,
    "kernel_constraint": _ANY,
    "bias_constraint": _ANY,
    "attention_axes": (None,),
    "use_gate": (False,),
    "sliding_window": (None,),
    "flash_attention": _ANY,  # the fused switch under Keras's name
}
_FEEDFORWARD_OPTIONS = {
    **_BASE,
    "intermediate_dim": _ANY,
    "activation": _ANY,
    "dropout": _ANY,
    "gated": (False,),
    "output_dim": (None,),
    "use_bias": _ANY,
    "kernel_initializer": _ANY,
    "bias_initializer": _ANY,
    "kernel_regularizer": _ANY,
    "bias_regularizer": _ANY,
    "seed": _ANY,
}
_EMBEDDING_OPTIONS = {
    **_BASE,
    "vocabulary_size": _ANY,
    "sequence_length": _ANY,
    "embedding_dim": _ANY,
    "mask_zero": _ANY,
    "tie_weights": (True,),
    "position_initializer": _ANY,
    "embeddings_initializer": _ANY,
    "position": ("learned",),
    "max_wavelength": _ANY,
}


def allowed(layer, options):
    for key, value in layer.get_config().items():
        if key not in options:
            return False
        accepted = options[key]
        if accepted is not _ANY and value not in accepted:
            return False
    return True


def plain(dense):
    """A kernel that is a plain weight: no quantization, no LoRA."""
    return dense.quantization_mode is None and not dense.lora_enabled


def plain_norm(norm):
    """Keras's layer norm over the last axis (not its RMS variant)."""
    return (
        isinstance(norm, keras.layers.LayerNormalization)
        and not norm.rms_scaling
        and norm.axis in (-1, [-1], (-1,))
    )


def _attention_denses(attention):
    return (
        attention.query_dense,
        attention.key_dense,
        attention.value_dense,
        attention.output_dense,
    )


def _attention_options_allowed(attention):
    return (
        attention is not None
        and allowed(attention, _ATTENTION_OPTIONS)
        and attention.score.dot_product_scale(attention.key_dim) is not None
    )


def attention_allowed(attention):
    return _attention_options_allowed(attention) and all(
        plain(d) for d in _attention_denses(attention)
    )


def cross_attention(block):
    """A decoder block's cross-attention layer; None for an encoder block."""
    return getattr(block, "cross_attention", None)


def _attentions(block):
    attentions = [block.self_attention]
    if cross_attention(block) is not None:
        attentions.append(block.cross_attention)
    return attentions


def _norms(block):
    norms = [block.self_attention_layer_norm, block.feedforward_layer_norm]
    if cross_attention(block) is not None:
        norms.append(block.cross_attention_layer_norm)
    return norms


def _options_allowed(block):
    """The options of the block and its layers, weights aside."""
    if cross_attention(block) is not None and not _attention_options_allowed(
        block.cross_attention
    ):
        return False
    return (
        allowed(block, _BLOCK_OPTIONS)
        and _attention_options_allowed(block.self_attention)
        and allowed(block.feedforward, _FEEDFORWARD_OPTIONS)
        and all(plain_norm(n) for n in _norms(block))
    )


def weights_plain(block):
    """Every kernel of the block a plain weight (checked at each call: LoRA
    and quantization can be switched on after the block is made)."""
    denses = [d for a in _attentions(block) for d in _attention_denses(a)]
    denses += [block.feedforward.intermediate_dense, block.feedforward.output_dense]
    return all(plain(d) for d in denses)


def block_allowed(block):
    return _options_allowed(block) and weights_plain(block)


def _layers(block):
    feedforward = block.feedforward
    layers = [block, feedforward, feedforward.intermediate_dense, feedforward.output_dense]
    for attention in _attentions(block):
        layers += [attention, *_attention_denses(attention)]
    return layers + _norms(block)


def sequence_options_allowed(block):
    """Whether a block's options allow the sequence pass: an encoder block or
    a decoder block (with or without cross-attention) with the options of
    the decoding step and equal key and value head sizes in each attention
    (the fused kernel's; whether the layer asks for that kernel, an
    attribute, is checked at each call: `call_adds_nothing`)."""
    return _options_allowed(block) and all(
        attention.key_dim == (attention.value_dim or attention.key_dim)
        for attention in _attentions(block)
    )


def call_adds_nothing(block):
    """Whether the layers' calls add nothing to their arithmetic: no activity
    regularization (a loss the call records), no rematerialization
    (`keras.RematScope`), and the attentions' fused kernel, not the explicit
    one they may be switched to. Checked at each call: all are attributes a
    user can set after the block is made."""
    return all(bool(a.fused) for a in _attentions(block)) and all(
        getattr(layer, "activity_regularizer", None) is None
        and getattr(layer, "_remat_mode", None) is None
        for layer in _layers(block)
    )


def own_dropout(layer):
    """A dropout layer of the package (`layers/_dropout.py`), which draws its
    whole-shape mask through `backend.dropout` from its own seed generator:
    a pass that draws the same way gets the same masks."""
    # Imported here: the layers import this package.
    from keras_attention.layers._dropout import Dropout

    return type(layer) is Dropout and layer.noise_shape is None


def dropout_drawn_as_the_layers(block):
    """Whether the pass can draw every dropout layer of a training call of
    the block as the layers would: the package's own dropout layers.
    (Attention dropout needs no check here: on torch the layers draw it in
    `dropout_attention`, `Preferences.dropout_kernel`, which the pass calls
    too.)"""
    dropouts = [
        block.self_attention_residual_dropout,
        block.feedforward_residual_dropout,
        block.feedforward.dropout_layer,
    ]
    if cross_attention(block) is not None:
        dropouts.append(block.cross_attention_residual_dropout)
    return all(own_dropout(layer) for layer in dropouts)


def embedding_allowed(embedding):
    """A `TokenAndPositionEmbedding` of learned positions, tied logits."""
    return (
        allowed(embedding, _EMBEDDING_OPTIONS)
        and plain(embedding.token_embedding)
        and embedding.token_embedding.logit_soft_cap is None
    )
