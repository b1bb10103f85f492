"""Shared checks for every layer of the package.

`run_layer_test` builds a layer from its constructor arguments and checks, on
the current backend:

- config round trip: `from_config(get_config())` gives the same config, also
  through `keras.saving.serialize_keras_object`;
- eager and symbolic calls give the expected output shapes, and the symbolic
  shapes agree with the eager ones;
- a functional model of the layer takes one training step that changes every
  trainable weight and keeps the loss finite;
- under `mixed_float16` and `mixed_bfloat16` the outputs are finite and in the
  compute dtype, and the variables stay float32.
"""

import contextlib
import importlib.util
import math
import os
import pathlib
import re
import signal
import subprocess
import sys

import keras
import numpy as np
from keras import ops

ROOT = pathlib.Path(__file__).resolve().parent.parent


def to_numpy(x):
    """A backend tensor (or nested structure of them) as numpy."""
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(t) for t in x)
    return np.asarray(ops.convert_to_numpy(x))


def variable_gradients(loss_fn, variables, jit=False):
    """Gradients of the scalar `loss_fn()` w.r.t. Keras `variables`, as numpy.

    Uses the backend's own autodiff, so what is checked is what training
    sees; a variable the loss does not use gets zeros. `jit=True` compiles
    the gradient as a whole on JAX (one compilation instead of one per
    primitive: faster for a computation that runs once).
    """
    values = [v.value for v in variables]
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn()
        grads = tape.gradient(loss, values)
    elif backend == "jax":
        import jax

        def loss(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return loss_fn()

        grad = jax.grad(loss)
        grads = (jax.jit(grad) if jit else grad)(values)
    else:
        import torch

        grads = torch.autograd.grad(loss_fn(), values, allow_unused=True)
    return [
        np.zeros(v.shape, "float32") if g is None else to_numpy(g)
        for g, v in zip(grads, variables)
    ]


def input_gradients(fn, inputs, cotangent, jit=False):
    """Gradients of `sum(fn(*inputs) * cotangent)` w.r.t. every input, as numpy.

    Uses the backend's own autodiff. `cotangent` is an array, or a function
    of the output's shape that makes one. `jit=True` compiles the gradient
    as a whole on JAX and traces it into a graph on TensorFlow.
    """
    backend = keras.backend.backend()

    def weights(out):
        value = cotangent(tuple(out.shape)) if callable(cotangent) else cotangent
        return np.asarray(value, "float32")

    if backend == "tensorflow":
        import tensorflow as tf

        xs = [tf.constant(x) for x in inputs]

        def gradients(*xs):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                out = tf.cast(fn(*xs), "float32")
                loss = tf.reduce_sum(out * weights(out))
            return tape.gradient(loss, xs)

        # A graph, as `fit` runs: a `cond` is differentiated as a graph op
        # there, and as a Python `if` eagerly.
        grads = (tf.function(gradients) if jit else gradients)(*xs)
    elif backend == "jax":
        import jax
        import jax.numpy as jnp

        xs = [jnp.asarray(x) for x in inputs]
        cotangent_value = weights(jax.eval_shape(fn, *xs))

        def loss(*xs):
            return jnp.sum(fn(*xs).astype("float32") * cotangent_value)

        grad = jax.grad(loss, argnums=tuple(range(len(xs))))
        grads = (jax.jit(grad) if jit else grad)(*xs)
    else:
        import torch

        xs = [ops.convert_to_tensor(x).detach().requires_grad_(True) for x in inputs]
        out = fn(*xs).float()
        loss = torch.sum(out * torch.as_tensor(weights(out), device=out.device))
        grads = torch.autograd.grad(loss, xs)
    return [to_numpy(g) for g in grads]


@contextlib.contextmanager
def trains_every_weight(layer, unless=(), rtol=0.0, atol=0.0):
    """Asserts that what runs inside the `with` leaves every trainable weight
    of `layer` finite and changed (not `np.allclose` to its value before,
    with `rtol` and `atol`: by default, any change), but those whose path
    ends with a name in `unless`: a weight whose gradient is 0 (the key
    bias, which softmax ignores: it adds the same to every score of a row)
    moves by rounding alone, which an optimizer like Adam scales up to a
    full step."""
    weights = list(layer.trainable_weights)
    assert weights, f"{layer.name} has no trainable weights"
    before = [to_numpy(w).copy() for w in weights]
    yield
    for weight, old in zip(weights, before):
        new = to_numpy(weight)
        assert np.all(np.isfinite(new)), weight.path
        if not weight.path.endswith(tuple(unless)):
            assert not np.allclose(old, new, rtol=rtol, atol=atol), f"{weight.path} did not train"


def _flat(outputs):
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _symbolic_inputs(inputs):
    return {
        name: keras.Input(
            shape=value.shape[1:],
            dtype=str(value.dtype),
            name=name,
        )
        for name, value in inputs.items()
    }


def randomize_weights(model, seed=0, embedding_scale=1.0):
    """Gives every weight of a decoder model (ours or KerasHub's) a random
    value, biases and norms included, and returns the model.

    Kernels are `N(0, 9 / fan_in)` (output projections `(H, K, D)` read
    `H * K`, the others axis 0), the embeddings `N(0, embedding_scale**2)`,
    biases and norm offsets `N(0, 0.01)`, norm scales `N(1, 0.04)`: large
    enough that the greedy continuations of a random model do not collapse
    onto one token. `embedding_scale=0.5` keeps float32 logits (about 1 in
    size) exact to 1e-5.
    """
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        shape, path = tuple(variable.shape), variable.path
        name = path.split("/")[-1]
        if name in ("gamma", "scale"):
            value = 1 + 0.2 * rng.normal(size=shape)
        elif name in ("beta", "bias"):
            value = 0.1 * rng.normal(size=shape)
        elif name == "embeddings":
            value = embedding_scale * rng.normal(size=shape)
        else:
            fan_in = np.prod(shape[:-1]) if "output" in path else shape[0]
            value = 3 * rng.normal(size=shape) / np.sqrt(fan_in)
        variable.assign(value.astype("float32"))
    return model


def padded_logits(model, ids, rows, length):
    """`model(ids)` as float64 numpy, run at one shape `(rows, length)`:
    the ids padded with zeros and the logits cut back (later positions
    change nothing before them: causality)."""
    batch, ids_length = ids.shape
    padded = np.zeros((max(rows, batch), length), "int32")
    padded[:batch, :ids_length] = ids
    return to_numpy(model(padded))[:batch, :ids_length].astype("float64")


def greedy_reference(model, prompt, max_new_tokens, rows, length):
    """Greedy decoding that reruns the whole sequence for every new token
    (each pass `padded_logits(model, ids, rows, length)`)."""
    ids = np.array(prompt, "int32")
    for _ in range(max_new_tokens):
        logits = padded_logits(model, ids, rows, length)  # (B, T, V)
        next_ids = logits[:, -1].argmax(-1).astype("int32")  # (B,)
        ids = np.concatenate([ids, next_ids[:, None]], axis=1)
    return ids


def check_config_round_trip(layer):
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    serialized = keras.saving.serialize_keras_object(layer)
    restored = keras.saving.deserialize_keras_object(serialized)
    assert type(restored) is type(layer)
    assert restored.get_config() == config


def run_layer_test(
    layer_cls,
    init_kwargs,
    inputs,
    call_kwargs=None,
    expected_output_shapes=None,
    run_training_check=True,
    run_mixed_precision_check=True,
):
    """Runs the common layer checks.

    Args:
        layer_cls: the layer class.
        init_kwargs: constructor arguments.
        inputs: dict of call argument name -> numpy array (tensor inputs).
        call_kwargs: other call arguments (flags).
        expected_output_shapes: list of the expected eager output shapes.
        run_training_check: whether to fit one step.
        run_mixed_precision_check: whether to run the mixed precision checks.
    """
    call_kwargs = call_kwargs or {}

    # Config round trip, before and after building.
    layer = layer_cls(**init_kwargs)
    check_config_round_trip(layer)

    # Eager call.
    eager = _flat(layer(**inputs, **call_kwargs))
    eager_shapes = [tuple(t.shape) for t in eager]
    if expected_output_shapes is not None:
        assert eager_shapes == [tuple(s) for s in expected_output_shapes]
    for t in eager:
        assert np.all(np.isfinite(to_numpy(t)))
    check_config_round_trip(layer)

    # Symbolic call on a fresh layer, batch size unknown.
    symbolic_inputs = _symbolic_inputs(inputs)
    symbolic = _flat(layer_cls(**init_kwargs)(**symbolic_inputs, **call_kwargs))
    assert len(symbolic) == len(eager)
    for sym, shape in zip(symbolic, eager_shapes):
        assert tuple(sym.shape)[0] is None
        assert tuple(sym.shape)[1:] == shape[1:], (sym.shape, shape)

    # One training step through a functional model.
    if run_training_check:
        trained = layer_cls(**init_kwargs)
        symbolic_inputs = _symbolic_inputs(inputs)
        outputs = _flat(trained(**symbolic_inputs, **call_kwargs))
        model = keras.Model(symbolic_inputs, outputs[0])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        target = np.random.default_rng(0).normal(size=eager_shapes[0])
        with trains_every_weight(trained):
            loss = model.train_on_batch(inputs, target.astype("float32"))
        assert np.isfinite(loss)

    # Mixed precision.
    if run_mixed_precision_check:
        for policy in ("mixed_float16", "mixed_bfloat16"):
            mixed = layer_cls(**init_kwargs, dtype=policy)
            outputs = _flat(mixed(**inputs, **call_kwargs))
            compute_dtype = policy.split("_")[1]
            for t in outputs:
                assert keras.backend.standardize_dtype(t.dtype) == compute_dtype
                assert np.all(np.isfinite(to_numpy(t).astype("float32")))
            for w in mixed.weights:
                assert keras.backend.standardize_dtype(w.dtype) == "float32"
    return layer


def load_module(path, name):
    """Imports the file `path` (an example's module) as a module `name`;
    its folder is importable while it loads (for its sibling modules).

    Examples name their siblings alike (`data`, `train`): a sibling another
    example imported earlier in this process is set aside while this one
    loads, so `import data` finds this folder's, and each example's
    siblings stay its own afterwards."""
    folder = pathlib.Path(path).parent
    siblings = {p.stem for p in folder.glob("*.py")}
    set_aside = {n: sys.modules.pop(n) for n in siblings if n in sys.modules}
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
        for sibling in siblings:
            sys.modules.pop(sibling, None)
        sys.modules.update(set_aside)
    return module


def run_script(path, *args, env=None):
    """Runs the script `path` with `args` in a subprocess from the repository
    root, on the current backend; asserts that it succeeds and returns its
    stdout lines."""
    env = {**os.environ, "KERAS_BACKEND": keras.backend.backend(), **(env or {})}
    result = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout.strip().splitlines()


def without_tensorflow(tmp_path):
    """The environment of a process in which `import tensorflow` fails (a
    package of that name first on `PYTHONPATH` that raises ImportError), as
    on a machine without TensorFlow. On the TensorFlow backend, which needs
    it, the process runs JAX instead."""
    stub = tmp_path / "no_tensorflow" / "tensorflow"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        'raise ImportError("TensorFlow is absent from this test\'s process")\n'
    )
    path = os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path}
    if keras.backend.backend() == "tensorflow":
        env["KERAS_BACKEND"] = "jax"
    return env


