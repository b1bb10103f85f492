"""Data for the GPT example: a text corpus, its tokens, `tf.data` pipelines.

- `load_text`: the shipped tiny-shakespeare (`examples/data/`), a local file,
  or a URL downloaded once into a cache directory (`keras.utils.get_file`;
  `file://` URLs work offline).
- Tokenizers: `CharTokenizer` (one id per distinct character, nanoGPT's
  `shakespeare_char`) and `BytePairTokenizer` (a byte-pair vocabulary learned
  from the training text, for word-piece modelling without downloads).
- `train_batches`: an endless dataset of random windows whose batch `k` is a
  pure function of `(seed, k)`: a run resumed at step `k` sees exactly the
  batches an uninterrupted run would.
- `validation_batches`: the whole validation split in consecutive windows.

The first 90% of the token ids train and the last 10% validate (nanoGPT's
split).
"""

import collections
import gzip
import json
import pathlib

import numpy as np
import tensorflow as tf

DEFAULT_CORPUS = (
    pathlib.Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt.gz"
)


def load_text(source=None, cache_dir=None):
    """The corpus as one string.

    Args:
        source: `None` for the shipped tiny-shakespeare; a path (`.gz` is
            decompressed); or an `http(s)://`/`file://` URL, downloaded once
            into `cache_dir` and read from there afterwards.
        cache_dir: where downloads are kept (default `~/.keras/datasets`).
    """
    if source is None:
        source = DEFAULT_CORPUS
    source = str(source)
    if "://" in source:
        import keras

        name = source.rstrip("/").rsplit("/", 1)[-1] or "corpus.txt"
        if cache_dir is not None:
            # get_file falls back to /tmp/.keras for a directory it cannot
            # write, which includes one that does not exist yet.
            pathlib.Path(cache_dir).mkdir(parents=True, exist_ok=True)
        source = keras.utils.get_file(
            fname=name, origin=source, cache_dir=cache_dir, cache_subdir="gpt_lm"
        )
    path = pathlib.Path(source)
    if not path.exists():
        raise ValueError(f"`source` does not exist. Received: source={str(path)!r}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


class CharTokenizer:
    """Characters <-> ids, one id per distinct character of the text, sorted."""

    kind = "char"

    def __init__(self, characters):
        self.characters = list(characters)
        self._ids = {c: i for i, c in enumerate(self.characters)}

    @classmethod
    def fit(cls, text):
        return cls(sorted(set(text)))

    @property
    def vocabulary_size(self):
        return len(self.characters)

    def encode(self, text):
        unknown = set(text) - self._ids.keys()
        if unknown:
            raise ValueError(
                "`text` has characters outside the vocabulary. Received: "
                f"{sorted(unknown)[:10]}"
            )
        return np.array([self._ids[c] for c in text], dtype="int32")

    def decode(self, ids):
        return "".join(self.characters[int(i)] for i in ids)

    def to_json(self):
        return {"kind": self.kind, "characters": self.characters}


class BytePairTokenizer:
    """A byte-pair encoding learned from the text (Sennrich et al., 2016).

    Starts from the characters of the text and merges the most frequent
    adjacent pair, `vocabulary_size - num_characters` times, within
    whitespace-separated words (a space stays attached to the word after it,
    as in GPT-2). Encoding applies the merges in the order they were learned.
    """

    kind = "bpe"

    def __init__(self, characters, merges):
        self.characters = list(characters)
        self.merges = [tuple(m) for m in merges]
        self.tokens = self.characters + [a + b for a, b in self.merges]
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self._rank = {pair: i for i, pair in enumerate(self.merges)}

    @staticmethod
    def _words(text):
        words, current = [], ""
        for c in text:
            if c.isspace() and current and not current[-1].isspace():
                words.append(current)
                current = ""
            current += c
        if current:
            words.append(current)
        return words

    @classmethod
    def fit(cls, text, vocabulary_size):
        characters = sorted(set(text))
        if vocabulary_size < len(characters):
            raise ValueError(
                "`vocabulary_size` must be at least the number of distinct "
                f"characters ({len(characters)}). Received: "
                f"vocabulary_size={vocabulary_size}"
            )
        counts = collections.Counter(cls._words(text))
        words = {w: list(w) for w in counts}
        merges = []
        while len(characters) + len(merges) < vocabulary_size:
            pairs = collections.Counter()
            for word, pieces in words.items():
                for pair in zip(pieces, pieces[1:]):
                    pairs[pair] += counts[word]
            if not pairs:
                break
            best = max(pairs, key=lambda p: (pairs[p], p))
            merges.append(best)
            merged = best[0] + best[1]
            for word, pieces in words.items():
                i, out = 0, []
                while i < len(pieces):
                    if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == best:
                        out.append(merged)
                        i += 2
                    else:
                        out.append(pieces[i])
                        i += 1
                words[word] = out
        return cls(characters, merges)

    @property
    def vocabulary_size(self):
        return len(self.tokens)

    def _encode_word(self, word):
        pieces = list(word)
        while len(pieces) > 1:
            ranked = [
                (self._rank.get(pair, len(self._rank)), i)
                for i, pair in enumerate(zip(pieces, pieces[1:]))
            ]
            rank, i = min(ranked)
            if rank == len(self._rank):
                break
            pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
        return pieces

    def encode(self, text):
        cache, ids = {}, []
        for word in self._words(text):
            if word not in cache:
                unknown = set(word) - set(self.characters)
                if unknown:
                    raise ValueError(
                        "`text` has characters outside the vocabulary. "
                        f"Received: {sorted(unknown)[:10]}"
                    )
                cache[word] = [self._ids[p] for p in self._encode_word(word)]
            ids.extend(cache[word])
        return np.array(ids, dtype="int32")

    def decode(self, ids):
        return "".join(self.tokens[int(i)] for i in ids)

    def to_json(self):
        return {"kind": self.kind, "characters": self.characters, "merges": self.merges}


def tokenizer_from_json(data):
    if data["kind"] == "char":
        return CharTokenizer(data["characters"])
    return BytePairTokenizer(data["characters"], data["merges"])


def save_tokenizer(tokenizer, path):
    pathlib.Path(path).write_text(json.dumps(tokenizer.to_json()))


def load_tokenizer(path):
    return tokenizer_from_json(json.loads(pathlib.Path(path).read_text()))


def split_ids(ids, train_fraction=0.9):
    """The first `train_fraction` of `ids` trains, the rest validates."""
    boundary = int(train_fraction * len(ids))
    return ids[:boundary], ids[boundary:]


def train_batches(ids, context_length, batch_size, seed, start_step=0):
    """Endless `(inputs, targets)` batches `(B, T)` of random windows.

    Batch `k` (counting from 0 at the first step of training) draws its window
    starts from `stateless_uniform(seed=(seed, k))`, so the dataset created
    with `start_step=k` continues exactly where a run stopped at step `k`.
    Targets are the inputs shifted left by one.
    """
    num_starts = len(ids) - context_length  # the last start still has T + 1 ids
    if num_starts <= 0:
        raise ValueError(
            "The training text must be longer than `context_length`. Received: "
            f"{len(ids)} ids, context_length={context_length}"
        )
    ids = tf.constant(ids, dtype="int32")
    offsets = tf.range(context_length + 1, dtype="int64")  # (T + 1,)

    def batch(step):
        starts = tf.random.stateless_uniform(
            (batch_size,),
            seed=tf.stack([tf.constant(seed, "int64"), step]),
            maxval=num_starts,
            dtype="int64",
        )  # (B,)
        window = tf.gather(ids, starts[:, None] + offsets[None, :])  # (B, T + 1)
        return window[:, :-1], window[:, 1:]

    return (
        tf.data.Dataset.range(start_step, 2**62)
        .map(batch, num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )


def validation_batches(ids, context_length, batch_size, max_windows=None):
    """Consecutive non-overlapping windows covering `ids` (all of it by default)."""
    num_windows = (len(ids) - 1) // context_length
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    length = num_windows * context_length
    inputs = ids[:length].reshape(num_windows, context_length)  # (N, T)
    targets = ids[1 : length + 1].reshape(num_windows, context_length)  # (N, T)
    return tf.data.Dataset.from_tensor_slices((inputs, targets)).batch(batch_size)
