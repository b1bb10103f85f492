"""Train a GPT (`keras_attention.models.GPT`) on tiny-shakespeare, nanoGPT style.

Reads top to bottom: config presets -> data (`tf.data`) -> model -> optimizer
(AdamW, linear warm-up, cosine decay, gradient clipping) -> `model.fit` with
an evaluation on the whole validation split (or, with `--eval-batches N`, an
estimate from N random batches of each split, as nanoGPT), a checkpoint and a
text sample every `eval_interval` steps -> final evaluation.

Usage:

    python examples/gpt_lm/train.py --config cpu              # nanoGPT's CPU config
    python examples/gpt_lm/train.py --config gpu --mixed-precision --jit
    python examples/gpt_lm/train.py --backend jax              # or tensorflow, torch
    python examples/gpt_lm/train.py --eval-batches 20          # nanoGPT's estimate
    python examples/gpt_lm/train.py --tiny                     # seconds, for tests
    python examples/gpt_lm/train.py --backend jax --distribute data   # every device

A run that finds a checkpoint in `--output-dir` resumes from it (same batches,
optimizer state and schedule included), and refuses options other than the
checkpoint's; `--fresh` starts over. Checkpoints are written atomically, so a
run killed at any moment resumes to the weights an uninterrupted run ends
with. The metrics of every interval go to `log.csv` in the output directory.
The summary gives the training time per step and tokens/s with evaluation,
checkpoints and samples left out, and their own times. The last line printed
is `val_loss: <value>`, the mean cross-entropy in nats per token over the
whole validation split (with `--eval-batches N`, over N random batches).
"""

import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402
import distribute  # noqa: E402



def build_parser():
    """The command line (checked before the heavy imports below)."""
    parser = common.training_parser(__doc__.split("\n")[0], "gpt_lm_output")
    parser.add_argument("--learning-rate", type=common.positive_float)
    parser.add_argument("--tokenizer", choices=["char", "bpe"])
    parser.add_argument(
        "--eval-batches", type=common.positive_int, metavar="N",
        help="estimate each split's loss from N random batches, as nanoGPT "
        "(default: the whole validation split)",
    )
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import data  # noqa: E402
from keras_attention.models import GPT  # noqa: E402
from sample import sample_text  # noqa: E402


@dataclasses.dataclass
class Config:
    # Data.
    source: str | None = None  # None: the shipped tiny-shakespeare
    cache_dir: str | None = None
    tokenizer: str = "char"  # or "bpe"
    bpe_vocabulary_size: int = 512
    context_length: int = 64
    batch_size: int = 12
    eval_batch_size: int = 256  # windows per batch of the whole-split evaluation
    eval_windows: int | None = None  # None: the whole validation split
    # None: evaluate the whole validation split. N: estimate the loss of each
    # split from N random batches of `batch_size` windows, as nanoGPT's
    # `estimate_loss` (drawn afresh at every evaluation, from the seed and
    # the step, so a resumed run draws the same ones).
    eval_batches: int | None = None
    # Model.
    num_layers: int = 4
    num_heads: int = 4
    hidden_dim: int = 128
    intermediate_dim: int = 512
    dropout: float = 0.0
    # On the attention weights alone (None: `dropout`). The `gpu` presets
    # take 0: only torch's fused kernel takes dropout (README, "On a GPU").
    attention_dropout: float | None = None
    # nanoGPT's shakespeare_char model: no biases, the exact GELU.
    use_bias: bool = False
    activation: str = "gelu"
    # Optimization (nanoGPT's shakespeare_char settings).
    steps: int = 2000
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta_1: float = 0.9
    beta_2: float = 0.99
    epsilon: float = 1e-8  # torch's AdamW default, as nanoGPT
    clip_norm: float = 1.0
    eval_interval: int = 250
    # Sampling.
    sample_length: int = 200
    temperature: float = 0.8
    top_k: int | None = 40
    seed: int = 1337
    # Precision: None (float32), "bfloat16" or "float16" (with loss scaling).
    mixed_precision: str | None = None


