"""Looking at attention: capture every layer's weights, draw them as heat maps.

`capture_attention(model, *inputs)` runs a model (or any layer) once and
returns the attention weights of every attention layer of the package inside
it (`SoftAttention`, `HardAttention`, `SelfAttention`'s, `MultiHeadAttention`,
in blocks and models), in call order. The attention core records them
(`keras_attention.kernels.recording`), computing them through the explicit
kernel where a fused one ran (a fused kernel never forms the weights).
`plot_attention(weights, query_labels, key_labels)` draws the heads of one
layer side by side with matplotlib, an optional dependency imported only when
a plot is drawn.
"""

from typing import Any

import keras
import numpy as np

from keras_attention import backend
from keras_attention import kernels
from keras_attention.layers.hard_attention import HardAttention
from keras_attention.layers.multi_head_attention import MultiHeadAttention
from keras_attention.layers.soft_attention import SoftAttention

# The layers that call the attention core on their own behalf.
_ATTENTION_LAYERS = (SoftAttention, HardAttention, MultiHeadAttention)


def _check_has_attention(model):
    if isinstance(model, _ATTENTION_LAYERS) or any(
        isinstance(layer, _ATTENTION_LAYERS)
        for layer in model._flatten_layers(include_self=False, recursive=True)
    ):
        return
    raise ValueError(
        "`model` contains no keras_attention attention layer. "
        f"Received: model={model.name!r}"
    )


def capture_attention(model: keras.layers.Layer, *args: Any, **kwargs: Any) -> list:
    """Runs `model(*args, **kwargs)` once and returns every attention map.

    Every attention layer of the package inside `model` records the weights
    it applied, as `(batch, heads, T, S)` arrays: `heads` is 1 for
    `SoftAttention`, `HardAttention` (whose weights are the one-hot
    selections it applied) and `SelfAttention` (recorded as its inner
    `attention` layer). Where a fused kernel ran, the weights are recomputed
    through the explicit kernel from the same projected queries, keys and
    masks, so they are the weights the kernel used. The call runs in
    inference mode unless `training` is passed; on JAX a built model runs it
    as one program compiled for the call (eagerly, JAX would compile each of
    its operations anew for every new input shape), elsewhere it runs
    eagerly. Inputs of one shape are best captured as one batch.

    Args:
        model: a `keras.Model` or layer containing attention layers.
        *args: the inputs, as for `model(...)`.
        **kwargs: the keyword inputs, as for `model(...)`.

    Returns:
        A list of `(name, weights)` in call order: `name` is the attention
        layer's path in the model (e.g. `"encoder/block_0/self_attention"`),
        `weights` a numpy array `(batch, heads, T, S)`. A layer called twice
        appears twice.

    Example:

    >>> import numpy as np
    >>> from keras_attention import layers
    >>> encoder = layers.TransformerEncoderStack(num_layers=2, intermediate_dim=32, num_heads=2)
    >>> x = np.random.rand(1, 4, 16).astype("float32")
    >>> maps = capture_attention(encoder, x)
    >>> len(maps), maps[0][0].split("/")[-2], maps[0][1].shape
    (2, 'block_0', (1, 2, 4, 4))
    """
    kwargs.setdefault("training", False)
    owners = []

    def run():
        with kernels.recording() as records:
            model(*args, **kwargs)
        owners[:] = [layer for layer, _ in records]
        return [weights for _, weights in records]

    if model.built:
        _check_has_attention(model)
        recorded = backend.run_once(run, model.variables)
    else:  # the call creates the variables and sublayers: eagerly
        recorded = run()
        _check_has_attention(model)
    return [
        (layer.path, keras.ops.convert_to_numpy(weights).astype("float32"))
        for layer, weights in zip(owners, recorded)
    ]


def plot_attention(
    weights,
    query_labels=None,
    key_labels=None,
    title=None,
    head_names=None,
    columns=4,
    cmap="viridis",
    panel_size=3.0,
):
    """Draws attention weights as heat maps, one panel per head.

    Rows are queries, columns keys; darker = less weight (with the default
    colour map). Masked positions have weight 0.

    Args:
        weights: `(heads, T, S)` (or `(T, S)` for one head) array or tensor,
            e.g. one example of what `capture_attention` returns.
        query_labels: optional `T` labels (tokens) for the rows.
        key_labels: optional `S` labels for the columns.
        title: optional figure title.
        head_names: optional list of panel titles; defaults to
            `"head 0"`, `"head 1"`, ...
        columns: positive int, panels per row.
        cmap: a matplotlib colour map name.
        panel_size: the size in inches of one panel.

    Returns:
        A `matplotlib.figure.Figure` with one image panel per head (save it
        with `figure.savefig("attention.png")`).

    Example:

    >>> import numpy as np
    >>> w = np.random.dirichlet(np.ones(3), size=(2, 3))  # (heads, T, S)
    >>> figure = plot_attention(w, ["a", "b", "c"], ["x", "y", "z"])
    >>> len(figure.axes) - 1  # one panel per head, plus the colour bar
    2
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "plot_attention needs matplotlib: pip install matplotlib "
            "(or keras3-attention[examples])"
        ) from error
    weights = np.asarray(keras.ops.convert_to_numpy(weights), dtype="float32")
    if weights.ndim == 2:
        weights = weights[None]
    if weights.ndim != 3:
        raise ValueError(
            "`weights` must have shape (heads, T, S) or (T, S). Received: "
            f"weights with shape {weights.shape}"
        )
    heads, query_length, key_length = weights.shape
    for name, labels, length in (
        ("query_labels", query_labels, query_length),
        ("key_labels", key_labels, key_length),
    ):
        if labels is not None and len(labels) != length:
            raise ValueError(
                f"`{name}` must have one label per position ({length}). "
                f"Received: {len(labels)} labels"
            )
    if head_names is not None and len(head_names) != heads:
        raise ValueError(
            f"`head_names` must have one name per head ({heads}). "
            f"Received: {len(head_names)} names"
        )
    if isinstance(columns, bool) or not isinstance(columns, int) or columns <= 0:
        raise ValueError(
            f"`columns` must be a positive integer. Received: columns={columns!r}"
        )
    columns = min(columns, heads)
    rows = -(-heads // columns)
    # A Figure without pyplot: no global state, no GUI backend needed.
    figure = Figure(figsize=(panel_size * columns + 1, panel_size * rows + 0.5))
    grid = figure.subplots(rows, columns, squeeze=False)
    image = None
    for index, axes in enumerate(grid.flat):
        if index >= heads:
            figure.delaxes(axes)
            continue
        image = axes.imshow(weights[index], cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        axes.set_title(head_names[index] if head_names else f"head {index}")
        if query_labels is not None:
            axes.set_yticks(range(query_length), labels=[str(t) for t in query_labels])
        if key_labels is not None:
            axes.set_xticks(
                range(key_length), labels=[str(t) for t in key_labels], rotation=90
            )
    figure.colorbar(image, ax=[a for a in grid.flat if a.figure is figure and a in figure.axes])
    if title:
        figure.suptitle(title)
    return figure
