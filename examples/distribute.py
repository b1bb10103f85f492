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

The model must be built, compiled and trained inside the scope. On JAX every
batch is split evenly over the devices of the batch axis, so `even_batches`
pads a last, smaller batch with rows of weight 0.
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


def batch_multiple(kind):
    """What every batch size must be a multiple of under `kind`: JAX splits
    each batch evenly over the mesh's batch axis; TensorFlow's
    MirroredStrategy splits uneven batches itself (1)."""
    import keras

    if kind is None or keras.backend.backend() != "jax":
        return 1
    from keras import distribution

    devices = len(distribution.list_devices())
    return devices if kind == "data" else devices // MODEL_AXIS


def even_batches(dataset, kind):
    """`dataset`, batches of `(x, y)` or `(x, y, sample_weight)`, with each
    batch padded by rows of zeros (weight 0) to a multiple of
    `batch_multiple(kind)`, so that no example is dropped. Batches without
    weights get weights of 1 shaped like `y`.

    The padded rows add nothing to a loss or metric reduced over the sample
    weights (`"mean_with_sample_weight"`, weighted metrics); Keras's running
    mean of the per-batch losses still weighs a padded batch by its rows.
    """
    multiple = batch_multiple(kind)
    if multiple == 1:
        return dataset
    import tensorflow as tf

    def pad(x, y, sample_weight=None):
        if sample_weight is None:
            sample_weight = tf.ones_like(y, "float32")
        rows = tf.shape(y)[0]
        extra = (multiple - rows % multiple) % multiple

        def pad_rows(tensor):
            padding = [[0, extra]] + [[0, 0]] * (len(tensor.shape) - 1)
            return tf.pad(tensor, padding)

        return tf.nest.map_structure(pad_rows, (x, y, sample_weight))

    return dataset.map(pad)
