"""The translation example's data: sentence pairs, book splits, WordPiece, batches.

- `load_pairs`: a tab-separated file of sentence pairs (a path, or an
  `http(s)://` or `file://` URL downloaded once into a cache directory), in
  either of two layouts:
  - the Bible layout of the shipped `examples/data/web_rv1909.tsv.gz`:
    `book:chapter:verse<TAB>english<TAB>spanish`;
  - the Anki / Tatoeba layout of `spa-eng.zip`:
    `english<TAB>spanish[<TAB>attribution]`.
  Each line becomes a `Pair(reference, book, source, target)`.
- `split_pairs`: validation and test hold out WHOLE books, never single
  verses: neighbouring verses repeat each other (parallel phrasing, refrains,
  genealogies), so a random verse split would test on near copies of
  training verses. Tatoeba has no books; its "book" is a stable hash of the
  English sentence into `NUM_GROUPS` groups, so an English sentence with
  several translations never sits on both sides of a split.
- `filter_by_length`: at most `max_words` whitespace-separated words on each
  side (30 by default: 22,410 of the 31,025 Bible pairs).
- `PairTokenizer`: KerasHub WordPiece vocabularies learned from the training
  split (one per language, or one shared by both), saved as one token a line
  next to the checkpoints; its tokenizers are those of a
  `keras_attention.models.TranslationPreprocessor` (`preprocessor`);
  `detokenize` turns ids back into text for BLEU.
- `train_batches` and `eval_batches`: `tf.data` pipelines that tokenize,
  bucket by length (`bucket_by_sequence_length`) and pad with 0 for teacher
  forcing: `({"encoder_token_ids": (B, S), "decoder_token_ids": (B, T)},
  labels (B, T), sample weights (B, T))`, the decoder inputs `[START] target`,
  the labels `target [END]`, the weights 1 on tokens and 0 on padding.
- `source_batches`: the source sentences alone, for translating them.
"""

import collections
import gzip
import pathlib
import re
import zipfile
import sys
import zlib

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402

DEFAULT_SOURCE = (
    pathlib.Path(__file__).resolve().parents[1] / "data" / "web_rv1909.tsv.gz"
)
# The Tatoeba English-Spanish pairs (118,964), for `--source`.
TATOEBA_SPA_ENG = "https://storage.googleapis.com/download.tensorflow.org/data/spa-eng.zip"
CACHE_SUBDIR = "translation"

Pair = collections.namedtuple("Pair", ["reference", "book", "source", "target"])
Pair.__doc__ = """One sentence pair.

`reference`: `"book:chapter:verse"` in the Bible layout, the line number
(from 1) otherwise; `book`: the book number (1 Genesis .. 66 Revelation), or
the sentence's hash group in the Tatoeba layout; `source` the English,
`target` the Spanish."""

BIBLE_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges",
    "Ruth", "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles",
    "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job", "Psalms", "Proverbs",
    "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations",
    "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah",
    "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi", "Matthew",
    "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians", "2 Corinthians",
    "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews",
    "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)

# The held-out books of the Bible layout (pairs of at most 30 words a side in
# brackets). Test: a gospel without synoptic parallels (John, 756; Matthew,
# Mark and Luke retell each other, so one of them would be tested on its
# parallels), an Old Testament story (Ruth, 50), a court story (Esther, 72)
# and wisdom writing (Ecclesiastes, 163): 1,041 pairs of four genres.
# Validation: history (Joshua, 383) and a letter (Romans, 371): 754 pairs.
# 20,615 pairs train.
BIBLE_VALIDATION_BOOKS = (6, 45)
BIBLE_TEST_BOOKS = (8, 17, 21, 43)
# The Tatoeba layout: groups 0-4 validate, 5-9 test (about 5% each).
NUM_GROUPS = 100
GROUP_VALIDATION_BOOKS = tuple(range(0, 5))
GROUP_TEST_BOOKS = tuple(range(5, 10))

RESERVED_TOKENS = ("[PAD]", "[UNK]", "[START]", "[END]")
PAD_ID, UNK_ID, START_ID, END_ID = range(4)