PRESETS = {
    # nanoGPT README, "I only have a macbook": validation loss 1.88. Its
    # learning rate, 1e-3, ends at 1.905-1.912 on our whole validation split
    # (two runs); the peak of 2e-3 suits 2000 short steps better.
    "cpu": dict(learning_rate=2e-3),
    # nanoGPT config/train_shakespeare_char.py: validation loss 1.4697. Its
    # dropout, 0.2, on the embeddings and residual branches; nanoGPT's flash
    # path drops attention weights too (`dropout_p`), which only torch's
    # fused kernel can: `--attention-dropout 0.2` on torch is its exact
    # configuration. 0 keeps JAX on its fused kernel, and both backends on
    # the same model.
    "gpu": dict(
        context_length=256,
        batch_size=64,
        num_layers=6,
        num_heads=6,
        hidden_dim=384,
        intermediate_dim=1536,
        dropout=0.2,
        attention_dropout=0.0,
        steps=5000,
        eval_interval=500,
    ),
    "tiny": dict(
        context_length=16,
        batch_size=4,
        eval_batch_size=8,
        eval_windows=16,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        steps=6,
        eval_interval=3,
        warmup_steps=2,
        sample_length=20,
    ),
}


# Data.


def make_data(config, start_step=0, tokenizer=None, pipeline="tf.data"):
    """The tokenizer, the training dataset, the whole-split validation
    dataset, and the training and validation ids; the datasets through
    `pipeline` (`common.PIPELINES`)."""
    text = common.load_text(config.source, config.cache_dir)
    train_text, _ = common.split_ids(np.array(list(text)), 0.9)
    if tokenizer is None:
        if config.tokenizer == "bpe":
            tokenizer = data.BytePairTokenizer.fit(
                "".join(train_text), config.bpe_vocabulary_size
            )
        else:
            tokenizer = common.CharTokenizer.fit(text)
    train_ids, val_ids = common.split_ids(tokenizer.encode(text), 0.9)
    train = common.train_batches(
        train_ids, config.context_length, config.batch_size, config.seed, start_step,
        pipeline=pipeline, num_batches=max(config.steps - start_step, 1),
    )
    val = common.consecutive_windows(
        val_ids, config.context_length, config.eval_batch_size, config.eval_windows,
        pipeline=pipeline,
    )
    return tokenizer, train, val, train_ids, val_ids


def estimate_batches(ids, config, split, step):
    """The windows of the loss estimate at `step` (`--eval-batches N`): N
    random batches of `batch_size` windows of `ids`, as nanoGPT's
    `estimate_loss` draws, as one `(inputs, targets)` pair `(N B, T)`. All
    batches have the same size, so the mean over the pair is the mean of the
    N batch means. Drawn from `(seed, split, step)` (`split`: 0 training, 1
    validation): a resumed run draws the same windows."""
    rng = np.random.default_rng((config.seed, split, step))
    length = config.context_length
    starts = rng.integers(0, len(ids) - length, config.eval_batches * config.batch_size)
    windows = ids[starts[:, None] + np.arange(length + 1)]  # (N B, T + 1)
    return windows[:, :-1], windows[:, 1:]  # (N B, T), (N B, T)


class Evaluation:
    """The losses at a step: the whole validation split (`val_loss`), or
    with `eval_batches` the estimates of both splits (`train_estimate`,
    `val_loss`); `seconds` adds up the time spent."""

    def __init__(self, config, val, train_ids, val_ids, distribution, pipeline="tf.data"):
        self.config = config
        self.pipeline = pipeline
        self.val = distribute.even_batches(val, distribution)
        self.ids = {"train": train_ids, "val": val_ids}
        self.distribution = distribution
        self.seconds = 0.0

    def __call__(self, model, step, splits=("train", "val")):
        start = time.perf_counter()
        if self.config.eval_batches is None:
            losses = {"val_loss": model.evaluate(self.val, verbose=0)}
        else:
            losses = {}
            for split in splits:
                pair = estimate_batches(self.ids[split], self.config, int(split == "val"), step)
                # One batch of N B windows: one call, one shape to compile.
                batch = distribute.even_batches(
                    common.batched_arrays(pair, len(pair[0]), self.pipeline),
                    self.distribution,
                )
                name = "val_loss" if split == "val" else "train_estimate"
                losses[name] = model.evaluate(batch, verbose=0)
        self.seconds += time.perf_counter() - start
        return losses


# Model and optimizer.


def build_model(config, vocabulary_size):
    model = GPT(
        vocabulary_size=vocabulary_size,
        max_sequence_length=config.context_length,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation=config.activation,
        use_bias=config.use_bias,
        seed=config.seed,
    )
    model.build((None, config.context_length))
    return model


