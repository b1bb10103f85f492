"""The BERT example's data: verses, book splits, WordPiece, masked sentence pairs.

- `load_verses`: the English side of the shipped Bible pairs
  (`examples/data/web_rv1909.tsv.gz`, `book:chapter:verse<TAB>english<TAB>
  spanish`), or any text file (a path, or an `http(s)://` or `file://` URL
  downloaded once into a cache directory), one sentence a line. Each line
  becomes a `Verse(reference, book, text)`; a plain text file has no books,
  so its lines are cut into `NUM_BLOCKS` consecutive blocks that stand for
  them.
- `split_verses`: validation and test hold out WHOLE books: neighbouring
  verses repeat each other, so a random verse split would test on near
  copies of training verses. The Bible's held-out books are the translation
  example's (the reasons are in `examples/translation/data.py`).
- `Vocabulary`: a WordPiece vocabulary learned from the training verses
  with `keras_hub.tokenizers.compute_word_piece_vocabulary`, and the
  `keras_hub.tokenizers.WordPieceTokenizer` that reads it (lowercased, as
  BERT's uncased models); saved one token a line.
- `pair_batches`: `tf.data` batches of sentence pairs (each verse with the
  verse after it in the same book, `[CLS] a [SEP] b [SEP]` with segment ids
  0 then 1), tokenized inside the pipeline and masked by `mask_tokens`
  (`keras_hub.layers.MaskedLMMaskGenerator`'s rules, 15% of the tokens, of
  those 80% become `[MASK]`, 10% a random token, 10% stay, drawn from a seed
  per batch so that a resumed run sees the same masks): `({"token_ids",
  "segment_ids", "padding_mask", "mask_positions"}, mask_ids, mask_weights)`,
  what `keras_hub.models.BertMaskedLMPreprocessor` makes.
- `word_order_task` and `word_order_batches`: the fine-tuning task, single
  verses labelled by whether their words stand as written (1) or were put in
  a random order (0).
"""

import collections
import gzip
import pathlib
import re
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402

# The translation example's copy: its English side is this example's text.
DEFAULT_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "data" / "web_rv1909.tsv.gz"
CACHE_SUBDIR = "bert_mlm"

Verse = collections.namedtuple("Verse", ["reference", "book", "text"])
Verse.__doc__ = """One line of text: `reference` (`"book:chapter:verse"`, or the
line number from 1 for a plain text), `book` (1 Genesis .. 66 Revelation, or
the block number of a plain text) and `text`."""

# Held out as in the translation example. Validation: Joshua (6), Romans
# (45). Test: Ruth (8), Esther (17), Ecclesiastes (21), John (43).
BIBLE_VALIDATION_BOOKS = (6, 45)
BIBLE_TEST_BOOKS = (8, 17, 21, 43)
# A plain text: 100 consecutive blocks; the 5th and 55th validate, the 10th,
# 35th, 60th and 85th test.
NUM_BLOCKS = 100
BLOCK_VALIDATION_BOOKS = (5, 55)
BLOCK_TEST_BOOKS = (10, 35, 60, 85)

RESERVED_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)

_REFERENCE = re.compile(r"\d+:\d+:\d+")


# Verses.


