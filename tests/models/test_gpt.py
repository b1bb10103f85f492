"""Tests of `GPT`: GPT-2 parity, causality, cached generation, saving, training.

Shape legend: `B` batch, `T` length, `P` prompt length, `N` new tokens, `V`
vocabulary size, `D` width.

Most tests share one small model with random weights (`model`), which no test
changes; the tests that train or change a model build their own. Reference
passes run at one padded shape (`_forward`), so that JAX compiles its eager
ops once, not once per length. The fresh-process load and the training step
are marked slow.
"""

import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import harness
import keras_attention
from keras_attention.models import GPT
from keras_attention.models import generation

BACKEND = keras.backend.backend()
V, MAX_LENGTH = 37, 24
CONFIG = dict(
    vocabulary_size=V,
    max_sequence_length=MAX_LENGTH,
    num_layers=2,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
)
GPT2_SMALL = dict(
    vocabulary_size=50257,
    max_sequence_length=1024,
    num_layers=12,
    num_heads=12,
    hidden_dim=768,
    intermediate_dim=3072,
)
GPT2_SMALL_PARAMETERS = 124_439_808
TOLERANCE = 1e-4
FORWARD_BATCH = 64


def _small_gpt(seed=0, **kwargs):
    model = GPT(**{**CONFIG, **kwargs})
    model.build((None, None))
    return harness.randomize_weights(model, seed)


def _ids(shape, seed=0):
    return np.random.default_rng(seed).integers(0, V, size=shape).astype("int32")


def _pad(ids, padding_mask=None):
    """`(B, T)` ids (and mask) padded to `(max(B, 64), MAX_LENGTH)`."""
    batch, length = ids.shape
    rows = max(batch, FORWARD_BATCH)
    padded = np.zeros((rows, MAX_LENGTH), "int32")
    padded[:batch, :length] = ids
    if padding_mask is None:
        return padded, None
    mask = np.ones((rows, MAX_LENGTH), bool)
    mask[:batch, :length] = padding_mask
    return padded, mask


def _forward(model, ids, padding_mask=None):
    """`model(ids)` as float64 numpy, run at one shape `(64, MAX_LENGTH)`.

    The ids (and mask) are padded to that shape and the logits cut back: by
    causality (tested on its own) later positions change nothing before
    them. One shape keeps JAX from compiling every op anew for every length.
    """
    batch, length = ids.shape
    padded, mask = _pad(ids, padding_mask)
    kwargs = {} if mask is None else {"padding_mask": mask}
    logits = harness.to_numpy(model(padded, **kwargs))
    return logits[:batch, :length].astype("float64")


def _greedy_reference(model, prompt, max_new_tokens):
    """Greedy decoding that reruns the whole sequence for every new token.

    Each full pass is `predict_on_batch` at one padded shape: compiled once
    per model (eagerly on torch), like `_forward` otherwise.
    """
    ids = np.array(prompt, "int32")
    batch = ids.shape[0]
    for _ in range(max_new_tokens):
        padded, _ = _pad(ids)
        logits = np.asarray(model.predict_on_batch(padded))  # (B', L, V)
        next_ids = logits[:batch, ids.shape[1] - 1].argmax(-1).astype("int32")  # (B,)
        ids = np.concatenate([ids, next_ids[:, None]], axis=1)
    return ids


def _softmax(logits):
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    return probabilities / probabilities.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def model():
    """A small GPT with random weights, shared by the tests that only read it."""
    return _small_gpt()


@pytest.fixture(scope="module")
def prompt():
    return _ids((3, 4), seed=1)


@pytest.fixture(scope="module")
def greedy(model, prompt):
    """The recomputed greedy continuation of `prompt`, 8 new tokens."""
    return _greedy_reference(model, prompt, 8)


# GPT-2 parity.


