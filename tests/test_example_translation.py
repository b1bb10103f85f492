"""The translation example: pair files, book splits, WordPiece, batches, the
schedule and loss, and a `--tiny` run that saves, resumes, draws and translates.

The run goes in subprocesses on the current backend (`KERAS_BACKEND`), as a
user would run the README's commands; the rest runs in-process on small data
the tests write.
"""

import gzip
import os
import re
import subprocess
import sys
import time
import zipfile

import keras
import numpy as np
import pytest

import harness
from harness import ROOT

EXAMPLE = ROOT / "examples" / "translation"

BIBLE = [
    ("1:1:1", "In the beginning God created the heavens and the earth.",
     "EN el principio crió Dios los cielos y la tierra."),
    ("1:1:3", 'God said, "Let there be light," and there was light.',
     "Y dijo Dios: Sea la luz: y fué la luz."),
    ("6:1:1", "Now after the death of Moses the servant of Yahweh, Yahweh spoke.",
     "Y ACONTECIO después de la muerte de Moisés siervo de Jehová, que Jehová habló."),
    ("8:1:16", "Ruth said, Don't entreat me to leave you.",
     "Y Ruth respondió: No me ruegues que te deje."),
    ("43:11:35", "Jesus wept.", "Y lloró Jesús."),
    ("43:1:1", "In the beginning was the Word.", "EN el principio era el Verbo."),
    ("45:1:1", "Paul, a servant of Jesus Christ.", "PABLO, siervo de Jesucristo."),
]
TATOEBA = [
    ("Go.", "Ve.", "CC-BY 2.0 (France) Attribution: tatoeba.org #2877272 (CM)"),
    ("Go.", "Vete.", "CC-BY 2.0 (France) Attribution: tatoeba.org #2877272 (CM)"),
    ("I'm hungry!", "¡Tengo hambre!", "CC-BY 2.0 (France) Attribution: tatoeba.org #1"),
    ("Who are you?", "¿Quién eres?", "CC-BY 2.0 (France) Attribution: tatoeba.org #2"),
]
SENTENCES = [
    ('God said, "Let there be light," and there was light.',
     "Y dijo Dios: Sea la luz: y fué la luz."),
    ("God's Spirit was hovering over the waters.",
     "El Espíritu de Dios se movía sobre la haz de las aguas."),
    ("Who are you? I am hungry!", "¿Quién eres? ¡Tengo hambre!"),
    ("She kissed her mother-in-law (Naomi).", "Ella besó á su suegra (Noemi)."),
]


def _load(name):
    return harness.load_module(EXAMPLE / f"{name}.py", f"translation_{name}")


@pytest.fixture(scope="module")
def data():
    return _load("data")


@pytest.fixture(scope="module")
def train():
    return _load("train")


