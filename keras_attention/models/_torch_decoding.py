"""GPT's one-token decoding step as plain torch operations.

On torch a decoding step runs eagerly, and through the Keras layers most of
its time is the layer-call and op-dispatch machinery (every layer call binds
its arguments and opens scopes, every `keras.ops` call converts and checks
its inputs): for the `cpu` preset of examples/gpt_lm, about 22 ms per token,
against about 1.4 ms for the same arithmetic written in torch. `step_for`
returns that arithmetic for a `GPT` whose layers it can read: the same
weights (gathered at each `generate` call, so training between calls is
seen), the same cache layout `(B, 2, L, G, K)` per block, the same dtype
rules as the layers (kernels cast to the compute dtype, layer norm in
float32). For anything else (quantized or LoRA kernels, another norm) it
returns None and `generate` calls the Keras layers.

Shape legend: `B` batch, `D` width, `H` query heads, `G` key/value heads,
`K` head size, `V` vocabulary size, `L` cache length, `i` the step's position.
"""

import keras

from keras_attention.layers import _gemm


def step_for(model):
    """`step(token_ids, caches, index) -> (logits, caches)` or None.

    `token_ids` int `(B, 1)`, `caches` a tuple of per-block caches
    `(B, 2, L, G, K)` written in place at `index`, logits `(B, 1, V)`: the
    contract of `GPT._call_with_layer_caches` for one token.
    """
    if keras.backend.backend() != "torch" or not _readable(model):
        return None
    return _Step(model)


def _readable(model):
    embedding = model.embedding
    if embedding.token_embedding.quantization_mode is not None:
        return False
    if not embedding.tie_weights or embedding.position != "learned":
        return False
    if embedding.token_embedding.logit_soft_cap is not None:
        return False
    for block in model.decoder.blocks:
        attention, feedforward = block.self_attention, block.feedforward
        denses = [
            attention.query_dense,
            attention.key_dense,
            attention.value_dense,
            attention.output_dense,
            feedforward.intermediate_dense,
            feedforward.output_dense,
        ]
        if not all(_gemm.takes_linear(d) for d in denses):
            return False
        if (
            not block.normalize_first
            or block.normalization != "layer_norm"
            or feedforward.gated
            or attention.rotary_embedding is not None
            or attention.score.dot_product_scale(attention.key_dim) is None
            or attention._attention_recorder is not None
        ):
            return False
    return model.decoder.output_layer_norm is not None


class _Step:
    """The step of one `GPT`: weights gathered per `generate` call."""

    def __init__(self, model):
        import torch

        torch_dtype = getattr(torch, keras.backend.standardize_dtype(model.compute_dtype))

        def weight(variable):
            return variable.value.to(torch_dtype)

        def bias(dense):
            return None if dense.bias is None else weight(dense.bias)

        self.token_table = weight(model.embedding.token_embedding.embeddings)  # (V, D)
        self.position_table = weight(
            model.embedding.position_embedding.embeddings
        )  # (L, D)
        self.width = self.token_table.shape[1]
        self.blocks = []
        for block in model.decoder.blocks:
            attention, feedforward = block.self_attention, block.feedforward
            denses = (attention.query_dense, attention.key_dense, attention.value_dense)
            # One (3 widths, D) weight: a single GEMM gives q, k and v (the
            # only copy; the other kernels are used through transposed views).
            qkv_kernel = torch.cat(
                [weight(d.kernel).reshape(self.width, -1) for d in denses], dim=1
            ).T
            biases = [bias(d) for d in denses]
            qkv_bias = (
                None
                if biases[0] is None
                else torch.cat([b.reshape(-1) for b in biases])
            )
            self.blocks.append(
                dict(
                    norm1=_norm_weights(block.self_attention_layer_norm),
                    qkv=(qkv_kernel, qkv_bias),
                    splits=[d.kernel.shape[1] * d.kernel.shape[2] for d in denses],
                    heads=attention.num_heads,
                    kv_heads=attention._kv_heads,
                    groups=attention.num_heads // attention._kv_heads,
                    head_size=attention.key_dim,
                    value_size=attention._value_dim,
                    scale=attention.score.dot_product_scale(attention.key_dim),
                    output=(
                        weight(attention.output_dense.kernel)
                        .reshape(-1, self.width)  # (H K, D)
                        .T,
                        bias(attention.output_dense),
                    ),
                    norm2=_norm_weights(block.feedforward_layer_norm),
                    intermediate=(
                        weight(feedforward.intermediate_dense.kernel).T,
                        bias(feedforward.intermediate_dense),
                    ),
                    activation=feedforward.activation,
                    feedforward_output=(
                        weight(feedforward.output_dense.kernel).T,
                        bias(feedforward.output_dense),
                    ),
                )
            )
        self.final_norm = _norm_weights(model.decoder.output_layer_norm)

    def __call__(self, token_ids, caches, index):
        import torch
        import torch.nn.functional as F

        i = int(index)
        batch = token_ids.shape[0]
        x = F.embedding(token_ids, self.token_table) + self.position_table[i]  # (B, 1, D)
        for block, cache in zip(self.blocks, caches):
            h = _layer_norm(x, block["norm1"])
            q, k, v = torch.split(F.linear(h, *block["qkv"]), block["splits"], dim=-1)
            kv_shape = (batch, block["kv_heads"])
            cache[:, 0, i] = k.reshape(kv_shape + (block["head_size"],))  # (B, G, K)
            cache[:, 1, i] = v.reshape(kv_shape + (block["value_size"],))  # (B, G, K)
            q = q.reshape(batch, 1, block["heads"], block["head_size"])  # (B, 1, H, K)
            q = q.transpose(1, 2)  # (B, H, 1, K)
            keys = cache[:, 0, : i + 1].transpose(1, 2)  # (B, G, i + 1, K)
            values = cache[:, 1, : i + 1].transpose(1, 2)  # (B, G, i + 1, K)
            groups = block["groups"]
            if groups > 1:  # query head h reads key/value head h // groups
                keys = keys.repeat_interleave(groups, dim=1)  # (B, H, i + 1, K)
                values = values.repeat_interleave(groups, dim=1)
            attended = F.scaled_dot_product_attention(
                q, keys, values, scale=block["scale"]
            )  # (B, H, 1, K)
            attended = attended.transpose(1, 2).reshape(batch, 1, -1)  # (B, 1, H K)
            x = x + F.linear(attended, *block["output"])
            h = _layer_norm(x, block["norm2"])
            h = block["activation"](F.linear(h, *block["intermediate"]))
            x = x + F.linear(h, *block["feedforward_output"])
        x = _layer_norm(x, self.final_norm)
        return torch.matmul(x, self.token_table.T), caches  # (B, 1, V)


def _norm_weights(norm):
    gamma = None if norm.gamma is None else norm.gamma.value.float()
    beta = None if norm.beta is None else norm.beta.value.float()
    return gamma, beta, norm.epsilon


def _layer_norm(x, weights):
    """Keras's `LayerNormalization`: computed in float32, returned in `x`'s dtype."""
    import torch.nn.functional as F

    gamma, beta, epsilon = weights
    output = F.layer_norm(x.float(), (x.shape[-1],), gamma, beta, epsilon)
    return output.to(x.dtype)
