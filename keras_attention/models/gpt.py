"""A GPT-style causal language model with cached, compiled generation.

Shape legend: `B` batch, `T` length, `P` prompt length, `V` vocabulary
size, `D` width (`hidden_dim`), `N` layers, `L` cache length, `G` key/value
heads, `K` head size.
"""

import inspect
from typing import Any

import keras

from keras_attention import _docs
from keras_attention import _validation
from keras_attention import kv_cache
from keras_attention._typing import Activation
from keras_attention._typing import Tensor
from keras_attention.layers._dropout import Dropout
from keras_attention.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attention.layers.transformer_decoder import TransformerDecoderStack
from keras_attention.models import _generation_args
from keras_attention.models import _keras_hub
from keras_attention.models import _model_arguments
from keras_attention.models import _text
from keras_attention.models import _text_tasks
from keras_attention.models import generation
from keras_attention.models import layouts

POSITIONS = ("learned", "rotary")


def _arguments(
    vocabulary_size: int,
    max_sequence_length: int,
    num_layers: int,
    num_heads: int,
    hidden_dim: int,
    intermediate_dim: int,
    dropout: float = 0.0,
    activation: Activation = "gelu_approximate",
    layer_norm_epsilon: float = 1e-5,
    num_key_value_heads: int | None = None,
    use_bias: bool = True,
    normalization: str = "layer_norm",
    positions: str = "learned",
    rotary_max_wavelength: int = 10000,
    gated_feedforward: bool = False,
    tie_weights: bool = True,
    initializer_range: float = 0.02,
):
    """`GPT`'s own constructor arguments, before those every model ends
    with (`_model_arguments.ends_with`)."""


# The constructor arguments `get_config` saves as the attributes hold them
# (`activation` as the decoder's blocks hold it).
_CONFIG_NAMES = tuple(n for n in inspect.signature(_arguments).parameters if n != "activation")
_CONFIG_NAMES += ("attention_dropout", "seed")


