"""What the encoder and decoder blocks and stacks share.

Shape legend: `B` batch, `T` (decoder) length, `S` encoder length, `D` model
width (`hidden_dim`), `H` heads, `K` head size.

- `BlockArguments`: the block arguments, validated once, serialized, and the
  factories of the sublayers a block is made of. A block holds one; a stack
  holds one and hands it to each of its blocks.
- `TransformerBlock`: the base of the two blocks (the residual sub-layer).
- `TransformerStack`: the base of the two stacks (N blocks, a final norm).
"""

import inspect
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_attention import _keras_objects
from keras_attention import _validation
from keras_attention import activations
from keras_attention import masking
from keras_attention import scoring
from keras_attention.layers._direct_calls import DirectCalls
from keras_attention.layers._dropout import Dropout
from keras_attention.layers.feed_forward import FeedForward
from keras_attention.layers.layer_normalization import LayerNormalization
from keras_attention.layers.multi_head_attention import MultiHeadAttention
from keras_attention.layers.rms_normalization import RMSNormalization
from keras_attention.layers.rotary_embedding import RotaryEmbedding


NORMALIZATIONS = ("layer_norm", "rms_norm")


class BlockArguments:
    """The arguments of a Transformer block (`TransformerEncoderBlock`'s
    docstring says what each means), validated, with the sublayer factories.

    A plain object, not a layer: it holds no weights, and Keras does not
    track it.
    """

    def __init__(
        self,
        intermediate_dim,
        num_heads,
        dropout=0.0,
        activation="relu",
        layer_norm_epsilon=1e-5,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        normalize_first=False,
        key_dim=None,
        num_key_value_heads=None,
        score="scaled_dot",
        attention_dropout=None,
        feedforward_dropout=0.0,
        gated_feedforward=False,
        normalization="layer_norm",
        use_rotary_embedding=False,
        rotary_max_wavelength=10000,
        use_bias=True,
        seed=None,
    ):
        check = _validation.check_positive_int
        self.intermediate_dim = check("intermediate_dim", intermediate_dim)
        self.num_heads = check("num_heads", num_heads)
        self.dropout = _validation.check_rate("dropout", dropout)
        # The package's resolver: it also knows "gelu_approximate" (GPT-2).
        self.activation = activations.get(activation)
        if (
            isinstance(layer_norm_epsilon, bool)
            or not isinstance(layer_norm_epsilon, (int, float))
            or layer_norm_epsilon <= 0
        ):
            raise ValueError(
                "`layer_norm_epsilon` must be a positive float. Received: "
                f"layer_norm_epsilon={layer_norm_epsilon!r}"
            )
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        _keras_objects.store(
            self, kernel_initializer=kernel_initializer, bias_initializer=bias_initializer
        )
        self.normalize_first = bool(normalize_first)
        self.key_dim = check("key_dim", key_dim, allow_none=True)
        self.num_key_value_heads = check(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        _validation.check_divisible(
            "num_heads", self.num_heads, "num_key_value_heads", self.num_key_value_heads
        )
        # Kept as a name or a config: each attention sublayer builds its own
        # scorer from it, so no two share weights. Unknown names fail here.
        scorer = scoring.get(score)
        self.score = score if isinstance(score, str) else scoring.serialize(scorer)
        self.attention_dropout = _validation.check_rate(
            "attention_dropout",
            self.dropout if attention_dropout is None else attention_dropout,
        )
        self.attention_dropout_given = attention_dropout is not None
        self.feedforward_dropout = _validation.check_rate(
            "feedforward_dropout", feedforward_dropout
        )
        self.gated_feedforward = bool(gated_feedforward)
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"`normalization` must be one of {NORMALIZATIONS}. Received: "
                f"normalization={normalization!r}"
            )
        self.normalization = normalization
        self.use_rotary_embedding = bool(use_rotary_embedding)
        self.rotary_max_wavelength = check("rotary_max_wavelength", rotary_max_wavelength)
        self.use_bias = bool(use_bias)
        self.seed = _validation.check_seed("seed", seed)

    @classmethod
    def names(cls):
        """The argument names, in order."""
        return tuple(inspect.signature(cls.__init__).parameters)[1:]

    @classmethod
    def split(cls, kwargs):
        """`(BlockArguments, rest)`: the block arguments among `kwargs` and
        the others (base layer arguments)."""
        names = cls.names()
        mine = {k: v for k, v in kwargs.items() if k in names}
        rest = {k: v for k, v in kwargs.items() if k not in names}
        return cls(**mine), rest

    def _arguments(self):
        arguments = {name: getattr(self, name) for name in self.names()}
        arguments["attention_dropout"] = (
            self.attention_dropout if self.attention_dropout_given else None
        )
        return arguments

    def config(self):
        """The arguments serialized (a block's or stack's config entries)."""
        config = self._arguments()
        config.update(
            _keras_objects.serialize(self, ("kernel_initializer", "bias_initializer")),
            activation=activations.serialize(self.activation),
        )
        return config

    def unserialized(self):
        """The arguments as a block's constructor takes them, not
        serialized: the activation as its function, each initializer a
        fresh copy of its own config (so each block's public attribute is
        its own, as when it was deserialized). Keras's serialization imports
        TensorFlow where it is installed (about 1.5 s), which a stack built
        on JAX or torch should not pay for its blocks."""
        arguments = self._arguments()
        arguments.update(
            kernel_initializer=_keras_objects.copy_initializer(self.kernel_initializer),
            bias_initializer=_keras_objects.copy_initializer(self.bias_initializer),
        )
        return arguments

    def apply_to(self, layer):
        """Sets each argument as a public attribute of `layer`, as Keras
        layers expose their constructor arguments."""
        for name in self.names():
            setattr(layer, name, getattr(self, name))

    # Sublayer factories.

    def seed_at(self, offset):
        return None if self.seed is None else self.seed + offset

    def head_size(self, hidden_dim):
        if self.key_dim is not None:
            return self.key_dim
        if hidden_dim is None or hidden_dim % self.num_heads:
            raise ValueError(
                "`hidden_dim` (the last dimension of the inputs) must be "
                "divisible by `num_heads` when `key_dim` is not given. "
                f"Received: hidden_dim={hidden_dim}, num_heads={self.num_heads}"
            )
        return hidden_dim // self.num_heads

    def initializers(self):
        # Fresh instances, so that no two kernels start equal.
        return {
            "kernel_initializer": _keras_objects.copy_initializer(self.kernel_initializer),
            "bias_initializer": _keras_objects.copy_initializer(self.bias_initializer),
        }

    def attention(self, hidden_dim, name, rotary, seed_offset, dtype):
        return MultiHeadAttention(
            num_heads=self.num_heads,
            key_dim=self.head_size(hidden_dim),
            dropout=self.attention_dropout,
            use_bias=self.use_bias,
            num_key_value_heads=self.num_key_value_heads,
            score=self.score,
            rotary_embedding=RotaryEmbedding(
                max_wavelength=self.rotary_max_wavelength,
                dtype=dtype,
                name=f"{name}_rotary_embedding",
            )
            if rotary
            else None,
            seed=self.seed_at(seed_offset),
            dtype=dtype,
            name=name,
            **self.initializers(),
        )

    def norm(self, name, dtype):
        if self.normalization == "rms_norm":
            return RMSNormalization(epsilon=self.layer_norm_epsilon, dtype=dtype, name=name)
        return LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=dtype, name=name
        )

    def residual_dropout(self, name, seed_offset, dtype):
        return Dropout(
            self.dropout, seed=self.seed_at(seed_offset), dtype=dtype, name=name
        )

    def feedforward(self, seed_offset, dtype):
        return FeedForward(
            self.intermediate_dim,
            activation=self.activation,
            dropout=self.feedforward_dropout,
            gated=self.gated_feedforward,
            use_bias=self.use_bias,
            seed=self.seed_at(seed_offset),
            dtype=dtype,
            name="feedforward",
            **self.initializers(),
        )