def test_gpt2_small_has_the_parameters_of_keras_hub_gpt2():
    keras_hub = pytest.importorskip("keras_hub")
    # Variables created in a stateless scope without initialization exist in
    # shape only: counting 124 M parameters then costs no memory and no time.
    try:
        with keras.StatelessScope(initialize_variables=False):
            ours = GPT(**GPT2_SMALL)
            ours.build((None, None))
            backbone = keras_hub.models.GPT2Backbone(**GPT2_SMALL)
            assert backbone.count_params() == GPT2_SMALL_PARAMETERS
            assert ours.count_params() == GPT2_SMALL_PARAMETERS
            assert sorted(tuple(w.shape) for w in ours.weights) == sorted(
                tuple(w.shape) for w in backbone.weights
            )
    finally:
        # Forget the never-initialized variables, so that no later stateless
        # scope tries to initialize them.
        keras.backend.clear_session()


@pytest.fixture(scope="module")
def hub_backbone():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=V,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=MAX_LENGTH,
    )
    return harness.randomize_weights(backbone, seed=3)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding_mask"])
def test_from_keras_hub_reproduces_the_backbone(hub_backbone, masked):
    ids = _ids((2, 9), seed=4)
    mask = np.ones(ids.shape, bool)
    if masked:
        # Holes and left padding, so the mask changes the real positions too.
        mask[0, [2, 5]] = False
        mask[1, :3] = False
    ours = GPT.from_keras_hub(hub_backbone)
    assert ours.count_params() == hub_backbone.count_params()
    hidden = harness.to_numpy(hub_backbone({"token_ids": ids, "padding_mask": mask}))
    table = harness.to_numpy(hub_backbone.token_embedding.embeddings)  # (V, D)
    expected = hidden.astype("float64") @ table.T.astype("float64")  # (B, T, V)
    got = _forward(ours, ids, padding_mask=mask if masked else None)
    # The real positions match. (Padded ones differ by design: here a padded
    # query attends to nothing, in KerasHub to the real keys before it.)
    np.testing.assert_allclose(
        got[mask], expected[mask], rtol=TOLERANCE, atol=TOLERANCE
    )
    if masked:
        # The mask mattered: without it the real positions differ.
        unmasked = _forward(ours, ids)
        assert np.abs(unmasked[mask] - expected[mask]).max() > 1e-2


def test_from_keras_hub_copies_the_weights(hub_backbone):
    ours = GPT.from_keras_hub(hub_backbone)
    ids = _ids((1, 5), seed=5)
    before = _forward(ours, ids)
    original = hub_backbone.get_weights()
    try:
        harness.randomize_weights(hub_backbone, seed=99)
        np.testing.assert_array_equal(_forward(ours, ids), before)
    finally:
        hub_backbone.set_weights(original)


# The model.


def test_logits_shape_and_dtype(model):
    logits = model(_ids((FORWARD_BATCH, MAX_LENGTH)))
    assert tuple(logits.shape) == (FORWARD_BATCH, MAX_LENGTH, V)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"


def test_later_tokens_never_change_earlier_logits(model):
    ids = _ids((2, MAX_LENGTH), seed=6)
    logits = _forward(model, ids)
    for t in (0, 5, MAX_LENGTH - 2):
        changed = ids.copy()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + t) % V
        other = _forward(model, changed)
        np.testing.assert_allclose(
            other[:, : t + 1], logits[:, : t + 1], rtol=1e-5, atol=1e-5
        )
        assert np.abs(other[:, t + 1 :] - logits[:, t + 1 :]).max() > 1e-3


def test_positions_matter(model):
    """The same token at different positions gets different logits."""
    logits = _forward(model, np.full((1, 6), 5, "int32"))
    assert np.abs(logits[0, 1:] - logits[0, :1]).max() > 1e-3


def test_call_with_cache_equals_full_pass(model):
    """Token by token through the cache: the logits of one full pass."""
    ids = _ids((2, 6), seed=7)
    full = _forward(model, ids)
    cache = model.empty_cache(2, MAX_LENGTH)
    assert tuple(cache.shape) == (2, 2, 2, MAX_LENGTH, 2, 8)  # (B, N, 2, L, G, K)
    steps = []
    for i in range(ids.shape[1]):
        logits, cache = model.call_with_cache(ids[:, i : i + 1], cache, i)
        steps.append(harness.to_numpy(logits))  # (B, 1, V)
    np.testing.assert_allclose(
        np.concatenate(steps, axis=1), full, rtol=TOLERANCE, atol=TOLERANCE
    )
    # The cache holds the six written positions only.
    cache = harness.to_numpy(cache)
    assert np.all(cache[:, :, :, 6:] == 0) and np.all(np.any(cache[:, :, :, :6], -1))


