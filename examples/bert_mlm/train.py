"""Pretrain a BERT-style masked language model on the Bible, then fine-tune it.

Reads top to bottom: config presets -> data (English verses, whole books
held out, a WordPiece vocabulary learned from the training books, masked
sentence pairs in `tf.data`) -> model (`BertMaskedLM`) -> optimizer (AdamW,
linear warm-up then cosine decay) -> `model.fit` with a validation loss and
a checkpoint every `eval_interval` steps -> masked-token accuracy and
perplexity on the test books beside two baselines (the most frequent token;
a unigram model) -> fine-tuning `BertClassifier` to tell a verse as
written from one with its words shuffled, from the pretrained encoder and
from scratch, each with the same budget and the learning rate its
validation books chose -> a fill-mask demo on verses of the test books -> a
picture of one layer's attention heads.

Usage:

    python examples/bert_mlm/train.py                   # --config cpu, < 20 minutes
    python examples/bert_mlm/train.py --backend jax     # or tensorflow, torch
    python examples/bert_mlm/train.py --config gpu --mixed-precision
    python examples/bert_mlm/train.py --tiny            # seconds, for tests
    python examples/bert_mlm/train.py --source file:///path/to/book.txt

A run that finds a checkpoint in `--output-dir` resumes from it (same steps,
same order of sentence pairs, optimizer state and schedule included);
`--fresh` starts over. The last line printed is `masked_accuracy: <value>`,
the share of the masked tokens of the test books predicted exactly.
"""

import dataclasses
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402
import distribute  # noqa: E402



def build_parser():
    """The command line (checked before the heavy imports below)."""
    parser = common.training_parser(
        __doc__.split("\n")[0], "bert_mlm_output",
        "text file path or URL (default: the shipped Bible)",
    )
    parser.add_argument(
        "--pretrain-only", action="store_true",
        help="stop after pretraining and the masked-LM scores (no fine-tuning, demo, picture)",
    )
    common.add_prepare_options(parser)
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import data  # noqa: E402
from keras_attention.models import BertClassifier  # noqa: E402
from keras_attention.models import BertEncoder  # noqa: E402
from keras_attention.models import BertMaskedLM  # noqa: E402

# The fill-mask demo: verses of the test books (never trained on), each with a
# content word masked, beside the word the verse has there. The first that fits
# the model is the picture's sentence.
FILL_MASK_SENTENCES = (
    ("The [MASK] loved Esther above all the women.", "king"),  # Esther 2:17
    ("I am the good [MASK]. The good shepherd lays down his life for the sheep.",
     "shepherd"),  # John 10:11
    ("Whoever believes in him should not perish, but have eternal [MASK].", "life"),  # John 3:16
    ("For everything there is a season, and a [MASK] for every purpose under heaven.",
     "time"),  # Ecclesiastes 3:1
    ("Your people shall be my people, and your [MASK] my God.", "god"),  # Ruth 1:16
)


@dataclasses.dataclass
class Config:
    # Data.
    source: str | None = None  # None: the shipped Bible (English side)
    cache_dir: str | None = None
    max_train_verses: int | None = None  # the first verses only (None: all)
    max_eval_verses: int | None = None  # per held-out split (None: all)
    vocabulary_size: int = 8000  # the learner may return fewer
    sequence_length: int = 64  # [CLS] a [SEP] b [SEP], truncated round-robin
    mask_selection_length: int = 10  # masks per pair at most (15% of 64)
    batch_size: int = 32
    # Model (BERT's layout at a quarter of BERT-mini's width squared).
    num_layers: int = 4
    num_heads: int = 4
    hidden_dim: int = 128
    intermediate_dim: int = 512
    # No dropout on the 2-core budget: a model this small, trained this
    # briefly, underfits rather than overfits (`gpu` sets its own).
    dropout: float = 0.0
    # On the attention weights alone (None: `dropout`). The `gpu` presets
    # take 0: only torch's fused kernel takes dropout (README, "On a GPU").
    attention_dropout: float | None = None
    # Pretraining: AdamW, linear warm-up then cosine decay.
    steps: int = 3000
    eval_interval: int = 300
    warmup_steps: int = 150
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    progress_seconds: float = 30.0  # a progress line at least this often
    # Fine-tuning: is a verse's word order as written, or shuffled
    # (`data.word_order_task`)? Both classifiers (on the pretrained encoder,
    # and from scratch) get the same budget: at each learning rate of the
    # sweep, at most `finetune_steps` steps, validated on the validation
    # books every `finetune_eval_interval` steps, stopped when that accuracy,
    # once above the majority class's, has not risen for `finetune_patience`
    # checks, the best weights kept. Each keeps the rate its validation liked
    # best, and only that classifier is scored on the test books.
    finetune_steps: int = 600
    finetune_eval_interval: int = 50
    finetune_patience: int = 3
    finetune_learning_rates: list[float] = dataclasses.field(
        default_factory=lambda: [1e-4, 3e-4, 1e-3, 3e-3]
    )
    # Training verses of each class, drawn from the training books.
    finetune_verses_per_class: int = 2000
    finetune_batch_size: int = 32
    finetune_sequence_length: int = 48  # [CLS] verse [SEP], truncated
    # The picture.
    attention_layer: int = -1  # the block whose heads are drawn
    seed: int = 1
    mixed_precision: str | None = None  # "bfloat16" or "float16" (loss scaling)


