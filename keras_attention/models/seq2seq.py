"""The encoder-decoder Transformer of "Attention Is All You Need", for translation.

Shape legend: `B` batch, `S` source length, `T` target length, `V` target
vocabulary size, `D` width (`hidden_dim`), `N` decoder blocks, `L` cache
length, `G` key/value heads, `K` head size, `E` beams.
"""

import math
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_attention import _docs
from keras_attention import _validation
from keras_attention._typing import Activation
from keras_attention._typing import Tensor
from keras_attention.layers._dropout import Dropout
from keras_attention.layers.layer_normalization import LayerNormalization
from keras_attention.layers.position_embedding import PositionEmbedding
from keras_attention.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding
from keras_attention.layers.token_and_position_embedding import ReversibleEmbedding
from keras_attention.layers.transformer_decoder import TransformerDecoderStack
from keras_attention.layers.transformer_encoder import TransformerEncoderStack
from keras_attention.models import _generation_args
from keras_attention.models._translation_decoding import TranslationDecoding
from keras_attention.models import _keras_hub
from keras_attention.models import _model_arguments
from keras_attention.models import _text
from keras_attention.models import _text_tasks
from keras_attention.models import layouts

POSITIONS = ("sinusoidal", "learned")

# The constructor arguments `get_config` saves as the attributes hold them.
_CONFIG_NAMES = (
    "source_vocabulary_size", "target_vocabulary_size",
    "max_source_length", "max_target_length", "num_encoder_layers",
    "num_decoder_layers", "num_heads", "hidden_dim", "intermediate_dim",
    "dropout", "normalize_first", "positions", "share_embeddings",
    "embedding_layer_norm", "pad_token_id", "scale_embeddings",
    "layer_norm_epsilon", "attention_dropout", "seed",
)