# Generation.


def test_generate_returns_the_prompt_then_the_new_tokens(model, prompt):
    out = model.generate(prompt, max_new_tokens=8)
    assert isinstance(out, np.ndarray)
    assert out.shape == (3, 4 + 8)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :4], prompt)
    assert out.min() >= 0 and out.max() < V


def test_greedy_generation_equals_recomputing_every_step(model, prompt, greedy):
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=8), greedy)
    # A tensor prompt gives the same.
    tensor = keras.ops.convert_to_tensor(prompt)
    np.testing.assert_array_equal(model.generate(tensor, max_new_tokens=8), greedy)


def test_generation_reads_the_weights_at_each_call(prompt):
    """The compiled loop, made at the first call, decodes with the weights a
    later call finds (a model sampled between training intervals)."""
    changed = _small_gpt(seed=0)
    other = _small_gpt(seed=5)
    before = changed.generate(prompt, max_new_tokens=6)
    changed.set_weights(other.get_weights())
    after = changed.generate(prompt, max_new_tokens=6)
    np.testing.assert_array_equal(after, other.generate(prompt, max_new_tokens=6))
    np.testing.assert_array_equal(after, _greedy_reference(other, prompt, 6))
    assert not np.array_equal(before, after)


@pytest.mark.parametrize(
    "kwargs",
    [dict(sampling="top_k", top_k=1), dict(sampling="top_p", top_p=1e-6)],
    ids=["top_k_1", "top_p_tiny"],
)
def test_top_k_1_and_tiny_top_p_are_greedy(model, prompt, greedy, kwargs):
    for temperature in (1.0, 3.0):
        out = model.generate(
            prompt, max_new_tokens=8, seed=11, temperature=temperature, **kwargs
        )
        np.testing.assert_array_equal(out, greedy)


SAMPLERS = {
    "random": dict(sampling="random"),
    "top_k": dict(sampling="top_k", top_k=4),
    "top_p": dict(sampling="top_p", top_p=0.6),
}
SAMPLES, SAMPLE_PROMPT_LENGTH, SAMPLE_TOKENS, TEMPERATURE = 1024, 3, 3, 1.7


@pytest.fixture(scope="module")
def sampled(model):
    """Samples of each sampler from `SAMPLES` copies of one prompt, memoized.

    `sampled(name)` returns the outputs for seed 1, seed 1 again and seed 2,
    each `(SAMPLES, SAMPLE_PROMPT_LENGTH + SAMPLE_TOKENS)`, then the number
    of times the decoding loop was traced (or, on torch, run) for them and
    for one more call with another temperature and seed.
    """
    prompt = np.repeat(_ids((1, SAMPLE_PROMPT_LENGTH), seed=10), SAMPLES, axis=0)
    memo = {}

    def generate(name, seed, temperature=TEMPERATURE):
        return model.generate(
            prompt,
            max_new_tokens=SAMPLE_TOKENS,
            temperature=temperature,
            seed=seed,
            **SAMPLERS[name],
        )

    def sample(name):
        if name not in memo:
            traces = []
            original = generation.decode

            def counted(*args, **kwargs):
                traces.append(1)
                return original(*args, **kwargs)

            # The loop of the generation core, as the compiled function calls
            # it when tracing.
            generation.decode = counted
            try:
                outputs = [generate(name, seed) for seed in (1, 1, 2)]
                generate(name, seed=3, temperature=0.7)
            finally:
                generation.decode = original
            memo[name] = (*outputs, len(traces))
        return memo[name]

    return sample


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_seed_fixes_the_samples(sampled, sampler):
    first, again, other, _ = sampled(sampler)
    assert first.shape == (SAMPLES, SAMPLE_PROMPT_LENGTH + SAMPLE_TOKENS)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    # Identical prompts, yet the rows differ: each row draws its own noise.
    assert len(np.unique(first[:, SAMPLE_PROMPT_LENGTH])) > 1