PRESETS = {
    # 4 blocks of width 128 on the 2-core CPU: 3,000 steps of 32 pairs of
    # up to 64 tokens, 3.4 passes over the 28,521 training pairs.
    "cpu": {},
    # BERT-base's shape on the same corpus, with longer pairs; BERT's
    # dropout on the embeddings and residual branches only, so that every
    # backend trains on its fused attention kernel. Not yet measured.
    "gpu": dict(
        sequence_length=128,
        mask_selection_length=20,
        batch_size=128,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        intermediate_dim=3072,
        attention_dropout=0.0,
        steps=10000,
        eval_interval=1000,
        warmup_steps=1000,
        dropout=0.1,
        learning_rate=2e-4,
        finetune_steps=2000,
        finetune_eval_interval=100,
        finetune_learning_rates=[1e-5, 3e-5, 1e-4],
    ),
    "tiny": dict(
        max_train_verses=600,
        max_eval_verses=40,
        vocabulary_size=300,
        sequence_length=24,
        mask_selection_length=4,
        batch_size=8,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        steps=6,
        eval_interval=3,
        warmup_steps=2,
        finetune_steps=4,
        finetune_eval_interval=2,
        finetune_patience=1,
        finetune_learning_rates=[1e-3, 3e-3],
        finetune_verses_per_class=16,
        finetune_batch_size=8,
        finetune_sequence_length=16,
        progress_seconds=0.0,
    ),
}


# Data.


# The options that shape the prepared data (`--prepare`, `--data`).
DATA_OPTIONS = ("source", "max_train_verses", "max_eval_verses", "vocabulary_size")


def make_splits(config, vocabulary=None):
    """The verse splits (a dict of `data.PREPARED_SPLITS`) and the vocabulary
    (learned from the training verses unless given)."""
    verses = data.load_verses(config.source, config.cache_dir)
    validation_books, test_books = data.default_held_out_books(verses)
    train, validation, test = data.split_verses(verses, validation_books, test_books)
    splits = dict(
        train=train[: config.max_train_verses],
        validation=validation[: config.max_eval_verses],
        test=test[: config.max_eval_verses],
    )
    if vocabulary is None:
        start = time.perf_counter()
        vocabulary = data.Vocabulary.fit([v.text for v in splits["train"]],
                                         config.vocabulary_size)
        print(
            f"learned a WordPiece vocabulary of {vocabulary.size} tokens (asked "
            f"{config.vocabulary_size}) from {len(splits['train'])} verses in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    print(
        f"held-out books: validation {list(validation_books)}, test {list(test_books)}",
        flush=True,
    )
    return splits, vocabulary


