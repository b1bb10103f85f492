"""Layout maps: how a model's weights are sharded over a device mesh.

Shape legend: `D` width, `H` query heads, `G` key/value heads, `K` and `V`
head sizes, `F` feed-forward width, `V` (tables) vocabulary size, `L`
positions.

Every model of the package names its weights the same way, so one set of
rules serves them all (`layout_map`). Megatron-style tensor parallelism
along the mesh axis `model`: a matmul into a wider space is split along its
output (column-parallel: Q, K, V, the feed-forward network's first
kernels), the matmul back is split along its input (row-parallel: the
attention output, the feed-forward output), so each pair needs one
reduction. The weight paths (the keys are these regular expressions with
`.*` in front, which Keras matches with `re.fullmatch` against
`variable.path`):

    path                                              shape        sharding
    token_embedding/embeddings (also the source's)    (V, D)       (None, model)
    position_embedding/embeddings                     (L, D)       (None, model)
    _attention/(query|key|value)/kernel               (D, H|G, K)  (None, model, None)
    _attention/attention_output/kernel                (H, V, D)    (model, None, None)
    feedforward/(intermediate|gate)_dense/kernel      (D, F)       (None, model)
    feedforward/output_dense/kernel                   (F, D)       (model, None)
    everything else: biases, norms                    any          replicated

A sharded axis must be divisible by the size of the mesh's `model` axis
(the heads: `num_heads` and `num_key_value_heads`; the widths). Tables are
split along their width, not their rows: vocabularies rarely divide (65
characters, GPT-2's 50,257 tokens). Weights are replicated
along the data-parallel axis; `keras.distribution.ModelParallel(layout_map=
..., batch_dim_name=data_parallel_dim_name)` splits the batch along it.
Users with other needs add or replace keys of the returned map.
"""

import keras

RULES = (
    (r"token_embedding/embeddings", (None, "model")),
    (r"position_embedding/embeddings", (None, "model")),
    (r"_attention/(query|key|value)/kernel", (None, "model", None)),
    (r"_attention/attention_output/kernel", ("model", None, None)),
    (r"feedforward/(intermediate|gate)_dense/kernel", (None, "model")),
    (r"feedforward/output_dense/kernel", ("model", None)),
)


def layout_map(device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"):
    """The `keras.distribution.LayoutMap` of the rules above on `device_mesh`.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` with both axes.
        model_parallel_dim_name: the mesh axis the weights are split along.
        data_parallel_dim_name: the mesh axis the batch is split along
            (the weights are replicated along it).

    Returns:
        A `keras.distribution.LayoutMap`.
    """
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise ValueError(
            "`device_mesh` must be a `keras.distribution.DeviceMesh`. "
            f"Received: device_mesh={device_mesh!r}"
        )
    for name, value in (
        ("model_parallel_dim_name", model_parallel_dim_name),
        ("data_parallel_dim_name", data_parallel_dim_name),
    ):
        if value not in device_mesh.axis_names:
            raise ValueError(
                f"`{name}` must be an axis of the device mesh "
                f"{tuple(device_mesh.axis_names)}. Received: {name}={value!r}"
            )
    if model_parallel_dim_name == data_parallel_dim_name:
        raise ValueError(
            "`model_parallel_dim_name` and `data_parallel_dim_name` must differ. "
            f"Received: both {model_parallel_dim_name!r}"
        )
    layouts = keras.distribution.LayoutMap(device_mesh)
    for path, axes in RULES:
        layouts[".*" + path] = tuple(model_parallel_dim_name if a == "model" else a for a in axes)
    return layouts


class TensorParallel:
    """What the package's models share for `keras.distribution`: the
    `get_layout_map` of KerasHub's backbones."""

    @staticmethod
    def get_layout_map(
        device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"
    ):
        """A `keras.distribution.LayoutMap` for tensor-parallel training.

        The attention and feed-forward kernels and the embedding tables are
        split along `model_parallel_dim_name` (Megatron-style; the weight
        paths and their shardings are listed in `keras_attention.models.layouts`),
        biases and norms replicated. The heads (and the widths split) must
        be divisible by that axis's size. For instance, on 8 devices:

        ```python
        mesh = keras.distribution.DeviceMesh(
            (2, 4), ("batch", "model"), keras.distribution.list_devices())
        distribution = keras.distribution.ModelParallel(
            layout_map=GPT.get_layout_map(mesh), batch_dim_name="batch")
        with distribution.scope():
            model = GPT(...)  # or Seq2SeqTransformer, BertMaskedLM
        ```

        Args:
            device_mesh: a `keras.distribution.DeviceMesh`.
            model_parallel_dim_name: the mesh axis the weights are split along.
            data_parallel_dim_name: the mesh axis the batch is split along.
        """
        return layout_map(device_mesh, model_parallel_dim_name, data_parallel_dim_name)
