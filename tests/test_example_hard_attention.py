"""Smoke test of `examples/hard_attention`: key-value retrieval.

`train.py --tiny` runs end to end in a subprocess on the current backend
(`KERAS_BACKEND`), training every method, and must print its metric on its
last line; the data generator is checked in-process.
"""

import re

import keras
import numpy as np
import pytest

import harness
from harness import ROOT

EXAMPLE = ROOT / "examples" / "hard_attention"
METHODS = ("soft", "straight_through", "gumbel", "reinforce")


@pytest.fixture(scope="module")
def data():
    return harness.load_module(EXAMPLE / "data.py", "hard_attention_data")


@pytest.mark.long_run
def test_tiny_run_trains_every_method_and_prints_accuracy_last():
    lines = harness.run_script(EXAMPLE / "train.py", "--tiny")  # threads: conftest.py
    assert lines[0] == f"backend: {keras.backend.backend()}"
    value = harness.last_line_value(lines, "accuracy")
    assert 0.0 <= float(value) <= 1.0
    # One result line per method, REINFORCE last; its accuracy is the last line's.
    reports = [line for line in lines if re.match(r"\w+: test accuracy ", line)]
    assert [line.split(":")[0] for line in reports] == list(METHODS)
    assert reports[-1].startswith(f"reinforce: test accuracy {value};")
    # The table has a row per method.
    rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == list(METHODS)


def test_answer_is_the_value_stored_under_the_query_key(data):
    rng = np.random.default_rng(0)
    inputs, answers = data.make_examples(
        rng, 500, num_pairs=6, num_keys=10, num_values=7
    )
    keys, values, query = inputs["keys"], inputs["values"], inputs["query"]
    assert keys.shape == values.shape == (500, 6) and query.shape == (500, 1)
    assert answers.shape == (500,)
    assert {x.dtype for x in (keys, values, query, answers)} == {np.dtype("int32")}
    assert keys.min() >= 0 and keys.max() < 10
    assert values.min() >= 0 and values.max() < 7
    for k, v, q, a in zip(keys, values, query[:, 0], answers):
        assert len(set(k)) == 6  # distinct keys: the answer is unambiguous
        (slot,) = np.flatnonzero(k == q)
        assert v[slot] == a
    # The query is spread over the slots, and the answers over the values.
    slots = np.argmax(keys == query, axis=1)
    assert set(slots) == set(range(6)) and set(answers) == set(range(7))


def test_streams_and_splits_are_reproducible_and_distinct(data):
    sizes = dict(num_pairs=4, num_keys=16, num_values=16)
    first = data.training_batches(3, 8, **sizes)
    again = data.training_batches(3, 8, **sizes)
    batches = [next(first) for _ in range(3)]
    for batch, repeat in zip(batches, (next(again) for _ in range(3))):
        for name in ("keys", "values", "query"):
            np.testing.assert_array_equal(batch[0][name], repeat[0][name])
        np.testing.assert_array_equal(batch[1], repeat[1])
    # Every batch is fresh.
    assert not np.array_equal(batches[0][0]["keys"], batches[1][0]["keys"])
    validation = data.fixed_split(4, 100, **sizes)
    np.testing.assert_array_equal(
        validation[0]["keys"], data.fixed_split(4, 100, **sizes)[0]["keys"]
    )
    assert not np.array_equal(
        validation[0]["keys"], data.fixed_split(5, 100, **sizes)[0]["keys"]
    )


def test_rejects_more_pairs_than_keys(data):
    with pytest.raises(ValueError, match=r"num_pairs=9, num_keys=8"):
        data.make_examples(np.random.default_rng(0), 2, 9, 8, 4)
