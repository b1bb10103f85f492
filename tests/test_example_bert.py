"""The BERT example: verse files, book splits, WordPiece, masked sentence pairs,
the metrics and baselines, and a `--tiny` run that pretrains, saves, resumes,
fine-tunes, fills a mask and draws.

The run goes in subprocesses on the current backend (`KERAS_BACKEND`), as a
user would run the README's commands; the rest runs in-process on small data
the tests write.
"""

import gzip
import math
import re
import time

import keras
import numpy as np
import pytest

import harness
from harness import ROOT

EXAMPLE = ROOT / "examples" / "bert_mlm"

BIBLE = [
    ("1:1:1", "In the beginning God created the heavens and the earth.", "EN el principio"),
    ("1:1:2", "The earth was formless and empty.", "Y la tierra"),
    ("1:1:3", 'God said, "Let there be light," and there was light.', "Y dijo Dios"),
    ("6:1:1", "Now after the death of Moses the servant of Yahweh.", "Y ACONTECIO"),
    ("8:1:16", "Ruth said, Don't entreat me to leave you.", "Y Ruth"),
    ("43:1:1", "In the beginning was the Word.", "EN el principio"),
    ("43:11:35", "Jesus wept.", "Y lloró Jesús."),
    ("45:1:1", "Paul, a servant of Jesus Christ.", "PABLO"),
]
TEXTS = [
    "in the beginning god created the heavens and the earth",
    "the earth was formless and empty and darkness was on the deep",
    "god said let there be light and there was light",
    "god saw the light and saw that it was good",
] * 12


def _load(name):
    return harness.load_module(EXAMPLE / f"{name}.py", f"bert_mlm_{name}")


@pytest.fixture(scope="module")
def data():
    return _load("data")


@pytest.fixture(scope="module")
def train():
    return _load("train")


@pytest.fixture(scope="module")
def vocabulary(data):
    return data.Vocabulary.fit(TEXTS, 100)


def _write(path, lines):
    text = "".join(line + "\n" for line in lines)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# Verses and splits.


@pytest.mark.parametrize("name", ["bible.tsv.gz", "book.txt"])
def test_verses_through_a_file_url_into_the_cache(data, tmp_path, name):
    bible = name.startswith("bible")
    lines = ["\t".join(row) for row in BIBLE] if bible else [t for t in TEXTS[:4]] + [""]
    path = _write(tmp_path / name, lines)
    cache = tmp_path / "cache" / "not_made_yet"
    verses = data.load_verses(path.as_uri(), cache_dir=str(cache))
    if bible:
        assert verses[0] == data.Verse("1:1:1", 1, BIBLE[0][1])  # the English side
        assert [v.book for v in verses] == [1, 1, 1, 6, 8, 43, 43, 45]
        assert data.is_bible(verses)
    else:
        # One verse a line (blank lines skipped), in consecutive blocks.
        assert [v.text for v in verses] == TEXTS[:4]
        assert [v.reference for v in verses] == ["1", "2", "3", "4"]
        assert [v.book for v in verses] == [0, 25, 50, 75]
    assert [c.parent for c in cache.rglob(name)] == [cache / data.CACHE_SUBDIR]
    path.unlink()  # read from the cache from now on
    assert data.load_verses(path.as_uri(), cache_dir=str(cache)) == verses
    with pytest.raises(ValueError, match=r"`source` does not exist"):
        data.load_verses(str(tmp_path / "missing.txt"))


def test_split_holds_out_whole_books(data):
    verses = data.parse_verses("".join("\t".join(r) + "\n" for r in BIBLE))
    train, validation, test = data.split_verses(verses)
    assert {v.book for v in train} == {1}
    assert {v.book for v in validation} == {6, 45}
    assert {v.book for v in test} == {8, 43}
    with pytest.raises(ValueError, match=r"cannot both validate and test.*\[43\]"):
        data.split_verses(verses, validation_books=[43], test_books=[8, 43])
    with pytest.raises(ValueError, match=r"book:chapter:verse<TAB>english.*line 2: 'oops'"):
        data.parse_verses("1:1:1\ta\tb\noops\n")


