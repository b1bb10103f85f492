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

import keras
import numpy as np
from keras import ops


def to_numpy(x):
    """A backend tensor (or nested structure of them) as numpy."""
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(t) for t in x)
    return np.asarray(ops.convert_to_numpy(x))


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
        before = [to_numpy(w).copy() for w in trained.trainable_weights]
        target = np.random.default_rng(0).normal(size=eager_shapes[0])
        loss = model.train_on_batch(inputs, target.astype("float32"))
        assert np.isfinite(loss)
        after = [to_numpy(w) for w in trained.trainable_weights]
        for w, b, a in zip(trained.trainable_weights, before, after):
            assert np.all(np.isfinite(a)), w.path
            assert not np.array_equal(b, a), f"{w.path} did not train"

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
