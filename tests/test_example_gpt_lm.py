"""The GPT example: `--tiny` training that saves, resumes and samples; its tokenizers.

The training runs in subprocesses on the current backend (`KERAS_BACKEND`),
as a user would run the README's commands. The corpus, the character
tokenizer, the split and the pipelines it shares with the other examples are
tested in `test_examples_common.py`.
"""

import gzip
import json
import os
import re
import time

import keras
import numpy as np
import pytest

import harness
import keras_attention  # noqa: F401  (registers the models for loading)
from harness import ROOT

EXAMPLE = ROOT / "examples" / "gpt_lm"


def _load(name):
    return harness.load_module(EXAMPLE / f"{name}.py", f"gpt_lm_{name}")


@pytest.fixture(scope="module")
def data():
    return _load("data")


def _run(script, *args, env=None):
    return harness.run_script(EXAMPLE / script, *args, env=env)


def _val_loss(lines):
    return float(harness.last_line_value(lines, "val_loss"))


@pytest.mark.long_run
def test_tiny_run_trains_without_tensorflow(tmp_path):
    env = harness.without_tensorflow(tmp_path)
    lines = _run("train.py", "--tiny", "--output-dir", str(tmp_path / "run"), env=env)
    assert "data pipeline: arrays" in lines
    assert _val_loss(lines) < 4.5  # from ln(65) = 4.17 at the start, near it after 6 steps
    # Asked for, tf.data is refused by name.
    stderr = harness.run_refused(
        EXAMPLE / "train.py", "--tiny", "--pipeline", "tf.data", "--output-dir",
        str(tmp_path / "refused"), env=env,
    )
    assert "pipeline='tf.data'" in stderr


@pytest.mark.long_run
def test_tiny_run_trains_saves_resumes_and_samples(tmp_path):
    output = tmp_path / "run"
    start = time.perf_counter()
    lines = _run("train.py", "--tiny", "--output-dir", str(output))
    seconds = time.perf_counter() - start
    assert lines[0] == f"backend: {keras.backend.backend()}"
    first = _val_loss(lines)
    assert any(re.match(r"step 3: loss \S+, val_loss \S+", line) for line in lines)
    assert any(line.startswith("---- sample at step 6") for line in lines)
    assert (output / "model.keras").exists()
    log = (output / "log.csv").read_text().splitlines()
    assert log[0].split(",")[0] == "epoch" and len(log) == 3  # two intervals

    # Run again: it finds the finished run and trains nothing.
    lines = _run("train.py", "--tiny", "--output-dir", str(output))
    assert f"resuming from step 6 of {output}" in lines
    assert f"nothing to train: the checkpoint in {output} is at step 6, the last of --steps 6" in "\n".join(lines)
    assert _val_loss(lines) == first

    # Other options are refused, naming each (the schedule depends on --steps).
    refused = harness.run_refused(
        EXAMPLE / "train.py", "--tiny", "--steps", "9", "--learning-rate", "0.01",
        "--output-dir", str(output),
    )
    assert "steps: 6 in the checkpoint, 9 now" in refused
    assert "learning_rate: 0.001 in the checkpoint, 0.01 now" in refused

    # Killed while writing its first checkpoint, then between the renames of
    # its second, then at a moment of the clock's choosing, and resumed each
    # time: it ends with the uninterrupted run's weights.
    lines = harness.check_killed_runs_end_as_one(
        EXAMPLE / "train.py", ("--tiny",), tmp_path / "killed", output, seconds
    )
    assert _val_loss(lines) == pytest.approx(float(first), abs=1e-4)

    # The saved model (loaded in safe mode) writes text after a prompt; 24
    # characters need one slide of the 16-character context.
    args = ("--output-dir", str(output), "--prompt", "ROMEO:", "--length", "24", "--seed", "3")
    text = "\n".join(_run("sample.py", *args))
    assert text.startswith("ROMEO:")
    assert len(text) == len("ROMEO:") + 24


@pytest.mark.long_run
def test_eval_batches_estimates_each_split_from_n_random_batches(tmp_path):
    """`--eval-batches 2`: every interval evaluates 2 random batches of 4
    windows of each split, drawn from `(seed, split, step)`; the printed
    validation loss is the mean cross-entropy over those 8 windows, computed
    here by hand from the saved model's logits. A resume refuses another N."""
    output = tmp_path / "run"
    lines = _run("train.py", "--tiny", "--eval-batches", "2", "--output-dir", str(output))
    assert any(
        re.match(r"step 3: loss \S+, val_loss \S+, train_estimate \S+, ", line)
        for line in lines
    )
    assert any(re.match(r"training: [\d.]+ ms/step", line) for line in lines)
    assert any(re.match(r"time: training [\d.]+ s, evaluation [\d.]+ s", line) for line in lines)
    log = (output / "log.csv").read_text().splitlines()
    assert {"val_loss", "train_estimate"} <= set(log[0].split(","))

    # The tiny preset: seed 1337, batches of 4 windows of 16; the estimate
    # at the last step (6) draws 2 x 4 windows of the validation split.
    tokenizer = _load("data").load_tokenizer(output / "tokenizer.json")
    with gzip.open(ROOT / "examples" / "data" / "tinyshakespeare.txt.gz", "rt") as f:
        ids = tokenizer.encode(f.read())
    val_ids = ids[int(0.9 * len(ids)):]
    rng = np.random.default_rng((1337, 1, 6))
    starts = rng.integers(0, len(val_ids) - 16, 2 * 4)
    windows = val_ids[starts[:, None] + np.arange(17)]  # (8, 17)
    model = keras.saving.load_model(output / "model.keras")
    logits = keras.ops.convert_to_numpy(model(windows[:, :-1])).astype("float64")
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    targets = windows[:, 1:]
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    assert _val_loss(lines) == pytest.approx(expected, abs=1e-4)

    refused = harness.run_refused(
        EXAMPLE / "train.py", "--tiny", "--eval-batches", "3", "--output-dir", str(output)
    )
    assert "eval_batches: 2 in the checkpoint, 3 now" in refused


@pytest.mark.long_run
def test_tiny_run_on_several_devices_matches_one_device(tmp_path):
    """`--distribute`: JAX data and model parallel over 4 virtual CPU devices,
    TensorFlow's MirroredStrategy (one replica per device here: the CPU);
    torch is refused with a message."""
    backend = keras.backend.backend()
    args = ("--tiny", "--fresh")
    if backend == "torch":
        refused = harness.run_refused(
            EXAMPLE / "train.py", *args, "--distribute", "data",
            "--output-dir", str(tmp_path / "t"),
        )
        assert "no distribution engine for torch" in refused
        return
    flags = os.environ.get("XLA_FLAGS", "")  # the suite's (conftest.py)
    env = {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4".strip()}
    one = _run("train.py", *args, "--output-dir", str(tmp_path / "one"), env=env)
    kinds = ("data", "model") if backend == "jax" else ("data",)
    for kind in kinds:
        lines = _run(
            "train.py", *args, "--distribute", kind, "--output-dir", str(tmp_path / kind),
            env=env,
        )
        expected = "devices: 4" if backend == "jax" else "devices: 1 replicas"
        assert any(line.startswith(expected) for line in lines), lines[:5]
        assert float(_val_loss(lines)) == pytest.approx(float(_val_loss(one)), abs=1e-4)


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