def _candidates(model, out):
    """The sampled tokens `(B, N)` and the sampling distributions `(B, N, V)`.

    The distributions are `softmax(logits / TEMPERATURE)` of the logits that
    chose each token, from full passes over the first 64 rows.
    """
    out = out[:FORWARD_BATCH]
    logits = _forward(model, out[:, :-1])[:, SAMPLE_PROMPT_LENGTH - 1 :]  # (B, N, V)
    return out[:, SAMPLE_PROMPT_LENGTH:], _softmax(logits / TEMPERATURE)


@pytest.mark.parametrize("seed_index", [0, 2])
def test_top_k_never_samples_outside_the_k_most_likely(model, sampled, seed_index):
    k = SAMPLERS["top_k"]["top_k"]
    out = sampled("top_k")[seed_index]
    tokens, probabilities = _candidates(model, out)
    allowed = np.argsort(-probabilities, axis=-1)[..., :k]  # (B, N, k)
    assert np.all(np.any(tokens[..., None] == allowed, axis=-1))
    # Over all rows, the first new token is one of the k, and all k occur
    # (none below has probability under 1%: see the check).
    first = out[:, SAMPLE_PROMPT_LENGTH]
    assert set(np.unique(first)) <= set(allowed[0, 0])
    top = np.sort(probabilities[0, 0])[::-1][:k]
    assert top[-1] / top.sum() > 0.01
    assert set(np.unique(first)) == set(allowed[0, 0])


@pytest.mark.parametrize("seed_index", [0, 2])
def test_top_p_samples_only_from_the_nucleus(model, sampled, seed_index):
    top_p = SAMPLERS["top_p"]["top_p"]
    out = sampled("top_p")[seed_index]
    tokens, probabilities = _candidates(model, out)
    order = np.argsort(-probabilities, axis=-1)  # (B, N, V)
    ranked = np.take_along_axis(probabilities, order, axis=-1)
    mass_before = np.cumsum(ranked, axis=-1) - ranked  # (B, N, V)
    rank = np.argmax(order == tokens[..., None], axis=-1)  # (B, N)
    # Inside the smallest set of most likely tokens holding `top_p` (slack
    # for float32 rounding at the boundary).
    chosen_mass_before = np.take_along_axis(mass_before, rank[..., None], -1)[..., 0]
    assert np.all(chosen_mass_before < top_p + 1e-4)
    # Over all rows, the first new token is in the nucleus of the first
    # step, and every token of it occurs: also the least likely one, which
    # takes the mass over `top_p` (none has under 1% of the nucleus: see
    # the check).
    nucleus = order[0, 0][mass_before[0, 0] < top_p]
    first = out[:, SAMPLE_PROMPT_LENGTH]
    assert len(nucleus) > 1
    assert probabilities[0, 0, nucleus[-1]] / ranked[0, 0, : len(nucleus)].sum() > 0.01
    assert set(np.unique(first)) == set(nucleus)


def test_random_sampling_follows_softmax_with_temperature(model, sampled):
    samples = sampled("random")[0]
    first = samples[:, SAMPLE_PROMPT_LENGTH]  # (SAMPLES,)
    prompt = samples[:1, :SAMPLE_PROMPT_LENGTH]
    logits = _forward(model, prompt)[0, -1]  # (V,)
    expected = _softmax(logits / TEMPERATURE)
    frequencies = np.bincount(first, minlength=V) / SAMPLES
    # Within five standard errors for every token.
    standard_error = np.sqrt(expected * (1 - expected) / SAMPLES)
    assert np.all(np.abs(frequencies - expected) <= 5 * standard_error + 1e-3), (
        frequencies,
        expected,
    )
    assert 0.5 * np.abs(frequencies - expected).sum() < 0.1
    # The temperature is applied: the mean log-likelihood ratio of the
    # samples, hot over cold distribution, is the KL divergence between them
    # (within five standard errors), not the negative value it would have
    # if the samples followed `softmax(logits)`.
    ratio = np.log(expected) - np.log(_softmax(logits))  # (V,)
    divergence = (expected * ratio).sum()
    spread = np.sqrt((expected * (ratio - divergence) ** 2).sum() / SAMPLES)
    assert divergence > 0.1
    assert abs(ratio[first].mean() - divergence) < 5 * spread


