"""Tests of `BertMaskedLM`, `BertEncoder` and `BertClassifier`: KerasHub's
parameter count and logits, bidirectionality, padding, training on KerasHub's
preprocessor in `tf.data`, fill-mask, fine-tuning, saving, errors.

Shape legend: `B` batch, `T` length, `M` masked positions, `V` vocabulary.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import harness
from keras_attention.models import BertClassifier
from keras_attention.models import BertEncoder
from keras_attention.models import BertMaskedLM

V, MAX_T = 37, 12
MASK_ID = 4


def _randomize(model, seed=0, scale=0.5):
    """Spread weights: every float variable normal with `scale`."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        if "float" in keras.backend.standardize_dtype(variable.dtype):
            variable.assign(rng.normal(scale=scale, size=variable.shape).astype("float32"))


def _model(seed=0, **kwargs):
    config = dict(num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16,
                  dropout=0.0, max_sequence_length=MAX_T)
    config.update(kwargs)
    model = BertMaskedLM(V, **config)
    model.build()
    _randomize(model, seed)
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


def _inputs():
    """Two rows of 8: a sentence pair, and 6 real tokens then padding."""
    rng = np.random.default_rng(1)
    return {
        "token_ids": rng.integers(5, V, (2, 8)).astype("int32"),
        "segment_ids": np.array([[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8], "int32"),
        "padding_mask": np.array([[True] * 8, [True] * 6 + [False] * 2]),
        "mask_positions": np.array([[1, 3, 6], [0, 2, 5]], "int32"),
    }


def _logits(model, inputs):
    return harness.to_numpy(model(inputs)).astype("float64")


# KerasHub's model.


def test_bert_base_has_keras_hub_parameter_count():
    keras_hub = pytest.importorskip("keras_hub")
    base = dict(vocabulary_size=30522, num_layers=12, num_heads=12, hidden_dim=768,
                intermediate_dim=3072)
    # Shapes only: in a stateless scope the variables get no values.
    with keras.StatelessScope():
        ours = BertMaskedLM(**base)
        ours.build()
        backbone = keras_hub.models.BertBackbone(**base)
    theirs = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    assert ours.count_params() == theirs.count_params() == 110_104_890
    assert ours.encoder.count_params() == backbone.count_params() == 109_482_240
    assert sorted(tuple(v.shape) for v in ours.weights) == sorted(
        tuple(v.shape) for v in theirs.weights
    )


def _keras_hub_masked_lm(seed=2):
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=MAX_T, dropout=0.0,
    )
    masked_lm = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    _randomize(masked_lm, seed)
    return masked_lm


def test_from_keras_hub_reproduces_the_masked_lm_logits():
    theirs = _keras_hub_masked_lm()
    ours = BertMaskedLM.from_keras_hub(theirs)
    inputs = _inputs()
    expected = harness.to_numpy(theirs(inputs))
    assert np.abs(expected).max() > 1.0  # spread weights: a real comparison
    np.testing.assert_allclose(_logits(ours, inputs), expected, rtol=1e-4, atol=1e-4)
    # KerasHub's 0/1 int padding mask reads the same.
    as_ints = dict(inputs, padding_mask=inputs["padding_mask"].astype("int32"))
    np.testing.assert_allclose(_logits(ours, as_ints), expected, rtol=1e-4, atol=1e-4)
    # The call computes the last block at the mask positions only; the head on
    # the whole sequence output, read there, is the same function.
    sequence = ours.encoder(inputs)["sequence_output"]
    np.testing.assert_allclose(
        harness.to_numpy(ours.mask_logits(sequence, inputs["mask_positions"])), expected,
        rtol=1e-4, atol=1e-4,
    )


def test_from_keras_hub_backbone_takes_the_encoder_and_a_new_head():
    theirs = _keras_hub_masked_lm()
    ours = BertMaskedLM.from_keras_hub(theirs.backbone)
    inputs = _inputs()
    expected = theirs.backbone({k: v for k, v in inputs.items() if k != "mask_positions"})
    got = ours.encoder(inputs)
    # Real positions (a padded one attends to nothing here, while KerasHub
    # lets it attend; no real position reads it).
    real = inputs["padding_mask"]
    np.testing.assert_allclose(
        harness.to_numpy(got["sequence_output"])[real],
        harness.to_numpy(expected["sequence_output"])[real], rtol=1e-4, atol=1e-4,
    )
    np.testing.assert_allclose(
        harness.to_numpy(got["pooled_output"]), harness.to_numpy(expected["pooled_output"]),
        rtol=1e-4, atol=1e-4,
    )
    assert not harness.to_numpy(ours.mlm_output_bias).any()  # newly initialized
    with pytest.raises(ValueError, match=r"`model` must be a keras_hub.models.BertMaskedLM"):
        BertMaskedLM.from_keras_hub(keras.layers.Dense(3))


