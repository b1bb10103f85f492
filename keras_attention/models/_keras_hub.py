"""Taking over the weights of KerasHub's Transformer blocks.

KerasHub's `TransformerEncoder` / `TransformerDecoder` layers hold the same
sublayers as our blocks, in kernels of the same layout (attention kernels
`(D, H, K)`, biases `(H, K)`), so each pair copies with `set_weights` (the
pairs are listed once, in `keras_attention.layers._keras_interop`). So do
those of KerasHub's LLaMA decoder layers (`llama_block_pairs`), and the
embeddings and final norms of its GPT-2, LLaMA, BART and BERT backbones
(`gpt_pairs`, `bart_pairs`, `bert_pairs`): each a model's embedding pairs
(by name: `named_pairs`), then its blocks' (`weight_pairs`), copied by
`built_from`.
"""

import functools
import sys

from keras_attention.layers._keras_interop import keras_hub_block_pairs as block_pairs


def weight_pairs(embeddings, *stacks):
    """(our sublayer, KerasHub's) pairs in weight order: the `embeddings`
    pairs, then those of every block of each stack, a stack given as
    `(our_blocks, their_blocks, block_pairs_of)`."""
    pairs = list(embeddings)
    for ours, theirs, block_pairs_of in stacks:
        for our_block, their_block in zip(ours, theirs):
            pairs += block_pairs_of(our_block, their_block)
    return pairs


def named_pairs(ours, theirs, *names):
    """`(ours.<name>, theirs.<name>)` for each of `names`: the name of a
    sublayer both hold (ours keep KerasHub's names), or a pair `(our name,
    their name)`."""
    pairs = []
    for name in names:
        our_name, their_name = (name, name) if isinstance(name, str) else name
        pairs.append((getattr(ours, our_name), getattr(theirs, their_name)))
    return pairs


def built_from(model, backbone, pairs_of, *build_arguments):
    """`model` built, with copies of the weights of `pairs_of(model,
    backbone)`."""
    model.build(*build_arguments)
    for ours, theirs in pairs_of(model, backbone):
        ours.set_weights(theirs.get_weights())
    return model


# GPT from a decoder-only backbone: `gpt_arguments` reads the configuration,
# `gpt_pairs` lists the sublayers whose weights copy as they are.

BACKBONES = "a keras_hub.models.GPT2Backbone or keras_hub.models.LlamaBackbone"


def backbone_kind(backbone):
    """`"gpt2"` or `"llama"`; a `ValueError` for anything else.

    KerasHub is looked up among the imported modules, not imported: a
    backbone of it exists only once it is imported.
    """
    hub_models = getattr(sys.modules.get("keras_hub"), "models", None)
    if hub_models is not None:
        # Llama 3's backbone is a LlamaBackbone too.
        if isinstance(backbone, hub_models.LlamaBackbone):
            return "llama"
        if isinstance(backbone, hub_models.GPT2Backbone):
            return "gpt2"
    raise ValueError(
        f"`backbone` must be {BACKBONES}. Received: backbone of type "
        f"{type(backbone).__name__} ({backbone!r:.80})"
    )


def gpt_arguments(backbone, max_sequence_length=None):
    """The `GPT` arguments that reproduce `backbone`.

    A GPT-2 backbone fixes `max_sequence_length` (its position table); a
    LLaMA backbone has none, and `max_sequence_length` (default 4096, LLaMA
    2's context) only bounds the sequences.
    """
    kind = backbone_kind(backbone)
    config = backbone.get_config()
    if kind == "gpt2":
        table = config["max_sequence_length"]
        if max_sequence_length not in (None, table):
            raise ValueError(
                "A GPT2Backbone's position table fixes `max_sequence_length` "
                f"({table}). Received: max_sequence_length={max_sequence_length!r}"
            )
        return {
            name: config[name]
            for name in (
                "vocabulary_size", "max_sequence_length", "num_layers", "num_heads",
                "hidden_dim", "intermediate_dim", "dropout",
            )
        }
    # Not taken over: LLaMA 3.1's frequency-dependent wavelengths (our
    # rotary layer has none) and linearly scaled positions (our rotary layer
    # has them, the Transformer blocks do not pass them on).
    for name, plain in (
        ("rope_position_scaling_factor", 1.0),
        ("rope_frequency_adjustment_factor", None),
    ):
        if config.get(name, plain) != plain:
            raise ValueError(
                f"Only LLaMA backbones with `{name}={plain}` are supported. "
                f"Received: {name}={config[name]!r}"
            )
    wavelength = config["rope_max_wavelength"]
    if isinstance(wavelength, float) and wavelength.is_integer():
        wavelength = int(wavelength)  # as `rotary_max_wavelength` takes it
    return {
        "vocabulary_size": config["vocabulary_size"],
        "max_sequence_length": 4096 if max_sequence_length is None else max_sequence_length,
        "num_layers": config["num_layers"],
        "num_heads": config["num_query_heads"],
        "hidden_dim": config["hidden_dim"],
        "intermediate_dim": config["intermediate_dim"],
        "dropout": config["dropout"],
        "activation": "silu",
        "layer_norm_epsilon": config["layer_norm_epsilon"],
        "num_key_value_heads": config["num_key_value_heads"],
        "use_bias": False,
        "normalization": "rms_norm",
        "positions": "rotary",
        "rotary_max_wavelength": wavelength,
        "gated_feedforward": True,
        # Not in KerasHub 0.32's config: the embedding layer knows.
        "tie_weights": bool(backbone.token_embedding.tie_weights),
    }


