"""A GPT-style causal language model with cached, compiled generation.

Shape legend: `B` batch, `T` length, `P` prompt length, `V` vocabulary
size, `D` width (`hidden_dim`), `N` layers, `L` cache length, `G` key/value
heads, `K` head size.
"""

import numpy as np

import keras
from keras import ops

from keras_attention import _validation
from keras_attention.layers.token_and_position_embedding import (
    TokenAndPositionEmbedding,
)
from keras_attention.layers.transformer_decoder import TransformerDecoder
from keras_attention.models import _sampling
from keras_attention.models import _torch_decoding


@keras.saving.register_keras_serializable(package="keras_attention")
class GPT(keras.Model):
    """A decoder-only Transformer language model (GPT-2 by default).

    token ids -> token embedding + learned position embedding -> dropout ->
    `num_layers` pre-norm decoder blocks (causal self-attention, GELU
    feed-forward) -> final layer norm -> logits through the transposed token
    embedding (input and output embeddings tied, no output bias). Every
    position predicts the next token from the positions up to itself only.

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
        dropout: float in [0, 1), on the embeddings, the attention weights and
            each residual branch (GPT-2 trains with 0.1).
        activation: the feed-forward activation; GPT-2's is
            `"gelu_approximate"` (the tanh approximation).
        layer_norm_epsilon: positive float (GPT-2: 1e-5).
        num_key_value_heads: optional int dividing `num_heads`: grouped-query
            attention (not GPT-2).
        use_bias: bool, biases in the attention and feed-forward projections
            (GPT-2: True; nanoGPT's small configurations: False).
        initializer_range: positive float, the standard deviation of the
            normal initializer of every kernel and embedding (GPT-2: 0.02).
        seed: optional int, the seed of the dropout layers.
        **kwargs: base `keras.Model` arguments (`name`, `dtype`, ...).

    Call arguments:
        token_ids: int `(B, T)`, `T <= max_sequence_length`.
        padding_mask: optional bool `(B, T)`, `True` for real tokens.
        training: bool, whether dropout is active.

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

    References:
        - [Radford et al., 2019 (GPT-2)](https://openai.com/research/better-language-models)
        - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
        - [Holtzman et al., 2020 (top-p sampling)](https://arxiv.org/abs/1904.09751)
    """

    def __init__(
        self,
        vocabulary_size,
        max_sequence_length,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        dropout=0.0,
        activation="gelu_approximate",
        layer_norm_epsilon=1e-5,
        num_key_value_heads=None,
        use_bias=True,
        initializer_range=0.02,
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check = _validation.check_positive_int
        self.vocabulary_size = check("vocabulary_size", vocabulary_size)
        self.max_sequence_length = check("max_sequence_length", max_sequence_length)
        self.num_layers = check("num_layers", num_layers)
        self.num_heads = check("num_heads", num_heads)
        self.hidden_dim = check("hidden_dim", hidden_dim)
        self.intermediate_dim = check("intermediate_dim", intermediate_dim)
        if hidden_dim % num_heads:
            raise ValueError(
                "`hidden_dim` must be divisible by `num_heads`. Received: "
                f"hidden_dim={hidden_dim}, num_heads={num_heads}"
            )
        self.dropout = _validation.check_rate("dropout", dropout)
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.num_key_value_heads = num_key_value_heads
        self.use_bias = bool(use_bias)
        if (
            isinstance(initializer_range, bool)
            or not isinstance(initializer_range, (int, float))
            or initializer_range <= 0
        ):
            raise ValueError(
                "`initializer_range` must be a positive float. Received: "
                f"initializer_range={initializer_range!r}"
            )
        self.initializer_range = float(initializer_range)
        self.seed = _validation.check_seed("seed", seed)

        # Embedding block.
        self.embedding = TokenAndPositionEmbedding(
            vocabulary_size,
            max_sequence_length,
            hidden_dim,
            tie_weights=True,
            embeddings_initializer=self._initializer(),
            position_initializer=self._initializer(),
            dtype=self.dtype_policy,
            name="embedding",
        )
        self.embedding_dropout = keras.layers.Dropout(
            dropout, seed=seed, dtype=self.dtype_policy, name="embedding_dropout"
        )
        # Decoder blocks, with the final layer norm of a pre-norm stack.
        self.decoder = TransformerDecoder(
            num_layers,
            intermediate_dim,
            num_heads,
            dropout=dropout,
            activation=activation,
            layer_norm_epsilon=layer_norm_epsilon,
            kernel_initializer=self._initializer(),
            normalize_first=True,
            num_key_value_heads=num_key_value_heads,
            use_bias=use_bias,
            seed=None if seed is None else seed + 1,
            dtype=self.dtype_policy,
            name="decoder",
        )
        self._generate_functions = {}

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
        if isinstance(token_ids, (np.ndarray, list, tuple)):
            self._check_ids("token_ids", np.asarray(token_ids))
        return super().__call__(token_ids, *args, **kwargs)

    def call(self, token_ids, padding_mask=None, training=None):
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
        """
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

    def _layer_cache_shape(self, batch_size, max_length):
        heads = self.num_key_value_heads or self.num_heads
        return (batch_size, 2, max_length, heads, self.hidden_dim // self.num_heads)

    def _empty_layer_caches(self, batch_size, max_length):
        """One zero cache `(B, 2, max_length, G, K)` per block, as a tuple."""
        shape = self._layer_cache_shape(batch_size, max_length)
        return tuple(ops.zeros(shape, self.compute_dtype) for _ in range(self.num_layers))

    def empty_cache(self, batch_size, max_length):
        """A zero KV cache `(B, N, 2, max_length, G, K)` for `call_with_cache`."""
        shape = self._layer_cache_shape(batch_size, max_length)
        return ops.zeros(shape[:1] + (self.num_layers,) + shape[1:], self.compute_dtype)

    def generate(
        self,
        prompt_ids,
        max_new_tokens,
        sampling="greedy",
        temperature=1.0,
        top_k=None,
        top_p=None,
        seed=None,
        stop_token_ids=None,
        prompt_padding_mask=None,
        pad_token_id=0,
    ):
        """Continues prompts token by token with the KV cache.

        The prompt is run once (prefill) and then one token per step reads and
        extends the cache: no step recomputes the prefix (a step's cost grows
        only with the keys and values it reads). The
        whole loop is compiled once per shape and sampling configuration
        (`jax.jit` on JAX, `tf.function` with XLA on TensorFlow; torch runs it
        eagerly without autograd, each step in plain torch operations).

        Args:
            prompt_ids: int `(B, P)` prompts.
            max_new_tokens: positive int, the tokens to add to each prompt.
            sampling: `"greedy"` (the most likely token), `"random"` (from
                `softmax(logits / temperature)`), `"top_k"` (from the `top_k`
                most likely) or `"top_p"` (from the smallest set of most likely
                tokens holding probability `top_p`).
            temperature: positive float; below 1 sharpens, above 1 flattens.
            top_k: positive int, for `"top_k"` (`top_k=1` is greedy).
            top_p: float in (0, 1], for `"top_p"` (a tiny value is greedy).
            seed: optional int; the same seed gives the same tokens.
            stop_token_ids: optional ids that end a row once generated; the
                positions after it are `pad_token_id`.
            prompt_padding_mask: optional bool `(B, P)` for prompts of
                different lengths: each row's prompt is its first `True`
                positions (right padding); its new tokens follow it.
            pad_token_id: int, the id written after a row has ended.

        Returns:
            int32 numpy array `(B, P + max_new_tokens)`: each prompt followed
            by its new tokens (then `pad_token_id` where a row ended early).
        """
        prompt = np.asarray(keras.ops.convert_to_numpy(prompt_ids))
        if prompt.ndim != 2 or prompt.shape[1] == 0:
            raise ValueError(
                "`prompt_ids` must have shape (batch, length) with length >= 1. "
                f"Received: prompt_ids with shape {prompt.shape}"
            )
        self._check_ids("prompt_ids", prompt)
        max_new_tokens = _validation.check_positive_int("max_new_tokens", max_new_tokens)
        batch, prompt_length = prompt.shape
        total = prompt_length + max_new_tokens
        if total > self.max_sequence_length:
            raise ValueError(
                "The prompt and the new tokens must fit in "
                f"max_sequence_length={self.max_sequence_length}. Received: "
                f"prompt length {prompt_length} + max_new_tokens={max_new_tokens} "
                f"= {total}"
            )
        if sampling not in _sampling.SAMPLING:
            raise ValueError(
                f"`sampling` must be one of {_sampling.SAMPLING}. Received: "
                f"sampling={sampling!r}"
            )
        if isinstance(temperature, bool) or not (
            isinstance(temperature, (int, float)) and temperature > 0
        ):
            raise ValueError(
                "`temperature` must be a positive float. Received: "
                f"temperature={temperature!r}"
            )
        if sampling == "top_k":
            top_k = _validation.check_positive_int("top_k", top_k)
        if sampling == "top_p" and not (
            isinstance(top_p, (int, float)) and 0 < top_p <= 1
        ):
            raise ValueError(
                f"`top_p` must be a float in (0, 1]. Received: top_p={top_p!r}"
            )
        stop = tuple(int(t) for t in (stop_token_ids or ()))
        for token in stop + (pad_token_id,):
            if not 0 <= token < self.vocabulary_size:
                raise ValueError(
                    "`stop_token_ids` and `pad_token_id` must be ids in "
                    f"[0, {self.vocabulary_size}). Received: {token}"
                )
        if prompt_padding_mask is None:
            lengths = np.full((batch,), prompt_length)
        else:
            mask = np.asarray(keras.ops.convert_to_numpy(prompt_padding_mask)).astype(bool)
            lengths = mask.sum(axis=1)
            if mask.shape != prompt.shape or not np.array_equal(
                mask, np.arange(prompt_length)[None] < lengths[:, None]
            ) or lengths.min() == 0:
                raise ValueError(
                    "`prompt_padding_mask` must have the shape of `prompt_ids` "
                    "and mark a non-empty prefix of each row (right padding). "
                    f"Received: a mask of shape {mask.shape}"
                )
        if seed is None:
            seed = int(np.random.randint(0, 2**31 - 1))
        seed = _validation.check_seed("seed", seed)

        ids = np.full((batch, total), pad_token_id, "int32")
        ids[:, :prompt_length] = prompt
        positions = np.arange(total)[None]
        in_prompt = positions < lengths[:, None]  # (B, total)
        limits = (lengths + max_new_tokens).astype("int32")  # (B,)
        start = int(lengths.min())
        if not self.built:
            self.build((None, None))
        function = self._generate_function(sampling, top_k, stop, pad_token_id, start)
        output = function(
            ids,
            in_prompt,
            limits,
            np.int32(seed),
            np.float32(temperature),
            np.float32(top_p if top_p is not None else 1.0),
        )
        return np.asarray(keras.ops.convert_to_numpy(output)).astype("int32")

    def _decode_loop(
        self, ids, in_prompt, limits, seed, temperature, top_p, *, sampling, top_k,
        stop, pad_token_id, start, step=None,
    ):
        """The decoding loop, in `keras.ops` (compiled by `_generate_function`).

        `step(token_ids, caches, index)` runs one token through the model
        (default: `_call_with_layer_caches`, the Keras layers).
        """
        step = step or self._call_with_layer_caches
        ids = ops.convert_to_tensor(ids, "int32")
        batch, total = ids.shape[0], ids.shape[1]
        # One cache per block, carried as a tuple: each step writes only its
        # new keys and values instead of re-stacking every block's cache.
        cache = self._empty_layer_caches(batch, total)
        logits, cache = self._call_with_layer_caches(ids[:, :start], cache, 0)
        next_logits = logits[:, -1]  # (B, V)
        done = ops.zeros((batch,), "bool")
        pad = ops.full((batch,), pad_token_id, "int32")
        stop_ids = ops.convert_to_tensor(list(stop), "int32") if stop else None

        def condition(i, ids, cache, next_logits, done):
            return ops.logical_and(i < total, ops.logical_not(ops.all(done)))

        def body(i, ids, cache, next_logits, done):
            sampled = _sampling.next_token(
                next_logits, sampling, temperature, top_k, top_p, seed, i
            )  # (B,)
            given = ops.take(ids, i, axis=1)  # (B,) prompt token or padding
            from_prompt = ops.take(in_prompt, i, axis=1)  # (B,)
            token = ops.where(from_prompt, given, sampled)
            finished = ops.logical_or(done, i >= limits)
            token = ops.where(finished, pad, token)
            if stop_ids is not None:
                stopped = ops.any(token[:, None] == stop_ids[None, :], axis=-1)
                stopped = ops.logical_and(stopped, ops.logical_not(from_prompt))
                finished = ops.logical_or(finished, stopped)
            done = ops.logical_or(finished, i + 1 >= limits)
            ids = ops.slice_update(ids, (0, i), token[:, None])
            logits, cache = step(token[:, None], cache, i)
            return i + 1, ids, cache, logits[:, -1], done

        i = ops.convert_to_tensor(start, "int32")
        _, ids, _, _, _ = ops.while_loop(
            condition, body, (i, ids, cache, next_logits, done)
        )
        return ids

    def _generate_function(self, sampling, top_k, stop, pad_token_id, start):
        """The compiled loop for one sampling configuration, made once."""
        key = (sampling, top_k, stop, pad_token_id, start)
        if key in self._generate_functions:
            return self._generate_functions[key]
        options = dict(
            sampling=sampling, top_k=top_k, stop=stop, pad_token_id=pad_token_id,
            start=start,
        )
        backend = keras.backend.backend()
        if backend == "jax":
            import jax

            variables = list(self.variables)

            def stateless(values, *args):
                mapping = list(zip(variables, values))
                with keras.StatelessScope(state_mapping=mapping):
                    return self._decode_loop(*args, **options)

            jitted = jax.jit(stateless)

            def function(*args):
                return jitted([v.value for v in variables], *args)

        elif backend == "tensorflow":
            import tensorflow as tf

            # XLA fuses a step's few hundred small ops: without it the graph
            # executor's per-op overhead is most of a step on a CPU.
            function = tf.function(
                lambda *args: self._decode_loop(*args, **options), jit_compile=True
            )
        else:
            import torch

            def function(*args):
                with torch.no_grad():
                    args = [ops.convert_to_tensor(a) for a in args]
                    # Eager steps through the layers are mostly Keras's call
                    # machinery: the same arithmetic in torch, where it can.
                    step = _torch_decoding.step_for(self)
                    return self._decode_loop(*args, step=step, **options)

        self._generate_functions[key] = function
        return function

    def _check_ids(self, name, ids):
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocabulary_size):
            bad = ids[(ids < 0) | (ids >= self.vocabulary_size)][0]
            raise ValueError(
                f"`{name}` must hold ids in [0, {self.vocabulary_size}). "
                f"Received: an id {int(bad)}"
            )
        if ids.ndim == 2 and ids.shape[1] > self.max_sequence_length:
            raise ValueError(
                f"`{name}` is longer than max_sequence_length="
                f"{self.max_sequence_length}. Received: length {ids.shape[1]}"
            )

    @classmethod
    def from_keras_hub(cls, backbone, **kwargs):
        """A `GPT` holding the weights of a `keras_hub.models.GPT2Backbone`.

        Nothing is downloaded: pass a backbone built or loaded locally. The
        logits equal `hidden @ token_embedding^T` of the backbone's output.

        Args:
            backbone: a `keras_hub.models.GPT2Backbone`.
            **kwargs: other `GPT` arguments (e.g. `dtype`).

        Returns:
            A built `GPT` with copies of the weights.
        """
        config = backbone.get_config()
        model = cls(
            vocabulary_size=config["vocabulary_size"],
            max_sequence_length=config["max_sequence_length"],
            num_layers=config["num_layers"],
            num_heads=config["num_heads"],
            hidden_dim=config["hidden_dim"],
            intermediate_dim=config["intermediate_dim"],
            dropout=config["dropout"],
            **kwargs,
        )
        model.build((None, None))
        pairs = [
            (model.embedding.token_embedding, backbone.token_embedding),
            (model.embedding.position_embedding, backbone.position_embedding),
            (model.decoder.output_layer_norm, backbone.layer_norm),
        ]
        for ours, theirs in zip(model.decoder.blocks, backbone.transformer_layers):
            attention = theirs._self_attention_layer
            pairs += [
                (ours.self_attention.query_dense, attention._query_dense),
                (ours.self_attention.key_dense, attention._key_dense),
                (ours.self_attention.value_dense, attention._value_dense),
                (ours.self_attention.output_dense, attention._output_dense),
                (ours.self_attention_layer_norm, theirs._self_attention_layer_norm),
                (ours.feedforward.intermediate_dense, theirs._feedforward_intermediate_dense),
                (ours.feedforward.output_dense, theirs._feedforward_output_dense),
                (ours.feedforward_layer_norm, theirs._feedforward_layer_norm),
            ]
        for ours, theirs in pairs:
            ours.set_weights(theirs.get_weights())
        return model

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "max_sequence_length": self.max_sequence_length,
                "num_layers": self.num_layers,
                "num_heads": self.num_heads,
                "hidden_dim": self.hidden_dim,
                "intermediate_dim": self.intermediate_dim,
                "dropout": self.dropout,
                "activation": self.decoder.block_arguments()["activation"],
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "num_key_value_heads": self.num_key_value_heads,
                "use_bias": self.use_bias,
                "initializer_range": self.initializer_range,
                "seed": self.seed,
            }
        )
        return config
