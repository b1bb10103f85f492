"""Saving and loading: `.keras` files in a fresh process, weights across backends.

On the backend of this pytest process (`KERAS_BACKEND`):

1. a model saved as `.keras` loads in a fresh process with the default
   `safe_mode=True` and no `custom_objects` (only `import keras_attention`),
   and gives the same outputs, layer configs (scorers included) and weights;
2. its `model.weights.h5` loads, under each other installed backend, into the
   same model rebuilt from the same code (`_saving_worker.BUILDERS`), and the
   outputs agree to 1e-5; the `.keras` file loads there too;
3. attention weights returned with `return_attention_scores=True` are model
   outputs, so both checks cover them.

The models (see `_saving_worker.py`) use SoftAttention with the dot, scaled
dot, additive and bilinear scorers (normal and key-value mode) and
SelfAttention with causal masks, Keras implicit masks from `mask_zero=True`
embeddings, an explicit attention mask input and fully masked rows.

Subprocesses are slow to start (a backend import takes seconds), so the module
fixture starts all of them at once: one same-backend worker and one worker per
other backend, each handling every model.
"""

import importlib.util
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import _saving_worker as worker
import harness
import keras_attention

BACKEND = keras.backend.backend()
BACKENDS = ("tensorflow", "jax", "torch")
OTHER_BACKENDS = [b for b in BACKENDS if b != BACKEND]
MODEL_NAMES = list(worker.BUILDERS)
WORKER_TIMEOUT = 300
SAME_BACKEND_TOLERANCE = 1e-6
CROSS_BACKEND_TOLERANCE = 1e-5


def _installed(backend):
    return importlib.util.find_spec(backend) is not None