def compile_model(model, config, jit_compile="auto"):
    """AdamW with warm-up and cosine decay; no decay on biases and norms."""
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        warmup_target=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps - config.warmup_steps, 1),
        alpha=config.min_learning_rate / config.learning_rate,
    )
    optimizer = keras.optimizers.AdamW(
        schedule,
        weight_decay=config.weight_decay,
        beta_1=config.beta_1,
        beta_2=config.beta_2,
        epsilon=config.epsilon,
        global_clipnorm=config.clip_norm,
    )
    # As nanoGPT: weight decay on matrices and embeddings only.
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if len(v.shape) < 2]
    )
    model.compile(
        optimizer=optimizer,
        # The mean over the weighted tokens: the same as the plain mean when
        # there are no weights, and exact on the rows of weight 0 that pad a
        # batch for several devices (`distribute.even_batches`).
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution(config),
    )
    # Built now (the loss-scaling wrapper too, under float16) so that a
    # checkpoint loads into it.
    model.optimizer.build(model.trainable_variables)


def steps_per_execution(config):
    """Training steps per call of the compiled train function: a whole
    evaluation interval where the backend can (TensorFlow runs them in one
    `tf.function` loop; on JAX Keras still calls the compiled step per batch,
    with fewer trips through `fit`'s loop), 1 on torch (Keras allows no
    more). The callbacks only act at the ends of intervals,
    so this changes no result."""
    return 1 if keras.backend.backend() == "torch" else config.eval_interval


# Checkpoints.