_REFERENCE = re.compile(r"\d+:\d+:\d+")


# Pairs.


def read_source(source=None, cache_dir=None):
    """The text of a pair file, decoded as UTF-8.

    Args:
        source: `None` for the shipped Bible pairs; a path; or an
            `http(s)://` or `file://` URL, downloaded once into `cache_dir`
            (with `keras.utils.get_file`) and read from there afterwards. A
            `.gz` file is decompressed; of a `.zip` archive the largest
            `.txt` or `.tsv` member whose name starts with neither `_` nor
            `.` is read (`spa-eng.zip` holds `spa.txt` and `_about.txt`).
        cache_dir: where downloads are kept (default `~/.keras/datasets`),
            in its subfolder `CACHE_SUBDIR`.

    Raises:
        ValueError: if `source` is a path that does not exist.
    """
    path = common.local_path(
        DEFAULT_SOURCE if source is None else source, cache_dir,
        cache_subdir=CACHE_SUBDIR, default_name="pairs.tsv",
    )
    if not path.is_file():
        raise ValueError(f"`source` does not exist. Received: source={str(path)!r}")
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            members = [
                m for m in archive.infolist()
                if m.filename.endswith((".txt", ".tsv"))
                and not pathlib.PurePosixPath(m.filename).name.startswith(("_", "."))
            ]
            if not members:
                raise ValueError(
                    f"`source` holds no .txt or .tsv file. Received: source={str(path)!r}"
                )
            member = max(members, key=lambda m: m.file_size)
            return archive.read(member).decode("utf-8")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def group_of(sentence):
    """The stable hash group, in `[0, NUM_GROUPS)`, of an English sentence."""
    key = " ".join(sentence.lower().split()).encode("utf-8")
    return zlib.crc32(key) % NUM_GROUPS


def parse_pairs(text, layout="auto"):
    """The `Pair`s of the lines of `text` (blank lines skipped).

    Args:
        text: the file's text.
        layout: `"bible"` (`book:chapter:verse<TAB>english<TAB>spanish`),
            `"tatoeba"` (`english<TAB>spanish[<TAB>attribution]`), or
            `"auto"`: the Bible layout if the first field of the first line
            is a `book:chapter:verse` reference.

    Raises:
        ValueError: for an unknown `layout`, or a line without the columns
            its layout needs (the message gives its line number).
    """
    lines = text.splitlines()
    if layout == "auto":
        first = next((line for line in lines if line.strip()), "")
        layout = "bible" if _REFERENCE.fullmatch(first.split("\t", 1)[0]) else "tatoeba"
    if layout not in ("bible", "tatoeba"):
        raise ValueError(
            "`layout` must be one of auto, bible, tatoeba. Received: "
            f"layout={layout!r}"
        )
    pairs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if layout == "bible":
            if len(fields) < 3 or not _REFERENCE.fullmatch(fields[0]):
                raise ValueError(
                    "A line of a Bible pair file must read "
                    f"`book:chapter:verse<TAB>english<TAB>spanish`. Received: line "
                    f"{number}: {line[:80]!r}"
                )
            reference, source, target = fields[:3]
            book = int(reference.split(":", 1)[0])
        else:
            if len(fields) < 2:
                raise ValueError(
                    "A line of a pair file must read `english<TAB>spanish` (then "
                    f"optional columns). Received: line {number}: {line[:80]!r}"
                )
            reference, (source, target) = str(number), fields[:2]
            book = group_of(source)
        pairs.append(Pair(reference, book, source.strip(), target.strip()))
    return pairs


def load_pairs(source=None, cache_dir=None, layout="auto"):
    """The `Pair`s of a pair file (see `read_source` and `parse_pairs`)."""
    return parse_pairs(read_source(source, cache_dir), layout)


def is_bible(pairs):
    """Whether `pairs` come from the Bible layout (their references say so)."""
    return bool(pairs) and all(_REFERENCE.fullmatch(p.reference) for p in pairs)


