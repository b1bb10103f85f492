"""The GPT example: `--tiny` training that saves, resumes and samples; its data.

The training runs in subprocesses on the current backend (`KERAS_BACKEND`),
as a user would run the README's commands.
"""

import re

import keras
import numpy as np
import pytest

import harness
from harness import ROOT

EXAMPLE = ROOT / "examples" / "gpt_lm"


def _load(name):
    return harness.load_module(EXAMPLE / f"{name}.py", f"gpt_lm_{name}")


@pytest.fixture(scope="module")
def data():
    return _load("data")


def _run(script, *args):
    return harness.run_script(EXAMPLE / script, *args)


def _val_loss(lines):
    return float(harness.last_line_value(lines, "val_loss"))


def test_tiny_run_trains_saves_resumes_and_samples(tmp_path):
    output = str(tmp_path / "run")
    lines = _run("train.py", "--tiny", "--output-dir", output)
    assert lines[0] == f"backend: {keras.backend.backend()}"
    first = _val_loss(lines)
    assert any(re.match(r"step 3: loss \S+, val_loss \S+", line) for line in lines)
    assert any(line.startswith("---- sample at step 6") for line in lines)
    assert (tmp_path / "run" / "model.keras").exists()

    # A second run with more steps resumes at step 6 and trains 3 more.
    lines = _run("train.py", "--tiny", "--steps", "9", "--output-dir", output)
    assert f"resuming from step 6 of {output}" in lines
    assert "trained 3 steps" in "\n".join(lines)
    assert any(re.match(r"step 9: loss", line) for line in lines)
    assert not any(re.match(r"step [36]: loss", line) for line in lines)
    assert _val_loss(lines) != first

    # The saved model (loaded in safe mode) writes text after a prompt; 24
    # characters need one slide of the 16-character context.
    args = ("--output-dir", output, "--prompt", "ROMEO:", "--length", "24", "--seed", "3")
    text = "\n".join(_run("sample.py", *args))
    assert text.startswith("ROMEO:")
    assert len(text) == len("ROMEO:") + 24


def test_resumed_run_sees_the_batches_of_an_uninterrupted_run(data):
    ids = np.arange(500, dtype="int32")
    whole = list(data.train_batches(ids, 8, 4, seed=5).take(6).as_numpy_iterator())
    resumed = list(data.train_batches(ids, 8, 4, seed=5, start_step=3).take(3).as_numpy_iterator())
    for (x, y), (rx, ry) in zip(whole[3:], resumed):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
    x, y = whole[0]
    assert x.shape == (4, 8) and y.shape == (4, 8)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets: shifted inputs
    np.testing.assert_array_equal(np.diff(x, axis=1), 1)  # consecutive windows
    other = list(data.train_batches(ids, 8, 4, seed=6).take(1).as_numpy_iterator())
    assert not np.array_equal(other[0][0], x)


def test_validation_covers_the_whole_split_in_order(data):
    ids = np.arange(101, dtype="int32")
    batches = list(data.validation_batches(ids, 10, 4).as_numpy_iterator())
    inputs = np.concatenate([x for x, _ in batches])
    targets = np.concatenate([y for _, y in batches])
    np.testing.assert_array_equal(inputs.reshape(-1), np.arange(100))
    np.testing.assert_array_equal(targets.reshape(-1), np.arange(1, 101))
    train, val = data.split_ids(np.arange(1000), 0.9)
    assert train[-1] == 899 and val[0] == 900 and len(val) == 100


def test_tokenizers_round_trip_and_refuse_unknown_characters(data, tmp_path):
    text = "the cat sat on the mat; the cat ate.\n" * 5
    chars = data.CharTokenizer.fit(text)
    assert chars.decode(chars.encode(text)) == text
    assert chars.vocabulary_size == len(set(text))
    bpe = data.BytePairTokenizer.fit(text, vocabulary_size=chars.vocabulary_size + 12)
    assert bpe.vocabulary_size == chars.vocabulary_size + 12
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert len(ids) < len(text) / 2  # merges shorten the text
    assert " cat" in bpe.tokens and "the" in bpe.tokens
    data.save_tokenizer(bpe, tmp_path / "t.json")
    np.testing.assert_array_equal(data.load_tokenizer(tmp_path / "t.json").encode(text), ids)
    for tokenizer in (chars, bpe):
        with pytest.raises(ValueError, match=r"outside the vocabulary.*'Z'"):
            tokenizer.encode("Zebra")


def test_load_text_from_a_url_into_a_cache_dir(data, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be\n", encoding="utf-8")
    cache = tmp_path / "cache"
    text = data.load_text(corpus.as_uri(), cache_dir=str(cache))
    assert text == "to be or not to be\n"
    cached = list(cache.rglob("corpus.txt"))
    assert len(cached) == 1
    corpus.unlink()  # read from the cache from now on
    assert data.load_text(corpus.as_uri(), cache_dir=str(cache)) == text
    assert len(data.load_text()) == 1_115_394  # the shipped tiny-shakespeare
    with pytest.raises(ValueError, match="does not exist"):
        data.load_text(str(tmp_path / "missing.txt"))