class TransformerBlock(DirectCalls, keras.layers.Layer):
    """Base of `TransformerEncoderBlock` and `TransformerDecoderBlock`.

    Takes the block arguments (`BlockArguments`) and the base layer's, and
    computes the residual sub-layer both blocks are made of. Not public: use
    one of the two blocks.
    """

    def __init__(self, intermediate_dim: int, num_heads: int, **kwargs: Any) -> None:
        arguments, rest = BlockArguments.split(
            dict(kwargs, intermediate_dim=intermediate_dim, num_heads=num_heads)
        )
        super().__init__(**rest)
        self.arguments = arguments
        arguments.apply_to(self)
        self.supports_masking = True

    def _attention(self, hidden_dim, name, rotary, seed_offset):
        return self.arguments.attention(
            hidden_dim, name, rotary, seed_offset, self.dtype_policy
        )

    def _norm(self, name):
        return self.arguments.norm(name, self.dtype_policy)

    def _dropout(self, name, seed_offset):
        return self.arguments.residual_dropout(name, seed_offset, self.dtype_policy)

    def _feedforward(self, seed_offset):
        return self.arguments.feedforward(seed_offset, self.dtype_policy)

    def _build_attention_sublayer(self, name, query_shape, value_shape, rotary, seed_offset):
        """Makes and builds the attention sub-layer `name` (`"self_attention"`
        or `"cross_attention"`) of `(B, T, D)` queries; `_build_sublayer`
        says which attributes it sets."""
        attention = self._attention(query_shape[-1], name, rotary, seed_offset)
        self._build_sublayer(name, attention, (query_shape, value_shape), seed_offset)

    def _build_feedforward_sublayer(self, shape, seed_offset):
        """Makes and builds the feed-forward sub-layer of `(B, T, D)` inputs."""
        self._build_sublayer("feedforward", self._feedforward(seed_offset), (shape,), seed_offset)

    def _build_sublayer(self, name, sublayer, shapes, seed_offset):
        """Sets the residual sub-layer `name` (KerasHub's names, also the
        layers' `name`): `sublayer` as `name`, built on `shapes`; its norm as
        `{name}_layer_norm`, built on the block's stream `shapes[0]`; its
        residual dropout as `{name}_residual_dropout`, seeded after
        `sublayer` (`seed_offset + 1`)."""
        setattr(self, name, sublayer)
        sublayer.build(*shapes)
        norm = self._norm(f"{name}_layer_norm")
        setattr(self, f"{name}_layer_norm", norm)
        norm.build(shapes[0])
        dropout = self._dropout(f"{name}_residual_dropout", seed_offset + 1)
        setattr(self, f"{name}_residual_dropout", dropout)

    def _sublayer(self, x, norm, dropout, fn, training, residual=None):
        """One residual sub-layer: post-norm `norm(x + f(x))` or pre-norm
        `x + f(norm(x))`, with dropout on `f`'s output. Returns the new `x`
        and whatever else `fn` returned. A `residual` other than `x` is what
        `f`'s output adds to, when `f` computes fewer rows than `x` has."""
        residual = x if residual is None else residual
        if self.normalize_first:
            x = norm(x)
        x, *extra = fn(x)
        if dropout.rate > 0:  # rate 0 is the identity: no layer call (eager cost)
            x = dropout(x, training=training)
        x = residual + x
        if not self.normalize_first:
            x = norm(x)
        return x, extra

    def _check_inputs(self, name, shape):
        _validation.check_rank(name, shape, 3)

    def block_arguments(self):
        """The constructor arguments of a block, serialized (no base-layer ones)."""
        return self.arguments.config()

    def get_config(self):
        config = super().get_config()
        config.update(self.block_arguments())
        return config