def default_held_out_books(pairs):
    """`(validation_books, test_books)` for the layout of `pairs`."""
    if is_bible(pairs):
        return BIBLE_VALIDATION_BOOKS, BIBLE_TEST_BOOKS
    return GROUP_VALIDATION_BOOKS, GROUP_TEST_BOOKS


def book_names(books):
    """Printable names of Bible book numbers, e.g. `"Ruth (8)"`."""
    return ", ".join(
        f"{BIBLE_BOOKS[b - 1]} ({b})" if 1 <= b <= len(BIBLE_BOOKS) else str(b)
        for b in books
    )


def split_pairs(pairs, validation_books=None, test_books=None):
    """`(train, validation, test)`: whole books held out, in file order.

    Args:
        pairs: a list of `Pair`s.
        validation_books, test_books: the book numbers each split holds;
            every other book trains. `None`: `default_held_out_books(pairs)`.

    Raises:
        ValueError: if a book is both a validation and a test book.
    """
    default_validation, default_test = default_held_out_books(pairs)
    validation_books = set(default_validation if validation_books is None else validation_books)
    test_books = set(default_test if test_books is None else test_books)
    if validation_books & test_books:
        raise ValueError(
            "A book cannot both validate and test. Received: books "
            f"{sorted(validation_books & test_books)} in both"
        )
    train, validation, test = [], [], []
    for pair in pairs:
        if pair.book in validation_books:
            validation.append(pair)
        elif pair.book in test_books:
            test.append(pair)
        else:
            train.append(pair)
    return train, validation, test


def filter_by_length(pairs, max_words=30):
    """The pairs with at most `max_words` words (split on whitespace) a side."""
    return [
        p for p in pairs
        if len(p.source.split()) <= max_words and len(p.target.split()) <= max_words
    ]


# Tokens.


def learn_vocabulary(sentences, vocabulary_size, lowercase=False):
    """A WordPiece vocabulary of at most `vocabulary_size` tokens.

    `keras_hub.tokenizers.compute_word_piece_vocabulary` on `sentences`; the
    reserved tokens come first, so `[PAD]` is id 0, `[UNK]` 1, `[START]` 2
    and `[END]` 3.
    """
    import keras_hub
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(list(sentences)).batch(1024)
    return keras_hub.tokenizers.compute_word_piece_vocabulary(
        dataset,
        vocabulary_size,
        lowercase=lowercase,
        reserved_tokens=list(RESERVED_TOKENS),
    )


def save_vocabulary(vocabulary, path):
    """Writes `vocabulary` to `path`, one token a line (UTF-8)."""
    pathlib.Path(path).write_text("".join(t + "\n" for t in vocabulary), encoding="utf-8")


def load_vocabulary(path):
    """The vocabulary `save_vocabulary` wrote to `path`."""
    return pathlib.Path(path).read_text(encoding="utf-8").splitlines()


# Punctuation written without a space before it, or after it.
_CLOSING = set(".,;:!?)]}»%")
_OPENING = set("([{¿¡«")


def join_tokens(tokens):
    """Text from WordPiece tokens: `##` pieces joined, punctuation spaced.

    The inverse of the tokenizer's split for ordinary prose: no space before
    `. , ; : ! ? ) ] }`, none after `( [ { ¿ ¡`, straight double quotes
    alternately opening and closing, and an apostrophe or hyphen after a
    letter kept inside the word (`God ' s` -> `God's`, `mother - in - law`
    -> `mother-in-law`). BLEU (sacrebleu's `13a` tokenization) and chrF do
    not depend on these spaces; they make the output readable.
    """
    text, glue, quote_open = "", True, False
    for token in tokens:
        if token.startswith("##"):
            text += token[2:]
            continue
        if token in _CLOSING:
            text += token
        elif token in _OPENING:
            text += ("" if glue else " ") + token
            glue = True
            continue
        elif token == '"':
            if quote_open:
                text += token
            else:
                text += ("" if glue else " ") + token
                glue = True
                quote_open = not quote_open
                continue
            quote_open = not quote_open
        elif token in "'-" and text[-1:].isalnum():
            text += token
            glue = True
            continue
        else:
            text += ("" if glue else " ") + token
        glue = False
    return text


