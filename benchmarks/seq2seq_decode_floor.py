"""Greedy translation on JAX against a loop written by hand, in one process.

`seq2seq_speed.py` times `Seq2SeqTransformer.generate` against KerasHub's
`BartSeq2SeqLM`. This script adds what the same translation costs without
Keras or the package, so that a ratio against KerasHub can be read against
the best one this machine allows (as `gpt_decode_floor.py` does for GPT):

- `floor`: greedy translation with the BART backbone's weights written
  directly in `jax.numpy` and compiled as one `jax.jit`: the encoder in one
  pass, the cross-attention keys and values of every decoder block computed
  once, then a `fori_loop` of one-token steps over self-attention caches of
  the whole length laid out for the products (`(B, H, L, K)`, no copies or
  transposes per step), one Q/K/V product a block with the kernels
  concatenated once, no source mask (every source token is real here), no
  masks beyond the positions not yet written, no guards; the weights are
  arguments;
- `ours`: `keras_attention.models.Seq2SeqTransformer.generate`, weights from
  the backbone with `Seq2SeqTransformer.from_keras_hub`;
- `keras_hub`: `BartSeq2SeqLM.generate` with the greedy sampler, no
  preprocessor.

All three must decode the same tokens (checked before timing). Sizes: those
of `seq2seq_speed.py` (2 + 2 blocks, 4 heads, width 128, feed-forward 256,
vocabulary 1,000, 20-token sources, 32 new tokens after BART's start token).
Medians of `--repeats` rounds, the three in turn within a round.

    python benchmarks/seq2seq_decode_floor.py        # --batches 1,4 --repeats 9
"""

import _floor

VOCABULARY = 1000
LAYERS, HEADS, WIDTH, FEEDFORWARD = 2, 4, 128, 256
MAX_LENGTH, SOURCE_LENGTH = 64, 20
BART_START, BART_PAD = 2, 1  # BART's decoder start token `</s>` and `<pad>`
EPSILON = 1e-5


def floor_translator(backbone, new_tokens):
    """`translate(source) -> tokens (B, 1 + new_tokens)`, numpy in and out:
    one jitted call of greedy translation with a KerasHub `BartBackbone`'s
    weights as arguments."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    head_size = WIDTH // HEADS
    total = 1 + new_tokens
    weights = {w.path: np.asarray(w.numpy()) for w in backbone.weights}

    def get(prefix, *names):
        return tuple(weights[f"{prefix}/{name}"] for name in names)

    def attention_params(prefix, fused_inputs):
        """The projections of the attention layer at `prefix`: the kernels
        named in `fused_inputs` as one `(D, n D)` product, the others apart."""
        kernels = {
            n: (get(prefix, f"{n}/kernel")[0].reshape(WIDTH, WIDTH),
                get(prefix, f"{n}/bias")[0].reshape(WIDTH))
            for n in ("query", "key", "value")
        }
        params = {
            "fused": (
                np.concatenate([kernels[n][0] for n in fused_inputs], axis=1),
                np.concatenate([kernels[n][1] for n in fused_inputs]),
            ),
            "output": (
                get(prefix, "attention_output/kernel")[0].reshape(WIDTH, WIDTH),
                get(prefix, "attention_output/bias")[0],
            ),
        }
        params.update({n: kernels[n] for n in ("query", "key", "value") if n not in fused_inputs})
        return params

    def encoder_block(i):
        prefix = f"transformer_encoder_layer_{i}"
        return {
            "attention": attention_params(
                f"{prefix}/self_attention_layer", ("query", "key", "value")
            ),
            "norm_1": get(f"{prefix}/self_attention_layer_norm", "gamma", "beta"),
            "up": get(f"{prefix}/feedforward_intermediate_dense", "kernel", "bias"),
            "down": get(f"{prefix}/feedforward_output_dense", "kernel", "bias"),
            "norm_2": get(f"{prefix}/feedforward_layer_norm", "gamma", "beta"),
        }

    def decoder_block(i):
        prefix = f"transformer_decoder_layer_{i}"
        return {
            "self": attention_params(f"{prefix}/self_attention", ("query", "key", "value")),
            "norm_1": get(f"{prefix}/self_attention_layer_norm", "gamma", "beta"),
            "cross": attention_params(f"{prefix}/cross_attention", ("key", "value")),
            "norm_2": get(f"{prefix}/cross_attention_layer_norm", "gamma", "beta"),
            "up": get(f"{prefix}/feedforward_intermediate_dense", "kernel", "bias"),
            "down": get(f"{prefix}/feedforward_output_dense", "kernel", "bias"),
            "norm_3": get(f"{prefix}/feedforward_layer_norm", "gamma", "beta"),
        }

    params = jax.tree.map(
        jnp.asarray,
        {
            "token": weights["token_embedding/embeddings"],
            "encoder_position": weights["encoder_position_embedding/embeddings"],
            "decoder_position": weights["decoder_position_embedding/embeddings"][:total],
            "encoder_norm": get("encoder_embeddings_layer_norm", "gamma", "beta"),
            "decoder_norm": get("decoder_embeddings_layer_norm", "gamma", "beta"),
            "encoder": [encoder_block(i) for i in range(LAYERS)],
            "decoder": [decoder_block(i) for i in range(LAYERS)],
        },
    )

    def layer_norm(x, gamma_beta):
        return _floor.layer_norm(x, gamma_beta, EPSILON)

    dense = _floor.dense

    def heads(x):
        """`(B, T, D)` -> `(B, H, T, K)`."""
        return x.reshape(x.shape[0], x.shape[1], HEADS, head_size).transpose(0, 2, 1, 3)

    def attend(q, keys, values, visible=None):
        """`q` `(B, H, T, K)` over `(B, H, S, K)`: `(B, T, D)`."""
        scores = jnp.einsum("bhtk,bhsk->bhts", q / np.sqrt(head_size), keys)
        if visible is not None:
            scores = jnp.where(visible, scores, -jnp.inf)
        attended = jnp.einsum("bhts,bhsk->bhtk", jax.nn.softmax(scores, axis=-1), values)
        return attended.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], WIDTH)

    def feedforward(x, block):
        return dense(jax.nn.gelu(dense(x, block["up"]), approximate=False), block["down"])

    def encode(params, source):
        """The encoder's output `(B, S, D)`."""
        x = params["token"][source] + params["encoder_position"][: source.shape[1]]
        x = layer_norm(x, params["encoder_norm"])
        for block in params["encoder"]:
            q, k, v = (heads(t) for t in jnp.split(dense(x, block["attention"]["fused"]), 3, -1))
            x = layer_norm(x + dense(attend(q, k, v), block["attention"]["output"]),
                           block["norm_1"])
            x = layer_norm(x + feedforward(x, block), block["norm_2"])
        return x

    @jax.jit
    def translate(params, source):
        batch = source.shape[0]
        encoded = encode(params, source)
        cross = [
            tuple(heads(t) for t in jnp.split(dense(encoded, b["cross"]["fused"]), 2, -1))
            for b in params["decoder"]
        ]  # per block (B, H, S, K) twice
        empty = jnp.zeros((batch, HEADS, total, head_size), "float32")
        caches = [(empty, empty) for _ in params["decoder"]]
        tokens = jnp.full((batch, total), BART_PAD, "int32").at[:, 0].set(BART_START)

        def step(i, state):
            tokens, caches = state
            y = params["token"][tokens[:, i]] + params["decoder_position"][i]  # (B, D)
            y = layer_norm(y[:, None], params["decoder_norm"])  # (B, 1, D)
            visible = (jnp.arange(total) <= i)[None, None, None]  # (1, 1, 1, L)
            new_caches = []
            for block, (key_cache, value_cache), (cross_k, cross_v) in zip(
                params["decoder"], caches, cross
            ):
                q, k, v = (heads(t) for t in jnp.split(dense(y, block["self"]["fused"]), 3, -1))
                key_cache = jax.lax.dynamic_update_slice(key_cache, k, (0, 0, i, 0))
                value_cache = jax.lax.dynamic_update_slice(value_cache, v, (0, 0, i, 0))
                attended = attend(q, key_cache, value_cache, visible)
                y = layer_norm(y + dense(attended, block["self"]["output"]), block["norm_1"])
                q = heads(dense(y, block["cross"]["query"]))
                attended = attend(q, cross_k, cross_v)
                y = layer_norm(y + dense(attended, block["cross"]["output"]), block["norm_2"])
                y = layer_norm(y + feedforward(y, block), block["norm_3"])
                new_caches.append((key_cache, value_cache))
            logits = y[:, 0] @ params["token"].T  # (B, V)
            tokens = tokens.at[:, i + 1].set(jnp.argmax(logits, axis=-1).astype("int32"))
            return tokens, new_caches

        tokens, _ = jax.lax.fori_loop(0, total - 1, step, (tokens, caches))
        return tokens

    return lambda source: np.asarray(translate(params, source))


