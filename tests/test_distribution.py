"""Tests of training and generating on several devices: the layout maps, and
Keras's distribution engines against one device.

The engines need their devices before the backend starts, so they run in a
fresh process (`_distribution_worker.py`): JAX with 4 virtual CPU devices
(`DataParallel`, and `ModelParallel` over a 2 x 2 mesh with the models'
layout maps), TensorFlow with 2 logical CPU devices (`MirroredStrategy`).
Keras has no distribution engine for torch, so the torch suite runs the JAX
process.
"""

import json
import os
import pathlib
import subprocess
import sys

import keras
import pytest

from keras_attention.models import BertMaskedLM
from keras_attention.models import GPT
from keras_attention.models import Seq2SeqTransformer
from keras_attention.models import layouts

BACKEND = keras.backend.backend()
WORKER = pathlib.Path(__file__).with_name("_distribution_worker.py")
ROOT = WORKER.parent.parent


def _mesh():
    # A layout map is only names and axes: a one-device mesh of any backend.
    return keras.distribution.DeviceMesh((1, 1), ("batch", "model"), ["cpu:0"])


def _expected_axes(path):
    """The sharding `layouts` documents for a weight path."""
    if path.endswith("token_embedding/embeddings"):
        return (None, "model")
    if path.endswith("position_embedding/embeddings"):
        return (None, "model")
    if "_attention/" in path and path.rsplit("/", 2)[-2] in ("query", "key", "value"):
        return (None, "model", None) if path.endswith("kernel") else None
    if path.endswith("_attention/attention_output/kernel"):
        return ("model", None, None)
    if path.endswith("intermediate_dense/kernel"):
        return (None, "model")
    if path.endswith("feedforward/output_dense/kernel"):
        return ("model", None)
    return None  # biases and norms: replicated


@pytest.mark.parametrize("model_class", [GPT, Seq2SeqTransformer, BertMaskedLM])
def test_layout_map_shards_kernels_and_embeddings_and_replicates_the_rest(model_class):
    if model_class is GPT:
        model = GPT(vocabulary_size=16, max_sequence_length=8, num_layers=2, num_heads=2,
                    hidden_dim=8, intermediate_dim=16)
        model.build((None, None))
    elif model_class is Seq2SeqTransformer:
        model = Seq2SeqTransformer(16, 12, 8, 8, num_encoder_layers=1, num_decoder_layers=1,
                                   num_heads=2, hidden_dim=8, intermediate_dim=16,
                                   positions="learned")
        model.build()
    else:
        model = BertMaskedLM(vocabulary_size=16, num_layers=2, num_heads=2, hidden_dim=8,
                             intermediate_dim=16, max_sequence_length=8)
        model.build()
    layout_map = model_class.get_layout_map(_mesh())
    sharded = 0
    for variable in model.weights:
        layout = layout_map[variable.path]
        expected = _expected_axes(variable.path)
        if expected is None:
            assert layout is None, variable.path
        else:
            assert tuple(layout.axes) == expected, variable.path
            assert len(layout.axes) == len(variable.shape)
            sharded += 1
    # Per block: Q, K, V, output, two feed-forward kernels (and cross-attention's
    # four); then the token and position tables.
    expected = {GPT: 2 * 6 + 2, Seq2SeqTransformer: 6 + 10 + 4, BertMaskedLM: 2 * 6 + 2}
    assert sharded == expected[model_class]


def test_layout_map_names_its_axes():
    layout_map = GPT.get_layout_map(_mesh(), "batch", "model")  # the roles swapped
    assert tuple(layout_map["gpt/decoder/block_0/feedforward/output_dense/kernel"].axes) == (
        "batch", None,
    )
    with pytest.raises(ValueError, match="model_parallel_dim_name.*'tensor'"):
        GPT.get_layout_map(_mesh(), model_parallel_dim_name="tensor")
    with pytest.raises(ValueError, match="data_parallel_dim_name.*'data'"):
        Seq2SeqTransformer.get_layout_map(_mesh(), data_parallel_dim_name="data")
    with pytest.raises(ValueError, match="must differ"):
        layouts.layout_map(_mesh(), "model", "model")
    with pytest.raises(ValueError, match="device_mesh"):
        GPT.get_layout_map(("batch", "model"))


def _report(backend):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, str(WORKER), backend], env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


def _assert_same_step(differences):
    # The step moved the weights (by ~0.1), and both runs moved them alike.
    assert differences["moved"] > 1e-2
    assert differences["logits"] < 1e-5
    assert differences["loss"] < 1e-5
    assert differences["weights"] < 1e-5


KERNEL_CASES = ("blocked_causal", "chunked_causal", "chunked_padding", "fused_padding")


def _assert_kernels_match(report):
    """The kernels on inputs split over the devices (JAX: batch and heads,
    the output sharded alike; TensorFlow: the batch over the replicas), and
    their gradients, against one device; hard attention's sampled selections
    on several devices are values of their example's rows (and, on JAX, the
    one-device samples)."""
    for case in KERNEL_CASES:
        differences = report[f"kernel_{case}"]
        assert differences["output"] < 1e-5, case
        assert differences["gradients"] < 1e-5, case
        if BACKEND != "tensorflow":
            assert differences["sharded"] == "P('batch', None, 'model', None)", case
    assert report["hard_attention_data"]["valid"]
    if BACKEND != "tensorflow":
        assert report["hard_attention_data"]["equal"]
        assert report["hard_attention_data"]["sampled"]  # not the argmax


@pytest.mark.long_run
def test_engines_match_one_device():
    """This suite's engine (JAX's for torch) against one device."""
    if BACKEND == "tensorflow":
        report = _report("tensorflow")
        assert report["devices"] == 2 and report["replicas"] == 2
        _assert_same_step(report["gpt_data"])
        _assert_kernels_match(report)
        return
    report = _report("jax")
    _assert_kernels_match(report)
    assert report["devices"] == 4
    for name in ("gpt", "seq2seq"):
        _assert_same_step(report[f"{name}_data"])
        _assert_same_step(report[f"{name}_model"])
        assert report[f"{name}_data_generate_equal"]
        assert report[f"{name}_model_generate_equal"]
        for path, spec in report[f"{name}_shardings"].items():
            expected = _expected_axes(path.split("/", 1)[1])
            if expected is None:
                assert "model" not in spec, path
            else:
                axes = ", ".join(repr(a) if a else "None" for a in expected)
                assert spec == f"P({axes})", (path, spec)
