"""The GPT example: `--tiny` training that saves, resumes and samples; its tokenizers.

The training runs in subprocesses on the current backend (`KERAS_BACKEND`),
as a user would run the README's commands. The corpus, the character
tokenizer, the split and the pipelines it shares with the other examples are
tested in `test_examples_common.py`.
"""

import json
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


def test_byte_pair_tokenizer_round_trips_and_refuses_unknown_characters(
    data, tmp_path
):
    text = "the cat sat on the mat; the cat ate.\n" * 5
    chars = data.CharTokenizer.fit(text)
    bpe = data.BytePairTokenizer.fit(text, vocabulary_size=chars.vocabulary_size + 12)
    assert bpe.vocabulary_size == chars.vocabulary_size + 12
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert len(ids) < len(text) / 2  # merges shorten the text
    assert " cat" in bpe.tokens and "the" in bpe.tokens
    data.save_tokenizer(bpe, tmp_path / "t.json")
    np.testing.assert_array_equal(data.load_tokenizer(tmp_path / "t.json").encode(text), ids)
    with pytest.raises(ValueError, match=r"outside the vocabulary.*'Z'"):
        bpe.encode("Zebra")
    with pytest.raises(ValueError, match=r"at least the number of distinct"):
        data.BytePairTokenizer.fit(text, vocabulary_size=chars.vocabulary_size - 1)


def test_saved_character_tokenizers_load(data, tmp_path):
    # The file a checkpoint of the default (character) run holds.
    path = tmp_path / "tokenizer.json"
    path.write_text('{"kind": "char", "characters": ["\\n", " ", "a", "b"]}')
    tokenizer = data.load_tokenizer(path)
    assert tokenizer.kind == "char" and tokenizer.vocabulary_size == 4
    np.testing.assert_array_equal(tokenizer.encode("ab a\n"), [2, 3, 1, 2, 0])
    data.save_tokenizer(tokenizer, tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(
        path.read_text()
    )
