"""Train an English-to-Spanish `Seq2SeqTransformer` and score it in BLEU.

Reads top to bottom: config presets -> data (Bible verse pairs, whole books
held out, KerasHub WordPiece, `tf.data` batches bucketed by length) -> model
-> optimizer (Adam with the paper's inverse-square-root warm-up) and a
label-smoothed loss -> `model.fit` with a validation loss and a checkpoint
every `eval_interval` steps -> BLEU and chrF on the test books, greedy and
with beam search -> sample translations and a picture of the cross-attention.

Usage:

    python examples/translation/train.py                    # --config cpu, < 20 minutes
    python examples/translation/train.py --backend jax      # or tensorflow, torch
    python examples/translation/train.py --config gpu --mixed-precision
    python examples/translation/train.py --tiny             # seconds, for tests
    python examples/translation/translate.py "The Lord is my shepherd."

A run that finds a checkpoint in `--output-dir` resumes from it (same steps,
same batches, optimizer state and schedule included); `--fresh` starts over.
The last line printed is `bleu: <value>`: sacrebleu's corpus BLEU of the
beam-search translations of the test books.
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
    parser = common.training_parser(
        __doc__.split("\n")[0], "translation_output", "pair file path or URL (default: shipped)"
    )
    parser.add_argument("--layout", choices=["auto", "bible", "tatoeba"])
    parser.add_argument(
        "--train-only", action="store_true",
        help="stop after training and saving (no BLEU, samples or picture)",
    )
    common.add_prepare_options(parser)
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import data  # noqa: E402
from keras_attention.models import Seq2SeqTransformer  # noqa: E402
from translate import translate  # noqa: E402


@dataclasses.dataclass
class Config:
    # Data.
    source: str | None = None  # None: the shipped Bible pairs
    cache_dir: str | None = None
    layout: str = "auto"  # "bible", "tatoeba" or "auto"
    max_words: int = 30  # words per side at most (every split)
    validation_books: tuple | None = None  # None: data.default_held_out_books
    test_books: tuple | None = None
    max_train_pairs: int | None = None  # the first pairs only (None: all)
    max_eval_pairs: int | None = None  # per held-out split (None: all)
    vocabulary_size: int = 4000  # per language; the learner returns fewer
    lowercase: bool = False
    max_length: int = 64  # tokens per side (START / END included), multiple of 8
    batch_tokens: int = 2048  # about this many tokens per side per batch
    # Model.
    num_encoder_layers: int = 3
    num_decoder_layers: int = 3
    num_heads: int = 4
    hidden_dim: int = 128
    intermediate_dim: int = 512
    dropout: float = 0.0
    # On the attention weights alone (None: `dropout`). The `gpu` presets
    # take 0: only torch's fused kernel takes dropout (README, "On a GPU").
    attention_dropout: float | None = None
    normalize_first: bool = False  # the paper's post-norm
    share_embeddings: bool = False  # one joint vocabulary when True
    # Optimization (the paper's Adam, schedule and label smoothing).
    steps: int = 2700
    eval_interval: int = 300
    warmup_steps: int = 800
    learning_rate_scale: float = 1.0
    beta_1: float = 0.9
    beta_2: float = 0.98
    epsilon: float = 1e-9
    label_smoothing: float = 0.1
    progress_seconds: float = 30.0  # a progress line at least this often
    # Evaluation.
    num_beams: int = 4
    length_penalty: float = 0.6
    eval_batch_size: int = 64
    num_samples: int = 3
    seed: int = 1
    # Precision: None (float32), "bfloat16" or "float16" (with loss scaling).
    mixed_precision: str | None = None


PRESETS = {
    # 3 + 3 blocks of width 128 on the 2-core CPU: 2,700 steps of about
    # 2,048 target tokens, 8.5 passes over the 20,615 training pairs of
    # up to 30 words. No dropout: in so few passes the training loss stays
    # at the validation loss (README, "Results").
    "cpu": {},
    # The paper's base model and schedule on the 25,895 training pairs of up
    # to 40 words (about 110 batches of 8,192 tokens a pass) with the
    # dropout of the paper's big model, 0.3, as a corpus this small needs,
    # on the embeddings and residual branches only, so that every backend
    # trains on its fused attention kernel: 6,000 steps, about 55 passes.
    # Not yet measured.
    "gpu": dict(
        max_words=40,
        max_length=96,
        batch_tokens=8192,
        vocabulary_size=8000,
        num_encoder_layers=6,
        num_decoder_layers=6,
        num_heads=8,
        hidden_dim=512,
        intermediate_dim=2048,
        dropout=0.3,
        attention_dropout=0.0,
        steps=6000,
        eval_interval=500,
        warmup_steps=4000,
        learning_rate_scale=1.0,
        eval_batch_size=256,
    ),
    "tiny": dict(
        max_words=20,
        max_train_pairs=300,
        max_eval_pairs=8,
        vocabulary_size=300,
        max_length=16,
        batch_tokens=128,
        num_encoder_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=0.1,
        steps=6,
        eval_interval=3,
        warmup_steps=2,
        learning_rate_scale=0.5,
        num_beams=2,
        eval_batch_size=8,
        num_samples=1,
    ),
}


# Data.


# The options that shape the prepared data (`--prepare`, `--data`).
DATA_OPTIONS = (
    "source", "layout", "max_words", "validation_books", "test_books", "max_train_pairs",
    "max_eval_pairs", "vocabulary_size", "lowercase", "share_embeddings",
)


def data_settings(config):
    return {name: getattr(config, name) for name in DATA_OPTIONS}


def make_splits(config, tokenizer=None):
    """The pairs' splits (a dict of `data.PREPARED_SPLITS`) and the tokenizer
    (learned from the training split unless given)."""
    pairs = data.filter_by_length(
        data.load_pairs(config.source, config.cache_dir, config.layout), config.max_words
    )
    default_validation, default_test = data.default_held_out_books(pairs)
    validation_books = config.validation_books or default_validation
    test_books = config.test_books or default_test
    train, validation, test = data.split_pairs(pairs, validation_books, test_books)
    splits = dict(
        train=train[: config.max_train_pairs],
        validation=validation[: config.max_eval_pairs],
        test=test[: config.max_eval_pairs],
    )
    if tokenizer is None:
        print(f"learning the WordPiece vocabularies from {len(splits['train'])} pairs",
              flush=True)
        start = time.perf_counter()
        tokenizer = data.PairTokenizer.fit(
            splits["train"], config.vocabulary_size, config.share_embeddings, config.lowercase
        )
        print(f"learned the WordPiece vocabularies in {time.perf_counter() - start:.1f} s")
    names = data.book_names if data.is_bible(pairs) else (lambda books: f"groups {list(books)}")
    print(
        f"pairs: {len(splits['train'])} train, {len(splits['validation'])} validation "
        f"({names(validation_books)}), {len(splits['test'])} test ({names(test_books)})"
    )
    return splits, tokenizer


def read_prepared(config, directory):
    """`data.load_prepared(directory)`, checked against the run's options."""
    splits, tokenizer, ids, settings = data.load_prepared(directory)
    common.check_prepared_settings(settings, data_settings(config), directory)
    return splits, tokenizer, ids