def _stopped_reference(greedy, prompt_length, stop, pad):
    """`greedy` with each row cut after its first new stop token, then padded."""
    expected = greedy.copy()
    for row in expected:
        hits = np.flatnonzero(np.isin(row[prompt_length:], stop))
        if hits.size:
            row[prompt_length + hits[0] + 1 :] = pad
    return expected


def test_stop_tokens_end_a_row_and_pad_after_it(model, prompt, greedy):
    new = greedy[:, 4:]
    # Row r generates one of these at its new position r + 1 at the latest.
    stops = [int(new[r, r + 1]) for r in range(3)]
    pad = V - 1
    out = model.generate(
        prompt, max_new_tokens=8, stop_token_ids=stops, pad_token_id=pad
    )
    expected = _stopped_reference(greedy, 4, stops, pad)
    np.testing.assert_array_equal(out, expected)
    # Every row stopped, so the decoding loop ended early, padded.
    assert np.all(out[:, -1] == pad)
    assert not np.array_equal(out, greedy)


def test_prompts_of_two_widths_with_one_total_length_decode_alike(model):
    """Two calls whose compiled loops share a configuration (the same total
    length and shortest prompt) but not the prompt's width: each row is
    still its prompt continued greedily, as alone."""
    prompts = _ids((2, 4), seed=11)
    mask = np.array([[True, True, True, False], [True, True, True, True]])
    out = model.generate(prompts, max_new_tokens=4, prompt_padding_mask=mask)
    np.testing.assert_array_equal(out[1], _greedy_reference(model, prompts[1:], 4)[0])
    np.testing.assert_array_equal(out[0, :7], _greedy_reference(model, prompts[:1, :3], 4)[0])
    assert out[0, 7] == 0  # the pad id after row 0's last token
    narrow = _ids((2, 3), seed=12)
    np.testing.assert_array_equal(
        model.generate(narrow, max_new_tokens=5), _greedy_reference(model, narrow, 5)
    )


@pytest.mark.parametrize("sampling", ["greedy", "random"])
@pytest.mark.parametrize("seed", [-1, 1.5, 2**31])
def test_generate_rejects_a_bad_seed_in_every_mode(model, prompt, sampling, seed):
    with pytest.raises(ValueError, match=r"`seed`"):
        model.generate(prompt, max_new_tokens=2, sampling=sampling, seed=seed)


def test_ragged_prompts_equal_generating_each_alone(model):
    # Row 0 fills the position table exactly: 16 + 8 = MAX_LENGTH.
    lengths, prompt_length, max_new_tokens = [16, 9, 12], 16, 8
    prompts = _ids((3, prompt_length), seed=14)
    mask = np.arange(prompt_length)[None] < np.array(lengths)[:, None]  # (B, P)
    prompts[~mask] = 7  # junk where the mask is False: must be ignored
    alone = [
        _greedy_reference(model, prompts[r : r + 1, :n], max_new_tokens)[0]
        for r, n in enumerate(lengths)
    ]
    # A stop token that only row 1 generates, after its first new token.
    others = set(alone[0][lengths[0] :]) | set(alone[2][lengths[2] :])
    new_1 = list(alone[1][lengths[1] :])
    candidates = [
        t
        for i, t in enumerate(new_1)
        if 0 < i < max_new_tokens - 1 and t not in others and t not in new_1[:i]
    ]
    assert candidates
    # And a token of row 0's prompt that no row generates. The loop starts
    # at the shortest prompt, so it reads this token as a prompt token of
    # row 0: a stop id in a prompt must not end the row.
    generated = others | set(new_1)
    in_prompt = [t for t in prompts[0, min(lengths) :] if t not in generated]
    assert in_prompt
    stops, pad = [int(candidates[0]), int(in_prompt[0])], V - 1
    out = model.generate(
        prompts,
        max_new_tokens=max_new_tokens,
        prompt_padding_mask=mask,
        stop_token_ids=stops,
        pad_token_id=pad,
    )
    assert out.shape == (3, prompt_length + max_new_tokens)
    for row, length in enumerate(lengths):
        expected = np.full(prompt_length + max_new_tokens, pad, "int32")
        expected[: length + max_new_tokens] = _stopped_reference(
            alone[row][None], length, stops, pad
        )[0]
        np.testing.assert_array_equal(out[row], expected, err_msg=f"row {row}")
    # Rows 0 and 2 ran to their limit; row 1 stopped early.
    np.testing.assert_array_equal(out[0], alone[0])
    assert out[1, lengths[1] + max_new_tokens - 1] == pad


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_generation_compiles_once_per_shape(sampled, sampler):
    """Four calls, with other seeds and temperatures: one trace."""
    traces = sampled(sampler)[-1]
    if BACKEND == "torch":
        # Eager: the loop runs once per call (and gives the greedy reference,
        # `test_greedy_generation_equals_recomputing_every_step`).
        assert traces == 4
    else:
        assert traces == 1