def test_default_split_of_the_shipped_english(data):
    verses = data.load_verses()
    assert len(verses) == 31_025
    train, validation, test = data.split_verses(verses)
    assert (len(train), len(validation), len(test)) == (28_581, 1_091, 1_353)
    assert {v.book for v in test} == set(data.BIBLE_TEST_BOOKS)
    assert not {v.book for v in train} & {v.book for v in validation + test}
    # Pairs never cross a book.
    pairs = data.sentence_pairs(validation)
    assert len(pairs) == len(validation) - 2
    assert pairs[0] == (validation[0].text, validation[1].text)


# WordPiece.


def test_vocabulary_reserved_tokens_mask_and_save(data, vocabulary, tmp_path):
    assert vocabulary.tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert vocabulary.size <= 100
    ids = vocabulary.encode("In the beginning God created the [MASK] and the earth.")
    tokens = [vocabulary.tokens[i] for i in ids]
    assert tokens[:6] == ["in", "the", "beginning", "god", "created", "the"]
    # "." never occurs in the training texts: [UNK].
    assert ids[6] == data.MASK_ID and tokens[7:] == ["and", "the", "earth", "[UNK]"]
    counts = vocabulary.counts(["the earth the", "god"])
    assert counts[vocabulary.tokens.index("the")] == 2 and counts.sum() == 4
    vocabulary.save(tmp_path)
    assert data.Vocabulary.load(tmp_path).tokens == vocabulary.tokens
    with pytest.raises(ValueError, match=r"`tokens` must start with"):
        data.Vocabulary(["a", "b", "c", "d", "e"])


# Masked pairs.


def _unmasked(x, labels, weights):
    """The token ids with each masked position given back its label."""
    ids = x["token_ids"].copy()
    for row in range(len(ids)):
        real = weights[row] > 0
        ids[row, x["mask_positions"][row][real]] = labels[row][real]
    return ids


def test_pair_batches_pack_segments_and_mask_as_bert(data, vocabulary):
    pairs = [(a, b) for a, b in zip(TEXTS, TEXTS[1:])]
    dataset = data.pair_batches(pairs, vocabulary, 32, 8, 6, seed=0, shuffle=False)
    batches = list(dataset.as_numpy_iterator())
    assert len(batches) == math.ceil(len(pairs) / 8)
    selected = changed = to_mask = 0
    for b, (x, labels, weights) in enumerate(batches):
        original = _unmasked(x, labels, weights)
        for row, (first, second) in enumerate(pairs[8 * b: 8 * b + len(labels)]):
            a, s = vocabulary.encode(first), vocabulary.encode(second)
            # [CLS] a [SEP] b [SEP], segments 0 then 1, then padding.
            expected = [data.CLS_ID] + a + [data.SEP_ID] + s + [data.SEP_ID]
            assert len(expected) <= 32
            np.testing.assert_array_equal(original[row, : len(expected)], expected)
            assert not original[row, len(expected):].any()
            segments = [0] * (len(a) + 2) + [1] * (len(s) + 1)
            np.testing.assert_array_equal(x["segment_ids"][row, : len(segments)], segments)
            np.testing.assert_array_equal(x["padding_mask"][row], original[row] != data.PAD_ID)
            positions = x["mask_positions"][row][weights[row] > 0]
            assert set(original[row, positions]).isdisjoint(
                {data.PAD_ID, data.CLS_ID, data.SEP_ID})
            selected += len(positions)
            to_mask += (x["token_ids"][row, positions] == data.MASK_ID).sum()
            changed += (x["token_ids"][row, positions] != original[row, positions]).sum()
    real = sum((x["padding_mask"].sum() - 3 * len(x["token_ids"])) for x, _, _ in batches)
    assert 0.10 < selected / real < 0.20  # 15% of the selectable tokens
    assert 0.65 < to_mask / selected < 0.95  # 80% become [MASK]
    assert to_mask < changed  # and some a random token
    # Evaluation masks are drawn once: a second pass is the same.
    for (x, labels, _), (y, again, _) in zip(batches, dataset.as_numpy_iterator()):
        np.testing.assert_array_equal(x["token_ids"], y["token_ids"])
        np.testing.assert_array_equal(labels, again)