def main():
    parser = _floor.argument_parser(__doc__)
    parser.add_argument("--batches", default="1,4", help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    batches = _floor.integer_list(parser, "--batches", args.batches, 1)
    if not 1 <= args.new_tokens < MAX_LENGTH:
        parser.error(f"--new-tokens must be from 1 to {MAX_LENGTH - 1}; received {args.new_tokens}")
    _floor.check_run(parser, args)

    import keras_hub
    import numpy as np

    from keras_attention.models import Seq2SeqTransformer

    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=VOCABULARY, num_layers=LAYERS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=FEEDFORWARD, dropout=0.0, max_sequence_length=MAX_LENGTH,
    )
    theirs = keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
    theirs.compile(sampler="greedy")
    ours = Seq2SeqTransformer.from_keras_hub(backbone)
    floor = floor_translator(backbone, args.new_tokens)
    new = args.new_tokens
    rng = np.random.default_rng(0)
    for batch in batches:
        # Ids from 3: no <s>, <pad> or </s> in the sources.
        source = rng.integers(3, VOCABULARY, (batch, SOURCE_LENGTH)).astype("int32")
        source_mask = np.ones_like(source, bool)
        decoder_ids = np.full((batch, 1 + new), BART_PAD, "int32")
        decoder_ids[:, 0] = BART_START
        their_inputs = {
            "encoder_token_ids": source,
            "encoder_padding_mask": source_mask,
            "decoder_token_ids": decoder_ids,
            "decoder_padding_mask": decoder_ids != BART_PAD,
        }
        runners = {
            "floor": lambda: floor(source),
            "ours": lambda: np.asarray(
                ours.generate(
                    source, new, start_token_id=BART_START, encoder_padding_mask=source_mask
                )
            ),
            "keras_hub": lambda: np.asarray(
                theirs.generate(their_inputs, stop_token_ids=None)["decoder_token_ids"]
            ),
        }
        _floor.time_against_floor(runners, args.repeats, new, {"batch": batch})


if __name__ == "__main__":
    main()