# Invariants.


def test_attention_is_bidirectional(model):
    inputs = _inputs()
    before = _logits(model, inputs)
    changed = dict(inputs, token_ids=inputs["token_ids"].copy())
    changed["token_ids"][:, 7] = (changed["token_ids"][:, 7] + 1 - 5) % (V - 5) + 5
    after = _logits(model, changed)
    # Row 0: positions 1, 3 and 6 all lie before the changed token 7.
    assert np.abs(after[0] - before[0]).min(axis=-1).max() > 0
    for m in range(3):
        assert not np.allclose(after[0, m], before[0, m], atol=1e-4)
    # Row 1: position 7 is padding, so nothing changes.
    np.testing.assert_allclose(after[1], before[1], rtol=1e-6, atol=1e-6)


def test_padding_changes_no_real_position(model):
    inputs = _inputs()
    before = _logits(model, inputs)
    # Longer padding, with arbitrary ids and segments in it.
    padded = {
        "token_ids": np.concatenate([inputs["token_ids"], np.full((2, 3), 9, "int32")], 1),
        "segment_ids": np.concatenate([inputs["segment_ids"], np.ones((2, 3), "int32")], 1),
        "padding_mask": np.concatenate([inputs["padding_mask"], np.zeros((2, 3), bool)], 1),
        "mask_positions": inputs["mask_positions"],
    }
    padded["token_ids"][1, 6:8] = [30, 31]
    np.testing.assert_allclose(_logits(model, padded), before, rtol=1e-5, atol=1e-5)
    # Without a padding mask every position is real: the padding then counts.
    unmasked = {k: v for k, v in padded.items() if k != "padding_mask"}
    assert not np.allclose(_logits(model, unmasked)[1], before[1], atol=1e-4)


def test_segments_and_positions_matter(model):
    inputs = _inputs()
    before = _logits(model, inputs)
    flipped = dict(inputs, segment_ids=1 - inputs["segment_ids"])
    assert not np.allclose(_logits(model, flipped), before, atol=1e-4)
    # The head reads exactly the gathered positions: one mask alone gives
    # the same row.
    single = dict(inputs, mask_positions=inputs["mask_positions"][:, 1:2])
    np.testing.assert_allclose(_logits(model, single)[:, 0], before[:, 1], rtol=1e-5, atol=1e-5)


# Training on KerasHub's preprocessing.


def _preprocessor(keras_hub, sequence_length=16):
    words = "in the beginning god created heavens and earth was light said let there be".split()
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    tokenizer = keras_hub.tokenizers.BertTokenizer(vocabulary=vocabulary)
    preprocessor = keras_hub.models.BertMaskedLMPreprocessor(
        tokenizer, sequence_length=sequence_length, mask_selection_rate=0.3,
        mask_selection_length=4,
    )
    return preprocessor, len(vocabulary)


