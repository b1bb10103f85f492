"""Training on more than one device with the engines Keras offers.

`--distribute data` splits each batch across the devices, every device
holding all the weights; `--distribute model` also splits the weights
(tensor parallelism, the model's `get_layout_map`). The engines:

- JAX: `keras.distribution.DataParallel` over every device, or
  `keras.distribution.ModelParallel` over a mesh `(batch, model)` whose
  `model` axis has 2 devices (the heads must be divisible by 2);
- TensorFlow: `tf.distribute.MirroredStrategy` over every GPU (or the CPU)
  for `data`; Keras's TensorFlow backend has no tensor-parallel engine;
- torch: Keras has no distribution engine for torch.

The model must be built, compiled and trained inside the scope.
"""

import contextlib

CHOICES = ("data", "model")
MODEL_AXIS = 2


def scope(kind, model_class=None):
    """The context to build, compile and `fit` a model in.

    Args:
        kind: None (one device), "data" or "model".
        model_class: for "model", a class with `get_layout_map(mesh)`.
    """
    if kind is None:
        return contextlib.nullcontext()
    if kind not in CHOICES:
        raise ValueError(f"`distribute` must be one of {CHOICES} or None. Received: {kind!r}")
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        from keras import distribution

        devices = distribution.list_devices()
        if kind == "data":
            return distribution.DataParallel(devices=devices).scope()
        if len(devices) % MODEL_AXIS:
            raise ValueError(
                f"--distribute model needs an even number of devices. Received: "
                f"{len(devices)} devices"
            )
        mesh = distribution.DeviceMesh(
            (len(devices) // MODEL_AXIS, MODEL_AXIS), ("batch", "model"), devices
        )
        layout_map = model_class.get_layout_map(mesh)
        return distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope()
    if backend == "tensorflow" and kind == "data":
        import tensorflow as tf

        return tf.distribute.MirroredStrategy().scope()
    raise ValueError(
        f"--distribute {kind} is not available on the {backend} backend: "
        + (
            "Keras's TensorFlow backend has data parallelism only (--distribute data)"
            if backend == "tensorflow"
            else "Keras has no distribution engine for torch (use --backend jax)"
        )
    )


def describe(kind):
    """A line saying where the run trains."""
    if kind is None:
        return "devices: one"
    import keras

    if keras.backend.backend() == "jax":
        from keras import distribution

        return f"devices: {len(distribution.list_devices())} ({kind} parallel)"
    import tensorflow as tf

    return f"devices: {tf.distribute.get_strategy().num_replicas_in_sync} replicas (data parallel)"