def make_data(config, start_step=0, tokenizer=None, pipeline="tf.data", prepared=None):
    """The pairs' splits, the tokenizer and the training / validation batches.

    Args:
        pipeline: `"tf.data"` (tokenizes with KerasHub's WordPiece) or
            `"arrays"` (numpy batches of token ids, `data.train_arrays`).
        prepared: a folder `--prepare` wrote (`data.save_prepared`): its
            splits, vocabularies and token ids (no WordPiece needed).

    Returns:
        A dict: `train`, `validation`, `test` (lists of `data.Pair`),
        `tokenizer` (learned from `train` unless given or prepared),
        `train_batches` (the endless stream from `start_step`),
        `batches_per_epoch` and `validation_batches`.
    """
    ids = None
    if prepared is not None:
        splits, prepared_tokenizer, ids = read_prepared(config, prepared)
        if tokenizer is not None and (
            tokenizer.source_vocabulary != prepared_tokenizer.source_vocabulary
            or tokenizer.target_vocabulary != prepared_tokenizer.target_vocabulary
        ):
            raise ValueError(
                f"The checkpoint's vocabularies differ from those in {prepared}. "
                f"Received: data={str(prepared)!r}"
            )
        tokenizer = prepared_tokenizer
    else:
        common.require_tensorflow_or_prepared(prepared)
        splits, tokenizer = make_splits(config, tokenizer)
    if pipeline == "arrays":
        if ids is None:
            ids = {
                name: (tokenizer.encode_source([p.source for p in splits[name]]),
                       tokenizer.encode_target([p.target for p in splits[name]]))
                for name in ("train", "validation")
            }
        train_batches, per_epoch = data.train_arrays(
            *ids["train"], config.max_length, config.batch_tokens, config.seed, start_step,
            num_batches=max(config.steps - start_step, 1),
        )
        validation_batches = data.eval_arrays(
            *ids["validation"], config.max_length, config.batch_tokens
        )
    else:
        train_batches, per_epoch = data.train_batches(
            splits["train"], tokenizer, config.max_length, config.batch_tokens, config.seed,
            start_step,
        )
        validation_batches = data.eval_batches(
            splits["validation"], tokenizer, config.max_length, config.batch_tokens
        )
    print(f"{per_epoch} training batches per pass ({pipeline})")
    return dict(
        **splits, tokenizer=tokenizer, train_batches=train_batches,
        batches_per_epoch=per_epoch, validation_batches=validation_batches,
    )


