"""Key-value retrieval with soft and hard attention: which estimator trains?

The task (see `data.py`): a memory of key/value token pairs and a query key;
answer the value stored under the query. The model embeds keys, values and the
query, attends from the query over the pairs (keys to match, values to
return), and reads the answer off the attended value with a `Dense` layer.
Only the attention step differs between the four runs, all on the same data
stream from the same initial weights:

- `soft`: `SoftAttention`, a softmax-weighted average, trained by backprop;
- `straight_through`: `HardAttention(estimator="straight_through")`: reads one
  sampled pair, backpropagates the soft distribution's gradient;
- `gumbel`: `HardAttention(estimator="gumbel")`: reads a Gumbel-softmax
  relaxed sample in training, its temperature annealed from 1 to 0.5;
- `reinforce`: `HardAttention(estimator="reinforce")` inside
  `keras_attention.losses.ReinforceModel`: reads one sampled pair; the scorer
  learns from the reward (minus the example's cross-entropy) through the
  REINFORCE estimator with a moving-average baseline and an entropy bonus.

At test time every hard model reads the argmax pair.

Usage:

    python examples/hard_attention/train.py                # all four methods
    python examples/hard_attention/train.py --backend jax  # or tensorflow, torch
    python examples/hard_attention/train.py --method reinforce
    python examples/hard_attention/train.py --tiny            # a few steps, for tests

It prints, per method, the test accuracy, the step at which the validation
accuracy first reached 95% and the training time, then a table, and on its
last line `accuracy: <value>`: the test accuracy of the last method trained
(hard attention with REINFORCE by default).
"""

import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402

METHODS = ("soft", "straight_through", "gumbel", "reinforce")


def build_parser():
    """The command line (checked before the heavy imports below)."""
    parser = common.OptionParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a few steps, in seconds")
    parser.add_argument("--steps", type=common.positive_int, help="training steps per method")
    parser.add_argument(
        "--method", choices=METHODS + ("all",), default="all",
        help="the method to train (default: all four, REINFORCE last)",
    )
    common.backend_option(parser)
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)

import keras  # noqa: E402

import keras_attention  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import data  # noqa: E402


@dataclasses.dataclass
class Config:
    # Data.
    num_pairs: int = 16
    num_keys: int = 64
    num_values: int = 64
    batch_size: int = 64
    validation_size: int = 2000
    test_size: int = 10000
    # Model.
    dim: int = 32
    score: str = "scaled_dot"
    # Training.
    steps: int = 1500
    eval_interval: int = 50
    learning_rate: float = 3e-3
    target_accuracy: float = 0.95
    # Hard attention.
    gumbel_final_temperature: float = 0.5
    entropy_weight: float = 0.01
    baseline_decay: float = 0.9
    seed: int = 1337


TINY = dict(
    num_pairs=4,
    num_keys=8,
    num_values=8,
    batch_size=16,
    validation_size=64,
    test_size=64,
    dim=8,
    steps=20,
    eval_interval=10,
)


# Data.


def make_data(config):
    """The training stream (a generator) and the fixed validation and test sets."""
    sizes = dict(
        num_pairs=config.num_pairs,
        num_keys=config.num_keys,
        num_values=config.num_values,
    )
    train = data.training_batches(config.seed, config.batch_size, **sizes)
    validation = data.fixed_split(config.seed + 1, config.validation_size, **sizes)
    test = data.fixed_split(config.seed + 2, config.test_size, **sizes)
    return train, validation, test


# Model.


def make_attention(config, method):
    """The attention step of `method`: the only part that differs."""
    if method == "soft":
        return keras_attention.layers.SoftAttention(
            score=config.score, name="attention"
        )
    if method == "gumbel":
        # Anneal the relaxation towards the hard selection used at test time.
        temperature = keras.optimizers.schedules.PolynomialDecay(
            1.0, config.steps, end_learning_rate=config.gumbel_final_temperature
        )
        return keras_attention.layers.HardAttention(
            score=config.score,
            estimator="gumbel",
            temperature=temperature,
            seed=config.seed,
            name="attention",
        )
    return keras_attention.layers.HardAttention(
        score=config.score, estimator=method, seed=config.seed, name="attention"
    )