def gpt_pairs(model, backbone):
    """(our sublayer, KerasHub's) pairs of a `GPT` made from
    `gpt_arguments(backbone)`, in weight order."""
    embeddings = [
        (model.embedding.token_embedding, backbone.token_embedding),
        (model.decoder.output_layer_norm, backbone.layer_norm),
    ]
    if backbone_kind(backbone) == "gpt2":
        embeddings.append(
            (model.embedding.position_embedding, backbone.position_embedding)
        )
        block_pairs_of = block_pairs
    else:
        block_pairs_of = llama_block_pairs
    return weight_pairs(
        embeddings, (model.decoder.blocks, backbone.transformer_layers, block_pairs_of)
    )


def llama_block_pairs(ours, theirs):
    """(our sublayer, KerasHub's) pairs of one decoder block: `ours` a
    `TransformerDecoderBlock` with RMS norms and a gated feed-forward
    network, `theirs` a LLaMA decoder layer.

    The attention kernels share our layout (queries `(D, H, K)`, keys and
    values `(D, G, K)`, output `(H, K, D)`, no biases) and the grouping of
    query heads onto key/value heads (head `h` reads group `h // (H / G)`);
    KerasHub's LLaMA norm is an RMS norm whose one weight is the scale;
    `intermediate_dense` is the linear branch of the SwiGLU and `gate_dense`
    the activated one, in both.
    """
    attention = theirs._self_attention_layer
    return [
        (ours.self_attention.query_dense, attention._query_dense),
        (ours.self_attention.key_dense, attention._key_dense),
        (ours.self_attention.value_dense, attention._value_dense),
        (ours.self_attention.output_dense, attention._output_dense),
        (ours.self_attention_layer_norm, theirs._self_attention_layernorm),
        (ours.feedforward.intermediate_dense, theirs._feedforward_intermediate_dense),
        (ours.feedforward.gate_dense, theirs._feedforward_gate_dense),
        (ours.feedforward.output_dense, theirs._feedforward_output_dense),
        (ours.feedforward_layer_norm, theirs._feedforward_layernorm),
    ]


# A translation model from BART: the same Transformer with learned positions,
# an embedding layer norm, exact GELU, one shared token table and unscaled
# embeddings.


def bart_arguments(backbone, kwargs):
    """The `Seq2SeqTransformer` arguments that reproduce a `BartBackbone`,
    with the caller's `kwargs` (BART's pad id 1 unless they give one)."""
    config = backbone.get_config()
    kwargs = dict(kwargs)
    return dict(
        source_vocabulary_size=config["vocabulary_size"],
        target_vocabulary_size=config["vocabulary_size"],
        max_source_length=config["max_sequence_length"],
        max_target_length=config["max_sequence_length"],
        num_encoder_layers=config["num_layers"],
        num_decoder_layers=config["num_layers"],
        num_heads=config["num_heads"],
        hidden_dim=config["hidden_dim"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config["dropout"],
        activation="gelu",
        positions="learned",
        share_embeddings=True,
        embedding_layer_norm=True,
        scale_embeddings=False,
        pad_token_id=kwargs.pop("pad_token_id", 1),  # BART's <pad>
        **kwargs,
    )


def bart_pairs(model, backbone):
    """(our sublayer, the `BartBackbone`'s) pairs, in weight order."""
    embeddings = named_pairs(
        model, backbone, "token_embedding", "encoder_position_embedding",
        "decoder_position_embedding",
        ("encoder_embedding_norm", "encoder_embeddings_layer_norm"),
        ("decoder_embedding_norm", "decoder_embeddings_layer_norm"),
    )
    return weight_pairs(
        embeddings,
        (model.encoder.blocks, backbone.encoder_transformer_layers, block_pairs),
        (
            model.decoder.blocks,
            backbone.decoder_transformer_layers,
            functools.partial(block_pairs, cross=True),
        ),
    )


# BERT: an encoder of post-norm blocks after embeddings and their norm.


def bert_pairs(encoder, backbone):
    """(our sublayer, the `BertBackbone`'s) pairs of a `BertEncoder`, in
    weight order."""
    embeddings = named_pairs(
        encoder, backbone, "token_embedding", "position_embedding", "segment_embedding",
        "embeddings_layer_norm", "pooled_dense",
    )
    return weight_pairs(
        embeddings, (encoder.encoder.blocks, backbone.transformer_layers, block_pairs)
    )
