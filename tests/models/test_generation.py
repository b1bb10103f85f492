"""Tests of `generation`'s pieces that the models' tests reach only through
`generate`: the loop's starting arrays made from a prompt and its lengths.

Shape legend: `B` batch, `P` prompt length, `L` total length.
"""

import keras
import numpy as np

import harness
from keras_attention.models import generation


def test_layout_matches_the_numpy_arrays_it_replaces():
    """Ragged prompts (right padding, as `prompt_padding_mask` marks them):
    ids are the prompt then the pad id, the mask is True on each row's own
    tokens only, and each row may run `L - P` tokens past its prompt."""
    prompt = np.array([[5, 6, 7], [8, 9, 0], [4, 0, 0]], "int32")  # (B, P)
    lengths = np.array([3, 2, 1], "int32")
    total, pad = 7, 1
    # Tensors, as the compiled loop receives them.
    made = generation.layout(
        keras.ops.convert_to_tensor(prompt), keras.ops.convert_to_tensor(lengths), total, pad
    )
    ids, in_prompt, limits = (harness.to_numpy(x) for x in made)
    expected_ids = np.full((3, total), pad, "int32")
    expected_ids[:, :3] = prompt
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(in_prompt, np.arange(total)[None] < lengths[:, None])
    np.testing.assert_array_equal(limits, lengths + total - 3)