class _Worker:
    """A worker subprocess started in the background; `wait` collects it."""

    def __init__(self, mode, backend, workdir):
        self.mode = mode
        self.backend = backend
        self.workdir = workdir
        log_dir = os.path.join(workdir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        self.stdout_path = os.path.join(log_dir, f"{mode}-{backend}.stdout")
        self.stderr_path = os.path.join(log_dir, f"{mode}-{backend}.stderr")
        package_root = os.path.dirname(os.path.dirname(keras_attention.__file__))
        env = dict(os.environ)
        env["KERAS_BACKEND"] = backend
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH")) if p
        )
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, worker.__file__, mode, workdir],
                env=env,
                stdout=out,
                stderr=err,
            )
        self.returncode = None

    def wait(self):
        if self.returncode is None:
            try:
                self.returncode = self.process.wait(timeout=WORKER_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                self.returncode = f"killed after {WORKER_TIMEOUT} s"
        return self.returncode

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stderr(self, limit=8000):
        with open(self.stderr_path) as f:
            text = f.read()
        return text[-limit:]

    def describe(self):
        return (
            f"worker `{self.mode}` under KERAS_BACKEND={self.backend} "
            f"(return code {self.returncode}); its stderr:\n{self.stderr()}"
        )


class _Saved:
    """The models saved by this process, their outputs and the workers."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.expected = {}  # model name -> {output name: array}
        self.layers = {}  # model name -> layer records
        self.weight_paths = {}
        self.weights = {}
        self.workers = {}

    def result(self, task, backend, name):
        """The outputs and metadata a worker wrote; fails with its stderr."""
        mode = "keras_file" if task == "keras_file" else "cross"
        run = self.workers[(mode, backend)]
        run.wait()
        out_dir = os.path.join(self.workdir, "results", f"{task}-{backend}", name)
        meta_path = os.path.join(out_dir, "meta.json")
        if not os.path.exists(meta_path):
            pytest.fail(f"no result for model {name!r}: {run.describe()}")
        with open(meta_path) as f:
            meta = json.load(f)
        if meta["error"]:
            pytest.fail(
                f"task {task!r} failed for model {name!r} under "
                f"{backend}:\n{meta['error']}\n{run.describe()}"
            )
        output_dir = os.path.join(out_dir, "outputs")
        outputs = {
            f[: -len(".npy")]: np.load(os.path.join(output_dir, f))
            for f in os.listdir(output_dir)
        }
        with np.load(os.path.join(out_dir, "weights.npz")) as data:
            weights = [data[str(i)] for i in range(len(data.files))]
        return outputs, meta, weights, run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("saving"))
    result = _Saved(workdir)
    models = {}
    for name in worker.BUILDERS:
        # Fresh layer names, so the weight paths match those of a fresh process.
        model = worker.build(name)
        worker.randomize_weights(model)
        model_dir = os.path.join(workdir, name)
        os.makedirs(os.path.join(model_dir, "inputs"))
        for input_name, value in worker.make_inputs(name).items():
            np.save(os.path.join(model_dir, "inputs", f"{input_name}.npy"), value)
        model.save(os.path.join(model_dir, "model.keras"))
        model.save_weights(os.path.join(model_dir, "model.weights.h5"))
        models[name] = model
    # Start every worker now; they run while this process predicts.
    try:
        result.workers[("keras_file", BACKEND)] = _Worker(
            "keras_file", BACKEND, workdir
        )
        for backend in OTHER_BACKENDS:
            if _installed(backend):
                result.workers[("cross", backend)] = _Worker("cross", backend, workdir)
        for name, model in models.items():
            result.expected[name] = worker.predict(model, worker.make_inputs(name))
            result.layers[name] = worker.layer_records(model)
            result.weight_paths[name] = worker.weight_paths(model)
            result.weights[name] = [harness.to_numpy(w) for w in model.weights]
        del models
        keras.backend.clear_session()
        yield result
    finally:
        for run in result.workers.values():
            run.kill()


def _assert_outputs_match(expected, got, tolerance, context):
    assert sorted(got) == sorted(expected), context
    for key, want in expected.items():
        have = got[key]
        message = f"output {key!r}; {context}"
        assert have.shape == want.shape, message
        assert have.dtype == want.dtype, message
        assert np.all(np.isfinite(have)), message
        np.testing.assert_allclose(
            have, want, rtol=tolerance, atol=tolerance, err_msg=message
        )
        # Masked attention weights and fully masked outputs are exactly 0.
        np.testing.assert_array_equal(have == 0, want == 0, err_msg=message)


def _assert_weights_match(saved, name, weights, context):
    """The variables hold the saved values, in `model.weights` order."""
    assert len(weights) == len(saved.weights[name]), context
    expected = zip(saved.weight_paths[name], saved.weights[name])
    for (path, want), have in zip(expected, weights):
        assert have.shape == want.shape, f"{path}; {context}"
        np.testing.assert_array_equal(
            have.astype(want.dtype), want, err_msg=f"{path}; {context}"
        )


def _cross_backend(backend):
    if not _installed(backend):
        pytest.skip(f"backend {backend} is not installed")
    return backend


# 1. `.keras` in a fresh process on the same backend.


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_keras_file_fresh_process_same_outputs(saved, name):
    outputs, _, _, run = saved.result("keras_file", BACKEND, name)
    _assert_outputs_match(
        saved.expected[name], outputs, SAME_BACKEND_TOLERANCE, run.describe()
    )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_keras_file_fresh_process_same_configs_and_weights(saved, name):
    _, meta, weights, run = saved.result("keras_file", BACKEND, name)
    loaded, original = meta["layers"], saved.layers[name]
    assert sorted(loaded) == sorted(original)
    for layer_name, record in original.items():
        # Class, registered name, full config and scorer (class and config).
        assert loaded[layer_name] == record, layer_name
    attention_layers = [
        r for r in loaded.values() if r["class"].startswith("keras_attention.")
    ]
    assert attention_layers
    for record in attention_layers:
        assert record["registered_name"].startswith("keras_attention>")
        assert record["score"]["registered_name"].startswith("keras_attention>")
    _assert_weights_match(saved, name, weights, run.describe())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_keras_file_fresh_process_same_weight_paths(saved, name):
    """Variable paths (used by optimizers and layout maps) survive a load."""
    _, meta, _, _ = saved.result("keras_file", BACKEND, name)
    changed = [
        f"{want} -> {have}"
        for want, have in zip(saved.weight_paths[name], meta["weight_paths"])
        if want != have
    ]
    assert not changed, "weight paths changed on load:\n" + "\n".join(changed)
    assert meta["weight_paths"] == saved.weight_paths[name]


def test_keras_file_scorer_configs_survive(saved):
    """The non-default scorer arguments are in the loaded layers."""
    _, meta, _, _ = saved.result("keras_file", BACKEND, "encoder_decoder")
    layers = meta["layers"]
    scores = {
        name: layers[name]["score"]
        for name in ("dot", "scaled_dot", "additive", "bilinear")
    }
    assert scores["dot"]["class"].endswith("DotProduct")
    assert scores["scaled_dot"]["class"].endswith("ScaledDotProduct")
    assert scores["scaled_dot"]["config"]["scale"] == pytest.approx(0.3)
    assert scores["additive"]["class"].endswith("Additive")
    assert scores["additive"]["config"]["units"] == 6
    assert scores["bilinear"]["class"].endswith("Bilinear")
    assert layers["bilinear"]["config"]["dropout"] == pytest.approx(0.25)
    assert layers["bilinear"]["config"]["seed"] == 3
    assert layers["self_attention"]["score"]["class"].endswith("ScaledDotProduct")


# 3. Attention weights returned as model outputs.


@pytest.mark.parametrize(
    "name, weights_output",
    [
        ("encoder_decoder", "additive_weights"),
        ("encoder_decoder", "bilinear_weights"),
        ("self_attention_stack", "weights"),
    ],
)
def test_keras_file_reproduces_attention_scores(saved, name, weights_output):
    outputs, _, _, run = saved.result("keras_file", BACKEND, name)
    want = saved.expected[name][weights_output]
    got = outputs[weights_output]
    tokens = worker.make_inputs(name)["tokens"]
    assert got.shape[:2] == tokens.shape  # (batch, T, S)
    np.testing.assert_allclose(
        got, want, rtol=SAME_BACKEND_TOLERANCE, atol=SAME_BACKEND_TOLERANCE
    )
    # Each row is a distribution, or all zeros where the query sees nothing.
    sums = got.sum(axis=-1)
    assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0)), run.describe()
    assert np.all(got[tokens == 0] == 0)  # padded queries attend to nothing
    assert np.any(sums == 0) and np.any(sums > 0)


# 2. Weights (and the `.keras` file) under the other backends.


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_weights_load_under_other_backend(saved, backend, name):
    _cross_backend(backend)
    outputs, meta, weights, run = saved.result("cross_weights", backend, name)
    context = f"saved under {BACKEND}, loaded under {backend}; {run.describe()}"
    # The same code builds the same variables under every backend.
    assert meta["weight_paths"] == saved.weight_paths[name], context
    _assert_weights_match(saved, name, weights, context)
    _assert_outputs_match(
        saved.expected[name], outputs, CROSS_BACKEND_TOLERANCE, context
    )


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_keras_file_loads_under_other_backend(saved, backend, name):
    _cross_backend(backend)
    outputs, meta, weights, run = saved.result("cross_keras_file", backend, name)
    context = f"saved under {BACKEND}, loaded under {backend}; {run.describe()}"
    _assert_weights_match(saved, name, weights, context)
    _assert_outputs_match(
        saved.expected[name], outputs, CROSS_BACKEND_TOLERANCE, context
    )
    for layer_name, record in saved.layers[name].items():
        if "score" in record:
            assert meta["layers"][layer_name]["score"] == record["score"]
