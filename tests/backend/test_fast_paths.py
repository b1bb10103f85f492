"""Tests of the backend seam: the decoding steps outside the layers (plain
torch on torch, `keras.ops` elsewhere) against the layers, their
allow-lists, and the backends' preferences.

Shape legend: `B` batch, `T` decoder length, `S` encoder length, `L` cache
length, `D` width, `G` key/value heads, `K` head size.
"""

import keras
import numpy as np
import pytest

import harness
from keras_attention import backend
from keras_attention import kernels
from keras_attention import kv_cache
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.models import GPT

BACKEND = keras.backend.backend()
B, T, S, L, D, H = 2, 4, 5, 6, 8, 2


def _normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _block(encoder=True, **kwargs):
    block = TransformerDecoderBlock(16, H, **kwargs)
    block.build((None, None, D), (None, None, D) if encoder else None)
    rng = np.random.default_rng(3)
    block.set_weights([0.5 * rng.normal(size=w.shape).astype("float32") for w in block.get_weights()])
    return block


def _steps_both_ways(block, encoder_mask=None):
    """The block's cached step for the last of `T` tokens, by the layers and
    by the fast step: `(layers, fast)` outputs and self caches."""
    x = _normal((B, T, D), 1)
    memory = _normal((B, S, D), 2)
    cache = kv_cache.empty(B, L, block.num_key_value_heads or H, D // H, "float32")
    cross = None
    kwargs = {}
    if block.cross_attention is not None:
        cross = block.cross_attention.compute_cache(memory)  # (B, 2, S, G, K)
        kwargs = dict(cross_attention_cache=cross, encoder_padding_mask=encoder_mask)
    # Prefill the first T - 1 tokens through the layers.
    outputs = block(
        x[:, :-1], self_attention_cache=cache, self_attention_cache_update_index=0, **kwargs
    )
    prefilled = outputs[1]
    expected = block(
        x[:, -1:], self_attention_cache=keras.ops.copy(prefilled),
        self_attention_cache_update_index=T - 1, **kwargs,
    )
    step = backend.block_step(block)
    if step is None:
        return expected, None
    mask = None if encoder_mask is None else keras.ops.convert_to_tensor(encoder_mask)
    got = step(
        keras.ops.convert_to_tensor(x[:, -1:]), keras.ops.copy(prefilled), T - 1,
        cross_cache=cross, cross_mask=mask,
    )
    return expected, got


@pytest.mark.parametrize(
    "kwargs, encoder",
    [
        (dict(normalize_first=True), False),  # a GPT block
        ({}, True),  # the paper's post-norm block with cross-attention
        (dict(normalize_first=True, num_key_value_heads=1, activation="gelu"), True),
    ],
    ids=["gpt_block", "post_norm_cross", "pre_norm_cross_mqa"],
)
def test_block_step_equals_the_layers(kwargs, encoder):
    block = _block(encoder, **kwargs)
    encoder_mask = None
    if encoder:
        encoder_mask = np.ones((B, S), bool)
        encoder_mask[0, -2:] = False
    expected, got = _steps_both_ways(block, encoder_mask)
    (want_x, want_cache), (got_x, got_cache) = expected[:2], got
    np.testing.assert_allclose(harness.to_numpy(got_x), harness.to_numpy(want_x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        harness.to_numpy(got_cache), harness.to_numpy(want_cache), rtol=1e-5, atol=1e-5
    )


def test_block_step_keeps_the_rules_on_a_padded_encoder():
    # One example's encoder is all padding (its cross-attention output is
    # exactly 0, as the layers give), and NaN at a padded encoder position
    # reaches no output: the torch step guards, the `keras.ops` step reads
    # cross caches whose hidden positions the model zeroed (`kv_cache.hide`).
    block = _block(True)
    encoder_mask = np.ones((B, S), bool)
    encoder_mask[0] = False
    encoder_mask[1, -1] = False
    expected, got = _steps_both_ways(block, encoder_mask)
    np.testing.assert_allclose(
        harness.to_numpy(got[0]), harness.to_numpy(expected[0]), rtol=1e-5, atol=1e-5
    )
    cross = block.cross_attention.compute_cache(_normal((B, S, D), 2))
    poisoned = harness.to_numpy(cross).copy()
    poisoned[1, :, -1] = np.nan
    poisoned = keras.ops.convert_to_tensor(poisoned)
    step = backend.block_step(block)
    x = keras.ops.convert_to_tensor(_normal((B, 1, D), 4))
    mask = keras.ops.convert_to_tensor(encoder_mask)
    empty = lambda: kv_cache.empty(B, L, H, D // H, "float32")  # noqa: E731
    clean, _ = step(x, empty(), 0, kv_cache.hide(cross, mask), mask)
    dirty, _ = step(x, empty(), 0, kv_cache.hide(poisoned, mask), mask)
    np.testing.assert_array_equal(harness.to_numpy(dirty), harness.to_numpy(clean))
    assert np.isfinite(harness.to_numpy(clean)).all()
    if BACKEND == "torch":  # the torch step also guards an unhidden cache
        dirty, _ = step(x, empty(), 0, poisoned, mask)
        np.testing.assert_array_equal(harness.to_numpy(dirty), harness.to_numpy(clean))


def test_hide_zeroes_only_hidden_positions():
    cache = _normal((B, 2, S, H, D // H), 5)
    mask = np.ones((B, S), bool)
    mask[0, 1] = mask[1, -1] = False
    hidden = harness.to_numpy(kv_cache.hide(keras.ops.convert_to_tensor(cache), mask))
    expected = np.where(mask[:, None, :, None, None], cache, 0.0)
    np.testing.assert_array_equal(hidden, expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(normalization="rms_norm"),
        dict(use_rotary_embedding=True),
        dict(gated_feedforward=True),
        dict(score="additive"),
    ],
    ids=["rms_norm", "rotary", "gated", "additive"],
)
def test_options_off_the_allow_list_fall_back_to_the_layers(kwargs):
    assert backend.block_step(_block(False, **kwargs)) is None


def test_an_unknown_option_falls_back_to_the_layers():
    """A block with a config key the allow-list does not know (a feature
    added later) is not run by the fast step."""

    class NewBlock(TransformerDecoderBlock):
        def get_config(self):
            return {**super().get_config(), "some_new_option": True}

    block = NewBlock(16, H)
    block.build((None, None, D))
    assert backend.block_step(block) is None
    plain = _block(False)
    assert backend.block_step(plain) is not None
    plain.self_attention.value_dense.enable_lora(2)  # not a plain weight
    assert backend.block_step(plain) is None


def test_recording_sends_decoding_to_the_layers():
    model = GPT(vocabulary_size=11, max_sequence_length=8, num_layers=1, num_heads=2,
                hidden_dim=8, intermediate_dim=16)
    model.build((None, None))
    assert model._fast_step() is not None
    with kernels.recording():
        assert model._fast_step() is None  # only the layers record


def test_preferences_are_declared_per_backend():
    preferences = backend.preferences()
    assert isinstance(preferences, backend.Preferences)
    assert preferences.blocked in ("always", "never")
    expected = {"tensorflow": "always", "jax": "always", "torch": "never"}
    assert preferences.blocked == expected[BACKEND]
    assert preferences.linear_projections
    assert not preferences.fuse_projections  # an option; no backend's default


def _translation_model(seed, **kwargs):
    """A small built `Seq2SeqTransformer` (two decoder blocks) with weights
    drawn from `seed`."""
    from keras_attention.models import Seq2SeqTransformer

    model = Seq2SeqTransformer(
        13, 11, 8, 8, num_encoder_layers=1, num_decoder_layers=2, num_heads=2,
        hidden_dim=D, intermediate_dim=16, dropout=0.0, **kwargs,
    )
    model.build()
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        variable.assign(0.5 * rng.normal(size=variable.shape).astype("float32"))
    return model


@pytest.mark.parametrize("beams", [1, 3])
def test_translation_step_equals_the_layers(beams):
    """The translation model's decoding step (block steps with cross-attention,
    padded sources) against its step through the layers, over three
    positions of `beams` hypotheses per source that beam search reorders
    between steps: the layers' step on caches of `B E` rows that are
    gathered (`_reorder_caches`), the fast step on its own caches where it
    has them (TensorFlow, JAX: the grouped layout, where only an ancestry
    follows the hypotheses)."""
    model = _translation_model(7)
    rng = np.random.default_rng(7)
    fast = model._fast_step()
    assert fast is not None
    assert hasattr(fast, "beam_caches") == (BACKEND != "torch")
    # A source all padding too: its cross-attention gives exactly 0.
    source = np.array([[3, 4, 5, 6], [7, 8, 0, 0], [0, 0, 0, 0]], "int32")
    batch, length = 3, 5
    rows_source = np.repeat(source, beams, axis=0)  # row b E + k: source b
    layer_caches = model._decoding_caches(batch * beams, length, rows_source, rows_source != 0)
    if hasattr(fast, "beam_caches"):
        fast_caches = fast.beam_caches(batch, length, beams, source, source != 0)
        reorder = fast.reorder_caches
    else:
        fast_caches = model._decoding_caches(batch * beams, length, rows_source, rows_source != 0)
        reorder = model._reorder_caches
    for index in range(3):
        token = keras.ops.convert_to_tensor(rng.integers(0, 11, (batch * beams, 1)).astype("int32"))
        want, layer_caches = model._decoding_step(token, layer_caches, index)
        got, fast_caches = fast(token, fast_caches, index)
        np.testing.assert_allclose(
            harness.to_numpy(got), harness.to_numpy(want), rtol=1e-5, atol=1e-5,
            err_msg=f"position {index}",
        )
        # Each hypothesis continues one of its source's (repeats allowed).
        rows = (np.arange(batch)[:, None] * beams + rng.integers(0, beams, (batch, beams))).ravel()
        rows = keras.ops.convert_to_tensor(rows.astype("int32"))
        layer_caches = model._reorder_caches(layer_caches, rows)
        fast_caches = reorder(fast_caches, rows)


def test_translation_step_casts_its_kernels_once_when_made():
    """Under mixed precision the translation model's fast step multiplies by
    kernels cast to bfloat16 when the step is made, once per call before the
    loop (as torch's plain step casts its weights), not at every step: with
    every block kernel zeroed after the step was made, the step computes
    what it computed before, while the layers see the zeros. Before that,
    it equals the layers' step within bfloat16's rounding."""
    model = _translation_model(8, dtype="mixed_bfloat16")
    fast = model._fast_step()
    assert fast is not None
    source = np.array([[3, 4, 5, 6], [7, 8, 0, 0]], "int32")
    if hasattr(fast, "empty_caches"):
        fast_caches = fast.empty_caches(2, 3, source, source != 0)
    else:
        fast_caches = model._decoding_caches(2, 3, source, source != 0)
    layer_caches = model._decoding_caches(2, 3, source, source != 0)
    token = keras.ops.convert_to_tensor(np.array([[1], [2]], "int32"))

    def logits(step, caches):
        return harness.to_numpy(keras.ops.cast(step(token, caches, 0)[0], "float32"))

    want = logits(model._decoding_step, layer_caches)
    got = logits(fast, fast_caches)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
    for block in model.decoder.blocks:
        attention, cross, feedforward = block.self_attention, block.cross_attention, block.feedforward
        for dense in (
            attention.query_dense, attention.key_dense, attention.value_dense,
            attention.output_dense, cross.query_dense, cross.output_dense,
            feedforward.intermediate_dense, feedforward.output_dense,
        ):
            dense.kernel.assign(np.zeros(dense.kernel.shape, "float32"))
    np.testing.assert_array_equal(logits(fast, fast_caches), got)
    assert not np.allclose(logits(model._decoding_step, layer_caches), want, atol=0.05)


def _argmax_cases():
    x = _normal((7, 37), 4)
    x[1, [3, 20]] = 9.0  # a tie: the first
    x[2, [5, 30]] = np.nan  # NaN counts as the largest: the first NaN
    x[2, 1] = 50.0
    x[3, :] = -np.inf  # nothing but -inf: the first
    x[4, 36] = np.inf  # the last position
    x[5, 0] = np.nan  # NaN first
    x[6, :] = 2.5  # all equal
    return x


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("function", ["backend", "first_argmax"])
def test_argmax_is_the_first_largest_with_nan_as_largest(function, compiled):
    x = _argmax_cases()
    argmax = backend.argmax if function == "backend" else backend.common.first_argmax
    if compiled:
        argmax = backend.compiled_loop(argmax)
    got = keras.ops.convert_to_numpy(argmax(keras.ops.convert_to_tensor(x)))
    # numpy's argmax: the first largest, NaN the largest.
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    # Keras's on the rows without NaN (TensorFlow's skips NaN).
    finite = ~np.isnan(x).any(axis=-1)
    expected = keras.ops.convert_to_numpy(keras.ops.argmax(x[finite], axis=-1))
    np.testing.assert_array_equal(got[finite], expected)


@pytest.mark.parametrize("rows", [3, 300], ids=["small", "large"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_linear_equals_numpy_with_gradients(rows, with_bias):
    """`backend.linear` against numpy, forward and every gradient. On torch
    the large product (2 x 300 x 64 x 256 multiply-adds) goes to oneDNN
    where torch has it, the small one to `F.linear`."""
    x, kernel, bias = _normal((2, rows, 64), 1), _normal((64, 256), 2), _normal((256,), 3)
    inputs = [x, kernel] + ([bias] if with_bias else [])

    def fn(x, kernel, bias=None):
        x, kernel = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(kernel)
        return backend.linear(x, kernel, None if bias is None else keras.ops.convert_to_tensor(bias))

    want = x @ kernel + (bias if with_bias else 0)
    np.testing.assert_allclose(harness.to_numpy(fn(*inputs)), want, rtol=1e-4, atol=1e-4)
    cotangent = _normal(want.shape, 4)
    got = harness.input_gradients(fn, inputs, cotangent)
    np.testing.assert_allclose(got[0], cotangent @ kernel.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        got[1], np.einsum("btk,btn->kn", x, cotangent), rtol=1e-4, atol=1e-3
    )
    if with_bias:
        np.testing.assert_allclose(got[2], cotangent.sum((0, 1)), rtol=1e-4, atol=1e-4)
    if BACKEND == "torch":
        import torch

        from keras_attention.backend import torch as torch_backend

        large = rows * 64 * 256 * 2 >= torch_backend.ONEDNN_MIN_WORK
        onednn = torch_backend._onednn_linear() is not None
        assert onednn == torch.backends.mkldnn.is_available()
        calls = []
        original = torch_backend._OneDNNLinear.apply
        torch_backend._OneDNNLinear.apply = lambda *a: calls.append(1) or original(*a)
        try:
            tensor = torch.tensor(x, requires_grad=True)
            backend.linear(tensor, torch.tensor(kernel), None)
        finally:
            torch_backend._OneDNNLinear.apply = original
        assert bool(calls) == (large and onednn)


def test_compiled_decoding_computes_the_loop():
    """`compile_decoding` computes the loop as written, on the first call
    (trace and compile) and on those after it (what was kept; on
    TensorFlow a concrete function through its flat call)."""
    x, w = _normal((4, 64)), _normal((64, 48), 1)

    def loop(x, w, step=None):
        product = keras.ops.matmul(x, w)
        return keras.ops.tanh(product), keras.ops.sum(product, axis=1)

    compiled = backend.compile_decoding(loop, [])
    for _ in range(2):
        got, sums = (keras.ops.convert_to_numpy(y) for y in compiled(x, w))
        np.testing.assert_allclose(got, np.tanh(x @ w), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sums, (x @ w).sum(axis=1), rtol=1e-4, atol=1e-4)


def test_decoding_options_are_options_xla_knows(monkeypatch):
    """JAX's decoding loops compile with XLA options per platform
    (`decoding_compiler_options`): on a GPU XLA's command buffers for
    `while` loops, on a CPU, for a step of one row, without the pass that
    splits every reduction into two kernels. XLA parses the options on any
    platform, so a name or a value this jaxlib does not know fails here: a
    `while` loop compiled with the GPU's counts as it should, a sum
    compiled with the CPU's is one reduction and not a reduce-window and a
    reduce (on this machine's platform, a CPU) and still sums, and options
    XLA refuses are dropped rather than passed. Under the JAX backend,
    `compile_decoding` passes each platform's options, on a CPU none to a
    loop of several rows or of rows not given, and the loop still
    computes."""
    import jax

    from keras_attention.backend import jax as jax_backend

    assert jax_backend.decoding_compiler_options("cpu", rows=1) == jax_backend.CPU_DECODING_OPTIONS
    assert jax_backend.decoding_compiler_options("cpu", rows=4) == {}
    assert jax_backend.decoding_compiler_options("cpu") == {}
    assert jax_backend.decoding_compiler_options("tpu", rows=1) == {}
    options = jax_backend.decoding_compiler_options("gpu")
    assert options == jax_backend.GPU_DECODING_OPTIONS
    assert jax_backend.decoding_compiler_options("gpu", rows=1) == options
    assert {"WHILE", "CONDITIONAL", "FUSION"} <= set(
        options["xla_gpu_enable_command_buffer"].split(",")
    )

    def count(limit):
        return jax.lax.while_loop(lambda s: s[0] < limit, lambda s: (s[0] + 1, s[1] * 2.0), (0, 1.0))

    steps, value = jax.jit(count, compiler_options=options)(5)
    assert (int(steps), float(value)) == (5, 32.0)

    row = _normal((1, 1000))
    for cpu_options, windows in ((jax_backend.CPU_DECODING_OPTIONS, 0), ({}, 1)):
        summed = jax.jit(lambda x: x.sum(axis=-1), compiler_options=cpu_options)
        if jax.default_backend() == "cpu":
            program = summed.lower(row).compile().as_text()
            assert program.count("reduce-window(") == windows
        np.testing.assert_allclose(summed(row), row.sum(axis=-1), rtol=1e-5)
    with monkeypatch.context() as patched:
        patched.setattr(
            jax_backend, "GPU_DECODING_OPTIONS", {"xla_gpu_enable_command_buffer": "WHILE,BOGUS"}
        )
        assert jax_backend.decoding_compiler_options("gpu") == {}

    if keras.backend.backend() != "jax":
        return
    seen = []
    real_jit = jax.jit

    def jit(function, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(function, **kwargs)

    monkeypatch.setattr(jax_backend.jax, "jit", jit)
    x, w = _normal((4, 8)), _normal((8, 3), 1)
    for platform in ("gpu", "cpu"):
        monkeypatch.setattr(jax_backend.jax, "default_backend", lambda: platform)
        for rows in (1, 4):
            compiled = backend.compile_decoding(
                lambda x, w, step=None: keras.ops.matmul(x, w), [], rows=rows
            )
            np.testing.assert_allclose(compiled(x, w), x @ w, rtol=1e-5, atol=1e-5)
    cpu = jax_backend.CPU_DECODING_OPTIONS
    assert seen == [options, options, cpu, None]


def test_generation_compiles_each_loop_for_the_rows_of_its_step(monkeypatch):
    """`generate` tells `compile_decoding` how many rows each loop's step
    computes (on JAX a CPU compiles one-row loops with other options):
    sources for sampling, sources times beams for beam search; each
    configuration's loop is compiled once and reused."""
    model = _translation_model(3)
    one, two = np.array([[3, 4, 5, 6]], "int32"), np.array([[3, 4, 5, 6], [7, 8, 9, 10]], "int32")
    compiled = []
    real = backend.compile_decoding

    def compile_decoding(loop, variables, fast_step=None, rows=None):
        compiled.append(rows)
        return real(loop, variables, fast_step, rows=rows)

    monkeypatch.setattr(backend, "compile_decoding", compile_decoding)
    calls = [(one, "greedy"), (one, "beam"), (two, "greedy"), (one, "greedy"), (one, "top_k"), (two, "beam")]
    for source, sampling in calls:
        model.generate(source, 3, start_token_id=1, sampling=sampling, num_beams=2, top_k=3, seed=1)
    assert compiled == [1, 2, 2, 1, 4]


def _greedy_by_recomputation(model, source, new_tokens, start):
    """Greedy decoding by the full forward pass over the whole target at
    every step (no cache, no compiled loop)."""
    tokens = np.full((source.shape[0], 1), start, "int32")
    for _ in range(new_tokens):
        logits = model({"encoder_token_ids": source, "decoder_token_ids": tokens})
        best = np.argmax(keras.ops.convert_to_numpy(logits)[:, -1], axis=-1)
        tokens = np.concatenate([tokens, best[:, None].astype("int32")], axis=1)
    return tokens


def _loops(model):
    """The model's compiled decoding loops, in the order they were made."""
    return list(model._get_generator()._functions.values())


def test_decoding_reads_weights_that_change_after_the_loop_compiled(monkeypatch):
    """A loop compiled at the first call decodes with whatever weights a later
    call finds: assigned ones, then the first ones again. On JAX on a CPU a
    one-row loop takes the weights as arguments, compiles them in as
    constants at the second call in a row that finds the same ones, and
    once they change takes them as arguments for good (a several-row loop
    always does); weights of more than `CONSTANT_WEIGHTS_BYTES` are never
    compiled in, decoding alike."""
    model = _translation_model(3)
    first = [keras.ops.convert_to_numpy(v) for v in model.weights]
    source = np.array([[3, 4, 5, 6, 7]], "int32")
    before = model.generate(source, 5, start_token_id=1)
    np.testing.assert_array_equal(before, _greedy_by_recomputation(model, source, 5, 1))
    (loop,) = _loops(model)
    embeds = BACKEND == "jax" and _jax_platform() == "cpu"
    if BACKEND == "jax":
        assert not loop.compiled_weights()
    np.testing.assert_array_equal(model.generate(source, 5, start_token_id=1), before)
    np.testing.assert_array_equal(model.generate(source, 5, start_token_id=1), before)
    if BACKEND == "jax":
        assert loop.compiled_weights() is embeds

    rng = np.random.default_rng(11)
    for variable in model.weights:
        variable.assign(0.5 * rng.normal(size=variable.shape).astype("float32"))
    after = model.generate(source, 5, start_token_id=1)
    np.testing.assert_array_equal(after, _greedy_by_recomputation(model, source, 5, 1))
    assert not np.array_equal(after, before)
    assert _loops(model) == [loop]  # the same configuration's loop
    if BACKEND == "jax":
        assert not loop.compiled_weights()

    for variable, value in zip(model.weights, first):
        variable.assign(value)
    for _ in range(2):
        np.testing.assert_array_equal(model.generate(source, 5, start_token_id=1), before)
    if BACKEND == "jax":
        assert not loop.compiled_weights()  # once changed, always arguments

    # Several rows a step: always arguments.
    two = np.concatenate([source, source[:, ::-1]])
    for _ in range(2):
        np.testing.assert_array_equal(
            model.generate(two, 4, start_token_id=1), _greedy_by_recomputation(model, two, 4, 1)
        )
    if BACKEND == "jax":
        assert not _loops(model)[-1].compiled_weights()

    if BACKEND == "jax":
        from keras_attention.backend import jax as jax_backend

        size = sum(value.nbytes for value in first)
        monkeypatch.setattr(jax_backend, "CONSTANT_WEIGHTS_BYTES", size - 1)
        limited = _translation_model(3)
        for _ in range(3):
            np.testing.assert_array_equal(limited.generate(source, 5, start_token_id=1), before)
        assert not _loops(limited)[0].compiled_weights()
        monkeypatch.setattr(jax_backend, "CONSTANT_WEIGHTS_BYTES", size)
        exact = _translation_model(3)
        for _ in range(2):
            np.testing.assert_array_equal(exact.generate(source, 5, start_token_id=1), before)
        assert _loops(exact)[0].compiled_weights() is embeds


def _jax_platform():
    import jax

    return jax.default_backend()
