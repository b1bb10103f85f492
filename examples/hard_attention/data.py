"""Key-value retrieval, generated on the fly.

An example is a memory of `num_pairs` (key, value) token pairs, with distinct
keys, and a query that is one of those keys; the answer is the value stored
under it:

    keys    = [12, 40,  3, 27]
    values  = [ 5,  5, 61, 18]
    query   = [ 3]
    answer  = 61

Keys come from a vocabulary of `num_keys` tokens, values from one of
`num_values` tokens (values may repeat). Reading one position is the whole
task: a model must find the pair whose key matches the query and return its
value, which is what hard attention does.

Shape legend: `N` examples, `P` pairs.
"""

import numpy as np


def make_examples(rng, num_examples, num_pairs, num_keys, num_values):
    """Draws `num_examples` examples with the numpy generator `rng`.

    Returns:
        `(inputs, answers)`: inputs a dict of int32 arrays `"keys"` `(N, P)`,
        `"values"` `(N, P)` and `"query"` `(N, 1)`; answers `(N,)` int32.
    """
    if num_pairs > num_keys:
        raise ValueError(
            f"`num_pairs` must be at most `num_keys` (keys are distinct). "
            f"Received: num_pairs={num_pairs}, num_keys={num_keys}"
        )
    # Distinct keys: the first `P` of a random permutation of the vocabulary.
    keys = np.argsort(rng.random((num_examples, num_keys)), axis=1)[:, :num_pairs]
    values = rng.integers(0, num_values, size=(num_examples, num_pairs))
    slot = rng.integers(0, num_pairs, size=num_examples)  # (N,)
    rows = np.arange(num_examples)
    inputs = {
        "keys": keys.astype("int32"),
        "values": values.astype("int32"),
        "query": keys[rows, slot][:, None].astype("int32"),  # (N, 1)
    }
    return inputs, values[rows, slot].astype("int32")


def training_batches(seed, batch_size, num_pairs, num_keys, num_values):
    """An endless stream of fresh batches; the same seed, the same stream."""
    rng = np.random.default_rng(seed)
    while True:
        yield make_examples(rng, batch_size, num_pairs, num_keys, num_values)


def fixed_split(seed, num_examples, num_pairs, num_keys, num_values):
    """A fixed set of examples (validation or test), drawn with its own seed.

    With the default sizes there are about 10^58 distinct examples, so a
    fixed split and the training stream practically never share one.
    """
    rng = np.random.default_rng(seed)
    return make_examples(rng, num_examples, num_pairs, num_keys, num_values)
