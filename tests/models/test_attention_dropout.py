"""The models' `attention_dropout`: dropout on the attention weights alone,
apart from `dropout` (embeddings, residual branches), so that a model can
train with dropout on the fused attention kernels of every backend.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend
from keras_attention import kernels
from keras_attention.kernels import choice
from keras_attention.models import GPT
from keras_attention.models import BertMaskedLM
from keras_attention.models import Seq2SeqTransformer

V, L = 13, 8
# The kernel dot-product attention with dropout takes on this backend.
DROPOUT_ROW = choice.DROPOUT if backend.preferences().dropout_kernel else choice.EXPLICIT


def _gpt(**kwargs):
    return GPT(V, L, num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16, **kwargs)


def _bert(**kwargs):
    return BertMaskedLM(V, num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16,
                        max_sequence_length=L, **kwargs)


def _seq2seq(**kwargs):
    return Seq2SeqTransformer(V, V, L, L, num_encoder_layers=1, num_decoder_layers=1,
                              num_heads=2, hidden_dim=8, intermediate_dim=16, **kwargs)


def _inputs(name):
    ids = np.random.default_rng(0).integers(3, V, (2, L)).astype("int32")
    if name == "gpt":
        return ids
    if name == "bert":
        return {"token_ids": ids, "segment_ids": np.zeros_like(ids),
                "padding_mask": ids > 0, "mask_positions": np.array([[1, 2], [3, 4]], "int32")}
    return {"encoder_token_ids": ids, "decoder_token_ids": ids[:, ::-1].copy()}


MODELS = {"gpt": _gpt, "bert": _bert, "seq2seq": _seq2seq}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "attention_dropout, kernel",
    [(None, DROPOUT_ROW), (0.0, "fused"), (0.2, DROPOUT_ROW)],
    ids=["default", "zero", "own"],
)
def test_attention_dropout_chooses_the_attention_kernel(name, attention_dropout, kernel):
    model = MODELS[name](dropout=0.1, attention_dropout=attention_dropout, seed=1)
    inputs = _inputs(name)
    model(inputs)  # built
    with kernels.tracing() as taken:
        trained = harness.to_numpy(model(inputs, training=True))
    used = {c.kernel for _, c in taken}
    if kernel == "fused":
        # Training with residual dropout still runs a fused row.
        assert used and not used & {choice.EXPLICIT, choice.DROPOUT}, used
    else:
        assert used == {kernel}
    # The blocks' attention layers carry the rate.
    rate = 0.1 if attention_dropout is None else attention_dropout
    rates = {layer.dropout for layer in _attention_layers(model)}
    assert rates == {rate}
    # The residual dropout still acts in training.
    assert not np.allclose(trained, harness.to_numpy(model(inputs)))


def _attention_layers(model):
    from keras_attention.layers import MultiHeadAttention

    return [layer for layer in model._flatten_layers() if isinstance(layer, MultiHeadAttention)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_dropout_round_trips_and_is_checked(name):
    model = MODELS[name](dropout=0.1, attention_dropout=0.0)
    config = model.get_config()
    assert config["attention_dropout"] == 0.0
    assert type(model).from_config(config).attention_dropout == 0.0
    assert MODELS[name]().get_config()["attention_dropout"] is None
    with pytest.raises(ValueError, match=r"attention_dropout.*1\.5"):
        MODELS[name](attention_dropout=1.5)


def test_attention_dropout_zero_trains_through_fit():
    model = _gpt(dropout=0.1, attention_dropout=0.0, seed=1)
    ids = np.random.default_rng(2).integers(0, V, (8, L + 1)).astype("int32")
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(ids[:, :-1], ids[:, 1:], batch_size=4, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
