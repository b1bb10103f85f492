"""Projections: a layer's kernel as one GEMM where the backend prefers it.

Shape legend: `B` batch, `T` length, `D` input width, `N` output width, `H`
query heads, `G` key/value heads, `K` key head size, `V` value head size.

Keras's `Dense` and `EinsumDense` compute `x @ kernel` and then add the bias
in a second pass. Where the backend prefers (`Preferences.linear_projections`:
torch, whose `linear` adds the bias inside the GEMM and skips the layer-call
machinery, most of the cost of a small eager decoding step; JAX and
TensorFlow, whose compiled training steps ran faster with the plain matmul
than with the einsum), a projection with a plain kernel runs as one
`backend.linear` call.
"""

import keras
from keras import ops

from keras_attention import _keras_objects
from keras_attention import backend


def plain(dense):
    """Whether `dense`'s kernel is a plain weight (not quantized, no LoRA),
    which a projection may read directly; otherwise the projection is the
    sublayer's own call."""
    return dense.quantization_mode is None and not dense.lora_enabled


def takes_linear(dense):
    """Whether `dense` is better called as one `backend.linear`."""
    return backend.preferences().linear_projections and plain(dense)


def dense_call(dense, x):
    """`dense(x)` for a built `keras.layers.Dense` without activation."""
    if not takes_linear(dense):
        return dense(x)
    return backend.dense(x, dense.kernel, dense.bias, dtype=dense.compute_dtype)


def project(dense, x, merge_heads=False):
    """An attention projection (`EinsumDense` to or from heads).

    `(B, T, D) -> (B, T, heads, size)`, or with `merge_heads`
    `(B, T, H, V) -> (B, T, *O)` (the output projection). The dense's
    activation (the gate's sigmoid) is applied as the layer applies it.
    """
    if not takes_linear(dense):
        return dense(x)
    output = backend.dense(
        x, dense.kernel, dense.bias, inputs=2 if merge_heads else 1,
        dtype=dense.compute_dtype,
    )  # (B, T, heads, size) or (B, T, *O)
    if dense.activation is not keras.activations.linear:
        output = dense.activation(output)
    return output


def project_self(query_dense, key_dense, value_dense, x):
    """Self-attention's Q, K and V as one `(D, HK + GK + GV)` matmul.

    One large matmul instead of three smaller ones reads `x` once and fills
    the machine better; the kernels stay three weights (Keras's layout) and
    are concatenated on the fly, which costs `O(D N)` next to the matmul's
    `O(B T D N)`.

    Returns:
        `q` `(B, T, H, K)`, `k` `(B, T, G, K)`, `v` `(B, T, G, V)`.
    """
    denses = (query_dense, key_dense, value_dense)
    width = x.shape[-1]
    kernel = ops.concatenate(
        [ops.reshape(d.kernel, (width, -1)) for d in denses], axis=1
    )  # (D, N)
    bias = None
    if query_dense.bias is not None:
        bias = ops.concatenate([ops.reshape(d.bias, (-1,)) for d in denses])
    x = ops.convert_to_tensor(x, query_dense.compute_dtype)
    qkv = backend.linear(x, kernel, bias)  # (B, T, N)
    sizes = [d.kernel.shape[1] * d.kernel.shape[2] for d in denses]
    q, k, v = ops.split(qkv, [sizes[0], sizes[0] + sizes[1]], axis=-1)
    batch, length = ops.shape(x)[0], ops.shape(x)[1]
    return tuple(
        ops.reshape(t, (batch, length) + tuple(d.kernel.shape[1:]))
        for t, d in zip((q, k, v), denses)
    )  # (B, T, H, K), (B, T, G, K), (B, T, G, V)


def fusable(denses, width):
    """Whether the kernels can be concatenated (plain, reading `width`)."""
    return all(plain(d) and d.kernel.shape[0] == width for d in denses)


