"""The GPT example's own data: byte-pair tokens and saved tokenizers.

- `BytePairTokenizer`: a byte-pair vocabulary learned from the training text,
  for word-piece modelling without downloads.
- `tokenizer_from_json`, `save_tokenizer`, `load_tokenizer`: the tokenizer
  of a checkpoint, either kind, as JSON.

The corpus, the character tokenizer (`CharTokenizer`), the 90%/10% split and
the training and validation pipelines are shared with the other examples in
`examples/common.py`.
"""

import collections
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
from common import CharTokenizer  # noqa: E402


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
    """The tokenizer of a `to_json` dict, of either kind (`"char"`, `"bpe"`)."""
    if data["kind"] == CharTokenizer.kind:
        return CharTokenizer.from_json(data)
    return BytePairTokenizer(data["characters"], data["merges"])


def save_tokenizer(tokenizer, path):
    """Writes `tokenizer` (either kind) to the file `path` as JSON."""
    pathlib.Path(path).write_text(json.dumps(tokenizer.to_json()))


def load_tokenizer(path):
    """The tokenizer that `save_tokenizer` wrote to `path`."""
    return tokenizer_from_json(json.loads(pathlib.Path(path).read_text()))
