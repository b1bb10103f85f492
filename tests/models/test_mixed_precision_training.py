"""One training step of every model in mixed precision against float32.

The same weights and batch on a float32 model and on `mixed_bfloat16` and
`mixed_float16` copies (float16 trains through the `LossScaleOptimizer`
that `compile` wraps around the optimizer, as the examples do): the loss and
the update of every weight stay finite and within a tolerance of float32's.
bfloat16 keeps 8 bits of mantissa, float16 11, hence the two tolerances.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention.models import BertMaskedLM
from keras_attention.models import GPT
from keras_attention.models import Seq2SeqTransformer

V, T, B = 32, 8, 4
rng = np.random.default_rng(0)
IDS = rng.integers(1, V, (B, T + 1)).astype("int32")
MASK_POSITIONS = np.sort(rng.permuted(np.tile(np.arange(T), (B, 1)), axis=1)[:, :3], axis=1)


def _gpt(dtype):
    return GPT(vocabulary_size=V, max_sequence_length=T, num_layers=2, num_heads=4,
               hidden_dim=16, intermediate_dim=32, dropout=0.0, seed=1, dtype=dtype)


def _seq2seq(dtype):
    return Seq2SeqTransformer(V, V, T, T, num_encoder_layers=1, num_decoder_layers=1,
                              num_heads=4, hidden_dim=16, intermediate_dim=32, dropout=0.0,
                              seed=1, dtype=dtype)


def _bert(dtype):
    return BertMaskedLM(V, num_layers=2, num_heads=4, hidden_dim=16, intermediate_dim=32,
                        dropout=0.0, max_sequence_length=T, seed=1, dtype=dtype)


MODELS = {
    "gpt": (_gpt, IDS[:, :-1], IDS[:, 1:]),
    "seq2seq": (
        _seq2seq,
        {"encoder_token_ids": IDS[:, 1:], "decoder_token_ids": IDS[:, :-1]},
        IDS[:, 1:],
    ),
    "bert": (
        _bert,
        {"token_ids": IDS[:, :-1], "segment_ids": np.zeros((B, T), "int32"),
         "padding_mask": np.ones((B, T), bool), "mask_positions": MASK_POSITIONS},
        np.take_along_axis(IDS[:, :-1], MASK_POSITIONS, axis=1),
    ),
}
TOLERANCE = {"mixed_bfloat16": 0.05, "mixed_float16": 0.01}


def _trained(name, dtype, weights):
    """The model, its loss on the batch and its weights after one applied
    SGD step (float16: the loss scale halves on an overflow and the step is
    skipped, so it retries until one is applied)."""
    make, x, y = MODELS[name]
    model = make(dtype)
    model(x)
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    for _ in range(20):
        loss = float(model.train_on_batch(x, y))
        if int(harness.to_numpy(inner.iterations)) == 1:
            break
    assert int(harness.to_numpy(inner.iterations)) == 1, "no step was applied"
    return model, loss, [harness.to_numpy(w).astype("float64") for w in model.weights]


@pytest.fixture(scope="module", params=sorted(MODELS))
def float32_step(request):
    name = request.param
    make, x, _ = MODELS[name]
    model = make("float32")
    model(x)
    weights = model.get_weights()
    _, loss, after = _trained(name, "float32", weights)
    return name, weights, loss, after


@pytest.mark.parametrize("policy", sorted(TOLERANCE))
def test_one_training_step_is_close_to_float32(float32_step, policy):
    name, weights, loss, after = float32_step
    model, mixed_loss, mixed_after = _trained(name, policy, weights)
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert keras.backend.standardize_dtype(model.compute_dtype) == policy.split("_")[1]
    tolerance = TOLERANCE[policy]
    assert np.isfinite(mixed_loss)
    assert mixed_loss == pytest.approx(loss, rel=tolerance)
    update = np.concatenate([(a - w).ravel() for a, w in zip(after, weights)])
    mixed_update = np.concatenate([(a - w).ravel() for a, w in zip(mixed_after, weights)])
    assert np.all(np.isfinite(mixed_update))
    assert np.linalg.norm(update) > 1e-3  # the step moved the weights
    # The whole update, relative to its size (one number per model: a
    # single weight's update can be tiny and then relatively noisy).
    error = np.linalg.norm(mixed_update - update) / np.linalg.norm(update)
    assert error < 4 * tolerance, f"{name} {policy}: update off by {error:.3%}"