def run_refused(path, *args, env=None):
    """Runs the script `path` with `args` as `run_script` does; asserts that
    it fails and returns its stderr (the message to check)."""
    env = {**os.environ, "KERAS_BACKEND": keras.backend.backend(), **(env or {})}
    result = subprocess.run(
        [sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    return result.stderr


def last_line_value(lines, name):
    """The value of a last line `<name>: <value>`, a finite number, as printed."""
    match = re.fullmatch(rf"{name}: (\S+)", lines[-1])
    assert match, f"last line is not `{name}: <value>`: {lines[-1]!r}"
    assert math.isfinite(float(match.group(1))), lines[-1]
    return match.group(1)


# Runs that are killed and resumed (the examples' `common.fault_point`).

FAULT_ENV = "EXAMPLES_FAULT_POINT"


def run_killed(path, *args, env=None, after=None):
    """Runs the script `path` until it dies: by its own fault point (`env`,
    e.g. `{FAULT_ENV: "weights written:1"}`) or by a SIGKILL `after`
    seconds; returns True if it was killed (False if it finished first)."""
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), **(env or {}))
    process = subprocess.Popen(
        [sys.executable, str(path), *args], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        process.wait(timeout=after)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()
    return process.returncode == -signal.SIGKILL


def saved_weights(path):
    """The weights of the `.keras` file `path`, as numpy arrays."""
    import keras_attention  # noqa: F401  (registers the classes for loading)

    model = keras.saving.load_model(path, compile=False)
    return [to_numpy(w) for w in model.weights]


def check_killed_runs_end_as_one(path, args, output, finished, seconds, first_write=True):
    """Runs the training script `path` with `args` into `output`, killing it
    while it writes its first checkpoint (unless `first_write` is False),
    between the renames of its second, then after `0.6 * seconds` (it may
    have finished), resuming each time; asserts that it ends with the
    weights of the uninterrupted run whose folder is `finished` and returns
    the last run's stdout lines. The run must write a checkpoint at least
    twice.

    The kill during the first write tests `common.save_checkpoint` alone
    (the half-written folder is never read, and the run starts afresh), the
    same code for every script: one example's test is enough for it. The
    kill between the renames tests the script too, which must resume from
    the folder `common.load_checkpoint` names (`checkpoint.old` there)."""
    args = (*args, "--output-dir", str(output))
    if first_write:
        assert run_killed(path, *args, env={FAULT_ENV: "weights written:1"})
        assert not (output / "checkpoint").exists()  # nothing half-written is read
    assert run_killed(path, *args, env={FAULT_ENV: "between the renames:2"})
    assert (output / "checkpoint.old" / "state.json").exists()  # the first survives
    run_killed(path, *args, after=0.6 * seconds)
    lines = run_script(path, *args)
    for want, got in zip(
        saved_weights(finished / "model.keras"), saved_weights(output / "model.keras"),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    return lines
