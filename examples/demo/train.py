"""A character-level language model on tiny-shakespeare, built from SelfAttention.

Reads the text one character at a time and learns to predict the next one. The
model is a small decoder-only transformer: token and learned position
embeddings, then a few blocks of causal attention (heads that are each a
`keras_attention.layers.SelfAttention`, side by side) and a feed-forward
network, each with a residual connection and a layer norm in front (pre-norm,
as in GPT-2), then a softmax over the characters.

Data: the first 90% of the text trains, the last 10% validates (the split of
nanoGPT's `shakespeare_char`). Training draws random windows of
`context_length + 1` characters; validation reads the whole held-out tenth in
consecutive windows.

Usage:

    python examples/demo/train.py                    # a few minutes on a CPU
    python examples/demo/train.py --backend jax      # or tensorflow, torch
    python examples/demo/train.py --tiny             # a few steps, for tests

The last line printed is `val_loss: <value>`: the mean cross-entropy, in nats
per character, on the validation text (a model that only knew character
frequencies would score about 3.3).
"""

import dataclasses
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402

def build_parser():
    """The command line (checked before the heavy imports below)."""
    parser = common.OptionParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a few steps, in seconds")
    parser.add_argument("--steps", type=common.positive_int, help="training steps")
    common.backend_option(parser)
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_attention  # noqa: E402


@dataclasses.dataclass
class Config:
    # Data.
    data_path: str = str(common.DEFAULT_CORPUS)
    train_fraction: float = 0.9
    context_length: int = 64
    batch_size: int = 16
    # Model.
    num_layers: int = 2
    num_heads: int = 4
    hidden_dim: int = 128
    intermediate_dim: int = 256
    # Training.
    steps: int = 1500
    eval_interval: int = 500
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    eval_batch_size: int = 64
    eval_windows: int | None = None  # None: the whole validation text.
    # Sampling.
    sample_length: int = 200
    temperature: float = 0.8
    seed: int = 1337


TINY = dict(
    context_length=16,
    batch_size=8,
    eval_batch_size=8,
    num_layers=1,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    steps=6,
    eval_interval=3,
    warmup_steps=2,
    eval_windows=32,
    sample_length=20,
)


# Data.


def make_datasets(config):
    """Returns the tokenizer, the training and validation datasets, the ids.

    The text, its characters, the split and both pipelines are those of
    `examples/common.py`, shared with the GPT example.
    """
    text = common.load_text(config.data_path)
    tokenizer = common.CharTokenizer.fit(text)
    train_ids, val_ids = common.split_ids(
        tokenizer.encode(text), config.train_fraction
    )
    train_data = common.train_batches(
        train_ids, config.context_length, config.batch_size, config.seed
    )
    val_data = common.consecutive_windows(
        val_ids, config.context_length, config.eval_batch_size, config.eval_windows
    )
    return tokenizer, train_data, val_data, val_ids


# Model.


def build_model(config, vocabulary_size):
    """A causal character model: `(B, T)` ids -> `(B, T, vocabulary_size)` logits."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")  # (B, T)
    # Position ids 0 .. T-1 taken from the input, so any length up to
    # `context_length` works (sampling feeds a full window, training too).
    positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1  # (B, T)
    token_embedding = keras.layers.Embedding(
        vocabulary_size, config.hidden_dim, name="token_embedding"
    )
    position_embedding = keras.layers.Embedding(
        config.context_length, config.hidden_dim, name="position_embedding"
    )
    x = token_embedding(tokens) + position_embedding(positions)  # (B, T, D)
    for i in range(config.num_layers):
        # Self-attention block: each position sees only itself and its left.
        # Several heads, each a SelfAttention of D / num_heads units, side by side.
        h = keras.layers.LayerNormalization(name=f"block{i}_attention_norm")(x)
        heads = [
            keras_attention.layers.SelfAttention(
                units=config.hidden_dim // config.num_heads,
                name=f"block{i}_head{j}",
            )(h, use_causal_mask=True)  # (B, T, D / num_heads)
            for j in range(config.num_heads)
        ]
        h = keras.layers.Concatenate(name=f"block{i}_heads")(heads)  # (B, T, D)
        h = keras.layers.Dense(config.hidden_dim, name=f"block{i}_attention_output")(h)
        x = x + h
        # Feedforward block.
        h = keras.layers.LayerNormalization(name=f"block{i}_feedforward_norm")(x)
        h = keras.layers.Dense(
            config.intermediate_dim, activation="gelu", name=f"block{i}_intermediate"
        )(h)  # (B, T, intermediate_dim)
        h = keras.layers.Dense(config.hidden_dim, name=f"block{i}_output")(h)
        x = x + h
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    logits = keras.layers.Dense(vocabulary_size, name="logits")(x)  # (B, T, V)
    return keras.Model(tokens, logits, name="char_transformer")


# Training and evaluation.


def train(config, model, train_data, val_data):
    """Adam with a linear warmup and a cosine decay; evaluates as it goes.

    Returns the number of steps trained.
    """
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        warmup_target=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps - config.warmup_steps, 1),
        alpha=0.1,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(schedule, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    # One Keras "epoch" per evaluation: `steps` split into near-equal parts.
    num_evaluations = max(round(config.steps / config.eval_interval), 1)
    steps_per_evaluation = math.ceil(config.steps / num_evaluations)
    model.fit(
        train_data,
        epochs=num_evaluations,
        steps_per_epoch=steps_per_evaluation,
        validation_data=val_data,
        verbose=2,
    )
    return num_evaluations * steps_per_evaluation


def sample(model, tokenizer, prompt_ids, length, temperature, seed):
    """Extends `prompt_ids` (a full context window) by `length` sampled ids."""
    rng = np.random.default_rng(seed)
    window = np.array(prompt_ids, dtype="int32")[None, :]  # (1, T)
    new_ids = []
    for _ in range(length):
        logits = keras.ops.convert_to_numpy(model.predict_on_batch(window))
        logits = logits[0, -1].astype("float64") / temperature  # (V,)
        probabilities = np.exp(logits - logits.max())
        next_id = rng.choice(len(probabilities), p=probabilities / probabilities.sum())
        new_ids.append(next_id)
        # Slide the window: one fixed shape, so the predict function compiles once.
        window = np.concatenate([window[:, 1:], [[next_id]]], axis=1).astype("int32")
    return tokenizer.decode(new_ids)


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    config = Config(**TINY) if args.tiny else Config()
    if args.steps is not None:
        config.steps = args.steps
    return config


def main(argv=None):
    config = parse_args(argv)
    keras.utils.set_random_seed(config.seed)
    print(f"backend: {keras.backend.backend()}")
    print(config)

    tokenizer, train_data, val_data, val_ids = make_datasets(config)
    model = build_model(config, tokenizer.vocabulary_size)
    print(
        f"vocabulary: {tokenizer.vocabulary_size} characters, "
        f"parameters: {model.count_params():,}"
    )

    start = time.perf_counter()
    steps = train(config, model, train_data, val_data)
    print(f"trained {steps} steps in {time.perf_counter() - start:.1f} s")

    prompt = val_ids[: config.context_length]
    continuation = sample(
        model, tokenizer, prompt, config.sample_length, config.temperature, config.seed
    )
    print("---- sample ----")
    print(tokenizer.decode(prompt) + continuation)
    print("----------------")

    val_loss, val_accuracy = model.evaluate(val_data, verbose=0)
    print(f"val_accuracy: {val_accuracy:.4f}")
    print(f"val_loss: {val_loss:.4f}")


if __name__ == "__main__":
    common.run(main, build_parser(), resumable=False)
