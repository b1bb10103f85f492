"""`examples/common.py`, the module the examples share, tested once.

Backend selection from the command line, the corpus, the character tokenizer,
the split and both window pipelines. The examples' own tests only run them.
"""

import gzip
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import harness
from harness import ROOT

EXAMPLES = ROOT / "examples"
SCRIPTS = (
    "demo/train.py", "gpt_lm/train.py", "gpt_lm/sample.py", "hard_attention/train.py",
    "bert_mlm/train.py",
)
# sha256 of the decompressed tiny-shakespeare, as examples/data/README.md states.
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@pytest.fixture(scope="module")
def common():
    return harness.load_module(EXAMPLES / "common.py", "examples_common")


@pytest.fixture(scope="module")
def corpus(common):
    return common.load_text()


# Backend.


@pytest.fixture
def environ(monkeypatch):
    """`os.environ` without KERAS_BACKEND, restored after the test."""
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    return os.environ


@pytest.mark.parametrize(
    "argv",
    [
        ["--backend", "jax"],
        ["--tiny", "--backend=jax"],
        ["--backend", "torch", "--steps", "3", "--backend", "jax"],  # the last wins
    ],
)
def test_select_backend_sets_keras_backend(common, environ, argv):
    assert common.select_backend(argv) == "jax"
    assert environ["KERAS_BACKEND"] == "jax"