def build_model(config, method):
    """`{"keys", "values", "query"}` -> logits over the values `(B, num_values)`."""
    keys = keras.Input((None,), dtype="int32", name="keys")  # (B, P)
    values = keras.Input((None,), dtype="int32", name="values")  # (B, P)
    query = keras.Input((1,), dtype="int32", name="query")  # (B, 1)
    inputs = {"keys": keys, "values": values, "query": query}
    key_vectors = keras.layers.Embedding(
        config.num_keys, config.dim, name="key_embedding"
    )(keys)  # (B, P, D)
    # A separate query embedding: matching a query to its key is learned.
    query_vector = keras.layers.Embedding(
        config.num_keys, config.dim, name="query_embedding"
    )(query)  # (B, 1, D)
    value_vectors = keras.layers.Embedding(
        config.num_values, config.dim, name="value_embedding"
    )(values)  # (B, P, D)

    attention = make_attention(config, method)
    if method == "reinforce":
        read, log_prob, entropy = attention(
            query_vector, value_vectors, key=key_vectors, return_log_prob=True
        )  # (B, 1, D), (B,), (B,)
    else:
        read = attention(query_vector, value_vectors, key=key_vectors)  # (B, 1, D)
    read = keras.layers.Reshape((config.dim,), name="read")(read)  # (B, D)
    logits = keras.layers.Dense(config.num_values, name="answer")(read)  # (B, V)

    if method == "reinforce":
        # The policy returns what REINFORCE needs; the wrapper adds the
        # objective to the task loss in `fit` and predicts the logits alone.
        policy = keras.Model(inputs, (logits, log_prob, entropy), name="policy")
        return keras_attention.losses.ReinforceModel(
            policy,
            entropy_weight=config.entropy_weight,
            baseline_decay=config.baseline_decay,
            name=method,
        )
    return keras.Model(inputs, logits, name=method)


# Training and evaluation.


class FirstStepAtAccuracy(keras.callbacks.Callback):
    """Records the first step at which the validation accuracy reaches a target."""

    def __init__(self, target, steps_per_epoch):
        super().__init__()
        self.target = target
        self.steps_per_epoch = steps_per_epoch
        self.step = None

    def on_epoch_end(self, epoch, logs=None):
        if self.step is None and logs["val_accuracy"] >= self.target:
            self.step = (epoch + 1) * self.steps_per_epoch


def train(config, model, train_data, validation):
    """Adam on the cross-entropy; validates every `eval_interval` steps.

    Returns the first step at which the validation accuracy reached
    `target_accuracy` (None if it never did).
    """
    model.compile(
        optimizer=keras.optimizers.Adam(config.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    first_step = FirstStepAtAccuracy(config.target_accuracy, config.eval_interval)
    model.fit(
        train_data,
        epochs=config.steps // config.eval_interval,
        steps_per_epoch=config.eval_interval,
        validation_data=validation,
        validation_batch_size=1000,
        callbacks=[first_step],
        shuffle=False,  # A generator: every batch is fresh already.
        verbose=0,
    )
    return first_step.step


def run(config, method):
    """Trains and tests one method on the shared data; returns its results."""
    keras.utils.set_random_seed(config.seed)  # The same initial weights for all.
    train_data, validation, (test_x, test_y) = make_data(config)
    model = build_model(config, method)
    start = time.perf_counter()
    first_step = train(config, model, train_data, validation)
    seconds = time.perf_counter() - start
    accuracy = model.evaluate(
        test_x, test_y, batch_size=1000, verbose=0, return_dict=True
    )["accuracy"]
    reached = f"step {first_step}" if first_step else "never"
    print(
        f"{method}: test accuracy {accuracy:.4f}; validation accuracy "
        f">= {config.target_accuracy:.0%} at {reached}; "
        f"{config.steps} steps in {seconds:.1f} s",
        flush=True,
    )
    return {"method": method, "accuracy": accuracy, "first_step": first_step,
            "seconds": seconds}


def print_table(config, results):
    print(
        f"| method | test accuracy | steps to {config.target_accuracy:.0%} "
        f"validation accuracy | training time ({config.steps} steps) |"
    )
    print("| --- | --- | --- | --- |")
    for r in results:
        steps = r["first_step"] or f"not within {config.steps}"
        print(
            f"| {r['method']} | {r['accuracy']:.4f} | {steps} | {r['seconds']:.0f} s |"
        )


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    config = Config(**TINY) if args.tiny else Config()
    if args.steps is not None:
        config.steps = args.steps
    methods = METHODS if args.method == "all" else (args.method,)
    return config, methods


def main(argv=None):
    config, methods = parse_args(argv)
    print(f"backend: {keras.backend.backend()}")
    print(config)
    results = [run(config, method) for method in methods]
    print_table(config, results)
    print(f"accuracy: {results[-1]['accuracy']:.4f}")


if __name__ == "__main__":
    common.run(main, build_parser(), resumable=False)