class PairTokenizer:
    """KerasHub WordPiece on both sides of the pairs.

    `source` and `target` are `keras_hub.tokenizers.WordPieceTokenizer`s:
    they split on whitespace and punctuation and keep the case and accents
    (unless `lowercase`). With `target_vocabulary=None` the two sides share
    one vocabulary (for a model that shares its embeddings).

    Args:
        source_vocabulary: list of tokens, the reserved ones first.
        target_vocabulary: list of tokens, or `None` to share
            `source_vocabulary`.
        lowercase: bool, whether text is lowercased before it is split (as
            when the vocabulary was learned).
    """

    def __init__(self, source_vocabulary, target_vocabulary=None, lowercase=False):
        self.shared = target_vocabulary is None
        self.lowercase = bool(lowercase)
        self.source_vocabulary = list(source_vocabulary)
        self.target_vocabulary = list(
            source_vocabulary if target_vocabulary is None else target_vocabulary
        )
        for name, vocabulary in (
            ("source_vocabulary", self.source_vocabulary),
            ("target_vocabulary", self.target_vocabulary),
        ):
            if tuple(vocabulary[: len(RESERVED_TOKENS)]) != RESERVED_TOKENS:
                raise ValueError(
                    f"`{name}` must start with {list(RESERVED_TOKENS)}. Received: "
                    f"{vocabulary[: len(RESERVED_TOKENS)]}"
                )

        # Ids of texts tokenized before (`remember`): prepared data, read
        # where KerasHub's WordPiece (and so TensorFlow) is absent.
        self.known = {"source": {}, "target": {}}
        self._preprocessor = None

    @property
    def preprocessor(self):
        """The `keras_attention.models.TranslationPreprocessor` of the pairs,
        made on first use (it needs KerasHub): KerasHub's WordPiece
        tokenizers of the two vocabularies (one for both when shared) and the
        ids `[START]`, `[END]` and `[PAD]`. Its tokenizers tokenize the
        pairs here; `translate.load` gives it to the model, whose
        `translate("text")` then works."""
        if self._preprocessor is None:
            import keras_hub

            from keras_attention.models import TranslationPreprocessor

            def wordpiece(vocabulary):
                return keras_hub.tokenizers.WordPieceTokenizer(
                    vocabulary=vocabulary, lowercase=self.lowercase, oov_token="[UNK]",
                    dtype="int32",
                )

            self._preprocessor = TranslationPreprocessor(
                wordpiece(self.source_vocabulary),
                None if self.shared else wordpiece(self.target_vocabulary),
                start_token_id=START_ID, end_token_id=END_ID, pad_token_id=PAD_ID,
            )
        return self._preprocessor

    @property
    def source(self):
        """KerasHub's WordPiece tokenizer of the source side."""
        return self.preprocessor.source_tokenizer

    @property
    def target(self):
        """KerasHub's WordPiece tokenizer of the target side."""
        return self.preprocessor.target_tokenizer

    def remember(self, side, texts, ids):
        """Records the ids of `texts` on `side` (`"source"` or `"target"`), so
        that encoding them needs no WordPiece."""
        self.known[side].update(zip(texts, (list(map(int, x)) for x in ids)))

    def _encode(self, side, texts):
        texts = list(texts)
        known = self.known[side]
        if all(text in known for text in texts):
            return [list(known[text]) for text in texts]
        tokenizer = self.source if side == "source" else self.target
        return [list(map(int, ids)) for ids in tokenizer.tokenize(texts)]

    @classmethod
    def fit(cls, pairs, vocabulary_size, shared=False, lowercase=False):
        """Vocabularies learned from `pairs` (the training split).

        Args:
            pairs: `Pair`s.
            vocabulary_size: the most tokens per vocabulary (the learner may
                return fewer).
            shared: one vocabulary from both sides.
            lowercase: whether to lowercase first.
        """
        sources = [p.source for p in pairs]
        targets = [p.target for p in pairs]
        if shared:
            return cls(learn_vocabulary(sources + targets, vocabulary_size, lowercase),
                       None, lowercase)
        return cls(
            learn_vocabulary(sources, vocabulary_size, lowercase),
            learn_vocabulary(targets, vocabulary_size, lowercase),
            lowercase,
        )

    @property
    def source_vocabulary_size(self):
        return len(self.source_vocabulary)

    @property
    def target_vocabulary_size(self):
        return len(self.target_vocabulary)

    def encode_source(self, texts):
        """Lists of source ids (no `[START]` or `[END]`), one per text."""
        return self._encode("source", texts)

    def encode_target(self, texts):
        """Lists of target ids (no `[START]` or `[END]`), one per text."""
        return self._encode("target", texts)

    def target_tokens(self, ids):
        """The target tokens of `ids` up to the first `[END]`, without
        `[START]` and `[PAD]`."""
        tokens = []
        for i in np.asarray(ids).reshape(-1):
            i = int(i)
            if i == END_ID:
                break
            if i not in (PAD_ID, START_ID):
                tokens.append(self.target_vocabulary[i])
        return tokens

    def source_tokens(self, ids):
        """The source tokens of `ids`, without `[PAD]`."""
        return [self.source_vocabulary[int(i)] for i in np.asarray(ids).reshape(-1)
                if int(i) != PAD_ID]

    def detokenize(self, ids):
        """The text of target ids (a generated row): up to `[END]`, joined."""
        return join_tokens(self.target_tokens(ids))

    def save(self, directory):
        """Writes the vocabularies (and `tokenizer.json`) into `directory`:
        `vocabulary.txt` when shared, else `source_vocabulary.txt` and
        `target_vocabulary.txt`."""
        import json

        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.shared:
            save_vocabulary(self.source_vocabulary, directory / "vocabulary.txt")
        else:
            save_vocabulary(self.source_vocabulary, directory / "source_vocabulary.txt")
            save_vocabulary(self.target_vocabulary, directory / "target_vocabulary.txt")
        settings = {"shared": self.shared, "lowercase": self.lowercase}
        (directory / "tokenizer.json").write_text(json.dumps(settings))

    @classmethod
    def load(cls, directory):
        """The tokenizer `save` wrote into `directory`."""
        import json

        directory = pathlib.Path(directory)
        settings = json.loads((directory / "tokenizer.json").read_text())
        if settings["shared"]:
            return cls(load_vocabulary(directory / "vocabulary.txt"), None,
                       settings["lowercase"])
        return cls(
            load_vocabulary(directory / "source_vocabulary.txt"),
            load_vocabulary(directory / "target_vocabulary.txt"),
            settings["lowercase"],
        )