# Decoding through the layers, for every block configuration.

OTHER_BLOCKS = dict(
    num_heads=4, num_key_value_heads=2, use_bias=False, activation="relu",
    layer_norm_epsilon=1e-3,
)


def test_generation_with_other_blocks_equals_recomputing():
    """Grouped-query attention, no biases, ReLU: the whole loop as well."""
    model = _small_gpt(seed=5, **OTHER_BLOCKS)
    prompt = _ids((2, 5), seed=18)
    np.testing.assert_array_equal(
        model.generate(prompt, max_new_tokens=8), _greedy_reference(model, prompt, 8)
    )


def test_lora_kernels_decode_through_the_layers():
    """A LoRA kernel is not a plain weight: its projection is the sublayer's
    own call, and the adapter's contribution is in every step."""
    model = _small_gpt(seed=6)
    dense = model.decoder.blocks[1].self_attention.value_dense
    dense.enable_lora(2)
    rng = np.random.default_rng(0)
    for variable in (dense.lora_kernel_a, dense.lora_kernel_b):
        variable.assign(rng.normal(size=variable.shape).astype("float32"))
    prompt = _ids((2, 5), seed=19)
    out = model.generate(prompt, max_new_tokens=8)
    np.testing.assert_array_equal(out, _greedy_reference(model, prompt, 8))
    dense.lora_kernel_b.assign(np.zeros(dense.lora_kernel_b.shape, "float32"))
    assert not np.array_equal(model.generate(prompt, max_new_tokens=8), out)


# Errors.


def test_rejects_a_prompt_longer_than_the_position_table(model):
    message = re.escape(
        f"max_sequence_length={MAX_LENGTH}. Received: prompt length 20 + "
        "max_new_tokens=5 = 25"
    )
    with pytest.raises(ValueError, match=message):
        model.generate(_ids((1, 20)), max_new_tokens=5)
    with pytest.raises(ValueError, match=f"max_sequence_length={MAX_LENGTH}"):
        model(_ids((1, MAX_LENGTH + 1)))


