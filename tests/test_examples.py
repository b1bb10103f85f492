"""Smoke tests of the examples and of the README's quick start.

Each example runs end to end with `--tiny` in a subprocess on the current
backend (`KERAS_BACKEND`) and must print its metric on its last line; its data
pipeline is checked in-process.
"""

import re

import keras
import numpy as np
import pytest

import harness
from harness import ROOT

DEMO = ROOT / "examples" / "demo" / "train.py"


@pytest.fixture(scope="module")
def demo():
    return harness.load_module(DEMO, "demo_train")


def test_demo_tiny_runs_and_prints_val_loss_last():
    lines = harness.run_script(DEMO, "--tiny")
    assert lines[0] == f"backend: {keras.backend.backend()}"
    harness.last_line_value(lines, "val_loss")
    assert re.fullmatch(r"val_accuracy: \S+", lines[-2])


def test_split_ids_keeps_first_90_percent_for_training(demo):
    ids = np.arange(1000, dtype="int32")
    train, val = demo.split_ids(ids, 0.9)
    assert len(train) == 900 and len(val) == 100
    assert train[-1] == 899 and val[0] == 900
    np.testing.assert_array_equal(np.concatenate([train, val]), ids)


def test_split_of_the_real_text(demo):
    config = demo.Config(**demo.TINY)
    text = demo.load_text(config.data_path)
    assert len(text) == 1_115_394
    vocabulary = demo.Vocabulary(text)
    assert len(vocabulary) == 65
    train, val = demo.split_ids(vocabulary.encode(text), config.train_fraction)
    assert len(train) == int(0.9 * len(text)) == 1_003_854
    assert vocabulary.decode(train[-20:]) == text[1_003_834:1_003_854]
    assert vocabulary.decode(val[:20]) == text[1_003_854:1_003_874]


def test_random_windows_are_consecutive_and_targets_shift_by_one(demo):
    # Distinct ids, so a window's values tell where it was taken from.
    ids = np.arange(500, dtype="int32")
    context_length, batch_size = 16, 8
    dataset = demo.random_windows(ids, context_length, batch_size, seed=0)
    starts = []
    for inputs, targets in dataset.take(20).as_numpy_iterator():
        assert inputs.shape == targets.shape == (batch_size, context_length)
        assert inputs.dtype == targets.dtype == np.int32
        np.testing.assert_array_equal(targets, inputs + 1)
        np.testing.assert_array_equal(np.diff(inputs, axis=1), 1)
        assert inputs.min() >= 0 and targets.max() <= len(ids) - 1
        starts.extend(inputs[:, 0])
    # Random starts, spread over the whole array.
    assert len(set(starts)) > 100
    assert max(starts) > len(ids) - 2 * context_length - 60


def test_training_windows_come_from_the_training_text_only(demo):
    config = demo.Config(**demo.TINY)
    vocabulary, train_data, _, val_ids = demo.make_datasets(config)
    text = demo.load_text(config.data_path)
    boundary = int(config.train_fraction * len(text))
    train_text = text[:boundary]
    for inputs, targets in train_data.take(4).as_numpy_iterator():
        assert inputs.shape == (config.batch_size, config.context_length)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        for x, y in zip(inputs, targets):
            assert vocabulary.decode(np.append(x, y[-1])) in train_text
    assert vocabulary.decode(val_ids) == text[boundary:]


def test_consecutive_windows_cover_the_validation_ids(demo):
    ids = np.arange(103, dtype="int32")
    batches = list(demo.consecutive_windows(ids, 10, 4).as_numpy_iterator())
    inputs = np.concatenate([x for x, _ in batches])
    targets = np.concatenate([y for _, y in batches])
    assert inputs.shape == targets.shape == (10, 10)
    np.testing.assert_array_equal(inputs.reshape(-1), ids[:100])
    np.testing.assert_array_equal(targets.reshape(-1), ids[1:101])
    limited = list(demo.consecutive_windows(ids, 10, 4, max_windows=3))
    assert sum(x.shape[0] for x, _ in limited) == 3


def test_readme_quick_start_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert len(code.strip().splitlines()) <= 20
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert any("self_attention" in layer.name for layer in model.layers)
    assert np.isfinite(model.history.history["loss"][-1])