def einsum_dense(layer, equation, output_shape, bias_axes, name, activation=None):
    """An attention projection of `layer`, with its initializers (fresh
    instances, so that no two kernels start equal), regularizers,
    constraints, bias switch and dtype policy."""
    initializers = {
        key: _keras_objects.copy_initializer(getattr(layer, key))
        for key in ("kernel_initializer", "bias_initializer")
    }
    dense = keras.layers.EinsumDense(
        equation,
        output_shape=output_shape,
        bias_axes=bias_axes if layer.use_bias else None,
        kernel_regularizer=layer.kernel_regularizer,
        bias_regularizer=layer.bias_regularizer,
        kernel_constraint=layer.kernel_constraint,
        bias_constraint=layer.bias_constraint,
        activation=activation,
        dtype=layer.dtype_policy,
        name=name,
        **initializers,
    )
    # The projections are position-wise, so a padding mask carries over;
    # without this, Keras warns on every call with a masked input that the
    # projection "destroys the mask".
    dense.supports_masking = True
    return dense


def convert_self_attention_inputs(layer, query, value, args, kwargs):
    """`layer(x, x)` with a numpy `x`, converted once.

    Keras converts each argument on its own, so the same array would reach
    `call` as two tensors and miss the fused self-attention projection. (A
    numpy array carries no Keras mask to keep.) Returns `(query, value, args,
    kwargs)` for `Layer.__call__`.
    """
    key = kwargs.get("key", args[0] if args else None)
    if (
        value is not query
        or (key is not None and key is not query)
        or ops.is_tensor(query)
        or isinstance(query, keras.KerasTensor)
    ):
        return query, value, args, kwargs
    query = value = layer.dtype_policy.convert_input(
        query, layer.autocast, layer.input_dtype
    )
    if key is not None:
        if "key" in kwargs:
            kwargs["key"] = query
        else:
            args = (query,) + tuple(args[1:])
    return query, value, args, kwargs


def attention_projections(layer, query_width, value_width, key_width):
    """Multi-head attention's projections, built, in Keras's layout.

    Query `(D, H, K)`, key `(D, G, K)`, value `(D, G, V)`, output
    `(H, V, *O)` kernels and, with `layer.use_gate`, the gate `(D, H, V)`
    (a sigmoid of the query), as `keras.layers.MultiHeadAttention` has them,
    so weights move between the two unchanged. They are built for
    `(B, T, D)` inputs; the layer brings other ranks to that form first.

    Returns:
        `(query, key, gate, value, output)` denses (`gate` None without a
        gate), in the order Keras creates them (so `get_weights` lists the
        weights in Keras's order).
    """
    heads, kv_heads = layer.num_heads, layer.num_key_value_heads or layer.num_heads
    key_dim, value_dim = layer.key_dim, layer.value_dim or layer.key_dim
    output_shape = layer.output_shape or (query_width,)
    # Output letters after the ones the heads use (b, t, h, v).
    letters = "nopqrsuwxyz"[: len(output_shape)]
    specs = [
        ("btd,dhk->bthk", (None, heads, key_dim), "hk", "query", query_width, None),
        ("bsd,dgk->bsgk", (None, kv_heads, key_dim), "gk", "key", key_width, None),
        ("btd,dhv->bthv", (None, heads, value_dim), "hv", "gate", query_width, "sigmoid"),
        ("bsd,dgv->bsgv", (None, kv_heads, value_dim), "gv", "value", value_width, None),
        (
            f"bthv,hv{letters}->bt{letters}", (None,) + tuple(output_shape), letters,
            "attention_output", None, None,
        ),
    ]
    denses = []
    for equation, output, bias_axes, name, width, activation in specs:
        if name == "gate" and not layer.use_gate:
            denses.append(None)
            continue
        dense = einsum_dense(layer, equation, output, bias_axes, name, activation)
        input_shape = (None, None, width) if width else (None, None, heads, value_dim)
        dense.build(input_shape)
        denses.append(dense)
    return tuple(denses)
