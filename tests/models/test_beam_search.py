"""Tests of `models.beam_search` on its own: the best `k` of a row through
blocks (`beam_search.top_k`), and the search with it against the search
without it.

Shape legend: `B` rows (sources), `N` candidates, `K` beams, `V`
vocabulary size, `L` total length.
"""

import dataclasses

import keras
import numpy as np
import pytest
from keras import ops

from keras_attention import backend
from keras_attention.models import beam_search

# torch's `topk` promises no order among equal values; TensorFlow's and
# JAX's put the lower index first, and so do the blocks over them.
STABLE = keras.backend.backend() != "torch"


def _stable_top_k(values, k):
    """numpy: the `k` largest of each row, ties to the lower index."""
    index = np.argsort(-values, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(values, index, axis=-1), index


@pytest.mark.parametrize(
    "rows, size, k, block",
    [
        (1, 4000, 8, 32),  # 4 beams of a vocabulary of 1,000
        (3, 1000, 8, 32),  # blocks that do not divide the row: padded
        (2, 513, 4, 16),
        (2, 256, 8, 8),  # exactly 4 k blocks
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_in_blocks_equals_a_stable_sort(rows, size, k, block, ties):
    """Values and indices equal numpy's stable sort and the one `top_k`
    they replace, with many equal values (integers from a range of 5, the
    maxima of most blocks tied) and without."""
    rng = np.random.default_rng(size + k)
    if ties:
        values = rng.integers(0, 5, (rows, size)).astype("float32")
    else:
        values = rng.standard_normal((rows, size)).astype("float32")
    values[0, 5] = -np.inf  # a row may hold minus infinity (padding's value)
    expected_values, expected_index = _stable_top_k(values, k)
    got_values, got_index = beam_search.top_k(ops.convert_to_tensor(values), k, block=block)
    got_values, got_index = ops.convert_to_numpy(got_values), ops.convert_to_numpy(got_index)
    np.testing.assert_array_equal(got_values, expected_values)
    if STABLE or not ties:
        np.testing.assert_array_equal(got_index, expected_index)
    else:  # distinct indices of the values returned
        np.testing.assert_array_equal(np.take_along_axis(values, got_index, -1), got_values)
        assert all(len(set(row)) == k for row in got_index.tolist())
    one_values, one_index = ops.top_k(ops.convert_to_tensor(values), k=k)
    np.testing.assert_array_equal(got_values, ops.convert_to_numpy(one_values))
    if STABLE or not ties:
        np.testing.assert_array_equal(got_index, ops.convert_to_numpy(one_index))


def test_top_k_in_blocks_ranks_a_tie_across_blocks_by_index():
    """Equal values in three blocks, after the highest maximum in a fourth:
    hand-worked, the lower indices come first (on torch, any of the tied)."""
    values = np.zeros((1, 64), "float32")
    values[0, 40] = 3.0  # block 5 of 8: the highest maximum
    values[0, 3] = 2.0  # block 0
    values[0, 60] = 2.0  # block 7: ties with index 3
    values[0, 17] = 2.0  # block 2: ties too, between them
    for k, block, expected in ((2, 8, [40, 3]), (3, 4, [40, 3, 17])):
        got_values, got_index = beam_search.top_k(ops.convert_to_tensor(values), k, block=block)
        assert ops.convert_to_numpy(got_values).tolist() == [[3.0] + [2.0] * (k - 1)]
        got_index = ops.convert_to_numpy(got_index).tolist()[0]
        if STABLE:
            assert got_index == expected
        else:
            assert got_index[0] == 40 and set(got_index[1:]) <= {3, 17, 60}
            assert len(set(got_index)) == k
    # A tie between a block of a high maximum and a later-ranked block of
    # lower index: the blocks' elements are read in index order, not rank.
    values = np.full((1, 128), -1.0, "float32")
    values[0, 24:26] = [9.0, 2.0]  # block 3 of 16: maximum 9, and a 2
    values[0, 0] = 2.0  # block 0: maximum 2
    got_values, got_index = beam_search.top_k(ops.convert_to_tensor(values), 3, block=8)
    assert ops.convert_to_numpy(got_values).tolist() == [[9.0, 2.0, 2.0]]
    got_index = ops.convert_to_numpy(got_index).tolist()[0]
    if STABLE:
        assert got_index == [24, 0, 25]
    else:
        assert got_index[0] == 24 and sorted(got_index[1:]) == [0, 25]


def test_beam_search_through_blocks_keeps_its_hypotheses_and_scores(monkeypatch):
    """A search over 4 beams of a vocabulary of 300 (1,200 candidates a
    source, so the blocks are taken) returns the sequences and scores of
    the search with one `top_k`, with an end token and without."""
    vocabulary, beams, total, batch = 300, 4, 6, 2
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocabulary, total, vocabulary)).astype("float32") * 3
    # Two of the next tokens' logits equal at every step: ties reach top_k.
    table[:, :, 7] = table[:, :, 11]
    table = ops.convert_to_tensor(table)

    def step(token_ids, caches, index):
        logits = ops.take(ops.take(table, token_ids[:, 0], axis=0), index, axis=1)
        return logits[:, None, :], caches

    caches = ops.zeros((batch * beams, 1))
    found = {}
    for block in (0, 32):
        preferences = dataclasses.replace(backend.preferences(), top_k_block=block)
        monkeypatch.setattr(backend, "preferences", lambda p=preferences: p)
        for end in (None, 5):
            sequences, scores = beam_search.beam_search(
                step, caches, 1, total, num_beams=beams, end_token_id=end,
                pad_token_id=0, length_penalty=1.0,
            )
            found[block, end] = (ops.convert_to_numpy(sequences), ops.convert_to_numpy(scores))
    for end in (None, 5):
        np.testing.assert_array_equal(found[0, end][0], found[32, end][0])
        np.testing.assert_array_equal(found[0, end][1], found[32, end][1])
    # The blocks were taken: a source's candidates fill 4 k blocks of 32.
    assert beams * vocabulary >= 4 * (2 * beams) * 32