def make_data(config, start_step=0, vocabulary=None, pipeline="tf.data", prepared=None):
    """The verse splits, the vocabulary and the batches.

    Args:
        pipeline: `"tf.data"` (tokenizes with KerasHub's WordPiece) or
            `"arrays"` (numpy batches of token ids, `data.pair_arrays`).
        prepared: a folder `--prepare` wrote (`data.save_prepared`).

    Returns:
        A dict: `train`, `validation`, `test` (lists of `data.Verse`),
        `vocabulary` (learned from `train` unless given or prepared),
        `train_batches` (endless, from `start_step`), `validation_batches`,
        `test_batches` (one pass each, masks drawn once).
    """
    ids = None
    if prepared is not None:
        splits, prepared_vocabulary, ids, settings = data.load_prepared(prepared)
        common.check_prepared_settings(
            settings, {name: getattr(config, name) for name in DATA_OPTIONS}, prepared
        )
        if vocabulary is not None and vocabulary.tokens != prepared_vocabulary.tokens:
            raise ValueError(
                f"The checkpoint's vocabulary differs from the one in {prepared}. "
                f"Received: data={str(prepared)!r}"
            )
        vocabulary = prepared_vocabulary
    else:
        common.require_tensorflow_or_prepared(prepared)
        splits, vocabulary = make_splits(config, vocabulary)

    def batches(split, **kwargs):
        if pipeline == "arrays":
            split_ids = ids[split] if ids is not None else vocabulary.encode_texts(
                [v.text for v in splits[split]]
            )
            if kwargs.get("shuffle", True):
                kwargs["num_batches"] = max(config.steps - start_step, 1)
            return data.pair_arrays(
                *data.sentence_pair_ids(splits[split], split_ids), vocabulary.size,
                config.sequence_length, config.batch_size, config.mask_selection_length,
                config.seed, **kwargs,
            )
        return data.pair_batches(
            data.sentence_pairs(splits[split]), vocabulary, config.sequence_length,
            config.batch_size, config.mask_selection_length, config.seed, **kwargs,
        )

    train = splits["train"]
    print(
        f"verses: {len(train)} train ({len(data.sentence_pairs(train))} pairs), "
        f"{len(splits['validation'])} validation, {len(splits['test'])} test ({pipeline})",
        flush=True,
    )
    return dict(
        **splits, vocabulary=vocabulary,
        train_batches=batches("train", start_step=start_step),
        validation_batches=batches("validation", shuffle=False),
        test_batches=batches("test", shuffle=False),
    )


# Model and optimizer.


def model_arguments(config, vocabulary):
    return dict(
        vocabulary_size=vocabulary.size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        max_sequence_length=config.sequence_length,
        seed=config.seed,
    )


def build_model(config, vocabulary):
    model = BertMaskedLM(**model_arguments(config, vocabulary))
    model.build()
    return model


def adamw(learning_rate, steps, warmup_steps, weight_decay):
    """AdamW (BERT's betas and epsilon) on a linear warm-up to
    `learning_rate`, then a cosine decay to 0; no decay on biases and norms."""
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(steps - warmup_steps, 1), warmup_target=learning_rate,
        warmup_steps=warmup_steps,
    )
    optimizer = keras.optimizers.AdamW(
        schedule, weight_decay=weight_decay, beta_1=0.9, beta_2=0.999, epsilon=1e-6
    )
    optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    return optimizer


def compile_model(model, config, jit_compile="auto"):
    optimizer = adamw(config.learning_rate, config.steps, config.warmup_steps,
                      config.weight_decay)
    model.compile(
        optimizer=optimizer,
        # The weights are 1 on real masks, 0 on the padding of
        # `mask_positions`: the mean runs over the real masks only.
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=jit_compile,
    )
    # Built now (the loss-scaling wrapper too, under float16) so that a
    # checkpoint loads into it.
    model.optimizer.build(model.trainable_variables)


# Pretraining.


def train(model, config, datasets, output, start_step):
    """`model.fit` from `start_step` to `config.steps`, the vocabulary in
    each checkpoint; returns the seconds."""
    return common.fit_in_intervals(
        model, config, datasets, output, start_step, datasets["vocabulary"].save
    )


# Evaluation.


def _log_softmax(logits):
    logits = logits - logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def evaluate(model, batches, counts):
    """Masked-token accuracy and perplexity on `batches`, and the baselines.

    Every masked token counts once (the weights leave out the padding of
    `mask_positions`). Baselines from the training counts: always the most
    frequent token; a unigram model (add-one smoothed frequencies, special
    tokens excluded), whose best guess is that same token.

    Returns:
        A dict: `masks`, `accuracy`, `perplexity`, `most_frequent_accuracy`,
        `unigram_perplexity`.
    """
    counts = counts.astype("float64").copy()
    counts[: len(data.RESERVED_TOKENS)] = 0
    unigram = np.log((counts + 1) / (counts + 1)[len(data.RESERVED_TOKENS):].sum())
    unigram[: len(data.RESERVED_TOKENS)] = -np.inf
    most_frequent = int(np.argmax(counts))
    total = correct = nll = frequent = unigram_nll = 0.0
    for x, labels, weights in common.numpy_batches(batches):
        log_p = _log_softmax(np.asarray(model.predict_on_batch(x), "float64"))  # (B, M, V)
        real = weights > 0
        labels = labels[real]
        log_p = log_p[real]  # (N, V)
        total += len(labels)
        correct += (log_p.argmax(-1) == labels).sum()
        nll -= log_p[np.arange(len(labels)), labels].sum()
        frequent += (labels == most_frequent).sum()
        unigram_nll -= unigram[labels].sum()
    return dict(
        masks=int(total),
        accuracy=correct / total,
        perplexity=math.exp(nll / total),
        most_frequent_token=most_frequent,
        most_frequent_accuracy=frequent / total,
        unigram_perplexity=math.exp(unigram_nll / total),
    )