# Model, schedule and loss.


def build_model(config, tokenizer):
    model = Seq2SeqTransformer(
        source_vocabulary_size=tokenizer.source_vocabulary_size,
        target_vocabulary_size=tokenizer.target_vocabulary_size,
        max_source_length=config.max_length,
        max_target_length=config.max_length,
        num_encoder_layers=config.num_encoder_layers,
        num_decoder_layers=config.num_decoder_layers,
        num_heads=config.num_heads,
        hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        normalize_first=config.normalize_first,
        share_embeddings=config.share_embeddings,
        pad_token_id=data.PAD_ID,
        seed=config.seed,
    )
    model.build()
    return model


@keras.saving.register_keras_serializable(package="translation")
class InverseSquareRootSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The paper's learning rate (section 5.3), times `scale`:

        lrate = scale * hidden_dim^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

    a linear rise for `warmup_steps` steps to `scale / sqrt(hidden_dim *
    warmup_steps)`, then a decay as `1 / sqrt(step)`. `step` counts from 1
    (the optimizer's iteration counter plus one), so the first update is not
    0.
    """

    def __init__(self, hidden_dim, warmup_steps=4000, scale=1.0):
        self.hidden_dim = int(hidden_dim)
        self.warmup_steps = int(warmup_steps)
        self.scale = float(scale)

    def __call__(self, step):
        step = ops.cast(step, "float32") + 1.0
        return (
            self.scale
            * self.hidden_dim**-0.5
            * ops.minimum(ops.rsqrt(step), step * self.warmup_steps**-1.5)
        )

    def get_config(self):
        return {
            "hidden_dim": self.hidden_dim,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
        }


@keras.saving.register_keras_serializable(package="translation")
class SmoothedCrossEntropy(keras.losses.Loss):
    """Cross-entropy from logits against label-smoothed sparse labels.

    The target distribution is `(1 - e) onehot(y) + e / V` (the paper's
    label smoothing, `e = 0.1`), so

        loss = (1 - e) (-log p_y) + e mean_v(-log p_v),

    `keras.losses.CategoricalCrossentropy(label_smoothing=e,
    from_logits=True)` on one-hot labels, without building them. The default
    reduction averages over the tokens whose sample weight is not 0 (the
    padding has weight 0).
    """

    def __init__(
        self, label_smoothing=0.1, reduction="mean_with_sample_weight",
        name="smoothed_cross_entropy", **kwargs,
    ):
        super().__init__(name=name, reduction=reduction, **kwargs)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        log_p = ops.log_softmax(ops.cast(y_pred, "float32"), axis=-1)  # (B, T, V)
        labels = ops.expand_dims(ops.cast(y_true, "int32"), -1)  # (B, T, 1)
        nll = -ops.squeeze(ops.take_along_axis(log_p, labels, axis=-1), -1)  # (B, T)
        uniform = -ops.mean(log_p, axis=-1)  # (B, T)
        return (1.0 - self.label_smoothing) * nll + self.label_smoothing * uniform

    def get_config(self):
        config = super().get_config()
        config["label_smoothing"] = self.label_smoothing
        return config


def compile_model(model, config, jit_compile="auto"):
    """Adam(0.9, 0.98, 1e-9) on the warm-up schedule; accuracy on real tokens."""
    schedule = InverseSquareRootSchedule(
        config.hidden_dim, config.warmup_steps, config.learning_rate_scale
    )
    optimizer = keras.optimizers.Adam(
        schedule, beta_1=config.beta_1, beta_2=config.beta_2, epsilon=config.epsilon
    )
    model.compile(
        optimizer=optimizer,
        loss=SmoothedCrossEntropy(config.label_smoothing),
        # Weighted: the sample weights leave the padding out.
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=jit_compile,
    )
    # Built now (the loss-scaling wrapper too, under float16) so that a
    # checkpoint loads into it.
    model.optimizer.build(model.trainable_variables)


# Training.


def train(model, config, datasets, output, start_step):
    """`model.fit` from `start_step` to `config.steps`, the tokenizer in each
    checkpoint; returns the seconds."""
    return common.fit_in_intervals(
        model, config, datasets, output, start_step, datasets["tokenizer"].save
    )


# Evaluation and samples.


def evaluate(model, tokenizer, pairs, config):
    """Corpus BLEU and chrF (sacrebleu) of greedy and beam-search translations.

    Returns:
        `{"greedy": {...}, "beam": {...}}`, each with `bleu`, `chrf`,
        `seconds` and `translations`.
    """
    import sacrebleu

    sources = [p.source for p in pairs]
    references = [p.target for p in pairs]
    ticker = common.Ticker(config.progress_seconds)
    results = {}
    for sampling in ("greedy", "beam"):
        label = f"beam ({config.num_beams} beams)" if sampling == "beam" else "greedy"

        def on_batch(done, total):
            if ticker.due():
                print(f"translating ({label}): {done}/{total}", flush=True)

        start = time.perf_counter()
        hypotheses = translate(
            model, tokenizer, sources, sampling, config.num_beams,
            config.length_penalty, config.eval_batch_size, on_batch,
        )
        seconds = time.perf_counter() - start
        bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
        chrf = sacrebleu.corpus_chrf(hypotheses, [references]).score
        print(
            f"test {label}: BLEU {bleu:.2f}, chrF {chrf:.2f} "
            f"({len(pairs)} pairs, {seconds:.1f} s)",
            flush=True,
        )
        results[sampling] = dict(
            bleu=bleu, chrf=chrf, seconds=seconds, translations=hypotheses
        )
    return results


def show_samples(pairs, results, count):
    """Prints `count` test pairs with their greedy and beam translations."""
    for i in np.linspace(0, len(pairs) - 1, count).astype(int) if count else []:
        pair = pairs[i]
        print(
            f"---- {pair.reference} ----\n"
            f"source:    {pair.source}\n"
            f"reference: {pair.target}\n"
            f"greedy:    {results['greedy']['translations'][i]}\n"
            f"beam:      {results['beam']['translations'][i]}",
            flush=True,
        )


def plot_cross_attention(model, tokenizer, text, path):
    """Saves the cross-attention of the last decoder block as a PNG.

    The model translates `text` greedily, then reads its own translation
    with teacher forcing; row `t` of each head is the decoder position that
    produces target token `t` (labelled by it), column `s` source token `s`.
    """
    from keras_attention.visualization import capture_attention, plot_attention

    source = np.array([tokenizer.encode_source([text])[0][: model.max_source_length]], "int32")
    generated = model.generate(
        source, model.max_target_length - 1, start_token_id=data.START_ID,
        end_token_id=data.END_ID,
    )[0]
    produced = tokenizer.target_tokens(generated)
    if data.END_ID in generated:
        produced.append("[END]")
    # [START] and the tokens before the last one produced: (1, T)
    decoder_ids = generated[None, : len(produced)]
    maps = dict(
        capture_attention(
            model, {"encoder_token_ids": source, "decoder_token_ids": decoder_ids}
        )
    )
    name = model.decoder.blocks[-1].cross_attention.path
    weights = maps[name][0]  # (H, T, S)
    figure = plot_attention(
        weights,
        query_labels=produced,
        key_labels=tokenizer.source_tokens(source[0]),
        title=f"{name}: {text}",
        columns=2,
        panel_size=max(3.0, 0.2 * max(weights.shape[1:])),
    )
    common.save_head_panels(figure, weights.shape[0], 2, path)
    print(f"cross-attention of {name} saved to {path}")


# Main.


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    config = common.config_from_args(parser, args, PRESETS, Config, options=("layout",))
    return args, config


def main(argv=None):
    args, config = parse_args(argv)
    output = common.begin(args, config)

    if args.prepare:
        splits, tokenizer = make_splits(config)
        data.save_prepared(args.prepare, splits, tokenizer, data_settings(config))
        print(f"data prepared in {args.prepare}")
        return None
    pipeline = common.choose_pipeline(args.pipeline)
    start_step, tokenizer = 0, None
    checkpoint = None if args.fresh else common.load_checkpoint(output)
    if checkpoint is not None:
        saved_step, saved, path = checkpoint
        tokenizer = data.PairTokenizer.load(path)
        # The data, model and schedule must be the checkpoint's; the number
        # of steps may change (the warm-up schedule does not depend on it).
        common.check_resumed_config(saved, config, output, honoured=("steps",))
        start_step = saved_step  # where the batches continue
        print(f"resuming from step {start_step} of {output}")
    print(config)

    datasets = make_data(config, start_step, tokenizer, pipeline, args.data)
    # Built, compiled, trained and evaluated inside the distribution's scope
    # (a no-op on one device).
    with distribute.scope(args.distribute, Seq2SeqTransformer):
        print(distribute.describe(args.distribute))
        return _run(args, config, output, checkpoint, start_step, datasets)


def _run(args, config, output, checkpoint, start_step, datasets):
    # Bucketed batches vary in size: padded with rows of weight 0 where
    # the devices need equal shares.
    for name in ("train_batches", "validation_batches"):
        datasets[name] = distribute.even_batches(datasets[name], args.distribute)
    tokenizer = datasets["tokenizer"]
    model = build_model(config, tokenizer)
    compile_model(model, config, jit_compile=True if args.jit else "auto")
    if checkpoint is not None:
        saved_step, _, path = checkpoint
        start_step = common.resume(model, path, saved_step)
    print(
        f"vocabularies: {tokenizer.source_vocabulary_size} source, "
        f"{tokenizer.target_vocabulary_size} target tokens; parameters: "
        f"{model.count_params():,}"
    )

    seconds = train(model, config, datasets, output, start_step)
    model.save(output / "model.keras")
    tokenizer.save(output)
    print(f"model saved to {output / 'model.keras'}")
    trained = {"model": model, "config": config, "train_seconds": seconds}
    if args.train_only:
        return trained

    results = evaluate(model, tokenizer, datasets["test"], config)
    results.update(trained)
    show_samples(datasets["test"], results, config.num_samples)
    plot_cross_attention(
        model, tokenizer, datasets["test"][0].source, output / "cross_attention.png"
    )
    print(f"bleu: {results['beam']['bleu']:.2f}")
    return results


if __name__ == "__main__":
    common.run(main, build_parser(), resumable=True)