def _write_tsv(path, rows):
    text = "".join("\t".join(row) + "\n" for row in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _pairs(data, rows):
    return data.parse_pairs("".join("\t".join(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def tokenizer(data):
    # The learner keeps words seen at least 10 times.
    pairs = [data.Pair(str(i), 1, s, t) for i, (s, t) in enumerate(SENTENCES * 10)]
    return data.PairTokenizer.fit(pairs, vocabulary_size=200)


# Pair files.


@pytest.mark.parametrize("name", ["bible.tsv", "bible.tsv.gz"])
def test_bible_layout_through_a_file_url_into_the_cache(data, tmp_path, name):
    path = _write_tsv(tmp_path / name, BIBLE)
    cache = tmp_path / "cache" / "not_made_yet"
    pairs = data.load_pairs(path.as_uri(), cache_dir=str(cache))
    assert [tuple(p) for p in pairs[:2]] == [
        ("1:1:1", 1, BIBLE[0][1], BIBLE[0][2]),
        ("1:1:3", 1, BIBLE[1][1], BIBLE[1][2]),
    ]
    assert [p.book for p in pairs] == [1, 1, 6, 8, 43, 43, 45]
    assert data.is_bible(pairs)
    assert [c.parent for c in cache.rglob(name)] == [cache / data.CACHE_SUBDIR]
    path.unlink()  # read from the cache from now on
    assert data.load_pairs(path.as_uri(), cache_dir=str(cache)) == pairs


def test_tatoeba_layout_and_its_zip(data, tmp_path):
    # spa-eng.zip holds spa-eng/spa.txt and a smaller spa-eng/_about.txt.
    text = "".join("\t".join(row) + "\n" for row in TATOEBA)
    archive = tmp_path / "spa-eng.zip"
    with zipfile.ZipFile(archive, "w") as f:
        f.writestr("spa-eng/_about.txt", "About the pairs.\n" * 100)
        f.writestr("spa-eng/spa.txt", text)
    pairs = data.load_pairs(archive.as_uri(), cache_dir=str(tmp_path / "cache"))
    assert [(p.reference, p.source, p.target) for p in pairs] == [
        (str(i + 1), s, t) for i, (s, t, _) in enumerate(TATOEBA)
    ]
    assert not data.is_bible(pairs)
    # Two columns are enough; the group is a stable hash of the English.
    two = data.parse_pairs("Go.\tVe.\n\nWho are you?\t¿Quién eres?\n")
    assert [p.reference for p in two] == ["1", "3"]
    assert two[0].book == pairs[0].book == data.group_of("go.")
    assert 0 <= two[1].book < data.NUM_GROUPS


def test_layout_errors_name_the_line(data, tmp_path):
    with pytest.raises(ValueError, match=r"book:chapter:verse.*line 2: 'oops'"):
        data.parse_pairs("1:1:1\ta\tb\noops\n")
    with pytest.raises(ValueError, match=r"english<TAB>spanish.*line 1: 'alone'"):
        data.parse_pairs("alone\n")
    with pytest.raises(ValueError, match=r"`layout` must be one of.*'csv'"):
        data.parse_pairs("a\tb\n", layout="csv")
    with pytest.raises(ValueError, match=r"`source` does not exist"):
        data.load_pairs(str(tmp_path / "missing.tsv"))


# Splits and the length filter.


def test_split_holds_out_whole_books(data):
    pairs = _pairs(data, BIBLE)
    train, validation, test = data.split_pairs(pairs, validation_books=[6, 45],
                                               test_books=[8, 43])
    assert {p.book for p in train} == {1}
    assert {p.book for p in validation} == {6, 45}
    assert {p.book for p in test} == {8, 43}
    assert sorted(train + validation + test) == sorted(pairs)
    with pytest.raises(ValueError, match=r"cannot both validate and test.*\[43\]"):
        data.split_pairs(pairs, validation_books=[43], test_books=[8, 43])


def test_default_split_of_the_shipped_pairs(data):
    pairs = data.load_pairs()
    assert len(pairs) == 31_025
    short = data.filter_by_length(pairs)
    assert len(short) == 22_410
    train, validation, test = data.split_pairs(short)
    assert (len(train), len(validation), len(test)) == (20_615, 754, 1_041)
    assert len(data.filter_by_length(pairs, max_words=20)) == 12_302
    books = [{p.book for p in split} for split in (train, validation, test)]
    assert books[1] == set(data.BIBLE_VALIDATION_BOOKS)
    assert books[2] == set(data.BIBLE_TEST_BOOKS)
    assert not (books[0] & books[1]) and not (books[0] & books[2])
    assert data.book_names(data.BIBLE_TEST_BOOKS) == (
        "Ruth (8), Esther (17), Ecclesiastes (21), John (43)"
    )


def test_tatoeba_split_keeps_an_english_sentence_on_one_side(data):
    rows = [(f"Sentence number {i}.", f"Frase {i}.") for i in range(300)]
    rows += [("Sentence number 7.", "Otra frase siete.")]
    pairs = data.parse_pairs("".join(f"{s}\t{t}\n" for s, t in rows))
    train, validation, test = data.split_pairs(pairs)
    assert validation and test and len(train) > len(validation) + len(test)
    for split in (train, validation, test):
        sevens = [p for p in split if p.source == "Sentence number 7."]
        assert len(sevens) in (0, 2)
    assert {p.book for p in validation} <= set(data.GROUP_VALIDATION_BOOKS)


def test_length_filter_counts_words_on_both_sides(data):
    thirty, thirty_one = " ".join(["w"] * 30), " ".join(["w"] * 31)
    pairs = [
        data.Pair("1", 1, thirty, thirty),
        data.Pair("2", 1, thirty_one, "corto"),
        data.Pair("3", 1, "short", thirty_one),
        data.Pair("4", 1, "a  b\tc", "x"),
    ]
    assert [p.reference for p in data.filter_by_length(pairs)] == ["1", "4"]
    assert [p.reference for p in data.filter_by_length(pairs, max_words=3)] == ["4"]


# WordPiece.


def test_wordpiece_round_trip(data, tokenizer):
    assert tokenizer.source_vocabulary[:4] == ["[PAD]", "[UNK]", "[START]", "[END]"]
    assert (data.PAD_ID, data.UNK_ID, data.START_ID, data.END_ID) == (0, 1, 2, 3)
    sources = [s for s, _ in SENTENCES]
    targets = [t for _, t in SENTENCES]
    for ids, text in zip(tokenizer.encode_source(sources), sources):
        assert min(ids) >= 4
        assert data.join_tokens(tokenizer.source_tokens(ids)) == text
    for ids, text in zip(tokenizer.encode_target(targets), targets):
        assert tokenizer.detokenize([data.START_ID] + ids + [data.END_ID, 0, 0]) == text
    # An unseen character is [UNK]; ids after [END] are not read.
    ids = tokenizer.encode_target(["luz €"])[0]
    assert ids[-1] == data.UNK_ID
    assert tokenizer.detokenize(ids + [data.END_ID] + ids) == "luz [UNK]"


def test_wordpiece_vocabularies_save_and_load(data, tokenizer, tmp_path):
    tokenizer.save(tmp_path)
    assert (tmp_path / "source_vocabulary.txt").read_text(encoding="utf-8").split("\n")[:2] == [
        "[PAD]", "[UNK]"
    ]
    loaded = data.PairTokenizer.load(tmp_path)
    assert loaded.source_vocabulary == tokenizer.source_vocabulary
    assert loaded.target_vocabulary == tokenizer.target_vocabulary
    text = [SENTENCES[1][1]]
    assert loaded.encode_target(text) == tokenizer.encode_target(text)

    pairs = [data.Pair(str(i), 1, s, t) for i, (s, t) in enumerate(SENTENCES * 10)]
    shared = data.PairTokenizer.fit(pairs, vocabulary_size=200, shared=True)
    assert shared.shared and shared.source_vocabulary == shared.target_vocabulary
    assert {"luz", "light", "¿", "w"} <= set(shared.source_vocabulary)
    text = [SENTENCES[2][0]]
    assert shared.encode_target(text) == shared.encode_source(text)
    shared.save(tmp_path / "shared")
    assert (tmp_path / "shared" / "vocabulary.txt").exists()
    assert data.PairTokenizer.load(tmp_path / "shared").shared
    with pytest.raises(ValueError, match=r"`target_vocabulary` must start with"):
        data.PairTokenizer(tokenizer.source_vocabulary, ["a", "b", "c", "d"])


def test_join_tokens_spaces_punctuation(data):
    assert data.join_tokens(["¿", "Qui", "##én", "?", "¡", "Sí", "!"]) == "¿Quién? ¡Sí!"
    assert data.join_tokens(["a", '"', "b", ",", '"', "c", "."]) == 'a "b," c.'
    assert data.join_tokens(["Don", "'", "t", "(", "x", ")"]) == "Don't (x)"
    assert data.join_tokens([]) == ""


# Batches.


def _rows(dataset):
    """`(encoder ids, decoder ids, labels, weights)` of every row, unpadded by
    the weights, and the batches."""
    rows, batches = [], list(dataset.as_numpy_iterator())
    for inputs, labels, weights in batches:
        for e, d, y, w in zip(inputs["encoder_token_ids"], inputs["decoder_token_ids"],
                              labels, weights):
            rows.append((e, d, y, w))
    return rows, batches


def test_eval_batches_teacher_forcing_and_padding(data, tokenizer):
    pairs = [data.Pair(str(i), 1, s, t) for i, (s, t) in enumerate(SENTENCES * 5)]
    dataset = data.eval_batches(pairs, tokenizer, max_length=24, batch_tokens=64)
    assert dataset.options().autotune.enabled is False
    rows, batches = _rows(dataset)
    assert len(rows) == len(pairs)  # none dropped
    expected = sorted(
        (tuple(s[:24]), tuple(t[:23]))  # truncated to max_length with [START] / [END]
        for s, t in zip(tokenizer.encode_source([p.source for p in pairs]),
                        tokenizer.encode_target([p.target for p in pairs]))
    )
    seen = []
    for encoder, decoder, labels, weights in rows:
        assert encoder.dtype == np.int32 and decoder.dtype == np.int32
        assert decoder.shape == labels.shape == weights.shape == encoder.shape
        n = int(weights.sum())  # target tokens + [END]
        np.testing.assert_array_equal(weights, labels != 0)
        np.testing.assert_array_equal(weights[:n], 1.0)
        assert decoder[0] == data.START_ID and labels[n - 1] == data.END_ID
        np.testing.assert_array_equal(decoder[1:n], labels[: n - 1])  # shifted by one
        assert not decoder[n:].any() and not labels[n:].any()
        source = encoder[encoder != 0]
        assert not encoder[len(source):].any()  # padding at the end
        seen.append((tuple(source), tuple(labels[: n - 1])))
    assert sorted(seen) == expected
    for inputs, _, _ in batches:
        assert inputs["encoder_token_ids"].shape[1] % 8 == 0


def test_bucketing_keeps_similar_lengths_together(data, tokenizer):
    short = [(f"Go {i}.", "Ve.") for i in range(12)]
    long = [(s + " " + s, t + " " + t) for s, t in SENTENCES] * 3
    pairs = [data.Pair(str(i), 1, s, t) for i, (s, t) in enumerate(short + long)]
    pairs = [pairs[i] for i in np.random.default_rng(0).permutation(len(pairs))]
    max_length, batch_tokens = 48, 96
    boundaries = data.bucket_boundaries(max_length)
    assert boundaries == [9, 17, 25, 33, 41, 49]
    _, batches = _rows(data.eval_batches(pairs, tokenizer, max_length, batch_tokens))
    for inputs, labels, weights in batches:
        source_lengths = (inputs["encoder_token_ids"] != 0).sum(axis=1)
        lengths = np.maximum(source_lengths, weights.sum(axis=1))
        padded = labels.shape[1]
        assert padded + 1 in boundaries
        # Every row of the batch lies in the bucket below the boundary.
        assert lengths.max() <= padded and lengths.min() > padded - 8
        assert len(labels) <= batch_tokens // padded
    assert len({b[1].shape[1] for b in batches}) > 1


def test_training_stream_is_a_function_of_the_step(data, tokenizer):
    pairs = [data.Pair(str(i), 1, s, t) for i, (s, t) in enumerate(SENTENCES * 6)]
    stream, per_epoch = data.train_batches(pairs, tokenizer, 24, 64, seed=3)
    assert per_epoch > 1
    # No autotuner: deleting its iterator could hold `fit` up to a minute.
    assert stream.options().autotune.enabled is False
    first = list(stream.take(2 * per_epoch + 2).as_numpy_iterator())
    # A pass sees every pair at most once and drops each bucket's remainder.
    epoch = [row for batch in first[:per_epoch] for row in batch[1]]
    assert len(epoch) <= len(pairs)
    # Resumed at step k, the stream continues as the uninterrupted one.
    k = per_epoch + 1
    resumed, _ = data.train_batches(pairs, tokenizer, 24, 64, seed=3, start_step=k)
    for a, b in zip(first[k:], resumed.take(2).as_numpy_iterator()):
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[0]["encoder_token_ids"], b[0]["encoder_token_ids"])
    # Passes are shuffled differently.
    again = first[per_epoch : 2 * per_epoch]
    assert any(
        a[1].shape != b[1].shape or (a[1] != b[1]).any() for a, b in zip(first, again)
    )


def _as_numpy(batch):
    inputs, labels, weights = batch
    return (
        {k: np.asarray(v) for k, v in sorted(inputs.items())}, np.asarray(labels),
        np.asarray(weights),
    )


def _assert_same_batches(expected, got):
    assert len(got) == len(expected) > 1
    for want, have in zip(expected, got):
        want, have = _as_numpy(want), _as_numpy(have)
        assert list(want[0]) == list(have[0]) == ["decoder_token_ids", "encoder_token_ids"]
        for a, b in zip([*want[0].values(), *want[1:]], [*have[0].values(), *have[1:]]):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("start_step", [0, 4])
def test_array_pipeline_gives_the_tf_data_batches(data, tokenizer, start_step):
    pairs = [data.Pair(str(i), 1, s, t) for i, (s, t) in enumerate(SENTENCES * 6)]
    sources = tokenizer.encode_source([p.source for p in pairs])
    targets = tokenizer.encode_target([p.target for p in pairs])
    stream, per_epoch = data.train_batches(pairs, tokenizer, 24, 64, seed=3,
                                           start_step=start_step)
    count = 2 * per_epoch + 1  # across data epochs
    arrays, arrays_per_epoch = data.train_arrays(
        sources, targets, 24, 64, seed=3, start_step=start_step, num_batches=count
    )
    assert arrays_per_epoch == per_epoch and arrays.num_batches == count
    _assert_same_batches(
        list(stream.take(count).as_numpy_iterator()), [arrays[i] for i in range(count)]
    )
    # The evaluation pass, partial buckets included.
    evaluation = data.eval_arrays(sources, targets, 24, 64)
    _assert_same_batches(
        list(data.eval_batches(pairs, tokenizer, 24, 64).as_numpy_iterator()),
        [evaluation[i] for i in range(evaluation.num_batches)],
    )


def test_prepared_data_round_trips_without_wordpiece(data, tokenizer, tmp_path):
    pairs = [data.Pair(f"1:1:{i}", 1, s, t) for i, (s, t) in enumerate(SENTENCES)]
    splits = {"train": pairs[:2], "validation": pairs[2:3], "test": pairs[3:]}
    data.save_prepared(tmp_path, splits, tokenizer, {"max_words": 20})
    loaded, prepared, ids, settings = data.load_prepared(tmp_path)
    assert loaded == splits and settings == {"max_words": 20}
    assert prepared._preprocessor is None
    for name, split in splits.items():
        expected = tokenizer.encode_source([p.source for p in split])
        assert ids[name][0] == expected
        assert ids[name][1] == tokenizer.encode_target([p.target for p in split])
        # Known texts encode without making KerasHub's WordPiece.
        assert prepared.encode_source([p.source for p in split]) == expected
    assert prepared._preprocessor is None
    with pytest.raises(ValueError, match=r"`--data` must be a folder .*data='"):
        data.load_prepared(tmp_path / "missing")


def test_tokenizers_are_a_translation_preprocessors(data, tokenizer, tmp_path):
    from keras_attention.models import Seq2SeqTransformer
    from keras_attention.models import TranslationPreprocessor

    preprocessor = tokenizer.preprocessor
    assert isinstance(preprocessor, TranslationPreprocessor)
    assert (tokenizer.source, tokenizer.target) == (
        preprocessor.source_tokenizer, preprocessor.target_tokenizer
    )
    assert (preprocessor.start_token_id, preprocessor.end_token_id,
            preprocessor.pad_token_id) == (data.START_ID, data.END_ID, data.PAD_ID)
    # Its packing is the example's teacher forcing, padded.
    sources, targets = [s for s, _ in SENTENCES], [t for _, t in SENTENCES]
    x, labels, _ = preprocessor((sources, targets), encoder_sequence_length=24,
                                decoder_sequence_length=24)
    for row, (s, t) in enumerate(zip(tokenizer.encode_source(sources),
                                     tokenizer.encode_target(targets))):
        encoder, decoder, y = data.teacher_forcing(s, t, 24)
        np.testing.assert_array_equal(np.asarray(x["encoder_token_ids"][row])[: len(encoder)], encoder)
        np.testing.assert_array_equal(np.asarray(x["decoder_token_ids"][row])[: len(decoder)], decoder)
        np.testing.assert_array_equal(np.asarray(labels[row]), y + [0] * (24 - len(y)))

    # A model saved and loaded as `translate.py` does translates text, as
    # the example's `translate` does, but for the spaces around punctuation
    # and a leading `##` piece, which KerasHub's detokenization keeps.
    keras.utils.set_random_seed(2)
    model = Seq2SeqTransformer(tokenizer.source_vocabulary_size, tokenizer.target_vocabulary_size,
                               16, 16, 1, 1, 2, 16, 32)
    model.build()
    model.save(tmp_path / "model.keras")
    tokenizer.save(tmp_path)
    loaded, loaded_tokenizer = _load("translate").load(tmp_path)
    assert loaded.preprocessor.decoder_sequence_length == 16
    texts = ["In the beginning.", "Jesus wept."]
    example = _load("translate").translate(loaded, loaded_tokenizer, texts, "greedy")

    def bare(text):
        return text.replace(" ", "").replace("##", "")

    assert [bare(t) for t in loaded.translate(texts)] == [bare(t) for t in example]
    assert all(example)


def test_source_batches_sort_by_length_and_pad(data, tokenizer):
    texts = [s for s, _ in SENTENCES] + ["Who are you?"]
    batches = data.source_batches(texts, tokenizer, max_length=16, batch_size=2)
    assert sorted(i for indices, _ in batches for i in indices) == list(range(len(texts)))
    encoded = tokenizer.encode_source(texts)
    for indices, ids in batches:
        assert ids.shape[1] % 8 == 0 and ids.shape[1] <= 16
        for row, i in zip(ids, indices):
            n = min(len(encoded[i]), 16)
            np.testing.assert_array_equal(row[:n], encoded[i][:n])
            assert not row[n:].any()


# Schedule and loss.


def test_inverse_square_root_schedule(train):
    schedule = train.InverseSquareRootSchedule(hidden_dim=64, warmup_steps=100, scale=2.0)
    steps = np.array([0, 49, 99, 399], "int64")
    expected = [2.0 * 64**-0.5 * min(s**-0.5, s * 100**-1.5) for s in steps + 1]
    actual = [float(keras.ops.convert_to_numpy(schedule(int(s)))) for s in steps]
    np.testing.assert_allclose(actual, expected, rtol=1e-6)
    assert actual[2] == max(actual)  # the peak at the end of the warm-up
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(schedule)
    )
    assert isinstance(restored, train.InverseSquareRootSchedule)
    assert restored.get_config() == {"hidden_dim": 64, "warmup_steps": 100, "scale": 2.0}


def test_smoothed_loss_is_categorical_cross_entropy_on_real_tokens(train):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype("float32")
    labels = rng.integers(1, 7, size=(2, 5)).astype("int32")
    labels[0, 3:] = 0
    weights = (labels != 0).astype("float32")
    loss = train.SmoothedCrossEntropy(0.1)
    reference = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=0.1, reduction="none"
    )(np.eye(7, dtype="float32")[labels], logits)
    expected = (keras.ops.convert_to_numpy(reference) * weights).sum() / weights.sum()
    actual = float(keras.ops.convert_to_numpy(loss(labels, logits, sample_weight=weights)))
    np.testing.assert_allclose(actual, expected, rtol=1e-5)
    restored = train.SmoothedCrossEntropy.from_config(loss.get_config())
    assert restored.label_smoothing == 0.1


# The scripts.


def _run(script, *args):
    return harness.run_script(EXAMPLE / script, *args)


@pytest.mark.parametrize("script", ["train.py", "translate.py"])
def test_scripts_reject_an_unknown_backend_before_importing_keras(script):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / script), "--backend", "numpy"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "argument --backend: invalid choice: 'numpy'" in result.stderr