@keras.saving.register_keras_serializable(package="keras_attention")
@_docs.completes
class GPT(_text_tasks.CausalTextModel, layouts.TensorParallel, keras.Model):
    """A decoder-only Transformer language model (GPT-2 by default, or LLaMA).

    token ids -> token embedding + learned position embedding -> dropout ->
    `num_layers` pre-norm decoder blocks (causal self-attention, GELU
    feed-forward) -> final layer norm -> logits through the transposed token
    embedding (input and output embeddings tied, no output bias). Every
    position predicts the next token from the positions up to itself only.

    LLaMA is a configuration of the same model: `normalization="rms_norm"`
    (RMS norms with a scale, no offset), `positions="rotary"` (no position
    table; queries and keys rotated by their positions in every attention
    layer), `gated_feedforward=True` with `activation="silu"` (SwiGLU),
    `use_bias=False`, `tie_weights=False` (a separate output projection,
    without bias), `layer_norm_epsilon=1e-6` and, from LLaMA 2 70B on,
    grouped-query attention (`num_key_value_heads`). A SwiGLU network has
    three kernels where GPT-2's has two: `intermediate_dim = 2/3 * 4 D` keeps
    the feed-forward cost of GPT-2's `4 D`.

    With `vocabulary_size=50257, max_sequence_length=1024, num_layers=12,
    num_heads=12, hidden_dim=768, intermediate_dim=3072` it is GPT-2 small,
    parameter for parameter (124,439,808 parameters), and
    `GPT.from_keras_hub(backbone)` takes over the weights of a
    `keras_hub.models.GPT2Backbone`.

    Args:
        vocabulary_size: positive int `V`.
        max_sequence_length: positive int, the longest sequence (the length
            of the position table).
        num_layers: positive int `N`.
        num_heads: positive int, attention heads per layer.
        hidden_dim: positive int `D`, divisible by `num_heads`.
        intermediate_dim: positive int, the feed-forward width.
        dropout: float in [0, 1), on the embeddings, the attention weights
            (unless `attention_dropout` is given) and each residual branch
            (GPT-2 trains with 0.1).
        activation: the feed-forward activation; GPT-2's is
            `"gelu_approximate"` (the tanh approximation).
        layer_norm_epsilon: positive float (GPT-2: 1e-5; LLaMA: 1e-6 or
            1e-5).
        num_key_value_heads: optional int dividing `num_heads`: grouped-query
            attention (not GPT-2).
        use_bias: bool, biases in the attention and feed-forward projections
            (GPT-2: True; nanoGPT's small configurations and LLaMA: False).
        normalization: `"layer_norm"` (GPT-2) or `"rms_norm"` (LLaMA), the
            norm before each sub-layer and after the last block.
        positions: `"learned"` (GPT-2: a position table added to the token
            embedding) or `"rotary"` (LLaMA: rotary position embeddings of
            the queries and keys in each self-attention layer, no table).
            Either way `max_sequence_length` bounds the sequences.
        rotary_max_wavelength: positive int, the base of the rotary
            wavelengths (with `positions="rotary"`; LLaMA: 10000).
        gated_feedforward: bool, a gated feed-forward network
            (`FeedForward(gated=True)`; with `activation="silu"` SwiGLU, as
            LLaMA) instead of GPT-2's plain one.
        tie_weights: bool, whether the logits use the transposed token
            embedding (GPT-2: True) or a separate `(D, V)` output kernel
            without bias (LLaMA: False).
        initializer_range: positive float, the standard deviation of the
            normal initializer of every kernel and embedding (GPT-2: 0.02).
        {model_attention_dropout_and_seed}
        **kwargs: base `keras.Model` arguments (`name`, `dtype`, ...).

    Call arguments:
        token_ids: int `(B, T)`, `T <= max_sequence_length`; or KerasHub's
            input dictionary `{"token_ids": ..., "padding_mask": ...}`.
        padding_mask: optional bool `(B, T)`, `True` for real tokens.
        training: bool, whether dropout is active.

    Text in, text out (`keras_attention.models._text_tasks.CausalTextModel`): with a
    KerasHub preprocessor in `model.preprocessor` (`GPT.from_preset` sets
    it), `generate` takes and returns strings. `compile()` without a loss
    compiles the from-logits cross-entropy.

    Returns:
        Logits `(B, T, V)`: position `t` scores the token at `t + 1`.

    Example:

    >>> import numpy as np
    >>> model = GPT(vocabulary_size=20, max_sequence_length=16, num_layers=2,
    ...             num_heads=2, hidden_dim=8, intermediate_dim=16)
    >>> tuple(model(np.array([[1, 2, 3]])).shape)
    (1, 3, 20)
    >>> tuple(model.generate(np.array([[1, 2, 3]]), max_new_tokens=4).shape)
    (1, 7)
    >>> llama = GPT(vocabulary_size=20, max_sequence_length=16, num_layers=2,
    ...             num_heads=4, hidden_dim=16, intermediate_dim=32,
    ...             num_key_value_heads=2, normalization="rms_norm",
    ...             positions="rotary", gated_feedforward=True,
    ...             activation="silu", use_bias=False, tie_weights=False,
    ...             layer_norm_epsilon=1e-6)
    >>> tuple(llama.generate(np.array([[1, 2, 3]]), max_new_tokens=4).shape)
    (1, 7)

    References:
        - [Radford et al., 2019 (GPT-2)](https://openai.com/research/better-language-models)
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
        - [Holtzman et al., 2020 (top-p sampling)](https://arxiv.org/abs/1904.09751)
        - [Touvron et al., 2023 (LLaMA)](https://arxiv.org/abs/2302.13971)
    """

    # The decoder stack; a subclass may name its own (blocks that override
    # `call`, attention layers that override `_compute_attention`): training,
    # inference and `generate` all run its layers.
    decoder_class = TransformerDecoderStack

    @_model_arguments.takes_arguments(_arguments)
    def __init__(
        self, vocabulary_size, max_sequence_length, num_layers, num_heads, hidden_dim,
        intermediate_dim, dropout, activation, layer_norm_epsilon, num_key_value_heads, use_bias,
        normalization, positions, rotary_max_wavelength, gated_feedforward, tie_weights,
        initializer_range, attention_dropout, seed, **kwargs,
    ):
        super().__init__(**kwargs)
        _model_arguments.store_sizes(
            self, num_heads, hidden_dim, intermediate_dim, dropout,
            vocabulary_size=vocabulary_size, max_sequence_length=max_sequence_length,
            num_layers=num_layers,
        )
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.num_key_value_heads = num_key_value_heads
        self.use_bias = bool(use_bias)
        self.positions = _validation.check_choice("positions", positions, POSITIONS)
        self.gated_feedforward = _validation.check_bool("gated_feedforward", gated_feedforward)
        self.tie_weights = _validation.check_bool("tie_weights", tie_weights)
        self.initializer_range = _validation.check_positive_float("initializer_range", initializer_range)
        self.attention_dropout = _validation.check_optional_rate("attention_dropout", attention_dropout)
        self.seed = _validation.check_seed("seed", seed)

        # Embedding block.
        self.embedding = TokenAndPositionEmbedding(
            vocabulary_size,
            max_sequence_length,
            hidden_dim,
            tie_weights=self.tie_weights,
            embeddings_initializer=self._initializer(),
            position="learned" if positions == "learned" else None,
            position_initializer=self._initializer(),
            dtype=self.dtype_policy,
            name="embedding",
        )
        self.embedding_dropout = Dropout(
            dropout, seed=seed, dtype=self.dtype_policy, name="embedding_dropout"
        )
        # Decoder blocks, with the final layer norm of a pre-norm stack.
        self.decoder = self.decoder_class(
            num_layers,
            intermediate_dim,
            num_heads,
            dropout=dropout,
            attention_dropout=self.attention_dropout,
            activation=activation,
            layer_norm_epsilon=layer_norm_epsilon,
            kernel_initializer=self._initializer(),
            normalize_first=True,
            num_key_value_heads=num_key_value_heads,
            use_bias=use_bias,
            normalization=normalization,
            use_rotary_embedding=positions == "rotary",
            rotary_max_wavelength=rotary_max_wavelength,
            gated_feedforward=self.gated_feedforward,
            seed=None if seed is None else seed + 1,
            dtype=self.dtype_policy,
            name="decoder",
        )
        arguments = self.decoder.arguments  # validated there
        self.normalization = arguments.normalization
        self.rotary_max_wavelength = arguments.rotary_max_wavelength
        self._generator = None  # made at the first `generate` call

    def _initializer(self):
        return keras.initializers.RandomNormal(stddev=self.initializer_range)

    def build(self, token_ids_shape):
        self.embedding.build(token_ids_shape)
        hidden_shape = tuple(token_ids_shape) + (self.hidden_dim,)
        self.decoder.build(hidden_shape)
        # GPT-2 (section 2.3) scales the initial weights of the projections
        # that write into the residual stream by 1 / sqrt(2 N): each of the
        # 2 N sub-layers adds to it, and the sum should not grow with depth.
        # Unseeded: a seeded initializer would give every kernel equal values.
        scaled = keras.initializers.RandomNormal(
            stddev=self.initializer_range / (2 * self.num_layers) ** 0.5
        )
        for block in self.decoder.blocks:
            for dense in (block.self_attention.output_dense, block.feedforward.output_dense):
                dense.kernel.assign(scaled(dense.kernel.shape, dense.kernel.dtype))
        self.built = True

    def __call__(self, token_ids, *args, **kwargs):
        if isinstance(token_ids, dict):
            token_ids, kwargs = _text.unpack_token_inputs(token_ids, kwargs, "GPT")
        # Checked where their values are known (numpy, eager tensors); inside
        # a compiled train step they are not, and an embedding lookup clamps.
        ids = _validation.known_token_ids("token_ids", token_ids)
        if ids is not None:
            self._check_ids("token_ids", ids)
        return super().__call__(token_ids, *args, **kwargs)

    def call(
        self,
        token_ids: Tensor | dict[str, Tensor],
        padding_mask: Tensor | None = None,
        training: bool | None = None,
    ):
        if isinstance(token_ids, dict):  # as `fit` hands it to a stateless call
            token_ids, padding_mask = token_ids["token_ids"], token_ids.get("padding_mask")
        x = self.embedding(token_ids)  # (B, T, D)
        x = self.embedding_dropout(x, training=training)
        x = self.decoder(x, decoder_padding_mask=padding_mask, training=training)
        return self.embedding(x, reverse=True)  # (B, T, V)

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """One cached forward pass: the logits of `token_ids` at their positions.

        Args:
            token_ids: int `(B, T)`, the tokens at positions
                `cache_update_index .. cache_update_index + T - 1`.
            cache: `(B, N, 2, L, G, K)`, from `empty_cache`.
            cache_update_index: int or scalar int tensor.

        Returns:
            `(logits, cache)`: logits `(B, T, V)` and the updated cache.

        Raises:
            ValueError: for a cache of another shape than `empty_cache`'s, or
                an index that is not an integer or (where its value is known)
                out of the cache's range.
        """
        kv_cache.check_stacked(cache, self.num_layers, "cache")
        kv_cache.check_index(
            cache_update_index, token_ids.shape[1], kv_cache.stacked_length(cache)
        )
        x = self.embedding(token_ids, start_index=cache_update_index)  # (B, T, D)
        x, cache = self.decoder(
            x,
            self_attention_cache=cache,
            self_attention_cache_update_index=cache_update_index,
        )
        return self.embedding(x, reverse=True), cache  # (B, T, V)

    def _call_with_layer_caches(self, token_ids, caches, cache_update_index):
        """`call_with_cache` with a tuple of per-block caches `(B, 2, L, G, K)`."""
        x = self.embedding(token_ids, start_index=cache_update_index)  # (B, T, D)
        x, caches = self.decoder.call_with_layer_caches(
            x, list(caches), cache_update_index
        )
        return self.embedding(x, reverse=True), tuple(caches)  # (B, T, V)

    def _empty_layer_caches(self, batch_size, max_length):
        """One zero cache `(B, 2, max_length, G, K)` per block, as a tuple."""
        heads = self.num_key_value_heads or self.num_heads
        head_size = self.hidden_dim // self.num_heads
        return tuple(
            kv_cache.empty(batch_size, max_length, heads, head_size, self.compute_dtype)
            for _ in range(self.num_layers)
        )

    def empty_cache(self, batch_size, max_length):
        """A zero KV cache `(B, N, 2, max_length, G, K)` for `call_with_cache`."""
        return kv_cache.stack(self._empty_layer_caches(batch_size, max_length))

    def generate(
        self,
        prompt_ids: Tensor | str | list[str],
        max_new_tokens: int | None = None,
        sampling: str = "auto",
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        prompt_padding_mask: Tensor | None = None,
        pad_token_id: int = 0,
        max_length: int | None = None,
        num_beams: int | None = None,
        length_penalty: float = 1.0,
        num_return_sequences: int = 1,
        return_scores: bool = False,
        strip_prompt: bool = False,
    ):
        """Continues prompts token by token with the KV cache.

        The prompt is run once (prefill) and then one token per step reads and
        extends the cache: no step recomputes the prefix (a step's cost grows
        only with the keys and values it reads). The whole loop is compiled
        once per shape and sampling configuration (`jax.jit` on JAX,
        `tf.function` with XLA on TensorFlow; torch runs it eagerly without
        autograd). Each step is the model's own layers, so a subclass's
        override of a block's or an attention layer's call takes effect
        here too. The loop is the package's generation core
        (`keras_attention.models.generation`).

        Args:
            prompt_ids: int `(B, P)` prompts; KerasHub's input dictionary
                (a dictionary back, by default to its width, as KerasHub's);
                or, with a `preprocessor`, text (text back, rows ending at
                the tokenizer's end token).
            max_new_tokens: positive int, the tokens to add to each prompt.
                Give this or `max_length`.
            sampling: `"greedy"` (the most likely token), `"random"` (from
                `softmax(logits / temperature)`), `"top_k"` (from the `top_k`
                most likely), `"top_p"` (from the smallest set of most likely
                tokens holding probability `top_p`) or `"beam"` (beam search:
                the `num_beams` most likely continuations are kept at each
                step; the prompt runs once per row, then each step runs the
                row's `num_beams` hypotheses as a batch). `"auto"`: the
                sampler given to `compile(sampler=...)`, else `"greedy"`.
            temperature: positive float (default 1.0, or the sampler's).
            top_k: positive int, for `"top_k"` (`top_k=1` is greedy).
            top_p: float in (0, 1], for `"top_p"` (a tiny value is greedy).
            seed: optional int; the same seed gives the same tokens.
            stop_token_ids: optional ids that end a row (a beam hypothesis)
                once generated, the positions after it `pad_token_id`;
                `"auto"`: the preprocessor's end token, as KerasHub's.
            prompt_padding_mask: optional bool `(B, P)` for prompts of
                different lengths: each row's prompt is its first `True`
                positions (right padding); its new tokens follow it (in beam
                search too).
            pad_token_id: int, the id written after a row has ended.
            max_length: int, KerasHub's meaning: the output's length, prompt
                included (`max_new_tokens = max_length - P`). For text without
                either, the preprocessor's `sequence_length`.
            num_beams: positive int (default 4), the hypotheses per row.
            length_penalty: float; beam hypotheses (and the returned scores)
                rank by `sum log p / length ** length_penalty`, the sum over
                the new tokens and `length` their number, a stop token
                included (0: the plain log-probability; above 0 favours
                longer hypotheses, which only arise with `stop_token_ids`).
            num_return_sequences: positive int, at most `num_beams` with
                beam search (1 otherwise): the best hypotheses per row.
            return_scores: bool, also return each sequence's score: the
                log-probability of its new tokens over `length **
                length_penalty` as above.
            strip_prompt: bool, KerasHub's: the new tokens only, each row's
                from the end of its own prompt (`(B, max_new_tokens)` for
                ids; text, the continuation; a dictionary, shifted left).

        Returns:
            int32 numpy array `(B, P + max_new_tokens)`: each prompt followed
            by its new tokens (then `pad_token_id` where a row ended early);
            `(B, num_return_sequences, P + max_new_tokens)`, best first, when
            `num_return_sequences > 1`. With `return_scores`, a tuple of that
            and float32 scores `(B,)` (or `(B, num_return_sequences)`).
            For text, a string (or a list of strings).
        """
        sampling, temperature, top_k, top_p, seed, num_beams = self.sampling_arguments(
            sampling, temperature, top_k, top_p, seed, num_beams
        )
        stop_token_ids = self.stop_token_arguments(stop_token_ids)
        if _text.is_text(prompt_ids) or isinstance(prompt_ids, dict):
            return _text_tasks.generate_inputs(
                self, prompt_ids, max_new_tokens, max_length, sampling=sampling,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                stop_token_ids=stop_token_ids, num_beams=num_beams, length_penalty=length_penalty,
                prompt_padding_mask=prompt_padding_mask, pad_token_id=pad_token_id,
                num_return_sequences=num_return_sequences, return_scores=return_scores,
                strip_prompt=strip_prompt,
            )
        prompt, prompt_padding_mask = _generation_args.check_prompt(
            self, prompt_ids, prompt_padding_mask
        )
        max_new_tokens = _text.new_token_count(max_new_tokens, max_length, prompt.shape[1])
        max_new_tokens = _validation.check_integer("max_new_tokens", max_new_tokens, 1)
        stop_token_ids = _validation.check_token_id_list(
            "stop_token_ids", stop_token_ids, self.vocabulary_size
        )
        pad_token_id = _validation.check_token_id(
            "pad_token_id", pad_token_id, self.vocabulary_size
        )
        if not self.built:
            self.build((None, None))
        generator = generation.model_generator(
            self, self._call_with_layer_caches, self._empty_layer_caches, self.vocabulary_size
        )
        result = generator.run(
            prompt, max_new_tokens, sampling=sampling, temperature=temperature, top_k=top_k,
            top_p=top_p, seed=seed, stop_token_ids=stop_token_ids,
            prompt_padding_mask=prompt_padding_mask, pad_token_id=pad_token_id,
            num_beams=num_beams, length_penalty=length_penalty,
            num_return_sequences=num_return_sequences, return_scores=return_scores,
        )
        if not strip_prompt:
            return result
        return _generation_args.strip_prompts(result, prompt, prompt_padding_mask, max_new_tokens)

    def _check_ids(self, name, ids):
        _validation.check_token_ids(
            name, ids, self.vocabulary_size, self.max_sequence_length,
            "max_sequence_length",
        )

    @classmethod
    def from_keras_hub(
        cls, backbone: Any, max_sequence_length: int | None = None, **kwargs: Any
    ) -> "GPT":
        """A `GPT` holding the weights of a KerasHub GPT-2 or LLaMA backbone.

        Nothing is downloaded: pass a backbone built or loaded locally. The
        logits equal `backbone.token_embedding(hidden, reverse=True)` of the
        backbone's output `hidden` (for GPT-2, `hidden @ token_embedding^T`).
        A `LlamaBackbone` gives the LLaMA configuration (see the class
        docstring), untied or tied as the backbone is.

        Args:
            backbone: a `keras_hub.models.GPT2Backbone` or
                `keras_hub.models.LlamaBackbone` (Llama 3's included, without
                rotary scaling), or a KerasHub task holding one (its
                `backbone` is taken). A preset name is `GPT.from_preset`'s.
            max_sequence_length: optional positive int. A GPT-2 backbone's
                position table fixes it; for a LLaMA backbone (no table) it
                bounds the sequences, 4096 by default.
            **kwargs: other `GPT` arguments (e.g. `dtype`).

        Returns:
            A built `GPT` with copies of the weights.

        Raises:
            ValueError: for anything but those two backbones, or a LLaMA
                backbone with scaled rotary positions.
        """
        backbone = _text.keras_hub_backbone(
            backbone, "backbone", ("GPT2Backbone", "LlamaBackbone"), "GPT"
        )
        arguments = _keras_hub.gpt_arguments(backbone, max_sequence_length)
        model = cls(**arguments, **kwargs)
        return _keras_hub.built_from(model, backbone, _keras_hub.gpt_pairs, (None, None))

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _CONFIG_NAMES})
        config["activation"] = self.decoder.block_arguments()["activation"]
        return config