class TransformerStack(DirectCalls, keras.layers.Layer):
    """Base of `TransformerEncoderStack` and `TransformerDecoderStack`: N
    blocks of `block_class` made from one `BlockArguments`, then an optional
    norm."""

    block_class = None

    def __init__(
        self,
        num_layers: int,
        intermediate_dim: int,
        num_heads: int,
        final_layer_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        arguments, rest = BlockArguments.split(
            dict(kwargs, intermediate_dim=intermediate_dim, num_heads=num_heads)
        )
        super().__init__(**rest)
        self.arguments = arguments
        arguments.apply_to(self)
        self.num_layers = _validation.check_positive_int("num_layers", num_layers)
        if final_layer_norm is not None and not isinstance(final_layer_norm, bool):
            raise ValueError(
                "`final_layer_norm` must be None, True or False. Received: "
                f"final_layer_norm={final_layer_norm!r}"
            )
        self.final_layer_norm = final_layer_norm
        self.supports_masking = True

    @property
    def _has_final_norm(self):
        if self.final_layer_norm is None:
            return self.normalize_first
        return self.final_layer_norm

    def _check_inputs(self, name, shape):
        _validation.check_rank(name, shape, 3)

    def _build_blocks(self, *shapes):
        """Creates and builds the blocks (block `i` seeded `seed + 10 i`) and
        the final norm; `shapes` are the blocks' build arguments."""
        self.blocks = []
        for i in range(self.num_layers):
            block = self.block_class(
                **{**self.arguments.unserialized(), "seed": self.arguments.seed_at(10 * i)},
                dtype=self.dtype_policy,
                name=f"block_{i}",
            )
            block.build(*shapes)
            self.blocks.append(block)
        self.output_layer_norm = None
        if self._has_final_norm:
            self.output_layer_norm = self.arguments.norm(
                "output_layer_norm", self.dtype_policy
            )
            self.output_layer_norm.build(shapes[0])

    def block_arguments(self):
        """The arguments every block gets, serialized."""
        return self.arguments.config()

    def get_config(self):
        config = super().get_config()
        config.update(self.block_arguments())
        config.update(
            {"num_layers": self.num_layers, "final_layer_norm": self.final_layer_norm}
        )
        return config


def combined_padding_mask(
    sequence, padding_mask, name="padding_mask", sequence_name="inputs"
):
    """The explicit padding mask AND the Keras mask of `sequence`."""
    padding_mask = masking.standardize_mask(padding_mask, name, ranks=(2,))
    if padding_mask is not None:
        # Checked here, so that the message names the block's arguments
        # rather than those of the attention layer it reaches.
        for axis, what in ((0, "batch size"), (1, "length")):
            _validation.check_same_dim(
                name,
                padding_mask.shape[axis],
                sequence_name,
                sequence.shape[axis],
                what,
            )
    return masking.merge_masks(padding_mask, masking.implicit_mask(sequence))


def check_positions(positions, sequence, name="output_positions", sequence_name="inputs"):
    """`positions` as int32 `(B, M)` after checking its rank and batch size
    against `sequence` `(B, T, D)`, and for concrete (numpy) values that
    each is in `[0, T)`; `ValueError`s name the argument and the value."""
    if isinstance(positions, (list, tuple, np.ndarray)):
        positions = np.asarray(positions)
        length = sequence.shape[1]
        if not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(
                f"`{name}` must hold ints. Received: {name} of dtype {positions.dtype}"
            )
        _validation.check_positions(name, positions, length, sequence_name)
    _validation.check_rank(name, positions.shape, 2)
    _validation.check_same_dim(
        name, positions.shape[0], sequence_name, sequence.shape[0], "batch size"
    )
    return ops.cast(positions, "int32")


class ChecksOutputPositions:
    """Checks a layer's `output_positions` before Keras's `__call__` turns a
    numpy array into a tensor: only concrete values can be range-checked,
    and out of range, a gather would clamp them silently on JAX."""

    def __call__(self, inputs, *args, **kwargs):
        positions = kwargs.get("output_positions")
        if positions is not None:
            check_positions(positions, inputs)
        return super().__call__(inputs, *args, **kwargs)


def rows_at(x, positions, axis=1):
    """`x` at `positions` `(B, M)` (int) along `axis`: `(B, T, ...)` ->
    `(B, M, ...)` for `axis=1`. An `x` without the batch axis (`axis=0`,
    `(T, ...)`) gives `(B, M, ...)`; size-1 axes other than `axis`
    broadcast."""
    positions = ops.cast(positions, "int32")
    if axis == 0:
        return ops.take(x, positions, axis=0)
    # Indices (B, 1, ..., M, 1, ...): M on `axis`, every other axis broadcast.
    shape = [1] * len(x.shape)
    shape[0], shape[axis] = -1, positions.shape[1]
    if shape[axis] is None:
        shape[axis] = ops.shape(positions)[1]
    return ops.take_along_axis(x, ops.reshape(positions, shape), axis=axis)


def as_tuple(outputs):
    """A layer's outputs as a tuple (one tensor becomes a 1-tuple)."""
    return outputs if isinstance(outputs, tuple) else (outputs,)