def test_masks_follow_keras_hub_generator_rules(data):
    """`mask_tokens` against `keras_hub.layers.MaskedLMMaskGenerator` with
    the same settings: the same number of masks in every row, only
    selectable tokens, and the same shares of [MASK] / random / unchanged
    over many rows; a pure function of the seed."""
    import keras_hub
    import tensorflow as tf

    rng = np.random.default_rng(0)
    vocabulary_size, rows, length, most = 50, 400, 40, 5
    lengths = rng.integers(3, length + 1, rows)
    token_ids = rng.integers(5, vocabulary_size, (rows, length)).astype("int32")
    token_ids[:, 0] = data.CLS_ID
    for row, n in enumerate(lengths):
        token_ids[row, n - 1] = data.SEP_ID
        token_ids[row, n:] = data.PAD_ID
    ours = data.mask_tokens(token_ids, [7, 1], vocabulary_size, most)
    again = data.mask_tokens(token_ids, [7, 1], vocabulary_size, most)
    other = data.mask_tokens(token_ids, [7, 2], vocabulary_size, most)
    for name in ours:
        np.testing.assert_array_equal(ours[name], again[name])
    assert (ours["mask_positions"] != other["mask_positions"]).any()
    generator = keras_hub.layers.MaskedLMMaskGenerator(
        vocabulary_size=vocabulary_size, mask_selection_rate=0.15, mask_token_id=data.MASK_ID,
        mask_selection_length=most, unselectable_token_ids=[data.PAD_ID, data.CLS_ID, data.SEP_ID],
        mask_token_rate=0.8, random_token_rate=0.1,
    )
    # Traced, as in a `tf.data` pipeline (eagerly it takes another path,
    # which draws each token's selection on its own).
    theirs = tf.function(generator)(tf.constant(token_ids))
    np.testing.assert_array_equal(
        np.sum(ours["mask_weights"], 1), np.sum(np.asarray(theirs["mask_weights"], "float32"), 1)
    )
    shares = []
    for masked in (ours, theirs):
        ids = np.asarray(masked["token_ids"])
        positions = np.asarray(masked["mask_positions"])
        weights = np.asarray(masked["mask_weights"]) > 0
        labels = np.asarray(masked["mask_ids"])
        rows_of = np.broadcast_to(np.arange(rows)[:, None], positions.shape)
        np.testing.assert_array_equal(labels[weights], token_ids[rows_of, positions][weights])
        assert (token_ids[rows_of, positions][weights] >= 5).all()  # selectable only
        unmasked = ~np.zeros_like(ids, bool)
        unmasked[rows_of[weights], positions[weights]] = False
        np.testing.assert_array_equal(ids[unmasked], token_ids[unmasked])  # the rest stay
        new = ids[rows_of, positions][weights]
        shares.append([np.mean(new == data.MASK_ID), np.mean(new == labels[weights])])
    # 80% [MASK]; 10% random plus 10% kept: about 12% equal to the original.
    np.testing.assert_allclose(shares[0], shares[1], atol=0.06)
    np.testing.assert_allclose(shares[0], [0.8, 0.1 + 0.1 / vocabulary_size], atol=0.06)
    # Positions sorted within a row, padding (weight 0) after the real ones.
    positions = ours["mask_positions"]
    weights = ours["mask_weights"] > 0
    assert (np.diff(np.where(weights, positions, length), axis=1) >= 0).all()
    assert not positions[~weights].any()


def test_training_stream_resumes_at_the_same_batches(data, vocabulary):
    pairs = [(a, b) for a, b in zip(TEXTS, TEXTS[1:])]
    per_pass = len(pairs) // 8
    stream = data.pair_batches(pairs, vocabulary, 24, 8, 6, seed=3)
    # No autotuner: deleting its iterator could hold `fit` up to a minute.
    assert stream.options().autotune.enabled is False
    unshuffled = data.pair_batches(pairs, vocabulary, 24, 8, 6, seed=3, shuffle=False)
    assert unshuffled.options().autotune.enabled is False
    first = list(stream.take(per_pass + 3).as_numpy_iterator())
    k = per_pass + 1
    resumed = data.pair_batches(pairs, vocabulary, 24, 8, 6, seed=3, start_step=k)
    for a, b in zip(first[k:], resumed.take(2).as_numpy_iterator(), strict=False):
        # The same pairs with the same masks.
        for name in ("token_ids", "segment_ids", "mask_positions"):
            np.testing.assert_array_equal(a[0][name], b[0][name])
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[2], b[2])
    # Each pass is in another order.
    unmasked = [_unmasked(*b) for b in first]
    assert any((a != b).any() for a, b in zip(unmasked[:2], unmasked[per_pass: per_pass + 2]))