def read_text(source=None, cache_dir=None):
    """The text of `source` (see `load_verses`), decoded as UTF-8."""
    path = common.local_path(
        DEFAULT_SOURCE if source is None else source, cache_dir,
        cache_subdir=CACHE_SUBDIR, default_name="corpus.txt",
    )
    if not path.is_file():
        raise ValueError(f"`source` does not exist. Received: source={str(path)!r}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def parse_verses(text):
    """The `Verse`s of `text`: the Bible layout if the first field of the
    first line is a `book:chapter:verse` reference (the second field is the
    English), else one verse per non-empty line in `NUM_BLOCKS` blocks."""
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and _REFERENCE.fullmatch(lines[0].split("\t", 1)[0]):
        verses = []
        for number, line in enumerate(lines, start=1):
            fields = line.split("\t")
            if len(fields) < 2 or not _REFERENCE.fullmatch(fields[0]):
                raise ValueError(
                    "A line of a Bible file must read `book:chapter:verse<TAB>"
                    f"english[<TAB>...]`. Received: line {number}: {line[:80]!r}"
                )
            book = int(fields[0].split(":", 1)[0])
            verses.append(Verse(fields[0], book, fields[1].strip()))
        return verses
    return [
        Verse(str(i + 1), i * NUM_BLOCKS // len(lines), line.strip())
        for i, line in enumerate(lines)
    ]


def load_verses(source=None, cache_dir=None):
    """The `Verse`s of `source`: `None` for the shipped Bible; a path; or a
    URL, downloaded once into `cache_dir/CACHE_SUBDIR` (default
    `~/.keras/datasets`) and read from there afterwards. `.gz` files are
    decompressed."""
    return parse_verses(read_text(source, cache_dir))


def is_bible(verses):
    return bool(verses) and all(_REFERENCE.fullmatch(v.reference) for v in verses)


def default_held_out_books(verses):
    """`(validation_books, test_books)` for the layout of `verses`."""
    if is_bible(verses):
        return BIBLE_VALIDATION_BOOKS, BIBLE_TEST_BOOKS
    return BLOCK_VALIDATION_BOOKS, BLOCK_TEST_BOOKS


def split_verses(verses, validation_books=None, test_books=None):
    """`(train, validation, test)`: whole books held out, in file order."""
    default_validation, default_test = default_held_out_books(verses)
    validation_books = set(default_validation if validation_books is None else validation_books)
    test_books = set(default_test if test_books is None else test_books)
    if validation_books & test_books:
        raise ValueError(
            "A book cannot both validate and test. Received: books "
            f"{sorted(validation_books & test_books)} in both"
        )
    splits = ([], [], [])
    for verse in verses:
        index = 1 if verse.book in validation_books else 2 if verse.book in test_books else 0
        splits[index].append(verse)
    return splits


# Tokens.


class Vocabulary:
    """A WordPiece vocabulary and its tokenizer (lowercased, punctuation
    split off); the reserved tokens first (`[PAD]` 0, `[UNK]` 1, `[CLS]` 2,
    `[SEP]` 3, `[MASK]` 4)."""

    def __init__(self, tokens):
        self.tokens = list(tokens)
        if tuple(self.tokens[: len(RESERVED_TOKENS)]) != RESERVED_TOKENS:
            raise ValueError(
                f"`tokens` must start with {list(RESERVED_TOKENS)}. Received: "
                f"{self.tokens[: len(RESERVED_TOKENS)]}"
            )
        # Ids of texts tokenized before (`remember`): prepared data, read
        # where KerasHub's WordPiece (and so TensorFlow) is absent.
        self.known = {}
        self._tokenizer = None

    @property
    def tokenizer(self):
        """KerasHub's WordPiece tokenizer, made on first use (it needs
        TensorFlow and tensorflow-text)."""
        if self._tokenizer is None:
            import keras_hub

            self._tokenizer = keras_hub.tokenizers.WordPieceTokenizer(
                vocabulary=self.tokens, lowercase=True, oov_token="[UNK]", dtype="int32"
            )
        return self._tokenizer

    def remember(self, texts, ids):
        """Records the ids of `texts`, so that encoding them needs no WordPiece."""
        self.known.update(zip(texts, (list(map(int, x)) for x in ids)))

    def encode_texts(self, texts):
        """The ids of each of `texts`, lists."""
        texts = list(texts)
        if all(text in self.known for text in texts):
            return [list(self.known[text]) for text in texts]
        return [list(map(int, ids)) for ids in self.tokenizer.tokenize(texts)]

    @classmethod
    def fit(cls, texts, size):
        """Learned from `texts` with at most `size` tokens (the learner
        keeps what it finds often enough, so it may return fewer)."""
        import keras_hub
        import tensorflow as tf

        dataset = tf.data.Dataset.from_tensor_slices(list(texts)).batch(1024)
        return cls(
            keras_hub.tokenizers.compute_word_piece_vocabulary(
                dataset, size, lowercase=True, reserved_tokens=list(RESERVED_TOKENS)
            )
        )

    @property
    def size(self):
        return len(self.tokens)

    def encode(self, text):
        """The ids of `text`, a list; `"[MASK]"` in it becomes `MASK_ID`."""
        parts = text.split("[MASK]")
        ids = []
        for i, part in enumerate(parts):
            if i:
                ids.append(MASK_ID)
            if part.strip():
                ids += [int(t) for t in self.tokenizer.tokenize(part)]
        return ids

    def counts(self, texts):
        """How often each id occurs in `texts` (an int64 array of `size`)."""
        counts = np.zeros(self.size, "int64")
        for ids in self.encode_texts(texts):
            np.add.at(counts, np.asarray(ids, "int64"), 1)
        return counts

    def save(self, directory):
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "vocabulary.txt").write_text(
            "".join(t + "\n" for t in self.tokens), encoding="utf-8"
        )

    @classmethod
    def load(cls, directory):
        path = pathlib.Path(directory) / "vocabulary.txt"
        return cls(path.read_text(encoding="utf-8").splitlines())


# Batches.


def sentence_pairs(verses):
    """`(first, second)` texts: each verse and the next verse of its book
    (the last verse of a book has none and is left out)."""
    return [
        (a.text, b.text) for a, b in zip(verses, verses[1:]) if a.book == b.book
    ]


def sentence_pair_ids(verses, ids):
    """The ids of `sentence_pairs(verses)`, `(firsts, seconds)`, from the ids
    of each verse."""
    kept = [(x, y) for a, b, x, y in zip(verses, verses[1:], ids, ids[1:]) if a.book == b.book]
    return [x for x, _ in kept], [y for _, y in kept]


PREPARED_SPLITS = ("train", "validation", "test")


def save_prepared(directory, splits, vocabulary, settings):
    """Writes what training needs into `directory`: `vocabulary.txt`,
    `verses.json.gz` (the verses of each split), `ids.npz` (the ids of every
    verse, `common.save_id_lists`) and `settings.json` (the options that
    made them)."""
    import json

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocabulary.save(directory)
    common.save_id_lists(directory / "ids.npz", {
        name: vocabulary.encode_texts([v.text for v in splits[name]])
        for name in PREPARED_SPLITS
    })
    verses = {name: [list(v) for v in splits[name]] for name in PREPARED_SPLITS}
    with gzip.open(directory / "verses.json.gz", "wt", encoding="utf-8") as f:
        json.dump(verses, f, ensure_ascii=False)
    (directory / "settings.json").write_text(json.dumps(settings, sort_keys=True))


def load_prepared(directory):
    """What `save_prepared` wrote: `(splits, vocabulary, ids, settings)`, the
    verses' ids remembered by the vocabulary."""
    import json

    directory = common.check_prepared(
        directory, ("ids.npz", "verses.json.gz", "settings.json", "vocabulary.txt")
    )
    vocabulary = Vocabulary.load(directory)
    ids = common.load_id_lists(directory / "ids.npz")
    with gzip.open(directory / "verses.json.gz", "rt", encoding="utf-8") as f:
        verses = json.load(f)
    splits = {name: [Verse(*v) for v in verses[name]] for name in PREPARED_SPLITS}
    for name in PREPARED_SPLITS:
        vocabulary.remember([v.text for v in splits[name]], ids[name])
    settings = json.loads((directory / "settings.json").read_text())
    return splits, vocabulary, ids, settings


def _packer(sequence_length):
    import keras_hub

    return keras_hub.layers.MultiSegmentPacker(
        sequence_length=sequence_length, start_value=CLS_ID, end_value=SEP_ID,
        pad_value=PAD_ID,
    )


def mask_tokens(token_ids, seed, vocabulary_size, mask_selection_length,
                mask_selection_rate=0.15, mask_token_rate=0.8, random_token_rate=0.1):
    """BERT's masking of a packed batch, as a pure function of `seed`.

    The rules of `keras_hub.layers.MaskedLMMaskGenerator` (and of the
    `tensorflow_text` selector it wraps): in each row, `ceil(rate * n)` of
    the `n` selectable tokens (not `[PAD]`, `[CLS]`, `[SEP]`), at most
    `mask_selection_length`, chosen uniformly; of those, `mask_token_rate`
    become `[MASK]`, `random_token_rate` a token drawn uniformly from the
    vocabulary, the rest stay. KerasHub's generator draws from TensorFlow's
    stateful random ops inside a parallel `map_fn`, so its masks differ from
    run to run and a resumed run could not see the batches the uninterrupted
    run saw; these are drawn by numpy's generator seeded with `seed`, in
    numpy, so that both pipelines mask alike.

    Args:
        token_ids: int `(B, L)` numpy array.
        seed: a pair of integers.

    Returns:
        The generator's dict of numpy arrays: `token_ids` (masked),
        `mask_positions` (sorted, padded with 0), `mask_ids` (the original
        tokens, padded with 0) and `mask_weights` (1.0 for a real mask, 0.0
        for padding), the last three `(B, mask_selection_length)`.
    """
    token_ids = np.asarray(token_ids, "int32")
    batch, length = token_ids.shape
    # Evaluation batches count down from -1: numpy's seeds are unsigned.
    rng = np.random.default_rng([int(x) % 2**64 for x in np.asarray(seed).reshape(-1)])
    selectable = ~np.isin(token_ids, (PAD_ID, CLS_ID, SEP_ID))  # (B, L)
    count = np.ceil(selectable.sum(axis=1) * mask_selection_rate).astype("int64")
    count = np.minimum(count, mask_selection_length)  # (B,)
    # A random order of the selectable positions (the others sort last);
    # the first `count` of each row are chosen, then sorted.
    keys = np.where(selectable, rng.random((batch, length)), 2.0)
    order = np.argsort(keys, axis=1, kind="stable")[:, :mask_selection_length]  # (B, M)
    chosen = np.arange(order.shape[1])[None, :] < count[:, None]
    positions = np.sort(np.where(chosen, order, length), axis=1)
    weights = positions < length
    positions = np.where(weights, positions, 0)
    mask_ids = np.where(weights, np.take_along_axis(token_ids, positions, axis=1), 0)
    draw = rng.random(positions.shape)
    random_ids = rng.integers(0, vocabulary_size, positions.shape)
    replacement = np.where(
        draw < mask_token_rate,
        MASK_ID,
        np.where(draw < mask_token_rate + random_token_rate, random_ids, mask_ids),
    )
    masked = token_ids.copy()
    rows = np.nonzero(weights)
    masked[rows[0], positions[rows]] = replacement[rows]
    if positions.shape[1] < mask_selection_length:  # fewer tokens than masks
        pad = ((0, 0), (0, mask_selection_length - positions.shape[1]))
        positions, mask_ids, weights = (np.pad(a, pad) for a in (positions, mask_ids, weights))
    return {
        "token_ids": masked,
        "mask_positions": positions.astype("int32"),
        "mask_ids": mask_ids.astype("int32"),
        "mask_weights": weights.astype("float32"),
    }


def pack(first, second, sequence_length):
    """`[CLS] a [SEP] b [SEP]` padded with `[PAD]` to `sequence_length`, and
    the segment ids (0 to the first `[SEP]`, 1 after), for lists of id
    lists: numpy `(B, L)` arrays as KerasHub's `MultiSegmentPacker` makes
    them, the segments cut round robin (one token each in turn, the first
    segment first) to fit."""
    budget = sequence_length - 3
    token_ids = np.full((len(first), sequence_length), PAD_ID, "int32")
    segment_ids = np.zeros((len(first), sequence_length), "int32")
    for row, (a, b) in enumerate(zip(first, second)):
        keep_a = min(len(a), max(-(-budget // 2), budget - len(b)))
        keep_b = min(len(b), budget - keep_a)
        ids = [CLS_ID, *a[:keep_a], SEP_ID, *b[:keep_b], SEP_ID]
        token_ids[row, : len(ids)] = ids
        segment_ids[row, keep_a + 2 : len(ids)] = 1
    return token_ids, segment_ids


def pass_order(num_pairs, seed, index):
    """The order of the pairs in training pass `index`: a permutation drawn
    by numpy's generator seeded with `(seed, index)`, in both pipelines."""
    return np.random.default_rng((seed, int(index))).permutation(num_pairs)


def masked_batch(token_ids, segment_ids, index, vocabulary_size, mask_selection_length,
                 seed, mask_selection_rate=0.15):
    """`(x, mask_ids, mask_weights)` of packed batch number `index`, masked
    with the seed `(seed, index)`."""
    masked = mask_tokens(
        token_ids, (seed, index), vocabulary_size, mask_selection_length, mask_selection_rate
    )
    x = {
        "token_ids": masked["token_ids"],
        "segment_ids": np.asarray(segment_ids, "int32"),
        "padding_mask": np.asarray(token_ids) != PAD_ID,
        "mask_positions": masked["mask_positions"],
    }
    return x, masked["mask_ids"], masked["mask_weights"]


def _pass_batches(num_pairs, batch_size):
    per_pass = num_pairs // batch_size
    if per_pass == 0:
        raise ValueError(
            f"The training text gives {num_pairs} sentence pairs, fewer than one batch of "
            f"{batch_size}: give a longer text with --source (or --tiny, with smaller batches)"
        )
    return per_pass


def pair_arrays(first_ids, second_ids, vocabulary_size, sequence_length, batch_size,
                mask_selection_length, seed, shuffle=True, start_step=0,
                mask_selection_rate=0.15, num_batches=None):
    """`pair_batches` from token ids (a list of id lists per side), through a
    `keras.utils.PyDataset`: the same batches in the same order,
    `num_batches` of them with `shuffle` (the stream is endless)."""
    def batch(rows, index):
        token_ids, segment_ids = pack(
            [first_ids[i] for i in rows], [second_ids[i] for i in rows], sequence_length
        )
        return masked_batch(token_ids, segment_ids, index, vocabulary_size,
                            mask_selection_length, seed, mask_selection_rate)

    if not shuffle:
        starts = range(0, len(first_ids), batch_size)
        rows = [range(a, min(a + batch_size, len(first_ids))) for a in starts]
        batches = [batch(r, -1 - k) for k, r in enumerate(rows)]
        return common.array_batches(batches.__getitem__, len(batches))
    per_pass = _pass_batches(len(first_ids), batch_size)

    def training_batch(i):
        step = start_step + i
        index, k = divmod(step, per_pass)
        order = pass_order(len(first_ids), seed, index)
        return batch(order[k * batch_size : (k + 1) * batch_size], step)

    return common.array_batches(training_batch, num_batches)


def pair_batches(pairs, vocabulary, sequence_length, batch_size, mask_selection_length,
                 seed, shuffle=True, start_step=0, mask_selection_rate=0.15):
    """Masked sentence-pair batches, as `BertMaskedLMPreprocessor` makes them.

    With `shuffle` (training) the stream is endless: each pass over the
    pairs is in `pass_order(len(pairs), seed, pass)` and
    drops its last partial batch, and batch `k` is masked by `mask_tokens`
    with the seed `(seed, k)`, so the stream made with `start_step=k`
    continues with exactly the batches an uninterrupted run sees from step
    `k`. Without it: one pass in order, the last batch partial, batch `k`
    masked with the seed `(seed, -1 - k)`, so every evaluation (and every
    run) sees the same masks.

    Returns:
        A `tf.data.Dataset` of `(x, mask_ids, mask_weights)`: `x` the dict
        of `token_ids`, `segment_ids`, `padding_mask` (bool) and
        `mask_positions`, each `(B, sequence_length)` or `(B,
        mask_selection_length)`.
    """
    import tensorflow as tf

    # Made here, eagerly: KerasHub's tokenizer holds lookup tables that a
    # tokenizer first made inside a traced `map` would leave in its graph.
    tokenizer = vocabulary.tokenizer
    first = tf.constant([a for a, _ in pairs])
    second = tf.constant([b for _, b in pairs])
    packer = _packer(sequence_length)

    def mask(token_ids, segment_ids, index):  # numpy
        x, mask_ids, mask_weights = masked_batch(
            token_ids, segment_ids, index, vocabulary.size, mask_selection_length, seed,
            mask_selection_rate,
        )
        return (*x.values(), mask_ids, mask_weights)

    def preprocess(index, texts):  # (), ((B,), (B,)) strings
        token_ids, segment_ids = packer(tuple(tokenizer(t) for t in texts))
        values = tf.numpy_function(
            mask, [token_ids, segment_ids, index],
            ("int32", "int32", "bool", "int32", "int32", "float32"),
        )
        shapes = [(sequence_length,)] * 3 + [(mask_selection_length,)] * 3
        values = [tf.ensure_shape(v, (None, *shape)) for v, shape in zip(values, shapes)]
        x = dict(zip(("token_ids", "segment_ids", "padding_mask", "mask_positions"), values))
        return x, values[4], values[5]

    def one_pass(index):
        order = tf.numpy_function(
            lambda i: pass_order(len(pairs), seed, i), [index], tf.int64
        )
        order = tf.ensure_shape(order, (len(pairs),))
        return tf.data.Dataset.from_tensor_slices(
            (tf.gather(first, order), tf.gather(second, order))
        ).batch(batch_size, drop_remainder=True)

    if not shuffle:
        dataset = tf.data.Dataset.from_tensor_slices((first, second)).batch(batch_size)
        dataset = tf.data.Dataset.zip(tf.data.Dataset.range(-1, -(2**62), -1), dataset)
        dataset = dataset.map(preprocess).cache().prefetch(tf.data.AUTOTUNE)
        return common.without_autotuning(dataset)
    per_pass = _pass_batches(len(pairs), batch_size)
    first_pass, skip = divmod(start_step, per_pass)
    batches = tf.data.Dataset.range(first_pass, 2**62).flat_map(one_pass).skip(skip)
    return common.without_autotuning(
        tf.data.Dataset.zip(tf.data.Dataset.range(start_step, 2**62), batches)
        .map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )


def word_order_task(verses, seed):
    """The fine-tuning task: `(texts, labels)`, one of each per verse, in
    order. A random half of the verses (drawn from `seed`) have their words
    (split at spaces, so that punctuation stays with its word) put in a
    random order, labelled 0; the others stand as written, labelled 1. A
    shuffle that reads as the verse (repeated words, one word) counts as
    written. The same words in both classes: a classifier must know the
    language's word order, which the masked-LM pretraining learns from
    unlabelled text and a classifier from scratch must learn from the
    labelled verses alone."""
    rng = np.random.default_rng(seed)
    shuffled = set(rng.permutation(len(verses))[: len(verses) // 2].tolist())
    texts = []
    for index, verse in enumerate(verses):
        words = verse.text.split(" ")
        if index in shuffled:
            words = [words[i] for i in rng.permutation(len(words))]
        texts.append(" ".join(words))
    labels = [int(text == verse.text) for text, verse in zip(texts, verses)]
    return texts, labels


def word_order_batches(texts, labels, vocabulary, sequence_length, batch_size, seed=None):
    """Single texts `[CLS] text [SEP]` (truncated to `sequence_length`) with
    their labels: `({"token_ids", "segment_ids", "padding_mask"}, labels)`.
    With `seed`, an endless stream of shuffled passes; without, one pass in
    order."""
    import tensorflow as tf

    tokenizer = vocabulary.tokenizer  # made eagerly, as in `pair_batches`
    packer = _packer(sequence_length)

    def preprocess(text, label):
        token_ids, segment_ids = packer(tokenizer(text))
        x = {"token_ids": token_ids, "segment_ids": segment_ids,
             "padding_mask": token_ids != PAD_ID}
        return x, label

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.constant(texts), tf.constant(labels, "int32"))
    )
    if seed is not None:
        dataset = dataset.repeat().shuffle(len(texts), seed=seed)
    return common.without_autotuning(
        dataset.batch(batch_size).map(preprocess).prefetch(tf.data.AUTOTUNE)
    )