def _arguments(
    source_vocabulary_size: int,
    target_vocabulary_size: int,
    max_source_length: int,
    max_target_length: int,
    num_encoder_layers: int = 6,
    num_decoder_layers: int = 6,
    num_heads: int = 8,
    hidden_dim: int = 512,
    intermediate_dim: int = 2048,
    dropout: float = 0.1,
    activation: Activation = "relu",
    normalize_first: bool = False,
    positions: str = "sinusoidal",
    share_embeddings: bool = False,
    embedding_layer_norm: bool = False,
    pad_token_id: int = 0,
    scale_embeddings: bool = True,
    layer_norm_epsilon: float = 1e-5,
):
    """`Seq2SeqTransformer`'s own constructor arguments, before those every model ends
    with (`_model_arguments.ends_with`)."""


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class Seq2SeqTransformer(
    _text_tasks.TranslationTextModel, TranslationDecoding, layouts.TensorParallel, keras.Model
):
    """An encoder-decoder Transformer (the paper's base model by default).

    source ids -> token embedding * sqrt(D) + positions -> `num_encoder_layers`
    encoder blocks (bidirectional self-attention, feed-forward); target ids
    (shifted right: the decoder input starts with a start token) -> the same
    embedding of the target vocabulary -> `num_decoder_layers` decoder blocks
    (causal self-attention; encoder-decoder attention, whose queries come
    from the decoder and keys and values from the encoder output;
    feed-forward) -> logits through the transposed target embedding (input
    and output embeddings tied, section 3.4).

    Defaults are the paper's base model: post-norm, ReLU, sinusoidal
    positions, embeddings scaled by `sqrt(hidden_dim)`, dropout 0.1.
    `positions="learned"` uses learned position tables (one for the source,
    one for the target); `share_embeddings=True` one token table for the
    source, the target and the output (equal vocabularies required);
    `embedding_layer_norm=True` a layer norm after each embedding (BART).
    With `normalize_first=True` the blocks are pre-norm and each stack ends
    with a layer norm.

    `generate` decodes with the KV caches: the encoder runs once, each
    decoder block's cross-attention keys and values are computed once, and
    its self-attention cache grows by one token per step. Greedy, sampling
    and beam search share the package's generation core
    (`keras_attention.models.generation`).

    Args:
        source_vocabulary_size: positive int.
        target_vocabulary_size: positive int `V`.
        max_source_length: positive int, the longest source.
        max_target_length: positive int, the longest target (decoder
            input), the start token included.
        num_encoder_layers: positive int (paper: 6).
        num_decoder_layers: positive int (paper: 6).
        num_heads: positive int dividing `hidden_dim` (paper: 8).
        hidden_dim: positive int `D` (paper: 512).
        intermediate_dim: positive int, the feed-forward width (paper:
            2048).
        dropout: float in [0, 1), on the embeddings, the attention weights
            (unless `attention_dropout` is given) and each residual branch
            (paper: 0.1).
        activation: the feed-forward activation (paper: `"relu"`).
        normalize_first: bool, pre-norm blocks (paper: post-norm).
        positions: `"sinusoidal"` (paper) or `"learned"`.
        share_embeddings: bool, one token table for both languages.
        embedding_layer_norm: bool, a layer norm after each embedding.
        pad_token_id: int, the padding id; masks are derived from it unless
            given.
        scale_embeddings: bool, multiply token embeddings by `sqrt(D)`
            (paper: True; BART: False).
        layer_norm_epsilon: positive float.
        {model_attention_dropout_and_seed}
        **kwargs: base `keras.Model` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: a dict with `"encoder_token_ids"` `(B, S)` and
            `"decoder_token_ids"` `(B, T)`, and optionally
            `"encoder_padding_mask"` and `"decoder_padding_mask"` (bool,
            True = real token), which replace the masks derived from
            `pad_token_id` (KerasHub's names, as `BartSeq2SeqLM` takes).
        training: bool, whether dropout is active.

    Returns:
        Logits `(B, T, V)`: position `t` scores the target token `t + 1`.

    Text in, text out (`keras_attention.models._text_tasks.TranslationTextModel`):
    with a preprocessor in `model.preprocessor` (`from_preset` sets it),
    `translate("text")` returns the translation as text.

    Example:

    >>> import numpy as np
    >>> model = Seq2SeqTransformer(30, 40, 16, 16, num_encoder_layers=1,
    ...     num_decoder_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16)
    >>> inputs = {"encoder_token_ids": np.array([[5, 6, 7, 0]]),
    ...           "decoder_token_ids": np.array([[1, 9, 4]])}
    >>> tuple(model(inputs).shape)
    (1, 3, 40)
    >>> model.generate(np.array([[5, 6, 7, 0]]), 4, start_token_id=1).shape
    (1, 5)

    References:
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
        - [Lewis et al., 2020 (BART)](https://arxiv.org/abs/1910.13461)
        - [Wu et al., 2016 (length penalty)](https://arxiv.org/abs/1609.08144)
    """

    # The stacks; a subclass may name its own (blocks that override `call`,
    # attention layers that override `_compute_attention`): training,
    # inference and `generate` all run their layers.
    encoder_class = TransformerEncoderStack
    decoder_class = TransformerDecoderStack

    @_model_arguments.takes_arguments(_arguments)
    def __init__(
        self, source_vocabulary_size, target_vocabulary_size, max_source_length, max_target_length,
        num_encoder_layers, num_decoder_layers, num_heads, hidden_dim, intermediate_dim, dropout,
        activation, normalize_first, positions, share_embeddings, embedding_layer_norm,
        pad_token_id, scale_embeddings, layer_norm_epsilon, attention_dropout, seed, **kwargs,
    ):
        super().__init__(**kwargs)
        _model_arguments.store_sizes(
            self, num_heads, hidden_dim, intermediate_dim, dropout,
            source_vocabulary_size=source_vocabulary_size,
            target_vocabulary_size=target_vocabulary_size,
            max_source_length=max_source_length, max_target_length=max_target_length,
            num_encoder_layers=num_encoder_layers, num_decoder_layers=num_decoder_layers,
        )
        self.activation = activation
        self.normalize_first = bool(normalize_first)
        if positions not in POSITIONS:
            raise ValueError(
                f"`positions` must be one of {POSITIONS}. Received: positions={positions!r}"
            )
        self.positions = positions
        self.share_embeddings = bool(share_embeddings)
        if self.share_embeddings and source_vocabulary_size != target_vocabulary_size:
            raise ValueError(
                "`share_embeddings=True` needs one vocabulary: "
                "`source_vocabulary_size` must equal `target_vocabulary_size`. "
                f"Received: source_vocabulary_size={source_vocabulary_size}, "
                f"target_vocabulary_size={target_vocabulary_size}"
            )
        self.embedding_layer_norm = bool(embedding_layer_norm)
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)):
            raise ValueError(
                f"`pad_token_id` must be an int. Received: pad_token_id={pad_token_id!r}"
            )
        self.pad_token_id = int(pad_token_id)
        self.scale_embeddings = bool(scale_embeddings)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.attention_dropout = _validation.check_optional_rate(
            "attention_dropout", attention_dropout
        )
        self.seed = _validation.check_seed("seed", seed)
        dtype = self.dtype_policy

        # Embeddings.
        self.token_embedding = self._token_table(self.target_vocabulary_size, "token_embedding")
        self.source_token_embedding = (
            self.token_embedding
            if self.share_embeddings
            else self._token_table(self.source_vocabulary_size, "source_token_embedding")
        )
        if positions == "learned":
            self.encoder_position_embedding = PositionEmbedding(
                self.max_source_length, dtype=dtype, name="encoder_position_embedding"
            )
            self.decoder_position_embedding = PositionEmbedding(
                self.max_target_length, dtype=dtype, name="decoder_position_embedding"
            )
        else:
            # No weights: one table serves both.
            self.encoder_position_embedding = SinusoidalPositionEncoding(
                dtype=dtype, name="position_encoding"
            )
            self.decoder_position_embedding = self.encoder_position_embedding
        self.encoder_embedding_norm = self.decoder_embedding_norm = None
        if self.embedding_layer_norm:
            self.encoder_embedding_norm = LayerNormalization(
                epsilon=layer_norm_epsilon, dtype=dtype, name="encoder_embedding_norm"
            )
            self.decoder_embedding_norm = LayerNormalization(
                epsilon=layer_norm_epsilon, dtype=dtype, name="decoder_embedding_norm"
            )
        self.embedding_dropout = Dropout(
            dropout, seed=seed, dtype=dtype, name="embedding_dropout"
        )
        # Encoder and decoder stacks.
        stack = dict(
            intermediate_dim=intermediate_dim,
            num_heads=num_heads,
            dropout=dropout,
            attention_dropout=self.attention_dropout,
            activation=activation,
            layer_norm_epsilon=layer_norm_epsilon,
            normalize_first=normalize_first,
            dtype=dtype,
        )
        self.encoder = self.encoder_class(
            num_encoder_layers, seed=None if seed is None else seed + 1, name="encoder",
            **stack,
        )
        self.decoder = self.decoder_class(
            num_decoder_layers, seed=None if seed is None else seed + 1000, name="decoder",
            **stack,
        )
        self._generator = None  # made at the first `generate` call

    def _token_table(self, vocabulary_size, name):
        return ReversibleEmbedding(
            vocabulary_size,
            self.hidden_dim,
            tie_weights=True,
            embeddings_initializer=keras.initializers.RandomNormal(
                stddev=self.hidden_dim**-0.5
            ),
            # An Embedding does not autocast: without this, float32 variables
            # would turn the logits float32 under mixed precision.
            reverse_dtype=self.compute_dtype,
            dtype=self.dtype_policy,
            name=name,
        )

    def build(self, inputs_shape=None):
        hidden = (None, None, self.hidden_dim)
        self.source_token_embedding.build((None, None))
        if not self.token_embedding.built:
            self.token_embedding.build((None, None))
        for layer in (self.encoder_position_embedding, self.decoder_position_embedding):
            if not layer.built:
                layer.build(hidden)
        for norm in (self.encoder_embedding_norm, self.decoder_embedding_norm):
            if norm is not None:
                norm.build(hidden)
        self.encoder.build(hidden)
        self.decoder.build(hidden, hidden)
        self.built = True

    # The forward pass.

    def _embed(self, ids, side, start_index=0, training=None):
        """The embedded `"source"` or `"target"` ids: token embedding (scaled
        by `sqrt(D)` if `scale_embeddings`) + positions from `start_index`,
        the embedding norm if any, dropout. `(B, T)` -> `(B, T, D)`."""
        if side == "source":
            table = self.source_token_embedding
            position, norm = self.encoder_position_embedding, self.encoder_embedding_norm
        else:
            table = self.token_embedding
            position, norm = self.decoder_position_embedding, self.decoder_embedding_norm
        x = table(ids)  # (B, T, D)
        if self.scale_embeddings:
            x = x * ops.cast(math.sqrt(self.hidden_dim), x.dtype)
        x = x + position(x, start_index=start_index)
        if norm is not None:
            x = norm(x)
        return self.embedding_dropout(x, training=training)

    def encode(self, encoder_token_ids, encoder_padding_mask=None, training=None):
        """The encoder output `(B, S, D)` and the source mask `(B, S)`."""
        if encoder_padding_mask is None:
            encoder_padding_mask = ops.not_equal(encoder_token_ids, self.pad_token_id)
        encoder_padding_mask = ops.cast(encoder_padding_mask, "bool")
        x = self._embed(encoder_token_ids, "source", training=training)
        x = self.encoder(x, padding_mask=encoder_padding_mask, training=training)
        return x, encoder_padding_mask

    def call(self, inputs: dict[str, Tensor], training: bool | None = None):
        source = inputs["encoder_token_ids"]
        target = inputs["decoder_token_ids"]
        encoded, source_mask = self.encode(
            source, inputs.get("encoder_padding_mask"), training=training
        )
        target_mask = inputs.get("decoder_padding_mask")
        if target_mask is None:
            target_mask = ops.not_equal(target, self.pad_token_id)
        x = self._embed(target, "target", training=training)
        x = self.decoder(
            x,
            encoded,
            decoder_padding_mask=ops.cast(target_mask, "bool"),
            encoder_padding_mask=source_mask,
            training=training,
        )
        return self.token_embedding(x, reverse=True)  # (B, T, V)

    def __call__(self, inputs, *args, **kwargs):
        if isinstance(inputs, dict):
            for name, vocabulary, length in (
                ("encoder_token_ids", self.source_vocabulary_size, self.max_source_length),
                ("decoder_token_ids", self.target_vocabulary_size, self.max_target_length),
            ):
                if name not in inputs:
                    raise ValueError(
                        f"`inputs` must hold {name!r}. Received: keys {sorted(inputs)}"
                    )
                # Checked where their values are known (numpy, eager tensors).
                ids = _validation.known_token_ids(name, inputs[name])
                if ids is not None:
                    length_name = "max_source_length" if name[0] == "e" else "max_target_length"
                    _validation.check_token_ids(name, ids, vocabulary, length, length_name)
        return super().__call__(inputs, *args, **kwargs)

    def generate(
        self, encoder_token_ids: Tensor | dict, max_new_tokens: int | None = None,
        start_token_id: int | list[int] | None = None, end_token_id: int | None = None,
        sampling: str = "auto", num_beams: int | None = None, length_penalty: float = 1.0,
        num_return_sequences: int = 1, temperature: float | None = None,
        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
        encoder_padding_mask: Tensor | None = None, return_scores: bool = False,
        strip_prompt: bool = False,
    ):
        """Translates: target tokens for each source, with the KV caches.

        The encoder runs once and each decoder block's cross-attention keys
        and values are computed once; the decoder's self-attention cache
        grows by one token per step. The loop is compiled once per shape
        and configuration, as `GPT.generate`'s. The pad id, which the
        decoder reads as padding, is never generated: the model's own full
        pass scores a returned sequence as `return_scores` says.

        Args:
            encoder_token_ids: int `(B, S)` sources, `S <= max_source_length`;
                or KerasHub's input dictionary (`"encoder_token_ids"`,
                `"decoder_token_ids"`, optionally `"encoder_padding_mask"`,
                `"decoder_padding_mask"`), each row's decoder prompt
                continued as `BartSeq2SeqLM.generate` without a
                preprocessor does: to the width of `decoder_token_ids`
                unless `max_new_tokens` is given; `{"decoder_token_ids",
                "decoder_padding_mask"}` back, the mask `True` through each
                row's end token.
            max_new_tokens: positive int; `len(start_token_id) +
                max_new_tokens` must not exceed `max_target_length`.
                Required with ids.
            start_token_id: the id the decoder starts from, or a list of ids
                (a decoder prompt, such as BART's `[</s>, <s>]`). Required
                with ids; a dictionary holds the decoder prompts.
            end_token_id: optional id that ends a hypothesis (`None`: every
                hypothesis runs `max_new_tokens`); not `pad_token_id`.
            sampling: `"greedy"`, `"beam"`, `"random"`, `"top_k"` or
                `"top_p"` (see `GPT.generate` for the sampling ones);
                `"auto"`, as in `GPT.generate`: the sampler given to
                `compile(sampler=...)`, else `"greedy"`.
            num_beams: positive int (default 4), the hypotheses beam search
                keeps per source.
            length_penalty: float; beam hypotheses (and the returned scores)
                rank by `sum log p / length ** length_penalty`, `length` the
                new tokens, the end token included (0: plain log-probability).
            num_return_sequences: positive int, at most `num_beams`: the best
                hypotheses returned per source (beam search).
            temperature: for the sampling ones, as in `GPT.generate`.
            top_k: for `"top_k"`, as in `GPT.generate`.
            top_p: for `"top_p"`, as in `GPT.generate`.
            seed: optional int, for the sampling ones.
            encoder_padding_mask: optional bool `(B, S)`; by default the
                source positions that are not `pad_token_id`.
            return_scores: bool, also return the scores.
            strip_prompt: bool, KerasHub's: the new tokens only (ids `(B,
                max_new_tokens)`; a dictionary's decoder rows shifted left).

        Returns:
            int32 numpy `(B, P + max_new_tokens)`, `P` the start ids (`(B,
            num_return_sequences, P + max_new_tokens)` when
            `num_return_sequences > 1`; without the start ids with
            `strip_prompt`), `pad_token_id` after the end token; with
            `return_scores`, also float32 scores `(B,)` (or `(B,
            num_return_sequences)`). A dictionary for a dictionary.
        """
        sampling, temperature, top_k, top_p, seed, num_beams = self.sampling_arguments(
            sampling, temperature, top_k, top_p, seed, num_beams
        )
        options = dict(sampling=sampling, num_beams=num_beams, length_penalty=length_penalty,
                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if not self.built:
            self.build()
        if isinstance(encoder_token_ids, dict):
            _text_tasks.check_text_generation(
                start_token_id=(start_token_id, None), return_scores=(return_scores, False),
                encoder_padding_mask=(encoder_padding_mask, None),
                num_return_sequences=(num_return_sequences, 1),
            )
            return self._generate_packed(
                encoder_token_ids, max_new_tokens, end_token_id, strip_prompt, **options
            )
        source, mask = _generation_args.check_source(
            self, encoder_token_ids, encoder_padding_mask
        )
        _generation_args.require_with_ids(
            max_new_tokens=max_new_tokens, start_token_id=start_token_id
        )
        max_new_tokens = _validation.check_integer("max_new_tokens", max_new_tokens, 1)
        generator = self._get_generator()
        start_ids, end_token_id = _generation_args.check_start_and_end(
            generator, start_token_id, end_token_id, self.pad_token_id
        )
        prompt = np.tile(np.array(start_ids, "int32"), (source.shape[0], 1))  # (B, len(start))
        result = generator.run(
            prompt,
            max_new_tokens,
            num_return_sequences=num_return_sequences,
            return_scores=return_scores,
            stop_token_ids=None if end_token_id is None else [end_token_id],
            pad_token_id=self.pad_token_id,
            context=(source.astype("int32", copy=False), mask),
            **options,
        )
        if not strip_prompt:
            return result
        return _generation_args.strip_prompts(result, prompt, None, max_new_tokens)

    @classmethod
    def from_keras_hub(cls, backbone: Any, **kwargs: Any) -> "Seq2SeqTransformer":
        """A `Seq2SeqTransformer` holding a `keras_hub.models.BartBackbone`'s weights.

        BART is this model with learned positions, an embedding layer norm,
        exact GELU, one shared token table and unscaled embeddings; the
        logits equal `token_embedding(decoder_output, reverse=True)` of the
        backbone's output. Nothing is downloaded: pass a backbone built or
        loaded locally (a preset by name or folder: `from_preset`); a
        `keras_hub.models.BartSeq2SeqLM` gives its backbone.
        """
        backbone = _text.keras_hub_backbone(
            backbone, "backbone", "BartBackbone", "Seq2SeqTransformer"
        )
        model = cls(**_keras_hub.bart_arguments(backbone, kwargs))
        return _keras_hub.built_from(model, backbone, _keras_hub.bart_pairs)

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _CONFIG_NAMES})
        config["activation"] = self.decoder.block_arguments()["activation"]
        return config

