"""GPT greedy decoding on JAX against a loop written by hand, in one process.

`gpt_speed.py` times `GPT.generate` against KerasHub's `GPT2CausalLM`. This
script adds what the same decoding costs without Keras or the package, so
that a ratio against KerasHub can be read against the best one this machine
allows:

- `floor`: greedy decoding of the same weights written directly in
  `jax.numpy` and compiled as one `jax.jit`, the loop a JAX user would write
  by hand for this model: the prompt in one pass, then a `fori_loop` of
  one-token steps over a cache of the whole length laid out for the products
  (`(H, L, K)` keys and values, no copies or transposes per step), one Q/K/V
  product with the kernels concatenated once, no masks beyond the positions
  not yet written, no guards. The weights are arguments, as in the other
  two;
- `ours`: `keras_attention.models.GPT.generate` (the GPT-2 configuration,
  weights from the KerasHub backbone with `GPT.from_keras_hub`);
- `keras_hub`: `GPT2CausalLM.generate` with the greedy sampler.

All three must decode the same tokens (checked before timing). Sizes: the
`cpu` preset of `examples/gpt_lm` (4 layers, 4 heads, width 128, 65 tokens),
batch 1, a 16-token prompt, as in `gpt_speed.py`. Medians of `--repeats`
rounds, the three in turn within a round.

    python benchmarks/gpt_decode_floor.py                    # --lengths 64,128,256
"""

import _floor

LAYERS, HEADS, WIDTH, INTERMEDIATE, VOCABULARY = 4, 4, 128, 512, 65
PROMPT_LENGTH = 16
EPSILON = 1e-5