def test_trains_on_keras_hub_preprocessor_outputs_in_tf_data():
    keras_hub = pytest.importorskip("keras_hub")
    tf = pytest.importorskip("tensorflow")
    preprocessor, vocabulary_size = _preprocessor(keras_hub)
    texts = ["in the beginning god created the heavens and the earth",
             "god said let there be light and there was light"] * 4
    pairs = (tf.constant(texts), tf.constant(texts[::-1]))  # sentence pairs
    dataset = (
        tf.data.Dataset.from_tensor_slices(pairs).batch(4)
        .map(lambda a, b: preprocessor(x=(a, b))).repeat().take(20)
    )
    x, y, weights = next(iter(dataset))
    assert set(x) == {"token_ids", "segment_ids", "padding_mask", "mask_positions"}
    assert tuple(y.shape) == (4, 4) and tuple(weights.shape) == (4, 4)
    assert int(tf.reduce_max(x["segment_ids"])) == 1  # sentence pairs
    model = BertMaskedLM(vocabulary_size, num_layers=1, num_heads=2, hidden_dim=16,
                         intermediate_dim=32, max_sequence_length=16, dropout=0.0)
    model.compile(
        optimizer=keras.optimizers.AdamW(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"],
    )
    history = model.fit(dataset, epochs=2, steps_per_epoch=10, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    logits = model.predict(dataset.take(1), verbose=0)
    assert logits.shape == (4, 4, vocabulary_size)


# Fill-mask.


def test_training_with_dropout_takes_the_backend_dropout_kernel():
    # With attention dropout (BERT's 0.1) every block's attention runs the
    # backend's fused kernel with dropout where it has one (torch), else the
    # explicit kernel; inference stays on the other fused rows.
    from keras_attention import backend
    from keras_attention import kernels
    from keras_attention.kernels import choice

    model = _model(dropout=0.1)
    inputs = _inputs()
    with kernels.tracing() as taken:
        trained = harness.to_numpy(model(inputs, training=True))
    kernel = choice.DROPOUT if backend.preferences().dropout_kernel else choice.EXPLICIT
    assert [chosen.kernel for _, chosen in taken] == [kernel] * 2
    with kernels.tracing() as taken:
        inference = harness.to_numpy(model(inputs))
    assert all(chosen.kernel not in (choice.EXPLICIT, choice.DROPOUT) for _, chosen in taken)
    assert np.all(np.isfinite(trained)) and not np.allclose(trained, inference)


def test_fill_mask_returns_the_top_tokens_and_probabilities(model):
    ids = np.array([[5, MASK_ID, 7, 8, MASK_ID, 9], [6, 7, MASK_ID, 10, 11, 12]], "int32")
    results = model.fill_mask(ids, MASK_ID, top_k=3)
    assert [[p for p, _, _ in row] for row in results] == [[1, 4], [2]]
    logits = _logits(model, {"token_ids": ids, "mask_positions": np.array([[1, 4], [2, 2]])})
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    for row, masks in enumerate(results):
        for m, (_, top, p) in enumerate(masks):
            np.testing.assert_array_equal(top, np.argsort(-probabilities[row, m])[:3])
            np.testing.assert_allclose(p, probabilities[row, m, top], rtol=1e-5)
            assert np.all(np.diff(p) <= 0) and p.sum() <= 1.0
    # One row as a 1-D array.
    single = model.fill_mask(ids[1], MASK_ID, top_k=2)
    np.testing.assert_array_equal(single[0][0][1], results[1][0][1][:2])
    with pytest.raises(ValueError, match=r"must hold `mask_token_id`=4. Received: rows \[0\]"):
        model.fill_mask(np.array([[5, 6], [MASK_ID, 7]]), MASK_ID)
    with pytest.raises(ValueError, match=r"`top_k` must be an int in \[1, 37\]"):
        model.fill_mask(ids, MASK_ID, top_k=0)
    # The model's own checks of the ids, on the built model's compiled path.
    with pytest.raises(ValueError, match=r"`token_ids` must hold ids in \[0, 37\)\. Received: an id 37"):
        model.fill_mask(np.array([[5, MASK_ID, V]]), MASK_ID)
    with pytest.raises(ValueError, match=r"longer than max_sequence_length=12\. Received: length 13"):
        model.fill_mask(np.full((1, MAX_T + 1), MASK_ID), MASK_ID)


# Fine-tuning.


def test_classifier_starts_from_the_pretrained_encoder(model):
    classifier = BertClassifier.from_masked_lm(model, num_classes=3, dropout=0.0)
    inputs = {k: v for k, v in _inputs().items() if k != "mask_positions"}
    pooled = harness.to_numpy(model.encoder(inputs)["pooled_output"])
    np.testing.assert_allclose(
        harness.to_numpy(classifier.encoder(inputs)["pooled_output"]), pooled, rtol=1e-6
    )
    logits = harness.to_numpy(classifier(inputs))
    kernel, bias = classifier.output_dense.get_weights()
    np.testing.assert_allclose(logits, pooled @ kernel + bias, rtol=1e-5, atol=1e-5)
    # Fine-tuning trains a copy: the masked LM keeps its weights.
    before = [w.copy() for w in model.encoder.get_weights()]
    classifier.compile(optimizer=keras.optimizers.Adam(1e-2),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    classifier.fit(inputs, np.array([0, 2]), epochs=2, verbose=0)
    assert any(not np.allclose(a, b) for a, b in
               zip(classifier.encoder.get_weights(), before))
    for a, b in zip(model.encoder.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    config = classifier.get_config()
    json.dumps(config)
    assert BertClassifier.from_config(config).get_config() == config


# Saving, precision.


def test_keras_files_load_in_a_fresh_process(model, tmp_path):
    classifier = BertClassifier.from_masked_lm(model, num_classes=2)
    inputs = _inputs()
    model.save(tmp_path / "masked_lm.keras")
    classifier.save(tmp_path / "classifier.keras")
    np.savez(tmp_path / "io.npz", **inputs, logits=_logits(model, inputs),
             classes=harness.to_numpy(classifier(inputs)))
    code = f"""
import numpy as np, keras, keras_attention
data = dict(np.load({str(tmp_path / "io.npz")!r}))
inputs = {{k: data[k] for k in ("token_ids", "segment_ids", "padding_mask", "mask_positions")}}
for name, key in (("masked_lm", "logits"), ("classifier", "classes")):
    model = keras.saving.load_model({str(tmp_path)!r} + f"/{{name}}.keras")
    got = keras.ops.convert_to_numpy(model(inputs))
    np.testing.assert_allclose(got, data[key], rtol=1e-5, atol=1e-5)
    print("ok", type(model).__name__)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-4:] == ["ok", "BertMaskedLM", "ok", "BertClassifier"]
    config = model.get_config()
    json.dumps(config)
    assert BertMaskedLM.from_config(config).get_config() == config
    encoder = model.encoder.get_config()
    assert BertEncoder.from_config(encoder).get_config() == encoder


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_is_finite(policy):
    model = BertMaskedLM(V, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
                         max_sequence_length=MAX_T, dtype=policy)
    logits = model(_inputs())
    assert keras.backend.standardize_dtype(logits.dtype) == policy.split("_")[1]
    assert np.all(np.isfinite(harness.to_numpy(logits).astype("float32")))
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in model.weights)


# Errors.


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mask_positions=np.array([[1, 3, 8], [0, 2, 5]])),
         r"`mask_positions` must hold positions in \[0, 8\), the length of `token_ids`\. "
         r"Received: a position 8"),
        (dict(mask_positions=np.array([[1, -1, 2], [0, 2, 5]])),
         r"`mask_positions` must hold positions in \[0, 8\).*Received: a position -1"),
        (dict(token_ids=np.full((2, 8), V)),
         r"`token_ids` must hold ids in \[0, 37\)\. Received: an id 37"),
        (dict(segment_ids=np.full((2, 8), 2)),
         r"`segment_ids` must hold ids in \[0, 2\)\. Received: an id 2"),
        (dict(token_ids=np.ones((2, MAX_T + 1), "int32"),
              segment_ids=np.zeros((2, MAX_T + 1), "int32"),
              padding_mask=np.ones((2, MAX_T + 1), bool)),
         r"`token_ids` is longer than max_sequence_length=12\. Received: length 13"),
        (dict(padding_mask=np.ones((2, 7), bool)),
         r"must have one shape \(batch, length\)"),
    ],
    ids=["mask_past_end", "mask_negative", "token_id", "segment_id", "too_long", "shapes"],
)
def test_bad_inputs_are_clear_errors(model, change, message):
    with pytest.raises(ValueError, match=message):
        model(dict(_inputs(), **change))


def test_encoder_output_positions_are_range_checked(model):
    inputs = {k: v for k, v in _inputs().items() if k != "mask_positions"}
    with pytest.raises(
        ValueError,
        match=r"`output_positions` must hold positions in \[0, 8\), the length of "
        r"`token_ids`\. Received: a position 8",
    ):
        model.encoder(inputs, output_positions=np.array([[0, 8], [1, 2]]))
    rows = model.encoder(inputs, output_positions=np.array([[0, 7], [1, 2]]))
    assert set(rows) == {"sequence_output"} and tuple(rows["sequence_output"].shape) == (2, 2, 8)


def test_bad_arguments_and_missing_inputs(model):
    with pytest.raises(ValueError, match=r"`inputs` must hold 'mask_positions'"):
        model({"token_ids": np.ones((1, 4), "int32")})
    with pytest.raises(ValueError, match=r"`inputs` must be a dict holding 'token_ids'"):
        model(np.ones((1, 4), "int32"))
    with pytest.raises(ValueError, match=r"`hidden_dim` must be divisible by `num_heads`"):
        BertMaskedLM(V, 1, 3, 8, 16)
    with pytest.raises(ValueError, match=r"`num_segments` must be a positive integer"):
        BertMaskedLM(V, 1, 2, 8, 16, num_segments=0)
    with pytest.raises(ValueError, match=r"`encoder` must be a BertEncoder"):
        BertClassifier(model, num_classes=2)
