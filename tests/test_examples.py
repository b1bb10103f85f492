"""Smoke tests of the examples and of the README's quick start.

Each example runs end to end with `--tiny` in a subprocess on the current
backend (`KERAS_BACKEND`) and must print its metric on its last line; the
demo's datasets are checked in-process (the shared pieces they are made of,
from `examples/common.py`, in `test_examples_common.py`).
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


@pytest.mark.long_run
def test_demo_tiny_runs_and_prints_val_loss_last():
    lines = harness.run_script(DEMO, "--tiny")
    assert lines[0] == f"backend: {keras.backend.backend()}"
    harness.last_line_value(lines, "val_loss")
    assert re.fullmatch(r"val_accuracy: \S+", lines[-2])


def test_training_windows_come_from_the_training_text_only(demo):
    config = demo.Config(**demo.TINY)
    tokenizer, train_data, val_data, val_ids = demo.make_datasets(config)
    text = demo.common.load_text(config.data_path)
    boundary = int(config.train_fraction * len(text))
    train_text = text[:boundary]
    for inputs, targets in train_data.take(4).as_numpy_iterator():
        assert inputs.shape == (config.batch_size, config.context_length)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        for x, y in zip(inputs, targets):
            assert tokenizer.decode(np.append(x, y[-1])) in train_text
    assert tokenizer.decode(val_ids) == text[boundary:]
    # Validation: the first `eval_windows` windows of the validation text.
    inputs = np.concatenate([x for x, _ in val_data.as_numpy_iterator()])
    assert inputs.shape == (config.eval_windows, config.context_length)
    np.testing.assert_array_equal(
        inputs.reshape(-1), val_ids[: config.eval_windows * config.context_length]
    )


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