def test_select_backend_reads_sys_argv_by_default(common, environ, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--tiny", "--backend", "torch"])
    assert common.select_backend() == "torch"
    assert environ["KERAS_BACKEND"] == "torch"


@pytest.mark.parametrize("argv", [[], ["--tiny"], ["--tiny", "--backend"]])
def test_select_backend_without_a_value_leaves_keras_backend(common, environ, argv):
    # A bare trailing `--backend` is argparse's to report.
    assert common.select_backend(argv) is None
    assert "KERAS_BACKEND" not in environ


@pytest.mark.parametrize("argv", [["--backend", "numpy"], ["--backend=numpy"]])
def test_select_backend_rejects_an_unknown_backend(common, environ, argv):
    with pytest.raises(ValueError, match=r"`--backend` must be one of.*'numpy'"):
        common.select_backend(argv)
    assert "KERAS_BACKEND" not in environ


def test_select_backend_imports_neither_keras_nor_tensorflow():
    code = (
        "import os, sys; sys.path.insert(0, 'examples'); import common; "
        "common.select_backend(['--backend', 'torch']); "
        "print(os.environ['KERAS_BACKEND'], os.environ['TF_CPP_MIN_LOG_LEVEL'], "
        "'keras' in sys.modules, 'tensorflow' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch", "3", "False", "False"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_reject_an_unknown_backend_before_importing_keras(script):
    # Importing keras with KERAS_BACKEND=numpy would fail; the script names the
    # argument first.
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--backend", "numpy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"{pathlib.Path(script).name}: error: argument --backend: invalid choice: 'numpy' "
        "(choose from 'tensorflow', 'jax', 'torch') (see --help)"
    ]


# Corpus.


def test_load_text_reads_the_shipped_tiny_shakespeare(common, corpus):
    assert len(corpus) == 1_115_394
    assert len(set(corpus)) == 65
    assert hashlib.sha256(corpus.encode("utf-8")).hexdigest() == CORPUS_SHA256
    assert common.load_text(common.DEFAULT_CORPUS) == corpus


def test_load_text_reads_a_path_and_a_gz(common, tmp_path):
    text = "to be or not to be\nthat is the question: é\n"
    plain = tmp_path / "corpus.txt"
    plain.write_text(text, encoding="utf-8")
    packed = tmp_path / "corpus.txt.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(text)
    assert common.load_text(plain) == text
    assert common.load_text(str(plain)) == text
    assert common.load_text(str(packed)) == text
    with pytest.raises(ValueError, match="does not exist"):
        common.load_text(str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("name", ["corpus.txt", "corpus.txt.gz"])
def test_load_text_downloads_a_url_once_into_the_cache_dir(common, tmp_path, name):
    text = "to be or not to be\n"
    corpus = tmp_path / name
    opener = gzip.open if name.endswith(".gz") else open
    with opener(corpus, "wt", encoding="utf-8") as f:
        f.write(text)
    cache = tmp_path / "cache" / "not_made_yet"
    assert common.load_text(corpus.as_uri(), cache_dir=str(cache)) == text
    cached = list(cache.rglob(name))
    assert len(cached) == 1
    assert cached[0].parent == cache / common.CACHE_SUBDIR
    corpus.unlink()  # read from the cache from now on
    assert common.load_text(corpus.as_uri(), cache_dir=str(cache)) == text


# Characters.


def test_char_tokenizer_round_trips_and_refuses_unknown_characters(common):
    text = "the cat sat on the mat; the cat ate.\n" * 5
    tokenizer = common.CharTokenizer.fit(text)
    assert tokenizer.characters == sorted(set(text))
    assert tokenizer.vocabulary_size == len(set(text))
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(list(ids[:3])) == "the"
    with pytest.raises(ValueError, match=r"outside the vocabulary.*'Z'"):
        tokenizer.encode("Zebra")


def test_char_tokenizer_json_round_trip(common):
    tokenizer = common.CharTokenizer.fit("hello, world\n")
    data = json.loads(json.dumps(tokenizer.to_json()))
    # The form checkpoints store: it must keep loading.
    assert data == {"kind": "char", "characters": sorted(set("hello, world\n"))}
    restored = common.CharTokenizer.from_json(data)
    assert restored.characters == tokenizer.characters
    np.testing.assert_array_equal(restored.encode("hello"), tokenizer.encode("hello"))
    with pytest.raises(ValueError, match=r"not a 'char' tokenizer.*'bpe'"):
        common.CharTokenizer.from_json({"kind": "bpe", "characters": [], "merges": []})


# Split.


def test_split_ids_keeps_the_first_90_percent_for_training(common):
    ids = np.arange(1000, dtype="int32")
    train, val = common.split_ids(ids)
    assert len(train) == 900 and len(val) == 100
    assert train[-1] == 899 and val[0] == 900
    np.testing.assert_array_equal(np.concatenate([train, val]), ids)
    train, val = common.split_ids(ids, 0.75)
    assert len(train) == 750 and val[0] == 750


def test_split_of_the_real_text(common, corpus):
    tokenizer = common.CharTokenizer.fit(corpus)
    assert tokenizer.vocabulary_size == 65
    train, val = common.split_ids(tokenizer.encode(corpus), 0.9)
    assert len(train) == int(0.9 * len(corpus)) == 1_003_854
    assert tokenizer.decode(train[-20:]) == corpus[1_003_834:1_003_854]
    assert tokenizer.decode(val[:20]) == corpus[1_003_854:1_003_874]


# Windows.


def test_train_batches_are_consecutive_windows_with_targets_shifted_by_one(common):
    # Distinct ids, so a window's values tell where it was taken from.
    ids = np.arange(500, dtype="int32")
    context_length, batch_size = 16, 8
    dataset = common.train_batches(ids, context_length, batch_size, seed=0)
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


def test_example_pipelines_run_without_the_autotuner(common):
    # Deleting an autotuned iterator waits for the autotuner's sleep (up to
    # a minute): `fit` ended a minute late in about half of the GPT runs.
    ids = np.arange(100, dtype="int32")
    for dataset in (
        common.train_batches(ids, 8, 4, seed=0),
        common.consecutive_windows(ids, 8, 4),
    ):
        assert dataset.options().autotune.enabled is False
        # And still gives its batches.
        inputs, targets = next(dataset.as_numpy_iterator())
        np.testing.assert_array_equal(targets, inputs + 1)


def test_train_batches_resume_from_start_step(common):
    ids = np.arange(500, dtype="int32")
    whole = list(common.train_batches(ids, 8, 4, seed=5).take(6).as_numpy_iterator())
    resumed = common.train_batches(ids, 8, 4, seed=5, start_step=3)
    for (x, y), (rx, ry) in zip(whole[3:], resumed.take(3).as_numpy_iterator()):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
    # Another seed, other batches; every batch differs from the next.
    other = next(common.train_batches(ids, 8, 4, seed=6).as_numpy_iterator())
    assert not np.array_equal(other[0], whole[0][0])
    assert not np.array_equal(whole[0][0], whole[1][0])


def test_train_batches_need_more_ids_than_the_context(common):
    with pytest.raises(ValueError, match=r"longer than the context of 8 tokens: .*--source.*Received: 8"):
        common.train_batches(np.arange(8, dtype="int32"), 8, 2, seed=0)


@pytest.mark.parametrize("length", [101, 103])
def test_consecutive_windows_cover_the_ids_in_order(common, length):
    ids = np.arange(length, dtype="int32")
    batches = list(common.consecutive_windows(ids, 10, 4).as_numpy_iterator())
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    inputs = np.concatenate([x for x, _ in batches])
    targets = np.concatenate([y for _, y in batches])
    assert inputs.shape == targets.shape == (10, 10)
    np.testing.assert_array_equal(inputs.reshape(-1), ids[:100])
    np.testing.assert_array_equal(targets.reshape(-1), ids[1:101])
    limited = list(common.consecutive_windows(ids, 10, 4, max_windows=3))
    assert sum(x.shape[0] for x, _ in limited) == 3
    np.testing.assert_array_equal(np.asarray(limited[0][0]).reshape(-1), ids[:30])


# The two pipelines.


def _batches(dataset, count=None):
    """The first `count` batches (all with None) of either pipeline, as numpy."""
    if hasattr(dataset, "as_numpy_iterator"):
        iterator = dataset.as_numpy_iterator()
    else:
        iterator = (dataset[i] for i in range(dataset.num_batches or 2**62))
    batches = []
    for batch in iterator:
        batches.append(tuple(np.asarray(part) for part in batch))
        if count is not None and len(batches) == count:
            break
    return batches


@pytest.mark.parametrize("start_step", [0, 5])
def test_array_pipeline_gives_the_tf_data_batches(common, start_step):
    ids = np.random.default_rng(0).integers(0, 65, 700).astype("int32")
    made = {
        pipeline: (
            common.train_batches(ids, 12, 4, seed=3, start_step=start_step, pipeline=pipeline,
                                 num_batches=7),
            common.consecutive_windows(ids, 12, 5, max_windows=23, pipeline=pipeline),
            common.batched_arrays((ids[:30].reshape(10, 3), ids[30:40]), 4, pipeline),
        )
        for pipeline in ("tf.data", "arrays")
    }
    counts = (7, None, None)
    for tf_data, arrays, count in zip(made["tf.data"], made["arrays"], counts):
        expected, got = _batches(tf_data, count), _batches(arrays, count)
        assert len(got) == len(expected) > 1
        for want, have in zip(expected, got):
            for a, b in zip(want, have):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)
    # The windows of batch k are drawn from (seed, k): independent of where
    # the pipeline started.
    k = start_step + 2
    starts = np.random.default_rng((3, k)).integers(0, len(ids) - 12, 4)
    inputs, targets = _batches(made["arrays"][0], 3)[2]
    np.testing.assert_array_equal(inputs, ids[starts[:, None] + np.arange(12)])
    np.testing.assert_array_equal(targets, ids[starts[:, None] + np.arange(1, 13)])


def test_array_pipeline_trains_a_model_in_order(common):
    seen = []

    def batch(i):
        seen.append(i)
        return np.full((2, 3), float(i), "float32"), np.zeros((2, 1), "float32")

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(common.array_batches(batch, 6), epochs=3, steps_per_epoch=2, shuffle=False,
              verbose=0)
    # Every batch once, in order, across the epochs (a first read of batch 0
    # may come first, for its shapes).
    assert sorted(set(seen)) == list(range(6))
    assert [i for n, i in enumerate(seen) if i not in seen[n + 1:]] == list(range(6))


def test_choose_pipeline(common, monkeypatch):
    assert common.choose_pipeline() == "tf.data"  # TensorFlow is installed here
    assert common.choose_pipeline("arrays") == "arrays"
    with pytest.raises(ValueError, match=r"`pipeline` must be one of .*pipeline='grain'"):
        common.choose_pipeline("grain")
    monkeypatch.setattr(common, "tensorflow_installed", lambda: False)
    assert common.choose_pipeline() == "arrays"
    with pytest.raises(ValueError, match=r"needs TensorFlow.*pipeline='tf.data'"):
        common.choose_pipeline("tf.data")


# Checkpoints and progress.


class _Weights:
    """Stands in for a model: `save_weights` writes a file (or fails)."""

    variables = ()  # no random states

    def __init__(self, fail=False):
        self.fail = fail

    def save_weights(self, path):
        if self.fail:
            raise RuntimeError("killed while saving")
        path.write_bytes(b"weights")


def test_checkpoints_are_atomic_and_carry_what_an_example_adds(common, tmp_path):
    import dataclasses

    @dataclasses.dataclass
    class Config:
        steps: int = 6
        name: str = "tiny"

    assert common.load_checkpoint(tmp_path) is None

    def vocabulary(folder):
        (folder / "vocabulary.txt").write_text("[PAD]\n")

    common.save_checkpoint(tmp_path, _Weights(), 3, Config(), vocabulary)
    step, config, folder = common.load_checkpoint(tmp_path)
    assert (step, config) == (3, {"steps": 6, "name": "tiny"})
    assert folder == tmp_path / "checkpoint"
    assert (folder / "vocabulary.txt").read_text() == "[PAD]\n"
    assert (folder / "model.weights.h5").read_bytes() == b"weights"
    # A save that fails midway leaves the previous checkpoint whole.
    with pytest.raises(RuntimeError, match="killed while saving"):
        common.save_checkpoint(tmp_path, _Weights(fail=True), 6, Config())
    assert common.load_checkpoint(tmp_path)[0] == 3
    common.save_checkpoint(tmp_path, _Weights(), 6, Config(steps=9))
    assert common.load_checkpoint(tmp_path)[:2] == (6, {"steps": 9, "name": "tiny"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    # Between the two renames only `checkpoint.old` exists: it is read.
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
    assert common.load_checkpoint(tmp_path)[0] == 6


def test_checkpoints_restore_the_dropout_random_states(common, tmp_path):
    """Keras leaves the seed generators' states out of the weights file; the
    checkpoint keeps them, so a resumed run draws the masks the
    uninterrupted run would."""
    import dataclasses

    import keras

    @dataclasses.dataclass
    class Config:
        steps: int = 6

    def make():
        inputs = keras.Input((16,))
        return keras.Model(inputs, keras.layers.Dropout(0.5, seed=3)(inputs))

    model = make()
    x = np.ones((4, 16), "float32")
    model(x, training=True)  # the state moves on from its initial value
    common.save_checkpoint(tmp_path, model, 1, Config())
    expected = keras.ops.convert_to_numpy(model(x, training=True))  # the next draw

    resumed = make()
    common.load_weights(resumed, tmp_path / "checkpoint")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(resumed(x, training=True)), expected
    )
    fresh = make()
    assert not np.array_equal(keras.ops.convert_to_numpy(fresh(x, training=True)), expected)


def test_resume_loads_the_weights_and_reads_the_step_back(common, tmp_path):
    import dataclasses

    import keras

    @dataclasses.dataclass
    class Config:
        steps: int = 6

    def make():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    model = make()
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    for _ in range(2):
        model.train_on_batch(x, y)
    common.save_checkpoint(tmp_path, model, 2, Config())
    folder = tmp_path / "checkpoint"

    resumed = make()
    assert common.resume(resumed, folder, 2) == 2
    for ours, saved in zip(resumed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(ours, saved)
    with pytest.raises(RuntimeError, match="optimizer step 2, its state says 3"):
        common.resume(make(), folder, 3)


def test_ticker_is_due_after_its_seconds(common, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    ticker = common.Ticker(30)
    now[0] = 129.0
    assert not ticker.due()
    now[0] = 130.5
    assert ticker.due() and not ticker.due()
    now[0] = 170.0
    ticker.reset()
    now[0] = 199.0
    assert not ticker.due()