# Batches.


def bucket_boundaries(max_length, width=8):
    """The length buckets: `width`, `2 width`, ... up to `max_length`.

    As `bucket_by_sequence_length` wants them with `pad_to_bucket_boundary`:
    a bucket holds lengths below its boundary and pads to boundary - 1, so
    the boundaries are `width + 1, 2 width + 1, ..., max_length + 1`.
    """
    if max_length % width:
        raise ValueError(
            f"`max_length` must be a multiple of {width}. Received: "
            f"max_length={max_length}"
        )
    return list(range(width + 1, max_length + 2, width))


def bucket_batch_sizes(boundaries, batch_tokens):
    """Sentences per batch in each bucket: about `batch_tokens` tokens a side.

    One entry per boundary and one for the overflow bucket (never used: the
    pipelines truncate to `max_length`).
    """
    sizes = [max(1, batch_tokens // (b - 1)) for b in boundaries]
    return sizes + [sizes[-1]]


def epoch_order(num_pairs, seed, epoch):
    """The order of the training pairs in data epoch `epoch`: a permutation
    drawn by numpy's generator seeded with `(seed, epoch)`, which both
    pipelines use."""
    return np.random.default_rng((seed, int(epoch))).permutation(num_pairs)


def _pair_dataset(pairs, tokenizer, max_length, seed=None, epoch=None):
    """One `(encoder ids, decoder ids, labels)` element per pair, ragged.

    With `seed`, the pairs come in `epoch_order(len(pairs), seed, epoch)`
    (`epoch` an int64 scalar tensor); else in list order.
    """
    import tensorflow as tf

    # Made here, eagerly: KerasHub's tokenizers hold lookup tables that a
    # tokenizer first made inside a traced `map` would leave in its graph.
    source_tokenizer, target_tokenizer = tokenizer.source, tokenizer.target
    sources = tf.constant([p.source for p in pairs])
    targets = tf.constant([p.target for p in pairs])
    if seed is not None:
        order = tf.numpy_function(
            lambda e: epoch_order(len(pairs), seed, e), [epoch], tf.int64
        )
        order = tf.ensure_shape(order, (len(pairs),))
        sources, targets = tf.gather(sources, order), tf.gather(targets, order)

    def tokenize(source, target):  # (N,) strings, tokenized in batches
        return source_tokenizer(source), target_tokenizer(target)

    def teacher_forcing(source_ids, target_ids):
        source_ids = source_ids[:max_length]  # (S,)
        target_ids = target_ids[: max_length - 1]  # (T - 1,)
        start = tf.constant([START_ID], "int32")
        end = tf.constant([END_ID], "int32")
        inputs = {
            "encoder_token_ids": source_ids,
            "decoder_token_ids": tf.concat([start, target_ids], 0),  # (T,)
        }
        return inputs, tf.concat([target_ids, end], 0)  # (T,)

    return (
        tf.data.Dataset.from_tensor_slices((sources, targets))
        .batch(512)
        .map(tokenize, num_parallel_calls=tf.data.AUTOTUNE)
        .unbatch()
        .map(teacher_forcing, num_parallel_calls=tf.data.AUTOTUNE)
    )


def _bucketed(dataset, max_length, batch_tokens, drop_remainder):
    """Batches of similar lengths, padded with 0, with padding weights 0."""
    import tensorflow as tf

    boundaries = bucket_boundaries(max_length)

    def length(inputs, labels):
        return tf.maximum(
            tf.shape(inputs["encoder_token_ids"])[0], tf.shape(labels)[0]
        )

    def with_weights(inputs, labels):
        return inputs, labels, tf.cast(labels != PAD_ID, "float32")  # (B, T)

    return dataset.bucket_by_sequence_length(
        length,
        boundaries,
        bucket_batch_sizes(boundaries, batch_tokens),
        pad_to_bucket_boundary=True,
        drop_remainder=drop_remainder,
    ).map(with_weights)


def _count(dataset):
    """The number of elements of a finite dataset (one pass)."""

    def add_one(count, _):
        return count + 1

    return int(dataset.reduce(0, add_one))


def train_batches(pairs, tokenizer, max_length, batch_tokens, seed, start_step=0):
    """Endless training batches; batch `k` is a pure function of `(seed, k)`.

    Each pass over the pairs (a data epoch) shuffles them
    (`epoch_order(len(pairs), seed, epoch)`), tokenizes, buckets and drops each
    bucket's last partial batch. The number of batches per epoch depends
    only on the lengths, not on the order, so the stream made with
    `start_step=k` starts at batch `k` exactly: a resumed run sees the
    batches an uninterrupted one would.

    Args:
        pairs: the training `Pair`s.
        tokenizer: a `PairTokenizer`.
        max_length: `S` and `T` at most (longer sentences are truncated);
            a multiple of 8.
        batch_tokens: about this many tokens per side per batch.
        seed: integer.
        start_step: the index of the first batch.

    Returns:
        `(dataset, batches_per_epoch)`: the `tf.data.Dataset` of
        `(inputs, labels, weights)` and the number of batches in a data
        epoch.
    """
    import tensorflow as tf

    def epoch(index):
        return _bucketed(
            _pair_dataset(pairs, tokenizer, max_length, seed, index),
            max_length, batch_tokens, drop_remainder=True,
        )

    per_epoch = _count(epoch(tf.constant(0, "int64")))
    if per_epoch == 0:
        raise ValueError(
            "The training pairs fill no batch: lower `batch_tokens`. Received: "
            f"{len(pairs)} pairs, batch_tokens={batch_tokens}"
        )
    first_epoch, skip = divmod(start_step, per_epoch)
    dataset = (
        tf.data.Dataset.range(first_epoch, 2**62)
        .flat_map(epoch)
        .skip(skip)
        .prefetch(tf.data.AUTOTUNE)
    )
    return common.without_autotuning(dataset), per_epoch


def eval_batches(pairs, tokenizer, max_length, batch_tokens):
    """One pass over `pairs` in bucketed batches (none dropped), for
    `model.evaluate`: the same `(inputs, labels, weights)` as training."""
    import tensorflow as tf

    dataset = _bucketed(
        _pair_dataset(pairs, tokenizer, max_length),
        max_length, batch_tokens, drop_remainder=False,
    )
    # Bucketing hides the number of batches; stated, `fit` and `evaluate`
    # know where the pass ends.
    count = _count(dataset)
    return common.without_autotuning(
        dataset.apply(tf.data.experimental.assert_cardinality(count)).prefetch(tf.data.AUTOTUNE)
    )


def source_batches(texts, tokenizer, max_length, batch_size, width=8):
    """The source texts as padded `(B, S)` id batches, for generation.

    Sorted by length, so a batch pads little; `S` is the longest source of
    the batch rounded up to a multiple of `width` (at most `max_length`),
    so a compiled generation sees few shapes.

    Returns:
        A list of `(indices, encoder_token_ids)`: the positions in `texts` of
        the batch's rows and an int32 `(B, S)` array padded with 0.
    """
    encoded = [ids[:max_length] for ids in tokenizer.encode_source(texts)]
    order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
    batches = []
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        longest = max(max(len(encoded[i]) for i in indices), 1)
        length = min(-(-longest // width) * width, max_length)
        ids = np.zeros((len(indices), length), "int32")
        for row, i in enumerate(indices):
            ids[row, : len(encoded[i])] = encoded[i]
        batches.append((indices, ids))
    return batches


# The same batches from token ids in numpy arrays (no TensorFlow).


def teacher_forcing(source_ids, target_ids, max_length):
    """`(encoder ids, decoder ids, labels)` of one pair: the source cut to
    `max_length`, the decoder inputs `[START] target` and the labels
    `target [END]`, the target cut to `max_length - 1`."""
    target_ids = list(target_ids[: max_length - 1])
    return list(source_ids[:max_length]), [START_ID] + target_ids, target_ids + [END_ID]


def _padded(examples, length):
    """A batch of `teacher_forcing` triples padded with 0 to `length`."""
    encoder, decoder, labels = (np.zeros((len(examples), length), "int32") for _ in range(3))
    for row, (e, d, y) in enumerate(examples):
        encoder[row, : len(e)], decoder[row, : len(d)], labels[row, : len(y)] = e, d, y
    inputs = {"encoder_token_ids": encoder, "decoder_token_ids": decoder}
    return inputs, labels, (labels != PAD_ID).astype("float32")


def bucketed_arrays(examples, max_length, batch_tokens, drop_remainder):
    """`teacher_forcing` triples in batches as `_bucketed` makes them with
    tf.data's `bucket_by_sequence_length`: each goes to the bucket of its
    length (the longer of source and labels), a bucket is emitted padded to
    its boundary - 1 as soon as it holds its batch size, and at the end the
    partial buckets are dropped, or emitted in the order of their
    boundaries."""
    boundaries = bucket_boundaries(max_length)
    sizes = bucket_batch_sizes(boundaries, batch_tokens)
    buckets = [[] for _ in sizes]
    batches = []
    for example in examples:
        bucket = int(np.searchsorted(boundaries, max(len(example[0]), len(example[2])),
                                     side="right"))
        buckets[bucket].append(example)
        if len(buckets[bucket]) == sizes[bucket]:
            batches.append(_padded(buckets[bucket], boundaries[bucket] - 1))
            buckets[bucket] = []
    if not drop_remainder:
        batches += [_padded(b, boundaries[i] - 1) for i, b in enumerate(buckets) if b]
    return batches


def train_arrays(source_ids, target_ids, max_length, batch_tokens, seed, start_step=0,
                 num_batches=None):
    """`train_batches` from token ids (lists of ids per pair, as
    `PairTokenizer.encode_source` / `encode_target` give them), through a
    `keras.utils.PyDataset`: the batches of the `tf.data` stream, in its
    order, `num_batches` of them from `start_step`.

    Returns:
        `(dataset, batches_per_epoch)`.
    """
    def epoch(index):
        order = epoch_order(len(source_ids), seed, index)
        examples = (teacher_forcing(source_ids[i], target_ids[i], max_length) for i in order)
        return bucketed_arrays(examples, max_length, batch_tokens, drop_remainder=True)

    cached = {0: epoch(0)}
    per_epoch = len(cached[0])
    if per_epoch == 0:
        raise ValueError(
            "The training pairs fill no batch: lower `batch_tokens`. Received: "
            f"{len(source_ids)} pairs, batch_tokens={batch_tokens}"
        )

    def batch(i):
        index, k = divmod(start_step + i, per_epoch)
        if index not in cached:  # one data epoch held at a time
            cached.clear()
            cached[index] = epoch(index)
        return cached[index][k]

    return common.array_batches(batch, num_batches), per_epoch


def eval_arrays(source_ids, target_ids, max_length, batch_tokens):
    """`eval_batches` from token ids, through a `keras.utils.PyDataset`."""
    examples = (teacher_forcing(s, t, max_length) for s, t in zip(source_ids, target_ids))
    batches = bucketed_arrays(examples, max_length, batch_tokens, drop_remainder=False)
    return common.array_batches(batches.__getitem__, len(batches))


# Prepared data: the splits, vocabularies and token ids as plain files.

PREPARED_SPLITS = ("train", "validation", "test")


def save_prepared(directory, splits, tokenizer, settings):
    """Writes what training needs into `directory`: the vocabularies
    (`PairTokenizer.save`), `pairs.json.gz` (the pairs of each split),
    `ids.npz` (each split's source and target ids, flat with offsets) and
    `settings.json` (the options that made them).

    Args:
        splits: a dict of the `PREPARED_SPLITS` to lists of `Pair`s.
        tokenizer: the `PairTokenizer` (its WordPiece tokenizes here).
        settings: a JSON-able dict of the data options.
    """
    import json

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(directory)
    named = {}
    for name in PREPARED_SPLITS:
        pairs = splits[name]
        named[f"{name}_source"] = tokenizer.encode_source([p.source for p in pairs])
        named[f"{name}_target"] = tokenizer.encode_target([p.target for p in pairs])
    common.save_id_lists(directory / "ids.npz", named)
    pairs = {name: [list(p) for p in splits[name]] for name in PREPARED_SPLITS}
    with gzip.open(directory / "pairs.json.gz", "wt", encoding="utf-8") as f:
        json.dump(pairs, f, ensure_ascii=False)
    (directory / "settings.json").write_text(json.dumps(settings, sort_keys=True))


def load_prepared(directory):
    """What `save_prepared` wrote: `(splits, tokenizer, ids, settings)`;
    `ids[split] = (source ids, target ids)`, lists of id lists, which the
    tokenizer also remembers (it encodes these texts without WordPiece)."""
    import json

    directory = common.check_prepared(
        directory, ("ids.npz", "pairs.json.gz", "settings.json", "tokenizer.json")
    )
    tokenizer = PairTokenizer.load(directory)
    named = common.load_id_lists(directory / "ids.npz")
    with gzip.open(directory / "pairs.json.gz", "rt", encoding="utf-8") as f:
        pairs = json.load(f)
    splits, ids = {}, {}
    for name in PREPARED_SPLITS:
        splits[name] = [Pair(*p) for p in pairs[name]]
        for side in ("source", "target"):
            texts = [getattr(p, side) for p in splits[name]]
            tokenizer.remember(side, texts, named[f"{name}_{side}"])
        ids[name] = (named[f"{name}_source"], named[f"{name}_target"])
    settings = json.loads((directory / "settings.json").read_text())
    return splits, tokenizer, ids, settings