class Checkpoint(keras.callbacks.Callback):
    """After every `eval_interval` steps: evaluate, save, sample.

    The evaluation's losses join the epoch's logs (so `log.csv` has them).
    A checkpoint holds everything a resumed run needs: the model weights, the
    optimizer's moments and step counter (so the schedule continues), the
    tokenizer and the config. Writes go to temporary names first, so a run
    killed while saving leaves the previous checkpoint intact.

    The clock: `train_seconds` is the time inside `fit`'s epochs (the
    training steps); evaluation, checkpoints and samples are timed apart.
    """

    def __init__(self, directory, config, tokenizer, evaluation, val_ids):
        super().__init__()
        self.directory = pathlib.Path(directory)
        self.config = config
        self.tokenizer = tokenizer
        self.evaluation = evaluation
        self.val_ids = val_ids
        self._start = None
        self.train_seconds = []  # one entry per interval
        self.save_seconds = 0.0
        self.sample_seconds = 0.0

    @property
    def tokens_per_second(self):
        tokens = self.config.eval_interval * self.config.batch_size * self.config.context_length
        return [tokens / seconds for seconds in self.train_seconds]

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        self.train_seconds.append(seconds)
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        losses = self.evaluation(self.model, step)
        logs.update(losses)
        tokens = self.config.eval_interval * self.config.batch_size * self.config.context_length
        estimate = (
            f", train_estimate {losses['train_estimate']:.4f}"
            if "train_estimate" in losses else ""
        )
        print(
            f"step {step}: loss {logs['loss']:.4f}, val_loss {logs['val_loss']:.4f}"
            f"{estimate}, {1e3 * seconds / self.config.eval_interval:.1f} ms/step, "
            f"{tokens / seconds:,.0f} tokens/s",
            flush=True,
        )
        start = time.perf_counter()
        save_checkpoint(self.directory, self.model, self.config, self.tokenizer, step)
        self.save_seconds += time.perf_counter() - start
        start = time.perf_counter()
        prompt = self.val_ids[: self.config.context_length // 2]
        text = sample_text(
            self.model, prompt, self.config.sample_length,
            temperature=self.config.temperature, top_k=self.config.top_k,
            seed=self.config.seed + step,
        )
        text = self.tokenizer.decode(prompt) + self.tokenizer.decode(text)
        self.sample_seconds += time.perf_counter() - start
        print(f"---- sample at step {step} ----\n{text}\n----", flush=True)


def save_checkpoint(directory, model, config, tokenizer, step):
    """`common.save_checkpoint` (atomic) with the tokenizer beside the weights."""
    common.save_checkpoint(
        directory, model, step, config,
        save_extra=lambda folder: data.save_tokenizer(tokenizer, folder / "tokenizer.json"),
    )


def load_checkpoint(directory):
    """`(step, config dict, tokenizer, folder)` of the checkpoint in
    `directory`, or None."""
    found = common.load_checkpoint(directory)
    if found is None:
        return None
    step, config, folder = found
    return step, config, data.load_tokenizer(folder / "tokenizer.json"), folder


# Main.


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    config = common.config_from_args(
        parser, args, PRESETS, Config, options=("learning_rate", "tokenizer", "eval_batches")
    )
    return args, config


def main(argv=None):
    args, config = parse_args(argv)
    output = common.begin(args, config)

    start_step, tokenizer = 0, None
    checkpoint = None if args.fresh else load_checkpoint(output)
    if checkpoint is not None:
        saved_step, saved, tokenizer, folder = checkpoint
        # A resumed run continues the run it finds: every option must be
        # that run's (the schedule depends on the steps, the data on the rest).
        common.check_resumed_config(saved, config, output)
        start_step = saved_step  # where the batches continue
        print(f"resuming from step {saved_step} of {output}")
    print(config)

    pipeline = common.choose_pipeline(args.pipeline)
    print(f"data pipeline: {pipeline}")
    tokenizer, train, val, train_ids, val_ids = make_data(
        config, start_step, tokenizer, pipeline
    )
    # Built, compiled and trained inside the distribution's scope (a no-op on
    # one device).
    with distribute.scope(args.distribute, GPT):
        print(distribute.describe(args.distribute))
        evaluation = Evaluation(config, val, train_ids, val_ids, args.distribute, pipeline)
        return _train(args, config, output, checkpoint, start_step, tokenizer, train,
                      evaluation, val_ids)


def _train(args, config, output, checkpoint, start_step, tokenizer, train, evaluation,
           val_ids):
    model = build_model(config, tokenizer.vocabulary_size)
    compile_model(model, config, jit_compile=True if args.jit else "auto")
    if checkpoint is not None:
        saved_step, _, _, folder = checkpoint
        start_step = common.resume(model, folder, saved_step)
    print(
        f"vocabulary: {tokenizer.vocabulary_size} tokens ({tokenizer.kind}), "
        f"parameters: {model.count_params():,}"
    )

    epochs = config.steps // config.eval_interval
    start = time.perf_counter()
    checkpointer = Checkpoint(output, config, tokenizer, evaluation, val_ids)
    if start_step < config.steps:
        model.fit(
            train,
            initial_epoch=start_step // config.eval_interval,
            epochs=epochs,
            steps_per_epoch=config.eval_interval,
            # No `validation_data`: `checkpointer` evaluates at the end of
            # each interval (the whole split, or nanoGPT's estimate of both
            # splits), on its own clock. CSVLogger: the metrics of every
            # interval, appended across resumes.
            callbacks=[checkpointer, keras.callbacks.CSVLogger(output / "log.csv", append=True)],
            shuffle=False,  # the batches are random windows already
            verbose=0,
        )
    trained = config.steps - start_step
    seconds = time.perf_counter() - start
    print(common.trained_line(trained, seconds, config.steps, output))
    model.save(output / "model.keras")
    data.save_tokenizer(tokenizer, output / "tokenizer.json")
    # With `eval_batches`, the estimate at the last step: the windows the
    # last interval's evaluation drew.
    val_loss = evaluation(model, config.steps, splits=("val",))["val_loss"]
    print_summary(config, trained, time.perf_counter() - start, checkpointer, evaluation)
    print(f"val_loss: {val_loss:.4f}")
    return {
        "val_loss": val_loss,
        "train_tokens_per_second": checkpointer.tokens_per_second,
        "parameters": model.count_params(),
        "model": model,
        "config": config,
        "seconds": seconds,
    }


def print_summary(config, trained, wall, checkpointer, evaluation):
    """Where the `wall` seconds went: the training steps (ms/step and
    tokens/s, evaluation, checkpoints and samples left out; the first
    interval holds the compilation), then the rest."""
    parts = {
        "training": sum(checkpointer.train_seconds),
        "evaluation": evaluation.seconds,
        "checkpoints": checkpointer.save_seconds,
        "samples": checkpointer.sample_seconds,
    }
    parts["other"] = wall - sum(parts.values())  # start-up, the final save
    if trained:
        tokens = trained * config.batch_size * config.context_length
        later = checkpointer.train_seconds[1:]
        steady = (
            f" ({1e3 * sum(later) / (len(later) * config.eval_interval):.1f} after "
            "the first interval)" if later else ""
        )
        print(
            f"training: {1e3 * parts['training'] / trained:.1f} ms/step{steady}, "
            f"{tokens / parts['training']:,.0f} tokens/s"
        )
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) + f"; wall {wall:.1f} s")


if __name__ == "__main__":
    common.run(main, build_parser(), resumable=True)