@pytest.mark.parametrize("bad", [V, V + 5, -1])
def test_rejects_out_of_vocabulary_ids(model, bad):
    ids = _ids((2, 4))
    ids[1, 2] = bad
    expected = re.escape(f"[0, {V}). Received: an id {bad}")
    with pytest.raises(ValueError, match=r"`prompt_ids`.*" + expected):
        model.generate(ids, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`token_ids`.*" + expected):
        model(ids)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sampling="nucleus"), r"`sampling` must be one of .*sampling='nucleus'"),
        (dict(sampling="random", temperature=0), r"`temperature`.*temperature=0"),
        (dict(sampling="random", temperature=-1.0), r"`temperature`.*temperature=-1.0"),
        (dict(temperature=0.0), r"`temperature`.*temperature=0.0"),
        (dict(sampling="top_k"), r"`top_k` must be a positive integer.*top_k=None"),
        (dict(sampling="top_k", top_k=0), r"`top_k`.*top_k=0"),
        (dict(sampling="top_p"), r"`top_p` must be a float in \(0, 1\].*top_p=None"),
        (dict(sampling="top_p", top_p=0.0), r"`top_p`.*top_p=0.0"),
        (dict(sampling="top_p", top_p=1.5), r"`top_p`.*top_p=1.5"),
        (dict(max_new_tokens=0), r"`max_new_tokens`.*max_new_tokens=0"),
        (dict(stop_token_ids=[V]), rf"`stop_token_ids`.*Received: stop_token_ids={V}"),
        (dict(stop_token_ids=[1.5]), r"`stop_token_ids`.*Received: stop_token_ids=1.5"),
        (dict(pad_token_id=-1), r"`pad_token_id`.*Received: pad_token_id=-1"),
        (dict(pad_token_id=True), r"`pad_token_id`.*Received: pad_token_id=True"),
        (dict(max_new_tokens=2.0), r"`max_new_tokens`.*max_new_tokens=2.0"),
    ],
)
def test_rejects_bad_generation_arguments(model, kwargs, message):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        model.generate(_ids((1, 3)), **kwargs)