def floor_decoder(backbone, total_length):
    """`decode(prompt) -> tokens (L,)`, numpy in and out: one jitted call of
    greedy decoding with a KerasHub `GPT2Backbone`'s weights as arguments."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    head_size = WIDTH // HEADS
    weights = {w.path: np.asarray(w.numpy()) for w in backbone.weights}

    def block_params(i):
        prefix = f"transformer_layer_{i}/"

        def get(name, *parts):
            """The weights of the layer `name`, each part `(D, N)` or `(N,)`."""
            return tuple(weights[f"{prefix}{name}/{part}"] for part in parts)

        heads = ("query", "key", "value")
        qkv = [get(f"self_attention/{n}", "kernel")[0].reshape(WIDTH, WIDTH) for n in heads]
        qkv_bias = [get(f"self_attention/{n}", "bias")[0].reshape(WIDTH) for n in heads]
        output_kernel, output_bias = get("self_attention/attention_output", "kernel", "bias")
        return {
            "norm_1": get("self_attention_layer_norm", "gamma", "beta"),
            "qkv": (np.concatenate(qkv, axis=1), np.concatenate(qkv_bias)),
            "output": (output_kernel.reshape(WIDTH, WIDTH), output_bias),
            "norm_2": get("feedforward_layer_norm", "gamma", "beta"),
            "up": get("feedforward_intermediate_dense", "kernel", "bias"),
            "down": get("feedforward_output_dense", "kernel", "bias"),
        }

    params = jax.tree.map(
        jnp.asarray,
        {
            "token": weights["token_embedding/embeddings"],
            "position": weights["position_embedding/embeddings"][:total_length],
            "final_norm": (weights["layer_norm/gamma"], weights["layer_norm/beta"]),
            "blocks": [block_params(i) for i in range(LAYERS)],
        },
    )

    def layer_norm(x, gamma_beta):
        return _floor.layer_norm(x, gamma_beta, EPSILON)

    dense = _floor.dense

    def run_blocks(params, x, caches, start):
        """`x` `(T, D)` at positions `start ..`; caches: per block `(k, v)`
        `(H, L, K)` each. Returns the last row's logits and the caches."""
        length = x.shape[0]
        positions = start + jnp.arange(length)  # (T,)
        visible = jnp.arange(total_length)[None] <= positions[:, None]  # (T, L)
        new_caches = []
        for block, (key_cache, value_cache) in zip(params["blocks"], caches):
            qkv = dense(layer_norm(x, block["norm_1"]), block["qkv"])  # (T, 3D)
            q, k, v = (
                t.reshape(length, HEADS, head_size).transpose(1, 0, 2)  # (H, T, K)
                for t in jnp.split(qkv, 3, axis=-1)
            )
            key_cache = jax.lax.dynamic_update_slice(key_cache, k, (0, start, 0))
            value_cache = jax.lax.dynamic_update_slice(value_cache, v, (0, start, 0))
            scores = jnp.einsum("htk,hlk->htl", q, key_cache) / np.sqrt(head_size)
            scores = jnp.where(visible[None], scores, -jnp.inf)
            attended = jnp.einsum("htl,hlk->htk", jax.nn.softmax(scores, axis=-1), value_cache)
            x = x + dense(attended.transpose(1, 0, 2).reshape(length, WIDTH), block["output"])
            hidden = dense(layer_norm(x, block["norm_2"]), block["up"])
            hidden = jax.nn.gelu(hidden, approximate=True)
            x = x + dense(hidden, block["down"])
            new_caches.append((key_cache, value_cache))
        logits = layer_norm(x[-1], params["final_norm"]) @ params["token"].T  # (V,)
        return logits, new_caches

    @jax.jit
    def decode(params, prompt):
        empty = jnp.zeros((HEADS, total_length, head_size), "float32")
        caches = [(empty, empty) for _ in range(LAYERS)]
        x = params["token"][prompt] + params["position"][:PROMPT_LENGTH]
        logits, caches = run_blocks(params, x, caches, 0)
        tokens = jnp.zeros((total_length,), "int32").at[:PROMPT_LENGTH].set(prompt)
        tokens = tokens.at[PROMPT_LENGTH].set(jnp.argmax(logits).astype("int32"))

        def step(i, state):
            tokens, caches = state
            x = (params["token"][tokens[i]] + params["position"][i])[None]  # (1, D)
            logits, caches = run_blocks(params, x, caches, i)
            return tokens.at[i + 1].set(jnp.argmax(logits).astype("int32")), caches

        tokens, _ = jax.lax.fori_loop(PROMPT_LENGTH, total_length - 1, step, (tokens, caches))
        return tokens

    return lambda prompt: np.asarray(decode(params, prompt))


def main():
    parser = _floor.argument_parser(__doc__)
    parser.add_argument("--lengths", default="64,128,256", help="total lengths, comma-separated")
    args = parser.parse_args()
    lengths = _floor.integer_list(parser, "--lengths", args.lengths, PROMPT_LENGTH + 2)
    _floor.check_run(parser, args)

    import keras_hub
    import numpy as np

    from keras_attention.models import GPT

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=LAYERS, num_heads=HEADS, hidden_dim=WIDTH,
        intermediate_dim=INTERMEDIATE, dropout=0.0, max_sequence_length=max(lengths),
    )
    theirs = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    theirs.compile(sampler="greedy")
    ours = GPT.from_keras_hub(backbone)
    rng = np.random.default_rng(0)
    for length in lengths:
        prompt = rng.integers(1, VOCABULARY, (PROMPT_LENGTH,)).astype("int32")
        token_ids = np.zeros((1, length), "int32")
        token_ids[0, :PROMPT_LENGTH] = prompt
        padding_mask = np.arange(length)[None] < PROMPT_LENGTH
        their_inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
        floor = floor_decoder(backbone, length)
        new = length - PROMPT_LENGTH
        runners = {
            "floor": lambda: floor(prompt),
            "ours": lambda: np.asarray(ours.generate(prompt[None], new))[0],
            "keras_hub": lambda: np.asarray(
                theirs.generate(their_inputs, stop_token_ids=None)["token_ids"]
            )[0],
        }
        _floor.time_against_floor(runners, args.repeats, new, {"length": length})


if __name__ == "__main__":
    main()