# Fine-tuning.


def word_order_split(verses, seed, count=None):
    """`data.word_order_task` of `count` verses drawn at random (all, in
    order, without `count`): `(texts, labels)`."""
    if count is not None and count < len(verses):
        picks = np.random.default_rng(seed).permutation(len(verses))[:count]
        verses = [verses[i] for i in sorted(picks)]
    return data.word_order_task(verses, seed)


class StopOnceAboveMajority(keras.callbacks.EarlyStopping):
    """Keras's `EarlyStopping` whose patience runs only once the monitored
    accuracy is above `floor` (the majority class's share, with a margin): a
    classifier that has not yet learned more than the majority class (a flat
    start, common from scratch) trains its whole budget."""

    def __init__(self, floor, **kwargs):
        super().__init__(**kwargs)
        self.floor = floor

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.best <= self.floor:
            self.wait, self.stopped_epoch = 0, 0
            self.model.stop_training = False


def fine_tune(config, vocabulary, splits, learning_rate, pretrained=None,
               distribute_kind=None):
    """Trains a word-order classifier from the encoder of `pretrained` (a
    `BertMaskedLM`) or from scratch at `learning_rate`: at most
    `finetune_steps` steps, validated every `finetune_eval_interval` steps on
    `splits["validation"]`, stopped after `finetune_patience` checks without
    a better validation accuracy once it is above `splits["floor"]` (the
    majority class's share of the validation verses and one verse),
    ending with the best weights (`StopOnceAboveMajority`). Returns
    `(classifier, validation accuracy, steps)`."""
    if pretrained is not None:
        classifier = BertClassifier.from_masked_lm(pretrained, num_classes=2, seed=config.seed)
    else:
        # The same seed: every run starts from the same draws.
        keras.utils.set_random_seed(config.seed)
        encoder = BertEncoder(**model_arguments(config, vocabulary))
        classifier = BertClassifier(encoder, num_classes=2, seed=config.seed)
        classifier.build()
    warmup = max(config.finetune_steps // 10, 1)
    classifier.compile(
        optimizer=adamw(learning_rate, config.finetune_steps, warmup, config.weight_decay),
        # Over the weighted verses: the rows that pad a batch for several
        # devices weigh 0 (`distribute.even_batches`).
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    batches = data.word_order_batches(
        *splits["train"], vocabulary, config.finetune_sequence_length,
        config.finetune_batch_size, seed=config.seed,
    )
    stopping = StopOnceAboveMajority(
        splits["floor"], monitor="val_accuracy", mode="max",
        patience=config.finetune_patience, restore_best_weights=True,
    )
    interval = config.finetune_eval_interval
    history = classifier.fit(
        batches, epochs=config.finetune_steps // interval, steps_per_epoch=interval,
        validation_data=splits["validation"], callbacks=[stopping], verbose=0, shuffle=False,
    )
    accuracy = max(history.history["val_accuracy"])
    return classifier, accuracy, (stopping.best_epoch + 1) * interval


def compare_fine_tuning(config, vocabulary, datasets, pretrained, distribute_kind=None):
    """Fine-tunes a classifier on the pretrained encoder and one from
    scratch, each at every learning rate of `finetune_learning_rates`; each
    keeps the rate with the best validation accuracy, which alone is scored
    on the test books. Returns `{"pretrained": accuracy, "from scratch":
    accuracy, "majority": the majority class's share of the test verses}`."""
    splits = {"train": word_order_split(
        datasets["train"], config.seed, 2 * config.finetune_verses_per_class
    )}
    length, batch_size = config.finetune_sequence_length, config.finetune_batch_size
    shares = {}  # the majority class's share of each split
    for offset, name in enumerate(("validation", "test"), start=1):
        texts, labels = word_order_split(datasets[name], config.seed + offset)
        batches = data.word_order_batches(texts, labels, vocabulary, length, batch_size)
        splits[name] = distribute.even_batches(batches, distribute_kind)
        shares[name] = max(np.mean(labels), 1 - np.mean(labels))
    majority = shares["test"]
    # Above the majority class by at least one validation verse (the metric
    # is float32: the majority's own accuracy can round above its share).
    splits["floor"] = shares["validation"] + 1 / len(datasets["validation"])
    print(
        f"fine-tuning: is the word order as written or shuffled, "
        f"{len(splits['train'][0])} training verses (half shuffled), "
        f"{len(datasets['validation'])} validation verses to choose the learning rate and "
        f"stop, {len(datasets['test'])} test verses (majority class {majority:.4f})",
        flush=True,
    )
    results = {"majority": majority}
    for label, source in (("pretrained", pretrained), ("from scratch", None)):
        best = None
        for rate in config.finetune_learning_rates:
            start = time.perf_counter()
            classifier, accuracy, steps = fine_tune(
                config, vocabulary, splits, rate, source, distribute_kind
            )
            print(
                f"  {label}, learning rate {rate:g}: validation accuracy {accuracy:.4f} "
                f"(best at step {steps}, {time.perf_counter() - start:.1f} s)",
                flush=True,
            )
            if best is None or accuracy > best[1]:
                best = (classifier, accuracy, rate)
        _, results[label] = best[0].evaluate(splits["test"], verbose=0)
        print(f"fine-tuned ({label}, learning rate {best[2]:g}): test accuracy "
              f"{results[label]:.4f}", flush=True)
    return results


# Samples.


def fill_mask(model, vocabulary, sentence, top_k=5):
    """The `top_k` tokens and probabilities for each `[MASK]` of `sentence`,
    printed; returns `[(tokens, probabilities)]`, one per mask."""
    ids = [data.CLS_ID] + vocabulary.encode(sentence) + [data.SEP_ID]
    results = []
    print(f"fill-mask: {sentence}")
    for position, top, probabilities in model.fill_mask(np.array([ids]), data.MASK_ID, top_k)[0]:
        tokens = [vocabulary.tokens[i] for i in top]
        print(f"  [MASK] at position {position}:")
        for rank, (token, probability) in enumerate(zip(tokens, probabilities), start=1):
            print(f"    {rank}. {token} {probability:.3f}")
        results.append((tokens, probabilities))
    return results


def fill_mask_demo(model, vocabulary, picture, layer):
    """`fill_mask` on each of `FILL_MASK_SENTENCES` that fits the model, with
    the rank of the verse's own word; then the attention of block `layer`
    on the first of them, `[MASK]` and all (where the mask's row shows what
    the model reads to fill it), saved to `picture`."""
    found, fitting = 0, []
    for sentence, answer in FILL_MASK_SENTENCES:
        length = len(vocabulary.encode(sentence)) + 2  # [CLS] ... [SEP]
        if length > model.max_sequence_length:
            print(f"fill-mask: {sentence}\n  skipped: {length} tokens, the model takes "
                  f"{model.max_sequence_length}")
            continue
        [(tokens, _)] = fill_mask(model, vocabulary, sentence)
        found += answer in tokens
        fitting.append(sentence)
        print(f"  the verse has {answer!r}: {_rank(answer, tokens, vocabulary)}")
    print(f"fill-mask: the verse's word in the top 5 for {found} of {len(FILL_MASK_SENTENCES)}")
    if fitting:
        plot_attention_heads(model, vocabulary, fitting[0], layer, picture)


def _rank(answer, tokens, vocabulary):
    if answer in tokens:
        return f"rank {tokens.index(answer) + 1}"
    if answer not in vocabulary.tokens:
        return "not one token of the vocabulary"
    return f"not in the top {len(tokens)}"


def plot_attention_heads(model, vocabulary, sentence, layer, path):
    """Saves the attention of every head of block `layer` on `sentence`
    (`[CLS] sentence [SEP]`) as a PNG, rows the queries, columns the keys."""
    from keras_attention.visualization import capture_attention, plot_attention

    ids = np.array([[data.CLS_ID] + vocabulary.encode(sentence) + [data.SEP_ID]], "int32")
    # The encoder alone: the masked-LM model computes its last block at the
    # mask positions only, so its maps there would have those rows alone.
    maps = dict(capture_attention(model.encoder, {"token_ids": ids}))
    name = model.encoder.encoder.blocks[layer].self_attention.path
    weights = maps[name][0]  # (H, T, T)
    tokens = [vocabulary.tokens[i] for i in ids[0]]
    figure = plot_attention(
        weights, query_labels=tokens, key_labels=tokens, title=f"{name}: {sentence}",
        columns=2, panel_size=max(3.0, 0.3 * len(tokens)),
    )
    common.save_head_panels(figure, weights.shape[0], 2, path)
    print(f"attention of {name} saved to {path}")


# Main.


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    return args, common.config_from_args(parser, args, PRESETS, Config)


def main(argv=None):
    args, config = parse_args(argv)
    output = common.begin(args, config)
    began = time.perf_counter()

    if args.prepare:
        splits, vocabulary = make_splits(config)
        settings = {name: getattr(config, name) for name in DATA_OPTIONS}
        data.save_prepared(args.prepare, splits, vocabulary, settings)
        print(f"data prepared in {args.prepare}")
        return None
    pipeline = common.choose_pipeline(args.pipeline)
    if not common.tensorflow_installed() and not args.pretrain_only:
        # Fine-tuning, the fill-in demo and the picture tokenize new text.
        raise ValueError(
            "Without TensorFlow only `--pretrain-only` runs. Received: pretrain_only=False"
        )
    start_step, vocabulary = 0, None
    checkpoint = None if args.fresh else common.load_checkpoint(output)
    if checkpoint is not None:
        saved_step, saved, path = checkpoint
        vocabulary = data.Vocabulary.load(path)
        # A resumed run continues the run it finds: every option must be
        # that run's (the cosine decay depends on the steps, the data and
        # model on the rest).
        common.check_resumed_config(saved, config, output)
        start_step = saved_step  # where the pairs continue
        print(f"resuming from step {start_step} of {output}")
    print(config)

    datasets = make_data(config, start_step, vocabulary, pipeline, args.data)
    vocabulary = datasets["vocabulary"]
    # Built, compiled and trained inside the distribution's scope (a no-op
    # on one device).
    with distribute.scope(args.distribute, BertMaskedLM):
        print(distribute.describe(args.distribute))
        return _run(args, config, output, checkpoint, start_step, datasets, began)


def _run(args, config, output, checkpoint, start_step, datasets, began):
    for name in ("validation_batches", "test_batches"):
        datasets[name] = distribute.even_batches(datasets[name], args.distribute)
    vocabulary = datasets["vocabulary"]
    model = build_model(config, vocabulary)
    compile_model(model, config, jit_compile=True if args.jit else "auto")
    if checkpoint is not None:
        saved_step, _, path = checkpoint
        start_step = common.resume(model, path, saved_step)
    print(f"vocabulary: {vocabulary.size} tokens; parameters: {model.count_params():,}")

    seconds = train(model, config, datasets, output, start_step)
    model.save(output / "model.keras")
    vocabulary.save(output)
    print(f"model saved to {output / 'model.keras'}")

    counts = vocabulary.counts([v.text for v in datasets["train"]])
    results = evaluate(model, datasets["test_batches"], counts)
    results.update(model=model, config=config, train_seconds=seconds)
    print(
        f"test ({results['masks']} masked tokens): masked accuracy "
        f"{results['accuracy']:.4f}, perplexity {results['perplexity']:.2f}; baselines: "
        f"most frequent token ({vocabulary.tokens[results['most_frequent_token']]!r}) "
        f"accuracy {results['most_frequent_accuracy']:.4f}, unigram perplexity "
        f"{results['unigram_perplexity']:.2f}",
        flush=True,
    )

    if args.pretrain_only:
        print(f"masked_accuracy: {results['accuracy']:.4f}")
        return results
    scores = compare_fine_tuning(config, vocabulary, datasets, model, args.distribute)
    print(
        f"word-order accuracy: pretrained {scores['pretrained']:.4f}, from scratch "
        f"{scores['from scratch']:.4f}, majority class {scores['majority']:.4f}"
    )

    fill_mask_demo(model, vocabulary, output / "attention.png", config.attention_layer)
    print(f"total {time.perf_counter() - began:.0f} s")
    print(f"masked_accuracy: {results['accuracy']:.4f}")
    return results


if __name__ == "__main__":
    common.run(main, build_parser(), resumable=True)