def test_rejects_bad_prompt_shapes_and_masks(model):
    with pytest.raises(ValueError, match=r"`prompt_ids`.*shape \(3,\)"):
        model.generate(_ids((3,)), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`prompt_padding_mask`"):
        model.generate(_ids((2, 3)), 2, prompt_padding_mask=[[1, 0, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match=r"`prompt_padding_mask`"):
        model.generate(_ids((2, 3)), 2, prompt_padding_mask=[[0, 0, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match=r"`prompt_padding_mask` must have shape \(2, 3\)\. Received: prompt_padding_mask with shape \(2, 2\)"):
        model.generate(_ids((2, 3)), 2, prompt_padding_mask=[[1, 1], [1, 1]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(hidden_dim=10, num_heads=3),
            r"`hidden_dim` must be divisible by `num_heads`.*"
            r"hidden_dim=10, num_heads=3",
        ),
        (dict(num_layers=0), r"`num_layers`.*num_layers=0"),
        (dict(vocabulary_size=2.5), r"`vocabulary_size`.*vocabulary_size=2.5"),
        (dict(dropout=1.0), r"`dropout`.*dropout=1.0"),
        (dict(initializer_range=0), r"`initializer_range`.*initializer_range=0"),
    ],
)
def test_rejects_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT(**{**CONFIG, **kwargs})


# Serialization.


NON_DEFAULT = dict(
    dropout=0.1,
    activation="relu",
    layer_norm_epsilon=1e-6,
    num_key_value_heads=1,
    initializer_range=0.05,
    seed=3,
)


@pytest.mark.parametrize("kwargs", [{}, NON_DEFAULT], ids=["defaults", "non_default"])
def test_config_round_trip(kwargs):
    gpt = GPT(**CONFIG, **kwargs)
    harness.check_config_round_trip(gpt)
    config = gpt.get_config()
    for name, value in {**CONFIG, **kwargs}.items():
        if name != "activation":
            assert config[name] == value, name
    clone = GPT.from_config(config)
    assert clone.get_config() == config
    assert clone.num_key_value_heads == gpt.num_key_value_heads
    assert clone.decoder.block_arguments() == gpt.decoder.block_arguments()


_FRESH_LOAD = textwrap.dedent(
    """
    import sys

    import keras
    import numpy as np

    import keras_attention  # noqa: F401  (registers the classes)

    folder = sys.argv[1]
    # The default safe_mode=True, and no custom_objects.
    model = keras.saving.load_model(folder + "/gpt.keras")
    logits = model(np.load(folder + "/ids.npy"))
    np.save(folder + "/logits.npy", keras.ops.convert_to_numpy(logits))
    """
)


@pytest.mark.slow  # a fresh process imports a backend: 5 to 30 s
def test_keras_file_round_trip_in_safe_mode(model, tmp_path):
    ids = _ids((FORWARD_BATCH, MAX_LENGTH), seed=15)
    path = str(tmp_path / "gpt.keras")
    model.save(path)
    np.save(tmp_path / "ids.npy", ids)
    # A fresh process loads it with only `import keras_attention`; it runs
    # while this process loads the file too.
    package_root = os.path.dirname(os.path.dirname(keras_attention.__file__))
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, env.get("PYTHONPATH")) if p
    )
    process = subprocess.Popen(
        [sys.executable, "-c", _FRESH_LOAD, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        loaded = keras.saving.load_model(path)
        assert type(loaded) is GPT
        assert loaded.get_config() == model.get_config()
        expected = _forward(model, ids)
        np.testing.assert_allclose(
            _forward(loaded, ids), expected, rtol=1e-6, atol=1e-6
        )
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-8000:]
    np.testing.assert_allclose(
        np.load(tmp_path / "logits.npy"), expected, rtol=1e-6, atol=1e-6
    )


# Precision and training.


def _mixed(model, policy):
    """A GPT under `policy` holding the weights of `model`."""
    mixed = GPT(**CONFIG, dtype=policy)
    mixed.build((None, None))
    mixed.set_weights(model.get_weights())
    return mixed


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_bfloat16", 0.04), ("mixed_float16", 0.005)]
)
def test_mixed_precision_close_to_float32(model, policy, tolerance):
    """Logits close to float32's, relative to their spread.

    The bounds are loose: KerasHub's `GPT2Backbone` with these weights errs
    as much (measured: bfloat16 mean error 1.4% of the logits' standard
    deviation, worst 15% of the largest logit; float16 ten times less).
    """
    mixed = _mixed(model, policy)
    for w in mixed.weights:
        assert keras.backend.standardize_dtype(w.dtype) == "float32", w.path
    ids = _ids((FORWARD_BATCH, MAX_LENGTH), seed=16)
    logits = mixed(ids)
    assert keras.backend.standardize_dtype(logits.dtype) == policy.split("_")[1]
    got, expected = harness.to_numpy(logits).astype("float64"), _forward(model, ids)
    assert np.all(np.isfinite(got))
    error = np.abs(got - expected)
    assert error.mean() <= tolerance * expected.std(), error.mean()
    assert error.max() <= 10 * tolerance * np.abs(expected).max(), error.max()
    assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.95


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_generates(model, prompt, greedy, policy):
    """The compiled loop runs in the compute dtype, with a cache of it."""
    mixed = _mixed(model, policy)
    cache = mixed.empty_cache(3, MAX_LENGTH)
    assert keras.backend.standardize_dtype(cache.dtype) == policy.split("_")[1]
    out = mixed.generate(prompt, max_new_tokens=8)
    assert out.shape == (3, 12) and out.min() >= 0 and out.max() < V
    np.testing.assert_array_equal(out[:, :4], prompt)
    # Mostly the float32 choice (a near tie may go the other way).
    assert np.mean(out[:, 4] == greedy[:, 4]) >= 2 / 3


def _counting_dataset(batch=8, length=10, seed=0):
    """One batch of `(ids, next_ids)`: `start, start + 1, ...` mod `V`."""
    import tensorflow as tf

    starts = np.random.default_rng(seed).integers(0, V, size=(batch, 1))
    sequences = ((starts + np.arange(length + 1)) % V).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((sequences[:, :-1], sequences[:, 1:]))
    return dataset.batch(batch)


@pytest.mark.slow  # compiling the train step: 5 to 15 s
def test_fit_on_tf_data_trains_every_weight_and_lowers_the_loss():
    pytest.importorskip("tensorflow")
    # With dropout, so that its seeds are part of the compiled train step.
    gpt = GPT(**CONFIG, dropout=0.1, seed=0)
    gpt.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    gpt.build((None, None))
    dataset = _counting_dataset()  # one batch: one step per epoch
    assert len(gpt.trainable_weights) == len(gpt.weights)
    with harness.trains_every_weight(gpt, unless=("key/bias",)):
        first = gpt.fit(dataset, epochs=1, verbose=0).history["loss"]
    losses = first + gpt.fit(dataset, epochs=5, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.2, losses