def _assert_same_batches(expected, got):
    assert len(got) == len(expected) > 1
    for (x, labels, weights), (y, their_labels, their_weights) in zip(expected, got):
        assert sorted(x) == sorted(y)
        for a, b in [*((x[k], y[k]) for k in sorted(x)), (labels, their_labels),
                     (weights, their_weights)]:
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("start_step", [0, 3])
def test_array_pipeline_gives_the_tf_data_batches(data, vocabulary, start_step):
    verses = [data.Verse(f"1:1:{i}", 1 + i // 5, text) for i, text in enumerate(TEXTS * 3)]
    pairs = data.sentence_pairs(verses)
    firsts, seconds = data.sentence_pair_ids(verses, vocabulary.encode_texts(TEXTS * 3))
    assert firsts == vocabulary.encode_texts([a for a, _ in pairs])
    assert seconds == vocabulary.encode_texts([b for _, b in pairs])
    # Length 12 cuts most pairs, round robin.
    for length, batch in ((12, 4), (24, 3)):
        args = (length, batch, 5, 9)
        count = 2 * (len(pairs) // batch) + 1  # across passes
        stream = data.pair_batches(pairs, vocabulary, *args, start_step=start_step)
        arrays = data.pair_arrays(firsts, seconds, vocabulary.size, *args,
                                  start_step=start_step, num_batches=count)
        _assert_same_batches(list(stream.take(count).as_numpy_iterator()),
                             [arrays[i] for i in range(count)])
        once = data.pair_batches(pairs, vocabulary, *args, shuffle=False)
        arrays = data.pair_arrays(firsts, seconds, vocabulary.size, *args, shuffle=False)
        _assert_same_batches(list(once.as_numpy_iterator()),
                             [arrays[i] for i in range(arrays.num_batches)])


def test_prepared_data_round_trips_without_wordpiece(data, vocabulary, tmp_path):
    verses = [data.Verse(f"1:1:{i}", 1, text) for i, text in enumerate(TEXTS)]
    splits = {"train": verses[:3], "validation": verses[3:4], "test": verses[4:]}
    data.save_prepared(tmp_path, splits, vocabulary, {"vocabulary_size": 100})
    loaded, prepared, ids, settings = data.load_prepared(tmp_path)
    assert loaded == splits and settings == {"vocabulary_size": 100}
    assert prepared._tokenizer is None
    for name, split in splits.items():
        texts = [v.text for v in split]
        assert ids[name] == vocabulary.encode_texts(texts) == prepared.encode_texts(texts)
    np.testing.assert_array_equal(prepared.counts(TEXTS), vocabulary.counts(TEXTS))
    assert prepared._tokenizer is None  # known texts need no WordPiece
    with pytest.raises(ValueError, match=r"`--data` must be a folder .*data='"):
        data.load_prepared(tmp_path / "missing")


def test_word_order_task_shuffles_a_random_half_of_the_verses(data):
    verses = [data.Verse(f"1:1:{i}", 1, text) for i, text in enumerate(TEXTS[:4] * 5)]
    verses.append(data.Verse("1:2:1", 1, "amen amen"))  # every order reads as written
    texts, labels = data.word_order_task(verses, seed=3)
    assert (texts, labels) == data.word_order_task(verses, seed=3)
    changed = [text != verse.text for text, verse in zip(texts, verses)]
    assert labels == [int(not c) for c in changed]
    assert sum(changed) >= 9  # 10 of the 21 are shuffled, a shuffle rarely reads as written
    for text, verse in zip(texts, verses):  # the same words, another order
        assert sorted(text.split(" ")) == sorted(verse.text.split(" "))
    assert texts[-1] == "amen amen" and labels[-1] == 1
    # Another seed, another half.
    assert data.word_order_task(verses, seed=4)[1] != labels


def test_word_order_batches(data, vocabulary):
    texts = [TEXTS[0], "the earth and the heavens the in created beginning god"]
    dataset = data.word_order_batches(texts, [1, 0], vocabulary, 16, 4)
    assert dataset.options().autotune.enabled is False
    (x, labels), = dataset.as_numpy_iterator()
    np.testing.assert_array_equal(labels, [1, 0])
    assert x["token_ids"][0, 0] == data.CLS_ID and not x["segment_ids"].any()
    np.testing.assert_array_equal(x["padding_mask"], x["token_ids"] != data.PAD_ID)
    # The same tokens in the other order.
    np.testing.assert_array_equal(np.sort(x["token_ids"][0]), np.sort(x["token_ids"][1]))
    stream = data.word_order_batches(texts, [1, 0], vocabulary, 16, 4, seed=1)
    assert len(next(iter(stream))[1]) == 4  # endless: passes repeat


@pytest.mark.parametrize(
    "accuracies, stops_after",
    [
        # Flat at the majority class for 4 checks, then above it: patience
        # (2 checks) runs from there.
        ([0.5, 0.5, 0.5, 0.5, 0.7, 0.7, 0.7, 0.7], 7),
        ([0.6, 0.6, 0.6, 0.6], 3),  # above from the start: Keras's rule
        ([0.5, 0.4, 0.5, 0.5, 0.5, 0.5], None),  # never above: the whole budget
        ([0.5004583, 0.5004583, 0.5004583, 0.5004583], None),  # 546/1091 in float32
    ],
)
def test_fine_tuning_stops_only_once_above_the_majority_class(train, accuracies, stops_after):
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    stopping = train.StopOnceAboveMajority(
        546 / 1091 + 1 / 1091, monitor="val_accuracy", mode="max", patience=2,
        restore_best_weights=True,
    )
    stopping.set_model(model)
    model.stop_training = False  # as `fit` sets it
    stopping.on_train_begin()
    stopped = None
    for epoch, accuracy in enumerate(accuracies, start=1):
        stopping.on_epoch_end(epoch - 1, {"val_accuracy": accuracy})
        if model.stop_training:
            stopped = epoch
            break
    assert stopped == stops_after


# Metrics and baselines.


class _Unigram:
    """A stand-in model whose logits are the log-frequencies of `counts`."""

    def __init__(self, log_p):
        self.log_p = log_p

    def predict_on_batch(self, x):
        batch, masks = x["mask_positions"].shape
        return np.broadcast_to(self.log_p, (batch, masks, len(self.log_p)))


def test_evaluate_counts_every_real_mask_and_its_baselines(train, data, vocabulary):
    pairs = [(a, b) for a, b in zip(TEXTS, TEXTS[1:])]
    batches = data.pair_batches(pairs, vocabulary, 24, 8, 6, seed=0, shuffle=False)
    counts = vocabulary.counts(TEXTS)
    smoothed = counts.astype("float64") + 1
    smoothed[:5] = 0
    log_p = np.log(np.maximum(smoothed, 1e-300) / smoothed.sum())
    results = train.evaluate(_Unigram(log_p), batches, counts)
    labels = np.concatenate([y[w > 0] for _, y, w in batches.as_numpy_iterator()])
    assert results["masks"] == len(labels)
    # A model that is the unigram model scores as the unigram baseline.
    assert results["most_frequent_token"] == int(np.argmax(counts[5:]) + 5)
    np.testing.assert_allclose(results["accuracy"], results["most_frequent_accuracy"])
    np.testing.assert_allclose(results["perplexity"], results["unigram_perplexity"], rtol=1e-6)
    np.testing.assert_allclose(
        results["unigram_perplexity"], math.exp(-log_p[labels].mean()), rtol=1e-6
    )


# The script.


@pytest.mark.long_run
def test_tiny_run_on_prepared_data_without_tensorflow(tmp_path):
    prepared = tmp_path / "data"
    lines = harness.run_script(EXAMPLE / "train.py", "--tiny", "--prepare", str(prepared))
    assert lines[-1] == f"data prepared in {prepared}"
    env = harness.without_tensorflow(tmp_path)
    args = ("--tiny", "--pretrain-only", "--output-dir", str(tmp_path / "run"))
    lines = harness.run_script(EXAMPLE / "train.py", *args, "--data", str(prepared), env=env)
    assert any(line.endswith("test (arrays)") for line in lines)
    assert re.search(r"step 3: loss \S+, accuracy \S+, val_loss \S+", "\n".join(lines))
    assert 0.0 <= float(harness.last_line_value(lines, "masked_accuracy")) <= 1.0
    assert "pass `--data DIR`" in harness.run_refused(EXAMPLE / "train.py", *args, env=env)
    refused = harness.run_refused(
        EXAMPLE / "train.py", "--tiny", "--data", str(prepared), env=env,
    )
    assert "only `--pretrain-only` runs" in refused


@pytest.mark.long_run
def test_tiny_run_pretrains_resumes_fine_tunes_fills_and_draws(tmp_path):
    output = tmp_path / "run"
    start = time.perf_counter()
    lines = harness.run_script(EXAMPLE / "train.py", "--tiny", "--output-dir", str(output))
    seconds = time.perf_counter() - start
    assert lines[0] == f"backend: {keras.backend.backend()}"
    accuracy = float(harness.last_line_value(lines, "masked_accuracy"))
    assert 0.0 <= accuracy <= 1.0
    text = "\n".join(lines)
    assert re.search(r"learned a WordPiece vocabulary of (\d+) tokens \(asked 300\)", text)
    assert re.search(r"step 3: loss \S+, accuracy \S+, val_loss \S+, val_accuracy", text)
    assert re.search(r"masked accuracy \S+, perplexity \S+; baselines: most frequent token "
                     r"\(.*\) accuracy \S+, unigram perplexity \S+", text)
    assert re.search(r"word-order accuracy: pretrained \S+, from scratch \S+, majority class "
                     r"\S+", text)
    # Each classifier tries every learning rate of the sweep (the tiny
    # preset's 1e-3 and 3e-3) and keeps the one its validation liked best.
    for label in ("pretrained", "from scratch"):
        sweep = [re.fullmatch(rf"  {label}, learning rate (\S+): validation accuracy (\S+) "
                              r"\(best at step (\d+), \S+ s\)", line) for line in lines]
        sweep = [match for match in sweep if match]
        assert [match.group(1) for match in sweep] == ["0.001", "0.003"]
        assert all(int(match.group(3)) in (2, 4) for match in sweep)  # every 2 of 4 steps
        best = max(sweep, key=lambda match: float(match.group(2)))  # the first of ties
        assert re.search(rf"fine-tuned \({label}, learning rate {best.group(1)}\): test "
                         r"accuracy \S+", text)
    assert re.search(r"fill-mask: the verse's word in the top 5 for [0-5] of 5", text)
    fill = lines.index("fill-mask: The [MASK] loved Esther above all the women.")
    assert re.fullmatch(r"  \[MASK\] at position \d+:", lines[fill + 1])
    top = [re.fullmatch(rf"    {rank}\. (\S+) (\S+)", line)
           for rank, line in enumerate(lines[fill + 2: fill + 7], start=1)]
    assert all(top), lines[fill + 2: fill + 7]
    assert re.fullmatch(r"  the verse has 'king': (rank [1-5]|not in the top 5|not one token "
                        r"of the vocabulary)", lines[fill + 7])
    probabilities = [float(match.group(2)) for match in top]
    assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1
    for name in ("model.keras", "vocabulary.txt", "checkpoint/model.weights.h5",
                 "checkpoint/state.json", "checkpoint/vocabulary.txt"):
        assert (output / name).exists(), name
    assert (output / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (output / "checkpoint.tmp").exists()

    log = (output / "log.csv").read_text().splitlines()
    assert log[0].split(",")[0] == "epoch" and len(log) == 3  # two intervals

    # A changed option is refused, naming it (the decay depends on --steps).
    refused = harness.run_refused(
        EXAMPLE / "train.py", "--tiny", "--steps", "9", "--output-dir", str(output)
    )
    assert "steps: 6 in the checkpoint, 9 now" in refused

    # Killed between a checkpoint's renames and at a random moment, resumed
    # each time: the weights (dropout and masks included) and the scores of
    # one run. (`--pretrain-only`: the fine-tuning after the last
    # checkpoint, about half the run, is not what is tested here; the kill
    # during a first write, which no script's code sees, is the GPT
    # example's test.)
    lines = harness.check_killed_runs_end_as_one(
        EXAMPLE / "train.py", ("--tiny", "--pretrain-only"), tmp_path / "killed", output,
        seconds / 2, first_write=False,
    )
    assert harness.last_line_value(lines, "masked_accuracy") == f"{accuracy:.4f}"
