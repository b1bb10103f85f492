"""Tests of `capture_attention` and `plot_attention`.

Shape legend: `B` batch, `T` decoder length, `S` encoder length, `D` model
width, `H` heads, `N` blocks.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import kernels
from keras_attention.kernels import choice
from keras_attention.layers import TransformerDecoderStack
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerEncoderStack
from keras_attention.visualization import capture_attention
from keras_attention.visualization import plot_attention

B, T, S, D, H, F, N = 2, 5, 7, 16, 4, 32, 2
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _randomize(layer, seed=0):
    rng = np.random.default_rng(seed + 100)
    layer.set_weights(
        [
            (0.3 * rng.normal(size=w.shape)).astype("float32")
            for w in layer.get_weights()
        ]
    )


def _model(**kwargs):
    """An encoder-decoder of the stacks; the source padding mask is an input."""
    common = dict(
        num_layers=N,
        intermediate_dim=F,
        num_heads=H,
        kernel_initializer="zeros",
        **kwargs,
    )
    source = keras.Input((None, D), name="source")
    target = keras.Input((None, D), name="target")
    source_mask = keras.Input((None,), dtype="bool", name="source_mask")
    memory = TransformerEncoderStack(**common, name="encoder")(
        source, padding_mask=source_mask
    )
    output = TransformerDecoderStack(**common, name="decoder")(
        target, memory, encoder_padding_mask=source_mask
    )
    model = keras.Model(
        {"source": source, "target": target, "source_mask": source_mask}, output
    )
    _randomize(model)
    return model


def _model_inputs():
    # The source has the decoder's length T, so that JAX reuses the eager
    # operations other tests compiled.
    source_mask = np.ones((B, T), bool)
    source_mask[1, 3:] = False
    return {
        "source": _normal((B, T, D)),
        "target": _normal((B, T, D), seed=1),
        "source_mask": source_mask,
    }


def _explicit_weights(model, inputs):
    """Every attention map in call order, through `return_attention_scores`."""
    encoder, decoder = model.get_layer("encoder"), model.get_layer("decoder")
    memory, encoder_weights = encoder(
        inputs["source"],
        padding_mask=inputs["source_mask"],
        return_attention_scores=True,
    )
    _, self_weights, cross_weights = decoder(
        inputs["target"],
        memory,
        encoder_padding_mask=inputs["source_mask"],
        return_attention_scores=True,
    )
    maps = list(encoder_weights)
    for self_w, cross_w in zip(self_weights, cross_weights):
        maps += [self_w, cross_w]
    return [harness.to_numpy(w) for w in maps]


# capture_attention.


def test_captures_every_layer_and_head_as_the_explicit_path_gives():
    model = _model()
    inputs = _model_inputs()
    expected = _explicit_weights(model, inputs)
    # Count the calls of the fused kernel: the model's call takes it, and the
    # weights are recomputed from the same projections and masks.
    with kernels.tracing() as taken:
        maps = capture_attention(model, inputs)
    fused_calls = [o.path for o, c in taken if c.kernel != choice.EXPLICIT]
    names = [name for name, _ in maps]
    assert names == [
        "encoder/block_0/self_attention",
        "encoder/block_1/self_attention",
        "decoder/block_0/self_attention",
        "decoder/block_0/cross_attention",
        "decoder/block_1/self_attention",
        "decoder/block_1/cross_attention",
    ]
    assert fused_calls == names
    shapes = [(B, H, T, T)] * N + [(B, H, T, T), (B, H, T, T)] * N
    assert [w.shape for _, w in maps] == shapes
    for (name, got), want in zip(maps, expected):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
        # Every head is there, and heads differ.
        assert not np.allclose(got[:, 0], got[:, 1], atol=1e-4), name
    # Masks are the ones the kernel used: padded sources and the future get
    # no weight, and real rows are distributions.
    padded = ~inputs["source_mask"][:, None, None, :]  # (B, 1, 1, S)
    for index in (0, 1, 3, 5):
        weights = maps[index][1]
        assert np.all(weights[np.broadcast_to(padded, weights.shape)] == 0)
    for index in (2, 4):
        weights = maps[index][1]
        assert np.all(weights[..., ~np.tril(np.ones((T, T), bool))] == 0)
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    # Recording ends with the capture.
    assert not kernels.is_recording()


def test_captures_a_block_on_either_path_and_in_inference_mode():
    block = TransformerDecoderBlock(
        F, H, dropout=0.5, seed=1, kernel_initializer="zeros", name="block"
    )
    x, memory = _normal((B, T, D)), _normal((B, S, D), seed=1)
    block.build(x.shape, memory.shape)
    _randomize(block)
    _, self_weights, cross_weights = harness.to_numpy(
        block(x, memory, return_attention_scores=True)
    )
    fused = capture_attention(block, x, memory)  # no scores: the fused kernel
    explicit = capture_attention(block, x, memory, return_attention_scores=True)
    for maps in (fused, explicit):
        assert [name for name, _ in maps] == [
            "block/self_attention",
            "block/cross_attention",
        ]
        # Dropout is off: `training=False` unless told.
        np.testing.assert_allclose(maps[0][1], self_weights, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(maps[1][1], cross_weights, rtol=1e-5, atol=1e-6)
    # A lone attention layer is captured too.
    attention = block.self_attention
    maps = capture_attention(attention, x, x, use_causal_mask=True)
    assert len(maps) == 1 and maps[0][1].shape == (B, H, T, T)


def test_capture_refuses_a_model_without_attention():
    dense = keras.layers.Dense(3, name="dense")
    with pytest.raises(ValueError, match=r"contains no keras_attention.*model='dense'"):
        capture_attention(dense, np.zeros((1, 2), "float32"))


# plot_attention.


def _image_panels(figure):
    return [axes for axes in figure.axes if axes.images]


@pytest.mark.parametrize("heads, columns", [(H, 4), (3, 2), (5, 4)])
def test_plot_writes_a_png_with_one_image_panel_per_head(tmp_path, heads, columns):
    weights = np.random.default_rng(0).dirichlet(np.ones(S), size=(heads, T))
    queries = [f"q{i}" for i in range(T)]
    keys = [f"k{i}" for i in range(S)]
    figure = plot_attention(weights, queries, keys, title="cross", columns=columns)
    path = tmp_path / "attention.png"
    figure.savefig(path)
    assert path.exists()
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    panels = _image_panels(figure)
    assert len(panels) == heads
    for index, axes in enumerate(panels):
        image = axes.images[0].get_array()
        np.testing.assert_allclose(image, weights[index], rtol=1e-6)
        assert axes.get_title() == f"head {index}"
        assert [t.get_text() for t in axes.get_xticklabels()] == keys
        assert [t.get_text() for t in axes.get_yticklabels()] == queries


def test_plot_of_captured_weights(tmp_path):
    block = TransformerDecoderBlock(F, H, kernel_initializer="zeros", name="block")
    x, memory = _normal((B, T, D)), _normal((B, S, D), seed=1)
    block.build(x.shape, memory.shape)
    _randomize(block)
    (_, self_weights), (_, cross_weights) = capture_attention(block, x, memory)
    for weights, keys in (
        (self_weights, list("abcde")),
        (cross_weights, list("ABCDEFG")),
    ):
        figure = plot_attention(
            weights[0], list("abcde"), keys, head_names=[f"h{i}" for i in range(H)]
        )
        figure.savefig(tmp_path / "captured.png")
        assert len(_image_panels(figure)) == H
        titles = [a.get_title() for a in _image_panels(figure)]
        assert titles == ["h0", "h1", "h2", "h3"]
    # One head given as (T, S): one panel.
    figure = plot_attention(cross_weights[0, 0])
    assert len(_image_panels(figure)) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"query_labels": ["a", "b"]},
            r"`query_labels` must have one label per position \(5\)\. "
            r"Received: 2 labels",
        ),
        (
            {"key_labels": list("abcdefgh")},
            r"`key_labels` must have one label per position \(7\)\. Received: 8 labels",
        ),
        (
            {"head_names": ["only one"]},
            r"`head_names` must have one name per head \(4\)\. Received: 1 names",
        ),
        ({"columns": 0}, r"`columns` must be a positive integer\. Received: columns=0"),
    ],
)
def test_plot_rejects_bad_labels(kwargs, message):
    weights = np.full((H, T, S), 1.0 / S)
    with pytest.raises(ValueError, match=message):
        plot_attention(weights, **kwargs)


def test_plot_rejects_weights_of_the_wrong_rank():
    with pytest.raises(
        ValueError,
        match=r"`weights` must have shape \(heads, T, S\) or \(T, S\)\. "
        r"Received: weights with shape \(2, 4, 5, 7\)",
    ):
        plot_attention(np.zeros((2, H, T, S)))


def test_captures_the_demo_model_built_from_self_attention():
    demo = harness.load_module(harness.ROOT / "examples" / "demo" / "train.py", "demo_capture")
    config = demo.Config(**demo.TINY)
    model = demo.build_model(config, 11)
    tokens = np.random.default_rng(0).integers(0, 11, size=(2, 6)).astype("int32")
    with kernels.tracing() as taken:
        maps = capture_attention(model, tokens)
    heads = config.num_layers * config.num_heads
    assert len(maps) == heads
    assert maps[0][0] == "block0_head0/attention"
    # Each SelfAttention head is one head of the core; causal, distributions.
    future = np.triu(np.ones((6, 6), bool), 1)
    for name, weights in maps:
        assert weights.shape == (2, 1, 6, 6), name
        assert np.all(weights[..., future] == 0), name
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    # SoftAttention's dot-product scorer takes a fused kernel; the weights
    # come from the explicit kernel all the same.
    assert [c.kernel != choice.EXPLICIT for _, c in taken] == [True] * heads


def test_captures_hard_attention_selections():
    from keras_attention.layers import HardAttention

    query = keras.Input((None, 4))
    value = keras.Input((None, 4))
    hard = HardAttention(score="dot", selection="argmax", name="hard")
    model = keras.Model([query, value], hard(query, value))
    q, v = _normal((2, 3, 4)), _normal((2, 5, 4), seed=1)
    [(name, weights)] = capture_attention(model, [q, v])
    assert name == "hard" and weights.shape == (2, 1, 3, 5)
    _, _, selection = hard(q, v, return_attention_scores=True)
    np.testing.assert_array_equal(weights[:, 0], harness.to_numpy(selection))
    assert np.all(weights.sum(-1) == 1.0)


def test_capture_in_training_draws_as_an_eager_call_and_moves_the_seed_on():
    from keras_attention.layers import HardAttention

    query = keras.Input((None, 4))
    value = keras.Input((None, 4))
    hard = HardAttention(score="dot", selection="sample", seed=3, name="hard")
    model = keras.Model([query, value], hard(query, value))
    # Small scores: near-uniform draws, 16 of them over 6 keys.
    q, v = 0.1 * _normal((2, 8, 4)), _normal((2, 6, 4), seed=1)
    state = hard.seed_generator.state
    start = keras.ops.convert_to_numpy(state)
    [(_, captured)] = capture_attention(model, [q, v], training=True)
    moved = keras.ops.convert_to_numpy(state)
    assert not np.array_equal(moved, start)
    # From the same state an eager call draws the same selections and moves
    # the state as the capture did (on JAX the capture ran compiled).
    state.assign(start)
    _, _, selection = hard(q, v, training=True, return_attention_scores=True)
    np.testing.assert_array_equal(captured[:, 0], harness.to_numpy(selection))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(state), moved)
    [(_, again)] = capture_attention(model, [q, v], training=True)
    assert not np.array_equal(again, captured)


def test_capture_of_an_unbuilt_model_equals_that_of_the_built_one():
    encoder = TransformerEncoderStack(num_layers=N, intermediate_dim=F, num_heads=H)
    x = _normal((B, T, D))
    first = capture_attention(encoder, x)  # builds the stack, eagerly
    assert encoder.built
    second = capture_attention(encoder, x)  # on JAX, one compiled program
    assert [name for name, _ in first] == [name for name, _ in second]
    for (name, a), (_, b) in zip(first, second):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_capture_runs_a_built_model_compiled_on_jax_and_eagerly_elsewhere():
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(x)
            return x

    query = keras.Input((None, 4))
    probed = Probe()(query)
    model = keras.Model(query, TransformerEncoderStack(1, F, 2)(probed))
    x = _normal((1, 3, 4))
    seen.clear()
    capture_attention(model, x)
    if keras.backend.backend() == "jax":
        import jax

        assert isinstance(seen[-1], jax.core.Tracer)
    else:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(seen[-1]), x)