@pytest.mark.long_run
def test_tiny_run_on_prepared_data_without_tensorflow(tmp_path):
    prepared = tmp_path / "data"
    lines = _run("train.py", "--tiny", "--prepare", str(prepared))
    assert lines[-1] == f"data prepared in {prepared}"
    env = harness.without_tensorflow(tmp_path)
    args = ("--tiny", "--output-dir", str(tmp_path / "run"))
    lines = harness.run_script(EXAMPLE / "train.py", *args, "--data", str(prepared), env=env)
    assert any(line.endswith("training batches per pass (arrays)") for line in lines)
    assert any(re.match(r"step 3: loss \S+, accuracy \S+, val_loss", line) for line in lines)
    harness.last_line_value(lines, "bleu")
    # Without the prepared data it says what to do; another option is refused.
    assert "pass `--data DIR`" in harness.run_refused(EXAMPLE / "train.py", *args, env=env)
    (tmp_path / "other.tsv").write_text("Hello.\tHola.\n")  # exists: only its name differs
    refused = harness.run_refused(
        EXAMPLE / "train.py", *args, "--fresh", "--data", str(prepared), "--source",
        str(tmp_path / "other.tsv"), env=env,
    )
    assert "prepared with source=None" in refused


@pytest.mark.long_run
def test_tiny_run_trains_resumes_draws_and_translates(tmp_path):
    output = tmp_path / "run"
    start = time.perf_counter()
    lines = _run("train.py", "--tiny", "--output-dir", str(output))
    seconds = time.perf_counter() - start
    assert lines[0] == f"backend: {keras.backend.backend()}"
    harness.last_line_value(lines, "bleu")
    assert any(re.match(r"step 3: loss \S+, accuracy \S+, val_loss", line) for line in lines)
    assert any(re.match(r"test greedy: BLEU \S+, chrF \S+", line) for line in lines)
    assert any(re.match(r"test beam \(2 beams\): BLEU \S+, chrF \S+", line) for line in lines)
    for name in ("model.keras", "source_vocabulary.txt", "target_vocabulary.txt",
                 "checkpoint/model.weights.h5", "checkpoint/state.json"):
        assert (output / name).exists(), name
    png = output / "cross_attention.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (output / "checkpoint.tmp").exists()

    # Another option than the checkpoint's is refused, naming it.
    refused = harness.run_refused(
        EXAMPLE / "train.py", "--tiny", "--eval-interval", "2", "--steps", "8",
        "--output-dir", str(output),
    )
    assert "eval_interval: 3 in the checkpoint, 2 now" in refused
    assert "steps:" not in refused  # honoured: the schedule ignores it

    # Killed between a checkpoint's renames and at a random moment, resumed
    # each time: the weights of one run (`--train-only`: the scoring after
    # the last checkpoint, about half the run, is not what is tested here;
    # the kill during a first write, which no script's code sees, is the GPT
    # example's test).
    harness.check_killed_runs_end_as_one(
        EXAMPLE / "train.py", ("--tiny", "--train-only"), tmp_path / "killed", output,
        seconds / 2, first_write=False,
    )

    # A second run with more steps resumes at step 6 and trains 3 more.
    lines = _run("train.py", "--tiny", "--steps", "9", "--output-dir", str(output))
    assert f"resuming from step 6 of {output}" in lines
    assert "trained 3 steps" in "\n".join(lines)
    assert any(re.match(r"step 9: loss", line) for line in lines)
    assert not any(re.match(r"step [36]: loss", line) for line in lines)
    harness.last_line_value(lines, "bleu")
    log = (output / "log.csv").read_text().splitlines()
    assert log[0].startswith("epoch") and len(log) == 4  # three intervals, two runs

    # The saved model (loaded in safe mode) translates, one line a sentence.
    sentences = ("In the beginning.", "Jesus wept.", "God said.")
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / "translate.py"), "--output-dir", str(output),
         "--sampling", "greedy", *sentences],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, KERAS_BACKEND=keras.backend.backend()),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # Each source, then its translation on the next line (never blank).
    lines = result.stdout.rstrip("\n").split("\n")
    assert lines[0::2] == list(sentences)
    assert all(re.fullmatch(r"  -> \S.*", line) for line in lines[1::2]), lines
    assert len(lines) == 2 * len(sentences)
